#!/usr/bin/env python3
"""Tests of `qkv generate --kv-dtype` on the stories260K model: every format runs; f32 is the
default's text; the quantized formats keep the README's greedy start; --prompts with a quantized
cache gives each prompt the bits of its --prompt run (the batch-invariant kernel on the codes);
a bad name is one line on stderr, exit 2, nothing on stdout.

usage: test_kv_dtype.py <path to the qkv binary>
"""
import json
import os
import subprocess
import sys
import tempfile

QKV = os.path.abspath(sys.argv[1])
START = "Once upon a time, there was a little girl named Lily."
TMP = tempfile.mkdtemp(prefix="qkv_kv_dtype_")
failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else "  " + detail))
    if not cond:
        failures.append(name)


def gen(*args):
    p = subprocess.run([QKV, "generate"] + list(args), capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


rc, default, err = gen("--prompt", "Once upon a time", "--temperature", "0", "--steps", "80")
check("default: exit 0", rc == 0, err)
for f in ("f32", "bf16", "f16", "int8", "q8_0", "fp8"):
    rc, out, err = gen("--prompt", "Once upon a time", "--temperature", "0", "--steps", "80", "--kv-dtype", f)
    check(f"{f}: exit 0", rc == 0, err)
    check(f"{f}: the README's greedy start", out.startswith(START), repr(out[:120]))
    if f == "f32":
        check("f32: the default's text", out == default, repr(out[:200]))

# --prompts over an int8 cache: each text equals its --prompt run.
prompts = ["Once upon a time", "Lily and Ben", "The cat sat"]
pf = os.path.join(TMP, "prompts.txt")
with open(pf, "w") as fh:
    fh.write("\n".join(prompts) + "\n")
outj = os.path.join(TMP, "out.jsonl")
p = subprocess.run([QKV, "generate", "--prompts", pf, "--out-jsonl", outj, "--temperature", "0", "--steps", "60",
                    "--batch", "2", "--kv-dtype", "int8"], capture_output=True, text=True, timeout=120)
check("--prompts int8: exit 0", p.returncode == 0, p.stderr)
if p.returncode == 0:
    with open(outj) as fh:
        lines = [json.loads(x) for x in fh]
    for pr, line in zip(prompts, lines):
        rc, out, err = gen("--prompt", pr, "--temperature", "0", "--steps", "60", "--kv-dtype", "int8")
        check(f"--prompts int8 '{pr}': the --prompt run's text", line["text"] == out, repr((line["text"], out)))

rc, out, err = gen("--prompt", "x", "--kv-dtype", "int4")
check("bad --kv-dtype: exit 2, one line, no stdout",
      rc == 2 and out == "" and err.count("\n") == 1 and "--kv-dtype: expected one of f32, bf16, f16, int8, q8_0, fp8" in err,
      repr((rc, out, err)))

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("all passed")

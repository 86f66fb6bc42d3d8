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

# qkv bench --kv-quant --quick: a decode row per format and Hkv, prefill rows; --kv-accuracy --quick:
# the 16 rows of the table, the f32 cache exactly the reference's greedy text.
p = subprocess.run([QKV, "bench", "--kv-quant", "--quick", "--repeats", "1", "--read-mib", "16", "--peak-seconds", "0.05"],
                   capture_output=True, text=True, timeout=300)
check("bench --kv-quant: exit 0", p.returncode == 0, p.stderr)
rows = [l.split() for l in p.stdout.splitlines() if l.startswith(("decode ", "prefill "))]
for f in ("f32", "bf16", "f16", "int8", "q8_0", "fp8"):
    check(f"bench --kv-quant: decode rows of {f} for Hkv 8 and 2",
          sorted(r[2] for r in rows if r[0] == "decode" and r[1] == f) == ["2", "8"], p.stdout)
    check(f"bench --kv-quant: a prefill row of {f}", any(r[0] == "prefill" and r[1] == f for r in rows), p.stdout)
# The cold columns: each decode row also timed on copies of its cache that together hold twice the
# read buffer (16 MiB here), and the speed-up line gives both.
check("bench --kv-quant: cold columns", "cold ms" in p.stdout, p.stdout)
check("bench --kv-quant: a warm and a cold speed-up per Hkv",
      sum(1 for l in p.stdout.splitlines() if l.startswith("decode Hkv") and " warm, " in l and " cold " in l) == 2, p.stdout)
for r in rows:
    if r[0] == "decode" and r[1] in ("bf16", "int8"):
        check(f"bench --kv-quant: {r[1]} Hkv {r[2]}: a cold time", len(r) == 12 and float(r[8]) > 0, p.stdout)
p = subprocess.run([QKV, "bench", "--kv-accuracy", "--quick"], capture_output=True, text=True, timeout=300)
check("bench --kv-accuracy: exit 0", p.returncode == 0, p.stderr)
table = [l for l in p.stdout.splitlines() if l.startswith("| ") and "/" in l.split("|")[1] and "K/V" not in l]
check("bench --kv-accuracy: 16 rows", len(table) == 16, p.stdout)
check("bench --kv-accuracy: f32/f32 keeps the greedy text", table and table[0].startswith("| f32/f32 | neither") and
      table[0].rstrip().endswith("| same |"), p.stdout)

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("all passed")

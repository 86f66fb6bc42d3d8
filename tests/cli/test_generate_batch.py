#!/usr/bin/env python3
"""Tests of `qkv generate --prompts FILE --batch N --out-jsonl OUT` on the stories260K model: one
JSON line per prompt, in the file's order, whose `text` is byte-identical to what
`qkv generate --prompt P` (same other options) prints for that prompt alone: greedy, sampled with
a seed, on the float64 reference kernel, Q8_0 weights, batch sizes 1, 3 and more than the
prompts, prompts finishing at different steps (continuous batching); bad input gives one line on
stderr, exit 2 and no output file.

usage: test_generate_batch.py <path to the qkv binary>
"""
import json
import os
import subprocess
import sys
import tempfile

QKV = os.path.abspath(sys.argv[1])
HERE = os.path.dirname(os.path.abspath(__file__))
DIR = os.path.normpath(os.path.join(HERE, "..", "..", "models", "stories260K"))
V0 = os.path.join(DIR, "stories260K.bin")
Q80 = os.path.join(DIR, "stories260K_q80.bin")
TOK = os.path.join(DIR, "tok512.bin")
TMP = tempfile.mkdtemp(prefix="qkv_generate_batch_")
PROMPTS = ["Once upon a time", "Lily and Ben", "", "The cat sat on the mat and", "Once upon a time",
           "Tom had a big red ball. He", "Sue"]
failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else "  " + detail))
    if not cond:
        failures.append(name)


def run(args):
    e = dict(os.environ)
    e.pop("QKV_MODELS_DIR", None)
    p = subprocess.run([QKV] + args, capture_output=True, env=e, timeout=300)
    return p.returncode, p.stdout, p.stderr.decode("utf-8", "replace")


def batch_case(name, batch, extra, model=V0):
    pf = os.path.join(TMP, name + ".txt")
    out = os.path.join(TMP, name + ".jsonl")
    with open(pf, "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    base = ["generate", "--model", model, "--tokenizer", TOK] + extra
    rc, _, err = run(base + ["--prompts", pf, "--batch", str(batch), "--out-jsonl", out])
    check(f"{name}: exit 0", rc == 0, err)
    if rc != 0:
        return
    lines = [json.loads(line) for line in open(out, encoding="utf-8")]
    check(f"{name}: one line per prompt, in order", [l["prompt"] for l in lines] == PROMPTS, str(lines)[:300])
    check(f"{name}: tokens/s on stderr", "tok/s" in err, err)
    for i, l in enumerate(lines):
        rc, single, err = run(base + ["--prompt", l["prompt"]])
        check(f"{name}: prompt {i} text byte-identical to the single run", rc == 0 and single.decode("utf-8") == l["text"],
              repr(single[:120]) + " vs " + repr(l["text"][:120]))


batch_case("greedy batch 3", 3, ["--steps", "80", "--temperature", "0"])
batch_case("sampled batch 2", 2, ["--steps", "100", "--temperature", "0.9", "--seed", "11"])
batch_case("sampled batch 16", 16, ["--steps", "64", "--temperature", "1.0", "--top-p", "0.8", "--seed", "5", "--threads", "2"])
batch_case("batch 1", 1, ["--steps", "40", "--temperature", "0.5", "--seed", "3"])
batch_case("reference kernel", 4, ["--steps", "30", "--temperature", "0", "--reference"])
batch_case("q8_0", 3, ["--steps", "50", "--temperature", "0.7", "--seed", "9"], model=Q80)

# Bad input: exit 2, one line on stderr naming the flag, no output file.
pf = os.path.join(TMP, "p.txt")
with open(pf, "w") as f:
    f.write("Once\n")
for name, args, needle in [
    ("batch 0", ["--prompts", pf, "--batch", "0"], "--batch"),
    ("no --out-jsonl", ["--prompts", pf], "--out-jsonl"),
    ("missing file", ["--prompts", os.path.join(TMP, "nope.txt")], "--prompts"),
    ("--out-jsonl without --prompts", ["--prompt", "Once"], "--out-jsonl"),
    ("too long for --steps", ["--prompts", pf, "--steps", "1"], "--prompts: line 1"),
    ("a directory as --prompts", ["--prompts", TMP], "--prompts"),
    ("unwritable --out-jsonl", ["--prompts", pf], "--out-jsonl: " + os.path.join(TMP, "no", "bad.jsonl")),
]:
    out = os.path.join(TMP, "no" if name == "unwritable --out-jsonl" else "", "bad.jsonl")
    extra = [] if name in ("no --out-jsonl",) else ["--out-jsonl", out]
    rc, so, err = run(["generate", "--model", V0, "--tokenizer", TOK] + args + extra)
    check(f"error {name}: exit 2, one line naming the flag", rc == 2 and err.startswith("qkv: error:") and
          err.count("\n") == 1 and needle in err, err)
    check(f"error {name}: no output file", not os.path.exists(out))

print("all passed" if not failures else f"{len(failures)} failed: {failures}")
sys.exit(1 if failures else 0)

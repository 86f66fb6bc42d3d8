#!/usr/bin/env python3
"""Tests of `qkv generate` and the model part of `qkv demo` on the stories260K model: the greedy
text the model's README states (float32 and Q8_0 checkpoints), deterministic sampling for a
seed, the speed report, and every kind of bad input (one line on stderr, exit 2, nothing on
stdout).

usage: test_generate.py <path to the qkv binary>
"""
import os
import struct
import subprocess
import sys
import tempfile

QKV = os.path.abspath(sys.argv[1])
HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.normpath(os.path.join(HERE, "..", "..", "models"))  # the repository's bundled model
DIR = os.path.join(MODELS, "stories260K")
V0 = os.path.join(DIR, "stories260K.bin")
Q80 = os.path.join(DIR, "stories260K_q80.bin")
TOK = os.path.join(DIR, "tok512.bin")
TMP = tempfile.mkdtemp(prefix="qkv_generate_")
START = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else "  " + detail))
    if not cond:
        failures.append(name)


def run(args, env=None, cwd=None):
    e = dict(os.environ)
    e.pop("QKV_MODELS_DIR", None)
    e.update(env or {})
    p = subprocess.run([QKV] + args, capture_output=True, text=True, env=e, cwd=cwd, timeout=120)
    return p.returncode, p.stdout, p.stderr


def gen(*extra, model=V0, tok=TOK):
    return run(["generate", "--model", model, "--tokenizer", tok] + list(extra))


# ---- the README's greedy continuation, both checkpoint formats ----------------------------------
for name, model in (("v0", V0), ("q80", Q80)):
    rc, out, err = gen("--prompt", "Once upon a time", "--temperature", "0", "--steps", "64", model=model)
    check(f"greedy {name}: exit 0", rc == 0, err)
    check(f"greedy {name}: begins with the README's text", out.startswith(START), repr(out[:200]))
    check(f"greedy {name}: tokens/s for prefill and decode on stderr",
          "prefill:" in err and "decode:" in err and "tok/s" in err, err)

# The same through the float64 reference kernel for every attention call.
rc, out_ref, err = gen("--prompt", "Once upon a time", "--temperature", "0", "--steps", "64", "--reference")
check("greedy --reference: same text as the default kernels", rc == 0 and out_ref.startswith(START), out_ref[:200])

# Without --model/--tokenizer the binary finds the bundled model from its own location (the
# source tree above the build folder), whatever the working directory.
root = os.path.normpath(os.path.join(HERE, "..", ".."))
for where in (root, TMP):
    rc, out, err = run(["generate", "--prompt", "Once upon a time", "--temperature", "0", "--steps", "40"], cwd=where)
    check(f"defaults find the bundled model (cwd {where})", rc == 0 and out.startswith(START[:60]), err + out[:100])
# ... or the folder QKV_MODELS_DIR names.
rc, out, err = run(["generate", "--prompt", "Once upon a time", "--temperature", "0", "--steps", "40"],
                   env={"QKV_MODELS_DIR": MODELS}, cwd=TMP)
check("QKV_MODELS_DIR is honoured", rc == 0 and out.startswith(START[:60]), err)
rc, out, err = run(["generate", "--steps", "10"], env={"QKV_MODELS_DIR": TMP})
check("QKV_MODELS_DIR without the model: exit 2 naming the path", rc == 2 and TMP in err, err)
check("QKV_MODELS_DIR without the model: one line naming --model", err.startswith("qkv: error: --model:")
      and len(err.strip().splitlines()) == 1 and out == "", err)

# --steps counts positions including the prompt's: 5 prompt tokens + steps 6 -> 2 sampled tokens.
rc, out, err = gen("--prompt", "Once upon a time", "--temperature", "0", "--steps", "6")
check("--steps 6: the prompt plus two tokens", rc == 0 and out.strip() == "Once upon a time, there", repr(out))
check("--steps 6: one decode step reported", "decode: 1 tokens" in err, err)

# An empty prompt starts from BOS alone.
rc, out, err = gen("--temperature", "0", "--steps", "30")
check("empty prompt: generates from BOS", rc == 0 and len(out.strip()) > 20, repr(out))


# ---- an independent NumPy Llama-2 (float64) and tokenizer: same greedy text ---------------------
def numpy_greedy(prompt, steps):
    """llama2.c's encode, a from-scratch float64 forward pass, greedy decoding, llama2.c's decode."""
    saved = dict(os.environ)
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")  # tiny matrices: threads only cost
    import numpy as np
    os.environ.clear()
    os.environ.update(saved)  # the qkv runs keep their usual threading
    raw = open(TOK, "rb").read()
    off, pieces, scores = 4, [], []
    while off < len(raw):
        sc, n = struct.unpack_from("<fi", raw, off)
        pieces.append(raw[off + 8: off + 8 + n])
        scores.append(sc)
        off += 8 + n
    index = {}
    for i, p in enumerate(pieces):
        index.setdefault(p, i)
    text = prompt.encode()
    ids = [1] + ([index[b" "]] if text else [])
    i = 0
    while i < len(text):  # one token per UTF-8 code point, else byte fallback
        j = i + 1
        while j < len(text) and (text[j] & 0xC0) == 0x80 and j - i < 4:
            j += 1
        cp = text[i:j]
        ids += [index[cp]] if cp in index else [b + 3 for b in cp]
        i = j
    while True:  # merge the best-scoring adjacent pair, leftmost on ties
        best, at = -1e10, -1
        for k in range(1, len(ids) - 1):
            m = index.get(pieces[ids[k]] + pieces[ids[k + 1]])
            if m is not None and scores[m] > best:
                best, at = scores[m], k
        if at < 0:
            break
        ids[at: at + 2] = [index[pieces[ids[at]] + pieces[ids[at + 1]]]]
    b = open(V0, "rb").read()
    dim, hid, L, H, Hkv, V, S = struct.unpack_from("<7i", b, 0)
    D, kv = dim // H, Hkv * dim // H
    w = np.frombuffer(b, dtype="<f4", offset=28).astype(np.float64)
    o = [0]

    def take(*shape):
        n = int(np.prod(shape))
        a = w[o[0]: o[0] + n].reshape(shape)
        o[0] += n
        return a
    emb, ra, wq, wk, wv, wo = take(V, dim), take(L, dim), take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
    rf, w1, w2, w3, rfin = take(L, dim), take(L, hid, dim), take(L, dim, hid), take(L, hid, dim), take(dim)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rope(x):  # x [n, heads, D], interleaved pairs
        n = x.shape[0]
        ang = np.arange(n)[:, None] * 10000.0 ** (-np.arange(0, D, 2) / D)
        c, s_ = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        y = x.copy()
        y[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s_
        y[..., 1::2] = x[..., 0::2] * s_ + x[..., 1::2] * c
        return y
    seq = list(ids)
    while len(seq) <= steps:
        n = len(seq)
        x = emb[seq]
        for l in range(L):
            h = norm(x, ra[l])
            q = rope((h @ wq[l].T).reshape(n, H, D))
            k = np.repeat(rope((h @ wk[l].T).reshape(n, Hkv, D)), H // Hkv, axis=1)
            v = np.repeat((h @ wv[l].T).reshape(n, Hkv, D), H // Hkv, axis=1)
            sc = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(D)
            sc = np.where(np.tril(np.ones((n, n), bool)), sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            x = x + np.einsum("hij,jhd->ihd", p, v).reshape(n, dim) @ wo[l].T
            h = norm(x, rf[l])
            a = h @ w1[l].T
            x = x + ((a / (1 + np.exp(-a))) * (h @ w3[l].T)) @ w2[l].T
        nxt = int(np.argmax(norm(x[-1], rfin) @ emb.T))
        if nxt == 1:
            break
        seq.append(nxt)
    out = b""
    for prev, t in zip(seq, seq[1:]):
        p = pieces[t]
        if prev == 1 and p.startswith(b" "):
            p = p[1:]
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            p = bytes([int(p[3:5], 16)])
        out += p
    return out.decode("utf-8", "replace")


expected = numpy_greedy("Once upon a time", 48)
rc, out, err = gen("--prompt", "Once upon a time", "--temperature", "0", "--steps", "48")
check("greedy text equals an independent NumPy float64 Llama-2", rc == 0 and out.rstrip("\n") == expected,
      repr(out) + " vs " + repr(expected))
check("NumPy Llama-2 agrees with the README", expected.startswith(START), expected)
rc, out, err = gen("--prompt", "Lily and Ben", "--temperature", "0", "--steps", "40")
check("greedy text of another prompt equals NumPy's", rc == 0 and out.rstrip("\n") == numpy_greedy("Lily and Ben", 40),
      repr(out))

# ---- sampling: deterministic for a seed, different across seeds --------------------------------
a = gen("--prompt", "Once upon a time", "--temperature", "0.9", "--top-p", "0.9", "--seed", "42", "--steps", "100")
b = gen("--prompt", "Once upon a time", "--temperature", "0.9", "--top-p", "0.9", "--seed", "42", "--steps", "100")
c = gen("--prompt", "Once upon a time", "--temperature", "0.9", "--top-p", "0.9", "--seed", "43", "--steps", "100")
check("sampling: exit 0", a[0] == 0 and b[0] == 0 and c[0] == 0, a[2] + c[2])
check("sampling: same seed, same text", a[1] == b[1], a[1] + "\n---\n" + b[1])
check("sampling: another seed, another text", a[1] != c[1], a[1])
check("sampling: the seed is reported", "seed 42" in a[2], a[2])
rc, out, err = gen("--prompt", "Once upon a time", "--temperature", "1", "--top-p", "1", "--seed", "7", "--steps", "50")
check("top-p 1 (plain sampling) is accepted", rc == 0 and out.startswith("Once upon a time"), err)


# ---- bad input: one line on stderr starting `qkv: error:`, exit 2, nothing on stdout ------------
def expect_error(name, args, needle, env=None):
    rc, out, err = run(["generate"] + args, env=env)
    ok = rc == 2 and err.startswith("qkv: error:") and err.count("\n") == 1 and out == "" and needle in err
    check("error: " + name, ok, f"rc={rc} out={out[:80]!r} err={err!r}")


def write(name, data):
    p = os.path.join(TMP, name)
    with open(p, "wb") as f:
        f.write(data)
    return p


model_bytes = open(V0, "rb").read()
q80_bytes = open(Q80, "rb").read()
tok_bytes = open(TOK, "rb").read()
T = ["--tokenizer", TOK]
M = ["--model", V0]
expect_error("missing model", ["--model", os.path.join(TMP, "nope.bin")] + T, "--model")
expect_error("missing tokenizer", M + ["--tokenizer", os.path.join(TMP, "nope.bin")], "--tokenizer")
expect_error("truncated model (v0)", ["--model", write("trunc.bin", model_bytes[:-100])] + T, "--model")
expect_error("truncated model (q80)", ["--model", write("trunc_q80.bin", q80_bytes[: len(q80_bytes) // 2])] + T,
             "--model")
expect_error("model header only", ["--model", write("hdr.bin", model_bytes[:20])] + T, "--model")
expect_error("empty model file", ["--model", write("empty.bin", b"")] + T, "--model")
expect_error("tokenizer given as the model", ["--model", TOK] + T, "--model")
expect_error("model given as the tokenizer", M + ["--tokenizer", V0], "--tokenizer")
expect_error("truncated tokenizer", M + ["--tokenizer", write("trunc_tok.bin", tok_bytes[:-7])], "--tokenizer")
expect_error("text file as the tokenizer", M + ["--tokenizer", write("text.txt", b"hello world\n" * 50)],
             "--tokenizer")
expect_error("prompt longer than max_seq_len", M + T + ["--prompt", "the cat and the dog " * 120], "max_seq_len")
expect_error("steps beyond max_seq_len", M + T + ["--steps", "513"], "--steps")
expect_error("steps below the prompt", M + T + ["--prompt", "Once upon a time", "--steps", "3"], "--steps")
expect_error("steps 0", M + T + ["--steps", "0"], "--steps")
expect_error("negative temperature", M + T + ["--temperature", "-0.5"], "--temperature")
expect_error("top-p 0", M + T + ["--top-p", "0"], "--top-p")
expect_error("top-p above 1", M + T + ["--top-p", "1.5"], "--top-p")
expect_error("top-p negative", M + T + ["--top-p", "-0.2"], "--top-p")
expect_error("non-numeric steps", M + T + ["--steps", "many"], "--steps")
expect_error("negative seed", M + T + ["--seed", "-3"], "--seed")

# ---- qkv demo: the model part --------------------------------------------------------------------
rc, out, err = run(["demo"], cwd=root)
check("demo: exit 0", rc == 0, err)
check("demo: keeps the embedded example", "the cat sat on the mat" in out, out[:200])
check("demo: the model's story", START[:60] in out, out[-2000:])
check("demo: one token's attention per head", out.count("  head ") == 8 and "(KV head 3)" in out, out[-1500:])
check("demo: the model check passes", "float64 reference forward pass" in out and "MISMATCH" not in out, out[-600:])
check("demo: readable length", len(out.splitlines()) < 150, str(len(out.splitlines())))
rc, out, err = run(["demo"], env={"QKV_MODELS_DIR": TMP})
check("demo without the model: exit 0, says where it looked",
      rc == 0 and "not found" in out and os.path.join(TMP, "stories260K") in out, out[-400:] + err)

if failures:
    print(f"{len(failures)} failed: {failures}")
    sys.exit(1)
print("all passed")

#!/usr/bin/env python3
"""Checks `qkv attend --explain`: the kernel choice of each pass printed on stdout, then the usual
run, cross-checked against the float64 NumPy definition of test_attend.py.

Usage: test_attend_explain.py <path to the qkv binary>

A decode-shaped call (one query row over many keys) chooses `decode`, a prefill-shaped one
`flash` (and `flash` for its backward), float64 inputs the `reference`, packed sequences the
`serving` kernel (`per-sequence` with --reference, and for the backward); every block names each
kernel of its entry point once, exactly one of them chosen, and the outputs still match the
definition. --explain with --simulate-ranks and a bad input exit 2 with one line on stderr and
print nothing on stdout. Needs NumPy only.
"""
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_attend as ta  # noqa: E402  (attention_ref, the float64 definition)
import test_attend_varlen as tv  # noqa: E402  (ref_packed, cu, run)

O_ATOL = 2e-5
check = tv.check  # one count of passed and failed checks, tv.passed and tv.failed

# The kernels of each entry point, in the registry's priority order (src/dispatch/dispatch.cpp).
KERNELS = {
    "qkv::attention": ["decode", "flash", "reference"],
    "qkv::attention_backward": ["flash", "reference"],
    "qkv::attention_varlen": ["serving", "per-sequence", "reference"],
    "qkv::attention_varlen_backward": ["per-sequence"],
}


def blocks(stdout):
    """{entry point: [kernel lines]} from --explain's output (an entry line, then indented lines)."""
    out, entry = {}, None
    for line in stdout.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            entry = line[:-1]
            out[entry] = []
        elif line.startswith("  ") and entry:
            out[entry].append(line[2:])
    return out


def chosen(name, stdout, entries):
    """Checks the blocks' form; returns {entry point: its chosen line}."""
    got = blocks(stdout)
    check(f"{name}: the passes explained", list(got) == entries, f"{list(got)} in {stdout!r}")
    picks = {}
    for entry, lines in got.items():
        names = [l.split(":")[0] for l in lines]
        check(f"{name}: {entry} names its kernels", names == KERNELS.get(entry), str(lines))
        picked = [l for l in lines if ": chosen" in l]
        check(f"{name}: {entry} has one chosen line", len(picked) == 1, str(lines))
        picks[entry] = picked[0] if picked else ""
    return picks


def dense_case(tmp, name, rng, shape_q, shape_k, dtype, flags=(), grads=False):
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k).astype(dtype)
    p = {n: os.path.join(tmp, f"{name}_{n}.npy") for n in ("q", "k", "v", "o", "do", "dq")}
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(p[n], a)
    args = ["attend", "--q", p["q"], "--k", p["k"], "--v", p["v"], "--out", p["o"], "--explain", *flags]
    if grads:
        np.save(p["do"], rng.standard_normal(shape_q).astype(dtype))
        args += ["--grad-out", p["do"], "--grad-q", p["dq"]]
    rc, out, err = tv.run(args)
    check(f"{name}: exit 0", rc == 0, err.strip())
    if rc != 0:
        return {}
    ro, _, _ = ta.attention_ref(q, k, v, causal="--causal" in flags)
    o = np.load(p["o"])
    check(f"{name}: out", np.abs(o - ro).max() <= O_ATOL, f"max err {np.abs(o - ro).max():.3g}")
    return chosen(name, out, ["qkv::attention"] + (["qkv::attention_backward"] if grads else []))


def varlen_case(tmp, name, rng, lq, lk, flags=(), grads=False):
    Hq, Hkv, D = 4, 2, 32
    q = rng.standard_normal((sum(lq), Hq, D)).astype(np.float32)
    k = rng.standard_normal((sum(lk), Hkv, D)).astype(np.float32)
    v = rng.standard_normal((sum(lk), Hkv, D)).astype(np.float32)
    p = {n: os.path.join(tmp, f"{name}_{n}.npy") for n in ("q", "k", "v", "cq", "ck", "o", "do", "dv")}
    for n, a in (("q", q), ("k", k), ("v", v), ("cq", tv.cu(lq)), ("ck", tv.cu(lk))):
        np.save(p[n], a)
    args = ["attend", "--q", p["q"], "--k", p["k"], "--v", p["v"], "--out", p["o"], "--cu-seqlens-q", p["cq"],
            "--cu-seqlens-k", p["ck"], "--causal", "--explain", *flags]
    if grads:
        np.save(p["do"], rng.standard_normal((sum(lq), Hq, D)).astype(np.float32))
        args += ["--grad-out", p["do"], "--grad-v", p["dv"]]
    rc, out, err = tv.run(args)
    check(f"{name}: exit 0", rc == 0, err.strip())
    if rc != 0:
        return {}
    ro, _ = tv.ref_packed(q, k, v, lq, lk, causal=True)
    o = np.load(p["o"])
    check(f"{name}: out", np.abs(o - ro).max() <= O_ATOL, f"max err {np.abs(o - ro).max():.3g}")
    return chosen(name, out, ["qkv::attention_varlen"] + (["qkv::attention_varlen_backward"] if grads else []))


def main():
    global QKV
    if len(sys.argv) != 2:
        print("usage: test_attend_explain.py <path to qkv>", file=sys.stderr)
        return 2
    QKV = os.path.abspath(sys.argv[1])
    tv.QKV = QKV  # tv.run runs it
    rng = np.random.default_rng(23)
    with tempfile.TemporaryDirectory(prefix="qkv_explain_") as tmp:
        c = dense_case(tmp, "decode-shaped", rng, (2, 8, 1, 64), (2, 2, 300, 64), np.float32)
        check("decode-shaped: decode", c.get("qkv::attention", "").startswith("decode: chosen ("), str(c))

        c = dense_case(tmp, "prefill-shaped", rng, (1, 4, 96, 32), (1, 2, 96, 32), np.float32, ["--causal"], grads=True)
        check("prefill-shaped: flash", c.get("qkv::attention", "").startswith("flash: chosen ("), str(c))
        check("prefill-shaped: flash backward", c.get("qkv::attention_backward", "").startswith("flash: chosen ("), str(c))

        c = dense_case(tmp, "float64", rng, (1, 2, 40, 16), (1, 2, 40, 16), np.float64)
        check("float64: reference", c.get("qkv::attention") == "reference: chosen", str(c))
        c = dense_case(tmp, "--reference", rng, (1, 2, 1, 16), (1, 2, 40, 16), np.float32, ["--reference"])
        check("--reference: reference", c.get("qkv::attention") == "reference: chosen", str(c))

        mixed_q, mixed_k = [1, 0, 30, 5], [200, 7, 30, 60]
        c = varlen_case(tmp, "varlen", rng, mixed_q, mixed_k)
        check("varlen: serving", c.get("qkv::attention_varlen", "").startswith("serving: chosen ("), str(c))
        c = varlen_case(tmp, "varlen --reference", rng, mixed_q, mixed_k, ["--reference"], grads=True)
        check("varlen --reference: per-sequence, the reference for each",
              c.get("qkv::attention_varlen") == "per-sequence: chosen (one qkv::attention call per sequence: "
                                                "reference for 4)", str(c))
        check("varlen --reference: backward per sequence",
              c.get("qkv::attention_varlen_backward") == "per-sequence: chosen (one qkv::attention_backward call "
                                                         "per sequence: reference for 4)", str(c))

        # Errors: status 2, one line on stderr, nothing explained.
        q = os.path.join(tmp, "e_q.npy")
        k = os.path.join(tmp, "e_k.npy")
        np.save(q, np.zeros((1, 2, 4, 8), np.float32))
        np.save(k, np.zeros((1, 2, 4, 6), np.float32))
        for name, args, needle in (
                ("simulate-ranks", ["--k", q, "--v", q, "--simulate-ranks", "2"], "--explain: not available"),
                ("bad D", ["--k", k, "--v", k], "k: expected")):
            out = os.path.join(tmp, "e_o.npy")
            rc, so, err = tv.run(["attend", "--q", q, "--out", out, "--explain", *args])
            lines = err.strip().splitlines()
            check(f"error {name}: status 2", rc == 2, f"rc {rc}")
            check(f"error {name}: one line", len(lines) == 1 and lines[0].startswith("qkv: error:") and needle in lines[0],
                  err.strip())
            check(f"error {name}: nothing on stdout, no output", so == "" and not os.path.exists(out), so)
    print(f"python attend explain: {tv.passed} passed, {tv.failed} failed")
    return 1 if tv.failed else 0


if __name__ == "__main__":
    sys.exit(main())

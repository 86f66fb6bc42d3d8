#!/usr/bin/env python3
"""Cross-checks `qkv attend --grad-out ... --grad-q/--grad-k/--grad-v` against a float64 NumPy
backward pass written from the derivative of docs/semantics.md (independent of the C++ code).

Usage: test_attend_backward.py <path to the qkv binary>

Checks every option the forward has (causal both alignments, window, softcap, bool and additive
masks, key lengths, GQA, BSHD, Sq != Sk), the fast path and --reference, and the errors of the
gradient flags (exit 2, one line on stderr, no output file left). Needs NumPy only.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attend import attention_ref  # noqa: E402  (the forward's float64 definition)

passed = 0
failed = 0
QKV = None


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name}: {detail}", flush=True)


def run(args):
    r = subprocess.run([QKV] + args, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def backward_ref(q, k, v, dout, *, layout="bhsd", scale=None, causal=False, align="bottom-right",
                 window=None, mask=None, kv_lens=None, softcap=0.0):
    """dQ, dK, dV in `layout`, float64: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
    through softcap (1 - tanh^2), dQ = scale dS K, dK = scale dS^T Q, summed over GQA groups."""
    o, _, p = attention_ref(q, k, v, layout=layout, scale=scale, causal=causal, align=align, window=window,
                            mask=mask, kv_lens=kv_lens, softcap=softcap)
    q, k, v, dout, o = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout, o))
    if layout == "bshd":
        q, k, v, dout, o = (a.transpose(0, 2, 1, 3) for a in (q, k, v, dout, o))
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    dv = np.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = np.einsum("bhqd,bhkd->bhqk", dout, vr)
    Di = (dout * o).sum(-1, keepdims=True)
    ds = p * (dp - Di)
    if softcap > 0:
        x = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
        ds = ds * (1.0 - np.tanh(x / softcap) ** 2)
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, kr)
    dk = scale * np.einsum("bhqk,bhqd->bhkd", ds, q)
    dk = dk.reshape(B, Hkv, g, *dk.shape[2:]).sum(2)
    dv = dv.reshape(B, Hkv, g, *dv.shape[2:]).sum(2)
    out = (dq, dk, dv)
    if layout == "bshd":
        out = tuple(a.transpose(0, 2, 1, 3) for a in out)
    return out


def case(tmp, rng, name, *, B, Hq, Hkv, Sq, Sk, D, Dv, layout="bhsd", causal=False, align=None, window=None,
         mask=None, kv_lens=None, softcap=None, scale=None, reference=False, threads=None):
    def make(H, S, X):
        a = rng.standard_normal((B, H, S, X))
        if layout == "bshd":
            a = a.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(a.astype(np.float32))

    q, k, v, dout = make(Hq, Sq, D), make(Hkv, Sk, D), make(Hkv, Sk, Dv), make(Hq, Sq, Dv)
    paths = {n: os.path.join(tmp, f"{name}_{n}.npy") for n in ("q", "k", "v", "do", "o", "dq", "dk", "dv", "m", "l")}
    for n, a in (("q", q), ("k", k), ("v", v), ("do", dout)):
        np.save(paths[n], a)
    args = ["attend", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out", paths["o"], "--layout", layout,
            "--grad-out", paths["do"], "--grad-q", paths["dq"], "--grad-k", paths["dk"], "--grad-v", paths["dv"]]
    if causal:
        args += ["--causal"]
    if align:
        args += ["--align", align]
    if window:
        args += [f"--window={window[0]},{window[1]}"]
    if mask is not None:
        np.save(paths["m"], mask)
        args += ["--mask", paths["m"]]
    if kv_lens is not None:
        np.save(paths["l"], kv_lens)
        args += ["--kv-lens", paths["l"]]
    if softcap:
        args += ["--softcap", repr(softcap)]
    if scale is not None:
        args += ["--scale", repr(scale)]
    if reference:
        args += ["--reference"]
    if threads:
        args += ["--threads", str(threads)]
    rc, _, err = run(args)
    if rc != 0:
        check(name, False, f"exit {rc}: {err.strip()}")
        return
    want = backward_ref(q, k, v, dout, layout=layout, scale=scale, causal=causal, align=align or "bottom-right",
                        window=window, mask=mask, kv_lens=kv_lens, softcap=softcap or 0.0)
    for n, w in zip(("dq", "dk", "dv"), want):
        got = np.load(paths[n])
        check(f"{name}: {n} dtype and shape", got.dtype == np.float32 and got.shape == w.shape, f"{got.dtype} {got.shape}")
        if got.shape == w.shape:
            err = np.abs(got.astype(np.float64) - w).max() if w.size else 0.0
            tol = 2e-5 * max(1.0, np.abs(w).max() if w.size else 0.0)
            check(f"{name}: {n}", err <= tol, f"max abs err {err:.3g} > {tol:.3g}")


def random_cases(tmp):
    rng = np.random.default_rng(17)
    for reference in (False, True):
        r = "ref_" if reference else ""
        case(tmp, rng, r + "plain", B=1, Hq=2, Hkv=2, Sq=33, Sk=47, D=16, Dv=16, reference=reference)
        case(tmp, rng, r + "causal_br", B=2, Hq=2, Hkv=1, Sq=20, Sk=70, D=24, Dv=8, causal=True, reference=reference)
        case(tmp, rng, r + "causal_br_sq_gt_sk", B=1, Hq=2, Hkv=2, Sq=40, Sk=25, D=8, Dv=8, causal=True,
             reference=reference)
        case(tmp, rng, r + "causal_tl", B=1, Hq=4, Hkv=2, Sq=31, Sk=17, D=8, Dv=12, causal=True, align="top-left",
             reference=reference)
        case(tmp, rng, r + "window", B=1, Hq=2, Hkv=2, Sq=50, Sk=50, D=16, Dv=16, window=(7, 3), reference=reference)
        case(tmp, rng, r + "softcap", B=1, Hq=2, Hkv=2, Sq=19, Sk=23, D=32, Dv=32, softcap=2.5, scale=0.7,
             reference=reference)
        case(tmp, rng, r + "bool_mask", B=2, Hq=2, Hkv=2, Sq=9, Sk=13, D=5, Dv=7,
             mask=rng.random((1, 2, 9, 13)) > 0.3, reference=reference)
        add = np.where(rng.random((9, 13)) > 0.2, rng.standard_normal((9, 13)), -np.inf).astype(np.float32)
        case(tmp, rng, r + "additive_mask", B=1, Hq=2, Hkv=1, Sq=9, Sk=13, D=6, Dv=6, mask=add, reference=reference)
        case(tmp, rng, r + "kv_lens", B=3, Hq=2, Hkv=2, Sq=5, Sk=30, D=8, Dv=8, causal=True,
             kv_lens=np.array([30, 11, 0], dtype=np.int64), reference=reference)
        case(tmp, rng, r + "gqa8_bshd", B=1, Hq=8, Hkv=1, Sq=21, Sk=34, D=16, Dv=16, layout="bshd", causal=True,
             reference=reference, threads=2)
        case(tmp, rng, r + "d1", B=1, Hq=1, Hkv=1, Sq=7, Sk=1, D=1, Dv=1, reference=reference)


def error_cases(tmp):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    paths = {n: os.path.join(tmp, f"err_{n}.npy") for n in ("q", "do", "bad_do", "o", "dq", "dk", "dv")}
    np.save(paths["q"], q)
    np.save(paths["do"], q)
    np.save(paths["bad_do"], q[:, :, :3])
    base = ["attend", "--q", paths["q"], "--k", paths["q"], "--v", paths["q"], "--out", paths["o"]]
    cases = [
        ("grad flags without --grad-out", ["--grad-q", paths["dq"]], "--grad-out: expected dO"),
        ("--grad-out without a gradient to write", ["--grad-out", paths["do"]], "--grad-out: expected at least one"),
        ("dO of the wrong shape", ["--grad-out", paths["bad_do"], "--grad-q", paths["dq"]],
         "grad_out: expected the shape of out"),
        ("two gradients to one path", ["--grad-out", paths["do"], "--grad-q", paths["dq"], "--grad-k", paths["dq"]],
         "--grad-k: expected a path different from --grad-q"),
        ("dO missing", ["--grad-out", os.path.join(tmp, "none.npy"), "--grad-v", paths["dv"]], "--grad-out:"),
    ]
    for name, extra, needle in cases:
        for p in (paths["o"], paths["dq"], paths["dk"], paths["dv"]):
            if os.path.exists(p):
                os.remove(p)
        rc, _, err = run(base + extra)
        lines = err.strip().splitlines()
        check(f"error: {name}: exit 2, one line", rc == 2 and len(lines) == 1 and lines[0].startswith("qkv: error:"),
              f"rc {rc}, stderr {err!r}")
        check(f"error: {name}: message", needle in err, err)
        check(f"error: {name}: no output file", not any(os.path.exists(paths[n]) for n in ("o", "dq", "dk", "dv")),
              str([n for n in ("o", "dq", "dk", "dv") if os.path.exists(paths[n])]))


def main():
    global QKV
    if len(sys.argv) != 2:
        print("usage: test_attend_backward.py <path to qkv>", file=sys.stderr)
        return 2
    QKV = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="qkv_backward_") as tmp:
        random_cases(tmp)
        error_cases(tmp)
    print(f"python attend backward: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

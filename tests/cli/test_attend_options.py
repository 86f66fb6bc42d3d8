#!/usr/bin/env python3
"""Cross-checks `qkv attend --sinks/--alibi-slopes/--keep-first` and `--grad-sinks` against a
float64 NumPy definition of docs/semantics.md ("Score options"), independent of the C++ code.

Usage: test_attend_options.py <path to the qkv binary>

Dense (BHSD, BSHD) and packed (--cu-seqlens-q/-k) calls, combined with causal in both alignments,
a window, softcap, key lengths and GQA, Sq != Sk; the backward's dQ, dK, dV and dL/dz against the
NumPy derivative; --explain names the fast kernel that runs them; the errors (exit 2, one line
on stderr, no output file). Needs NumPy only.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

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


def forward(q, k, v, *, causal=False, align="bottom-right", window=None, kv_lens=None, softcap=0.0,
            sinks=None, slopes=None, keep=0):
    """BHSD float64: O, softmax_lse, P [B,Hq,Sq,Sk] and the sink's weight [B,Hq,Sq]."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, kr) / np.sqrt(D)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    lens = np.full(B, Sk) if kv_lens is None else np.asarray(kv_lens, dtype=np.int64)
    i = np.arange(Sq)[None, :, None]
    j = np.arange(Sk)[None, None, :]
    L = lens[:, None, None]
    diag = i + L - Sq if align == "bottom-right" else i + 0 * L
    if slopes is not None:
        sl = np.broadcast_to(np.asarray(slopes, dtype=np.float64).reshape(-1, Hq), (B, Hq))
        s = s - sl[:, :, None, None] * np.abs(diag - j)[:, None, :, :]
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    allowed = j < L
    if right >= 0:
        allowed = allowed & (j <= diag + right)
    if left >= 0:
        allowed = allowed & ((j >= diag - left) | (j < keep))
    allowed = np.broadcast_to(allowed[:, None], s.shape)
    s = np.where(allowed, s, -np.inf)
    z = np.full(Hq, -np.inf) if sinks is None else np.asarray(sinks, dtype=np.float64)
    zb = np.broadcast_to(z[None, :, None], (B, Hq, Sq))
    m = np.maximum(s.max(axis=-1), zb)
    empty = m == -np.inf
    m0 = np.where(empty, 0.0, m)
    e = np.where(allowed, np.exp(s - m0[..., None]), 0.0)
    es = np.where(np.isinf(zb), 0.0, np.exp(zb - m0))
    den = e.sum(-1) + es
    den1 = np.where(empty, 1.0, den)
    p = e / den1[..., None]
    psink = np.where(empty, 0.0, es / den1)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m0 + np.log(den1))
    o = np.einsum("bhqk,bhkd->bhqd", p, vr)
    return o, lse, p, psink


def backward(q, k, v, dout, **opts):
    o, _, p, psink = forward(q, k, v, **opts)
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1.0 / np.sqrt(D)
    dv = np.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = np.einsum("bhqd,bhkd->bhqk", dout, vr)
    Di = (dout * o).sum(-1)
    ds = p * (dp - Di[..., None])
    if opts.get("softcap", 0.0) > 0:
        c = opts["softcap"]
        x = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
        ds = ds * (1.0 - np.tanh(x / c) ** 2)
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, kr)
    dk = (scale * np.einsum("bhqk,bhqd->bhkd", ds, q)).reshape(B, Hkv, g, *k.shape[2:]).sum(2)
    dv = dv.reshape(B, Hkv, g, *v.shape[2:]).sum(2)
    dz = -(psink * Di).sum(axis=(0, 2))
    return dq, dk, dv, dz


def close(name, got, want, tol):
    check(f"{name}: shape", got.shape == want.shape, f"{got.shape} vs {want.shape}")
    if got.shape != want.shape:
        return
    inf = np.isinf(want)
    check(f"{name}: infinities", np.array_equal(np.isinf(got), inf) and np.all(got[inf] == want[inf]))
    err = np.abs(got[~inf].astype(np.float64) - want[~inf]).max() if (~inf).any() else 0.0
    t = tol * max(1.0, np.abs(want[~inf]).max() if (~inf).any() else 0.0)
    check(name, err <= t, f"max abs err {err:.3g} > {t:.3g}")


def dense_case(tmp, rng, name, *, B, Hq, Hkv, Sq, Sk, D, layout="bhsd", sinks=True, slopes=None, keep=0,
               causal=False, align="bottom-right", window=None, kv_lens=None, softcap=0.0, reference=False):
    q = rng.standard_normal((B, Hq, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, D))
    dout = rng.standard_normal((B, Hq, Sq, D))
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    z = (rng.standard_normal(Hq) * 2).astype(np.float32) if sinks else None
    sl = None
    if slopes == "heads":
        sl = (2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)).astype(np.float32)
    elif slopes == "batch":
        sl = rng.random((B, Hq)).astype(np.float32)
    f = {n: os.path.join(tmp, f"{name}_{n}.npy") for n in ("q", "k", "v", "do", "o", "lse", "dq", "dk", "dv", "z",
                                                           "dz", "s", "l")}
    t = (lambda a: a.transpose(0, 2, 1, 3)) if layout == "bshd" else (lambda a: a)
    for n, a in (("q", q), ("k", k), ("v", v), ("do", dout)):
        np.save(f[n], np.ascontiguousarray(t(a)).astype(np.float32))
    args = ["attend", "--q", f["q"], "--k", f["k"], "--v", f["v"], "--out", f["o"], "--lse", f["lse"],
            "--layout", layout, "--grad-out", f["do"], "--grad-q", f["dq"], "--grad-k", f["dk"], "--grad-v", f["dv"],
            "--align", align]
    if z is not None:
        np.save(f["z"], z)
        args += ["--sinks", f["z"], "--grad-sinks", f["dz"]]
    if sl is not None:
        np.save(f["s"], sl)
        args += ["--alibi-slopes", f["s"]]
    if keep:
        args += ["--keep-first", str(keep)]
    if causal:
        args += ["--causal"]
    if window:
        args += [f"--window={window[0]},{window[1]}"]
    if kv_lens is not None:
        np.save(f["l"], np.asarray(kv_lens, dtype=np.int64))
        args += ["--kv-lens", f["l"]]
    if softcap:
        args += ["--softcap", repr(softcap)]
    if reference:
        args += ["--reference"]
    rc, _, err = run(args)
    if rc != 0:
        check(name, False, f"exit {rc}: {err.strip()}")
        return
    opts = dict(causal=causal, align=align, window=window, kv_lens=kv_lens, softcap=softcap,
                sinks=None if z is None else z.astype(np.float64), slopes=sl, keep=keep)
    o, lse, _, _ = forward(q, k, v, **opts)
    close(f"{name}: out", t(np.load(f["o"])), o, 2e-5)
    close(f"{name}: lse", np.load(f["lse"]), lse, 2e-5)
    dq, dk, dv, dz = backward(q, k, v, dout, **opts)
    close(f"{name}: dq", t(np.load(f["dq"])), dq, 5e-5)
    close(f"{name}: dk", t(np.load(f["dk"])), dk, 5e-5)
    close(f"{name}: dv", t(np.load(f["dv"])), dv, 5e-5)
    if z is not None:
        got = np.load(f["dz"])
        check(f"{name}: dz dtype", got.dtype == np.float32 and got.shape == (Hq,), f"{got.dtype} {got.shape}")
        close(f"{name}: dz", got, dz, 5e-5)


def packed_case(tmp, rng):
    """Two sequences packed, [batch, Hq] slopes (a row per sequence), sinks and keep-first."""
    Hq, Hkv, D = 4, 2, 8
    sq, sk = [3, 5], [7, 4]
    cu_q, cu_k = np.array([0, 3, 8], dtype=np.int32), np.array([0, 7, 11], dtype=np.int32)
    q = rng.standard_normal((8, Hq, D)).astype(np.float32)
    k = rng.standard_normal((11, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((11, Hkv, D)).astype(np.float32)
    z = rng.standard_normal(Hq).astype(np.float32)
    sl = rng.random((2, Hq)).astype(np.float32)
    f = {n: os.path.join(tmp, f"packed_{n}.npy") for n in ("q", "k", "v", "o", "z", "s", "cq", "ck", "lse")}
    for n, a in (("q", q), ("k", k), ("v", v), ("z", z), ("s", sl), ("cq", cu_q), ("ck", cu_k)):
        np.save(f[n], a)
    rc, out, err = run(["attend", "--q", f["q"], "--k", f["k"], "--v", f["v"], "--out", f["o"], "--lse", f["lse"],
                        "--cu-seqlens-q", f["cq"], "--cu-seqlens-k", f["ck"], "--sinks", f["z"],
                        "--alibi-slopes", f["s"], "--keep-first", "1", "--causal", "--window=1,0", "--explain"])
    if rc != 0:
        check("packed", False, f"exit {rc}: {err.strip()}")
        return
    check("packed: --explain names the serving kernel", "serving: chosen" in out, out)
    got, got_lse = np.load(f["o"]), np.load(f["lse"])
    for b in range(2):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2)[None].astype(np.float64)
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)[None].astype(np.float64)
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)[None].astype(np.float64)
        o, lse, _, _ = forward(qs, ks, vs, causal=True, window=(1, 0), sinks=z.astype(np.float64), slopes=sl[b],
                               keep=1)
        close(f"packed seq {b}: out", got[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2)[None], o, 2e-5)
        close(f"packed seq {b}: lse", got_lse[:, cu_q[b]:cu_q[b + 1]][None], lse, 2e-5)


def explain_dense(tmp, rng):
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    z = np.array([0.5, -1.0], dtype=np.float32)
    f = {n: os.path.join(tmp, f"ex_{n}.npy") for n in ("q", "z", "o")}
    np.save(f["q"], q)
    np.save(f["z"], z)
    rc, out, err = run(["attend", "--q", f["q"], "--k", f["q"], "--v", f["q"], "--out", f["o"], "--sinks", f["z"],
                        "--explain"])
    check("explain: exit 0", rc == 0, err)
    check("explain: decode takes sinks", "decode: chosen" in out, out)


def error_cases(tmp):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    f = {n: os.path.join(tmp, f"err_{n}.npy") for n in ("q", "o", "dq", "dz", "z", "z64", "z3", "znan", "s3")}
    np.save(f["q"], q)
    np.save(f["z"], np.zeros(2, np.float32))
    np.save(f["z64"], np.zeros(2))
    np.save(f["z3"], np.zeros(3, np.float32))
    np.save(f["znan"], np.array([0.0, np.nan], np.float32))
    np.save(f["s3"], np.zeros((3, 2), np.float32))
    base = ["attend", "--q", f["q"], "--k", f["q"], "--v", f["q"], "--out", f["o"]]
    cases = [
        ("float64 sinks", ["--sinks", f["z64"]], "sinks: expected dtype float32, got float64"),
        ("sinks of the wrong shape", ["--sinks", f["z3"]], "sinks: expected shape [Hq] = [2], got [3]"),
        ("NaN sink", ["--sinks", f["znan"]], "sinks: expected finite values, got nan at index 1"),
        ("missing sinks file", ["--sinks", os.path.join(tmp, "none.npy")], "--sinks:"),
        ("slopes of the wrong shape", ["--alibi-slopes", f["s3"]], "alibi_slopes: expected shape [Hq] = [2] or [B,Hq]"),
        ("negative keep-first", ["--keep-first", "-1"], "--keep-first: expected an integer >= 0"),
        ("--grad-sinks without --sinks", ["--grad-out", f["q"], "--grad-sinks", f["dz"]],
         "--grad-sinks: expected --sinks"),
        ("--grad-sinks without --grad-out", ["--sinks", f["z"], "--grad-sinks", f["dz"]], "--grad-out: expected dO"),
        ("sinks of the wrong shape with --simulate-ranks", ["--sinks", f["z3"], "--simulate-ranks", "2"],
         "sinks: expected shape [Hq] = [2], got [3]"),
        ("--grad-sinks without --sinks, --simulate-ranks", ["--grad-out", f["q"], "--grad-sinks", f["dz"],
                                                            "--simulate-ranks", "2"], "--grad-sinks: expected --sinks"),
    ]
    for name, extra, needle in cases:
        for n in ("o", "dq", "dz"):
            if os.path.exists(f[n]):
                os.remove(f[n])
        rc, _, err = run(base + extra)
        lines = err.strip().splitlines()
        check(f"error: {name}: exit 2, one line", rc == 2 and len(lines) == 1 and lines[0].startswith("qkv: error:"),
              f"rc {rc}, stderr {err!r}")
        check(f"error: {name}: message", needle in err, err)
        check(f"error: {name}: no output file", not any(os.path.exists(f[n]) for n in ("o", "dq", "dz")))


def main():
    global QKV
    if len(sys.argv) != 2:
        print("usage: test_attend_options.py <path to qkv>", file=sys.stderr)
        return 2
    QKV = os.path.abspath(sys.argv[1])
    rng = np.random.default_rng(23)
    with tempfile.TemporaryDirectory(prefix="qkv_options_") as tmp:
        for ref in (False, True):
            r = "ref_" if ref else ""
            dense_case(tmp, rng, r + "sinks", B=2, Hq=4, Hkv=2, Sq=5, Sk=9, D=8, reference=ref)
            dense_case(tmp, rng, r + "alibi_heads_causal_br", B=1, Hq=3, Hkv=1, Sq=6, Sk=11, D=4, sinks=False,
                       slopes="heads", causal=True, reference=ref)
            dense_case(tmp, rng, r + "all_tl_window", B=2, Hq=2, Hkv=2, Sq=9, Sk=5, D=6, slopes="batch", keep=2,
                       causal=True, align="top-left", window=(1, 0), reference=ref)
            dense_case(tmp, rng, r + "all_kv_lens_softcap_bshd", B=3, Hq=4, Hkv=1, Sq=4, Sk=10, D=5, layout="bshd",
                       slopes="batch", keep=3, window=(2, 1), kv_lens=[10, 6, 0], softcap=1.5, reference=ref)
        packed_case(tmp, rng)
        explain_dense(tmp, rng)
        error_cases(tmp)
    print(f"python attend options: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

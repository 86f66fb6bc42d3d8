#!/usr/bin/env python3
"""Cross-checks `qkv attend` against a float64 NumPy implementation of docs/semantics.md.

Usage: test_attend.py <path to the qkv binary>

Random cases cover every flag of `qkv attend`; malformed inputs must give exit status 2, exactly
one line on stderr starting `qkv: error:` that names the argument, and no output file. Also runs
`qkv demo` and `qkv info`. Needs NumPy only. Exits non-zero if any check fails.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

O_ATOL = 2e-5     # O, float32 output
LSE_RTOL = 1e-5   # softmax_lse, relative
P_ATOL = 1e-6     # probabilities

passed = 0
failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name}: {detail}", flush=True)


# ---- the float64 definition --------------------------------------------------------------------

def attention_ref(q, k, v, *, layout="bhsd", scale=None, causal=False, align="bottom-right",
                  window=None, mask=None, kv_lens=None, softcap=0.0):
    """Returns O (in `layout`), softmax_lse [B,Hq,Sq] and probs [B,Hq,Sq,Sk], all float64."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if layout == "bshd":
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    k = np.repeat(k, group, axis=1)  # query head h reads KV head h // group
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)

    lens = np.full(B, Sk, dtype=np.int64) if kv_lens is None else np.asarray(kv_lens, dtype=np.int64)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i = np.arange(Sq)[None, :, None]
    j = np.arange(Sk)[None, None, :]
    L = lens[:, None, None]
    diag = i + L - Sq if align == "bottom-right" else i + 0 * L
    allowed = j < L
    if left >= 0:
        allowed = allowed & (j >= diag - left)
    if right >= 0:
        allowed = allowed & (j <= diag + right)
    allowed = np.broadcast_to(allowed[:, None, :, :], s.shape)

    if mask is not None:
        m = np.broadcast_to(mask, s.shape)
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            s = s + m.astype(np.float64)
            allowed = allowed & (m != -np.inf)

    s = np.where(allowed, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    empty = mx == -np.inf
    e = np.where(allowed, np.exp(s - np.where(empty, 0.0, mx)), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    p = np.where(empty, 0.0, e / np.where(empty, 1.0, tot))
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, mx + np.log(np.where(empty, 1.0, tot)))[..., 0]
    o = np.einsum("bhqk,bhkd->bhqd", p, v)
    if layout == "bshd":
        o = o.transpose(0, 2, 1, 3)
    return o, lse, p


# ---- running the tool --------------------------------------------------------------------------

def run(args, cwd=None, env=None):
    r = subprocess.run([QKV] + args, capture_output=True, text=True, cwd=cwd, timeout=120,
                       env=None if env is None else {**os.environ, **env})
    return r.returncode, r.stdout, r.stderr


def lse_close(got, want):
    inf = np.isinf(want)
    if not np.array_equal(np.isinf(got), inf) or not np.all(got[inf] == want[inf]):
        return False, "infinite entries differ"
    if inf.all():
        return True, ""
    rel = np.abs(got[~inf] - want[~inf]) / np.maximum(np.abs(want[~inf]), 1e-30)
    # Relative error, with an absolute floor of float32 resolution for LSE values near 0.
    bad = (rel > LSE_RTOL) & (np.abs(got[~inf] - want[~inf]) > 1e-6)
    return not bad.any(), f"max rel err {rel.max():.3g}"


def attend_case(name, tmp, rng, *, B, Hq, Hkv, Sq, Sk, D, Dv, dtype=np.float32, layout="bhsd",
                scale=None, causal=False, align=None, window=None, mask=None, kv_lens=None,
                softcap=None, reference=False, threads=None, want_lse=True, want_probs=True):
    def make(H, S, X):
        a = rng.standard_normal((B, H, S, X)) * 1.5
        if layout == "bshd":
            a = a.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(a.astype(dtype))

    q, k, v = make(Hq, Sq, D), make(Hkv, Sk, D), make(Hkv, Sk, Dv)
    paths = {n: os.path.join(tmp, f"{name}_{n}.npy") for n in ("q", "k", "v", "o", "lse", "p", "mask", "lens")}
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(paths[n], a)
    args = ["attend", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out", paths["o"],
            "--layout", layout]
    if want_lse:
        args += ["--lse", paths["lse"]]
    if want_probs:
        args += ["--probs", paths["p"]]
    if scale is not None:
        args += ["--scale", repr(scale)]
    if causal:
        args += ["--causal"]
    if align is not None:
        args += ["--align", align]
    if window is not None:
        args += [f"--window={window[0]},{window[1]}"]
    if mask is not None:
        np.save(paths["mask"], mask)
        args += ["--mask", paths["mask"]]
    if kv_lens is not None:
        np.save(paths["lens"], kv_lens)
        args += ["--kv-lens", paths["lens"]]
    if softcap is not None:
        args += ["--softcap", repr(softcap)]
    if reference:
        args += ["--reference"]
    if threads is not None:
        args += ["--threads", str(threads)]

    rc, out, err = run(args)
    if rc != 0:
        check(name, False, f"exit {rc}: {err.strip()}")
        return
    ref_o, ref_lse, ref_p = attention_ref(
        q, k, v, layout=layout, scale=scale, causal=causal, align=align or "bottom-right",
        window=window, mask=mask, kv_lens=kv_lens, softcap=softcap or 0.0)
    o = np.load(paths["o"])
    check(f"{name}: O dtype", o.dtype == np.float32, str(o.dtype))
    check(f"{name}: O shape", o.shape == ref_o.shape, f"{o.shape} vs {ref_o.shape}")
    if o.shape == ref_o.shape:
        err_o = np.abs(o.astype(np.float64) - ref_o).max() if o.size else 0.0
        check(f"{name}: O", err_o <= O_ATOL, f"max abs err {err_o:.3g}")
    if want_lse:
        lse = np.load(paths["lse"])
        check(f"{name}: lse dtype/shape", lse.dtype == np.float32 and lse.shape == (B, Hq, Sq), f"{lse.dtype} {lse.shape}")
        if lse.shape == ref_lse.shape:
            ok, why = lse_close(lse.astype(np.float64), ref_lse)
            check(f"{name}: lse", ok, why)
    if want_probs:
        p = np.load(paths["p"])
        check(f"{name}: probs dtype/shape", p.dtype == np.float32 and p.shape == (B, Hq, Sq, Sk), f"{p.dtype} {p.shape}")
        if p.shape == ref_p.shape:
            err_p = np.abs(p.astype(np.float64) - ref_p).max() if p.size else 0.0
            check(f"{name}: probs", err_p <= P_ATOL, f"max abs err {err_p:.3g}")
            sums = p.astype(np.float64).sum(-1)
            rows_ok = np.all((np.abs(sums - 1) < 1e-5) | ((sums == 0) & np.isinf(ref_lse)))
            check(f"{name}: probs rows sum to 1 (or 0 when empty)", rows_ok, str(sums))


def random_cases(tmp):
    rng = np.random.default_rng(20240601)

    def dims(**over):
        d = dict(B=int(rng.integers(1, 3)), Hkv=int(rng.integers(1, 3)), Sq=int(rng.integers(1, 10)),
                 Sk=int(rng.integers(1, 12)), D=int(rng.integers(1, 17)), Dv=int(rng.integers(1, 9)))
        d["Hq"] = d["Hkv"] * int(rng.integers(1, 3))
        d.update(over)
        return d

    def bool_mask(shape):
        return rng.random(shape) < 0.75

    def float_mask(shape, dt):
        m = rng.standard_normal(shape)
        m[rng.random(shape) < 0.2] = -np.inf
        return m.astype(dt)

    cases = []
    for n in range(3):
        cases.append((f"plain{n}", dims(), {}))
    cases += [
        ("bshd", dims(), dict(layout="bshd")),
        ("bshd_gqa", dims(Hq=4, Hkv=2), dict(layout="bshd", causal=True)),
        ("mqa", dims(Hq=4, Hkv=1), {}),
        ("scale", dims(), dict(scale=0.3)),
        ("scale_zero", dims(), dict(scale=0.0)),
        ("causal_sq_lt_sk", dims(Sq=3, Sk=8), dict(causal=True)),
        ("causal_sq_gt_sk", dims(Sq=8, Sk=3), dict(causal=True)),
        ("causal_top_left", dims(Sq=3, Sk=8), dict(causal=True, align="top-left")),
        ("causal_top_left_sq_gt_sk", dims(Sq=8, Sk=3), dict(causal=True, align="top-left")),
        ("align_bottom_right_explicit", dims(Sq=2, Sk=7), dict(causal=True, align="bottom-right")),
        ("window", dims(Sq=7, Sk=9), dict(window=(2, 1))),
        ("window_top_left", dims(Sq=7, Sk=9), dict(window=(1, 2), align="top-left")),
        ("window_left_unbounded", dims(Sq=6, Sk=6), dict(window=(-1, 1))),
        ("window_right_unbounded", dims(Sq=6, Sk=6), dict(window=(1, -1))),
        ("window_causal", dims(Sq=7, Sk=9), dict(window=(2, 3), causal=True)),
        ("window_causal_top_left", dims(Sq=9, Sk=5), dict(window=(1, 1), causal=True, align="top-left")),
        ("softcap", dims(), dict(softcap=1.5, scale=2.0)),
        ("reference", dims(), dict(reference=True, causal=True)),
        ("threads1", dims(), dict(threads=1)),
        ("threads2", dims(B=2, Hq=2, Hkv=2), dict(threads=2, causal=True)),
        ("float16", dims(), dict(dtype=np.float16, causal=True)),
        ("float64", dims(), dict(dtype=np.float64)),
        ("float64_bshd_window", dims(), dict(dtype=np.float64, layout="bshd", window=(1, 1))),
        ("no_lse_no_probs", dims(), dict(want_lse=False, want_probs=False)),
        ("lse_only", dims(), dict(want_probs=False)),
        ("probs_only", dims(), dict(want_lse=False)),
    ]
    # masks: bool and additive, every rank, broadcast axes
    for dt in (np.bool_, np.float32, np.float64):
        for r, pick in ((1, lambda d: (d["Sk"],)), (2, lambda d: (d["Sq"], d["Sk"])), (2, lambda d: (1, d["Sk"])),
                        (3, lambda d: (d["Hq"], 1, d["Sk"])), (4, lambda d: (d["B"], 1, d["Sq"], d["Sk"])),
                        (4, lambda d: (1, d["Hq"], d["Sq"], 1))):
            d = dims()
            shape = pick(d)
            m = bool_mask(shape) if dt == np.bool_ else float_mask(shape, dt)
            tag = "x".join(str(x) for x in shape)
            cases.append((f"mask_{np.dtype(dt).name}_r{r}_{tag}", d, dict(mask=m)))
    # kv_lens, int32 and int64, with and without causal and windows, both alignments
    for dt in (np.int32, np.int64):
        d = dims(B=3, Sq=4, Sk=9)
        lens = np.array([9, 0, 5], dtype=dt)
        cases.append((f"kv_lens_{np.dtype(dt).name}", d, dict(kv_lens=lens)))
        cases.append((f"kv_lens_{np.dtype(dt).name}_causal", dims(B=3, Sq=4, Sk=9), dict(kv_lens=lens, causal=True)))
        cases.append((f"kv_lens_{np.dtype(dt).name}_top_left", dims(B=3, Sq=4, Sk=9),
                      dict(kv_lens=lens, causal=True, align="top-left")))
        cases.append((f"kv_lens_{np.dtype(dt).name}_window", dims(B=3, Sq=4, Sk=9), dict(kv_lens=lens, window=(1, 0))))
    # everything at once
    d = dims(B=2, Hq=4, Hkv=2, Sq=6, Sk=10)
    cases.append(("everything", d, dict(layout="bshd", scale=0.7, causal=True, align="bottom-right", window=(3, 2),
                                        mask=float_mask((d["Hq"], 1, d["Sk"]), np.float32),
                                        kv_lens=np.array([10, 7], dtype=np.int32), softcap=3.0, threads=2,
                                        dtype=np.float16)))
    cases.append(("everything_reference", d, dict(layout="bhsd", scale=0.7, causal=True, align="top-left", window=(2, 2),
                                                  mask=bool_mask((d["Sq"], d["Sk"])),
                                                  kv_lens=np.array([3, 10], dtype=np.int64), softcap=3.0,
                                                  reference=True, dtype=np.float64)))
    for name, d, kw in cases:
        attend_case(name, tmp, rng, **d, **kw)


def nan_isolation(tmp):
    """NaN and inf stored at keys excluded by causal or kv_lens never reach the output."""
    rng = np.random.default_rng(3)
    B, H, Sq, Sk, D = 2, 1, 3, 8, 4
    q = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, H, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, H, Sk, D)).astype(np.float32)
    lens = np.array([5, 8], dtype=np.int32)
    # top-left causal, Sq=3: keys 3.. are never admitted; kv_lens[0]=5: keys 5.. of batch 0 neither
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[:, :, 3:, :] = np.nan
    v_bad[:, :, 3:, :] = np.inf
    paths = {n: os.path.join(tmp, f"nan_{n}.npy") for n in ("q", "k", "v", "kb", "vb", "lens", "o1", "o2")}
    for n, a in (("q", q), ("k", k), ("v", v), ("kb", k_bad), ("vb", v_bad), ("lens", lens)):
        np.save(paths[n], a)
    common = ["attend", "--q", paths["q"], "--causal", "--align", "top-left", "--kv-lens", paths["lens"]]
    rc1, _, e1 = run(common + ["--k", paths["k"], "--v", paths["v"], "--out", paths["o1"]])
    rc2, _, e2 = run(common + ["--k", paths["kb"], "--v", paths["vb"], "--out", paths["o2"]])
    check("nan isolation: runs", rc1 == 0 and rc2 == 0, e1 + e2)
    if rc1 == 0 and rc2 == 0:
        o1, o2 = np.load(paths["o1"]), np.load(paths["o2"])
        check("nan isolation: finite and equal to the clean run", np.all(np.isfinite(o2)) and np.array_equal(o1, o2),
              f"{o2}")


def files_numpy_writes(tmp):
    """Fortran-order and big-endian .npy files (both valid NumPy output) give the same result."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 4, 3)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 3)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    p = {n: os.path.join(tmp, f"disk_{n}.npy") for n in ("q", "k", "v", "o")}
    np.save(p["q"], np.asfortranarray(q))
    np.save(p["k"], k.astype(">f4"))
    np.save(p["v"], np.asfortranarray(v.astype(">f4")))
    rc, _, err = run(["attend", "--q", p["q"], "--k", p["k"], "--v", p["v"], "--out", p["o"], "--causal"])
    check("fortran/big-endian inputs: runs", rc == 0, err)
    if rc == 0:
        want, _, _ = attention_ref(q, k, v, causal=True)
        err_o = np.abs(np.load(p["o"]).astype(np.float64) - want).max()
        check("fortran/big-endian inputs: O", err_o <= O_ATOL, f"max abs err {err_o:.3g}")


# ---- malformed inputs --------------------------------------------------------------------------

def error_cases(tmp):
    rng = np.random.default_rng(7)
    f32 = np.float32
    good = {
        "q": rng.standard_normal((1, 2, 3, 4)).astype(f32),
        "k": rng.standard_normal((1, 2, 5, 4)).astype(f32),
        "v": rng.standard_normal((1, 2, 5, 6)).astype(f32),
    }
    files = {}
    for n, a in good.items():
        files[n] = os.path.join(tmp, f"good_{n}.npy")
        np.save(files[n], a)

    def save(name, a):
        p = os.path.join(tmp, name)
        np.save(p, a)
        return p

    def raw(name, data):
        p = os.path.join(tmp, name)
        with open(p, "wb") as f:
            f.write(data)
        return p

    rank3 = save("rank3.npy", good["q"][0])
    k_badD = save("k_badD.npy", rng.standard_normal((1, 2, 5, 3)).astype(f32))
    v_badSk = save("v_badSk.npy", rng.standard_normal((1, 2, 4, 6)).astype(f32))
    k_3heads = save("k_3heads.npy", rng.standard_normal((1, 3, 5, 4)).astype(f32))
    v_3heads = save("v_3heads.npy", rng.standard_normal((1, 3, 5, 6)).astype(f32))
    k_f16 = save("k_f16.npy", good["k"].astype(np.float16))
    q_int = save("q_int.npy", np.ones((1, 2, 3, 4), dtype=np.int32))
    garbage = raw("garbage.npy", b"this is not an array at all")
    with open(files["q"], "rb") as f:
        qbytes = f.read()
    truncated = raw("truncated.npy", qbytes[:-5])
    huge_hdr = raw("huge_header.npy", b"\x93NUMPY\x02\x00\xff\xff\xff\x7f{")
    lens_big = save("lens_big.npy", np.array([6], dtype=np.int32))
    lens_neg = save("lens_neg.npy", np.array([-1], dtype=np.int64))
    lens_float = save("lens_float.npy", np.array([3.0], dtype=np.float32))
    lens_shape = save("lens_shape.npy", np.array([3, 3], dtype=np.int64))
    mask_bad = save("mask_bad.npy", np.ones((3, 4), dtype=bool))
    mask_int = save("mask_int.npy", np.ones((3, 5), dtype=np.int32))
    mask_rank5 = save("mask_rank5.npy", np.ones((1, 1, 2, 3, 5), dtype=bool))

    base = ["attend", "--q", files["q"], "--k", files["k"], "--v", files["v"]]
    no_dir = os.path.join(tmp, "no", "such", "dir")

    def with_(flag, path):
        a = list(base)
        a[a.index(flag) + 1] = path
        return a

    cases = [
        ("missing q file", with_("--q", os.path.join(tmp, "absent.npy")), "--q"),
        ("missing k file", with_("--k", os.path.join(tmp, "absent.npy")), "--k"),
        ("missing mask file", base + ["--mask", os.path.join(tmp, "absent.npy")], "--mask"),
        ("wrong rank q", with_("--q", rank3), "--q"),
        ("wrong rank v", with_("--v", rank3), "--v"),
        ("k head_dim mismatch", with_("--k", k_badD), "k:"),
        ("k head_dim mismatch, bshd", with_("--k", k_badD) + ["--layout", "bshd"], "--layout bshd"),
        ("v Sk mismatch", with_("--v", v_badSk), "v:"),
        ("Hq % Hkv", with_("--k", k_3heads)[:] , "k:"),
        ("k dtype mismatch", with_("--k", k_f16), "k:"),
        ("q integer dtype", with_("--q", q_int), "q:"),
        ("bad window text no comma", base + ["--window", "3"], "--window"),
        ("bad window text letters", base + ["--window", "a,b"], "--window"),
        ("bad window text three", base + ["--window", "1,2,3"], "--window"),
        ("bad window text empty side", base + ["--window=1,"], "--window"),
        ("bad window text overflow", base + ["--window", "99999999999999999999,1"], "--window"),
        ("window below -1", base + ["--window=-2,0"], "window"),
        ("garbage npy", with_("--q", garbage), "--q"),
        ("truncated npy", with_("--v", truncated), "--v"),
        ("absurd header npy", with_("--k", huge_hdr), "--k"),
        ("bad npy mask", base + ["--mask", garbage], "--mask"),
        ("bad npy kv-lens", base + ["--kv-lens", truncated], "--kv-lens"),
        ("kv-lens above Sk", base + ["--kv-lens", lens_big], "kv_lens"),
        ("kv-lens negative", base + ["--kv-lens", lens_neg], "kv_lens"),
        ("kv-lens float", base + ["--kv-lens", lens_float], "kv_lens"),
        ("kv-lens shape", base + ["--kv-lens", lens_shape], "kv_lens"),
        ("mask not broadcastable", base + ["--mask", mask_bad], "mask"),
        ("mask int dtype", base + ["--mask", mask_int], "mask"),
        ("mask rank 5", base + ["--mask", mask_rank5], "mask"),
        ("bad layout", base + ["--layout", "sbhd"], "--layout"),
        ("bad align", base + ["--align", "middle"], "--align"),
        ("negative threads", base + ["--threads", "-1"], "--threads"),
        ("negative softcap", base + ["--softcap", "-1"], "softcap"),
        ("nan scale", base + ["--scale", "nan"], "scale"),
        ("bad scale text", base + ["--scale", "big"], "--scale"),
        ("unknown flag", base + ["--bogus"], "--bogus"),
    ]
    outputs = lambda tag: [os.path.join(tmp, f"err_{tag}_o.npy"), os.path.join(tmp, f"err_{tag}_l.npy"),
                           os.path.join(tmp, f"err_{tag}_p.npy")]
    runs = []
    for n, (name, args, needle) in enumerate(cases):
        o, l, p = outputs(n)
        runs.append((name, args + ["--out", o, "--lse", l, "--probs", p], needle, [o, l, p]))
    # Hq % Hkv needs matching v
    runs[[r[0] for r in runs].index("Hq % Hkv")][1][base.index("--v") + 1] = v_3heads
    o, l, p = outputs("missing_out")
    runs.append(("missing --out", list(base), "--out", [o, l, p]))
    o, l, p = outputs("unwritable_out")
    runs.append(("unwritable --out dir", base + ["--out", os.path.join(no_dir, "o.npy"), "--lse", l, "--probs", p],
                 os.path.join(no_dir, "o.npy"), [l, p, os.path.join(no_dir, "o.npy")]))
    o, l, p = outputs("unwritable_lse")
    runs.append(("unwritable --lse dir (after --out succeeded)",
                 base + ["--out", o, "--lse", os.path.join(no_dir, "l.npy"), "--probs", p], os.path.join(no_dir, "l.npy"),
                 [o, p]))
    o, l, p = outputs("unwritable_probs")
    runs.append(("unwritable --probs dir (after --out and --lse succeeded)",
                 base + ["--out", o, "--lse", l, "--probs", os.path.join(no_dir, "p.npy")], os.path.join(no_dir, "p.npy"),
                 [o, l]))
    o, l, p = outputs("same_path")
    runs.append(("--lse same path as --out", base + ["--out", o, "--lse", o], "--lse", [o]))
    # A directory as a later output: refused before --out is written, not when renaming into place.
    a_dir = os.path.join(tmp, "a_directory")
    os.makedirs(a_dir, exist_ok=True)
    o, l, p = outputs("dir_lse")
    runs.append(("a directory as --lse (after --out)", base + ["--out", o, "--lse", a_dir, "--probs", p],
                 "--lse: " + a_dir + ": is a directory", [o, p]))
    o, l, p = outputs("dir_probs")
    runs.append(("a directory as --probs (after --out and --lse)", base + ["--out", o, "--lse", l, "--probs", a_dir],
                 "--probs: " + a_dir + ": is a directory", [o, l]))

    for name, args, needle, outs in runs:
        before = set(os.listdir(tmp))
        for x in outs:
            if os.path.exists(x):
                os.remove(x)
        rc, out, err = run(args)
        lines = err.splitlines()
        check(f"error '{name}': exit 2", rc == 2, f"exit {rc}, stderr {err!r}")
        check(f"error '{name}': one stderr line", len(lines) == 1, repr(err))
        check(f"error '{name}': starts with 'qkv: error:'", err.startswith("qkv: error:"), repr(err))
        check(f"error '{name}': names {needle!r}", needle in err, repr(err))
        check(f"error '{name}': no output file", not any(os.path.exists(x) for x in outs),
              str([x for x in outs if os.path.exists(x)]))
        after = set(os.listdir(tmp))
        check(f"error '{name}': no stray file", not [f for f in after - before if ".tmp" in f or ".part" in f],
              str(after - before))
    check("unwritable dir not created", not os.path.exists(os.path.join(tmp, "no")))
    # Files already at the output paths stay as they were when a later output cannot be written.
    o, l, p = outputs("kept")
    for x in (o, l):
        with open(x, "wb") as f:
            f.write(b"OLD")
    before = set(os.listdir(tmp))
    rc, out, err = run(base + ["--out", o, "--lse", l, "--probs", os.path.join(no_dir, "p.npy")])
    check("existing outputs, unwritable --probs: exit 2", rc == 2, f"exit {rc}, stderr {err!r}")
    check("existing outputs, unwritable --probs: the error names --probs", err.startswith("qkv: error: --probs:"), repr(err))
    kept = [open(x, "rb").read() == b"OLD" for x in (o, l)]
    check("existing outputs, unwritable --probs: --out and --lse files unchanged", all(kept), str(kept))
    check("existing outputs, unwritable --probs: no stray file", set(os.listdir(tmp)) == before,
          str(set(os.listdir(tmp)) ^ before))


def demo_and_info():
    rc, out, err = run(["demo"])
    check("demo: exit 0", rc == 0, err)
    ok_lines = [l for l in out.splitlines() if l.startswith("check:")]
    # Two checks of the embedded example, and a third of the model when the bundled model is found.
    check("demo: every check OK", len(ok_lines) >= 2 and all(l.endswith("OK") for l in ok_lines), str(ok_lines))
    check("demo: no MISMATCH", "MISMATCH" not in out)
    sums = [l for l in out.splitlines() if l.startswith("row sums:")]
    check("demo: weights rows sum to 1", len(sums) == 1 and all(abs(float(x) - 1) < 1e-6 for x in sums[0].split()[2:]),
          str(sums))
    for word in ("Q = X W^Q", "K = X W^K", "V = X W^V", "scores", "softmax weights", "output"):
        check(f"demo: prints {word!r}", word in out)
    rc, out, err = run(["info"])
    check("info: exit 0", rc == 0, err)
    check("info: version", out.startswith("qkv "), out[:40])
    check("info: cpu features line", "cpu features:" in out, out)
    check("info: lists the reference kernel", "reference" in out, out)
    # QKV_ISA caps the instruction set of the fast kernels below the CPU's own.
    rc, out, err = run(["info"], env={"QKV_ISA": "scalar"})
    check("info with QKV_ISA=scalar: kernels run scalar code", rc == 0 and "kernel ISA: scalar, capped by QKV_ISA=scalar" in out, out)
    rc, out, err = run(["info"], env={"QKV_ISA": "avx2"})
    check("info with QKV_ISA=avx2: kernels run at most AVX2", rc == 0 and "kernel ISA: " in out and "avx512" not in out.split("kernel ISA:")[1].splitlines()[0], out)
    rc, out, err = run(["demo"], env={"QKV_ISA": "scalar"})
    check("demo with QKV_ISA=scalar: exit 0", rc == 0 and "MISMATCH" not in out, err)
    rc, out, err = run(["--version"])
    check("--version", rc == 0 and out.startswith("qkv "), out + err)
    rc, out, err = run([])
    check("no subcommand: exit 2 with one error line", rc == 2 and err.startswith("qkv: error:") and len(err.splitlines()) == 1,
          repr(err))
    rc, out, err = run(["attend", "--help"])
    flags = ("--q", "--k", "--v", "--out", "--lse", "--probs", "--layout", "--scale", "--causal", "--align",
             "--window", "--mask", "--kv-lens", "--softcap", "--reference", "--threads")
    check("attend --help lists every flag", rc == 0 and all(f in out for f in flags), out)


def self_test():
    """The NumPy definition reproduces the hand-computed values of docs/semantics.md."""
    q = k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    o, lse, _ = attention_ref(q, k, v, mask=np.array([[False, False], [True, True]]))
    check("self: fully masked row", np.allclose(o[0, 0, 0], 0) and lse[0, 0, 0] == -np.inf
          and np.allclose(o[0, 0, 1], [2.3395231, 3.3395231]) and abs(lse[0, 0, 1] - 1.1079403) < 1e-7, f"{o} {lse}")
    z = np.zeros((1, 1, 2, 1))
    vk = np.arange(1.0, 5.0).reshape(1, 1, 4, 1)
    o, _, _ = attention_ref(z, np.zeros((1, 1, 4, 1)), vk, causal=True)
    check("self: bottom-right", np.allclose(o.ravel(), [2, 2.5]), str(o.ravel()))
    o, _, _ = attention_ref(z, np.zeros((1, 1, 4, 1)), vk, causal=True, align="top-left")
    check("self: top-left", np.allclose(o.ravel(), [1, 1.5]), str(o.ravel()))
    o, lse, _ = attention_ref(np.zeros((1, 1, 4, 1)), np.zeros((1, 1, 2, 1)), vk[:, :, :2], causal=True)
    check("self: Sq > Sk", np.allclose(o.ravel(), [0, 0, 1, 1.5]) and np.all(np.isinf(lse.ravel()[:2])), str(o.ravel()))


def main():
    global QKV
    if len(sys.argv) != 2:
        print("usage: test_attend.py <path to qkv>", file=sys.stderr)
        return 2
    QKV = os.path.abspath(sys.argv[1])
    self_test()
    with tempfile.TemporaryDirectory(prefix="qkv_attend_") as tmp:
        random_cases(tmp)
        nan_isolation(tmp)
        files_numpy_writes(tmp)
        error_cases(tmp)
    demo_and_info()
    print(f"python attend: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

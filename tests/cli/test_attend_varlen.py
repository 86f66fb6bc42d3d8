#!/usr/bin/env python3
"""Cross-checks `qkv attend --cu-seqlens-q CQ.npy --cu-seqlens-k CK.npy` (packed sequences) against
the float64 NumPy definition of test_attend.py run sequence by sequence.

Usage: test_attend_varlen.py <path to the qkv binary>

Packed q [total_q,Hq,D], k and v [total_k,Hkv,X] with int32 prefix sums: mixed batches (one token
beside a long sequence, empty sequences), GQA, every option of `attend` that applies (causal in
both alignments, window, softcap, scale, --reference, --threads), softmax_lse [Hq,total_q], the
gradients; malformed inputs give exit status 2, one line on stderr naming the argument, and no
output file. Needs NumPy only.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_attend as ta  # noqa: E402  (attention_ref, the float64 definition)

O_ATOL = 2e-5
LSE_ATOL = 2e-5
GRAD_ATOL = 1e-4
passed = 0
failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name}: {detail}", flush=True)


def run(args):
    r = subprocess.run([QKV] + args, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def ref_packed(q, k, v, lq, lk, **opts):
    """Per sequence: attention_ref on [1,H,S,X] views of the packed arrays. O packed, lse [Hq,total_q]."""
    Hq, Dv = q.shape[1], v.shape[2]
    o = np.zeros((q.shape[0], Hq, Dv))
    lse = np.zeros((Hq, q.shape[0]))
    cq, ck = cu(lq), cu(lk)
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        qs = q[cq[b]:cq[b + 1]].transpose(1, 0, 2)[None]
        ks = k[ck[b]:ck[b + 1]].transpose(1, 0, 2)[None]
        vs = v[ck[b]:ck[b + 1]].transpose(1, 0, 2)[None]
        if lk[b] == 0:
            lse[:, cq[b]:cq[b + 1]] = -np.inf
            continue
        ob, lb, _ = ta.attention_ref(qs, ks, vs, **opts)
        o[cq[b]:cq[b + 1]] = ob[0].transpose(1, 0, 2)
        lse[:, cq[b]:cq[b + 1]] = lb[0]
    return o, lse


def lse_ok(got, want):
    inf = np.isinf(want)
    if not np.array_equal(np.isinf(got), inf):
        return False
    return inf.all() or np.abs(got[~inf] - want[~inf]).max() <= LSE_ATOL


def case(tmp, name, rng, lq, lk, Hq, Hkv, D, flags=(), opts=None, grads=False):
    opts = opts or {}
    q = rng.standard_normal((sum(lq), Hq, D)).astype(np.float32)
    k = rng.standard_normal((sum(lk), Hkv, D)).astype(np.float32)
    v = rng.standard_normal((sum(lk), Hkv, D)).astype(np.float32)
    paths = {n: os.path.join(tmp, f"{name}_{n}.npy") for n in ("q", "k", "v", "cq", "ck", "o", "l", "do", "dq", "dk", "dv")}
    for n, a in (("q", q), ("k", k), ("v", v), ("cq", cu(lq)), ("ck", cu(lk))):
        np.save(paths[n], a)
    args = ["attend", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out", paths["o"],
            "--lse", paths["l"], "--cu-seqlens-q", paths["cq"], "--cu-seqlens-k", paths["ck"], *flags]
    if grads:
        do = rng.standard_normal((sum(lq), Hq, D)).astype(np.float32)
        np.save(paths["do"], do)
        args += ["--grad-out", paths["do"], "--grad-q", paths["dq"], "--grad-k", paths["dk"], "--grad-v", paths["dv"]]
    rc, _, err = run(args)
    check(f"{name}: exit 0", rc == 0, err.strip())
    if rc != 0:
        return
    o, lse = np.load(paths["o"]), np.load(paths["l"])
    ro, rl = ref_packed(q, k, v, lq, lk, **opts)
    check(f"{name}: out shape", o.shape == (sum(lq), Hq, D), str(o.shape))
    check(f"{name}: lse shape [Hq,total_q]", lse.shape == (Hq, sum(lq)), str(lse.shape))
    check(f"{name}: out", np.abs(o - ro).max(initial=0) <= O_ATOL, f"max err {np.abs(o - ro).max(initial=0):.3g}")
    check(f"{name}: lse", lse_ok(lse, rl), "lse differs")
    if grads:
        # Central differences of the float64 definition would be slow; the gradient of
        # L = sum(dO * O) by v is P^T dO per sequence, which the definition gives directly.
        dv = np.load(paths["dv"])
        want = np.zeros_like(dv, dtype=np.float64)
        cq, ck = cu(lq), cu(lk)
        G = Hq // Hkv
        for b in range(len(lq)):
            if lq[b] == 0 or lk[b] == 0:
                continue
            qs = q[cq[b]:cq[b + 1]].transpose(1, 0, 2)[None]
            ks = k[ck[b]:ck[b + 1]].transpose(1, 0, 2)[None]
            vs = v[ck[b]:ck[b + 1]].transpose(1, 0, 2)[None]
            _, _, p = ta.attention_ref(qs, ks, vs, **opts)
            dos = do[cq[b]:cq[b + 1]].transpose(1, 0, 2).astype(np.float64)
            g = np.einsum("hqk,hqd->hkd", p[0], dos)  # [Hq, Sk, D]
            want[ck[b]:ck[b + 1]] = g.reshape(Hkv, G, lk[b], D).sum(axis=1).transpose(1, 0, 2)
        check(f"{name}: grad v", np.abs(dv - want).max(initial=0) <= GRAD_ATOL, f"max err {np.abs(dv - want).max(initial=0):.3g}")
        check(f"{name}: grad q, k written", os.path.exists(paths["dq"]) and os.path.exists(paths["dk"]))


def error_case(tmp, name, args, needle):
    out = os.path.join(tmp, f"err_{name}.npy")
    rc, _, err = run(args + ["--out", out])
    lines = err.strip().splitlines()
    check(f"error {name}: status 2", rc == 2, f"rc {rc}")
    check(f"error {name}: one line naming the argument", len(lines) == 1 and lines[0].startswith("qkv: error:")
          and needle in lines[0], err.strip())
    check(f"error {name}: no output", not os.path.exists(out))


def main():
    global QKV
    if len(sys.argv) != 2:
        print("usage: test_attend_varlen.py <path to qkv>", file=sys.stderr)
        return 2
    QKV = os.path.abspath(sys.argv[1])
    rng = np.random.default_rng(19)
    with tempfile.TemporaryDirectory(prefix="qkv_varlen_") as tmp:
        mixed_q, mixed_k = [1, 0, 60, 13, 3], [200, 5, 60, 130, 0]
        case(tmp, "plain", rng, mixed_q, mixed_k, 4, 4, 64)
        case(tmp, "causal gqa", rng, mixed_q, mixed_k, 8, 2, 64, ["--causal"], {"causal": True})
        case(tmp, "causal top-left", rng, mixed_q, mixed_k, 9, 3, 32, ["--causal", "--align", "top-left"],
             {"causal": True, "align": "top-left"})
        case(tmp, "window softcap scale", rng, mixed_q, mixed_k, 6, 3, 48,
             ["--window", "20,3", "--softcap", "3", "--scale", "0.2", "--threads", "2"],
             {"window": (20, 3), "softcap": 3.0, "scale": 0.2})
        case(tmp, "reference", rng, mixed_q, mixed_k, 4, 2, 16, ["--causal", "--reference"], {"causal": True})
        case(tmp, "grads", rng, [5, 0, 9], [7, 3, 9], 4, 2, 16, ["--causal"], {"causal": True}, grads=True)

        q = os.path.join(tmp, "e_q.npy"); k = os.path.join(tmp, "e_k.npy"); c = os.path.join(tmp, "e_c.npy")
        c64 = os.path.join(tmp, "e_c64.npy"); q4 = os.path.join(tmp, "e_q4.npy")
        np.save(q, np.zeros((5, 2, 8), np.float32)); np.save(k, np.zeros((5, 2, 8), np.float32))
        np.save(c, cu([2, 3])); np.save(c64, cu([2, 3]).astype(np.int64)); np.save(q4, np.zeros((1, 5, 2, 8), np.float32))
        base = ["attend", "--k", k, "--v", k]
        error_case(tmp, "one cu", base + ["--q", q, "--cu-seqlens-q", c], "--cu-seqlens-k")
        error_case(tmp, "int64 cu", base + ["--q", q, "--cu-seqlens-q", c64, "--cu-seqlens-k", c], "cu_seqlens_q: expected dtype int32")
        error_case(tmp, "4-D packed", base + ["--q", q4, "--cu-seqlens-q", c, "--cu-seqlens-k", c], "--q: expected a packed 3-D array")
        error_case(tmp, "3-D without cu", base + ["--q", q], "--cu-seqlens-q and --cu-seqlens-k")
        error_case(tmp, "bshd", base + ["--q", q, "--cu-seqlens-q", c, "--cu-seqlens-k", c, "--layout", "bshd"], "--layout")
        error_case(tmp, "bhsd", base + ["--q", q, "--cu-seqlens-q", c, "--cu-seqlens-k", c, "--layout", "bhsd"], "--layout")
        bad = os.path.join(tmp, "e_bad.npy")
        np.save(bad, np.array([0, 2, 4], np.int32))
        error_case(tmp, "sum", base + ["--q", q, "--cu-seqlens-q", bad, "--cu-seqlens-k", c], "cu_seqlens_q: expected the last entry == total_q (5), got 4")
    print(f"python attend varlen: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`mpirun -np P qkv attend --distributed ...` writes the same files as `qkv attend
--simulate-ranks P ...` (the same schedule in one process), byte for byte, and values close to a
plain `qkv attend`; with P = 1 and no causal, window, mask or key lengths the forward files equal
plain `attend`'s (one block, whole tiles of rows: the same kernel calls row for row). Also
--decode, the score options (--sinks with --grad-sinks, --alibi-slopes, --keep-first), --bench,
and a bad input (one error line, exit status non-zero, no output file).

Usage: test_attend_distributed.py <qkv binary> <mpirun>
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

QKV, MPIRUN = sys.argv[1], sys.argv[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_rmaps_base_oversubscribe="1")
failures = []


def run(args, np_=None, check=True):
    cmd = ([MPIRUN, "--oversubscribe", "-np", str(np_)] if np_ else []) + [QKV] + args
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def expect(ok, what):
    if not ok:
        failures.append(what)
        print("FAILED:", what)


def case(tmp, name, rng, *, B, Hq, Hkv, Sq, Sk, D, Dv, layout="bhsd", flags=(), grads=False, mask=None, lens=None,
         ranks=(1, 2, 3), same_as_plain_at_1=False, sinks=False, slopes=None):
    d = pathlib.Path(tmp) / name
    d.mkdir()
    shp = (lambda b, h, s, x: (b, s, h, x)) if layout == "bshd" else (lambda b, h, s, x: (b, h, s, x))
    files = {"q": rng.standard_normal(shp(B, Hq, Sq, D)), "k": rng.standard_normal(shp(B, Hkv, Sk, D)),
             "v": rng.standard_normal(shp(B, Hkv, Sk, Dv)), "do": rng.standard_normal(shp(B, Hq, Sq, Dv))}
    for n, a in files.items():
        np.save(d / f"{n}.npy", a.astype(np.float32))
    args = ["attend", "--q", str(d / "q.npy"), "--k", str(d / "k.npy"), "--v", str(d / "v.npy"), "--layout", layout,
            *flags]
    if mask is not None:
        np.save(d / "mask.npy", mask)
        args += ["--mask", str(d / "mask.npy")]
    if lens is not None:
        np.save(d / "lens.npy", np.array(lens, dtype=np.int64))
        args += ["--kv-lens", str(d / "lens.npy")]
    if sinks:
        np.save(d / "z.npy", rng.uniform(-1, 4, Hq).astype(np.float32))
        args += ["--sinks", str(d / "z.npy")]
    if slopes is not None:
        np.save(d / "slopes.npy", np.asarray(slopes, dtype=np.float32))
        args += ["--alibi-slopes", str(d / "slopes.npy")]
    outs = ["out", "lse"] + (["dq", "dk", "dv"] if grads else []) + (["dz"] if grads and sinks else [])

    def outargs(tag):
        a = ["--out", str(d / f"out.{tag}.npy"), "--lse", str(d / f"lse.{tag}.npy")]
        if grads:
            a += ["--grad-out", str(d / "do.npy"), "--grad-q", str(d / f"dq.{tag}.npy"), "--grad-k",
                  str(d / f"dk.{tag}.npy"), "--grad-v", str(d / f"dv.{tag}.npy")]
            if sinks:
                a += ["--grad-sinks", str(d / f"dz.{tag}.npy")]
        return a

    run(args + outargs("single"))
    for P in ranks:
        run(args + outargs(f"sim{P}") + ["--simulate-ranks", str(P)])
        run(args + outargs(f"mpi{P}") + ["--distributed"], np_=P)
        for o in outs:
            mpi = (d / f"{o}.mpi{P}.npy").read_bytes()
            expect(mpi == (d / f"{o}.sim{P}.npy").read_bytes(), f"{name} P={P}: {o} file = --simulate-ranks {P}'s")
            a, b = np.load(d / f"{o}.mpi{P}.npy"), np.load(d / f"{o}.single.npy")
            fin = np.isfinite(b)
            expect(np.array_equal(np.isfinite(a), fin) and np.allclose(a[fin], b[fin], rtol=1e-4, atol=2e-5),
                   f"{name} P={P}: {o} close to plain attend (max diff {np.max(np.abs(a[fin] - b[fin])) if fin.any() else 0})")
            if P == 1 and same_as_plain_at_1 and o in ("out", "lse"):
                expect(mpi == (d / f"{o}.single.npy").read_bytes(), f"{name} P=1: {o} file = plain attend's")
    print(f"{name}: ok")


def main():
    rng = np.random.default_rng(21)
    with tempfile.TemporaryDirectory() as tmp:
        case(tmp, "gqa_grads", rng, B=2, Hq=4, Hkv=2, Sq=37, Sk=37, D=8, Dv=8, grads=True, same_as_plain_at_1=True)
        m = rng.random((1, 1, 29, 35)) < 0.85
        m[..., 4, :] = False  # an empty row
        case(tmp, "causal_bshd_window_mask_lens", rng, B=2, Hq=2, Hkv=1, Sq=29, Sk=35, D=8, Dv=5, layout="bshd",
             flags=["--causal", "--window", "6,0", "--softcap", "3"], mask=m, lens=[35, 20], grads=True)
        case(tmp, "top_left_zigzag_forced", rng, B=1, Hq=2, Hkv=2, Sq=40, Sk=23, D=8, Dv=8,
             flags=["--causal", "--align", "top-left", "--placement", "zigzag", "--tile-rows", "7"], ranks=(2, 4))
        case(tmp, "sinks_alibi_keep_first_grads", rng, B=2, Hq=4, Hkv=2, Sq=31, Sk=38, D=8, Dv=6,
             flags=["--causal", "--window", "5,0", "--keep-first", "4", "--softcap", "4"], lens=[38, 21], grads=True,
             sinks=True, slopes=rng.uniform(-0.3, 0.5, (2, 4)))
        case(tmp, "decode_sinks_alibi", rng, B=1, Hq=2, Hkv=1, Sq=2, Sk=33, D=8, Dv=8,
             flags=["--decode", "--keep-first", "3", "--window", "7,0"], ranks=(2, 3), sinks=True, slopes=[0.5, 0.25])
        case(tmp, "decode", rng, B=2, Hq=4, Hkv=1, Sq=1, Sk=45, D=8, Dv=8, flags=["--decode", "--causal"],
             ranks=(2, 3))

        # --bench: one JSON line from rank 0.
        d = pathlib.Path(tmp) / "gqa_grads"
        r = run(["attend", "--q", str(d / "q.npy"), "--k", str(d / "k.npy"), "--v", str(d / "v.npy"), "--out",
                 str(d / "bench_out.npy"), "--distributed", "--bench", "3"], np_=2)
        rec = json.loads(r.stdout.strip().splitlines()[-1])
        expect(rec["ranks"] == 2 and rec["runs"] == 3 and rec["seconds_median"] > 0, f"--bench prints its record: {rec}")

        # A missing input: every rank refuses, one error line, exit status non-zero, nothing written.
        bad = d / "bad_out.npy"
        r = run(["attend", "--q", str(d / "missing.npy"), "--k", str(d / "k.npy"), "--v", str(d / "v.npy"), "--out",
                 str(bad), "--distributed"], np_=2, check=False)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("qkv: error:")]
        expect(r.returncode != 0 and len(lines) == 1 and "--q" in lines[0] and not bad.exists(),
               f"a missing file: one error line naming --q (got {r.returncode}, {lines})")
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()

"""python -m qkv.bench: qkv's Python API against PyTorch's CPU scaled_dot_product_attention on the
same tensors, in one run. Prints medians (milliseconds, or microseconds for the call overhead) and
the ratio torch / qkv (> 1: qkv is faster) as a Markdown table.

Shapes: B = 1, H = 8, D in {64, 128}, S in {1024, 4096}, causal and not, float32 and bfloat16,
forward and forward + backward; decode (Sq = 1, Sk = 32768, Hq = 8, Hkv in {8, 2}) against
PyTorch's best of enable_gqa=True and K/V repeated to Hq heads beforehand; the call overhead at
B = H = S = 1, D = 8: qkv.attention against F.scaled_dot_product_attention from NumPy arrays,
from PyTorch tensors without autograd, and from tensors that require grad (the forward alone,
the graph recorded; forward + backward), timed as the calling thread's CPU time (the rest is
wall time). Both libraries use the same threads (torch.get_num_threads(), OpenMP's default for
qkv). Options: --quick (S = 1024 only, fewer repeats), --repeats N, --overhead (the call-overhead
rows only), --json FILE, --transformers (Hugging Face transformers models with
attn_implementation "qkv", "sdpa" and "eager" instead: qkv/_bench_transformers.py).
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt


def median_time(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(fn_qkv, fn_torch, repeats, clock=time.perf_counter):
    """Runs the two alternately (qkv, torch, qkv, torch, ...) so that both see the same load on a
    shared machine; returns their medians and the median of the per-pair ratios torch / qkv."""
    fn_qkv()
    fn_torch()
    tq, tt = [], []
    for _ in range(repeats):
        for fn, out in ((fn_qkv, tq), (fn_torch, tt)):
            t0 = clock()
            fn()
            out.append(clock() - t0)
    return statistics.median(tq), statistics.median(tt), statistics.median(b / a for a, b in zip(tq, tt))


def fwd_bwd(attn, q, k, v, do):
    def run():
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        attn(qq, kk, vv).backward(do)
    return run


def sdpa_rows(row, reps, seqs, g):
    """Forward and forward + backward at B = 1, H = 8, against F.scaled_dot_product_attention."""
    for dtype in (torch.float32, torch.bfloat16):
        dn = "fp32" if dtype == torch.float32 else "bf16"
        for D in (64, 128):
            for S in seqs:
                q, k, v = (torch.randn(1, 8, S, D, generator=g).to(dtype) for _ in range(3))
                for causal in (False, True):
                    shape = f"{dn} D={D} S={S}{' causal' if causal else ''}"
                    with torch.no_grad():
                        row("forward", shape, paired(lambda: qkv.attention(q, k, v, causal=causal),
                                                     lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                     reps))
                    if dtype == torch.float32 or D == 128:
                        do = torch.randn(1, 8, S, D, generator=g).to(dtype)
                        row("forward+backward", shape, paired(
                            fwd_bwd(lambda a, b, c: qt.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, do),
                            fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, do),
                            reps))


def decode_rows(row, reps, g):
    """One query over Sk = 32768 keys, against the faster of PyTorch's two ways to run GQA."""
    for dtype in (torch.float32, torch.bfloat16):
        dn = "fp32" if dtype == torch.float32 else "bf16"
        for Hkv in (8, 2):
            Sk, D = 32768, 128
            q = torch.randn(1, 8, 1, D, generator=g).to(dtype)
            k, v = (torch.randn(1, Hkv, Sk, D, generator=g).to(dtype) for _ in range(2))
            kr, vr = k.repeat_interleave(8 // Hkv, 1), v.repeat_interleave(8 // Hkv, 1)
            with torch.no_grad():
                t_gqa = median_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=Hkv != 8), reps * 2)
                t_rep = median_time(lambda: F.scaled_dot_product_attention(q, kr, vr), reps * 2)
                best = (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=Hkv != 8)) if t_gqa <= t_rep else \
                    (lambda: F.scaled_dot_product_attention(q, kr, vr))
                row("decode", f"{dn} Hq=8 Hkv={Hkv} Sk={Sk} D={D} (torch: {'enable_gqa' if t_gqa <= t_rep else 'K/V repeated'})",
                    paired(lambda: qkv.attention(q, k, v), best, reps * 4))


def call_overhead(row, reps):
    """One call at B = H = S = 1, D = 8, where the time is the call's own: microseconds per call
    (loops of 1000 calls), qkv.attention against F.scaled_dot_product_attention. Timed as the CPU
    time of the calling thread, which does all of this work (neither library starts a thread team
    at this size), so other processes on a shared machine change it little."""
    q = torch.randn(1, 1, 1, 8)
    qn = q.numpy()
    qg = q.clone().requires_grad_()
    do = torch.randn(1, 1, 1, 8)

    def per_call(fn_qkv, fn_torch):
        def loop(fn):
            return lambda: [fn() for _ in range(1000)]
        t_qkv, t_torch, ratio = paired(loop(fn_qkv), loop(fn_torch), reps, time.thread_time)
        return t_qkv / 1000, t_torch / 1000, ratio

    shape = "B=H=S=1 D=8"
    with torch.no_grad():
        sdpa = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
        row("call overhead", f"numpy {shape}", per_call(lambda: qkv.attention(qn, qn, qn), sdpa), "us")
        row("call overhead", f"torch.Tensor {shape}", per_call(lambda: qkv.attention(q, q, q), sdpa), "us")
    row("call overhead", f"torch.Tensor requires_grad {shape}",
        per_call(lambda: qkv.attention(qg, qg, qg), lambda: F.scaled_dot_product_attention(qg, qg, qg)), "us")
    row("call overhead", f"torch.Tensor requires_grad, with backward {shape}",
        per_call(lambda: qkv.attention(qg, qg, qg).backward(do),
                 lambda: F.scaled_dot_product_attention(qg, qg, qg).backward(do)), "us")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m qkv.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--overhead", action="store_true", help="only the call-overhead rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--transformers", action="store_true",
                    help="transformers models: qkv against sdpa and eager (needs transformers)")
    args = ap.parse_args(argv)
    if args.transformers:
        from . import _bench_transformers
        rows = _bench_transformers.run(quick=args.quick, repeats=args.repeats if args.repeats != 5 else 3)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    reps = 3 if args.quick else args.repeats
    seqs = (1024,) if args.quick else (1024, 4096)
    rows = []

    def row(kind, shape, timing, unit="ms"):
        t_qkv, t_torch, ratio = timing
        scale = 1e6 if unit == "us" else 1e3
        rows.append({"kind": kind, "shape": shape, "unit": unit, "qkv": t_qkv * scale, "torch": t_torch * scale,
                     "ratio": ratio})
        r = rows[-1]
        print(f"| {kind} | {shape} | {r['qkv']:.3f} | {r['torch']:.3f} | {r['ratio']:.2f} |", flush=True)

    print(f"qkv {qkv.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "medians of {reps} alternating runs; ratio = median of torch / qkv per pair".replace("{reps}", str(reps)))
    print("\n| what | shape | qkv | torch | ratio |\n| --- | --- | --- | --- | --- |")
    if not args.overhead:
        g = torch.Generator().manual_seed(0)
        sdpa_rows(row, reps, seqs, g)
        decode_rows(row, reps, g)
    call_overhead(row, 5 if args.quick else 15)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

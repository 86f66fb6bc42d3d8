#!/usr/bin/env python3
"""The cost model of ring attention (docs/distributed.md): predicted time and efficiency of one
forward pass at P ranks for sequence length S, as a Markdown table.

Per ring step each rank computes its queries against one K/V shard while the next shard travels:
    n        = S / P                              positions per rank
    compute  = f * Hq * n^2 / R                   f = 1 (full), 1/2 (causal, zigzag placement)
    transfer = alpha + B * Hkv * n * (D + Dv) * e / beta
    step     = compute + transfer - h * min(compute, transfer)
               h = the fraction of the transfer hidden behind the compute: 1 (default) gives
               max(compute, transfer), 0 gives no overlap at all (--hidden)
    time     = (P - 1) * step + compute           (the last step sends nothing)
    ideal    = P * compute                        (the same work with free communication)
    efficiency = ideal / time
R is the rate of one rank in (query, key, query head) pairs per second: the per-thread tile rate
measured by tests/dist/measure_dist.cpp times the threads of a rank (assumed to scale linearly).

Usage: scripts/dist_cost_model.py [--rate 3.6e8] [--threads 32] [--latency 5e-6] [--gbits 100]
       [--heads 32] [--kv-heads 8] [--dim 128] [--elem-bytes 2] [--causal] [--batch 1] [--hidden 1]
"""
import argparse


def predict(S, P, a):
    n = S / P
    f = 0.5 if a.causal else 1.0
    R = a.rate * a.threads
    compute = f * a.heads * n * n / R
    transfer = a.latency + a.batch * a.kv_heads * n * 2 * a.dim * a.elem_bytes / (a.gbits * 1e9 / 8)
    step = compute + transfer - a.hidden * min(compute, transfer)
    time = (P - 1) * step + compute
    ideal = P * compute
    # Memory per rank: q, out (Hq), K/V held and the second buffer (2 x Hkv), elements of e bytes;
    # the fp32 accumulators of out and softmax_lse.
    mem = a.batch * n * (a.heads * a.dim * a.elem_bytes * 2 + 2 * a.kv_heads * 2 * a.dim * a.elem_bytes
                         + a.heads * (a.dim + 1) * 4)
    return time * a.batch, ideal / time, compute, transfer, mem


def fmt_time(t):
    if t >= 3600:
        return f"{t / 3600:.1f} h"
    if t >= 60:
        return f"{t / 60:.1f} min"
    if t >= 1:
        return f"{t:.1f} s"
    return f"{t * 1e3:.0f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=3.6e8, help="pairs/s of one thread (measured, D = 128)")
    ap.add_argument("--threads", type=int, default=32, help="threads per rank")
    ap.add_argument("--latency", type=float, default=5e-6, help="link latency alpha, seconds")
    ap.add_argument("--gbits", type=float, default=100.0, help="link bandwidth beta, Gbit/s")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128, help="D = Dv")
    ap.add_argument("--elem-bytes", type=int, default=2, help="bytes per K/V element (2: bfloat16)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", action="store_true", help="causal mask, zigzag placement")
    ap.add_argument("--hidden", type=float, default=1.0, help="fraction of each transfer hidden by compute (0..1)")
    a = ap.parse_args()
    ranks = [8, 16, 32, 64, 128, 256, 512, 1024]
    lengths = [128 * 1024, 512 * 1024, 2 * 1024 * 1024, 10 * 1000 * 1000]
    print(f"{'causal, zigzag' if a.causal else 'non-causal, contiguous'}; Hq = {a.heads}, Hkv = {a.kv_heads}, "
          f"D = Dv = {a.dim}, {a.elem_bytes}-byte K/V, B = {a.batch}; R = {a.rate:.3g} pairs/s x {a.threads} threads; "
          f"alpha = {a.latency * 1e6:g} us, beta = {a.gbits:g} Gbit/s, hidden h = {a.hidden:g}. "
          "Cells: time of one forward (efficiency).\n")
    print("| S \\ P | " + " | ".join(str(p) for p in ranks) + " |")
    print("|---" * (len(ranks) + 1) + "|")
    for S in lengths:
        cells = []
        for P in ranks:
            t, eff, _, _, mem = predict(S, P, a)
            cells.append(f"{fmt_time(t)} ({100 * eff:.0f}%)")
        label = {128 * 1024: "128k", 512 * 1024: "512k", 2 * 1024 * 1024: "2M"}.get(S, "10M")
        print(f"| {label} | " + " | ".join(cells) + " |")
    # Where communication stops hiding: compute = transfer.
    f = 0.5 if a.causal else 1.0
    R = a.rate * a.threads
    bytes_per_pos = a.batch * a.kv_heads * 2 * a.dim * a.elem_bytes
    n_star = bytes_per_pos / (a.gbits * 1e9 / 8) * R / (f * a.heads)
    print(f"\nTransfers hide behind compute when n = S/P >= {n_star:,.0f} positions per rank "
          f"(latency aside): compute grows as n^2, transfers as n.")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the CPU beside qkv, forward and forward + backward.

Times torch.nn.functional.scaled_dot_product_attention on the CPU: the forward alone (under
torch.no_grad()) and the forward followed by the backward (out.backward(dO), q, k, v requiring
gradients), for B = 1, H = 8, D in {64, 128}, S = Sq = Sk in {1024, 4096}, causal and not, float32
and bfloat16: the median of --repeats timed runs after --warmup runs, each shape on
--threads threads (torch.set_num_threads, default 2).

With --qkv PATH (the qkv binary), runs `qkv bench --shapes forward --backward --json -` on the
same shapes, threads and dtypes in the same run and prints both side by side, with the ratio
qkv/torch of the speeds (torch seconds / qkv seconds: > 1 means qkv is faster) for the forward
and for forward + backward. qkv's forward + backward time is the forward row's seconds plus the
backward row's (qkv times them as two calls; torch's backward reuses what its forward saved).

GFLOP/s count 4 * B * H * D * (unmasked score pairs) for the forward and 2.5 times that for the
backward (FlashAttention's convention), as `qkv bench` does.

dtypes: torch runs q, k, v, out, dO and the gradients in the dtype; qkv's bfloat16 forward writes
a float32 output and its backward bfloat16 gradients. Causal: torch's is_causal is the top-left
diagonal, qkv's the bottom-right one; they are the same mask for these square shapes.

`qkv bench --report` runs a copy of this script embedded in the qkv binary (python3 -c, with
--json) for the report's PyTorch rows; when torch cannot be imported the script exits with status
3 and the JSON file says why.

Not a test (torch is not a test dependency). Usage (see docs/performance.md):
    pip install torch==2.13.0
    python3 bench/torch_sdpa.py --qkv build/qkv
    python3 bench/torch_sdpa.py --seqlens 1024 --head-dims 128 --dtype f32 --repeats 3
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

# Exit status when torch cannot be imported (with --json, the file says why).
NOT_IMPORTABLE = 3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qkv", metavar="PATH", help="the qkv binary: also run `qkv bench` on the same shapes")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and for qkv (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per shape; the median is shown (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before them (default 1)")
    p.add_argument("--head-dims", default="64,128", help="comma-separated D (default 64,128)")
    p.add_argument("--seqlens", default="1024,4096", help="comma-separated S = Sq = Sk (default 1024,4096)")
    p.add_argument("--heads", type=int, default=8, help="H (default 8; B is 1)")
    p.add_argument("--dtype", choices=["all", "f32", "bf16"], default="all")
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    return p.parse_args(argv)


def ints(text):
    return [int(x) for x in text.split(",") if x]


def unmasked_pairs(s, causal):
    return s * (s + 1) // 2 if causal else s * s


def forward_flops(h, s, d, causal):
    return 4.0 * h * d * unmasked_pairs(s, causal)


def median_time(fn, repeats, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def backend_name(torch, q, causal):
    """The fused kernel scaled_dot_product_attention picks for these inputs (a private but
    long-standing function; 'unknown' where it is missing)."""
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, causal)).name
    except Exception:  # noqa: BLE001 - only a label
        return "unknown"


def time_torch(torch, h, s, d, dtype, causal, repeats, warmup):
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(42)
    # Uniform in [-1, 1] as qkv bench's inputs.
    q, k, v, do = (torch.rand(1, h, s, d, generator=g).mul_(2).sub_(1).to(dtype) for _ in range(4))

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def forward_backward():
        qg.grad = kg.grad = vg.grad = None
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        out.backward(do)

    return {
        "backend": backend_name(torch, q, causal),
        "forward_seconds": median_time(forward, repeats, warmup),
        "forward_backward_seconds": median_time(forward_backward, repeats, warmup),
    }


def run_qkv(args, dtypes):
    cmd = [args.qkv, "bench", "--shapes", "forward", "--backward", "--json", "-", "--no-baseline",
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--head-dims", args.head_dims,
           "--seqlens", args.seqlens, "--causal", args.causal,
           "--dtype", dtypes[0] if len(dtypes) == 1 else "all"]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    # Its table goes to stderr as it runs; the JSON comes back on stdout.
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"qkv bench failed with exit status {r.returncode}")
    doc = json.loads(r.stdout)
    rows = {}
    for row in doc["rows"]:
        if row["kind"] not in ("forward", "backward") or row["shape"]["Hq"] != args.heads:
            continue
        key = (row["shape"]["D"], row["shape"]["Sq"], row["causal"], row["dtype"])
        rows.setdefault(key, {})[row["kind"]] = row
    return doc, rows


def main(argv):
    args = parse_args(argv)
    dtypes = {"all": ["f32", "bf16"], "f32": ["f32"], "bf16": ["bf16"]}[args.dtype]
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    if args.qkv and args.heads != 8:
        sys.exit("--qkv: qkv bench runs H = 8 only")
    # qkv first, in its own process, before torch is loaded: the two never hold threads at once.
    # (On a machine shared with other work, compare ratios from runs on a quiet machine only.)
    qkv_doc, qkv_rows = run_qkv(args, dtypes) if args.qkv else (None, {})

    try:
        import torch  # here, so that --help works without it
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install (OSError, ...)
        reason = f"torch not importable: {type(e).__name__}: {e}"
        print(reason, file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"error": reason}, f)
        return NOT_IMPORTABLE

    torch.set_num_threads(args.threads)
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}
    long_name = {"f32": "float32", "bf16": "bfloat16"}
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; medians of {args.repeats} runs after {args.warmup} warm-up")
    if qkv_doc:
        print(f"qkv {qkv_doc['qkv_version']}, {qkv_doc['threads']} threads, run first (its own table above, "
              f"on stderr)")
    print("GFLOP/s: forward 4*B*H*D*(unmasked pairs), backward 2.5x that; ratio = torch seconds / qkv seconds "
          "(> 1: qkv faster)")
    head = (f"{'D':>4} {'S':>6} {'causal':>6} {'dtype':>5} {'torch backend':>16} {'torch fwd s':>11} "
            f"{'GFLOP/s':>8} {'torch f+b s':>11} {'GFLOP/s':>8}")
    if args.qkv:
        head += (f" {'qkv fwd s':>10} {'GFLOP/s':>8} {'qkv f+b s':>10} {'GFLOP/s':>8} {'fwd ratio':>9} "
                 f"{'f+b ratio':>9} {'qkv backward kernel':>20}")
    print(head)
    results = []
    for d in ints(args.head_dims):
        for s in ints(args.seqlens):
            for causal in causals:
                for dt in dtypes:
                    t = time_torch(torch, args.heads, s, d, torch_dtype[dt], causal, args.repeats, args.warmup)
                    fwd = forward_flops(args.heads, s, d, causal)
                    res = {"D": d, "S": s, "H": args.heads, "causal": causal, "dtype": long_name[dt],
                           "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(), **t}
                    line = (f"{d:>4} {s:>6} {'yes' if causal else 'no':>6} {dt:>5} {t['backend']:>16} "
                            f"{t['forward_seconds']:>11.4g} {fwd / t['forward_seconds'] * 1e-9:>8.1f} "
                            f"{t['forward_backward_seconds']:>11.4g} "
                            f"{3.5 * fwd / t['forward_backward_seconds'] * 1e-9:>8.1f}")
                    if args.qkv:
                        q = qkv_rows.get((d, s, causal, long_name[dt]), {})
                        qf = q.get("forward", {}).get("seconds")
                        qb = q.get("backward", {}).get("seconds")
                        qfb = qf + qb if qf and qb else None
                        res.update(qkv_forward_seconds=qf, qkv_backward_seconds=qb, qkv_forward_backward_seconds=qfb,
                                   qkv_backward_kernel=q.get("backward", {}).get("kernel"))
                        cell = lambda x, w, f: format(x, f).rjust(w) if x else "-".rjust(w)  # noqa: E731
                        line += (f" {cell(qf, 10, '.4g')} {cell(qf and fwd / qf * 1e-9, 8, '.1f')}"
                                 f" {cell(qfb, 10, '.4g')} {cell(qfb and 3.5 * fwd / qfb * 1e-9, 8, '.1f')}"
                                 f" {cell(qf and t['forward_seconds'] / qf, 9, '.2f')}"
                                 f" {cell(qfb and t['forward_backward_seconds'] / qfb, 9, '.2f')}"
                                 f" {(res['qkv_backward_kernel'] or '-'):>20}")
                    print(line, flush=True)
                    results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch_version": torch.__version__,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "threads": torch.get_num_threads(), "repeats": args.repeats, "warmup": args.warmup,
                       "rows": results, "qkv": qkv_doc}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

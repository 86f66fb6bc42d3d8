#!/usr/bin/env python3
"""Smoke test of `qkv bench`: a tiny grid with --json, forward, decode and backward rows, option
rows (--sinks, --alibi, --keep-first), and `--report --quick`; checks the outputs' structure only (timings are not asserted: they depend on
the machine and its load)."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

ROW_FIELDS = ["shape", "causal", "dtype", "kernel", "seconds", "gflops", "gbps",
              "baseline_seconds", "peak_fraction"]
SHAPE_FIELDS = ["B", "Hq", "Hkv", "Sq", "Sk", "D"]

# --report --quick: its sections, in order, and the rows of each table.
REPORT_SECTIONS = ["# qkv performance report", "## Machine", "## Bounds (", "## Rows", "### Forward", "### Backward",
                   "### Decode", "### Serving", "### Quantized KV decode", "### PyTorch SDPA",
                   "## How each figure is measured"]
REPORT_ROWS = {"Forward": 4, "Backward": 4, "Decode": 4, "Serving": 3, "Quantized KV decode": 12, "PyTorch SDPA": 8}
REPORT_COLUMNS = ["row", "dtype", "kernel", "time", "rate", "bound", "of bound", "of SGEMM", "x naive BLAS",
                  "x PyTorch", "note"]


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def check_report(md, check, torch_available):
    """The sections of a --report file, and every table row with all its columns; PyTorch's rows
    measured when torch can be imported, else saying why not."""
    at = [md.find("\n" + h) if i else md.find(h) for i, h in enumerate(REPORT_SECTIONS)]
    check(all(a >= 0 for a in at) and at == sorted(at), f"report sections {list(zip(REPORT_SECTIONS, at))}")
    for key in ("| CPU |", "| logical CPUs |", "| caches (cpu0) |", "| ISA level qkv uses |", "| qkv | ",
                "| fp32 FMA peak", "| DRAM read (a ", "| OpenBLAS SGEMM, n = "):
        check(key in md, f"report lacks {key!r}")
    check(", commit " in md, "report without a commit")
    sections = md.split("\n### ")[1:]
    for sec in sections:
        title = sec.split("\n", 1)[0]
        lines = [ln for ln in sec.split("\n## ")[0].split("\n") if ln.startswith("|")]
        check(len(lines) >= 2 and cells(lines[0]) == REPORT_COLUMNS, f"{title}: header {lines[:1]}")
        rows = [cells(ln) for ln in lines[2:]]
        check(len(rows) == REPORT_ROWS.get(title, -1), f"{title}: {len(rows)} rows")
        for r in rows:
            check(len(r) == len(REPORT_COLUMNS) and all(r), f"{title}: row {r}")
            if len(r) != len(REPORT_COLUMNS):
                continue
            row = dict(zip(REPORT_COLUMNS, r))
            if title == "PyTorch SDPA":
                check((row["time"] != "-") == torch_available, f"PyTorch row, torch importable: {torch_available}: {r}")
            if title == "PyTorch SDPA" and row["time"] == "-":
                # torch not importable: the row says why.
                check("torch not importable" in row["note"], f"PyTorch row without a reason: {r}")
                continue
            check(row["time"].endswith(("s", "ms", "us")) and row["rate"].endswith(("GFLOP/s", "GB/s")), f"{title}: {r}")
            check(row["of bound"].endswith(("%", "%)")), f"{title}: of bound {r}")
            memory = row["rate"].endswith("GB/s")
            check(row["bound"] == "DRAM" if memory else row["bound"] in ("FMA", "bf16 dot", "AMX"), f"{title}: bound {r}")
            check((row["of SGEMM"] == "-") == memory, f"{title}: of SGEMM {r}")
            if title in ("Forward", "Backward", "Decode"):
                check(row["x naive BLAS"] != "-", f"{title}: no naive baseline {r}")


def main() -> int:
    qkv = sys.argv[1]
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        env = dict(os.environ)
        # The bench must drop these itself (OpenBLAS reads them at load time).
        env["OPENBLAS_CORETYPE"] = "Haswell"
        env["OPENBLAS_L2_SIZE"] = "512"
        env.pop("QKV_BENCH_BLAS_ENV", None)
        cmd = [qkv, "bench", "--quick", "--seqlens", "64", "--decode-seqlens", "256", "--repeats", "1",
               "--min-time", "0", "--adjacent-seconds", "0.02", "--peak-seconds", "0.03", "--read-mib", "32", "--scaling", "--scaling-seqlen", "64", "--memory",
               "--memory-seqlen", "128", "--backward", "--json", path, "--markdown", path + ".md"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        check(r.returncode == 0, f"exit status {r.returncode}, stderr: {r.stderr}")
        check("openblas core:" in r.stdout, "no 'openblas core:' line in the table")
        check("OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset" in r.stdout or "SkylakeX" in r.stdout,
              "OpenBLAS variables were not removed: " + r.stdout[:400])
        doc = json.load(open(path))
        md = open(path + ".md").read()
        check(len(doc.get("kv_read_bandwidth_by_size", [])) >= 1, "no kv_read_bandwidth_by_size")
        check(md.count("\n| forward |") == 4 and md.count("\n| decode (two-stream K/V read ") == 4
              and md.count("\n| backward |") == 4 and md.count("\n| backward-scaling (1 thread ") == 8
              and md.count("\n| backward-memory (peak RSS ") == 1, "markdown rows:\n" + md)
        check("2.5x the forward" in md and "2.5x the forward" in r.stdout, "no note on the backward FLOP count")
        check(doc.get("backward_flops_factor") == 2.5, "backward_flops_factor")
        check(doc["openblas_core"] not in ("", "unknown", "Haswell") or "SkylakeX" in doc["openblas_note"],
              f"openblas core {doc['openblas_core']!r}: the environment's Haswell core was kept")
        for t, p in doc["peaks"].items():
            check(p["fma_gflops"] > 0 and p["read_gbps"] > 0, f"peaks for {t} threads not measured: {p}")
        rows = doc["rows"]
        kinds = {r["kind"] for r in rows}
        check(kinds == {"forward", "decode", "scaling", "memory", "backward", "backward-scaling", "backward-memory"},
              f"row kinds {kinds}")
        # --quick with both dtypes: forward 2 (causal) x 2 (dtype), decode 2 (Hkv) x 2 (dtype);
        # --backward adds backward 2 x 2, scaling 2 (H = 8 and 1) x 2 x 2, one memory row.
        check(sum(r["kind"] == "forward" for r in rows) == 4, "forward row count")
        check(sum(r["kind"] == "decode" for r in rows) == 4, "decode row count")
        check(sum(r["kind"] == "backward" for r in rows) == 4, "backward row count")
        check(sum(r["kind"] == "backward-scaling" for r in rows) == 8, "backward-scaling row count")
        check({r["shape"]["Hq"] for r in rows if r["kind"] == "backward-scaling"} == {1, 8},
              "backward-scaling rows for H = 8 and H = 1")
        for row in rows:
            for f in ROW_FIELDS:
                check(f in row, f"row {row.get('kind')} lacks field {f!r}")
            if any(f not in row for f in ROW_FIELDS):
                continue
            check(sorted(row["shape"]) == sorted(SHAPE_FIELDS), f"shape fields {row['shape']}")
            check(row["dtype"] in ("float32", "bfloat16"), f"dtype {row['dtype']}")
            check(isinstance(row["causal"], bool), "causal not a bool")
            check(row["seconds"] > 0 and math.isfinite(row["gflops"]) and row["gflops"] > 0, f"timing {row}")
            check(row["kernel"] and row["kernel"] != "unknown", f"kernel {row['kernel']!r}")
            check(row.get("repeats") == 1, f"--repeats 1 --min-time 0 gave {row.get('repeats')} timed runs")
            if row["kind"] in ("forward", "decode", "backward"):
                s = row["shape"]
                check(row["baseline_seconds"] is not None and row["baseline_seconds"] > 0, "no baseline")
                # The baseline runs the same values (rounded to bf16 for every dtype): outputs agree
                # (backward: dQ, in bfloat16 for the bfloat16 rows).
                tol = 2e-2 if row["kind"] == "backward" and row["dtype"] == "bfloat16" else 1e-3
                check(row["max_abs_diff_vs_baseline"] < tol, f"qkv and baseline differ: {row}")
                check(row["speedup_vs_baseline"] > 0, f"speedup_vs_baseline {row}")
                # FLOPs: 4*B*Hq*D*pairs; causal counts the Sq*(Sq+1)/2 unmasked pairs when Sq == Sk;
                # the backward counts 2.5 times that.
                pairs = s["Sq"] * s["Sk"]
                if row["causal"] and s["Sq"] == s["Sk"]:
                    pairs = s["Sq"] * (s["Sq"] + 1) // 2
                flops = 4 * s["B"] * s["Hq"] * s["D"] * pairs * (2.5 if row["kind"] == "backward" else 1)
                check(abs(row["gflops"] * row["seconds"] * 1e9 - flops) <= 1e-6 * flops, f"flop count {row}")
                esize = 4 if row["dtype"] == "float32" else 2
                kv = 2 * s["B"] * s["Hkv"] * s["Sk"] * s["D"] * esize
                check(abs(row["gbps"] * row["seconds"] * 1e9 - kv) <= 1e-6 * kv, f"byte count {row}")
                check(row["peak_fraction"] > 0, "peak fraction")
                # The same peak measured next to the row, and the row's share of it.
                rate = row["gbps"] if row["kind"] == "decode" else row["gflops"]
                check(row.get("adjacent_peak_value", 0) > 0, f"no adjacent peak {row}")
                check(abs(row.get("adjacent_peak_fraction", 0) * row.get("adjacent_peak_value", 0) - rate) <= 1e-9 * rate,
                      f"adjacent_peak_fraction {row}")
            if row["kind"] == "decode":
                # The two-stream (K and V) read reference of the same size, and this row's share of it.
                check(row.get("kv_read_gbps", 0) > 0, f"decode row without kv_read_gbps {row}")
                check(abs(row["kv_read_fraction"] * row["kv_read_gbps"] - row["gbps"]) <= 1e-9 * row["gbps"],
                      f"kv_read_fraction {row}")
            if row["kind"] in ("backward", "backward-scaling", "backward-memory"):
                want = "fma_gflops"
                if row["dtype"] == "bfloat16" and doc["kernel_isa"] == "avx512amx":
                    want = "amx_gflops"
                elif row["dtype"] == "bfloat16" and doc["bf16_dot_used"]:
                    want = "bf16_gflops"
                check(row["peak"] == want, f"backward peak {row}")
                check(row["peak_fraction"] > 0, f"backward peak fraction {row}")
            if row["kind"] in ("scaling", "backward-scaling"):
                check(row.get("seconds_1thread", 0) > 0, "scaling row without a 1-thread time")
                check(row["baseline_seconds"] is None, "scaling rows run no baseline")
            if row["kind"] in ("memory", "backward-memory"):
                check(row.get("peak_rss_mib", 0) > 0 and "extra_rss_mib" in row, f"memory row {row}")

        # JSON to stdout: the document is the whole of stdout.
        r = subprocess.run([qkv, "bench", "--quick", "--shapes", "decode", "--dtype", "f32",
                            "--decode-seqlens", "128", "--repeats", "1", "--peak-seconds", "0.03",
                            "--read-mib", "32", "--no-baseline", "--json", "-"], env=env, capture_output=True, text=True, timeout=60)
        check(r.returncode == 0, f"--json - exit status {r.returncode}: {r.stderr}")
        try:
            doc = json.loads(r.stdout)
            check(len(doc["rows"]) == 2, f"--json -: {len(doc['rows'])} rows")
        except json.JSONDecodeError as e:
            failures.append(f"--json - did not write JSON to stdout: {e}")

        # --shapes backward: backward rows only, JSON on stdout.
        r = subprocess.run([qkv, "bench", "--shapes", "backward", "--seqlens", "64", "--head-dims", "32",
                            "--dtype", "f32", "--causal", "on", "--repeats", "1", "--min-time", "0",
                            "--adjacent-seconds", "0", "--peak-seconds", "0.03", "--read-mib", "32", "--json", "-"],
                           env=env, capture_output=True, text=True, timeout=60)
        check(r.returncode == 0, f"--shapes backward exit status {r.returncode}: {r.stderr}")
        try:
            rows = json.loads(r.stdout)["rows"]
            check([(x["kind"], x["shape"]["D"], x["causal"], x["dtype"]) for x in rows] == [("backward", 32, True, "float32")],
                  f"--shapes backward rows: {rows}")
            check(all(x["gflops"] > 0 and x["seconds"] > 0 and x["kernel"] for x in rows), f"--shapes backward: {rows}")
            check(all("adjacent_peak_value" not in x for x in rows), "--adjacent-seconds 0 measured adjacent peaks")
        except (json.JSONDecodeError, KeyError) as e:
            failures.append(f"--shapes backward --json -: {e}")

        # Option rows: each forward and backward row, then one row per option beside it, with its
        # time over the plain row's; --window on all of them (and no baseline, which has none).
        r = subprocess.run([qkv, "bench", "--shapes", "forward", "--backward", "--seqlens", "70", "--head-dims", "16",
                            "--dtype", "f32", "--causal", "on", "--repeats", "1", "--min-time", "0",
                            "--adjacent-seconds", "0", "--peak-seconds", "0.03", "--read-mib", "32", "--window", "20",
                            "--sinks", "--alibi", "--keep-first", "3", "--json", "-"],
                           env=env, capture_output=True, text=True, timeout=60)
        check(r.returncode == 0, f"option rows exit status {r.returncode}: {r.stderr}")
        try:
            rows = json.loads(r.stdout)["rows"]
            want = [(k, o) for k in ("forward", "backward") for o in (None, "sinks", "alibi", "keep-first")]
            check([(x["kind"], x.get("option")) for x in rows] == want, f"option rows: {rows}")
            for x in rows:
                check(x["baseline_seconds"] is None, f"--window row with a baseline {x}")
                if x.get("option"):
                    check(x["plain_seconds"] > 0 and abs(x["ratio_vs_plain"] * x["plain_seconds"] - x["seconds"])
                          <= 1e-9 * x["seconds"] and "flash" in x["kernel"], f"option row {x}")
            check("with alibi:" in r.stderr and "ratio" in r.stderr, "option rows: no ratio in the table")
        except (json.JSONDecodeError, KeyError) as e:
            failures.append(f"option rows --json -: {e}")

        # An unwritable JSON path fails at once, before measuring, and writes nothing.
        bad = os.path.join(tmp, "missing", "x.json")
        r = subprocess.run([qkv, "bench", "--quick", "--json", bad], env=env, capture_output=True, text=True,
                           timeout=30)
        check(r.returncode == 2 and r.stderr.startswith("qkv: error: --json") and not os.path.exists(bad),
              f"bad --json path: {r.returncode} {r.stderr}")
        # An empty output path is refused, not taken as no output (the rows measured for nothing).
        for flag in ("--json", "--markdown"):
            r = subprocess.run([qkv, "bench", "--quick", "--shapes", "decode", "--dtype", "f32", "--decode-seqlens",
                                "128", "--repeats", "1", "--peak-seconds", "0.03", "--read-mib", "32", "--no-baseline",
                                flag, ""], env=env, capture_output=True, text=True, timeout=60)
            check(r.returncode == 2 and r.stderr == f"qkv: error: {flag}: expected a file path, got ''\n",
                  f"empty {flag} path: {r.returncode} {r.stderr[-500:]}")

        # --report --quick: the whole report's form in seconds, written at once.
        report = os.path.join(tmp, "report.md")
        # PyTorch's rows run under this interpreter: measured if it has torch (not a test dependency).
        r = subprocess.run([qkv, "bench", "--report", report, "--quick", "--repeats", "1", "--peak-seconds", "0.03",
                            "--read-mib", "32", "--adjacent-seconds", "0.02", "--python", sys.executable], env=env,
                           capture_output=True, text=True, timeout=300)
        check(r.returncode == 0 and r.stdout == "", f"--report exit status {r.returncode}: {r.stderr[-2000:]}")
        check("wrote " + report in r.stderr, "--report: no progress on stderr")
        if os.path.exists(report):
            check_report(open(report).read(), check, importlib.util.find_spec("torch") is not None)
        else:
            failures.append("--report wrote no file")
        # Bad arguments: one line, exit 2, no file.
        for args, what in ([os.path.join(tmp, "missing", "r.md")], "--report: directory"), \
                          ([os.path.join(tmp, "r.md"), "--serving"], "--serving excludes --report"), \
                          ([tmp], "--report: '"), \
                          ([""], "--report: expected a file path"):
            r = subprocess.run([qkv, "bench", "--quick", "--report"] + args, env=env, capture_output=True, text=True,
                               timeout=30)
            check(r.returncode == 2 and r.stderr.startswith("qkv: error: " + what) and r.stderr.count("\n") == 1,
                  f"--report {args}: {r.returncode} {r.stderr}")
        check(not os.path.exists(os.path.join(tmp, "r.md")), "--report with a bad option wrote a file")
        r = subprocess.run([qkv, "bench", "--python", "python3"], env=env, capture_output=True, text=True, timeout=30)
        check(r.returncode == 2 and "requires --report" in r.stderr, f"--python alone: {r.returncode} {r.stderr}")

        # Bad options exit 2 with one error line.
        r = subprocess.run([qkv, "bench", "--shapes", "sideways"], env=env, capture_output=True, text=True,
                           timeout=30)
        check(r.returncode == 2 and r.stderr.startswith("qkv: error:"), f"bad option: {r.returncode} {r.stderr}")

    for f in failures:
        print("FAIL:", f)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

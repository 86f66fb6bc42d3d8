"""Checks of `qkv train`: one short run prints falling losses; `--study scaling --quick` writes a
CSV with one row per run and step and sane values, a summary with a row per (scale, d_k), and a
PNG and an SVG per quantity; bad input gives one error line and no output.

Usage: /usr/bin/python3 tests/cli/test_train.py <path to qkv>
"""
import csv
import math
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

QKV = sys.argv[1]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def run(*args, expect=0):
    p = subprocess.run([QKV, *map(str, args)], capture_output=True, text=True)
    if p.returncode != expect:
        raise AssertionError(f"qkv {' '.join(map(str, args))}: exit {p.returncode}, expected {expect}\n{p.stderr}")
    return p


def single_run():
    p = run("train", "--steps", "40", "--batch", "8", "--log-every", "10", "--task", "copy")
    lines = [l.split() for l in p.stdout.splitlines() if len(l.split()) == 8 and l.split()[0].isdigit()]
    check(len(lines) == 5, f"five progress lines (steps 1, 10, .., 40): {p.stdout}")
    losses = [float(l[1]) for l in lines]
    check(losses[-1] < losses[0], f"the loss falls: {losses}")
    check("tokens/s" in p.stdout and "attention layer backward" in p.stdout, "throughput and time split printed")


def quick_study(tmp):
    out = os.path.join(tmp, "study")
    # CPU time, not wall time: on a shared machine a niced test may wait far longer than it runs.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = run("train", "--study", "scaling", "--quick", "--out", out)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"--quick: {cpu:.1f} s of CPU time, {time.time() - t0:.1f} s of wall time")
    check(cpu < 60, f"--quick needs under a minute of CPU time (took {cpu:.1f} s)")
    with open(os.path.join(out, "study.csv")) as f:
        rows = list(csv.DictReader(f))
    for col in ("scale", "d_k", "seed", "step", "loss", "accuracy", "max_weight", "entropy", "saturated_frac",
                "grad_wq", "grad_wk"):
        check(col in rows[0], f"CSV column {col}")
    runs = {(r["scale_rule"], int(r["d_k"]), int(r["seed"])) for r in rows}
    check(len(runs) == 9, f"9 runs (3 scales x 3 d_k): {sorted(runs)}")
    check(len(rows) == 9 * 60, f"one row per run and step: {len(rows)}")
    for r in rows:
        d_k, scale = int(r["d_k"]), float(r["scale"])
        want = {"1/sqrt(d_k)": 1 / math.sqrt(d_k), "1": 1.0, "1/d_k": 1 / d_k}[r["scale_rule"]]
        if not math.isclose(scale, want, rel_tol=1e-6):
            check(False, f"scale {scale} for {r['scale_rule']} at d_k {d_k}")
            break
        v = {k: float(r[k]) for k in ("loss", "accuracy", "max_weight", "entropy", "saturated_frac", "grad_wq",
                                      "grad_wk")}
        ok = (v["loss"] > 0 and 0 <= v["accuracy"] <= 1 and 0 < v["max_weight"] <= 1 + 1e-6 and v["entropy"] >= 0
              and 0 <= v["saturated_frac"] <= 1 and v["grad_wq"] > 0 and v["grad_wk"] > 0)
        if not ok or not all(math.isfinite(x) for x in v.values()):
            check(False, f"row out of range: {r}")
            break
    # The forward study's prediction at step 1: unscaled, d_k = 256 is the most peaked.
    first = {(r["scale_rule"], int(r["d_k"])): float(r["max_weight"]) for r in rows if r["step"] == "1"}
    check(first[("1", 256)] > first[("1/sqrt(d_k)", 256)] > first[("1/d_k", 256)],
          f"step-1 largest weight ordered by scale at d_k = 256: {first}")
    summary = open(os.path.join(out, "summary.md")).read()
    check(summary.count("\n| ") == 9 or len([l for l in summary.splitlines() if l.startswith("| ")]) == 10,
          f"a summary row per (scale, d_k): {summary}")
    for q in ("loss", "accuracy", "max_weight", "entropy", "saturated_frac", "grad_wq", "grad_wk"):
        png = open(os.path.join(out, q + ".png"), "rb").read()
        check(png[:8] == b"\x89PNG\r\n\x1a\n", f"{q}.png is a PNG")
        w, h = struct.unpack(">II", png[16:24])
        check(w > 600 and h > 200, f"{q}.png size {w}x{h}")
        root = ET.parse(os.path.join(out, q + ".svg")).getroot()
        lines = root.findall("{http://www.w3.org/2000/svg}polyline")
        texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
        check(len(lines) >= 9, f"{q}.svg has curves ({len(lines)} polylines)")
        check(any(t and "scale = 1/sqrt(d_k)" in t for t in texts) and "step" in texts, f"{q}.svg legend, axis")
    check(not [n for n in os.listdir(out) if ".tmp" in n], "no temporary files left")
    check("study wall time" in p.stdout, "the wall time is printed")


def errors(tmp):
    for args, what in ((("--scale", "big"), "--scale"),
                       (("--study", "scaling"), "--out"),
                       (("--out", os.path.join(tmp, "x")), "--study"),
                       (("--d-k", "0"), "--d-k"),
                       (("--task", "sort"), "--task")):
        p = run("train", "--steps", "1", *args, expect=2)
        err = p.stderr.strip().splitlines()
        check(len(err) == 1 and err[0].startswith("qkv: error:") and what in err[0], f"error for {what}: {p.stderr!r}")
    check(not os.path.exists(os.path.join(tmp, "x")), "no output after an error")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        single_run()
        quick_study(tmp)
        errors(tmp)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")


main()

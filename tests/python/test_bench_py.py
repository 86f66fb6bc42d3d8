"""python -m qkv.bench: every row it promises, with positive times and ratios (a smoke run of the
benchmark's own code, not a speed test: speed is judged from its output in docs/python.md)."""
import json
import subprocess
import sys


def test_python_bench_quick_rows(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "qkv.bench", "--quick", "--json", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    kinds = {}
    for row in rows:
        assert row["qkv"] > 0 and row["torch"] > 0 and row["ratio"] > 0, row
        kinds.setdefault(row["kind"], []).append(row["shape"])
    # --quick: S = 1024, D in {64, 128}, causal and not; fp32 and bf16 forward; fp32 forward +
    # backward at both D and bf16 at D = 128; decode at Hkv 8 and 2 in both dtypes; the overheads
    # from NumPy, from PyTorch, and under autograd (forward; forward and backward)
    assert len(kinds["forward"]) == 8 and len(kinds["forward+backward"]) == 6
    assert {(s.split()[0], s.split()[2]) for s in kinds["decode"]} == {(d, h) for d in ("fp32", "bf16")
                                                                      for h in ("Hkv=8", "Hkv=2")}
    assert sorted(kinds["call overhead"]) == ["numpy B=H=S=1 D=8", "torch.Tensor B=H=S=1 D=8",
                                              "torch.Tensor requires_grad B=H=S=1 D=8",
                                              "torch.Tensor requires_grad, with backward B=H=S=1 D=8"]
    assert "| forward | fp32 D=128 S=1024 |" in r.stdout

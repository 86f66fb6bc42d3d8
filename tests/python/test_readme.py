"""The README's "Python in ten lines" runs as printed."""
import pathlib
import re

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

#!/usr/bin/python3
"""Lists every error qkv's library (src/), command line (cli/, bench/command/) and
Python binding (python/src/) can raise.

Each throw site (`throw Error(...)`, a reader's `fail(name, ...)`, `throw std::...(...)`) gives one
row: the source file and line, the condition that raises it (the guarding `if`, as code), and the
message pattern (the string literals of the message, with `…` for the parts computed at run time).
`scripts/errors_table.py` prints the Markdown table that docs/errors.md embeds;
tests/cli/test_errors_doc.py checks that docs/errors.md names every message.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = re.compile(r"\bthrow\s+(?:qkv::)?Error\s*\(|\bthrow\s+std::\w+\s*\(|(?<![\w:])fail\s*\(|\bthrow\s+bad\s*\(")
LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def call_args(text, start):
    """The text between the parenthesis that ends at `start` and its match."""
    depth, i = 1, start
    in_str = False
    while i < len(text) and depth:
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        i += 1
    return text[start:i - 1]


def condition(lines, lineno, col):
    """The `if (...)` guarding the throw on line `lineno` (1-based), as written."""
    line = lines[lineno - 1]
    head = line[:col]
    m = re.search(r"\bif\s*\((.*)\)\s*(\{\s*)?$", head.strip())
    if m:
        return m.group(1).strip()
    for back in range(lineno - 2, max(lineno - 4, -1), -1):
        prev = lines[back].strip()
        m = re.match(r"^(?:\}\s*else\s+)?if\s*\((.*)\)\s*\{?$", prev)
        if m:
            return m.group(1).strip()
        if prev.endswith(";") or prev.endswith("}") or prev.endswith("{"):
            break
    if re.search(r"\bcatch\b", " ".join(lines[max(lineno - 3, 0):lineno])):
        return "a nested call threw (message prefixed)"
    return "see source"


def sites():
    rows = []
    for top in ("src", "cli", "bench/command", "python/src"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if not f.endswith((".cpp", ".hpp")):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)
                text = open(path, encoding="utf-8").read()
                lines = text.split("\n")
                for m in SITE.finditer(text):
                    lineno = text.count("\n", 0, m.start()) + 1
                    line = lines[lineno - 1]
                    if re.search(r"(void|int|auto)\s+fail\s*\(", line) or line.lstrip().startswith("//"):
                        continue  # the definition of a fail() helper, or a comment
                    args = call_args(text, m.end())
                    lits = LITERAL.findall(args)
                    if not lits and "bad" not in m.group(0):
                        continue
                    col = m.start() - text.rfind("\n", 0, m.start()) - 1
                    rows.append((rel, lineno, condition(lines, lineno, col), lits, m.group(0)))
    return rows


def pattern(lits, args_kind):
    if not lits:
        return "(see the helper above it)"
    return "…".join(l for l in lits)


def key_fragment(lits):
    """The longest literal of a message: what docs/errors.md must contain."""
    return max((l for l in lits), key=len) if lits else None


def md_escape(s):
    return s.replace("|", "\\|").replace("`", "'")


def table():
    out = ["| Source | Condition (code) | Message pattern |", "|---|---|---|"]
    for rel, lineno, cond, lits, kind in sites():
        out.append("| %s:%d | `%s` | %s |" % (rel, lineno, md_escape(cond), md_escape(pattern(lits, kind))))
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")

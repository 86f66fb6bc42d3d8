#!/usr/bin/python3
"""docs/errors.md must name every error message that src/ and cli/ can raise.

Each throw site's message pattern (as scripts/errors_table.py renders it) must appear in
docs/errors.md; run scripts/errors_table.py to regenerate the table there. The argument (the qkv
binary, as CTest passes it to every Python test) is not needed.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import errors_table  # noqa: E402


def main():
    doc = open(os.path.join(ROOT, "docs", "errors.md"), encoding="utf-8").read()
    sites = errors_table.sites()
    assert len(sites) > 100, "found only %d throw sites: is the scanner broken?" % len(sites)
    missing = []
    for rel, lineno, cond, lits, kind in sites:
        pat = errors_table.md_escape(errors_table.pattern(lits, kind))
        if pat not in doc:
            missing.append("%s:%d: %s" % (rel, lineno, pat))
    if missing:
        print("docs/errors.md does not list %d message(s); run scripts/errors_table.py:" % len(missing))
        print("\n".join(missing))
        sys.exit(1)
    # Every CLI outcome is documented with its exit status.
    for needle in ("| 2 |", "| 0 |", "qkv: error:", "temporary name", "rename"):
        assert needle in doc, needle
    print("docs/errors.md lists all %d throw sites" % len(sites))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Fails when a folder includes one above it, or when docs/architecture.md stops being true.

The floors, lowest first (a folder may include its own floor's and lower floors' headers):
    tensor -> core -> platform | blas -> reference | kernels -> dispatch -> api
           -> io | cache | layers | dist -> models -> explain -> train -> cli | bench | python
Folders on one floor may include each other's headers only one way (no cycle). A public header
include/qkv/X.hpp belongs to the floor that docs/architecture.md's header table gives it, so
including it counts as including that floor; the table must list every public header and only
source files that exist.

Usage: scripts/check_layers.py [ROOT]   (exit 0: clean; 1: each violation printed)
"""
import pathlib
import re
import sys

FLOORS = [["tensor"], ["core"], ["platform", "blas"], ["reference", "kernels"], ["dispatch"], ["api"],
          ["io", "cache", "layers", "dist"], ["models"], ["explain"], ["train"], ["cli", "bench", "python"]]
LEVEL = {folder: n for n, floor in enumerate(FLOORS) for folder in floor}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
TABLE_ROW = re.compile(r"^\|\s*`qkv/(\w+\.hpp)`\s*\|\s*(\w+)\s*\|\s*(.*?)\s*\|\s*$", re.M)


def folder_of(root, path):
    """The floor folder of a source file: src/<folder>/..., cli/..., bench/..., python/..."""
    rel = path.relative_to(root).parts
    if rel[0] == "src":
        return rel[1]
    return rel[0]


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    errors = []
    doc = (root / "docs" / "architecture.md").read_text()
    header_floor = {}
    for name, floor, sources in TABLE_ROW.findall(doc):
        if floor not in LEVEL and floor != "umbrella":
            errors.append(f"docs/architecture.md: qkv/{name}: unknown floor '{floor}'")
        header_floor[name] = floor
        for src in re.findall(r"`([^`]+/[^`]+)`", sources):
            if not (root / src).exists():
                errors.append(f"docs/architecture.md: qkv/{name}: '{src}' does not exist")
    for h in sorted((root / "include" / "qkv").glob("*.hpp")):
        if h.name not in header_floor:
            errors.append(f"docs/architecture.md: the header table does not list qkv/{h.name}")
    for d in sorted((root / "src").iterdir()):
        if d.is_dir() and d.name not in LEVEL:
            errors.append(f"src/{d.name}: a folder on no floor (add it to scripts/check_layers.py and docs/architecture.md)")

    def level_of_include(inc):
        first = inc.split("/")[0]
        if first == "qkv":
            f = header_floor.get(inc.split("/", 1)[1])
            return f, (LEVEL[f] if f in LEVEL else len(FLOORS))
        return first, LEVEL.get(first)

    edges = set()
    files = [p for d in ("src", "cli", "bench", "python") for p in (root / d).rglob("*") if p.suffix in (".hpp", ".cpp", ".h")]
    for path in sorted(files):
        me = folder_of(root, path)
        if me not in LEVEL:
            continue
        for inc in INCLUDE.findall(path.read_text(errors="replace")):
            target, lvl = level_of_include(inc)
            if lvl is None or target == me:
                continue  # a header beside the file (bench's own, a test's) or its own folder
            if lvl > LEVEL[me]:
                errors.append(f"{path.relative_to(root)}: includes \"{inc}\" ({target}, above {me})")
            elif lvl == LEVEL[me]:
                edges.add((me, target))
    for a, b in sorted(edges):
        if (b, a) in edges and a < b:
            errors.append(f"{a} and {b} include each other")
    for h in sorted((root / "include" / "qkv").glob("*.hpp")):
        mine = header_floor.get(h.name)
        for inc in INCLUDE.findall(h.read_text()):
            if not inc.startswith("qkv/"):
                errors.append(f"include/qkv/{h.name}: includes \"{inc}\", not a public header")
                continue
            theirs = header_floor.get(inc[4:])
            if mine in LEVEL and theirs in LEVEL and LEVEL[theirs] > LEVEL[mine]:
                errors.append(f"include/qkv/{h.name} ({mine}): includes {inc} ({theirs}, above it)")
    for e in errors:
        print(e)
    print(f"check_layers: {len(files)} files, {len(errors)} violation(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

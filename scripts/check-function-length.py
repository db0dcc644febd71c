#!/usr/bin/env python3
"""No function in the crates' sources longer than a limit (ARCHITECTURE.md invariant).

Every `fn` with a body in crates/*/src (test modules included; the integration tests under
crates/*/tests are not counted) is measured from its `fn` line to its closing brace, which
rustfmt puts alone on a line at the `fn`'s indentation (`cargo fmt --check` runs first in CI).
Prints each function over the limit and exits 1 when there is one.

usage: scripts/check-function-length.py [--max LINES] [ROOT]   (default 150, the repository)
"""
import argparse
import glob
import os
import re
import sys

FN = re.compile(r"^(\s*)(pub(\([^)]*\))?\s+)?((const|async|unsafe|extern\s+\"[^\"]*\")\s+)*fn\s+(\w+)")


def functions(path):
    """(name, first line, lines) of every function with a body in the file."""
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        indent, name = m.group(1), m.group(6)
        # The signature ends at the first line ending in `{` (a body) or `;` (a declaration).
        j = i
        while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")):
            j += 1
        if j == len(lines) or lines[j].rstrip().endswith(";"):
            continue
        if lines[j].rstrip().endswith("}") or lines[j].strip().endswith("{}"):
            continue
        end = next((k for k in range(j, len(lines)) if lines[k].rstrip() == indent + "}"), None)
        if end is None:
            sys.exit(f"check-function-length: {path}:{i + 1}: no closing brace for fn {name}")
        found.append((name, i + 1, end - i + 1))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=150)
    ap.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), ".."))
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.root, "crates/*/src/**/*.rs"), recursive=True))
    long = [
        (os.path.relpath(f, args.root), line, name, n)
        for f in files
        for name, line, n in functions(f)
        if n > args.max
    ]
    for path, line, name, n in long:
        print(f"{path}:{line}: fn {name} is {n} lines (at most {args.max})")
    if long:
        sys.exit(1)
    print(f"check-function-length: every function of {len(files)} source files is at most {args.max} lines")


if __name__ == "__main__":
    main()

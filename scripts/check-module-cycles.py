#!/usr/bin/env python3
"""No import cycle between the top-level modules of any crate (ARCHITECTURE.md invariant).

For each crates/*/src, a module's dependencies are the `crate::<module>` paths its files use
(comments and #[cfg(test)] parts ignored); prints the cycles and exits 1 when there is one.
"""
import glob
import os
import re
import sys


def graph(src):
    g = {}
    for f in glob.glob(src + "/**/*.rs", recursive=True):
        mod = os.path.relpath(f, src).split("/")[0].removesuffix(".rs")
        if mod in ("lib", "main"):
            continue
        text = open(f).read().split("#[cfg(test)]")[0]
        text = "\n".join(l for l in text.split("\n") if not l.strip().startswith("//"))
        g.setdefault(mod, set()).update(d for d in re.findall(r"crate::([a-z_]+)", text) if d != mod)
    return g


def cycles(g):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(g):
        if v not in index:
            visit(v)
    return out


root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
bad = False
for src in sorted(glob.glob(os.path.join(root, "crates/*/src"))):
    g = graph(src)
    for c in cycles(g):
        bad = True
        edges = [f"{a} -> {b}" for a in c for b in sorted(g[a]) if b in c]
        print(f"{os.path.relpath(src, root)}: import cycle among {c}: {', '.join(edges)}")
if bad:
    sys.exit(1)
print("check-module-cycles: no import cycle between the modules of any crate")

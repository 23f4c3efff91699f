#!/usr/bin/env python3
"""Fails when a module of a workspace crate imports, directly or through others, a module that
imports it back (issue 24's rule: no import cycles between modules).

A module is a file under `<crate>/src`; it imports another when its code (comments and its
`#[cfg(test)] mod tests` left out) names `crate::...` or `super::...` paths that resolve to
that module. A child naming its parent is not counted (a parent's `mod` lines are not
imports), and re-exports count like any import. Prints each cycle with its edges.

    python3 scripts/check_module_cycles.py [WORKSPACE]
"""

import os
import re
import sys

PATH = re.compile(r"\b((?:crate|super)(?:::super)*)::([A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)")
GROUP = re.compile(r"\b((?:crate|super)(?:::super)*)::\{([^}]*)\}")


def modules(src: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                parts = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split("/")
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                out["::".join(parts)] = os.path.join(dirpath, f)
    return out


def edges_of(mods: dict[str, str]) -> dict[str, set[str]]:
    def resolve(parts):
        while parts:
            if "::".join(parts) in mods:
                return "::".join(parts)
            parts = parts[:-1]
        return None

    edges = {m: set() for m in mods}
    for m, path in mods.items():
        text = re.split(r"#\[cfg\(test\)\]\s*mod tests", open(path).read())[0]
        text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))
        me = m.split("::") if m else []
        # `super` from a file module is its parent; each further `super` one more level up.
        found = [(h, r.split("::")) for h, r in PATH.findall(text)]
        found += [(h, i.strip().split(" as ")[0].split("::")) for h, items in GROUP.findall(text) for i in items.split(",") if i.strip() and i.strip() != "self"]
        for head, rest in found:
            base = [] if head == "crate" else me[: max(len(me) - head.count("super"), 0)]
            t = resolve(base + rest)
            if t and t != m and not m.startswith(t + "::"):
                edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    bad = 0
    for crate in sorted(os.listdir(root)):
        src = os.path.join(root, crate, "src")
        if not (os.path.isfile(os.path.join(root, crate, "Cargo.toml")) and os.path.isdir(src)):
            continue
        edges = edges_of(modules(src))
        for comp in cycles(edges):
            bad += 1
            print(f"{crate}: modules that import each other: {', '.join(comp)}")
            for m in comp:
                print(f"    {m or '(crate root)'} -> {', '.join(sorted(e for e in edges[m] if e in comp))}")
    if bad:
        print(f"{bad} import cycle(s)", file=sys.stderr)
        return 1
    print("no import cycles between modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())

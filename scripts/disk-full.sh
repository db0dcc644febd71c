#!/usr/bin/env bash
# A full disk is a deterministic failure: the job ends at once with exit status 3 (no restart
# loop), names the file it could not write, leaves no temporary file behind, and keeps every
# file written before (earlier checkpoints, config.toml).
#
# The run directory is a 512 KiB tmpfs in a private mount namespace, so it fills at a checkpoint
# of the default digits MLP. Needs root (mount). Usage: scripts/disk-full.sh [path/to/lockstep]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(realpath "${1:-$root/target/debug/lockstep}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat >"$work/inner.sh" <<INNER
set -u
mount -t tmpfs -o size=512k lockstep-full "$work/mnt"
"$bin" train --nproc 2 --out "$work/mnt/run" --set train.steps=400 --set checkpoint.every=10 \
    --set checkpoint.keep=100 >"$work/log" 2>&1
echo \$? >"$work/status"
ls -la "$work/mnt/run" "$work/mnt/run/checkpoints" >"$work/listing" 2>&1
find "$work/mnt/run" -name '*tmp*' >"$work/leftovers"
ls "$work/mnt/run/checkpoints" | grep -c '^step-' >"$work/kept" || true
test -s "$work/mnt/run/config.toml" && echo yes >"$work/config_kept"
INNER
mkdir -p "$work/mnt"
unshare --mount --propagation private bash "$work/inner.sh"

fail() { echo "disk-full: FAIL: $*"; echo "--- log"; tail -n 30 "$work/log"; echo "--- files"; cat "$work/listing"; exit 1; }
status="$(cat "$work/status")"
[[ "$status" == 3 ]] || fail "exit status $status, expected 3"
grep -q "no space left" "$work/log" || grep -qi "No space left on device" "$work/log" || fail "the error does not say the disk is full"
grep -q "not restarting" "$work/log" || fail "the launcher did not say it will not restart"
if grep -q "restart 1/" "$work/log"; then fail "a full disk was retried"; fi
[[ ! -s "$work/leftovers" ]] || fail "temporary files left behind: $(cat "$work/leftovers")"
[[ "$(cat "$work/kept")" -ge 1 ]] || fail "no earlier checkpoint kept"
[[ -f "$work/config_kept" ]] || fail "config.toml lost"
echo "disk-full: ok: exit 3, not retried, $(cat "$work/kept") earlier checkpoint(s) kept, no temporary file left"
grep "error" "$work/log" | tail -n 2

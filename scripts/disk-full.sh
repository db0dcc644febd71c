#!/usr/bin/env bash
# A full disk is a deterministic failure: the job ends at once with exit status 3 (no restart
# loop), names the file it could not write, leaves no temporary file behind, and keeps every
# file written before (earlier checkpoints, config.toml).
#
# The run directory is a 512 KiB tmpfs in a private mount namespace, so it fills at a checkpoint
# of the default digits MLP. Checked with checkpoints written in the step, in the background
# (checkpoint.async, where the full disk is met by the writer thread while training goes on) and
# sharded (checkpoint.sharded, where every rank writes its shard and one of them meets it), in the
# step and in the background.
# Needs root (mount). Usage: scripts/disk-full.sh [path/to/lockstep]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(realpath "${1:-$root/target/debug/lockstep}")"

check() {
setting="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat >"$work/inner.sh" <<INNER
set -u
mount -t tmpfs -o size=512k lockstep-full "$work/mnt"
"$bin" train --nproc 2 --out "$work/mnt/run" --set train.steps=400 --set checkpoint.every=10 \
    --set checkpoint.keep=100 --set $setting >"$work/log" 2>&1
echo \$? >"$work/status"
ls -la "$work/mnt/run" "$work/mnt/run/checkpoints" >"$work/listing" 2>&1
find "$work/mnt/run" -name '*tmp*' >"$work/leftovers"
ls "$work/mnt/run/checkpoints" | grep -c '^step-' >"$work/kept" || true
test -s "$work/mnt/run/config.toml" && echo yes >"$work/config_kept"
# Space freed (the tmpfs grown): the resumed run ends, and metrics.jsonl holds every step once
# per rank — a full disk while writing the metrics must not leave steps unrecorded for good.
mount -o remount,size=64m "$work/mnt"
"$bin" train --nproc 2 --resume "$work/mnt/run" >"$work/resume_log" 2>&1
echo \$? >"$work/resume_status"
python3 - "$work/mnt/run/metrics.jsonl" >"$work/metrics_check" 2>&1 <<'PY'
import collections, json, sys
seen = collections.Counter((r["rank"], r["step"]) for r in map(json.loads, open(sys.argv[1])))
want = {(rank, step) for rank in range(2) for step in range(400)}
missing, twice = want - set(seen), [k for k, n in seen.items() if n > 1]
print("ok" if not missing and not twice and set(seen) == want else f"missing {sorted(missing)[:5]} ({len(missing)}), twice {twice[:5]}")
PY
INNER
mkdir -p "$work/mnt"
unshare --mount --propagation private bash "$work/inner.sh"

fail() { echo "disk-full ($setting): FAIL: $*"; echo "--- log"; tail -n 30 "$work/log"; echo "--- files"; cat "$work/listing"; exit 1; }
status="$(cat "$work/status")"
[[ "$status" == 3 ]] || fail "exit status $status, expected 3"
grep -q "no space left" "$work/log" || grep -qi "No space left on device" "$work/log" || fail "the error does not say the disk is full"
grep -q "not restarting" "$work/log" || fail "the launcher did not say it will not restart"
if grep -q "restart 1/" "$work/log"; then fail "a full disk was retried"; fi
[[ ! -s "$work/leftovers" ]] || fail "temporary files left behind: $(cat "$work/leftovers")"
[[ "$(cat "$work/kept")" -ge 1 ]] || fail "no earlier checkpoint kept"
[[ -f "$work/config_kept" ]] || fail "config.toml lost"
[[ "$(cat "$work/resume_status")" == 0 ]] || { tail -n 20 "$work/resume_log"; fail "the resumed run failed once space was freed"; }
[[ "$(cat "$work/metrics_check")" == ok ]] || fail "metrics.jsonl after the resume: $(cat "$work/metrics_check")"
echo "disk-full ($setting): ok: exit 3, not retried, $(cat "$work/kept") earlier checkpoint(s) kept, no temporary file left; resumed once space was freed, every step recorded once"
grep "error" "$work/log" | tail -n 2
rm -rf "$work"
trap - EXIT
}

check checkpoint.async=false
check checkpoint.async=true
check checkpoint.sharded=true
check "checkpoint.sharded=true --set checkpoint.async=true"

#!/usr/bin/env bash
# A model that fits only when sharded, under a memory cap the kernel enforces per worker
# (`--worker-memory-gib`: a memory cgroup per worker; needs root or a delegated cgroup).
#
# configs/shakespeare-large.toml (22 M parameters, AdamW), 3 steps, on 4 workers capped at CAP GiB:
#  1. one uncapped worker: the reference hash, and the calibration run for `lockstep plan`;
#  2. `lockstep plan --memory-gib CAP` predicts dp4 × ZeRO 0 does not fit and dp4 × ZeRO 3 fits;
#  3. dp4 × ZeRO 0 under the cap: the kernel OOM-kills a worker, the launcher names the cap and
#     ends with exit status 3 without restarting, and no cgroup is left behind;
#  4. dp4 × ZeRO 3 under the cap: finishes with the reference hash, every rank's peak resident
#     memory below the cap.
# Usage: scripts/memory-cap.sh [path/to/lockstep]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(realpath "${1:-$root/target/release/lockstep}")"
cap=0.6
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$root"
common=(--config configs/shakespeare-large.toml --set train.steps=3 --set checkpoint.every=0)
fail() { echo "memory-cap: FAIL: $*"; exit 1; }

cgroups_left() {
    find /sys/fs/cgroup -maxdepth 6 -type d -name 'lockstep-*' 2>/dev/null | wc -l
}
before="$(cgroups_left)"

"$bin" train "${common[@]}" --nproc 1 --out "$work/reference" >"$work/reference.log" 2>&1 ||
    { tail -n 20 "$work/reference.log"; fail "the uncapped reference run failed"; }
want="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$work/reference/summary.json")"

# What the plan predicts, before running either.
for zero in 0 3; do
    set +e
    "$bin" plan --from "$work/reference" --workers-per-node 4 --layouts 4 --zero "$zero" \
        --memory-gib "$cap" --json "$work/plan-$zero.json" >"$work/plan-$zero.log" 2>&1
    echo $? >"$work/plan-$zero.status"
    set -e
done
fits() {
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["predictions"][0]["fits_memory"])' "$work/plan-$1.json"
}
[[ "$(fits 0)" == False ]] || { cat "$work/plan-0.log"; fail "plan: dp4 × ZeRO 0 predicted to fit in $cap GiB"; }
[[ "$(cat "$work/plan-0.status")" != 0 ]] || fail "plan: no error when nothing fits"
[[ "$(fits 3)" == True ]] || { cat "$work/plan-3.log"; fail "plan: dp4 × ZeRO 3 predicted not to fit in $cap GiB"; }
[[ "$(cat "$work/plan-3.status")" == 0 ]] || { cat "$work/plan-3.log"; fail "plan failed for ZeRO 3"; }

# ZeRO 0 under the cap: killed by the kernel, named, not restarted.
set +e
"$bin" train "${common[@]}" --nproc 4 --worker-memory-gib "$cap" --out "$work/zero0" >"$work/zero0.log" 2>&1
status=$?
set -e
[[ "$status" == 3 ]] || { tail -n 20 "$work/zero0.log"; fail "ZeRO 0 under the cap: exit status $status, expected 3"; }
grep -q "killed by the kernel's OOM killer at its memory cap of 0.600 GiB (--worker-memory-gib)" "$work/zero0.log" ||
    { tail -n 20 "$work/zero0.log"; fail "ZeRO 0: the failure does not name the memory cap"; }
grep -q "out of memory: not restarting" "$work/zero0.log" || fail "ZeRO 0: not said to be permanent"
if grep -q "restart 1/" "$work/zero0.log"; then fail "ZeRO 0: a capped worker was restarted"; fi

# ZeRO 3 under the same cap: the reference's bits, every rank below the cap.
"$bin" train "${common[@]}" --nproc 4 --worker-memory-gib "$cap" --set parallel.zero=3 \
    --out "$work/zero3" >"$work/zero3.log" 2>&1 || { tail -n 20 "$work/zero3.log"; fail "ZeRO 3 under the cap failed"; }
python3 - "$work/zero3/summary.json" "$want" "$cap" <<'PY' || fail "ZeRO 3 under the cap (above)"
import json, sys
s = json.load(open(sys.argv[1]))
want, cap = sys.argv[2], float(sys.argv[3]) * 2**30
assert s["param_hash"] == want, f"hash {s['param_hash']} != reference {want}"
peaks = [r["memory"]["peak_rss_bytes"] for r in s["ranks"]]
assert len(peaks) == 4 and all(0 < p < cap for p in peaks), f"peaks {peaks} against cap {cap}"
print("memory-cap: ZeRO 3 peaks (MiB):", [p >> 20 for p in peaks])
PY
[[ "$(cgroups_left)" == "$before" ]] || fail "memory cgroups left behind: $(find /sys/fs/cgroup -maxdepth 6 -type d -name 'lockstep-*')"
echo "memory-cap: ok: plan predicted ZeRO 0 does not fit and ZeRO 3 fits in $cap GiB per worker; ZeRO 0 OOM-killed by the kernel, exit 3, not restarted; ZeRO 3 ended with the reference hash $want"

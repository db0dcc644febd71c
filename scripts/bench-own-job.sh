#!/usr/bin/env bash
# Does the public library path cost anything? own-cnn (a user-written burn CNN through
# lockstep::Job, burn's Dataset trait, per-item batching) against lockstep's built-in CNN of the same
# shape (conv 8, 16 → 64 → 10) on the same Fashion-MNIST steps, same config values.
#
# Interleaved runs in one invocation (machine noise is ±25% between invocations), REPS each,
# 1 worker with 1 compute thread; per run the median per-step samples/s (evaluation steps
# excluded); reports medians, ranges and the ratio own/built-in as JSON.
#
# usage: scripts/bench-own-job.sh OUT.json [REPS] [STEPS]   (build first: cargo build --release)
set -euo pipefail
out=${1:?usage: $0 OUT.json [REPS] [STEPS]}
reps=${2:-5}
steps=${3:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/target/release}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--nproc 1 --threads-per-worker 1 --set train.steps="$steps" --set train.global_batch=96
        --set train.microbatch=16 --set train.lr=0.05 --set train.warmup_steps=10
        --set train.eval_every=0 --set checkpoint.every=0)
median_step_rate() {  # metrics.jsonl → median samples/s over non-evaluation steps
    python3 - "$1" <<'PY'
import json, statistics, sys
rates = [r["samples_per_sec"] for r in map(json.loads, open(sys.argv[1])) if not r.get("eval")]
print(statistics.median(rates))
PY
}
for i in $(seq 1 "$reps"); do
    "$bin/own-cnn" train "${common[@]}" --out "$work/own-$i" >/dev/null 2>&1
    "$bin/lockstep" train "${common[@]}" --set model.kind='"cnn"' --set model.conv='[8, 16]' \
        --set model.cnn_hidden=64 --set data.dataset='"fashion-mnist"' --out "$work/builtin-$i" >/dev/null 2>&1
    echo "rep $i: own $(median_step_rate "$work/own-$i/metrics.jsonl")  built-in $(median_step_rate "$work/builtin-$i/metrics.jsonl")" >&2
done
python3 - "$work" "$reps" "$out" <<'PY'
import json, statistics, sys
work, reps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rates(kind):
    vals = []
    for i in range(1, reps + 1):
        steps = [json.loads(l) for l in open(f"{work}/{kind}-{i}/metrics.jsonl")]
        vals.append(statistics.median(r["samples_per_sec"] for r in steps if not r.get("eval")))
    return vals
own, builtin = rates("own"), rates("builtin")
ratios = [o / b for o, b in zip(own, builtin)]
res = {
    "what": "own-cnn (public lockstep::Job path) vs built-in CNN, same shape and steps, 1 worker, 1 thread",
    "reps": reps,
    "own_samples_per_sec": {"median": statistics.median(own), "min": min(own), "max": max(own)},
    "builtin_samples_per_sec": {"median": statistics.median(builtin), "min": min(builtin), "max": max(builtin)},
    "ratio_own_over_builtin": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps(res, indent=2))
PY

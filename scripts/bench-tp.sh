#!/usr/bin/env bash
# The cost of tensor parallelism's pieces, and a tp2 step: configs/shakespeare.toml
# (d_model 128, 4 heads, 4 blocks, d_ff 512, context 64, batch 32 = 4 × 8) on
#   - 1 worker computing blocks whole (model.tp_pieces = 1),
#   - 1 worker computing each block as 4 pieces summed exactly (model.tp_pieces = 4: the model as
#     a LayeredJob of lockstep::tp layers),
#   - 2 workers, tp2, sharing those 4 pieces (same bits as the 1-worker tp_pieces = 4 run).
# Interleaved runs in one invocation, REPS each, 1 compute thread per worker; per run the median
# step time of rank 0 (evaluation steps excluded); reports medians, ranges and steps/s as JSON.
#
# usage: scripts/bench-tp.sh OUT.json [REPS] [STEPS]   (build first: cargo build --release;
#        BIN_DIR=target/debug uses the dev build, whose dependencies are optimised too;
#        BASELINE_BIN_DIR=DIR also runs every layout with DIR/lockstep, interleaved, as NAME-baseline:
#        an earlier build against this one)
set -euo pipefail
out=${1:?usage: $0 OUT.json [REPS] [STEPS]}
reps=${2:-3}
steps=${3:-30}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/target/release}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--config "$root/configs/shakespeare.toml" --threads-per-worker 1 --set parallel.pp=1
        --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.every=0)
declare -A layout=(
    [whole]="--nproc 1 --set model.tp_pieces=1"
    [pieces4]="--nproc 1 --set model.tp_pieces=4"
    [tp2]="--nproc 2 --set model.tp_pieces=4 --set parallel.tp=2"
)
baseline=${BASELINE_BIN_DIR:-}
for i in $(seq 1 "$reps"); do
    for name in whole pieces4 tp2; do
        # shellcheck disable=SC2086
        "$bin/lockstep" train "${common[@]}" ${layout[$name]} --out "$work/$name-$i" >/dev/null 2>&1
        if [[ -n "$baseline" ]]; then
            # shellcheck disable=SC2086
            "$baseline/lockstep" train "${common[@]}" ${layout[$name]} \
                --out "$work/$name-baseline-$i" >/dev/null 2>&1
        fi
    done
    echo "rep $i done" >&2
done
python3 - "$work" "$reps" "$out" "$baseline" <<'PY'
import json, statistics, sys
work, reps, out, baseline = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def step_seconds(name):
    vals, hashes = [], set()
    for i in range(1, reps + 1):
        d = f"{work}/{name}-{i}"
        steps = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
        vals.append(statistics.median(r["step_seconds"] for r in steps
                                      if r.get("rank") == 0 and not r.get("eval")))
        hashes.add(json.load(open(f"{d}/summary.json"))["param_hash"])
    return vals, hashes
def cpu():
    info = {}
    for line in open("/proc/cpuinfo"):
        k, _, v = line.partition(":")
        info.setdefault(k.strip(), v.strip())
    return f'{info.get("model name")} (family {info.get("cpu family")}, model {info.get("model")})'
res = {"what": "configs/shakespeare.toml, 1 thread per worker: blocks whole vs 4 exact-summed "
               "pieces on 1 worker vs the 4 pieces over tp2", "reps": reps, "cpu": cpu(),
       "layouts": {}}
names = ["whole", "pieces4", "tp2"]
if baseline:
    res["baseline"] = baseline
    names += [n + "-baseline" for n in names]
for name in names:
    v, h = step_seconds(name)
    res["layouts"][name] = {"median_step_seconds": statistics.median(v), "min": min(v), "max": max(v),
                            "steps_per_sec": 1 / statistics.median(v), "param_hashes": sorted(h)}
L = res["layouts"]
res["pieces4_over_whole_step_time"] = L["pieces4"]["median_step_seconds"] / L["whole"]["median_step_seconds"]
res["tp2_same_bits_as_pieces4"] = L["tp2"]["param_hashes"] == L["pieces4"]["param_hashes"]
if baseline:
    res["over_baseline_step_time"] = {
        n: L[n]["median_step_seconds"] / L[n + "-baseline"]["median_step_seconds"]
        for n in ["whole", "pieces4", "tp2"]}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps(res, indent=2))
PY

#!/usr/bin/env bash
# Memory that is used, not held: peak resident memory per worker against the goal
# 1.5 × (parameters + gradients + optimizer state + peak activations) + 0.5 GiB, and the model-state
# bytes per rank, for the default Shakespeare transformer (0.82 M parameters), the issue's 19 M one
# (configs/shakespeare.toml with d_model 512, 8 heads, 6 blocks, d_ff 2048) and the large one
# (configs/shakespeare-large.toml, 22 M): on 1 worker, 2 data-parallel workers, 2 tensor-parallel
# ranks (tp2, model.tp_pieces = 2) and, on the large config, 2 data-parallel workers at ZeRO 1, 2
# and 3.
#
# Figures come from each run's summary.json (`ranks[i].memory`: model state counted from the
# buffers the training loop holds, peak resident = the worker's VmHWM). Each run is short (STEPS
# steps, then the end-of-run validation pass, where resident memory used to climb) and writes no
# checkpoint. With BASELINE_BIN set to an older `lockstep` binary (one without memory figures),
# each run is repeated with it under /usr/bin/time -v for a before/after comparison (its maximum
# resident set over the launcher and its workers). ONLY=regex keeps the runs whose name matches.
#
# usage: scripts/bench-memory.sh [OUT.json] [STEPS]   (build first: cargo build --workspace; set
#        BIN_DIR=target/release after a release build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/bench/memory.json}
steps=${2:-4}
bin=${BIN_DIR:-$root/target/debug}/lockstep
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
runs=()
d512=(--set model.d_model=512 --set model.heads=8 --set model.blocks=6 --set model.d_ff=2048)
tp2=(--set model.tp_pieces=2 --set parallel.tp=2)
# name | config | workers | extra settings (a bash array's name)
none=()
zero1=(--set parallel.zero=1)
zero2=(--set parallel.zero=2)
zero3=(--set parallel.zero=3)
d512tp2=("${d512[@]}" "${tp2[@]}")
plan=(
    "shakespeare-1 shakespeare 1 none" "shakespeare-2 shakespeare 2 none"
    "shakespeare-tp2 shakespeare 2 tp2"
    "shakespeare-d512-1 shakespeare 1 d512" "shakespeare-d512-tp2 shakespeare 2 d512tp2"
    "shakespeare-large-1 shakespeare-large 1 none" "shakespeare-large-2 shakespeare-large 2 none"
    "shakespeare-large-tp2 shakespeare-large 2 tp2"
    "shakespeare-large-zero1 shakespeare-large 2 zero1"
    "shakespeare-large-zero2 shakespeare-large 2 zero2"
    "shakespeare-large-zero3 shakespeare-large 2 zero3"
)
for entry in "${plan[@]}"; do
    read -r name config n extra <<<"$entry"
    [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]] && continue
    declare -n sets="$extra"
    args=(train --config "$root/configs/$config.toml" --nproc "$n" --threads-per-worker 1
          --set train.steps="$steps" --set checkpoint.every=0 --set parallel.pp=1 "${sets[@]}")
    unset -n sets
    start=$(date +%s%N)
    "$bin" "${args[@]}" --out "$work/$name" >"$work/$name.log" 2>&1 ||
        { cat "$work/$name.log" >&2; exit 1; }
    secs=$(( ($(date +%s%N) - start) / 1000000 ))
    before=""
    if [[ -n "${BASELINE_BIN:-}" ]]; then
        /usr/bin/time -v "$BASELINE_BIN" "${args[@]}" --out "$work/$name-before" \
            >"$work/$name-before.log" 2>&1 || { cat "$work/$name-before.log" >&2; exit 1; }
        before=$(awk -F': ' '/Maximum resident set size/ {printf "%d", $2 * 1024}' "$work/$name-before.log")
    fi
    echo "$name: ${secs} ms${before:+, baseline peak $before bytes}" >&2
    runs+=("$name" "$config" "$n" "$extra" "$work/$name/summary.json" "$secs" "${before:-0}")
done
python3 - "$out" "$steps" "${runs[@]}" <<'PY'
import json, platform, subprocess, sys
out, steps, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
GIB = 1 << 30
def state(m):
    return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["activation_peak_bytes"]
results = []
LAYOUT = {"none": "dp2", "d512": "dp2", "tp2": "tp2", "d512tp2": "tp2", "zero1": "dp2 zero 1",
          "zero2": "dp2 zero 2", "zero3": "dp2 zero 3"}
for i in range(0, len(rest), 7):
    name, config, n, extra, path, ms, before = rest[i:i + 7]
    n, ms, before = int(n), int(ms), int(before)
    s = json.load(open(path))
    ranks = []
    for r in s["ranks"]:
        m = r["memory"]
        bound = int(1.5 * state(m)) + (512 << 20)
        ranks.append({"rank": r["rank"], **m, "model_state_bytes": state(m), "bound_bytes": bound,
                      "within_bound": m["peak_rss_bytes"] <= bound,
                      "peak_over_bound": round(m["peak_rss_bytes"] / bound, 3)})
    layout = "one worker" if n == 1 else LAYOUT[extra]
    row = {"name": name, "config": f"configs/{config}.toml"
           + (" with d_model 512, 8 heads, 6 blocks, d_ff 2048" if extra.startswith("d512") else ""),
           "layout": layout, "workers": n, "steps": s["steps"],
           "wall_seconds": round(ms / 1000, 1), "param_hash": s["param_hash"], "ranks": ranks}
    if before:
        row["baseline_peak_rss_bytes_max_over_processes"] = before
    results.append(row)
    for k in ranks:
        print(f'{name} rank {k["rank"]}: peak {k["peak_rss_bytes"] / GIB:.3f} GiB, '
              f'state {k["model_state_bytes"] / GIB:.3f} GiB, goal {k["bound_bytes"] / GIB:.3f} GiB'
              f'{", baseline " + format(before / GIB, ".3f") + " GiB" if before else ""}',
              file=sys.stderr)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
res = {
    "what": "peak resident memory per worker (VmHWM) vs the goal 1.5 × model state + 0.5 GiB; "
            "model state = parameters + gradients + optimizer state + peak activations, per rank",
    "steps_per_run": steps,
    "machine": f"{platform.machine()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
    "commit": commit,
    "all_within_bound": all(k["within_bound"] for r in results for k in r["ranks"]),
    "runs": results,
}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps({"all_within_bound": res["all_within_bound"]}))
PY

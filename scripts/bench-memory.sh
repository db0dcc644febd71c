#!/usr/bin/env bash
# Memory that is used, not held: peak resident memory per worker against the goal
# 1.5 × (parameters + gradients + optimizer state + peak activations) + 0.5 GiB, and the model-state
# bytes per rank, for the default Shakespeare transformer (0.82 M parameters) and the large one
# (configs/shakespeare-large.toml, 22 M), on 1 and 2 workers (data parallel).
#
# Figures come from each run's summary.json (`ranks[i].memory`: model state counted from the
# buffers the training loop holds, peak resident = the worker's VmHWM). Each run is short (STEPS
# steps, then the end-of-run validation pass, where resident memory used to climb) and writes no
# checkpoint. With BASELINE_BIN set to an older `lockstep` binary (one without memory figures),
# each run is repeated with it under /usr/bin/time -v for a before/after comparison (its maximum
# resident set over the launcher and its workers).
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
for config in shakespeare shakespeare-large; do
    for n in 1 2; do
        name="$config-$n"
        args=(train --config "$root/configs/$config.toml" --nproc "$n" --threads-per-worker 1
              --set train.steps="$steps" --set checkpoint.every=0 --set parallel.pp=1)
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
        runs+=("$config" "$n" "$work/$name/summary.json" "$secs" "${before:-0}")
    done
done
python3 - "$out" "$steps" "${runs[@]}" <<'PY'
import json, platform, subprocess, sys
out, steps, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
GIB = 1 << 30
def state(m):
    return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["activation_peak_bytes"]
results = []
for i in range(0, len(rest), 5):
    config, n, path, ms, before = rest[i], int(rest[i + 1]), rest[i + 2], int(rest[i + 3]), int(rest[i + 4])
    s = json.load(open(path))
    ranks = []
    for r in s["ranks"]:
        m = r["memory"]
        bound = int(1.5 * state(m)) + (512 << 20)
        ranks.append({"rank": r["rank"], **m, "model_state_bytes": state(m), "bound_bytes": bound,
                      "within_bound": m["peak_rss_bytes"] <= bound,
                      "peak_over_bound": round(m["peak_rss_bytes"] / bound, 3)})
    row = {"config": f"configs/{config}.toml", "workers": n, "steps": s["steps"],
           "wall_seconds": round(ms / 1000, 1), "param_hash": s["param_hash"], "ranks": ranks}
    if before:
        row["baseline_peak_rss_bytes_max_over_processes"] = before
    results.append(row)
    for k in ranks:
        print(f'{config} × {n} rank {k["rank"]}: peak {k["peak_rss_bytes"] / GIB:.3f} GiB, '
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

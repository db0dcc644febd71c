#!/usr/bin/env bash
# Validates `lockstep plan` on two simulated hosts: network namespaces lpA$$ (10.78.0.1) and lpB$$
# (10.78.0.2) joined by a veth pair whose both ends are shaped with tc tbf (burst 256 KiB), plus a
# one-way latency per TCP message added by the transport's test-only delay
# (LOCKSTEP_TEST_LATENCY_US; this kernel has no netem).
#
# Cases: data-parallel dp = 2 (1 worker per host) and dp = 4 (2 per host) of
# configs/bench-mlp784.toml at RATE (default 1 Gbit/s), and a 2-stage pipeline (dp 1 × pp 2, one
# worker per host) of configs/shakespeare.toml with 2 blocks at 100 Mbit/s, where activations
# rival compute; all with LATENCY (default 500 µs). Each case:
#   1. a calibration run on the *unshaped* link, same workers, same placement, so compute is
#      measured under the same CPU contention (what is validated is the communication model);
#   2. (data-parallel) the speed of the calibration run's own CPU-bound links, measured with
#      bench-collectives over loopback TCP at the same worker count and gradient size;
#   3. `lockstep plan` for the shaped cluster, calibrated from run 1;
#   4. the run on the shaped link; its median step (slowest rank, warm-up skipped) is compared
#      with the prediction. Exits 1 if a data-parallel case's |error| > 20% (the issue's check);
#      the pipeline case is reported, not gated (noisier: few long steps on 2 shared cores).
# A data-parallel case that misses is measured again (steps 1–4 afresh), up to seven attempts, and
# judged by the median of its errors over the attempts whose runs kept their CPU (the hypervisor
# stole at most 10% of it): attempts disturbed by other guests on a shared machine do not decide,
# a model that is wrong still fails. Every attempt is printed with its steal, so a miss can be read.
# Needs root. About 40 s with the release build. PLAN_VALIDATE_KEEP=DIR keeps the runs. Usage:
#   scripts/netns-plan-validate.sh [path/to/lockstep] [rate_gbit] [latency_us]
# Traffic stays between these two namespaces; nothing else is addressed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-}"
if [[ -z "$bin" ]]; then
    bin="$root/target/release/lockstep"
    [[ -x "$bin" ]] || bin="$root/target/debug/lockstep"
fi
bin="$(realpath "$bin")"
gbit="${2:-1}"
lat_us="${3:-500}"
pipe_gbit=0.1
burst_kib=256
limit="${PLAN_VALIDATE_LIMIT:-20}" # the check is 20; lower only to exercise the retries

work="$(mktemp -d)"
A=lpA$$ B=lpB$$ VA=lvA$$ VB=lvB$$
source "$root/scripts/lib/netns-pair.sh"
cleanup() {
    netns_unpair "$A" "$B"
    if [[ -n "${PLAN_VALIDATE_KEEP:-}" ]]; then
        mkdir -p "$PLAN_VALIDATE_KEEP" && cp -r "$work"/. "$PLAN_VALIDATE_KEEP"/
    fi
    rm -rf "$work"
}
trap cleanup EXIT

netns_pair "$A" "$B" "$VA" "$VB" 10.78.0

shape() { # RATE_GBIT
    ip netns exec "$A" tc qdisc replace dev "$VA" root tbf rate "${1}gbit" burst "${burst_kib}kb" latency 200ms
    ip netns exec "$B" tc qdisc replace dev "$VB" root tbf rate "${1}gbit" burst "${burst_kib}kb" latency 200ms
}
unshape() {
    ip netns exec "$A" tc qdisc del dev "$VA" root 2>/dev/null || true
    ip netns exec "$B" tc qdisc del dev "$VB" root 2>/dev/null || true
}

secret="$("$bin" secret)"
port=$((20000 + $$ % 20000))
# cpu_times: the machine's "steal total" CPU ticks so far (/proc/stat); steal_since BEFORE: the
# percentage of CPU time since BEFORE that the hypervisor gave to other guests. A run that lost
# much of its CPU is slower than any model of its links says: the table shows it per attempt.
cpu_times() { awk '/^cpu /{print $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }
steal_since() {
    local s0 t0 s1 t1
    read -r s0 t0 <<<"$1"
    read -r s1 t1 < <(cpu_times)
    echo $(( 100 * (s1 - s0) / (t1 - t0 + 1) ))
}
# run_job NAME WORKERS_PER_HOST LATENCY_US CONFIG [--set ...]: one job over both hosts; the run
# directory is $work/NAME.
run_job() {
    local name="$1" npn="$2" lat="$3" config="$4"
    shift 4
    port=$((port + 1))
    local sets=(--config "$config" --threads-per-worker 1 --set checkpoint.every=0
        --set train.eval_every=0 --set dist.timeout_secs=60 "$@")
    LOCKSTEP_TEST_LATENCY_US="$lat" LOCKSTEP_SECRET="$secret" ip netns exec "$A" "$bin" train \
        --nproc "$npn" --nnodes 2 --node-rank 0 --rdzv "10.78.0.1:$port" --out "$work/$name" \
        "${sets[@]}" >"$work/$name.a.log" 2>&1 &
    local pa=$!
    LOCKSTEP_TEST_LATENCY_US="$lat" LOCKSTEP_SECRET="$secret" ip netns exec "$B" "$bin" train \
        --nproc "$npn" --nnodes 2 --node-rank 1 --rdzv "10.78.0.1:$port" --out "$work/$name-b" \
        "${sets[@]}" >"$work/$name.b.log" 2>&1 &
    local pb=$! status=0 before
    before="$(cpu_times)"
    wait "$pa" || status=$?
    wait "$pb" || status=$?
    steal_since "$before" >"$work/$name.steal"
    if [[ $status -ne 0 ]]; then
        echo "netns-plan: run $name failed"; cat "$work/$name.a.log" "$work/$name.b.log"; exit 1
    fi
}
# json FILE EXPR: evaluate a Python expression over the parsed file `d`.
json() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"d": d}))' "$@"; }

# Other work on the machine slows the CPU-bound calibration runs more than the network-bound
# shaped runs: say so when the CPUs are busy before we start (idle share over one second).
idle() { awk '/^cpu /{print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8}' /proc/stat; }
read -r i0 t0 < <(idle); sleep 1; read -r i1 t1 < <(idle)
busy=$(( 100 - 100 * (i1 - i0) / (t1 - t0 + 1) ))
if (( busy > 25 )); then
    echo "netns-plan: warning: the CPUs are ${busy}% busy before the runs start; other load skews the errors"
fi
echo "netns-plan: 2 hosts joined by a veth shaped with tbf (burst ${burst_kib} KiB), ${lat_us} µs emulated latency per message; $bin"

rows=()
# case_ CASE ATTEMPT LAYOUT WORKERS_PER_HOST RATE_GBIT CONFIG [--set ...]
case_() {
    local case="$1" attempt="$2" layout="$3" npn="$4" rate="$5" config="$6"
    shift 6
    local name="$case-$attempt"
    unshape
    run_job "calib-$name" "$npn" 0 "$config" "$@"
    shape "$rate"
    run_job "shaped-$name" "$npn" "$lat_us" "$config" "$@"
    unshape
    local cluster=(--nodes 2 --workers-per-node "$npn" --link-gbps "$rate" --link-latency-us "$lat_us"
        --link-burst-kib "$burst_kib" --intra-latency-us "$((12 + lat_us))" --layouts "$layout")
    local calib=()
    if [[ "$layout" != *x* ]]; then
        # The calibration run's links: loopback TCP at the same worker count and gradient size.
        "$bin" plan --from "$work/calib-$name" "${cluster[@]}" --json "$work/first-$name.json" >/dev/null 2>&1
        local bytes
        bytes="$(json "$work/first-$name.json" "(8 if d['workload']['reproducible'] else 4) * d['workload']['params']")"
        "$bin" bench-collectives --nproc "$((2 * npn))" --transport tcp --op all_reduce --sizes "$bytes" \
            --json "$work/bench-$name.json" >"$work/bench-$name.log" 2>&1 || { cat "$work/bench-$name.log"; exit 1; }
        calib=(--calib-gbytes-per-s "$(json "$work/bench-$name.json" "d['rows'][0]['busbw_gbps']")")
    fi
    "$bin" plan --from "$work/calib-$name" "${cluster[@]}" "${calib[@]}" \
        --json "$work/plan-$name.json" >"$work/plan-$name.txt" 2>&1 || { cat "$work/plan-$name.txt"; exit 1; }
    # The shaped run's own median step, measured the same way (the calibration block of a plan).
    "$bin" plan --from "$work/shaped-$name" "${cluster[@]}" --json "$work/measured-$name.json" >/dev/null 2>&1
    rows+=("$case $attempt $npn $rate $work/plan-$name.json $work/measured-$name.json $(cat "$work/calib-$name.steal")/$(cat "$work/shaped-$name.steal")")
    sed 's/^/    /' "$work/plan-$name.txt"
}

mlp="$root/configs/bench-mlp784.toml"
# data_parallel CASE ATTEMPT: one attempt at a gated case.
data_parallel() {
    case "$1" in
        dp2) case_ dp2 "$2" 2 1 "$gbit" "$mlp" --set train.steps=60 ;;
        dp4) case_ dp4 "$2" 4 2 "$gbit" "$mlp" --set train.steps=60 ;;
    esac
}
data_parallel dp2 1
data_parallel dp4 1
case_ pp2 1 1x2 1 "$pipe_gbit" "$root/configs/shakespeare.toml" --set train.steps=20 \
    --set model.blocks=2 --set parallel.pp=2 --set parallel.dp=1 --set parallel.microbatches=4

# judge MODE: MODE "missed" prints CASE:ATTEMPTS for each gated case that needs another attempt;
# MODE "table" prints every attempt and exits 1 if a gated case's median error exceeds the limit.
# An attempt counts when the hypervisor stole at most STEAL_LIMIT % of the CPU during both of its
# runs (a run that lost a fifth of its CPU is slower than any model of its links says: one such
# CI attempt measured dp 4 at -26%); a case is judged by the median over its counted attempts,
# or over all of them when none counted after MAX_ATTEMPTS.
judge() {
    python3 - "$1" "$limit" "$lat_us" "${rows[@]}" <<'PY'
import json, statistics, sys
mode, limit, lat = sys.argv[1], float(sys.argv[2]), sys.argv[3]
MAX_ATTEMPTS, STEAL_LIMIT = 7, 10
attempts, counted = {}, {}
lines = []
for row in sys.argv[4:]:
    case, attempt, npn, rate, plan_path, meas_path, steal = row.split()
    p, m = json.load(open(plan_path)), json.load(open(meas_path))
    pred = p["predictions"][0]
    meas = m["calibration"]["measured_step_s"]
    err = 100.0 * (pred["step_s"] / meas - 1.0)
    clean = max(int(x) for x in steal.split("/")) <= STEAL_LIMIT
    attempts.setdefault(case, []).append(err)
    counted.setdefault(case, [])
    if clean:
        counted[case].append(err)
    comm = pred["sync_cpu_s"] + pred["network_s"] + pred["p2p_s"]
    layout = f"{pred['layout']['dp']}x{pred['layout']['pp']}"
    link = f"{float(rate):g}G/{lat}us"
    lines.append(f"{layout:<10} {attempt:>7} {npn:>8} {link:>13} "
                 f"{p['calibration']['measured_step_s']*1e3:>9.2f} {pred['step_s']*1e3:>8.2f} "
                 f"{pred['compute_s']*1e3:>8.2f} {comm*1e3:>7.2f} {pred['bubble_s']*1e3:>7.2f} "
                 f"{meas*1e3:>8.2f} {err:>+6.1f}% {steal + '%':>9}"
                 # The data-parallel cases are the check; the pipeline case (fewer, longer steps
                 # on a slow link, noisier on 2 shared cores) is reported alongside.
                 + ("" if case.startswith("dp") else "  (reported, not gated)")
                 + ("" if clean else f"  (not counted: over {STEAL_LIMIT}% stolen)"))
judged = {c: counted[c] or attempts[c] for c in attempts if c.startswith("dp")}
medians = {c: statistics.median(e) for c, e in judged.items()}
if mode == "missed":
    print(" ".join(f"{c}:{len(attempts[c])}" for c in judged
                   if (not counted[c] or abs(medians[c]) > limit)
                   and len(attempts[c]) < MAX_ATTEMPTS))
    sys.exit(0)
print(f"{'layout':<10} {'attempt':>7} {'per host':>8} {'link':>13} {'calib_ms':>9} {'pred_ms':>8} "
      f"{'compute':>8} {'comm':>7} {'bubble':>7} {'meas_ms':>8} {'error':>7} {'stolen':>9}")
print("(stolen: CPU time the hypervisor gave to other guests during the calibration/shaped runs)")
print("\n".join(lines))
for c, e in judged.items():
    if len(attempts[c]) > 1:
        what = "counted" if counted[c] else "(none counted: every one)"
        print(f"netns-plan: {c}: median error over {len(e)} {what} attempt(s) {medians[c]:+.1f}%")
worst = max(abs(m) for m in medians.values())
if worst > limit:
    print(f"netns-plan: FAILED: a data-parallel error of {worst:.1f}% exceeds {limit:.0f}%")
    sys.exit(1)
print(f"netns-plan: ok: predicted data-parallel steps within {limit:.0f}% of measured (worst {worst:.1f}%)")
PY
}

while missed="$(judge missed)" && [[ -n "$missed" ]]; do
    for c in $missed; do
        n="${c#*:}" c="${c%:*}"
        echo "netns-plan: $c: after $n attempt(s), no counted one or their median misses ${limit}%: measuring it again"
        data_parallel "$c" $((n + 1))
    done
done
judge table

#!/usr/bin/env bash
# Two simulated hosts on this machine: network namespaces lsA (10.77.0.1) and lsB (10.77.0.2) joined
# by a veth pair. (1) Runs the same digits job split over both "hosts" (TCP between them, since each
# namespace is its own host to lockstep) and checks that its param_hash equals a one-host run's.
# (2) Runs a 4-stage transformer pipeline across both hosts and checks it against one worker.
# (3) Cuts the link mid-run and checks every worker fails within 2× the timeout, naming a rank.
# Needs root. Usage: scripts/netns-two-hosts.sh path/to/lockstep [rate]   (rate e.g. 1gbit: tbf shaping)
# Traffic stays between these two namespaces; nothing else is addressed.
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep [rate]}")"
rate="${2:-}"
work="$(mktemp -d)"
A=lsA$$ B=lsB$$
source "$(dirname "$0")/lib/netns-pair.sh"
cleanup() {
    netns_unpair "$A" "$B"
    rm -rf "$work"
}
trap cleanup EXIT

netns_pair "$A" "$B" "vA$$" "vB$$" 10.77.0
if [[ -n "$rate" ]]; then
    ip netns exec "$A" tc qdisc add dev "vA$$" root tbf rate "$rate" burst 256kb latency 50ms
    ip netns exec "$B" tc qdisc add dev "vB$$" root tbf rate "$rate" burst 256kb latency 50ms
fi

secret="$("$bin" secret)"
sets=(--set train.steps=40 --set dist.timeout_secs=30)
port=29611
echo "netns: two hosts, 2 workers each, rendezvous at 10.77.0.1:$port"
LOCKSTEP_SECRET="$secret" ip netns exec "$A" "$bin" train --nproc 2 --nnodes 2 --node-rank 0 \
    --rdzv "10.77.0.1:$port" --out "$work/two-hosts" "${sets[@]}" >"$work/a.log" 2>&1 &
pa=$!
LOCKSTEP_SECRET="$secret" ip netns exec "$B" "$bin" train --nproc 2 --nnodes 2 --node-rank 1 \
    --rdzv "10.77.0.1:$port" --out "$work/two-hosts-b" "${sets[@]}" >"$work/b.log" 2>&1 &
pb=$!
status=0
wait "$pa" || status=$?
wait "$pb" || status=$?
if [[ $status -ne 0 ]]; then
    echo "netns: two-host run failed"; echo "--- host A"; cat "$work/a.log"; echo "--- host B"; cat "$work/b.log"
    exit 1
fi
"$bin" train --nproc 1 --out "$work/one-host" "${sets[@]}" >"$work/one.log" 2>&1 || { cat "$work/one.log"; exit 1; }

hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
transport_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["transport"])' "$1"; }
h2="$(hash_of "$work/two-hosts/summary.json")"
h1="$(hash_of "$work/one-host/summary.json")"
t2="$(transport_of "$work/two-hosts/summary.json")"
echo "netns: two hosts × 2 workers ($t2): $h2"
echo "netns: one host  × 1 worker       : $h1"
[[ "$t2" == tcp ]] || { echo "netns: expected the tcp transport between hosts, got $t2"; exit 1; }
[[ "$h1" == "$h2" ]] || { echo "netns: FAILED: param_hash differs between one host and two hosts"; exit 1; }
echo "netns: ok: same param_hash on one host and on two hosts"

# A 4-stage pipeline across the two hosts (stages 0-1 on A, 2-3 on B: activations and gradients
# cross the link over TCP, 1F1B's combined send/receive included) against one worker.
pipe_sets=(--config "$(dirname "$0")/../configs/shakespeare.toml" --set model.d_model=32 --set model.heads=2
    --set model.blocks=2 --set model.context=16 --set model.d_ff=64 --set train.global_batch=8
    --set parallel.microbatches=4 --set train.steps=6 --set train.eval_every=3 --set dist.timeout_secs=30)
port=29613
LOCKSTEP_SECRET="$secret" ip netns exec "$A" "$bin" train --nproc 2 --nnodes 2 --node-rank 0 \
    --rdzv "10.77.0.1:$port" --out "$work/pipe-a" "${pipe_sets[@]}" --set parallel.pp=4 >"$work/pa.log" 2>&1 &
pa=$!
LOCKSTEP_SECRET="$secret" ip netns exec "$B" "$bin" train --nproc 2 --nnodes 2 --node-rank 1 \
    --rdzv "10.77.0.1:$port" --out "$work/pipe-b" "${pipe_sets[@]}" --set parallel.pp=4 >"$work/pb.log" 2>&1 &
pb=$!
status=0
wait "$pa" || status=$?
wait "$pb" || status=$?
if [[ $status -ne 0 ]]; then
    echo "netns: two-host pipeline failed"; echo "--- host A"; cat "$work/pa.log"; echo "--- host B"; cat "$work/pb.log"
    exit 1
fi
"$bin" train --nproc 1 --out "$work/pipe-one" "${pipe_sets[@]}" --set parallel.pp=1 >"$work/pone.log" 2>&1 || { cat "$work/pone.log"; exit 1; }
hp="$(hash_of "$work/pipe-a/summary.json")"
h1p="$(hash_of "$work/pipe-one/summary.json")"
echo "netns: 4-stage pipeline on two hosts: $hp"
echo "netns: one worker, no pipeline        : $h1p"
[[ "$hp" == "$h1p" ]] || { echo "netns: FAILED: the two-host pipeline's param_hash differs"; exit 1; }
echo "netns: ok: a pipeline across hosts gives the one-worker bits"

# Cut the link between the hosts mid-run: both hosts must end within 2× the timeout (the node
# agents' heartbeat timeout = the collective timeout here), each naming what it lost; nothing may hang.
timeout_secs=3
cut_sets=(--set train.steps=1000000 --set "dist.timeout_secs=$timeout_secs" --set checkpoint.every=0)
port=29612
LOCKSTEP_SECRET="$secret" ip netns exec "$A" "$bin" train --nproc 2 --nnodes 2 --node-rank 0 \
    --rdzv "10.77.0.1:$port" --out "$work/cut-a" --heartbeat-timeout "$timeout_secs" "${cut_sets[@]}" >"$work/cut-a.log" 2>&1 &
pa=$!
LOCKSTEP_SECRET="$secret" ip netns exec "$B" "$bin" train --nproc 2 --nnodes 2 --node-rank 1 \
    --rdzv "10.77.0.1:$port" --out "$work/cut-b" --heartbeat-timeout "$timeout_secs" "${cut_sets[@]}" >"$work/cut-b.log" 2>&1 &
pb=$!
for _ in $(seq 100); do grep -q "step 50/" "$work/cut-a.log" 2>/dev/null && break; sleep 0.1; done
grep -q "step 50/" "$work/cut-a.log" || { echo "netns: the cut-link job never got going"; cat "$work/cut-a.log" "$work/cut-b.log"; exit 1; }
cut_at=$(date +%s.%N)
ip -n "$A" link set "vA$$" down
deadline=$(( $(date +%s) + 2 * timeout_secs + 5 ))
for p in $pa $pb; do
    while kill -0 "$p" 2>/dev/null && (( $(date +%s) < deadline )); do sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then
        echo "netns: FAILED: a launcher still runs $((2 * timeout_secs + 5)) s after the link was cut"
        kill -9 $pa $pb 2>/dev/null; cat "$work/cut-a.log" "$work/cut-b.log"; exit 1
    fi
done
elapsed=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$cut_at")
wait $pa && { echo "netns: FAILED: host A's job succeeded despite the cut"; exit 1; }
wait $pb && { echo "netns: FAILED: host B's job succeeded despite the cut"; exit 1; }
# Each side names the other: host A's agent the node whose heartbeat stopped, host B's agent the
# store on node 0 it can no longer reach (or, if its workers timed out first, the rank they
# waited for).
grep -Eq "node 1 \([^)]*\) lost \(no heartbeat for [0-9.]+s\)" "$work/cut-a.log" || {
    echo "netns: FAILED: host A does not name the lost node 1"; cat "$work/cut-a.log"; exit 1; }
grep -Eq "store at 10\.77\.0\.1:[0-9]+ \(node 0 \([^)]*\)\) does not answer|timed out after [0-9.]+s waiting for rank [0-9]+ \(" "$work/cut-b.log" || {
    echo "netns: FAILED: host B names neither the lost store on node 0 nor a rank"; cat "$work/cut-b.log"; exit 1; }
echo "netns: ok: link cut detected on both hosts within ${elapsed}s (heartbeat and collective timeout ${timeout_secs}s):"
grep -hEo "node 1 \([^)]*\) lost \(no heartbeat for [0-9.]+s\)|store at [0-9.:]+ \(node 0 \([^)]*\)\) does not answer|timed out after [0-9.]+s waiting for rank [0-9]+ \([^)]*\)" "$work/cut-a.log" "$work/cut-b.log" | sort -u | head -4
echo "netns: 3 passed, 0 failed"

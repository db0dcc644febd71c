#!/usr/bin/env bash
# Two simulated hosts on this machine: network namespaces lsA (10.77.0.1) and lsB (10.77.0.2) joined
# by a veth pair. Runs the same digits job split over both "hosts" (TCP between them, since each
# namespace is its own host to lockstep) and checks that its param_hash equals a one-host run's.
# Needs root. Usage: scripts/netns-two-hosts.sh path/to/lockstep [rate]   (rate e.g. 1gbit: tbf shaping)
# Traffic stays between these two namespaces; nothing else is addressed.
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep [rate]}")"
rate="${2:-}"
work="$(mktemp -d)"
A=lsA$$ B=lsB$$
cleanup() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

ip netns add "$A"
ip netns add "$B"
ip link add "vA$$" type veth peer name "vB$$"
ip link set "vA$$" netns "$A"
ip link set "vB$$" netns "$B"
ip -n "$A" addr add 10.77.0.1/24 dev "vA$$"
ip -n "$B" addr add 10.77.0.2/24 dev "vB$$"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "vA$$" up
ip -n "$B" link set "vB$$" up
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
echo "netns: 1 passed, 0 failed"

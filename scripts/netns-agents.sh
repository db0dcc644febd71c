#!/usr/bin/env bash
# Node agents across two simulated hosts (network namespaces lsA 10.78.0.1 and lsB 10.78.0.2):
# (1) SIGKILL a worker on host B at a random step: both hosts' agents stop their workers and
#     restart together from the last checkpoint; the run ends with the fault-free param_hash and
#     restarts = 1, and host A's summary blames the killed rank on host B.
# (2) Agents that disagree on the restart policy are refused before any worker starts (exit 3,
#     naming the node).
# (3) A worker on host B hung outside any collective is found by its heartbeat (not by a 60 s
#     collective timeout), named, and both hosts restart to the fault-free bits.
# (4) A worker stuck inside a user's dataset (the test job `lockstep-testjob`, built next to
#     lockstep, whose read of one training sample hangs once) is found the same way, named, and
#     both hosts recover to the bits of a run whose data never hung.
# Needs root. Usage: scripts/netns-agents.sh path/to/lockstep
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep}")"
work="$(mktemp -d)"
A=laA$$ B=laB$$
source "$(dirname "$0")/lib/netns-pair.sh"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    netns_unpair "$A" "$B"
    [[ -n "${KEEP:-}" ]] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
netns_pair "$A" "$B" "vA$$" "vB$$" 10.78.0
secret="$("$bin" secret)"
passed=0
hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
field() { python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"s": v}))' "$1" "$2"; }

testjob="$(dirname "$bin")/lockstep-testjob"
[[ -x "$testjob" ]] || { echo "agents: FAILED: $testjob is missing (cargo build -p lockstep-testjobs)"; exit 1; }

# Both agents of one job ($run, default lockstep); $1 = case name, then extra arguments for both.
start_pair() {
    local name="$1" port="$2"; shift 2
    LOCKSTEP_SECRET="$secret" ip netns exec "$A" "${run:-$bin}" train --nproc 2 --nnodes 2 --node-rank 0 \
        --rdzv "10.78.0.1:$port" --out "$work/$name-a" "$@" >"$work/$name-a.log" 2>&1 &
    pa=$!
    LOCKSTEP_SECRET="$secret" ip netns exec "$B" "${run:-$bin}" train --nproc 2 --nnodes 2 --node-rank 1 \
        --rdzv "10.78.0.1:$port" --out "$work/$name-b" "$@" >"$work/$name-b.log" 2>&1 &
    pb=$!
    pids+=("$pa" "$pb")
}
show_logs() { echo "--- host A"; cat "$work/$1-a.log"; echo "--- host B"; cat "$work/$1-b.log"; }

# (1) A SIGKILLed worker on host B.
sets=(--set train.steps=150 --set checkpoint.every=10 --set dist.timeout_secs=20)
"$bin" train --nproc 1 --out "$work/one" "${sets[@]}" >"$work/one.log" 2>&1 || { cat "$work/one.log"; exit 1; }
victim=$(( 2 + RANDOM % 2 ))
kill_step=$(( 15 + RANDOM % 100 ))
start_pair kill 29621 "${sets[@]}" --max-restarts 2 --heartbeat-timeout 5 --inject "slow:rank=0,factor=4"
metrics="$work/kill-a/metrics.jsonl"
for _ in $(seq 600); do
    [[ -f "$metrics" ]] && (( $(wc -l <"$metrics") >= kill_step )) && break
    sleep 0.05
done
target=""
for p in $(pgrep -f -- "--out $work/kill-b" || true); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "LOCKSTEP_RANK=$victim"; then target=$p; fi
done
[[ -n "$target" ]] || { echo "agents: FAILED: no running worker rank $victim on host B at step $kill_step"; show_logs kill; exit 1; }
reached=$(wc -l <"$metrics")
kill -9 "$target"
status=0
wait "$pa" || status=$?
wait "$pb" || status=$((status + $?))
[[ $status -eq 0 ]] || { echo "agents: FAILED: a host's job failed after the kill"; show_logs kill; exit 1; }
h1="$(hash_of "$work/one/summary.json")"
h2="$(hash_of "$work/kill-a/summary.json")"
restarts="$(field "$work/kill-a/summary.json" 's["restarts"]')"
blamed="$(field "$work/kill-a/summary.json" 's["failures"][0]["rank"]')"
what="$(field "$work/kill-a/summary.json" 's["failures"][0]["what"]')"
echo "agents: killed rank $victim on host B after step $reached: restarts=$restarts, blamed rank $blamed ($what)"
echo "agents: fault-free one worker: $h1"
echo "agents: two hosts, restarted : $h2"
[[ "$restarts" == 1 ]] || { echo "agents: FAILED: expected restarts = 1"; show_logs kill; exit 1; }
[[ "$blamed" == "$victim" && "$what" == *SIGKILL* ]] || { echo "agents: FAILED: host A's summary does not blame the killed rank"; show_logs kill; exit 1; }
[[ "$h1" == "$h2" ]] || { echo "agents: FAILED: param_hash differs from the fault-free run"; show_logs kill; exit 1; }
grep -q "restart 1/2" "$work/kill-b.log" || { echo "agents: FAILED: host B did not restart with host A"; show_logs kill; exit 1; }
echo "agents: ok: both hosts restarted together and reached the fault-free bits"
passed=$((passed + 1))

# (3) A worker on host B hung outside any collective (the injected hang, at the start of its step):
#     its agent finds it by its heartbeat long before the 60 s collective timeout, and both hosts
#     restart together to the fault-free bits.
start_pair hang 29623 "${sets[@]}" --set dist.timeout_secs=60 --max-restarts 1 --stall-timeout 3 \
    --inject "hang:rank=3,step=40"
status=0
wait "$pa" || status=$?
wait "$pb" || status=$((status + $?))
[[ $status -eq 0 ]] || { echo "agents: FAILED: a host's job failed after the hang"; show_logs hang; exit 1; }
h3="$(hash_of "$work/hang-a/summary.json")"
what="$(field "$work/hang-a/summary.json" 's["failures"][0]["what"]')"
blamed="$(field "$work/hang-a/summary.json" 's["failures"][0]["rank"]')"
took="$(field "$work/hang-a/summary.json" 's["failures"][0]["detection_seconds"]')"
echo "agents: hung rank 3 on host B: blamed rank $blamed ($what), detected after ${took}s"
[[ "$blamed" == 3 && "$what" == *"outside any collective"* ]] || { echo "agents: FAILED: the hung rank is not named"; show_logs hang; exit 1; }
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 6 else 1)" "$took" || { echo "agents: FAILED: detection took more than 2 × the 3 s stall timeout"; exit 1; }
[[ "$h3" == "$h1" ]] || { echo "agents: FAILED: param_hash after the hang differs from the fault-free run"; show_logs hang; exit 1; }
echo "agents: ok: a hang outside collectives on host B found by heartbeat, both hosts recovered, same bits"
passed=$((passed + 1))

# (4) A worker hung in data loading: the test job's read of training sample 37 never returns
#     (once: the marker file is created as it hangs), on whichever host reads it.
"$testjob" train --nproc 1 --out "$work/tj-one" >"$work/tj-one.log" 2>&1 || { cat "$work/tj-one.log"; exit 1; }
export LOCKSTEP_TESTJOB_HANG_ONCE="$work/hang-once"
run="$testjob" start_pair data 29624 --set 'job.misbehave="hang-in-data"' --set dist.timeout_secs=60 \
    --max-restarts 1 --stall-timeout 3
unset LOCKSTEP_TESTJOB_HANG_ONCE
status=0
wait "$pa" || status=$?
wait "$pb" || status=$((status + $?))
[[ $status -eq 0 ]] || { echo "agents: FAILED: a host's job failed after the hang in data loading"; show_logs data; exit 1; }
what="$(field "$work/data-a/summary.json" 's["failures"][0]["what"]')"
blamed="$(field "$work/data-a/summary.json" 's["failures"][0]["rank"]')"
took="$(field "$work/data-a/summary.json" 's["failures"][0]["detection_seconds"]')"
host=$(( blamed < 2 ? 0 : 1 )); log="$work/data-$([[ $host == 0 ]] && echo a || echo b).log"
echo "agents: rank $blamed hung reading its data on host $([[ $host == 0 ]] && echo A || echo B): named ($what), detected after ${took}s"
grep -q "reading training sample 37 hangs" "$log" && [[ "$what" == *"outside any collective"* ]] || { echo "agents: FAILED: the hang in data loading is not named"; show_logs data; exit 1; }
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 6 else 1)" "$took" || { echo "agents: FAILED: detection took more than 2 × the 3 s stall timeout"; exit 1; }
[[ "$(hash_of "$work/data-a/summary.json")" == "$(hash_of "$work/tj-one/summary.json")" ]] || { echo "agents: FAILED: param_hash after the hang differs from the one-worker run"; show_logs data; exit 1; }
[[ "$(field "$work/data-a/summary.json" 's["restarts"]')" == 1 ]] || { echo "agents: FAILED: expected restarts = 1"; show_logs data; exit 1; }
echo "agents: ok: a hang in data loading found by heartbeat, named, both hosts recovered, same bits"
passed=$((passed + 1))

# (2) Agents that disagree on --max-restarts: refused up front on both hosts, naming node 1.
LOCKSTEP_SECRET="$secret" ip netns exec "$A" "$bin" train --nproc 2 --nnodes 2 --node-rank 0 \
    --rdzv "10.78.0.1:29622" --out "$work/mis-a" --max-restarts 1 >"$work/mis-a.log" 2>&1 &
pa=$!
LOCKSTEP_SECRET="$secret" ip netns exec "$B" "$bin" train --nproc 2 --nnodes 2 --node-rank 1 \
    --rdzv "10.78.0.1:29622" --out "$work/mis-b" --max-restarts 2 >"$work/mis-b.log" 2>&1 &
pb=$!
pids+=("$pa" "$pb")
sa=0; sb=0
wait "$pa" || sa=$?
wait "$pb" || sb=$?
[[ $sa -eq 3 && $sb -eq 3 ]] || { echo "agents: FAILED: mismatched agents should exit 3 (got $sa, $sb)"; show_logs mis; exit 1; }
grep -q "node 1 (.*) runs --nproc 2 --max-restarts 2" "$work/mis-b.log" || { echo "agents: FAILED: the refusal does not name node 1"; show_logs mis; exit 1; }
grep -q "\[rank" "$work/mis-a.log" && { echo "agents: FAILED: a worker started despite the refusal"; show_logs mis; exit 1; }
echo "agents: ok: agents that disagree are refused before any worker starts (exit 3, node named)"
passed=$((passed + 1))

echo "agents: $passed passed, 0 failed"

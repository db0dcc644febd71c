#!/usr/bin/env bash
# Elastic nodes across three simulated hosts (network namespaces on one bridge: A 10.79.0.1,
# B 10.79.0.2, C 10.79.0.3), 2 workers each, --nnodes 2:3, heartbeat timeout 3 s:
# (1) host C's agent and workers are killed: the job goes on with A and B (world 6 -> 4); C's
#     agent is started again and admitted at the next checkpoint (world 4 -> 6); same bits as one
#     worker, both changes on the summary's membership timeline.
# (2) host C's link is cut: detected within 2 × the heartbeat timeout, the job goes on with A and
#     B to the same bits; C's agent ends naming the store it lost.
# (3) host A (node 0: the store, rank 0, the checkpoints) is killed. With the run directory on
#     storage every host reaches (one --out for all), the store moves to B, rank 0 with it, and the
#     job goes on with B and C to the same bits. With a run directory per host, B (the new leader)
#     cannot reach the checkpoints and ends the job by name; it is continued with --resume on B and
#     C from A's run directory, to the same bits.
# (4) chaos: 10 runs (one run directory for all hosts), each killing at a random step a random
#     worker on any host, or a whole host — B or C, started again half of the time, or A (the
#     store moves): every run ends with the fault-free bits.
# Needs root. Usage: scripts/netns-elastic-nodes.sh path/to/lockstep
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep}")"
work="$(mktemp -d)"
tag="le$$"
hosts=("${tag}A" "${tag}B" "${tag}C")
source "$(dirname "$0")/lib/netns-hosts.sh"
cleanup() {
    pkill -9 -f -- "--out $work/" 2>/dev/null || true
    pkill -9 -f -- "--resume $work/" 2>/dev/null || true
    netns_unhosts "$tag" "${hosts[@]}"
    [[ -n "${KEEP:-}" ]] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
netns_hosts "$tag" 10.79.0 "${hosts[@]}"
export LOCKSTEP_SECRET="$("$bin" secret)"
passed=0
hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
field() { python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"s": v}))' "$1" "$2"; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
fail() { echo "elastic-nodes: FAILED: $1"; shift; for f in "$@"; do echo "--- $f"; cat "$f"; done; exit 1; }

# 300 steps of the digits MLP (12 micro-batches feed 6, 4 or 2 replicas), rank 0 slowed down so
# that a run lasts long enough to lose and regain a host.
cfg=(--set train.steps=300 --set train.microbatch=8 --set checkpoint.every=10)
agent_args=("${cfg[@]}" --set dist.timeout_secs=20 --nproc 2 --heartbeat-timeout 3 --max-restarts 3
    --inject "slow:rank=0,factor=20")
# start NAME PORT NODE [OUT]: node NODE's agent of job NAME (--nnodes 2:3, store on A) in the
# background, its run directory OUT (default: one per host, NAME-NODE).
start() {
    local name="$1" port="$2" node="$3" out="${4:-$work/$1-$3}"
    ip netns exec "${hosts[$node]}" "$bin" train "${agent_args[@]}" --nnodes 2:3 --node-rank "$node" \
        --rdzv "10.79.0.1:$port" --out "$out" >>"$work/$name-$node.log" 2>&1 &
    pid[$node]=$!
}
start_all() { declare -g -a pid=(); for n in 0 1 2; do start "$1" "$2" "$n" ${3:+"$3"}; done; }
# wait_step NAME N: until rank 0 has reported step N (or 60 s).
wait_step() {
    for _ in $(seq 1200); do
        grep -Eq "step ([0-9]+)/" "$work/$1-0.log" 2>/dev/null &&
            (( $(grep -Eo "step [0-9]+/" "$work/$1-0.log" | tail -1 | tr -dc 0-9) >= $2 )) && return 0
        sleep 0.05
    done
    fail "job $1 never reached step $2" "$work/$1-0.log"
}
# kill_host NODE: every process on that host (its agent, workers and — node 0 — the store).
kill_host() { local p; p=$(ip netns pids "${hosts[$1]}"); [[ -z "$p" ]] || kill -9 $p 2>/dev/null || true; }
"$bin" train --nproc 1 --out "$work/one" "${cfg[@]}" >"$work/one.log" 2>&1 || fail "reference run" "$work/one.log"
want="$(hash_of "$work/one/summary.json")"
echo "elastic-nodes: fault-free one worker: $want"

# (1) Lose host C, then start its agent again.
start_all rejoin 29701
wait_step rejoin 40
kill_host 2
t0=$(now)
for _ in $(seq 300); do grep -q "node lost: node 2" "$work/rejoin-0.log" && break; sleep 0.05; done
took=$(since "$t0")
grep -q "node lost: node 2" "$work/rejoin-0.log" || fail "host A never dropped node 2" "$work/rejoin-0.log"
start rejoin 29701 2
s0=0; s1=0; s2=0
wait "${pid[0]}" || s0=$?; wait "${pid[1]}" || s1=$?; wait "${pid[2]}" || s2=$?
[[ $s0$s1$s2 == 000 ]] || fail "exit statuses $s0 $s1 $s2 (want 0 0 0)" "$work/rejoin-0.log" "$work/rejoin-2.log"
sum="$work/rejoin-0/summary.json"
got="$(hash_of "$sum")"
changes="$(field "$sum" '[(c["change"], c["world_before"], c["world_after"]) for c in s["membership"]]')"
echo "elastic-nodes: lost host C (dropped after ${took}s) and rejoined: $changes; $got"
[[ "$got" == "$want" ]] || fail "param_hash differs from one worker" "$work/rejoin-0.log"
[[ "$changes" == "[('node lost', 6, 4), ('node joined', 4, 6)]" ]] || fail "membership timeline" "$work/rejoin-0.log"
[[ "$(field "$sum" 's["world_size"]')" == 6 && "$(field "$sum" 's["restarts"]')" == 1 ]] || fail "world size / restarts" "$work/rejoin-0.log"
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 6 else 1)" "$took" || fail "dropping host C took ${took}s > 2 × 3 s" "$work/rejoin-0.log"
grep -q "node lost" "$work/rejoin-0/report.md" || fail "the report has no membership timeline" "$work/rejoin-0/report.md"
echo "elastic-nodes: ok: a lost host is dropped, a restarted one admitted, same bits"
passed=$((passed + 1))

# (2) Cut host C's link.
start_all cut 29702
wait_step cut 40
netns_cut "$tag" 3
t0=$(now)
for _ in $(seq 300); do grep -q "node lost: node 2" "$work/cut-0.log" && break; sleep 0.05; done
took=$(since "$t0")
s0=0; s1=0; s2=0
wait "${pid[0]}" || s0=$?; wait "${pid[1]}" || s1=$?; wait "${pid[2]}" || s2=$?
netns_mend "$tag" 3
[[ $s0$s1 == 00 && $s2 != 0 ]] || fail "exit statuses $s0 $s1 $s2 (want 0 0 and a failure on C)" "$work/cut-0.log" "$work/cut-2.log"
got="$(hash_of "$work/cut-0/summary.json")"
echo "elastic-nodes: cut host C's link: dropped after ${took}s; world $(field "$work/cut-0/summary.json" 's["world_size"]'); $got"
[[ "$got" == "$want" ]] || fail "param_hash differs from one worker" "$work/cut-0.log"
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 6 else 1)" "$took" || fail "detecting the cut took ${took}s > 2 × 3 s" "$work/cut-0.log"
grep -Eq "store at 10\.79\.0\.1:29702 \(node 0 \([^)]*\)\) does not answer" "$work/cut-2.log" || fail "host C does not name the store it lost" "$work/cut-2.log"
echo "elastic-nodes: ok: a cut host is dropped within 2 × the heartbeat timeout, same bits; it names what it lost"
passed=$((passed + 1))

# (3a) Lose node 0 (host A) with one run directory for all hosts: the store moves to B.
start_all moved 29705 "$work/moved"
wait_step moved 40
kill_host 0
s1=0; s2=0
wait "${pid[1]}" || s1=$?; wait "${pid[2]}" || s2=$?
[[ $s1$s2 == 00 ]] || fail "B and C should go on without node 0 (got $s1 $s2)" "$work/moved-1.log" "$work/moved-2.log"
got="$(hash_of "$work/moved/summary.json")"
changes="$(field "$work/moved/summary.json" '[(c["change"], c["who"].split(" ")[1], c["world_before"], c["world_after"]) for c in s["membership"]]')"
echo "elastic-nodes: lost node 0 with a shared run directory: $changes; $got"
grep -q "the store moves to node 1" "$work/moved-2.log" || fail "host C did not follow the store to B" "$work/moved-2.log"
[[ "$changes" == "[('node lost', '0', 6, 4)]" ]] || fail "membership timeline" "$work/moved-1.log"
[[ "$got" == "$want" ]] || fail "param_hash after the store moved differs from one worker" "$work/moved-1.log"
echo "elastic-nodes: ok: node 0 lost, the store and rank 0 moved to B, the job went on to the same bits"
passed=$((passed + 1))

# (3b) Lose node 0 with a run directory per host: B cannot reach the checkpoints and ends the job
#      by name; continued with --resume from A's run directory on B and C.
start_all n0 29703
wait_step n0 40
kill_host 0
t0=$(now)
s1=0; s2=0
wait "${pid[1]}" || s1=$?; wait "${pid[2]}" || s2=$?
took=$(since "$t0")
[[ $s1 != 0 && $s2 != 0 ]] || fail "B and C should end without node 0 (got $s1 $s2)" "$work/n0-1.log" "$work/n0-2.log"
grep -q "store at 10.79.0.1:29703 (node 0" "$work/n0-1.log" || fail "host B does not name node 0's store" "$work/n0-1.log"
grep -q "rank 0 had written the checkpoint of step .*continue with --resume on node 0's run directory" "$work/n0-1.log" || fail "host B does not say why the job cannot go on" "$work/n0-1.log"
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 20 else 1)" "$took" || fail "B and C took ${took}s to end" "$work/n0-1.log"
for n in 1 2; do
    ip netns exec "${hosts[$n]}" "$bin" train "${agent_args[@]}" --nnodes 2 --node-rank $((n - 1)) \
        --rdzv "10.79.0.2:29704" --resume "$work/n0-0" >"$work/n0-resume-$n.log" 2>&1 &
    pid[$n]=$!
done
s1=0; s2=0
wait "${pid[1]}" || s1=$?; wait "${pid[2]}" || s2=$?
[[ $s1$s2 == 00 ]] || fail "the resumed job failed ($s1 $s2)" "$work/n0-resume-1.log" "$work/n0-resume-2.log"
got="$(hash_of "$work/n0-0/summary.json")"
echo "elastic-nodes: lost node 0 (run directory per host): B and C ended after ${took}s naming its store and the checkpoints out of reach; resumed on B+C: $got"
[[ "$got" == "$want" ]] || fail "param_hash after resuming differs from one worker" "$work/n0-resume-1.log"
echo "elastic-nodes: ok: losing node 0 ends the job by name; --resume from its checkpoints on the survivors gives the same bits"
passed=$((passed + 1))

# (4) Chaos.
for run in $(seq 10); do
    name="chaos$run"
    start_all "$name" $((29710 + run)) "$work/$name"
    step=$(( 20 + RANDOM % 200 ))
    wait_step "$name" "$step"
    if (( RANDOM % 2 )); then
        host=$(( RANDOM % 3 ))
        victims=($(for p in $(ip netns pids "${hosts[$host]}"); do grep -qa "^worker" <(tr '\0' '\n' </proc/$p/cmdline | sed -n 2p) && echo "$p"; done 2>/dev/null || true))
        (( ${#victims[@]} )) || fail "no worker on host $host of $name" "$work/$name-0.log"
        victim=${victims[$(( RANDOM % ${#victims[@]} ))]}
        what="worker pid $victim on host $host"
        kill -9 "$victim" || true
        rejoin=0
    else
        host=$(( RANDOM % 3 ))
        what="whole host $host"
        kill_host "$host"
        # Node 0 does not rejoin: its store has moved.
        rejoin=$(( host > 0 ? RANDOM % 2 : 0 ))
        if (( rejoin )); then sleep 2; start "$name" $((29710 + run)) "$host" "$work/$name"; what="$what, started again"; fi
    fi
    # Every node that was not killed (or was started again) ends well; the run directory is one.
    bad=""
    for n in 0 1 2; do
        st=0; wait "${pid[$n]}" 2>/dev/null || st=$?
        [[ $st == 0 || ( $what == "whole host $n" ) ]] || bad="$bad node $n: $st"
    done
    [[ -z "$bad" ]] || fail "chaos run $run ($what at step $step):$bad" "$work/$name-0.log" "$work/$name-1.log" "$work/$name-2.log"
    got="$(hash_of "$work/$name/summary.json")"
    world="$(field "$work/$name/summary.json" 's["world_size"]')"
    echo "elastic-nodes: chaos $run: killed $what at step $step -> world $world, $got"
    [[ "$got" == "$want" ]] || fail "chaos run $run: param_hash differs" "$work/$name-0.log"
    # The world it ends with: whole again after a worker was killed, without the host after a
    # host was lost, and whole again after a host rejoined — unless the job ended before the
    # rejoined agent could be admitted, which that agent then says.
    expect=6
    [[ $what == "whole host $host" ]] && expect=4
    if [[ $what == *"started again" && $world == 4 ]]; then
        grep -q "the job ended before node $host was admitted" "$work/$name-$host.log" && expect=4
    fi
    [[ "$world" == "$expect" ]] || fail "chaos run $run ($what): world $world, want $expect" "$work/$name-0.log" "$work/$name-$host.log"
done
echo "elastic-nodes: ok: 10 chaos runs all ended with the fault-free bits"
passed=$((passed + 1))
echo "elastic-nodes: $passed passed, 0 failed"

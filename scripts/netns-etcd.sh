#!/usr/bin/env bash
# Rendezvous on a real HA store: three simulated hosts (network namespaces on one bridge: A
# 10.80.0.1, B 10.80.0.2, C 10.80.0.3), each running a member of one 3-member etcd cluster
# (Debian's etcd-server) and a lockstep agent with --rdzv-backend etcd, 2 workers each,
# --nnodes 2:3, one run directory for all hosts:
# (1) host A — node 0: the leader, rank 0, and an etcd member — is killed mid-run: B and C go on
#     without any store move (etcd keeps the agents' keys), the job ends with the fault-free
#     param_hash, restarts = 1 and "node lost" (6 -> 4) on the membership timeline;
# (2) two of the three etcd members (B's and C's) are killed mid-run: no quorum, so every agent
#     stops, naming the etcd cluster; with the members started again, `--resume` on all three
#     hosts ends with the fault-free param_hash.
# Needs root and etcd (fails when it is missing). Usage: scripts/netns-etcd.sh path/to/lockstep
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep}")"
command -v etcd >/dev/null || { echo "etcd: FAILED: etcd is not installed (apt-get install etcd-server)"; exit 1; }
work="$(mktemp -d)"
tag="ed$$"
hosts=("${tag}A" "${tag}B" "${tag}C")
source "$(dirname "$0")/lib/netns-hosts.sh"
cleanup() {
    pkill -9 -f -- "--out $work/" 2>/dev/null || true
    pkill -9 -f -- "--resume $work/" 2>/dev/null || true
    pkill -9 -f -- "--data-dir $work/" 2>/dev/null || true
    netns_unhosts "$tag" "${hosts[@]}"
    [[ -n "${KEEP:-}" ]] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
netns_hosts "$tag" 10.80.0 "${hosts[@]}"
passed=0
hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
field() { python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"s": v}))' "$1" "$2"; }
fail() { echo "etcd: FAILED: $1"; shift; for f in "$@"; do echo "--- $f"; tail -n 40 "$f"; done; exit 1; }

# etcd member I (0, 1, 2) on host I, in the background.
declare -a etcd_pid
cluster="e0=http://10.80.0.1:2380,e1=http://10.80.0.2:2380,e2=http://10.80.0.3:2380"
start_etcd() {
    local i="$1" ip="10.80.0.$(( $1 + 1 ))"
    ip netns exec "${hosts[$i]}" etcd --name "e$i" --data-dir "$work/etcd-$i" \
        --listen-client-urls "http://$ip:2379" --advertise-client-urls "http://$ip:2379" \
        --listen-peer-urls "http://$ip:2380" --initial-advertise-peer-urls "http://$ip:2380" \
        --initial-cluster "$cluster" --initial-cluster-token "lockstep-$tag" \
        --initial-cluster-state new >>"$work/etcd-$i.log" 2>&1 &
    etcd_pid[$i]=$!
}
for i in 0 1 2; do start_etcd "$i"; done
for _ in $(seq 300); do
    ip netns exec "${hosts[0]}" etcdctl --endpoints http://10.80.0.1:2379 endpoint health >/dev/null 2>&1 && break
    sleep 0.1
done
ip netns exec "${hosts[0]}" etcdctl --endpoints http://10.80.0.1:2379 endpoint health >/dev/null 2>&1 ||
    fail "the etcd cluster did not become healthy" "$work/etcd-0.log"
echo "etcd: a 3-member etcd cluster runs on hosts A, B and C"

cfg=(--set train.steps=300 --set train.microbatch=8 --set checkpoint.every=10)
agent_args=("${cfg[@]}" --set dist.timeout_secs=20 --nproc 2 --heartbeat-timeout 3 --max-restarts 3
    --rdzv-backend etcd)
# Rank 0 slowed down so that a run lasts long enough to lose a host (1), or for the agents to
# notice a lost quorum well before the last step (2).
slow=(--inject "slow:rank=0,factor=20")
slower=(--inject "slow:rank=0,factor=400")
# Each host lists its own etcd member first (a dead endpoint is tried last).
endpoints() {
    local me=$(( $1 + 1 )) list="10.80.0.$(( $1 + 1 )):2379" j
    for j in 1 2 3; do [[ $j == "$me" ]] || list="$list,10.80.0.$j:2379"; done
    echo "etcd://$list"
}
declare -a pid
# start NAME NODE MODE...: node NODE's agent of job NAME (MODE: --out DIR or --resume DIR).
start() {
    local name="$1" node="$2"; shift 2
    ip netns exec "${hosts[$node]}" "$bin" train "${agent_args[@]}" --nnodes 2:3 --node-rank "$node" \
        --rdzv "$(endpoints "$node")" "$@" >>"$work/$name-$node.log" 2>&1 &
    pid[$node]=$!
}
wait_step() {
    for _ in $(seq 1200); do
        grep -Eq "step ([0-9]+)/" "$work/$1-0.log" 2>/dev/null &&
            (( $(grep -Eo "step [0-9]+/" "$work/$1-0.log" | tail -1 | tr -dc 0-9) >= $2 )) && return 0
        sleep 0.05
    done
    fail "job $1 never reached step $2" "$work/$1-0.log"
}
# kill_host I: every process on host I: its agent, its workers and its etcd member.
kill_host() { local p; p=$(ip netns pids "${hosts[$1]}"); [[ -z "$p" ]] || kill -9 $p 2>/dev/null || true; }

"$bin" train --nproc 1 --out "$work/one" "${cfg[@]}" >"$work/one.log" 2>&1 || fail "reference run" "$work/one.log"
want="$(hash_of "$work/one/summary.json")"
echo "etcd: fault-free one worker: $want"

# (1) Host A lost whole: node 0's agent, its workers and its etcd member.
export LOCKSTEP_SECRET="$("$bin" secret)"
for n in 0 1 2; do start lost "$n" --out "$work/lost" "${slow[@]}"; done
wait_step lost 40
kill_host 0
s1=0; s2=0
wait "${pid[1]}" || s1=$?; wait "${pid[2]}" || s2=$?
[[ $s1$s2 == 00 ]] || fail "B and C should go on without host A (got $s1 $s2)" "$work/lost-1.log" "$work/lost-2.log"
got="$(hash_of "$work/lost/summary.json")"
restarts="$(field "$work/lost/summary.json" 's["restarts"]')"
changes="$(field "$work/lost/summary.json" '[(c["change"], c["who"].split(" ")[1], c["world_before"], c["world_after"]) for c in s["membership"]]')"
echo "etcd: host A (node 0 and an etcd member) killed: restarts=$restarts, $changes; $got"
[[ "$restarts" == 1 ]] || fail "expected restarts = 1" "$work/lost-1.log"
[[ "$changes" == "[('node lost', '0', 6, 4)]" ]] || fail "membership timeline" "$work/lost-1.log"
[[ "$got" == "$want" ]] || fail "param_hash after losing host A differs from one worker" "$work/lost-1.log"
grep -q "the store moves" "$work/lost-1.log" "$work/lost-2.log" && fail "the builtin store move ran under etcd" "$work/lost-1.log"
echo "etcd: ok: node 0's host lost with its etcd member; B and C went on to the same bits, no store move"
passed=$((passed + 1))

# (2) Quorum lost: two of the three etcd members killed mid-run. Host A's member is started again
#     first (it was killed in (1)) so that the job starts with all three.
start_etcd 0
for _ in $(seq 300); do
    ip netns exec "${hosts[0]}" etcdctl --endpoints http://10.80.0.1:2379 endpoint health >/dev/null 2>&1 && break
    sleep 0.1
done
export LOCKSTEP_SECRET="$("$bin" secret)"
for n in 0 1 2; do start quorum "$n" --out "$work/quorum" "${slower[@]}"; done
wait_step quorum 40
kill -9 "${etcd_pid[1]}" "${etcd_pid[2]}"
t0=$(date +%s)
statuses=""
for n in 0 1 2; do st=0; wait "${pid[$n]}" || st=$?; statuses="$statuses $st"; done
took=$(( $(date +%s) - t0 ))
echo "etcd: two of three etcd members killed: the agents ended after ${took}s with statuses$statuses"
for n in 0 1 2; do
    [[ "$(echo $statuses | cut -d' ' -f$((n + 1)))" != 0 ]] || fail "node $n's agent ended well without a quorum" "$work/quorum-$n.log"
    grep -q "the etcd cluster at" "$work/quorum-$n.log" || fail "node $n does not name the etcd cluster" "$work/quorum-$n.log"
done
(( took <= 90 )) || fail "the agents took ${took}s to stop" "$work/quorum-0.log"
grep -q "final loss" "$work/quorum-0.log" && fail "the job ran to its end without a quorum" "$work/quorum-0.log"
start_etcd 1; start_etcd 2
for _ in $(seq 300); do
    ip netns exec "${hosts[1]}" etcdctl --endpoints http://10.80.0.2:2379 endpoint health >/dev/null 2>&1 && break
    sleep 0.1
done
for n in 0 1 2; do start quorum-resume "$n" --resume "$work/quorum" "${slow[@]}"; done
st=""
for n in 0 1 2; do s=0; wait "${pid[$n]}" || s=$?; st="$st$s"; done
[[ $st == 000 ]] || fail "the resumed job failed ($st)" "$work/quorum-resume-0.log" "$work/quorum-resume-1.log"
got="$(hash_of "$work/quorum/summary.json")"
echo "etcd: members started again, --resume on A, B and C: $got"
[[ "$got" == "$want" ]] || fail "param_hash after resuming differs from one worker" "$work/quorum-resume-0.log"
echo "etcd: ok: a lost etcd quorum stops every agent by name; --resume reaches the same bits"
passed=$((passed + 1))
echo "etcd: $passed passed, 0 failed"

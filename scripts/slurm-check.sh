#!/usr/bin/env bash
# lockstep under a real Slurm (start one with scripts/slurm-cluster.sh, which sets SLURM_CONF):
# (1) `srun -n 3 lockstep train` (digits) ends with the param_hash of `lockstep train --nproc 1`,
#     and every rank's log names its Slurm rank;
# (2) a 3-stage Shakespeare pipeline under srun gives the one-worker hash;
# (3) an sbatch job script with --nodes=1 --ntasks-per-node=3 gives the one-worker hash;
# (4) `srun -n 3` with parallel.pp = 2 is refused on every rank, exit 3, naming Slurm's world and pp;
# (5) one task SIGKILLed mid-run (its pid from `scontrol listpids`): the job fails within
#     2 × dist.timeout_secs naming rank 1, and resubmitting with --resume ends on the fault-free hash.
# The srun/sbatch lines are the recipes of docs/src/clusters.md ("Tested with Slurm and Open MPI"), word for word.
# Usage: scripts/slurm-cluster.sh bash scripts/slurm-check.sh path/to/lockstep
set -euo pipefail
bin="$(realpath "${1:?usage: scripts/slurm-cluster.sh bash $0 path/to/lockstep}")"
repo="$(realpath "$(dirname "$0")/..")"
[[ -n "${SLURM_CONF:-}" ]] || { echo "slurm: FAILED: SLURM_CONF is not set; run me under scripts/slurm-cluster.sh"; exit 1; }
sinfo -h -o %t | grep -q idle || { echo "slurm: FAILED: no idle Slurm node"; exit 1; }
work="$(mktemp -d /tmp/lockstep-slurm-check.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/runs"
ln -s "$bin" "$work/bin/lockstep"
ln -s "$repo/configs" "$work/configs"
export PATH="$work/bin:$PATH"
cd "$work"
started=$(date +%s)
fail() { echo "slurm: FAILED: $*"; exit 1; }
passed=0

# One-worker references (the lockstep launcher, no engine).
source "$repo/scripts/lib/cluster-refs.sh"

# (1) srun, digits. (docs/src/clusters.md recipe.)
export MASTER_ADDR=$(hostname) MASTER_PORT=29500 LOCKSTEP_SECRET=$(lockstep secret)
srun -n 3 lockstep train --out runs/slurm-digits --set train.steps=40 >srun.log 2>&1 || { cat srun.log; fail "srun -n 3 lockstep train"; }
h="$(hash_of runs/slurm-digits/summary.json)"
echo "slurm: srun -n 3 digits: $h (1 worker: $ref_digits)"
[[ "$h" == "$ref_digits" ]] || fail "srun -n 3 digits param_hash differs from 1 worker"
for r in 0 1 2; do
    grep -q "lockstep: rank $r of 3 (local rank $r, started by Slurm)" srun.log || { cat srun.log; fail "no log line names Slurm rank $r"; }
done
grep "started by Slurm" srun.log | sed 's/^/slurm:   /'
passed=$((passed + 1))

# (2) srun, the Shakespeare pipeline with 3 stages.
srun -n 3 lockstep train --out runs/slurm-pipe "${pipe[@]}" --set parallel.pp=3 >srun-pipe.log 2>&1 || { cat srun-pipe.log; fail "srun -n 3 pipeline"; }
h="$(hash_of runs/slurm-pipe/summary.json)"
echo "slurm: srun -n 3 Shakespeare pp = 3: $h (1 worker: $ref_pipe)"
[[ "$h" == "$ref_pipe" ]] || fail "the 3-stage pipeline under srun differs from 1 worker"
passed=$((passed + 1))

# (3) sbatch of the job script in docs/src/clusters.md.
cat >job.sh <<'EOF'
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=3
#SBATCH --output=runs/slurm-%j.log
export MASTER_ADDR=$(hostname) MASTER_PORT=29500 LOCKSTEP_SECRET=$(lockstep secret)
srun lockstep train --out runs/slurm-$SLURM_JOB_ID --set train.steps=40
EOF
job=$(sbatch --parsable job.sh)
for _ in $(seq 600); do
    st="$(squeue -h -j "$job" -o %T 2>/dev/null || true)"
    [[ -z "$st" ]] && break
    sleep 0.2
done
[[ -z "$st" ]] || fail "sbatch job $job still $st after 120 s"
[[ -f "runs/slurm-$job/summary.json" ]] || { cat "runs/slurm-$job.log"; fail "sbatch job $job wrote no summary"; }
h="$(hash_of "runs/slurm-$job/summary.json")"
echo "slurm: sbatch --nodes=1 --ntasks-per-node=3 (job $job): $h"
[[ "$h" == "$ref_digits" ]] || fail "the sbatch job's param_hash differs from 1 worker"
[[ $(grep -c "started by Slurm" "runs/slurm-$job.log") -eq 3 ]] || { cat "runs/slurm-$job.log"; fail "the sbatch log does not name 3 Slurm ranks"; }
passed=$((passed + 1))

# (4) A world that disagrees with the layout: refused on every rank, exit 3, before any collective.
set +e
srun -n 3 lockstep train --config configs/shakespeare.toml --set parallel.pp=2 --out runs/mismatch >mismatch.log 2>&1
rc=$?
set -e
[[ $rc -eq 3 ]] || { cat mismatch.log; fail "a pp = 2 layout on 3 Slurm tasks exited $rc, not 3"; }
n=$(grep -c "lockstep: error: .*Slurm.* 3 .*parallel.pp = 2" mismatch.log || true)
[[ $n -eq 3 ]] || { cat mismatch.log; fail "expected the refusal once per rank (3), got $n"; }
echo "slurm: pp = 2 on 3 tasks refused on every rank (exit 3):"
grep -m1 "lockstep: error" mismatch.log | sed 's/^/slurm:   /'
passed=$((passed + 1))

# (5) Kill one task with SIGKILL mid-run; the job fails naming it; resubmit with --resume.
timeout_secs=5
srun -n 3 lockstep train --out runs/slurm-kill --set train.steps=300 --set checkpoint.every=25 --set dist.timeout_secs=5 >kill.log 2>&1 &
srun_pid=$!
for _ in $(seq 600); do grep -q "step [6-9]0/300\|step 1[0-9][0-9]/300" kill.log 2>/dev/null && break; sleep 0.1; done
grep -q "step [6-9]0/300\|step 1[0-9][0-9]/300" kill.log || { cat kill.log; fail "the kill job never reached step 60"; }
jobid="$(squeue -h -o %i -n lockstep | head -1)"
victim="$(scontrol listpids "$jobid" | awk '$5 == 1 && $3 != "batch" && $3 != "extern" {print $1}' | while read -r p; do
    [[ "$(readlink "/proc/$p/exe" 2>/dev/null)" == "$bin" ]] && echo "$p"; done | head -1)"
[[ -n "$victim" ]] || { scontrol listpids "$jobid"; fail "could not find rank 1's pid in job $jobid"; }
killed_at=$(date +%s.%N)
kill -KILL "$victim"
deadline=$(( $(date +%s) + 2 * timeout_secs ))
while kill -0 "$srun_pid" 2>/dev/null && (( $(date +%s) <= deadline )); do sleep 0.1; done
if kill -0 "$srun_pid" 2>/dev/null; then
    scancel --signal=KILL "$jobid"; cat kill.log; fail "the job still runs $((2 * timeout_secs)) s after rank 1 was killed"
fi
elapsed=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$killed_at")
if wait "$srun_pid"; then cat kill.log; fail "srun succeeded although rank 1 was killed"; fi
grep -q "task 1: Killed" kill.log || { cat kill.log; fail "srun does not report task 1 as killed"; }
grep -Eq "rank [02]: .*rank 1 \(" kill.log || { cat kill.log; fail "no surviving rank names rank 1"; }
echo "slurm: rank 1 (pid $victim) SIGKILLed at $(grep -o 'step [0-9]*/300' kill.log | tail -1): job failed after ${elapsed}s (timeout ${timeout_secs}s):"
grep -E "task 1: Killed|rank [02]: .*rank 1 \(" kill.log | head -3 | sed 's/^/slurm:   /'
srun -n 3 lockstep train --resume runs/slurm-kill >resume.log 2>&1 || { cat resume.log; fail "srun --resume"; }
grep -q "resumed from the checkpoint of step" resume.log || { cat resume.log; fail "--resume did not load a checkpoint"; }
h="$(hash_of runs/slurm-kill/summary.json)"
echo "slurm: $(grep -m1 -o 'resumed from the checkpoint of step [0-9]*' resume.log); final $h (fault-free 1 worker: $ref_kill)"
[[ "$h" == "$ref_kill" ]] || fail "the resumed job's param_hash differs from the fault-free run"
passed=$((passed + 1))

echo "slurm: $passed passed, 0 failed ($(( $(date +%s) - started )) s)"

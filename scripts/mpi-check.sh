#!/usr/bin/env bash
# lockstep under a real Open MPI mpirun (Debian's openmpi-bin, installed when missing):
# (1) `mpirun -np 3 lockstep train` (digits) ends with the param_hash of `lockstep train --nproc 1`,
#     every rank's log naming its MPI rank;
# (2) a 3-stage Shakespeare pipeline under mpirun gives the one-worker hash;
# (3) `mpirun -np 3` with parallel.pp = 2 is refused on every rank, exit 3, naming both;
# (4) rank 1 SIGKILLed mid-run: the job ends within 2 × dist.timeout_secs, rank 1 named, and
#     `--resume` ends on the fault-free hash.
# The mpirun lines are README.md's recipes ("Under Slurm and Open MPI"), word for word.
# Needs root only for the install. Usage: scripts/mpi-check.sh path/to/lockstep
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep}")"
repo="$(realpath "$(dirname "$0")/..")"
if ! command -v mpirun >/dev/null; then
    echo "mpi: installing openmpi-bin (Debian)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin >/dev/null
fi
command -v mpirun >/dev/null || { echo "mpi: FAILED: mpirun is still missing after the install"; exit 1; }
work="$(mktemp -d /tmp/lockstep-mpi-check.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/runs"
ln -s "$bin" "$work/bin/lockstep"
ln -s "$repo/configs" "$work/configs"
export PATH="$work/bin:$PATH"
cd "$work"
started=$(date +%s)
fail() { echo "mpi: FAILED: $*"; exit 1; }
hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
passed=0
echo "mpi: $(mpirun --version | head -1)"

digits=(--set train.steps=40)
pipe=(--config configs/shakespeare.toml --set model.d_model=32 --set model.heads=2 --set model.blocks=2
    --set model.context=16 --set model.d_ff=64 --set train.global_batch=8 --set parallel.microbatches=4
    --set train.steps=6 --set train.eval_every=3)
kill_sets=(--set train.steps=300 --set checkpoint.every=25 --set dist.timeout_secs=5)
lockstep train --nproc 1 --out runs/ref-digits "${digits[@]}" >ref1.log 2>&1 || { cat ref1.log; fail "1-worker digits run"; }
lockstep train --nproc 1 --out runs/ref-pipe "${pipe[@]}" --set parallel.pp=1 >ref2.log 2>&1 || { cat ref2.log; fail "1-worker pipeline reference"; }
lockstep train --nproc 1 --out runs/ref-kill "${kill_sets[@]}" >ref3.log 2>&1 || { cat ref3.log; fail "1-worker 300-step run"; }
ref_digits="$(hash_of runs/ref-digits/summary.json)"
ref_pipe="$(hash_of runs/ref-pipe/summary.json)"
ref_kill="$(hash_of runs/ref-kill/summary.json)"

# (1) mpirun, digits. (README recipe.)
export MASTER_ADDR=$(hostname) MASTER_PORT=29500 LOCKSTEP_SECRET=$(lockstep secret)
mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR -x MASTER_PORT -x LOCKSTEP_SECRET lockstep train --out runs/mpi --set train.steps=40 >mpi.log 2>&1 || { cat mpi.log; fail "mpirun -np 3 lockstep train"; }
h="$(hash_of runs/mpi/summary.json)"
echo "mpi: mpirun -np 3 digits: $h (1 worker: $ref_digits)"
[[ "$h" == "$ref_digits" ]] || fail "mpirun -np 3 digits param_hash differs from 1 worker"
for r in 0 1 2; do
    grep -q "lockstep: rank $r of 3 (local rank $r, started by OpenMPI mpirun)" mpi.log || { cat mpi.log; fail "no log line names MPI rank $r"; }
done
grep "started by OpenMPI" mpi.log | sed 's/^/mpi:   /'
passed=$((passed + 1))

# (2) The Shakespeare pipeline, 3 stages.
mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR -x MASTER_PORT -x LOCKSTEP_SECRET lockstep train --out runs/mpi-pipe "${pipe[@]}" --set parallel.pp=3 >mpi-pipe.log 2>&1 || { cat mpi-pipe.log; fail "mpirun -np 3 pipeline"; }
h="$(hash_of runs/mpi-pipe/summary.json)"
echo "mpi: mpirun -np 3 Shakespeare pp = 3: $h (1 worker: $ref_pipe)"
[[ "$h" == "$ref_pipe" ]] || fail "the 3-stage pipeline under mpirun differs from 1 worker"
passed=$((passed + 1))

# (3) World vs layout.
set +e
mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR -x MASTER_PORT -x LOCKSTEP_SECRET lockstep train --config configs/shakespeare.toml --set parallel.pp=2 --out runs/mismatch >mismatch.log 2>&1
rc=$?
set -e
[[ $rc -eq 3 ]] || { cat mismatch.log; fail "a pp = 2 layout on mpirun -np 3 exited $rc, not 3"; }
n=$(grep -c "lockstep: error: .*mpirun.* 3 .*parallel.pp = 2" mismatch.log || true)
[[ $n -eq 3 ]] || { cat mismatch.log; fail "expected the refusal once per rank (3), got $n"; }
echo "mpi: pp = 2 on mpirun -np 3 refused on every rank (exit 3):"
grep -m1 "lockstep: error" mismatch.log | sed 's/^/mpi:   /'
passed=$((passed + 1))

# (4) Rank 1 SIGKILLed mid-run; then --resume.
timeout_secs=5
mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR -x MASTER_PORT -x LOCKSTEP_SECRET lockstep train --out runs/mpi-kill --set train.steps=300 --set checkpoint.every=25 --set dist.timeout_secs=5 >kill.log 2>&1 &
mpirun_pid=$!
for _ in $(seq 600); do grep -q "step [6-9]0/300\|step 1[0-9][0-9]/300" kill.log 2>/dev/null && break; sleep 0.1; done
grep -q "step [6-9]0/300\|step 1[0-9][0-9]/300" kill.log || { cat kill.log; fail "the kill job never reached step 60"; }
victim=""
for p in $(pgrep -P "$mpirun_pid"); do
    [[ "$(readlink "/proc/$p/exe" 2>/dev/null)" == "$bin" ]] || continue
    tr '\0' '\n' <"/proc/$p/environ" | grep -qx "OMPI_COMM_WORLD_RANK=1" && victim=$p
done
[[ -n "$victim" ]] || fail "could not find rank 1's pid under mpirun $mpirun_pid"
killed_at=$(date +%s.%N)
kill -KILL "$victim"
deadline=$(( $(date +%s) + 2 * timeout_secs ))
while kill -0 "$mpirun_pid" 2>/dev/null && (( $(date +%s) <= deadline )); do sleep 0.1; done
if kill -0 "$mpirun_pid" 2>/dev/null; then
    kill -KILL "$mpirun_pid"; cat kill.log; fail "mpirun still runs $((2 * timeout_secs)) s after rank 1 was killed"
fi
elapsed=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$killed_at")
if wait "$mpirun_pid"; then cat kill.log; fail "mpirun succeeded although rank 1 was killed"; fi
grep -q "process rank 1 with PID $victim .*signal 9" kill.log || { cat kill.log; fail "mpirun does not name rank 1"; }
echo "mpi: rank 1 (pid $victim) SIGKILLed at $(grep -o 'step [0-9]*/300' kill.log | tail -1): job ended after ${elapsed}s (timeout ${timeout_secs}s):"
grep -E "process rank 1 with PID" kill.log | head -1 | sed 's/^ */mpi:   /'
mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR -x MASTER_PORT -x LOCKSTEP_SECRET lockstep train --resume runs/mpi-kill >resume.log 2>&1 || { cat resume.log; fail "mpirun --resume"; }
grep -q "resumed from the checkpoint of step" resume.log || { cat resume.log; fail "--resume did not load a checkpoint"; }
h="$(hash_of runs/mpi-kill/summary.json)"
echo "mpi: $(grep -m1 -o 'resumed from the checkpoint of step [0-9]*' resume.log); final $h (fault-free 1 worker: $ref_kill)"
[[ "$h" == "$ref_kill" ]] || fail "the resumed job's param_hash differs from the fault-free run"
passed=$((passed + 1))

echo "mpi: $passed passed, 0 failed ($(( $(date +%s) - started )) s)"

#!/usr/bin/env bash
# lockstep under a real Open MPI mpirun (Debian's openmpi-bin, installed when missing):
# (1) `mpirun -np 3 lockstep train` (digits) ends with the param_hash of `lockstep train --nproc 1`,
#     every rank's log naming its MPI rank;
# (2) a 3-stage Shakespeare pipeline under mpirun gives the one-worker hash;
# (3) `mpirun -np 3` with parallel.pp = 2 is refused, exit 3, naming mpirun's world and pp;
# (4) rank 1 SIGKILLed mid-run: the job ends within 2 × dist.timeout_secs, rank 1 named, and
#     `--resume` ends on the fault-free hash;
# the MPI transport (lockstep built with --features mpi):
# (5) the collective sweep (closed forms, every op, dtype, algorithm) under mpirun -np 1..4;
# (6) dist.transport = "mpi" without MASTER_ADDR (no store): digits and the pp = 3 pipeline give the
#     one-worker hashes;
# (7) a hung rank under the MPI transport: the survivors fail within 2 × dist.timeout_secs naming
#     it, and mpirun ends the job;
# (8) bench-collectives --transport mpi runs and reports.
# The mpirun lines are the recipes of docs/src/clusters.md ("Tested with Slurm and Open MPI"), word for word.
# Needs root only for the install.
# Usage: scripts/mpi-check.sh path/to/lockstep path/to/mpi_sweep   (both built with --features mpi:
#   cargo build -p lockstep-cli -p lockstep-comm --features lockstep-cli/mpi,lockstep-comm/mpi --bin lockstep --example mpi_sweep)
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep path/to/mpi_sweep}")"
sweep="$(realpath "${2:?usage: $0 path/to/lockstep path/to/mpi_sweep}")"
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
passed=0
echo "mpi: $(mpirun --version | head -1)"

# One-worker references (the lockstep launcher, no engine).
source "$repo/scripts/lib/cluster-refs.sh"

# (1) mpirun, digits. (docs/src/clusters.md recipe.)
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
# mpirun aborts the remaining ranks as soon as the first one exits non-zero, so 1 to 3 ranks get
# to print their (identical) refusal; none may print anything else or reach a collective.
n=$(grep -c "lockstep: error: .*mpirun.* 3 .*parallel.pp = 2" mismatch.log || true)
[[ $n -ge 1 && $n -le 3 ]] || { cat mismatch.log; fail "expected the refusal from 1..3 ranks, got $n"; }
[[ $(grep -c "lockstep: error" mismatch.log) -eq $n ]] || { cat mismatch.log; fail "another error besides the refusal"; }
! grep -q "lockstep: rank [0-9] of" mismatch.log || { cat mismatch.log; fail "a rank started despite the bad layout"; }
echo "mpi: pp = 2 on mpirun -np 3 refused (exit 3; $n rank(s) printed it before mpirun aborted the rest):"
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
# Who names rank 1 depends on which mpirun sees first: rank 1's SIGKILL ("process rank 1 … exited
# on signal 9") or a survivor's exit with lockstep's error ("… waiting for rank 1 (…)"); one must.
named='process rank 1 with PID .* exited on signal 9|rank [02]: .*waiting for rank 1 \('
grep -Eq "$named" kill.log || { cat kill.log; fail "neither mpirun nor a surviving rank names rank 1"; }
echo "mpi: rank 1 (pid $victim) SIGKILLed at $(grep -o 'step [0-9]*/300' kill.log | tail -1): job ended after ${elapsed}s (timeout ${timeout_secs}s):"
grep -E "$named" kill.log | head -2 | sed 's/^ */mpi:   /'
mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR -x MASTER_PORT -x LOCKSTEP_SECRET lockstep train --resume runs/mpi-kill >resume.log 2>&1 || { cat resume.log; fail "mpirun --resume"; }
grep -q "resumed from the checkpoint of step" resume.log || { cat resume.log; fail "--resume did not load a checkpoint"; }
h="$(hash_of runs/mpi-kill/summary.json)"
echo "mpi: $(grep -m1 -o 'resumed from the checkpoint of step [0-9]*' resume.log); final $h (fault-free 1 worker: $ref_kill)"
[[ "$h" == "$ref_kill" ]] || fail "the resumed job's param_hash differs from the fault-free run"
passed=$((passed + 1))

# (5) The collective sweep over the MPI transport, worlds 1..4.
for n in 1 2 3 4; do
    mpirun --allow-run-as-root --oversubscribe -np $n "$sweep" >sweep.log 2>&1 || { cat sweep.log; fail "collective sweep over MPI, world $n"; }
    grep "mpi sweep: world $n:" sweep.log | sed 's/^/mpi: /'
done
passed=$((passed + 1))

# (6) The MPI transport: no MASTER_ADDR, no store. (docs/src/clusters.md recipe.)
unset MASTER_ADDR MASTER_PORT
mpirun --allow-run-as-root --oversubscribe -np 3 -x LOCKSTEP_SECRET lockstep train --out runs/mpi-transport --set dist.transport=mpi --set train.steps=40 >mpi-t.log 2>&1 || { cat mpi-t.log; fail "mpirun with dist.transport = mpi"; }
h="$(hash_of runs/mpi-transport/summary.json)"
t="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["transport"])' runs/mpi-transport/summary.json)"
echo "mpi: dist.transport = mpi, digits: $h over $t (1 worker: $ref_digits)"
[[ "$t" == mpi ]] || fail "summary.json says transport $t, not mpi"
[[ "$h" == "$ref_digits" ]] || fail "the MPI transport's digits param_hash differs from 1 worker"
mpirun --allow-run-as-root --oversubscribe -np 3 -x LOCKSTEP_SECRET lockstep train --out runs/mpi-transport-pipe "${pipe[@]}" --set parallel.pp=3 --set dist.transport=mpi >mpi-tp.log 2>&1 || { cat mpi-tp.log; fail "pipeline over the MPI transport"; }
h="$(hash_of runs/mpi-transport-pipe/summary.json)"
echo "mpi: dist.transport = mpi, Shakespeare pp = 3: $h (1 worker: $ref_pipe)"
[[ "$h" == "$ref_pipe" ]] || fail "the MPI transport's pipeline param_hash differs from 1 worker"
passed=$((passed + 1))

# (7) A hung rank under the MPI transport: named by the survivors within 2 × the timeout; the job ends.
timeout_secs=5
mpirun --allow-run-as-root --oversubscribe -np 3 -x LOCKSTEP_SECRET lockstep train --out runs/mpi-hang --set dist.transport=mpi --set train.steps=300 --set dist.timeout_secs=5 --inject hang:rank=1,step=30 >hang.log 2>&1 &
mpirun_pid=$!
for _ in $(seq 600); do grep -q "injected fault: rank 1 hangs" hang.log 2>/dev/null && break; sleep 0.1; done
grep -q "injected fault: rank 1 hangs" hang.log || { kill -KILL "$mpirun_pid" 2>/dev/null || true; cat hang.log; fail "the hang was not injected"; }
hung_at=$(date +%s.%N)
deadline=$(( $(date +%s) + 2 * timeout_secs ))
while kill -0 "$mpirun_pid" 2>/dev/null && (( $(date +%s) <= deadline )); do sleep 0.1; done
if kill -0 "$mpirun_pid" 2>/dev/null; then
    kill -KILL "$mpirun_pid"; cat hang.log; fail "mpirun still runs $((2 * timeout_secs)) s after rank 1 hung"
fi
elapsed=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$hung_at")
if wait "$mpirun_pid"; then cat hang.log; fail "mpirun succeeded although rank 1 hung"; fi
grep -Eq "rank [02]: .*timed out after [0-9.]+s waiting for rank 1 \(mpi:world rank 1\)" hang.log || { cat hang.log; fail "no survivor names the hung rank 1"; }
echo "mpi: rank 1 hung at step 30 over the MPI transport: job ended after ${elapsed}s (timeout ${timeout_secs}s); survivors say:"
grep -Eo "rank [02]: .*waiting for rank 1 \(mpi:world rank 1\)" hang.log | sort -u | sed 's/^/mpi:   /'
passed=$((passed + 1))

# (8) bench-collectives over MPI. (docs/src/clusters.md recipe, shortened sizes.)
mpirun --allow-run-as-root --oversubscribe -np 2 -x LOCKSTEP_SECRET lockstep bench-collectives --transport mpi --op all_reduce --sizes 4K..1M --json mpi.json >bench.log 2>&1 || { cat bench.log; fail "bench-collectives --transport mpi"; }
python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["rows"]; assert r and all(x["transport"]=="mpi" and x["time_us"]>0 for x in r), r' mpi.json || fail "mpi.json has no mpi rows"
sed 's/^/mpi:   /' bench.log | tail -4
passed=$((passed + 1))

echo "mpi: $passed passed, 0 failed ($(( $(date +%s) - started )) s)"

#!/usr/bin/env bash
# A real one-machine Slurm cluster for tests: installs Debian's slurm-wlm and munge when missing,
# writes a minimal private configuration (this host as controller and as the one compute node, no
# cgroups: proctrack/linuxproc, task/none), starts munged, slurmctld and slurmd, waits until the
# node is idle, runs the given command with SLURM_CONF pointing at that configuration, and stops the
# daemons (and cancels any job left) on exit. Nothing under /etc/slurm is touched.
# Needs root. Usage: scripts/slurm-cluster.sh COMMAND [ARGS…]   (exit status: the command's)
# Example: scripts/slurm-cluster.sh bash scripts/slurm-check.sh target/debug/lockstep
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 COMMAND [ARGS…]" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "slurm-cluster: needs root (munged, slurmctld, slurmd)" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v srun >/dev/null; then
    echo "slurm-cluster: installing slurm-wlm and munge (Debian)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
for c in slurmctld slurmd munged srun sbatch sinfo scancel scontrol; do
    command -v "$c" >/dev/null || { echo "slurm-cluster: FAILED: $c is still missing after the install" >&2; exit 1; }
done

dir="$(mktemp -d /tmp/lockstep-slurm.XXXXXX)"
chmod 755 "$dir"
host="$(hostname -s)"
cpus=8 # more than the cores here (config_overrides), so srun -n 3 and 2 × 3 tasks fit on 2 cores
mkdir -p "$dir/state" "$dir/spool" "$dir/munge" "$dir/munge-run"
pids=()
stop() {
    local rc=$?
    if [[ -f "$dir/slurm.conf" ]] && command -v squeue >/dev/null; then
        SLURM_CONF="$dir/slurm.conf" scancel --full --signal=KILL --user=root 2>/dev/null || true
    fi
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null || true
    done
    if [[ $rc -ne 0 && -n "${SLURM_CLUSTER_KEEP_LOGS:-}" ]]; then
        echo "slurm-cluster: logs kept in $dir"
    else
        rm -rf "$dir"
    fi
    exit $rc
}
trap stop EXIT INT TERM

# munge: a private key and socket, so a system munged (if any) is left alone.
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none
chown -R munge:munge "$dir/munge" "$dir/munge-run"
chmod 700 "$dir/munge"
chmod 755 "$dir/munge-run"
chmod 400 "$dir/munge/munge.key"
sock="$dir/munge-run/munge.socket"
runuser -u munge -- munged --key-file="$dir/munge/munge.key" --socket="$sock" \
    --pid-file="$dir/munge-run/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" \
    --foreground >"$dir/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [[ -S "$sock" ]] && break; sleep 0.1; done
[[ -S "$sock" ]] || { echo "slurm-cluster: FAILED: munged did not start"; cat "$dir/munged.out" 2>/dev/null; exit 1; }

cat >"$dir/slurm.conf" <<EOF
ClusterName=lockstep
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket=$sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MinJobAge=30
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$dir/slurm.conf"

slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >"$dir/slurmd.out" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 120); do
    state="$(sinfo -h -n "$host" -o %t 2>/dev/null || true)"
    [[ "$state" == idle ]] && break
    sleep 0.25
done
if [[ "$state" != idle ]]; then
    echo "slurm-cluster: FAILED: node $host is not idle after 30 s (state: '${state:-none}')"
    for f in slurmctld.out slurmctld.log slurmd.out slurmd.log munged.out; do
        echo "--- $f"; tail -20 "$dir/$f" 2>/dev/null || true
    done
    exit 1
fi
echo "slurm-cluster: Slurm $(sinfo --version | awk '{print $2}') up: node $host idle ($cpus CPUs), SLURM_CONF=$SLURM_CONF"
set +e
"$@"
status=$?
set -e
if [[ $status -ne 0 ]]; then
    for f in slurmctld.log slurmd.log; do echo "--- $f (tail)"; tail -15 "$dir/$f" 2>/dev/null || true; done
fi
exit $status

# Shared by scripts/slurm-check.sh and scripts/mpi-check.sh (sourced after each defines `fail`):
# the jobs both launchers run, and their one-worker references from lockstep's own launcher.
# Sets: digits, pipe, kill_sets (argument arrays); ref_digits, ref_pipe, ref_kill (hashes).

hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }

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

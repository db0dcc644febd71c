#!/usr/bin/env bash
# Users' burn models on burn's wgpu backend, through Mesa's software Vulkan driver (llvmpipe):
# (1) own-cnn (a Job) with --device wgpu at --nproc 1 and --nproc 2: one param_hash, and every
#     rank's summary names the backend and the adapter;
# (2) own-pipeline (a LayeredJob) with --device wgpu at --nproc 1 (pp 1) and --nproc 2 (pp 2):
#     one param_hash;
# (3) the built-in transformer (configs/shakespeare.toml) with --device wgpu at 1 worker, 2
#     workers (dp 2) and 2 stages (pp 2): one param_hash, not the CPU's;
# (4) the built-in classifiers (the default MLP on digits, and a CNN) with --device wgpu at 1
#     worker, 2 workers (dp 2) and 2 stages (pp 2): one param_hash per model, not the CPU's;
# (5) refused before any worker starts, exit 3, naming the setting: tensor parallelism and
#     tensor-parallel pieces on wgpu, cuda on a machine without a GPU (with CUDA_BUILT=1, the
#     binaries have burn's CUDA backend and the refusal must name the missing driver, not the
#     build);
# (6) wgpu without any Vulkan adapter (no ICD) is refused, never trained on OpenGL instead;
# and prints own-cnn's wgpu/cpu samples/s for the closing note.
# Needs: Debian's mesa-vulkan-drivers and binaries built with `cargo build --release --features
# wgpu` (.ci/run does both, with `--features wgpu,cuda` and CUDA_BUILT=1).
# Usage: [CUDA_BUILT=1] bash scripts/wgpu-check.sh target/release
set -euo pipefail
bins="$(realpath "${1:?usage: $0 target/release}")"
repo="$(realpath "$(dirname "$0")/..")"
icd=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json
fail() { echo "wgpu: FAILED: $*"; exit 1; }
[[ -f "$icd" ]] || fail "no Mesa software Vulkan driver ($icd): apt-get install mesa-vulkan-drivers"
for b in lockstep own-cnn own-pipeline; do [[ -x "$bins/$b" ]] || fail "no $bins/$b (build it with the wgpu feature)"; done
work="$(mktemp -d /tmp/lockstep-wgpu-check.XXXXXX)"
trap 'rm -rf "$work"' EXIT
export VK_ICD_FILENAMES="$icd" XDG_RUNTIME_DIR="$work/xdg"
mkdir -m 700 -p "$XDG_RUNTIME_DIR"
hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
field() { python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$@"; }
run() { local what="$1"; shift; "$@" >"$work/log" 2>&1 || { tail -30 "$work/log"; fail "$what"; }; }
refused() {
    local what="$1" want="$2"; shift 2
    set +e; "$@" >"$work/log" 2>&1; local rc=$?; set -e
    [[ $rc == 3 ]] || { cat "$work/log"; fail "$what: exit $rc, not 3"; }
    grep -qF -- "$want" "$work/log" || { cat "$work/log"; fail "$what: the error does not name $want"; }
    ! grep -q '^\[rank ' "$work/log" || fail "$what: a worker started"
    echo "wgpu: refused as it should: $what: $(grep -m1 error "$work/log")"
}
cnn=(--set train.steps=12 --set train.eval_every=0 --set checkpoint.every=0 --set train.log_every=1000)

# (1) own-cnn at 1 and 2 workers.
run "own-cnn wgpu 1 worker" "$bins/own-cnn" train --device wgpu --nproc 1 --out "$work/cnn1" "${cnn[@]}"
run "own-cnn wgpu 2 workers" "$bins/own-cnn" train --device wgpu --nproc 2 --out "$work/cnn2" "${cnn[@]}"
h1="$(hash_of "$work/cnn1/summary.json")"; h2="$(hash_of "$work/cnn2/summary.json")"
echo "wgpu: own-cnn 1 worker $h1, 2 workers $h2"
[[ "$h1" == "$h2" ]] || fail "own-cnn on wgpu: 2 workers differ from 1"
for r in 0 1; do
    d="$(field "$work/cnn2/summary.json" "s['ranks'][$r]['device']")"
    echo "wgpu:   rank $r: $d"
    [[ "$d" == wgpu/vulkan*llvmpipe* ]] || fail "rank $r's device is not named wgpu/vulkan llvmpipe: $d"
done
run "own-cnn cpu 1 worker" "$bins/own-cnn" train --nproc 1 --out "$work/cnn-cpu" "${cnn[@]}"
[[ "$(hash_of "$work/cnn-cpu/summary.json")" != "$h1" ]] || fail "the cpu and wgpu runs have one hash: did wgpu run at all?"
python3 - "$work/cnn1/summary.json" "$work/cnn-cpu/summary.json" <<'EOF'
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:])
print(f"wgpu: own-cnn 1 worker, 12 steps: wgpu {g['samples_per_sec']:.0f} samples/s, cpu {c['samples_per_sec']:.0f} "
      f"samples/s: wgpu (llvmpipe) = {g['samples_per_sec'] / c['samples_per_sec']:.2f}x cpu")
EOF
grep -q '"device_copy"' "$work/cnn1/metrics.jsonl" || fail "metrics.jsonl has no device_copy phase"

# (2) own-pipeline: one stage on one worker against two stages on two.
pipe=(--set train.steps=10 --set train.eval_every=0 --set checkpoint.every=0 --set train.log_every=1000)
run "own-pipeline wgpu pp 1" "$bins/own-pipeline" train --device wgpu --nproc 1 --set parallel.pp=1 --out "$work/pipe1" "${pipe[@]}"
run "own-pipeline wgpu pp 2" "$bins/own-pipeline" train --device wgpu --nproc 2 --set parallel.pp=2 --out "$work/pipe2" "${pipe[@]}"
p1="$(hash_of "$work/pipe1/summary.json")"; p2="$(hash_of "$work/pipe2/summary.json")"
echo "wgpu: own-pipeline pp 1 $p1, pp 2 $p2"
[[ "$p1" == "$p2" ]] || fail "own-pipeline on wgpu: pp 2 differs from pp 1"

# (3) the built-in transformer: its stages compose burn's operations off the flex backend.
tf=(--config "$repo/configs/shakespeare.toml" --set train.steps=2 --set train.eval_every=0 --set checkpoint.every=0 --set train.log_every=1000)
run "transformer wgpu 1 worker" "$bins/lockstep" train --device wgpu --nproc 1 --set parallel.pp=1 --out "$work/tf1" "${tf[@]}"
run "transformer wgpu dp 2" "$bins/lockstep" train --device wgpu --nproc 2 --set parallel.pp=1 --out "$work/tf2" "${tf[@]}"
run "transformer wgpu pp 2" "$bins/lockstep" train --device wgpu --nproc 2 --set parallel.pp=2 --out "$work/tf3" "${tf[@]}"
run "transformer cpu 1 worker" "$bins/lockstep" train --nproc 1 --set parallel.pp=1 --out "$work/tf-cpu" "${tf[@]}"
t1="$(hash_of "$work/tf1/summary.json")"
echo "wgpu: transformer 1 worker $t1, dp 2 $(hash_of "$work/tf2/summary.json"), pp 2 $(hash_of "$work/tf3/summary.json")"
[[ "$(hash_of "$work/tf2/summary.json")" == "$t1" ]] || fail "transformer on wgpu: dp 2 differs from 1 worker"
[[ "$(hash_of "$work/tf3/summary.json")" == "$t1" ]] || fail "transformer on wgpu: pp 2 differs from 1 worker"
[[ "$(hash_of "$work/tf-cpu/summary.json")" != "$t1" ]] || fail "the transformer's cpu and wgpu runs have one hash"
[[ "$(field "$work/tf3/summary.json" "s['ranks'][1]['device']")" == wgpu/vulkan* ]] || fail "pp 2's rank 1 is not on wgpu"
python3 - "$work/tf1/summary.json" "$work/tf-cpu/summary.json" <<'EOF2'
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:])
print(f"wgpu: transformer 1 worker, 2 steps: wgpu {g['samples_per_sec']:.1f} samples/s, cpu {c['samples_per_sec']:.0f} "
      f"samples/s: wgpu (llvmpipe) = {g['samples_per_sec'] / c['samples_per_sec']:.3f}x cpu")
EOF2

# (4) the built-in classifiers: a LayeredJob like any user's, so they run wherever burn does.
for model in mlp cnn; do
    cls=(--set model.kind=$model --set model.conv=[4] --set model.cnn_hidden=16 --set train.steps=6
         --set train.eval_every=0 --set checkpoint.every=0 --set train.log_every=1000)
    run "$model wgpu 1 worker" "$bins/lockstep" train --device wgpu --nproc 1 --out "$work/builtin-$model-1" "${cls[@]}"
    run "$model wgpu dp 2" "$bins/lockstep" train --device wgpu --nproc 2 --out "$work/builtin-$model-2" "${cls[@]}"
    run "$model wgpu pp 2" "$bins/lockstep" train --device wgpu --nproc 2 --set parallel.pp=2 --out "$work/builtin-$model-3" "${cls[@]}"
    run "$model cpu 1 worker" "$bins/lockstep" train --nproc 1 --out "$work/builtin-$model-cpu" "${cls[@]}"
    c1="$(hash_of "$work/builtin-$model-1/summary.json")"
    echo "wgpu: built-in $model 1 worker $c1, dp 2 $(hash_of "$work/builtin-$model-2/summary.json"), pp 2 $(hash_of "$work/builtin-$model-3/summary.json")"
    [[ "$(hash_of "$work/builtin-$model-2/summary.json")" == "$c1" ]] || fail "built-in $model on wgpu: dp 2 differs from 1 worker"
    [[ "$(hash_of "$work/builtin-$model-3/summary.json")" == "$c1" ]] || fail "built-in $model on wgpu: pp 2 differs from 1 worker"
    [[ "$(hash_of "$work/builtin-$model-cpu/summary.json")" != "$c1" ]] || fail "the built-in $model's cpu and wgpu runs have one hash"
    [[ "$(field "$work/builtin-$model-3/summary.json" "s['ranks'][1]['device']")" == wgpu/vulkan* ]] || fail "$model pp 2's rank 1 is not on wgpu"
done

# (5) what the plan or the machine cannot do.
refused "tensor-parallel pieces on wgpu" 'model.tp_pieces = 2' \
    "$bins/lockstep" train --config "$repo/configs/shakespeare.toml" --set model.tp_pieces=2 --set parallel.pp=1 --device wgpu --nproc 1 --out "$work/no5"
refused "tensor parallelism on wgpu" 'parallel.tp' \
    "$bins/own-pipeline" train --device wgpu --nproc 2 --set parallel.pp=1 --set parallel.tp=2 --out "$work/no2"
refused "cuda without a GPU" 'train.device = "cuda"' \
    "$bins/own-cnn" train --device cuda --nproc 1 --out "$work/no3"
if [[ "${CUDA_BUILT:-0}" == 1 ]]; then
    # Built with the CUDA backend: what is missing is the machine's driver, not the feature.
    ! grep -q -- '--features cuda' "$work/log" || fail "a binary built with cuda says it was built without"
    grep -qi 'cuda driver\|cuda gpu' "$work/log" || { cat "$work/log"; fail "the cuda refusal does not name the driver or GPU"; }
    refused "cuda without a GPU (built-in transformer)" 'train.device = "cuda"' \
        "$bins/lockstep" train --config "$repo/configs/shakespeare.toml" --set parallel.pp=1 --device cuda --nproc 1 --out "$work/no6"
    # auto without a GPU (and with only a software Vulkan adapter) is the CPU.
    run "auto without a GPU" "$bins/own-cnn" train --device auto --nproc 1 --out "$work/auto" "${cnn[@]}"
    [[ "$(field "$work/auto/summary.json" "s['ranks'][0]['device']")" == flex* ]] \
        || fail "auto without a GPU did not train on the cpu: $(field "$work/auto/summary.json" "s['ranks'][0]['device']")"
fi
# (6) no Vulkan at all: refused, not run on OpenGL.
VK_ICD_FILENAMES=/nonexistent.json refused "wgpu without a Vulkan adapter" 'no vulkan adapter' \
    "$bins/own-cnn" train --device wgpu --nproc 1 --out "$work/no4"
for d in no2 no3 no4 no5 no6; do [[ ! -e "$work/$d" ]] || fail "a refused run wrote $d"; done
echo "wgpu: all checks passed"

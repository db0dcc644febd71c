#!/usr/bin/env bash
# The GPU check (issue 29), for a machine with one NVIDIA GPU, PyTorch as `python3`, no Rust and
# no network: build here, carry the binaries, run this there in one call (under 8 minutes).
#   (1) the built-in transformer (configs/shakespeare.toml, pp 1) on $DEVICE at 1 worker and at
#       2 workers sharing the GPU: one param_hash; each rank's summary names the GPU;
#   (2) a user's LayeredJob (own-pipeline, digits: committed data) likewise, 1 and 2 workers;
#   (3) the same transformer in PyTorch on the same GPU with the same shapes, batch and optimizer
#       (scripts/bench-vs-pytorch-transformer.py torch-one --device cuda; fp32, and TF32 allowed),
#       against lockstep's samples/s; model FLOP utilisation of both against the GPU's peak.
# Writes $OUT/gpu-check.json and prints one line per figure.
#
# DEVICE: cuda (a binary built with `--features cuda`: burn's CUDA backend, kernels compiled by the
# machine's NVRTC; builds offline through vendor/cubecl-cuda) or wgpu (`--features wgpu`: the GPU
# through NVIDIA's Vulkan driver);
# default: cuda if the binary accepts it here, else wgpu. DRY=1 runs everything on the CPU, to
# check the script itself on a machine without a GPU.
# Usage: bash scripts/gpu-check.sh BIN_DIR [OUT_DIR]   (BIN_DIR: lockstep and own-pipeline)
set -euo pipefail
bins="$(realpath "${1:?usage: $0 BIN_DIR [OUT_DIR]}")"
out="$(realpath -m "${2:-${OUT:-gpu-check-out}}")"
repo="$(realpath "$(dirname "$0")/..")"
mkdir -p "$out"
work="$(mktemp -d /tmp/lockstep-gpu-check.XXXXXX)"
trap 'rm -rf "$work"' EXIT
export XDG_RUNTIME_DIR="$work/xdg"; mkdir -m 700 -p "$XDG_RUNTIME_DIR"
fail() { echo "gpu: FAILED: $*"; exit 1; }
for b in lockstep own-pipeline; do [[ -x "$bins/$b" ]] || fail "no $bins/$b"; done
py="${PY:-python3}"
hash_of() { $py -c 'import json,sys; print(json.load(open(sys.argv[1]))["param_hash"])' "$1"; }
run() { local what="$1"; shift; "$@" >"$work/log" 2>&1 || { tail -30 "$work/log"; fail "$what"; }; }

if [[ "${DRY:-0}" == 1 ]]; then
    device=cpu; torch_device=cpu
else
    device="${DEVICE:-}"
    if [[ -z "$device" ]]; then
        if "$bins/lockstep" train --device cuda --nproc 1 --config "$repo/configs/shakespeare.toml" \
            --set train.steps=1 --set train.eval_every=0 --set checkpoint.every=0 \
            --set parallel.pp=1 --out "$work/probe" >/dev/null 2>&1; then device=cuda; else device=wgpu; fi
    fi
    torch_device=cuda
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /'
fi
echo "gpu: lockstep on --device $device, PyTorch on $torch_device"

steps=${STEPS:-30}
tf=(--config "$repo/configs/shakespeare.toml" --set parallel.pp=1 --set train.steps=$steps
    --set train.eval_every=0 --set checkpoint.every=0 --set train.log_every=1000)
# (1) the transformer, 1 worker and 2 sharing the device.
run "transformer 1 worker" "$bins/lockstep" train --device "$device" --nproc 1 --out "$work/tf1" "${tf[@]}"
run "transformer 2 workers" "$bins/lockstep" train --device "$device" --nproc 2 --out "$work/tf2" "${tf[@]}"
t1="$(hash_of "$work/tf1/summary.json")"; t2="$(hash_of "$work/tf2/summary.json")"
echo "gpu: transformer 1 worker $t1, 2 workers $t2"
[[ "$t1" == "$t2" ]] || fail "transformer: 2 workers differ from 1"
# (2) a user's LayeredJob.
pipe=(--set parallel.pp=1 --set train.steps=$steps --set train.eval_every=0 --set checkpoint.every=0 --set train.log_every=1000)
run "own-pipeline 1 worker" "$bins/own-pipeline" train --device "$device" --nproc 1 --out "$work/p1" "${pipe[@]}"
run "own-pipeline 2 workers" "$bins/own-pipeline" train --device "$device" --nproc 2 --out "$work/p2" "${pipe[@]}"
[[ "$(hash_of "$work/p1/summary.json")" == "$(hash_of "$work/p2/summary.json")" ]] || fail "own-pipeline: 2 workers differ from 1"
echo "gpu: own-pipeline 1 and 2 workers: $(hash_of "$work/p1/summary.json")"

# (3) PyTorch, same model and step; then the figures.
settings="$(python3 "$repo/scripts/bench-vs-pytorch-transformer.py" settings)"
for tf32 in "" "--tf32"; do
    $py "$repo/scripts/bench-vs-pytorch-transformer.py" torch-one --settings "$settings" \
        --device "$torch_device" --steps "$steps" --warmup 5 $tf32 >"$work/torch$tf32.log" 2>&1 \
        || { cat "$work/torch$tf32.log"; fail "PyTorch $tf32"; }
done
$py - "$work" "$out/gpu-check.json" "$device" "$settings" <<'EOF'
import json, statistics, subprocess, sys, datetime
work, dest, device, settings = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
def result(name):
    line = [l for l in open(f"{work}/{name}") if l.startswith("RESULT ")][0]
    return json.loads(line[len("RESULT "):])
def lockstep(run):
    s = json.load(open(f"{work}/{run}/summary.json"))
    steps = [json.loads(l) for l in open(f"{work}/{run}/metrics.jsonl")]
    slow = {}
    for r in steps:
        slow[r["step"]] = max(slow.get(r["step"], 0), r["step_seconds"])
    med = statistics.median([v for k, v in sorted(slow.items())][5:])
    return s, s["global_batch"] / med
s1, sps1 = lockstep("tf1")
s2, sps2 = lockstep("tf2")
torch32, torchtf32 = result("torch.log"), result("torch--tf32.log")
V, T, D, L, FF = (settings[k] for k in ("vocab", "context", "d_model", "blocks", "d_ff"))
# Training FLOPs per sequence: 3 x (2 x weights touched per token x tokens + attention products).
dense = L * (D * 3 * D + D * D + 2 * D * FF) + D * V
flops = 3 * (2 * dense * T + L * 2 * 2 * T * T * D)
gpu = torch32.get("gpu") or "cpu"
# Dense peaks (no sparsity), from NVIDIA's data sheets: fp32 on CUDA cores, TF32 on tensor cores.
peaks = {"H100": (67e12, 495e12), "H200": (67e12, 495e12)}
peak = next((v for k, v in peaks.items() if k in gpu), None)
def mfu(sps, which):
    return None if peak is None else sps * flops / peak[which]
out = {
    "what": "the Shakespeare transformer (configs/shakespeare.toml, pp 1) on one GPU: lockstep at 1 "
            "worker and 2 workers sharing it, PyTorch with the same shapes, batch and AdamW step "
            "(fp32, then TF32 allowed); samples/s = global batch / median step time after 5 "
            "warm-up steps (lockstep: the slowest rank's); MFU = samples/s x training FLOPs per "
            "sequence / the GPU's dense peak (fp32 CUDA cores; TF32 tensor cores)",
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "gpu": gpu, "lockstep_device": [r["device"] for r in s1["ranks"]],
    "flops_per_sequence": flops, "peak_flops": peak,
    "lockstep_1": {"samples_per_s": sps1, "mfu_fp32": mfu(sps1, 0), "param_hash": s1["param_hash"]},
    "lockstep_2_sharing": {"samples_per_s": sps2, "param_hash": s2["param_hash"]},
    "torch_fp32": dict(torch32, mfu_fp32=mfu(torch32["samples_per_s"], 0)),
    "torch_tf32": dict(torchtf32, mfu_tf32=mfu(torchtf32["samples_per_s"], 1)),
    "ratio_lockstep_to_torch_fp32": sps1 / torch32["samples_per_s"],
    "ratio_lockstep_to_torch_tf32": sps1 / torchtf32["samples_per_s"],
}
json.dump(out, open(dest, "w"), indent=1)
print(f"gpu: {gpu}: lockstep {sps1:.0f} samples/s (2 workers sharing: {sps2:.0f}); PyTorch fp32 "
      f"{torch32['samples_per_s']:.0f}, TF32 {torchtf32['samples_per_s']:.0f}; lockstep / PyTorch "
      f"fp32 = {out['ratio_lockstep_to_torch_fp32']:.2f}; MFU lockstep {out['lockstep_1']['mfu_fp32']}")
EOF
echo "gpu: all checks passed; figures in $out/gpu-check.json"

#!/usr/bin/env bash
# TensorBoard's own reader against lockstep's event files: a run at 2 workers (with a user job's
# metric and gradient clipping) is read with tensorboard's EventAccumulator (pip's `tensorboard`,
# installed into a scratch virtualenv), and its loss curve, learning rates, gradient norms and
# evaluations must equal metrics.jsonl's (as the f32 the event file stores). Fails — never
# skips — when the package cannot be installed.
#
# Usage: scripts/tensorboard-check.sh [path/to/lockstep-testjob]
set -euo pipefail
BIN=${1:-target/release/lockstep-testjob}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q tensorboard
"$BIN" train --nproc 2 --out "$WORK/run" --set optimizer.clip_grad_norm=0.2 --set train.eval_every=4 >/dev/null 2>&1

"$WORK/venv/bin/python" - "$WORK/run" <<'PY'
import json, struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

run = sys.argv[1]
acc = EventAccumulator(run + "/tensorboard", size_guidance={"scalars": 0})
acc.Reload()
tags = acc.Tags()["scalars"]
records = [json.loads(l) for l in open(run + "/metrics.jsonl")]
rank0 = {r["step"]: r for r in records if r["rank"] == 0}
f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]

def curve(tag):
    return {e.step: e.value for e in acc.Scalars(tag)}

def expect(tag, want):
    got = curve(tag)
    assert got == want, f"{tag}: tensorboard {got} != metrics.jsonl {want}"
    print(f"tensorboard-check: {tag}: {len(got)} points equal metrics.jsonl")

expect("train/loss", {s: f32(r["loss"]) for s, r in rank0.items()})
expect("train/lr", {s: f32(r["lr"]) for s, r in rank0.items()})
expect("train/grad_norm", {s: f32(r["grad_norm"]) for s, r in rank0.items()})
expect("train/mae", {s: f32(r["train_metrics"]["mae"]) for s, r in rank0.items()})
evals = {r["step"]: r["eval"] for r in records if r.get("eval")}
assert len(evals) >= 3, evals
expect("eval/test_loss", {s: f32(e["test_loss"]) for s, e in evals.items()})
expect("eval/mae", {s: f32(e["metrics"]["mae"]) for s, e in evals.items()})
for rank in (0, 1):
    tag = f"seconds/rank{rank}/forward"
    assert tag in tags, tags
    expect(tag, {r["step"]: f32(r["seconds"]["forward"]) for r in records if r["rank"] == rank})
print("tensorboard-check: ok")
PY

#!/usr/bin/env python3
"""Model state per rank and step time of the sharded and tensor-parallel layouts against plain
data parallelism, on configs/shakespeare-large.toml (22 M parameters, AdamW), 2 workers.

Layouts: dp2 at ZeRO 0 (plain data parallelism, the baseline), 1, 2 and 3, and tp2 (with
model.tp_pieces = 2, the canonical split). Every run is short (STEPS steps, no evaluation, no
checkpoint); the layouts are interleaved and repeated REPS times so that the machine's drift hits
them alike. Per layout: the largest rank's `memory` from summary.json (parameters, gradient
buffers, optimizer state, activation estimate, peak resident), the mean step time of the ranks
(steps other than the first, a warm-up, and the last, which also runs the end-of-run validation;
so STEPS ≥ 3), the parameter hash (all ZeRO levels must agree; tp2 agrees with its own
one-worker canonical split, not with plain dp), and the medians and ranges of the step-time ratio
to dp2 × zero 0 measured in the same repetition.

usage: scripts/bench-layouts.py [OUT.json] [STEPS] [REPS]
       (build first: cargo build --workspace; BIN_DIR=target/release after a release build)
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench", "layouts.json")
STEPS = max(3, int(sys.argv[2]) if len(sys.argv) > 2 else 4)
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
BIN = os.path.join(os.environ.get("BIN_DIR", os.path.join(ROOT, "target", "debug")), "lockstep")
CONFIG = os.path.join(ROOT, "configs", "shakespeare-large.toml")

LAYOUTS = [
    ("dp2-zero0", ["parallel.zero=0"]),
    ("dp2-zero1", ["parallel.zero=1"]),
    ("dp2-zero2", ["parallel.zero=2"]),
    ("dp2-zero3", ["parallel.zero=3"]),
    ("tp2", ["model.tp_pieces=2", "parallel.tp=2"]),
]
STATE = ("params_bytes", "grads_bytes", "optimizer_bytes")


def run(work, name, sets):
    out = os.path.join(work, name)
    args = [BIN, "train", "--config", CONFIG, "--nproc", "2", "--threads-per-worker", "1",
            "--out", out, "--overwrite"]
    for s in [f"train.steps={STEPS}", "train.eval_every=0", "checkpoint.every=0",
              "parallel.pp=1"] + sets:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    summary = json.load(open(os.path.join(out, "summary.json")))
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    # The first step warms up; the last one also runs the end-of-run validation pass.
    later = [r["step_seconds"] for r in records if 0 < r["step"] < STEPS - 1]
    fullest = max(summary["ranks"], key=lambda r: sum(r["memory"][k] for k in STATE))
    return {
        "param_hash": summary["param_hash"],
        "memory": fullest["memory"],
        "model_state_bytes": sum(fullest["memory"][k] for k in STATE),
        "step_seconds": statistics.mean(later),
    }


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    results = {name: [] for name, _ in LAYOUTS}
    with tempfile.TemporaryDirectory() as work:
        for rep in range(REPS):
            for name, sets in LAYOUTS:
                r = run(work, name, sets)
                results[name].append(r)
                print(f"rep {rep} {name}: {r['step_seconds']:.3f} s/step, "
                      f"state {r['model_state_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    base = results["dp2-zero0"]
    report = {
        "what": "model state per rank (largest rank) and mean step time of 2-worker layouts on "
                "configs/shakespeare-large.toml vs dp2 × zero 0, interleaved repetitions",
        "steps": STEPS,
        "reps": REPS,
        # Other work on the machine slows every layout alike only roughly: say how busy it was.
        "load_average_at_end": os.getloadavg(),
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "layouts": {},
    }
    hashes = {r["param_hash"] for n, rs in results.items() if n.startswith("dp2") for r in rs}
    report["zero_levels_share_one_hash"] = len(hashes) == 1
    for name, sets in LAYOUTS:
        rs = results[name]
        state = rs[0]["model_state_bytes"]
        report["layouts"][name] = {
            "sets": sets,
            "param_hash": rs[0]["param_hash"],
            "memory": rs[0]["memory"],
            "model_state_bytes": state,
            "model_state_vs_zero0": state / base[0]["model_state_bytes"],
            "optimizer_vs_zero0": rs[0]["memory"]["optimizer_bytes"]
            / base[0]["memory"]["optimizer_bytes"],
            "step_seconds": spread([r["step_seconds"] for r in rs]),
            "step_time_vs_zero0": spread(
                [r["step_seconds"] / b["step_seconds"] for r, b in zip(rs, base)]
            ),
        }
    with open(OUT, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    for name, l in report["layouts"].items():
        print(f"{name:10} state {l['model_state_vs_zero0']:.3f} of zero 0, optimizer "
              f"{l['optimizer_vs_zero0']:.3f}, step time {l['step_time_vs_zero0']['median']:.3f} "
              f"({l['step_time_vs_zero0']['min']:.3f}–{l['step_time_vs_zero0']['max']:.3f})")
    print(f"ZeRO levels share one parameter hash: {report['zero_levels_share_one_hash']}")


if __name__ == "__main__":
    main()

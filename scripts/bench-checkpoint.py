#!/usr/bin/env python3
"""Checkpoints written in the step against checkpoint.async = true, on configs/shakespeare-large.toml
(22 M parameters: each checkpoint holds 264 MB of parameters and AdamW state) on one worker,
a checkpoint every 4 steps, with the worker's compute on both cores (`--threads-per-worker 2`,
the default here) and on one (a core left for the writer): per run, the median time of the
checkpoint steps, of the steps during which a background write goes on (the step after each
checkpoint) and of the other steps, each step's `checkpoint` phase (the stall), and peak resident
memory. Cases interleaved, REPS repetitions, medians with ranges. Writes JSON (argv[2], default
bench/checkpoint.json).

The first step (warm-up) and the last (it also runs the final evaluation) are left out.

Usage: scripts/bench-checkpoint.py [path/to/lockstep] [out.json]
"""
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchlib import cpu_model, median_range

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/lockstep"
OUT = sys.argv[2] if len(sys.argv) > 2 else "bench/checkpoint.json"
REPS = 3
EVERY = 4
STEPS = 17
ARGS = [
    "--config", "configs/shakespeare-large.toml", "--nproc", "1",
    "--set", f"train.steps={STEPS}", "--set", f"checkpoint.every={EVERY}",
]


def run(background, threads, work):
    out = os.path.join(work, f"{background}-{len(os.listdir(work))}")
    subprocess.run([BIN, "train", *ARGS, "--threads-per-worker", str(threads),
                    "--set", f"checkpoint.async={background}", "--out", out],
                   check=True, capture_output=True)
    s = json.load(open(os.path.join(out, "summary.json")))
    records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    records = [r for r in records if 0 < r["step"] < STEPS - 1]
    is_checkpoint = lambda step: (step + 1) % EVERY == 0
    after = lambda step: step % EVERY == 0
    pick = lambda keep: statistics.median(r["step_seconds"] for r in records if keep(r["step"]))
    return {
        "param_hash": s["param_hash"],
        "checkpoint_step_seconds": pick(is_checkpoint),
        "step_after_checkpoint_seconds": pick(after),
        "ordinary_step_seconds": pick(lambda s: not is_checkpoint(s) and not after(s)),
        "stall_seconds": statistics.median(
            r["seconds"]["checkpoint"] for r in records if is_checkpoint(r["step"])),
        "peak_rss_mib": s["ranks"][0]["memory"]["peak_rss_bytes"] / 2**20,
    }


def main():
    results = {f"{mode}_threads{t}": [] for t in (2, 1) for mode in ("in_step", "background")}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(REPS):
            for case in results:  # interleaved
                background = str(case.startswith("background")).lower()
                results[case].append(run(background, int(case[-1]), work))
    hashes = {r["param_hash"] for rs in results.values() for r in rs}
    assert len(hashes) == 1, f"the checkpoint mode or thread count changed the bits: {hashes}"
    report = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "command": " ".join([BIN, "train", *ARGS]),
        "repetitions": REPS,
        "param_hash": hashes.pop(),
        "modes": {},
        "ratios": {},
    }
    for mode, rs in results.items():
        report["modes"][mode] = {k: median_range([r[k] for r in rs]) for k in rs[0] if k != "param_hash"}
        m = report["modes"][mode]
        ordinary = m["ordinary_step_seconds"]["median"]
        report["ratios"][mode] = {
            "checkpoint_step_over_ordinary": m["checkpoint_step_seconds"]["median"] / ordinary,
            "step_after_checkpoint_over_ordinary":
                m["step_after_checkpoint_seconds"]["median"] / ordinary,
        }
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["ratios"]), "->", OUT)


if __name__ == "__main__":
    main()

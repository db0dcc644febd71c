#!/usr/bin/env python3
"""Sharded checkpoints (checkpoint.sharded = true) against whole-model ones and against none, on
configs/shakespeare-large.toml (22 M parameters; a checkpoint holds 264 MB of parameters and
AdamW state) at dp2 × ZeRO 3, a checkpoint every 4 of 17 steps: per run and rank, peak resident
memory (VmHWM) and its ratio to the same rank's peak in the run without checkpoints (the issue's
"no process's resident memory during a checkpoint exceeds its training peak by more than 10%"),
and the median time of the checkpoint steps, of their `checkpoint` phase (the stall) and of the
other steps. Modes interleaved, REPS repetitions, medians with ranges. Writes JSON (argv[2],
default bench/checkpoint-sharded.json).

The first step (warm-up) and the last (final evaluation, final hash) are left out of the step
times; the peaks cover the whole run, the final hash's gather included, in every mode alike.

Usage: scripts/bench-sharded-checkpoint.py [path/to/lockstep] [out.json] [key=value ...]
(the extra settings go to every run, e.g. train.recompute=layers, which gathers ZeRO 3's
parameters one layer at a time, so a checkpoint that gathered a whole stage would show.)
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
OUT = sys.argv[2] if len(sys.argv) > 2 else "bench/checkpoint-sharded.json"
REPS = 3
EVERY = 4
STEPS = 17
EXTRA = [a for kv in sys.argv[3:] for a in ("--set", kv)]
ARGS = [
    "--config", "configs/shakespeare-large.toml", "--nproc", "2",
    "--set", "parallel.zero=3", "--set", f"train.steps={STEPS}", *EXTRA,
]
MODES = {
    "none": ["--set", "checkpoint.every=0"],
    "whole": ["--set", f"checkpoint.every={EVERY}"],
    "sharded": ["--set", f"checkpoint.every={EVERY}", "--set", "checkpoint.sharded=true"],
    "sharded-async": ["--set", f"checkpoint.every={EVERY}", "--set", "checkpoint.sharded=true",
                      "--set", "checkpoint.async=true"],
}


def run(mode, work):
    out = os.path.join(work, f"{mode}-{len(os.listdir(work))}")
    subprocess.run([BIN, "train", *ARGS, *MODES[mode], "--out", out],
                   check=True, capture_output=True)
    s = json.load(open(os.path.join(out, "summary.json")))
    records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    records = [r for r in records if 0 < r["step"] < STEPS - 1]
    is_checkpoint = lambda step: mode != "none" and (step + 1) % EVERY == 0
    # The step after a checkpoint: where a background set is settled and published.
    is_after = lambda step: mode != "none" and step % EVERY == 0
    steps = lambda keep: [r["step_seconds"] for r in records if keep(r["step"])]
    result = {
        "param_hash": s["param_hash"],
        "peak_rss_mib": [r["memory"]["peak_rss_bytes"] / 2**20 for r in s["ranks"]],
        "ordinary_step_seconds": statistics.median(
            steps(lambda s: not is_checkpoint(s) and not is_after(s))),
    }
    if mode != "none":
        result["checkpoint_step_seconds"] = statistics.median(steps(is_checkpoint))
        result["after_checkpoint_step_seconds"] = statistics.median(steps(is_after))
        result["stall_seconds"] = statistics.median(
            r["seconds"]["checkpoint"] for r in records if is_checkpoint(r["step"]))
    return result


def main():
    results = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(REPS):
            for mode in results:  # interleaved
                results[mode].append(run(mode, work))
    hashes = {r["param_hash"] for rs in results.values() for r in rs}
    assert len(hashes) == 1, f"the checkpoint mode changed the bits: {hashes}"
    ranks = len(results["none"][0]["peak_rss_mib"])
    base = [statistics.median(r["peak_rss_mib"][k] for r in results["none"]) for k in range(ranks)]
    report = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "command": " ".join([BIN, "train", *ARGS]),
        "checkpoint_every": EVERY,
        "repetitions": REPS,
        "param_hash": hashes.pop(),
        "modes": {},
    }
    for mode, rs in results.items():
        m = {"peak_rss_mib": [median_range([r["peak_rss_mib"][k] for r in rs]) for k in range(ranks)]}
        m["peak_rss_over_no_checkpoints"] = [
            m["peak_rss_mib"][k]["median"] / base[k] for k in range(ranks)]
        for k in rs[0]:
            if k.endswith("seconds"):
                m[k] = median_range([r[k] for r in rs])
        if mode != "none":
            m["checkpoint_step_over_ordinary"] = (
                m["checkpoint_step_seconds"]["median"] / m["ordinary_step_seconds"]["median"])
            m["after_checkpoint_step_over_ordinary"] = (
                m["after_checkpoint_step_seconds"]["median"]
                / m["ordinary_step_seconds"]["median"])
        report["modes"][mode] = m
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v["peak_rss_over_no_checkpoints"] for k, v in report["modes"].items()}),
          "->", OUT)


if __name__ == "__main__":
    main()

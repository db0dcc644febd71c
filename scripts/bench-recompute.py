#!/usr/bin/env python3
"""train.recompute = "layers" against keeping every layer's graph, on the layered test job as a
two-stage GPipe pipeline with eight micro-batches in flight (hidden width 2048, dropout 0.2):
peak resident memory (VmHWM) and mean step time per rank, interleaved, REPS repetitions,
medians with ranges. Writes JSON (argv[2], default bench/recompute.json).

Usage: scripts/bench-recompute.py [path/to/lockstep-testjob-layered] [out.json]
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile

from benchlib import cpu_model, median_range

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/lockstep-testjob-layered"
OUT = sys.argv[2] if len(sys.argv) > 2 else "bench/recompute.json"
REPS = 3
ARGS = [
    "--nproc", "2", "--set", "parallel.pp=2", "--set", 'parallel.schedule="gpipe"',
    "--set", "job.hidden=2048", "--set", "job.train_samples=4096", "--set", "job.dropout=0.2",
    "--set", "train.global_batch=4096", "--set", "train.microbatch=512", "--set", "train.steps=4",
]


def run(mode, work):
    out = os.path.join(work, f"{mode}-{len(os.listdir(work))}")
    subprocess.run([BIN, "train", *ARGS, "--set", f'train.recompute="{mode}"', "--out", out],
                   check=True, capture_output=True)
    s = json.load(open(os.path.join(out, "summary.json")))
    ranks = sorted(s["ranks"], key=lambda r: r["rank"])
    return {
        "param_hash": s["param_hash"],
        "peak_rss_mib": [r["memory"]["peak_rss_bytes"] / 2**20 for r in ranks],
        "activation_peak_mib": [r["memory"]["activation_peak_bytes"] / 2**20 for r in ranks],
        "step_seconds": ranks[0]["step_seconds_mean"],
    }


def main():
    results = {"none": [], "layers": []}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(REPS):
            for mode in results:  # interleaved
                results[mode].append(run(mode, work))
    hashes = {r["param_hash"] for rs in results.values() for r in rs}
    assert len(hashes) == 1, f"recompute changed the bits: {hashes}"
    report = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "command": " ".join([BIN, "train", *ARGS]),
        "repetitions": REPS,
        "param_hash": hashes.pop(),
        "modes": {},
    }
    for mode, rs in results.items():
        report["modes"][mode] = {
            "peak_rss_mib_rank0": median_range([r["peak_rss_mib"][0] for r in rs]),
            "peak_rss_mib_rank1": median_range([r["peak_rss_mib"][1] for r in rs]),
            "activation_estimate_mib": rs[0]["activation_peak_mib"],
            "step_seconds": median_range([r["step_seconds"] for r in rs]),
        }
    m = report["modes"]
    report["ratios"] = {
        "rank0_peak_rss_layers_over_none": m["layers"]["peak_rss_mib_rank0"]["median"]
        / m["none"]["peak_rss_mib_rank0"]["median"],
        "step_time_layers_over_none": m["layers"]["step_seconds"]["median"]
        / m["none"]["step_seconds"]["median"],
    }
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["ratios"]), "->", OUT)


if __name__ == "__main__":
    main()

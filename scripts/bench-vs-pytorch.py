#!/usr/bin/env python3
"""lockstep against PyTorch on the same CPUs, the same MLPs and the same step (issue 13).

Why a script and not a test: speed is a benchmark, never a test. This runs, interleaved in one
invocation (the machine's speed drifts between runs, and other work may share it), for each model
(small: MLP 784-512-512-10, big: 784-2048x3-10; global batch 256, SGD lr 0.05 momentum 0.9,
1 thread per process, 2 in the 1x2 cases):

  torch_1x1     PyTorch, 1 process x 1 thread      (/work/shared/anchors/ddp_mlp.py config a)
  torch_ddp2    PyTorch DDP over gloo, 2 x 1        (config c)
  lockstep_1x1  lockstep train --nproc 1 --threads-per-worker 1 (exact reduction, the default)
  lockstep_1x1_plain  the same with dist.reproducible = false
  lockstep_2x1  --nproc 2, exact reduction (dist.reproducible = true, the default)
  lockstep_2x1_plain  --nproc 2, plain f32 all-reduce (dist.reproducible = false)
  torch_1x2     PyTorch, 1 process x 2 threads      (config b): per-worker compute at
  lockstep_1x2  --nproc 1 --threads-per-worker 2      cores / nproc threads with nproc = 1

lockstep's 2 threads split its own loops' outputs (the dense layers' products, the parameter and
gradient copies, the optimizer, the one-worker exact sum; burn's kernels stay on one), with the
bits of one thread: lockstep_1x2 must end with lockstep_1x1's hash (checked here).

Order: every other repetition runs the configurations in reverse, so each system's runs come
before and after the other's equally often. A run can leave this VM slower for the next tens of
seconds: lockstep 1x2 measured 8.3 ms per step right after a PyTorch 2-thread run and for ~20 s
after it, 5.6 ms alone (2026-12-05).

samples/s = 256 / median step time over the steps after the first 20, where a step's time is the
slowest rank's (PyTorch: ddp_mlp.py's own figure; lockstep: metrics.jsonl's `step_seconds`, max
over ranks). lockstep's micro-batch is 128 (2 per step at 1 worker, 1 per worker at 2): the same
micro-batches at both world sizes, so both end with the same parameter hash (checked here).
Ratios are taken within one repetition (lockstep run next to the PyTorch run it is compared with),
then the median over repetitions.

Differences that remain: lockstep reads Fashion-MNIST, PyTorch synthetic data of the same shape;
lockstep's 2 workers talk through shared memory, PyTorch's through gloo over loopback TCP (the
transports each uses by default on one host).

usage: scripts/bench-vs-pytorch.py [--python VENV/bin/python] [--reps 3] [--reps-big 2]
                                   [--out bench/vs-pytorch.json]
Build first: cargo build --release --workspace --bin lockstep.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_model, spread, wait_for_quiet, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 20
MODELS = {"small": ("[512, 512]", 200), "big": ("[2048, 2048, 2048]", 60)}
CONFIGS = ["torch_1x1", "lockstep_1x1", "lockstep_1x1_plain", "torch_ddp2", "lockstep_2x1",
           "lockstep_2x1_plain", "torch_1x2", "lockstep_1x2"]


def run_torch(py, anchor, config, model, steps, threads=1):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [py, anchor, "one", "--config", config, "--model", model, "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not line:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    d = json.loads(line[0][len("RESULT "):])
    return {"samples_per_s": d["samples_per_s"], "step_ms": d["step_ms"],
            "torch": d["torch"]}


def run_lockstep(binary, model, steps, nproc, reproducible, threads=1):
    hidden, _ = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="vs-pytorch-") as d:
        out_dir = os.path.join(d, "run")
        cmd = [binary, "train", "--config", os.path.join(ROOT, "configs/bench-mlp784.toml"),
               "--nproc", str(nproc), "--threads-per-worker", str(threads), "--out", out_dir,
               "--set", f"model.hidden={hidden}", "--set", f"train.steps={steps}",
               "--set", "train.microbatch=128", "--set", "train.log_every=1000",
               "--set", f"dist.reproducible={'true' if reproducible else 'false'}"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
        per_step = {}
        with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
            for line in fh:
                r = json.loads(line)
                if "step_seconds" in r and "rank" in r:
                    per_step[r["step"]] = max(per_step.get(r["step"], 0.0), r["step_seconds"])
        with open(os.path.join(out_dir, "summary.json")) as fh:
            summary = json.load(fh)
    times = [t for s, t in sorted(per_step.items()) if s > WARMUP]
    med = statistics.median(times)
    return {"samples_per_s": 256 / med, "step_ms": med * 1e3,
            "param_hash": summary["param_hash"],
            "kernels": summary.get("compute", {}).get("kernels", "unknown")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="/work/scratch/venv/bin/python")
    ap.add_argument("--anchor", default="/work/shared/anchors/ddp_mlp.py")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/lockstep"))
    ap.add_argument("--reps", type=int, default=3, help="repetitions, small MLP")
    ap.add_argument("--reps-big", type=int, default=2, help="repetitions, big MLP")
    ap.add_argument("--models", default="small,big")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/vs-pytorch.json"))
    ap.add_argument("--quiet-load", type=float, default=2.5,
                    help="before each run, wait for the 1-minute load average to fall under this")
    ap.add_argument("--max-wait", type=float, default=60, help="... but at most this many s")
    a = ap.parse_args()

    runs = {}  # (model, config) -> [result per rep]
    for model in a.models.split(","):
        _, steps = MODELS[model]
        for rep in range(a.reps if model == "small" else a.reps_big):
            for cfg in (CONFIGS if rep % 2 == 0 else CONFIGS[::-1]):
                load0 = wait_for_quiet(a.quiet_load, a.max_wait)
                if cfg == "torch_1x1":
                    r = run_torch(a.python, a.anchor, "a", model, steps)
                elif cfg == "torch_ddp2":
                    r = run_torch(a.python, a.anchor, "c", model, steps)
                elif cfg == "torch_1x2":
                    r = run_torch(a.python, a.anchor, "b", model, steps, threads=2)
                elif cfg == "lockstep_1x2":
                    r = run_lockstep(a.bin, model, steps, 1, True, threads=2)
                else:
                    nproc = 1 if cfg.startswith("lockstep_1x1") else 2
                    r = run_lockstep(a.bin, model, steps, nproc, not cfg.endswith("_plain"))
                r["load_before"] = load0
                runs.setdefault((model, cfg), []).append(r)
                print(f"{model:5s} rep {rep} {cfg:18s} {r['samples_per_s']:9.0f} samples/s "
                      f"(step {r['step_ms']:.2f} ms, load {load0:.2f})", flush=True)

    result = {
        "what": "samples/s = 256 / median step time (slowest rank) over steps after the first "
                f"{WARMUP}; 1 thread per process (2 in the 1x2 cases); global batch 256; SGD momentum 0.9; "
                "runs of both systems interleaved, order reversed every other repetition; ratios taken within one repetition",
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "shared": "the machine is shared with other agents' builds and tests: absolute "
                              "figures swing; compare the ratios (measured side by side), and see "
                              "load_before of each run"},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "models": {},
    }
    for model in a.models.split(","):
        m = {}
        for cfg in CONFIGS:
            rs = runs[(model, cfg)]
            m[cfg] = spread([r["samples_per_s"] for r in rs])
            m[cfg]["load_before"] = [round(r["load_before"], 2) for r in rs]
            if "kernels" in rs[0]:
                m[cfg]["kernels"] = rs[0]["kernels"]
                m[cfg]["param_hashes"] = sorted({r["param_hash"] for r in rs})
            if "torch" in rs[0]:
                m[cfg]["torch"] = rs[0]["torch"]

        def ratio(x, y):
            return spread([p["samples_per_s"] / q["samples_per_s"]
                           for p, q in zip(runs[(model, x)], runs[(model, y)])])
        m["ratios"] = {
            "lockstep_1x1 / torch_1x1": ratio("lockstep_1x1", "torch_1x1"),
            "lockstep_1x1_plain / torch_1x1": ratio("lockstep_1x1_plain", "torch_1x1"),
            "lockstep_2x1 / torch_ddp2": ratio("lockstep_2x1", "torch_ddp2"),
            "lockstep_2x1_plain / torch_ddp2": ratio("lockstep_2x1_plain", "torch_ddp2"),
            "lockstep_2x1 / lockstep_2x1_plain": ratio("lockstep_2x1", "lockstep_2x1_plain"),
            "lockstep_1x2 / torch_1x2": ratio("lockstep_1x2", "torch_1x2"),
            "lockstep_1x2 / lockstep_1x1": ratio("lockstep_1x2", "lockstep_1x1"),
            "torch_1x2 / torch_1x1": ratio("torch_1x2", "torch_1x1"),
        }
        hashes = {h for cfg in ("lockstep_1x1", "lockstep_2x1") for h in m[cfg]["param_hashes"]}
        m["exact_same_hash_1x1_2x1"] = len(hashes) == 1
        hashes |= set(m["lockstep_1x2"]["param_hashes"])
        m["exact_same_hash_1x1_2x1_1x2"] = len(hashes) == 1
        result["models"][model] = m
    write_json(a.out, result)
    print_table(result)


def print_table(result):
    def f(s):
        return f"{s['median']:.0f} ({s['min']:.0f}–{s['max']:.0f})"

    def r(s):
        return f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f})"
    print("\n| model | PyTorch 1×1 | lockstep 1×1 | ratio | lockstep 1×1 plain | ratio "
          "| PyTorch DDP 2×1 | lockstep 2×1 exact | ratio | lockstep 2×1 plain | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, m in result["models"].items():
        q = m["ratios"]
        print(f"| {model} | {f(m['torch_1x1'])} | {f(m['lockstep_1x1'])} | "
              f"{r(q['lockstep_1x1 / torch_1x1'])} | {f(m['lockstep_1x1_plain'])} | "
              f"{r(q['lockstep_1x1_plain / torch_1x1'])} | {f(m['torch_ddp2'])} | "
              f"{f(m['lockstep_2x1'])} | {r(q['lockstep_2x1 / torch_ddp2'])} | "
              f"{f(m['lockstep_2x1_plain'])} | {r(q['lockstep_2x1_plain / torch_ddp2'])} |")
    print("\n| model | PyTorch 1×2 | lockstep 1×2 | ratio | PyTorch 1×2 / 1×1 "
          "| lockstep 1×2 / 1×1 | same hash 1×1, 2×1, 1×2 |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for model, m in result["models"].items():
        q = m["ratios"]
        print(f"| {model} | {f(m['torch_1x2'])} | {f(m['lockstep_1x2'])} | "
              f"{r(q['lockstep_1x2 / torch_1x2'])} | {r(q['torch_1x2 / torch_1x1'])} | "
              f"{r(q['lockstep_1x2 / lockstep_1x1'])} | {m['exact_same_hash_1x1_2x1_1x2']} |")


if __name__ == "__main__":
    main()

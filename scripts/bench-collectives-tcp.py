#!/usr/bin/env python3
"""TCP all-reduce of lockstep against shared memory, memcpy and PyTorch's gloo, interleaved.

Each repetition runs, in turn, `lockstep bench-collectives --transport tcp`, the same with
`--transport shm` (each prints the single-thread memcpy bandwidth it measured in the same run) and
`scripts/bench-gloo.py` (torch.distributed over gloo, same sizes and conventions), all with 2
processes of 1 thread on this host. The JSON holds every run plus, per size and implementation,
the median and range of busbw, and for lockstep TCP the ratio busbw / memcpy of the same run.

    python3 scripts/bench-collectives-tcp.py --lockstep target/release/lockstep \\
        --python /path/to/venv/bin/python [--reps 3] [--sizes 4K,64K,1M,16M,64M] \\
        [--prefix "chrt -f 1"] --json bench/collectives-tcp.json

`--prefix` runs every command under a wrapper, e.g. `chrt -f 1` to measure on a machine other
jobs keep busy (real-time priority: the benchmark's processes then get the cores they ask for).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, prefix, env=None):
    full = shlex.split(prefix) + cmd if prefix else cmd
    print("+", " ".join(full), env or "", file=sys.stderr, flush=True)
    subprocess.run(full, check=True, timeout=900, stdout=sys.stderr,
                   env={**os.environ, **(env or {})})


def lockstep_run(a, transport, env=None):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        run([a.lockstep, "bench-collectives", "--nproc", "2", "--transport", transport,
             "--op", "all_reduce", "--sizes", a.sizes, "--json", path], a.prefix, env)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def gloo_run(a):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        run([a.python, os.path.join(HERE, "bench-gloo.py"), "--nproc", "2", "--sizes", a.sizes,
             "--json", path], a.prefix)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lockstep", default="target/release/lockstep")
    ap.add_argument("--python", default=sys.executable, help="a Python with torch (for gloo)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--prefix", default="", help='wrapper for every command, e.g. "chrt -f 1"')
    ap.add_argument("--json", required=True)
    ap.add_argument("--low-water-off", action="store_true",
                    help="also run TCP with LOCKSTEP_TCP_RECV_LOW_WATER=0 (the transport before the "
                         "receive low-water mark), as kind lockstep-tcp-low-water-off")
    a = ap.parse_args()

    runs = []
    for rep in range(a.reps):
        runs.append({"rep": rep, "kind": "lockstep-tcp", **lockstep_run(a, "tcp")})
        if a.low_water_off:
            off = lockstep_run(a, "tcp", {"LOCKSTEP_TCP_RECV_LOW_WATER": "0"})
            runs.append({"rep": rep, "kind": "lockstep-tcp-low-water-off", **off})
        runs.append({"rep": rep, "kind": "lockstep-shm", **lockstep_run(a, "shm")})
        runs.append({"rep": rep, "kind": "gloo", **gloo_run(a)})

    per_size = {}
    for r in runs:
        for row in r["rows"]:
            d = per_size.setdefault(row["bytes"], {})
            d.setdefault(r["kind"], []).append(row["busbw_gbps"])
            d.setdefault(r["kind"] + "-time_us", []).append(row["time_us"])
            if r["kind"].startswith("lockstep-tcp"):
                ratio = r["kind"].replace("lockstep-tcp", "tcp") + "/memcpy"
                d.setdefault(ratio, []).append(row["busbw_gbps"] / r["memcpy_gbps"])
    memcpy = [r["memcpy_gbps"] for r in runs if "memcpy_gbps" in r]
    table = []
    for size in sorted(per_size):
        d = per_size[size]
        table.append({"bytes": size, **{k: summary(v) for k, v in d.items()},
                      "tcp_ahead_of_gloo_every_rep": all(
                          t > g for t, g in zip(d["lockstep-tcp"], d["gloo"]))})
    out = {
        "what": "all_reduce f32, 2 processes x 1 thread, this host; busbw in GB/s "
                "(nccl-tests convention, = algbw for 2 ranks); tcp/memcpy uses the memcpy of the "
                "same lockstep run",
        "command": " ".join(shlex.quote(x) for x in sys.argv),
        "prefix": a.prefix,
        "reps": a.reps,
        "memcpy_gbps": summary(memcpy),
        "summary": table,
        "runs": runs,
    }
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"memcpy {out['memcpy_gbps']['median']:.2f} GB/s (median of {len(memcpy)})")
    kinds = ["lockstep-tcp"] + (["lockstep-tcp-low-water-off"] if a.low_water_off else [])
    kinds += ["lockstep-shm", "gloo"]
    print("busbw GB/s, median [min-max]; tcp/memcpy: median")
    print(f"{'bytes':>10} " + " ".join(f"{k:>18}" for k in kinds) + f" {'tcp/memcpy':>11}")
    for t in table:
        f = lambda k: f"{t[k]['median']:.2f} [{t[k]['min']:.2f}-{t[k]['max']:.2f}]"
        print(f"{t['bytes']:>10} " + " ".join(f"{f(k):>18}" for k in kinds)
              + f" {100 * t['tcp/memcpy']['median']:>10.1f}%")


if __name__ == "__main__":
    main()

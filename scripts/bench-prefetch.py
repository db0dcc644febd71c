#!/usr/bin/env python3
"""ZeRO 3 one layer at a time with the next layer's gather prefetched (`parallel.prefetch_layers`
= 1, the default) against gathering each layer when it is needed (0), interleaved, REPS
repetitions, medians with ranges.

configs/shakespeare-large.toml (22 M parameters, 7 blocks of 3.1 M), dp 2 × ZeRO 3 with
`train.recompute = "layers"` (14 gathers of 12.6 MB per micro-batch), in two settings:
- one host: 2 workers, the shared-memory transport;
- two hosts: network namespaces joined by a veth pair shaped to RATE with tbf (one worker each,
  TCP between them). Needs root.
Per run: the median step time of the steps between the first and the last (the last includes
the final evaluation), the exposed gather and gradient communication per step, each rank's peak
resident memory, and the param_hash (the same for every run: prefetch never changes the bits).

Usage: sudo scripts/bench-prefetch.py [path/to/lockstep] [out.json] [rate]
"""
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchlib import cpu_model, median_range, write_json

BIN = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "target/release/lockstep")
OUT = sys.argv[2] if len(sys.argv) > 2 else "bench/prefetch.json"
RATE = sys.argv[3] if len(sys.argv) > 3 else "1gbit"
REPS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = [
    "--config", os.path.join(ROOT, "configs/shakespeare-large.toml"),
    "--set", "train.steps=6", "--set", "parallel.zero=3", "--set", 'train.recompute="layers"',
]
NS = (f"lspfA{os.getpid()}", f"lspfB{os.getpid()}")
VETH = (f"vpA{os.getpid()}", f"vpB{os.getpid()}")


def sh(*cmd):
    subprocess.run(cmd, check=True)


def make_hosts():
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for i, (ns, veth) in enumerate(zip(NS, VETH)):
        sh("ip", "link", "set", veth, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"10.78.0.{i + 1}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", veth, "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
           "rate", RATE, "burst", "256kb", "latency", "50ms")


def drop_hosts():
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def measure(out):
    s = json.load(open(os.path.join(out, "summary.json")))
    steps = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        d = json.loads(line)
        if "step_seconds" in d:
            steps.setdefault(d["step"], []).append(d)
    inner = [max(r["step_seconds"] for r in rs) for k, rs in sorted(steps.items())][1:-1]
    comm = [statistics.mean(r["seconds"]["communication"] for r in rs)
            for k, rs in sorted(steps.items())][1:-1]
    return {
        "param_hash": s["param_hash"],
        "layers_prefetched": s.get("layers_prefetched"),
        "step_seconds": statistics.median(inner),
        "communication_seconds": statistics.median(comm),
        "peak_rss_mib": max(r["memory"]["peak_rss_bytes"] for r in s["ranks"]) / 2**20,
    }


def one_host(ahead, out):
    subprocess.run([BIN, "train", *SETS, "--set", f"parallel.prefetch_layers={ahead}",
                    "--nproc", "2", "--out", out], check=True, capture_output=True)
    return measure(out)


def two_hosts(ahead, out, port):
    secret = subprocess.run([BIN, "secret"], check=True, capture_output=True,
                            text=True).stdout.strip()
    env = {**os.environ, "LOCKSTEP_SECRET": secret}
    procs = [
        subprocess.Popen(["ip", "netns", "exec", ns, BIN, "train", *SETS,
                          "--set", f"parallel.prefetch_layers={ahead}", "--nproc", "1",
                          "--nnodes", "2", "--node-rank", str(i), "--rdzv", f"10.78.0.1:{port}",
                          "--out", out if i == 0 else out + "-b"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for i, ns in enumerate(NS)
    ]
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"two-host run failed: {err.decode()[-2000:]}")
    return measure(out)


def main():
    results = {s: {0: [], 1: []} for s in ("one_host_shm", f"two_hosts_tcp_{RATE}")}
    make_hosts()
    try:
        with tempfile.TemporaryDirectory() as work:
            port = 29711
            for rep in range(REPS):
                for ahead in (0, 1):  # interleaved
                    out = os.path.join(work, f"one-{rep}-{ahead}")
                    results["one_host_shm"][ahead].append(one_host(ahead, out))
                    out = os.path.join(work, f"two-{rep}-{ahead}")
                    port += 1
                    results[f"two_hosts_tcp_{RATE}"][ahead].append(two_hosts(ahead, out, port))
    finally:
        drop_hosts()
    hashes = {r["param_hash"] for s in results.values() for rs in s.values() for r in rs}
    assert len(hashes) == 1, f"prefetch or the hosts changed the bits: {hashes}"
    report = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "command": " ".join([BIN, "train", *SETS]),
        "repetitions": REPS,
        "param_hash": hashes.pop(),
        "settings": {},
    }
    for setting, by_ahead in results.items():
        row = {}
        for ahead, rs in by_ahead.items():
            row[f"prefetch_layers_{ahead}"] = {
                k: median_range([r[k] for r in rs])
                for k in ("step_seconds", "communication_seconds", "peak_rss_mib")
            }
        row["step_time_prefetch_over_none"] = (
            row["prefetch_layers_1"]["step_seconds"]["median"]
            / row["prefetch_layers_0"]["step_seconds"]["median"])
        report["settings"][setting] = row
    write_json(OUT, report)
    print(json.dumps({s: r["step_time_prefetch_over_none"]
                      for s, r in report["settings"].items()}), "->", OUT)


if __name__ == "__main__":
    main()

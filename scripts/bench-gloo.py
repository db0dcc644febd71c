#!/usr/bin/env python3
"""All-reduce timing of PyTorch's gloo backend, for comparison with `lockstep bench-collectives`.

Same conventions as lockstep's bench (crates/cli/src/bench.rs): f32 buffer of `bytes`, one warm-up,
a probe sizes the iteration count to ~0.3 s (the max over ranks), time = max over ranks of the
timed loop / iterations, algbw = bytes / time, busbw = algbw * 2(n-1)/n. Processes run with one
thread each, over TCP loopback (GLOO_SOCKET_IFNAME=lo).

    python scripts/bench-gloo.py [--nproc 2] [--sizes 4096,65536,...] [--json out.json]

Prints a table; with --json writes {"rows": [...]} with the fields of lockstep's rows.
"""

import argparse
import json
import os
import socket
import sys
import time


def parse_size(s):
    s = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def worker(rank, world, port, sizes, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        dist.all_reduce(buf)  # warm-up
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(buf)
        probe = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        iters = min(max(int(0.3 / max(probe.item(), 1e-7)), 3), 2000)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        secs = elapsed.item() / iters
        real = buf.numel() * 4
        algbw = real / secs / 1e9
        rows.append(
            dict(
                op="all_reduce",
                transport="gloo",
                world_size=world,
                bytes=real,
                time_us=secs * 1e6,
                algbw_gbps=algbw,
                busbw_gbps=algbw * 2 * (world - 1) / world,
            )
        )
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--json")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a.nproc, port, sizes, queue)) for r in range(a.nproc)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            sys.exit(f"gloo worker exited with {p.exitcode}")
    print(f"{'bytes':>12} {'time_us':>12} {'algbw_GB/s':>11} {'busbw_GB/s':>11}")
    for r in rows:
        print(f"{r['bytes']:>12} {r['time_us']:>12.1f} {r['algbw_gbps']:>11.2f} {r['busbw_gbps']:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

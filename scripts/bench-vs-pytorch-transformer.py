#!/usr/bin/env python3
"""lockstep against PyTorch on the same CPU, the Shakespeare transformer, one worker (issue 13).

Why a script and not a test: speed is a benchmark, never a test. Companion of
scripts/bench-vs-pytorch.py (the MLPs). This runs, interleaved in one invocation (the machine's
speed drifts between runs, and other work may share it), for each repetition:

  lockstep_1x1      lockstep train --config configs/shakespeare.toml --nproc 1
                    --threads-per-worker 1 --set parallel.pp=1 (data-parallel, one worker)
  torch_1x1         PyTorch, 1 process x 1 thread, the same model written as a PyTorch user would
                    (nn.Linear, nn.LayerNorm, F.gelu, F.scaled_dot_product_attention is_causal)
  torch_1x1_eager   the same, attention spelled out as lockstep computes it
                    (q k^T / sqrt(dh) + additive -1e9 mask, softmax, @ v)
  with --two-threads also:
  lockstep_1x2      --threads-per-worker 2 (lockstep's own loops split their outputs between the
                    two: the linear layers' and attention's products, GELU, softmax, layer norm,
                    the copies, the optimizer and the one-worker exact sum; burn's remaining
                    kernels run on one: see `lockstep train --help`)
  torch_1x2         torch.set_num_threads(2), OMP_NUM_THREADS=MKL_NUM_THREADS=2
  with --baseline-bin B also:
  baseline_1x1      lockstep_1x1 with an earlier build B (a change measured against its parent
                    in the same invocation)
  with --ddp also:
  lockstep_2x1      --nproc 2 --threads-per-worker 1 (data parallel, exact sum; the slowest
                    rank's step time)
  torch_ddp_2x1     2 processes x 1 thread, DistributedDataParallel over gloo, each rank its half
                    of the global batch, gradients all-reduced during the last micro-batch's
                    backward (no_sync before it); the slowest rank's step time

The model (configs/shakespeare.toml, `model.kind = "transformer"`, crates/model/src/transformer.rs):
token embedding [vocab, 128] + learned position embedding [64, 128]; 4 pre-norm blocks
x + proj(attn(ln1(x))), x + fc2(gelu(fc1(ln2(x)))) with qkv [128, 384] split Q|K|V into 4 heads
of 32, causal; exact (erf) GELU; d_ff 512; LayerNorm eps 1e-5 with gain and bias; every linear
has a bias; final LayerNorm and an untied output projection [128, vocab] with bias; no dropout.
vocab = the distinct bytes of data/shakespeare/{train,val}.txt.gz (as crates/data/src/text.rs
builds it). The PyTorch model's parameter count is checked against lockstep's (summary.json,
ranks[0].memory.params_bytes / 4) after every run; a mismatch stops the script.

The step, both sides: global batch 32 sequences of 64 tokens, split into micro-batches as lockstep
resolves the config (parallel.microbatches = 4: micro-batches of 8, checked against
summary.json), each micro-batch forward + backward with loss = sum of token cross-entropy /
(32 * 64), gradients accumulated; then AdamW (beta1 0.9, beta2 0.99, eps 1e-8, weight decay
0.01, applied to every parameter as lockstep does). samples/s = 32 / median step time over the
steps after the first --warmup; lockstep's step time is metrics.jsonl's `step_seconds`, its phases
(`seconds`: data, forward, backward, communication, optimizer, ...) are reported as medians too.
Ratios are taken within one repetition (lockstep run next to the PyTorch run it is compared
with), then the median and range over repetitions. Every other repetition runs the
configurations in reverse order (a run can leave the VM slower for the next tens of seconds; see
scripts/bench-vs-pytorch.py).

Differences that remain: lockstep reads Shakespeare windows, PyTorch random token ids of the same
shape (the compute does not depend on the values); lockstep's learning rate follows its warmup /
cosine schedule, PyTorch's is constant 0.003 (a scalar per step either way); lockstep's step also
holds its exact (fixed-point) gradient sum over the 4 micro-batches ("communication", even at one
worker), the loss check of each micro-batch and the copy of the flat parameters back into its
burn tensors; PyTorch's default init differs from lockstep's (timing does not depend on it);
PyTorch's AdamW is its default CPU implementation (per-tensor loop, not fused).

usage: scripts/bench-vs-pytorch-transformer.py [--python /work/torchvenv/bin/python] [--reps 3]
           [--steps 40] [--warmup 5] [--two-threads] [--ddp] [--out bench/vs-pytorch-transformer.json]
Build first: cargo build --release --bin lockstep.
"""
import argparse
import contextlib
import gzip
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
CONFIG = os.path.join(ROOT, "configs/shakespeare.toml")
CONFIGS_1 = ["lockstep_1x1", "torch_1x1", "torch_1x1_eager"]
CONFIGS_2 = ["lockstep_1x2", "torch_1x2"]
CONFIGS_DDP = ["lockstep_2x1", "torch_ddp_2x1"]


def is_lockstep(cfg):
    """Whether a case runs a lockstep build (this one, or the --baseline-bin one)."""
    return cfg.startswith("lockstep") or cfg.startswith("baseline")


def shakespeare_vocab():
    """Distinct bytes of train ∪ val, as crates/data/src/text.rs builds the vocabulary."""
    present = set()
    for split in ("train", "val"):
        with gzip.open(os.path.join(ROOT, f"data/shakespeare/{split}.txt.gz"), "rb") as fh:
            present |= set(fh.read())
    return len(present)


def model_settings():
    """The transformer, batch and optimizer of configs/shakespeare.toml, with lockstep's
    defaults for what it leaves out (crates/train/src/config.rs)."""
    import tomllib
    with open(CONFIG, "rb") as fh:
        c = tomllib.load(fh)
    m, t, o, p = c["model"], c["train"], c.get("optimizer", {}), c.get("parallel", {})
    assert m["kind"] == "transformer" and o.get("kind") == "adamw", CONFIG
    gb = t["global_batch"]
    mbs = p.get("microbatches", 0)
    microbatch = gb // mbs if mbs else t.get("microbatch", 16)
    return {"vocab": shakespeare_vocab(), "context": m.get("context", 64),
            "d_model": m.get("d_model", 128), "heads": m.get("heads", 4),
            "blocks": m.get("blocks", 4), "d_ff": m.get("d_ff", 0) or 4 * m.get("d_model", 128),
            "global_batch": gb, "microbatch": microbatch, "lr": t["lr"],
            "beta1": o.get("beta1", 0.9), "beta2": o.get("beta2", 0.999), "eps": o.get("eps", 1e-8),
            "weight_decay": o.get("weight_decay", 0.0)}


# ----- PyTorch side (runs in the torch venv: `script torch-one --settings JSON ...`) -----

def torch_one(settings, threads, attention, steps, warmup, device="cpu", tf32=False, rank=None,
              world=1):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    s = settings
    V, T, D, H, L, FF = (s[k] for k in ("vocab", "context", "d_model", "heads", "blocks", "d_ff"))
    dh = D // H

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(D, eps=1e-5)
            self.qkv = nn.Linear(D, 3 * D)
            self.proj = nn.Linear(D, D)
            self.ln2 = nn.LayerNorm(D, eps=1e-5)
            self.fc1 = nn.Linear(D, FF)
            self.fc2 = nn.Linear(FF, D)

        def attend(self, x, mask):
            n, t, _ = x.shape
            q, k, v = (z.view(n, t, H, dh).transpose(1, 2)
                       for z in self.qkv(x).split(D, dim=2))
            if attention == "sdpa":
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = q @ k.transpose(2, 3) * (1.0 / dh ** 0.5) + mask
                a = scores.softmax(dim=3) @ v
            return a.transpose(1, 2).reshape(n, t, D)

        def forward(self, x, mask):
            x = x + self.proj(self.attend(self.ln1(x), mask))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, D)
            self.pos = nn.Parameter(torch.zeros(T, D))
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln = nn.LayerNorm(D, eps=1e-5)
            self.out = nn.Linear(D, V)
            self.register_buffer("mask", torch.triu(torch.full((T, T), -1e9), diagonal=1))

        def forward(self, idx):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for b in self.blocks:
                x = b(x, self.mask)
            return self.out(self.ln(x))

    torch.manual_seed(0)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = Transformer().to(dev)
    params = sum(p.numel() for p in model.parameters())
    if world > 1:
        # Data parallel as a PyTorch user runs it: DDP over gloo, gradients all-reduced in
        # buckets during the last micro-batch's backward (no_sync before it).
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(s["beta1"], s["beta2"]),
                            eps=s["eps"], weight_decay=s["weight_decay"])
    gb, mb = s["global_batch"], s["microbatch"]
    # DDP averages over ranks: the sum over the global batch is world x this.
    scale = world / (gb * T)
    share = gb // world
    lo = 0 if rank is None else rank * share
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, V, (gb, T + 1), generator=g).to(dev) for _ in range(8)]
    times = []
    for step in range(steps):
        batch = pool[step % len(pool)]
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        starts = list(range(lo, lo + share, mb))
        for i in starts:
            x, y = batch[i:i + mb, :T], batch[i:i + mb, 1:]
            last = i == starts[-1]
            ctx = model.no_sync() if world > 1 and not last else contextlib.nullcontext()
            with ctx:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="sum") * scale
                loss.backward()
            loss_sum += loss.item()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    if world > 1:
        # The step of the slowest rank, as lockstep's figures.
        import torch.distributed as dist
        every = [None] * world
        dist.all_gather_object(every, times)
        times = [max(ts) for ts in zip(*every)]
        dist.destroy_process_group()
        if rank != 0:
            return
    med = statistics.median(times[warmup:])
    print("RESULT " + json.dumps({
        "samples_per_s": gb / med, "step_ms": med * 1e3, "params": params,
        "microbatch": mb, "final_loss": loss_sum, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "attention": attention, "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "tf32": tf32,
        "adamw": "default (foreach=None, fused=None: per-tensor loop on CPU)",
        "world": world}), flush=True)


def torch_ddp(settings, attention, steps, warmup, world=2):
    """`world` processes of one thread each, DDP over gloo on this host."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(_ddp_rank, args=(settings, attention, steps, warmup, world), nprocs=world)


def _ddp_rank(rank, settings, attention, steps, warmup, world):
    torch_one(settings, 1, attention, steps, warmup, rank=rank, world=world)


def run_torch(py, settings, threads, attention, steps, warmup, ddp=1):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [py, os.path.abspath(__file__), "torch-one", "--settings", json.dumps(settings),
           "--threads", str(threads), "--attention", attention, "--steps", str(steps),
           "--warmup", str(warmup), "--ddp", str(ddp)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not line:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(line[0][len("RESULT "):])


# ----- lockstep side -----

def lockstep_cmd(binary, out_dir, threads, steps, config=CONFIG, nproc=1):
    return [binary, "train", "--config", config, "--nproc", str(nproc),
            "--threads-per-worker", str(threads), "--out", out_dir,
            "--set", "parallel.pp=1", "--set", f"train.steps={steps}",
            "--set", "train.eval_every=0", "--set", "checkpoint.every=0",
            "--set", "train.log_every=1000"]


def run_lockstep(binary, threads, steps, warmup, settings, nproc=1):
    with tempfile.TemporaryDirectory(prefix="vs-pytorch-tf-") as d:
        out_dir = os.path.join(d, "run")
        cmd = lockstep_cmd(binary, out_dir, threads, steps, nproc=nproc)
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
        rows = []
        with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
            for line in fh:
                r = json.loads(line)
                if "step_seconds" in r and "rank" in r:
                    rows.append(r)
        with open(os.path.join(out_dir, "summary.json")) as fh:
            summary = json.load(fh)
    rows = [r for r in sorted(rows, key=lambda r: r["step"]) if r["step"] >= warmup]
    # The slowest rank's step (one row per rank and step).
    slowest = {}
    for r in rows:
        if r["step"] not in slowest or r["step_seconds"] > slowest[r["step"]]["step_seconds"]:
            slowest[r["step"]] = r
    rows = [slowest[k] for k in sorted(slowest)]
    med = statistics.median(r["step_seconds"] for r in rows)
    phases = {k: statistics.median(r["seconds"][k] for r in rows) * 1e3
              for k in rows[0]["seconds"]}
    params_bytes = summary["ranks"][0]["memory"]["params_bytes"]
    if params_bytes % 4 or summary["microbatch"] != settings["microbatch"] \
            or summary["global_batch"] != settings["global_batch"] \
            or summary["pipeline"]["pp"] != 1 or summary["world_size"] != nproc:
        sys.exit(f"lockstep ran another setup than the PyTorch side's {settings}: params_bytes "
                 f"{params_bytes}, microbatch {summary['microbatch']}, global_batch "
                 f"{summary['global_batch']}, pp {summary['pipeline']['pp']}, world "
                 f"{summary['world_size']}")
    return {"samples_per_s": settings["global_batch"] / med, "step_ms": med * 1e3,
            "phases_ms": phases, "params": params_bytes // 4,
            "param_hash": summary["param_hash"], "final_loss": summary["final_loss"],
            "kernels": summary.get("compute", {}).get("kernels", "unknown")}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "settings":
        print(json.dumps(model_settings()))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "torch-one":
        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        ap.add_argument("--settings", required=True)
        ap.add_argument("--threads", type=int, default=1)
        ap.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa")
        ap.add_argument("--steps", type=int, default=40)
        ap.add_argument("--warmup", type=int, default=5)
        ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (scripts/gpu-check.sh)")
        ap.add_argument("--tf32", action="store_true", help="allow TF32 products on CUDA")
        ap.add_argument("--ddp", type=int, default=1, help="DDP over this many 1-thread processes")
        a = ap.parse_args()
        if a.ddp > 1:
            torch_ddp(json.loads(a.settings), a.attention, a.steps, a.warmup, a.ddp)
            return
        torch_one(json.loads(a.settings), a.threads, a.attention, a.steps, a.warmup, a.device,
                  a.tf32)
        return

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="/work/torchvenv/bin/python")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/lockstep"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--two-threads", action="store_true",
                    help="also lockstep --threads-per-worker 2 and torch at 2 threads")
    ap.add_argument("--ddp", action="store_true",
                    help="also 2 workers x 1 thread: lockstep --nproc 2 and PyTorch DDP (gloo)")
    ap.add_argument("--baseline-bin", help="also an earlier lockstep build, 1 x 1 (baseline_1x1), "
                    "to measure a change against it in the same invocation")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/vs-pytorch-transformer.json"))
    ap.add_argument("--quiet-load", type=float, default=2.5,
                    help="before each run, wait for the 1-minute load average to fall under this")
    ap.add_argument("--max-wait", type=float, default=60, help="... but at most this many s")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        sys.exit("--steps must exceed --warmup")

    settings = model_settings()
    configs = CONFIGS_1 + (["baseline_1x1"] if a.baseline_bin else []) \
        + (CONFIGS_2 if a.two_threads else []) + (CONFIGS_DDP if a.ddp else [])
    runs = {}  # config -> [result per rep]
    for rep in range(a.reps):
        for cfg in (configs if rep % 2 == 0 else configs[::-1]):
            load0 = wait_for_quiet(a.quiet_load, a.max_wait)
            threads = 2 if "_1x2" in cfg else 1
            nproc = 2 if "_2x1" in cfg else 1
            if is_lockstep(cfg):
                binary = a.baseline_bin if cfg.startswith("baseline") else a.bin
                r = run_lockstep(binary, threads, a.steps, a.warmup, settings, nproc)
            else:
                attention = "eager" if cfg.endswith("_eager") else "sdpa"
                r = run_torch(a.python, settings, threads, attention, a.steps, a.warmup, nproc)
            r["load_before"] = load0
            runs.setdefault(cfg, []).append(r)
            counts = {c: rs[0]["params"] for c, rs in runs.items()}
            counts.update({f"{cfg} rep {rep}": r["params"]})
            if len(set(counts.values())) != 1:
                sys.exit(f"parameter counts differ, the models are not the same: {counts}")
            print(f"rep {rep} {cfg:16s} {r['samples_per_s']:7.1f} samples/s "
                  f"(step {r['step_ms']:.1f} ms, load {load0:.2f})", flush=True)

    lock = runs["lockstep_1x1"][0]
    result = {
        "what": f"samples/s = {settings['global_batch']} / median step time over steps "
                f"{a.warmup}..{a.steps - 1} of each run; one worker; global batch "
                f"{settings['global_batch']} x {settings['context']} tokens in micro-batches of "
                f"{settings['microbatch']} (gradient accumulation); AdamW; runs of both systems "
                "interleaved; ratios (lockstep / PyTorch samples/s) taken within one repetition",
        "model": dict(settings, params=lock["params"],
                      architecture="token + learned position embeddings; pre-norm blocks "
                                   "(LayerNorm, causal MHA with fused qkv, exact GELU MLP), "
                                   "residuals; final LayerNorm; untied output head; biases "
                                   "everywhere; no dropout"),
        "lockstep_command": " ".join(lockstep_cmd("target/release/lockstep", "DIR", 1, a.steps,
                                                  os.path.relpath(CONFIG, ROOT))),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": runs["torch_1x1"][0]["torch"], "lockstep_kernels": lock["kernels"],
                    "shared": "the machine is shared with other agents' builds and tests: absolute "
                              "figures swing; compare the ratios (measured side by side), and see "
                              "load_before of each run"},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "reps": a.reps, "steps": a.steps, "warmup": a.warmup,
        "configs": {},
    }
    for cfg in configs:
        rs = runs[cfg]
        c = spread([r["samples_per_s"] for r in rs])
        c["step_ms"] = spread([r["step_ms"] for r in rs])
        c["load_before"] = [round(r["load_before"], 2) for r in rs]
        if is_lockstep(cfg):
            c["phases_ms_median"] = {k: statistics.median(r["phases_ms"][k] for r in rs)
                                     for k in rs[0]["phases_ms"]}
            c["phases_ms"] = [r["phases_ms"] for r in rs]
            c["param_hashes"] = sorted({r["param_hash"] for r in rs})
            c["kernels"] = rs[0]["kernels"]
        else:
            c["torch"] = rs[0]["torch"]
            c["attention"] = rs[0]["attention"]
            c["adamw"] = rs[0]["adamw"]
        result["configs"][cfg] = c

    def ratio(x, y):
        return spread([p["samples_per_s"] / q["samples_per_s"] for p, q in zip(runs[x], runs[y])])
    result["ratios"] = {
        "lockstep_1x1 / torch_1x1": ratio("lockstep_1x1", "torch_1x1"),
        "lockstep_1x1 / torch_1x1_eager": ratio("lockstep_1x1", "torch_1x1_eager"),
    }
    if a.baseline_bin:
        result["baseline_bin"] = a.baseline_bin
        result["ratios"]["lockstep_1x1 / baseline_1x1"] = ratio("lockstep_1x1", "baseline_1x1")
    if a.two_threads:
        result["ratios"]["lockstep_1x2 / torch_1x2"] = ratio("lockstep_1x2", "torch_1x2")
    if a.ddp:
        result["ratios"]["lockstep_2x1 / torch_ddp_2x1"] = ratio("lockstep_2x1", "torch_ddp_2x1")
        result["ratios"]["lockstep_2x1 / lockstep_1x1"] = ratio("lockstep_2x1", "lockstep_1x1")
        result["ratios"]["torch_ddp_2x1 / torch_1x1"] = ratio("torch_ddp_2x1", "torch_1x1")
    write_json(a.out, result)
    print_table(result)


def print_table(result):
    c, q = result["configs"], result["ratios"]

    def f(s):
        ms = s["step_ms"]
        return (f"{ms['median']:.1f} ms, {s['median']:.1f} samples/s "
                f"({s['min']:.1f}–{s['max']:.1f})")

    def r(s):
        return f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f})"
    print("\n| threads | lockstep | PyTorch (SDPA) | ratio | PyTorch (eager attention) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| 1 | {f(c['lockstep_1x1'])} | {f(c['torch_1x1'])} | "
          f"{r(q['lockstep_1x1 / torch_1x1'])} | {f(c['torch_1x1_eager'])} | "
          f"{r(q['lockstep_1x1 / torch_1x1_eager'])} |")
    if "lockstep_1x2" in c:
        print(f"| 2 | {f(c['lockstep_1x2'])} | {f(c['torch_1x2'])} | "
              f"{r(q['lockstep_1x2 / torch_1x2'])} | | |")
    if "lockstep_2x1" in c:
        print(f"| 2 workers x 1 (DDP) | {f(c['lockstep_2x1'])} | {f(c['torch_ddp_2x1'])} | "
              f"{r(q['lockstep_2x1 / torch_ddp_2x1'])} | | |")
        print(f"\n2x1 / 1x1: lockstep {r(q['lockstep_2x1 / lockstep_1x1'])}, PyTorch DDP "
              f"{r(q['torch_ddp_2x1 / torch_1x1'])}")
    phases = c["lockstep_1x1"]["phases_ms_median"]
    print("\nlockstep 1×1 phase medians (ms/step): "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v >= 0.005))


if __name__ == "__main__":
    main()

"""Helpers the benchmark scripts share (bench-vs-pytorch.py, bench-vs-pytorch-transformer.py, the
checkpoint and recompute benchmarks)."""
import json
import os
import platform
import statistics
import time


def wait_for_quiet(thresh, max_wait):
    """Wait (at most max_wait s) for the 1-minute load average to fall under thresh: other work
    on a shared machine slows whichever run it overlaps. Returns the load when starting."""
    t0 = time.time()
    while os.getloadavg()[0] > thresh and time.time() - t0 < max_wait:
        time.sleep(5)
    return os.getloadavg()[0]


def spread(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}


def median_range(xs):
    """The median of repeated measurements, with their range."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            return next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def write_json(path, result):
    """`result` as indented JSON at `path`, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")

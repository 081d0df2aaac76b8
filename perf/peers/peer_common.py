"""Shared pieces of the peer scripts (run on the GPU machine only): event timing, the summary of a
set of timings, and the context block every result file carries."""
import json
import os
import statistics
import subprocess
import sys
import time

import torch


# Device seconds of back-to-back calls before the timed ones, as the suite's benchmarks run (perf/bench_dense.c
# CEILING_WARM_S, perf/bench_sparse.c SB_DENSE_WARM_S): a GPU fresh from idle runs its first tens of
# milliseconds at boost clocks that a sustained run does not keep, so a peer timed in a short burst would be
# flattered against the suite's sustained benchmarks (how much: perf/NOTES.md, the timeline's outcome).
STEADY_WARM_S = 0.3


def time_it(fn, iters, warmup, warm_s=STEADY_WARM_S):
    """Seconds of each of `iters` calls of fn, each between its own pair of CUDA events, after `warmup`
    calls and then calls until warm_s seconds of device time have passed (the steady state)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    warm = 0.0
    while warm < warm_s:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        spent = start.elapsed_time(stop) * 1e-3
        warm += spent if spent > 0 else warm_s  # a zero-time call cannot stall the loop
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    return times


def summary(times, flops):
    med = statistics.median(times)
    mean = statistics.fmean(times)
    sd = statistics.pstdev(times) if len(times) > 1 else 0.0
    return {
        "median_s": med,
        "min_s": min(times),
        "mean_s": mean,
        "cv": sd / mean if mean > 0 else 0.0,
        "iterations": len(times),
        "flops": flops,
        "tflop_per_second": flops / med / 1e12,
    }


def rand(shape, std=1.0):
    """bf16 normal values on the device (never zeros: they run faster than real data)."""
    return (torch.randn(shape, device="cuda", dtype=torch.float32) * std).to(torch.bfloat16)


def context(extra=None):
    dev = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    ctx = {
        "gpu": dev.name,
        "sms": dev.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit or os.environ.get("UPF_COMMIT", "unknown"),
        "command": " ".join([sys.executable] + sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    ctx.update(extra or {})
    return ctx


def write_report(report, path):
    """Writes the peer's JSON report (creating its folder) and says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")

#!/usr/bin/env python3
"""Issue 5's ratios from device runs: bench_upf's chunked gdn.scan medians next to fla_gdn.py's.

One column per variant given as NAME=PATH[,PATH...] (its bench JSONs, merged), the first taken as the reference
for the (ratio) columns, then the FLA medians and best/FLA. Without an FLA JSON from the same run,
the FLA medians of the 282ec2f run (perf/reports/H200/fla-gdn-282ec2f.json) stand in, and the output
says so. Reads only JSON, so it runs anywhere:
  python3 perf/peers/compare_gdn.py default=bench-a.json[,bench-a-128k.json] [v2split=bench-b.json ...] [--fla FLA.json]
"""
import argparse
import json

# FLA 0.6.0 chunk_gated_delta_rule on the H200, 282ec2f run (ms): the stand-in when a run has no FLA JSON
FLA_282EC2F = {"qwen3next_prefill/T:8192": 1.160, "qwen3next_prefill/T:32768": 2.329,
               "qwen3next_prefill/T:131072": 8.488, "qwen3next_batch16x2K/T:32768": 2.443}


def case_key(parts):
    """'qwen3next_prefill/T:32768' from the '/'-split name of a bench or FLA result."""
    return parts[3] + "/" + next(p for p in parts if p.startswith("T:"))


def ours(path):
    """Median ms per chunked case of one bench_upf JSON (empty when the file is missing or broken)."""
    out = {}
    try:
        bench = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        return out
    for b in bench.get("benchmarks", []):
        name = b["name"]
        median = b.get("aggregate_name") == "median" or name.endswith("_median")
        if median and "/cuda/" in name and "/chunked/" in name:
            unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "us")]
            out[case_key(name.split("/"))] = b["real_time"] * unit
    return out


def fla(path):
    """(medians in ms, source line) of fla_gdn.py's JSON, or the 282ec2f stand-in."""
    if path:
        try:
            return ({case_key(r["name"].split("/")): r["median_s"] * 1e3
                     for r in json.load(open(path))["results"]}, path)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: {e}")
    return FLA_282EC2F, "282ec2f run (not this one)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", help="NAME=PATH[,PATH...]: a variant's bench_upf JSONs (first = reference)")
    ap.add_argument("--fla", help="fla_gdn.py JSON, of the same run where there is one")
    args = ap.parse_args()
    runs = []
    for spec in args.bench:
        name, _, paths = spec.partition("=")
        merged = {}
        for path in (paths or name).split(","):
            merged.update(ours(path))
        runs.append((name, merged))
    peer, src = fla(args.fla)
    keys = sorted({k for _, r in runs for k in r}, key=lambda k: (k.split("/")[0], int(k.split(":")[1])))
    print(f"medians in ms; (ratio) = variant / {runs[0][0]}; FLA column: {src}")
    print(f"{'case':30s}" + "".join(f" {n:>14s}" for n, _ in runs) + f" {'FLA':>8s} {'best/FLA':>8s}")
    for k in keys:
        ref = runs[0][1].get(k)
        row, best = f"{k:30s}", None
        for i, (_, r) in enumerate(runs):
            x = r.get(k)
            if x is None:
                row += f" {'-':>14s}"
                continue
            best = x if best is None or x < best else best
            row += f" {x:14.3f}" if i == 0 or not ref else f" {x:7.3f} ({x / ref:4.2f})"
        f = peer.get(k)
        row += f" {f:8.3f} {best / f:8.2f}" if f and best else f" {'-':>8s} {'-':>8s}"
        print(row)


if __name__ == "__main__":
    main()

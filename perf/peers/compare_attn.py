#!/usr/bin/env python3
"""Issue 3's ratios from one device run: bench_upf's attention JSON next to torch_sdpa.py's JSON.

Prints, per prefill shape, our TFLOP/s (median), SDPA's default backend (and which one torch
picked), SDPA's best backend, and the two ratios; the sliding-window rate at each T against the
global-causal rate of the same head shape; and the paged-decode share of the copy bandwidth.
Reads only JSON, so it runs anywhere:
  python3 perf/peers/compare_attn.py BENCH.json SDPA.json
"""
import json
import re
import sys

# bench_upf case family -> torch_sdpa.py shape name
SHAPES = {"llama_causal": "llama", "d64_causal": "d64", "gemma_global": "gemma_global"}


UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def seconds(b):
    return b["real_time"] * UNIT_S[b.get("time_unit", "ns")]


def medians(bench):
    out = {}
    for b in bench["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        m = re.match(r"(attn_\w+|kv_cache_write)/cuda/bf16/(\w+)/B:(\d+)/kv:(\d+)", b["name"])
        if m:
            out[(m.group(2), int(m.group(3)), int(m.group(4)))] = b
    return out


def main():
    bench, sdpa = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
    ours = medians(bench)
    peer = {}
    for r in sdpa["results"]:
        if "tflop_per_second" in r:  # the "<shape>/best" entry copies its backend's fields: key it by name
            peer[(r["shape"], r["T"], "best" if r["name"].endswith("/best") else r["backend"])] = r
    print("prefill (bf16, one request, exact causal FLOPs): TFLOP/s")
    print(f"{'shape':14s} {'T':>7s} {'ours':>7s} {'sdpa default':>20s} {'sdpa best':>18s} {'flash':>7s} "
          f"{'vs default':>10s} {'vs best':>8s} {'vs flash':>8s}")
    for (fam, B, T), b in sorted(ours.items()):
        if fam not in SHAPES or B != 1:
            continue
        name = SHAPES[fam]
        mine = b["flop_per_second"] / 1e12
        dflt, best = peer.get((name, T, "default")), peer.get((name, T, "best"))
        if not dflt or not best:
            print(f"{name:14s} {T:7d} {mine:7.1f}   (no peer number)")
            continue
        d, bb = dflt["tflop_per_second"], best["tflop_per_second"]
        fl = peer.get((name, T, "flash"), {}).get("tflop_per_second", float("nan"))
        picked = dflt.get("picked", "?").replace("FLASH_ATTENTION", "flash").replace("CUDNN_ATTENTION", "cudnn")
        print(f"{name:14s} {T:7d} {mine:7.1f} {d:7.1f} ({picked[:10]:>10s}) {bb:7.1f} ({best['backend']:>8s}) "
              f"{fl:7.1f} {mine / d:10.2f} {mine / bb:8.2f} {mine / fl:8.2f}")
    glob = {T: b["flop_per_second"] for (fam, B, T), b in ours.items() if fam == "gemma_global"}
    swa = sorted((T, b) for (fam, B, T), b in ours.items() if fam == "gemma_swa1024")
    if swa and glob:
        ref_T = max(glob)
        print(f"\nsliding window 1024 (Gemma D 256) vs global causal at T={ref_T} ({glob[ref_T] / 1e12:.1f} TFLOP/s)")
        for T, b in swa:
            per_tok = seconds(b) / T * 1e9
            print(f"  T={T:6d} {seconds(b) * 1e3:8.3f} ms  {per_tok:7.2f} ns/token  {b['flop_per_second'] / 1e12:6.1f} "
                  f"TFLOP/s  time per visible key vs global: {glob[ref_T] / b['flop_per_second']:.2f}x")
    # the same against a global run with as many visible (query, key) pairs (FLOPs count them, so the time
    # per visible key compares as the inverse TFLOP/s ratio)
    eq = sorted((T, b) for (fam, B, T), b in ours.items() if fam == "gemma_global_eqkeys")
    if swa and eq:
        print("\nsliding window 1024 vs global causal with the same number of visible keys")
        for (T, b), (Tg, g) in zip(swa, eq):
            print(f"  window T={T:6d} {seconds(b) * 1e3:8.3f} ms  global T={Tg:6d} {seconds(g) * 1e3:8.3f} ms  "
                  f"({g['flop_per_second'] / 1e12:6.1f} TFLOP/s)  time per visible key: "
                  f"{g['flop_per_second'] / b['flop_per_second']:.2f}x")
    print("\npaged decode: share of the measured copy bandwidth")
    for (fam, B, T), b in sorted(ours.items()):
        if "decode" in fam:
            print(f"  {fam:26s} B={B:3d} kv={T:6d} {seconds(b) * 1e3:8.3f} ms  {b['bytes_per_second'] / 1e12:5.2f} TB/s"
                  f"  share {b.get('copy_bw_share', float('nan')):.2f}")


if __name__ == "__main__":
    main()

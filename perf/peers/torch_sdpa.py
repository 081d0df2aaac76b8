#!/usr/bin/env python3
"""Peer numbers for perf/bench_attn.c (issue 3): torch scaled_dot_product_attention, causal, bf16,
on the same shapes, timed with CUDA events (median, min and spread after a warm-up), written as
JSON. Runs only on the GPU machine (torch with CUDA).

Shapes: one request of T tokens, q (1, Hq, T, D), k/v (1, Hkv, T, D) with enable_gqa:
  Llama-3.1-8B  Hq=32 Hkv=8 D=128 at T = 8K, 32K, 128K
  Gemma-3-12B   Hq=16 Hkv=8 D=256 at T = 8K, 32K (global layers; scale = query_pre_attn_scalar^-0.5)
FLOPs: exact causal count, 4 * D * Hq * T (T + 1) / 2 (QK^T and PV, the diagonal included), the
same formula as upf_attn_flops.

Usage:
  python3 perf/peers/torch_sdpa.py [--out perf/reports/H200/torch_sdpa.json] [--iters 10] [--warmup 3]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from peer_common import context, rand, summary, time_it

CASES = [  # name, Hq, Hkv, D, scale, tokens
    ("llama", 32, 8, 128, 128 ** -0.5, (8192, 32768, 131072)),
    ("gemma_global", 16, 8, 256, 256 ** -0.5, (8192, 32768)),
]


def causal_flops(T, Hq, D):
    return 4.0 * D * Hq * T * (T + 1) / 2.0


def bench(T, Hq, Hkv, D, scale, args):
    q, k, v = rand((1, Hq, T, D)), rand((1, Hkv, T, D)), rand((1, Hkv, T, D))

    def run():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    times = time_it(run, args.iters, args.warmup)
    del q, k, v
    torch.cuda.empty_cache()
    return summary(times, causal_flops(T, Hq, D))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/reports/H200/torch_sdpa.json")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_sdpa.py: no CUDA device visible to torch")
    torch.manual_seed(0)
    report = {"context": context(), "results": []}
    for name, Hq, Hkv, D, scale, tokens in CASES:
        for T in tokens:
            res = dict(name=f"attn.prefill/torch_sdpa/bf16/{name}/T:{T}", **bench(T, Hq, Hkv, D, scale, args))
            report["results"].append(res)
            print(f"{res['name']:44s} {res['median_s'] * 1e3:9.3f} ms {res['tflop_per_second']:7.1f} TFLOP/s",
                  flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

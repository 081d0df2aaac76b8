#!/usr/bin/env python3
"""Peer numbers for perf/bench_dense.c: torch.matmul on the same Llama-3.1-8B projection and FFN
shapes, bf16, timed with CUDA events (each iteration alone; median, min and spread of many after a
warm-up), written as JSON.

Runs only on the GPU machine (it needs torch with CUDA). Shapes follow bench_dense.c exactly:
  x (T, in) @ w (in, out)            projections qkv 4096->6144, o 4096->4096, gate_up 4096->28672,
                                     down 14336->4096, at T = 8K, 32K, 128K
  FFN: gu = x @ [Wg | Wu]; h = act(gu[:, :I]) * gu[:, I:]; y = h @ Wd
                                     Llama SwiGLU (silu) at T = 8K..128K, Gemma-3 GeGLU (tanh GELU)
  ceiling: one 8192^3 bf16 matmul on random data (zeros run faster: do not use them)
FLOPs: 2*T*in*out per projection, 6*T*H*I per FFN (the activation is not counted as FLOPs but its
time is included, as in bench_dense.c).

Usage:
  python3 perf/peers/torch_matmul.py [--out perf/reports/H200/torch_matmul.json]
                                     [--tokens 8192,32768,131072] [--iters 20] [--warmup 5]
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from peer_common import context, rand, summary, time_it, write_report

LLAMA_H, LLAMA_I = 4096, 14336          # hidden_size, intermediate_size (Llama-3.1-8B config.json)
GEMMA_H, GEMMA_I = 3840, 15360          # Gemma-3-12B text_config
PROJECTIONS = {                          # name: (in, out)
    "llama_qkv": (LLAMA_H, 6144),        # 32 q heads + 2 * 8 kv heads, head_dim 128
    "llama_o": (LLAMA_H, LLAMA_H),
    "llama_gate_up": (LLAMA_H, 2 * LLAMA_I),
    "llama_down": (LLAMA_I, LLAMA_H),
}
CEILING_N = 8192


def bench_ceiling(args):
    a, b = rand((CEILING_N, CEILING_N)), rand((CEILING_N, CEILING_N), CEILING_N ** -0.5)
    out = torch.empty((CEILING_N, CEILING_N), device="cuda", dtype=torch.bfloat16)
    times = time_it(lambda: torch.matmul(a, b, out=out), args.iters, args.warmup)
    del a, b, out
    return summary(times, 2.0 * CEILING_N ** 3)


def bench_projection(name, T, args):
    k, n = PROJECTIONS[name]
    x, w = rand((T, k)), rand((k, n), k ** -0.5)
    out = torch.empty((T, n), device="cuda", dtype=torch.bfloat16)
    times = time_it(lambda: torch.matmul(x, w, out=out), args.iters, args.warmup)
    del x, w, out
    return summary(times, 2.0 * T * k * n)


def bench_ffn(T, H, I, act, args):
    x = rand((T, H))
    w_gu, w_d = rand((H, 2 * I), H ** -0.5), rand((I, H), I ** -0.5)
    act_fn = (lambda g: F.silu(g)) if act == "silu" else (lambda g: F.gelu(g, approximate="tanh"))

    def ffn():
        gu = torch.matmul(x, w_gu)
        h = act_fn(gu[:, :I]) * gu[:, I:]
        return torch.matmul(h, w_d)

    times = time_it(ffn, max(5, args.iters // 2), args.warmup)
    del x, w_gu, w_d
    torch.cuda.empty_cache()
    return summary(times, 6.0 * T * H * I)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/reports/H200/torch_matmul.json")
    ap.add_argument("--tokens", default="8192,32768,131072")
    ap.add_argument("--ffn-tokens", default="8192,16384,32768,65536,131072")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_matmul.py: no CUDA device visible to torch")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # fp32 accumulation, as ours
    torch.manual_seed(0)
    report = {
        "context": context({"cublas_bf16_reduced_precision_reduction": False}),
        "results": [],
    }
    ceiling = bench_ceiling(args)
    report["ceiling"] = dict(name=f"matmul/bf16/n:{CEILING_N}", **ceiling)
    peak = ceiling["tflop_per_second"]
    print(f"ceiling {CEILING_N}^3 bf16: {peak:.1f} TFLOP/s", flush=True)

    def add(name, res):
        res = dict(name=name, **res)
        res["share_of_torch_ceiling"] = res["tflop_per_second"] / peak
        report["results"].append(res)
        print(f"{name:40s} {res['median_s'] * 1e3:9.3f} ms {res['tflop_per_second']:7.1f} TFLOP/s "
              f"share {res['share_of_torch_ceiling']:.3f}", flush=True)

    for T in [int(t) for t in args.tokens.split(",") if t]:
        for name in PROJECTIONS:
            add(f"gemm/torch/bf16/{name}/T:{T}", bench_projection(name, T, args))
    for T in [int(t) for t in args.ffn_tokens.split(",") if t]:
        add(f"ffn/torch/bf16/llama_swiglu/T:{T}", bench_ffn(T, LLAMA_H, LLAMA_I, "silu", args))
    for T in (8192, 32768):
        add(f"ffn/torch/bf16/gemma_geglu/T:{T}", bench_ffn(T, GEMMA_H, GEMMA_I, "gelu_tanh", args))

    write_report(report, args.out)


if __name__ == "__main__":
    main()

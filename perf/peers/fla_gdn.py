#!/usr/bin/env python3
"""Peer numbers for perf/bench_gdn.c (issue 5): flash-linear-attention's Triton
`chunk_gated_delta_rule` on the same inputs as `gdn.scan`, timed with CUDA events (median, min and
spread after a warm-up), written as JSON. Runs only on the GPU machine (torch with CUDA, the fla wheels
on PYTHONPATH).

Like with like: q, k (1, T, 16, 128) and v (1, T, 32, 128) bf16 (16 key heads shared by 32 value
heads), the raw gate inputs a and b (1, T, 32) bf16 with A_log and dt_bias (32) f32, so FLA computes
g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) and the q/k L2 norm in its kernels as gdn.scan
does (use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel); fp32 initial states
in, final states out; varlen through cu_seqlens. If this fla build refuses the in-kernel gate, g and
beta are computed before the timed region and the result says so ("gate": "precomputed").

Shapes: one request of T = 8K, 32K, 128K tokens, and 16 requests of 2K.
FLOPs: the recurrence's count 7 Dk Dv per token and value head, the same as bench_gdn.c.

Usage:
  python3 perf/peers/fla_gdn.py [--out perf/reports/H200/fla_gdn.json] [--iters 20] [--warmup 3]
"""
import argparse
import sys

import torch

from peer_common import context, rand, summary, time_it, write_report

HK, HV, D = 16, 32, 128
CASES = [  # name, requests, tokens per request
    ("qwen3next_prefill", 1, 8192),
    ("qwen3next_prefill", 1, 32768),
    ("qwen3next_prefill", 1, 131072),
    ("qwen3next_batch16x2K", 16, 2048),
]


def flops(T):
    return 7.0 * T * HV * D * D


def bench(chunk_gated_delta_rule, reqs, per_req, args):
    T = reqs * per_req
    q, k, v = rand((1, T, HK, D)), rand((1, T, HK, D)), rand((1, T, HV, D))
    a = (torch.rand((1, T, HV), device="cuda") * 7.0 - 4.0).to(torch.bfloat16)  # a + dt_bias in [-5, 3]
    b = (torch.rand((1, T, HV), device="cuda") * 6.0 - 3.0).to(torch.bfloat16)
    a_log = torch.rand(HV, device="cuda") * 2.0
    dt_bias = -torch.rand(HV, device="cuda")
    s0 = torch.rand((reqs, HV, D, D), device="cuda") - 0.5
    cu = torch.arange(0, T + 1, per_req, device="cuda", dtype=torch.long)
    scale = D ** -0.5
    # cu_seqlens_cpu spares FLA a device-to-host read per call (gdn.scan plans from its host copy too);
    # FLA caches its chunk indices per cu_seqlens tensor, so the warm-up builds them once.
    common = dict(scale=scale, initial_state=s0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
                  use_qk_l2norm_in_kernel=True)

    def in_kernel():
        return chunk_gated_delta_rule(q, k, v, a, b, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                                      use_beta_sigmoid_in_kernel=True, **common)

    gate = "in_kernel"
    try:
        with torch.no_grad():
            in_kernel()
        fn = in_kernel
    except Exception as e:  # an fla without the fused gate: precompute g and beta outside the timing
        print(f"in-kernel gate refused ({type(e).__name__}: {e}); precomputing g and beta", flush=True)
        gate = "precomputed"
        g = (-a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)).contiguous()
        beta = torch.sigmoid(b.float()).to(torch.bfloat16)

        def fn():
            return chunk_gated_delta_rule(q, k, v, g, beta, **common)

    with torch.no_grad():
        times = time_it(fn, args.iters, args.warmup)
    res = summary(times, flops(T))
    res["gate"] = gate
    del q, k, v, a, b, s0
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/reports/H200/fla_gdn.json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fla_gdn.py: no CUDA device visible to torch")
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        sys.exit(f"fla_gdn.py: flash-linear-attention is not importable ({e}); install the carried wheels")
    torch.manual_seed(0)
    report = {"context": context({"fla": getattr(fla, "__version__", "unknown")}), "results": []}
    for name, reqs, per_req in CASES:
        T = reqs * per_req
        res = dict(name=f"gdn.scan/fla_chunk_gated_delta_rule/bf16/{name}/T:{T}",
                   **bench(chunk_gated_delta_rule, reqs, per_req, args))
        report["results"].append(res)
        print(f"{res['name']:64s} {res['median_s'] * 1e3:9.3f} ms {res['tflop_per_second']:7.2f} TFLOP/s "
              f"(cv {res['cv']:.3f}, gate {res['gate']})", flush=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()

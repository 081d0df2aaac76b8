#!/usr/bin/env python3
"""Peer numbers for perf/bench_attn.c (issue 3): torch scaled_dot_product_attention, causal, bf16,
on the same shapes, timed with CUDA events (median, min and spread after a warm-up), written as
JSON. Runs only on the GPU machine (torch with CUDA).

Each shape runs under every SDPA backend that takes it, so the ratio against bench_upf is honest:
  default  - whatever torch picks; `picked` names it (torch._fused_sdp_choice)
  flash    - SDPBackend.FLASH_ATTENTION (FlashAttention-2 inside torch)
  cudnn    - SDPBackend.CUDNN_ATTENTION
  efficient- SDPBackend.EFFICIENT_ATTENTION
A backend that refuses enable_gqa gets K/V repeated to Hq heads (`gqa: "expanded"`; the same FLOPs,
more K/V bytes). A backend that refuses the shape altogether is recorded with its error. `best`
per shape is the fastest backend that ran.

Shapes: one request of T tokens, q (1, Hq, T, D), k/v (1, Hkv, T, D):
  llama        Hq=32 Hkv=8 D=128 at T = 8K, 32K, 128K
  d64          Hq=32 Hkv=8 D=64  at T = 32K, 128K
  gemma_global Hq=16 Hkv=8 D=256 at T = 8K, 32K (scale = query_pre_attn_scalar^-0.5 = 256^-0.5)
FLOPs: exact causal count, 4 * D * Hq * T (T + 1) / 2 (QK^T and PV, the diagonal included), the
same formula as upf_attn_flops.

Usage:
  python3 perf/peers/torch_sdpa.py [--out perf/reports/H200/torch_sdpa.json] [--iters 10] [--warmup 3]
                                   [--only REGEX]
"""
import argparse
import re
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from peer_common import context, rand, summary, time_it, write_report

CASES = [  # name, Hq, Hkv, D, scale, tokens
    ("llama", 32, 8, 128, 128 ** -0.5, (8192, 32768, 131072)),
    ("d64", 32, 8, 64, 64 ** -0.5, (32768, 131072)),
    ("gemma_global", 16, 8, 256, 256 ** -0.5, (8192, 32768)),
]

BACKENDS = [
    ("default", None),
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
]

LONG_T = 65536  # at and above: fewer timed calls (one 128K call is a few hundred ms)


def causal_flops(T, Hq, D):
    return 4.0 * D * Hq * T * (T + 1) / 2.0


def picked_backend(q, k, v, scale):
    """The backend torch's dispatcher chooses by default for these inputs (private API: best effort)."""
    try:
        idx = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=True)
        return SDPBackend(idx).name
    except Exception as e:  # noqa: BLE001 - a private API; report rather than fail
        return f"unknown ({type(e).__name__})"


def run_backend(backend, q, k, v, scale, iters, warmup):
    """Times one backend; GQA natively when it takes it, else with K/V expanded to Hq heads."""
    group = q.shape[1] // k.shape[1]
    tries = [("native", k, v, True)]
    if group > 1:
        tries.append(("expanded", None, None, False))
    errors = []
    for gqa, kk, vv, enable_gqa in tries:
        if kk is None:
            kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def call():
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scale, enable_gqa=enable_gqa)

        try:
            if backend is None:
                call()
                times = time_it(call, iters, warmup)
            else:
                with sdpa_kernel([backend]):
                    call()
                    times = time_it(call, iters, warmup)
            return gqa, times, None
        except RuntimeError as e:
            errors.append(f"{gqa}: {str(e).splitlines()[0][:200]}")
            torch.cuda.synchronize()
        finally:
            if not enable_gqa:
                del kk, vv
                torch.cuda.empty_cache()
    return None, None, "; ".join(errors)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/reports/H200/torch_sdpa.json")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="regex: run only the shapes whose name matches (e.g. 'llama/T:32768')")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_sdpa.py: no CUDA device visible to torch")
    torch.manual_seed(0)
    report = {"context": context(), "results": []}
    for name, Hq, Hkv, D, scale, tokens in CASES:
        for T in tokens:
            base = f"attn.prefill/torch_sdpa/bf16/{name}/T:{T}"
            if args.only and not re.search(args.only, base):
                continue
            q, k, v = rand((1, Hq, T, D)), rand((1, Hkv, T, D)), rand((1, Hkv, T, D))
            iters, warmup = (max(3, args.iters // 2), 1) if T >= LONG_T else (args.iters, args.warmup)
            picked = picked_backend(q, k, v, scale)
            best = None
            for bname, backend in BACKENDS:
                gqa, times, err = run_backend(backend, q, k, v, scale, iters, warmup)
                res = dict(name=f"{base}/{bname}", shape=name, T=T, hq=Hq, hkv=Hkv, d=D, backend=bname)
                if bname == "default":
                    res["picked"] = picked
                if err is not None:
                    res["error"] = err
                    print(f"{res['name']:56s} not run: {err}", flush=True)
                else:
                    res.update(gqa=gqa, **summary(times, causal_flops(T, Hq, D)))
                    print(f"{res['name']:56s} {res['median_s'] * 1e3:9.3f} ms {res['tflop_per_second']:7.1f} TFLOP/s"
                          f"  gqa {gqa}" + (f"  picked {picked}" if bname == "default" else ""), flush=True)
                    if best is None or res["median_s"] < best["median_s"]:
                        best = res
                report["results"].append(res)
            if best is not None:
                report["results"].append(dict(best, name=f"{base}/best", best_of=best["backend"]))
                print(f"{base + '/best':56s} {best['median_s'] * 1e3:9.3f} ms {best['tflop_per_second']:7.1f} TFLOP/s"
                      f"  ({best['backend']})", flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    write_report(report, args.out)


if __name__ == "__main__":
    main()

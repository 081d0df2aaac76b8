#!/usr/bin/env python3
"""Peer numbers for the end-to-end dense prefill (issues 15 and 27, `upf prefill --mode dense`): PyTorch doing
the same layers as models/ and layers/ on Llama-3.1-8B, Gemma-3-12B and Qwen3-Next-80B-A3B at their real
shapes, random bf16 weights, one request of T tokens (or B requests of T tokens packed), timed with CUDA
events after a warm-up (median, min and spread), written as JSON in the format of the other peers. Runs on
the GPU machine; `--check` runs a tiny config of each family on the CPU (or `--device cuda`) against an f32
reference instead, `--against-upf UPF` against our CPU reference on the same seeded weights, and
`--tiny --device cpu` runs the timing path itself on the tiny configs (CPU testing; times mean nothing).

The layers (models/configs.c, layers/attention.c, layers/gdn.c, layers/ffn.c, uniprefill/moe.h, models/prefill.c):
  x = embed(ids) * embed_scale                         Gemma: sqrt(3840) rounded to bf16 (62.0)
  per layer:  h = norm(x); then the layer's mixer:
    attention  qkv = h W_qkv^T                         fused QKV weight (Hq D (x2 with a gate) + 2 Hkv D, H)
              q, k <- q/k RMSNorm per head [Gemma, Qwen3-Next], then RoPE (rotate-half) at each token's position
                      Llama: theta 5e5, llama3 scaling (8, 1, 4, 8192)
                      Gemma: global layers theta 1e6 linear /8, sliding layers theta 1e4
                      Qwen3-Next: theta 1e7 on the first 64 of the 256 dims (partial rotary 0.25)
              o = causal attention, GQA                full: SDPA (the fastest backend that takes the
                                                       shape, probed per length, recorded); sliding
                                                       window 1024 (keys, the query's own included):
                                                       flex_attention compiled, causal-window block mask
              o *= sigmoid(gate) [Qwen3-Next: q_proj emits [query | gate] per head]
              a = o W_o^T; a = norm(a) [Gemma sandwich]
    GDN [Qwen3-Next, layers i with (i+1) % 4 != 0]
              proj = h W_in^T (T, C + Hv Dv) = [q (Hk Dk) | k (Hk Dk) | v (Hv Dv) | z (Hv Dv)], C = 8192
              ba = h W_ba^T (T, 2 Hv) = [b | a]
              conv = silu(causal depthwise conv1d of proj[:, :C], kernel 4) over each request
              o = gated delta rule: Hk 16 key heads of Dk 128 shared by Hv 32 value heads of Dv 128
                  (value head h reads key head h // 2); q, k L2-normalised (eps 1e-6), scale Dk^-0.5,
                  g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), zero initial state
              o = rmsnorm(o) * w * silu(z) per value head (Qwen3NextRMSNormGated: plain gain, eps 1e-6)
              a = o W_out^T
              x += a; h = norm(x); then the FFN:
    dense     gu = h W_gu^T; f = act(gate) * up (SwiGLU silu / GeGLU tanh); f = f W_d^T; f = norm(f) [Gemma]
    MoE [Qwen3-Next] logits = h W_r^T (f32), p = softmax over 512 experts, the top 10 renormalised to sum 1;
              f = sum_k w_k down_e(silu(gate_e h) * up_e h) + sigmoid(h . w_sg) shared(h), every expert and
              the shared one SwiGLU of 512, the weighted sum in f32 rounded once
              x += f
  logits = norm(x[last token of each request]) W_out^T  (Gemma: tied, W_out = the embedding), f32
Norms: RMSNorm in f32, Llama x/rms * w (eps 1e-5), Gemma and Qwen3-Next zero-centred x/rms * (1 + w) (eps 1e-6).
Gemma: every 6th layer global ((i+1) % 6 == 0), scale 256^-0.5; Llama: all 32 layers full, 128^-0.5;
Qwen3-Next: every 4th layer full attention (16/2 heads of 256, scale 256^-0.5), the other 36 of 48 GDN.

How PyTorch runs it (recorded in the JSON's context and results):
  - matmuls: F.linear on bf16 (cuBLAS), weights (out, in), distinct weights per layer (--shared-weights:
    the layers of one mixer kind run on the weights of the first layer of that kind, MoE routers apart, as
    `upf --shared-weights`: stated in the context, in each result and its name);
  - the pointwise glue (norms with the residual add, q/k norm + RoPE, act * up, the attention gate, the
    GDN conv as a shifted sum, its gated norm, the MoE routing and combine) is torch.compile'd (--glue
    compiled, default on the GPU; --glue eager for plain eager ops): a strong peer, not eager PyTorch;
  - GDN: flash-linear-attention's chunk_gated_delta_rule (Triton; the gate, beta's sigmoid and the q/k L2
    norm in its kernels, varlen through cu_seqlens) when `fla` imports (the carried wheels); the conv FLA's
    causal_conv1d or the compiled shifted sum, whichever is faster at the length (probed, recorded).
    Without FLA a plain-torch chunked scan runs (f32, slow; the output says so: CPU testing only);
  - MoE: router logits in f32 (torch.mm with out_dtype where torch has it), softmax + top-k (glue), the
    (token, rank) pairs sorted by expert (stable argsort), gate_up and down as one grouped GEMM each
    (F.grouped_mm / torch._grouped_mm) over the sorted rows, else one F.linear per expert with tokens
    (recorded as moe_experts), the shared expert by F.linear, the combine (gather, weights, sigmoid gate) glue;
  - torch.inference_mode, no autograd; intermediates die at the end of each block (the caching
    allocator reuses their memory); peak memory is recorded;
  - outside the timed region (per length, as a serving stack would cache them): the RoPE cos/sin
    tables of the positions, cu_seqlens, the flex block mask, the compilation (warm-up), the SDPA and
    conv probes.
  - a batch (--reqs B > 1): B requests of T tokens packed into B*T rows for every per-token op; the
    attention runs per request (SDPA / flex over each request's rows; neither takes packed varlen
    input in PyTorch), so the per-request loop is part of the time; the GDN ops take the packed rows.
Timing: CUDA events at the start, after the embedding and first norm, after each layer's mixer (its
pre-norm, the attention / GDN block and the add + norm after it: `upf prefill`'s mixer_ms) and after its
FFN / MoE block (ffn_ms), and at the end of every timed iteration; `median_s`, `min_s`, `cv` are over the
whole forward (the layers run); `layer_s` the median of each layer, `per_layer_s` the median per layer
kind, `mixer_s` / `ffn_s` the medians of the two parts, `per_part_s` the median per mixer kind and of
the FFN ("ffn" or "moe"), `layer_kind` each layer's kind.
--layers N times the first N layers only (plus embedding and head); `ttft_model_s` then extrapolates
the whole model: pre + post + sum over kinds of (layers of that kind in the model) x (median per layer
of that kind), and `extrapolated` says so (null when a kind of the model was not among the N layers);
`model_part_s` the same by part (e.g. Qwen3-Next: 36 x gdn, 12 x full, 48 x moe).
FLOPs (of what ran): attention layers 2 T (H Nqkv + Hq D H) + 4 D Hq x (query, key) pairs (causal:
t (t+1)/2 per request of t tokens; window W: the pairs within the window); GDN layers 2 T H (C + 2 Hv Dv
+ 2 Hv) + 2 T C K + 7 T Hv Dk Dv; dense FFN 6 T H I; MoE upf_moe_flops (router 2 T H E, routed 6 T K I H,
shared 6 T Is H + 2 T H); head 2 B H V.

Usage (GPU machine):
  python3 perf/peers/torch_prefill.py [--model llama|gemma|qwen3-next|all] [--lengths 8192,32768,131072]
        [--reqs 1] [--layers N] [--iters 5] [--warmup 2] [--glue compiled|eager] [--shared-weights]
        [--out perf/reports/H200/torch_prefill.json]
      (a model whose weights do not fit the free GPU memory is recorded as not run: Qwen3-Next's 148 GiB
      of distinct weights need --shared-weights or --layers N)
  python3 perf/peers/torch_prefill.py --check [--model ...] [--device cpu|cuda]
  python3 perf/peers/torch_prefill.py --against-upf build-cpu/upf [--model ...]    (CPU; numpy)
  python3 perf/peers/torch_prefill.py --tiny --device cpu --model qwen3-next --lengths 64 --layers 4
"""
import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from peer_common import context, summary, write_report
from qwen3next_ops import GLUE as QN_GLUE, Gdn, Moe, conv_channels, gdn_flops, moe_flops

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - the device has torch 2.11
    create_block_mask = flex_attention = None
from torch.nn.attention import SDPBackend, sdpa_kernel

LONG_T = 65536  # at and above (tokens in the step): fewer timed calls


@dataclass(frozen=True)
class Rope:
    kind: str                     # "default", "linear", "llama3"
    theta: float
    factor: float = 1.0
    low_freq: float = 0.0         # llama3
    high_freq: float = 0.0        # llama3
    orig_max_pos: int = 0         # llama3


@dataclass(frozen=True)
class Config:
    name: str
    hidden: int                   # H
    layers: int
    vocab: int                    # V
    q_heads: int                  # Hq
    kv_heads: int                 # Hkv
    head_dim: int                 # D
    inter: int                    # I (dense FFN)
    act: str                      # "silu" (SwiGLU), "gelu_tanh" (GeGLU)
    eps: float
    norm_offset: float            # 0: x/rms * w; 1: zero-centred x/rms * (1 + w)
    qk_norm: bool
    sandwich: bool
    full_interval: int            # layer i is full attention iff (i + 1) % full_interval == 0
    window: int                   # sliding window of the other layers (keys, the query's own included)
    scale: float
    rope_full: Rope
    rope_sliding: Rope
    embed_scale: float            # already rounded to bf16 where the model does so
    tied: bool
    other: str = "sliding"        # the mixer of the other layers: "sliding" or "gdn"
    rotary_dim: int = 0           # RoPE on the first rotary_dim dims of a head (0: all of them)
    attn_gate: bool = False       # q_proj emits [query | gate] per head; o *= sigmoid(gate)
    gdn_key_heads: int = 0        # Hk
    gdn_value_heads: int = 0      # Hv
    gdn_key_dim: int = 0          # Dk
    gdn_value_dim: int = 0        # Dv
    gdn_conv_kernel: int = 0
    gdn_eps: float = 1e-6         # the gated norm (plain gain)
    moe_experts: int = 0          # E; 0: dense FFN
    moe_top_k: int = 0            # K
    moe_inter: int = 0            # I of a routed expert
    moe_shared_inter: int = 0     # Is of the shared expert
    moe_norm_topk: bool = True

    def kind(self, layer):
        return "full" if (layer + 1) % self.full_interval == 0 else self.other

    @property
    def qkv_cols(self):
        return (self.q_heads * (2 if self.attn_gate else 1) + 2 * self.kv_heads) * self.head_dim

    @property
    def rot(self):
        return self.rotary_dim or self.head_dim

    @property
    def ffn_part(self):
        return "moe" if self.moe_experts else "ffn"


LLAMA_ROPE = Rope("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
QWEN3N_ROPE = Rope("default", 10000000.0)
CONFIGS = {
    "llama": Config("llama3.1-8b", 4096, 32, 128256, 32, 8, 128, 14336, "silu", 1e-5, 0.0, False, False, 1, 0,
                    128 ** -0.5, LLAMA_ROPE, LLAMA_ROPE, 1.0, False),
    "gemma": Config("gemma3-12b", 3840, 48, 262208, 16, 8, 256, 15360, "gelu_tanh", 1e-6, 1.0, True, True, 6, 1024,
                    256 ** -0.5, Rope("linear", 1e6, 8.0), Rope("default", 1e4),
                    torch.tensor(3840 ** 0.5, dtype=torch.bfloat16).item(), True),
    # model_config.h UPF_QWEN3N_80B_*, uniprefill/moe.h upf_moe_config_qwen3_next
    "qwen3-next": Config("qwen3-next-80b-a3b", 2048, 48, 151936, 16, 2, 256, 0, "silu", 1e-6, 1.0, True, False, 4, 0,
                         256 ** -0.5, QWEN3N_ROPE, QWEN3N_ROPE, 1.0, False, other="gdn", rotary_dim=64,
                         attn_gate=True, gdn_key_heads=16, gdn_value_heads=32, gdn_key_dim=128, gdn_value_dim=128,
                         gdn_conv_kernel=4, gdn_eps=1e-6, moe_experts=512, moe_top_k=10, moe_inter=512,
                         moe_shared_inter=512, moe_norm_topk=True),
}
# The tiny configs of models/configs.c (llama-tiny, gemma3-tiny, qwen3-next-tiny): same sub-layers and pattern.
TINY = {
    "llama": replace(CONFIGS["llama"], name="llama-tiny", hidden=128, layers=6, vocab=512, q_heads=4, kv_heads=2,
                     head_dim=32, inter=256, scale=32 ** -0.5),
    "gemma": replace(CONFIGS["gemma"], name="gemma3-tiny", hidden=128, layers=9, vocab=512, q_heads=4, kv_heads=2,
                     head_dim=32, inter=256, full_interval=3, window=32, scale=32 ** -0.5,
                     embed_scale=torch.tensor(128 ** 0.5, dtype=torch.bfloat16).item()),
    "qwen3-next": replace(CONFIGS["qwen3-next"], name="qwen3-next-tiny", hidden=128, layers=12, vocab=512, q_heads=4,
                          kv_heads=2, head_dim=32, scale=32 ** -0.5, rotary_dim=8, moe_experts=8, moe_top_k=2,
                          moe_inter=64, moe_shared_inter=64, gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=32,
                          gdn_value_dim=32),
}
FAMILIES = list(CONFIGS)


# ---- RoPE tables ----

def inv_freq(rope, dim):
    """(dim/2) f64, as HF computes it (the llama3 rule included); dim: the rotary dims."""
    f = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope.kind == "linear":
        return f / rope.factor
    if rope.kind == "llama3":
        low_wl, high_wl = rope.orig_max_pos / rope.low_freq, rope.orig_max_pos / rope.high_freq
        wavelen = 2 * math.pi / f
        scaled = torch.where(wavelen > low_wl, f / rope.factor, f)
        smooth = (rope.orig_max_pos / wavelen - rope.low_freq) / (rope.high_freq - rope.low_freq)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled)
    return f


def rope_tables(rope, dim, positions, device):
    """cos, sin (T, dim/2) f32 of positions (T) i64; angles in f64 (no f32 rounding at 128K)."""
    ang = positions.to(torch.float64)[:, None] * inv_freq(rope, dim)[None, :]
    return torch.cos(ang).to(device, torch.float32), torch.sin(ang).to(device, torch.float32)


# ---- The pointwise glue (torch.compile'd under --glue compiled) ----

def rmsnorm(x, w, eps: float, offset: float):
    """x (..., n) -> same dtype; f32 inside; w (n) multiplies (offset 0) or 1 + w multiplies (offset 1)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (w.float() + offset)).to(x.dtype)


def add_rmsnorm(residual, x, w, eps: float, offset: float):
    """residual + x (the new residual) and its norm."""
    r = residual + x
    return r, rmsnorm(r, w, eps, offset)


def qk_prep(x, w, cos, sin, eps: float, offset: float, norm: bool):
    """x (T, h, D) any strides [-> per-head RMSNorm] -> RoPE rotate-half on the first 2 cos.shape[-1] dims
    (partial rotary: the rest pass through); (T, h, D) contiguous, x's dtype."""
    if norm:
        x = rmsnorm(x, w, eps, offset)
    xf = x.float()
    half = cos.shape[-1]
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if 2 * half < xf.shape[-1]:
        parts.append(xf[..., 2 * half:])
    return torch.cat(parts, dim=-1).to(x.dtype)


def act_mul(gu, act: str):
    """gu (T, 2I) = [gate | up] -> act(gate) * up (T, I)."""
    i = gu.shape[-1] // 2
    g, u = gu[:, :i], gu[:, i:]
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


def gate_mul(o, gate):
    """o * sigmoid(gate) in f32, rounded once; o, gate (T, h, D) any strides -> contiguous."""
    return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)


@dataclass
class Glue:
    rmsnorm: object = rmsnorm
    add_rmsnorm: object = add_rmsnorm
    qk_prep: object = qk_prep
    act_mul: object = act_mul
    gate_mul: object = gate_mul
    conv_shift: object = QN_GLUE["conv_shift"]
    gdn_gates: object = QN_GLUE["gdn_gates"]
    gated_norm: object = QN_GLUE["gated_norm"]
    moe_route: object = QN_GLUE["moe_route"]
    moe_combine: object = QN_GLUE["moe_combine"]


def compiled_glue():
    for knob in ("cache_size_limit", "recompile_limit"):  # one specialisation per length and head count
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    c = lambda f: torch.compile(f, dynamic=False)  # noqa: E731
    eager = Glue()
    return Glue(**{k: c(v) for k, v in vars(eager).items()})


# ---- Attention ----

def reference_attention(q, k, v, scale, window):
    """Explicit f32 softmax with a boolean mask, K/V expanded: the --check reference. q (1,Hq,t,D)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).float(), v.repeat_interleave(g, dim=1).float()
    s = (q.float() @ k.transpose(-1, -2)) * scale
    t = q.shape[2]
    i = torch.arange(t, device=q.device)
    mask = i[:, None] >= i[None, :]
    if window:
        mask &= (i[:, None] - i[None, :]) < window
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).to(q.dtype)


class Attention:
    """The two attention calls of the model: full (SDPA, backend and GQA mode chosen by `probe`) and
    sliding window (flex_attention with a causal-window block mask per request length)."""

    def __init__(self, cfg, device, reference=False):
        self.cfg, self.device, self.reference = cfg, device, reference
        self.sdpa_mode = (None, "native")  # (SDPBackend or None for torch's choice, "native" | "expanded")
        self.flex = None
        self.flex_impl = "none"
        self.masks = {}

    def setup_flex(self, compiled):
        if flex_attention is None:
            self.flex_impl = "mask (no flex_attention in this torch)"
            return
        self.flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        self.flex_impl = "flex_attention compiled" if compiled else "flex_attention eager"

    def block_mask(self, t):
        if t not in self.masks:
            w = self.cfg.window

            def causal_window(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

            # compiled on the GPU: eager create_block_mask materialises all t x t pairs (17 G at 128K)
            make = create_block_mask if self.device == "cpu" else torch.compile(create_block_mask)
            self.masks[t] = make(causal_window, 1, 1, t, t, self.device)
        return self.masks[t]

    def full(self, q, k, v):
        if self.reference:
            return reference_attention(q, k, v, self.cfg.scale, 0)
        backend, gqa = self.sdpa_mode
        if gqa == "expanded":
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.cfg.scale,
                                                  enable_gqa=gqa == "native")

    def sliding(self, q, k, v):
        if self.reference or self.flex is None:
            return reference_attention(q, k, v, self.cfg.scale, self.cfg.window)
        return self.flex(q, k, v, block_mask=self.block_mask(q.shape[2]), scale=self.cfg.scale, enable_gqa=True)

    def probe(self, t, iters=2):
        """Times one full-attention call of a request of t tokens under each SDPA backend (GQA native,
        else K/V expanded) and keeps the fastest; returns what each did."""
        c = self.cfg
        q = torch.randn((1, c.q_heads, t, c.head_dim), device=self.device, dtype=torch.bfloat16)
        k = torch.randn((1, c.kv_heads, t, c.head_dim), device=self.device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        found, best = {}, None
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for gqa in ("native", "expanded"):
                self.sdpa_mode = (backend, gqa)
                key = f"{backend.name}/{gqa}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        self.full(q, k, v)
                        torch.cuda.synchronize()
                        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                        ev[0].record()
                        for _ in range(iters):
                            self.full(q, k, v)
                        ev[1].record()
                        ev[1].synchronize()
                    found[key] = ev[0].elapsed_time(ev[1]) * 1e-3 / iters
                    if best is None or found[key] < found[best]:
                        best = key
                    break  # native ran: expanded costs more bytes for the same FLOPs
                except RuntimeError as e:
                    found[key] = f"not run: {str(e).splitlines()[0][:160]}"
                    torch.cuda.synchronize()
        del q, k, v
        if best is None:
            raise RuntimeError(f"no SDPA backend runs the full attention of {c.name} at T={t}: {found}")
        name, gqa = best.split("/")
        self.sdpa_mode = (getattr(SDPBackend, name), gqa)
        return {"sdpa_probe_s": found, "sdpa_backend": best}


@dataclass
class Ops:
    """What runs each kind of block: the attention calls, the GDN conv and scan, the MoE."""
    attn: Attention
    gdn: Gdn = None
    moe: Moe = None

    @staticmethod
    def make(cfg, device, reference=False):
        return Ops(Attention(cfg, device, reference),
                   Gdn(cfg, device, reference) if cfg.other == "gdn" else None,
                   Moe(cfg, device, reference) if cfg.moe_experts else None)


# ---- Weights and the forward pass ----

@dataclass
class LayerWeights:
    attn_norm: torch.Tensor       # (H)
    ffn_norm: torch.Tensor = None  # (H)
    # attention layers
    qkv: torch.Tensor = None      # (Nqkv, H)  [q | k | v] rows; Qwen3-Next: [query | gate] rows per q head
    q_norm: torch.Tensor = None   # (D)   qk_norm
    k_norm: torch.Tensor = None   # (D)   qk_norm
    o: torch.Tensor = None        # (H, Hq D)
    post_attn_norm: torch.Tensor = None  # (H)  sandwich
    # GDN layers
    ssm_in: torch.Tensor = None   # (C + Hv Dv, H)  [q | k | v | z] rows
    ssm_ba: torch.Tensor = None   # (2 Hv, H)  [b | a] rows
    ssm_conv: torch.Tensor = None  # (C, kernel)
    ssm_a: torch.Tensor = None    # (Hv) f32 A_log
    ssm_dt: torch.Tensor = None   # (Hv) f32 dt_bias
    ssm_norm: torch.Tensor = None  # (Dv)  the gated norm's gain
    ssm_out: torch.Tensor = None  # (H, Hv Dv)
    # dense FFN
    gate_up: torch.Tensor = None  # (2I, H)  [gate | up] rows
    down: torch.Tensor = None     # (H, I)
    post_ffn_norm: torch.Tensor = None  # (H)   sandwich
    # MoE
    router: torch.Tensor = None   # (E, H)
    exp_gate_up: torch.Tensor = None  # (E, 2I, H)  [gate | up] rows per expert
    exp_down: torch.Tensor = None  # (E, H, I)
    sh_gate_up: torch.Tensor = None  # (2Is, H)
    sh_down: torch.Tensor = None  # (H, Is)
    sh_gate: torch.Tensor = None  # (H)  the shared expert's sigmoid gate

    def tensors(self):
        return [t for t in vars(self).values() if t is not None]


def normal(shape, std, gen, device, dtype):
    if device == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)


def uniform(shape, lo, hi, gen, device, dtype):
    if device == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype).uniform_(lo, hi, generator=gen)


def norm_weight(n, cfg, gen, device, dtype):
    """What the norm multiplies by (Llama) or its offset (Gemma, Qwen3-Next): 1 + small noise, or small noise."""
    return normal((n,), 0.02, gen, device, dtype) + (1.0 - cfg.norm_offset)


def make_layer(cfg, kind, gen, device, dtype):
    """Random weights of one layer of the mixer `kind`: projections (out, in) with std in^-0.5."""
    H, D = cfg.hidden, cfg.head_dim
    nw = lambda n: norm_weight(n, cfg, gen, device, dtype)  # noqa: E731
    mat = lambda rows, cols: normal((rows, cols), cols ** -0.5, gen, device, dtype)  # noqa: E731
    lw = LayerWeights(attn_norm=nw(H))
    if kind == "gdn":
        C, Hv, HvDv, K = conv_channels(cfg), cfg.gdn_value_heads, cfg.gdn_value_heads * cfg.gdn_value_dim, \
            cfg.gdn_conv_kernel
        lw.ssm_in, lw.ssm_ba = mat(C + HvDv, H), mat(2 * Hv, H)
        lw.ssm_conv = normal((C, K), K ** -0.5, gen, device, dtype)
        # as models/weights.c: A_log in [0, log 16], dt_bias in [-6, -2] (decays of a real checkpoint's range)
        lw.ssm_a = uniform((Hv,), 0.0, math.log(16.0), gen, device, torch.float32)
        lw.ssm_dt = uniform((Hv,), -6.0, -2.0, gen, device, torch.float32)
        lw.ssm_norm = normal((cfg.gdn_value_dim,), 0.02, gen, device, dtype) + 1.0
        lw.ssm_out = mat(H, HvDv)
    else:
        lw.qkv, lw.q_norm, lw.k_norm = mat(cfg.qkv_cols, H), nw(D), nw(D)
        lw.o, lw.post_attn_norm = mat(H, cfg.q_heads * D), nw(H)
    lw.ffn_norm = nw(H)
    if cfg.moe_experts:
        E, I, Is = cfg.moe_experts, cfg.moe_inter, cfg.moe_shared_inter
        lw.router = mat(E, H)
        lw.exp_gate_up = normal((E, 2 * I, H), H ** -0.5, gen, device, dtype)
        lw.exp_down = normal((E, H, I), I ** -0.5, gen, device, dtype)
        lw.sh_gate_up, lw.sh_down = mat(2 * Is, H), mat(H, Is)
        lw.sh_gate = normal((H,), H ** -0.5, gen, device, dtype)
    else:
        lw.gate_up, lw.down, lw.post_ffn_norm = mat(2 * cfg.inter, H), mat(H, cfg.inter), nw(H)
    return lw


@dataclass
class Model:
    cfg: Config
    layers: list                 # LayerWeights of the layers run
    embed: torch.Tensor          # (V, H)
    final_norm: torch.Tensor     # (H)
    output: torch.Tensor         # (V, H), the embedding when tied
    shared: bool
    weight_bytes: int = 0

    def count_bytes(self):
        seen = {}
        for t in [self.embed, self.output, self.final_norm] + [t for lw in self.layers for t in lw.tensors()]:
            seen[id(t)] = t.numel() * t.element_size()
        self.weight_bytes = sum(seen.values())
        return self

    @staticmethod
    def random(cfg, num_layers, shared, device, dtype=torch.bfloat16, seed=0):
        """shared: the layers of one mixer kind reuse the first such layer's weights (upf --shared-weights)."""
        gen = None
        if device != "meta":
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
        embed = normal((cfg.vocab, cfg.hidden), 1.0 / cfg.embed_scale, gen, device, dtype)
        output = embed if cfg.tied else normal((cfg.vocab, cfg.hidden), cfg.hidden ** -0.5, gen, device, dtype)
        first, layers = {}, []
        for i in range(num_layers):
            kind = cfg.kind(i)
            if shared and kind in first:
                # as upf: a MoE layer keeps its own router (one router sends the tokens to ever fewer experts)
                lw = first[kind]
                if cfg.moe_experts:
                    lw = dataclasses.replace(lw, router=normal((cfg.moe_experts, cfg.hidden), cfg.hidden ** -0.5,
                                                               gen, device, dtype))
                layers.append(lw)
                continue
            lw = make_layer(cfg, kind, gen, device, dtype)
            first.setdefault(kind, lw)
            layers.append(lw)
        return Model(cfg, layers, embed, norm_weight(cfg.hidden, cfg, gen, device, dtype), output, shared).count_bytes()

    def to(self, dtype):
        """The same weights in another dtype (the f32 reference of --check); A_log and dt_bias stay f32."""
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        casts = {}
        layers = []
        for lw in self.layers:
            if id(lw) not in casts:
                casts[id(lw)] = LayerWeights(**{k: v if k in ("ssm_a", "ssm_dt") else cast(v)
                                                for k, v in vars(lw).items()})
            layers.append(casts[id(lw)])
        return Model(self.cfg, layers, cast(self.embed), cast(self.final_norm),
                     cast(self.embed) if self.cfg.tied else cast(self.output), self.shared, self.weight_bytes)


@dataclass
class Batch:
    ids: torch.Tensor            # (T) i64 on the device
    cu: list                     # (B+1) host ints
    rope: dict = field(default_factory=dict)  # kind -> (cos, sin) (T, rot/2) f32 at each token's position
    last: torch.Tensor = None    # (B) i64: the packed row of each request's last token
    pos: torch.Tensor = None     # (T) i64: each token's position in its request (the GDN conv's window)
    cu_dev: torch.Tensor = None  # (B+1) i64 on the device (FLA's cu_seqlens)
    cu_cpu: torch.Tensor = None  # (B+1) i64 on the host (FLA's cu_seqlens_cpu)

    def __post_init__(self):
        dev = self.ids.device
        self.last = torch.tensor([e - 1 for e in self.cu[1:]], dtype=torch.int64, device=dev)
        spans = zip(self.cu[:-1], self.cu[1:])
        self.pos = torch.cat([torch.arange(e - s, dtype=torch.int64) for s, e in spans]).to(dev)
        self.cu_cpu = torch.tensor(self.cu, dtype=torch.int64)
        self.cu_dev = self.cu_cpu.to(dev)

    @staticmethod
    def make(cfg, lengths, device, seed=1):
        gen = torch.Generator().manual_seed(seed)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        ids = torch.randint(0, cfg.vocab, (cu[-1],), generator=gen)
        pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
        kinds = (("full", cfg.rope_full),) + ((("sliding", cfg.rope_sliding),) if cfg.other == "sliding" else ())
        rope = {kind: rope_tables(r, cfg.rot, pos, device) for kind, r in kinds}
        return Batch(ids.to(device), cu, rope)

    def slice(self, s, e):
        """Request [s, e) of the packed rows alone (a batch of one)."""
        return Batch(self.ids[s:e], [0, e - s], {k: (c[s:e], sn[s:e]) for k, (c, sn) in self.rope.items()})


def attention_block(m, lw, kind, h, batch, glue, attn):
    """h (T, H) normed -> attention output (T, H) after o_proj (and the post-attention norm, Gemma)."""
    c = m.cfg
    T, D, Hq, Hkv = h.shape[0], c.head_dim, c.q_heads, c.kv_heads
    qs = D * (2 if c.attn_gate else 1)                           # a q head's columns: [query | gate]
    qkv = F.linear(h, lw.qkv)                                    # (T, Nqkv)
    cos, sin = batch.rope[kind]
    qg = qkv[:, :Hq * qs].view(T, Hq, qs)
    q = glue.qk_prep(qg[..., :D], lw.q_norm, cos, sin, c.eps, c.norm_offset, c.qk_norm)
    k = glue.qk_prep(qkv[:, Hq * qs:Hq * qs + Hkv * D].view(T, Hkv, D), lw.k_norm, cos, sin, c.eps, c.norm_offset,
                     c.qk_norm)
    v = qkv[:, Hq * qs + Hkv * D:].view(T, Hkv, D)              # (T, Hkv, D) view
    call = attn.full if kind == "full" else attn.sliding
    heads = lambda x, s, e: x[s:e].transpose(0, 1).unsqueeze(0)  # noqa: E731  (1, h, t, D)
    if len(batch.cu) == 2:
        o = call(heads(q, 0, T), heads(k, 0, T), heads(v, 0, T))[0].transpose(0, 1)  # (T, Hq, D)
    else:
        o = torch.empty((T, Hq, D), device=h.device, dtype=h.dtype)
        for s, e in zip(batch.cu[:-1], batch.cu[1:]):
            o[s:e] = call(heads(q, s, e), heads(k, s, e), heads(v, s, e))[0].transpose(0, 1)
    if c.attn_gate:
        o = glue.gate_mul(o, qg[..., D:])                        # (T, Hq, D) contiguous
    del qkv, qg, q, k, v
    a = F.linear(o.reshape(T, Hq * D), lw.o)                     # (T, H)
    return glue.rmsnorm(a, lw.post_attn_norm, c.eps, c.norm_offset) if c.sandwich else a


def gdn_block(m, lw, h, batch, glue, gdn):
    """h (T, H) normed -> Gated DeltaNet output (T, H) after out_proj (layers/gdn.c)."""
    c = m.cfg
    T, Hk, Hv, Dk, Dv = h.shape[0], c.gdn_key_heads, c.gdn_value_heads, c.gdn_key_dim, c.gdn_value_dim
    C = conv_channels(c)
    proj = F.linear(h, lw.ssm_in)                                # (T, C + Hv Dv) [q | k | v | z]
    ba = F.linear(h, lw.ssm_ba)                                  # (T, 2 Hv) [b | a]
    conv = gdn.conv(proj[:, :C], lw.ssm_conv, batch, glue)       # (T, C)
    q = conv[:, :Hk * Dk].view(T, Hk, Dk)
    k = conv[:, Hk * Dk:2 * Hk * Dk].view(T, Hk, Dk)
    v = conv[:, 2 * Hk * Dk:].view(T, Hv, Dv)
    o = gdn.scan(q, k, v, ba[:, Hv:], ba[:, :Hv], lw.ssm_a, lw.ssm_dt, Dk ** -0.5, batch, glue)  # (T, Hv, Dv)
    del conv, q, k, v, ba
    o = glue.gated_norm(o, proj[:, C:].view(T, Hv, Dv), lw.ssm_norm, c.gdn_eps)
    del proj
    return F.linear(o.reshape(T, Hv * Dv), lw.ssm_out)           # (T, H)


def ffn_block(m, lw, h, glue, ops):
    """h (T, H) normed -> FFN / MoE output (T, H) (and the post-FFN norm, Gemma)."""
    c = m.cfg
    if c.moe_experts:
        return ops.moe(h, lw, glue, c.act)
    f = glue.act_mul(F.linear(h, lw.gate_up), c.act)             # (T, I)
    f = F.linear(f, lw.down)                                     # (T, H)
    return glue.rmsnorm(f, lw.post_ffn_norm, c.eps, c.norm_offset) if c.sandwich else f


def forward(m, batch, glue, ops, marks=None):
    """Last-position logits (B, V) f32. marks: 2 len(layers) + 3 marks (start, after the embedding and
    first norm, after each layer's mixer and after its FFN, end) or None."""
    c = m.cfg
    mark = marks.record if marks is not None else (lambda i: None)
    mark(0)
    residual = F.embedding(batch.ids, m.embed)                   # (T, H)
    if c.embed_scale != 1.0:
        residual = residual * c.embed_scale
    h = glue.rmsnorm(residual, m.layers[0].attn_norm, c.eps, c.norm_offset)
    mark(1)
    out = None
    for i, lw in enumerate(m.layers):
        if i > 0:
            residual, h = glue.add_rmsnorm(residual, out, lw.attn_norm, c.eps, c.norm_offset)
            out = None  # free the last FFN output before this layer's mixer allocates
        kind = c.kind(i)
        a = gdn_block(m, lw, h, batch, glue, ops.gdn) if kind == "gdn" else \
            attention_block(m, lw, kind, h, batch, glue, ops.attn)
        residual, h = glue.add_rmsnorm(residual, a, lw.ffn_norm, c.eps, c.norm_offset)
        del a
        mark(2 + 2 * i)
        out = ffn_block(m, lw, h, glue, ops)
        mark(3 + 2 * i)
    x = residual.index_select(0, batch.last) + out.index_select(0, batch.last)  # (B, H): the last add, last rows only
    logits = F.linear(glue.rmsnorm(x, m.final_norm, c.eps, c.norm_offset), m.output).float()
    mark(2 * len(m.layers) + 2)
    return logits


# ---- Counting ----

def attn_pairs(t, window):
    """(query, key) pairs of one request of t tokens: causal, or causal within a window of w keys."""
    if not window or window >= t:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def flops(cfg, num_layers, lengths):
    T, H, D, Hq = sum(lengths), cfg.hidden, cfg.head_dim, cfg.q_heads
    attn_proj = 2.0 * T * (H * cfg.qkv_cols + Hq * D * H)
    ffn = moe_flops(cfg, T) if cfg.moe_experts else 6.0 * T * H * cfg.inter
    total = 2.0 * len(lengths) * H * cfg.vocab
    for i in range(num_layers):
        kind = cfg.kind(i)
        if kind == "gdn":
            total += gdn_flops(cfg, T) + ffn
        else:
            w = 0 if kind == "full" else cfg.window
            total += attn_proj + ffn + 4.0 * D * Hq * sum(attn_pairs(t, w) for t in lengths)
    return total


# ---- Timing ----

class Marks:
    """Time stamps of one forward: CUDA events on the GPU, perf_counter on the CPU (synchronous there)."""

    def __init__(self, n, device):
        self.cuda = device == "cuda"
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if self.cuda else [0.0] * n

    def record(self, i):
        if self.cuda:
            self.ev[i].record()
        else:
            self.ev[i] = time.perf_counter()

    def segments(self):
        if self.cuda:
            self.ev[-1].synchronize()
            return [self.ev[i].elapsed_time(self.ev[i + 1]) * 1e-3 for i in range(len(self.ev) - 1)]
        return [self.ev[i + 1] - self.ev[i] for i in range(len(self.ev) - 1)]


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(m, batch, glue, ops, iters, warmup, device):
    """Per timed iteration: the seconds of each segment between the marks of `forward`."""
    for _ in range(warmup):
        forward(m, batch, glue, ops)
    synchronize(device)
    runs = []
    for _ in range(iters):
        marks = Marks(2 * len(m.layers) + 3, device)
        forward(m, batch, glue, ops, marks)
        runs.append(marks.segments())
    return runs


def layer_summary(cfg, runs):
    """Medians: pre (embedding + first norm), each layer and its two parts, post (last add, final norm,
    head), per kind and part; and the whole-model estimates from them."""
    n = (len(runs[0]) - 2) // 2
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    pre, post = med(lambda r: r[0]), med(lambda r: r[-1])
    mixer_s = [med(lambda r, i=i: r[1 + 2 * i]) for i in range(n)]
    ffn_s = [med(lambda r, i=i: r[2 + 2 * i]) for i in range(n)]
    layer_s = [med(lambda r, i=i: r[1 + 2 * i] + r[2 + 2 * i]) for i in range(n)]
    kinds = [cfg.kind(i) for i in range(n)]
    per_kind = {k: statistics.median(layer_s[i] for i in range(n) if kinds[i] == k) for k in dict.fromkeys(kinds)}
    per_part = {k: statistics.median(mixer_s[i] for i in range(n) if kinds[i] == k) for k in dict.fromkeys(kinds)}
    per_part[cfg.ffn_part] = statistics.median(ffn_s)
    counts = {}
    for i in range(cfg.layers):
        counts[cfg.kind(i)] = counts.get(cfg.kind(i), 0) + 1
    if all(k in per_kind for k in counts):
        model_s = pre + post + sum(per_kind[k] * counts[k] for k in counts)
        model_part = {k: per_part[k] * counts[k] for k in counts}
        model_part[cfg.ffn_part] = per_part[cfg.ffn_part] * cfg.layers
    else:
        model_s = model_part = None
    return {"pre_s": pre, "post_s": post, "layer_s": layer_s, "per_layer_s": per_kind,
            "model_layer_counts": counts, "ttft_model_s": model_s, "layer_kind": kinds, "mixer_s": mixer_s,
            "ffn_s": ffn_s, "per_part_s": per_part, "model_part_s": model_part}


def case_name(cfg, B, T, layers, shared, dtype="bf16"):
    name = f"model.prefill/torch/{dtype}/{cfg.name}/B:{B}/T:{T}"
    if layers < cfg.layers:
        name += f"/layers:{layers}"
    return name + ("/shared-weights" if shared else "")


def run_case(cfg, m, glue, ops, T, B, args):
    device = args.device
    lengths = [T] * B
    batch = Batch.make(cfg, lengths, device)
    n = len(m.layers)
    name = case_name(cfg, B, T, n, m.shared)
    res = {"name": name, "model": cfg.name, "B": B, "T": T, "tokens": B * T,
           "layers_timed": n, "layers_model": cfg.layers, "shared_weights": m.shared}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    kinds = {cfg.kind(i) for i in range(n)}
    if "full" in kinds:
        res.update(ops.attn.probe(T) if device == "cuda" else {"sdpa_backend": "default (cpu)"})
    if "sliding" in kinds:
        res["sliding_impl"] = ops.attn.flex_impl
    if "gdn" in kinds:
        res.update(ops.gdn.probe(T, glue))
    if ops.moe is not None:
        res.update(ops.moe.describe())
    iters, warmup = (max(3, args.iters // 2), 1) if B * T >= LONG_T else (args.iters, args.warmup)
    runs = time_case(m, batch, glue, ops, iters, warmup, device)
    res.update(summary([sum(r) for r in runs], flops(cfg, n, lengths)))
    ls = layer_summary(cfg, runs)
    res.update(ls)
    res["extrapolated"] = n < cfg.layers
    res["peak_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    res["activation_peak_bytes"] = res["peak_bytes"] - m.weight_bytes if device == "cuda" else None
    per = "  ".join(f"{k} {v * 1e3:.2f}" for k, v in ls["per_part_s"].items())
    model = "n/a" if ls["ttft_model_s"] is None else f"{ls['ttft_model_s'] * 1e3:.1f} ms"
    peak = f"peak {res['peak_bytes'] / 2**30:.1f} GiB" if res["peak_bytes"] is not None else "peak n/a (cpu)"
    print(f"{name:60s} {res['median_s'] * 1e3:10.1f} ms (min {res['min_s'] * 1e3:.1f}, cv {res['cv']:.3f}) "
          f"{res['tflop_per_second']:6.1f} TFLOP/s  ms/layer part: {per}  model {model}"
          f"{' (extrapolated)' if res['extrapolated'] else ''}{' (shared weights)' if m.shared else ''}  "
          f"sdpa {res.get('sdpa_backend', '-')}  {peak}", flush=True)
    ops.attn.masks.clear()
    return res


def run_context(extra, device):
    """peer_common.context on the GPU; the same keys on the CPU (no device properties there)."""
    if device == "cuda":
        return context(extra)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    ctx = {"gpu": "none (cpu)", "sms": 0, "torch": torch.__version__, "cuda": torch.version.cuda,
           "commit": commit or os.environ.get("UPF_COMMIT", "unknown"),
           "command": " ".join([sys.executable] + sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    ctx.update(extra)
    return ctx


def weights_note(shared):
    return ("shared: the layers of one mixer kind run on the weights of the first layer of that kind, each MoE "
            "layer with its own router (as upf --shared-weights; real shapes, routing and state sizes)") if shared \
        else "distinct random weights per layer"


def bench(args):
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_prefill.py: no CUDA device visible to torch (use --check, or --tiny --device cpu)")
    glue_mode = args.glue or ("compiled" if device == "cuda" else "eager")
    glue = compiled_glue() if glue_mode == "compiled" else Glue()
    notes = [
        "attention per request when B > 1 (SDPA / flex take no packed varlen input); projections packed",
        "buffers: intermediates are freed at the end of each block and PyTorch's caching allocator reuses "
        "them (no explicit out= buffers); peak_bytes is torch.cuda.max_memory_allocated, weights included",
        "outside the timed region: RoPE cos/sin tables, cu_seqlens, flex block masks, compilation (warm-up), "
        "SDPA and conv probes",
        "ttft_model_s extrapolates from per-kind medians when layers_timed < layers_model (extrapolated: true)",
        "mixer_s: the layer's pre-norm (add + norm), attention / GDN block and the add + norm after it; ffn_s: "
        "the FFN / MoE block (upf prefill's mixer_ms / ffn_ms)",
    ]
    if device == "cpu":
        notes.append("CPU run (testing the script): perf_counter stamps, no peak memory, times mean nothing")
    configs = TINY if args.tiny else CONFIGS
    models = FAMILIES if args.model == "all" else [args.model]
    extra = {"peer": "torch_prefill", "glue": glue_mode, "dtype": "bf16", "device": device,
             "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
             "weights": weights_note(args.shared_weights), "shared_weights": args.shared_weights, "notes": notes}
    if args.tiny:
        extra["tiny"] = "the tiny configs of models/configs.c (testing the script)"
    report = {"context": run_context(extra, device), "results": []}
    lengths = [int(x) for x in args.lengths.split(",") if x]
    for key in models:
        cfg = configs[key]
        n = min(args.layers or cfg.layers, cfg.layers)
        need = Model.random(cfg, n, args.shared_weights, "meta").weight_bytes
        free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
        if free is not None and need > 0.9 * free:
            why = (f"weights {need / 2**30:.1f} GiB ({n} layers, {'shared' if args.shared_weights else 'distinct'}) "
                   f"do not fit the {free / 2**30:.1f} GiB free: --shared-weights or --layers N")
            print(f"{cfg.name}: not run: {why}", flush=True)
            for T in lengths:
                report["results"].append({"name": case_name(cfg, args.reqs, T, n, args.shared_weights),
                                          "model": cfg.name, "error": why, "weight_bytes": need})
            continue
        m = Model.random(cfg, n, args.shared_weights, device)
        ops = Ops.make(cfg, device)
        if ops.moe is not None:
            ops.moe.setup()
        print(f"{cfg.name}: {n} of {cfg.layers} layers, weights {m.weight_bytes / 2**30:.2f} GiB"
              f" ({'shared' if m.shared else 'distinct'}), glue {glue_mode}"
              + (f", gdn scan {ops.gdn.scan_impl}" if ops.gdn else "")
              + (f", moe {ops.moe.experts}; router {ops.moe.router}" if ops.moe else ""), flush=True)
        ops.attn.setup_flex(compiled=device == "cuda")
        for T in lengths:
            try:
                res = run_case(cfg, m, glue, ops, T, args.reqs, args)
            except Exception as e:  # noqa: BLE001 - out of memory, a backend refusing: record, go on
                res = {"name": case_name(cfg, args.reqs, T, n, m.shared), "model": cfg.name,
                       "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
                print(f"{res['name']:60s} not run: {res['error']}", flush=True)
                ops.attn.masks.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()
            res["weight_bytes"] = m.weight_bytes
            report["results"].append(res)
        del m, ops
        if device == "cuda":
            torch.cuda.empty_cache()
    write_report(report, args.out)


# ---- --check: tiny configs, one step, against an explicit-mask f32 reference ----

def setup_sliding(cfg, attn, device):
    """compiled flex may not run on the CPU: then eager flex, then the explicit mask; returns which ran."""
    if not any(cfg.kind(i) == "sliding" for i in range(cfg.layers)):
        return "n/a (no sliding layers)"
    for compiled in (True, False):
        attn.setup_flex(compiled)
        try:
            attn.sliding(*[torch.randn((1, h, 160, cfg.head_dim), device=device, dtype=torch.bfloat16)
                           for h in (cfg.q_heads, cfg.kv_heads, cfg.kv_heads)])
            return attn.flex_impl
        except Exception as e:  # noqa: BLE001 - report which path the check exercised
            print(f"{cfg.name}: {attn.flex_impl} did not run here: {type(e).__name__}: {str(e)[:160]}")
            attn.masks.clear()
    attn.flex = None
    return "explicit mask (flex_attention did not run here)"


def describe_ops(ops, impl):
    parts = [f"sliding {impl}",
             f"sdpa {ops.attn.sdpa_mode[0].name if ops.attn.sdpa_mode[0] else 'default'}/{ops.attn.sdpa_mode[1]}"]
    if ops.gdn:
        parts.append(f"gdn conv {ops.gdn.conv_impl}, scan {ops.gdn.scan_impl}")
    if ops.moe:
        parts.append(f"moe {ops.moe.experts}, router {ops.moe.router}")
    return "; ".join(parts)


def check_case(cfg, device, glue, dtype, tol):
    """One tiny model in `dtype` through the timing path against the f32 reference path, and a batch of two
    requests against each alone; returns (ok, line)."""
    m = Model.random(cfg, cfg.layers, False, device, dtype=dtype)
    ref_m = m.to(torch.float32)
    ops = Ops.make(cfg, device)
    if device == "cuda":
        ops.attn.probe(256)
    if ops.moe:
        ops.moe.setup(dtype)
    if ops.gdn:
        ops.gdn.probe(256, glue)
    impl = setup_sliding(cfg, ops.attn, device)
    ref_ops = Ops.make(cfg, device, reference=True)
    lengths = [256, 160]
    both = Batch.make(cfg, lengths, device)
    with torch.inference_mode():
        got = forward(m, both, glue, ops)
        want = forward(ref_m, both, Glue(), ref_ops)
        alone = [forward(m, both.slice(s, e), glue, ops) for s, e in zip(both.cu[:-1], both.cu[1:])]
    scale = want.abs().max().item()
    err = (got - want).abs().max().item() / scale
    err_b = max((a[0] - got[r]).abs().max().item() for r, a in enumerate(alone)) / scale
    finite = bool(torch.isfinite(got).all())
    ok = finite and got.shape == (len(lengths), cfg.vocab) and err < tol and err_b < 2e-2
    name = "bf16" if dtype == torch.bfloat16 else "f32"
    line = (f"logits {tuple(got.shape)} finite {finite}; {name} vs f32 reference max err {err:.2e} (of max |logit| "
            f"{scale:.2f}, tol {tol:g}); batch of {lengths} vs alone {err_b:.2e} (tol 2e-2); {describe_ops(ops, impl)}")
    return ok, line, err


def check(args):
    device = args.device
    torch.manual_seed(0)
    glue_mode = args.glue or "eager"
    glue = compiled_glue() if glue_mode == "compiled" else Glue()
    passed = failures = 0
    for key in (FAMILIES if args.model == "all" else [args.model]):
        cfg = TINY[key]
        cases = [(cfg, torch.bfloat16, 5e-2, "")]
        if cfg.moe_experts:
            # bf16 moves near-tied router logits across the top-k boundary (random weights route almost
            # uniformly), so the routed model is checked in f32 and the bf16 arithmetic with every expert chosen
            # f32 on the GPU: FLA's Triton dots round their f32 operands to TF32
            cases = [(cfg, torch.float32, 1e-4 if device == "cpu" else 5e-3, "the timing path in f32; "),
                     (replace(cfg, moe_top_k=cfg.moe_experts), torch.bfloat16, 5e-2,
                      f"bf16 with top-{cfg.moe_experts} of {cfg.moe_experts} (no routing choice to flip); ")]
        for c, dtype, tol, what in cases:
            ok, line, _ = check_case(c, device, glue, dtype, tol)
            passed, failures = passed + ok, failures + (not ok)
            print(f"{cfg.name}: {what}{line}; glue {glue_mode}  {'ok' if ok else 'FAIL'}", flush=True)
        if cfg.moe_experts:
            _, _, err = check_case(cfg, device, glue, torch.bfloat16, 5e-2)
            print(f"{cfg.name}: (not gated) bf16 at top-{cfg.moe_top_k} of {cfg.moe_experts} vs the f32 reference: "
                  f"max err {err:.2e}, routing flips included", flush=True)
    print(f"{passed} passed, {failures} failed")
    sys.exit(1 if failures else 0)


# ---- --against-upf: the tiny configs' logits against our CPU reference on the same seeded weights ----

def seeded_model(cfg, dtype, shared, seed=1):
    """The peer's Model holding exactly the weights of `upf --model <tiny> --seed S` (perf/peers/upf_seeded.py)."""
    from upf_seeded import seeded_weights  # numpy: only this mode needs it
    w = seeded_weights(cfg, seed)
    t = lambda a: torch.from_numpy(a).to(dtype)  # noqa: E731  (f32 values; bf16 rounds to nearest even, as upf)
    layers, made = [], {}
    for i in range(cfg.layers):
        src = i
        if shared:  # the first layer of the same mixer kind, as upf_model_init_seeded_shared
            src = next(j for j in range(i + 1) if cfg.kind(j) == cfg.kind(i))
        if src not in made:
            made[src] = LayerWeights(**{k: torch.from_numpy(v) if k in ("ssm_a", "ssm_dt") else t(v)
                                        for k, v in w["layers"][src].items()})
        lw = made[src]
        if src != i and "router" in w["layers"][i]:  # its own router, as upf_model_init_seeded_shared
            lw = dataclasses.replace(lw, router=t(w["layers"][i]["router"]))
        layers.append(lw)
    output = t(w["embed"]) if cfg.tied else t(w["output"])
    m = Model(cfg, layers, t(w["embed"]), t(w["final_norm"]), output, shared)
    if cfg.tied:
        m.output = m.embed
    return m.count_bytes()


def run_upf(upf, cfg, batch, dtype_name, shared, tmp):
    """The last-position logits (B, V) f32 of `upf prefill --backend cpu` on batch's ids."""
    import numpy as np
    ids_p, cu_p, out_p = (os.path.join(tmp, f) for f in ("ids.npy", "cu.npy", "logits.npy"))
    np.save(ids_p, batch.ids.numpy().astype("<i4"))
    np.save(cu_p, np.array(batch.cu, dtype="<i4"))
    cmd = [upf, "prefill", "--model", cfg.name, "--backend", "cpu", "--dtype", dtype_name, "--token-ids", ids_p,
           "--cu-seqlens", cu_p, "--out-logits", out_p] + (["--shared-weights"] if shared else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"torch_prefill.py: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[:400]}")
    return torch.from_numpy(np.load(out_p)).float()


def against_upf(args):
    """Runs `UPF prefill --model <tiny> --backend cpu` on ids of two requests and the peer's forward on
    the same seeded weights and ids, distinct and shared weights; compares the last-position logits. f32:
    the peer's timing path and its f32 reference against upf f32 (tol 1e-4). bf16: the timing path against
    upf bf16 (tol 5e-2); on an MoE model bf16 rounding moves near-tied router logits across the top-k
    boundary in either implementation, so there the gate is the peer's bf16 distance from upf f32 against
    upf's own bf16 distance from upf f32 (at most twice it, or 5e-2)."""
    device = "cpu"
    glue = Glue()
    failures = 0
    lengths = [int(x) for x in args.lengths.split(",") if x] if args.lengths_given else [200, 77]
    rel = lambda a, b: (a - b).abs().max().item() / b.abs().max().item()  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="qpeer-") as tmp:
        for key in (FAMILIES if args.model == "all" else [args.model]):
            for shared in (False, True):
                want = {}
                for dtype_name in ("f32", "bf16"):
                    # upf rounds the embed scale to bf16 only in a bf16 model
                    cfg = TINY[key] if not (TINY[key].embed_scale != 1.0 and dtype_name == "f32") else \
                        replace(TINY[key], embed_scale=float(torch.tensor(math.sqrt(TINY[key].hidden)).item()))
                    batch = Batch.make(cfg, lengths, device, seed=7)
                    want[dtype_name] = run_upf(args.against_upf, cfg, batch, dtype_name, shared, tmp)
                    dtype = torch.float32 if dtype_name == "f32" else torch.bfloat16
                    m = seeded_model(cfg, dtype, shared)
                    ops = Ops.make(cfg, device)
                    if ops.moe:
                        ops.moe.setup(dtype)
                    impl = setup_sliding(cfg, ops.attn, device)
                    rows = [("timing path", ops, glue)]
                    if dtype_name == "f32":
                        rows.append(("f32 reference", Ops.make(cfg, device, reference=True), Glue()))
                    for label, o, g in rows:
                        with torch.inference_mode():
                            got = forward(m, batch, g, o)
                        err = rel(got, want[dtype_name])
                        tol, extra = (1e-4 if dtype_name == "f32" else 5e-2), ""
                        if dtype_name == "bf16" and cfg.moe_experts:
                            spread = rel(want["bf16"], want["f32"])
                            err32 = rel(got, want["f32"])
                            tol = max(5e-2, 2 * spread)
                            extra = (f"; vs upf f32 {err32:.2e}, upf bf16 vs upf f32 {spread:.2e} (routing flips); "
                                     f"gate: vs upf f32 < {tol:.2e}")
                            err = err32
                        ok = bool(torch.isfinite(got).all()) and err < tol
                        failures += not ok
                        print(f"{cfg.name:16s} {'shared' if shared else 'distinct':8s} {dtype_name:4s} "
                              f"peer {label:13s} "
                              f"vs upf cpu {dtype_name}: max |diff| / max |logit| = {rel(got, want[dtype_name]):.2e} "
                              f"(max |logit| {want[dtype_name].abs().max().item():.2f}, tol {tol:.0e}, requests "
                              f"{lengths}){extra}{'' if label != 'timing path' else '; ' + describe_ops(o, impl)}  "
                              f"{'ok' if ok else 'FAIL'}", flush=True)
    print(f"{failures} failed")
    sys.exit(1 if failures else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=FAMILIES + ["all"], default="all")
    ap.add_argument("--lengths", default=None, help="tokens per request, comma-separated (default 8192,32768,131072)")
    ap.add_argument("--reqs", type=int, default=1, help="requests of each length in the batch (packed)")
    ap.add_argument("--layers", type=int, default=0, help="time the first N layers only (0: all)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--glue", choices=["compiled", "eager"], default=None,
                    help="the pointwise glue: torch.compile'd (default on the GPU) or eager (default on the CPU)")
    ap.add_argument("--shared-weights", action="store_true",
                    help="the layers of one mixer kind run on the weights of the first layer of that kind")
    ap.add_argument("--out", default="perf/reports/H200/torch_prefill.json")
    ap.add_argument("--check", action="store_true", help="tiny configs, one step, against a reference; no timing")
    ap.add_argument("--against-upf", metavar="UPF", help="tiny configs' logits against `UPF prefill --backend cpu` "
                    "on the same seeded weights (CPU, numpy); no timing")
    ap.add_argument("--tiny", action="store_true", help="time the tiny configs of models/configs.c (testing)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda for timing, cpu for --check)")
    args = ap.parse_args()
    args.lengths_given = args.lengths is not None
    args.lengths = args.lengths or "8192,32768,131072"
    args.device = args.device or ("cpu" if args.check or args.against_upf else "cuda")
    if args.reqs < 1 or args.layers < 0:
        sys.exit("torch_prefill.py: --reqs must be >= 1 and --layers >= 0")
    if args.device not in ("cpu", "cuda"):
        sys.exit(f"torch_prefill.py: --device {args.device}: cpu or cuda")
    with torch.inference_mode():
        if args.against_upf:
            against_upf(args)
        check(args) if args.check else bench(args)


if __name__ == "__main__":
    main()

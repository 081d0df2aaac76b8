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
    the layers of one mixer kind run on the weights of the first layer of that kind, as `upf --shared-weights`:
    stated in the context, in each result and its name);
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
import math
import statistics
import sys
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from peer_common import context, summary, write_report

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
    inter: int                    # I
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

    def kind(self, layer):
        return "full" if (layer + 1) % self.full_interval == 0 else "sliding"

    @property
    def qkv_cols(self):
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim


LLAMA_ROPE = Rope("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
CONFIGS = {
    "llama": Config("llama3.1-8b", 4096, 32, 128256, 32, 8, 128, 14336, "silu", 1e-5, 0.0, False, False, 1, 0,
                    128 ** -0.5, LLAMA_ROPE, LLAMA_ROPE, 1.0, False),
    "gemma": Config("gemma3-12b", 3840, 48, 262208, 16, 8, 256, 15360, "gelu_tanh", 1e-6, 1.0, True, True, 6, 1024,
                    256 ** -0.5, Rope("linear", 1e6, 8.0), Rope("default", 1e4),
                    torch.tensor(3840 ** 0.5, dtype=torch.bfloat16).item(), True),
}
# The tiny configs of models/configs.c (llama-tiny, gemma3-tiny): same sub-layers and pattern.
TINY = {
    "llama": replace(CONFIGS["llama"], name="llama-tiny", hidden=128, layers=6, vocab=512, q_heads=4, kv_heads=2,
                     head_dim=32, inter=256, scale=32 ** -0.5),
    "gemma": replace(CONFIGS["gemma"], name="gemma3-tiny", hidden=128, layers=6, vocab=512, q_heads=4, kv_heads=2,
                     head_dim=32, inter=256, full_interval=3, window=32, scale=32 ** -0.5,
                     embed_scale=torch.tensor(128 ** 0.5, dtype=torch.bfloat16).item()),
}


# ---- RoPE tables ----

def inv_freq(rope, dim):
    """(dim/2) f64, as HF computes it (the llama3 rule included)."""
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
    """x (T, h, D) any strides [-> per-head RMSNorm] -> RoPE rotate-half; (T, h, D) contiguous, x's dtype."""
    if norm:
        x = rmsnorm(x, w, eps, offset)
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def act_mul(gu, act: str):
    """gu (T, 2I) = [gate | up] -> act(gate) * up (T, I)."""
    i = gu.shape[-1] // 2
    g, u = gu[:, :i], gu[:, i:]
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


@dataclass
class Glue:
    rmsnorm: object = rmsnorm
    add_rmsnorm: object = add_rmsnorm
    qk_prep: object = qk_prep
    act_mul: object = act_mul


def compiled_glue():
    for knob in ("cache_size_limit", "recompile_limit"):  # one specialisation per length and head count
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    c = lambda f: torch.compile(f, dynamic=False)  # noqa: E731
    return Glue(c(rmsnorm), c(add_rmsnorm), c(qk_prep), c(act_mul))


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


# ---- Weights and the forward pass ----

@dataclass
class LayerWeights:
    attn_norm: torch.Tensor      # (H)
    qkv: torch.Tensor            # (Hq D + 2 Hkv D, H)  [q | k | v] rows
    q_norm: torch.Tensor         # (D)   qk_norm
    k_norm: torch.Tensor         # (D)   qk_norm
    o: torch.Tensor              # (H, Hq D)
    post_attn_norm: torch.Tensor  # (H)  sandwich
    ffn_norm: torch.Tensor       # (H)
    gate_up: torch.Tensor        # (2I, H)  [gate | up] rows
    down: torch.Tensor           # (H, I)
    post_ffn_norm: torch.Tensor  # (H)   sandwich


def normal(shape, std, gen, device, dtype):
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)


def norm_weight(n, cfg, gen, device, dtype):
    """What the norm multiplies by (Llama) or its offset (Gemma): 1 + small noise, or small noise."""
    return normal((n,), 0.02, gen, device, dtype) + (1.0 - cfg.norm_offset)


def make_layer(cfg, gen, device, dtype):
    H, D, I = cfg.hidden, cfg.head_dim, cfg.inter
    nw = lambda n: norm_weight(n, cfg, gen, device, dtype)  # noqa: E731
    return LayerWeights(
        attn_norm=nw(H), qkv=normal((cfg.qkv_cols, H), H ** -0.5, gen, device, dtype),
        q_norm=nw(D), k_norm=nw(D), o=normal((H, cfg.q_heads * D), (cfg.q_heads * D) ** -0.5, gen, device, dtype),
        post_attn_norm=nw(H), ffn_norm=nw(H), gate_up=normal((2 * I, H), H ** -0.5, gen, device, dtype),
        down=normal((H, I), I ** -0.5, gen, device, dtype), post_ffn_norm=nw(H))


@dataclass
class Model:
    cfg: Config
    layers: list                 # LayerWeights of the layers run
    embed: torch.Tensor          # (V, H)
    final_norm: torch.Tensor     # (H)
    output: torch.Tensor         # (V, H), the embedding when tied
    shared: bool
    weight_bytes: int = 0

    @staticmethod
    def random(cfg, num_layers, shared, device, dtype=torch.bfloat16, seed=0):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        embed = normal((cfg.vocab, cfg.hidden), 1.0 / cfg.embed_scale, gen, device, dtype)
        output = embed if cfg.tied else normal((cfg.vocab, cfg.hidden), cfg.hidden ** -0.5, gen, device, dtype)
        first = make_layer(cfg, gen, device, dtype)
        layers = [first] + [first if shared else make_layer(cfg, gen, device, dtype) for _ in range(num_layers - 1)]
        m = Model(cfg, layers, embed, norm_weight(cfg.hidden, cfg, gen, device, dtype), output, shared)
        seen = {}
        for t in [m.embed, m.output, m.final_norm] + [t for lw in layers for t in vars(lw).values()]:
            seen[id(t)] = t.numel() * t.element_size()
        m.weight_bytes = sum(seen.values())
        return m

    def to(self, dtype):
        """The same weights in another dtype (the f32 reference of --check)."""
        cast = lambda t: t.to(dtype)  # noqa: E731
        return Model(self.cfg, [LayerWeights(**{k: cast(v) for k, v in vars(lw).items()}) for lw in self.layers],
                     cast(self.embed), cast(self.final_norm), cast(self.output), self.shared, self.weight_bytes)


@dataclass
class Batch:
    ids: torch.Tensor            # (T) i64 on the device
    cu: list                     # (B+1) host ints
    rope: dict = field(default_factory=dict)  # kind -> (cos, sin) (T, D/2) f32 at each token's position
    last: torch.Tensor = None    # (B) i64: the packed row of each request's last token

    def __post_init__(self):
        self.last = torch.tensor([e - 1 for e in self.cu[1:]], dtype=torch.int64, device=self.ids.device)

    @staticmethod
    def make(cfg, lengths, device, seed=1):
        gen = torch.Generator().manual_seed(seed)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        ids = torch.randint(0, cfg.vocab, (cu[-1],), generator=gen).to(device)
        pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
        rope = {kind: rope_tables(r, cfg.head_dim, pos, device)
                for kind, r in (("full", cfg.rope_full), ("sliding", cfg.rope_sliding))}
        return Batch(ids, cu, rope)


def attention_block(m, lw, kind, h, batch, glue, attn):
    """h (T, H) normed -> attention output (T, H) after o_proj (and the post-attention norm, Gemma)."""
    c = m.cfg
    T, D, Hq, Hkv = h.shape[0], c.head_dim, c.q_heads, c.kv_heads
    qkv = F.linear(h, lw.qkv)                                    # (T, Nqkv)
    cos, sin = batch.rope[kind]
    q = glue.qk_prep(qkv[:, :Hq * D].view(T, Hq, D), lw.q_norm, cos, sin, c.eps, c.norm_offset, c.qk_norm)
    k = glue.qk_prep(qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), lw.k_norm, cos, sin, c.eps, c.norm_offset,
                     c.qk_norm)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)                  # (T, Hkv, D) view
    call = attn.full if kind == "full" else attn.sliding
    heads = lambda x, s, e: x[s:e].transpose(0, 1).unsqueeze(0)  # noqa: E731  (1, h, t, D)
    if len(batch.cu) == 2:
        o = call(heads(q, 0, T), heads(k, 0, T), heads(v, 0, T))[0].transpose(0, 1)  # (T, Hq, D)
    else:
        o = torch.empty((T, Hq, D), device=h.device, dtype=h.dtype)
        for s, e in zip(batch.cu[:-1], batch.cu[1:]):
            o[s:e] = call(heads(q, s, e), heads(k, s, e), heads(v, s, e))[0].transpose(0, 1)
    del qkv, q, k, v
    a = F.linear(o.reshape(T, Hq * D), lw.o)                     # (T, H)
    return glue.rmsnorm(a, lw.post_attn_norm, c.eps, c.norm_offset) if c.sandwich else a


def ffn_block(m, lw, h, glue):
    """h (T, H) normed -> FFN output (T, H) (and the post-FFN norm, Gemma)."""
    c = m.cfg
    f = glue.act_mul(F.linear(h, lw.gate_up), c.act)             # (T, I)
    f = F.linear(f, lw.down)                                     # (T, H)
    return glue.rmsnorm(f, lw.post_ffn_norm, c.eps, c.norm_offset) if c.sandwich else f


def forward(m, batch, glue, attn, marks=None):
    """Last-position logits (B, V) f32. marks: len(layers) + 3 CUDA events (start, after the embedding
    and first norm, after each layer, end) or None."""
    c = m.cfg
    mark = (lambda i: marks[i].record()) if marks is not None else (lambda i: None)  # noqa: E731
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
            out = None  # free the last FFN output before this layer's attention allocates
        a = attention_block(m, lw, c.kind(i), h, batch, glue, attn)
        residual, h = glue.add_rmsnorm(residual, a, lw.ffn_norm, c.eps, c.norm_offset)
        del a
        out = ffn_block(m, lw, h, glue)
        mark(2 + i)
    x = residual.index_select(0, batch.last) + out.index_select(0, batch.last)  # (B, H): the last add, last rows only
    logits = F.linear(glue.rmsnorm(x, m.final_norm, c.eps, c.norm_offset), m.output).float()
    mark(len(m.layers) + 2)
    return logits


# ---- Counting ----

def attn_pairs(t, window):
    """(query, key) pairs of one request of t tokens: causal, or causal within a window of w keys."""
    if not window or window >= t:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def flops(cfg, num_layers, lengths):
    T, H, D, Hq = sum(lengths), cfg.hidden, cfg.head_dim, cfg.q_heads
    dense = 2.0 * T * (H * cfg.qkv_cols + Hq * D * H + 3 * H * cfg.inter)
    total = 2.0 * len(lengths) * H * cfg.vocab
    for i in range(num_layers):
        w = 0 if cfg.kind(i) == "full" else cfg.window
        total += dense + 4.0 * D * Hq * sum(attn_pairs(t, w) for t in lengths)
    return total


# ---- Timing ----

def time_case(m, batch, glue, attn, iters, warmup):
    """Per timed iteration: the seconds of each segment between the marks of `forward`."""
    for _ in range(warmup):
        forward(m, batch, glue, attn)
    torch.cuda.synchronize()
    runs = []
    for _ in range(iters):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(m.layers) + 3)]
        forward(m, batch, glue, attn, marks)
        marks[-1].synchronize()
        runs.append([marks[i].elapsed_time(marks[i + 1]) * 1e-3 for i in range(len(marks) - 1)])
    return runs


def layer_summary(cfg, runs):
    """Medians: pre (embedding + first norm), each layer, post (last add, final norm, head), per kind;
    and the whole-model estimate from them."""
    n = len(runs[0]) - 2
    med = [statistics.median(r[j] for r in runs) for j in range(n + 2)]
    pre, layer_s, post = med[0], med[1:n + 1], med[n + 1]
    kinds = {}
    for i in range(n):
        kinds.setdefault(cfg.kind(i), []).append(layer_s[i])
    per_kind = {k: statistics.median(v) for k, v in kinds.items()}
    counts = {}
    for i in range(cfg.layers):
        counts[cfg.kind(i)] = counts.get(cfg.kind(i), 0) + 1
    if all(k in per_kind for k in counts):
        model_s = pre + post + sum(per_kind[k] * counts[k] for k in counts)
    else:
        model_s = None
    return {"pre_s": pre, "post_s": post, "layer_s": layer_s, "per_layer_s": per_kind,
            "model_layer_counts": counts, "ttft_model_s": model_s}


def run_case(cfg, m, glue, attn, T, B, args):
    lengths = [T] * B
    batch = Batch.make(cfg, lengths, "cuda")
    name = f"model.prefill/torch/bf16/{cfg.name}/B:{B}/T:{T}"
    if len(m.layers) < cfg.layers:
        name += f"/layers:{len(m.layers)}"
    res = {"name": name, "model": cfg.name, "B": B, "T": T, "tokens": B * T,
           "layers_timed": len(m.layers), "layers_model": cfg.layers}
    torch.cuda.reset_peak_memory_stats()
    if any(cfg.kind(i) == "full" for i in range(len(m.layers))):
        res.update(attn.probe(T))
    if any(cfg.kind(i) == "sliding" for i in range(len(m.layers))):
        res["sliding_impl"] = attn.flex_impl
    iters, warmup = (max(3, args.iters // 2), 1) if B * T >= LONG_T else (args.iters, args.warmup)
    runs = time_case(m, batch, glue, attn, iters, warmup)
    res.update(summary([sum(r) for r in runs], flops(cfg, len(m.layers), lengths)))
    ls = layer_summary(cfg, runs)
    res.update(ls)
    res["extrapolated"] = len(m.layers) < cfg.layers
    res["peak_bytes"] = torch.cuda.max_memory_allocated()
    res["activation_peak_bytes"] = res["peak_bytes"] - m.weight_bytes
    per = "  ".join(f"{k} {v * 1e3:.2f} ms/layer" for k, v in ls["per_layer_s"].items())
    model = "n/a" if ls["ttft_model_s"] is None else f"{ls['ttft_model_s'] * 1e3:.1f} ms"
    print(f"{name:60s} {res['median_s'] * 1e3:10.1f} ms (min {res['min_s'] * 1e3:.1f}, cv {res['cv']:.3f}) "
          f"{res['tflop_per_second']:6.1f} TFLOP/s  {per}  model {model}"
          f"{' (extrapolated)' if res['extrapolated'] else ''}  sdpa {res.get('sdpa_backend', '-')}  "
          f"peak {res['peak_bytes'] / 2**30:.1f} GiB", flush=True)
    attn.masks.clear()
    return res


def bench(args):
    if not torch.cuda.is_available():
        sys.exit("torch_prefill.py: no CUDA device visible to torch (use --check for the CPU)")
    glue_mode = args.glue or "compiled"
    glue = compiled_glue() if glue_mode == "compiled" else Glue()
    notes = [
        "attention per request when B > 1 (SDPA / flex take no packed varlen input); projections packed",
        "buffers: intermediates are freed at the end of each block and PyTorch's caching allocator reuses "
        "them (no explicit out= buffers); peak_bytes is torch.cuda.max_memory_allocated, weights included",
        "outside the timed region: RoPE cos/sin tables, flex block masks, compilation (warm-up), SDPA probe",
        "ttft_model_s extrapolates from per-kind medians when layers_timed < layers_model (extrapolated: true)",
    ]
    report = {"context": context({
        "peer": "torch_prefill", "glue": glue_mode, "dtype": "bf16", "cudnn": torch.backends.cudnn.version(),
        "weights": "shared: every layer reuses layer 0's weights" if args.shared_weights
        else "distinct random weights per layer", "notes": notes}), "results": []}
    models = ["llama", "gemma"] if args.model == "all" else [args.model]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    for key in models:
        cfg = CONFIGS[key]
        n = min(args.layers or cfg.layers, cfg.layers)
        m = Model.random(cfg, n, args.shared_weights, "cuda")
        print(f"{cfg.name}: {n} of {cfg.layers} layers, weights {m.weight_bytes / 2**30:.2f} GiB"
              f" ({'shared' if m.shared else 'distinct'}), glue {glue_mode}", flush=True)
        attn = Attention(cfg, "cuda")
        attn.setup_flex(compiled=True)
        for T in lengths:
            try:
                res = run_case(cfg, m, glue, attn, T, args.reqs, args)
            except Exception as e:  # noqa: BLE001 - out of memory, a backend refusing: record, go on
                res = {"name": f"model.prefill/torch/bf16/{cfg.name}/B:{args.reqs}/T:{T}",
                       "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
                print(f"{res['name']:60s} not run: {res['error']}", flush=True)
                attn.masks.clear()
                torch.cuda.empty_cache()
            res["weight_bytes"] = m.weight_bytes
            report["results"].append(res)
        del m, attn
        torch.cuda.empty_cache()
    write_report(report, args.out)


# ---- --check: tiny configs, one step, against an explicit-mask f32 reference ----

def check(args):
    device = args.device
    torch.manual_seed(0)
    glue_mode = args.glue or "eager"
    glue = compiled_glue() if glue_mode == "compiled" else Glue()
    passed = failures = 0
    for key in (["llama", "gemma"] if args.model == "all" else [args.model]):
        cfg = TINY[key]
        m = Model.random(cfg, cfg.layers, False, device)
        ref_m = m.to(torch.float32)
        attn = Attention(cfg, device)
        if device == "cuda":
            attn.probe(256)
        impl = None if any(cfg.kind(i) == "sliding" for i in range(cfg.layers)) else "n/a (no sliding layers)"
        # compiled flex may not run on the CPU: then eager flex, then the explicit mask
        for compiled in ((True, False) if impl is None else ()):
            attn.setup_flex(compiled)
            try:
                attn.sliding(*[torch.randn((1, h, 160, cfg.head_dim), device=device, dtype=torch.bfloat16)
                               for h in (cfg.q_heads, cfg.kv_heads, cfg.kv_heads)])
                impl = attn.flex_impl
                break
            except Exception as e:  # noqa: BLE001 - report which path the check exercised
                print(f"{cfg.name}: {attn.flex_impl} did not run here: {type(e).__name__}: {str(e)[:160]}")
                attn.masks.clear()
        if impl is None:
            attn.flex, impl = None, "explicit mask (flex_attention did not run here)"
        ref_attn = Attention(cfg, device, reference=True)
        lengths = [256, 160]
        both = Batch.make(cfg, lengths, device)
        with torch.inference_mode():
            got = forward(m, both, glue, attn)
            want = forward(ref_m, both, Glue(), ref_attn)
            alone = [forward(m, Batch(both.ids[s:e], [0, e - s],
                                      {k: (c[s:e], sn[s:e]) for k, (c, sn) in both.rope.items()}), glue, attn)
                     for s, e in zip(both.cu[:-1], both.cu[1:])]
        scale = want.abs().max().item()
        err = (got - want).abs().max().item() / scale
        err_b = max((a[0] - got[r]).abs().max().item() for r, a in enumerate(alone)) / scale
        finite = bool(torch.isfinite(got).all())
        ok = finite and got.shape == (len(lengths), cfg.vocab) and err < 5e-2 and err_b < 2e-2
        passed, failures = passed + ok, failures + (not ok)
        print(f"{cfg.name}: logits {tuple(got.shape)} finite {finite}; bf16 vs f32 explicit-mask reference "
              f"max err {err:.2e} (of max |logit| {scale:.2f}, tol 5e-2); batch of {lengths} vs alone "
              f"{err_b:.2e} (tol 2e-2); sliding {impl}; glue {glue_mode}; "
              f"sdpa {attn.sdpa_mode[0].name if attn.sdpa_mode[0] else 'default'}/{attn.sdpa_mode[1]}  "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    print(f"{passed} passed, {failures} failed")
    sys.exit(1 if failures else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["llama", "gemma", "all"], default="all")
    ap.add_argument("--lengths", default="8192,32768,131072", help="tokens per request, comma-separated")
    ap.add_argument("--reqs", type=int, default=1, help="requests of each length in the batch (packed)")
    ap.add_argument("--layers", type=int, default=0, help="time the first N layers only (0: all)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--glue", choices=["compiled", "eager"], default=None,
                    help="the pointwise glue: torch.compile'd (default) or eager (default of --check)")
    ap.add_argument("--shared-weights", action="store_true", help="every layer reuses layer 0's weights")
    ap.add_argument("--out", default="perf/reports/H200/torch_prefill.json")
    ap.add_argument("--check", action="store_true", help="tiny configs, one step, against a reference; no timing")
    ap.add_argument("--device", default="cpu", help="--check only: cpu or cuda")
    args = ap.parse_args()
    if args.reqs < 1 or args.layers < 0:
        sys.exit("torch_prefill.py: --reqs must be >= 1 and --layers >= 0")
    with torch.inference_mode():
        check(args) if args.check else bench(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The MoE peer of perf/bench_moe.c (issue 26): vLLM's published Triton `fused_moe_kernel` running
Qwen3-Next-80B-A3B's MoE layer (H 2048, E 512, top-10 renormalised, I 512, a shared expert of 512 with a
sigmoid gate), bf16, at T = 8K and 32K, timed with CUDA events over the same span as our moe.ffn
benchmark (backend->moe_ffn: router GEMM, routing, permutation, expert GEMMs, SwiGLU, combine, shared
expert), written as JSON under OUR benchmark ids ("moe.ffn/cuda/bf16/T:8192"). Runs on the GPU machine;
`--self-test` runs anywhere under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).

The published code is never copied here: it is read from a git-ignored folder, .peers/vllm/fused_moe.py
(--published PATH), with its tuned configs in configs/ beside it; .peers/vllm/FETCH.md says which
release, which files and their sha256 (vLLM 0.34.0 from PyPI: pip download, unzip). vLLM's module imports
much of vllm (platforms, envs, logger, custom ops, the modular-kernel classes), so this script does not
import it: it parses the file and executes only these of its top-level functions, compiled under the
file's own name and line numbers (Triton's @jit reads a kernel's source back from the file):
  write_zeros_to_output, fused_moe_kernel   the Triton kernel (and its helper), unchanged
  invoke_fused_moe_triton_kernel            vLLM's launcher (grid, EM, strides, config handling)
  get_config_file_name, get_moe_configs, get_default_config
                                            how vLLM picks the tile config for a shape and device
Stubbed, in the namespace those functions run in (vLLM's values for a bf16 layer on CUDA):
  envs                 VLLM_BATCH_INVARIANT False, VLLM_TRITON_USE_TD None, VLLM_TUNED_CONFIG_FOLDER None
  current_platform     CUDA (torch.cuda), not ROCm, not XPU; the device's name and capability
  resolve_moe_use_td   False (vLLM: the tensor-descriptor path only on XPU unless the env forces it)
  warn_if_moe_use_td_ineffective  no-op (it returns at once while VLLM_TRITON_USE_TD is unset)
  enable_swap_ab       vLLM's rule (sm90, BLOCK_M < 64, BLOCK_N >= 64); consulted for fp8 only
  get_device_name_as_file_name    vLLM's rule: the device name with blanks and '/' as '_'
  logger, next_power_of_2, set_triton_allocator (never reached for bf16: raises if it were)
The tuned config is the entry of configs/E=512,N=512,device_name=<GPU>.json nearest to T (vLLM's
_get_configured_moe_config, two lines repeated here), else get_default_config's choice; the output says
which. The same config serves both expert GEMMs, as fused_experts_impl does.

The harness (ours, not the peer's kernel), in the order fused_experts_impl and Qwen3-Next's MoE block run:
  route     logits = x [router | shared_gate]^T in f32 (torch.mm out_dtype; one GEMM gives the router's
            E logits and the shared expert's gate logit), softmax, top-10, renormalised (vLLM: its
            topk_softmax CUDA op; here torch)
  align     vLLM's moe_align_block_size (a CUDA custom op) in plain torch, with no host sync: the
            (token, rank) pairs grouped by expert (stable), each expert padded to BLOCK_SIZE_M with the
            sentinel T*K, one expert id per block (-1 past the end), num_tokens_post_padded
  w1        fused_moe_kernel: cache1 (T, K, 2I) = x[token] . w1[e]^T per pair
  act       silu(gate) * up, f32 inside, one pass (our Triton kernel, as vLLM's silu_and_mul CUDA op)
  w2        fused_moe_kernel with MUL_ROUTED_WEIGHT: cache3 (T, K, H) = w_k . a . w2[e]^T
  moe_sum   cache3 summed over K (vLLM's moe_sum CUDA op; here torch.sum, f32 accumulation, bf16 out)
  shared    F.linear gate_up, act, F.linear down, out = routed + sigmoid(gate) * shared (torch.addcmul)
Weights and x: random normals at the scales of verify/moe_inputs.c (x N(0,1), router and gate_up
1/sqrt(H), down 1/sqrt(I)); bf16.

Correctness before timing: each distinct tile config is first run on --check-tokens tokens and compared
with a float64 reference of the same layer (per-expert loop, the intermediates rounded to bf16 where
uniprefill/moe.h stores them): the routing by token (a differing top-10 set passes only where the
choice is marginal, within relative 1e-3 of the probability it dropped: verify's rule), then the
outputs of the agreeing tokens within SPEC section 7's bf16 tolerance (nmse <= 5e-4 and
|a - r| <= 1e-2 + 1.6e-2 |r|). A config that fails is not timed (its result carries "error").
Reported per T: median, min and spread of the layer (peer_common.summary; FLOPs as upf_moe_flops), and
from a second, event-instrumented loop the median of each stage above and the two fused_moe_kernel
launches' share of the layer.

Usage:
  python3 perf/peers/vllm_moe.py [--out perf/reports/H200/vllm_moe.json] [--tokens 8192,32768]
                                 [--iters 20] [--warmup 5] [--check-tokens 8192] [--published PATH]
  python3 perf/peers/vllm_moe.py --self-test [--published PATH]     (CPU, Triton interpreter)
The self-test: the alignment against a hand-worked case and invariants, the act kernel, then the layer
against the reference under three tile configs (vLLM's default for the small shape, small tiles, the
H200 tuned entry the device uses at 8K/32K) and a corrupted expert that must fail. It runs the layer in
fp16, not bf16: the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584), and it
needs Triton 3.9's interpreter (3.6's stops at the kernel's K loop); on the GPU Triton 3.6 compiles it.
On the device machine, carry .peers (the fetched files) with the working tree.
"""
import argparse
import ast
import functools
import hashlib
import json
import os
import re
import statistics
import sys
import types

if "--self-test" in sys.argv:
    # Triton reads this when a kernel is decorated: before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
PUBLISHED_NAME = os.path.join(".peers", "vllm", "fused_moe.py")
PUBLISHED_FUNCS = ("write_zeros_to_output", "fused_moe_kernel", "invoke_fused_moe_triton_kernel",
                   "get_config_file_name", "get_moe_configs", "get_default_config")
PEER_NAME = "vLLM fused_moe (Triton)"

# SPEC section 7 (bf16 inputs) and verify/moe_checks.c's marginal-routing tau for bf16
RTOL, ATOL, NMSE_MAX, ROUTE_TAU = 1.6e-2, 1e-2, 5e-4, 1e-3


class MoeConfig(types.SimpleNamespace):
    """hidden H, experts E, top_k K, inter I, shared_inter Is (0: none), norm_topk."""


QWEN3_NEXT = MoeConfig(hidden=2048, experts=512, top_k=10, inter=512, shared_inter=512, norm_topk=True)
SELF_TEST = MoeConfig(hidden=64, experts=8, top_k=2, inter=32, shared_inter=32, norm_topk=True)


def moe_flops(c, T):
    """upf_moe_flops: router 2THE, routed 2TK(3IH), shared 2T(3 Is H) + its gate 2TH."""
    f = 2.0 * T * c.hidden * c.experts + 2.0 * T * c.top_k * 3 * c.inter * c.hidden
    if c.shared_inter:
        f += 2.0 * T * 3 * c.shared_inter * c.hidden + 2.0 * T * c.hidden
    return f


# ---------------------------------------------------------------------------- the published code

class _Logger:
    """vLLM's logger, for the few calls the executed functions make: to stderr."""

    def _say(self, msg, *args, **_):
        print("vllm: " + (msg % args if args else msg), file=sys.stderr)

    info = info_once = warning = warning_once = debug = _say


class _Platform:
    """vllm.platforms.current_platform as seen on a CUDA machine (or the interpreter's CPU)."""

    def is_cuda(self):
        return torch.cuda.is_available()

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id)

    def _cap(self):
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)

    def is_device_capability(self, cap):
        major, minor = self._cap()
        return major * 10 + minor == cap

    def is_device_capability_family(self, cap):
        return self._cap()[0] * 10 == cap // 10 * 10

    def fp8_dtype(self):
        return torch.float8_e4m3fn


def _no_allocator(*_args, **_kwargs):
    raise RuntimeError("vllm_moe.py: set_triton_allocator reached (a TMA/TD path this bf16 peer does not take)")


def published_paths(arg):
    """Candidates for the fetched fused_moe.py: --published, else .peers/vllm under the checkout
    that holds this script, else under the working directory."""
    if arg:
        return [arg]
    return [os.path.normpath(os.path.join(HERE, "..", "..", PUBLISHED_NAME)), os.path.abspath(PUBLISHED_NAME)]


def load_published(arg):
    """(namespace with PUBLISHED_FUNCS executed from the file, its path, its sha256)."""
    path = next((p for p in published_paths(arg) if os.path.isfile(p)), None)
    if path is None:
        sys.exit(f"vllm_moe.py: no published fused_moe.py at {' or '.join(published_paths(arg))} "
                 "(fetch it as .peers/vllm/FETCH.md says, or pass --published PATH)")
    raw = open(path, "rb").read()
    try:
        tree = ast.parse(raw.decode(), filename=path)
    except (SyntaxError, UnicodeDecodeError) as e:
        sys.exit(f"vllm_moe.py: {path}: not Python source ({e})")
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in PUBLISHED_FUNCS}
    missing = [n for n in PUBLISHED_FUNCS if n not in found]
    if missing:
        sys.exit(f"vllm_moe.py: {path} defines no top-level {', '.join(missing)} (another vLLM layout?)")
    envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TRITON_USE_TD=None, VLLM_TUNED_CONFIG_FOLDER=None)
    platform = _Platform()
    ns = {
        "__name__": "vllm_published_fused_moe", "__file__": path,
        "functools": functools, "json": json, "os": os, "Any": object, "torch": torch, "triton": triton, "tl": tl,
        "envs": envs, "logger": _Logger(), "current_platform": platform,
        "resolve_moe_use_td": lambda: False,
        "warn_if_moe_use_td_ineffective": lambda *a, **k: None,
        "enable_swap_ab": lambda m, n: platform.is_device_capability(90) and m < 64 and n >= 64,
        "get_device_name_as_file_name": lambda device_id=0: re.sub(r"[\s/]+", "_",
                                                                   platform.get_device_name(device_id)),
        "next_power_of_2": lambda n: 1 if n <= 1 else 1 << (n - 1).bit_length(),
        "set_triton_allocator": _no_allocator,
    }
    body = sorted((found[n] for n in PUBLISHED_FUNCS), key=lambda n: n.lineno)
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)  # noqa: S102 - the fetched peer
    return ns, path, hashlib.sha256(raw).hexdigest()


def fetch_note(path):
    """The 'Source:' line of FETCH.md beside the published file, or ''."""
    try:
        with open(os.path.join(os.path.dirname(path), "FETCH.md")) as f:
            return next((ln[len("Source:"):].strip() for ln in f if ln.startswith("Source:")), "")
    except OSError:
        return ""


def pick_config(pub, c, M):
    """(config, where it came from) as fused_experts_impl picks it for M tokens: the tuned file's entry
    nearest M, else vLLM's default heuristic."""
    tuned = pub["get_moe_configs"](c.experts, c.inter, None) if torch.cuda.is_available() else None
    if tuned:
        key = min(tuned.keys(), key=lambda k: abs(k - M))
        name = pub["get_config_file_name"](c.experts, c.inter, None)
        return dict(tuned[key]), f"tuned: configs/{name} entry {key}"
    cfg = pub["get_default_config"](M, c.experts, c.inter, c.hidden, c.top_k, None)
    return dict(cfg), "default: get_default_config (no tuned file for this device)"


# ---------------------------------------------------------------------------- the harness

@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """out (rows, n) = silu(x[:, :n]) * x[:, n:], f32 inside, rounded once; x (rows, 2n)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x, out):
    rows, n = out.shape
    block = min(1024, triton.next_power_of_2(n))
    silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out


def align_block_size(topk_ids, block_m, num_experts):
    """vLLM's moe_align_block_size in torch, without a host sync. topk_ids (T, K) int.
    Returns sorted_ids (P,) int32: pair indices t*K+k grouped by expert (ascending pair within one),
    each expert's run padded to a multiple of block_m with the sentinel T*K; expert_ids (P/block_m,)
    int32, the expert of each block (-1 past the last); num_tokens_post_padded (1,) int32.
    P = T*K + E*(block_m-1) (at most T*K*block_m when T*K < E), vLLM's bound."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    max_padded = n + num_experts * (block_m - 1)
    if n < num_experts:
        max_padded = min(n * block_m, max_padded)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    first = torch.cumsum(counts, 0) - counts             # each expert's first place among the n pairs
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = pad_start[expert] + torch.arange(n, device=dev) - first[expert]
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


def router_logits(x, w_rg, how):
    """(T, E+1) f32 logits of bf16 x and weights; `how` records whether the product stayed f32."""
    if x.is_cuda:
        try:
            out = torch.mm(x, w_rg.t(), out_dtype=torch.float32)
            how.setdefault("router_logits", "f32 (torch.mm out_dtype)")
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            how["router_logits"] = "bf16, widened to f32 (this torch has no mm out_dtype)"
            return torch.mm(x, w_rg.t()).float()
    how.setdefault("router_logits", "f32 (CPU: f32 product of the 16-bit values)")
    return x.float() @ w_rg.float().t()


def _nomark(_stage):
    pass


COMPUTE_TYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def peer_forward(pub, x, w, c, config, how, mark=_nomark):
    """The layer: out (T, H) in x's dtype and the top-K expert ids (T, K). mark(stage) after each stage."""
    T, E, K, I, H = x.shape[0], c.experts, c.top_k, c.inter, c.hidden
    logits = router_logits(x, w["router_gate"], how)
    probs = torch.softmax(logits[:, :E], dim=-1)
    topk_w, topk_ids = torch.topk(probs, K, dim=-1)
    if c.norm_topk:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    topk_ids = topk_ids.to(torch.int32)
    mark("route")
    sorted_ids, expert_ids, post_padded = align_block_size(topk_ids, config["BLOCK_SIZE_M"], E)
    mark("align")
    cache1 = torch.empty((T, K, 2 * I), dtype=x.dtype, device=x.device)
    cache2 = torch.empty((T * K, I), dtype=x.dtype, device=x.device)
    cache3 = torch.empty((T, K, H), dtype=x.dtype, device=x.device)
    launch = pub["invoke_fused_moe_triton_kernel"]
    flags = dict(compute_type=COMPUTE_TYPE[x.dtype], use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=False, per_channel_quant=False)
    launch(x, w["w1"], cache1, None, None, topk_w, sorted_ids, expert_ids, post_padded, False, K, config, **flags)
    mark("fused_moe_w1")
    silu_mul(cache1.view(T * K, 2 * I), cache2)
    mark("act")
    launch(cache2, w["w2"], cache3, None, None, topk_w, sorted_ids, expert_ids, post_padded, True, 1, config, **flags)
    mark("fused_moe_w2")
    out = cache3.sum(dim=1)
    mark("moe_sum")
    if c.shared_inter:
        hs = F.linear(x, w["shared_gate_up"])
        a = silu_mul(hs, torch.empty((T, c.shared_inter), dtype=x.dtype, device=x.device))
        out = torch.addcmul(out, torch.sigmoid(logits[:, E:]).to(x.dtype), F.linear(a, w["shared_down"]))
    mark("shared")
    return out, topk_ids


def make_weights(c, device, dtype=torch.bfloat16, seed=0):
    """Random weights at verify/moe_inputs.c's scales; the shared gate rides as router row E."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal(shape, std):
        t = torch.randn(shape, generator=g, dtype=torch.float32) if device == "cpu" else \
            torch.randn(shape, device=device, dtype=torch.float32)
        return (t * std).to(dtype).to(device)

    H, E, I, Is = c.hidden, c.experts, c.inter, c.shared_inter
    w = {"router_gate": normal((E + (1 if Is else 0), H), H ** -0.5),
         "w1": normal((E, 2 * I, H), H ** -0.5), "w2": normal((E, H, I), I ** -0.5)}
    if Is:
        w["shared_gate_up"] = normal((2 * Is, H), H ** -0.5)
        w["shared_down"] = normal((H, Is), Is ** -0.5)
    return w


def reference(x, w, c, dt=torch.float64):
    """The layer in `dt`, expert by expert, with the stored intermediates rounded to x's dtype as
    uniprefill/moe.h says: (out (T, H), probs (T, E), topk ids (T, K))."""
    def r(t):
        return t.to(x.dtype).to(dt)

    E, K, I, Is = c.experts, c.top_k, c.inter, c.shared_inter
    xf, wr = x.to(dt), w["router_gate"].to(dt)
    logits = xf @ wr.t()
    probs = torch.softmax(logits[:, :E], dim=-1)
    topk_w, topk_ids = torch.topk(probs, K, dim=-1)
    if c.norm_topk:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    out = torch.zeros((x.shape[0], c.hidden), dtype=dt, device=x.device)
    for e in range(E):
        tok, rank = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = r(xf[tok] @ w["w1"][e].to(dt).t())
        a = r(F.silu(gu[:, :I]) * gu[:, I:])
        y = r(a @ w["w2"][e].to(dt).t())
        out.index_add_(0, tok, y * topk_w[tok, rank][:, None])
    if Is:
        gu = r(xf @ w["shared_gate_up"].to(dt).t())
        a = r(F.silu(gu[:, :Is]) * gu[:, Is:])
        out += torch.sigmoid(logits[:, E:]) * r(a @ w["shared_down"].to(dt).t())
    return out, probs, topk_ids


def compare(out, ids, ref_out, ref_probs, ref_ids):
    """verify's contract for the layer: routing per token (marginal differences allowed and left out of
    the output comparison), then the agreeing tokens' outputs within the bf16 tolerance."""
    T, E = ref_probs.shape
    ids, ref_ids = ids.long().cpu(), ref_ids.long().cpu()
    probs = ref_probs.cpu()
    same = (ids.sort(dim=-1).values == ref_ids.sort(dim=-1).values).all(dim=-1)
    marginal, why = 0, ""
    for t in (~same).nonzero().flatten().tolist():
        got, want = set(ids[t].tolist()), set(ref_ids[t].tolist())
        if len(got) != ids.shape[1] or not all(0 <= e < E for e in got):
            why = why or f"token {t}: experts {sorted(got)} out of range or chosen twice"
            continue
        dropped = max(probs[t, e].item() for e in want - got)
        added = min(probs[t, e].item() for e in got - want)
        if dropped - added <= ROUTE_TAU * dropped:
            marginal += 1
        else:
            why = why or (f"token {t}: chose {sorted(got - want)} over {sorted(want - got)} "
                          f"(p {added:.3g} < {dropped:.3g})")
    res = {"tokens": T, "routing_same": int(same.sum()), "routing_marginal": marginal}
    a = out.cpu()[same].double()
    ref = ref_out.cpu()[same].double()
    if not torch.isfinite(a).all():
        why = why or "NaN/Inf in the peer's output"
    elif a.numel():
        err = (a - ref).abs()
        res["nmse"] = float((err ** 2).sum() / (ref ** 2).sum().clamp_min(1e-300))
        ratio = err / (ATOL + RTOL * ref.abs())
        res["budget"] = float(ratio.max())
        if res["nmse"] > NMSE_MAX:
            why = why or f"nmse {res['nmse']:.3g} > {NMSE_MAX}"
        elif res["budget"] > 1.0:
            why = why or f"worst element {res['budget']:.3g} of its budget ({ATOL} + {RTOL} |r|)"
    else:
        why = why or "no token routed alike"
    res["passed"] = not why
    if why:
        res["detail"] = why
    return res


def check(pub, x, w, c, config, how, w_ref=None):
    """The peer on weights w against the reference on w_ref (default w)."""
    out, ids = peer_forward(pub, x, w, c, config, how)
    ref_out, probs, ref_ids = reference(x, w if w_ref is None else w_ref, c)
    return compare(out, ids, ref_out, probs, ref_ids)


# ---------------------------------------------------------------------------- self-test (CPU)

def self_test(args):
    """Triton's interpreter on CPU tensors: the alignment on a hand-computed case, the layer against the
    reference with vLLM's default config and with the tuned config the device uses at 8K/32K, and a
    corrupted expert that the check must catch."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("vllm_moe.py --self-test: needs TRITON_INTERPRET=1 (set before triton loads)")
    failures = 0

    def report(name, ok, detail=""):
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    # Hand-computed: T=3, K=2, E=4, BLOCK_M=2. Pairs p=t*K+k hold experts [2,0, 2,1, 0,2]: expert 0 has
    # pairs 1,4; expert 1 pair 3 (+1 pad); expert 2 pairs 0,2,5 (+1 pad); expert 3 none. Sentinel 6.
    s, e, n = align_block_size(torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32), 2, 4)
    want = ([1, 4, 3, 6, 0, 2, 5, 6, 6, 6], [0, 1, 2, 2, -1], [8])
    report("align_block_size hand case", (s.tolist(), e.tolist(), n.tolist()) == want,
           f"got {s.tolist()} {e.tolist()} {n.tolist()}")
    # Every pair exactly once, each block one expert, on a random routing.
    ids = torch.stack([torch.randperm(16)[:3] for _ in range(37)]).to(torch.int32)
    s, e, n = align_block_size(ids, 4, 16)
    valid = s[s < ids.numel()]
    blocks_ok = all(ids.reshape(-1)[s[b * 4:(b + 1) * 4][s[b * 4:(b + 1) * 4] < ids.numel()].long()].eq(e[b]).all()
                    for b in range(int(n) // 4))
    report("align_block_size invariants", sorted(valid.tolist()) == list(range(ids.numel())) and blocks_ok
           and int(n) % 4 == 0 and bool((e[int(n) // 4:] == -1).all()))

    # The harness's own kernel on bf16 input: f32 output to f32 accuracy; bf16 output within one bf16 ulp
    # (the interpreter truncates f32 -> bf16 where the GPU rounds to nearest even).
    xb = torch.randn((7, 2 * 48)).to(torch.bfloat16)
    want = F.silu(xb[:, :48].float()) * xb[:, 48:].float()
    got32 = silu_mul(xb, torch.empty((7, 48), dtype=torch.float32))
    got16 = silu_mul(xb, torch.empty((7, 48), dtype=torch.bfloat16)).float()
    err32 = float(((got32 - want).abs() / (want.abs() + 1e-6)).max())
    err16 = float(((got16 - want).abs() / want.abs().clamp_min(1e-30)).max())
    report("silu_mul on bf16 input", err32 < 1e-5 and err16 <= 2.0 ** -7,
           f"relative error {err32:.2g} (f32 out), {err16:.2g} (bf16 out, 1 ulp = {2.0 ** -7:.2g})")

    pub, path, digest = load_published(args.published)
    print(f"published: {path} sha256 {digest[:16]}...", flush=True)
    c, T = SELF_TEST, 200  # 50 pairs an expert: several blocks of 16 or 32 each
    torch.manual_seed(0)
    # The layer in fp16: Triton's interpreter multiplies bf16 bit patterns in tl.dot (it keeps bf16 as
    # uint16; triton-lang/triton#11584, "not supported yet"). The kernel's code path is the same but for
    # compute_type; the device's check runs it in bf16.
    x = torch.randn((T, c.hidden)).to(torch.float16)
    w = make_weights(c, "cpu", dtype=torch.float16)
    how = {}
    default, source = pick_config(pub, c, T)
    small = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 4, "num_warps": 4,
             "num_stages": 2}  # experts over several M blocks, the grouped pid order, a K loop of 2
    configs = [("default " + json.dumps(default), default), ("small tiles " + json.dumps(small), small)]
    tuned = os.path.join(os.path.dirname(path), "configs", "E=512,N=512,device_name=NVIDIA_H200.json")
    if os.path.isfile(tuned):
        with open(tuned) as f:
            entry = json.load(f)["4096"]  # the H200 entry nearest T = 8K and 32K
        configs.append(("tuned H200 entry 4096 " + json.dumps(entry), dict(entry)))
    for name, config in configs:
        res = check(pub, x, w, c, config, how)
        report(f"layer vs float64 reference, {name}", res["passed"], ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items() if k != "passed"))
    bad = dict(w, w2=w["w2"].clone())
    bad["w2"][1] = w["w2"][2]  # expert 1 computes with expert 2's down projection
    res = check(pub, x, bad, c, default, how, w_ref=w)
    report("a corrupted expert fails the check", not res["passed"], res.get("detail", "it passed"))
    print(f"router logits: {how.get('router_logits')}; config source off the device: {source}")
    print(f"{failures} failed" if failures else "self-test passed")
    return 1 if failures else 0


# ---------------------------------------------------------------------------- device run

def stage_medians(pub, x, w, c, config, how, iters):
    """Median ms of each stage over `iters` runs, from events recorded between the stages."""
    per = {}
    for _ in range(iters):
        events = []

        def mark(stage):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append((stage, ev))

        mark("start")
        peer_forward(pub, x, w, c, config, how, mark)
        events[-1][1].synchronize()
        for (_, a), (stage, b) in zip(events, events[1:]):
            per.setdefault(stage, []).append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in per.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/reports/H200/vllm_moe.json")
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check-tokens", type=int, default=8192,
                    help="tokens of the check before timing (8192: 160 pairs an expert, two blocks of 128)")
    ap.add_argument("--published", help="vLLM's fused_moe.py (default: .peers/vllm/fused_moe.py of the checkout)")
    ap.add_argument("--self-test", action="store_true", help="CPU check under Triton's interpreter, then exit")
    args = ap.parse_args()
    if args.self_test:
        sys.exit(self_test(args))
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        sys.exit(f"vllm_moe.py: --tokens {args.tokens}: not a list of integers")
    if not tokens or min(tokens) < 1 or args.check_tokens < 1 or args.iters < 1 or args.warmup < 0:
        sys.exit("vllm_moe.py: --tokens, --check-tokens and --iters must be positive, --warmup >= 0")
    if not torch.cuda.is_available():
        sys.exit("vllm_moe.py: no CUDA device visible to torch (off the device: --self-test)")
    from peer_common import context, summary, time_it, write_report

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # fp32 accumulation, as ours
    pub, path, digest = load_published(args.published)
    c = QWEN3_NEXT
    torch.manual_seed(0)
    w = make_weights(c, "cuda")
    x_all = torch.randn((max(max(tokens), args.check_tokens), c.hidden), device="cuda").to(torch.bfloat16)
    how, checked = {}, {}
    report = {"peer": PEER_NAME, "results": []}
    for T in tokens:
        config, source = pick_config(pub, c, T)
        key = json.dumps(config, sort_keys=True)
        if key not in checked:
            checked[key] = check(pub, x_all[:args.check_tokens], w, c, config, how)
            print(f"check, {args.check_tokens} tokens, {key}: "
                  f"{'passed' if checked[key]['passed'] else 'FAILED: ' + checked[key]['detail']}", flush=True)
        res = dict(name=f"moe.ffn/cuda/bf16/T:{T}", T=T, hidden=c.hidden, experts=c.experts, top_k=c.top_k,
                   inter=c.inter, shared_inter=c.shared_inter, config=config, config_source=source,
                   check=checked[key])
        if not checked[key]["passed"]:
            res["error"] = f"not timed: the check failed ({checked[key]['detail']})"
            report["results"].append(res)
            continue
        x = x_all[:T]
        with torch.no_grad():
            times = time_it(lambda: peer_forward(pub, x, w, c, config, how), args.iters, args.warmup)
            stages = stage_medians(pub, x, w, c, config, how, max(5, args.iters // 2))
        res.update(summary(times, moe_flops(c, T)))
        fused = stages["fused_moe_w1"] + stages["fused_moe_w2"]
        res.update(stages_ms=stages, fused_moe_ms=fused, fused_moe_share=fused * 1e-3 / res["median_s"])
        report["results"].append(res)
        print(f"{res['name']:28s} {res['median_s'] * 1e3:9.3f} ms {res['tflop_per_second']:7.1f} TFLOP/s "
              f"(cv {res['cv']:.3f}); fused_moe kernels {fused:.3f} ms = {res['fused_moe_share']:.0%}; "
              f"config {source}", flush=True)
        print("  stages (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()), flush=True)
        torch.cuda.empty_cache()
    report["context"] = context({"vllm": fetch_note(path) or "unknown (no FETCH.md)", "published": path,
                                 "published_sha256": digest, "triton": triton.__version__, **how})
    write_report(report, args.out)


if __name__ == "__main__":
    main()

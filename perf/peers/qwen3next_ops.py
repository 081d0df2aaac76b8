"""Qwen3-Next's Gated DeltaNet and MoE blocks for the PyTorch peer of the end-to-end prefill
(torch_prefill.py), in the forms a strong PyTorch stack would run, with the plain-torch fallbacks and
the f32 references of `torch_prefill.py --check`. The math follows layers/gdn.c, ref_cpu/gdn.c and
uniprefill/moe.h (see torch_prefill.py's docstring for the layer as a whole)."""
import importlib
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F

GDN_CHUNK = 64  # tokens a chunk of the torch chunked scan (FLA's and HF's chunk)
L2_EPS = 1e-6   # UPF_GDN_L2_EPS, FLA's l2norm eps


def load_fla():
    """(chunk_gated_delta_rule, causal_conv1d or None, version) when flash-linear-attention imports
    (fla_gdn.py's import; the device installs the carried wheels), else (None, None, reason)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - ImportError, or triton failing to load on a CPU-only machine
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    conv = None
    for mod in ("fla.modules.causal_conv1d", "fla.modules.convolution", "fla.modules"):
        try:
            conv = importlib.import_module(mod).causal_conv1d
            break
        except Exception:  # noqa: BLE001 - moved between FLA versions
            continue
    return chunk_gated_delta_rule, conv, getattr(fla, "__version__", "unknown")


# ---- Pointwise glue of the two blocks (torch.compile'd with the rest of torch_prefill's glue) ----

def conv_shift(x, w, pos):
    """Causal depthwise conv1d + SiLU per request: y[t] = silu(sum_j w[:, j] x[t - (K-1) + j]), the inputs
    before a request's first token zero. x (T, C) any row stride, w (C, K), pos (T) i64 each token's
    position in its request; f32 inside, (T, C) in x's dtype."""
    K = w.shape[1]
    xp = F.pad(x.float(), (0, 0, K - 1, 0))
    wf = w.float()
    acc = x.new_zeros(x.shape, dtype=torch.float32)
    for j in range(K):
        back = K - 1 - j                     # tokens back from t
        term = xp[j:j + x.shape[0]] * wf[:, j]
        acc = acc + (term if back == 0 else torch.where((pos >= back)[:, None], term, 0.0))
    return F.silu(acc).to(x.dtype)


def gdn_gates(a, b, a_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) (f32, log decay), beta = sigmoid(b) (f32); a, b (T, Hv)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gated_norm(o, z, w, eps: float):
    """Qwen3NextRMSNormGated: rmsnorm(o) over Dv * w (plain gain) * silu(z), f32 inside; o, z (T, Hv, Dv)."""
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return (y * F.silu(z.float())).to(o.dtype)


def moe_route(logits, k: int, norm_topk: bool):
    """softmax over the experts (f32), the k largest (descending), renormalised to sum 1 when norm_topk.
    logits (T, E) -> weights (T, k) f32, experts (T, k) i64."""
    p = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(p, k, dim=-1)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    return w, idx


def moe_combine(y, pair_row, w, ys, h, sgw):
    """out (T, H) = sum_k w[t, k] y[pair_row[t K + k]] + sigmoid(h[t] . sgw) ys[t], all in f32, rounded once.
    y (T K, H) the experts' outputs in expert order, ys (T, H) the shared expert's, h (T, H) the MoE input."""
    T, K = w.shape
    routed = (y.index_select(0, pair_row).view(T, K, -1).float() * w[..., None]).sum(1)
    gate = torch.sigmoid((h.float() * sgw.float()).sum(-1, keepdim=True))
    return (routed + gate * ys.float()).to(ys.dtype)


GLUE = {"conv_shift": conv_shift, "gdn_gates": gdn_gates, "gated_norm": gated_norm, "moe_route": moe_route,
        "moe_combine": moe_combine}


# ---- The delta rule ----

def l2norm(x):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2_EPS)


def scan_recurrent(q, k, v, g, beta, scale, cu):
    """The recurrence one token at a time (ref_cpu/gdn.c, HF torch_recurrent_gated_delta_rule), f32:
    S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = scale S^T q, q and k L2-normalised.
    q, k (T, Hk, Dk), v (T, Hv, Dv), g, beta (T, Hv) f32; value head h reads key head h // (Hv / Hk)."""
    Hv, Dv = v.shape[1], v.shape[2]
    r = Hv // q.shape[1]
    qn, kn = l2norm(q).repeat_interleave(r, 1), l2norm(k).repeat_interleave(r, 1)
    vf = v.float()
    o = torch.empty((v.shape[0], Hv, Dv), dtype=torch.float32, device=v.device)
    for s, e in zip(cu[:-1], cu[1:]):
        S = torch.zeros((Hv, q.shape[2], Dv), dtype=torch.float32, device=v.device)
        for t in range(s, e):
            S = S * g[t].exp()[:, None, None]
            delta = beta[t][:, None] * (vf[t] - torch.einsum("hkv,hk->hv", S, kn[t]))
            S = S + kn[t][:, :, None] * delta[:, None, :]
            o[t] = scale * torch.einsum("hkv,hk->hv", S, qn[t])
    return o


def scan_chunked(q, k, v, g, beta, scale, cu, chunk=GDN_CHUNK):
    """The chunked (WY / UT-transform) form of the same recurrence in plain torch, f32, per request, every
    value head at once (HF torch_chunk_gated_delta_rule; ref_gdn_scan_chunked): the fallback when FLA does
    not import. Same arguments as scan_recurrent."""
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    r = Hv // q.shape[1]
    o = torch.empty((v.shape[0], Hv, Dv), dtype=torch.float32, device=v.device)
    C = chunk
    tri_incl = torch.triu(torch.ones(C, C, dtype=torch.bool, device=v.device), 0)   # j >= i
    tri_strict = torch.triu(torch.ones(C, C, dtype=torch.bool, device=v.device), 1)  # j > i
    eye = torch.eye(C, dtype=torch.float32, device=v.device)
    for s, e in zip(cu[:-1], cu[1:]):
        n = e - s
        pad = (C - n % C) % C
        N = (n + pad) // C

        def heads(x):  # (n, Hv, d) -> (Hv, N, C, d), zero rows past the request (beta 0, g 0: no effect)
            return F.pad(x, (0, 0, 0, 0, 0, pad)).view(N, C, Hv, -1).permute(2, 0, 1, 3)

        qh = heads(l2norm(q[s:e]).repeat_interleave(r, 1) * scale)
        kh = heads(l2norm(k[s:e]).repeat_interleave(r, 1))
        vh = heads(v[s:e].float())
        bh = heads(beta[s:e, :, None].float())[..., 0]           # (Hv, N, C)
        G = heads(g[s:e, :, None].float())[..., 0].cumsum(-1)    # within each chunk
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(tri_strict, float("-inf")).exp()  # i >= j
        kb = kh * bh[..., None]
        A = -((kb @ kh.transpose(-1, -2)) * decay).masked_fill(tri_incl, 0.0)
        for i in range(1, C):  # (I - A)^-1 by forward substitution on the rows
            A[..., i, :i] = A[..., i, :i] + (A[..., i, :, None] * A[..., :, :i]).sum(-2)
        A = A + eye
        U = A @ (vh * bh[..., None])                               # (Hv, N, C, Dv)
        W = A @ (kb * G.exp()[..., None])                          # (Hv, N, C, Dk)
        S = torch.zeros((Hv, Dk, Dv), dtype=torch.float32, device=v.device)
        out = torch.empty_like(U)
        for c in range(N):
            qc, kc, gc = qh[:, c], kh[:, c], G[:, c]
            vn = U[:, c] - W[:, c] @ S                             # the chunk's new values
            attn = (qc @ kc.transpose(-1, -2) * decay[:, c]).masked_fill(tri_strict, 0.0)
            out[:, c] = (qc * gc.exp()[..., None]) @ S + attn @ vn
            S = S * gc[:, -1, None, None].exp() + (kc * (gc[:, -1:] - gc).exp()[..., None]).transpose(-1, -2) @ vn
        o[s:e] = out.permute(1, 2, 0, 3).reshape(N * C, Hv, Dv)[:n]
    return o


class Gdn:
    """The causal conv and the delta-rule scan of the GDN layers: FLA's Triton kernels where FLA imports
    (the conv: FLA's or the compiled shifted sum, whichever `probe` times faster), else plain torch (the
    chunked scan: slow, not a peer); reference=True: the shifted-sum conv in f32 and the recurrent scan."""

    def __init__(self, cfg, device, reference=False, use_fla=True):
        self.cfg, self.device, self.reference = cfg, device, reference
        fla = load_fla() if use_fla and not reference else (None, None, "off")
        self.fla_scan, self.fla_conv, self.fla_version = fla
        if self.fla_scan is None:
            self.scan_impl = "recurrent torch f32 (reference)" if reference else \
                f"torch chunked f32 (no FLA: {self.fla_version}; slow, for CPU testing only, not a peer)"
        else:
            self.scan_impl = "fla chunk_gated_delta_rule (gate in kernel)"
        self.gate_in_kernel = self.fla_scan is not None
        self.gate_probed = False
        self.conv_impl = "shifted sum"  # or "fla causal_conv1d"

    def conv(self, x, w, batch, glue):
        if self.conv_impl == "fla causal_conv1d":
            y, _ = self.fla_conv(x.unsqueeze(0), weight=w, activation="silu", cu_seqlens=batch.cu_dev,
                                 **({"cu_seqlens_cpu": batch.cu_cpu} if batch.cu_cpu is not None else {}))
            return y[0]
        return glue.conv_shift(x, w, batch.pos)

    def scan(self, q, k, v, a, b, a_log, dt_bias, scale, batch, glue):
        """q, k (T, Hk, Dk), v (T, Hv, Dv), a, b (T, Hv) views -> o (T, Hv, Dv) in v's dtype."""
        if self.fla_scan is not None:
            common = dict(scale=scale, initial_state=None, output_final_state=False, cu_seqlens=batch.cu_dev,
                          use_qk_l2norm_in_kernel=True)
            if batch.cu_cpu is not None:
                common["cu_seqlens_cpu"] = batch.cu_cpu
            q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
            if self.gate_in_kernel:
                o, _ = self.fla_scan(q4, k4, v4, a.unsqueeze(0), b.unsqueeze(0), use_gate_in_kernel=True,
                                     A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, **common)
                return o[0]
            g, beta = glue.gdn_gates(a, b, a_log, dt_bias)
            o, _ = self.fla_scan(q4, k4, v4, g.unsqueeze(0), beta.to(v.dtype).unsqueeze(0), **common)
            return o[0]
        g, beta = glue.gdn_gates(a, b, a_log, dt_bias)
        run = scan_recurrent if self.reference else scan_chunked
        return run(q, k, v, g, beta, scale, batch.cu).to(v.dtype)

    def probe_gate(self):
        """Whether this FLA takes the raw gate inputs (use_gate_in_kernel, as fla_gdn.py calls it), on a
        request of 128 tokens; else the glue computes g and beta first (inside the timing)."""
        if self.fla_scan is None or self.gate_probed:
            return
        self.gate_probed = True
        c, t, dev = self.cfg, 128, self.device
        q, k = (torch.randn((1, t, c.gdn_key_heads, c.gdn_key_dim), device=dev, dtype=torch.bfloat16) for _ in "qk")
        v = torch.randn((1, t, c.gdn_value_heads, c.gdn_value_dim), device=dev, dtype=torch.bfloat16)
        a, b = (torch.randn((1, t, c.gdn_value_heads), device=dev, dtype=torch.bfloat16) for _ in "ab")
        hv = torch.zeros(c.gdn_value_heads, device=dev)
        cu = torch.tensor([0, t], device=dev, dtype=torch.int64)
        try:
            self.fla_scan(q, k, v, a, b, scale=c.gdn_key_dim ** -0.5, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, A_log=hv, dt_bias=hv, use_beta_sigmoid_in_kernel=True)
        except Exception as e:  # noqa: BLE001 - an FLA without the fused gate (fla_gdn.py does the same)
            print(f"FLA refused the in-kernel gate ({type(e).__name__}: {str(e)[:160]}); gates computed first",
                  flush=True)
            self.gate_in_kernel = False
            self.scan_impl = "fla chunk_gated_delta_rule (g, beta computed by the glue first, inside the timing)"

    def probe(self, t, glue, iters=3):
        """The FLA gate form (probe_gate), then times the conv of one request of t tokens with FLA's
        causal_conv1d and with the glue's shifted sum (the FLA one kept only if it also agrees with the
        shifted sum); keeps the faster."""
        self.probe_gate()
        if self.fla_conv is None or self.device == "cpu":
            return {"gdn_conv": self.conv_impl, "gdn_scan": self.scan_impl}
        C, K = conv_channels(self.cfg), self.cfg.gdn_conv_kernel
        x = torch.randn((t, C + 64), device=self.device, dtype=torch.bfloat16)[:, :C]  # strided, as proj's columns
        w = torch.randn((C, K), device=self.device, dtype=torch.bfloat16) * K ** -0.5

        one = torch.tensor([0, t], dtype=torch.int64)  # a batch of one request
        batch = SimpleNamespace(cu=[0, t], cu_dev=one.to(self.device), cu_cpu=one,
                                pos=torch.arange(t, device=self.device))
        found = {}
        want = None
        for impl in ("shifted sum", "fla causal_conv1d"):
            self.conv_impl = impl
            try:
                y = self.conv(x, w, batch, glue)
                if want is None:
                    want = y.float()
                elif (y.float() - want).abs().max().item() > 2e-2 * max(want.abs().max().item(), 1e-6):
                    raise RuntimeError("disagrees with the shifted sum")
                torch.cuda.synchronize()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                for _ in range(iters):
                    self.conv(x, w, batch, glue)
                ev[1].record()
                ev[1].synchronize()
                found[impl] = ev[0].elapsed_time(ev[1]) * 1e-3 / iters
            except Exception as e:  # noqa: BLE001 - an FLA conv that refuses this call: the shifted sum runs
                found[impl] = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        timed = {k: v for k, v in found.items() if isinstance(v, float)}
        self.conv_impl = min(timed, key=timed.get)
        return {"gdn_conv_probe_s": found, "gdn_conv": self.conv_impl, "gdn_scan": self.scan_impl}


def conv_channels(cfg):
    """C: the conv's channels, [q | k] of the key heads then v of the value heads."""
    return 2 * cfg.gdn_key_heads * cfg.gdn_key_dim + cfg.gdn_value_heads * cfg.gdn_value_dim


# ---- MoE ----

def grouped_mm_fn():
    """torch's grouped GEMM (F.grouped_mm, else torch._grouped_mm) or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class Moe:
    """The MoE FFN: the router GEMM (f32 logits where torch has a bf16 -> f32 GEMM), softmax and top-k
    (glue), the (token, rank) pairs sorted by expert (a stable sort), the experts' gate_up and down as one
    grouped GEMM each over the sorted rows (torch's grouped mm), or one F.linear per expert with tokens
    where torch has none that runs here, SwiGLU (glue), the shared expert (F.linear), and the weighted
    combine with the shared expert's sigmoid gate (glue, f32). reference=True: a per-expert dense f32 loop."""

    def __init__(self, cfg, device, reference=False):
        self.cfg, self.device, self.reference = cfg, device, reference
        self.gmm = None
        self.router = "F.linear in the weights' dtype (bf16: logits rounded to bf16), then f32"
        self.experts = "reference: per-expert f32 loop" if reference else \
            "per-expert F.linear loop (tokens sorted by expert)"

    def setup(self, dtype=torch.bfloat16):
        """Chooses the router form and the expert GEMM on a tiny case (each checked against plain
        F.linear); returns what was chosen."""
        if self.reference:
            return self.describe()
        H, I, E = 64, 32, 4
        x = torch.randn((64, H), device=self.device, dtype=dtype)
        wr = torch.randn((E, H), device=self.device, dtype=dtype)
        try:
            lg = torch.mm(x, wr.t(), out_dtype=torch.float32)
            if lg.dtype == torch.float32 and (lg - F.linear(x.float(), wr.float())).abs().max().item() < 1e-2:
                self.router = "torch.mm bf16 -> f32 logits (out_dtype)"
        except (TypeError, RuntimeError, NotImplementedError):
            if self.device == "cpu":  # no bf16 -> f32 GEMM on the CPU: the same logits from upcast operands
                self.router = "f32 F.linear of the upcast operands (cpu: no bf16 -> f32 GEMM)"
        fn = grouped_mm_fn()
        if fn is not None:
            w = torch.randn((E, 2 * I, H), device=self.device, dtype=dtype)
            offs = torch.tensor([16, 16, 48, 64], device=self.device, dtype=torch.int32)  # an empty group too
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    y = fn(x, w.transpose(-2, -1), offs=offs)
                want = torch.cat([F.linear(x[s:e].float(), w[i].float()) for i, (s, e) in
                                  enumerate(zip([0, 16, 16, 48], [16, 16, 48, 64]))])
                if (y.float() - want).abs().max().item() < 5e-2 * want.abs().max().item():
                    self.gmm = fn
                    which = "F.grouped_mm" if fn is getattr(F, "grouped_mm", None) else "torch._grouped_mm"
                    self.experts = f"grouped GEMM ({which}) over the expert-sorted rows"
            except (TypeError, RuntimeError, NotImplementedError, ValueError):
                pass
        return self.describe()

    def describe(self):
        return {"moe_router": self.router, "moe_experts": self.experts}

    def logits(self, h, router):
        if self.router.startswith("torch.mm"):
            return torch.mm(h, router.t(), out_dtype=torch.float32)
        if self.router.startswith("f32"):
            return F.linear(h.float(), router.float())
        return F.linear(h, router).float()

    def __call__(self, h, lw, glue, act):
        """h (T, H) normed -> (T, H) in h's dtype."""
        c = self.cfg
        E, K = c.moe_experts, c.moe_top_k
        if self.reference:
            return moe_reference(h, lw, c)
        w, idx = glue.moe_route(self.logits(h, lw.router), K, c.moe_norm_topk)
        flat = idx.view(-1)                                            # (T K) expert of pair p = t K + k
        order = torch.argsort(flat, stable=True)                       # pairs in expert order
        pair_row = torch.empty_like(order)
        pair_row[order] = torch.arange(order.numel(), device=h.device)
        xs = h.index_select(0, order // K)                             # (T K, H)
        if self.gmm is not None:
            offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
            hg = self.gmm(xs, lw.exp_gate_up.transpose(-2, -1), offs=offs)   # (T K, 2I)
            a = glue.act_mul(hg, act)
            del hg
            y = self.gmm(a, lw.exp_down.transpose(-2, -1), offs=offs)       # (T K, H)
        else:
            counts = torch.bincount(flat, minlength=E).tolist()            # a host sync, as any loop needs
            y = torch.empty_like(xs)
            s = 0
            for e, n in enumerate(counts):
                if n:
                    y[s:s + n] = F.linear(glue.act_mul(F.linear(xs[s:s + n], lw.exp_gate_up[e]), act), lw.exp_down[e])
                    s += n
        del xs
        ys = F.linear(glue.act_mul(F.linear(h, lw.sh_gate_up), act), lw.sh_down)  # (T, H) shared expert
        return glue.moe_combine(y, pair_row, w, ys, h, lw.sh_gate)


def moe_reference(h, lw, c):
    """Every token through its experts, dense per expert, in h's dtype (f32 for --check)."""
    logits = F.linear(h, lw.router).float()
    w, idx = moe_route(logits, c.moe_top_k, c.moe_norm_topk)
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for e in range(c.moe_experts):
        rows, rank = (idx == e).nonzero(as_tuple=True)
        if rows.numel():
            gu = F.linear(h[rows], lw.exp_gate_up[e])
            i = gu.shape[-1] // 2
            y = F.linear(F.silu(gu[:, :i]) * gu[:, i:], lw.exp_down[e])
            out.index_add_(0, rows, y.float() * w[rows, rank][:, None])
    gu = F.linear(h, lw.sh_gate_up)
    i = gu.shape[-1] // 2
    ys = F.linear(F.silu(gu[:, :i]) * gu[:, i:], lw.sh_down)
    gate = torch.sigmoid(h.float() @ lw.sh_gate.float())[:, None]
    return (out + gate * ys.float()).to(h.dtype)


# ---- FLOPs (of what runs; multiply-adds count 2) ----

def gdn_flops(cfg, T):
    """Projections in (C + Hv Dv) and ba (2 Hv), out (Hv Dv); the conv 2 C K; the scan 7 Dk Dv a value head
    (bench_gdn.c's count)."""
    H, C, HvDv = cfg.hidden, conv_channels(cfg), cfg.gdn_value_heads * cfg.gdn_value_dim
    proj = 2.0 * T * H * (C + HvDv + 2 * cfg.gdn_value_heads + HvDv)
    scan = 7.0 * T * cfg.gdn_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim
    return proj + 2.0 * T * C * cfg.gdn_conv_kernel + scan


def moe_flops(cfg, T):
    """upf_moe_flops: router 2THE, routed 2TK(3IH), shared 2T(3 Is H) + 2TH for its gate."""
    H, I, Is = cfg.hidden, cfg.moe_inter, cfg.moe_shared_inter
    f = 2.0 * T * H * cfg.moe_experts + 2.0 * T * cfg.moe_top_k * 3.0 * I * H
    return f + (2.0 * T * 3.0 * Is * H + 2.0 * T * H if Is else 0.0)

"""The seeded weights of `upf --model NAME --seed S` (models/weights.c) rebuilt in numpy, in the layouts of
the PyTorch peer (torch_prefill.py: linear weights (out, in)), so that `torch_prefill.py --against-upf`
runs the peer on exactly the weights our CPU reference runs. For the tiny configs (every element is drawn
in Python-visible numpy; the real models would take minutes and tens of GiB)."""
import math

import numpy as np

MASK = (1 << 64) - 1
GOLDEN = 0x9e3779b97f4a7c15


def splitmix64(x):
    """models/weights.c splitmix64 on a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
    return x ^ (x >> np.uint64(31))


def name_key(seed, name):
    """FNV-1a of the tensor's name, mixed with the seed (models/weights.c name_key)."""
    h = 0xcbf29ce484222325
    for byte in name.encode():
        h = ((h ^ byte) * 0x100000001b3) & MASK
    return int(splitmix64(np.array([(seed ^ h) & MASK], dtype=np.uint64))[0])


def tensor(seed, name, shape, amp, offset):
    """f32 values (row-major over upf's shape): (float)(offset + amp * unit), unit uniform in [-1, 1) on a
    2^-23 grid from (key, element index)."""
    n = int(np.prod(shape))
    with np.errstate(over="ignore"):
        x = splitmix64(np.uint64(name_key(seed, name)) + np.arange(n, dtype=np.uint64) * np.uint64(GOLDEN))
    unit = ((x >> np.uint64(40)).astype(np.float64) * (1.0 / 8388608.0) - 1.0).astype(np.float32)
    return (offset + amp * unit.astype(np.float64)).astype(np.float32).reshape(shape)


def proj_amp(fan_in):
    return math.sqrt(3.0 / fan_in)


def seeded_weights(cfg, seed=1):
    """Every layer's distinct weights (shared-weight models pick the first layer of each mixer kind) and the
    model's, as numpy f32 in the peer's layouts: {"embed", "final_norm", "output", "layers": [dict]}.
    cfg: torch_prefill's Config of a built-in model (its names and shapes are models/weights.c's)."""
    H, D, V = cfg.hidden, cfg.head_dim, cfg.vocab
    norm_off = 1.0 - cfg.norm_offset   # upf draws 1 + noise where the norm multiplies by w, noise where by 1 + w
    # upf's amplitude uses the config's f32 embed scale (rounded to bf16 only when a bf16 model embeds)
    embed_scale = float(np.float32(math.sqrt(H))) if cfg.embed_scale != 1.0 else 1.0
    T = lambda name, shape, amp, off=0.0: tensor(seed, name, shape, amp, off)  # noqa: E731
    layers = []
    for l in range(cfg.layers):
        b = f"blk.{l}."
        d = {"attn_norm": T(b + "attn_norm.weight", (H,), 0.1, norm_off)}
        if cfg.kind(l) == "gdn":
            Hk, Hv, Dk, Dv, K = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim, \
                cfg.gdn_conv_kernel
            C, HvDv = 2 * Hk * Dk + Hv * Dv, Hv * Dv
            d["ssm_in"] = T(b + "ssm_in.weight", (H, C + HvDv), proj_amp(H)).T.copy()
            d["ssm_ba"] = T(b + "ssm_ba.weight", (H, 2 * Hv), proj_amp(H)).T.copy()
            d["ssm_conv"] = T(b + "ssm_conv1d.weight", (C, K), proj_amp(K))
            d["ssm_a"] = T(b + "ssm_a", (Hv,), 0.5 * math.log(16.0), 0.5 * math.log(16.0))
            d["ssm_dt"] = T(b + "ssm_dt.bias", (Hv,), 2.0, -4.0)
            d["ssm_norm"] = T(b + "ssm_norm.weight", (Dv,), 0.1, 1.0)   # the gated norm: plain gain
            d["ssm_out"] = T(b + "ssm_out.weight", (HvDv, H), proj_amp(HvDv)).T.copy()
        else:
            d["qkv"] = T(b + "attn_qkv.weight", (H, cfg.qkv_cols), proj_amp(H)).T.copy()
            if cfg.qk_norm:
                d["q_norm"] = T(b + "attn_q_norm.weight", (D,), 0.1, norm_off)
                d["k_norm"] = T(b + "attn_k_norm.weight", (D,), 0.1, norm_off)
            d["o"] = T(b + "attn_output.weight", (cfg.q_heads * D, H), proj_amp(cfg.q_heads * D)).T.copy()
        if cfg.sandwich:
            d["post_attn_norm"] = T(b + "post_attention_norm.weight", (H,), 0.1, norm_off)
        d["ffn_norm"] = T(b + "ffn_norm.weight", (H,), 0.1, norm_off)
        if cfg.moe_experts:
            E, I, Is = cfg.moe_experts, cfg.moe_inter, cfg.moe_shared_inter
            d["router"] = T(b + "ffn_gate_inp.weight", (E, H), proj_amp(H))
            d["exp_gate_up"] = T(b + "ffn_gate_up_exps.weight", (E, 2 * I, H), proj_amp(H))
            d["exp_down"] = T(b + "ffn_down_exps.weight", (E, H, I), proj_amp(I))
            d["sh_gate_up"] = T(b + "ffn_gate_up_shexp.weight", (2 * Is, H), proj_amp(H))
            d["sh_down"] = T(b + "ffn_down_shexp.weight", (H, Is), proj_amp(Is))
            d["sh_gate"] = T(b + "ffn_gate_inp_shexp.weight", (H,), proj_amp(H))
        else:
            d["gate_up"] = T(b + "ffn_gate_up.weight", (H, 2 * cfg.inter), proj_amp(H)).T.copy()
            d["down"] = T(b + "ffn_down.weight", (cfg.inter, H), proj_amp(cfg.inter)).T.copy()
        if cfg.sandwich:
            d["post_ffn_norm"] = T(b + "post_ffw_norm.weight", (H,), 0.1, norm_off)
        layers.append(d)
    embed = T("token_embd.weight", (V, H), math.sqrt(3.0) / embed_scale)
    out = {"embed": embed, "final_norm": T("output_norm.weight", (H,), 0.1, norm_off), "layers": layers}
    # tied: upf's output (H, V) is the embedding transposed, i.e. the embedding in the peer's (V, H)
    out["output"] = embed if cfg.tied else T("output.weight", (H, V), proj_amp(H)).T.copy()
    return out

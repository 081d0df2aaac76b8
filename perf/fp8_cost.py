#!/usr/bin/env python3
"""What the fp8 variant of attn.block_sparse costs in accuracy on top of its E4M3 products: the same inputs
(bf16, Llama-3.1-8B heads: Hq 32, Hkv 8, D 128) through `upf block-sparse --backend cuda` with the default
kernel and with UPF_VARIANT=attn.block_sparse=fp8, the output of each against a float64 numpy reference of
the default's own kept blocks (--out-blocks), and fp8 against bf16. Inputs: normal q, k, v with a shared
direction per KV head (so logits have structure) and key blocks pushed hot or cold (so blocks drop).

  perf/fp8_cost.py --upf build/upf [--tokens 4096] [--alpha 0.18] [--json OUT]
"""
import argparse, json, os, subprocess, sys, tempfile

import numpy as np


def bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upf", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--alpha", type=float, default=0.18)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--backend", default="cuda", help="cpu: both runs take the reference (a check of this script)")
    ap.add_argument("--json")
    a = ap.parse_args()
    T, HQ, HKV, D, BN = a.tokens, 32, 8, 128, 64
    g = HQ // HKV
    rng = np.random.default_rng(a.seed)
    u = rng.standard_normal((HKV, D)).astype(np.float32)
    mag = np.sqrt(2.0 / np.sqrt(D) / np.log2(np.e))
    q = rng.standard_normal((T, HQ, D)).astype(np.float32) + mag * np.repeat(u, g, axis=0)[None]
    hot = np.where(rng.random((T // BN + 1, HKV)) < 0.3, 1.0, -1.0).astype(np.float32)
    sign = np.repeat(hot, BN, axis=0)[:T]
    k = rng.standard_normal((T, HKV, D)).astype(np.float32) + mag * sign[:, :, None] * u[None]
    v = rng.standard_normal((T, HKV, D)).astype(np.float32) + np.repeat(
        rng.standard_normal((T // BN + 1, HKV, D)).astype(np.float32), BN, axis=0)[:T]
    qb, kb, vb = bf16_bits(q), bf16_bits(k), bf16_bits(v)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, x in (("q", qb), ("k", kb), ("v", vb), ("cu", np.array([0, T], np.int32))):
            np.save(os.path.join(d, name + ".npy"), x)
        outs = {}
        for label, variant in (("bf16", ""), ("fp8", "attn.block_sparse=fp8")):
            env = dict(os.environ)
            env.pop("UPF_VARIANT", None)
            if variant:
                env["UPF_VARIANT"] = variant
            cmd = [a.upf, "block-sparse", "--q", f"{d}/q.npy", "--k", f"{d}/k.npy", "--v", f"{d}/v.npy",
                   "--cu-seqlens", f"{d}/cu.npy", "--alpha", str(a.alpha), "--block-n", str(BN), "--backend", a.backend,
                   "--out", f"{d}/o_{label}.npy", "--out-blocks", f"{d}/b_{label}.npy"]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"fp8_cost: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
            outs[label] = from_bits(np.load(f"{d}/o_{label}.npy")).astype(np.float64)
            blocks = np.load(f"{d}/b_{label}.npy")
        if not np.array_equal(np.load(f"{d}/b_bf16.npy"), blocks):
            sys.exit("fp8_cost: the two runs kept different blocks (the index does not depend on the variant)")
    # float64 reference over the kept blocks (BLK: (Hkv, tiles, key blocks), tiles of block_m 128 packed rows)
    qf, kf, vf = from_bits(qb).astype(np.float64), from_bits(kb).astype(np.float64), from_bits(vb).astype(np.float64)
    ref = np.zeros((T, HQ, D))
    scale = 1.0 / np.sqrt(D)
    pos = np.arange(T)
    for h in range(HQ):
        hk = h // g
        keep = blocks[hk].astype(bool)  # (tiles, key blocks)
        rows = pos * g + h % g
        kmask = keep[rows // 128][:, pos // BN] & (pos[None, :] <= pos[:, None])
        s = (qf[:, h] @ kf[:, hk].T) * scale
        s = np.where(kmask, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        ref[:, h] = (p @ vf[:, hk]) / p.sum(axis=1, keepdims=True)

    def nmse(x, y):
        return float(((x - y) ** 2).sum() / (y ** 2).sum())

    out = {"tokens": T, "alpha": a.alpha, "block_n": BN, "kept_share": float(blocks.mean()),
           "nmse_bf16_vs_f64": nmse(outs["bf16"], ref), "nmse_fp8_vs_f64": nmse(outs["fp8"], ref),
           "nmse_fp8_vs_bf16": nmse(outs["fp8"], outs["bf16"]),
           "max_abs_fp8_vs_f64": float(np.abs(outs["fp8"] - ref).max()),
           "max_abs_bf16_vs_f64": float(np.abs(outs["bf16"] - ref).max())}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

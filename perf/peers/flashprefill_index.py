#!/usr/bin/env python3
"""Peer check of the FlashPrefill V2 block-sparse index (issue 23): the PUBLISHED index builder
(qhfan/FlashPrefillv2 at b0ea5c7, flashprefill_ops/flash_block_sparse_index_triton.py, Triton) and our
`upf block-sparse --backend cuda` on the same inputs, block by block. Runs only on the GPU machine
(torch with CUDA and triton); --self-test and --help run anywhere (no torch, no numpy).

The published module is not part of the tree: fetch it byte for byte into .peers/flashprefill/ (git-
ignored through .git/info/exclude) and carry .peers to the device; --published names another path.

Per case the script builds seeded bf16 q (T, Hq, D), k, v (T, Hkv, D) in torch, calls the published
build_block_sparse_index on a paged copy of k (page size 1 or 16, pages of a request consecutive,
cache_seqlens = q lens: self-attention prefill), decodes its CSR (64-key physical tiles; logical block
= tile // (block_n / 64)) into a (Hkv, total_q_tiles, max_key_blocks) keep mask, writes q/k/v/cu as
.npy and runs `upf block-sparse ... --out-blocks BLK.npy`, then compares the two masks.

Inputs: random normal q and k, with queries biased along one direction u per KV head and ~30% of the
key blocks "hot": shifted along u by 3 s (s uniform in [0.5, 4]), so block scores spread over several
powers of two and both alpha 0.18 and alpha 1 cut through the scored blocks.

The published scoring dots bf16 on tensor cores with fp32 sums; ours sums in fp32 (CUDA), so a block
whose score sits at the threshold may flip. Every disagreement is measured against a float64 torch
recomputation of S (include/uniprefill/sparse.h: kbar the fp64 mean rounded to bf16, l = scale log2(e)
q.kbar over the contributing rows, S = sum 2^(l - m_t)): block b is kept iff S_b >= alpha M_-b, where
M_-b is the largest score of the tile's other scored blocks (the same rule as S_b >= alpha max_b S for
alpha <= 1, and it gives the tile's top block a real margin: its gap to the runner-up), so its relative
distance is rel = (S_b - alpha M_-b) / (alpha M_-b). A disagreement is marginal iff the block is decided
by the threshold alone (scored, not dense, sink or window) and |rel| <= --tol (1e-3). The same
recomputation is checked against the published mask: a non-marginal disagreement there means the
reference (or this script's reading of the published code) is wrong, and fails the case too. Before
the cases, the float64 scores are checked against plain Python loops on a small ragged batch.

A case fails on a non-marginal disagreement (ours or the reference against the published), on an upf
error, or on a BLK of the wrong shape or dtype. Exit status: 0 all cases pass, 1 a case failed, 2 the
set-up failed (the published module cannot be imported, no upf binary, no CUDA).

Usage (on the device, from the repository root; upf from the staged bundle or the build tree):
  python3 perf/peers/flashprefill_index.py [--upf bin/upf] [--published PATH] [--json OUT.json]
                                           [--only REGEX] [--tol 1e-3] [--keep-inputs DIR]
  python3 perf/peers/flashprefill_index.py --self-test      (anywhere: decoding, geometry, rule, .npy)
"""
import argparse
import ast
import ctypes
import hashlib
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

PUBLISHED_REPO = "qhfan/FlashPrefillv2"
PUBLISHED_COMMIT = "b0ea5c723f0bc44c4f7b1389792e45036d182821"
PUBLISHED_PATH = "flashprefill_ops/flash_block_sparse_index_triton.py"
PUBLISHED_LOCAL = os.path.join(".peers", "flashprefill", "flash_block_sparse_index_triton.py")
ATTN_TILE_N = 64  # the published CSR's physical tile
HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B attention
MAX_LISTED = 8  # disagreements listed per case

# name, request lengths, block_n, alpha, page size, min_sparse_q_len. The ragged batch has a request
# short enough to be dense by last_n (40 queries: 2 tiles), a kv_len whose 128-key tail holds one 64-key
# tile (2730 = 21 * 128 + 42) and one whose tail holds two (1000); min_sparse_q_len 1000 makes the
# 1000-query request dense by the published `q_len <= min_sparse_q_len`.
CASES = [
    ("llama/T:4096/bn:64/alpha:0.18", (4096,), 64, 0.18, 1, 0),
    ("llama/T:4096/bn:128/alpha:0.18", (4096,), 128, 0.18, 16, 0),
    ("llama/T:4096/bn:64/alpha:1", (4096,), 64, 1.0, 16, 0),
    ("llama/T:16384/bn:128/alpha:0.18", (16384,), 128, 0.18, 1, 0),
    ("llama/T:16384/bn:64/alpha:1", (16384,), 64, 1.0, 1, 0),  # page 1, 256 blocks: the K_TILE 32 path
    ("llama/ragged:1000,40,2730/bn:128/alpha:0.18", (1000, 40, 2730), 128, 0.18, 16, 0),
    ("llama/ragged:1000,40,2730/bn:64/alpha:0.5/minsparse:1000", (1000, 40, 2730), 64, 0.5, 1, 1000),
]


class Params:
    """The index parameters of one case (upf_sparse_params' fields that the index reads)."""

    def __init__(self, block_n, alpha, block_m=128, sink=2, window=4, last_n=2, min_sparse_q_len=0):
        self.block_m, self.block_n, self.alpha = block_m, block_n, alpha
        self.sink, self.window, self.last_n, self.min_sparse_q_len = sink, window, last_n, min_sparse_q_len


# ------------------------------------------------------------------------------------ pure Python parts
def tile_geometry(q_lens, kv_lens, group, p):
    """Per query tile of all requests in order (the tiles of every KV head): upf_sparse_tile_at's facts."""
    tiles = []
    for r, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        rows = q_len * group
        count = (rows + p.block_m - 1) // p.block_m
        prefix = kv_len - q_len
        for m in range(count):
            pbeg, pend = m * p.block_m, min((m + 1) * p.block_m, rows)
            q_first, q_last = pbeg // group, (pend - 1) // group
            tiles.append(dict(
                req=r, m=m, q_len=q_len, kv_len=kv_len, prefix=prefix, q_first=q_first, q_last=q_last,
                first_k=(prefix + q_first) // p.block_n, last_k=(prefix + q_last) // p.block_n,
                active=(prefix + q_last + 1) // p.block_n, nb=(kv_len + p.block_n - 1) // p.block_n,
                dense=q_len <= p.min_sparse_q_len or m >= count - p.last_n))
    return tiles


def decode_csr(cu, idx, hkv, geom, max_kb, block_n):
    """The published CSR (block_sparse_cu (S+1), block_sparse_idx: 64-key tiles, ascending per segment
    s = h * total_q_tiles + t) as a keep mask, bytearray (hkv, total_q_tiles, max_kb) of 0/1. A logical
    block must appear as all of its tiles (block_n / 64 of them, fewer for the tail block at kv_len):
    anything else is a misreading, and raises ValueError."""
    n_sub = block_n // ATTN_TILE_N
    tiles = len(geom)
    segs = hkv * tiles
    if len(cu) != segs + 1 or cu[0] != 0 or cu[-1] != len(idx):
        raise ValueError(f"CSR offsets: {len(cu)} entries from {cu[0] if cu else None} to "
                         f"{cu[-1] if cu else None}, expected {segs + 1} from 0 to {len(idx)}")
    mask = bytearray(segs * max_kb)
    for s in range(segs):
        lo, hi = cu[s], cu[s + 1]
        if hi < lo:
            raise ValueError(f"segment {s}: offsets decrease ({lo} > {hi})")
        kv_len = geom[s % tiles]["kv_len"]
        phys_tiles = (kv_len + ATTN_TILE_N - 1) // ATTN_TILE_N
        seen = {}
        prev = -1
        for j in range(lo, hi):
            tile = idx[j]
            if tile <= prev:
                raise ValueError(f"segment {s}: tiles not ascending ({prev} then {tile})")
            if tile < 0 or tile >= phys_tiles:
                raise ValueError(f"segment {s}: tile {tile} outside [0, {phys_tiles}) of kv_len {kv_len}")
            prev = tile
            blk = tile // n_sub
            seen[blk] = seen.get(blk, 0) + 1
        for blk, n in seen.items():
            want = min(n_sub, phys_tiles - blk * n_sub)
            if n != want or blk >= max_kb:
                raise ValueError(f"segment {s}: block {blk} has {n} of its {want} tiles (max_kb {max_kb})")
            mask[s * max_kb + blk] = 1
    return mask


def ref_segment(scores, g, max_kb, p):
    """The rule of sparse.h for one segment from its scores (a sequence, index b < g['active'] read):
    (keep list of 0/1 over max_kb blocks, rel list: the relative distance to the threshold of a block
    decided by the threshold alone, None where dense, sink, window or position decides)."""
    keep, rel = [0] * max_kb, [None] * max_kb
    last_k = g["last_k"]
    if g["dense"]:
        for b in range(last_k + 1):
            keep[b] = 1
        return keep, rel
    active = g["active"]
    top, top_b, second = -math.inf, -1, -math.inf
    for b in range(active):
        s = scores[b]
        if s > top:
            top, top_b, second = s, b, top
        elif s > second:
            second = s
    win_lo = g["first_k"] - p.window + 1
    for b in range(last_k + 1):
        forced = b < p.sink or b >= win_lo
        thresholded = False
        if b < active:
            others = second if b == top_b else top
            thresholded = p.alpha <= 0 or others <= 0 or scores[b] >= p.alpha * others
            if not forced:
                rel[b] = math.inf if p.alpha <= 0 or others <= 0 else \
                    (scores[b] - p.alpha * others) / (p.alpha * others)
        keep[b] = 1 if forced or thresholded else 0
    return keep, rel


def loop_tile_scores(qrows, row0, kbar, gt, group, block_n, c):
    """S of one tile by plain loops (the check of reference_scores): qrows are the tile's packed rows
    row0, row0 + 1, ... (those of the request), kbar the request's block means of the tile's KV head."""
    logits = {}
    for i, row in enumerate(qrows):
        pos = (row0 + i) // group
        for b in range(gt["active"]):
            if gt["prefix"] + pos >= b * block_n:
                logits[(i, b)] = c * sum(x * y for x, y in zip(row, kbar[b]))
    top = max(logits.values()) if logits else 0.0
    scores = [0.0] * gt["active"]
    for (i, b), l in logits.items():
        scores[b] += 2.0 ** (l - top)
    return scores


def compare(pub, ours, ref, rels, geom, hkv, max_kb, tol):
    """Block-by-block agreement of ours with the published mask (and of the float64 reference with the
    published), with each disagreement's relative distance to the threshold."""
    tiles = len(geom)
    out = dict(blocks=len(pub), agree=0, disagree=0, marginal=0, max_abs_rel=0.0, listed=[],
               ref_vs_published=0, ref_vs_published_nonmarginal=0, ref_vs_ours=0)
    for s in range(hkv * tiles):
        lo, hi = s * max_kb, (s + 1) * max_kb
        if pub[lo:hi] == ours[lo:hi] == ref[lo:hi]:
            continue
        h, t = divmod(s, tiles)
        for b in range(max_kb):
            i = lo + b
            rel = rels[i]
            marginal = rel is not None and abs(rel) <= tol
            if ref[i] != pub[i]:
                out["ref_vs_published"] += 1
                out["ref_vs_published_nonmarginal"] += 0 if marginal else 1
            if ref[i] != ours[i]:
                out["ref_vs_ours"] += 1
            if pub[i] == ours[i]:
                continue
            out["disagree"] += 1
            if marginal:
                out["marginal"] += 1
                out["max_abs_rel"] = max(out["max_abs_rel"], abs(rel))
            if len(out["listed"]) < MAX_LISTED:
                g = geom[t]
                out["listed"].append(dict(head=h, tile=t, block=b, req=g["req"], m=g["m"], published=pub[i],
                                          ours=ours[i], reference=ref[i],
                                          rel=rel if rel is None or math.isfinite(rel) else "inf",
                                          marginal=marginal))
    out["agree"] = out["blocks"] - out["disagree"]
    out["nonmarginal"] = out["disagree"] - out["marginal"]
    return out


def npy_header(descr, shape):
    """A version 1.0 .npy header, numpy's layout: the dict padded with spaces and a newline so that the
    data starts at a multiple of 64 bytes."""
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, tuple(shape))
    text += " " * ((-(10 + len(text) + 1)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


def npy_write(path, descr, shape, data):
    with open(path, "wb") as f:
        f.write(npy_header(descr, shape))
        f.write(data)


def npy_read(path):
    """(descr, shape, data bytes) of a C-order .npy file (versions 1 to 3)."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:6] != b"\x93NUMPY":
        raise ValueError(f"{path}: not a .npy file")
    if raw[6] == 1:
        hlen, start = struct.unpack("<H", raw[8:10])[0], 10
    else:
        hlen, start = struct.unpack("<I", raw[8:12])[0], 12
    head = ast.literal_eval(raw[start:start + hlen].decode("latin1"))
    if head.get("fortran_order"):
        raise ValueError(f"{path}: Fortran order")
    return head["descr"], tuple(head["shape"]), raw[start + hlen:]


# ----------------------------------------------------------------------------------------- self-test
def self_test():
    fails = []

    def check(cond, what):
        if not cond:
            fails.append(what)

    # geometry, by hand: q_len 40, g 4, block_m 128 -> 160 rows, tiles [0, 128) and [128, 160)
    p = Params(block_n=64, alpha=0.5)
    g = tile_geometry([40, 300], [40, 300], 4, p)
    check(len(g) == 2 + 10, f"tile count {len(g)} != 12")
    check((g[0]["q_first"], g[0]["q_last"], g[1]["q_first"], g[1]["q_last"]) == (0, 31, 32, 39), "tile spans")
    check(g[0]["active"] == 0 and g[1]["active"] == 0 and g[0]["dense"] and g[1]["dense"], "short request")
    # request 1: 1200 rows, 10 tiles; tile 7 = positions 224..255: blocks 3..3, active (255 + 1) / 64 = 4
    t7 = g[2 + 7]
    check((t7["q_first"], t7["q_last"], t7["first_k"], t7["last_k"], t7["active"], t7["dense"]) ==
          (224, 255, 3, 3, 4, False), f"tile 7 {t7}")
    check(g[2 + 8]["dense"] and g[2 + 9]["dense"] and not g[2 + 7]["dense"], "last_n 2 dense tiles")
    check(all(x["dense"] for x in tile_geometry([1000], [1000], 4, Params(64, 0.5, min_sparse_q_len=1000))),
          "q_len <= min_sparse_q_len is dense")
    gd = tile_geometry([1001], [1001], 4, Params(64, 0.5, min_sparse_q_len=1000))  # 4004 rows: 32 tiles
    check(len(gd) == 32 and [x["m"] for x in gd if x["dense"]] == [30, 31], "q_len > min_sparse_q_len: last_n")
    # prefix (kv_len > q_len): bottom-right alignment
    gp = tile_geometry([64], [200], 4, p)[0]
    check((gp["prefix"], gp["first_k"], gp["last_k"], gp["active"]) == (136, 2, 2, 2), f"prefix tile {gp}")

    # CSR decoding: block_n 128 (2 tiles a block), kv_len 300: 3 blocks, the tail (256..299) one tile
    geom = [dict(kv_len=300), dict(kv_len=300)]
    cu = [0, 3, 5, 5, 10]
    idx = [0, 1, 4, 2, 3, 0, 1, 2, 3, 4]
    want = bytes([1, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1])
    check(bytes(decode_csr(cu, idx, 2, geom, 3, 128)) == want, "decode block_n 128")
    check(bytes(decode_csr([0, 2, 3, 3, 5], [0, 4, 2, 1, 3], 2, geom, 5, 64)) ==
          bytes([1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0]), "decode block_n 64")
    for bad_cu, bad_idx, why in [([0, 2, 2, 2, 2], [0, 4], "half a block"),
                                 ([0, 2, 2, 2, 2], [1, 0], "descending"),
                                 ([0, 2, 2, 2, 2], [4, 5], "tile past kv_len"),
                                 ([0, 2, 2, 2], [0, 1], "short offsets"),
                                 ([0, 2, 2, 2, 3], [0, 1], "offsets past idx")]:
        try:
            decode_csr(bad_cu, bad_idx, 2, geom, 3, 128)
            fails.append(f"decode accepted {why}")
        except ValueError:
            pass

    # the rule: a sparse tile with 4 scored blocks, sink 0, window 1 (only the last diagonal block forced)
    pr = Params(block_n=64, alpha=1.0, sink=0, window=1)
    gt = dict(dense=False, active=4, first_k=4, last_k=4)
    keep, rel = ref_segment([10.0, 5.0, 2.0, 9.99], gt, 6, pr)
    check(keep == [1, 0, 0, 0, 1, 0], f"alpha 1 keep {keep}")
    check(abs(rel[3] + 1e-3) < 1e-12 and abs(rel[0] - 0.01 / 9.99) < 1e-12 and rel[4] is None and rel[5] is None,
          f"alpha 1 rel {rel}")
    pr.alpha = 0.5
    keep, rel = ref_segment([10.0, 5.0, 2.0, 9.99], gt, 6, pr)
    check(keep == [1, 1, 0, 1, 1, 0] and abs(rel[1]) < 1e-12 and abs(rel[2] + 0.6) < 1e-12, f"alpha 0.5 {keep} {rel}")
    pr.sink, pr.window = 1, 3  # sink keeps 0, window 2..4
    keep, rel = ref_segment([1.0, 5.0, 2.0, 9.0], gt, 6, pr)
    check(keep == [1, 1, 1, 1, 1, 0] and rel[0] is None and rel[2] is None and rel[1] is not None,
          f"sink/window {keep} {rel}")
    keep, rel = ref_segment([], dict(dense=True, active=0, first_k=1, last_k=2), 4, pr)
    check(keep == [1, 1, 1, 0] and rel == [None] * 4, "dense tile")

    # loop scores by hand: D 1, group 2, block_n 1, rows 0..3 = positions 0, 0, 1, 1; position 0 sees block 0,
    # position 1 blocks 0 and 1; logits b0 1, 1, 0, 3 and b1 (rows 2, 3) 0, 6; tile max 6. With prefix 1
    # every row sees both blocks: b1 adds rows 0, 1 at logit 2.
    sc = loop_tile_scores([[1.0], [1.0], [0.0], [3.0]], 0, [[1.0], [2.0]], dict(active=2, prefix=0), 2, 1, 1.0)
    check(sc == [2 ** -5 + 2 ** -5 + 2 ** -6 + 2 ** -3, 2 ** -6 + 1.0], f"loop scores {sc}")
    sc = loop_tile_scores([[1.0], [1.0], [0.0], [3.0]], 0, [[1.0], [2.0]], dict(active=2, prefix=1), 2, 1, 1.0)
    check(sc == [2 ** -5 + 2 ** -5 + 2 ** -6 + 2 ** -3, 2 ** -4 + 2 ** -4 + 2 ** -6 + 1.0], f"loop prefix {sc}")

    # compare: one marginal and one structural disagreement
    pub, ours, ref = bytes([1, 0, 1, 1]), bytes([1, 1, 0, 1]), bytes([1, 0, 1, 1])
    c = compare(pub, ours, ref, [None, 5e-4, None, None], [dict(req=0, m=0)], 1, 4, 1e-3)
    check((c["disagree"], c["marginal"], c["nonmarginal"], c["ref_vs_ours"], c["ref_vs_published"]) ==
          (2, 1, 1, 2, 0), f"compare {c}")

    # .npy: header length a multiple of 64 and a round trip
    with tempfile.TemporaryDirectory() as d:
        for shape in [(2, 3, 4), (5,), (1, 7)]:
            n = 1
            for x in shape:
                n *= x
            path = os.path.join(d, "a.npy")
            npy_write(path, "|u1", shape, bytes(range(n)))
            descr, back, data = npy_read(path)
            check(len(npy_header("|u1", shape)) % 64 == 0, f"npy header length {shape}")
            check((descr, back, data) == ("|u1", shape, bytes(range(n))), f"npy round trip {shape}: {back}")
    for f in fails:
        print(f"FAIL {f}")
    print(f"flashprefill_index self-test: {len(fails)} failed")
    return 1 if fails else 0


# ------------------------------------------------------------------------------------- device parts
def tensor_bytes(t):
    """The bytes of a tensor (copied to the host, contiguous) without numpy."""
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def make_inputs(torch, lens, block_n, seed):
    """Seeded bf16 q (T, Hq, D), k, v (T, Hkv, D) on the device: queries biased along one direction u per
    KV head; ~30% of each request's key blocks shifted along it by 3 s, s uniform in [0.5, 4]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, g = sum(lens), HQ // HKV
    u = torch.randn((HKV, D), device="cuda", generator=gen)
    u = u / u.norm(dim=1, keepdim=True)
    q = torch.randn((T, HQ, D), device="cuda", generator=gen) + 4.0 * u.repeat_interleave(g, dim=0)[None]
    k = torch.randn((T, HKV, D), device="cuda", generator=gen)
    start = 0
    for n in lens:
        nb = (n + block_n - 1) // block_n
        hot = torch.rand((nb, HKV), device="cuda", generator=gen) < 0.3
        s = 3.0 * (0.5 + 3.5 * torch.rand((nb, HKV), device="cuda", generator=gen)) * hot
        shift = (s[:, :, None] * u[None]).repeat_interleave(block_n, dim=0)[:n]  # (n, Hkv, D)
        k[start:start + n] += shift
        start += n
    v = torch.randn((T, HKV, D), device="cuda", generator=gen)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


def paged(torch, k, lens, page):
    """k (T, Hkv, D) as a paged cache (pages, page, Hkv, D): each request's pages consecutive, its last
    page zero-padded; the block table (B, max pages) int32."""
    counts = [(n + page - 1) // page for n in lens]
    cache = torch.zeros((sum(counts), page, HKV, D), dtype=k.dtype, device=k.device)
    table = torch.zeros((len(lens), max(counts)), dtype=torch.int32, device=k.device)
    tok = pg = 0
    for r, (n, c) in enumerate(zip(lens, counts)):
        flat = cache[pg:pg + c].view(c * page, HKV, D)
        flat[:n] = k[tok:tok + n]
        table[r, :c] = torch.arange(pg, pg + c, dtype=torch.int32, device=k.device)
        tok, pg = tok + n, pg + c
    return cache, table


def reference_scores(torch, q, k, lens, geom, p, max_kb):
    """S (Hkv, total_q_tiles, max_kb) in float64 by the rule of sparse.h (0 where not scored)."""
    g = HQ // HKV
    c = (1.0 / math.sqrt(D)) * math.log2(math.e)
    tiles = len(geom)
    S = torch.zeros((HKV, tiles, max_kb), dtype=torch.float64, device="cuda")
    tok = t0 = 0
    for r, n in enumerate(lens):
        nb, rows = (n + p.block_n - 1) // p.block_n, n * g
        nt = (rows + p.block_m - 1) // p.block_m
        kr = k[tok:tok + n].double()
        pad = nb * p.block_n - n
        sums = torch.nn.functional.pad(kr, (0, 0, 0, 0, 0, pad)).view(nb, p.block_n, HKV, D).sum(1)
        cnt = torch.full((nb,), float(p.block_n), dtype=torch.float64, device="cuda")
        cnt[-1] = n - (nb - 1) * p.block_n
        kbar = (sums / cnt[:, None, None]).to(torch.bfloat16).double()  # (nb, Hkv, D)
        prefix = geom[t0]["prefix"]  # 0 here: self-attention prefill, kv_len = q_len
        pos = torch.arange(nt * p.block_m, device="cuda") // g
        row_ok = torch.arange(nt * p.block_m, device="cuda") < rows
        contrib = (prefix + pos)[:, None] >= (torch.arange(nb, device="cuda") * p.block_n)[None, :]
        active = torch.tensor([geom[t0 + m]["active"] for m in range(nt)], device="cuda")
        scored = torch.arange(nb, device="cuda")[None, :] < active[:, None]  # (nt, nb)
        valid = (contrib & row_ok[:, None]).view(nt, p.block_m, nb) & scored[:, None, :]
        for h in range(HKV):
            qp = q[tok:tok + n, h * g:(h + 1) * g].double().reshape(rows, D)
            qp = torch.nn.functional.pad(qp, (0, 0, 0, nt * p.block_m - rows))
            l = (qp @ kbar[:, h].T * c).view(nt, p.block_m, nb)
            l = torch.where(valid, l, torch.tensor(-math.inf, dtype=torch.float64, device="cuda"))
            m = l.amax(dim=(1, 2))
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            S[h, t0:t0 + nt, :nb] = torch.exp2(l - m[:, None, None]).sum(1)
        tok, t0 = tok + n, t0 + nt
    return S


def reference_check(torch, seed):
    """reference_scores against loop_tile_scores (block means by plain double sums) on a small ragged
    batch, at block_n 64 and 128, KV heads 0 and Hkv - 1: the largest relative difference."""
    lens, g, worst = (130, 300), HQ // HKV, 0.0
    c = (1.0 / math.sqrt(D)) * math.log2(math.e)
    for block_n in (64, 128):
        p = Params(block_n=block_n, alpha=0.5)
        q, k, _ = make_inputs(torch, lens, block_n, seed)
        geom = tile_geometry(list(lens), list(lens), g, p)
        max_kb = (max(lens) + block_n - 1) // block_n
        S = reference_scores(torch, q, k, lens, geom, p, max_kb).cpu()
        qd, kd = q.double().cpu(), k.double().cpu()
        for h in (0, HKV - 1):
            tok = t0 = 0
            for n in lens:
                nb = (n + block_n - 1) // block_n
                means = []
                for b in range(nb):
                    keys = kd[tok + b * block_n:tok + min(n, (b + 1) * block_n), h].tolist()
                    means.append([sum(col) / len(keys) for col in zip(*keys)])
                kbar = torch.tensor(means, dtype=torch.float64).to(torch.bfloat16).double().tolist()
                rows = qd[tok:tok + n, h * g:(h + 1) * g].reshape(n * g, D).tolist()
                nt = (n * g + p.block_m - 1) // p.block_m
                for m in range(nt):
                    gt = geom[t0 + m]
                    want = loop_tile_scores(rows[m * p.block_m:(m + 1) * p.block_m], m * p.block_m, kbar, gt, g,
                                            block_n, c)
                    got = S[h, t0 + m, :gt["active"]].tolist()
                    for x, y in zip(got, want):
                        worst = max(worst, abs(x - y) / max(abs(y), 1e-300))
                    if any(S[h, t0 + m, gt["active"]:].tolist()):
                        worst = math.inf  # nothing past the scored blocks
                tok, t0 = tok + n, t0 + nt
    return worst


def find_file(given, candidates):
    if given:
        return given if os.path.isfile(given) else None
    for c in candidates:
        if os.path.isfile(c):
            return c
    return None


def run_case(torch, pub_mod, upf, name, lens, block_n, alpha, page, min_sparse, args, seed):
    p = Params(block_n=block_n, alpha=alpha, min_sparse_q_len=min_sparse)
    g = HQ // HKV
    res = dict(name=f"sparse.index/flashprefill/bf16/{name}", lens=list(lens), hq=HQ, hkv=HKV, d=D,
               block_m=p.block_m, block_n=block_n, alpha=alpha, sink=p.sink, window=p.window, last_n=p.last_n,
               min_sparse_q_len=min_sparse, page_size=page, seed=seed)
    geom = tile_geometry(list(lens), list(lens), g, p)
    max_kb = (max(lens) + block_n - 1) // block_n
    q, k, v = make_inputs(torch, lens, block_n, seed)
    cu_list = [0]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    seqlens = torch.tensor(list(lens), dtype=torch.int32, device="cuda")

    # the published index
    cache, table = paged(torch, k, lens, page)
    t = time.perf_counter()
    try:
        b_cu, b_idx, total_tiles, _ = pub_mod.build_block_sparse_index(
            q, cache, table, seqlens, cu, k_block_m=p.block_m, k_block_n=block_n, abs_threshold=alpha,
            attention_sink=p.sink, window_size=p.window, last_n_blocks=p.last_n, min_sparse_q_len=min_sparse,
            causal=True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the peer's own failure, told apart from ours
        res.update(status="fail", error=f"the published build_block_sparse_index raised {type(e).__name__}: "
                   f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}")
        return res
    res["published_s"] = time.perf_counter() - t  # first call: Triton compiles; for information only
    del cache, table
    if total_tiles != len(geom):
        res.update(status="fail", error=f"published total_q_tiles {total_tiles} != {len(geom)} of the geometry")
        return res
    pub = decode_csr(b_cu.tolist(), b_idx.tolist(), HKV, geom, max_kb, block_n)

    # ours
    with tempfile.TemporaryDirectory(prefix="upf-fp-index-") as tmp:
        d = args.keep_inputs or tmp
        os.makedirs(d, exist_ok=True)
        paths = {x: os.path.join(d, f"{x}.npy") for x in ("q", "k", "v", "cu", "o", "blk")}
        for x, tens in (("q", q), ("k", k), ("v", v)):
            npy_write(paths[x], "<u2", tuple(tens.shape), tensor_bytes(tens.view(torch.int16)))
        npy_write(paths["cu"], "<i4", (len(cu_list),), struct.pack(f"<{len(cu_list)}i", *cu_list))
        cmd = [upf, "block-sparse", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--cu-seqlens",
               paths["cu"], "--alpha", repr(alpha), "--block-m", str(p.block_m), "--block-n", str(block_n),
               "--sink", str(p.sink), "--window", str(p.window), "--last-n", str(p.last_n),
               "--min-sparse-q-len", str(min_sparse), "--backend", "cuda", "--out", paths["o"],
               "--out-blocks", paths["blk"]]
        res["upf_command"] = " ".join(cmd)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=upf_env(upf), timeout=args.upf_timeout)
        except subprocess.TimeoutExpired:
            res.update(status="fail", error=f"upf ran past {args.upf_timeout} s")
            return res
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            res.update(status="fail", error=f"upf exited {proc.returncode}: {' | '.join(tail)}")
            return res
        descr, shape, data = npy_read(paths["blk"])
    want_shape = (HKV, len(geom), max_kb)
    if descr != "|u1" or shape != want_shape or len(data) != len(pub):
        res.update(status="fail", error=f"BLK {descr} {shape} ({len(data)} bytes), expected |u1 {want_shape}")
        return res
    if any(x > 1 for x in set(data)):
        res.update(status="fail", error="BLK holds values other than 0 and 1")
        return res

    # the float64 reference
    S = reference_scores(torch, q, k, lens, geom, p, max_kb).flatten().tolist()
    ref, rels = bytearray(len(pub)), [None] * len(pub)
    thresholded = thresholded_kept = near = 0
    tiles = len(geom)
    for s in range(HKV * tiles):
        gt = geom[s % tiles]
        lo = s * max_kb
        keep, rel = ref_segment(S[lo:lo + max_kb], gt, max_kb, p)
        ref[lo:lo + max_kb] = bytes(keep)
        rels[lo:lo + max_kb] = rel
        for b, x in enumerate(rel):
            if x is not None:
                thresholded += 1
                thresholded_kept += keep[b]
                near += abs(x) <= args.tol
    visible = HKV * sum(gt["last_k"] + 1 for gt in geom)
    c = compare(pub, bytes(data), ref, rels, geom, HKV, max_kb, args.tol)
    res.update(c)
    res.update(visible_blocks=visible, kept_published=sum(pub), kept_ours=sum(data), kept_reference=sum(ref),
               kept_share_published=sum(pub) / visible, kept_share_ours=sum(data) / visible,
               thresholded_blocks=thresholded, thresholded_kept=thresholded_kept, near_threshold=near)
    bad = []
    if c["nonmarginal"]:
        bad.append(f"{c['nonmarginal']} non-marginal disagreements of ours")
    if c["ref_vs_published_nonmarginal"]:
        bad.append(f"{c['ref_vs_published_nonmarginal']} non-marginal disagreements of the float64 reference "
                   "with the published (reference or decoding at fault)")
    res["status"] = "fail" if bad else "ok"
    if bad:
        res["error"] = "; ".join(bad)
    return res


def upf_env(upf):
    """The environment for upf: a staged bundle's lib/ (bin/upf beside lib/) on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(upf))), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def summary_line(r):
    if "disagree" not in r:
        return f"{r['name']:64s} {r['status'].upper()}: {r.get('error', '')}"
    line = (f"{r['name']:64s} blocks {r['blocks']:8d} agree {r['agree']:8d} disagree {r['disagree']:4d} "
            f"(marginal {r['marginal']}, max|rel| {r['max_abs_rel']:.1e})  "
            f"kept pub {100 * r['kept_share_published']:5.2f}% ours {100 * r['kept_share_ours']:5.2f}%  "
            f"thresholded kept {r['thresholded_kept']}/{r['thresholded_blocks']}  "
            f"ref-vs-pub {r['ref_vs_published']} ref-vs-ours {r['ref_vs_ours']}  {r['status']}")
    if r["status"] != "ok":
        line += f": {r.get('error', '')}"
    return line


def driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upf", default="", help="the upf binary (default: bin/upf, else build/upf, from the working "
                    "folder or beside this script's bundle/checkout)")
    ap.add_argument("--published", default="", help=f"the published module (default {PUBLISHED_LOCAL} of the "
                    "working folder or of the checkout)")
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument("--only", default="", help="regex: run only the cases whose name matches")
    ap.add_argument("--tol", type=float, default=1e-3, help="relative distance to the threshold counted marginal")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--upf-timeout", type=int, default=300, help="seconds one upf block-sparse run may take")
    ap.add_argument("--keep-inputs", default="", help="write the .npy inputs and outputs here (last case's stay)")
    ap.add_argument("--self-test", action="store_true", help="check decoding, geometry, rule and .npy; no GPU")
    args = ap.parse_args()
    if args.self_test:
        try:
            return self_test()
        except Exception as e:  # noqa: BLE001 - a check that throws is a failed self-test
            print(f"FAIL self-test raised {type(e).__name__}: {e}")
            return 1

    here = os.path.dirname(os.path.abspath(__file__))
    upf = find_file(args.upf, ["bin/upf", os.path.join(here, "..", "bin", "upf"), "build/upf",
                               os.path.join(here, "..", "..", "build", "upf")])
    if not upf:
        print(f"flashprefill_index: no upf binary ({args.upf or 'bin/upf, build/upf'}): pass --upf", file=sys.stderr)
        return 2
    published = find_file(args.published, [PUBLISHED_LOCAL, os.path.join(here, "..", "..", PUBLISHED_LOCAL)])
    if not published:
        print(f"flashprefill_index: the published module is not at {args.published or PUBLISHED_LOCAL}: fetch "
              f"{PUBLISHED_REPO}@{PUBLISHED_COMMIT[:7]}:{PUBLISHED_PATH} there (carry .peers) or pass --published",
              file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as e:
        print(f"flashprefill_index: cannot import torch: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("flashprefill_index: no CUDA device visible to torch", file=sys.stderr)
        return 2
    import importlib.util
    try:
        spec = importlib.util.spec_from_file_location("flashprefill_published_index", published)
        pub_mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pub_mod  # Triton's JIT looks functions' modules up by name
        spec.loader.exec_module(pub_mod)
        pub_mod.build_block_sparse_index  # noqa: B018 - the entry point must be there
    except Exception as e:  # noqa: BLE001 - any failure to import is reported, then the run stops
        print(f"flashprefill_index: cannot import the published module {published}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    with open(published, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    from peer_common import context, write_report
    import triton
    report = dict(context=context(dict(driver=driver_version(), triton=triton.__version__, upf=upf)),
                  published=dict(repo=PUBLISHED_REPO, commit=PUBLISHED_COMMIT, path=PUBLISHED_PATH, file=published,
                                 sha256=sha),
                  tolerance=args.tol, results=[])
    print(f"published {PUBLISHED_REPO}@{PUBLISHED_COMMIT[:7]} ({published}, sha256 {sha[:12]}), upf {upf}, "
          f"{report['context']['gpu']}, driver {report['context']['driver']}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    try:
        worst = reference_check(torch, args.seed)
        why = ""
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        worst, why = math.inf, f" ({type(e).__name__}: {e})"
    report["reference_check"] = dict(max_rel_diff=worst if math.isfinite(worst) else "inf",
                                     status="ok" if worst <= 1e-9 else "fail" + why)
    print(f"reference check: float64 scores against plain loops, max relative difference {worst:.1e} "
          f"{report['reference_check']['status']}", flush=True)
    failed = 0 if worst <= 1e-9 else 1
    for i, (name, lens, block_n, alpha, page, min_sparse) in enumerate(CASES):
        if args.only and not re.search(args.only, name):
            continue
        try:
            r = run_case(torch, pub_mod, upf, name, lens, block_n, alpha, page, min_sparse, args, args.seed + i)
        except Exception as e:  # noqa: BLE001 - a case that throws is a failed case; the others still run
            r = dict(name=f"sparse.index/flashprefill/bf16/{name}", status="fail", error=f"{type(e).__name__}: {e}")
        failed += r["status"] != "ok"
        print(summary_line(r), flush=True)
        for x in r.get("listed", []):
            rel = "structural" if x["rel"] is None else f"rel {x['rel']}" if isinstance(x["rel"], str) \
                else f"rel {x['rel']:+.2e}"
            print(f"    head {x['head']} tile {x['tile']} (req {x['req']} m {x['m']}) block {x['block']}: "
                  f"published {x['published']} ours {x['ours']} reference {x['reference']} ({rel})")
        report["results"].append(r)
        torch.cuda.empty_cache()
    if args.json:
        write_report(report, args.json)
    ok = sum(r["status"] == "ok" for r in report["results"])
    print(f"{ok} passed, {len(report['results']) - ok} failed"
          + ("" if worst <= 1e-9 else " (and the reference check)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

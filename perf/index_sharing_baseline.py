#!/usr/bin/env python3
"""The neighbour share (upf prefill --index-sharing) that FlashPrefill-shaped lists would have if they were
drawn afresh for every query tile (the benchmarks' random rows) or as vertical stripes (one ranking per KV
head), at a model's geometry and kept share: the two ends a model's measured share sits between.

Same tiles and forced blocks as the index (block_m packed rows of g heads, block_n keys, the sink and window
blocks and the last_n dense tiles kept), the other visible blocks kept with the probability that brings a tile
to the kept share, as perf/bench_sparse.c draws them.

  perf/index_sharing_baseline.py --tokens 7639 --group 3 --block-n 128 --share 0.233
"""
import argparse
import random


def neighbour_share(tokens, group, block_m, block_n, share, sink, window, last_n, stripes, seed):
    rng = random.Random(seed)
    tiles = -(-tokens * group // block_m)
    draw, lists, visible = {}, [], 0
    for m in range(tiles):
        last_k = min((block_m * (m + 1) - 1) // group, tokens - 1) // block_n
        seen = last_k + 1
        visible += seen
        dense = m >= tiles - last_n
        forced = {b for b in range(seen) if dense or b < sink or b >= last_k - window + 1}
        want, cand = share * seen - len(forced), seen - len(forced)
        p = want / cand if want > 0 and cand > 0 else 0.0
        kept = set(forced)
        for b in range(seen):
            if b not in forced and (draw.setdefault(b, rng.random()) if stripes else rng.random()) < p:
                kept.add(b)
        lists.append(kept)
    shared = sum(len(lists[m] & lists[m - 1]) for m in range(1, tiles))
    total = sum(len(lists[m]) for m in range(1, tiles))
    return sum(len(k) for k in lists) / visible, shared / total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--group", type=int, required=True, help="q heads per KV head")
    ap.add_argument("--share", type=float, required=True, help="kept share of the visible key blocks")
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--sink", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--last-n", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    for stripes in (False, True):
        kept, shared = neighbour_share(a.tokens, a.group, a.block_m, a.block_n, a.share, a.sink, a.window,
                                       a.last_n, stripes, a.seed)
        print(f"{'stripes' if stripes else 'random'}: kept share {kept:.3f}, neighbour share {shared:.3f}")


if __name__ == "__main__":
    main()

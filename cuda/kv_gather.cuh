/* Paged K/V gathered into contiguous rows for the wgmma kernels (C++ header, CUDA sources only): the
 * Hopper attention kernels' producers read contiguous K/V rows (one 64-bit add a row); a chunk of prefill
 * over a paged cache (pages of 16 tokens) has its visible keys copied out first, at copy bandwidth, then
 * runs the contiguous kernel. attn.paged's long query runs (cuda/attn.cu) and attn.block_sparse's paged
 * calls with pages that do not hold whole 64-key blocks (cuda/attn_sparse.cu) use it. */
#ifndef UNIPREFILL_CUDA_KV_GATHER_CUH
#define UNIPREFILL_CUDA_KV_GATHER_CUH

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/status.h"

/* Requests a gather describes (one launch), and bytes of K and V a group gathers (one long request alone
 * may exceed it). */
constexpr int KV_GATHER_REQS = 8;
constexpr size_t KV_GATHER_CAP = (size_t)2 << 30;

/* A paged bf16 cache (pages, P, Hkv, D) with element strides s0 (page), s1 (slot), s2 (head); 16-byte
 * rows (D a multiple of 8, strides multiples of 8, 16-byte aligned base). */
struct kv_paged_view {
  const void *k, *v;
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
  const int32_t *block_table; /* device (B, max_blocks) */
  int32_t max_blocks, page_size;
  int hkv, d;
};

/* One group: keys [start[i], start[i] + len[i]) of block-table row row[i] go to the gathered rows
 * base[i] .. base[i] + len[i] - 1; rows in all. */
struct kv_gather_group {
  int32_t n;
  int32_t row[KV_GATHER_REQS], start[KV_GATHER_REQS], len[KV_GATHER_REQS], base[KV_GATHER_REQS];
  int64_t rows;
};

/* Fills g with the requests from `first` on (block-table row, first key and key count from the arrays)
 * while they fit KV_GATHER_REQS and KV_GATHER_CAP (the first always); returns how many it took. */
int kv_gather_plan(const int32_t *row, const int32_t *start, const int32_t *len, int first, int count,
                   size_t row_bytes, kv_gather_group *g);

/* Enqueues the copy of g's keys into the process's grow-only gather buffer (growing it waits for the
 * stream) and returns the contiguous K and V, each (g.rows, Hkv, D) with row stride Hkv D. */
upf_status kv_gather(const kv_paged_view &src, const kv_gather_group &g, void **k_rows, void **v_rows);

#endif

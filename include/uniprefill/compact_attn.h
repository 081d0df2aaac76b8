/* CompactAttention, the chunked-prefill baseline (SPEC.md section 9): the block-union table of one
 * chunk's kept key blocks per (request, KV head), its conversion to per-(request, KV head) block tables
 * over the paged cache, and the two ways to run a layer's attention over it (zero-copy through
 * attn.paged, and the gather-then-attn.prefill comparison). The ops are in the backend table
 * (uniprefill/ops.def):
 *   compact.block_union   table |u1 (B, Hkv, key_blocks) and counts (B, Hkv) from a sparse.index
 *   compact.block_tables  per pseudo-request (r, h): the pages of its kept blocks and its kept kv_len
 *
 * Choices the paper leaves open (no public code; docs/compactattention.md has the reasoning):
 *  - The selector is FlashPrefill V2's (uniprefill/sparse.h) run over the chunk: its PackGQA query tiles
 *    already mix the g query heads of a KV head, so "union over query blocks, then over the heads of a
 *    GQA group" is the union over the request's tiles of that KV head's CSR rows. The selector's own
 *    forced blocks stay in it; its default last_n 2 makes the chunk's last tiles dense (a dense union),
 *    so CompactAttention callers pass last_n 0.
 *  - Forced blocks, request r with q_len queries and kv_len keys (prefix = kv_len - q_len): every block
 *    holding a key of the chunk, prefix / block_n .. (kv_len - 1) / block_n (a block the chunk starts
 *    inside is kept whole), and the `recent` blocks before the first of them. A request with q_len 0
 *    keeps nothing (count 0, kept kv_len 0).
 *  - Blocks are block_n keys (the selector's), a multiple of the cache's page size, so a kept block is
 *    whole pages; only the request's tail block can be partial and it is always kept (it is the chunk's),
 *    so it comes last and the kept keys clip there.
 *  - Pseudo-request (r, h) is row h * B + r of the block tables (KV-head-major), so the B rows of head h
 *    are one contiguous attn.paged batch whose q and out are the (Tq, g, D) views of heads h g .. h g + g
 *    - 1 and whose caches are the (pages, P, 1, D) views of head h of the shared (pages, P, Hkv, D) cache:
 *    no K/V is copied. Bottom-right alignment stays exact: the chunk's blocks are kept and last, so query
 *    t at original position prefix + t sits at kept position kept_len - q_len + t and sees exactly the kept
 *    keys before it. */
#ifndef UNIPREFILL_COMPACT_ATTN_H
#define UNIPREFILL_COMPACT_ATTN_H

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/attn.h"
#include "uniprefill/sparse.h"
#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int32_t recent; /* key blocks before the chunk's first block always kept, >= 0 (default 2) */
} upf_compact_params;

upf_compact_params upf_compact_params_default(void);
upf_status upf_compact_params_check(const upf_compact_params *cp);

/* The per-(request, KV head) block tables (compact.block_tables' output). Row h * B + r is
 * pseudo-request (r, h). Device arrays in backend memory; the host copies, when set, are what the
 * execution paths below read for the checks and the launch plans. */
typedef struct {
  int32_t *block_table;            /* (Hkv, B, max_blocks) backend memory: page ids, -1 past the kept pages */
  int32_t *kv_lens;                /* (Hkv, B) backend memory: kept keys of (r, h) */
  const int32_t *block_table_host; /* (Hkv, B, max_blocks) host copy (NULL until downloaded) */
  const int32_t *kv_lens_host;     /* (Hkv, B) host copy */
  int32_t max_blocks;              /* row stride, >= ceil(max kv_len / page_size) of the chunk batch */
} upf_compact_tables;

/* ---- Checks shared by the backends (messages name op and operand) ---- */

/* compact.block_union: the batch as sparse.index takes it (host cu_seqlens_q, kv_len >= q_len), hq query
 * heads, the index's row_ptr and blocks non-NULL, table (B, Hkv, max_key_blocks) u8 contiguous (Hkv its
 * dim 1), counts non-NULL. Fills plan (free with upf_sparse_plan_free) on success. */
upf_status upf_compact_union_check(const upf_sparse_batch *b, int32_t hq, const upf_sparse_params *p,
                                   const upf_sparse_index *index, const upf_compact_params *cp,
                                   const upf_tensor *table, const int32_t *counts, upf_sparse_plan *plan);
/* compact.block_tables: the paged batch's host lengths and block table (kv_len >= q_len, the pages a
 * request reaches within max_blocks), block_n a positive multiple of page_size, table (B, Hkv, nb) u8
 * contiguous with nb >= ceil(max kv_len / block_n), out's arrays non-NULL and out->max_blocks >=
 * ceil(max kv_len / page_size). */
upf_status upf_compact_tables_check(const upf_attn_paged *batch, const upf_tensor *table, int32_t block_n,
                                    const upf_compact_tables *out);

/* The forced blocks of a request: [*lo, *hi] (empty, *lo > *hi, when q_len is 0). */
static inline void upf_compact_forced(int32_t q_len, int32_t kv_len, int32_t block_n, int32_t recent, int32_t *lo,
                                      int32_t *hi) {
  if (q_len <= 0) {
    *lo = 0, *hi = -1;
    return;
  }
  const int32_t first = (kv_len - q_len) / block_n;
  *lo = first - recent > 0 ? first - recent : 0;
  *hi = (kv_len - 1) / block_n;
}

/* ---- Execution (layers/compact_attn.c): attention of one chunk over the kept blocks ---- */

struct upf_backend;

/* out (Tq, Hq, D) = attention of the chunk batch `batch` (its cu_seqlens_q; q (Tq, Hq, D)) over the
 * kept keys of t (host copies required): for each KV head h one attn.paged call over the B
 * pseudo-requests of h, on views (no K/V copy). k_cache, v_cache (pages, P, Hkv, D); p as attn.paged
 * takes it (window 0). */
upf_status upf_compact_attn_zero_copy(const struct upf_backend *be, const upf_attn_paged *batch,
                                      const upf_compact_tables *t, const upf_tensor *q, const upf_tensor *k_cache,
                                      const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out);
/* The comparison: per KV head, gather the kept keys and values of head h into contiguous buffers
 * (compact.rows over the cache's (pages P Hkv, D) rows; the caches must be contiguous), then
 * attn.prefill. Same result as the zero-copy path (the same keys in the same order). */
upf_status upf_compact_attn_copy(const struct upf_backend *be, const upf_attn_paged *batch,
                                 const upf_compact_tables *t, const upf_tensor *q, const upf_tensor *k_cache,
                                 const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out);

/* ---- Scratch kept across calls ---- */

/* One grow-only buffer of a workspace. */
typedef struct {
  void *ptr;
  size_t bytes;
} upf_compact_buf;

/* What upf_compact_select and the *_ws paths use from one call to the next: every buffer grows to the
 * largest call seen and is kept, so a model's layers and chunks of one shape allocate nothing after the
 * first. Zero it before first use (the first call binds it to its backend); free it with
 * upf_compact_workspace_free. The tables stay on the backend; the host gets only the union table
 * (B Hkv key_blocks bytes), from which it derives the host copies attn.paged checks and plans from (the
 * CPU reference of compact.block_tables: integer logic, the same values as the backend's). */
typedef struct {
  const struct upf_backend *be; /* bound by the first call */
  /* backend memory */
  upf_compact_buf kbar;        /* (B, key_blocks, Hkv, D) the caches' dtype */
  upf_compact_buf row_ptr;     /* (S + 1) int32 */
  upf_compact_buf blocks;      /* (S * key_blocks) int32 */
  upf_compact_buf table;       /* (B, Hkv, key_blocks) u8 */
  upf_compact_buf counts;      /* (B, Hkv) int32 */
  upf_compact_buf block_table; /* (Hkv, B, max_blocks) int32 */
  upf_compact_buf kv_lens;     /* (Hkv, B) int32 */
  upf_compact_buf gather_index, gather_cu, k_rows, v_rows; /* the copy path: (n) (B+1) int32, (n, D) x 2 */
  /* host */
  upf_compact_buf table_host;       /* (B, Hkv, key_blocks) u8: the last selection's union (--dump-tables) */
  upf_compact_buf block_table_host; /* (Hkv, B, max_blocks) int32 */
  upf_compact_buf kv_lens_host;     /* (Hkv, B) int32 */
  upf_compact_buf gather_index_host, gather_cu_host; /* the copy path */
  int64_t allocations; /* buffers (re)allocated so far: unchanged by a call no larger than an earlier one */
  /* the last upf_compact_select's result */
  upf_compact_tables tables; /* backend arrays and their host copies, in the buffers above */
  int32_t num_reqs, hkv, key_blocks; /* table_host's shape */
  int64_t kept_blocks;               /* set entries of table_host */
} upf_compact_workspace;

/* Releases the buffers (after a synchronize: an attention may still read them) and zeroes ws. */
void upf_compact_workspace_free(upf_compact_workspace *ws);

/* The selector end to end over the chunk batch: sparse.block_means and sparse.index with sp (use last_n
 * 0), compact.block_union with cp, compact.block_tables; leaves the result in ws (tables, table_host,
 * kept_blocks). */
upf_status upf_compact_select(const struct upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                              const upf_tensor *k_cache, const upf_sparse_params *sp, const upf_compact_params *cp,
                              upf_compact_workspace *ws);
/* upf_compact_attn_copy with its gather buffers in ws. */
upf_status upf_compact_attn_copy_ws(const struct upf_backend *be, const upf_attn_paged *batch,
                                    const upf_compact_tables *t, const upf_tensor *q, const upf_tensor *k_cache,
                                    const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                                    upf_compact_workspace *ws);
/* upf_compact_attend with every buffer in ws: the union table and its kept count stay there
 * (ws->table_host, ws->kept_blocks). */
upf_status upf_compact_attend_ws(const struct upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                                 const upf_tensor *k_cache, const upf_tensor *v_cache, const upf_sparse_params *sp,
                                 const upf_compact_params *cp, const upf_attn_params *p, int copy_path,
                                 const upf_tensor *out, upf_compact_workspace *ws);

/* One layer's chunk rows end to end (what a model mode calls in place of attn.paged for the chunks):
 * sparse.block_means and sparse.index over the chunk batch with sp (use last_n 0: the default 2 keeps
 * the last tiles dense), compact.block_union with cp, compact.block_tables, then the zero-copy path (or,
 * copy_path 1, the copy path) with p. Scratch comes from be per call (upf_compact_attend_ws keeps it).
 * table_host, when not NULL, gets the table (B, Hkv, ceil(max kv_len / block_n)) |u1 (the --dump-tables
 * layout); kept_blocks, when not NULL, the sum of the counts. */
upf_status upf_compact_attend(const struct upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                              const upf_tensor *k_cache, const upf_tensor *v_cache, const upf_sparse_params *sp,
                              const upf_compact_params *cp, const upf_attn_params *p, int copy_path,
                              const upf_tensor *out, uint8_t *table_host, int64_t *kept_blocks);

#ifdef __cplusplus
}
#endif
#endif

/* FlashPrefill V2, the block-sparse prefill baseline (SPEC.md section 8): its parameters, the batch its
 * three ops take (contiguous or paged K/V), the index they exchange, the host-side plan every backend
 * shares, and the checks. The ops themselves are in the backend table (uniprefill/ops.def):
 *   sparse.block_means  kbar, vbar (B, max_key_blocks, Hkv, D): mean of each block_n keys (values)
 *   sparse.index        per (KV head, query tile) the block scores and the CSR list of kept key blocks
 *   attn.block_sparse   attention over the index, optionally mean-corrected
 *
 * What the published implementation (qhfan/FlashPrefillv2, flash_block_sparse_index_triton.py and
 * test_mean_correction.py) pins and this header follows (the rest is SPEC section 8; docs/flashprefill.md
 * lists each detail and where we depart):
 *  - PackGQA: packed row p of a request = query position p / g, head h * g + p % g; a query tile holds
 *    block_m packed rows, so a request has ceil(q_len * g / block_m) tiles. Segment s = h * total_q_tiles
 *    + (the request's first tile) + m: the tiles of all requests in order, per KV head.
 *  - Tile t covers positions q_first = (t block_m) / g .. q_last = (min((t+1) block_m, q_len g) - 1) / g;
 *    with prefix = kv_len - q_len, first_k = (prefix + q_first) / block_n, last_k = (prefix + q_last) /
 *    block_n. Blocks after last_k are never kept.
 *  - Scored blocks: b < active = (prefix + q_last + 1) / block_n (blocks wholly visible to the tile's last
 *    row). Row p contributes to block b iff b's FIRST key is visible to it: prefix + p / g >= b block_n.
 *    l[p, b] = scale log2(e) q_p . kbar_b, with kbar rounded to the input dtype (bf16 inputs: bf16 means);
 *    m_t = max of the contributing l; S[t, b] = sum of 2^(l[p, b] - m_t) over the contributing rows.
 *  - Keep b <= last_k iff (b < active and S[t, b] >= alpha max_b S[t, b]) or b < sink or
 *    b >= first_k - window + 1 (the window ends at the tile's last diagonal block).
 *  - Dense tiles keep every b <= last_k unscored: the last last_n tiles of a request, and every tile of
 *    a request with q_len <= min_sparse_q_len (published: `q_len <= min_sparse_q_len`).
 *  - Mean correction: an unkept block b < min(nb, (prefix + q_first) / block_n) (wholly visible to every
 *    row of the tile) adds one softmax term of logit scale q . kbar_b + ln(block_n) and value vbar_b;
 *    kbar, vbar rounded to the input dtype.
 * Our departures: window >= 1 (published allows 0, where a row can be left with no visible key), and
 * the index lists logical block_n blocks (published: 64-key physical tiles); the attention reads the
 * same keys either way. */
#ifndef UNIPREFILL_SPARSE_H
#define UNIPREFILL_SPARSE_H

#include <stdint.h>

#include "uniprefill/attn.h"
#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  float alpha;              /* [0, 1]: keep b iff S[t,b] >= alpha max_b S[t,b]; larger is sparser; 0 keeps all */
  int32_t block_m;          /* packed (query, head) rows a query tile: a multiple of 16 (default 128) */
  int32_t block_n;          /* keys a block: 64 or 128 (default 64) */
  int32_t sink;             /* leading blocks always kept (default 2) */
  int32_t window;           /* blocks always kept, ending at the tile's last diagonal block, >= 1 (default 4) */
  int32_t last_n;           /* last query tiles of a request kept dense (default 2) */
  int32_t min_sparse_q_len; /* requests with q_len <= this run dense (default 0) */
  int32_t mean_correction;  /* 1: unkept wholly visible blocks add their mean term */
  float scale;              /* softmax scale; 0 means 1/sqrt(D) */
} upf_sparse_params;

/* The published defaults: alpha 1, block_m 128, block_n 64, sink 2, window 4, last_n 2,
 * min_sparse_q_len 0, no mean correction, scale 1/sqrt(D). */
upf_sparse_params upf_sparse_params_default(void);
/* Range checks (UPF_ERR_INVALID_ARG naming the parameter and its value). */
upf_status upf_sparse_params_check(const upf_sparse_params *p);
/* The scale in effect at head dim d. */
float upf_sparse_scale(const upf_sparse_params *p, int64_t head_dim);

/* The K/V a call reads: exactly one of the two is set. Queries are those of the batch (cu_seqlens_q),
 * bottom-right aligned to their request's kv_len keys (kv_len >= q_len). */
typedef struct {
  const upf_attn_varlen *contiguous; /* k, v (Tkv, Hkv, D): request r's keys at rows cu_seqlens_kv[r] .. */
  const upf_attn_paged *paged;       /* k, v (num_pages, P, Hkv, D) through the block table */
} upf_sparse_batch;

/* Host facts of a batch (from its *_host arrays). */
int32_t upf_sparse_num_reqs(const upf_sparse_batch *b);
const int32_t *upf_sparse_cu_q_host(const upf_sparse_batch *b);
int32_t upf_sparse_kv_len_host(const upf_sparse_batch *b, int32_t r);

/* The launch plan of a batch: query tiles and key blocks. cu_q_tiles is owned (upf_sparse_plan_free). */
typedef struct {
  int32_t num_reqs;       /* B */
  int32_t group;          /* g = Hq / Hkv */
  int32_t hkv;            /* KV heads */
  int32_t total_q_tiles;  /* sum over requests of ceil(q_len g / block_m) */
  int32_t max_key_blocks; /* ceil(max kv_len / block_n), >= 1: the index's row capacity and the means' dim 1 */
  int32_t num_segments;   /* hkv * total_q_tiles */
  int32_t *cu_q_tiles;    /* (B+1) host: request r's tiles are [cu_q_tiles[r], cu_q_tiles[r+1]) */
} upf_sparse_plan;

/* UPF_ERR_SHAPE when segments x max_key_blocks passes INT32_MAX (the index's offsets are int32: one
 * request of 1M tokens at Llama's heads and block_n 64). */
upf_status upf_sparse_plan_make(const upf_sparse_batch *b, int32_t hq, int32_t hkv, const upf_sparse_params *p,
                                upf_sparse_plan *plan);
void upf_sparse_plan_free(upf_sparse_plan *plan);

/* The geometry of one query tile (host and device code alike: plain integer arithmetic). */
typedef struct {
  int32_t req;       /* request */
  int32_t m;         /* tile within the request */
  int32_t q_len, kv_len;
  int32_t q_first, q_last; /* first and last query positions (in the request) of the tile's rows */
  int32_t first_k, last_k; /* key blocks of prefix + q_first and prefix + q_last */
  int32_t active;    /* blocks b < active are scored (wholly visible to q_last) */
  int32_t dense;     /* 1: every b <= last_k is kept, unscored */
  int32_t corr_hi;   /* mean correction covers unkept b < corr_hi */
} upf_sparse_tile;

static inline upf_sparse_tile upf_sparse_tile_at(int32_t req, int32_t m, int32_t q_len, int32_t kv_len,
                                                 int32_t group, const upf_sparse_params *p) {
  upf_sparse_tile t;
  const int64_t rows = (int64_t)q_len * group;
  const int32_t tiles = (int32_t)((rows + p->block_m - 1) / p->block_m);
  const int64_t pbeg = (int64_t)m * p->block_m;
  const int64_t pend = pbeg + p->block_m < rows ? pbeg + p->block_m : rows;
  const int32_t prefix = kv_len - q_len;
  const int32_t nb = (kv_len + p->block_n - 1) / p->block_n;
  t.req = req, t.m = m, t.q_len = q_len, t.kv_len = kv_len;
  t.q_first = (int32_t)(pbeg / group);
  t.q_last = (int32_t)((pend - 1) / group);
  t.first_k = (prefix + t.q_first) / p->block_n;
  t.last_k = (prefix + t.q_last) / p->block_n;
  t.active = (prefix + t.q_last + 1) / p->block_n;
  t.dense = q_len <= p->min_sparse_q_len || m >= tiles - p->last_n;
  t.corr_hi = (prefix + t.q_first) / p->block_n < nb ? (prefix + t.q_first) / p->block_n : nb;
  return t;
}

/* The index (backend memory). Segment s = h * total_q_tiles + tile. */
typedef struct {
  int32_t *row_ptr; /* (S + 1): segment s's kept blocks are blocks[row_ptr[s] .. row_ptr[s+1]) */
  int32_t *blocks;  /* (S * max_key_blocks) capacity: kept block ids, ascending within a segment */
  float *scores;    /* (S, max_key_blocks) or NULL: S[t, b] (fp32) where scored, 0 elsewhere (dense tiles,
                     * b >= active, no row contributing) */
  int64_t kept_total; /* set by the call (host value): row_ptr[S] */
} upf_sparse_index;

/* ---- Shape checks shared by the backends (messages name op and operand) ---- */

/* The batch (exactly one K/V form, cu_seqlens_q valid, kv_len >= q_len), q (Tq, Hq, D) and k, v in its
 * form ((Tkv, Hkv, D) or (pages, P, Hkv, D)), f32 or bf16 of q's dtype, Hq % Hkv == 0, last dim
 * contiguous; v may be NULL where the op does not read it. */
upf_status upf_sparse_batch_check(const char *op, const upf_sparse_batch *b, const upf_tensor *q,
                                  const upf_tensor *k, const upf_tensor *v);
/* The same for an op that reads no queries (sparse.block_means): the lengths and K/V forms, k (and v,
 * when not NULL) in the batch's form. */
upf_status upf_sparse_kv_check(const char *op, const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v);
/* kbar (and vbar, when not NULL) (B, max_key_blocks, Hkv, D), contiguous, in k's dtype. */
upf_status upf_sparse_means_check(const char *op, const upf_sparse_plan *plan, const upf_tensor *k,
                                  const upf_tensor *kbar, const upf_tensor *vbar);

/* Exact FLOPs of block-sparse attention over a host copy of an index (row_ptr (S+1), blocks): 4 D per
 * visible (row, key) pair of the kept blocks (the mean-correction terms, one per row and unkept block,
 * are left out: under 1/block_n of the work they stand for). */
double upf_sparse_attn_flops(const upf_sparse_batch *b, const upf_sparse_plan *plan, const upf_sparse_params *p,
                             int64_t d, const int32_t *row_ptr_host, const int32_t *blocks_host);
/* How much of an index neighbouring tiles share, the L2 reuse block-sparse attention can have: over the
 * segments that have a predecessor (the previous query tile of the same request and KV head), *total their
 * kept blocks and *shared those of them the predecessor also keeps. A list drawn afresh for every tile at kept
 * share s shares about s of its blocks; vertical stripes (nested sets) nearly all. Host copies of the index. */
void upf_sparse_neighbour_blocks(const upf_sparse_plan *plan, const int32_t *row_ptr_host, const int32_t *blocks_host,
                                 int64_t *shared, int64_t *total);
/* Key blocks visible to the tiles (sum over segments of last_k + 1): the denominator of the kept share. */
int64_t upf_sparse_visible_blocks(const upf_sparse_batch *b, const upf_sparse_plan *plan, const upf_sparse_params *p);

#ifdef __cplusplus
}
#endif
#endif

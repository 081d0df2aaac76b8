/* Benchmarks of CompactAttention (uniprefill/compact_attn.h) on the last chunk of a chunked prefill: one
 * request of `total` tokens whose last `chunk` (8K) queries attend over the paged cache (pages of 16), at
 * Llama-3.1-8B heads (Hq 32, Hkv 8, D 128, bf16) and totals 32K, 64K, 128K. Rows per shape:
 *   compact.block_union    the union of a synthetic CSR index (each tile keeps its selector-forced blocks
 *                          and each other visible block with probability `keep`)
 *   compact.block_tables   the block tables of a synthetic union table
 *   compact.select         the selector a layer runs (block means + index + union + tables, and the host
 *                          copies attn.paged plans from; upf_compact_select on a kept workspace) over keys
 *                          with planted high-mass blocks, reporting the share it keeps
 *   compact.attn/dense     attn.paged over the whole prefix: dense chunk attention
 *   compact.attn/zero_copy attn.paged per KV head over the block tables of a synthetic union table
 *   compact.attn/copy      the comparison: gather each head's kept K/V, then attn.prefill
 * The synthetic union table keeps the chunk's blocks and the `recent` 2 before them, and each other block
 * of a KV head with the probability that brings the head to `keep` of its blocks, so the kept share is
 * controlled; every attention row reports kept_share (blocks) and flop_share ((query, key) pairs), and
 * vs_limit = time / (dense time x kept_share) with the dense time of the same shape measured in the same
 * process (vs_flop_limit the same with flop_share; issue 24's target is zero-copy vs_limit <= 1.2 at 128K).
 * CUDA cases are verified (the quick sets of the ops they call) before timing and skipped by name without a
 * device; the CPU cases run the same code at a small shape so that a CPU build compiles and runs them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "perf/bench_planted.h"
#include "uniprefill/backend.h"
#include "uniprefill/compact_attn.h"

#define CB_CUDA_REPETITIONS 5
#define CB_CUDA_MIN_TIME_S 0.1
#define CB_WARMUP 2
#define CB_DENSE_WARM_S 0.2
#define CB_DENSE_REPS 5
#define CB_ALPHA 0.18f /* the selector row: FlashPrefill's Llama-3.1-8B calibration, last_n 0 */
#define CB_RECENT 2
#define CB_SEED 0xc0ac7a11ull

typedef enum { CB_UNION, CB_TABLES, CB_SELECT, CB_DENSE, CB_ZERO_COPY, CB_COPY } cb_kind;

typedef struct {
  const char *name;
  cb_kind kind;
  int on_cuda;
  upf_dtype dt;
  int32_t total, chunk, hq, hkv, d, page, block_n;
  float keep;         /* synthetic tables and indexes: the share of blocks kept */
  int64_t iterations; /* CPU cases */
} cb_case;

#define BF UPF_DTYPE_BF16
#define F32 UPF_DTYPE_F32
#define LLAMA 8192, 32, 8, 128, 16, 64 /* chunk, Hq, Hkv, D, page, block_n */
#define SMALL 512, 4, 2, 64, 16, 64

static cb_case cases[] = {
    /* grouped by shape: a shape's buffers are built once for its rows */
    {"compact.block_union/cuda/bf16/llama_32k/keep0.2", CB_UNION, 1, BF, 32768, LLAMA, 0.2f},
    {"compact.block_tables/cuda/bf16/llama_32k/keep0.2", CB_TABLES, 1, BF, 32768, LLAMA, 0.2f},
    {"compact.select/cuda/bf16/llama_32k/a0.18", CB_SELECT, 1, BF, 32768, LLAMA, 0},
    {"compact.attn/cuda/bf16/llama_32k/dense", CB_DENSE, 1, BF, 32768, LLAMA, 1},
    {"compact.attn/cuda/bf16/llama_32k/zero_copy/keep0.2", CB_ZERO_COPY, 1, BF, 32768, LLAMA, 0.2f},
    {"compact.attn/cuda/bf16/llama_32k/copy/keep0.2", CB_COPY, 1, BF, 32768, LLAMA, 0.2f},
    {"compact.select/cuda/bf16/llama_64k/a0.18", CB_SELECT, 1, BF, 65536, LLAMA, 0},
    {"compact.attn/cuda/bf16/llama_64k/dense", CB_DENSE, 1, BF, 65536, LLAMA, 1},
    {"compact.attn/cuda/bf16/llama_64k/zero_copy/keep0.2", CB_ZERO_COPY, 1, BF, 65536, LLAMA, 0.2f},
    {"compact.attn/cuda/bf16/llama_64k/copy/keep0.2", CB_COPY, 1, BF, 65536, LLAMA, 0.2f},
    {"compact.block_union/cuda/bf16/llama_128k/keep0.2", CB_UNION, 1, BF, 131072, LLAMA, 0.2f},
    {"compact.block_tables/cuda/bf16/llama_128k/keep0.2", CB_TABLES, 1, BF, 131072, LLAMA, 0.2f},
    {"compact.select/cuda/bf16/llama_128k/a0.18", CB_SELECT, 1, BF, 131072, LLAMA, 0},
    {"compact.attn/cuda/bf16/llama_128k/dense", CB_DENSE, 1, BF, 131072, LLAMA, 1},
    {"compact.attn/cuda/bf16/llama_128k/zero_copy/keep0.1", CB_ZERO_COPY, 1, BF, 131072, LLAMA, 0.1f},
    {"compact.attn/cuda/bf16/llama_128k/zero_copy/keep0.2", CB_ZERO_COPY, 1, BF, 131072, LLAMA, 0.2f},
    {"compact.attn/cuda/bf16/llama_128k/zero_copy/keep0.4", CB_ZERO_COPY, 1, BF, 131072, LLAMA, 0.4f},
    {"compact.attn/cuda/bf16/llama_128k/copy/keep0.2", CB_COPY, 1, BF, 131072, LLAMA, 0.2f},
    {"compact.block_union/cpu/f32/small/keep0.3", CB_UNION, 0, F32, 2048, SMALL, 0.3f, 3},
    {"compact.block_tables/cpu/f32/small/keep0.3", CB_TABLES, 0, F32, 2048, SMALL, 0.3f, 3},
    {"compact.select/cpu/f32/small/a0.18", CB_SELECT, 0, F32, 2048, SMALL, 0, 3},
    {"compact.attn/cpu/f32/small/dense", CB_DENSE, 0, F32, 2048, SMALL, 1, 3},
    {"compact.attn/cpu/f32/small/zero_copy/keep0.3", CB_ZERO_COPY, 0, F32, 2048, SMALL, 0.3f, 3},
    {"compact.attn/cpu/f32/small/copy/keep0.3", CB_COPY, 0, F32, 2048, SMALL, 0.3f, 3},
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

/* ---- The live shape: one set of (up to 0.6 GB of) buffers at a time, shared by a shape's rows ---- */

static struct {
  const upf_backend *be;
  const cb_case *shape; /* the case whose shape is built (dt, total, chunk, heads, d, page, block_n) */
  float keep;           /* the synthetic table's and index's keep (-1: none built) */
  /* the chunk batch: one request of `chunk` queries over `total` keys */
  int32_t cu_host[2], kv_host[1], *bt_host; /* bt_host (1, max_blocks): identity pages */
  int32_t max_blocks, pages;
  void *cu, *kv, *bt; /* backend copies */
  upf_attn_paged batch;
  upf_sparse_params sp; /* the selector's (last_n 0) */
  upf_compact_params cp;
  upf_sparse_plan plan;
  void *q, *kc, *vc, *out; /* (chunk, Hq, D), (pages, P, Hkv, D) x 2, (chunk, Hq, D) */
  /* the synthetic selection of `keep` */
  uint8_t *table_host; /* (1, Hkv, nb) */
  void *table, *row_ptr, *blocks, *counts, *tbt, *tkv; /* backend: union table, CSR, counts, block tables */
  void *union_out, *tbt_out, *tkv_out; /* what the union and tables rows write (the tables above stay put) */
  int32_t *tbt_host, *tkv_host;
  int64_t index_total;
  double kept_share, flop_share;
  upf_compact_workspace ws; /* the selector row's and the copy path's */
  /* the dense chunk attention time of the shape (CUDA), 0 until measured */
  double dense_s;
} live;

static void release_selection(void) {
  void *bufs[9] = {live.table, live.row_ptr, live.blocks, live.counts, live.tbt, live.tkv,
                   live.union_out, live.tbt_out, live.tkv_out};
  for (int i = 0; i < 9; i++)
    if (bufs[i])
      live.be->release(bufs[i]);
  live.table = live.row_ptr = live.blocks = live.counts = live.tbt = live.tkv = NULL;
  live.union_out = live.tbt_out = live.tkv_out = NULL;
  free(live.table_host), free(live.tbt_host), free(live.tkv_host);
  live.table_host = NULL, live.tbt_host = live.tkv_host = NULL;
  live.keep = -1.0f;
}

static void release_live(void) {
  if (!live.be)
    return;
  if (live.be->synchronize)
    (void)live.be->synchronize(); /* teardown: nothing to report to */
  release_selection();
  upf_compact_workspace_free(&live.ws);
  void *bufs[7] = {live.cu, live.kv, live.bt, live.q, live.kc, live.vc, live.out};
  for (int i = 0; i < 7; i++)
    if (bufs[i])
      live.be->release(bufs[i]);
  free(live.bt_host);
  upf_sparse_plan_free(&live.plan);
  memset(&live, 0, sizeof live);
}

static void case_teardown(void *ctx) {
  (void)ctx;
  release_live();
}

static int same_shape(const cb_case *a, const cb_case *b) {
  return a && b && a->dt == b->dt && a->total == b->total && a->chunk == b->chunk && a->hq == b->hq &&
         a->hkv == b->hkv && a->d == b->d && a->page == b->page && a->block_n == b->block_n;
}

static double unit(uint64_t key) { return (double)(upf_mix64(CB_SEED ^ key) >> 11) * 0x1.0p-53; }

/* ---- Inputs: perf/bench_planted.h's planted blocks; q rows are the chunk's (key positions total -
 * chunk ..), k and v the cache's. The cache's pages are the identity (page i holds keys i P ..), so key
 * row t is cache row t. ---- */
static upf_status put_rows(const cb_case *c, upf_planted_kind kind, int64_t n, void **dst) {
  const upf_planted in = {c->hq, c->hkv, c->d, c->block_n, c->dt, CB_SEED};
  return upf_planted_upload(&in, live.be, kind, n, dst, "bench compact");
}

static upf_status put_ints(void **dst, const int32_t *vals, int64_t n) {
  UPF_TRY(live.be->alloc(dst, (size_t)(n ? n : 1) * sizeof(int32_t)));
  return live.be->upload(*dst, vals, (size_t)n * sizeof(int32_t));
}

static void tensors(const cb_case *c, upf_tensor *q, upf_tensor *kc, upf_tensor *vc, upf_tensor *out) {
  const int64_t sq[3] = {c->chunk, c->hq, c->d}, sc[4] = {live.pages, c->page, c->hkv, c->d};
  upf_tensor_init(q, live.q, c->dt, 3, sq), upf_tensor_init(out, live.out, c->dt, 3, sq);
  upf_tensor_init(kc, live.kc, c->dt, 4, sc), upf_tensor_init(vc, live.vc, c->dt, 4, sc);
}

static upf_status build_shape(const cb_case *c, const upf_backend *be) {
  release_live();
  live.be = be, live.shape = c, live.keep = -1.0f;
  live.pages = (c->total + c->page - 1) / c->page, live.max_blocks = live.pages;
  if (!(live.bt_host = malloc((size_t)live.max_blocks * sizeof *live.bt_host)))
    return upf_fail(UPF_ERR_NOMEM, "bench compact: block table");
  for (int32_t i = 0; i < live.max_blocks; i++)
    live.bt_host[i] = i;
  live.cu_host[0] = 0, live.cu_host[1] = c->chunk, live.kv_host[0] = c->total;
  UPF_TRY(put_ints(&live.cu, live.cu_host, 2));
  UPF_TRY(put_ints(&live.kv, live.kv_host, 1));
  UPF_TRY(put_ints(&live.bt, live.bt_host, live.max_blocks));
  live.batch = (upf_attn_paged){1, live.cu, live.cu_host, live.kv, live.kv_host, live.bt, live.bt_host,
                                live.max_blocks, c->page};
  live.sp = upf_sparse_params_default();
  live.sp.alpha = CB_ALPHA, live.sp.block_n = c->block_n, live.sp.last_n = 0;
  live.cp = upf_compact_params_default();
  live.cp.recent = CB_RECENT;
  const upf_sparse_batch sb = {NULL, &live.batch};
  UPF_TRY(upf_sparse_plan_make(&sb, c->hq, c->hkv, &live.sp, &live.plan));
  const int64_t cache_rows = (int64_t)live.pages * c->page;
  UPF_TRY(put_rows(c, UPF_PLANTED_Q, c->chunk, &live.q));
  UPF_TRY(put_rows(c, UPF_PLANTED_K, cache_rows, &live.kc));
  UPF_TRY(put_rows(c, UPF_PLANTED_V, cache_rows, &live.vc));
  return be->alloc(&live.out, (size_t)((int64_t)c->chunk * c->hq * c->d) * upf_dtype_size(c->dt));
}

/* The pairs of (query, key) a kept block stands for, summed over the head's kept blocks: a key k before
 * the chunk is seen by all its queries, a key of the chunk by the queries at or after it. */
static double block_pairs(const cb_case *c, int64_t b) {
  const int64_t prefix = c->total - c->chunk, k0 = b * c->block_n;
  const int64_t k1 = k0 + c->block_n < c->total ? k0 + c->block_n : c->total;
  double pairs = 0.0;
  for (int64_t k = k0; k < k1; k++)
    pairs += (double)(k < prefix ? c->chunk : c->chunk - (k - prefix));
  return pairs;
}

/* The synthetic union table of `keep` (the forced blocks, then each other block with the probability that
 * brings the head to keep of its blocks), its block tables, and the CSR index the union row times. */
static upf_status build_selection(const cb_case *c) {
  release_selection();
  const upf_backend *be = live.be;
  const int64_t hkv = c->hkv, nb = live.plan.max_key_blocks, mb = live.max_blocks;
  int32_t lo, hi;
  upf_compact_forced(c->chunk, c->total, c->block_n, live.cp.recent, &lo, &hi);
  live.table_host = calloc((size_t)(hkv * nb), 1);
  live.tbt_host = malloc((size_t)(hkv * mb) * sizeof *live.tbt_host);
  live.tkv_host = malloc((size_t)hkv * sizeof *live.tkv_host);
  if (!live.table_host || !live.tbt_host || !live.tkv_host)
    return upf_fail(UPF_ERR_NOMEM, "bench compact: tables");
  const int64_t forced = hi - lo + 1, cand = nb - forced;
  const double want = (double)c->keep * (double)nb - (double)forced;
  const double prob = want > 0.0 && cand > 0 ? want / (double)cand : 0.0;
  int64_t kept = 0;
  double pairs = 0.0, all_pairs = 0.0;
  for (int64_t b = 0; b < nb; b++)
    all_pairs += block_pairs(c, b);
  for (int64_t h = 0; h < hkv; h++)
    for (int64_t b = 0; b < nb; b++) {
      const int keep = (b >= lo && b <= hi) || unit(((uint64_t)h << 32) ^ (uint64_t)b) < prob;
      live.table_host[h * nb + b] = (uint8_t)keep;
      kept += keep;
      pairs += keep ? block_pairs(c, b) : 0.0;
    }
  live.kept_share = (double)kept / (double)(hkv * nb);
  live.flop_share = pairs / (all_pairs * (double)hkv);
  /* the block tables, by the CPU reference over the host copies (attn.paged reads the host copies for its
   * checks and plan), and on the backend by compact.block_tables */
  upf_tensor th, tt;
  const int64_t ts[3] = {1, hkv, nb};
  UPF_TRY(upf_tensor_init(&th, live.table_host, UPF_DTYPE_U8, 3, ts));
  const upf_attn_paged host = {1, live.cu_host, live.cu_host, live.kv_host, live.kv_host, live.bt_host, live.bt_host,
                               live.max_blocks, c->page};
  const upf_compact_tables out_h = {live.tbt_host, live.tkv_host, NULL, NULL, (int32_t)mb};
  UPF_TRY(upf_backend_cpu()->compact_block_tables(&host, &th, c->block_n, &out_h));
  UPF_TRY(be->alloc(&live.table, (size_t)(hkv * nb)));
  UPF_TRY(be->upload(live.table, live.table_host, (size_t)(hkv * nb)));
  UPF_TRY(upf_tensor_init(&tt, live.table, UPF_DTYPE_U8, 3, ts));
  UPF_TRY(be->alloc(&live.tbt, (size_t)(hkv * mb) * sizeof(int32_t)));
  UPF_TRY(be->alloc(&live.tkv, (size_t)hkv * sizeof(int32_t)));
  UPF_TRY(be->alloc(&live.counts, (size_t)hkv * sizeof(int32_t)));
  UPF_TRY(be->alloc(&live.union_out, (size_t)(hkv * nb)));
  UPF_TRY(be->alloc(&live.tbt_out, (size_t)(hkv * mb) * sizeof(int32_t)));
  UPF_TRY(be->alloc(&live.tkv_out, (size_t)hkv * sizeof(int32_t)));
  const upf_compact_tables out_d = {live.tbt, live.tkv, NULL, NULL, (int32_t)mb};
  UPF_TRY(be->compact_block_tables(&live.batch, &tt, c->block_n, &out_d));
  UPF_TRY(be->synchronize());
  /* the backend's tables must be the host's: the zero-copy row reads one, attn.paged plans from the other */
  int32_t *check = malloc((size_t)(hkv * mb + hkv) * sizeof *check);
  if (!check)
    return upf_fail(UPF_ERR_NOMEM, "bench compact: table check");
  upf_status st = be->download(check, live.tbt, (size_t)(hkv * mb) * sizeof *check);
  if (st == UPF_OK)
    st = be->download(check + hkv * mb, live.tkv, (size_t)hkv * sizeof *check);
  if (st == UPF_OK && (memcmp(check, live.tbt_host, (size_t)(hkv * mb) * sizeof *check) ||
                       memcmp(check + hkv * mb, live.tkv_host, (size_t)hkv * sizeof *check)))
    st = upf_fail(UPF_ERR_INVALID_ARG, "bench compact: compact.block_tables on %s differs from the CPU reference",
                  be->name);
  free(check);
  UPF_TRY(st);
  /* the CSR index over the chunk's tiles: each tile's forced blocks (sink, window) and each other visible
   * block with probability keep */
  const upf_sparse_plan *pl = &live.plan;
  const int64_t S = pl->num_segments, T = pl->total_q_tiles;
  int32_t *rp = malloc((size_t)(S + 1) * sizeof *rp), *bl = malloc((size_t)(S * nb + 1) * sizeof *bl);
  if (!rp || !bl) {
    free(rp), free(bl);
    return upf_fail(UPF_ERR_NOMEM, "bench compact: index");
  }
  int64_t n = 0;
  for (int64_t s = 0; s < S; s++) {
    const upf_sparse_tile t = upf_sparse_tile_at(0, (int32_t)(s % T), c->chunk, c->total, pl->group, &live.sp);
    rp[s] = (int32_t)n;
    for (int32_t b = 0; b <= t.last_k; b++) {
      const int forced = b < live.sp.sink || b >= t.first_k - live.sp.window + 1;
      if (forced || unit((1ull << 62) ^ ((uint64_t)s << 24) ^ (uint64_t)b) < c->keep)
        bl[n++] = b;
    }
  }
  rp[S] = (int32_t)n;
  live.index_total = n;
  st = put_ints(&live.row_ptr, rp, S + 1);
  if (st == UPF_OK)
    st = put_ints(&live.blocks, bl, n);
  free(rp), free(bl);
  live.keep = c->keep;
  return st;
}

static upf_status case_prepare(const cb_case *c, const upf_backend *be) {
  if (live.be != be || !same_shape(live.shape, c))
    UPF_TRY(build_shape(c, be));
  if ((c->kind == CB_UNION || c->kind == CB_TABLES || c->kind == CB_ZERO_COPY || c->kind == CB_COPY) &&
      live.keep != c->keep)
    UPF_TRY(build_selection(c));
  return UPF_OK;
}

static upf_status case_call(const cb_case *c) {
  const upf_backend *be = live.be;
  upf_tensor q, kc, vc, out;
  tensors(c, &q, &kc, &vc, &out);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  const upf_sparse_batch sb = {NULL, &live.batch};
  const int64_t nb = live.plan.max_key_blocks, ts[3] = {1, c->hkv, nb};
  const upf_compact_tables t = {live.tbt, live.tkv, live.tbt_host, live.tkv_host, live.max_blocks};
  upf_tensor tt;
  switch (c->kind) {
  case CB_UNION: {
    UPF_TRY(upf_tensor_init(&tt, live.union_out, UPF_DTYPE_U8, 3, ts));
    const upf_sparse_index idx = {live.row_ptr, live.blocks, NULL, live.index_total};
    return be->compact_block_union(&sb, c->hq, &live.sp, &idx, &live.cp, &tt, live.counts);
  }
  case CB_TABLES: {
    UPF_TRY(upf_tensor_init(&tt, live.table, UPF_DTYPE_U8, 3, ts));
    const upf_compact_tables out_d = {live.tbt_out, live.tkv_out, NULL, NULL, live.max_blocks};
    return be->compact_block_tables(&live.batch, &tt, c->block_n, &out_d);
  }
  case CB_SELECT:
    return upf_compact_select(be, &live.batch, &q, &kc, &live.sp, &live.cp, &live.ws);
  case CB_DENSE:
    return be->attn_paged(&live.batch, &q, &kc, &vc, &ap, &out, NULL);
  case CB_ZERO_COPY:
    return upf_compact_attn_zero_copy(be, &live.batch, &t, &q, &kc, &vc, &ap, &out);
  default:
    return upf_compact_attn_copy_ws(be, &live.batch, &t, &q, &kc, &vc, &ap, &out, &live.ws);
  }
}

/* Bytes counted once, for the rows that move little: union reads the CSR and writes the table; tables read
 * the table and the request's block table and write the block tables. */
static double case_bytes(const cb_case *c) {
  const double nb = live.plan.max_key_blocks, hkv = c->hkv, mb = live.max_blocks;
  if (c->kind == CB_UNION)
    return 4.0 * ((double)live.plan.num_segments + 1.0 + (double)live.index_total) + hkv * nb + 4.0 * hkv;
  if (c->kind == CB_TABLES)
    return hkv * nb + 4.0 * mb + 4.0 * hkv * (mb + 1.0);
  const double es = (double)upf_dtype_size(c->dt);
  return 2.0 * (double)c->total * hkv * c->d * es + 2.0 * (double)c->chunk * c->hq * c->d * es;
}

static void set_counters(upf_bench_state *st, const cb_case *c, double seconds) {
  const double visible = (double)c->hkv * (double)live.plan.max_key_blocks;
  switch (c->kind) {
  case CB_UNION: { /* the share of the union it made */
    upf_bench_set_counter(st, UPF_BENCH_BYTES, case_bytes(c), UPF_BENCH_COUNTER_RATE);
    int32_t counts[8 * 64] = {0}; /* Hkv <= 8 * 64 */
    int64_t kept = 0;
    if (c->hkv <= 8 * 64 && live.be->synchronize() == UPF_OK &&
        live.be->download(counts, live.counts, (size_t)c->hkv * sizeof(int32_t)) == UPF_OK) {
      for (int32_t h = 0; h < c->hkv; h++)
        kept += counts[h];
      upf_bench_set_counter(st, "kept_share", (double)kept / visible, UPF_BENCH_COUNTER_VALUE);
    }
    return;
  }
  case CB_TABLES:
    upf_bench_set_counter(st, UPF_BENCH_BYTES, case_bytes(c), UPF_BENCH_COUNTER_RATE);
    upf_bench_set_counter(st, "kept_share", live.kept_share, UPF_BENCH_COUNTER_VALUE);
    return;
  case CB_SELECT:
    upf_bench_set_counter(st, "kept_share", (double)live.ws.kept_blocks / visible, UPF_BENCH_COUNTER_VALUE);
    if (live.dense_s > 0.0 && seconds > 0.0)
      upf_bench_set_counter(st, "vs_dense", seconds / live.dense_s, UPF_BENCH_COUNTER_VALUE);
    return;
  case CB_DENSE: {
    const int32_t ql = c->chunk, kl = c->total;
    upf_bench_set_counter(st, UPF_BENCH_FLOPS, upf_attn_flops(&ql, &kl, 1, c->hq, c->d, 0), UPF_BENCH_COUNTER_RATE);
    upf_bench_set_counter(st, "kept_share", 1.0, UPF_BENCH_COUNTER_VALUE);
    return;
  }
  default: {
    const int32_t ql = c->chunk, kl = c->total;
    const double dense_flops = upf_attn_flops(&ql, &kl, 1, c->hq, c->d, 0);
    upf_bench_set_counter(st, UPF_BENCH_FLOPS, dense_flops * live.flop_share, UPF_BENCH_COUNTER_RATE);
    upf_bench_set_counter(st, "kept_share", live.kept_share, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "flop_share", live.flop_share, UPF_BENCH_COUNTER_VALUE);
    if (live.dense_s > 0.0 && seconds > 0.0) {
      upf_bench_set_counter(st, "dense_ms", live.dense_s * 1e3, UPF_BENCH_COUNTER_VALUE);
      upf_bench_set_counter(st, "vs_dense", seconds / live.dense_s, UPF_BENCH_COUNTER_VALUE);
      upf_bench_set_counter(st, "vs_limit", seconds / (live.dense_s * live.kept_share), UPF_BENCH_COUNTER_VALUE);
      upf_bench_set_counter(st, "vs_flop_limit", seconds / (live.dense_s * live.flop_share), UPF_BENCH_COUNTER_VALUE);
    }
  }
  }
}

static void bench_cpu(upf_bench_state *st, void *ctx) {
  const cb_case *c = ctx;
  if (case_prepare(c, upf_backend_cpu()) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    release_live();
    return;
  }
  while (upf_bench_keep_running(st)) {
    if (case_call(c) != UPF_OK) {
      upf_bench_skip_with_error(st, "%s: %s", c->name, upf_last_error());
      return;
    }
  }
  set_counters(st, c, 0.0);
}

#ifdef UPF_HAVE_CUDA
static upf_status call_case(void *arg) { return case_call(arg); }

static upf_status call_dense(void *arg) {
  const cb_case *c = arg;
  upf_tensor q, kc, vc, out;
  tensors(c, &q, &kc, &vc, &out);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  return live.be->attn_paged(&live.batch, &q, &kc, &vc, &ap, &out, NULL);
}

/* The ops a row runs, each verified against the CPU reference before anything is timed. */
static int ops_of(const cb_case *c, upf_op *ops) {
  int n = 0;
  switch (c->kind) {
  case CB_UNION:
    ops[n++] = UPF_OP_COMPACT_BLOCK_UNION;
    break;
  case CB_TABLES:
    ops[n++] = UPF_OP_COMPACT_BLOCK_TABLES;
    break;
  case CB_SELECT:
    ops[n++] = UPF_OP_SPARSE_BLOCK_MEANS, ops[n++] = UPF_OP_SPARSE_INDEX;
    ops[n++] = UPF_OP_COMPACT_BLOCK_UNION, ops[n++] = UPF_OP_COMPACT_BLOCK_TABLES;
    ops[n++] = UPF_OP_ATTN_PAGED; /* the dense time vs_dense divides by */
    break;
  case CB_DENSE:
  case CB_ZERO_COPY:
    ops[n++] = UPF_OP_ATTN_PAGED, ops[n++] = UPF_OP_COMPACT_BLOCK_TABLES;
    break;
  default:
    ops[n++] = UPF_OP_ATTN_PAGED, ops[n++] = UPF_OP_COMPACT_BLOCK_TABLES;
    ops[n++] = UPF_OP_COMPACT_ROWS, ops[n++] = UPF_OP_ATTN_PREFILL;
  }
  return n;
}
#endif

static void bench_cuda(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  (void)ctx;
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  const cb_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  char why[512];
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  upf_op ops[6];
  const int nops = ops_of(c, ops);
  for (int i = 0; i < nops; i++)
    if (!upf_bench_op_verified(ops[i], why, sizeof why)) {
      upf_bench_skip_with_error(st, "not timed, %s failed verification against the CPU reference: %s",
                                upf_op_name(ops[i]), why);
      return;
    }
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    release_live();
    return;
  }
  /* the dense chunk attention of the shape in its own steady state, once per shape */
  if (live.dense_s <= 0.0 && c->kind != CB_UNION && c->kind != CB_TABLES &&
      upf_bench_steady_median(call_dense, (void *)c, CB_DENSE_WARM_S, CB_DENSE_REPS, &live.dense_s) != UPF_OK) {
    upf_bench_skip_with_error(st, "dense attn.paged: %s", upf_last_error());
    return;
  }
  upf_bench_timing t;
  if (upf_bench_time_cuda(st, call_case, (void *)c, CB_WARMUP, case_bytes(c), &t) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s: %s", c->name, upf_last_error());
    return;
  }
  set_counters(st, c, t.iterations ? t.total_s / (double)t.iterations : 0.0);
  double copy_bw = 0.0;
  const double seconds = t.iterations ? t.total_s / (double)t.iterations : 0.0;
  if ((c->kind == CB_UNION || c->kind == CB_TABLES) && seconds > 0.0 && upf_bench_copy_ceiling(&copy_bw) == UPF_OK &&
      copy_bw > 0.0)
    upf_bench_set_counter(st, UPF_BENCH_COPY_SHARE, case_bytes(c) / seconds / copy_bw, UPF_BENCH_COUNTER_VALUE);
#endif
}

void upf_register_compact_benchmarks(void) {
  for (int i = 0; i < NUM_CASES; i++) {
    cb_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .teardown = i == 0 ? case_teardown : NULL, .num_args = 1};
    spec.args[0] = c->total, spec.arg_names[0] = "T";
    spec.fn = c->on_cuda ? bench_cuda : bench_cpu;
    upf_bench_spec_timing(&spec, c->on_cuda, CB_CUDA_MIN_TIME_S, CB_CUDA_REPETITIONS, c->iterations);
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench compact: %s\n", upf_last_error());
  }
}

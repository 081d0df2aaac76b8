/* Benchmarks of FlashPrefill V2 (uniprefill/sparse.h): sparse.block_means and sparse.index at Llama-3.1-8B
 * shapes (32K and 128K, bf16), and attn.block_sparse at Llama-3.1-8B 32K and 128K (D 128) and Gemma-3-12B
 * 32K (D 256) over structured indexes that keep a known share of the key blocks: dense tiles whole, the sink
 * and window blocks, and a deterministic pseudo-random subset of the other visible blocks sized so that the
 * tile keeps `keep` of them. Each attention case also has the time of dense attn.prefill of the same shape
 * in its steady state, measured in the same process before the first loop of that shape, and reports
 * vs_limit = time / (dense time x kept share of blocks), issue 23's target being <= 1.25 at 128K;
 * vs_flop_limit does the same with the exact share of (row, key) pairs (the diagonal blocks are half empty,
 * so the two differ); vs_stream_floor compares the time with streaming every segment's kept K/V blocks from
 * DRAM once at the run's copy bandwidth (stream_gb, with q and the output), the floor where no two segments
 * share a block in L2: a 128-row tile does 128 FLOP a byte of K/V at D 128, under the H100's ~180 FLOP/B
 * ridge, so lists that share nothing (the random rows) are bound by that stream and not by dense x share;
 * neighbour_share is the share of a tile's kept blocks its predecessor keeps too (upf prefill --index-sharing
 * measures the same of a model's lists).
 * TFLOP/s from the exact count of upf_sparse_attn_flops. One small CPU-reference case
 * per op. CUDA cases are verified (the op's quick set; attn.prefill's too for the dense time) before timing
 * and skipped by name without a device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "perf/bench_planted.h"
#include "uniprefill/backend.h"
#include "uniprefill/variant.h"

#define SB_CUDA_REPETITIONS 10
#define SB_CUDA_MIN_TIME_S 0.1
#define SB_WARMUP 3
#define SB_DENSE_WARM_S 0.2 /* device time of back-to-back dense calls before the timed ones */
#define SB_DENSE_REPS 5
#define SB_ALPHA 0.18f       /* the index cases: the paper's Llama-3.1-8B calibration */
#define SB_SEED 0xf1a5b9e2ull
#define SB_FLOPS_CROSSCHECK_T 32768 /* up to here the fast FLOP count is checked against the library's */

typedef enum { SB_MEANS, SB_INDEX, SB_ATTN } sb_kind;

typedef struct {
  const char *name;
  sb_kind kind;
  int on_cuda;
  upf_dtype dt;
  int32_t T, hq, hkv, d, block_n; /* one request of T queries over T keys */
  float keep;                     /* attention: the share of each sparse tile's visible blocks kept */
  int32_t mean_correction;
  int64_t iterations; /* CPU cases */
  int32_t stripes;    /* attention: every tile of a KV head draws its far blocks from one ranking (below) */
  /* prepared */
  const upf_backend *be;
  upf_sparse_params p;
  int32_t cu_host[2];
  upf_attn_varlen batch;
  upf_sparse_batch sb;
  upf_sparse_plan plan;
  void *q, *k, *v, *out, *cu, *kbar, *vbar, *row_ptr, *blocks, *scores; /* backend memory */
  int64_t kept_total, index_kept;
  double keep_share, flops, dense_flops, stream_bytes, neighbour_share;
} sb_case;

#define BF UPF_DTYPE_BF16
#define F32 UPF_DTYPE_F32

static sb_case cases[] = {
    {"sparse.block_means/cuda/bf16/llama_32k", SB_MEANS, 1, BF, 32768, 32, 8, 128, 64},
    {"sparse.block_means/cuda/bf16/llama_128k", SB_MEANS, 1, BF, 131072, 32, 8, 128, 64},
    {"sparse.index/cuda/bf16/llama_32k/a0.18", SB_INDEX, 1, BF, 32768, 32, 8, 128, 64},
    {"sparse.index/cuda/bf16/llama_128k/a0.18", SB_INDEX, 1, BF, 131072, 32, 8, 128, 64},
    {"attn.block_sparse/cuda/bf16/llama_32k/keep0.1", SB_ATTN, 1, BF, 32768, 32, 8, 128, 64, 0.1f},
    {"attn.block_sparse/cuda/bf16/llama_32k/keep0.2", SB_ATTN, 1, BF, 32768, 32, 8, 128, 64, 0.2f},
    {"attn.block_sparse/cuda/bf16/llama_32k/keep0.5", SB_ATTN, 1, BF, 32768, 32, 8, 128, 64, 0.5f},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.1", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 0.1f},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.2", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 0.2f},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.5", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 0.5f},
    /* every visible block kept: the list walk's cost against dense attention, before any sparsity */
    {"attn.block_sparse/cuda/bf16/llama_128k/keep1.0", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 1.0f},
    /* the same shares as vertical stripes: each KV head ranks its key blocks once, and every tile keeps the
     * top of that ranking (the heavy key blocks that real attention keeps for most queries), so neighbouring
     * tiles read the same blocks, as under dense attention, where the rows above draw each a fresh subset */
    {"attn.block_sparse/cuda/bf16/llama_32k/keep0.2/stripes", SB_ATTN, 1, BF, 32768, 32, 8, 128, 64, 0.2f, .stripes = 1},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.1/stripes", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 0.1f, .stripes = 1},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.2/stripes", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 0.2f, .stripes = 1},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.2/bn128", SB_ATTN, 1, BF, 131072, 32, 8, 128, 128, 0.2f},
    {"attn.block_sparse/cuda/bf16/llama_128k/keep0.2/mean_corr", SB_ATTN, 1, BF, 131072, 32, 8, 128, 64, 0.2f, 1},
    {"attn.block_sparse/cuda/bf16/gemma_32k/keep0.2", SB_ATTN, 1, BF, 32768, 16, 8, 256, 64, 0.2f},
    {"sparse.block_means/cpu/f32/small", SB_MEANS, 0, F32, 2048, 4, 1, 64, 64, 0, 0, 3},
    {"sparse.index/cpu/f32/small/a0.18", SB_INDEX, 0, F32, 2048, 4, 1, 64, 64, 0, 0, 3},
    {"attn.block_sparse/cpu/f32/small/keep0.2", SB_ATTN, 0, F32, 2048, 4, 1, 64, 64, 0.2f, 1, 3},
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

static upf_op case_op(const sb_case *c) {
  return c->kind == SB_MEANS ? UPF_OP_SPARSE_BLOCK_MEANS : c->kind == SB_INDEX ? UPF_OP_SPARSE_INDEX
                                                                               : UPF_OP_ATTN_BLOCK_SPARSE;
}

static void case_release(void *ctx) {
  sb_case *c = ctx;
  if (!c->be)
    return;
  void *bufs[10] = {c->q, c->k, c->v, c->out, c->cu, c->kbar, c->vbar, c->row_ptr, c->blocks, c->scores};
  for (int i = 0; i < 10; i++)
    if (bufs[i])
      c->be->release(bufs[i]);
  c->q = c->k = c->v = c->out = c->cu = c->kbar = c->vbar = c->row_ptr = c->blocks = c->scores = NULL;
  upf_sparse_plan_free(&c->plan);
  c->be = NULL;
}

/* ---- Inputs: perf/bench_planted.h's planted blocks (30% of each head's key blocks hot) ---- */
static upf_planted planted(const sb_case *c) {
  return (upf_planted){c->hq, c->hkv, c->d, c->block_n, c->dt, SB_SEED};
}

static upf_status put_ints(const upf_backend *be, void **dst, const int32_t *vals, int64_t n) {
  UPF_TRY(be->alloc(dst, (size_t)(n ? n : 1) * sizeof(int32_t)));
  return be->upload(*dst, vals, (size_t)n * sizeof(int32_t));
}

/* ---- The structured index ---- */

static int forced_keep(const upf_sparse_tile *t, const upf_sparse_params *p, int32_t b) {
  return t->dense || b < p->sink || b >= t->first_k - p->window + 1;
}

/* Dense tiles whole; elsewhere the sink and window blocks and each other visible block with the
 * probability that brings the tile to `keep` of its visible blocks (at least the forced ones): drawn per
 * segment (tile and KV head), or with `stripes` per KV head and block only, so that a tile keeps the blocks
 * whose draw is under its probability and tiles of one head keep nested sets. Host CSR. */
static upf_status build_index(const sb_case *c, int32_t **row_ptr, int32_t **blocks, int64_t *kept_total) {
  const upf_sparse_plan *pl = &c->plan;
  const int64_t S = pl->num_segments, T = pl->total_q_tiles;
  int32_t *rp = malloc((size_t)(S + 1) * sizeof *rp), *bl = NULL;
  if (!rp)
    return upf_fail(UPF_ERR_NOMEM, "bench sparse: row_ptr");
  for (int pass = 0; pass < 2; pass++) { /* count, then fill */
    int64_t n = 0;
    for (int64_t s = 0; s < S; s++) {
      const upf_sparse_tile t = upf_sparse_tile_at(0, (int32_t)(s % T), c->T, c->T, pl->group, &c->p);
      int32_t forced = 0;
      for (int32_t b = 0; b <= t.last_k; b++)
        forced += forced_keep(&t, &c->p, b);
      const double want = (double)c->keep * (t.last_k + 1) - forced, cand = (double)(t.last_k + 1 - forced);
      const double prob = want > 0.0 && cand > 0.0 ? want / cand : 0.0;
      rp[s] = (int32_t)n;
      for (int32_t b = 0; b <= t.last_k; b++) {
        const uint64_t who = c->stripes ? (uint64_t)(s / T) : (uint64_t)s; /* segment s: KV head s / T */
        const double x = (double)(upf_mix64(SB_SEED ^ (who << 24) ^ (uint64_t)b) >> 11) * 0x1.0p-53;
        if (forced_keep(&t, &c->p, b) || x < prob) {
          if (pass)
            bl[n] = b;
          n++;
        }
      }
    }
    rp[S] = (int32_t)n;
    *kept_total = n;
    if (!pass && !(bl = malloc((size_t)(n ? n : 1) * sizeof *bl))) {
      free(rp);
      return upf_fail(UPF_ERR_NOMEM, "bench sparse: %lld kept blocks", (long long)n);
    }
  }
  *row_ptr = rp, *blocks = bl;
  return UPF_OK;
}

/* upf_sparse_attn_flops' count in O(kept blocks): a block wholly below a tile's first row counts every
 * (row, key) pair; only the diagonal blocks are counted row by row. */
static double fast_flops(const sb_case *c, const int32_t *rp, const int32_t *bl) {
  const upf_sparse_plan *pl = &c->plan;
  const int64_t T = pl->total_q_tiles, g = pl->group, rows = (int64_t)c->T * g;
  double pairs = 0.0;
  for (int64_t s = 0; s < pl->num_segments; s++) {
    const int64_t m = s % T, r0 = m * c->p.block_m, r1 = r0 + c->p.block_m < rows ? r0 + c->p.block_m : rows;
    for (int32_t i = rp[s]; i < rp[s + 1]; i++) {
      const int64_t k0 = (int64_t)bl[i] * c->p.block_n;
      const int64_t k1 = k0 + c->p.block_n < c->T ? k0 + c->p.block_n : c->T;
      if (r0 / g >= k1 - 1) { /* the first row sees the whole block (prefix 0: position = row / g) */
        pairs += (double)(r1 - r0) * (double)(k1 - k0);
        continue;
      }
      for (int64_t r = r0; r < r1; r++) {
        const int64_t hi = r / g + 1 < k1 ? r / g + 1 : k1;
        if (hi > k0)
          pairs += (double)(hi - k0);
      }
    }
  }
  return 4.0 * (double)c->d * pairs;
}

static sb_case *live_case; /* one case holds its (up to GBs of) buffers at a time */

static void tensors(const sb_case *c, upf_tensor *q, upf_tensor *k, upf_tensor *v, upf_tensor *o, upf_tensor *kb,
                    upf_tensor *vb) {
  const int64_t sq[3] = {c->T, c->hq, c->d}, skv[3] = {c->T, c->hkv, c->d};
  const int64_t sm[4] = {1, c->plan.max_key_blocks, c->hkv, c->d};
  upf_tensor_init(q, c->q, c->dt, 3, sq), upf_tensor_init(o, c->out, c->dt, 3, sq);
  upf_tensor_init(k, c->k, c->dt, 3, skv), upf_tensor_init(v, c->v, c->dt, 3, skv);
  upf_tensor_init(kb, c->kbar, c->dt, 4, sm), upf_tensor_init(vb, c->vbar, c->dt, 4, sm);
}

static upf_status case_prepare(sb_case *c, const upf_backend *be) {
  if (c->be == be)
    return UPF_OK;
  if (live_case && live_case != c)
    case_release(live_case);
  case_release(c);
  live_case = c;
  c->be = be;
  c->p = upf_sparse_params_default();
  c->p.alpha = SB_ALPHA, c->p.block_n = c->block_n, c->p.mean_correction = c->mean_correction;
  c->cu_host[0] = 0, c->cu_host[1] = c->T;
  UPF_TRY(put_ints(be, &c->cu, c->cu_host, 2));
  c->batch = (upf_attn_varlen){1, c->cu, c->cu_host, c->cu, c->cu_host};
  c->sb = (upf_sparse_batch){&c->batch, NULL};
  UPF_TRY(upf_sparse_plan_make(&c->sb, c->hq, c->hkv, &c->p, &c->plan));
  const upf_planted in = planted(c);
  UPF_TRY(upf_planted_upload(&in, be, UPF_PLANTED_K, c->T, &c->k, "bench sparse"));
  UPF_TRY(upf_planted_upload(&in, be, UPF_PLANTED_V, c->T, &c->v, "bench sparse"));
  const size_t es = upf_dtype_size(c->dt), means = (size_t)c->plan.max_key_blocks * c->hkv * c->d * es;
  UPF_TRY(be->alloc(&c->kbar, means));
  UPF_TRY(be->alloc(&c->vbar, means));
  if (c->kind == SB_MEANS)
    return UPF_OK;
  UPF_TRY(upf_planted_upload(&in, be, UPF_PLANTED_Q, c->T, &c->q, "bench sparse"));
  upf_tensor q, k, v, o, kb, vb;
  tensors(c, &q, &k, &v, &o, &kb, &vb);
  UPF_TRY(be->sparse_block_means(&c->sb, &k, &v, &c->p, &kb, &vb));
  UPF_TRY(be->synchronize());
  const int64_t S = c->plan.num_segments, cap = S * c->plan.max_key_blocks;
  if (c->kind == SB_INDEX) {
    UPF_TRY(be->alloc(&c->row_ptr, (size_t)(S + 1) * sizeof(int32_t)));
    UPF_TRY(be->alloc(&c->blocks, (size_t)cap * sizeof(int32_t)));
    return be->alloc(&c->scores, (size_t)cap * sizeof(float));
  }
  int32_t *rp = NULL, *bl = NULL;
  UPF_TRY(build_index(c, &rp, &bl, &c->kept_total));
  upf_status st = put_ints(be, &c->row_ptr, rp, S + 1);
  if (st == UPF_OK)
    st = put_ints(be, &c->blocks, bl, c->kept_total);
  if (st == UPF_OK)
    st = be->alloc(&c->out, (size_t)((int64_t)c->T * c->hq * c->d) * es);
  c->keep_share = (double)c->kept_total / (double)upf_sparse_visible_blocks(&c->sb, &c->plan, &c->p);
  c->flops = fast_flops(c, rp, bl);
  /* every kept block's K and V once per segment, q read and the output written once (T a multiple of block_n) */
  c->stream_bytes = ((double)c->kept_total * 2.0 * c->block_n + 2.0 * (double)c->T * c->hq) * c->d * (double)es;
  int64_t shared = 0, with_pred = 0; /* the lists' kind: what upf prefill --index-sharing reports for a model */
  upf_sparse_neighbour_blocks(&c->plan, rp, bl, &shared, &with_pred);
  c->neighbour_share = with_pred ? (double)shared / (double)with_pred : 0.0;
  if (st == UPF_OK && c->T <= SB_FLOPS_CROSSCHECK_T) {
    const double exact = upf_sparse_attn_flops(&c->sb, &c->plan, &c->p, c->d, rp, bl);
    if (fabs(exact - c->flops) > 1e-9 * exact)
      st = upf_fail(UPF_ERR_INVALID_ARG, "bench sparse: FLOP count %.6g differs from upf_sparse_attn_flops %.6g",
                    c->flops, exact);
  }
  const int32_t len = c->T;
  c->dense_flops = upf_attn_flops(&len, &len, 1, c->hq, c->d, 0);
  free(rp), free(bl);
  return st;
}

static upf_status case_call(sb_case *c) {
  upf_tensor q, k, v, o, kb, vb;
  tensors(c, &q, &k, &v, &o, &kb, &vb);
  switch (c->kind) {
  case SB_MEANS:
    return c->be->sparse_block_means(&c->sb, &k, &v, &c->p, &kb, &vb);
  case SB_INDEX: {
    upf_sparse_index idx = {c->row_ptr, c->blocks, c->scores, -1};
    upf_status st = c->be->sparse_index(&c->sb, &q, &kb, &c->p, &idx);
    c->index_kept = idx.kept_total;
    return st;
  }
  default: {
    upf_sparse_index idx = {c->row_ptr, c->blocks, NULL, c->kept_total};
    return c->be->attn_block_sparse(&c->sb, &q, &k, &v, &c->p, &idx, c->mean_correction ? &kb : NULL,
                                    c->mean_correction ? &vb : NULL, &o);
  }
  }
}

/* Bytes counted once: means read k, v and write kbar, vbar; the index reads q and kbar and writes the
 * scores and the kept blocks. */
static double case_bytes(const sb_case *c) {
  const double es = (double)upf_dtype_size(c->dt), kv = (double)c->T * c->hkv * c->d * es;
  const double means = (double)c->plan.max_key_blocks * c->hkv * c->d * es;
  if (c->kind == SB_MEANS)
    return 2.0 * kv + 2.0 * means;
  const double S = (double)c->plan.num_segments;
  return (double)c->T * c->hq * c->d * es + means + S * c->plan.max_key_blocks * 4.0 + (S + 1) * 4.0 +
         (double)(c->index_kept > 0 ? c->index_kept : 0) * 4.0;
}

static void set_counters(upf_bench_state *st, const sb_case *c, double seconds, double dense_s) {
  if (c->kind != SB_ATTN) {
    upf_bench_set_counter(st, UPF_BENCH_BYTES, case_bytes(c), UPF_BENCH_COUNTER_RATE);
    if (c->kind == SB_INDEX && c->index_kept >= 0)
      upf_bench_set_counter(st, "keep_share",
                            (double)c->index_kept / (double)upf_sparse_visible_blocks(&c->sb, &c->plan, &c->p),
                            UPF_BENCH_COUNTER_VALUE);
    return;
  }
  const double flop_share = c->flops / c->dense_flops;
  upf_bench_set_counter(st, UPF_BENCH_FLOPS, c->flops, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, "keep_share", c->keep_share, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "flop_share", flop_share, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "neighbour_share", c->neighbour_share, UPF_BENCH_COUNTER_VALUE);
  if (dense_s > 0.0 && seconds > 0.0) {
    upf_bench_set_counter(st, "sparse_ms", seconds * 1e3, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "dense_ms", dense_s * 1e3, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "vs_dense", seconds / dense_s, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "vs_limit", seconds / (dense_s * c->keep_share), UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "vs_flop_limit", seconds / (dense_s * flop_share), UPF_BENCH_COUNTER_VALUE);
  }
}

#ifdef UPF_HAVE_CUDA
static upf_status call_case(void *arg) { return case_call(arg); }

/* Dense causal attn.prefill of the case's shape over the same q, k, v and output. */
static upf_status call_dense(void *arg) {
  const sb_case *c = arg;
  upf_tensor q, k, v, o, kb, vb;
  tensors(c, &q, &k, &v, &o, &kb, &vb);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  return c->be->attn_prefill(&c->batch, &q, &k, &v, &ap, &o, NULL);
}

/* The dense time of each attention shape, measured once per process (the first case of the shape, in its
 * first repetition): at 128K one dense call is a quarter second, and five cases share the shape. */
#define SB_DENSE_SHAPES 8
static struct {
  int32_t T, hq, hkv, d;
  double seconds;
} dense_times[SB_DENSE_SHAPES];

static upf_status dense_time(sb_case *c, double *seconds) {
  int i = 0;
  for (; i < SB_DENSE_SHAPES && dense_times[i].T; i++)
    if (dense_times[i].T == c->T && dense_times[i].hq == c->hq && dense_times[i].hkv == c->hkv &&
        dense_times[i].d == c->d) {
      *seconds = dense_times[i].seconds;
      return UPF_OK;
    }
  UPF_TRY(upf_bench_steady_median(call_dense, c, SB_DENSE_WARM_S, SB_DENSE_REPS, seconds));
  if (i < SB_DENSE_SHAPES)
    dense_times[i].T = c->T, dense_times[i].hq = c->hq, dense_times[i].hkv = c->hkv, dense_times[i].d = c->d,
    dense_times[i].seconds = *seconds;
  return UPF_OK;
}
#endif

static void bench_cpu(upf_bench_state *st, void *ctx) {
  sb_case *c = ctx;
  const upf_backend *be = upf_backend_cpu();
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    case_release(c);
    return;
  }
  while (upf_bench_keep_running(st)) {
    if (case_call(c) != UPF_OK) {
      upf_bench_skip_with_error(st, "%s: %s", upf_op_name(case_op(c)), upf_last_error());
      return;
    }
  }
  set_counters(st, c, 0.0, 0.0);
}

#ifdef UPF_HAVE_CUDA
/* "attn.prefill=<variant>" and the case's op's variant where it has some: which kernels ran. */
static upf_status variant_label(const sb_case *c, char *label, size_t cap) {
  label[0] = '\0';
  const upf_op ops[2] = {case_op(c), UPF_OP_ATTN_PREFILL};
  for (int i = 0; i < (c->kind == SB_ATTN ? 2 : 1); i++) {
    if (upf_variant_count(ops[i]) == 0)
      continue;
    upf_variant v;
    UPF_TRY(upf_variant_current(ops[i], &v));
    const size_t n = strlen(label);
    snprintf(label + n, cap - n, "%s%s=%s", n ? " " : "", upf_op_name(ops[i]), upf_variant_name(v));
  }
  return UPF_OK;
}
#endif

static void bench_cuda(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  (void)ctx;
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  sb_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  char why[512], label[128];
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  if (variant_label(c, label, sizeof label) != UPF_OK) { /* before verification: a bad UPF_VARIANT as itself */
    upf_bench_skip_with_error(st, "%s", upf_last_error());
    return;
  }
  if (label[0])
    upf_bench_set_label(st, label);
  const upf_op op = case_op(c);
  if (!upf_bench_op_verified(op, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
    return;
  }
  if (c->kind == SB_ATTN && !upf_bench_op_verified(UPF_OP_ATTN_PREFILL, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, the dense attn.prefill it is compared with failed verification: %s",
                              why);
    return;
  }
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    case_release(c);
    return;
  }
  /* The dense attention of the same shape in its own steady state, before the first loop of the shape. */
  double dense_s = 0.0;
  if (c->kind == SB_ATTN && dense_time(c, &dense_s) != UPF_OK) {
    upf_bench_skip_with_error(st, "dense attn.prefill: %s", upf_last_error());
    return;
  }
  c->index_kept = -1;
  upf_bench_timing t;
  if (upf_bench_time_cuda(st, call_case, c, SB_WARMUP, case_bytes(c), &t) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s: %s", upf_op_name(op), upf_last_error());
    return;
  }
  const double seconds = t.iterations ? t.total_s / (double)t.iterations : 0.0;
  set_counters(st, c, seconds, dense_s);
  double copy_bw = 0.0;
  if (seconds > 0.0 && upf_bench_copy_ceiling(&copy_bw) == UPF_OK && copy_bw > 0.0) {
    if (c->kind != SB_ATTN)
      upf_bench_set_counter(st, UPF_BENCH_COPY_SHARE, case_bytes(c) / seconds / copy_bw, UPF_BENCH_COUNTER_VALUE);
    else {
      upf_bench_set_counter(st, "stream_gb", c->stream_bytes * 1e-9, UPF_BENCH_COUNTER_VALUE);
      upf_bench_set_counter(st, "vs_stream_floor", seconds / (c->stream_bytes / copy_bw), UPF_BENCH_COUNTER_VALUE);
    }
  }
#endif
}

void upf_register_sparse_benchmarks(void) {
  for (int i = 0; i < NUM_CASES; i++) {
    sb_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .teardown = case_release, .num_args = 1};
    spec.args[0] = c->T, spec.arg_names[0] = "T";
    spec.fn = c->on_cuda ? bench_cuda : bench_cpu;
    upf_bench_spec_timing(&spec, c->on_cuda, SB_CUDA_MIN_TIME_S, SB_CUDA_REPETITIONS, c->iterations);
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench sparse: %s\n", upf_last_error());
  }
}

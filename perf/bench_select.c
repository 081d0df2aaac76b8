/* Benchmarks of the selection pipeline (backend->select_run, SPEC.md section 2) through the backend
 * table, on Llama-3.1-8B shapes: the CPU reference (wall clock, few iterations) and CUDA (device
 * events after warm-up, rotated inputs, verified against the CPU reference before any timing),
 * plus "copy_bandwidth", the measured ceiling their TB/s is compared with. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"

#ifdef UPF_HAVE_CUDA
#include "cuda/perf_support.cuh"
#endif

/* Llama-3.1-8B attention: 32 query heads over 8 KV heads of dim 128. */
enum { SEL_HQ = 32, SEL_HKV = 8, SEL_D = 128 };

#define SEL_MAX_COPIES 16
#define SEL_CHUNK_TOKENS 1024                      /* host staging granularity of the inputs */
#define SEL_COPY_BUDGET ((int64_t)16 << 30)        /* device bytes all rotated copies may take */
#define SEL_CUDA_REPETITIONS 10
#define SEL_CUDA_MIN_TIME_S 0.1                    /* of device time per repetition */
#define SEL_WARMUP 3
#define COPY_BENCH_BYTES ((size_t)1 << 30)         /* far beyond any L2 */

/* ---- Inputs ----
 * Pure noise would make every block look alike (the sum over 32 heads x 128 queries averages it
 * out) and top-p would keep nearly all of them. So each KV head has a direction u that its queries
 * lean towards, the first GEN_SINK_TOKENS keys of a request align with it strongly (an attention
 * sink, as trained models have), and every other block's keys align with it by a gain drawn per
 * block: mostly small, a few large (about 65% of tokens kept at 8K, 47% at 32K). The noise rows
 * come from a pool drawn once and indexed by (token, head), because drawing fresh normals for 1M
 * tokens x 40 heads x 128 would take minutes of host time per case. */
#define GEN_POOL_ROWS 4093 /* prime, so (a*token + b*head) mod P has no power-of-two period */
#define GEN_GAIN_POOL 1021
#define GEN_SINK_TOKENS 16
#define GEN_SEED 0x5e1ec7ull
static const float GEN_Q_GAIN = 0.5f, GEN_SINK_GAIN = 2.5f, GEN_BLOCK_GAIN = 2.0f;

typedef struct {
  int ready;
  float *pool;                /* (GEN_POOL_ROWS, D) standard normal rows */
  float u[SEL_HKV * SEL_D];   /* (Hkv, D) the direction queries and relevant keys share */
  float gain[GEN_GAIN_POOL];  /* GEN_BLOCK_GAIN * x^3, x uniform: many weak blocks, few strong */
} sel_gen;

static sel_gen gen;

static upf_status gen_init(void) {
  if (gen.ready)
    return UPF_OK;
  gen.pool = malloc((size_t)GEN_POOL_ROWS * SEL_D * sizeof *gen.pool);
  if (!gen.pool)
    return upf_fail(UPF_ERR_NOMEM, "bench select: cannot allocate the input noise pool");
  upf_rng rng;
  upf_rng_seed(&rng, GEN_SEED);
  upf_rng_fill_normal(&rng, gen.pool, (int64_t)GEN_POOL_ROWS * SEL_D, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, gen.u, SEL_HKV * SEL_D, 0.0f, 1.0f);
  for (int i = 0; i < GEN_GAIN_POOL; i++) {
    float x = upf_rng_uniform(&rng);
    gen.gain[i] = GEN_BLOCK_GAIN * x * x * x;
  }
  gen.ready = 1;
  return UPF_OK;
}

/* q rows at positions [j0, j0+ntok) of a request: dst (ntok, Hq, D). */
static void gen_q_rows(int64_t j0, int64_t ntok, float *dst) {
  for (int64_t t = 0; t < ntok; t++)
    for (int64_t h = 0; h < SEL_HQ; h++) {
      const float *noise = gen.pool + ((j0 + t) * 31 + h * 131 + 7) % GEN_POOL_ROWS * SEL_D;
      const float *u = gen.u + h / (SEL_HQ / SEL_HKV) * SEL_D;
      float *row = dst + (t * SEL_HQ + h) * SEL_D;
      for (int64_t d = 0; d < SEL_D; d++)
        row[d] = noise[d] + GEN_Q_GAIN * u[d];
    }
}

/* k rows at positions [j0, j0+ntok) of request `req`: dst (ntok, Hkv, D). */
static void gen_k_rows(int32_t req, int64_t j0, int64_t ntok, int32_t block, float *dst) {
  for (int64_t t = 0; t < ntok; t++) {
    int64_t j = j0 + t;
    float g = j < GEN_SINK_TOKENS ? GEN_SINK_GAIN : gen.gain[((int64_t)req * 131 + j / block) % GEN_GAIN_POOL];
    for (int64_t h = 0; h < SEL_HKV; h++) {
      const float *noise = gen.pool + (j * 17 + h * 389 + 3) % GEN_POOL_ROWS * SEL_D;
      const float *u = gen.u + h * SEL_D;
      float *row = dst + (t * SEL_HKV + h) * SEL_D;
      for (int64_t d = 0; d < SEL_D; d++)
        row[d] = noise[d] + g * u[d];
    }
  }
}

/* ---- One batch in a backend's memory ---- */

typedef struct {
  const upf_backend *be;
  upf_dtype dtype;
  int32_t num_reqs;
  int64_t T, num_blocks;
  int32_t *cu_host;         /* (B+1) host */
  int32_t *cu;              /* (B+1) backend memory */
  int copies;
  void *q[SEL_MAX_COPIES];  /* (T, Hq, D) backend memory; every copy holds the same values */
  void *k[SEL_MAX_COPIES];  /* (T, Hkv, D) */
  upf_select_outputs out;   /* backend memory; block_score/block_mask only when asked for */
} sel_data;

static void sel_data_release(sel_data *d) {
  if (!d->be)
    return;
  for (int c = 0; c < SEL_MAX_COPIES; c++) {
    d->be->release(d->q[c]);
    d->be->release(d->k[c]);
  }
  d->be->release(d->cu);
  d->be->release(d->out.block_score);
  d->be->release(d->out.block_mask);
  d->be->release(d->out.token_mask);
  d->be->release(d->out.kept_index);
  d->be->release(d->out.new_cu_seqlens);
  d->be->release(d->out.kept_count);
  free(d->cu_host);
  memset(d, 0, sizeof *d);
}

static upf_select_inputs sel_inputs(const sel_data *d, int copy) {
  upf_select_inputs in;
  memset(&in, 0, sizeof in);
  int64_t qs[3] = {d->T, SEL_HQ, SEL_D}, ks[3] = {d->T, SEL_HKV, SEL_D};
  upf_tensor_init(&in.q, d->q[copy], d->dtype, 3, qs);
  upf_tensor_init(&in.k, d->k[copy], d->dtype, 3, ks);
  in.cu_seqlens = d->cu;
  in.cu_seqlens_host = d->cu_host;
  in.num_reqs = d->num_reqs;
  return in;
}

/* Converts f32 rows to the batch dtype (into conv when needed) and uploads them at token `tok`. */
static upf_status upload_rows(const sel_data *d, void *base, int64_t heads, int64_t tok, int64_t ntok,
                              const float *rows, void *conv) {
  int64_t n = ntok * heads * SEL_D;
  size_t es = upf_dtype_size(d->dtype);
  const void *src = rows;
  if (d->dtype == UPF_DTYPE_BF16) {
    upf_bf16_from_f32_array(conv, rows, n);
    src = conv;
  }
  return d->be->upload((char *)base + (size_t)(tok * heads * SEL_D) * es, src, (size_t)n * es);
}

/* Fills one copy of q and k. Selection reads only the last L rows of q of each request; the rows
 * before them get the same filler chunk (already converted), which keeps T=1M cheap to set up. */
static upf_status fill_copy(const sel_data *d, int copy, const upf_select_params *p, float *stage, void *conv,
                            const void *filler) {
  size_t es = upf_dtype_size(d->dtype);
  size_t filler_row = (size_t)SEL_HQ * SEL_D * es;
  for (int32_t r = 0; r < d->num_reqs; r++) {
    int64_t tok0 = d->cu_host[r], n = d->cu_host[r + 1] - tok0;
    int64_t win = n < p->last_q ? n : p->last_q;
    for (int64_t j = 0; j < n - win; j += SEL_CHUNK_TOKENS) {
      int64_t m = n - win - j < SEL_CHUNK_TOKENS ? n - win - j : SEL_CHUNK_TOKENS;
      UPF_TRY(d->be->upload((char *)d->q[copy] + (size_t)(tok0 + j) * filler_row, filler, (size_t)m * filler_row));
    }
    gen_q_rows(n - win, win, stage);
    UPF_TRY(upload_rows(d, d->q[copy], SEL_HQ, tok0 + n - win, win, stage, conv));
    for (int64_t j = 0; j < n; j += SEL_CHUNK_TOKENS) {
      int64_t m = n - j < SEL_CHUNK_TOKENS ? n - j : SEL_CHUNK_TOKENS;
      gen_k_rows(r, j, m, p->block, stage);
      UPF_TRY(upload_rows(d, d->k[copy], SEL_HKV, tok0 + j, m, stage, conv));
    }
  }
  return d->be->synchronize();
}

static upf_status fill_all(sel_data *d, const upf_select_params *p) {
  size_t es = upf_dtype_size(d->dtype);
  size_t rows = (size_t)SEL_CHUNK_TOKENS * SEL_HQ * SEL_D;
  float *stage = malloc(rows * sizeof *stage);
  void *conv = malloc(rows * es), *filler = malloc(rows * es);
  upf_status st = stage && conv && filler ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "bench select: staging buffers");
  if (st == UPF_OK) {
    gen_q_rows(0, SEL_CHUNK_TOKENS, stage);
    if (d->dtype == UPF_DTYPE_BF16)
      upf_bf16_from_f32_array(filler, stage, (int64_t)rows);
    else
      memcpy(filler, stage, rows * es);
  }
  for (int c = 0; st == UPF_OK && c < d->copies; c++)
    st = fill_copy(d, c, p, stage, conv, filler);
  free(stage), free(conv), free(filler);
  return st;
}

static upf_status sel_alloc(const sel_data *d, void **ptr, size_t bytes, const char *what) {
  upf_status st = d->be->alloc(ptr, bytes);
  return st == UPF_OK ? st : upf_fail_context(st, what);
}

/* The batch of requests cu (B+1, host) on backend `be`, with `copies` copies of the inputs. */
static upf_status sel_data_create(sel_data *d, const upf_backend *be, upf_dtype dtype, const int32_t *cu,
                                  int32_t num_reqs, int copies, int want_blocks) {
  upf_select_params p = upf_select_params_default();
  memset(d, 0, sizeof *d);
  d->be = be, d->dtype = dtype, d->num_reqs = num_reqs, d->copies = copies;
  UPF_TRY(gen_init());
  d->cu_host = malloc((size_t)(num_reqs + 1) * sizeof *d->cu_host);
  if (!d->cu_host)
    return upf_fail(UPF_ERR_NOMEM, "bench select: cu_seqlens");
  memcpy(d->cu_host, cu, (size_t)(num_reqs + 1) * sizeof *cu);
  for (int32_t r = 0; r < num_reqs; r++)
    d->num_blocks += upf_select_blocks_of(cu[r + 1] - cu[r], p.block);
  d->T = d->cu_host[num_reqs];
  size_t es = upf_dtype_size(dtype), T = (size_t)d->T, B = (size_t)num_reqs;
  upf_status st = sel_alloc(d, (void **)&d->cu, (B + 1) * sizeof(int32_t), "cu_seqlens: ");
  for (int c = 0; st == UPF_OK && c < copies; c++) {
    st = sel_alloc(d, &d->q[c], T * SEL_HQ * SEL_D * es, "q: ");
    if (st == UPF_OK)
      st = sel_alloc(d, &d->k[c], T * SEL_HKV * SEL_D * es, "k: ");
  }
  if (st == UPF_OK)
    st = sel_alloc(d, (void **)&d->out.token_mask, T, "token_mask: ");
  if (st == UPF_OK)
    st = sel_alloc(d, (void **)&d->out.kept_index, T * sizeof(int32_t), "kept_index: ");
  if (st == UPF_OK)
    st = sel_alloc(d, (void **)&d->out.new_cu_seqlens, (B + 1) * sizeof(int32_t), "new_cu_seqlens: ");
  if (st == UPF_OK)
    st = sel_alloc(d, (void **)&d->out.kept_count, B * sizeof(int32_t), "kept_count: ");
  if (st == UPF_OK && want_blocks)
    st = sel_alloc(d, (void **)&d->out.block_score, (size_t)d->num_blocks * sizeof(float), "block_score: ");
  if (st == UPF_OK && want_blocks)
    st = sel_alloc(d, (void **)&d->out.block_mask, (size_t)d->num_blocks, "block_mask: ");
  if (st == UPF_OK)
    st = be->upload(d->cu, d->cu_host, (B + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = fill_all(d, &p);
  if (st != UPF_OK)
    sel_data_release(d);
  return st;
}

/* ---- Work of one select_run ----
 * FLOPs. Per scored request of n tokens and per query head, a pass over the keys is the causal
 * part-GEMM of the last L queries against the n keys. Query i (0..L-1) sits at position n-L+i and
 * sees n-L+i+1 keys, so there are L*(n-L) + L*(L+1)/2 (query, key) pairs, each a D-long dot product
 * (2*D FLOPs):
 *   flops = SEL_SCORE_PASSES * Hq * 2*D * (L*(n-L) + L*(L+1)/2)
 * Requests that are not scored (decode rows, n <= sink+L) do no arithmetic.
 * Bytes, counted once per pass that must move them: K (n*Hkv*D per pass), the last L rows of q, and
 * the outputs (token mask T bytes, kept index 4*T', new cu_seqlens and kept counts).
 * SEL_SCORE_PASSES: SPEC stage 2 reads as two passes (max and sum, then the normalised mass), and a
 * kernel that recomputes the scores for the second would read K and do the part-GEMM twice. Both
 * backends compute the scores once (CPU: one dgemm per head; CUDA: one fused pass, see the header
 * of cuda/select_score.cu), so one pass is the work done; 2 would rate them as the two-pass design, which
 * can put TFLOP/s above the device's peak. */
#define SEL_SCORE_PASSES 1.0

typedef struct {
  double flops;
  double bytes_in; /* everything but the outputs, which depend on T' */
} sel_work;

static sel_work select_work(const int32_t *cu, int32_t num_reqs, upf_dtype dtype) {
  upf_select_params p = upf_select_params_default();
  double es = (double)upf_dtype_size(dtype), L = p.last_q, D = SEL_D;
  sel_work w = {0.0, 0.0};
  for (int32_t r = 0; r < num_reqs; r++) {
    double n = cu[r + 1] - cu[r];
    if (!upf_select_is_scored((int64_t)n, &p))
      continue;
    w.flops += SEL_SCORE_PASSES * SEL_HQ * 2.0 * D * (L * (n - L) + L * (L + 1.0) / 2.0);
    w.bytes_in += SEL_SCORE_PASSES * n * SEL_HKV * D * es + L * SEL_HQ * D * es;
  }
  return w;
}

static double select_bytes(const sel_data *d, sel_work w, int64_t kept_total) {
  return w.bytes_in + (double)d->T + 4.0 * (double)kept_total + 4.0 * (2.0 * d->num_reqs + 1.0);
}

/* ---- Benchmark cases ---- */

typedef struct {
  const char *name;       /* family; args add T, or B and n */
  int on_cuda;
  upf_dtype dtype;
  int32_t num_reqs;       /* uniform batch of num_reqs x len ... */
  int32_t len;
  const int32_t *lens;    /* ... or these num_reqs lengths */
  int64_t iterations;     /* CPU: fixed, a 128K run takes seconds */
  int repetitions;
  int scores_only;        /* select.block_scores (stages 1-3 fused, what select_run spends most in) */
  /* Prepared on first use, kept across repetitions. */
  sel_data data;
  int ready;
#ifdef UPF_HAVE_CUDA
  upf_cuda_l2_flush *flush; /* when the rotated copies cannot reach 3x L2 */
#endif
} sel_case;

/* Decode rows (1), requests the guard leaves unscored (37, 200, 256 = sink+L) and scored ones of
 * every size up to 32K, interleaved as a scheduler would pack them. */
static const int32_t ragged_lens[] = {32768, 1,    1,    8192, 200,  1,   4096, 257, 1,  1,    16384, 1000,
                                      1,     2048, 256,  1,    12345, 4095, 1,   1,   37, 511,  1,     24576};
#define RAGGED_REQS ((int32_t)(sizeof ragged_lens / sizeof ragged_lens[0]))

#define CPU_CASE(T, iters, reps)                                                                      \
  { .name = "select/cpu/bf16", .dtype = UPF_DTYPE_BF16, .num_reqs = 1, .len = (T), .iterations = (iters), \
    .repetitions = (reps) }
#define CUDA_CASE(family, dt, B, n) { .name = (family), .on_cuda = 1, .dtype = (dt), .num_reqs = (B), .len = (n) }
#define SCORES_CASE(n)                                                                                \
  { .name = "select.block_scores/cuda/bf16", .on_cuda = 1, .dtype = UPF_DTYPE_BF16, .num_reqs = 1, .len = (n), \
    .scores_only = 1 }

static sel_case cases[] = {
    /* CPU reference, one request: seconds per run at 128K on two cores, so fixed iterations. */
    CPU_CASE(8192, 2, 5),
    CPU_CASE(32768, 1, 3),
    CPU_CASE(131072, 1, 2),
    /* CUDA, one request. */
    CUDA_CASE("select/cuda/bf16", UPF_DTYPE_BF16, 1, 8192),
    CUDA_CASE("select/cuda/bf16", UPF_DTYPE_BF16, 1, 32768),
    CUDA_CASE("select/cuda/bf16", UPF_DTYPE_BF16, 1, 131072),
    CUDA_CASE("select/cuda/bf16", UPF_DTYPE_BF16, 1, 1048576),
    CUDA_CASE("select/cuda/f32", UPF_DTYPE_F32, 1, 8192),
    CUDA_CASE("select/cuda/f32", UPF_DTYPE_F32, 1, 32768),
    CUDA_CASE("select/cuda/f32", UPF_DTYPE_F32, 1, 131072),
    CUDA_CASE("select/cuda/f32", UPF_DTYPE_F32, 1, 1048576),
    /* CUDA, batches of many requests. */
    CUDA_CASE("select/cuda/bf16/batch", UPF_DTYPE_BF16, 16, 8192),
    CUDA_CASE("select/cuda/bf16/batch", UPF_DTYPE_BF16, 64, 2048),
    {.name = "select/cuda/bf16/ragged", .on_cuda = 1, .dtype = UPF_DTYPE_BF16, .num_reqs = RAGGED_REQS,
     .lens = ragged_lens},
    /* CUDA, the block scores alone: select_run less its top-p and expansion (their cost by difference). */
    SCORES_CASE(32768),
    SCORES_CASE(131072),
    SCORES_CASE(1048576),
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

/* Only one case holds its (possibly tens of GB of) inputs at a time; Google Benchmark runs all
 * repetitions of a benchmark back to back, so each case is prepared once. */
static sel_case *live_case;

static void case_release(void *ctx) {
  sel_case *c = ctx;
  sel_data_release(&c->data);
#ifdef UPF_HAVE_CUDA
  upf_cuda_l2_flush_destroy(c->flush);
  c->flush = NULL;
#endif
  c->ready = 0;
  if (live_case == c)
    live_case = NULL;
}

/* cu_seqlens of the case (host, malloc'd; NULL when out of memory). */
static int32_t *case_cu(const sel_case *c) {
  int32_t *cu = malloc((size_t)(c->num_reqs + 1) * sizeof *cu);
  if (!cu)
    return NULL;
  cu[0] = 0;
  for (int32_t r = 0; r < c->num_reqs; r++)
    cu[r + 1] = cu[r] + (c->lens ? c->lens[r] : c->len);
  return cu;
}

static upf_status case_prepare(sel_case *c, const upf_backend *be, int copies) {
  if (c->ready)
    return UPF_OK;
  if (live_case)
    case_release(live_case);
  int32_t *cu = case_cu(c);
  if (!cu)
    return upf_fail(UPF_ERR_NOMEM, "bench select: cu_seqlens");
  upf_status st = sel_data_create(&c->data, be, c->dtype, cu, c->num_reqs, copies, c->scores_only);
  free(cu);
  if (st == UPF_OK)
    c->ready = 1, live_case = c;
  return st;
}

static void set_work_counters(upf_bench_state *st, const sel_data *d, int64_t kept_total) {
  sel_work w = select_work(d->cu_host, d->num_reqs, d->dtype);
  upf_bench_set_counter(st, UPF_BENCH_FLOPS, w.flops, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, UPF_BENCH_BYTES, select_bytes(d, w, kept_total), UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, "kept_frac", (double)kept_total / (double)d->T, UPF_BENCH_COUNTER_VALUE);
}

static void bench_select_cpu(upf_bench_state *st, void *ctx) {
  sel_case *c = ctx;
  const upf_backend *be = upf_backend_cpu();
  if (case_prepare(c, be, 1) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  upf_select_params p = upf_select_params_default();
  upf_select_inputs in = sel_inputs(&c->data, 0);
  while (upf_bench_keep_running(st)) {
    if (be->select_run(&in, &p, &c->data.out) != UPF_OK) {
      upf_bench_skip_with_error(st, "select_run: %s", upf_last_error());
      return;
    }
  }
  set_work_counters(st, &c->data, c->data.out.kept_total);
}

#ifdef UPF_HAVE_CUDA
/* ---- Verify before timing (CUDA) ----
 * A small ragged companion batch (a decode row, an unscored request, two scored ones; T=4096) runs
 * through select_run on CUDA and on the CPU reference. Decisions may differ on marginal blocks only,
 * so kept counts may differ by at most one block per request; block scores must agree within rtol
 * (plus an absolute floor of 1e-7 of a request's total mass L*Hq, for fp32 underflow of far tails). */
static const int32_t verify_cu[] = {0, 1, 201, 1501, 4096}; /* lengths 1, 200, 1300, 2595 */
#define VERIFY_REQS ((int32_t)(sizeof verify_cu / sizeof verify_cu[0]) - 1)

typedef struct {
  float *block_score;   /* (num_blocks) */
  uint8_t *block_mask;  /* (num_blocks) */
  uint8_t *token_mask;  /* (T) */
  int32_t *kept_index;  /* (T) */
  int32_t *new_cu;      /* (B+1) */
  int32_t *kept_count;  /* (B) */
  int64_t kept_total;
} host_outputs;

static void host_outputs_free(host_outputs *h) {
  free(h->block_score), free(h->block_mask), free(h->token_mask), free(h->kept_index), free(h->new_cu),
      free(h->kept_count);
}

/* Runs select_run on d and brings the outputs to the host. */
static upf_status run_to_host(sel_data *d, host_outputs *h) {
  upf_select_params p = upf_select_params_default();
  upf_select_inputs in = sel_inputs(d, 0);
  size_t T = (size_t)d->T, B = (size_t)d->num_reqs, nb = (size_t)d->num_blocks;
  memset(h, 0, sizeof *h);
  h->block_score = malloc(nb * sizeof(float));
  h->block_mask = malloc(nb);
  h->token_mask = malloc(T);
  h->kept_index = malloc(T * sizeof(int32_t));
  h->new_cu = malloc((B + 1) * sizeof(int32_t));
  h->kept_count = malloc(B * sizeof(int32_t));
  if (!h->block_score || !h->block_mask || !h->token_mask || !h->kept_index || !h->new_cu || !h->kept_count)
    return upf_fail(UPF_ERR_NOMEM, "verify: host outputs");
  UPF_TRY(upf_fail_context(d->be->select_run(&in, &p, &d->out), "select_run: "));
  h->kept_total = d->out.kept_total;
  UPF_TRY(d->be->download(h->block_score, d->out.block_score, nb * sizeof(float)));
  UPF_TRY(d->be->download(h->block_mask, d->out.block_mask, nb));
  UPF_TRY(d->be->download(h->token_mask, d->out.token_mask, T));
  UPF_TRY(d->be->download(h->kept_index, d->out.kept_index, T * sizeof(int32_t)));
  UPF_TRY(d->be->download(h->new_cu, d->out.new_cu_seqlens, (B + 1) * sizeof(int32_t)));
  return d->be->download(h->kept_count, d->out.kept_count, B * sizeof(int32_t));
}

/* Returns 1 when `got` passes; otherwise 0 with the first problem in `why`. */
static int compare_outputs(const sel_data *d, const host_outputs *ref, const host_outputs *got, double rtol,
                           char *why, size_t cap) {
  upf_select_params p = upf_select_params_default();
  const int32_t *cu = d->cu_host;
  double atol = 1e-7 * p.last_q * SEL_HQ;
  if (got->kept_total < 0 || got->kept_total > d->T || got->new_cu[0] != 0 ||
      got->new_cu[d->num_reqs] != got->kept_total) {
    snprintf(why, cap, "kept_total %lld inconsistent with new_cu_seqlens [0]=%d [B]=%d (T=%lld)",
             (long long)got->kept_total, got->new_cu[0], got->new_cu[d->num_reqs], (long long)d->T);
    return 0;
  }
  for (int64_t i = 0; i < got->kept_total; i++)
    if ((i > 0 && got->kept_index[i] <= got->kept_index[i - 1]) || got->kept_index[i] < 0 ||
        got->kept_index[i] >= d->T || !got->token_mask[got->kept_index[i]]) {
      snprintf(why, cap, "kept_index[%lld]=%d is not ascending or not a kept token", (long long)i,
               got->kept_index[i]);
      return 0;
    }
  int64_t block0 = 0;
  for (int32_t r = 0; r < d->num_reqs; r++) {
    int64_t n = cu[r + 1] - cu[r], nb = upf_select_blocks_of(n, p.block), masked = 0;
    for (int64_t j = cu[r]; j < cu[r + 1]; j++)
      masked += got->token_mask[j] != 0;
    int scored = upf_select_is_scored(n, &p);
    int64_t slack = scored ? p.block : 0;
    if (masked != got->kept_count[r] || got->new_cu[r + 1] - got->new_cu[r] != got->kept_count[r]) {
      snprintf(why, cap, "request %d: token mask holds %lld tokens, kept_count %d, new_cu step %d", r,
               (long long)masked, got->kept_count[r], got->new_cu[r + 1] - got->new_cu[r]);
      return 0;
    }
    if (llabs((long long)got->kept_count[r] - ref->kept_count[r]) > slack) {
      snprintf(why, cap, "request %d (n=%lld): kept %d tokens, the CPU reference %d (allowed difference %lld)", r,
               (long long)n, got->kept_count[r], ref->kept_count[r], (long long)slack);
      return 0;
    }
    for (int64_t c = block0; c < block0 + nb; c++) {
      double a = got->block_score[c], b = ref->block_score[c];
      if (!isfinite(a) || fabs(a - b) > rtol * fabs(b) + atol) {
        snprintf(why, cap, "request %d block %lld: score %.9g, CPU reference %.9g (rtol %g)", r,
                 (long long)(c - block0), a, b, rtol);
        return 0;
      }
    }
    block0 += nb;
  }
  return 1;
}

static upf_status verify_once(upf_dtype dtype, int *passed, char *why, size_t cap) {
  sel_data ref_data, dev_data;
  host_outputs ref, got;
  memset(&ref, 0, sizeof ref), memset(&got, 0, sizeof got);
  *passed = 0;
  upf_status st = sel_data_create(&ref_data, upf_backend_cpu(), dtype, verify_cu, VERIFY_REQS, 1, 1);
  if (st != UPF_OK)
    return upf_fail_context(st, "cpu inputs: ");
  st = sel_data_create(&dev_data, upf_backend_cuda(), dtype, verify_cu, VERIFY_REQS, 1, 1);
  if (st != UPF_OK) {
    sel_data_release(&ref_data);
    return upf_fail_context(st, "cuda inputs: ");
  }
  st = run_to_host(&ref_data, &ref);
  if (st == UPF_OK) {
    st = run_to_host(&dev_data, &got);
    if (st != UPF_OK)
      upf_fail_context(st, "cuda ");
  } else {
    upf_fail_context(st, "cpu ");
  }
  if (st == UPF_OK)
    *passed = compare_outputs(&ref_data, &ref, &got, dtype == UPF_DTYPE_BF16 ? 1.6e-2 : 1e-5, why, cap);
  host_outputs_free(&ref), host_outputs_free(&got);
  sel_data_release(&ref_data), sel_data_release(&dev_data);
  return st;
}

/* Verified once per dtype and remembered: every CUDA case of that dtype runs the same kernels. */
static int verify_cached(upf_dtype dtype, char *why, size_t cap) {
  static int state[2]; /* 0 not yet, 1 passed, -1 failed; [0] f32, [1] bf16 */
  static char message[2][512];
  int i = dtype == UPF_DTYPE_BF16;
  if (state[i] == 0) {
    int passed = 0;
    if (verify_once(dtype, &passed, message[i], sizeof message[i]) != UPF_OK)
      snprintf(message[i], sizeof message[i], "%s", upf_last_error());
    state[i] = passed ? 1 : -1;
  }
  snprintf(why, cap, "%s", message[i]);
  return state[i] == 1;
}

/* Copies of the inputs to rotate through so that what one iteration reads has left L2 by the time
 * it is read again (3x L2 of other reads in between), within SEL_COPY_BUDGET of device memory. */
static int rotation_copies(int64_t T, upf_dtype dtype, double bytes_read, int64_t l2) {
  int64_t per_copy = T * (SEL_HQ + SEL_HKV) * SEL_D * (int64_t)upf_dtype_size(dtype);
  double want = ceil(3.0 * (double)l2 / (bytes_read > 0.0 ? bytes_read : 1.0));
  int64_t fit = SEL_COPY_BUDGET / (per_copy > 0 ? per_copy : 1);
  int copies = want < SEL_MAX_COPIES ? (int)want : SEL_MAX_COPIES;
  if (copies > fit)
    copies = (int)fit;
  return copies < 1 ? 1 : copies;
}

static upf_status prepare_cuda_case(sel_case *c, const upf_backend *be) {
  if (c->ready)
    return UPF_OK;
  int64_t l2 = 0;
  UPF_TRY(upf_cuda_l2_bytes(&l2));
  int32_t *cu = case_cu(c);
  if (!cu)
    return upf_fail(UPF_ERR_NOMEM, "bench select: cu_seqlens");
  double bytes_read = select_work(cu, c->num_reqs, c->dtype).bytes_in;
  int copies = rotation_copies(cu[c->num_reqs], c->dtype, bytes_read, l2);
  free(cu);
  UPF_TRY(case_prepare(c, be, copies));
  if ((double)copies * bytes_read < 3.0 * (double)l2)
    UPF_TRY(upf_cuda_l2_flush_create(&c->flush));
  return UPF_OK;
}

/* One timed call of the case's op on copy `copy` of its inputs. */
static upf_status run_case(const sel_case *c, sel_data *d, int copy, const upf_select_params *p) {
  upf_select_inputs in = sel_inputs(d, copy);
  return c->scores_only ? d->be->select_block_scores(&in, p, d->out.block_score) : d->be->select_run(&in, p, &d->out);
}

/* Before timing select.block_scores on the case's own inputs: its scores equal select_run's bit for bit
 * (the same kernels, and select_run's are verified against the CPU reference first). */
static upf_status scores_match_pipeline(sel_data *d, const upf_select_params *p, char *why, size_t cap, int *ok) {
  const size_t nb = (size_t)d->num_blocks;
  float *a = malloc(nb * sizeof *a), *b = malloc(nb * sizeof *b);
  upf_select_inputs in = sel_inputs(d, 0);
  upf_status st = a && b ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "bench select: %zu block scores", nb);
  if (st == UPF_OK)
    st = upf_fail_context(d->be->select_run(&in, p, &d->out), "select_run: ");
  if (st == UPF_OK)
    st = d->be->download(a, d->out.block_score, nb * sizeof *a);
  if (st == UPF_OK)
    st = upf_fail_context(d->be->select_block_scores(&in, p, d->out.block_score), "select.block_scores: ");
  if (st == UPF_OK)
    st = d->be->download(b, d->out.block_score, nb * sizeof *b);
  *ok = 1;
  for (size_t i = 0; st == UPF_OK && i < nb && *ok; i++)
    if (memcmp(&a[i], &b[i], sizeof a[i]) != 0) {
      snprintf(why, cap, "block %zu: select.block_scores %.9g, select_run %.9g", i, (double)b[i], (double)a[i]);
      *ok = 0;
    }
  free(a), free(b);
  return st;
}
#endif /* UPF_HAVE_CUDA */

static void bench_select_cuda(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  sel_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  char why[512];
  double ceiling = 0.0;
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  if (!verify_cached(c->dtype, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
    return;
  }
  if (upf_bench_copy_ceiling(&ceiling) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s", upf_last_error());
    return;
  }
  if (prepare_cuda_case(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  sel_data *d = &c->data;
  upf_select_params p = upf_select_params_default();
  upf_cuda_timer *timer = NULL;
  if (upf_cuda_timer_create(&timer) != UPF_OK) {
    upf_bench_skip_with_error(st, "timer: %s", upf_last_error());
    return;
  }
  upf_status s = UPF_OK;
  for (int i = 0; s == UPF_OK && i < SEL_WARMUP; i++)
    s = run_case(c, d, i % d->copies, &p);
  if (s == UPF_OK && !c->scores_only && (d->out.kept_total < 1 || d->out.kept_total > d->T))
    s = upf_fail(UPF_ERR_INVALID_ARG, "kept_total %lld outside [1, T=%lld]", (long long)d->out.kept_total,
                 (long long)d->T);
  int same = 1;
  if (s == UPF_OK && c->scores_only)
    s = scores_match_pipeline(d, &p, why, sizeof why, &same);
  if (s == UPF_OK && !same) {
    upf_bench_skip_with_error(st, "not timed, the block scores differ from select_run's: %s", why);
    upf_cuda_timer_destroy(timer);
    return;
  }
  if (s != UPF_OK) {
    upf_bench_skip_with_error(st, "warm-up: %s", upf_last_error());
    upf_cuda_timer_destroy(timer);
    return;
  }
  double total_s = 0.0;
  int64_t iter = 0;
  while (upf_bench_keep_running(st)) {
    const int copy = (int)(iter++ % d->copies);
    double seconds = 0.0;
    if (c->flush)
      s = upf_cuda_l2_flush_run(c->flush); /* enqueued before the start event: not timed */
    if (s == UPF_OK)
      s = upf_cuda_timer_start(timer);
    if (s == UPF_OK)
      s = run_case(c, d, copy, &p);
    if (s == UPF_OK)
      s = upf_cuda_timer_stop(timer, &seconds);
    if (s != UPF_OK) {
      upf_bench_skip_with_error(st, "%s: %s", c->scores_only ? "select.block_scores" : "select_run", upf_last_error());
      break;
    }
    upf_bench_set_iteration_time(st, seconds);
    total_s += seconds;
  }
  upf_cuda_timer_destroy(timer);
  if (s != UPF_OK)
    return;
  sel_work w = select_work(d->cu_host, d->num_reqs, d->dtype);
  /* block_scores writes its scores, select_run its masks, index and counts */
  const double bytes = c->scores_only ? w.bytes_in + 4.0 * (double)d->num_blocks : select_bytes(d, w, d->out.kept_total);
  if (c->scores_only) {
    upf_bench_set_counter(st, UPF_BENCH_FLOPS, w.flops, UPF_BENCH_COUNTER_RATE);
    upf_bench_set_counter(st, UPF_BENCH_BYTES, bytes, UPF_BENCH_COUNTER_RATE);
  } else {
    set_work_counters(st, d, d->out.kept_total);
  }
  /* The same rate Google Benchmark derives for UPF_BENCH_BYTES (manual seconds summed over the run). */
  double bytes_per_s = total_s > 0.0 ? bytes * (double)iter / total_s : NAN;
  upf_bench_set_counter(st, UPF_BENCH_COPY_SHARE, bytes_per_s / ceiling, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "copies", d->copies, UPF_BENCH_COUNTER_VALUE);
#endif
}

/* ---- The ceiling as a benchmark of its own, so it appears in the JSON beside the results ---- */

static void bench_copy_bandwidth(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  const upf_backend *be = upf_backend_cuda();
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  void *src = NULL, *dst = NULL;
  upf_cuda_timer *timer = NULL;
  upf_status s = be->alloc(&src, COPY_BENCH_BYTES);
  if (s == UPF_OK)
    s = be->alloc(&dst, COPY_BENCH_BYTES);
  if (s == UPF_OK)
    s = be->fill(src, 0x3c, COPY_BENCH_BYTES);
  if (s == UPF_OK)
    s = upf_cuda_timer_create(&timer);
  for (int i = 0; s == UPF_OK && i < SEL_WARMUP; i++)
    s = upf_cuda_copy_async(dst, src, COPY_BENCH_BYTES);
  while (s == UPF_OK && upf_bench_keep_running(st)) {
    double seconds = 0.0;
    s = upf_cuda_timer_start(timer);
    if (s == UPF_OK)
      s = upf_cuda_copy_async(dst, src, COPY_BENCH_BYTES);
    if (s == UPF_OK)
      s = upf_cuda_timer_stop(timer, &seconds);
    if (s == UPF_OK)
      upf_bench_set_iteration_time(st, seconds);
  }
  if (s != UPF_OK)
    upf_bench_skip_with_error(st, "copy: %s", upf_last_error());
  else /* read + written */
    upf_bench_set_counter(st, UPF_BENCH_BYTES, 2.0 * (double)COPY_BENCH_BYTES, UPF_BENCH_COUNTER_RATE);
  upf_cuda_timer_destroy(timer);
  be->release(src);
  be->release(dst);
#endif
}

/* ---- Registration ---- */

static void register_or_report(const upf_bench_spec *spec) {
  /* Only a programming error (a duplicate name) fails here; say so rather than lose the benchmark. */
  if (upf_bench_register(spec) != UPF_OK)
    fprintf(stderr, "bench select: %s\n", upf_last_error());
}

void upf_register_select_benchmarks(void) {
  /* A benchmark that can only skip gets one repetition, so each prints one line, not ten. */
  int cuda_ok = upf_backend_cuda()->probe() == UPF_OK;
  int cuda_reps = cuda_ok ? SEL_CUDA_REPETITIONS : 1;
  upf_bench_spec copy = {.name = "copy_bandwidth", .fn = bench_copy_bandwidth, .flags = UPF_BENCH_MANUAL_TIME,
                         .unit = UPF_BENCH_US, .min_time_s = SEL_CUDA_MIN_TIME_S, .repetitions = cuda_reps};
  register_or_report(&copy);
  for (int i = 0; i < NUM_CASES; i++) {
    sel_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .teardown = case_release};
    if (c->on_cuda) {
      spec.fn = bench_select_cuda;
      spec.flags = UPF_BENCH_MANUAL_TIME;
      spec.unit = UPF_BENCH_US;
      spec.min_time_s = SEL_CUDA_MIN_TIME_S;
      spec.repetitions = cuda_reps;
    } else {
      spec.fn = bench_select_cpu;
      spec.flags = UPF_BENCH_REAL_TIME;
      spec.unit = UPF_BENCH_MS;
      spec.iterations = c->iterations;
      spec.repetitions = c->repetitions;
    }
    if (c->lens) { /* ragged: the request count and total tokens name it */
      int64_t T = 0;
      for (int32_t r = 0; r < c->num_reqs; r++)
        T += c->lens[r];
      spec.num_args = 2;
      spec.args[0] = c->num_reqs, spec.arg_names[0] = "B";
      spec.args[1] = T, spec.arg_names[1] = "T";
    } else if (c->num_reqs > 1) {
      spec.num_args = 2;
      spec.args[0] = c->num_reqs, spec.arg_names[0] = "B";
      spec.args[1] = c->len, spec.arg_names[1] = "n";
    } else {
      spec.num_args = 1;
      spec.args[0] = c->len, spec.arg_names[0] = "T";
    }
    register_or_report(&spec);
  }
}

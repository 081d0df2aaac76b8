/* Benchmarks of the attention ops: causal and sliding-window prefill at Llama-3.1-8B and Gemma-3-12B
 * head shapes, paged decode (many rows, and one long row that takes the split-KV path), the cache
 * write, and a small CPU-reference case. TFLOP/s from the exact causal/window FLOP count
 * (upf_attn_flops), TB/s from q, k, v, out counted once. CUDA cases are verified (the op's quick set)
 * before timing and skipped by name without a device. The kernel variants of attn.prefill and attn.paged
 * (`upf ops`) are selected with UPF_VARIANT=op=name or --variant; a CUDA case whose kernel the variant
 * picks carries it in its label ("attn.prefill=fa2"), so a result says which kernel ran. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"
#include "uniprefill/variant.h"

#ifdef UPF_HAVE_CUDA
#include "cuda/perf_support.cuh"
#endif

#define ATTN_CUDA_REPETITIONS 10
#define ATTN_CUDA_MIN_TIME_S 0.1
#define ATTN_WARMUP 3

typedef enum { A_PREFILL, A_PAGED, A_WRITE } attn_kind;

typedef struct {
  const char *name;
  attn_kind kind;
  int on_cuda;
  upf_dtype dt;
  int32_t B, q_len, kv_len; /* B requests of q_len rows over kv_len keys each */
  int64_t hq, hkv, d;
  int32_t window, page;
  int64_t iterations; /* CPU cases */
  /* prepared state */
  const upf_backend *be;
  void *q, *k, *v, *out, *lse, *cu_q, *cu_kv, *kv_lens, *bt;
  int32_t *cu_q_host, *cu_kv_host, *kv_lens_host, *bt_host;
  int32_t max_blocks, num_pages;
} attn_bench_case;

#define BF UPF_DTYPE_BF16
#define F32 UPF_DTYPE_F32

static attn_bench_case cases[] = {
    {"attn_prefill/cuda/bf16/llama_causal", A_PREFILL, 1, BF, 1, 4096, 4096, 32, 8, 128, 0, 0, 0},
    {"attn_prefill/cuda/bf16/llama_causal", A_PREFILL, 1, BF, 1, 16384, 16384, 32, 8, 128, 0, 0, 0},
    {"attn_prefill/cuda/bf16/llama_causal", A_PREFILL, 1, BF, 1, 32768, 32768, 32, 8, 128, 0, 0, 0},
    {"attn_prefill/cuda/bf16/llama_causal", A_PREFILL, 1, BF, 1, 131072, 131072, 32, 8, 128, 0, 0, 0},
    {"attn_prefill/cuda/bf16/d64_causal", A_PREFILL, 1, BF, 1, 32768, 32768, 32, 8, 64, 0, 0, 0},
    {"attn_prefill/cuda/bf16/d64_causal", A_PREFILL, 1, BF, 1, 131072, 131072, 32, 8, 64, 0, 0, 0},
    {"attn_prefill/cuda/bf16/llama_causal_batch8", A_PREFILL, 1, BF, 8, 2048, 2048, 32, 8, 128, 0, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_swa1024", A_PREFILL, 1, BF, 1, 4096, 4096, 16, 8, 256, 1024, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_swa1024", A_PREFILL, 1, BF, 1, 16384, 16384, 16, 8, 256, 1024, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_swa1024", A_PREFILL, 1, BF, 1, 65536, 65536, 16, 8, 256, 1024, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_global", A_PREFILL, 1, BF, 1, 8192, 8192, 16, 8, 256, 0, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_global", A_PREFILL, 1, BF, 1, 32768, 32768, 16, 8, 256, 0, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_global", A_PREFILL, 1, BF, 1, 131072, 131072, 16, 8, 256, 0, 0, 0},
    /* global causal with as many visible (query, key) pairs as the window-1024 cases at 4K, 16K, 64K:
     * T (T + 1) / 2 = 1024 * 1025 / 2 + (T_window - 1024) * 1024 (within 0.01%) */
    {"attn_prefill/cuda/bf16/gemma_global_eqkeys", A_PREFILL, 1, BF, 1, 2709, 2709, 16, 8, 256, 0, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_global_eqkeys", A_PREFILL, 1, BF, 1, 5701, 5701, 16, 8, 256, 0, 0, 0},
    {"attn_prefill/cuda/bf16/gemma_global_eqkeys", A_PREFILL, 1, BF, 1, 11540, 11540, 16, 8, 256, 0, 0, 0},
    {"attn_prefill/cuda/f32/llama_causal", A_PREFILL, 1, F32, 1, 4096, 4096, 32, 8, 128, 0, 0, 0},
    {"attn_prefill/cuda/bf16/llama_cached_chunk", A_PREFILL, 1, BF, 1, 2048, 32768, 32, 8, 128, 0, 0, 0},
    {"attn_paged/cuda/bf16/llama_decode_b64", A_PAGED, 1, BF, 64, 1, 4096, 32, 8, 128, 0, 16, 0},
    {"attn_paged/cuda/bf16/llama_decode_b16_p16", A_PAGED, 1, BF, 16, 1, 32768, 32, 8, 128, 0, 16, 0},
    {"attn_paged/cuda/bf16/llama_decode_b16_p64", A_PAGED, 1, BF, 16, 1, 32768, 32, 8, 128, 0, 64, 0},
    {"attn_paged/cuda/bf16/llama_decode_b32_p16", A_PAGED, 1, BF, 32, 1, 65536, 32, 8, 128, 0, 16, 0},
    {"attn_paged/cuda/bf16/llama_decode_long", A_PAGED, 1, BF, 1, 1, 131072, 32, 8, 128, 0, 16, 0},
    {"attn_paged/cuda/bf16/gemma_decode_swa_b64", A_PAGED, 1, BF, 64, 1, 8192, 16, 8, 256, 1024, 16, 0},
    {"kv_cache_write/cuda/bf16/llama", A_WRITE, 1, BF, 8192, 1, 1, 32, 8, 128, 0, 16, 0},
    {"attn_prefill/cpu/f32/small", A_PREFILL, 0, F32, 1, 256, 256, 4, 1, 64, 0, 0, 3},
    {"attn_paged/cpu/f32/decode_small", A_PAGED, 0, F32, 4, 1, 1024, 8, 2, 64, 0, 16, 3},
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

static double case_flops(const attn_bench_case *c) {
  if (c->kind == A_WRITE)
    return 0.0;
  double per = 0.0;
  int32_t q = c->q_len, kv = c->kv_len;
  per = upf_attn_flops(&q, &kv, 1, c->hq, c->d, c->window);
  return per * c->B;
}

static double case_bytes(const attn_bench_case *c) {
  double es = (double)upf_dtype_size(c->dt), rows_q = (double)c->B * c->q_len;
  if (c->kind == A_WRITE) /* k, v read and written */
    return 4.0 * c->B * (double)c->hkv * c->d * es;
  double kv = (double)c->B * c->kv_len * 2.0 * c->hkv * c->d * es;
  if (c->window > 0 && c->kv_len > c->window && c->kind == A_PAGED)
    kv = (double)c->B * c->window * 2.0 * c->hkv * c->d * es;
  return 2.0 * rows_q * c->hq * c->d * es + kv + 4.0 * rows_q * c->hq;
}

static void case_release(void *ctx) {
  attn_bench_case *c = ctx;
  if (!c->be)
    return;
  void *bufs[9] = {c->q, c->k, c->v, c->out, c->lse, c->cu_q, c->cu_kv, c->kv_lens, c->bt};
  for (int i = 0; i < 9; i++)
    if (bufs[i])
      c->be->release(bufs[i]);
  free(c->cu_q_host), free(c->cu_kv_host), free(c->kv_lens_host), free(c->bt_host);
  c->q = c->k = c->v = c->out = c->lse = c->cu_q = c->cu_kv = c->kv_lens = c->bt = NULL;
  c->cu_q_host = c->cu_kv_host = c->kv_lens_host = c->bt_host = NULL;
  c->be = NULL;
}

static upf_status put_random(const upf_backend *be, void **dst, int64_t n, upf_dtype dt, uint64_t seed) {
  size_t es = upf_dtype_size(dt), bytes = (size_t)n * es;
  UPF_TRY(be->alloc(dst, bytes));
  /* 1M random values tiled: the kernels' speed does not depend on the exact values */
  int64_t chunk = n < (1 << 20) ? n : (1 << 20);
  void *host = malloc((size_t)(chunk ? chunk : 1) * es);
  if (!host)
    return upf_fail(UPF_ERR_NOMEM, "bench attn: host staging");
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  for (int64_t i = 0; i < chunk; i++) {
    float x = upf_rng_normal(&rng);
    if (dt == UPF_DTYPE_BF16)
      ((uint16_t *)host)[i] = upf_bf16_from_f32(x);
    else
      ((float *)host)[i] = x;
  }
  upf_status st = UPF_OK;
  for (int64_t off = 0; st == UPF_OK && off < n; off += chunk) {
    int64_t len = n - off < chunk ? n - off : chunk;
    st = be->upload((char *)*dst + (size_t)off * es, host, (size_t)len * es);
  }
  free(host);
  return st;
}

static upf_status put_ints(const upf_backend *be, void **dst, const int32_t *vals, int64_t n) {
  UPF_TRY(be->alloc(dst, (size_t)(n ? n : 1) * sizeof(int32_t)));
  return be->upload(*dst, vals, (size_t)n * sizeof(int32_t));
}

static attn_bench_case *live_case; /* one case holds its (up to GBs of) buffers at a time */

static upf_status case_prepare(attn_bench_case *c, const upf_backend *be) {
  if (c->be == be)
    return UPF_OK;
  if (live_case && live_case != c)
    case_release(live_case);
  case_release(c);
  live_case = c;
  c->be = be;
  int64_t B = c->B, Tq = B * c->q_len, Tkv = B * (int64_t)c->kv_len, row = c->hkv * c->d;
  c->cu_q_host = malloc((size_t)(B + 1) * sizeof(int32_t));
  c->cu_kv_host = malloc((size_t)(B + 1) * sizeof(int32_t));
  c->kv_lens_host = malloc((size_t)B * sizeof(int32_t));
  if (!c->cu_q_host || !c->cu_kv_host || !c->kv_lens_host)
    return upf_fail(UPF_ERR_NOMEM, "bench attn: index arrays");
  for (int64_t r = 0; r <= B; r++) {
    c->cu_q_host[r] = (int32_t)(r * c->q_len);
    c->cu_kv_host[r] = (int32_t)(r * c->kv_len);
    if (r < B)
      c->kv_lens_host[r] = c->kv_len;
  }
  if (c->kind == A_WRITE) { /* B rows into the first B slots of a cache of B slots */
    int64_t P = c->page, pages = (B + P - 1) / P;
    c->num_pages = (int32_t)pages;
    for (int64_t r = 0; r < B; r++)
      c->kv_lens_host[r] = (int32_t)r; /* the slot mapping */
    UPF_TRY(put_random(be, &c->k, B * row, c->dt, 1));
    UPF_TRY(put_random(be, &c->v, B * row, c->dt, 2));
    UPF_TRY(put_random(be, &c->q, pages * P * row, c->dt, 3)); /* k_cache */
    UPF_TRY(put_random(be, &c->out, pages * P * row, c->dt, 4)); /* v_cache */
    return put_ints(be, &c->kv_lens, c->kv_lens_host, B);
  }
  UPF_TRY(put_random(be, &c->q, Tq * c->hq * c->d, c->dt, 5));
  UPF_TRY(be->alloc(&c->out, (size_t)(Tq * c->hq * c->d) * upf_dtype_size(c->dt)));
  UPF_TRY(be->alloc(&c->lse, (size_t)(Tq * c->hq) * sizeof(float)));
  UPF_TRY(put_ints(be, &c->cu_q, c->cu_q_host, B + 1));
  if (c->kind == A_PREFILL) {
    UPF_TRY(put_random(be, &c->k, Tkv * row, c->dt, 6));
    UPF_TRY(put_random(be, &c->v, Tkv * row, c->dt, 7));
    return put_ints(be, &c->cu_kv, c->cu_kv_host, B + 1);
  }
  int64_t P = c->page;
  c->max_blocks = (int32_t)((c->kv_len + P - 1) / P);
  c->num_pages = (int32_t)(B * c->max_blocks);
  c->bt_host = malloc((size_t)c->num_pages * sizeof(int32_t));
  if (!c->bt_host)
    return upf_fail(UPF_ERR_NOMEM, "bench attn: block table");
  /* pages interleaved across requests, as a long-running server's free list hands them out */
  for (int64_t r = 0; r < B; r++)
    for (int64_t i = 0; i < c->max_blocks; i++)
      c->bt_host[r * c->max_blocks + i] = (int32_t)(i * B + r);
  UPF_TRY(put_random(be, &c->k, (int64_t)c->num_pages * P * row, c->dt, 8));
  UPF_TRY(put_random(be, &c->v, (int64_t)c->num_pages * P * row, c->dt, 9));
  UPF_TRY(put_ints(be, &c->kv_lens, c->kv_lens_host, B));
  return put_ints(be, &c->bt, c->bt_host, c->num_pages);
}

static upf_status case_call(const attn_bench_case *c, const upf_backend *be) {
  int64_t B = c->B, Tq = B * c->q_len, Tkv = B * (int64_t)c->kv_len;
  upf_attn_params p = {0.0f, 0.0f, c->window};
  upf_tensor q, k, v, o, l;
  const int64_t sq[3] = {Tq, c->hq, c->d}, sl[2] = {Tq, c->hq};
  if (c->kind == A_WRITE) {
    const int64_t sr[3] = {B, c->hkv, c->d}, sc[4] = {c->num_pages, c->page, c->hkv, c->d};
    upf_tensor_init(&k, c->k, c->dt, 3, sr), upf_tensor_init(&v, c->v, c->dt, 3, sr);
    upf_tensor_init(&q, c->q, c->dt, 4, sc), upf_tensor_init(&o, c->out, c->dt, 4, sc);
    return be->kv_cache_write(&k, &v, c->kv_lens, c->kv_lens_host, &q, &o);
  }
  upf_tensor_init(&q, c->q, c->dt, 3, sq), upf_tensor_init(&o, c->out, c->dt, 3, sq);
  upf_tensor_init(&l, c->lse, UPF_DTYPE_F32, 2, sl);
  if (c->kind == A_PREFILL) {
    const int64_t skv[3] = {Tkv, c->hkv, c->d};
    upf_tensor_init(&k, c->k, c->dt, 3, skv), upf_tensor_init(&v, c->v, c->dt, 3, skv);
    upf_attn_varlen b = {c->B, c->cu_q, c->cu_q_host, c->cu_kv, c->cu_kv_host};
    return be->attn_prefill(&b, &q, &k, &v, &p, &o, &l);
  }
  const int64_t sc[4] = {c->num_pages, c->page, c->hkv, c->d};
  upf_tensor_init(&k, c->k, c->dt, 4, sc), upf_tensor_init(&v, c->v, c->dt, 4, sc);
  upf_attn_paged b = {c->B, c->cu_q, c->cu_q_host, c->kv_lens, c->kv_lens_host, c->bt, c->bt_host, c->max_blocks,
                      c->page};
  return be->attn_paged(&b, &q, &k, &v, &p, &o, &l);
}

static upf_op case_op(const attn_bench_case *c) {
  return c->kind == A_PREFILL ? UPF_OP_ATTN_PREFILL : c->kind == A_PAGED ? UPF_OP_ATTN_PAGED : UPF_OP_KV_CACHE_WRITE;
}

#ifdef UPF_HAVE_CUDA
/* The op variant that picks the kernel of a CUDA case (cuda/attn.cu): attn.prefill's for bf16 D = 128
 * and D = 256 prefill (the cases have no soft-cap, which at D = 256 leaves the variant), attn.paged's for bf16 decode rows (fewer than 16 query rows a request) at D = 64/128/256;
 * UPF_OP_COUNT for cases with one kernel. */
static upf_op case_variant_op(const attn_bench_case *c) {
  if (c->dt != UPF_DTYPE_BF16)
    return UPF_OP_COUNT;
  if (c->kind == A_PREFILL && (c->d == 128 || c->d == 256))
    return UPF_OP_ATTN_PREFILL;
  if (c->kind == A_PAGED && c->q_len < 16 && (c->d == 64 || c->d == 128 || c->d == 256))
    return UPF_OP_ATTN_PAGED;
  return UPF_OP_COUNT;
}
#endif

static void set_work_counters(upf_bench_state *st, const attn_bench_case *c) {
  double f = case_flops(c);
  if (f > 0.0)
    upf_bench_set_counter(st, UPF_BENCH_FLOPS, f, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, UPF_BENCH_BYTES, case_bytes(c), UPF_BENCH_COUNTER_RATE);
}

static void bench_cpu(upf_bench_state *st, void *ctx) {
  attn_bench_case *c = ctx;
  const upf_backend *be = upf_backend_cpu();
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  while (upf_bench_keep_running(st)) {
    if (case_call(c, be) != UPF_OK) {
      upf_bench_skip_with_error(st, "%s: %s", upf_op_name(case_op(c)), upf_last_error());
      return;
    }
  }
  set_work_counters(st, c);
}

#ifdef UPF_HAVE_CUDA
static upf_status call_cuda(void *arg) { return case_call(arg, upf_backend_cuda()); }
#endif

static void bench_cuda(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  attn_bench_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  char why[512];
  double copy_bw = 0.0;
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  upf_op op = case_op(c), vop = case_variant_op(c);
  if (vop != UPF_OP_COUNT) { /* before verification: a bad UPF_VARIANT is reported as itself */
    upf_variant v;
    if (upf_variant_current(vop, &v) != UPF_OK) {
      upf_bench_skip_with_error(st, "%s", upf_last_error());
      return;
    }
    char label[64];
    snprintf(label, sizeof label, "%s=%s", upf_op_name(vop), upf_variant_name(v));
    upf_bench_set_label(st, label);
  }
  if (!upf_bench_op_verified(op, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
    return;
  }
  if (upf_bench_copy_ceiling(&copy_bw) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s", upf_last_error());
    return;
  }
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    case_release(c);
    return;
  }
  upf_bench_timing t;
  upf_status s = upf_bench_time_cuda(st, call_cuda, c, ATTN_WARMUP, case_bytes(c), &t);
  if (s != UPF_OK) {
    upf_bench_skip_with_error(st, "%s: %s", upf_op_name(op), upf_last_error());
    return;
  }
  set_work_counters(st, c);
  if (t.total_s > 0.0)
    upf_bench_set_counter(st, UPF_BENCH_COPY_SHARE, case_bytes(c) * (double)t.iterations / t.total_s / copy_bw,
                          UPF_BENCH_COUNTER_VALUE);
#endif
}

void upf_register_attn_benchmarks(void) {
  for (int i = 0; i < NUM_CASES; i++) {
    attn_bench_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .teardown = case_release, .num_args = 2};
    spec.args[0] = c->B;
    spec.arg_names[0] = c->kind == A_WRITE ? "T" : "B";
    spec.args[1] = c->kind == A_WRITE ? c->hkv * c->d : c->kv_len;
    spec.arg_names[1] = c->kind == A_WRITE ? "row" : "kv";
    spec.fn = c->on_cuda ? bench_cuda : bench_cpu;
    upf_bench_spec_timing(&spec, c->on_cuda, ATTN_CUDA_MIN_TIME_S, ATTN_CUDA_REPETITIONS, c->iterations);
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench attn: %s\n", upf_last_error());
  }
}

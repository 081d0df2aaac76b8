/* Benchmarks of the Gated DeltaNet scan (backend->gdn_scan) at Qwen3-Next shapes (16 key heads, 32
 * value heads, Dk = Dv = 128): one long request (8K, 32K, 128K tokens), a batch of 16 requests of 2K,
 * each through the chunked tensor-core form (the default) and (8K, 32K, the batch) the recurrent
 * kernel (the gdn.scan variant "recurrent", uniprefill/variant.h), and a decode step of 256 one-token
 * requests with carried states. One call is the scan of one layer, through the backend table only.
 * TFLOP/s counts the recurrence's own work, 7 Dk Dv per token and value head (decay 1, S^T k 2, the
 * rank-1 update 2, S^T q 2), for both forms and for the FLA peer (perf/peers/fla_gdn.py), so the rates
 * compare times; the chunked form executes about 1.6x that count on tensor cores. TB/s the
 * bytes of q, k, v, a, b, o and the states in and out, each counted once. CUDA cases verify gdn.scan
 * against the CPU reference (its quick verify set) before any timing; without a device they are
 * skipped by name. The CPU case is a small shape, wall clock. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model_config.h"
#include "uniprefill/rng.h"
#include "uniprefill/variant.h"


#define GDN_CUDA_REPETITIONS 5
#define GDN_CUDA_MIN_TIME_S 0.1
#define GDN_WARMUP 2
#define GDN_MAX_REQS 256

typedef struct {
  const char *name;
  int on_cuda;
  upf_variant form; /* CUDA: the gdn.scan variant the case runs under */
  int64_t num_reqs, tokens_per_req; /* ragged: the last request takes the remainder of T */
  int64_t T, hk, hv, dk, dv;
  int with_state;
  int64_t iterations; /* CPU: fixed */
  /* prepared on first use, kept across repetitions */
  int ready;
  const upf_backend *be;
  void *qkv, *ab, *a_log, *dt_bias, *state, *o, *cu;
  int32_t cu_host[GDN_MAX_REQS + 1];
} gdn_bench_case;

#define QK UPF_QWEN3N_80B_LINEAR_KEY_HEADS
#define QV UPF_QWEN3N_80B_LINEAR_VALUE_HEADS
#define QD UPF_QWEN3N_80B_LINEAR_KEY_DIM
#define QDV UPF_QWEN3N_80B_LINEAR_VALUE_DIM

#define CHUNKED UPF_VARIANT_GDN_SCAN_CHUNKED     /* the default: chunked where it fits, else recurrent */
#define RECURRENT UPF_VARIANT_GDN_SCAN_RECURRENT

static gdn_bench_case cases[] = {
    {"gdn.scan/cuda/bf16/qwen3next_prefill/chunked", 1, CHUNKED, 1, 8192, 8192, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_prefill/chunked", 1, CHUNKED, 1, 32768, 32768, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_prefill/chunked", 1, CHUNKED, 1, 131072, 131072, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_batch16x2K/chunked", 1, CHUNKED, 16, 2048, 32768, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_prefill/recurrent", 1, RECURRENT, 1, 8192, 8192, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_prefill/recurrent", 1, RECURRENT, 1, 32768, 32768, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_batch16x2K/recurrent", 1, RECURRENT, 16, 2048, 32768, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cuda/bf16/qwen3next_decode", 1, CHUNKED, 256, 1, 256, QK, QV, QD, QDV, 1, 0},
    {"gdn.scan/cpu/bf16/small", 0, CHUNKED, 2, 32, 64, 2, 4, QD, QDV, 1, 3},
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

static int64_t conv_dim(const gdn_bench_case *c) { return 2 * c->hk * c->dk + c->hv * c->dv; }

static double case_flops(const gdn_bench_case *c) { return 7.0 * (double)c->T * (double)c->hv * c->dk * c->dv; }

static double case_bytes(const gdn_bench_case *c) {
  double es = 2.0; /* bf16 */
  double tok = (double)c->T * (2.0 * c->hk * c->dk + 2.0 * c->hv * c->dv + 2.0 * c->hv) * es;
  double states = (c->with_state ? 2.0 : 1.0) * (double)c->num_reqs * c->hv * c->dk * c->dv * 4.0;
  return tok + states;
}

static void case_release(void *ctx) {
  gdn_bench_case *c = ctx;
  if (!c->ready)
    return;
  void *bufs[7] = {c->qkv, c->ab, c->a_log, c->dt_bias, c->state, c->o, c->cu};
  for (int i = 0; i < 7; i++)
    c->be->release(bufs[i]);
  c->ready = 0;
}

/* A backend buffer of n values uniform in [lo, hi), bf16 or f32. */
static upf_status put_random(const upf_backend *be, upf_rng *rng, int64_t n, int bf16, float lo, float hi, void **dev) {
  size_t bytes = (size_t)n * (bf16 ? 2 : 4);
  float *host = malloc((size_t)n * sizeof *host);
  uint16_t *half = bf16 ? malloc((size_t)n * sizeof *half) : NULL;
  if (!host || (bf16 && !half)) {
    free(host), free(half);
    return upf_fail(UPF_ERR_NOMEM, "bench gdn: %lld values", (long long)n);
  }
  upf_rng_fill_uniform(rng, host, n, lo, hi);
  if (bf16)
    upf_bf16_from_f32_array(half, host, n);
  upf_status st = be->alloc(dev, bytes);
  if (st == UPF_OK)
    st = be->upload(*dev, bf16 ? (const void *)half : (const void *)host, bytes);
  free(host), free(half);
  return st;
}

static upf_status case_prepare(gdn_bench_case *c, const upf_backend *be) {
  if (c->ready)
    return UPF_OK;
  upf_rng rng;
  upf_rng_seed(&rng, 777);
  c->be = be;
  c->cu_host[0] = 0;
  for (int64_t r = 0; r < c->num_reqs; r++)
    c->cu_host[r + 1] = r + 1 == c->num_reqs ? (int32_t)c->T : (int32_t)((r + 1) * c->tokens_per_req);
  int64_t ns = c->num_reqs * c->hv * c->dk * c->dv;
  upf_status st = put_random(be, &rng, c->T * conv_dim(c), 1, -2.0f, 2.0f, &c->qkv);
  if (st == UPF_OK) /* a + dt_bias in [-5, 3] and b in [-3, 3]: decays and write strengths of real use */
    st = put_random(be, &rng, c->T * 2 * c->hv, 1, -4.0f, 3.0f, &c->ab);
  if (st == UPF_OK)
    st = put_random(be, &rng, c->hv, 0, 0.0f, 2.0f, &c->a_log);
  if (st == UPF_OK)
    st = put_random(be, &rng, c->hv, 0, -1.0f, 0.0f, &c->dt_bias);
  if (st == UPF_OK)
    st = put_random(be, &rng, ns, 0, -0.5f, 0.5f, &c->state);
  if (st == UPF_OK)
    st = be->alloc(&c->o, (size_t)(c->T * c->hv * c->dv) * 2);
  if (st == UPF_OK)
    st = be->alloc(&c->cu, sizeof(int32_t) * (size_t)(c->num_reqs + 1));
  if (st == UPF_OK)
    st = be->upload(c->cu, c->cu_host, sizeof(int32_t) * (size_t)(c->num_reqs + 1));
  c->ready = 1; /* release frees what was allocated (NULL entries are fine) */
  return st;
}

/* One scan over the case: q, k, v views into the (T, C) conv output; the state updates in place, as
 * in serving (repeated calls keep feeding it: the values stay bounded, the decay and beta <= 1). */
static upf_status case_call(gdn_bench_case *c) {
  upf_tensor q, k, v, a, b, al, dt, s, o;
  int64_t C = conv_dim(c);
  const int64_t sq[3] = {c->T, c->hk, c->dk}, sv[3] = {c->T, c->hv, c->dv}, sab[2] = {c->T, c->hv};
  const int64_t sh[1] = {c->hv}, ss[4] = {c->num_reqs, c->hv, c->dk, c->dv};
  uint16_t *qkv = c->qkv, *ab = c->ab;
  upf_tensor_init(&q, qkv, UPF_DTYPE_BF16, 3, sq), upf_tensor_init(&k, qkv + c->hk * c->dk, UPF_DTYPE_BF16, 3, sq);
  upf_tensor_init(&v, qkv + 2 * c->hk * c->dk, UPF_DTYPE_BF16, 3, sv);
  q.stride[0] = k.stride[0] = v.stride[0] = C;
  upf_tensor_init(&a, ab, UPF_DTYPE_BF16, 2, sab), upf_tensor_init(&b, ab + c->hv, UPF_DTYPE_BF16, 2, sab);
  a.stride[0] = b.stride[0] = 2 * c->hv;
  upf_tensor_init(&al, c->a_log, UPF_DTYPE_F32, 1, sh), upf_tensor_init(&dt, c->dt_bias, UPF_DTYPE_F32, 1, sh);
  upf_tensor_init(&s, c->state, UPF_DTYPE_F32, 4, ss);
  upf_tensor_init(&o, c->o, UPF_DTYPE_BF16, 3, sv);
  upf_gdn_batch batch = {c->cu, c->cu_host, (int32_t)c->num_reqs};
  upf_gdn_scan_inputs in = {&q, &k, &v, &a, &b, &al, &dt, c->with_state ? &s : NULL, 1.0f / sqrtf((float)c->dk)};
  return c->be->gdn_scan(&batch, &in, &o, &s);
}

static void set_work_counters(upf_bench_state *st, const gdn_bench_case *c) {
  upf_bench_set_counter(st, UPF_BENCH_FLOPS, case_flops(c), UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, UPF_BENCH_BYTES, case_bytes(c), UPF_BENCH_COUNTER_RATE);
  char label[96];
  snprintf(label, sizeof label, "B=%lld T=%lld Hk=%lld Hv=%lld Dk=%lld Dv=%lld", (long long)c->num_reqs,
           (long long)c->T, (long long)c->hk, (long long)c->hv, (long long)c->dk, (long long)c->dv);
  upf_bench_set_label(st, label);
}

static void bench_cpu(upf_bench_state *st, void *ctx) {
  gdn_bench_case *c = ctx;
  if (case_prepare(c, upf_backend_cpu()) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  while (upf_bench_keep_running(st))
    if (case_call(c) != UPF_OK) {
      upf_bench_skip_with_error(st, "gdn.scan: %s", upf_last_error());
      return;
    }
  set_work_counters(st, c);
}

#ifdef UPF_HAVE_CUDA
static upf_status call_cuda(void *arg) {
  gdn_bench_case *c = arg;
  upf_variant_select(c->form);
  upf_status st = case_call(c);
  upf_variant_reset(UPF_OP_GDN_SCAN);
  return st;
}
#endif

static void bench_cuda(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  (void)ctx;
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  gdn_bench_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  char why[160];
  if (!upf_bench_op_verified(UPF_OP_GDN_SCAN, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
    return;
  }
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  upf_bench_timing t;
  if (upf_bench_time_cuda(st, call_cuda, c, GDN_WARMUP, case_bytes(c), &t) != UPF_OK) {
    upf_bench_skip_with_error(st, "gdn.scan: %s", upf_last_error());
    return;
  }
  set_work_counters(st, c);
#endif
}

void upf_register_gdn_benchmarks(void) {
  for (int i = 0; i < NUM_CASES; i++) {
    gdn_bench_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .teardown = case_release, .num_args = 1};
    spec.args[0] = c->T;
    spec.arg_names[0] = "T";
    spec.fn = c->on_cuda ? bench_cuda : bench_cpu;
    upf_bench_spec_timing(&spec, c->on_cuda, GDN_CUDA_MIN_TIME_S, GDN_CUDA_REPETITIONS, c->iterations);
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench gdn: %s\n", upf_last_error());
  }
}

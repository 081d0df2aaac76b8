/* Benchmarks of the Qwen3-Next MoE layer (backend->moe_ffn; H=2048, E=512, K=10, I=Is=512): CUDA in
 * bf16 at T = 8K and 32K with the moe.ffn variant in effect (bench_upf --variant) and with each
 * expert-GEMM variant by name, every variant verified against the CPU reference before it is timed; "moe.dense_equiv", one cuBLAS bf16 GEMM (T, H) x (H, N) with N the
 * layer's FLOPs / (2 T H) rounded up to 64, timed alone; and the CPU reference on a small layer.
 * Each layer case also times that dense GEMM itself in its steady state (upf_bench_steady_median) just
 * before the layer's loop, and compares: "vs_dense" = the layer's time (the repetition's mean, the
 * reported time) / the dense median scaled to equal FLOPs (the target is <= 1.5);
 * "vs_dense_interleaved", the ratio of the medians of 16 (layer, dense) pairs run alternately;
 * "floor_vs_dense", the vs_dense of the layer's unfused DRAM traffic at the measured copy bandwidth
 * (the bound of its pass structure).
 * No L2 flush: every call streams the 3.2 GB of expert weights, which evicts the previous call's x. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "ref_cpu/moe.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "verify/moe_checks.h"
#include "verify/moe_inputs.h"

#include "uniprefill/variant.h"

#ifdef UPF_HAVE_CUDA
#include "cuda/perf_support.cuh"
#endif

#define MOE_MAX_T 32768
#define MOE_VERIFY_T 61 /* tokens of the verify-before-timing run */
#define MOE_CUDA_REPETITIONS 10
#define MOE_CUDA_MIN_TIME_S 0.1
#define MOE_WARMUP 3
#define MOE_INTERLEAVED_PAIRS 16
#define MOE_DENSE_REPS 41 /* timed dense GEMMs in their steady state, per repetition */
#define MOE_SEED 0x30e0b3e7ull

typedef struct {
  const char *name;
  int on_cuda;
  int dense;   /* the dense-GEMM ceiling rather than the layer */
  const char *variant; /* the moe.ffn variant it times (variants.def); NULL: the one in effect */
  int64_t T;
} moe_bench_case;

static moe_bench_case cases[] = {
    {"moe.dense_equiv/cuda/bf16", 1, 1, NULL, 8192},
    {"moe.dense_equiv/cuda/bf16", 1, 1, NULL, 32768},
    {"moe.ffn/cuda/bf16", 1, 0, NULL, 8192},
    {"moe.ffn/cuda/bf16", 1, 0, NULL, 32768},
    {"moe.ffn/cuda/bf16/grouped", 1, 0, "grouped", 8192},
    {"moe.ffn/cuda/bf16/grouped", 1, 0, "grouped", 32768},
    {"moe.ffn/cuda/bf16/padded", 1, 0, "padded", 8192},
    {"moe.ffn/cuda/bf16/padded", 1, 0, "padded", 32768},
    {"moe.ffn/cuda/bf16/bucketed", 1, 0, "bucketed", 8192},
    {"moe.ffn/cuda/bf16/bucketed", 1, 0, "bucketed", 32768},
    {"moe.ffn/cpu/bf16/small", 0, 0, NULL, 256},
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

/* ---- CPU: a small layer (H=256, E=32, K=4, I=Is=128) ---- */

static const upf_moe_config cpu_cfg = {256, 32, 4, 128, 128, 1};

static void bench_moe_cpu(upf_bench_state *st, void *ctx) {
  const moe_bench_case *c = ctx;
  upf_moe_problem pb;
  if (upf_moe_problem_make(&pb, &cpu_cfg, c->T, 0, UPF_DTYPE_BF16, UPF_MOE_DIST_RANDOM, MOE_SEED, NULL) != UPF_OK) {
    upf_bench_skip_with_error(st, "inputs: %s", upf_last_error());
    return;
  }
  upf_moe_weights w = upf_moe_problem_weights(&pb);
  void *out_data = malloc((size_t)(c->T * cpu_cfg.hidden) * 2);
  int64_t shape[2] = {c->T, cpu_cfg.hidden};
  upf_tensor out;
  upf_tensor_init(&out, out_data, UPF_DTYPE_BF16, 2, shape);
  const upf_backend *be = upf_backend_cpu();
  while (out_data && upf_bench_keep_running(st)) {
    if (be->moe_ffn(&cpu_cfg, &pb.x, &w, &out, NULL) != UPF_OK) {
      upf_bench_skip_with_error(st, "moe_ffn: %s", upf_last_error());
      break;
    }
  }
  if (!out_data)
    upf_bench_skip_with_error(st, "out: no memory");
  else
    upf_bench_set_counter(st, UPF_BENCH_FLOPS, upf_moe_flops(&cpu_cfg, c->T), UPF_BENCH_COUNTER_RATE);
  free(out_data);
  upf_moe_problem_free(&pb);
}

#ifdef UPF_HAVE_CUDA
/* ---- CUDA: Qwen3-Next weights and MOE_MAX_T tokens, made once and shared by every case ---- */

static struct {
  int ready;
  upf_status status;
  char message[512];
  upf_moe_config cfg;
  upf_moe_problem experts, data; /* data: x (MOE_MAX_T, H) and the router, borrowing the experts */
  upf_moe_device_problem dev_experts, dev_data;
  void *dense_c;          /* (MOE_MAX_T, dense_n) bf16 */
  int64_t dense_n;
  int verified[UPF_VARIANT_COUNT]; /* per moe.ffn variant: 0 not yet, 1 passed, -1 failed */
  char verify_message[UPF_VARIANT_COUNT][512];
} q;

static void qwen_release(void *ctx) {
  (void)ctx;
  if (!q.ready)
    return;
  upf_moe_device_problem_free(&q.dev_data);
  upf_moe_device_problem_free(&q.dev_experts);
  if (q.dense_c)
    upf_backend_cuda()->release(q.dense_c);
  upf_moe_problem_free(&q.data);
  upf_moe_problem_free(&q.experts);
  memset(&q, 0, sizeof q);
}

/* The dense GEMM of the layer's FLOPs at T tokens: (T, H) x (H, N), N = flops / (2 T H) rounded up
 * to a multiple of 64 (the time is scaled back to the layer's FLOPs). */
static int64_t dense_n(const upf_moe_config *cfg) {
  double n = upf_moe_flops(cfg, 1) / (2.0 * cfg->hidden);
  return ((int64_t)ceil(n) + 63) / 64 * 64;
}

static upf_status qwen_prepare(void) {
  if (q.ready)
    return q.status;
  q.ready = 1;
  q.cfg = upf_moe_config_qwen3_next();
  const upf_backend *be = upf_backend_cuda();
  upf_status st = upf_moe_problem_make(&q.experts, &q.cfg, 0, 0, UPF_DTYPE_BF16, UPF_MOE_DIST_RANDOM, MOE_SEED, NULL);
  if (st == UPF_OK)
    st = upf_moe_problem_make(&q.data, &q.cfg, MOE_MAX_T, 0, UPF_DTYPE_BF16, UPF_MOE_DIST_RANDOM, MOE_SEED + 1,
                              &q.experts);
  if (st == UPF_OK)
    st = upf_moe_problem_upload(be, &q.experts, NULL, &q.dev_experts);
  if (st == UPF_OK)
    st = upf_moe_problem_upload(be, &q.data, &q.dev_experts, &q.dev_data);
  q.dense_n = dense_n(&q.cfg);
  if (st == UPF_OK)
    st = be->alloc(&q.dense_c, (size_t)MOE_MAX_T * (size_t)q.dense_n * 2);
  q.status = st;
  if (st != UPF_OK)
    snprintf(q.message, sizeof q.message, "%s", upf_last_error());
  return st == UPF_OK ? st : upf_fail(st, "%s", q.message);
}

/* x of the first T tokens (device). */
static upf_tensor x_view(int64_t T) {
  upf_tensor x = q.dev_data.x;
  x.shape[0] = T;
  return x;
}

/* Verify before timing: MOE_VERIFY_T tokens through moe_ffn with `variant` (the one in effect) against
 * the CPU reference: routing under the marginal rule, outputs of agreeing tokens within the bf16
 * tolerances. */
static int verify_variant(upf_variant variant, char *why, size_t cap) {
  if (q.verified[variant]) {
    snprintf(why, cap, "%s", q.verify_message[variant]);
    return q.verified[variant] == 1;
  }
  const int64_t T = MOE_VERIFY_T, H = q.cfg.hidden, K = q.cfg.top_k, E = q.cfg.num_experts;
  const upf_backend *be = upf_backend_cuda();
  upf_tensor hx = q.data.x;
  hx.shape[0] = T;
  upf_moe_weights hw = upf_moe_problem_weights(&q.data);
  double *logits = malloc((size_t)(T * E) * sizeof *logits), *weight = malloc((size_t)(T * K) * sizeof *weight);
  double *ref = malloc((size_t)(T * H) * sizeof *ref);
  int32_t *index = malloc((size_t)(T * K) * sizeof *index), *got_index = malloc((size_t)(T * K) * sizeof *got_index);
  uint16_t *raw = malloc((size_t)(T * H) * 2);
  float *got = malloc((size_t)(T * H) * sizeof *got);
  uint8_t *agree = malloc((size_t)T);
  void *d_out = NULL, *d_index = NULL;
  char *msg = q.verify_message[variant];
  upf_status st = logits && weight && ref && index && got_index && raw && got && agree
                      ? UPF_OK
                      : upf_fail(UPF_ERR_NOMEM, "verify: host buffers");
  if (st == UPF_OK)
    st = ref_moe_route(&q.cfg, &hx, &hw, logits, index, weight);
  if (st == UPF_OK)
    st = ref_moe_ffn(&q.cfg, &hx, &hw, index, weight, ref);
  if (st == UPF_OK)
    st = be->alloc(&d_out, (size_t)(T * H) * 2);
  if (st == UPF_OK)
    st = be->alloc(&d_index, (size_t)(T * K) * 4);
  if (st == UPF_OK) {
    int64_t shape[2] = {T, H};
    upf_tensor out, x = x_view(T);
    upf_tensor_init(&out, d_out, UPF_DTYPE_BF16, 2, shape);
    upf_moe_routing rt = {d_index, NULL, NULL};
    st = be->moe_ffn(&q.cfg, &x, &q.dev_data.w, &out, &rt);
  }
  if (st == UPF_OK)
    st = be->download(raw, d_out, (size_t)(T * H) * 2);
  if (st == UPF_OK)
    st = be->download(got_index, d_index, (size_t)(T * K) * 4);
  int passed = 0;
  if (st != UPF_OK) {
    snprintf(msg, sizeof q.verify_message[0], "%s", upf_last_error());
  } else {
    upf_check check;
    memset(&check, 0, sizeof check);
    upf_moe_compare_routing(&q.cfg, T, logits, index, got_index, upf_moe_tau(UPF_DTYPE_BF16), agree, &check);
    if (check.passed) {
      int64_t m = 0;
      upf_bf16_to_f32_array(got, raw, T * H);
      for (int64_t t = 0; t < T; t++)
        if (agree[t]) {
          memmove(got + m * H, got + t * H, (size_t)H * sizeof *got);
          memmove(ref + m * H, ref + t * H, (size_t)H * sizeof *ref);
          m++;
        }
      upf_compare_f32(got, ref, m * H, upf_tolerance_for(UPF_DTYPE_BF16), &check);
    }
    passed = check.passed;
    snprintf(msg, sizeof q.verify_message[0], "%s", check.passed ? "" : check.detail);
  }
  q.verified[variant] = passed ? 1 : -1;
  snprintf(why, cap, "%s", msg);
  if (d_out)
    be->release(d_out);
  if (d_index)
    be->release(d_index);
  free(logits), free(weight), free(ref), free(index), free(got_index), free(raw), free(got), free(agree);
  return passed;
}

/* The dense GEMM of the layer's FLOPs (x times the first dense_n rows of the experts' gate_up, random
 * bf16, not zeros), enqueued on the backend stream. */
static upf_status dense_gemm(int64_t T) {
  return upf_cuda_gemm_bf16_nt(T, q.dense_n, q.cfg.hidden, q.dev_data.x.data, q.dev_experts.w.gate_up, q.dense_c);
}

/* One layer call on the backend stream: out = moe_ffn(x). */
typedef struct {
  const upf_backend *be;
  upf_tensor x, out;
} layer_call;

static upf_status run_layer(void *arg) {
  const layer_call *lc = arg;
  return lc->be->moe_ffn(&q.cfg, &lc->x, &q.dev_data.w, &lc->out, NULL);
}

static upf_status dense_call(void *arg) { return dense_gemm(*(const int64_t *)arg); }

/* MOE_INTERLEAVED_PAIRS of (layer call, dense GEMM), each timed: the medians of both. */
static upf_status interleaved_times(upf_cuda_timer *timer, layer_call *lc, int64_t T, double *layer_s,
                                    double *dense_s) {
  double lt[MOE_INTERLEAVED_PAIRS], dt[MOE_INTERLEAVED_PAIRS];
  for (int i = 0; i < MOE_INTERLEAVED_PAIRS; i++) {
    UPF_TRY(upf_cuda_timer_start(timer));
    UPF_TRY(run_layer(lc));
    UPF_TRY(upf_cuda_timer_stop(timer, &lt[i]));
    UPF_TRY(upf_cuda_timer_start(timer));
    UPF_TRY(dense_gemm(T));
    UPF_TRY(upf_cuda_timer_stop(timer, &dt[i]));
  }
  *layer_s = upf_bench_median(lt, MOE_INTERLEAVED_PAIRS);
  *dense_s = upf_bench_median(dt, MOE_INTERLEAVED_PAIRS);
  return UPF_OK;
}

static void bench_dense_cuda(upf_bench_state *st, moe_bench_case *c) {
  int64_t T = c->T;
  const int64_t H = q.cfg.hidden;
  upf_bench_timing timing;
  if (upf_bench_time_cuda(st, dense_call, &T, MOE_WARMUP, 0.0, &timing) != UPF_OK) {
    upf_bench_skip_with_error(st, "dense GEMM: %s", upf_last_error());
    return;
  }
  upf_bench_set_counter(st, UPF_BENCH_FLOPS, 2.0 * (double)T * (double)H * (double)q.dense_n, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, "N", (double)q.dense_n, UPF_BENCH_COUNTER_VALUE);
}

static void bench_layer_cuda(upf_bench_state *st, const moe_bench_case *c, upf_variant variant);

static void bench_moe_cuda(upf_bench_state *st, void *ctx) {
  moe_bench_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  if (qwen_prepare() != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing Qwen3-Next weights: %s", upf_last_error());
    return;
  }
  if (c->dense) {
    bench_dense_cuda(st, c);
    return;
  }
  /* The case's variant for its runs, then the one in effect before (a --variant choice, UPF_VARIANT
   * or the default) again. */
  upf_variant before, variant;
  if (upf_variant_current(UPF_OP_MOE_FFN, &before) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s", upf_last_error());
    return;
  }
  variant = c->variant ? upf_variant_by_name(UPF_OP_MOE_FFN, c->variant) : before;
  if (variant == UPF_VARIANT_COUNT) {
    upf_bench_skip_with_error(st, "moe.ffn has no variant '%s'", c->variant);
    return;
  }
  upf_variant_select(variant);
  bench_layer_cuda(st, c, variant);
  upf_variant_select(before);
}

/* The layer with `variant` in effect: verified, then timed against the equal-FLOP dense GEMM. */
static void bench_layer_cuda(upf_bench_state *st, const moe_bench_case *c, upf_variant variant) {
  const upf_backend *be = upf_backend_cuda();
  char why[512];
  if (!verify_variant(variant, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
    return;
  }
  const int64_t T = c->T, H = q.cfg.hidden;
  void *d_out = NULL;
  upf_cuda_timer *timer = NULL;
  upf_status s = be->alloc(&d_out, (size_t)(T * H) * 2);
  if (s == UPF_OK)
    s = upf_cuda_timer_create(&timer);
  int64_t shape[2] = {T, H};
  layer_call lc = {be, x_view(T), {0}};
  upf_tensor_init(&lc.out, d_out, UPF_DTYPE_BF16, 2, shape);
  /* The equal-FLOP dense GEMM in its own steady state, just before the layer's loop in its own: the
   * issue's comparison. */
  double dense_s = 0.0;
  if (s == UPF_OK)
    s = upf_bench_steady_median(dense_call, (void *)&T, MOE_CUDA_MIN_TIME_S, MOE_DENSE_REPS, &dense_s);
  upf_bench_timing timing = {0};
  if (s == UPF_OK)
    s = upf_bench_time_cuda(st, run_layer, &lc, MOE_WARMUP, 0.0, &timing);
  /* The same two interleaved: each dense GEMM right after a layer call, which leaves the GPU cooler
   * than a dense GEMM leaves it (1-4% faster dense at 8K and 32K on the H200). */
  double inter_layer_s = 0.0, inter_dense_s = 0.0;
  if (s == UPF_OK)
    s = interleaved_times(timer, &lc, T, &inter_layer_s, &inter_dense_s);
  upf_cuda_timer_destroy(timer);
  be->release(d_out);
  if (s != UPF_OK) {
    upf_bench_skip_with_error(st, "moe_ffn: %s", upf_last_error());
    return;
  }
  const double flops = upf_moe_flops(&q.cfg, T);
  /* The dense GEMM's N is rounded up to a multiple of 64: its times scale back to the layer's FLOPs. */
  const double to_layer_flops = flops / (2.0 * (double)T * (double)H * (double)q.dense_n);
  dense_s *= to_layer_flops, inter_dense_s *= to_layer_flops;
  const double layer_s = timing.iterations ? timing.total_s / (double)timing.iterations : NAN; /* the reported time */
  /* Bytes counted once: every weight, x read, out written. */
  double bytes = upf_moe_weight_bytes(&q.cfg, UPF_DTYPE_BF16) + 2.0 * (double)T * (double)H * 2.0;
  upf_bench_set_counter(st, UPF_BENCH_FLOPS, flops, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, UPF_BENCH_BYTES, bytes, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, "dense_equiv_ms", dense_s * 1e3, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "layer_ms", layer_s * 1e3, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "vs_dense", layer_s / dense_s, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "gemm_share", dense_s / layer_s, UPF_BENCH_COUNTER_VALUE);
  upf_bench_set_counter(st, "vs_dense_interleaved", inter_layer_s / inter_dense_s, UPF_BENCH_COUNTER_VALUE);
  /* The bandwidth side: the pass structure's DRAM bytes (upf_moe_unfused_traffic_bytes) as a share of
   * the measured copy bandwidth, and the vs_dense this structure would have at copy bandwidth. */
  double copy_bw = 0.0;
  if (upf_bench_copy_ceiling(&copy_bw) == UPF_OK && copy_bw > 0.0) {
    const double traffic = upf_moe_unfused_traffic_bytes(&q.cfg, T, UPF_DTYPE_BF16, UPF_DTYPE_BF16);
    upf_bench_set_counter(st, "traffic_gb", traffic * 1e-9, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "traffic_share", traffic / layer_s / copy_bw, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "floor_vs_dense", traffic / copy_bw / dense_s, UPF_BENCH_COUNTER_VALUE);
  }
  char label[64];
  snprintf(label, sizeof label, "gemm=%s", upf_variant_name(variant));
  upf_bench_set_label(st, label);
}
#endif /* UPF_HAVE_CUDA */

static void bench_moe_cuda_entry(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  (void)ctx;
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  bench_moe_cuda(st, ctx);
#endif
}

static void moe_teardown(void *ctx) {
#ifdef UPF_HAVE_CUDA
  qwen_release(ctx);
#else
  (void)ctx;
#endif
}

void upf_register_moe_benchmarks(void) {
  for (int i = 0; i < NUM_CASES; i++) {
    moe_bench_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .num_args = 1};
    spec.args[0] = c->T, spec.arg_names[0] = "T";
    spec.fn = c->on_cuda ? bench_moe_cuda_entry : bench_moe_cpu;
    upf_bench_spec_timing(&spec, c->on_cuda, MOE_CUDA_MIN_TIME_S, MOE_CUDA_REPETITIONS, 2);
    /* The shared Qwen3-Next data goes after the last CUDA case. */
    if (c->on_cuda && i == NUM_CASES - 2)
      spec.teardown = moe_teardown;
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench moe: %s\n", upf_last_error());
  }
}

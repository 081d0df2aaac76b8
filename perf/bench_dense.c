/* Benchmarks of the dense sub-layers through the backend table at real model shapes: the Llama-3.1-8B
 * projections and SwiGLU FFN at T = 8K..128K (TFLOP/s and the share of the measured cuBLAS ceiling),
 * Gemma-3's GeGLU FFN, and the memory-bound ops (activation-and-multiply, the norms, RoPE, the gated
 * output, embedding, last-token logits: TB/s and the share of the measured copy bandwidth). Also
 * "gemm_ceiling", the ceiling itself: one large square bf16 cublasGemmEx (8192^3, backend->gemm), and
 * "gemm_lt_best", each projection shape through the fastest of cublasLt's algorithms for it, with
 * cublasGemmEx's time for the same shape in the same sweep (does cuBLAS pick its fastest kernel for us?).
 * CUDA cases verify their op against the CPU reference (the op's quick verify set) before any
 * timing, warm up, time each iteration with device events and flush L2 before each iteration when
 * the working set is under three L2s. CPU cases are a few small shapes, wall clock. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model_config.h"
#include "uniprefill/rng.h"

#ifdef UPF_HAVE_CUDA
#include "cuda/perf_support.cuh"
#endif

#define DENSE_CUDA_REPETITIONS 10
#define DENSE_CUDA_MIN_TIME_S 0.1
#define DENSE_WARMUP 3
#define CEILING_N 8192                     /* square bf16 GEMM of the ceiling: 1.1 TFLOP */
#define CEILING_REPS 20
#define CEILING_WARM_S 0.3 /* ~180 calls: past the boost clocks of an idle GPU */
#define FILL_CHUNK ((size_t)32 << 20)      /* bytes of random data generated once, tiled into buffers */
#define MAX_BUFS 6

typedef enum {
  K_CEILING,
  K_GEMM,
  K_GEMM_LT, /* the same GEMM through cublasLt's fastest algorithm for the shape (a sweep on first use) */
  K_FFN,
  K_ACT,
  K_RMS,
  K_RMS_ADD,
  K_QK,
  K_ROPE,
  K_GATED,
  K_EMBED,
  K_LOGITS,
} bench_kind;

typedef enum { M_LLAMA, M_GEMMA_LOCAL, M_GEMMA_GLOBAL, M_QWEN } bench_model;

typedef struct {
  const char *name;  /* family; the arg T (or B, n) is appended */
  bench_kind kind;
  int on_cuda;
  upf_dtype dtype;
  int64_t T;         /* tokens; B for logits; n for the ceiling */
  int64_t a, b;      /* GEMM: K, N. FFN: H, I. ACT: I. norms: N (QK: D). ROPE: -. GATED: H, D. EMBED/LOGITS: H, V */
  bench_model model;
  upf_act act;
  int64_t iterations; /* CPU: fixed */
  /* prepared on first use, kept across repetitions */
  int ready;
  void *buf[MAX_BUFS];
  size_t bytes[MAX_BUFS];
  int32_t *cu_host; /* logits: (B+1) */
  int flush;        /* flush L2 before each timed iteration */
  void *lt_plan;    /* K_GEMM_LT: upf_gemm_lt_plan */
} dense_case;

/* ---- the cases ---- */

#define L_H UPF_LLAMA31_8B_HIDDEN
#define L_I UPF_LLAMA31_8B_INTERMEDIATE
#define BF UPF_DTYPE_BF16
#define CU(fam, kind, T, a, b) {fam, kind, 1, BF, T, a, b, M_LLAMA, UPF_ACT_SILU, 0}
#define CUM(fam, kind, T, a, b, model, act) {fam, kind, 1, BF, T, a, b, model, act, 0}
#define CPU(fam, kind, T, a, b, iters) {fam, kind, 0, BF, T, a, b, M_LLAMA, UPF_ACT_SILU, iters}

static dense_case cases[] = {
    {"gemm_ceiling/cuda/bf16", K_CEILING, 1, BF, CEILING_N, CEILING_N, CEILING_N, M_LLAMA, UPF_ACT_SILU, 0},
    /* Llama-3.1-8B projections, [T, in] x [in, out] */
    CU("gemm/cuda/bf16/llama_qkv", K_GEMM, 8192, L_H, 6144),
    CU("gemm/cuda/bf16/llama_qkv", K_GEMM, 32768, L_H, 6144),
    CU("gemm/cuda/bf16/llama_qkv", K_GEMM, 131072, L_H, 6144),
    CU("gemm/cuda/bf16/llama_o", K_GEMM, 8192, L_H, L_H),
    CU("gemm/cuda/bf16/llama_o", K_GEMM, 32768, L_H, L_H),
    CU("gemm/cuda/bf16/llama_o", K_GEMM, 131072, L_H, L_H),
    CU("gemm/cuda/bf16/llama_gate_up", K_GEMM, 8192, L_H, 2 * L_I),
    CU("gemm/cuda/bf16/llama_gate_up", K_GEMM, 32768, L_H, 2 * L_I),
    CU("gemm/cuda/bf16/llama_gate_up", K_GEMM, 131072, L_H, 2 * L_I),
    CU("gemm/cuda/bf16/llama_down", K_GEMM, 8192, L_I, L_H),
    CU("gemm/cuda/bf16/llama_down", K_GEMM, 32768, L_I, L_H),
    CU("gemm/cuda/bf16/llama_down", K_GEMM, 131072, L_I, L_H),
    /* cublasLt's algorithms for the projections, the fastest of each shape against cublasGemmEx's pick */
    CU("gemm_lt_best/cuda/bf16/llama_qkv", K_GEMM_LT, 8192, L_H, 6144),
    CU("gemm_lt_best/cuda/bf16/llama_o", K_GEMM_LT, 8192, L_H, L_H),
    CU("gemm_lt_best/cuda/bf16/llama_gate_up", K_GEMM_LT, 8192, L_H, 2 * L_I),
    CU("gemm_lt_best/cuda/bf16/llama_down", K_GEMM_LT, 8192, L_I, L_H),
    CU("gemm_lt_best/cuda/bf16/llama_gate_up", K_GEMM_LT, 32768, L_H, 2 * L_I),
    CU("gemm_lt_best/cuda/bf16/llama_down", K_GEMM_LT, 32768, L_I, L_H),
    /* the whole FFN, activation included */
    CU("ffn/cuda/bf16/llama_swiglu", K_FFN, 8192, L_H, L_I),
    CU("ffn/cuda/bf16/llama_swiglu", K_FFN, 16384, L_H, L_I),
    CU("ffn/cuda/bf16/llama_swiglu", K_FFN, 32768, L_H, L_I),
    CU("ffn/cuda/bf16/llama_swiglu", K_FFN, 65536, L_H, L_I),
    CU("ffn/cuda/bf16/llama_swiglu", K_FFN, 131072, L_H, L_I),
    CUM("ffn/cuda/bf16/gemma_geglu", K_FFN, 8192, UPF_GEMMA3_12B_HIDDEN, UPF_GEMMA3_12B_INTERMEDIATE, M_GEMMA_GLOBAL,
        UPF_ACT_GELU_TANH),
    CUM("ffn/cuda/bf16/gemma_geglu", K_FFN, 32768, UPF_GEMMA3_12B_HIDDEN, UPF_GEMMA3_12B_INTERMEDIATE,
        M_GEMMA_GLOBAL, UPF_ACT_GELU_TANH),
    /* memory-bound ops */
    CU("act_mul/cuda/bf16/llama_swiglu", K_ACT, 8192, L_I, 0),
    CU("act_mul/cuda/bf16/llama_swiglu", K_ACT, 32768, L_I, 0),
    CU("act_mul/cuda/bf16/llama_swiglu", K_ACT, 131072, L_I, 0),
    CUM("act_mul/cuda/bf16/gemma_geglu", K_ACT, 32768, UPF_GEMMA3_12B_INTERMEDIATE, 0, M_GEMMA_GLOBAL,
        UPF_ACT_GELU_TANH),
    CU("rmsnorm/cuda/bf16/llama", K_RMS, 8192, L_H, 0),
    CU("rmsnorm/cuda/bf16/llama", K_RMS, 32768, L_H, 0),
    CU("rmsnorm/cuda/bf16/llama", K_RMS, 131072, L_H, 0),
    CU("rmsnorm_add/cuda/bf16/llama", K_RMS_ADD, 8192, L_H, 0),
    CU("rmsnorm_add/cuda/bf16/llama", K_RMS_ADD, 32768, L_H, 0),
    CU("rmsnorm_add/cuda/bf16/llama", K_RMS_ADD, 131072, L_H, 0),
    CUM("rmsnorm/cuda/bf16/qwen3next", K_RMS, 32768, UPF_QWEN3N_80B_HIDDEN, 0, M_QWEN, UPF_ACT_SILU),
    CUM("qk_norm/cuda/bf16/gemma", K_QK, 8192, UPF_GEMMA3_12B_HEAD_DIM, 0, M_GEMMA_GLOBAL, UPF_ACT_SILU),
    CUM("qk_norm/cuda/bf16/gemma", K_QK, 32768, UPF_GEMMA3_12B_HEAD_DIM, 0, M_GEMMA_GLOBAL, UPF_ACT_SILU),
    CUM("qk_norm/cuda/bf16/qwen3next", K_QK, 32768, UPF_QWEN3N_80B_HEAD_DIM, 0, M_QWEN, UPF_ACT_SILU),
    CU("rope/cuda/bf16/llama", K_ROPE, 8192, 0, 0),
    CU("rope/cuda/bf16/llama", K_ROPE, 32768, 0, 0),
    CU("rope/cuda/bf16/llama", K_ROPE, 131072, 0, 0),
    CUM("rope/cuda/bf16/gemma_global", K_ROPE, 32768, 0, 0, M_GEMMA_GLOBAL, UPF_ACT_SILU),
    CUM("rope/cuda/bf16/qwen3next_partial", K_ROPE, 32768, 0, 0, M_QWEN, UPF_ACT_SILU),
    CUM("gated_output/cuda/bf16/qwen3next", K_GATED, 8192, UPF_QWEN3N_80B_Q_HEADS, UPF_QWEN3N_80B_HEAD_DIM, M_QWEN,
        UPF_ACT_SILU),
    CUM("gated_output/cuda/bf16/qwen3next", K_GATED, 32768, UPF_QWEN3N_80B_Q_HEADS, UPF_QWEN3N_80B_HEAD_DIM, M_QWEN,
        UPF_ACT_SILU),
    CU("embed/cuda/bf16/llama", K_EMBED, 8192, L_H, UPF_LLAMA31_8B_VOCAB),
    CU("embed/cuda/bf16/llama", K_EMBED, 131072, L_H, UPF_LLAMA31_8B_VOCAB),
    CU("logits_last/cuda/bf16/llama", K_LOGITS, 1, L_H, UPF_LLAMA31_8B_VOCAB),
    CU("logits_last/cuda/bf16/llama", K_LOGITS, 16, L_H, UPF_LLAMA31_8B_VOCAB),
    CU("logits_last/cuda/bf16/llama", K_LOGITS, 64, L_H, UPF_LLAMA31_8B_VOCAB),
    /* CPU reference: small shapes, seconds at most */
    CPU("gemm/cpu/bf16/llama_o", K_GEMM, 256, L_H, L_H, 3),
    CPU("ffn/cpu/bf16/llama_swiglu", K_FFN, 32, L_H, L_I, 1),
    CPU("rmsnorm/cpu/bf16/llama", K_RMS, 4096, L_H, 0, 5),
    CPU("rope/cpu/bf16/llama", K_ROPE, 2048, 0, 0, 5),
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

/* ---- shapes and work of a case ---- */

static void rope_shape(bench_model m, int64_t *hq, int64_t *hkv, int64_t *d, upf_rope_params *p) {
  switch (m) {
  case M_GEMMA_LOCAL:
  case M_GEMMA_GLOBAL:
    *hq = UPF_GEMMA3_12B_Q_HEADS, *hkv = UPF_GEMMA3_12B_KV_HEADS, *d = UPF_GEMMA3_12B_HEAD_DIM;
    *p = m == M_GEMMA_LOCAL ? upf_gemma3_12b_rope_local() : upf_gemma3_12b_rope_global();
    break;
  case M_QWEN:
    *hq = UPF_QWEN3N_80B_Q_HEADS, *hkv = UPF_QWEN3N_80B_KV_HEADS, *d = UPF_QWEN3N_80B_HEAD_DIM;
    *p = upf_qwen3n_80b_rope();
    break;
  default:
    *hq = UPF_LLAMA31_8B_Q_HEADS, *hkv = UPF_LLAMA31_8B_KV_HEADS, *d = UPF_LLAMA31_8B_HEAD_DIM;
    *p = upf_llama31_8b_rope();
    break;
  }
}

static upf_norm_params norm_of(bench_model m) {
  return m == M_LLAMA ? upf_llama31_8b_norm() : m == M_QWEN ? upf_qwen3n_80b_norm() : upf_gemma3_12b_norm();
}

/* Bytes each buffer of a case needs (es = element size). */
static int case_buffers(const dense_case *c, size_t *bytes) {
  size_t es = upf_dtype_size(c->dtype);
  size_t T = (size_t)c->T, a = (size_t)c->a, b = (size_t)c->b;
  memset(bytes, 0, MAX_BUFS * sizeof *bytes);
  int64_t hq, hkv, d;
  upf_rope_params rp;
  switch (c->kind) {
  case K_CEILING:
  case K_GEMM: /* a (T, K), b (K, N), c (T, N) */
  case K_GEMM_LT:
    bytes[0] = T * a * es, bytes[1] = a * b * es, bytes[2] = T * b * es;
    return 3;
  case K_FFN: /* x, w_gate_up, w_down, y */
    bytes[0] = T * a * es, bytes[1] = a * 2 * b * es, bytes[2] = b * a * es, bytes[3] = T * a * es;
    return 4;
  case K_ACT: /* gate_up, h */
    bytes[0] = T * 2 * a * es, bytes[1] = T * a * es;
    return 2;
  case K_RMS: /* x, w, y */
    bytes[0] = T * a * es, bytes[1] = a * es, bytes[2] = T * a * es;
    return 3;
  case K_RMS_ADD: /* x, residual, w, y */
    bytes[0] = T * a * es, bytes[1] = T * a * es, bytes[2] = a * es, bytes[3] = T * a * es;
    return 4;
  case K_QK: /* qkv, q_w, k_w */
  case K_ROPE: /* qkv, positions */
    rope_shape(c->model, &hq, &hkv, &d, &rp);
    bytes[0] = T * (size_t)(hq + 2 * hkv) * (size_t)d * es;
    if (c->kind == K_QK) {
      bytes[1] = bytes[2] = (size_t)d * es;
      return 3;
    }
    bytes[1] = T * sizeof(int32_t);
    return 2;
  case K_GATED: /* o, q_proj (gate view), y */
    bytes[0] = T * a * b * es, bytes[1] = T * a * 2 * b * es, bytes[2] = T * a * b * es;
    return 3;
  case K_EMBED: /* table (V, H), ids, y */
    bytes[0] = b * a * es, bytes[1] = T * sizeof(int32_t), bytes[2] = T * a * es;
    return 3;
  case K_LOGITS: /* hidden (B * 64 tokens, H), norm_w, w_lm (H, V), logits (B, V) f32 */
    bytes[0] = T * 64 * a * es, bytes[1] = a * es, bytes[2] = a * b * es, bytes[3] = T * b * sizeof(float);
    return 4;
  }
  return 0;
}

typedef struct {
  double flops;
  double bytes; /* moved once: inputs read, outputs written */
} dense_work;

static dense_work case_work(const dense_case *c) {
  double es = (double)upf_dtype_size(c->dtype), T = (double)c->T, a = (double)c->a, b = (double)c->b;
  dense_work w = {0.0, 0.0};
  int64_t hq, hkv, d;
  upf_rope_params rp;
  switch (c->kind) {
  case K_CEILING:
  case K_GEMM:
  case K_GEMM_LT:
    w.flops = 2.0 * T * a * b;
    w.bytes = (T * a + a * b + T * b) * es;
    break;
  case K_FFN: /* 2T.H.2I + 2T.I.H */
    w.flops = 6.0 * T * a * b;
    w.bytes = (2.0 * T * a + 3.0 * a * b) * es;
    break;
  case K_ACT:
    w.bytes = 3.0 * T * a * es;
    break;
  case K_RMS:
    w.bytes = (2.0 * T * a + a) * es;
    break;
  case K_RMS_ADD:
    w.bytes = (4.0 * T * a + a) * es;
    break;
  case K_QK:
    rope_shape(c->model, &hq, &hkv, &d, &rp);
    w.bytes = (2.0 * T * (double)(hq + hkv) * (double)d + 2.0 * (double)d) * es;
    break;
  case K_ROPE:
    rope_shape(c->model, &hq, &hkv, &d, &rp);
    w.bytes = 2.0 * T * (double)(hq + hkv) * (double)upf_rope_rotary_dim(&rp, d) * es + 4.0 * T;
    break;
  case K_GATED:
    w.bytes = 3.0 * T * a * b * es;
    break;
  case K_EMBED:
    w.bytes = 2.0 * T * a * es + 4.0 * T;
    break;
  case K_LOGITS: /* the LM head streams its weights once; B rows normalised and B x V logits out */
    w.flops = 2.0 * T * a * b;
    w.bytes = (a * b + T * a + a) * es + 4.0 * T * b;
    break;
  }
  return w;
}

static upf_op case_op(bench_kind k) {
  switch (k) {
  case K_CEILING:
  case K_GEMM:
  case K_GEMM_LT:
    return UPF_OP_GEMM;
  case K_FFN:
    return UPF_OP_FFN_GATED;
  case K_ACT:
    return UPF_OP_FFN_ACT_MUL;
  case K_RMS:
    return UPF_OP_RMSNORM;
  case K_RMS_ADD:
    return UPF_OP_RMSNORM_ADD;
  case K_QK:
    return UPF_OP_QK_NORM;
  case K_ROPE:
    return UPF_OP_ROPE;
  case K_GATED:
    return UPF_OP_GATED_OUTPUT;
  case K_EMBED:
    return UPF_OP_EMBED;
  default:
    return UPF_OP_LOGITS_LAST;
  }
}

/* ---- inputs ---- */

/* Random values (N(0, std) in the dtype) tiled from one FILL_CHUNK of host data: weights and
 * activations of tens of GB are filled at upload speed. */
static upf_status fill_random(const upf_backend *be, void *dst, size_t bytes, upf_dtype dt, float std, uint64_t seed) {
  size_t chunk = bytes < FILL_CHUNK ? bytes : FILL_CHUNK;
  size_t es = upf_dtype_size(dt), n = chunk / es;
  void *host = malloc(chunk ? chunk : 1);
  if (!host)
    return upf_fail(UPF_ERR_NOMEM, "bench dense: host fill chunk");
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  float pool[4096];
  upf_rng_fill_normal(&rng, pool, 4096, 0.0f, std);
  for (size_t i = 0; i < n; i++) {
    float v = pool[(upf_rng_next(&rng) >> 20) & 4095];
    if (dt == UPF_DTYPE_BF16)
      ((uint16_t *)host)[i] = upf_bf16_from_f32(v);
    else
      ((float *)host)[i] = v;
  }
  upf_status st = UPF_OK;
  for (size_t off = 0; st == UPF_OK && off < bytes; off += chunk)
    st = be->upload((char *)dst + off, host, bytes - off < chunk ? bytes - off : chunk);
  free(host);
  return st;
}

static void case_release(void *ctx) {
  dense_case *c = ctx;
  const upf_backend *be = c->on_cuda ? upf_backend_cuda() : upf_backend_cpu();
  for (int i = 0; i < MAX_BUFS; i++) {
    if (c->buf[i])
      be->release(c->buf[i]);
    c->buf[i] = NULL;
  }
  free(c->cu_host);
  c->cu_host = NULL;
  c->ready = 0;
#ifdef UPF_HAVE_CUDA
  upf_cuda_gemm_lt_plan_destroy(c->lt_plan);
#endif
  c->lt_plan = NULL;
}

static dense_case *live_case; /* one case holds its (up to tens of GB of) buffers at a time */

static upf_status case_prepare(dense_case *c, const upf_backend *be) {
  if (c->ready)
    return UPF_OK;
  if (live_case && live_case != c)
    case_release(live_case);
  int nb = case_buffers(c, c->bytes);
  upf_status st = UPF_OK;
  for (int i = 0; st == UPF_OK && i < nb; i++)
    st = be->alloc(&c->buf[i], c->bytes[i]);
  if (st != UPF_OK) {
    case_release(c);
    return upf_fail_context(st, "allocating the case's buffers: ");
  }
  upf_rng rng;
  upf_rng_seed(&rng, 0xbe4cull + (uint64_t)c->kind);
  for (int i = 0; st == UPF_OK && i < nb; i++) {
    int is_ints = (c->kind == K_ROPE && i == 1) || (c->kind == K_EMBED && i == 1);
    if (is_ints) {
      int64_t T = c->T;
      int32_t *ids = malloc((size_t)T * sizeof *ids);
      if (!ids) {
        st = upf_fail(UPF_ERR_NOMEM, "bench dense: ids");
        break;
      }
      int32_t p = 0;
      for (int64_t t = 0; t < T; t++) { /* positions with gaps as after a drop; ids anywhere in V */
        ids[t] = c->kind == K_EMBED ? (int32_t)upf_rng_below(&rng, (uint64_t)c->b) : p;
        p += 1 + (int32_t)(upf_rng_below(&rng, 4) == 0 ? upf_rng_below(&rng, 32) : 0);
      }
      st = be->upload(c->buf[i], ids, (size_t)T * sizeof *ids);
      free(ids);
    } else if (!(c->kind == K_LOGITS && i == 3)) {
      /* weights scaled 1/sqrt(fan-in) so activations stay O(1); norms' weights near 1 */
      float std = 1.0f;
      if ((c->kind == K_GEMM || c->kind == K_GEMM_LT || c->kind == K_CEILING) && i == 1)
        std = 1.0f / sqrtf((float)c->a);
      if (c->kind == K_FFN && i == 1)
        std = 1.0f / sqrtf((float)c->a);
      if (c->kind == K_FFN && i == 2)
        std = 1.0f / sqrtf((float)c->b);
      if (c->kind == K_LOGITS && i == 2)
        std = 1.0f / sqrtf((float)c->a);
      st = fill_random(be, c->buf[i], c->bytes[i], c->dtype, std, 0x5eedull * 31 + (uint64_t)i);
    }
  }
  if (st == UPF_OK && c->kind == K_LOGITS) { /* B requests of 64 tokens */
    c->cu_host = malloc((size_t)(c->T + 1) * sizeof *c->cu_host);
    if (!c->cu_host)
      st = upf_fail(UPF_ERR_NOMEM, "bench dense: cu_seqlens");
    for (int64_t r = 0; st == UPF_OK && r <= c->T; r++)
      c->cu_host[r] = (int32_t)(64 * r);
  }
  if (st == UPF_OK)
    st = be->synchronize();
  if (st != UPF_OK) {
    case_release(c);
    return st;
  }
  c->ready = 1;
  live_case = c;
  return UPF_OK;
}

/* One call of the op on the case's buffers. */
static upf_status case_call(const dense_case *c, const upf_backend *be) {
  upf_dtype dt = c->dtype;
  upf_tensor t0, t1, t2, t3;
  int64_t T = c->T, a = c->a, b = c->b, hq, hkv, d;
  upf_rope_params rp;
  rope_shape(c->model, &hq, &hkv, &d, &rp);
  upf_norm_params np = norm_of(c->model);
  switch (c->kind) {
  case K_CEILING:
  case K_GEMM:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){T, a});
    upf_tensor_init(&t1, c->buf[1], dt, 2, (const int64_t[2]){a, b});
    upf_tensor_init(&t2, c->buf[2], dt, 2, (const int64_t[2]){T, b});
    return be->gemm(&t0, &t1, &t2);
  case K_GEMM_LT:
#ifdef UPF_HAVE_CUDA
    return upf_cuda_gemm_lt_plan_run(c->lt_plan);
#else
    return upf_fail(UPF_ERR_UNSUPPORTED, "gemm_lt_best: built without CUDA");
#endif
  case K_FFN:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){T, a});
    upf_tensor_init(&t1, c->buf[1], dt, 2, (const int64_t[2]){a, 2 * b});
    upf_tensor_init(&t2, c->buf[2], dt, 2, (const int64_t[2]){b, a});
    upf_tensor_init(&t3, c->buf[3], dt, 2, (const int64_t[2]){T, a});
    return be->ffn_gated(&t0, &t1, &t2, c->act, &t3);
  case K_ACT:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){T, 2 * a});
    upf_tensor_init(&t1, c->buf[1], dt, 2, (const int64_t[2]){T, a});
    return be->ffn_act_mul(&t0, c->act, &t1);
  case K_RMS:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){T, a});
    upf_tensor_init(&t1, c->buf[1], dt, 1, (const int64_t[1]){a});
    upf_tensor_init(&t2, c->buf[2], dt, 2, (const int64_t[2]){T, a});
    return be->rmsnorm(&t0, &t1, &np, &t2);
  case K_RMS_ADD:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){T, a});
    upf_tensor_init(&t1, c->buf[1], dt, 2, (const int64_t[2]){T, a});
    upf_tensor_init(&t2, c->buf[2], dt, 1, (const int64_t[1]){a});
    upf_tensor_init(&t3, c->buf[3], dt, 2, (const int64_t[2]){T, a});
    return be->rmsnorm_add(&t0, &t1, &t2, &np, &t3);
  case K_QK:
  case K_ROPE: {
    int64_t W = (hq + 2 * hkv) * d;
    upf_tensor_init(&t0, c->buf[0], dt, 3, (const int64_t[3]){T, hq, d});
    t0.stride[0] = W;
    t1 = t0;
    t1.shape[1] = hkv;
    t1.data = (char *)c->buf[0] + (size_t)(hq * d) * upf_dtype_size(dt);
    if (c->kind == K_ROPE)
      return be->rope(&t0, &t1, c->buf[1], &rp);
    upf_tensor_init(&t2, c->buf[1], dt, 1, (const int64_t[1]){d});
    upf_tensor_init(&t3, c->buf[2], dt, 1, (const int64_t[1]){d});
    UPF_TRY(be->qk_norm(&t0, &t2, &np, &t0));
    return be->qk_norm(&t1, &t3, &np, &t1);
  }
  case K_GATED:
    upf_tensor_init(&t0, c->buf[0], dt, 3, (const int64_t[3]){T, a, b});
    upf_tensor_init(&t1, (char *)c->buf[1] + (size_t)b * upf_dtype_size(dt), dt, 3, (const int64_t[3]){T, a, b});
    t1.stride[0] = a * 2 * b, t1.stride[1] = 2 * b;
    upf_tensor_init(&t2, c->buf[2], dt, 3, (const int64_t[3]){T, a, b});
    return be->gated_output(&t0, &t1, &t2);
  case K_EMBED:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){b, a});
    upf_tensor_init(&t2, c->buf[2], dt, 2, (const int64_t[2]){T, a});
    return be->embed(c->buf[1], T, &t0, 1.0f, &t2);
  case K_LOGITS:
    upf_tensor_init(&t0, c->buf[0], dt, 2, (const int64_t[2]){T * 64, a});
    upf_tensor_init(&t1, c->buf[1], dt, 1, (const int64_t[1]){a});
    upf_tensor_init(&t2, c->buf[2], dt, 2, (const int64_t[2]){a, b});
    upf_tensor_init(&t3, c->buf[3], UPF_DTYPE_F32, 2, (const int64_t[2]){T, b});
    return be->logits_last(&t0, c->cu_host, (int32_t)T, &t1, &np, &t2, &t3);
  }
  return upf_fail(UPF_ERR_INVALID_ARG, "bench dense: unknown kind");
}

static void set_work_counters(upf_bench_state *st, const dense_case *c) {
  dense_work w = case_work(c);
  if (w.flops > 0.0)
    upf_bench_set_counter(st, UPF_BENCH_FLOPS, w.flops, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, UPF_BENCH_BYTES, w.bytes, UPF_BENCH_COUNTER_RATE);
}

static void bench_cpu(upf_bench_state *st, void *ctx) {
  dense_case *c = ctx;
  const upf_backend *be = upf_backend_cpu();
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  while (upf_bench_keep_running(st)) {
    if (case_call(c, be) != UPF_OK) {
      upf_bench_skip_with_error(st, "%s: %s", upf_op_name(case_op(c->kind)), upf_last_error());
      return;
    }
  }
  set_work_counters(st, c);
}

#ifdef UPF_HAVE_CUDA
/* ---- ceilings, measured once and shared ---- */

static upf_status call_case_cuda(void *arg) { return case_call(arg, upf_backend_cuda()); }

/* The cuBLAS ceiling: the median rate of CEILING_REPS timed square bf16 GEMMs of CEILING_N in their
 * steady state (upf_bench_steady_median, after CEILING_WARM_S of them back to back: a burst after idle
 * runs at boost clocks, well above the sustained rate the other rows run at; perf/NOTES.md), on random
 * data (zeros run faster: less switching power, higher clocks). */
static upf_status gemm_ceiling(double *flops_per_second) {
  static double measured;
  static upf_status status = UPF_STATUS_COUNT;
  static char message[512];
  if (status == UPF_STATUS_COUNT) {
    dense_case sq = {"ceiling", K_CEILING, 1, BF, CEILING_N, CEILING_N, CEILING_N, M_LLAMA, UPF_ACT_SILU, 0};
    const upf_backend *be = upf_backend_cuda();
    dense_case *was_live = live_case;
    live_case = NULL; /* keep the running case's buffers */
    status = case_prepare(&sq, be);
    double median_s = 0.0;
    if (status == UPF_OK)
      status = upf_bench_steady_median(call_case_cuda, &sq, CEILING_WARM_S, CEILING_REPS, &median_s);
    if (status == UPF_OK)
      measured = case_work(&sq).flops / median_s;
    snprintf(message, sizeof message, "%s", upf_last_error());
    case_release(&sq);
    live_case = was_live;
  }
  *flops_per_second = measured;
  return status == UPF_OK ? UPF_OK : upf_fail(status, "cuBLAS ceiling: %s", message);
}

#endif

static void bench_cuda(upf_bench_state *st, void *ctx) {
#ifndef UPF_HAVE_CUDA
  upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
#else
  dense_case *c = ctx;
  const upf_backend *be = upf_backend_cuda();
  char why[512];
  double copy_bw = 0.0, gemm_peak = 0.0;
  if (be->probe() != UPF_OK) {
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  upf_op op = case_op(c->kind);
  if (!upf_bench_op_verified(op, why, sizeof why)) {
    upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
    return;
  }
  int compute_bound = c->kind == K_GEMM || c->kind == K_GEMM_LT || c->kind == K_FFN || c->kind == K_CEILING;
  if (compute_bound && c->kind != K_CEILING && gemm_ceiling(&gemm_peak) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s", upf_last_error());
    return;
  }
  if (!compute_bound && upf_bench_copy_ceiling(&copy_bw) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s", upf_last_error());
    return;
  }
  if (case_prepare(c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  if (c->kind == K_GEMM_LT && !c->lt_plan &&
      upf_cuda_gemm_lt_plan_create(c->T, c->a, c->b, c->buf[0], c->buf[1], c->buf[2],
                                   (upf_gemm_lt_plan **)&c->lt_plan) != UPF_OK) {
    upf_bench_skip_with_error(st, "cublasLt sweep: %s", upf_last_error());
    return;
  }
  dense_work w = case_work(c);
  upf_bench_timing t;
  if (upf_bench_time_cuda(st, call_case_cuda, c, DENSE_WARMUP, compute_bound ? 0.0 : w.bytes, &t) != UPF_OK) {
    upf_bench_skip_with_error(st, "%s: %s", upf_op_name(op), upf_last_error());
    return;
  }
  set_work_counters(st, c);
  double per_second = t.total_s > 0.0 ? (double)t.iterations / t.total_s : 0.0;
  if (per_second > 0.0 && compute_bound && c->kind != K_CEILING)
    upf_bench_set_counter(st, UPF_BENCH_CUBLAS_SHARE, w.flops * per_second / gemm_peak, UPF_BENCH_COUNTER_VALUE);
  if (per_second > 0.0 && !compute_bound)
    upf_bench_set_counter(st, UPF_BENCH_COPY_SHARE, w.bytes * per_second / copy_bw, UPF_BENCH_COUNTER_VALUE);
  if (c->kind == K_GEMM_LT) { /* the sweep's own medians: the best algorithm and cublasGemmEx, same buffers */
    int algos = 0, rank = 0;
    double best_s = 0.0, gemmex_s = 0.0;
    upf_cuda_gemm_lt_plan_stats(c->lt_plan, &algos, &rank, &best_s, &gemmex_s);
    upf_bench_set_counter(st, "lt_algos", algos, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "lt_best_rank", rank, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "gemmex_ms", 1e3 * gemmex_s, UPF_BENCH_COUNTER_VALUE);
    upf_bench_set_counter(st, "gemmex_over_best", best_s > 0.0 ? gemmex_s / best_s : 0.0, UPF_BENCH_COUNTER_VALUE);
  }
#endif
}

static void register_or_report(const upf_bench_spec *spec) {
  if (upf_bench_register(spec) != UPF_OK)
    fprintf(stderr, "bench dense: %s\n", upf_last_error());
}

void upf_register_dense_benchmarks(void) {
  for (int i = 0; i < NUM_CASES; i++) {
    dense_case *c = &cases[i];
    upf_bench_spec spec = {.name = c->name, .ctx = c, .teardown = case_release, .num_args = 1};
    spec.args[0] = c->T;
    spec.arg_names[0] = c->kind == K_LOGITS ? "B" : c->kind == K_CEILING ? "n" : "T";
    spec.fn = c->on_cuda ? bench_cuda : bench_cpu;
    upf_bench_spec_timing(&spec, c->on_cuda, DENSE_CUDA_MIN_TIME_S, DENSE_CUDA_REPETITIONS, c->iterations);
    register_or_report(&spec);
  }
}

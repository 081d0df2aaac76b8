/* CUDA projections: cublasGemmEx, bf16 or f32 A/B, CUBLAS_COMPUTE_32F, bf16 or f32 C.
 *
 * Row-major c (M, N) = a (M, K) . b (K, N) is, read column-major, c^T (N, M) = b^T (N, K) . a^T
 * (K, M), where every transposed operand is the row-major buffer itself: one GemmEx with
 * m = N, n = M, k = K, A = b (ld = ldb), B = a (ld = lda), C = c (ld = ldc), no transposes. The
 * weights are the (in, out) layout of the projections, so nothing is copied or transposed.
 *
 * cuBLAS picks the kernel (on sm_90: its wgmma/TMA kernels for bf16 when the pointers are 16-byte
 * aligned and the leading dimensions multiples of 8). The ceiling that perf/bench_dense.c compares
 * every projection and FFN with is this same call on a large square bf16 problem.
 *
 * f32 operands (the verification dtype, not the performance path) run SGEMM over slices of
 * GEMM_F32_KSLICE along K, accumulated in the fp32 C (beta = 1 after the first slice): an SGEMM
 * kernel accumulates each output serially over all of K, an error of ~sqrt(K) roundings, while the
 * CPU reference's BLAS sums K in blocks; slicing gives the device the same blocked accuracy, so
 * f32 projections with K = 14336 stay within SPEC 7 of the CPU reference.
 *
 * The `lt-tuned` variant (variants.def) runs bf16 projections through cublasLt instead: on the first
 * call of a shape (extents, strides, dtypes, pointer alignment) it times up to LT_CANDIDATES of the
 * heuristic's algorithms and cublasGemmEx on the call's own buffers, remembers the fastest, and uses it
 * from then on (cublasGemmEx where that won). The first call of each shape waits for the device. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <new>
#include <vector>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/gemm.cuh"
#include "uniprefill/variant.h"

#define GEMM_F32_KSLICE 1024

/* ---- lt-tuned: cublasLt with the algorithm timed per shape ---- */

#define LT_CANDIDATES 16  /* heuristic algorithms timed per shape */
#define LT_TUNE_REPS 5    /* timed calls per candidate after one warm-up; the median counts */
#define LT_CACHE_MAX 1024 /* shapes remembered; later ones run cublasGemmEx */

struct upf_gemm_lt_choice {
  int64_t M, K, N, lda, ldb, ldc;
  upf_dtype ab, cd;
  int align; /* bytes, the largest power of two (<= 256) dividing the three pointers */
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  int candidates, rank, use_lt;
  double lt_s, gemmex_s;
};

namespace {

struct lt_state {
  std::mutex lock;
  cublasLtHandle_t handle = nullptr;
  std::vector<upf_gemm_lt_choice *> cache;
};
lt_state lt;

int pointer_align(const void *a, const void *b, const void *c) {
  const uintptr_t bits = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | 256;
  return (int)(bits & (~bits + 1));
}

void choice_free(upf_gemm_lt_choice *ch) {
  if (!ch)
    return;
  if (ch->la)
    cublasLtMatrixLayoutDestroy(ch->la);
  if (ch->lb)
    cublasLtMatrixLayoutDestroy(ch->lb);
  if (ch->lc)
    cublasLtMatrixLayoutDestroy(ch->lc);
  if (ch->op)
    cublasLtMatmulDescDestroy(ch->op);
  delete ch;
}

/* c of ch's shape marked as written for initcheck (cuda_backend.cuh), once after the calls that wrote it. */
void mark_c(const upf_gemm_lt_choice *ch, void *c) {
  const int64_t es = ch->cd == UPF_DTYPE_BF16 ? 2 : 4;
  upf_cuda_mark_written(upf_cuda_stream(), c, ch->M, ch->N * es, ch->ldc * es);
}

upf_status lt_call(const upf_gemm_lt_choice *ch, const cublasLtMatmulAlgo_t *algo, const void *a, const void *b,
                   void *c) {
  size_t ws_bytes = 0;
  void *ws = upf_cuda_cublas_workspace(&ws_bytes);
  const float one = 1.0f, zero = 0.0f;
  /* column-major c^T (N, M) = b^T (N, K) . a^T (K, M), as cublasGemmEx runs it above */
  UPF_CUBLAS_TRY(cublasLtMatmul(lt.handle, ch->op, &one, b, ch->la, a, ch->lb, &zero, c, ch->lc, c, ch->lc, algo, ws,
                        ws_bytes, upf_cuda_stream()));
  return UPF_OK;
}

upf_status gemmex_call(const upf_gemm_lt_choice *ch, const void *a, const void *b, void *c) {
  const float one = 1.0f, zero = 0.0f;
  UPF_CUBLAS_TRY(cublasGemmEx(upf_cuda_cublas(), CUBLAS_OP_N, CUBLAS_OP_N, (int)ch->N, (int)ch->M, (int)ch->K, &one, b,
                              CUDA_R_16BF, (int)ch->ldb, a, CUDA_R_16BF, (int)ch->lda, &zero, c,
                              ch->cd == UPF_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F, (int)ch->ldc, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  return UPF_OK;
}

/* The median device time of LT_TUNE_REPS calls of f after one warm-up; a call that fails makes the
 * candidate unusable (status returned, nothing recorded). */
template <typename F> upf_status median_time(F f, cudaEvent_t e0, cudaEvent_t e1, double *seconds) {
  double t[LT_TUNE_REPS];
  UPF_TRY(f());
  for (int i = 0; i < LT_TUNE_REPS; i++) {
    UPF_CUDA_TRY(cudaEventRecord(e0, upf_cuda_stream()));
    UPF_TRY(f());
    UPF_CUDA_TRY(cudaEventRecord(e1, upf_cuda_stream()));
    UPF_CUDA_TRY(cudaEventSynchronize(e1));
    float ms = 0.0f;
    UPF_CUDA_TRY(cudaEventElapsedTime(&ms, e0, e1));
    t[i] = ms * 1e-3;
  }
  std::sort(t, t + LT_TUNE_REPS);
  *seconds = t[LT_TUNE_REPS / 2];
  return UPF_OK;
}

/* Times the heuristic's candidates and cublasGemmEx for ch's shape on the call's buffers (c is
 * overwritten; a and b are only read) and records the fastest in ch. */
upf_status lt_tune(upf_gemm_lt_choice *ch, const void *a, const void *b, void *c) {
  const cudaDataType_t tc = ch->cd == UPF_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  UPF_CUBLAS_TRY(cublasLtMatmulDescCreate(&ch->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  UPF_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&ch->la, CUDA_R_16BF, (uint64_t)ch->N, (uint64_t)ch->K, ch->ldb));
  UPF_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&ch->lb, CUDA_R_16BF, (uint64_t)ch->K, (uint64_t)ch->M, ch->lda));
  UPF_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&ch->lc, tc, (uint64_t)ch->N, (uint64_t)ch->M, ch->ldc));
  size_t ws_bytes = 0;
  upf_cuda_cublas_workspace(&ws_bytes);
  const uint32_t align = (uint32_t)ch->align;
  cublasLtMatmulPreference_t pref = nullptr;
  UPF_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
  cublasStatus_t cs = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                           sizeof ws_bytes);
  const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && cs == CUBLAS_STATUS_SUCCESS; i++)
    cs = cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &align, sizeof align);
  cublasLtMatmulHeuristicResult_t res[LT_CANDIDATES];
  int n = 0;
  if (cs == CUBLAS_STATUS_SUCCESS)
    cs = cublasLtMatmulAlgoGetHeuristic(lt.handle, ch->op, ch->la, ch->lb, ch->lc, ch->lc, pref, LT_CANDIDATES, res,
                                        &n);
  cublasLtMatmulPreferenceDestroy(pref);
  if (cs != CUBLAS_STATUS_SUCCESS)
    n = 0; /* no candidate: cublasGemmEx runs the shape */

  cudaEvent_t e0 = nullptr, e1 = nullptr;
  UPF_CUDA_TRY(cudaEventCreate(&e0));
  upf_status st = cudaEventCreate(&e1) == cudaSuccess ? UPF_OK : upf_fail(UPF_ERR_CUDA, "gemm (cuda): cudaEventCreate");
  if (st == UPF_OK)
    st = median_time([&] { return gemmex_call(ch, a, b, c); }, e0, e1, &ch->gemmex_s);
  ch->candidates = 0, ch->rank = -1, ch->use_lt = 0;
  for (int i = 0; st == UPF_OK && i < n; i++) {
    double s = 0.0;
    if (res[i].state != CUBLAS_STATUS_SUCCESS ||
        median_time([&] { return lt_call(ch, &res[i].algo, a, b, c); }, e0, e1, &s) != UPF_OK) {
      upf_clear_error(); /* offered but refused by this problem: not a candidate */
      continue;
    }
    ch->candidates++;
    if (ch->rank < 0 || s < ch->lt_s)
      ch->lt_s = s, ch->rank = i, ch->algo = res[i].algo;
  }
  cudaEventDestroy(e0);
  if (e1)
    cudaEventDestroy(e1);
  ch->use_lt = ch->rank >= 0 && ch->lt_s < ch->gemmex_s;
  mark_c(ch, c);
  return st;
}

} // namespace

extern "C" upf_status upf_cuda_gemm_lt_choose(const void *a, int64_t lda, const void *b, int64_t ldb, void *c,
                                              int64_t ldc, int64_t M, int64_t K, int64_t N, upf_dtype cd,
                                              const upf_gemm_lt_choice **choice) {
  *choice = nullptr;
  UPF_TRY(upf_cuda_init());
  if (M < 1 || K < 1 || N < 1 || M > INT32_MAX || K > INT32_MAX || N > INT32_MAX || lda > INT32_MAX ||
      ldb > INT32_MAX || ldc > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "gemm (cuda): lt-tuned: M=%lld K=%lld N=%lld outside 1 .. int32", (long long)M,
                    (long long)K, (long long)N);
  if (!upf_cuda_cublas())
    return UPF_ERR_CUDA; /* message recorded by upf_cuda_cublas */
  const int align = pointer_align(a, b, c);
  std::lock_guard<std::mutex> guard(lt.lock);
  for (const upf_gemm_lt_choice *ch : lt.cache)
    if (ch->M == M && ch->K == K && ch->N == N && ch->lda == lda && ch->ldb == ldb && ch->ldc == ldc &&
        ch->cd == cd && ch->align == align) {
      *choice = ch;
      return UPF_OK;
    }
  if (lt.cache.size() >= LT_CACHE_MAX)
    return UPF_OK; /* no choice: the caller runs cublasGemmEx */
  if (!lt.handle)
    UPF_CUBLAS_TRY(cublasLtCreate(&lt.handle));
  upf_gemm_lt_choice *ch = new (std::nothrow) upf_gemm_lt_choice();
  if (!ch)
    return upf_fail(UPF_ERR_NOMEM, "gemm (cuda): lt-tuned choice");
  ch->M = M, ch->K = K, ch->N = N, ch->lda = lda, ch->ldb = ldb, ch->ldc = ldc, ch->ab = UPF_DTYPE_BF16, ch->cd = cd;
  ch->align = align;
  upf_status st = lt_tune(ch, a, b, c);
  if (st == UPF_OK) {
    try {
      lt.cache.push_back(ch);
    } catch (const std::bad_alloc &) {
      st = upf_fail(UPF_ERR_NOMEM, "gemm (cuda): lt-tuned cache");
    }
  }
  if (st != UPF_OK) {
    choice_free(ch);
    return st;
  }
  *choice = ch;
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gemm_lt_run(const upf_gemm_lt_choice *ch, const void *a, const void *b, void *c) {
  if (ch->rank < 0)
    return upf_fail(UPF_ERR_UNSUPPORTED, "gemm (cuda): cublasLt has no algorithm for M=%lld K=%lld N=%lld",
                    (long long)ch->M, (long long)ch->K, (long long)ch->N);
  UPF_TRY(lt_call(ch, &ch->algo, a, b, c));
  mark_c(ch, c);
  return UPF_OK;
}

extern "C" void upf_cuda_gemm_lt_describe(const upf_gemm_lt_choice *ch, int *candidates, int *rank, double *lt_s,
                                          double *gemmex_s) {
  *candidates = ch->candidates, *rank = ch->rank, *lt_s = ch->lt_s, *gemmex_s = ch->gemmex_s;
}

extern "C" upf_status upf_cuda_gemm_raw(const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc,
                                        int64_t M, int64_t K, int64_t N, upf_dtype ab, upf_dtype cd) {
  UPF_TRY(upf_cuda_init());
  if (M == 0 || N == 0)
    return UPF_OK;
  if (K < 1 || K > INT32_MAX || N > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "gemm (cuda): K=%lld N=%lld lda=%lld ldb=%lld ldc=%lld outside the int32 range",
                    (long long)K, (long long)N, (long long)lda, (long long)ldb, (long long)ldc);
  cublasHandle_t handle = upf_cuda_cublas();
  if (!handle)
    return UPF_ERR_CUDA; /* message recorded by upf_cuda_cublas */
  cudaDataType_t t_ab = ab == UPF_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  cudaDataType_t t_c = cd == UPF_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  size_t es_ab = ab == UPF_DTYPE_BF16 ? 2 : 4, es_c = cd == UPF_DTYPE_BF16 ? 2 : 4;
  const float alpha = 1.0f, beta0 = 0.0f, beta1 = 1.0f;
  int64_t widest = lda > ldc ? lda : ldc;
  int64_t chunk = (int64_t)INT32_MAX / (widest > 0 ? widest : 1);
  int64_t kslice = ab == UPF_DTYPE_F32 && cd == UPF_DTYPE_F32 ? GEMM_F32_KSLICE : K;
  upf_variant variant = UPF_VARIANT_COUNT;
  UPF_TRY(upf_variant_current(UPF_OP_GEMM, &variant));
  const bool lt_tuned = variant == UPF_VARIANT_GEMM_LT_TUNED && ab == UPF_DTYPE_BF16;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    int64_t rows = M - m0 < chunk ? M - m0 : chunk;
    char *c_rows = (char *)c + (size_t)(m0 * ldc) * es_c;
    for (int64_t k0 = 0; k0 < K; k0 += kslice) {
      int64_t kn = K - k0 < kslice ? K - k0 : kslice;
      const char *a_part = (const char *)a + (size_t)(m0 * lda + k0) * es_ab; /* columns k0.. of a's rows */
      const char *b_part = (const char *)b + (size_t)(k0 * ldb) * es_ab;      /* rows k0.. of b */
      if (lt_tuned) { /* the remembered algorithm; cublasGemmEx below where that won or the cache is full */
        const upf_gemm_lt_choice *ch = nullptr;
        UPF_TRY(upf_cuda_gemm_lt_choose(a_part, lda, b_part, ldb, c_rows, ldc, rows, kn, N, cd, &ch));
        if (ch && ch->use_lt) {
          UPF_TRY(lt_call(ch, &ch->algo, a_part, b_part, c_rows));
          continue;
        }
      }
      UPF_CUBLAS_TRY(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)rows, (int)kn, &alpha, b_part, t_ab,
                                  (int)ldb, a_part, t_ab, (int)lda, k0 == 0 ? &beta0 : &beta1, c_rows, t_c, (int)ldc,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    upf_cuda_mark_written(upf_cuda_stream(), c_rows, rows, N * (int64_t)es_c, ldc * (int64_t)es_c);
  }
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gemm(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gemm_check(a, b, c));
  return upf_cuda_gemm_raw(a->data, a->stride[0], b->data, b->stride[0], c->data, c->stride[0], a->shape[0],
                           a->shape[1], b->shape[1], a->dtype, c->dtype);
}

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
 * f32 projections with K = 14336 stay within SPEC 7 of the CPU reference. */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/gemm.cuh"

#define UPF_CUBLAS_TRY(call)                                                                                   \
  do {                                                                                                         \
    cublasStatus_t upf_cublas_st_ = (call);                                                                    \
    if (upf_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                               \
      return upf_fail(UPF_ERR_CUDA, "cublas: %s failed: %s (%d) at %s:%d", #call,                              \
                      cublasGetStatusString(upf_cublas_st_), (int)upf_cublas_st_, __FILE__, __LINE__);         \
  } while (0)

#define GEMM_F32_KSLICE 1024

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
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    int64_t rows = M - m0 < chunk ? M - m0 : chunk;
    char *c_rows = (char *)c + (size_t)(m0 * ldc) * es_c;
    for (int64_t k0 = 0; k0 < K; k0 += kslice) {
      int64_t kn = K - k0 < kslice ? K - k0 : kslice;
      const char *a_part = (const char *)a + (size_t)(m0 * lda + k0) * es_ab; /* columns k0.. of a's rows */
      const char *b_part = (const char *)b + (size_t)(k0 * ldb) * es_ab;      /* rows k0.. of b */
      UPF_CUBLAS_TRY(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)rows, (int)kn, &alpha, b_part, t_ab,
                                  (int)ldb, a_part, t_ab, (int)lda, k0 == 0 ? &beta0 : &beta1, c_rows, t_c, (int)ldc,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gemm(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gemm_check(a, b, c));
  return upf_cuda_gemm_raw(a->data, a->stride[0], b->data, b->stride[0], c->data, c->stride[0], a->shape[0],
                           a->shape[1], b->shape[1], a->dtype, c->dtype);
}

/* CUDA projections through cuBLAS (plain C header): c = a . b with bf16 or f32 operands, fp32
 * accumulation (CUBLAS_COMPUTE_32F; f32 operands run plain SGEMM, no TF32), bf16 or f32 output, on
 * the backend's cuBLAS handle and stream. */
#ifndef UNIPREFILL_CUDA_GEMM_CUH
#define UNIPREFILL_CUDA_GEMM_CUH

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (device pointers): see backend.h. */
upf_status upf_cuda_gemm(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c);

/* Row-major c (M, N) = a (M, K) . b (K, N) on raw device pointers with row strides lda/ldb/ldc (in
 * elements); a and b in `ab`, c in `cd` (f32 or bf16; f32 when ab is f32). No shape checks beyond
 * the int32 limits of cuBLAS: callers validate. Splits M so that no call addresses more than 2^31
 * elements of a or c. Enqueued on the backend stream; does not wait. */
upf_status upf_cuda_gemm_raw(const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc, int64_t M,
                             int64_t K, int64_t N, upf_dtype ab, upf_dtype cd);

/* The lt-tuned variant's choice for one bf16 shape (a in bf16, c in cd): cublasLt's fastest
 * heuristic algorithm, timed on first use against cublasGemmEx on the given buffers (c is written;
 * the stream is waited for), then remembered for the process. *choice stays NULL when the cache is
 * full. The benchmarks read the timings through upf_cuda_gemm_lt_describe. */
typedef struct upf_gemm_lt_choice upf_gemm_lt_choice;
upf_status upf_cuda_gemm_lt_choose(const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc,
                                   int64_t M, int64_t K, int64_t N, upf_dtype cd, const upf_gemm_lt_choice **choice);
/* Runs the chosen cublasLt algorithm (even where cublasGemmEx was faster) on buffers of the same shape. */
upf_status upf_cuda_gemm_lt_run(const upf_gemm_lt_choice *choice, const void *a, const void *b, void *c);
/* Algorithms that ran, the heuristic rank of the fastest (-1: none), its median time and
 * cublasGemmEx's, in seconds. */
void upf_cuda_gemm_lt_describe(const upf_gemm_lt_choice *choice, int *candidates, int *rank, double *lt_s,
                               double *gemmex_s);

#ifdef __cplusplus
}
#endif
#endif

/* CPU reference of the projections: c (M, N) = a (M, K) . b (K, N) through OpenBLAS cblas_sgemm
 * (fp32 accumulation; bf16 operands are widened to fp32 first, exactly), rounded once to c's dtype.
 * Also the fp64 truth that the long-reduction rule of SPEC section 7 measures errors against. */
#ifndef UNIPREFILL_REF_GEMM_H
#define UNIPREFILL_REF_GEMM_H

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst (rows, cols) contiguous fp32 = rows [row0, row0+rows) of the 2-D f32/bf16 tensor t. */
void ref_rows_to_f32(const upf_tensor *t, int64_t row0, int64_t rows, float *dst);
/* Rows [row0, row0+rows) of t = src (rows, cols) contiguous, rounded to t's dtype. */
void ref_rows_from_f32(const float *src, int64_t row0, int64_t rows, const upf_tensor *t);
/* The whole 2-D tensor as a new contiguous fp32 matrix (malloc; NULL when out of memory). */
float *ref_matrix_to_f32(const upf_tensor *t);

/* c (M, N) = a (M, K) . b (K, N), contiguous fp32, cblas_sgemm. */
void ref_sgemm(const float *a, const float *b, float *c, int64_t M, int64_t K, int64_t N);

/* Backend entry (host pointers): see backend.h. Works through rows of a in chunks, so its scratch
 * is b in fp32 plus a few MB. */
upf_status cpu_gemm(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c);

/* c (M, N) in double = a . b of the stored (dtype-rounded) operands, through cblas_dgemm: the fp64
 * truth for verification. */
upf_status ref_gemm_f64(const upf_tensor *a, const upf_tensor *b, double *c);

#ifdef __cplusplus
}
#endif
#endif

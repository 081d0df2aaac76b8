/* CUDA gated FFN (plain C header): the fused activation-and-multiply kernel and the whole FFN
 * (cuBLAS gate/up GEMM, activation-and-multiply, cuBLAS down GEMM) over chunks of tokens. */
#ifndef UNIPREFILL_CUDA_FFN_CUH
#define UNIPREFILL_CUDA_FFN_CUH

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entries (device pointers): see backend.h. ffn_gated takes its (chunk, 3I) intermediate
 * from the backend workspace. */
upf_status upf_cuda_ffn_act_mul(const upf_tensor *gate_up, upf_act act, const upf_tensor *h);
upf_status upf_cuda_ffn_gated(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                              const upf_tensor *y);

/* The act-and-multiply on raw device pointers, validated by the caller, enqueued on `stream`:
 * h[r, :inter] = act(gu[r, :inter]) * gu[r, inter:2 inter] (rows of strides ld_in and ld_out, in
 * elements of dt) for r = row_index[i], i < rows, or for r = i when row_index is NULL. The MoE layer
 * runs its SwiGLU over the expert-sorted rows through it. */
upf_status upf_cuda_act_mul_rows(const void *gu, int64_t ld_in, void *h, int64_t ld_out, const int32_t *row_index,
                                 int64_t rows, int64_t inter, upf_dtype dt, upf_act act, cudaStream_t stream);

/* Tokens per pass of ffn_gated: the (chunk, 2I) + (chunk, I) intermediates stay near 1 GB at
 * Gemma's I = 15360 in bf16, while every GEMM keeps M >= 16K rows (no loss against the ceiling). */
#define UPF_CUDA_FFN_CHUNK 16384

#ifdef __cplusplus
}
#endif
#endif

/* CUDA implementation of the Qwen3-Next MoE FFN entries of the ops table (uniprefill/moe.h); plain C
 * header. All pointers are device memory. Every entry runs on upf_cuda_stream(); moe_ffn waits for
 * the device once (the per-expert token counts, which size the expert GEMMs), moe_route and
 * moe_permute once each for their error flags. */
#ifndef UNIPREFILL_CUDA_MOE_CUH
#define UNIPREFILL_CUDA_MOE_CUH

#include <stdint.h>

#include "uniprefill/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

upf_status upf_cuda_moe_route(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                              upf_moe_routing *routing);
upf_status upf_cuda_moe_permute(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                                upf_moe_permutation *perm);
upf_status upf_cuda_moe_ffn(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                            const upf_tensor *out, upf_moe_routing *routing);

/* How moe_ffn runs the routed experts' two GEMMs (llm.c-style variants, for verify and benchmarks).
 * The choice holds for the calls that follow on this process. */
typedef enum {
  UPF_CUDA_MOE_GEMM_AUTO = 0, /* the variant measured fastest for the routing at hand (moe.cu) */
  UPF_CUDA_MOE_GEMM_GROUPED,  /* cublasGemmGroupedBatchedEx: one group per distinct token count */
  UPF_CUDA_MOE_GEMM_PADDED,   /* cublasGemmStridedBatchedEx over E slabs of the largest count */
  UPF_CUDA_MOE_GEMM_LOOP,     /* one cublasGemmEx per expert that received tokens */
  UPF_CUDA_MOE_GEMM_BUCKETED, /* experts sorted by count in a few buckets, one cublasGemmBatchedEx a
                                 bucket over slabs of the bucket's largest count */
  UPF_CUDA_MOE_GEMM_COUNT
} upf_cuda_moe_gemm_variant;

void upf_cuda_moe_set_gemm_variant(upf_cuda_moe_gemm_variant variant);
const char *upf_cuda_moe_gemm_variant_name(upf_cuda_moe_gemm_variant variant);
/* The variant the last successful moe_ffn call ran (AUTO resolved; GROUPED falls back to LOOP
 * where cuBLAS refuses the grouped call). */
upf_cuda_moe_gemm_variant upf_cuda_moe_last_gemm_variant(void);

/* Phase timing of moe_ffn for benchmarks: when enabled, moe_ffn records device events between its
 * phases; read gives the last call's milliseconds per phase and returns 0 when none completed.
 * Phases: router GEMM + top-k, counting sort + host read of the counts + gather, expert GEMM 1
 * (gate/up), SwiGLU, expert GEMM 2 (down), the wait for the shared expert (which runs on a side
 * stream from the start of the call), weighted un-permute. */
#define UPF_CUDA_MOE_PHASES 7
void upf_cuda_moe_profile(int enable);
int upf_cuda_moe_profile_read(float phase_ms[UPF_CUDA_MOE_PHASES]);
const char *upf_cuda_moe_phase_name(int phase);

/* The benchmark's ceiling: C (M, N) = A (M, K) . B (N, K)^T, bf16 in and out, fp32 accumulation,
 * one cuBLAS GEMM on the backend stream (no wait). */
upf_status upf_cuda_moe_dense_gemm(int64_t M, int64_t N, int64_t K, const void *A, const void *B, void *C);

#ifdef __cplusplus
}
#endif
#endif

/* CUDA implementations of the selection entries of the ops table (SPEC.md section 2); plain C
 * header. All pointers are device memory except cu_seqlens_host; every entry runs on
 * upf_cuda_stream() and returns without waiting for the device unless it must read a result
 * (select_run's kept_total, the non-finite and range checks). */
#ifndef UNIPREFILL_CUDA_SELECT_CUH
#define UNIPREFILL_CUDA_SELECT_CUH

#include <stdint.h>

#include "uniprefill/select.h"

#ifdef __cplusplus
extern "C" {
#endif

upf_status upf_cuda_select_part_gemm(const upf_select_inputs *in, const upf_select_params *params, float *scores);
upf_status upf_cuda_select_block_softmax(const upf_select_inputs *in, const upf_select_params *params,
                                         const float *scores, float *token_mass);
upf_status upf_cuda_select_block_reduce(const upf_select_inputs *in, const upf_select_params *params,
                                        const float *token_mass, float *block_score);
upf_status upf_cuda_select_topp(const upf_select_inputs *in, const upf_select_params *params,
                                const float *block_score, uint8_t *block_mask);
upf_status upf_cuda_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                                  const uint8_t *block_mask, upf_select_outputs *out);
upf_status upf_cuda_select_run(const upf_select_inputs *in, const upf_select_params *params,
                               upf_select_outputs *out);

/* Kernel variants of select_run, for verification and benchmarks (llm.c style). The choice holds
 * for the calls that follow on this process. */
typedef enum {
  UPF_CUDA_SCORE_AUTO = 0, /* bf16 tensor-core kernel where it applies, else the FFMA kernel */
  UPF_CUDA_SCORE_FFMA = 1, /* FFMA kernel for both dtypes */
} upf_cuda_score_variant;

typedef enum {
  UPF_CUDA_TOPP_AUTO = 0,      /* one CTA per request sorts in shared memory when its blocks fit */
  UPF_CUDA_TOPP_SEGMENTED = 1, /* device-wide segmented sort, any number of blocks */
} upf_cuda_topp_variant;

void upf_cuda_select_set_variants(upf_cuda_score_variant score, upf_cuda_topp_variant topp);

/* Key-chunk size (keys per CTA) of the fused score kernel: 0 picks it from the batch shape. */
void upf_cuda_select_set_key_chunk(int32_t keys);

/* Shape of the bf16 tensor-core score kernel (benchmarks). 0 (the default) = the wgmma kernel
 * (Hopper, sm_90a build, G >= 64; elsewhere as 8). Any other value picks the mma.sync kernel: low two
 * bits 0 = 8 warps x 2 m-tiles (256 query rows per CTA; 8 x 1 for D = 256), 1 = 4 warps x 2 m-tiles
 * (two CTAs per SM), 2 = 8 warps x 1 m-tile; add 4 to turn the half-tile MMA/exp pipeline off; 8 =
 * the mma.sync 8 x 2 shape with the pipeline (the mma.sync default); 16, 26, 30 = wgmma variants at
 * D = 128 (fence before each tile's wgmma; early fence with deferred stores; the same with 8 stages). */
void upf_cuda_select_set_mma_shape(int shape);

/* Phase timing of select_run for benchmarks: when enabled, select_run records device events between
 * its phases; read gives the last call's milliseconds for (score kernel, combine, top-p, expansion).
 * Returns 0 when no timed call has completed. */
void upf_cuda_select_profile(int enable);
int upf_cuda_select_profile_read(float phase_ms[4]);

#ifdef __cplusplus
}
#endif
#endif

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
upf_status upf_cuda_select_block_scores(const upf_select_inputs *in, const upf_select_params *params,
                                        float *block_score);
upf_status upf_cuda_select_topp(const upf_select_inputs *in, const upf_select_params *params,
                                const float *block_score, uint8_t *block_mask);
upf_status upf_cuda_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                                  const uint8_t *block_mask, upf_select_outputs *out);
upf_status upf_cuda_select_run(const upf_select_inputs *in, const upf_select_params *params,
                               upf_select_outputs *out);

#ifdef __cplusplus
}
#endif
#endif

/* CUDA implementation of the Qwen3-Next MoE FFN entries of the ops table (uniprefill/moe.h); plain C
 * header. All pointers are device memory. Every entry runs on upf_cuda_stream(); moe_ffn waits for
 * the device once (the per-expert token counts, which size the expert GEMMs), moe_route and
 * moe_permute once each for their error flags. moe_ffn's expert GEMMs run the moe.ffn variant in
 * effect (uniprefill/variant.h). */
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

#ifdef __cplusplus
}
#endif
#endif

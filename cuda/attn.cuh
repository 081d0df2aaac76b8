/* CUDA attention (plain C header): varlen causal prefill (full or sliding window, GQA, soft-cap, LSE),
 * paged attention through a block table (decode and cached-prefill rows), and the paged cache write. */
#ifndef UNIPREFILL_CUDA_ATTN_CUH
#define UNIPREFILL_CUDA_ATTN_CUH

#include <stdint.h>

#include "uniprefill/attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest head dim the kernels take. */
#define UPF_CUDA_ATTN_MAX_D 256

/* Backend entries (device pointers; the batch's *_host arrays on the host): see backend.h. */
upf_status upf_cuda_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                 const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                                 const upf_tensor *lse);
upf_status upf_cuda_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                               const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                               const upf_tensor *lse);
upf_status upf_cuda_kv_cache_write(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping,
                                   const int32_t *slot_mapping_host, const upf_tensor *k_cache,
                                   const upf_tensor *v_cache);

#ifdef __cplusplus
}
#endif
#endif

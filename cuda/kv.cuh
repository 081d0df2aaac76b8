/* CUDA paged KV metadata ops (plain C header): the slot mapping and the row scatter (uniprefill/kv.h). */
#ifndef UNIPREFILL_CUDA_KV_CUH
#define UNIPREFILL_CUDA_KV_CUH

#include <stdint.h>

#include "uniprefill/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* slot_mapping (T) device: one thread per token, its row found by binary search over cu_seqlens. */
upf_status upf_cuda_kv_slot_mapping(const upf_kv_slot_batch *b, int32_t *slot_mapping);
/* dst[index[i], :] = src[i, :] (device pointers; index_host the host copy the checks read). */
upf_status upf_cuda_scatter_rows(const void *src, int64_t num_src, int64_t row_bytes, const int32_t *index,
                                 const int32_t *index_host, void *dst, int64_t num_dst_rows);

#ifdef __cplusplus
}
#endif
#endif

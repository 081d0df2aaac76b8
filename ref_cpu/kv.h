/* CPU reference of the paged KV metadata ops (uniprefill/kv.h). */
#ifndef UNIPREFILL_REF_KV_H
#define UNIPREFILL_REF_KV_H

#include "uniprefill/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* slot_mapping (T) = the slot of every token of the batch (T = cu_seqlens[B]). */
upf_status cpu_kv_slot_mapping(const upf_kv_slot_batch *b, int32_t *slot_mapping);
/* dst[index[i], :] = src[i, :], rows of row_bytes. */
upf_status cpu_scatter_rows(const void *src, int64_t num_src, int64_t row_bytes, const int32_t *index,
                            const int32_t *index_host, void *dst, int64_t num_dst_rows);

#ifdef __cplusplus
}
#endif
#endif

/* CUDA CompactAttention ops (plain C header): the block-union table of a chunk and the per-(request,
 * KV head) block tables of the kept blocks (uniprefill/compact_attn.h; the backend entries of ops.def). */
#ifndef UNIPREFILL_CUDA_COMPACT_ATTN_CUH
#define UNIPREFILL_CUDA_COMPACT_ATTN_CUH

#include "uniprefill/compact_attn.h"

#ifdef __cplusplus
extern "C" {
#endif

upf_status upf_cuda_compact_block_union(const upf_sparse_batch *b, int32_t hq, const upf_sparse_params *p,
                                        const upf_sparse_index *index, const upf_compact_params *cp,
                                        const upf_tensor *table, int32_t *counts);
upf_status upf_cuda_compact_block_tables(const upf_attn_paged *batch, const upf_tensor *table, int32_t block_n,
                                         const upf_compact_tables *out);

#ifdef __cplusplus
}
#endif
#endif

/* CPU reference of CompactAttention's ops (SPEC section 9; uniprefill/compact_attn.h): the block-union
 * table of a chunk and the per-(request, KV head) block tables over the paged cache, exact integer logic. */
#ifndef UNIPREFILL_REF_CPU_COMPACT_ATTN_H
#define UNIPREFILL_REF_CPU_COMPACT_ATTN_H

#include "uniprefill/compact_attn.h"

upf_status cpu_compact_block_union(const upf_sparse_batch *b, int32_t hq, const upf_sparse_params *p,
                                   const upf_sparse_index *index, const upf_compact_params *cp,
                                   const upf_tensor *table, int32_t *counts);
upf_status cpu_compact_block_tables(const upf_attn_paged *batch, const upf_tensor *table, int32_t block_n,
                                    const upf_compact_tables *out);

#endif

/* CUDA FlashPrefill V2 (plain C header): block means, the block-sparse index, block-sparse attention
 * (uniprefill/sparse.h; the backend entries of ops.def). */
#ifndef UNIPREFILL_CUDA_SPARSE_CUH
#define UNIPREFILL_CUDA_SPARSE_CUH

#include "uniprefill/sparse.h"

#ifdef __cplusplus
extern "C" {
#endif

upf_status upf_cuda_sparse_block_means(const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v,
                                       const upf_sparse_params *p, const upf_tensor *kbar, const upf_tensor *vbar);
upf_status upf_cuda_sparse_index(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *kbar,
                                 const upf_sparse_params *p, upf_sparse_index *index);
upf_status upf_cuda_attn_block_sparse(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                      const upf_tensor *v, const upf_sparse_params *p, const upf_sparse_index *index,
                                      const upf_tensor *kbar, const upf_tensor *vbar, const upf_tensor *out);

#ifdef __cplusplus
}
#endif
#endif

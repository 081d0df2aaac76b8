/* CPU reference of FlashPrefill V2 (SPEC section 8; uniprefill/sparse.h): block means, the block-sparse
 * index and block-sparse attention with optional mean correction, accumulated in double. */
#ifndef UNIPREFILL_REF_CPU_SPARSE_H
#define UNIPREFILL_REF_CPU_SPARSE_H

#include "uniprefill/sparse.h"

upf_status cpu_sparse_block_means(const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v,
                                  const upf_sparse_params *p, const upf_tensor *kbar, const upf_tensor *vbar);
upf_status cpu_sparse_index(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *kbar,
                            const upf_sparse_params *p, upf_sparse_index *index);
upf_status cpu_attn_block_sparse(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                 const upf_tensor *v, const upf_sparse_params *p, const upf_sparse_index *index,
                                 const upf_tensor *kbar, const upf_tensor *vbar, const upf_tensor *out);

/* The plain loops, one packed row at a time (the oracle of cpu_attn_block_sparse; same checks): the
 * output rounded into out, or, when truth is not NULL, unrounded into truth (Tq, Hq, D) row-major (out
 * is then only shape-checked). */
upf_status ref_attn_block_sparse_naive(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                       const upf_tensor *v, const upf_sparse_params *p,
                                       const upf_sparse_index *index, const upf_tensor *kbar,
                                       const upf_tensor *vbar, const upf_tensor *out, double *truth);

#endif

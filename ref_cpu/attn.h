/* CPU reference of the attention ops: logits, softmax (two passes: max, then sum of exponentials) and
 * the weighted sum of values in double, each output rounded once; the log-sum-exp in the natural log.
 * The products go through cblas_dgemm over blocks of queries (the query heads of one kv head
 * together) against the keys the block can see, so causally or window-masked key ranges are never
 * computed; plain loops over (request, query row, head) remain as the oracle the tests compare it
 * with. The same core serves contiguous K/V and the paged cache (K/V rows located through the block
 * table), and the cache write through the slot mapping. */
#ifndef UNIPREFILL_REF_ATTN_H
#define UNIPREFILL_REF_ATTN_H

#include <stdint.h>

#include "uniprefill/attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entries (host pointers): see backend.h. */
upf_status cpu_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k, const upf_tensor *v,
                            const upf_attn_params *p, const upf_tensor *out, const upf_tensor *lse);
upf_status cpu_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                          const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                          const upf_tensor *lse);
upf_status cpu_kv_cache_write(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping,
                              const int32_t *slot_mapping_host, const upf_tensor *k_cache, const upf_tensor *v_cache);

/* The fp64 truth of the long-reduction rule: the outputs before rounding, truth (Tq, Hq, D) row-major. */
upf_status ref_attn_prefill_f64(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                const upf_tensor *v, const upf_attn_params *p, double *truth);
upf_status ref_attn_paged_f64(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                              const upf_tensor *v_cache, const upf_attn_params *p, double *truth);

/* The naive loops (the oracle of the blocked path; paged attention shares the blocked core, tested
 * equal to contiguous): truth (Tq, Hq, D) row-major; lse (Tq, Hq) f32 or NULL. */
upf_status ref_attn_prefill_naive(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                  const upf_tensor *v, const upf_attn_params *p, double *truth, const upf_tensor *lse);

#ifdef __cplusplus
}
#endif
#endif

/* CPU reference of the logits: for each request's last packed row (logits.last) or for any set of
 * rows (logits.rows), the final RMSNorm (rounded to the hidden dtype, as the LM head reads it), then
 * the LM head GEMM (cblas_sgemm, fp32 accumulation). logits.last rounds once to the logits dtype;
 * logits.rows goes through the rows in chunks of bounded scratch and reduces each f32 row in double:
 * argmax (ties to the lowest id), log-sum-exp (max first, then the sum of exponentials), the target's
 * logit. */
#ifndef UNIPREFILL_REF_LOGITS_H
#define UNIPREFILL_REF_LOGITS_H

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (host pointers): see backend.h. */
upf_status cpu_logits_last(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                           const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                           const upf_tensor *logits);

upf_status cpu_logits_rows(const upf_tensor *hidden, const upf_logits_rows_sel *sel, const upf_tensor *norm_w,
                           const upf_norm_params *p, const upf_tensor *w_lm, const upf_logits_rows_out *out);

/* The reductions of one f32 logits row x (V): argmax (lowest id of the maxima), log-sum-exp in double,
 * and (tlogit not NULL) x[target] as a double, NaN for target -1. */
void ref_logits_row_reduce(const float *x, int64_t V, int32_t target, int32_t *argmax, double *lse, double *tlogit);

#ifdef __cplusplus
}
#endif
#endif

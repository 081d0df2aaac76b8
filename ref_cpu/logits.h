/* CPU reference of the last-token logits: for each request, its last packed row of the final hidden
 * state, the final RMSNorm (rounded to the hidden dtype, as the LM head reads it), then the LM head
 * GEMM (cblas_sgemm, fp32 accumulation), rounded once to the logits dtype. */
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

#ifdef __cplusplus
}
#endif
#endif

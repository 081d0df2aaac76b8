/* CUDA logits: final norm and LM head of each request's last row (logits.last) or of chosen rows with
 * per-row reductions (logits.rows). Plain C header. */
#ifndef UNIPREFILL_CUDA_LOGITS_CUH
#define UNIPREFILL_CUDA_LOGITS_CUH

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (device pointers except cu_seqlens_host): see backend.h. */
upf_status upf_cuda_logits_last(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                                const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                                const upf_tensor *logits);

upf_status upf_cuda_logits_rows(const upf_tensor *hidden, const upf_logits_rows_sel *sel, const upf_tensor *norm_w,
                                const upf_norm_params *p, const upf_tensor *w_lm, const upf_logits_rows_out *out);

#ifdef __cplusplus
}
#endif
#endif

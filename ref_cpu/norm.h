/* CPU reference of RMSNorm: plain (x/rms * w), zero-centred (x/rms * (1 + w)), per-head q/k norm,
 * and the fused residual add then norm. Sums of squares and the scaling in double, each output
 * rounded once to its dtype. */
#ifndef UNIPREFILL_REF_NORM_H
#define UNIPREFILL_REF_NORM_H

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 / sqrt(mean(x^2) + eps) of x (n), in double. */
double ref_rms_inv(const double *x, int64_t n, float eps);
/* The factor that multiplies a normalised element: w, or 1 + w when zero-centred. */
static inline double ref_norm_gain(const upf_norm_params *p, double w) { return p->zero_centred ? 1.0 + w : w; }

/* Backend entries (host pointers): see backend.h. y may be x itself (in place). */
upf_status cpu_rmsnorm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);
upf_status cpu_rmsnorm_add(const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                           const upf_norm_params *p, const upf_tensor *y);
upf_status cpu_qk_norm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

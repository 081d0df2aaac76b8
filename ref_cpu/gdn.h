/* CPU reference of the Gated DeltaNet ops (uniprefill/gdn.h): the causal depthwise conv1d with SiLU
 * (varlen prefill with carried conv states, and the one-token step), the gated delta-rule scan in its
 * plain recurrent form with a double-precision state, and the gated RMSNorm. Each output is rounded
 * once to its dtype; states are stored as f32. */
#ifndef UNIPREFILL_REF_GDN_H
#define UNIPREFILL_REF_GDN_H

#include <stdint.h>

#include "uniprefill/gdn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* g = -exp(a_log) * softplus(a + dt_bias) and beta = sigmoid(b), in double. */
void ref_gdn_gates(double a, double b, double a_log, double dt_bias, double *g, double *beta);
/* x (n) *= 1 / sqrt(sum x^2 + UPF_GDN_L2_EPS). */
void ref_gdn_l2norm(double *x, int64_t n);

/* Backend entries (host pointers): see backend.h. */
upf_status cpu_gdn_conv(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                        const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y);
upf_status cpu_gdn_conv_step(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state, const upf_tensor *y);
upf_status cpu_gdn_scan(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                        const upf_tensor *state_out);
upf_status cpu_gdn_gated_norm(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w, const upf_norm_params *p,
                              const upf_tensor *y);

/* The scan's output o (T, Hv, Dv) in double, not rounded: the fp64 truth of the long-reduction rule. */
upf_status ref_gdn_scan_f64(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, double *o);

/* The same scan in the chunked (WY / UT-transform) form over chunks of `chunk` tokens, all in double: a
 * second reference path (the form the CUDA fast path will take), checked equal to the recurrence.
 * o (T, Hv, Dv) and, when not NULL, state_out (B, Hv, Dk, Dv) in double. */
upf_status ref_gdn_scan_chunked(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, int64_t chunk, double *o,
                                double *state_out);

#ifdef __cplusplus
}
#endif
#endif

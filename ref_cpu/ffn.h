/* CPU reference of the gated FFN: gate/up projection (one GEMM against the fused (H, 2I) weight),
 * the fused activation-and-multiply h = act(gate) * up, and the down projection. SwiGLU (silu) and
 * GeGLU (tanh GELU). The projection outputs and h are stored in the input dtype, as the frameworks
 * store them; the activation itself is taken in double and rounded once. */
#ifndef UNIPREFILL_REF_FFN_H
#define UNIPREFILL_REF_FFN_H

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* act(x) in double. */
double ref_act(upf_act act, double x);

/* Backend entries (host pointers): see backend.h. */
upf_status cpu_ffn_act_mul(const upf_tensor *gate_up, upf_act act, const upf_tensor *h);
upf_status cpu_ffn_gated(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                         const upf_tensor *y);

/* The FFN in double from the stored (dtype-rounded) operands, with no intermediate rounding:
 * y (T, H) = (act(x Wg) * (x Wu)) Wd. The fp64 truth of the long-reduction rule. */
upf_status ref_ffn_f64(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                       double *y);

#ifdef __cplusplus
}
#endif
#endif

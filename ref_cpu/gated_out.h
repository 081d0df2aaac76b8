/* CPU reference of the gated attention output (Qwen3-Next): y = o * sigmoid(gate), where the gate
 * is the second half of each head's q_proj output (so usually a strided view). */
#ifndef UNIPREFILL_REF_GATED_OUT_H
#define UNIPREFILL_REF_GATED_OUT_H

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (host pointers): see backend.h. y may be o itself. */
upf_status cpu_gated_output(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

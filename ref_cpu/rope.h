/* CPU reference of rotary position embedding at arbitrary (original, possibly gapped) positions:
 * neox rotate-half within the first rotary_dim dims of each head, frequencies from
 * upf_rope_inv_freq (default, linear, llama3), angles, sines, cosines and the rotation in double. */
#ifndef UNIPREFILL_REF_ROPE_H
#define UNIPREFILL_REF_ROPE_H

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rotates one head row x (rot dims used of it) in double: x[i], x[i+rot/2] by pos * inv_freq[i]. */
void ref_rope_row(double *x, int32_t rot, const double *inv_freq, int64_t pos);

/* Backend entry (host pointers): see backend.h. q and k are rotated in place; k may be NULL. */
upf_status cpu_rope(const upf_tensor *q, const upf_tensor *k, const int32_t *positions, const upf_rope_params *p);

#ifdef __cplusplus
}
#endif
#endif

/* CPU reference of the embedding lookup: y[t, :] = table[ids[t], :] * scale (Gemma-3 scales by
 * sqrt(hidden); the others pass 1), rounded once to the table's dtype. */
#ifndef UNIPREFILL_REF_EMBED_H
#define UNIPREFILL_REF_EMBED_H

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (host pointers): see backend.h. Every id must be in [0, V): UPF_ERR_INVALID_ARG
 * naming the first bad one, before anything is written. */
upf_status cpu_embed(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                     const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

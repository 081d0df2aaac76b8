/* CUDA embedding lookup, y = table[ids] * scale (plain C header). */
#ifndef UNIPREFILL_CUDA_EMBED_CUH
#define UNIPREFILL_CUDA_EMBED_CUH

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (device pointers): see backend.h. The ids are range-checked on the device before
 * anything is written (one small device-to-host read), so a bad id gives UPF_ERR_INVALID_ARG naming
 * the first bad position, as the CPU reference does. */
upf_status upf_cuda_embed(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                          const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

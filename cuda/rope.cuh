/* CUDA rotary position embedding at arbitrary positions (plain C header). */
#ifndef UNIPREFILL_CUDA_ROPE_CUH
#define UNIPREFILL_CUDA_ROPE_CUH

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest rotary_dim the CUDA kernel takes (its inverse frequencies travel as a kernel parameter);
 * larger ones give UPF_ERR_UNSUPPORTED. Every model here rotates at most 256 dims. */
#define UPF_CUDA_ROPE_MAX_ROT 512

/* Backend entry (device pointers): see backend.h. */
upf_status upf_cuda_rope(const upf_tensor *q, const upf_tensor *k, const int32_t *positions,
                         const upf_rope_params *p);

#ifdef __cplusplus
}
#endif
#endif

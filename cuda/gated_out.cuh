/* CUDA gated attention output, y = o * sigmoid(gate) (Qwen3-Next; plain C header). */
#ifndef UNIPREFILL_CUDA_GATED_OUT_CUH
#define UNIPREFILL_CUDA_GATED_OUT_CUH

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entry (device pointers): see backend.h. */
upf_status upf_cuda_gated_output(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

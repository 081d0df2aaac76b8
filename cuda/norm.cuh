/* CUDA RMSNorm family (plain C header): plain and zero-centred RMSNorm, the fused residual add then
 * norm, the per-head q/k norm, and the row-gathering form the last-token logits use. */
#ifndef UNIPREFILL_CUDA_NORM_CUH
#define UNIPREFILL_CUDA_NORM_CUH

#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entries (device pointers): see backend.h. */
upf_status upf_cuda_rmsnorm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);
upf_status upf_cuda_rmsnorm_add(const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                                const upf_norm_params *p, const upf_tensor *y);
upf_status upf_cuda_qk_norm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);

/* y (R, N) contiguous = rmsnorm of rows row_index[r] of x (token stride x_stride) with w (N), all in
 * dtype (device pointers; row_index (R) int32 in device memory). For logits.last. */
upf_status upf_cuda_rmsnorm_gather(const void *x, int64_t x_stride, const int32_t *row_index, int64_t rows, int64_t n,
                                   const void *w, const upf_norm_params *p, upf_dtype dtype, void *y);

#ifdef __cplusplus
}
#endif
#endif

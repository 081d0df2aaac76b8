/* CUDA Gated DeltaNet ops (plain C header): the causal depthwise conv1d with SiLU (varlen prefill
 * and the one-token step), the recurrent gated delta-rule scan, and the gated RMSNorm. */
#ifndef UNIPREFILL_CUDA_GDN_CUH
#define UNIPREFILL_CUDA_GDN_CUH

#include <stdint.h>

#include "uniprefill/gdn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Backend entries (device pointers; batch->cu_seqlens_host on the host): see backend.h. */
upf_status upf_cuda_gdn_conv(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                             const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y);
upf_status upf_cuda_gdn_conv_step(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state,
                                  const upf_tensor *y);
upf_status upf_cuda_gdn_scan(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                             const upf_tensor *state_out);
upf_status upf_cuda_gdn_gated_norm(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w,
                                   const upf_norm_params *p, const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

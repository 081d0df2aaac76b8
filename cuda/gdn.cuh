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
/* The scan's two CUDA forms. upf_cuda_gdn_scan takes the chunked tensor-core form (cuda/gdn_chunked.cu)
 * when it fits (bf16 inputs, Dk = Dv = 128) and some request has at least UPF_GDN_CHUNKED_MIN_TOKENS
 * tokens, else the recurrent kernel (decode rows, f32 inputs, other head sizes); under the gdn.scan
 * variant "recurrent" (uniprefill/variant.h) it takes the recurrent kernel for every batch. */
#define UPF_GDN_CHUNKED_MIN_TOKENS 64
int upf_cuda_gdn_scan_chunked_fits(const upf_gdn_scan_inputs *in);
/* The chunked form alone (shapes already checked by upf_gdn_scan_check; fits must hold). */
upf_status upf_cuda_gdn_scan_chunked(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                                     const upf_tensor *state_out);
upf_status upf_cuda_gdn_gated_norm(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w,
                                   const upf_norm_params *p, const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

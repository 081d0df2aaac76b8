/* The backend ops table. layers/, models/, verify/ and perf/ are written once against this table,
 * so the same code runs on the CPU reference and on CUDA and can be compared whole. Every pointer
 * an entry takes lives in that backend's memory (host for cpu, device for cuda). */
#ifndef UNIPREFILL_BACKEND_H
#define UNIPREFILL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/select.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct upf_backend {
  const char *name; /* "cpu", "cuda" */

  /* UPF_OK when usable here; otherwise UPF_ERR_NO_DEVICE / UPF_ERR_UNSUPPORTED with the reason. */
  upf_status (*probe)(void);
  /* One line naming the device ("NVIDIA H200, driver 580.x, CUDA 13.0"), "" if unknown. */
  const char *(*describe)(void);

  upf_status (*alloc)(void **ptr, size_t bytes);
  void (*release)(void *ptr);
  upf_status (*upload)(void *dst, const void *src, size_t bytes);   /* host -> backend */
  upf_status (*download)(void *dst, const void *src, size_t bytes); /* backend -> host */
  upf_status (*fill)(void *dst, int byte, size_t bytes);
  upf_status (*synchronize)(void);

  /* Stage 1. scores: one (Hq, L, n_r) slab per scored request at upf_select_score_offsets. */
  upf_status (*select_part_gemm)(const upf_select_inputs *in, const upf_select_params *params,
                                 float *scores);
  /* Stage 2. token_mass (T): sum over heads and the L rows of the row-softmaxed scores; 0 for
   * tokens of requests that are not scored. Only in->cu_seqlens*, num_reqs and q's Hq are read. */
  upf_status (*select_block_softmax)(const upf_select_inputs *in, const upf_select_params *params,
                                     const float *scores, float *token_mass);
  /* Stage 3. block_score (num_blocks) from token_mass (T); 0 for requests that are not scored. */
  upf_status (*select_block_reduce)(const upf_select_inputs *in, const upf_select_params *params,
                                    const float *token_mass, float *block_score);
  /* Stage 4. block_mask (num_blocks) from block_score; all 1 for requests that are not scored.
   * Fails with UPF_ERR_NONFINITE if a scored request has a NaN/Inf block score. */
  upf_status (*select_topp)(const upf_select_inputs *in, const upf_select_params *params,
                            const float *block_score, uint8_t *block_mask);
  /* Mask expansion: token_mask, kept_index, new_cu_seqlens, kept_count and kept_total from the
   * block mask (out->block_score/block_mask are not touched). */
  upf_status (*select_expand)(const upf_select_inputs *in, const upf_select_params *params,
                              const uint8_t *block_mask, upf_select_outputs *out);
  /* The whole selection (stages 1-4 fused as the backend sees fit, then expansion). Fills every
   * non-NULL array of `out`. Validates inputs; UPF_ERR_NONFINITE when q or k hold NaN/Inf. */
  upf_status (*select_run)(const upf_select_inputs *in, const upf_select_params *params,
                           upf_select_outputs *out);
  /* dst[i, :] = src[kept_index[i], :] for i < kept_total; rows of row_bytes bytes. */
  upf_status (*compact_rows)(const void *src, int64_t num_rows, int64_t row_bytes,
                             const int32_t *kept_index, int64_t kept_total, void *dst);
} upf_backend;

const upf_backend *upf_backend_cpu(void);
/* Always returns the table; in a CUDA=0 build every entry fails with UPF_ERR_UNSUPPORTED.
 * Setting UPF_BACKENDS=cpu in the environment makes probe() fail without touching CUDA. */
const upf_backend *upf_backend_cuda(void);
/* "cpu" or "cuda"; NULL (with a message) for anything else. */
const upf_backend *upf_backend_by_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif

/* CUDA last-token logits.
 *
 *   1. the B last-row indices (cu[r+1] - 1, from the host cu_seqlens) go up through pinned staging;
 *   2. rms_rows_kernel in gather mode normalises those rows into a (B, H) workspace in the hidden
 *      dtype (what the LM head reads, as in the frameworks);
 *   3. one cublasGemmEx, (B, H) . (H, V), fp32 accumulation, f32 or bf16 logits.
 * With B rows the GEMM is a weight stream: V * H elements read once (Llama-3.1: 1.05 GB in bf16,
 * 0.22 ms at 4.8 TB/s), which is why only the last token of each request goes through it. */
#include <stdlib.h>

#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/gemm.cuh"
#include "cuda/logits.cuh"
#include "cuda/norm.cuh"

extern "C" upf_status upf_cuda_logits_last(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                                           const upf_tensor *norm_w, const upf_norm_params *p,
                                           const upf_tensor *w_lm, const upf_tensor *logits) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_logits_last_check(hidden, cu_seqlens_host, num_reqs, norm_w, p, w_lm, logits));
  int64_t B = num_reqs, H = hidden->shape[1], V = w_lm->shape[1];
  upf_dtype dt = hidden->dtype;
  size_t idx_bytes = ((size_t)B * sizeof(int32_t) + 255) & ~(size_t)255;
  size_t rows_bytes = (size_t)(B * H) * upf_dtype_size(dt);
  int32_t *idx = (int32_t *)malloc((size_t)B * sizeof(int32_t));
  if (!idx)
    return upf_fail(UPF_ERR_NOMEM, "logits.last (cuda): row index of %lld requests", (long long)B);
  for (int64_t r = 0; r < B; r++)
    idx[r] = cu_seqlens_host[r + 1] - 1;
  void *ws = nullptr;
  upf_status st = upf_cuda_workspace(idx_bytes + rows_bytes, &ws);
  if (st == UPF_OK)
    st = upf_cuda_upload_async(ws, idx, (size_t)B * sizeof(int32_t));
  free(idx);
  UPF_TRY(st);
  void *rows = (char *)ws + idx_bytes;
  UPF_TRY(upf_cuda_rmsnorm_gather(hidden->data, hidden->stride[0], (const int32_t *)ws, B, H, norm_w->data, p, dt,
                                  rows));
  return upf_cuda_gemm_raw(rows, H, w_lm->data, w_lm->stride[0], logits->data, logits->stride[0], B, H, V, dt,
                           logits->dtype);
}

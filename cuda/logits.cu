/* CUDA logits: logits.last and logits.rows.
 *
 *   1. the B last-row indices (cu[r+1] - 1, from the host cu_seqlens) go up through pinned staging;
 *   2. rms_rows_kernel in gather mode normalises those rows into a (B, H) workspace in the hidden
 *      dtype (what the LM head reads, as in the frameworks);
 *   3. one cublasGemmEx, (B, H) . (H, V), fp32 accumulation, f32 or bf16 logits.
 * With B rows the GEMM is a weight stream: V * H elements read once (Llama-3.1: 1.05 GB in bf16,
 * 0.22 ms at 4.8 TB/s), which is why only the last token of each request goes through it.
 *
 * logits.rows: the chosen rows are normalised the same way (gather mode, all R rows at once), then
 * the LM head runs over chunks of rows into a bounded f32 scratch (256 MB: 256 rows of Gemma-3's
 * 262144 logits), and reduce_rows_kernel reduces each row of the chunk (one CTA a row): argmax with
 * ties to the lowest id, log-sum-exp and the target's logit in double, in a fixed order (no atomics),
 * so the results do not depend on the run. Rows of full_host are copied out of the chunk. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

namespace {

constexpr int kReduceThreads = 256;
constexpr int64_t kChunkFloats = (int64_t)64 << 20; /* 256 MB of f32 logits a chunk */

/* (value, id) pairs: the larger value wins, the lower id on equal values. */
__device__ __forceinline__ void better(float &v, int &i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i))
    v = v2, i = i2;
}

/* One CTA per row of x (rows, V): argmax[r], lse[r] and (target != NULL) tlogit[r]. */
__global__ void reduce_rows_kernel(const float *__restrict__ x, int64_t V, const int32_t *__restrict__ target,
                                   int32_t *__restrict__ argmax, double *__restrict__ lse, double *__restrict__ tlogit) {
  __shared__ float s_val[kReduceThreads / 32];
  __shared__ int s_idx[kReduceThreads / 32];
  __shared__ double s_sum[kReduceThreads / 32];
  __shared__ float s_max;
  const float *row = x + (int64_t)blockIdx.x * V;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  /* each thread's maximum over its strided ids: ascending, so strict > keeps its lowest id; NaN never
   * wins (as on the CPU); a row of -inf gives id 0 */
  float v = -INFINITY;
  int idx = INT_MAX;
  for (int64_t j = tid; j < V; j += kReduceThreads) {
    const float y = row[j];
    if (y > v || (idx == INT_MAX && y == v))
      v = y, idx = (int)j;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float v2 = __shfl_down_sync(0xffffffffu, v, off);
    const int i2 = __shfl_down_sync(0xffffffffu, idx, off);
    better(v, idx, v2, i2);
  }
  if (lane == 0)
    s_val[warp] = v, s_idx[warp] = idx;
  __syncthreads();
  if (tid == 0) {
    float bv = s_val[0];
    int bi = s_idx[0];
    for (int w = 1; w < kReduceThreads / 32; w++)
      better(bv, bi, s_val[w], s_idx[w]);
    s_max = bv;
    argmax[blockIdx.x] = bi == INT_MAX ? 0 : bi;
  }
  __syncthreads();
  const double m = (double)s_max;
  double sum = 0.0;
  for (int64_t j = tid; j < V; j += kReduceThreads)
    sum += exp((double)row[j] - m);
  for (int off = 16; off > 0; off >>= 1)
    sum += __shfl_down_sync(0xffffffffu, sum, off);
  if (lane == 0)
    s_sum[warp] = sum;
  __syncthreads();
  if (tid == 0) {
    double total = 0.0;
    for (int w = 0; w < kReduceThreads / 32; w++)
      total += s_sum[w];
    lse[blockIdx.x] = m + log(total);
    if (target)
      tlogit[blockIdx.x] = target[blockIdx.x] >= 0 ? (double)row[target[blockIdx.x]] : (double)NAN;
  }
}

} // namespace

extern "C" upf_status upf_cuda_logits_rows(const upf_tensor *hidden, const upf_logits_rows_sel *sel,
                                           const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                                           const upf_logits_rows_out *out) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_logits_rows_check(hidden, sel, norm_w, p, w_lm, out));
  const int64_t R = sel->num_rows, H = hidden->shape[1], V = w_lm->shape[1];
  if (R == 0)
    return UPF_OK;
  const upf_dtype dt = hidden->dtype;
  int64_t chunk = kChunkFloats / V;
  chunk = chunk < 1 ? 1 : chunk > R ? R : chunk;
  const size_t idx_bytes = ((size_t)R * sizeof(int32_t) + 255) & ~(size_t)255;
  const size_t tgt_bytes = sel->targets_host ? idx_bytes : 0;
  const size_t rows_bytes = (((size_t)(R * H) * upf_dtype_size(dt)) + 255) & ~(size_t)255;
  void *ws = nullptr;
  UPF_TRY(upf_cuda_workspace(idx_bytes + tgt_bytes + rows_bytes + (size_t)(chunk * V) * sizeof(float), &ws));
  int32_t *d_idx = (int32_t *)ws, *d_tgt = sel->targets_host ? (int32_t *)((char *)ws + idx_bytes) : nullptr;
  void *rows = (char *)ws + idx_bytes + tgt_bytes;
  float *scratch = (float *)((char *)rows + rows_bytes);
  UPF_TRY(upf_cuda_upload_async(d_idx, sel->rows_host, (size_t)R * sizeof(int32_t)));
  if (d_tgt)
    UPF_TRY(upf_cuda_upload_async(d_tgt, sel->targets_host, (size_t)R * sizeof(int32_t)));
  UPF_TRY(upf_cuda_rmsnorm_gather(hidden->data, hidden->stride[0], d_idx, R, H, norm_w->data, p, dt, rows));
  cudaStream_t stream = upf_cuda_stream();
  for (int64_t c0 = 0; c0 < R; c0 += chunk) {
    const int64_t n = R - c0 < chunk ? R - c0 : chunk;
    UPF_TRY(upf_cuda_gemm_raw((const char *)rows + (size_t)(c0 * H) * upf_dtype_size(dt), H, w_lm->data,
                              w_lm->stride[0], scratch, V, n, H, V, dt, UPF_DTYPE_F32));
    reduce_rows_kernel<<<(unsigned)n, kReduceThreads, 0, stream>>>(scratch, V, d_tgt ? d_tgt + c0 : nullptr,
                                                                    out->argmax + c0, out->lse + c0,
                                                                    d_tgt ? out->target + c0 : nullptr);
    UPF_CUDA_LAUNCH_TRY("reduce_rows_kernel");
    for (int64_t f = 0; f < sel->num_full; f++)
      if (sel->full_host[f] >= c0 && sel->full_host[f] < c0 + n)
        UPF_CUDA_TRY(cudaMemcpyAsync(out->full + f * V, scratch + (sel->full_host[f] - c0) * V,
                                     (size_t)V * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
  return UPF_OK;
}

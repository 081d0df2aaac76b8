/* CUDA embedding lookup.
 *
 * embed_check_kernel: one thread per id; the first position outside [0, V) wins an integer atomicMin
 *                     (no floats involved, so the reported position is deterministic).
 * embed_kernel<T, VEC>: a group of TPR threads per token row (TPR the power of two covering H/VEC,
 *                     at most 256), 16-byte vectors; y = table[id] * scale in fp32, rounded once
 *                     (scale 1 copies the bits).
 * Memory-bound: 2 * T * H elements moved (table rows read once each time they are named). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/embed.cuh"
#include "cuda/dense_vec.inc"

namespace {

__global__ void embed_check_kernel(const int32_t *__restrict__ ids, // (T)
                                   int64_t T, int64_t V, unsigned long long *__restrict__ first_bad) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < T && (ids[i] < 0 || (int64_t)ids[i] >= V))
    atomicMin(first_bad, (unsigned long long)i);
}

struct embed_args {
  const int32_t *ids;
  const void *table;
  int64_t t_s0;
  void *y;
  int64_t y_s0;
  int64_t rows, h;
  float scale;
  int tpr;
};

template <typename T, int VEC> __global__ void embed_kernel(const embed_args a) {
  const int rows_per_cta = blockDim.x / a.tpr;
  const int64_t row = (int64_t)blockIdx.x * rows_per_cta + threadIdx.x / a.tpr;
  if (row >= a.rows)
    return;
  const T *src = (const T *)a.table + (int64_t)a.ids[row] * a.t_s0;
  T *dst = (T *)a.y + row * a.y_s0;
  for (int64_t v = threadIdx.x % a.tpr; v < a.h / VEC; v += a.tpr) {
    float x[VEC];
    load_vec<VEC>(src + v * VEC, x);
#pragma unroll
    for (int i = 0; i < VEC; i++)
      x[i] *= a.scale;
    store_vec<VEC>(dst + v * VEC, x);
  }
}

template <typename T, int VEC> upf_status launch_embed(embed_args a, cudaStream_t stream) {
  a.tpr = pow2_at_least(a.h / VEC, 256);
  int rows_per_cta = 256 / a.tpr;
  int64_t grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "embed (cuda): %lld rows exceed the grid", (long long)a.rows);
  embed_kernel<T, VEC><<<(unsigned)grid, 256, 0, stream>>>(a);
  UPF_CUDA_LAUNCH_TRY("embed_kernel");
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_embed(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                                     const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_embed_check(ids, num_tokens, table, scale, y));
  int64_t V = table->shape[0], H = table->shape[1];
  if (num_tokens == 0)
    return UPF_OK;
  cudaStream_t stream = upf_cuda_stream();
  void *ws;
  UPF_TRY(upf_cuda_workspace(sizeof(unsigned long long), &ws));
  unsigned long long *first_bad = (unsigned long long *)ws;
  UPF_CUDA_TRY(cudaMemsetAsync(first_bad, 0xFF, sizeof *first_bad, stream));
  int64_t check_grid = (num_tokens + 255) / 256;
  if (check_grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "embed (cuda): %lld tokens exceed the grid", (long long)num_tokens);
  embed_check_kernel<<<(unsigned)check_grid, 256, 0, stream>>>(ids, num_tokens, V, first_bad);
  UPF_CUDA_LAUNCH_TRY("embed_check_kernel");
  unsigned long long bad = 0;
  UPF_TRY(upf_cuda_download_small(&bad, first_bad, sizeof bad));
  if (bad != ~0ull) {
    int32_t value = 0;
    UPF_TRY(upf_cuda_download_small(&value, ids + bad, sizeof value));
    return upf_fail(UPF_ERR_INVALID_ARG, "embed: ids[%lld]=%d outside [0, V=%lld)", (long long)bad, value,
                    (long long)V);
  }
  if (H == 0)
    return UPF_OK;
  embed_args a = {};
  a.ids = ids, a.table = table->data, a.t_s0 = table->stride[0], a.y = y->data, a.y_s0 = y->stride[0];
  a.rows = num_tokens, a.h = H, a.scale = scale;
  const void *ptrs[2] = {a.table, a.y};
  const int64_t strides[3] = {a.t_s0, a.y_s0, H};
  if (table->dtype == UPF_DTYPE_BF16) {
    if (vec_ok(vec16<bf16_t>::n, ptrs, 2, strides, 3))
      return launch_embed<bf16_t, vec16<bf16_t>::n>(a, stream);
    return launch_embed<bf16_t, 1>(a, stream);
  }
  if (vec_ok(vec16<float>::n, ptrs, 2, strides, 3))
    return launch_embed<float, vec16<float>::n>(a, stream);
  return launch_embed<float, 1>(a, stream);
}

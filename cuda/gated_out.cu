/* CUDA gated attention output.
 *
 * gated_kernel<T, VEC>: a group of TPR threads per (token, head) row of D elements (TPR the power of
 * two covering D/VEC, at most 256; 256/TPR rows per CTA), 16-byte vectors of o, gate and y;
 * y = o / (1 + expf(-gate)) in fp32, rounded once. The gate is usually the second half of each
 * head's q_proj output, a view with head stride 2D: the kernel takes any strides.
 * Memory-bound: 3 * T * H * D elements moved; the floor at T = 8K, Qwen3-Next's 16 x 256, bf16 is
 * 201 MB / 4.8 TB/s = 42 us. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/gated_out.cuh"
#include "cuda/dense_vec.inc"

namespace {

struct gated_args {
  const void *o;
  int64_t o_s0, o_s1;
  const void *g;
  int64_t g_s0, g_s1;
  void *y;
  int64_t y_s0, y_s1;
  int64_t rows, heads, d;
  int tpr;
};

template <typename T, int VEC> __global__ void gated_kernel(const gated_args a) {
  const int rows_per_cta = blockDim.x / a.tpr;
  const int64_t row = (int64_t)blockIdx.x * rows_per_cta + threadIdx.x / a.tpr;
  if (row >= a.rows)
    return;
  const int64_t t = row / a.heads, h = row - t * a.heads;
  const T *o = (const T *)a.o + t * a.o_s0 + h * a.o_s1;
  const T *g = (const T *)a.g + t * a.g_s0 + h * a.g_s1;
  T *y = (T *)a.y + t * a.y_s0 + h * a.y_s1;
  for (int64_t v = threadIdx.x % a.tpr; v < a.d / VEC; v += a.tpr) {
    float ov[VEC], gv[VEC], r[VEC];
    load_vec<VEC>(o + v * VEC, ov);
    load_vec<VEC>(g + v * VEC, gv);
#pragma unroll
    for (int i = 0; i < VEC; i++)
      r[i] = ov[i] / (1.0f + expf(-gv[i]));
    store_vec<VEC>(y + v * VEC, r);
  }
}

template <typename T, int VEC> upf_status launch_gated(gated_args a, cudaStream_t stream) {
  a.tpr = pow2_at_least(a.d / VEC, 256);
  int rows_per_cta = 256 / a.tpr;
  int64_t grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn.gated_output (cuda): %lld rows exceed the grid", (long long)a.rows);
  gated_kernel<T, VEC><<<(unsigned)grid, 256, 0, stream>>>(a);
  UPF_CUDA_LAUNCH_TRY("gated_kernel");
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_gated_output(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gated_output_check(o, gate, y));
  gated_args a = {};
  a.o = o->data, a.o_s0 = o->stride[0], a.o_s1 = o->stride[1];
  a.g = gate->data, a.g_s0 = gate->stride[0], a.g_s1 = gate->stride[1];
  a.y = y->data, a.y_s0 = y->stride[0], a.y_s1 = y->stride[1];
  a.heads = o->shape[1], a.rows = o->shape[0] * o->shape[1], a.d = o->shape[2];
  if (a.rows == 0 || a.d == 0)
    return UPF_OK;
  cudaStream_t stream = upf_cuda_stream();
  const void *ptrs[3] = {a.o, a.g, a.y};
  const int64_t strides[7] = {a.o_s0, a.o_s1, a.g_s0, a.g_s1, a.y_s0, a.y_s1, a.d};
  if (o->dtype == UPF_DTYPE_BF16) {
    if (vec_ok(vec16<bf16_t>::n, ptrs, 3, strides, 7))
      return launch_gated<bf16_t, vec16<bf16_t>::n>(a, stream);
    return launch_gated<bf16_t, 1>(a, stream);
  }
  if (vec_ok(vec16<float>::n, ptrs, 3, strides, 7))
    return launch_gated<float, vec16<float>::n>(a, stream);
  return launch_gated<float, 1>(a, stream);
}

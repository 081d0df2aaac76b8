/* CUDA RoPE, neox rotate-half, in place on q and k views (a fused qkv buffer is fine).
 *
 * rope_kernel<T, VEC>: one CTA per token (a thread per (head, 16-byte slice) up to 256). The
 * rotary_dim/2 inverse frequencies come from upf_rope_inv_freq on the host (double, the llama3 and
 * linear rules included) as a kernel parameter. Each thread issues the loads of its first slice,
 * then the CTA takes sincos(position * inv_freq[i]) in double, once per token for all heads, into
 * shared memory as fp32 (an fp32 angle would be off by up to ulp(131072) = 0.008 rad at
 * 128K positions; the double path gives the CPU reference's cos/sin to the last fp32 bit), then
 * rotates (x[i], x[i + rot/2]) pairs of every q and k head: 16-byte vectors of both halves, fp32
 * math, rounded once. Dims at and after rotary_dim are not read or written.
 * Memory-bound: per token (Hq + Hkv) * rot elements read and written; the floor for Llama at
 * T = 8K bf16 is 8K * 40 * 128 * 2 * 2 = 168 MB / 4.8 TB/s = 35 us. The double sincos costs about a
 * tenth of a token's memory time and overlaps with other CTAs' loads. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/rope.cuh"
#include "cuda/dense_vec.inc"

namespace {

struct rope_args {
  void *q;                 /* head rows at t * q_s0 + h * q_s1 */
  int64_t q_s0, q_s1;
  void *k;                 /* NULL when only q is rotated */
  int64_t k_s0, k_s1;
  const int32_t *pos;      /* (T) */
  int hq, hkv, half;
  double inv_freq[UPF_CUDA_ROPE_MAX_ROT / 2];
};

/* Head row of work item w (a head and a VEC-slice j of its first half). */
template <typename T>
__device__ __forceinline__ T *rope_item(const rope_args &a, int64_t t, int w, int vph, int vec, int *j) {
  const int head = w / vph;
  *j = (w - head * vph) * vec;
  return head < a.hq ? (T *)a.q + t * a.q_s0 + (int64_t)head * a.q_s1
                     : (T *)a.k + t * a.k_s0 + (int64_t)(head - a.hq) * a.k_s1;
}

template <typename T, int VEC> __global__ void rope_kernel(const __grid_constant__ rope_args a) {
  extern __shared__ float cs[]; /* [half] cos, [half] sin */
  const int64_t t = blockIdx.x;
  const int vph = a.half / VEC, items = (a.hq + a.hkv) * vph;
  /* The first item's loads go out before the double-precision sincos, to overlap its latency. */
  float x1[VEC], x2[VEC];
  int j = 0;
  T *base = nullptr;
  if ((int)threadIdx.x < items) {
    base = rope_item<T>(a, t, threadIdx.x, vph, VEC, &j);
    load_vec<VEC>(base + j, x1);
    load_vec<VEC>(base + a.half + j, x2);
  }
  const double p = (double)a.pos[t];
  for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
    double s, c;
    sincos(p * a.inv_freq[i], &s, &c);
    cs[i] = (float)c;
    cs[a.half + i] = (float)s;
  }
  __syncthreads();
  for (int w = threadIdx.x; w < items; w += blockDim.x) {
    if (w != (int)threadIdx.x) {
      base = rope_item<T>(a, t, w, vph, VEC, &j);
      load_vec<VEC>(base + j, x1);
      load_vec<VEC>(base + a.half + j, x2);
    }
    float o1[VEC], o2[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i++) {
      const float c = cs[j + i], s = cs[a.half + j + i];
      o1[i] = x1[i] * c - x2[i] * s;
      o2[i] = x2[i] * c + x1[i] * s;
    }
    store_vec<VEC>(base + j, o1);
    store_vec<VEC>(base + a.half + j, o2);
  }
}

template <typename T, int VEC> upf_status launch_rope(const rope_args &a, int64_t T_, cudaStream_t stream) {
  if (T_ > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "rope (cuda): T=%lld exceeds the grid", (long long)T_);
  size_t smem = 2 * (size_t)a.half * sizeof(float);
  /* A thread per work item up to 256 (Llama: 40 heads x 8 vectors = 320 items), at least 64. */
  int items = (a.hq + a.hkv) * (a.half / VEC);
  int block = (items + 31) / 32 * 32;
  block = block < 64 ? 64 : block > 256 ? 256 : block;
  rope_kernel<T, VEC><<<(unsigned)T_, block, smem, stream>>>(a);
  UPF_CUDA_LAUNCH_TRY("rope_kernel");
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_rope(const upf_tensor *q, const upf_tensor *k, const int32_t *positions,
                                    const upf_rope_params *p) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_rope_check(q, k, positions, p));
  int64_t T = q->shape[0], D = q->shape[2];
  int32_t rot = upf_rope_rotary_dim(p, D);
  if (rot > UPF_CUDA_ROPE_MAX_ROT)
    return upf_fail(UPF_ERR_UNSUPPORTED, "rope (cuda): rotary_dim=%d above the kernel's %d", rot,
                    UPF_CUDA_ROPE_MAX_ROT);
  if (T == 0)
    return UPF_OK;
  rope_args local = {}; /* about 2 KB with the frequencies: within the 4 KB kernel-parameter limit */
  local.q = q->data, local.q_s0 = q->stride[0], local.q_s1 = q->stride[1], local.hq = (int)q->shape[1];
  if (k)
    local.k = k->data, local.k_s0 = k->stride[0], local.k_s1 = k->stride[1], local.hkv = (int)k->shape[1];
  local.pos = positions;
  local.half = rot / 2;
  upf_rope_inv_freq(p, rot, local.inv_freq);
  cudaStream_t stream = upf_cuda_stream();
  const void *ptrs[2] = {q->data, k ? k->data : nullptr};
  const int64_t strides[5] = {q->stride[0], q->stride[1], k ? k->stride[0] : 0, k ? k->stride[1] : 0, local.half};
  if (q->dtype == UPF_DTYPE_BF16) {
    if (vec_ok(vec16<bf16_t>::n, ptrs, 2, strides, 5))
      return launch_rope<bf16_t, vec16<bf16_t>::n>(local, T, stream);
    return launch_rope<bf16_t, 1>(local, T, stream);
  }
  if (vec_ok(vec16<float>::n, ptrs, 2, strides, 5))
    return launch_rope<float, vec16<float>::n>(local, T, stream);
  return launch_rope<float, 1>(local, T, stream);
}

/* CUDA RoPE, neox rotate-half, in place on q and k views (a fused qkv buffer is fine).
 *
 * rope_kernel<T, VEC>: a CTA of 256 threads takes `tpc` consecutive tokens, enough that their work
 * items (a head and a VEC-slice j of its first half: (Hq + Hkv) * rot/2/VEC a token) give every
 * thread up to ITEMS of them (Llama: 320 items a token, 3 tokens a CTA; Qwen3-Next partial: 72 a
 * token, 14 tokens). Each thread issues the loads of all its items (x[j..], x[j + rot/2..], 16-byte
 * vectors) first; then the CTA takes sincos(position * inv_freq[i]) in double for its tokens, into
 * shared memory as fp32 (an fp32 angle would be off by up to ulp(131072) = 0.008 rad at 128K
 * positions; the double path gives the CPU reference's cos/sin to the last fp32 bit), while those
 * loads are in flight; then rotates each pair in fp32 and rounds once. Dims at and after rotary_dim
 * are not read or written: the op is in place, so the untouched 75% of a Qwen3-Next head never moves.
 * The inverse frequencies come from upf_rope_inv_freq on the host (double, the llama3 and linear
 * rules included) as a kernel parameter.
 * Memory-bound: per token (Hq + Hkv) * rot elements read and written; the floor for Llama at
 * T = 8K bf16 is 8K * 40 * 128 * 2 * 2 = 168 MB / 4.2 TB/s = 40 us; Qwen3-Next partial at 32K,
 * 32K * 18 * 64 * 2 * 2 = 151 MB: 36 us. */
#include <algorithm>

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

constexpr int ROPE_THREADS = 256;
constexpr int ROPE_ITEMS = 4;                  /* work items a thread loads before the sincos */
constexpr int ROPE_MAX_TOKENS = 64;            /* tokens a CTA */
constexpr size_t ROPE_SMEM_BYTES = 16 * 1024;  /* the CTA's cos/sin table */

/* Rotates the pair (v1, v2) of flat item f of the CTA (tokens from t0) by its token's cos/sin in
 * cs and stores it in place, rounded once. */
template <typename T, int VEC>
__device__ __forceinline__ void rotate_item(const rope_args &a, int64_t t0, int f, int ipt, int vph, const float *cs,
                                            const float (&v1)[VEC], const float (&v2)[VEC]) {
  int j;
  T *base = rope_item<T>(a, t0 + f / ipt, f % ipt, vph, VEC, &j);
  const float *c = cs + (f / ipt) * 2 * a.half + j, *s = c + a.half;
  float o1[VEC], o2[VEC];
#pragma unroll
  for (int i = 0; i < VEC; i++) {
    o1[i] = v1[i] * c[i] - v2[i] * s[i];
    o2[i] = v2[i] * c[i] + v1[i] * s[i];
  }
  store_vec<VEC>(base + j, o1);
  store_vec<VEC>(base + a.half + j, o2);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(ROPE_THREADS) rope_kernel(const __grid_constant__ rope_args a, int64_t T_,
                                                          int tpc) {
  extern __shared__ float cs[]; /* per token of the CTA: [half] cos, [half] sin */
  const int vph = a.half / VEC, ipt = (a.hq + a.hkv) * vph;
  const int64_t t0 = (int64_t)blockIdx.x * tpc;
  const int tokens = (int)(T_ - t0 < tpc ? T_ - t0 : tpc);
  const int items = tokens * ipt; /* flat index f: token f / ipt, item f % ipt */
  packed_vec<T, VEC> x1[ROPE_ITEMS], x2[ROPE_ITEMS];
#pragma unroll
  for (int r = 0; r < ROPE_ITEMS; r++) {
    const int f = threadIdx.x + r * ROPE_THREADS;
    if (f < items) {
      int j;
      const T *base = rope_item<T>(a, t0 + f / ipt, f % ipt, vph, VEC, &j);
      x1[r] = load_packed<T, VEC>(base + j);
      x2[r] = load_packed<T, VEC>(base + a.half + j);
    }
  }
  for (int f = threadIdx.x; f < tokens * a.half; f += ROPE_THREADS) {
    const int tok = f / a.half, i = f - tok * a.half;
    double s, c;
    sincos((double)a.pos[t0 + tok] * a.inv_freq[i], &s, &c);
    cs[tok * 2 * a.half + i] = (float)c;
    cs[tok * 2 * a.half + a.half + i] = (float)s;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < ROPE_ITEMS; r++) {
    const int f = threadIdx.x + r * ROPE_THREADS;
    if (f < items) {
      float v1[VEC], v2[VEC];
      unpack(x1[r], v1);
      unpack(x2[r], v2);
      rotate_item<T, VEC>(a, t0, f, ipt, vph, cs, v1, v2);
    }
  }
  /* only a CTA of one token with more than ROPE_ITEMS * 256 items gets here */
  for (int f = threadIdx.x + ROPE_ITEMS * ROPE_THREADS; f < items; f += ROPE_THREADS) {
    int j;
    const T *base = rope_item<T>(a, t0 + f / ipt, f % ipt, vph, VEC, &j);
    float v1[VEC], v2[VEC];
    load_vec<VEC>(base + j, v1);
    load_vec<VEC>(base + a.half + j, v2);
    rotate_item<T, VEC>(a, t0, f, ipt, vph, cs, v1, v2);
  }
}

template <typename T, int VEC> upf_status launch_rope(const rope_args &a, int64_t T_, cudaStream_t stream) {
  const int ipt = (a.hq + a.hkv) * (a.half / VEC);
  int tpc = (ROPE_ITEMS * ROPE_THREADS) / ipt;
  const int tpc_smem = (int)(ROPE_SMEM_BYTES / (2 * (size_t)a.half * sizeof(float)));
  tpc = std::max(1, std::min(std::min(tpc, tpc_smem), ROPE_MAX_TOKENS));
  const int64_t grid = (T_ + tpc - 1) / tpc;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "rope (cuda): T=%lld exceeds the grid", (long long)T_);
  const size_t smem = (size_t)tpc * 2 * a.half * sizeof(float);
  rope_kernel<T, VEC><<<(unsigned)grid, ROPE_THREADS, smem, stream>>>(a, T_, tpc);
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

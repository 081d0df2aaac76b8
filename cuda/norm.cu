/* CUDA RMSNorm family.
 *
 * One kernel, rms_rows_kernel<T, VEC, ADD, CACHE>: a group of TPR threads (a power of two) owns one
 * row; a CTA of 256 threads holds 256/TPR rows (wide rows: one row). Rows are
 * (token, head) pairs with explicit strides, so the same kernel serves (T, N) norms, (T, H, D)
 * per-head norms inside a fused qkv buffer and gathered rows (row_index).
 *   pass 1: each thread issues the loads of all its (up to CACHE) 16-byte vectors (8 bf16 / 4 f32)
 *           before it uses the first, and keeps them in registers as stored (packed: 4 registers a
 *           vector whatever T is); in ADD mode adds the residual, rounds the sum to T and stores it
 *           back as the new residual; sums squares in fp32.
 *   reduce: xor-shuffle tree inside the group (TPR <= 32: no shared memory, no barrier), else the
 *           row's warp sums in order through shared memory: a fixed order, so results are bitwise
 *           reproducible.
 *   pass 2: multiplies by 1/sqrt(mean + eps) and by w or 1 + w, rounds once to T (vectors beyond the
 *           register cache, in rows over 2048 vectors, are read again: L2 hits).
 * Group size: rows up to 32 x 16 vectors (bf16 N <= 4096, f32 N <= 2048; ADD: 32 x 8) take a
 * group of at most one warp with about 8 vectors a thread (at least 4 threads, so a group reads 64
 * contiguous bytes per access): 128-256 bytes of loads in flight per thread and no barrier.
 * Memory-bound: x read once, y written once (ADD: residual read and written too); the floor at
 * T = 8K, N = 4096 bf16 is 134 MB / 4.2 TB/s (measured copy) = 32 us. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/norm.cuh"
#include "cuda/dense_vec.inc"

namespace {

struct norm_args {
  const void *x;          /* rows at tok * x_s0 + head * x_s1 */
  int64_t x_s0, x_s1;
  void *res;              /* ADD: residual rows at tok * r_s0 (in place) */
  int64_t r_s0;
  const void *w;          /* (n) */
  void *y;                /* rows at tok * y_s0 + head * y_s1 */
  int64_t y_s0, y_s1;
  const int32_t *row_index; /* NULL, or the token of row r (heads == 1) */
  int64_t rows, heads, n;
  float eps;
  int zero_centred;
  int tpr;                /* threads per row */
};

/* CACHE: vectors of the row each thread loads at once in pass 1 and keeps in registers for pass 2. */
template <typename T, int VEC, bool ADD, int CACHE> __global__ void __launch_bounds__(256) rms_rows_kernel(const norm_args a) {
  __shared__ float warp_sums[32];
  const int tpr = a.tpr;
  const int rows_per_cta = blockDim.x / tpr;
  const int local = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int64_t row = (int64_t)blockIdx.x * rows_per_cta + local;
  const bool active = row < a.rows;
  int64_t tok = 0, head = 0, src_tok = 0;
  if (active) {
    tok = row / a.heads;
    head = row - tok * a.heads;
    src_tok = a.row_index ? a.row_index[tok] : tok; /* gathered rows land at their row, not their token */
  }
  const T *x = (const T *)a.x + src_tok * a.x_s0 + head * a.x_s1;
  T *r = ADD ? (T *)a.res + tok * a.r_s0 : nullptr;
  T *y = (T *)a.y + tok * a.y_s0 + head * a.y_s1;
  const int64_t nvec = a.n / VEC;

  float ss = 0.0f;
  packed_vec<T, VEC> cache[CACHE];
  if (active) {
#pragma unroll
    for (int it = 0; it < CACHE; it++) { /* every load in flight before the first use */
      const int64_t v = lane + (int64_t)it * tpr;
      if (v < nvec)
        cache[it] = load_packed<T, VEC>(x + v * VEC);
    }
    if constexpr (ADD) {
      packed_vec<T, VEC> res[CACHE];
#pragma unroll
      for (int it = 0; it < CACHE; it++) {
        const int64_t v = lane + (int64_t)it * tpr;
        if (v < nvec)
          res[it] = load_packed<T, VEC>(r + v * VEC);
      }
#pragma unroll
      for (int it = 0; it < CACHE; it++) {
        const int64_t v = lane + (int64_t)it * tpr;
        if (v < nvec) {
          float xv[VEC], rv[VEC];
          unpack(cache[it], xv);
          unpack(res[it], rv);
#pragma unroll
          for (int i = 0; i < VEC; i++)
            xv[i] += rv[i];
          pack(xv, cache[it]); /* the sum rounded to T: the new residual */
          store_packed(r + v * VEC, cache[it]);
        }
      }
    }
#pragma unroll
    for (int it = 0; it < CACHE; it++) {
      const int64_t v = lane + (int64_t)it * tpr;
      if (v < nvec) {
        float xv[VEC];
        unpack(cache[it], xv);
#pragma unroll
        for (int i = 0; i < VEC; i++)
          ss += xv[i] * xv[i];
        opaque(cache[it]); /* keep it packed until pass 2 */
      }
    }
    for (int64_t v = lane + (int64_t)CACHE * tpr; v < nvec; v += tpr) { /* longer rows: streamed */
      float xv[VEC];
      load_vec<VEC>(x + v * VEC, xv);
      if constexpr (ADD) {
        float rv[VEC];
        load_vec<VEC>(r + v * VEC, rv);
#pragma unroll
        for (int i = 0; i < VEC; i++)
          xv[i] = round_as(xv[i] + rv[i], (const T *)nullptr);
        store_vec<VEC>(r + v * VEC, xv);
      }
#pragma unroll
      for (int i = 0; i < VEC; i++)
        ss += xv[i] * xv[i];
    }
  }
  for (int off = (tpr < 32 ? tpr : 32) / 2; off > 0; off >>= 1)
    ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (tpr > 32) {
    if ((threadIdx.x & 31) == 0)
      warp_sums[threadIdx.x / 32] = ss;
    __syncthreads();
    const int wpr = tpr / 32, w0 = local * wpr;
    ss = 0.0f;
    for (int w = 0; w < wpr; w++)
      ss += warp_sums[w0 + w];
  }
  if (!active)
    return;
  const float inv = 1.0f / sqrtf(ss / (float)a.n + a.eps);
  const T *src = ADD ? (const T *)r : x;
  const T *w = (const T *)a.w;
#pragma unroll
  for (int it = 0; it < CACHE; it++) {
    const int64_t v = lane + (int64_t)it * tpr;
    if (v < nvec) {
      float xv[VEC], wv[VEC], o[VEC];
      unpack(cache[it], xv);
      load_vec<VEC>(w + v * VEC, wv);
#pragma unroll
      for (int i = 0; i < VEC; i++)
        o[i] = xv[i] * inv * (a.zero_centred ? 1.0f + wv[i] : wv[i]);
      store_vec<VEC>(y + v * VEC, o);
    }
  }
  for (int64_t v = lane + (int64_t)CACHE * tpr; v < nvec; v += tpr) {
    float xv[VEC], wv[VEC], o[VEC];
    load_vec<VEC>(src + v * VEC, xv); /* as stored: the rounded new residual in ADD mode */
    load_vec<VEC>(w + v * VEC, wv);
#pragma unroll
    for (int i = 0; i < VEC; i++)
      o[i] = xv[i] * inv * (a.zero_centred ? 1.0f + wv[i] : wv[i]);
    store_vec<VEC>(y + v * VEC, o);
  }
}

template <typename T, int VEC, bool ADD, int CACHE>
upf_status launch_cached(const norm_args &a, unsigned grid, int block, cudaStream_t stream) {
  rms_rows_kernel<T, VEC, ADD, CACHE><<<grid, block, 0, stream>>>(a);
  UPF_CUDA_LAUNCH_TRY("rms_rows_kernel");
  return UPF_OK;
}

template <typename T, int VEC> upf_status launch_rows(norm_args a, bool add, cudaStream_t stream) {
  const int64_t nvec = a.n / VEC;
  const int most = add ? 8 : 16; /* vectors a thread of a one-warp group may hold (ADD: x and residual) */
  int per_thread;
  if (nvec <= 32 * (int64_t)most) { /* a group of at most one warp: shuffles only */
    a.tpr = pow2_at_least((nvec + 7) / 8, 32);
    if (a.tpr < 4)
      a.tpr = pow2_at_least(nvec, 4);
    per_thread = (int)((nvec + a.tpr - 1) / a.tpr);
  } else { /* wide rows: up to 256 threads of 8 cached vectors, the rest streamed */
    a.tpr = pow2_at_least((nvec + 7) / 8, 256);
    per_thread = 8;
  }
  const int block = 256;
  const int rows_per_cta = block / a.tpr;
  const int64_t grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "norm (cuda): %lld rows exceed the grid", (long long)a.rows);
  if (add)
    return per_thread <= 4 ? launch_cached<T, VEC, true, 4>(a, (unsigned)grid, block, stream)
                           : launch_cached<T, VEC, true, 8>(a, (unsigned)grid, block, stream);
  if (per_thread <= 4)
    return launch_cached<T, VEC, false, 4>(a, (unsigned)grid, block, stream);
  if (per_thread <= 8)
    return launch_cached<T, VEC, false, 8>(a, (unsigned)grid, block, stream);
  return launch_cached<T, VEC, false, 16>(a, (unsigned)grid, block, stream);
}

upf_status run_rows(norm_args a, upf_dtype dt, bool add) {
  if (a.rows == 0)
    return UPF_OK;
  cudaStream_t stream = upf_cuda_stream();
  const void *ptrs[4] = {a.x, a.y, a.w, add ? a.res : nullptr};
  const int64_t strides[6] = {a.x_s0, a.x_s1, a.y_s0, a.y_s1, add ? a.r_s0 : 0, a.n};
  if (dt == UPF_DTYPE_BF16) {
    if (vec_ok(vec16<bf16_t>::n, ptrs, 4, strides, 6))
      return launch_rows<bf16_t, vec16<bf16_t>::n>(a, add, stream);
    return launch_rows<bf16_t, 1>(a, add, stream);
  }
  if (vec_ok(vec16<float>::n, ptrs, 4, strides, 6))
    return launch_rows<float, vec16<float>::n>(a, add, stream);
  return launch_rows<float, 1>(a, add, stream);
}

norm_args args_2d(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y) {
  norm_args a = {};
  a.x = x->data, a.x_s0 = x->stride[0];
  a.w = w->data;
  a.y = y->data, a.y_s0 = y->stride[0];
  a.rows = x->shape[0], a.heads = 1, a.n = x->shape[1];
  a.eps = p->eps, a.zero_centred = p->zero_centred;
  return a;
}

} // namespace

extern "C" upf_status upf_cuda_rmsnorm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p,
                                       const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_rmsnorm_check("norm.rms", x, NULL, w, p, y));
  return run_rows(args_2d(x, w, p, y), x->dtype, false);
}

extern "C" upf_status upf_cuda_rmsnorm_add(const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                                           const upf_norm_params *p, const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_rmsnorm_check("norm.rms_add", x, residual, w, p, y));
  norm_args a = args_2d(x, w, p, y);
  a.res = residual->data, a.r_s0 = residual->stride[0];
  return run_rows(a, x->dtype, true);
}

extern "C" upf_status upf_cuda_qk_norm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p,
                                       const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_qk_norm_check(x, w, p, y));
  norm_args a = {};
  a.x = x->data, a.x_s0 = x->stride[0], a.x_s1 = x->stride[1];
  a.w = w->data;
  a.y = y->data, a.y_s0 = y->stride[0], a.y_s1 = y->stride[1];
  a.heads = x->shape[1], a.rows = x->shape[0] * x->shape[1], a.n = x->shape[2];
  a.eps = p->eps, a.zero_centred = p->zero_centred;
  return run_rows(a, x->dtype, false);
}

extern "C" upf_status upf_cuda_rmsnorm_gather(const void *x, int64_t x_stride, const int32_t *row_index, int64_t rows,
                                              int64_t n, const void *w, const upf_norm_params *p, upf_dtype dtype,
                                              void *y) {
  UPF_TRY(upf_cuda_init());
  norm_args a = {};
  a.x = x, a.x_s0 = x_stride;
  a.w = w;
  a.y = y, a.y_s0 = n;
  a.row_index = row_index;
  a.rows = rows, a.heads = 1, a.n = n;
  a.eps = p->eps, a.zero_centred = p->zero_centred;
  return run_rows(a, dtype, false);
}

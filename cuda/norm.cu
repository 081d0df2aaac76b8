/* CUDA RMSNorm family.
 *
 * One kernel, rms_rows_kernel<T, VEC, ADD, CACHE, ROWS>: a group of TPR threads (a power of two)
 * owns ROWS rows, CACHE 16-byte vectors (8 bf16 / 4 f32) of each per thread. Rows are (token, head)
 * pairs with explicit strides, so the same kernel serves (T, N) norms, (T, H, D) per-head norms
 * inside a fused qkv buffer and gathered rows (row_index).
 *   pass 1: each thread issues the loads of all its ROWS x CACHE vectors before it uses the first,
 *           and keeps them in registers as stored (packed: 4 registers a vector whatever T is); in
 *           ADD mode adds the residual, rounds the sum to T and stores it back as the new residual;
 *           sums squares in fp32.
 *   reduce: xor-shuffle tree inside the group (TPR <= 32: no shared memory, no barrier), else the
 *           row's warp sums in order through shared memory: a fixed order, so results are bitwise
 *           reproducible.
 *   pass 2: multiplies by 1/sqrt(mean + eps) and by w or 1 + w, rounds once to T (vectors beyond the
 *           register cache, in rows over 2048 vectors, are read again: L2 hits).
 * Shapes (launch_rows):
 *   rows <= 32 vectors (per-head norms): TPR = half the row's vectors, 2 each, one row a group (the
 *     f898f0f shape: 0.69 / 0.80 of copy bandwidth for Gemma q/k at 8K / 32K; groups of 4 threads
 *     with 8 vectors each, and warps of 8 rows with 1 vector each, ran at 0.47-0.53 on the H200,
 *     see perf/NOTES.md);
 *   rows of 33-512 vectors (bf16 N <= 4096): one warp, CACHE = 2..16 vectors a thread (ADD: <= 8),
 *     ROWS = 8 / CACHE rows (at least 1): 128-256 bytes of loads in flight per thread, every warp
 *     access 512 contiguous bytes;
 *   wider rows: up to 256 threads of 8 cached vectors, the rest streamed.
 * Groups of at most a warp run in 64-thread CTAs: nothing waits on a whole CTA, so a slow warp
 * holds few others' slots.
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

/* Rows of a group for a CACHE (vectors a row a thread): about 8 vectors a thread in all (ADD: 4,
 * with as many of the residual). */
constexpr int rows_per_group(bool add, int cache) { return cache >= (add ? 4 : 8) ? 1 : (add ? 4 : 8) / cache; }

template <typename T, int VEC, bool ADD, int CACHE, int ROWS>
__global__ void __launch_bounds__(256, 2) rms_rows_kernel(const norm_args a) {
  __shared__ float warp_sums[32];
  const int tpr = a.tpr, groups = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int64_t nvec = a.n / VEC;
  const T *x[ROWS];
  T *r[ROWS], *y[ROWS];
  bool active[ROWS];
#pragma unroll
  for (int q = 0; q < ROWS; q++) { /* row q of the group: adjacent groups take adjacent rows */
    const int64_t row = ((int64_t)blockIdx.x * ROWS + q) * groups + group;
    active[q] = row < a.rows;
    int64_t tok = 0, head = 0, src_tok = 0;
    if (active[q]) {
      /* 32-bit division where the rows allow: a 64-bit one is a long subroutine, and short rows pay
       * it for every 512 bytes */
      tok = a.rows <= (int64_t)UINT32_MAX ? (int64_t)((uint32_t)row / (uint32_t)a.heads) : row / a.heads;
      head = row - tok * a.heads;
      src_tok = a.row_index ? a.row_index[tok] : tok; /* gathered rows land at their row, not their token */
    }
    x[q] = (const T *)a.x + src_tok * a.x_s0 + head * a.x_s1;
    r[q] = ADD ? (T *)a.res + tok * a.r_s0 : nullptr;
    y[q] = (T *)a.y + tok * a.y_s0 + head * a.y_s1;
  }

  float ss[ROWS];
  packed_vec<T, VEC> cache[ROWS][CACHE];
#pragma unroll
  for (int q = 0; q < ROWS; q++) { /* every load in flight before the first use */
    ss[q] = 0.0f;
#pragma unroll
    for (int it = 0; it < CACHE; it++) {
      const int64_t v = lane + (int64_t)it * tpr;
      if (active[q] && v < nvec)
        cache[q][it] = load_packed<T, VEC>(x[q] + v * VEC);
    }
  }
  if constexpr (ADD) {
    packed_vec<T, VEC> res[ROWS][CACHE];
#pragma unroll
    for (int q = 0; q < ROWS; q++)
#pragma unroll
      for (int it = 0; it < CACHE; it++) {
        const int64_t v = lane + (int64_t)it * tpr;
        if (active[q] && v < nvec)
          res[q][it] = load_packed<T, VEC>(r[q] + v * VEC);
      }
#pragma unroll
    for (int q = 0; q < ROWS; q++)
#pragma unroll
      for (int it = 0; it < CACHE; it++) {
        const int64_t v = lane + (int64_t)it * tpr;
        if (active[q] && v < nvec) {
          float xv[VEC], rv[VEC];
          unpack(cache[q][it], xv);
          unpack(res[q][it], rv);
#pragma unroll
          for (int i = 0; i < VEC; i++)
            xv[i] += rv[i];
          pack(xv, cache[q][it]); /* the sum rounded to T: the new residual */
          store_packed(r[q] + v * VEC, cache[q][it]);
        }
      }
  }
#pragma unroll
  for (int q = 0; q < ROWS; q++) {
#pragma unroll
    for (int it = 0; it < CACHE; it++) {
      const int64_t v = lane + (int64_t)it * tpr;
      if (active[q] && v < nvec) {
        float xv[VEC];
        unpack(cache[q][it], xv);
#pragma unroll
        for (int i = 0; i < VEC; i++)
          ss[q] += xv[i] * xv[i];
        opaque(cache[q][it]); /* keep it packed until pass 2 */
      }
    }
    if (active[q])
      for (int64_t v = lane + (int64_t)CACHE * tpr; v < nvec; v += tpr) { /* longer rows: streamed */
        float xv[VEC];
        load_vec<VEC>(x[q] + v * VEC, xv);
        if constexpr (ADD) {
          float rv[VEC];
          load_vec<VEC>(r[q] + v * VEC, rv);
#pragma unroll
          for (int i = 0; i < VEC; i++)
            xv[i] = round_as(xv[i] + rv[i], (const T *)nullptr);
          store_vec<VEC>(r[q] + v * VEC, xv);
        }
#pragma unroll
        for (int i = 0; i < VEC; i++)
          ss[q] += xv[i] * xv[i];
      }
  }
#pragma unroll
  for (int q = 0; q < ROWS; q++)
    for (int off = (tpr < 32 ? tpr : 32) / 2; off > 0; off >>= 1)
      ss[q] += __shfl_xor_sync(0xffffffffu, ss[q], off);
  if constexpr (ROWS == 1) { /* launch_rows gives groups wider than a warp one row */
    if (tpr > 32) {
      if ((threadIdx.x & 31) == 0)
        warp_sums[threadIdx.x / 32] = ss[0];
      __syncthreads();
      const int wpr = tpr / 32, w0 = group * wpr;
      ss[0] = 0.0f;
      for (int w = 0; w < wpr; w++)
        ss[0] += warp_sums[w0 + w];
    }
  }
  const T *w = (const T *)a.w;
#pragma unroll
  for (int q = 0; q < ROWS; q++) {
    if (!active[q])
      continue;
    const float inv = 1.0f / sqrtf(ss[q] / (float)a.n + a.eps);
#pragma unroll
    for (int it = 0; it < CACHE; it++) {
      const int64_t v = lane + (int64_t)it * tpr;
      if (v < nvec) {
        float xv[VEC], wv[VEC], o[VEC];
        unpack(cache[q][it], xv);
        load_vec<VEC>(w + v * VEC, wv);
#pragma unroll
        for (int i = 0; i < VEC; i++)
          o[i] = xv[i] * inv * (a.zero_centred ? 1.0f + wv[i] : wv[i]);
        store_vec<VEC>(y[q] + v * VEC, o);
      }
    }
    const T *src = ADD ? (const T *)r[q] : x[q];
    for (int64_t v = lane + (int64_t)CACHE * tpr; v < nvec; v += tpr) {
      float xv[VEC], wv[VEC], o[VEC];
      load_vec<VEC>(src + v * VEC, xv); /* as stored: the rounded new residual in ADD mode */
      load_vec<VEC>(w + v * VEC, wv);
#pragma unroll
      for (int i = 0; i < VEC; i++)
        o[i] = xv[i] * inv * (a.zero_centred ? 1.0f + wv[i] : wv[i]);
      store_vec<VEC>(y[q] + v * VEC, o);
    }
  }
}

template <typename T, int VEC, bool ADD, int CACHE, int ROWS = rows_per_group(ADD, CACHE)>
upf_status launch_cached(const norm_args &a, cudaStream_t stream) {
  const int block = a.tpr <= 32 ? 64 : 256;
  const int64_t rows_per_cta = (int64_t)(block / a.tpr) * ROWS;
  const int64_t grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "norm (cuda): %lld rows exceed the grid", (long long)a.rows);
  rms_rows_kernel<T, VEC, ADD, CACHE, ROWS><<<(unsigned)grid, block, 0, stream>>>(a);
  UPF_CUDA_LAUNCH_TRY("rms_rows_kernel");
  return UPF_OK;
}

template <typename T, int VEC, bool ADD> upf_status launch_mode(norm_args a, cudaStream_t stream) {
  const int64_t nvec = a.n / VEC;
  constexpr int most = ADD ? 8 : 16; /* vectors a thread of a one-warp group may hold of one row */
  int cache;
  if (nvec <= 32) { /* short rows (per-head norms): half-row groups of 2 vectors a thread, one row each */
    a.tpr = pow2_at_least((nvec + 1) / 2, 32);
    return launch_cached<T, VEC, ADD, 2, 1>(a, stream);
  }
  if (nvec <= 32 * (int64_t)most) { /* one warp a row */
    a.tpr = 32;
    cache = pow2_at_least((nvec + 31) / 32, most);
  } else { /* wide rows: up to 256 threads of 8 cached vectors, the rest streamed */
    a.tpr = pow2_at_least((nvec + 7) / 8, 256);
    cache = 8;
  }
  switch (cache) {
  case 2:
    return launch_cached<T, VEC, ADD, 2>(a, stream);
  case 4:
    return launch_cached<T, VEC, ADD, 4>(a, stream);
  case 8:
    return launch_cached<T, VEC, ADD, 8>(a, stream);
  default:
    if constexpr (ADD)
      return launch_cached<T, VEC, ADD, 8>(a, stream); /* not reached: ADD caps the cache at 8 */
    else
      return launch_cached<T, VEC, ADD, 16>(a, stream);
  }
}

template <typename T, int VEC> upf_status launch_rows(const norm_args &a, bool add, cudaStream_t stream) {
  return add ? launch_mode<T, VEC, true>(a, stream) : launch_mode<T, VEC, false>(a, stream);
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

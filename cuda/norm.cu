/* CUDA RMSNorm family.
 *
 * One kernel, rms_rows_kernel<T, VEC, ADD, CACHE>: a group of TPR threads (a power of two, 1..1024,
 * the smallest covering the row's N/VEC vectors at two vectors a thread) owns one row; a CTA holds
 * 256/TPR rows (or one row of 512/1024 threads). Rows are (token, head) pairs with explicit
 * strides, so the same kernel serves (T, N) norms, (T, H, D) per-head norms inside a fused qkv
 * buffer and gathered rows (row_index).
 *   pass 1: each thread loads its 16-byte vectors (8 bf16 / 4 f32) into registers (CACHE = 2
 *           vectors a thread, two loads in flight; 4 for rows over 16K bf16), in ADD mode adds the
 *           residual, rounds the sum to T and stores it back as the new residual; sums squares in fp32.
 *   reduce: xor-shuffle tree inside the warp, then (TPR > 32) the row's warp sums in order through
 *           shared memory: a fixed order, so results are bitwise reproducible.
 *   pass 2: multiplies the registers by 1/sqrt(mean + eps) and by w or 1 + w, rounds once to T
 *           (vectors beyond the register cache are read again: L1/L2 hits).
 * Memory-bound: x read once, y written once (ADD: residual read and written too); the floor at
 * T = 8K, N = 4096 bf16 is 134 MB / 4.8 TB/s = 28 us. */
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

/* CACHE: vectors of the row each thread keeps in registers between the passes (and loads in flight
 * at once in pass 1). */
template <typename T, int VEC, bool ADD, int CACHE> __global__ void rms_rows_kernel(const norm_args a) {
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
  float cache[CACHE][VEC];
  if (active) {
#pragma unroll
    for (int it = 0; it < CACHE; it++) { /* first CACHE vectors: kept in registers */
      const int64_t v = lane + (int64_t)it * tpr;
      if (v < nvec) {
        load_vec<VEC>(x + v * VEC, cache[it]);
        if constexpr (ADD) {
          float rv[VEC];
          load_vec<VEC>(r + v * VEC, rv);
#pragma unroll
          for (int i = 0; i < VEC; i++)
            cache[it][i] = round_as(cache[it][i] + rv[i], (const T *)nullptr);
          store_vec<VEC>(r + v * VEC, cache[it]);
        }
#pragma unroll
        for (int i = 0; i < VEC; i++)
          ss += cache[it][i] * cache[it][i];
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
      float wv[VEC], o[VEC];
      load_vec<VEC>(w + v * VEC, wv);
#pragma unroll
      for (int i = 0; i < VEC; i++)
        o[i] = cache[it][i] * inv * (a.zero_centred ? 1.0f + wv[i] : wv[i]);
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

template <typename T, int VEC> upf_status launch_rows(norm_args a, bool add, cudaStream_t stream) {
  int64_t nvec = a.n / VEC;
  a.tpr = pow2_at_least((nvec + 1) / 2, 1024);
  bool wide = nvec > 2 * (int64_t)a.tpr; /* only rows of more than 2048 vectors */
  int block = a.tpr > 256 ? a.tpr : 256;
  int rows_per_cta = block / a.tpr;
  int64_t grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "norm (cuda): %lld rows exceed the grid", (long long)a.rows);
  if (add && wide)
    rms_rows_kernel<T, VEC, true, 4><<<(unsigned)grid, block, 0, stream>>>(a);
  else if (add)
    rms_rows_kernel<T, VEC, true, 2><<<(unsigned)grid, block, 0, stream>>>(a);
  else if (wide)
    rms_rows_kernel<T, VEC, false, 4><<<(unsigned)grid, block, 0, stream>>>(a);
  else
    rms_rows_kernel<T, VEC, false, 2><<<(unsigned)grid, block, 0, stream>>>(a);
  UPF_CUDA_LAUNCH_TRY("rms_rows_kernel");
  return UPF_OK;
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

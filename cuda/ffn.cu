/* CUDA gated FFN.
 *
 * Kernels:
 *   act_mul_kernel<T, VEC, ACT>  h[t, i] = act(gu[t, i]) * gu[t, I + i], fp32 math (expf / tanhf,
 *                                IEEE, no fast-math), rounded once to T. Grid-stride over the
 *                                (T, I/VEC) vectors; VEC = 16 bytes of T (8 bf16, 4 f32) when I, both
 *                                row strides and both base pointers allow, else 1.
 *   Memory-bound: reads 2I and writes I elements per token, 6*T*I bytes in bf16; the floor at
 *   T = 8K, I = 14336 is 0.70 GB / 4.8 TB/s = 0.15 ms.
 *
 * ffn_gated, per chunk of UPF_CUDA_FFN_CHUNK tokens:
 *   gu (chunk, 2I) = x . [Wg | Wu]       one cublasGemmEx (N = 2I, the fused weight)
 *   h (chunk, I)   = act(gu_g) * gu_u    act_mul_kernel
 *   y (chunk, H)   = h . Wd              one cublasGemmEx
 *   gu and h live in the backend workspace, in x's dtype (as the frameworks store them). FLOPs
 *   6*T*H*I; the activation pass moves 6*T*I bytes, about 1/(H/2 * 0.2) of the GEMM time at
 *   Llama's H = 4096 (under 5%), so the whole FFN can sit within 10% of the cuBLAS ceiling. */
#include <math.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/ffn.cuh"
#include "cuda/gemm.cuh"
#include "cuda/dense_vec.inc"

namespace {

/* act_mul_kernel's launch: CTAs of ACT_THREADS, ACT_CTAS_PER_SM of them resident on an SM (2048 threads,
 * the SM's maximum: at most 32 registers a thread; the GELU path took 40 without the bound, 6 CTAs an SM,
 * and ran 3% slower). */
constexpr int ACT_THREADS = 256, ACT_CTAS_PER_SM = 8;

template <upf_act ACT> __device__ __forceinline__ float act_fn(float x) {
  if constexpr (ACT == UPF_ACT_GELU_TANH) {
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
  } else {
    /* __expf and __fdividef: a few fp32 ulps (far inside the fp32 and bf16 tolerances) for about half
     * the instructions of expf and the IEEE division, which kept this memory-bound kernel near its issue
     * limit. Large negative x: __expf(-x) overflows to inf or passes 2^126, and the quotient is 0, the
     * limit (x / (1 + e^-x) is below 1e-36 in magnitude there). */
    return __fdividef(x, 1.0f + __expf(-x));
  }
}

/* h[r] = act(gu[r, :I]) * gu[r, I:] for the rows r = row_index[i] (i < rows), or r = i when row_index
 * is NULL; a grid-stride loop over (row, vector) in order, VEC elements a thread. The (row, vector)
 * pair advances by the stride's quotient and remainder (no 64-bit division in the loop), and the next
 * row's index is loaded before this row's arithmetic. */
template <typename T, int VEC, upf_act ACT>
__global__ void __launch_bounds__(ACT_THREADS, ACT_CTAS_PER_SM)
    act_mul_kernel(const T *__restrict__ gu,                   // (T, ld_in) rows: [gate (I) | up (I)]
                   int64_t ld_in, T *__restrict__ h,           // (T, ld_out) rows: I outputs
                   int64_t ld_out, const int32_t *__restrict__ row_index, int64_t rows, int64_t inter) {
  const int64_t vpr = inter / VEC, n = rows * vpr, stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (first >= n)
    return;
  const int64_t di = stride / vpr, dv = stride - di * vpr;
  int64_t i = first / vpr, v = first - i * vpr;
  int64_t row = row_index ? (int64_t)row_index[i] : i;
  for (int64_t idx = first; idx < n; idx += stride) {
    const int64_t col = v * VEC;
    const T *g = gu + row * ld_in + col;
    float gv[VEC], uv[VEC], o[VEC];
    load_vec<VEC>(g, gv);
    load_vec<VEC>(g + inter, uv);
    T *out = h + row * ld_out + col;
    i += di, v += dv;
    if (v >= vpr)
      i++, v -= vpr;
    if (idx + stride < n)
      row = row_index ? (int64_t)row_index[i] : i;
#pragma unroll
    for (int j = 0; j < VEC; j++)
      o[j] = act_fn<ACT>(gv[j]) * uv[j];
    store_vec<VEC>(out, o);
  }
}

template <typename T, int VEC>
upf_status launch_act(const void *gu, int64_t ld_in, void *h, int64_t ld_out, const int32_t *row_index, int64_t rows,
                      int64_t inter, upf_act act, cudaStream_t stream) {
  int64_t n = rows * (inter / VEC);
  int64_t cap = (int64_t)upf_cuda_num_sms() * 2 * ACT_CTAS_PER_SM; /* two rounds of resident CTAs, then stride */
  int64_t grid = (n + ACT_THREADS - 1) / ACT_THREADS;
  grid = grid < cap ? grid : cap;
  grid = grid > 0 ? grid : 1;
  if (act == UPF_ACT_GELU_TANH)
    act_mul_kernel<T, VEC, UPF_ACT_GELU_TANH>
        <<<(unsigned)grid, ACT_THREADS, 0, stream>>>((const T *)gu, ld_in, (T *)h, ld_out, row_index, rows, inter);
  else
    act_mul_kernel<T, VEC, UPF_ACT_SILU>
        <<<(unsigned)grid, ACT_THREADS, 0, stream>>>((const T *)gu, ld_in, (T *)h, ld_out, row_index, rows, inter);
  UPF_CUDA_LAUNCH_TRY("act_mul_kernel");
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_act_mul_rows(const void *gu, int64_t ld_in, void *h, int64_t ld_out,
                                            const int32_t *row_index, int64_t rows, int64_t inter, upf_dtype dt,
                                            upf_act act, cudaStream_t stream) {
  if (rows == 0 || inter == 0)
    return UPF_OK;
  const void *ptrs[3] = {gu, (const char *)gu + (size_t)inter * (dt == UPF_DTYPE_BF16 ? 2 : 4), h};
  const int64_t strides[3] = {ld_in, ld_out, inter};
  if (dt == UPF_DTYPE_BF16) {
    if (vec_ok(vec16<bf16_t>::n, ptrs, 3, strides, 3))
      return launch_act<bf16_t, vec16<bf16_t>::n>(gu, ld_in, h, ld_out, row_index, rows, inter, act, stream);
    return launch_act<bf16_t, 1>(gu, ld_in, h, ld_out, row_index, rows, inter, act, stream);
  }
  if (vec_ok(vec16<float>::n, ptrs, 3, strides, 3))
    return launch_act<float, vec16<float>::n>(gu, ld_in, h, ld_out, row_index, rows, inter, act, stream);
  return launch_act<float, 1>(gu, ld_in, h, ld_out, row_index, rows, inter, act, stream);
}

extern "C" upf_status upf_cuda_ffn_act_mul(const upf_tensor *gate_up, upf_act act, const upf_tensor *h) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gated_act_check(gate_up, act, h));
  return upf_cuda_act_mul_rows(gate_up->data, gate_up->stride[0], h->data, h->stride[0], nullptr, h->shape[0],
                               h->shape[1], h->dtype, act, upf_cuda_stream());
}

extern "C" upf_status upf_cuda_ffn_gated(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down,
                                         upf_act act, const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_ffn_check(x, w_gate_up, w_down, act, y));
  int64_t T = x->shape[0], H = x->shape[1], inter = w_down->shape[0];
  if (T == 0)
    return UPF_OK;
  upf_dtype dt = x->dtype;
  size_t es = upf_dtype_size(dt);
  int64_t chunk = T < UPF_CUDA_FFN_CHUNK ? T : UPF_CUDA_FFN_CHUNK;
  size_t gu_bytes = ((size_t)(chunk * 2 * inter) * es + 255) & ~(size_t)255;
  size_t h_bytes = (size_t)(chunk * inter) * es;
  void *ws = nullptr;
  UPF_TRY(upf_cuda_workspace(gu_bytes + h_bytes, &ws));
  void *gu = ws, *h = (char *)ws + gu_bytes;
  size_t ys = upf_dtype_size(y->dtype);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    int64_t rows = T - t0 < chunk ? T - t0 : chunk;
    UPF_TRY(upf_cuda_gemm_raw((const char *)x->data + (size_t)(t0 * x->stride[0]) * es, x->stride[0], w_gate_up->data,
                              w_gate_up->stride[0], gu, 2 * inter, rows, H, 2 * inter, dt, dt));
    UPF_TRY(upf_cuda_act_mul_rows(gu, 2 * inter, h, inter, nullptr, rows, inter, dt, act, upf_cuda_stream()));
    UPF_TRY(upf_cuda_gemm_raw(h, inter, w_down->data, w_down->stride[0],
                              (char *)y->data + (size_t)(t0 * y->stride[0]) * ys, y->stride[0], rows, inter, H, dt,
                              y->dtype));
  }
  return UPF_OK;
}

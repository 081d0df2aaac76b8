/* CUDA Gated DeltaNet ops. The scan has two forms: the recurrent kernel here (decode rows, f32 inputs,
 * any head size; the form every other variant is checked against on the device) and the chunked
 * tensor-core form in cuda/gdn_chunked.cu (the prefill fast path; upf_cuda_gdn_scan picks, gdn.cuh, and
 * the gdn.scan variant "recurrent" of variants.def keeps every row on the recurrent kernel).
 *
 *   conv_kernel:       one thread per (token, channel), channels fastest (coalesced); the request of a
 *                      token by binary search over cu_seqlens; inputs before a request's first token
 *                      from its initial conv state. conv_state_kernel then writes each request's last
 *                      K-1 inputs (a second launch: the final states never race the reads of the
 *                      initial ones, which are different buffers by the shape rule).
 *   conv_step_kernel:  one thread per (request, channel): it owns that state column, so the in-place
 *                      shift needs no synchronisation.
 *   scan_kernel:       one CTA per (request, value head), one thread per value column j of the
 *                      (Dk, Dv) fp32 state, which lives in shared memory (S[i * Dv + j]: a warp's
 *                      threads touch consecutive words, no bank conflicts; 64 KiB + 1 KiB at the
 *                      Qwen3-Next 128 x 128). Per token the CTA stages q and k in shared memory, every
 *                      thread sums |q|^2 and |k|^2 itself in the same order (redundant but
 *                      deterministic, and a 128-term sum is cheap next to the 3 x 128 state updates),
 *                      then makes two passes down its column: m = (decay S)^T k, then
 *                      S = decay S + k delta^T fused with o = S^T q. Everything in a fixed order:
 *                      the same inputs give the same bits on every run.
 *   gated_norm_kernel: one warp per (token, head) row; sum of squares by lane stride then an xor tree. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/gdn.cuh"
#include "cuda/dense_vec.inc"
#include "uniprefill/variant.h"

namespace {

__device__ __forceinline__ float ld(const float *p) { return *p; }
__device__ __forceinline__ float ld(const bf16_t *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16_t *p, float v) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

/* The request of token t: the last r with cu[r] <= t (empty requests before it are skipped). */
__device__ __forceinline__ int find_req(const int32_t *cu, int num_reqs, int64_t t) {
  int lo = 0, hi = num_reqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if ((int64_t)cu[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

unsigned grid_for(int64_t items, int block) {
  int64_t blocks = (items + block - 1) / block, cap = (int64_t)upf_cuda_num_sms() * 32;
  if (cap < 1)
    cap = 1024;
  return (unsigned)(blocks < cap ? blocks : cap);
}

/* ---- conv1d ---- */

struct conv_args {
  const void *x;
  int64_t x_s0;
  const void *w; /* (C, K) */
  int64_t w_s0;
  const float *state_in; /* (B, K-1, C) or NULL */
  float *state_out;      /* (B, K-1, C) or NULL */
  void *y;
  int64_t y_s0;
  const int32_t *cu;
  int num_reqs;
  int64_t T, C;
  int K;
};

/* Input u of request r (first token s) in channel c. */
template <typename T> __device__ __forceinline__ float conv_in(const conv_args &a, int r, int64_t s, int64_t u,
                                                                int64_t c) {
  if (u >= s)
    return ld((const T *)a.x + u * a.x_s0 + c);
  if (!a.state_in)
    return 0.0f;
  return a.state_in[((int64_t)r * (a.K - 1) + (a.K - 1) + (u - s)) * a.C + c];
}

template <typename T> __global__ void conv_kernel(const conv_args a) {
  const int64_t total = a.T * a.C;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = e / a.C, c = e - t * a.C;
    const int r = find_req(a.cu, a.num_reqs, t);
    const int64_t s = a.cu[r];
    const T *w = (const T *)a.w + c * a.w_s0;
    float acc = 0.0f;
    for (int j = 0; j < a.K; j++)
      acc += ld(w + j) * conv_in<T>(a, r, s, t - (a.K - 1) + j, c);
    st((T *)a.y + t * a.y_s0 + c, silu_f(acc));
  }
}

template <typename T> __global__ void conv_state_kernel(const conv_args a) {
  const int64_t total = (int64_t)a.num_reqs * (a.K - 1) * a.C;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % a.C, ri = e / a.C;
    const int64_t i = ri % (a.K - 1);
    const int r = (int)(ri / (a.K - 1));
    const int64_t s = a.cu[r], n = a.cu[r + 1] - s;
    a.state_out[e] = conv_in<T>(a, r, s, s + n - (a.K - 1) + i, c);
  }
}

template <typename T> __global__ void conv_step_kernel(const conv_args a) {
  const int64_t total = a.T * a.C; /* T = B: one token per request */
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = e / a.C, c = e - r * a.C;
    float *state = a.state_out + r * (a.K - 1) * a.C + c; /* column c of request r, stride C */
    const T *w = (const T *)a.w + c * a.w_s0;
    const float xv = ld((const T *)a.x + r * a.x_s0 + c);
    float acc = 0.0f;
    for (int j = 0; j < a.K - 1; j++)
      acc += ld(w + j) * state[(int64_t)j * a.C];
    acc += ld(w + a.K - 1) * xv;
    st((T *)a.y + r * a.y_s0 + c, silu_f(acc));
    for (int j = 0; j + 1 < a.K - 1; j++)
      state[(int64_t)j * a.C] = state[(int64_t)(j + 1) * a.C];
    state[(int64_t)(a.K - 2) * a.C] = xv;
  }
}

/* ---- the delta-rule scan ---- */

struct scan_args {
  const void *q, *k, *v, *a, *b;
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, a_s0, b_s0;
  const float *a_log, *dt_bias; /* (Hv) */
  const float *state_in;        /* (B, Hv, Dk, Dv) or NULL */
  float *state_out;             /* (B, Hv, Dk, Dv) or NULL; may be state_in */
  void *o;
  int64_t o_s0, o_s1;
  const int32_t *cu;
  int hk, hv, dk, dv;
  float scale;
};

template <typename T, typename TO> __global__ void scan_kernel(const scan_args a) {
  extern __shared__ float smem[];
  float *S = smem;                           /* (Dk, Dv) */
  float *sq = S + (int64_t)a.dk * a.dv;      /* (Dk) this token's q */
  float *sk = sq + a.dk;                     /* (Dk) this token's k */
  const int r = blockIdx.x / a.hv, h = blockIdx.x % a.hv, j = threadIdx.x;
  const int kh = h / (a.hv / a.hk);
  const int dk = a.dk, dv = a.dv;
  const int64_t soff = ((int64_t)r * a.hv + h) * dk * dv;
  const bool col = j < dv;
  /* Each thread reads and (at the end) writes only its own column, so state_out may be state_in. */
  if (col)
    for (int i = 0; i < dk; i++)
      S[i * dv + j] = a.state_in ? a.state_in[soff + (int64_t)i * dv + j] : 0.0f;
  const float ea = expf(a.a_log[h]), dtb = a.dt_bias[h];
  const int64_t t0 = a.cu[r], t1 = a.cu[r + 1];
  for (int64_t t = t0; t < t1; t++) {
    const T *qp = (const T *)a.q + t * a.q_s0 + (int64_t)kh * a.q_s1;
    const T *kp = (const T *)a.k + t * a.k_s0 + (int64_t)kh * a.k_s1;
    for (int i = j; i < dk; i += blockDim.x) {
      sq[i] = ld(qp + i);
      sk[i] = ld(kp + i);
    }
    __syncthreads();
    if (col) {
      float qq = 0.0f, kk = 0.0f;
      for (int i = 0; i < dk; i++) {
        qq += sq[i] * sq[i];
        kk += sk[i] * sk[i];
      }
      const float rq = a.scale / sqrtf(qq + UPF_GDN_L2_EPS), rk = 1.0f / sqrtf(kk + UPF_GDN_L2_EPS);
      const float x = ld((const T *)a.a + t * a.a_s0 + h) + dtb;
      const float sp = x > 20.0f ? x : log1pf(expf(x)); /* softplus, torch's threshold */
      const float decay = expf(-ea * sp);
      const float beta = 1.0f / (1.0f + expf(-ld((const T *)a.b + t * a.b_s0 + h)));
      float m = 0.0f;
      for (int i = 0; i < dk; i++)
        m += S[i * dv + j] * sk[i];
      m *= decay * rk; /* (decay S)^T (k / |k|) */
      const float delta = beta * (ld((const T *)a.v + t * a.v_s0 + (int64_t)h * a.v_s1 + j) - m);
      const float kd = rk * delta;
      float acc = 0.0f;
      for (int i = 0; i < dk; i++) {
        const float s = S[i * dv + j] * decay + sk[i] * kd;
        S[i * dv + j] = s;
        acc += s * sq[i];
      }
      st((TO *)a.o + t * a.o_s0 + (int64_t)h * a.o_s1 + j, acc * rq);
    }
    __syncthreads(); /* the next token overwrites sq and sk */
  }
  if (col && a.state_out)
    for (int i = 0; i < dk; i++)
      a.state_out[soff + (int64_t)i * dv + j] = S[i * dv + j];
}

template <typename T, typename TO> upf_status launch_scan(const scan_args &a, int num_reqs, size_t smem) {
  if (smem > 48 * 1024)
    UPF_CUDA_TRY(cudaFuncSetAttribute(scan_kernel<T, TO>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int block = (a.dv + 31) / 32 * 32;
  scan_kernel<T, TO><<<(unsigned)((int64_t)num_reqs * a.hv), block, smem, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("scan_kernel");
  return UPF_OK;
}

/* ---- gated RMSNorm ---- */

struct gnorm_args {
  const void *o, *z, *w;
  void *y;
  int64_t o_s0, o_s1, z_s0, z_s1, y_s0, y_s1;
  int64_t rows, heads, d;
  float eps;
  int zero_centred;
};

template <typename T> __global__ void gated_norm_kernel(const gnorm_args a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (row >= a.rows) /* whole warps leave together: rows are per warp */
    return;
  const int64_t t = row / a.heads, h = row - t * a.heads;
  const T *o = (const T *)a.o + t * a.o_s0 + h * a.o_s1;
  const T *z = (const T *)a.z + t * a.z_s0 + h * a.z_s1;
  const T *w = (const T *)a.w;
  T *y = (T *)a.y + t * a.y_s0 + h * a.y_s1;
  float ss = 0.0f;
  for (int64_t d = lane; d < a.d; d += 32) {
    const float v = ld(o + d);
    ss += v * v;
  }
  for (int off = 16; off > 0; off >>= 1)
    ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv = 1.0f / sqrtf(ss / (float)a.d + a.eps);
  /* Each lane rewrites only the elements it read, so y may be o. */
  for (int64_t d = lane; d < a.d; d += 32) {
    const float wv = ld(w + d);
    st(y + d, ld(o + d) * inv * (a.zero_centred ? 1.0f + wv : wv) * silu_f(ld(z + d)));
  }
}

} // namespace

extern "C" upf_status upf_cuda_gdn_conv(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                                        const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gdn_conv_check(batch, x, w, state_in, state_out, y));
  conv_args a = {};
  a.x = x->data, a.x_s0 = x->stride[0];
  a.w = w->data, a.w_s0 = w->stride[0];
  a.state_in = state_in ? (const float *)state_in->data : nullptr;
  a.state_out = state_out ? (float *)state_out->data : nullptr;
  a.y = y->data, a.y_s0 = y->stride[0];
  a.cu = batch->cu_seqlens, a.num_reqs = batch->num_reqs;
  a.T = x->shape[0], a.C = x->shape[1], a.K = (int)w->shape[1];
  cudaStream_t stream = upf_cuda_stream();
  const int block = 256;
  const bool bf = x->dtype == UPF_DTYPE_BF16;
  if (a.T > 0) {
    unsigned grid = grid_for(a.T * a.C, block);
    if (bf)
      conv_kernel<bf16_t><<<grid, block, 0, stream>>>(a);
    else
      conv_kernel<float><<<grid, block, 0, stream>>>(a);
    UPF_CUDA_LAUNCH_TRY("conv_kernel");
  }
  if (state_out && a.num_reqs > 0) {
    unsigned grid = grid_for((int64_t)a.num_reqs * (a.K - 1) * a.C, block);
    if (bf)
      conv_state_kernel<bf16_t><<<grid, block, 0, stream>>>(a);
    else
      conv_state_kernel<float><<<grid, block, 0, stream>>>(a);
    UPF_CUDA_LAUNCH_TRY("conv_state_kernel");
  }
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gdn_conv_step(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state,
                                             const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gdn_conv_step_check(x, w, state, y));
  conv_args a = {};
  a.x = x->data, a.x_s0 = x->stride[0];
  a.w = w->data, a.w_s0 = w->stride[0];
  a.state_out = (float *)state->data;
  a.y = y->data, a.y_s0 = y->stride[0];
  a.T = x->shape[0], a.C = x->shape[1], a.K = (int)w->shape[1];
  if (a.T == 0)
    return UPF_OK;
  const int block = 256;
  unsigned grid = grid_for(a.T * a.C, block);
  if (x->dtype == UPF_DTYPE_BF16)
    conv_step_kernel<bf16_t><<<grid, block, 0, upf_cuda_stream()>>>(a);
  else
    conv_step_kernel<float><<<grid, block, 0, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("conv_step_kernel");
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gdn_scan(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                                        const upf_tensor *state_out) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gdn_scan_check(batch, in, o, state_out));
  const int64_t Hk = in->q->shape[1], Dk = in->q->shape[2], Hv = in->v->shape[1], Dv = in->v->shape[2];
  if (Dv > 1024)
    return upf_fail(UPF_ERR_UNSUPPORTED, "gdn.scan (cuda): Dv=%lld exceeds the 1024 threads of a CTA", (long long)Dv);
  const size_t smem = (size_t)(Dk * Dv + 2 * Dk) * sizeof(float);
  if (smem > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "gdn.scan (cuda): a %lld x %lld fp32 state (%zu bytes) exceeds the %zu bytes "
                    "of shared memory a CTA may use", (long long)Dk, (long long)Dv, smem, upf_cuda_smem_optin());
  if ((int64_t)batch->num_reqs * Hv > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "gdn.scan (cuda): %d requests x %lld heads exceed the grid", batch->num_reqs,
                    (long long)Hv);
  if (batch->num_reqs == 0)
    return UPF_OK;
  upf_variant form;
  UPF_TRY(upf_variant_current(UPF_OP_GDN_SCAN, &form));
  if (form != UPF_VARIANT_GDN_SCAN_RECURRENT && upf_cuda_gdn_scan_chunked_fits(in)) {
    int32_t longest = 0;
    for (int32_t r = 0; r < batch->num_reqs; r++) {
      const int32_t n = batch->cu_seqlens_host[r + 1] - batch->cu_seqlens_host[r];
      longest = n > longest ? n : longest;
    }
    if (longest >= UPF_GDN_CHUNKED_MIN_TOKENS)
      return upf_cuda_gdn_scan_chunked(batch, in, o, state_out);
  }
  scan_args a = {};
  a.q = in->q->data, a.q_s0 = in->q->stride[0], a.q_s1 = in->q->stride[1];
  a.k = in->k->data, a.k_s0 = in->k->stride[0], a.k_s1 = in->k->stride[1];
  a.v = in->v->data, a.v_s0 = in->v->stride[0], a.v_s1 = in->v->stride[1];
  a.a = in->a->data, a.a_s0 = in->a->stride[0];
  a.b = in->b->data, a.b_s0 = in->b->stride[0];
  a.a_log = (const float *)in->a_log->data, a.dt_bias = (const float *)in->dt_bias->data;
  a.state_in = in->state_in ? (const float *)in->state_in->data : nullptr;
  a.state_out = state_out ? (float *)state_out->data : nullptr;
  a.o = o->data, a.o_s0 = o->stride[0], a.o_s1 = o->stride[1];
  a.cu = batch->cu_seqlens;
  a.hk = (int)Hk, a.hv = (int)Hv, a.dk = (int)Dk, a.dv = (int)Dv;
  a.scale = in->scale;
  if (in->v->dtype == UPF_DTYPE_BF16)
    return o->dtype == UPF_DTYPE_BF16 ? launch_scan<bf16_t, bf16_t>(a, batch->num_reqs, smem)
                                      : launch_scan<bf16_t, float>(a, batch->num_reqs, smem);
  return launch_scan<float, float>(a, batch->num_reqs, smem);
}

extern "C" upf_status upf_cuda_gdn_gated_norm(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w,
                                              const upf_norm_params *p, const upf_tensor *y) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_gdn_gated_norm_check(o, z, w, p, y));
  gnorm_args a = {};
  a.o = o->data, a.o_s0 = o->stride[0], a.o_s1 = o->stride[1];
  a.z = z->data, a.z_s0 = z->stride[0], a.z_s1 = z->stride[1];
  a.w = w->data;
  a.y = y->data, a.y_s0 = y->stride[0], a.y_s1 = y->stride[1];
  a.heads = o->shape[1], a.rows = o->shape[0] * o->shape[1], a.d = o->shape[2];
  a.eps = p->eps, a.zero_centred = p->zero_centred;
  if (a.rows == 0)
    return UPF_OK;
  const int block = 256; /* 8 rows a CTA */
  int64_t grid = (a.rows * 32 + block - 1) / block;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "gdn.gated_norm (cuda): %lld rows exceed the grid", (long long)a.rows);
  if (o->dtype == UPF_DTYPE_BF16)
    gated_norm_kernel<bf16_t><<<(unsigned)grid, block, 0, upf_cuda_stream()>>>(a);
  else
    gated_norm_kernel<float><<<(unsigned)grid, block, 0, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("gated_norm_kernel");
  return UPF_OK;
}

/* The FFMA attention kernel: the one that takes every shape (f32 and bf16, any head dim up to 256,
 * contiguous or paged K/V, unaligned views), and the fixed-order merge of split-KV parts.
 *
 * attn_ffma_kernel<T, DPL, PAGED>: FFMA in fp32 (no TF32). A CTA (8 warps) owns a tile of ATT_BR = 16
 * (token, group head) rows of one request and one kv head (cuda/attn_kernels.cuh), so a decode step's
 * whole GQA group shares one read of each K/V tile. K and V tiles of ATT_KT = 32 keys are staged in
 * shared memory as fp32 with rows padded to D+1 (lane j reading key j's column e hits bank (j + e) % 32:
 * conflict-free); q rows live in shared memory too. Each warp owns two rows: lane j takes the logit of
 * key kv0 + j, the warp reduces max and sum by xor-butterflies (a fixed order: deterministic), and the
 * lane owning dims e = lane + 32 i accumulates p_j * v_j[e] with p_j broadcast by shuffle - the
 * FlashAttention-2 online softmax (running max m, running sum l, rescale by exp(m_old - m_new)).
 * Masking (causal, bottom-right aligned, window, tile end) sets the logit to -inf before the max;
 * soft-cap is tanh on the scaled logit. PAGED reads K/V rows through the block table.
 * Split-KV: when the tiles alone cannot fill the GPU (decode, short batches with long contexts), the
 * plan (cuda/attn.cu) cuts a tile's KV range into chunks that run as separate CTAs writing normalised
 * partial outputs and their LSE to the workspace; attn_combine_kernel merges them in chunk order (no
 * atomics, so the result does not depend on scheduling). The mma decode kernel's parts merge the same
 * way. */
#include <math.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"

namespace upf_attn {
namespace {

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T, int DPL, bool PAGED>
__global__ void __launch_bounds__(ATT_WARPS * 32) attn_ffma_kernel(const __grid_constant__ attn_args a) {
  extern __shared__ float smem[];
  const int d = a.d, ds = d + 1;
  float *qs = smem;             /* [ATT_BR][d] */
  float *ks = qs + ATT_BR * d;  /* [ATT_KT][d + 1] */
  float *vs = ks + ATT_KT * ds; /* [ATT_KT][d + 1] */
  const attn_tile tile = a.tiles[blockIdx.x];
  const int hk = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pos_off = tile.kv_len - tile.q_len;
  const T *Q = (const T *)a.q, *K = (const T *)a.k, *V = (const T *)a.v;

  for (int i = threadIdx.x; i < ATT_BR * d; i += blockDim.x) {
    const int r = i / d, e = i - r * d, ridx = tile.row0 + r;
    const int t = ridx / a.group, g = ridx - t * a.group;
    float x = 0.0f;
    if (t < tile.q_len)
      x = to_f(Q[(int64_t)(tile.q0 + t) * a.q_s0 + (int64_t)(hk * a.group + g) * a.q_s1 + e]);
    qs[i] = x;
  }

  float m[ATT_ROWS_PER_WARP], l[ATT_ROWS_PER_WARP], o[ATT_ROWS_PER_WARP][DPL];
  int pos[ATT_ROWS_PER_WARP], lo[ATT_ROWS_PER_WARP];
  bool valid[ATT_ROWS_PER_WARP];
#pragma unroll
  for (int rr = 0; rr < ATT_ROWS_PER_WARP; rr++) {
    const int t = (tile.row0 + warp * ATT_ROWS_PER_WARP + rr) / a.group;
    valid[rr] = t < tile.q_len;
    pos[rr] = t + pos_off;
    lo[rr] = a.window > 0 ? pos[rr] - a.window + 1 : 0; /* may be negative: every key >= 0 passes */
    m[rr] = -INFINITY, l[rr] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++)
      o[rr][i] = 0.0f;
  }

  for (int kv0 = tile.kv_lo; kv0 < tile.kv_hi; kv0 += ATT_KT) {
    __syncthreads(); /* the previous tile is consumed (first pass: q is staged) */
    if (sizeof(T) == 2 && a.vec8) { /* 16-byte loads: 8 bf16 per thread and load */
      const int cpr = d / 8;
      for (int i = threadIdx.x; i < ATT_KT * cpr; i += blockDim.x) {
        const int j = i / cpr, e = (i - j * cpr) * 8, kj = kv0 + j;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
        if (kj < tile.kv_hi) {
          int64_t ko, vo;
          kv_offsets<PAGED>(a, tile, kj, hk, &ko, &vo);
          kx = *reinterpret_cast<const uint4 *>(K + ko + e);
          vx = *reinterpret_cast<const uint4 *>(V + vo + e);
        }
        const bf16_t *kh = reinterpret_cast<const bf16_t *>(&kx), *vh = reinterpret_cast<const bf16_t *>(&vx);
#pragma unroll
        for (int u = 0; u < 8; u++) {
          ks[j * ds + e + u] = to_f(kh[u]);
          vs[j * ds + e + u] = to_f(vh[u]);
        }
      }
    } else {
      for (int i = threadIdx.x; i < ATT_KT * d; i += blockDim.x) {
        const int j = i / d, e = i - j * d, kj = kv0 + j;
        float kx = 0.0f, vx = 0.0f;
        if (kj < tile.kv_hi) {
          int64_t ko, vo;
          kv_offsets<PAGED>(a, tile, kj, hk, &ko, &vo);
          kx = to_f(K[ko + e]), vx = to_f(V[vo + e]);
        }
        ks[j * ds + e] = kx;
        vs[j * ds + e] = vx;
      }
    }
    __syncthreads();
    const int kj = kv0 + lane;
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS_PER_WARP; rr++) {
      if (!valid[rr]) /* warp-uniform */
        continue;
      const float *qr = qs + (warp * ATT_ROWS_PER_WARP + rr) * d, *kr = ks + lane * ds;
      float dot = 0.0f;
#pragma unroll 8
      for (int e = 0; e < d; e++)
        dot = fmaf(qr[e], kr[e], dot);
      float s = dot * a.scale;
      if (a.softcap > 0.0f)
        s = a.softcap * tanhf(s / a.softcap);
      const bool vis = kj < tile.kv_hi && kj <= pos[rr] && kj >= lo[rr];
      s = vis ? s : -INFINITY;
      const float mn = fmaxf(m[rr], warp_max(s));
      if (mn == -INFINITY) /* warp-uniform: nothing visible yet to this row */
        continue;
      const float p = vis ? expf(s - mn) : 0.0f;
      const float alpha = expf(m[rr] - mn); /* 0 on the first visible tile (m = -inf) */
      l[rr] = l[rr] * alpha + warp_sum(p);
#pragma unroll
      for (int i = 0; i < DPL; i++)
        o[rr][i] *= alpha;
      for (int j = 0; j < ATT_KT; j++) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.0f) /* warp-uniform: masked or underflowed keys add nothing */
          continue;
        const float *vr = vs + j * ds;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
          const int e = lane + 32 * i;
          if (e < d)
            o[rr][i] = fmaf(pj, vr[e], o[rr][i]);
        }
      }
      m[rr] = mn;
    }
  }

#pragma unroll
  for (int rr = 0; rr < ATT_ROWS_PER_WARP; rr++) {
    if (!valid[rr])
      continue;
    const int r = warp * ATT_ROWS_PER_WARP + rr, ridx = tile.row0 + r;
    const int t = ridx / a.group, hq = hk * a.group + (ridx - t * a.group);
    const int64_t tok = (int64_t)tile.q0 + t;
    if (tile.part < 0) { /* every row sees at least its own key: l > 0 */
      const float inv = 1.0f / l[rr];
      T *orow = (T *)a.out + tok * a.o_s0 + (int64_t)hq * a.o_s1;
#pragma unroll
      for (int i = 0; i < DPL; i++) {
        const int e = lane + 32 * i;
        if (e < d)
          orow[e] = from_f<T>(o[rr][i] * inv);
      }
      if (a.lse && lane == 0)
        a.lse[tok * a.hq + hq] = m[rr] + logf(l[rr]);
    } else { /* a chunk may hold none of this row's keys: l = 0, lse = -inf, weight 0 in the merge */
      const int64_t slot = ((int64_t)tile.part * a.hkv + hk) * ATT_BR + r;
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; i++) {
        const int e = lane + 32 * i;
        if (e < d)
          a.part_o[slot * d + e] = o[rr][i] * inv;
      }
      if (lane == 0)
        a.part_lse[slot] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : -INFINITY;
    }
  }
}

/* Merges the split chunks of one tile in chunk order: weights exp(lse_s - max lse). */
template <typename T> __global__ void __launch_bounds__(256) attn_combine_kernel(const __grid_constant__ attn_args a) {
  const attn_group gr = a.groups[blockIdx.x];
  const int hk = blockIdx.y, d = a.d;
  for (int r = 0; r < ATT_BR; r++) {
    const int ridx = gr.row0 + r, t = ridx / a.group;
    if (t >= gr.q_len)
      break; /* rows are token-major: the rest are past the request too */
    const int hq = hk * a.group + (ridx - t * a.group);
    const int64_t tok = (int64_t)gr.q0 + t;
    float mx = -INFINITY;
    for (int s = 0; s < gr.nsplit; s++)
      mx = fmaxf(mx, a.part_lse[((int64_t)(gr.first_part + s) * a.hkv + hk) * ATT_BR + r]);
    float sum = 0.0f;
    for (int s = 0; s < gr.nsplit; s++)
      sum += expf(a.part_lse[((int64_t)(gr.first_part + s) * a.hkv + hk) * ATT_BR + r] - mx);
    const float inv = 1.0f / sum;
    T *orow = (T *)a.out + tok * a.o_s0 + (int64_t)hq * a.o_s1;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
      float acc = 0.0f;
      for (int s = 0; s < gr.nsplit; s++) {
        const int64_t slot = ((int64_t)(gr.first_part + s) * a.hkv + hk) * ATT_BR + r;
        acc = fmaf(expf(a.part_lse[slot] - mx), a.part_o[slot * d + e], acc);
      }
      orow[e] = from_f<T>(acc * inv);
    }
    if (a.lse && threadIdx.x == 0)
      a.lse[tok * a.hq + hq] = mx + logf(sum);
  }
}

template <typename T, int DPL, bool PAGED> upf_status launch_ffma_kernel(attn_args &a, int ntiles) {
  const size_t smem = (size_t)(ATT_BR * a.d + 2 * ATT_KT * (a.d + 1)) * sizeof(float);
  if (smem > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "attn (cuda): D=%d needs %zu bytes of shared memory, the device has %zu",
                    a.d, smem, upf_cuda_smem_optin());
  UPF_CUDA_TRY(cudaFuncSetAttribute(attn_ffma_kernel<T, DPL, PAGED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem));
  attn_ffma_kernel<T, DPL, PAGED><<<dim3((unsigned)ntiles, (unsigned)a.hkv), ATT_WARPS * 32, smem,
                                    upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_ffma_kernel");
  return UPF_OK;
}

/* DPL = dims a lane accumulates: D <= 64, 128, 256. */
template <typename T, bool PAGED> upf_status launch_ffma_d(attn_args &a, int ntiles) {
  if (a.d <= 64)
    return launch_ffma_kernel<T, 2, PAGED>(a, ntiles);
  if (a.d <= 128)
    return launch_ffma_kernel<T, 4, PAGED>(a, ntiles);
  return launch_ffma_kernel<T, 8, PAGED>(a, ntiles);
}

template <typename T> upf_status launch_combine_kernel(attn_args &a, int ngroups) {
  attn_combine_kernel<T><<<dim3((unsigned)ngroups, (unsigned)a.hkv), 128, 0, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_combine_kernel");
  return UPF_OK;
}

} // namespace

upf_status launch_ffma(attn_args &a, upf_dtype dtype, bool paged, int ntiles) {
  if (dtype == UPF_DTYPE_BF16)
    return paged ? launch_ffma_d<bf16_t, true>(a, ntiles) : launch_ffma_d<bf16_t, false>(a, ntiles);
  return paged ? launch_ffma_d<float, true>(a, ntiles) : launch_ffma_d<float, false>(a, ntiles);
}

upf_status launch_combine(attn_args &a, upf_dtype dtype, int ngroups) {
  if (ngroups <= 0)
    return UPF_OK;
  return dtype == UPF_DTYPE_BF16 ? launch_combine_kernel<bf16_t>(a, ngroups) : launch_combine_kernel<float>(a, ngroups);
}

} // namespace upf_attn

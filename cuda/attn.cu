/* CUDA attention: varlen causal prefill, paged attention and the paged cache write.
 *
 * attn_ffma_kernel<T, DPL, PAGED>: the one attention kernel of this file, FFMA in fp32 (no TF32), for
 * f32 and bf16 inputs and any head dim up to 256. A CTA (8 warps) owns a tile of ATT_BR = 16 "rows"
 * of one request and one kv head, a row being a (query token, q head of the kv head's GQA group) pair
 * taken in token-major order, so a decode step's whole GQA group shares one CTA and one read of each K/V
 * tile. K and V tiles of ATT_KT = 32 keys are staged in shared memory as fp32 with rows padded to D+1
 * (lane j reading key j's column e hits bank (j + e) % 32: conflict-free); q rows live in shared memory
 * too. Each warp owns two rows: lane j takes the logit of key kv0 + j, the warp reduces max and sum by
 * xor-butterflies (a fixed order: deterministic), and the lane owning dims e = lane + 32 i accumulates
 * p_j * v_j[e] with p_j broadcast by shuffle - the FlashAttention-2 online softmax (running max m,
 * running sum l, rescale by exp(m_old - m_new)). Masking (causal, bottom-right aligned, window,
 * tile end) sets the logit to -inf before the max; soft-cap is tanh on the scaled logit.
 * Split-KV: when the tiles alone cannot fill the GPU (decode, short batches with long contexts), a
 * tile's KV range is cut into chunks that run as separate CTAs writing normalised partial outputs and
 * their LSE to the workspace; attn_combine_kernel merges them in chunk order (no atomics, so the
 * result does not depend on scheduling).
 * Paged variants read K/V rows through the block table (PAGED = true), everything else is shared.
 * attn_fa2_kernel<D, BN, STAGES, PAGED, BM>: the bf16 tensor-core prefill (FlashAttention-2 forward with
 * mma.sync m16n8k16, fp32 accumulation, 128-row tiles, 64-row ones for sliding windows at D = 64/256
 * by UPF_ATTN_SWA_BM (see fa2_tile_rows), cp.async K/V ring) for D = 64/128/256 with 16-byte aligned
 * rows; see its comment. attn_fa2_persistent_kernel: the same tiles at D = 64/256 with one CTA a resident
 * slot looping over them, the next tile's loads issued under the current one's last P V, by
 * UPF_ATTN_SWA_SCHED (see fa2_schedule_selected; the grid form is the default).
 * attn_wgmma2_kernel / attn_wgmma_kernel: the Hopper prefill (wgmma, warp-specialised producer and
 * consumers) that bf16 D = 128 over contiguous K/V takes instead of the FA2 kernel, by UPF_ATTN_PREFILL
 * (see prefill_kernel_selected; the FlashAttention-3 form without ping-pong is the default).
 * attn.prefill takes the tensor-core path for bf16 at those head dims, the FFMA kernel otherwise (f32,
 * odd D, unaligned views); attn.paged takes it (PAGED) for requests of at least MMA_MIN_Q_ROWS query
 * rows (prefill against the cache) and the FFMA kernel for the rest (decode rows: GQA packing and
 * split-KV matter more there), two launches writing disjoint rows. Those decode rows go, where the mma
 * path's layout holds, to attn_decode_mma_kernel (mma.sync, the default) or attn_decode_v2_kernel
 * (FFMA) by UPF_ATTN_DECODE (see decode_kernel_selected).
 * kv_cache_write_kernel: one CTA per token row, k and v rows to their slot. */
#include <math.h>
#include <stdlib.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/mma_sync.cuh"
#include "cuda/wgmma.cuh"
#include "uniprefill/env.h"

namespace {

typedef __nv_bfloat16 bf16_t;

constexpr int ATT_BR = 16;     /* rows per CTA */
constexpr int ATT_KT = 32;     /* keys per shared-memory tile = lanes of a warp */
constexpr int ATT_WARPS = 8;   /* ATT_BR / ATT_WARPS = 2 rows per warp */
constexpr int ATT_ROWS_PER_WARP = ATT_BR / ATT_WARPS;
constexpr int ATT_SPLIT_MIN = 256; /* fewest keys a split-KV chunk takes */
constexpr int ATT_SPLIT_WAVES = 4; /* split-KV fills this many CTAs per SM (41 KB of shared memory each at D=128) */

/* One CTA's work: rows [row0, row0 + ATT_BR) of request req over keys [kv_lo, kv_hi). */
struct attn_tile {
  int32_t q0, q_len;   /* first query token and query rows of the request */
  int32_t kv_len;      /* the request's keys; query t sits at kv position t + kv_len - q_len */
  int32_t kv_base;     /* contiguous K/V: first kv row of the request */
  int32_t req;         /* paged: block-table row */
  int32_t row0;        /* first (token, group head) row, token-major */
  int32_t kv_lo, kv_hi;
  int32_t part;        /* -1: writes out/lse; else its partial-output slot */
};

/* Merge of one split tile: its parts are [first_part, first_part + nsplit). */
struct attn_group {
  int32_t q0, q_len, row0, first_part, nsplit;
};

struct attn_args {
  const void *q;       /* (Tq, Hq, D) */
  int64_t q_s0, q_s1;
  const void *k, *v;   /* contiguous (Tkv, Hkv, D): s0 row, s1 head; paged (pages, P, Hkv, D): s0, s1, s2 */
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
  void *out;           /* (Tq, Hq, D) */
  int64_t o_s0, o_s1;
  float *lse;          /* (Tq, Hq) or NULL */
  const int32_t *block_table; /* (B, max_blocks) */
  int32_t max_blocks, page_size;
  const attn_tile *tiles;
  const attn_group *groups;
  float *part_o;       /* (parts, Hkv, ATT_BR, D) */
  float *part_lse;     /* (parts, Hkv, ATT_BR) */
  int hq, hkv, group, d;
  float scale, softcap;
  int window;
  int vec8;            /* bf16 K/V rows in 16-byte aligned runs of 8 (FFMA kernel: vector tile loads) */
  int32_t *work_next;  /* (1) persistent FA2: items taken after the first gridDim.x; zeroed before each launch */
  int32_t work_items;  /* persistent FA2: tiles x q heads */
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float x) { return __float2bfloat16_rn(x); }

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

/* Element offsets of kv head hk of the tile's logical key kj in k and v. */
template <bool PAGED>
__device__ __forceinline__ void kv_offsets(const attn_args &a, const attn_tile &t, int kj, int hk, int64_t *ko,
                                           int64_t *vo) {
  if (PAGED) {
    const int64_t page = a.block_table[(int64_t)t.req * a.max_blocks + kj / a.page_size];
    const int64_t slot = kj % a.page_size;
    *ko = page * a.k_s0 + slot * a.k_s1 + (int64_t)hk * a.k_s2;
    *vo = page * a.v_s0 + slot * a.v_s1 + (int64_t)hk * a.v_s2;
  } else {
    const int64_t row = (int64_t)t.kv_base + kj;
    *ko = row * a.k_s0 + (int64_t)hk * a.k_s1;
    *vo = row * a.v_s0 + (int64_t)hk * a.v_s1;
  }
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

/* ---- The bf16 tensor-core prefill (FlashAttention-2 forward) ----
 * Per KV tile of BN keys each warp computes S (16 x BN) = Q K^T by mma.sync m16n8k16 (bf16 in, fp32
 * accumulate), scale, soft-cap and masks in registers, the online softmax on the accumulator layout (a
 * row's 4 owner lanes reduce by xor 1, 2), then P (rounded to bf16, as FlashAttention does) times V
 * by mma into O (16 x D per warp, fp32). The S accumulator layout is exactly the A-operand layout of
 * the P.V mma, so P never leaves registers. Q, K, V tiles sit in shared memory with rows padded by 16
 * bytes: an ldmatrix phase's 8 row addresses hit 8 distinct 16-byte bank groups.
 * Fragment layouts (PTX ISA, mma.m16n8k16 .bf16): g = lane / 4, t = lane % 4;
 *   A regs {row g, cols 2t..2t+1}, {row g+8, same}, {row g, cols 2t+8..}, {row g+8, cols 2t+8..};
 *   B regs {k 2t..2t+1, col g}, {k 2t+8.., col g};  C {row g, cols 2t, 2t+1}, {row g+8, same}.
 * The fragment helpers (pack_bf16, mma_bf16, ldmatrix, cp.async) are cuda/mma_sync.cuh's. */
using upf_mma::cp_async16;
using upf_mma::cp_async_commit;
using upf_mma::cp_async_wait;
using upf_mma::ldsm_x4;
using upf_mma::ldsm_x4_trans;
using upf_mma::mma_bf16;
using upf_mma::pack_bf16;

/* attn_fa2_kernel<D, BN, STAGES, PAGED, BM>: a CTA of BM / 16 warps owns BM (FA_BM = 128, or FA_SWA_BM
 * below) query rows of one request and one q head; warp w owns rows [16w, 16w + 16). (Its first version,
 * 64-row tiles with synchronous loads, ran at 157 TFLOP/s against this one's 261 at Llama 32K:
 * perf/NOTES.md.)
 *  - K/V tiles stream through a STAGES-deep cp.async ring (tile t + STAGES - 1 is in flight while
 *    tile t is computed); Q arrives with the first tile's group. Rows past the request or past the
 *    tile's key range are zero-filled by cp.async's src-size 0 (zero V rows: P = 0 times 0, never NaN).
 *  - every fragment comes from ldmatrix: Q (A operand, kept in registers for D <= 128), K (.x4 gives
 *    the B fragments of two n-tiles), V (.x4.trans).
 *  - the softmax runs in base 2 with the scale (and log2 e) folded into one multiply per logit;
 *    LSE = (m + log2 l) ln 2.
 *  - masks are evaluated only on tiles that cross a warp's diagonal, window edge or the range end
 *    (warp-uniform test); a warp none of whose rows sees any key of a tile skips that tile's math.
 *  - the launch is one-dimensional, heads fastest, over tiles sorted by decreasing key span: the
 *    heaviest (latest causal) tiles start first, and the q heads of one kv head run side by side and
 *    share K/V through L2.
 * BM = FA_SWA_BM = 64 (4 warps, two CTAs an SM) is an optional tile of windowed rows at D = 64 and 256
 * (UPF_ATTN_SWA_BM=64, see fa2_tile_rows): a BM-row tile of a window w computes w + BM - 1 keys for w
 * visible a row, so half the rows halve that excess, and a second CTA an SM could run its main loop
 * through the other's Q load, ring fill and epilogue. Measured on the H200 it is slower than 128 rows
 * (1.35x against 1.18x of global per visible key at 64K): 128 stays the default. */
constexpr int FA_BM = 128;
constexpr int FA_SWA_BM = 64;
constexpr int FA_WARPS = 8;
constexpr int FA_THREADS = FA_WARPS * 32;
constexpr float FA_LOG2E = 1.4426950408889634f;
constexpr float FA_LN2 = 0.6931471805599453f;

/* The parts of the FlashAttention-2 step that attn_fa2_kernel (mma.sync) and attn_wgmma_kernel share: both
 * hold S, P and O in the m16n8 accumulator layout, where this thread owns rows g and g + 8 (i = c >> 1) of
 * the warp's 16 and, in n-block j, keys kv0 + 8j + 2 t4 + (c & 1). */

/* Logits s to base-2 exponents p (scale and soft-cap folded into mul, cap2); where `masked`, keys past
 * kv_hi, after the row's position or before its window start become -inf. p may be s. */
template <int NT>
__device__ __forceinline__ void fa_exponents(const float (&s)[NT][4], float (&p)[NT][4], bool capped, float mul,
                                             float cap2, bool masked, int kv0, int t4, int kv_hi,
                                             const int (&pos)[2], const int (&lo)[2]) {
  if (capped) { /* warp-uniform branches: the common case is one multiply per logit */
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int c = 0; c < 4; c++)
        p[j][c] = cap2 * tanhf(s[j][c] * mul);
  } else {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int c = 0; c < 4; c++)
        p[j][c] = s[j][c] * mul;
  }
  if (masked) {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int i = c >> 1, kj = kv0 + j * 8 + t4 * 2 + (c & 1);
        p[j][c] = kj < kv_hi && kj <= pos[i] && kj >= lo[i] ? p[j][c] : -INFINITY;
      }
  }
}

/* The online-softmax step of the mma.sync and wgmma kernels, on a tile of base-2 exponents x (NT 8-key
 * blocks in the accumulator layout: rows g and g + 8 of the warp's 16, a row spread over a quad's 4
 * lanes): the tile's row max (over the quad by xor 1, 2), the new running max m, alpha = exp2(m_old -
 * m_new) for the caller to scale O by, x <- p = exp2(x - m_new), l <- l alpha + this lane's part of the
 * row sum (the 4 parts meet at the end). A row with nothing visible yet keeps m = -inf and gets p = 0. */
/* mt[i] <- the max of mt[i] and this lane's entries of row i of the tile x (i = 0: row g, 1: row g + 8);
 * fa_quad_max then takes a row's max over the quad's 4 lanes (xor 1, 2). */
template <int NT> __device__ __forceinline__ void fa_lane_row_max(const float (&x)[NT][4], float (&mt)[2]) {
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int c = 0; c < 4; c++)
      mt[c >> 1] = fmaxf(mt[c >> 1], x[j][c]);
}

__device__ __forceinline__ float fa_quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

template <int NT>
__device__ __forceinline__ void fa_online_softmax(float (&x)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
  float mt[2] = {-INFINITY, -INFINITY};
  fa_lane_row_max<NT>(x, mt);
  float mref[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 2; i++) {
    mt[i] = fa_quad_max(mt[i]);
    const float mn = fmaxf(m[i], mt[i]);
    mref[i] = mn == -INFINITY ? 0.0f : mn; /* a row with nothing visible yet: exp2(-inf - 0) = 0 */
    alpha[i] = exp2f(m[i] - mref[i]);
    m[i] = mn;
  }
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      const float p = exp2f(x[j][c] - mref[c >> 1]);
      x[j][c] = p;
      rs[c >> 1] += p;
    }
#pragma unroll
  for (int i = 0; i < 2; i++)
    l[i] = l[i] * alpha[i] + rs[i];
}

/* O / l of this thread's rows (query rows wrow0 + g, + 8 of the tile, those inside the request) to out (bf16)
 * and, when asked, the LSE (m + log2 l) ln 2; l's 4 parts are summed first. */
template <int DT>
__device__ __forceinline__ void fa_store_rows(const attn_args &a, const attn_tile &tile, int hq, int wrow0, int g,
                                              int t4, const float (&m)[2], float (&l)[2], const float (&o)[DT][4]) {
#pragma unroll
  for (int i = 0; i < 2; i++) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int qt = wrow0 + g + 8 * i;
    if (qt >= tile.q_len)
      continue;
    const int64_t tok = (int64_t)tile.q0 + qt;
    const float inv = 1.0f / l[i]; /* every row sees at least its own key */
    bf16_t *orow = (bf16_t *)a.out + tok * a.o_s0 + (int64_t)hq * a.o_s1;
#pragma unroll
    for (int n = 0; n < DT; n++)
      *reinterpret_cast<__nv_bfloat162 *>(orow + n * 8 + t4 * 2) =
          __floats2bfloat162_rn(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    if (a.lse && t4 == 0)
      a.lse[tok * a.hq + hq] = (m[i] + log2f(l[i])) * FA_LN2;
  }
}

/* One key tile of attn_fa2_kernel and attn_fa2_persistent_kernel, in two halves so that the persistent
 * form can put a barrier between them: each row gets the same operations in the same order, so the same
 * bits, in either kernel. (attn_fa2_kernel had its inline copy until the H200 showed the helper form
 * verified and as fast: perf/NOTES.md.)
 * fa2_scores: S (16 x BN) = Q K^T for this warp's rows; Q fragments from registers (qf, D <= 128) or
 * from shared memory (q_lane), K from the stage ks_tile. */
template <int D, int BN>
__device__ __forceinline__ void fa2_scores(float (&s)[BN / 8][4], const uint32_t (&qf)[D <= 128 ? D / 16 : 1][4],
                                           const bf16_t *q_lane, const bf16_t *ks_tile, int k_lane) {
  constexpr int LD = D + 8, NT = BN / 8, KS = D / 16;
  constexpr bool Q_IN_REGS = D <= 128;
#pragma unroll
  for (int j = 0; j < NT; j++)
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    uint32_t qa[4];
    if (Q_IN_REGS) {
      qa[0] = qf[Q_IN_REGS ? ks : 0][0], qa[1] = qf[Q_IN_REGS ? ks : 0][1];
      qa[2] = qf[Q_IN_REGS ? ks : 0][2], qa[3] = qf[Q_IN_REGS ? ks : 0][3];
    } else {
      ldsm_x4(qa, q_lane + ks * 16);
    }
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t kb[4];
      ldsm_x4(kb, ks_tile + j * 8 * LD + k_lane + ks * 16);
      mma_bf16(s[j], qa[0], qa[1], qa[2], qa[3], kb[0], kb[1]);
      mma_bf16(s[j + 1], qa[0], qa[1], qa[2], qa[3], kb[2], kb[3]);
    }
  }
}

/* fa2_softmax_pv: the logits s to exponents (masked where asked), the online softmax (m, l of this
 * thread's two rows), O = O alpha + P V with V from the stage vs_tile. */
template <int D, int BN>
__device__ __forceinline__ void fa2_softmax_pv(float (&s)[BN / 8][4], float (&m)[2], float (&l)[2],
                                               float (&o)[D / 8][4], const bf16_t *vs_tile, int v_lane, bool capped,
                                               float mul, float cap2, bool masked, int kv0, int t4, int kv_hi,
                                               const int (&pos)[2], const int (&lo)[2]) {
  constexpr int LD = D + 8, NT = BN / 8, DT = D / 8;
  fa_exponents<NT>(s, s, capped, mul, cap2, masked, kv0, t4, kv_hi, pos, lo);
  float alpha[2];
  fa_online_softmax<NT>(s, m, l, alpha);
#pragma unroll
  for (int n = 0; n < DT; n++) {
    o[n][0] *= alpha[0], o[n][1] *= alpha[0];
    o[n][2] *= alpha[1], o[n][3] *= alpha[1];
  }
#pragma unroll
  for (int kk = 0; kk < BN / 16; kk++) {
    const uint32_t a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]), a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    const uint32_t a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    const uint32_t a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    const bf16_t *v0 = vs_tile + kk * 16 * LD + v_lane;
#pragma unroll
    for (int n = 0; n < DT; n += 2) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_trans(b0, b1, b2, b3, v0 + n * 8);
      mma_bf16(o[n], a0, a1, a2, a3, b0, b1);
      mma_bf16(o[n + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

template <int D, int BN, int STAGES, bool PAGED, int BM = FA_BM>
__global__ void __launch_bounds__(BM / 16 * 32, FA_BM / BM) attn_fa2_kernel(const __grid_constant__ attn_args a) {
  constexpr int LD = D + 8, NT = BN / 8, DT = D / 8, KS = D / 16, CH = D / 8, NTHREADS = BM / 16 * 32;
  constexpr bool Q_IN_REGS = D <= 128;
  static_assert(NT % 2 == 0 && DT % 2 == 0 && STAGES >= 2 && (BM == FA_BM || BM == FA_SWA_BM), "tile shape");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t *Qs = reinterpret_cast<bf16_t *>(smem_raw); /* [BM][LD] */
  bf16_t *Ks = Qs + BM * LD;                         /* [STAGES][BN][LD] */
  bf16_t *Vs = Ks + STAGES * BN * LD;                /* [STAGES][BN][LD] */
  const attn_tile tile = a.tiles[blockIdx.x / a.hq];
  const int hq = blockIdx.x % a.hq, hk = hq / a.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t4 = lane & 3;
  const int off = tile.kv_len - tile.q_len;
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;

  for (int c = threadIdx.x; c < BM * CH; c += NTHREADS) {
    const int r = c / CH, e = (c % CH) * 8, qt = tile.row0 + r;
    const bool ok = qt < tile.q_len;
    cp_async16(Qs + r * LD + e, ok ? Q + (int64_t)(tile.q0 + qt) * a.q_s0 + (int64_t)hq * a.q_s1 + e : Q, ok);
  }
  auto load_kv = [&](int stage, int kv0) {
    bf16_t *ks = Ks + stage * BN * LD, *vs = Vs + stage * BN * LD;
    for (int c = threadIdx.x; c < BN * CH; c += NTHREADS) {
      const int r = c / CH, e = (c % CH) * 8, kj = kv0 + r;
      const bool ok = kj < tile.kv_hi;
      int64_t ko = 0, vo = 0;
      if (ok)
        kv_offsets<PAGED>(a, tile, kj, hk, &ko, &vo);
      cp_async16(ks + r * LD + e, K + ko + e, ok);
      cp_async16(vs + r * LD + e, V + vo + e, ok);
    }
  };
  const int ntiles = (tile.kv_hi - tile.kv_lo + BN - 1) / BN;
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) { /* one group per stage, empty ones too: the wait count stays fixed */
    if (s < ntiles)
      load_kv(s, tile.kv_lo + s * BN);
    cp_async_commit();
  }

  /* This warp's rows; rows past the request borrow the last row's position (never written). */
  const int wrow0 = tile.row0 + warp * 16;
  int pos[2], lo[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    int qt = wrow0 + g + 8 * i;
    qt = qt < tile.q_len ? qt : tile.q_len - 1;
    pos[i] = qt + off;
    lo[i] = a.window > 0 ? pos[i] - a.window + 1 : 0;
  }
  const int wpos_first = (wrow0 < tile.q_len ? wrow0 : tile.q_len - 1) + off;
  const int wpos_last = (wrow0 + 15 < tile.q_len ? wrow0 + 15 : tile.q_len - 1) + off;
  const int wlo_first = a.window > 0 ? wpos_first - a.window + 1 : 0;
  const int wlo_last = a.window > 0 ? wpos_last - a.window + 1 : 0;
  const bool capped = a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E; /* logit -> base-2 exponent */
  const float cap2 = a.softcap * FA_LOG2E;

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; n++)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  uint32_t qf[Q_IN_REGS ? KS : 1][4];
  /* ldmatrix lane addresses: Q rows (g, g + 8 | cols +8 for lanes 16..31), K keys (+8 for lanes
   * 16..31 | dims +8 for lanes 8..15, 24..31), V keys (+8 for lanes 8..15, 24..31 | dims +8 for 16..31) */
  const bf16_t *q_lane = Qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
  const int k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
  const int v_lane = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;

  for (int it = 0; it < ntiles; it++) {
    const int kv0 = tile.kv_lo + it * BN, stage = it % STAGES;
    cp_async_wait<STAGES - 2>();
    __syncthreads(); /* tile it (and Q) landed for every thread; tile it - 1's stage is consumed */
    if (it + STAGES - 1 < ntiles)
      load_kv((it + STAGES - 1) % STAGES, kv0 + (STAGES - 1) * BN);
    cp_async_commit();
    if (Q_IN_REGS && it == 0) {
#pragma unroll
      for (int ks = 0; ks < (Q_IN_REGS ? KS : 0); ks++)
        ldsm_x4(qf[ks], q_lane + ks * 16);
    }
    /* warp-uniform: no row of this warp sees any key of the tile */
    if (kv0 > wpos_last || kv0 + BN <= wlo_first)
      continue;
    const bf16_t *ks_tile = Ks + stage * BN * LD, *vs_tile = Vs + stage * BN * LD;

    float s[NT][4];
    fa2_scores<D, BN>(s, qf, q_lane, ks_tile, k_lane);
    /* logits to base-2 exponents; masks only where the tile crosses a diagonal, window edge or end */
    const bool masked = kv0 + BN - 1 > wpos_first || kv0 + BN > tile.kv_hi || (a.window > 0 && kv0 < wlo_last);
    fa2_softmax_pv<D, BN>(s, m, l, o, vs_tile, v_lane, capped, mul, cap2, masked, kv0, t4, tile.kv_hi, pos, lo);
  }
  cp_async_wait<0>(); /* no copy outlives the CTA (the trailing groups are empty) */
  fa_store_rows<DT>(a, tile, hq, wrow0, g, t4, m, l, o);
}

/* attn_fa2_persistent_kernel<D, BN, STAGES, PAGED, BM>: attn_fa2_kernel's tiles with one CTA a resident slot
 * (UPF_ATTN_SWA_SCHED=persistent, see fa2_schedule_selected) instead of one CTA a tile. Work items are
 * attn_fa2_kernel's blocks (item i: tile i / hq, q head i % hq; tiles sorted by decreasing key span):
 * CTA b starts with item b and takes each next one from a.work_next (atomicAdd, greedy: the longest
 * items still open go to whichever CTA frees first). The gain is the overlap: the next item's Q and first
 * STAGES - 1 key tiles are issued in the current item's last key tile, right after the barrier that
 * follows its last Q K^T, so the last P V, the normalisation and the output stores run while they land;
 * the grid form exposes that fill at the start of every CTA. (Measured at b36dc5a: the same bits, ~4%
 * slower than the grid form on global and window alike, from ~4% more instructions in the loop; the fill
 * was not exposed. Kept as a verified switch, not the default: perf/NOTES.md.)
 *  - ring: key tile it of an item sits in stage (base + it) % STAGES, base = the CTA's key tiles before
 *    the item, so the ring runs on across items. At the last tile's barrier (1) every stage but the
 *    current one is consumed and none has a copy pending (the last tile issued, ntiles - 1, is the
 *    current one); Q is free after barrier (2), which follows the last Q K^T (Q is read from shared
 *    memory every tile at D = 256; at D <= 128 it went to registers at tile 0, before (2) too).
 *  - cp.async groups: the next item's first groups are exactly the grid form's prologue (Q with key tile
 *    0, then one group a tile, empty ones too) and are the newest when its loop starts, so the
 *    wait_group STAGES - 2 of each of its tiles leaves exactly the grid form's groups in flight.
 *  - the next item's index and tile are fetched by thread 0 after barrier (1) of the last tile and read
 *    by all after barrier (2); the next write to those slots comes after barrier (1) of a later tile.
 * Each row's operations and their order are attn_fa2_kernel's (fa2_scores, fa2_softmax_pv, fa_store_rows):
 * the same bits as the grid form. */
template <int D, int BN, int STAGES, bool PAGED, int BM = FA_BM>
__global__ void __launch_bounds__(BM / 16 * 32, FA_BM / BM)
    attn_fa2_persistent_kernel(const __grid_constant__ attn_args a) {
  constexpr int LD = D + 8, NT = BN / 8, DT = D / 8, KS = D / 16, CH = D / 8, NTHREADS = BM / 16 * 32;
  constexpr bool Q_IN_REGS = D <= 128;
  static_assert(NT % 2 == 0 && DT % 2 == 0 && STAGES >= 2 && (BM == FA_BM || BM == FA_SWA_BM), "tile shape");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t *Qs = reinterpret_cast<bf16_t *>(smem_raw); /* [BM][LD] */
  bf16_t *Ks = Qs + BM * LD;                         /* [STAGES][BN][LD] */
  bf16_t *Vs = Ks + STAGES * BN * LD;                /* [STAGES][BN][LD] */
  __shared__ attn_tile next_tile_s;                  /* the next item's tile (valid when next_item_s < work_items) */
  __shared__ int next_item_s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t4 = lane & 3;
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;
  const bool capped = a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E; /* logit -> base-2 exponent */
  const float cap2 = a.softcap * FA_LOG2E;
  /* ldmatrix lane addresses, as in attn_fa2_kernel */
  const bf16_t *q_lane = Qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
  const int k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
  const int v_lane = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;

  auto load_kv = [&](const attn_tile &t, int hk, int stage, int kv0) {
    bf16_t *ks = Ks + stage * BN * LD, *vs = Vs + stage * BN * LD;
    for (int c = threadIdx.x; c < BN * CH; c += NTHREADS) {
      const int r = c / CH, e = (c % CH) * 8, kj = kv0 + r;
      const bool ok = kj < t.kv_hi;
      int64_t ko = 0, vo = 0;
      if (ok)
        kv_offsets<PAGED>(a, t, kj, hk, &ko, &vo);
      cp_async16(ks + r * LD + e, K + ko + e, ok);
      cp_async16(vs + r * LD + e, V + vo + e, ok);
    }
  };
  /* An item's prologue, as attn_fa2_kernel's: Q and key tile 0 in one group, then one group a stage up to
   * STAGES - 1 (empty ones too: the wait count stays fixed), key tile s into stage (base + s) % STAGES. */
  auto load_first = [&](const attn_tile &t, int hq, int base) {
    for (int c = threadIdx.x; c < BM * CH; c += NTHREADS) {
      const int r = c / CH, e = (c % CH) * 8, qt = t.row0 + r;
      const bool ok = qt < t.q_len;
      cp_async16(Qs + r * LD + e, ok ? Q + (int64_t)(t.q0 + qt) * a.q_s0 + (int64_t)hq * a.q_s1 + e : Q, ok);
    }
    const int nt = (t.kv_hi - t.kv_lo + BN - 1) / BN;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
      if (s < nt)
        load_kv(t, hq / a.group, (base + s) % STAGES, t.kv_lo + s * BN);
      cp_async_commit();
    }
  };

  int item = blockIdx.x, base = 0;
  attn_tile tile = a.tiles[item / a.hq];
  load_first(tile, item % a.hq, base);
  for (;;) {
    const int hq = item % a.hq, hk = hq / a.group;
    const int off = tile.kv_len - tile.q_len;
    /* This warp's rows; rows past the request borrow the last row's position (never written). */
    const int wrow0 = tile.row0 + warp * 16;
    int pos[2], lo[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      int qt = wrow0 + g + 8 * i;
      qt = qt < tile.q_len ? qt : tile.q_len - 1;
      pos[i] = qt + off;
      lo[i] = a.window > 0 ? pos[i] - a.window + 1 : 0;
    }
    const int wpos_first = (wrow0 < tile.q_len ? wrow0 : tile.q_len - 1) + off;
    const int wpos_last = (wrow0 + 15 < tile.q_len ? wrow0 + 15 : tile.q_len - 1) + off;
    const int wlo_first = a.window > 0 ? wpos_first - a.window + 1 : 0;
    const int wlo_last = a.window > 0 ? wpos_last - a.window + 1 : 0;

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; n++)
      o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    uint32_t qf[Q_IN_REGS ? KS : 1][4];
    const int ntiles = (tile.kv_hi - tile.kv_lo + BN - 1) / BN; /* >= 1: every row sees its own key */
    int next = a.work_items;                                     /* set at the last key tile */
    for (int it = 0; it < ntiles; it++) {
      const int kv0 = tile.kv_lo + it * BN, stage = (base + it) % STAGES;
      const bool last = it == ntiles - 1;
      cp_async_wait<STAGES - 2>();
      __syncthreads(); /* (1) tile it (and Q) landed for every thread; tile it - 1's stage is consumed */
      if (it + STAGES - 1 < ntiles)
        load_kv(tile, hk, (base + it + STAGES - 1) % STAGES, kv0 + (STAGES - 1) * BN);
      cp_async_commit();
      if (last && threadIdx.x == 0) {
        const int n = (int)gridDim.x + atomicAdd(a.work_next, 1);
        if (n < a.work_items)
          next_tile_s = a.tiles[n / a.hq];
        next_item_s = n;
      }
      if (Q_IN_REGS && it == 0) {
#pragma unroll
        for (int ks = 0; ks < (Q_IN_REGS ? KS : 0); ks++)
          ldsm_x4(qf[ks], q_lane + ks * 16);
      }
      /* warp-uniform: no row of this warp sees any key of the tile */
      const bool skip = kv0 > wpos_last || kv0 + BN <= wlo_first;
      float s[NT][4];
      if (!skip)
        fa2_scores<D, BN>(s, qf, q_lane, Ks + stage * BN * LD, k_lane);
      if (last) {
        __syncthreads(); /* (2) every warp's last Q K^T of the item is done: Q's buffer is free */
        next = next_item_s;
        if (next < a.work_items)
          load_first(next_tile_s, next % a.hq, base + ntiles);
      }
      if (skip)
        continue;
      /* logits to base-2 exponents; masks only where the tile crosses a diagonal, window edge or end */
      const bool masked = kv0 + BN - 1 > wpos_first || kv0 + BN > tile.kv_hi || (a.window > 0 && kv0 < wlo_last);
      fa2_softmax_pv<D, BN>(s, m, l, o, Vs + stage * BN * LD, v_lane, capped, mul, cap2, masked, kv0, t4,
                            tile.kv_hi, pos, lo);
    }
    fa_store_rows<DT>(a, tile, hq, wrow0, g, t4, m, l, o);
    if (next >= a.work_items)
      break;
    item = next;
    tile = next_tile_s;
    base += ntiles;
  }
  cp_async_wait<0>(); /* no copy outlives the CTA (the trailing groups are empty) */
}

/* ---- Paged decode v2 (bandwidth first; UPF_ATTN_DECODE=v2, bf16, D = 64/128/256, 16-byte rows) ----
 * attn_decode_v2_kernel<D>: the same tiles as the FFMA kernel (ATT_BR (token, group head) rows of one
 * request and kv head over keys [kv_lo, kv_hi), split-KV parts merged by attn_combine_kernel), but
 * every warp loads and every warp computes:
 *  - the tile's keys are cut into DEC_WARPS contiguous slices, one per warp; a warp step takes
 *    DEC_KPS = 4 keys, DEC_LPK = 8 lanes per key, lane c of a key's 8 owning dims 8 (c + 8 i) .. + 7
 *    (i < VPL = D / 64): each warp load instruction reads four 128-byte runs of four K (V) rows.
 *  - K and V reach shared memory by cp.async into a DEC_STAGES-deep ring that is private to each lane
 *    (a lane reads back only what it copied itself: cp.async.wait_group alone orders it, no barrier);
 *    DEC_STAGES - 1 steps are in flight per warp while one is computed.
 *  - the block table is read 32 entries at a time (one per lane) and shuffled to the key's lanes; a
 *    lane advances its (block, slot) pair by adds, no division in the loop.
 *  - RB = 512 / D rows of the tile sit in registers as fp32 (q and the accumulator: 64 values each per
 *    lane at every D); the GQA rows of a decode step share each K/V load. A tile of more valid rows
 *    runs its rows RB at a time (a pass over the keys each: K/V come again, from L2).
 *  - each group of 8 lanes (one key per step) runs its own online softmax in base 2 (running max m,
 *    sum l, accumulator over its dims; rescaled only when the max grows): dot products reduce over
 *    the 8 lanes by xor 1, 2, 4. At the end the 4 key groups of a warp merge by xor 8, 16, the 8 warps
 *    through shared memory in warp order: a fixed order, so the result does not depend on scheduling.
 * Keys past the slice are zero-filled by cp.async (src-size 0) and masked; so are causal and window
 * masks per row (rows of a multi-token step see different key ranges). */
constexpr int DEC_WARPS = 8;
constexpr int DEC_THREADS = DEC_WARPS * 32;
constexpr int DEC_LPK = 8;              /* lanes per key */
constexpr int DEC_KPS = 32 / DEC_LPK;   /* keys per warp step */
constexpr int DEC_STAGES = 4;           /* cp.async ring depth (steps) */
constexpr int DEC_SPLIT_WAVES = 8;      /* split-KV target: CTAs per SM (one resident at a time) */

template <int D> struct dec_shape {
  static constexpr int VPL = D / (8 * DEC_LPK); /* 16-byte vectors per lane per K (and per V) row */
  static constexpr int NE = VPL * 8;            /* dims per lane */
  static constexpr int RB = 512 / D;            /* rows held in registers: 8, 4, 2 */
  static constexpr size_t ring_bytes = (size_t)DEC_STAGES * 2 * VPL * DEC_THREADS * sizeof(uint4);
  static constexpr size_t smem = ring_bytes + (size_t)DEC_WARPS * RB * (D + 2) * sizeof(float);
};

/* cp.async issue (cuda/wgmma.cuh's cp_async16_to) and wait with a "memory" clobber: with no block
 * barrier in the loop, these are what keeps the compiler from moving the ring's shared loads across the
 * copies that fill it. */
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
template <int N> __device__ __forceinline__ void cp_async_wait_ordered() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* 8 bf16 (one 16-byte vector) to fp32: the bf16 bits are the high half of the float. */
__device__ __forceinline__ void bf16x8_to_f32(const uint4 &x, float *f) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

/* The end of a decode CTA: its W warps' partial rows merge in warp order (a fixed order, so the result
 * does not depend on scheduling), a thread per (row, dim). wacc (W, RB, D): each warp's unnormalised
 * accumulators of rows rc .. rc + RB - 1 of the tile, relative to its base-2 running max wm (W, RB) (-inf:
 * no key seen), with sums wl (W, RB). Writes out (and lse) or, for a split part, part_o / part_lse. */
template <int D, int W, int RB>
__device__ __forceinline__ void dec_merge_store(const attn_args &a, const attn_tile &tile, int hk, int rc, int nrows,
                                                const float *wacc, const float *wm, const float *wl) {
  for (int i = threadIdx.x; i < nrows * D; i += W * 32) {
    const int r = i / D, e = i - r * D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; w++)
      M = fmaxf(M, wm[w * RB + r]);
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int w = 0; w < W; w++) {
      const float mw = wm[w * RB + r], f = mw == -INFINITY ? 0.0f : exp2f(mw - M);
      L = fmaf(f, wl[w * RB + r], L);
      O = fmaf(f, wacc[(w * RB + r) * D + e], O);
    }
    const int ridx = tile.row0 + rc + r, t = ridx / a.group, hq = hk * a.group + (ridx - t * a.group);
    const int64_t tok = (int64_t)tile.q0 + t;
    if (tile.part < 0) { /* every row sees at least its own key: L > 0 */
      bf16_t *orow = (bf16_t *)a.out + tok * a.o_s0 + (int64_t)hq * a.o_s1;
      orow[e] = __float2bfloat16_rn(O / L);
      if (a.lse && e == 0)
        a.lse[tok * a.hq + hq] = (M + log2f(L)) * FA_LN2;
    } else { /* a part may hold none of this row's keys: L = 0, lse = -inf, weight 0 in the merge */
      const int64_t pslot = ((int64_t)tile.part * a.hkv + hk) * ATT_BR + rc + r;
      a.part_o[pslot * D + e] = L > 0.0f ? O / L : 0.0f;
      if (e == 0)
        a.part_lse[pslot] = L > 0.0f ? (M + log2f(L)) * FA_LN2 : -INFINITY;
    }
  }
}

template <int D>
__global__ void __launch_bounds__(DEC_THREADS, 1) attn_decode_v2_kernel(const __grid_constant__ attn_args a) {
  typedef dec_shape<D> S;
  constexpr int VPL = S::VPL, NE = S::NE, RB = S::RB;
  static_assert(ATT_BR % RB == 0 && VPL >= 1, "decode v2 shape");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4 *ring = reinterpret_cast<uint4 *>(smem_raw);                  /* [STAGES][2 VPL][THREADS] */
  float *wacc = reinterpret_cast<float *>(smem_raw + S::ring_bytes); /* [WARPS][RB][D] */
  float *wm = wacc + DEC_WARPS * RB * D;                              /* [WARPS][RB] */
  float *wl = wm + DEC_WARPS * RB;                                    /* [WARPS][RB] */
  const attn_tile tile = a.tiles[blockIdx.x];
  const int hk = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, kg = lane / DEC_LPK, c = lane % DEC_LPK;
  const int pos_off = tile.kv_len - tile.q_len;
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;
  const int32_t *bt_row = a.block_table + (int64_t)tile.req * a.max_blocks;
  const int P = a.page_size;
  const int span = tile.kv_hi - tile.kv_lo;
  const int slice = ((span + DEC_WARPS - 1) / DEC_WARPS + DEC_KPS - 1) / DEC_KPS * DEC_KPS;
  const int w_lo = tile.kv_lo + warp * slice;
  const int w_hi = min(tile.kv_hi, w_lo + slice);
  const int nsteps = w_hi > w_lo ? (w_hi - w_lo + DEC_KPS - 1) / DEC_KPS : 0;
  const bool capped = a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E; /* logit -> base-2 exponent */
  const float cap2 = a.softcap * FA_LOG2E;
  const int valid_rows = min(ATT_BR, tile.q_len * a.group - tile.row0);
  uint4 *my_ring = ring + threadIdx.x; /* [stage][j] at my_ring[(stage * 2 VPL + j) * THREADS] */

  for (int rc = 0; rc < valid_rows; rc += RB) {
    /* This pass's rows: q in registers (rows past the tile: zeros, never written). */
    float q[RB][NE];
    int pos[RB], lo[RB];
#pragma unroll
    for (int r = 0; r < RB; r++) {
      const int ridx = tile.row0 + rc + r, t = ridx / a.group, g = ridx - t * a.group;
      const bool ok = rc + r < valid_rows;
      pos[r] = ok ? t + pos_off : -1; /* -1: no key visible */
      lo[r] = a.window > 0 ? pos[r] - a.window + 1 : 0;
      const bf16_t *qrow = Q + (int64_t)(tile.q0 + t) * a.q_s0 + (int64_t)(hk * a.group + g) * a.q_s1;
#pragma unroll
      for (int i = 0; i < VPL; i++) {
        const uint4 x = ok ? *reinterpret_cast<const uint4 *>(qrow + 8 * (c + DEC_LPK * i)) : make_uint4(0, 0, 0, 0);
        bf16x8_to_f32(x, &q[r][8 * i]);
      }
    }

    /* Issue state: the key, block and slot of this lane's next step to issue; the warp's cached
     * window of the block table (entries blk0 + lane). */
    int kj_issue = w_lo + kg;
    int blk = kj_issue / P, slot = kj_issue - blk * P;
    int blk0 = w_lo / P;
    int tbl = nsteps > 0 && blk0 + lane < a.max_blocks ? bt_row[blk0 + lane] : 0;
    auto issue = [&](int s) { /* steps in increasing order, each once (past the slice: zero-fill) */
      uint4 *dst = my_ring + (s % DEC_STAGES) * 2 * VPL * DEC_THREADS;
      const bool ok = kj_issue < w_hi;
      if (__any_sync(0xffffffffu, ok && blk - blk0 >= 32)) { /* lane 0 holds the step's first (valid) key */
        blk0 = __shfl_sync(0xffffffffu, blk, 0);
        tbl = blk0 + lane < a.max_blocks ? bt_row[blk0 + lane] : 0;
      }
      const int page = __shfl_sync(0xffffffffu, tbl, ok ? blk - blk0 : 0);
      const int64_t ko = ok ? (int64_t)page * a.k_s0 + (int64_t)slot * a.k_s1 + (int64_t)hk * a.k_s2 : 0;
      const int64_t vo = ok ? (int64_t)page * a.v_s0 + (int64_t)slot * a.v_s1 + (int64_t)hk * a.v_s2 : 0;
#pragma unroll
      for (int i = 0; i < VPL; i++) {
        const int e = 8 * (c + DEC_LPK * i);
        upf_wgmma::cp_async16_to(smem_addr(dst + i * DEC_THREADS), K + ko + e, ok);
        upf_wgmma::cp_async16_to(smem_addr(dst + (VPL + i) * DEC_THREADS), V + vo + e, ok);
      }
      kj_issue += DEC_KPS, slot += DEC_KPS;
      while (slot >= P)
        slot -= P, blk++;
    };
#pragma unroll
    for (int s = 0; s < DEC_STAGES - 1; s++) {
      issue(s);
      cp_async_commit();
    }

    float m[RB], l[RB], acc[RB][NE];
#pragma unroll
    for (int r = 0; r < RB; r++) {
      m[r] = -INFINITY, l[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < NE; j++)
        acc[r][j] = 0.0f;
    }
    for (int s = 0; s < nsteps; s++) {
      cp_async_wait_ordered<DEC_STAGES - 2>(); /* step s landed (this lane's own copies) */
      const uint4 *src = my_ring + (s % DEC_STAGES) * 2 * VPL * DEC_THREADS;
      uint4 kx[VPL], vx[VPL];
#pragma unroll
      for (int i = 0; i < VPL; i++)
        kx[i] = src[i * DEC_THREADS], vx[i] = src[(VPL + i) * DEC_THREADS];
      issue(s + DEC_STAGES - 1); /* into the stage step s - 1 used: consumed by this lane last iteration */
      cp_async_commit();
      const int kj = w_lo + s * DEC_KPS + kg;
      const bool kin = kj < w_hi;
      float f[NE];
#pragma unroll
      for (int i = 0; i < VPL; i++)
        bf16x8_to_f32(kx[i], &f[8 * i]);
      float p[RB];
#pragma unroll
      for (int r = 0; r < RB; r++) {
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < NE; j++)
          dot = fmaf(q[r][j], f[j], dot);
        dot += __shfl_xor_sync(0xffffffffu, dot, 1);
        dot += __shfl_xor_sync(0xffffffffu, dot, 2);
        dot += __shfl_xor_sync(0xffffffffu, dot, 4);
        float x = capped ? cap2 * tanhf(dot * mul) : dot * mul;
        const bool vis = kin && kj <= pos[r] && kj >= lo[r];
        x = vis ? x : -INFINITY;
        if (x > m[r]) { /* the running max grows (first visible key: alpha = exp2(-inf) = 0) */
          const float alpha = exp2f(m[r] - x);
          l[r] *= alpha;
#pragma unroll
          for (int j = 0; j < NE; j++)
            acc[r][j] *= alpha;
          m[r] = x;
        }
        p[r] = vis ? exp2f(x - m[r]) : 0.0f;
        l[r] += p[r];
      }
#pragma unroll
      for (int i = 0; i < VPL; i++)
        bf16x8_to_f32(vx[i], &f[8 * i]);
#pragma unroll
      for (int r = 0; r < RB; r++)
#pragma unroll
        for (int j = 0; j < NE; j++)
          acc[r][j] = fmaf(p[r], f[j], acc[r][j]);
    }
    cp_async_wait_ordered<0>(); /* the zero-fills past the slice too: the next pass reuses the ring */

    /* The warp's 4 key groups merge (xor 8, 16); lanes 0..7 write the warp's rows. */
#pragma unroll
    for (int r = 0; r < RB; r++) {
      float mx = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float w = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mx);
      float lr = l[r] * w;
      lr += __shfl_xor_sync(0xffffffffu, lr, 8);
      lr += __shfl_xor_sync(0xffffffffu, lr, 16);
#pragma unroll
      for (int j = 0; j < NE; j++) {
        float x = acc[r][j] * w;
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        acc[r][j] = x;
      }
      if (lane < DEC_LPK) {
        float *dst = wacc + (warp * RB + r) * D;
#pragma unroll
        for (int i = 0; i < VPL; i++)
#pragma unroll
          for (int u = 0; u < 8; u++)
            dst[8 * (c + DEC_LPK * i) + u] = acc[r][8 * i + u];
        if (lane == 0)
          wm[warp * RB + r] = mx, wl[warp * RB + r] = lr;
      }
    }
    __syncthreads();
    dec_merge_store<D, DEC_WARPS, RB>(a, tile, hk, rc, min(RB, valid_rows - rc), wacc, wm, wl);
    __syncthreads(); /* the next pass rewrites wacc */
  }
}

/* ---- Paged decode on tensor cores (UPF_ATTN_DECODE=mma; bf16, D = 64/128/256, 16-byte rows) ----
 * attn_decode_mma_kernel<D>: v2's tiles, split-KV plan, per-warp key slices, block-table window and
 * fixed-order merge, with the dot products on mma.sync (FlashInfer's tensor-core decode): the tile's
 * ATT_BR = 16 (token, group head) rows are the M dimension of m16n8k16 (a Llama decode step fills 4 of
 * them: decode is memory-bound, the idle rows cost nothing that matters, and every row of a multi-token
 * step fits in one pass - no RB passes as in v2).
 *  - Q (16 rows x D) is copied once into shared memory (rows past the tile zero-filled) and, at D <= 128,
 *    held as A fragments in registers for the whole kernel; at D = 256 it is read by ldmatrix each step.
 *  - MD_WARPS = 4 warps, each over its own contiguous slice of the tile's keys in steps of MD_BN = 16
 *    keys; a step's K and V rows ([16][D + 8] each, the FA2 kernel's padded layout) reach a ring of
 *    md_shape::STAGES steps private to the warp by cp.async with v2's map: 8 lanes a key, lane l the
 *    16-byte chunks l % 8 + 8 h of key l / 8 + 4 j (each instruction reads four whole 128-byte runs and
 *    writes shared memory in 4 wavefronts: conflict-free); v2's block-table window (32 entries per warp
 *    read at once and shuffled; (block, slot) advanced by adds). cp.async.wait_group then __syncwarp make the
 *    step's rows visible to the warp and retire the reads of the stage refilled next: no block barrier
 *    in the loop.
 *  - S (16 x 16) = Q K^T by ldmatrix of K (no transpose) exactly as attn_fa2_kernel; logits to base-2
 *    exponents by fa_exponents (masks only on steps crossing a row's position, window start or the
 *    slice end); online softmax per row on the accumulator (quad reductions xor 1, 2; O rescaled only
 *    when some row's max grew); P packed from the C layout into the A layout and O += P V with V by
 *    ldmatrix.trans, as attn_fa2_kernel.
 *  - Rows past the tile borrow the last row's position (their Q is zero; never written), as in
 *    attn_fa2_kernel. Keys past the slice are zero-filled by cp.async (src-size 0) and masked.
 *  - End: the 4 warps' rows (m, l, O in the accumulator layout) go through shared memory (over the
 *    ring) and merge in warp order by dec_merge_store, as v2.
 * 2 CTAs per SM at D <= 128 (8 warps; 2 steps of 8 KB in flight per warp at D 128: 128 KB per SM). */
constexpr int MD_WARPS = 4;
constexpr int MD_THREADS = MD_WARPS * 32;
constexpr int MD_BN = 16;          /* keys per warp step: one k16 block of P V */
constexpr int MD_SPLIT_WAVES = 4;  /* split-KV target: rounds of resident CTAs */

template <int D> struct md_shape {
  static constexpr int LD = D + 8;                         /* padded row (bf16): ldmatrix conflict-free */
  static constexpr int STAGES = D == 64 ? 4 : 3;           /* per-warp ring depth (steps) */
  static constexpr int MIN_CTAS = D <= 128 ? 2 : 1;        /* CTAs per SM (launch bounds, shared memory) */
  static constexpr int STEP = 2 * MD_BN * LD;              /* elements of one step: K rows then V rows */
  static constexpr size_t q_bytes = (size_t)ATT_BR * LD * sizeof(bf16_t);
  static constexpr size_t ring_bytes = (size_t)MD_WARPS * STAGES * STEP * sizeof(bf16_t);
  static constexpr size_t merge_bytes = (size_t)MD_WARPS * ATT_BR * (D + 2) * sizeof(float);
  static constexpr size_t smem = q_bytes + (ring_bytes > merge_bytes ? ring_bytes : merge_bytes);
};

/* The kernel's row offsets are page * s0 + slot * s1 in 32-bit factors (the (pages, P, Hkv, D) caches of
 * any real size); others take v2. */
bool md_strides_ok(const attn_args &a) {
  const int64_t lim = 0xffffffffLL;
  return a.k_s0 >= 0 && a.k_s0 <= lim && a.v_s0 >= 0 && a.v_s0 <= lim && a.k_s1 >= 0 && a.v_s1 >= 0 &&
         a.k_s1 * (a.page_size - 1) <= lim && a.v_s1 * (a.page_size - 1) <= lim;
}

template <int D>
__global__ void __launch_bounds__(MD_THREADS, md_shape<D>::MIN_CTAS)
    attn_decode_mma_kernel(const __grid_constant__ attn_args a) {
  typedef md_shape<D> S;
  constexpr int LD = S::LD, STAGES = S::STAGES, DT = D / 8, KS = D / 16, CH = D / 8, VPL = D / 64;
  constexpr bool Q_IN_REGS = D <= 128;
  static_assert(DT % 2 == 0 && D % 64 == 0 && STAGES >= 2 && MD_BN == 16, "decode mma shape");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t *Qs = reinterpret_cast<bf16_t *>(smem_raw);                     /* [ATT_BR][LD] */
  bf16_t *ring = reinterpret_cast<bf16_t *>(smem_raw + S::q_bytes);      /* [WARPS][STAGES][K, V][BN][LD] */
  float *wacc = reinterpret_cast<float *>(smem_raw + S::q_bytes);        /* after the loop: [WARPS][ATT_BR][D] */
  float *wm = wacc + MD_WARPS * ATT_BR * D;                               /* [WARPS][ATT_BR] */
  float *wl = wm + MD_WARPS * ATT_BR;                                     /* [WARPS][ATT_BR] */
  const attn_tile tile = a.tiles[blockIdx.x];
  const int hk = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t4 = lane & 3;
  const int pos_off = tile.kv_len - tile.q_len;
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;
  const int32_t *bt_row = a.block_table + (int64_t)tile.req * a.max_blocks;
  const int P = a.page_size;
  const int span = tile.kv_hi - tile.kv_lo;
  const int slice = ((span + MD_WARPS - 1) / MD_WARPS + MD_BN - 1) / MD_BN * MD_BN;
  const bf16_t *wring = ring + warp * STAGES * S::STEP;
  const int w_lo = tile.kv_lo + warp * slice;
  const int w_hi = min(tile.kv_hi, w_lo + slice);
  const int nsteps = w_hi > w_lo ? (w_hi - w_lo + MD_BN - 1) / MD_BN : 0;
  const int valid_rows = min(ATT_BR, tile.q_len * a.group - tile.row0);
  const bool capped = a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E; /* logit -> base-2 exponent */
  const float cap2 = a.softcap * FA_LOG2E;

  /* Q rows (token-major (token, group head) pairs), the first cp.async group of every thread. */
  for (int c = threadIdx.x; c < ATT_BR * CH; c += MD_THREADS) {
    const int r = c / CH, e = (c % CH) * 8, ridx = tile.row0 + r, t = ridx / a.group;
    const bool ok = r < valid_rows;
    const bf16_t *src =
        ok ? Q + (int64_t)(tile.q0 + t) * a.q_s0 + (int64_t)(hk * a.group + ridx - t * a.group) * a.q_s1 + e : Q;
    upf_wgmma::cp_async16_to(smem_addr(Qs + r * LD + e), src, ok);
  }
  cp_async_commit();

  /* Issue state (v2's): this lane's next key to issue (its keys are w_lo + kq + 4 m), its block and
   * slot; the warp's cached window of the block table (entries blk0 + lane). */
  const int kq = lane >> 3, c8 = lane & 7;
  int kj_issue = w_lo + kq;
  int blk = kj_issue / P, slot = kj_issue - blk * P;
  const int adv = 4 / P, rem = 4 - adv * P; /* 4 keys on: adv blocks and rem slots */
  int blk0 = w_lo / P;
  int tbl = nsteps > 0 && blk0 + lane < a.max_blocks ? bt_row[blk0 + lane] : 0;
  /* This lane's chunks start at dim 8 c8 of its keys' rows, and its ring slots at key kq of a step:
   * the copies of a step take constant offsets from these. Page and slot strides fit 32 bits (the host
   * checks, md_strides_ok): one wide multiply-add per row offset. */
  const uint32_t ring_lane = smem_addr(ring + warp * STAGES * S::STEP + kq * LD + 8 * c8);
  const bf16_t *Kh = K + (int64_t)hk * a.k_s2 + 8 * c8, *Vh = V + (int64_t)hk * a.v_s2 + 8 * c8;
  const uint32_t k_s0 = (uint32_t)a.k_s0, k_s1 = (uint32_t)a.k_s1, v_s0 = (uint32_t)a.v_s0, v_s1 = (uint32_t)a.v_s1;
  auto issue = [&](int s) { /* steps in increasing order, each once; call only for s < nsteps (lane 0 valid) */
    const uint32_t ks = ring_lane + (uint32_t)((s % STAGES) * S::STEP * sizeof(bf16_t));
    const uint32_t vs = ks + MD_BN * LD * sizeof(bf16_t);
#pragma unroll
    for (int j = 0; j < MD_BN / 4; j++) { /* keys 4 j + kq of the step */
      const bool ok = kj_issue < w_hi;
      if (__any_sync(0xffffffffu, ok && blk - blk0 >= 32)) { /* lane 0 holds the 4 keys' first (valid) */
        blk0 = __shfl_sync(0xffffffffu, blk, 0);
        tbl = blk0 + lane < a.max_blocks ? bt_row[blk0 + lane] : 0;
      }
      /* !ok: some table entry or 0 and a slot < P, never read (src-size 0 zero-fills) */
      const uint32_t page = (uint32_t)__shfl_sync(0xffffffffu, tbl, blk - blk0);
      const bf16_t *kp = Kh + ((uint64_t)page * k_s0 + (uint32_t)slot * k_s1);
      const bf16_t *vp = Vh + ((uint64_t)page * v_s0 + (uint32_t)slot * v_s1);
#pragma unroll
      for (int h = 0; h < VPL; h++) {
        const uint32_t o = (uint32_t)((4 * j * LD + 64 * h) * sizeof(bf16_t));
        upf_wgmma::cp_async16_to(ks + o, kp + 64 * h, ok);
        upf_wgmma::cp_async16_to(vs + o, vp + 64 * h, ok);
      }
      kj_issue += 4, slot += rem, blk += adv;
      if (slot >= P)
        slot -= P, blk++;
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) { /* one group per stage, empty ones too: the wait count stays fixed */
    if (s < nsteps)
      issue(s);
    cp_async_commit();
  }

  /* Rows g and g + 8 of the tile; rows past it borrow the last row's position (never written). */
  const int last = valid_rows - 1;
  int pos[2], lo[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int r = g + 8 * i < last ? g + 8 * i : last;
    pos[i] = (tile.row0 + r) / a.group + pos_off;
    lo[i] = a.window > 0 ? pos[i] - a.window + 1 : 0;
  }
  const int pos_first = tile.row0 / a.group + pos_off;
  const int lo_last = a.window > 0 ? (tile.row0 + last) / a.group + pos_off - a.window + 1 : 0;

  cp_async_wait_ordered<STAGES - 1>(); /* this thread's Q copies landed */
  __syncthreads();                     /* and every thread's */
  uint32_t qf[Q_IN_REGS ? KS : 1][4];
  /* ldmatrix lane addresses (attn_fa2_kernel's): Q rows (g, g + 8 | cols +8 for lanes 16..31), K keys
   * (+8 for lanes 16..31 | dims +8 for lanes 8..15, 24..31), V keys (+8 for lanes 8..15, 24..31 | dims
   * +8 for 16..31) */
  const bf16_t *q_lane = Qs + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
  const int k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
  const int v_lane = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
  if (Q_IN_REGS) {
#pragma unroll
    for (int ks = 0; ks < (Q_IN_REGS ? KS : 0); ks++)
      ldsm_x4(qf[ks], q_lane + ks * 16);
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; n++)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  for (int s = 0; s < nsteps; s++) {
    cp_async_wait_ordered<STAGES - 2>(); /* step s landed (this lane's copies) */
    __syncwarp(); /* every lane's: the warp reads them; and step s - 1's stage, refilled now, is consumed */
    if (s + STAGES - 1 < nsteps)
      issue(s + STAGES - 1);
    cp_async_commit();
    const int kv0 = w_lo + s * MD_BN;
    const bf16_t *ks_tile = wring + (s % STAGES) * S::STEP, *vs_tile = ks_tile + MD_BN * LD;

    float sc[2][4];
    fa2_scores<D, MD_BN>(sc, qf, q_lane, ks_tile, k_lane);

    const bool masked = kv0 + MD_BN - 1 > pos_first || kv0 + MD_BN > w_hi || (a.window > 0 && kv0 < lo_last);
    fa_exponents<2>(sc, sc, capped, mul, cap2, masked, kv0, t4, w_hi, pos, lo);
    float alpha[2]; /* O rescaled only when a max grew */
    fa_online_softmax<2>(sc, m, l, alpha);
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) { /* x 1 is exact: skipping it changes nothing */
#pragma unroll
      for (int n = 0; n < DT; n++) {
        o[n][0] *= alpha[0], o[n][1] *= alpha[0];
        o[n][2] *= alpha[1], o[n][3] *= alpha[1];
      }
    }
    const uint32_t a0 = pack_bf16(sc[0][0], sc[0][1]), a1 = pack_bf16(sc[0][2], sc[0][3]);
    const uint32_t a2 = pack_bf16(sc[1][0], sc[1][1]), a3 = pack_bf16(sc[1][2], sc[1][3]);
    const bf16_t *v0 = vs_tile + v_lane;
#pragma unroll
    for (int n = 0; n < DT; n += 2) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_trans(b0, b1, b2, b3, v0 + n * 8);
      mma_bf16(o[n], a0, a1, a2, a3, b0, b1);
      mma_bf16(o[n + 1], a0, a1, a2, a3, b2, b3);
    }
  }
  cp_async_wait_ordered<0>(); /* no copy outlives the loop (the trailing groups are empty) */
  __syncthreads();            /* every warp is done with its ring: the merge area lies over it */

  /* This warp's rows g, g + 8 (the quad's 4 sums meet first) to shared memory, then the warp-order merge. */
  float *acc_w = wacc + warp * ATT_BR * D;
#pragma unroll
  for (int i = 0; i < 2; i++) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int r = g + 8 * i;
#pragma unroll
    for (int n = 0; n < DT; n++)
      *reinterpret_cast<float2 *>(acc_w + r * D + n * 8 + t4 * 2) = make_float2(o[n][2 * i], o[n][2 * i + 1]);
    if (t4 == 0)
      wm[warp * ATT_BR + r] = m[i], wl[warp * ATT_BR + r] = l[i];
  }
  __syncthreads();
  dec_merge_store<D, MD_WARPS, ATT_BR>(a, tile, hk, 0, valid_rows, wacc, wm, wl);
}

/* ---- Hopper prefill (UPF_ATTN_PREFILL=wgmma; bf16, D = 128, contiguous K/V) ----
 * attn_wgmma_kernel: the FA2 kernel's tiles (WA_BM = 128 query rows of one request and one q head,
 * heaviest first) on wgmma. CTA = 2 consumer warpgroups (64 rows each) + a producer warpgroup of which
 * one warp copies; setmaxnreg moves registers from the producer (56) to the consumers (224): with
 * the launch's 384 threads ptxas caps every thread at 168; the OVERLAP loop needs more (no spills
 * at 224).
 *  - the producer streams K and V tiles of WA_BN = 64 keys into a WA_NS-stage ring by cp.async, in
 *    the 128-byte-swizzle layout wgmma reads (per 64 dims: 64 rows x 128 bytes, 16-byte chunk c of
 *    row r at r * 128 + ((c ^ (r % 8)) * 16); the second 64 dims WA_BN * 128 bytes further: the
 *    layout of cuda/select.cu's score kernel), and signals full[s] by cp.async.mbarrier.arrive; the
 *    consumer warps release a stage on empty[s] once the wgmma reading it has completed. Rows past
 *    the tile's key range are zero-filled (src-size 0).
 *  - S (64 x 64 per warpgroup) = Q K^T by 8 wgmma m64n64k16 (Q as the A operand from registers, the
 *    fragment layout of mma.sync's A; K tile K-major from the ring); softmax on the accumulator
 *    exactly as attn_fa2_kernel (base 2, scale folded, masks only on tiles crossing a diagonal, window
 *    edge or the range end; mref = 0 for rows that have seen nothing); P rounded to bf16 becomes the A
 *    operand of 4 wgmma m64n128k16 with the V tile as an MN-major B (imm-trans-b), O += P V in fp32.
 *  - OVERLAP = false: each wgmma group is waited for at once; the two warpgroups overlap each
 *    other's softmax and tensor work through the warp schedulers only. OVERLAP = true: S(t + 1) is
 *    issued before the softmax of tile t (two S accumulator sets), so a warpgroup's exponentials run
 *    while its own next QK^T is on the tensor cores (FlashAttention-3's intra-warpgroup overlap; no
 *    ping-pong between the warpgroups yet).
 * Warpgroups compute every tile of the CTA's key range (a wgmma is warpgroup-wide: no per-warp skip);
 * fully masked rows of a tile contribute p = 0. */
constexpr int WA_BM = 128;
constexpr int WA_BN = 64;
constexpr int WA_NS = 4;
constexpr int WA_D = 128;
constexpr int WA_THREADS = 3 * 128; /* 2 consumer warpgroups + the producer's (one warp of it copies) */
constexpr int WA_CONSUMER_REGS = 224, WA_PRODUCER_REGS = 56; /* setmaxnreg: 2 x 128 x 224 + 128 x 56 = 384 x 168 */
constexpr uint32_t WA_TILE_BYTES = WA_BN * WA_D * 2;    /* one K (or V) tile */
constexpr uint32_t WA_STAGE_BYTES = 2 * WA_TILE_BYTES;  /* K then V */
constexpr size_t WA_SMEM = 1024 + (size_t)WA_NS * WA_STAGE_BYTES + 2 * WA_NS * 8;
static_assert(FA_BM == WA_BM, "the wgmma kernel runs the FA2 kernel's plan");
static_assert(WA_NS >= 3, "OVERLAP waits for tile t + 1 before it releases tile t - 1");

template <bool OVERLAP>
__global__ void __launch_bounds__(WA_THREADS, 1) attn_wgmma_kernel(const __grid_constant__ attn_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace upf_wgmma;
  constexpr int KS = WA_D / 16, NT = WA_BN / 8, DT = WA_D / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t sbase = (sraw + 1023u) & ~1023u; /* swizzle atoms need 1024-byte alignment */
  const uint32_t full = sbase + WA_NS * WA_STAGE_BYTES, empty = full + WA_NS * 8;
  const attn_tile tile = a.tiles[blockIdx.x / a.hq];
  const int hq = blockIdx.x % a.hq, hk = hq / a.group;
  /* Broadcasts make the role and the loop bounds provably warp-uniform for ptxas (else it serialises
   * the wgmma: C7518). */
  const int warp = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int kv_lo = __shfl_sync(0xffffffffu, tile.kv_lo, 0);
  const int ntiles = __shfl_sync(0xffffffffu, (tile.kv_hi - tile.kv_lo + WA_BN - 1) / WA_BN, 0);
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < WA_NS; i++) {
      mbar_init(full + 8 * i, 32);  /* the producer's 32 lanes, each once its copies landed */
      mbar_init(empty + 8 * i, 8);  /* the 8 consumer warps */
    }
  }
  __syncthreads();

  if (warp >= 8) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WA_PRODUCER_REGS));
    if (warp != 8)
      return;
    /* Producer: lane copies 16-byte chunk c of rows r0, r0 + 2, ... of every K and V tile. */
    constexpr int CPR = WA_D / 8, RPI = 32 / CPR, J = WA_BN / RPI;
    const int c = lane % CPR, r0 = lane / CPR, cc = c & 7;
    const uint32_t coff = (uint32_t)(c >> 3) * (WA_BN * 128);
    const bf16_t *kb0 = K + (int64_t)tile.kv_base * a.k_s0 + (int64_t)hk * a.k_s1 + c * 8;
    const bf16_t *vb0 = V + (int64_t)tile.kv_base * a.v_s0 + (int64_t)hk * a.v_s1 + c * 8;
    for (int t = 0; t < ntiles; t++) {
      const int st = t % WA_NS;
      if (t >= WA_NS)
        mbar_wait(empty + 8 * st, (uint32_t)((t / WA_NS - 1) & 1));
      const int kv0 = kv_lo + t * WA_BN;
      const uint32_t kdst0 = sbase + st * WA_STAGE_BYTES + coff, vdst0 = kdst0 + WA_TILE_BYTES;
#pragma unroll 8
      for (int j = 0; j < J; j++) {
        const int kk = r0 + j * RPI, kj = kv0 + kk;
        const bool in = kj < tile.kv_hi;
        const uint32_t off = kk * 128 + ((cc ^ (kk & 7)) << 4);
        cp_async16_to(kdst0 + off, in ? kb0 + (int64_t)kj * a.k_s0 : kb0, in);
        cp_async16_to(vdst0 + off, in ? vb0 + (int64_t)kj * a.v_s0 : vb0, in);
      }
      cp_async_mbar_arrive(full + 8 * st);
    }
    cp_async_wait_all();
    return;
  }

  /* Consumers: warpgroup wg, warp w4 of it; this thread's rows g and g + 8 of the warp's 16. */
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WA_CONSUMER_REGS));
  const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
  const int off = tile.kv_len - tile.q_len;
  const int wrow0 = tile.row0 + wg * 64 + w4 * 16;
  int pos[2], lo[2];
  uint32_t qa[KS][4];
  {
    const uint32_t *rp[2];
    bool ok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int qt = wrow0 + g + 8 * i;
      ok[i] = qt < tile.q_len;
      const int qc = ok[i] ? qt : tile.q_len - 1; /* rows past the request: the last row's position */
      pos[i] = qc + off;
      lo[i] = a.window > 0 ? pos[i] - a.window + 1 : 0;
      rp[i] = reinterpret_cast<const uint32_t *>(Q + (int64_t)(tile.q0 + qc) * a.q_s0 + (int64_t)hq * a.q_s1);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ks++) { /* A fragment: {row g, k 2t4..}, {row g+8}, {row g, k 2t4+8..}, {row g+8} */
      qa[ks][0] = ok[0] ? __ldg(rp[0] + ks * 8 + t4) : 0u;
      qa[ks][1] = ok[1] ? __ldg(rp[1] + ks * 8 + t4) : 0u;
      qa[ks][2] = ok[0] ? __ldg(rp[0] + ks * 8 + 4 + t4) : 0u;
      qa[ks][3] = ok[1] ? __ldg(rp[1] + ks * 8 + 4 + t4) : 0u;
    }
  }
  const int wpos_first = (wrow0 < tile.q_len ? wrow0 : tile.q_len - 1) + off;
  const int wpos_last = (wrow0 + 15 < tile.q_len ? wrow0 + 15 : tile.q_len - 1) + off;
  const int wlo_last = a.window > 0 ? wpos_last - a.window + 1 : 0;
  const bool capped = a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E;
  const float cap2 = a.softcap * FA_LOG2E;

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; n++)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  /* Tile t's K/V have landed; their cp.async (generic proxy) writes are ordered before the wgmma
   * (async proxy) reads. */
  auto ready = [&](int t) {
    mbar_wait(full + 8 * (t % WA_NS), (uint32_t)((t / WA_NS) & 1));
    fence_proxy_async();
  };
  auto issue_s = [&](float (&sacc)[NT][4], int t) { /* S(t) = Q K(t)^T, one commit group */
    const uint32_t kbase = sbase + (t % WA_NS) * WA_STAGE_BYTES;
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
      wgmma_m64n64k16(sacc, qa[ks], desc_kmajor_sw128(kbase + (ks >> 2) * (WA_BN * 128) + (ks & 3) * 32), ks);
    wg_commit();
  };
  auto release = [&](int t) { /* this warp's wgmma reads of tile t's stage are complete */
    __syncwarp();
    if (lane == 0)
      mbar_arrive(empty + 8 * (t % WA_NS));
  };
  /* Softmax of S(t) (complete; read, never written: the logits go to p), O rescale (every earlier P V
   * complete), then O += P V(t) issued as one commit group. */
  auto softmax_pv = [&](const float (&sacc)[NT][4], int t) {
    const int kv0 = kv_lo + t * WA_BN;
    const uint32_t vbase = sbase + (t % WA_NS) * WA_STAGE_BYTES + WA_TILE_BYTES;
    /* logits to base-2 exponents; masks only where the tile crosses a diagonal, window edge or end */
    const bool masked = kv0 + WA_BN - 1 > wpos_first || kv0 + WA_BN > tile.kv_hi || (a.window > 0 && kv0 < wlo_last);
    float p[NT][4];
    fa_exponents<NT>(sacc, p, capped, mul, cap2, masked, kv0, t4, tile.kv_hi, pos, lo);
    float alpha[2];
    fa_online_softmax<NT>(p, m, l, alpha);
#pragma unroll
    for (int n = 0; n < DT; n++) {
      o[n][0] *= alpha[0], o[n][1] *= alpha[0];
      o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
    /* P (bf16) as the A operand: k-step kk = keys 16 kk .. 16 kk + 15 = accumulator n-blocks 2 kk, 2 kk + 1 */
    uint32_t pa[WA_BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < WA_BN / 16; kk++) {
      pa[kk][0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
      pa[kk][1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
      pa[kk][2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < WA_BN / 16; kk++)
      wgmma_m64n128k16_tb(o, pa[kk], desc_mnmajor_sw128(vbase + kk * 2048, WA_BN * 128), 1);
    wg_commit();
  };

  float sA[NT][4];
  if constexpr (!OVERLAP) {
    for (int t = 0; t < ntiles; t++) {
      ready(t);
      issue_s(sA, t);
      wg_wait<0>();
      softmax_pv(sA, t);
      wg_wait<0>();
      release(t);
    }
  } else {
    /* S(t + 1) runs on the tensor cores while the warpgroup does the softmax of tile t. Commit order
     * S(t), P V(t - 1), S(t + 1): wait_group 1 leaves only S(t + 1) in flight. */
    float sB[NT][4];
    auto step = [&](float (&cur)[NT][4], float (&nxt)[NT][4], int t) {
      if (t + 1 < ntiles) {
        ready(t + 1);
        issue_s(nxt, t + 1);
        wg_wait<1>();
      } else {
        wg_wait<0>();
      }
      if (t > 0)
        release(t - 1);
      softmax_pv(cur, t);
    };
    ready(0);
    issue_s(sA, 0);
    for (int t = 0; t < ntiles; t += 2) {
      step(sA, sB, t);
      if (t + 1 < ntiles)
        step(sB, sA, t + 1);
    }
    wg_wait<0>();
    release(ntiles - 1);
  }

  fa_store_rows<DT>(a, tile, hq, wrow0, g, t4, m, l, o);
#else
  __trap(); /* built without sm_90a: the host never launches this */
#endif
}

/* ---- Hopper prefill, FlashAttention-3 form (UPF_ATTN_PREFILL=wgmma2; bf16, D = 128, contiguous K/V) ----
 * attn_wgmma2_kernel: the same plan, CTA shape (2 consumer warpgroups of 64 rows + a producer
 * warpgroup), swizzle layouts and descriptor forms as attn_wgmma_kernel, with these changes:
 *  - W2_BN = 128 keys per tile: S (64 x 128 per warpgroup) by 8 wgmma m64n128k16, O += P V by 8
 *    (k = 16 keys each); the fixed per-tile costs (barrier waits, fences, commits, shuffles, the O
 *    rescale) are paid once per 128 keys.
 *  - Q lives in shared memory (copied once by the producer with tile 0, in the K tiles' swizzled
 *    K-major layout: per warpgroup and per 64 dims 64 rows x 128 bytes) and QK^T is an all-shared-memory
 *    wgmma: the 32 registers of the register-A Q fragment go to S, P and O.
 *  - all 4 producer warps copy (cp.async, per lane and tile 8 rows x 2 chunks of K and of V, the two
 *    chunks of a row off one pointer, one 64-bit add a row, no predicates but on a range's last tile:
 *    ~115 instructions a producer warp a tile, was ~566), so the copy issue is spread over the 4
 *    schedulers; a W2_NS = 3 stage ring of K + V (64 KB a stage) with full and
 *    empty barriers for K and for V apart: S(t) waits for K(t) only, and K(t) is released as soon as
 *    S(t) completes, so K(t + 3) is copied while P V(t) still reads V(t) (K and V each ~2 rounds ahead).
 *  - softmax: the running max is kept on the raw logits (no multiply before the max); exponents are
 *    one FFMA, s * mul - m * mul, and ex2.approx (MUFU, no range fix-up); alpha = exp2 of the
 *    difference of the stored scaled maxima (exactly 1 while the max holds). Soft-cap as before
 *    (tanh first, then mul = 1). Masks only on tiles crossing a warp's diagonal, window edge or the end.
 *  - intra-warpgroup overlap (FA3 section 3.2): round t issues S(t) and P(t - 1) V(t - 1) as two commit
 *    groups, waits for S(t) only, runs the softmax of tile t while P V(t - 1) is on the tensor cores,
 *    then waits for P V(t - 1), rescales O (only where a row of the warp raised its max) and packs
 *    P(t). Live: S 64 + P 32 + O 64 fp32 registers.
 *  - ping-pong (FA3 section 3.1): a round's wgmma issue is a critical section passed between the two
 *    warpgroups by named barriers 1 (warpgroup 0's turn) and 2 (warpgroup 1's), 256 threads each:
 *    warpgroup w syncs on 1 + w, issues, arrives on 2 - w; warpgroup 1 arrives once on barrier 1 before
 *    its first round (warpgroup 0 goes first) and skips its last arrive, so every barrier phase has
 *    exactly 128 syncing and 128 arriving threads. Both warpgroups run ntiles + 1 rounds.
 *  - setmaxnreg 240 (consumers) / 24 (producer): 2 x 128 x 240 + 128 x 24 = 384 x 168, the launch's.
 *  - every mbarrier wait gives up after W2_WAIT_LIMIT_NS of wall time; a consumer that gave up stops
 *    waiting and writes NaN (out and LSE), so a protocol error reads as a NaN verify failure and a
 *    slow but finished kernel, not a hang. (A named-barrier mismatch would still hang.)
 * PINGPONG = false (UPF_ATTN_PREFILL=wgmma2-nopp, the default) drops the named barriers: on the H200 the
 * hand-over bought nothing at 32K and cost 4% at 128K (perf/NOTES.md, version 5 measured).
 * Shared memory: Q 32 KB + 3 x 64 KB ring + 12 barriers + 1 KB alignment slack = 230,496 bytes (of 232,448). */
constexpr int W2_BN = 128;
constexpr int W2_NS = 3;
constexpr int W2_CONSUMER_REGS = 240, W2_PRODUCER_REGS = 24;
constexpr uint64_t W2_WAIT_LIMIT_NS = 4000000000ull; /* a wait takes microseconds; 4 s: something is wrong */
constexpr uint32_t W2_Q_WG_BYTES = 64 * WA_D * 2;        /* one warpgroup's 64 Q rows */
constexpr uint32_t W2_Q_BYTES = 2 * W2_Q_WG_BYTES;
constexpr uint32_t W2_TILE_BYTES = W2_BN * WA_D * 2;     /* one K (or V) tile */
constexpr uint32_t W2_STAGE_BYTES = 2 * W2_TILE_BYTES;   /* K then V */
constexpr size_t W2_SMEM = 1024 + W2_Q_BYTES + (size_t)W2_NS * W2_STAGE_BYTES + 4 * W2_NS * 8;
static_assert(2 * 128 * W2_CONSUMER_REGS + 128 * W2_PRODUCER_REGS == WA_THREADS * 168, "setmaxnreg budget");
static_assert(W2_NS >= 2, "a round holds tiles t - 1 and t");

/* fa_exponents' masking without the scale: logits stay raw (soft-capped: the base-2 exponent
 * cap2 tanh(s mul)); where `masked`, keys past kv_hi, after the row's position or before its window
 * start become -inf. */
template <int NT>
__device__ __forceinline__ void fa_logits_masked(float (&s)[NT][4], bool capped, float mul, float cap2, bool masked,
                                                 int kv0, int t4, int kv_hi, const int (&pos)[2],
                                                 const int (&lo)[2]) {
  if (capped) {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int c = 0; c < 4; c++)
        s[j][c] = cap2 * tanhf(s[j][c] * mul);
  }
  if (masked) {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int i = c >> 1, kj = kv0 + j * 8 + t4 * 2 + (c & 1);
        s[j][c] = kj < kv_hi && kj <= pos[i] && kj >= lo[i] ? s[j][c] : -INFINITY;
      }
  }
}

/* 2^x by one MUFU.EX2 (flushes subnormal results to 0; 2^-inf = 0). */
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <bool PINGPONG>
__global__ void __launch_bounds__(WA_THREADS, 1) attn_wgmma2_kernel(const __grid_constant__ attn_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace upf_wgmma;
  constexpr int KS = WA_D / 16, NT = W2_BN / 8, DT = WA_D / 8, PK = W2_BN / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t sbase = (sraw + 1023u) & ~1023u; /* swizzle atoms need 1024-byte alignment */
  const uint32_t qbase = sbase, ring = sbase + W2_Q_BYTES;
  const uint32_t fullk = ring + W2_NS * W2_STAGE_BYTES, fullv = fullk + W2_NS * 8;
  const uint32_t emptyk = fullv + W2_NS * 8, emptyv = emptyk + W2_NS * 8;
  const attn_tile tile = a.tiles[blockIdx.x / a.hq];
  const int hq = blockIdx.x % a.hq, hk = hq / a.group;
  /* Broadcasts make the role and the loop bounds provably warp-uniform for ptxas (else it serialises
   * the wgmma: C7518). */
  const int warp = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int kv_lo = __shfl_sync(0xffffffffu, tile.kv_lo, 0);
  const int ntiles = __shfl_sync(0xffffffffu, (tile.kv_hi - tile.kv_lo + W2_BN - 1) / W2_BN, 0);
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < W2_NS; i++) {
      mbar_init(fullk + 8 * i, 128); /* the producer's 128 lanes, each once its K copies (tile 0: and Q) landed */
      mbar_init(fullv + 8 * i, 128); /* the same for V */
      mbar_init(emptyk + 8 * i, 8);  /* the 8 consumer warps, once S of the stage's tile completed */
      mbar_init(emptyv + 8 * i, 8);  /* the same once P V completed */
    }
  }
  __syncthreads();
  if (ntiles <= 0) /* the plan never makes one (every row sees its own key); uniform over the CTA */
    return;

  if (warp >= 8) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W2_PRODUCER_REGS));
    /* Producer lane pl copies rows r + 16 j (j < 8, r = pl / 8) of Q (the CTA's 128 rows) and of every
     * K and V tile (128 keys), and of each row the 16-byte chunks c and c + 8 (c = pl % 8: dims
     * 8c .. 8c + 7 and 64 + 8c ..), 128 bytes apart in global memory (an immediate offset off one
     * pointer) and one 64-dims block apart in shared memory. With 128-byte rows and 1024-byte 8-row
     * groups, row R lands at (R / 8) * 1024 + (R % 8) * 128, chunk c ^ (R % 8) (the 128-byte swizzle);
     * rows 16 apart keep R % 8 = r % 8, so row r + 16 j lands at kvoff + j * 2048 (Q: in warpgroup
     * j / 4's block, at kvoff + (j % 4) * 2048). */
    const int pl = (int)threadIdx.x - 256, c = pl & 7, r = pl >> 3;
    const uint32_t kvoff = (uint32_t)(r >> 3) * 1024 + (uint32_t)(r & 7) * 128 + ((uint32_t)(c ^ (r & 7)) << 4);
    /* Byte pointers to a lane's row and the byte step to its next (16 rows on): one 64-bit add a row
     * (inline asm, so that the compiler does not turn the chain back into a multiply a row). */
    auto advance = [](const char *&p, int64_t step) { asm("add.s64 %0, %0, %1;\n" : "+l"(p) : "l"(step)); };
    {
      const char *qp = (const char *)(Q + (int64_t)(tile.q0 + tile.row0 + r) * a.q_s0 + (int64_t)hq * a.q_s1 + c * 8);
      const int64_t qstep = 16 * 2 * a.q_s0;
      const int qin = tile.q_len - (tile.row0 + r); /* row r + 16 j is in the request iff 16 j < qin */
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const bool ok = 16 * j < qin; /* rows past the request: zeros (never written) */
        const uint32_t qdst = qbase + (uint32_t)(j >> 2) * W2_Q_WG_BYTES + (uint32_t)(j & 3) * 2048 + kvoff;
        cp_async16_to(qdst, ok ? qp : (const char *)Q, ok);
        cp_async16_to(qdst + 64 * 128, ok ? qp + 128 : (const char *)Q, ok);
        advance(qp, qstep);
      }
    }
    const int64_t row = (int64_t)tile.kv_base + kv_lo + r;
    const char *kp = (const char *)(K + row * a.k_s0 + (int64_t)hk * a.k_s1 + c * 8);
    const char *vp = (const char *)(V + row * a.v_s0 + (int64_t)hk * a.v_s1 + c * 8);
    const int64_t kstep = 16 * 2 * a.k_s0, vstep = 16 * 2 * a.v_s0;
    int nin = tile.kv_hi - (kv_lo + r); /* of tile t: row r + 16 j is a key iff 16 j < nin */
    /* Tile t's ring stage, and the parity its empty barriers' wait needs, (t / W2_NS - 1) & 1: flipped on
     * entering stage 0, so 1 for t < W2_NS (never waited on), 0 from t = W2_NS (was 1: the first waits
     * passed at once and tile W2_NS overwrote a stage still being read; NaN on the device from 4 tiles). */
    uint32_t st = 0, eph = 0;
    bool live = true; /* false once a wait gave up: copy on without waiting, the kernel ends */
    for (int t = 0; t < ntiles; t++) {
      if (st == 0)
        eph ^= 1;
      const bool wait = t >= W2_NS && live;
      if (wait)
        live = mbar_wait_bounded(emptyk + 8 * st, eph, W2_WAIT_LIMIT_NS);
      const uint32_t kdst = ring + st * W2_STAGE_BYTES + kvoff, vdst = kdst + W2_TILE_BYTES;
      /* Every row of the tile a key (all tiles but a range's last): no predicates. Else rows past the
       * range are zero-filled (src-size 0; the pointer then only needs to be a valid address, and the
       * rows of a range's last tile lie before the next tile's first, which the 8 adds reach anyway). */
      const bool full = nin > 16 * 7;
      auto copy_tile = [&](uint32_t dst, const char *&p, int64_t step, const bf16_t *base) {
        if (full) {
#pragma unroll
          for (int j = 0; j < 8; j++) {
            cp_async16_full(dst + j * 2048, p);
            cp_async16_full(dst + j * 2048 + W2_TILE_BYTES / 2, p + 128);
            advance(p, step);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; j++) {
            const bool in = 16 * j < nin;
            cp_async16_to(dst + j * 2048, in ? p : (const char *)base, in);
            cp_async16_to(dst + j * 2048 + W2_TILE_BYTES / 2, in ? p + 128 : (const char *)base, in);
            advance(p, step);
          }
        }
      };
      copy_tile(kdst, kp, kstep, K);
      cp_async_mbar_arrive(fullk + 8 * st);
      if (wait && live)
        live = mbar_wait_bounded(emptyv + 8 * st, eph, W2_WAIT_LIMIT_NS);
      copy_tile(vdst, vp, vstep, V);
      cp_async_mbar_arrive(fullv + 8 * st);
      nin -= W2_BN;
      st = st == W2_NS - 1 ? 0 : st + 1;
    }
    cp_async_wait_all();
    return;
  }

  /* Consumers: warpgroup wg, warp w4 of it; this thread's rows g and g + 8 of the warp's 16. */
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(W2_CONSUMER_REGS));
  const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
  const int off = tile.kv_len - tile.q_len;
  const int wrow0 = tile.row0 + wg * 64 + w4 * 16;
  int pos[2], lo[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int qt = wrow0 + g + 8 * i;
    const int qc = qt < tile.q_len ? qt : tile.q_len - 1; /* rows past the request: the last row's position */
    pos[i] = qc + off;
    lo[i] = a.window > 0 ? pos[i] - a.window + 1 : 0;
  }
  const int wpos_first = (wrow0 < tile.q_len ? wrow0 : tile.q_len - 1) + off;
  const int wpos_last = (wrow0 + 15 < tile.q_len ? wrow0 + 15 : tile.q_len - 1) + off;
  const int wlo_last = a.window > 0 ? wpos_last - a.window + 1 : 0;
  const bool capped = a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E;
  const float cap2 = a.softcap * FA_LOG2E;
  const float mul2 = capped ? 1.0f : mul; /* logit (after fa_logits_masked) -> base-2 exponent */
  const uint32_t qwg = qbase + (uint32_t)wg * W2_Q_WG_BYTES;
  const uint32_t bar_mine = 1 + wg, bar_other = 2 - wg;
  auto my_turn = [&] {
    if constexpr (PINGPONG)
      named_bar_sync(bar_mine, 256);
  };
  auto pass_turn = [&] {
    if constexpr (PINGPONG)
      named_bar_arrive(bar_other, 256);
  };

  /* m: running max of the raw logits; msc = m * mul2 (rounded once), the base-2 reference every
   * exponent and the LSE use; both -inf while a row has seen nothing. */
  float m[2] = {-INFINITY, -INFINITY}, msc[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; n++)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float s[NT][4];
  uint32_t pa[PK][4];
  float alpha[2];
  bool live = true; /* false once a wait gave up (see above): no more waits, NaN results */

  /* The K (V) tile in ring stage st has landed (full barrier phase parity ph: tile t is in stage
   * t % W2_NS, parity (t / W2_NS) & 1; the loop below keeps both as counters). A round's waits are
   * followed by one fence_proxy_async: the cp.async (generic proxy) writes are ordered before the
   * wgmma (async proxy) reads. */
  auto wait_k = [&](uint32_t st, uint32_t ph) {
    if (live)
      live = mbar_wait_bounded(fullk + 8 * st, ph, W2_WAIT_LIMIT_NS);
  };
  auto wait_v = [&](uint32_t st, uint32_t ph) {
    if (live)
      live = mbar_wait_bounded(fullv + 8 * st, ph, W2_WAIT_LIMIT_NS);
  };
  /* Descriptors are built once per operand and advanced by adding (byte offset >> 4) to the address
   * field: every operand lies below 2^18 bytes, so the 14-bit field never carries. */
  const uint64_t desc_q = desc_kmajor_sw128(qwg);
  auto issue_s = [&](uint32_t st) { /* S = Q K^T of the tile in stage st, one commit group */
    const uint64_t desc_k = desc_kmajor_sw128(ring + st * W2_STAGE_BYTES);
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
      wgmma_m64n128k16_ss(s, desc_q + (uint64_t)(((ks >> 2) * (64 * 128) + (ks & 3) * 32) >> 4),
                          desc_k + (uint64_t)(((ks >> 2) * (W2_BN * 128) + (ks & 3) * 32) >> 4), ks);
    wg_commit();
  };
  auto issue_pv = [&](uint32_t st) { /* O += P V (stage st), one commit group; k-step kk = keys 16 kk .. 16 kk + 15 */
    const uint64_t desc_v = desc_mnmajor_sw128(ring + st * W2_STAGE_BYTES + W2_TILE_BYTES, W2_BN * 128);
#pragma unroll
    for (int kk = 0; kk < PK; kk++)
      wgmma_m64n128k16_tb(o, pa[kk], desc_v + (uint64_t)((kk * 2048) >> 4), 1);
    wg_commit();
  };
  auto release = [&](uint32_t bars, uint32_t st) { /* this warp's wgmma reads of stage st's K (V) are complete */
    __syncwarp();
    if (lane == 0)
      mbar_arrive(bars + 8 * st);
  };
  /* Softmax of S(t) (complete) in place: s becomes p; alpha = the factor for O and l. */
  auto softmax = [&](int t) {
    const int kv0 = kv_lo + t * W2_BN;
    const bool masked = kv0 + W2_BN - 1 > wpos_first || kv0 + W2_BN > tile.kv_hi || (a.window > 0 && kv0 < wlo_last);
    fa_logits_masked<NT>(s, capped, mul, cap2, masked, kv0, t4, tile.kv_hi, pos, lo);
    float mt[2] = {m[0], m[1]};
    fa_lane_row_max<NT>(s, mt);
    float ref[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; i++) {
      mt[i] = fa_quad_max(mt[i]);
      const float mn = mt[i] * mul2; /* mul2 > 0: -inf stays -inf; unchanged max: the same bits as msc */
      ref[i] = mn == -INFINITY ? 0.0f : mn; /* nothing visible yet: 2^(-inf - 0) = 0 */
      alpha[i] = ex2_approx(msc[i] - ref[i]); /* 1 while the max holds; 0 after a row's first keys */
      m[i] = mt[i];
      msc[i] = mn;
    }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) {
        s[j][c] = ex2_approx(fmaf(s[j][c], mul2, -ref[c >> 1]));
        rs[c >> 1] += s[j][c];
      }
#pragma unroll
    for (int i = 0; i < 2; i++)
      l[i] = fmaf(l[i], alpha[i], rs[i]); /* this lane's part of the row sum; the 4 parts meet at the end */
  };
  auto pack_p = [&] { /* P (bf16) as the A operand: k-step kk = accumulator n-blocks 2 kk, 2 kk + 1 */
#pragma unroll
    for (int kk = 0; kk < PK; kk++) {
      pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  auto rescale_o = [&] {
#pragma unroll
    for (int n = 0; n < DT; n++) {
      o[n][0] *= alpha[0], o[n][1] *= alpha[0];
      o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
  };

  if (PINGPONG && wg == 1)
    named_bar_arrive(1, 256); /* warpgroup 0 takes the first turn */
  /* round 0: S(0) */
  uint32_t st = 0, ph = 0; /* tile t's ring stage and full-barrier parity */
  wait_k(st, ph);
  fence_proxy_async();
  my_turn();
  wg_fence();
  issue_s(st);
  pass_turn();
  wg_wait<0>();
  release(emptyk, st);
  softmax(0); /* O is still 0: no rescale */
  pack_p();
  /* round t: S(t) and P V(t - 1) issued back to back; the softmax of t runs under P V(t - 1) and under
   * the other warpgroup's round. Commit order S(t), P V(t - 1): wait_group 1 = S(t) complete. */
  for (int t = 1; t < ntiles; t++) {
    const uint32_t sp = st, pp = ph; /* tile t - 1's */
    st = st == W2_NS - 1 ? 0 : st + 1;
    ph ^= st == 0 ? 1u : 0u;
    wait_k(st, ph);
    wait_v(sp, pp);
    fence_proxy_async();
    my_turn();
    wg_fence();
    issue_s(st);
    issue_pv(sp);
    pass_turn();
    wg_wait<1>();
    release(emptyk, st);
    softmax(t);
    /* x 1 is exact: where no row of the warp raised its max, skipping the rescale changes nothing.
     * The wait sits in both arms of the branch on purpose: as one wait after the softmax, ptxas 13.0
     * hoisted its WARPGROUP.DEPBAR above the whole softmax (nothing in the softmax depends on it), so
     * the softmax of tile t ran after P V(t - 1) had completed instead of under it. Behind the branch
     * the DEPBAR stays after the last EX2 (checked in the SASS of both PINGPONG forms). */
    const bool rescale = __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f);
    if (rescale) {
      wg_wait<0>();
      rescale_o();
    } else {
      wg_wait<0>();
    }
    release(emptyv, sp);
    pack_p();
  }
  /* round ntiles: the last P V (st, ph: tile ntiles - 1's) */
  wait_v(st, ph);
  fence_proxy_async();
  my_turn();
  wg_fence();
  issue_pv(st);
  if (wg == 0)
    pass_turn(); /* warpgroup 1's last arrive would have no round to open */
  wg_wait<0>();
  release(emptyv, st);

  if (!live)
    l[0] = l[1] = NAN;
  fa_store_rows<DT>(a, tile, hq, wrow0, g, t4, msc, l, o);
#else
  __trap(); /* built without sm_90a: the host never launches this */
#endif
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

template <typename T> __global__ void kv_cache_write_kernel(const T *k, int64_t k_s0, int64_t k_s1, const T *v,
                                                            int64_t v_s0, int64_t v_s1, const int32_t *slots,
                                                            T *kc, int64_t kc_s0, int64_t kc_s1, int64_t kc_s2,
                                                            T *vc, int64_t vc_s0, int64_t vc_s1, int64_t vc_s2,
                                                            int hkv, int d, int page_size) {
  const int64_t t = blockIdx.x;
  const int s = slots[t];
  if (s < 0)
    return;
  const int64_t page = s / page_size, off = s % page_size;
  for (int i = threadIdx.x; i < hkv * d; i += blockDim.x) {
    const int h = i / d, e = i - h * d;
    kc[page * kc_s0 + off * kc_s1 + (int64_t)h * kc_s2 + e] = k[t * k_s0 + (int64_t)h * k_s1 + e];
    vc[page * vc_s0 + off * vc_s1 + (int64_t)h * vc_s2 + e] = v[t * v_s0 + (int64_t)h * v_s1 + e];
  }
}

/* Per-request facts the planner needs. */
struct req_info {
  int32_t q0, q_len, kv_len, kv_base;
  int32_t req; /* block-table row (paged) */
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* The fixed-order merge of split tiles' parts (none: nothing to launch). */
template <typename T> upf_status launch_combine(attn_args &a, int ngroups) {
  if (ngroups > 0) {
    attn_combine_kernel<T><<<dim3((unsigned)ngroups, (unsigned)a.hkv), 128, 0, upf_cuda_stream()>>>(a);
    UPF_CUDA_LAUNCH_TRY("attn_combine_kernel");
  }
  return UPF_OK;
}

template <typename T, int DPL, bool PAGED> upf_status launch_attn(attn_args &a, int ntiles, int ngroups) {
  const size_t smem = (size_t)(ATT_BR * a.d + 2 * ATT_KT * (a.d + 1)) * sizeof(float);
  if (smem > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "attn (cuda): D=%d needs %zu bytes of shared memory, the device has %zu",
                    a.d, smem, upf_cuda_smem_optin());
  UPF_CUDA_TRY(cudaFuncSetAttribute(attn_ffma_kernel<T, DPL, PAGED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem));
  attn_ffma_kernel<T, DPL, PAGED><<<dim3((unsigned)ntiles, (unsigned)a.hkv), ATT_WARPS * 32, smem,
                                    upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_ffma_kernel");
  return launch_combine<T>(a, ngroups);
}

template <int D> upf_status launch_decode_v2(attn_args &a, int ntiles, int ngroups) {
  constexpr size_t smem = dec_shape<D>::smem;
  static bool attr_set;
  UPF_TRY(upf_cuda_smem_prepare(attn_decode_v2_kernel<D>, smem, false, &attr_set, "attn_decode_v2_kernel"));
  attn_decode_v2_kernel<D><<<dim3((unsigned)ntiles, (unsigned)a.hkv), DEC_THREADS, smem, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_decode_v2_kernel");
  return launch_combine<bf16_t>(a, ngroups);
}

template <int D> upf_status launch_decode_mma(attn_args &a, int ntiles, int ngroups) {
  constexpr size_t smem = md_shape<D>::smem;
  /* all of the SM's unified memory as shared memory: MIN_CTAS resident CTAs need it at D = 128 */
  static bool attr_set;
  UPF_TRY(upf_cuda_smem_prepare(attn_decode_mma_kernel<D>, smem, true, &attr_set, "attn_decode_mma_kernel"));
  attn_decode_mma_kernel<D><<<dim3((unsigned)ntiles, (unsigned)a.hkv), MD_THREADS, smem, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_decode_mma_kernel");
  return launch_combine<bf16_t>(a, ngroups);
}

template <typename T, bool PAGED> upf_status launch_d(attn_args &a, int ntiles, int ngroups) {
  if (a.d <= 64)
    return launch_attn<T, 2, PAGED>(a, ntiles, ngroups);
  if (a.d <= 128)
    return launch_attn<T, 4, PAGED>(a, ntiles, ngroups);
  return launch_attn<T, 8, PAGED>(a, ntiles, ngroups);
}

/* The kernel of the paged rows the FFMA kernel would take (see decode_kernel_selected). */
enum dec_kernel { DEC_FFMA = 0, DEC_V2 = 1, DEC_MMA = 2 };

/* Tiles every request's (token, group head) rows in ATT_BR blocks, splits long KV ranges when the
 * tiles alone would leave the GPU idle, uploads the plan and launches the FFMA kernel, or (decode =
 * DEC_V2 / DEC_MMA: paged bf16 with D = 64/128/256 and 16-byte rows, see decode_kernel_selected)
 * attn_decode_v2_kernel / attn_decode_mma_kernel. `a` has everything but the plan pointers. */
upf_status attn_plan_and_run(attn_args &a, const req_info *reqs, int32_t num_reqs, upf_dtype dtype, bool paged,
                             dec_kernel decode) {
  if (decode == DEC_MMA && !md_strides_ok(a))
    decode = DEC_V2;
  const int G = a.group;
  int64_t nbase = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    nbase += ((int64_t)reqs[r].q_len * G + ATT_BR - 1) / ATT_BR;
  if (nbase == 0)
    return UPF_OK;
  /* Split only when fewer than ATT_SPLIT_WAVES waves of CTAs would run (decode: memory-bound, and several
   * resident CTAs per SM overlap one's loads with another's math); a chunk keeps at least ATT_SPLIT_MIN
   * keys. */
  /* The mma decode kernel: MD_SPLIT_WAVES rounds of its resident CTAs (2 per SM at D <= 128), rounded
   * down, so that the CTAs of equal parts never spill a fraction of a round past the target. */
  const int64_t sms = upf_cuda_num_sms();
  int64_t want_split = 1;
  if (decode == DEC_MMA) {
    const int64_t target = MD_SPLIT_WAVES * (a.d <= 128 ? 2 : 1) * sms;
    want_split = nbase * a.hkv < target ? target / (nbase * a.hkv) : 1;
  } else {
    const int64_t target = (decode == DEC_V2 ? DEC_SPLIT_WAVES : ATT_SPLIT_WAVES) * sms;
    want_split = nbase * a.hkv < target ? (target + nbase * a.hkv - 1) / (nbase * a.hkv) : 1;
  }
  /* Pass 1 counts, pass 2 fills. */
  attn_tile *tiles = NULL;
  attn_group *groups = NULL;
  int64_t ntiles = 0, ngroups = 0, nparts = 0;
  for (int pass = 0; pass < 2; pass++) {
    ntiles = ngroups = nparts = 0;
    for (int32_t r = 0; r < num_reqs; r++) {
      const req_info &q = reqs[r];
      const int32_t rows = q.q_len * G, off = q.kv_len - q.q_len;
      for (int32_t row0 = 0; row0 < rows; row0 += ATT_BR) {
        const int32_t row_last = (row0 + ATT_BR < rows ? row0 + ATT_BR : rows) - 1;
        const int32_t hi = row_last / G + off + 1;
        int32_t lo = a.window > 0 ? row0 / G + off - a.window + 1 : 0;
        lo = lo < 0 ? 0 : lo;
        const int32_t span = hi - lo;
        int64_t nsplit = 1;
        if (want_split > 1 && span >= 2 * ATT_SPLIT_MIN) {
          nsplit = want_split < span / ATT_SPLIT_MIN ? want_split : span / ATT_SPLIT_MIN;
          nsplit = nsplit > 64 ? 64 : nsplit;
        }
        int32_t chunk = (int32_t)((span + nsplit - 1) / nsplit);
        chunk = (chunk + ATT_KT - 1) / ATT_KT * ATT_KT;
        nsplit = (span + chunk - 1) / chunk;
        attn_tile base = {q.q0, q.q_len, q.kv_len, q.kv_base, q.req, row0, lo, hi, -1};
        if (nsplit <= 1) {
          if (pass)
            tiles[ntiles] = base;
          ntiles++;
          continue;
        }
        if (pass)
          groups[ngroups] = attn_group{q.q0, q.q_len, row0, (int32_t)nparts, (int32_t)nsplit};
        ngroups++;
        for (int64_t s = 0; s < nsplit; s++) {
          if (pass) {
            attn_tile t = base;
            t.kv_lo = lo + (int32_t)s * chunk;
            t.kv_hi = t.kv_lo + chunk < hi ? t.kv_lo + chunk : hi;
            t.part = (int32_t)(nparts + s);
            tiles[ntiles] = t;
          }
          ntiles++;
        }
        nparts += nsplit;
      }
    }
    if (pass == 0) {
      if (ntiles > INT32_MAX)
        return upf_fail(UPF_ERR_SHAPE, "attn (cuda): %lld tiles exceed the grid", (long long)ntiles);
      tiles = (attn_tile *)malloc((size_t)ntiles * sizeof *tiles);
      groups = (attn_group *)malloc((size_t)(ngroups ? ngroups : 1) * sizeof *groups);
      if (!tiles || !groups) {
        free(tiles), free(groups);
        return upf_fail(UPF_ERR_NOMEM, "attn (cuda): plan of %lld tiles", (long long)ntiles);
      }
    }
  }
  const size_t tiles_bytes = align256((size_t)ntiles * sizeof(attn_tile));
  const size_t groups_bytes = align256((size_t)ngroups * sizeof(attn_group));
  const size_t part_rows = (size_t)nparts * a.hkv * ATT_BR;
  const size_t part_o_bytes = align256(part_rows * a.d * sizeof(float));
  const size_t part_lse_bytes = align256(part_rows * sizeof(float));
  void *ws = NULL;
  upf_status st = upf_cuda_workspace(tiles_bytes + groups_bytes + part_o_bytes + part_lse_bytes, &ws);
  if (st == UPF_OK) {
    char *p = (char *)ws;
    a.tiles = (const attn_tile *)p;
    a.groups = (const attn_group *)(p + tiles_bytes);
    a.part_o = (float *)(p + tiles_bytes + groups_bytes);
    a.part_lse = (float *)(p + tiles_bytes + groups_bytes + part_o_bytes);
    st = upf_cuda_upload_async(p, tiles, (size_t)ntiles * sizeof(attn_tile));
    if (st == UPF_OK && ngroups)
      st = upf_cuda_upload_async(p + tiles_bytes, groups, (size_t)ngroups * sizeof(attn_group));
  }
  free(tiles), free(groups);
  UPF_TRY(st);
  if (decode == DEC_MMA)
    return a.d == 64 ? launch_decode_mma<64>(a, (int)ntiles, (int)ngroups)
           : a.d == 128 ? launch_decode_mma<128>(a, (int)ntiles, (int)ngroups)
                        : launch_decode_mma<256>(a, (int)ntiles, (int)ngroups);
  if (decode == DEC_V2)
    return a.d == 64 ? launch_decode_v2<64>(a, (int)ntiles, (int)ngroups)
           : a.d == 128 ? launch_decode_v2<128>(a, (int)ntiles, (int)ngroups)
                        : launch_decode_v2<256>(a, (int)ntiles, (int)ngroups);
  if (dtype == UPF_DTYPE_BF16)
    return paged ? launch_d<bf16_t, true>(a, (int)ntiles, (int)ngroups)
                 : launch_d<bf16_t, false>(a, (int)ntiles, (int)ngroups);
  return paged ? launch_d<float, true>(a, (int)ntiles, (int)ngroups)
               : launch_d<float, false>(a, (int)ntiles, (int)ngroups);
}

/* A prefill kernel over the plan's tiles, one CTA a (tile, q head): the grid check, the shared-memory
 * preparation of the launch site (*attr_set, see upf_cuda_smem_prepare) and the launch. */
template <typename Kernel>
upf_status launch_prefill_tiles(Kernel *kernel, int threads, size_t smem, bool max_carveout, bool *attr_set,
                                const char *name, const attn_args &a, int ntiles) {
  if ((int64_t)ntiles * a.hq > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn (cuda): %d tiles x %d heads exceed the grid", ntiles, a.hq);
  UPF_TRY(upf_cuda_smem_prepare(kernel, smem, max_carveout, attr_set, name));
  kernel<<<(unsigned)(ntiles * a.hq), threads, smem, upf_cuda_stream()>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? UPF_OK : upf_cuda_fail(err, name, __FILE__, __LINE__);
}

/* The tensor-core path: tiles of BM query rows per (request, q head), no split (a prefill has rows
 * enough to fill the GPU). 64-row tiles ask for all of the SM's unified memory as shared memory: two
 * CTAs an SM need it. */
template <int D, int BN, int STAGES, bool PAGED, int BM = FA_BM> upf_status launch_fa2(attn_args &a, int ntiles) {
  constexpr size_t smem = (size_t)(BM + 2 * STAGES * BN) * (D + 8) * sizeof(bf16_t);
  static bool attr_set;
  return launch_prefill_tiles(attn_fa2_kernel<D, BN, STAGES, PAGED, BM>, BM / 16 * 32, smem, BM != FA_BM, &attr_set,
                              "attn_fa2_kernel", a, ntiles);
}

/* The same tiles on attn_fa2_persistent_kernel: as many CTAs as fit at once (the occupancy the runtime
 * reports for the kernel, read once per instantiation), at most max_ctas when that is > 0, at most one an
 * item. work_next (one int32 of device memory) is zeroed on the stream before the launch. */
template <int D, int BN, int STAGES, bool PAGED, int BM = FA_BM>
upf_status launch_fa2_persistent(attn_args &a, int ntiles, int max_ctas, int32_t *work_next) {
  constexpr size_t smem = (size_t)(BM + 2 * STAGES * BN) * (D + 8) * sizeof(bf16_t);
  constexpr int threads = BM / 16 * 32;
  /* item indices up to gridDim.x + work_next stay below 2 x items: int32 */
  const int64_t items = (int64_t)ntiles * a.hq;
  if (items > INT32_MAX / 2)
    return upf_fail(UPF_ERR_SHAPE, "attn (cuda): %d tiles x %d heads exceed the persistent schedule", ntiles, a.hq);
  static bool attr_set; /* as launch_fa2 */
  UPF_TRY((upf_cuda_smem_prepare(attn_fa2_persistent_kernel<D, BN, STAGES, PAGED, BM>, smem, BM != FA_BM, &attr_set,
                                 "attn_fa2_persistent_kernel")));
  static int per_sm = 0; /* one device per process (the backend's) */
  if (per_sm == 0) {
    int n = 0;
    UPF_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, attn_fa2_persistent_kernel<D, BN, STAGES, PAGED, BM>, threads, smem));
    if (n < 1)
      return upf_fail(UPF_ERR_UNSUPPORTED, "attn (cuda): the persistent D=%d kernel fits no CTA on an SM", D);
    per_sm = n;
  }
  int64_t grid = (int64_t)upf_cuda_num_sms() * per_sm;
  if (max_ctas > 0 && grid > max_ctas)
    grid = max_ctas;
  if (grid > items)
    grid = items;
  if (grid < 1)
    grid = 1;
  a.work_next = work_next;
  a.work_items = (int32_t)items;
  UPF_CUDA_TRY(cudaMemsetAsync(work_next, 0, sizeof *work_next, upf_cuda_stream()));
  attn_fa2_persistent_kernel<D, BN, STAGES, PAGED, BM><<<(unsigned)grid, threads, smem, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_fa2_persistent_kernel");
  return UPF_OK;
}

template <bool PINGPONG> upf_status launch_wgmma2(attn_args &a, int ntiles) {
  static bool attr_set;
  return launch_prefill_tiles(attn_wgmma2_kernel<PINGPONG>, WA_THREADS, W2_SMEM, false, &attr_set,
                              "attn_wgmma2_kernel", a, ntiles);
}

template <bool OVERLAP> upf_status launch_wgmma(attn_args &a, int ntiles) {
  static bool attr_set;
  return launch_prefill_tiles(attn_wgmma_kernel<OVERLAP>, WA_THREADS, WA_SMEM, false, &attr_set, "attn_wgmma_kernel",
                              a, ntiles);
}

/* UPF_ATTN_PREFILL (read once per process; any value but these is an error naming it) picks the kernel
 * of bf16 D = 128 prefill over contiguous K/V, by its index here: unset or "wgmma2-nopp" =
 * attn_wgmma2_kernel without the ping-pong named barriers (4, the default since the H200 run at e863817:
 * full verify 147/147, sanitizers clean; 512 / 473 TFLOP/s at 32K / 128K = 0.88x / 0.85x torch SDPA's
 * cuDNN), "wgmma2" = the same with the ping-pong (3; 513 / 454: no faster at 32K, slower at 128K),
 * "wgmma" = attn_wgmma_kernel with each wgmma group waited for at once (1, the default before: 297 /
 * 302), "wgmma-overlap" = S(t + 1) in flight during the softmax of tile t (2; measured no faster),
 * "fa2" = attn_fa2_kernel (0), which every other shape takes anyway. */
const char *const PREFILL_KERNELS[] = {"fa2", "wgmma", "wgmma-overlap", "wgmma2", "wgmma2-nopp"};
upf_status prefill_kernel_selected(int *mode) {
  static int cache = -1;
  return upf_env_choice_once("UPF_ATTN_PREFILL", PREFILL_KERNELS, 5, 4, &cache, mode);
}

/* Heaviest tiles (longest key span) first, ties in plan order: the last wave holds short tiles. */
int tile_heavier_first(const void *x, const void *y) {
  const attn_tile *p = (const attn_tile *)x, *q = (const attn_tile *)y;
  const int32_t sp = p->kv_hi - p->kv_lo, sq = q->kv_hi - q->kv_lo;
  if (sp != sq)
    return sp > sq ? -1 : 1;
  if (p->q0 != q->q0)
    return p->q0 < q->q0 ? -1 : 1;
  return p->row0 < q->row0 ? -1 : p->row0 > q->row0;
}

/* UPF_ATTN_SWA_BM (read once per process; any value but these is an error naming it): the query rows of
 * a tile of windowed prefill at D = 64 and 256 on the FA2 kernel. Unset or "128" = FA_BM, the tiles every
 * other prefill takes; "64" = FA_SWA_BM. Measured at b0390b2 (Gemma-3 shapes, w = 1024, time per visible
 * key vs global causal at T = 4K / 16K / 64K): 128 rows 1.42x / 1.22x / 1.18x, 64 rows 1.54x / 1.37x /
 * 1.35x, so 128 is the default (64 had been predicted 1.30x / 1.14x / 1.12x; perf/NOTES.md). Rows per
 * tile of this call's plan: FA_SWA_BM or FA_BM (by the switch) for windowed rows at D = 64 and 256,
 * FA_BM for everything else. D = 128 keeps FA_BM either way: its contiguous form runs the wgmma kernels
 * on the same plan (WA_BM rows). */
const char *const SWA_TILE_ROWS[] = {"128", "64"};
upf_status fa2_tile_rows(const attn_args &a, int32_t *bm) {
  *bm = FA_BM;
  if (!(a.window > 0 && (a.d == 64 || a.d == 256)))
    return UPF_OK;
  static int cache = -1;
  int index = 0;
  UPF_TRY(upf_env_choice_once("UPF_ATTN_SWA_BM", SWA_TILE_ROWS, 2, 0, &cache, &index));
  *bm = index == 0 ? FA_BM : FA_SWA_BM;
  return UPF_OK;
}

/* UPF_ATTN_SWA_SCHED (read once per process; any value but these is an error naming it): how the FA2
 * kernel's tiles at D = 64 and 256 (windowed or not, contiguous or paged: every prefill there runs
 * attn_fa2_kernel, so the sliding-window / global comparison stays one kernel family against itself) are
 * scheduled. Unset or "grid" = attn_fa2_kernel, one CTA a (tile, q head), the default (measured at
 * b36dc5a, the persistent form gives the same bits about 4% slower on global and window alike: ~4% more
 * instructions in its loop, nothing gained by the hidden fill; perf/NOTES.md); "persistent" =
 * attn_fa2_persistent_kernel on as many CTAs as fit at once;
 * "persistent-2cta" = the same kernel on two CTAs in all, for verification only: every CTA then walks many
 * items, so that `upf verify` covers the item loop and its hand-overs even on shapes with fewer items
 * than the GPU has slots. D = 128 keeps the grid form (its contiguous prefill runs the wgmma kernels). */
const char *const FA2_SCHEDULES[] = {"grid", "persistent", "persistent-2cta"};
enum { FA2_SCHED_GRID = 0, FA2_SCHED_PERSISTENT = 1, FA2_SCHED_PERSISTENT_2CTA = 2 };
upf_status fa2_schedule_selected(const attn_args &a, int *sched) {
  *sched = FA2_SCHED_GRID;
  if (a.d != 64 && a.d != 256)
    return UPF_OK;
  static int cache = -1;
  return upf_env_choice_once("UPF_ATTN_SWA_SCHED", FA2_SCHEDULES, 3, FA2_SCHED_GRID, &cache, sched);
}

template <bool PAGED> upf_status mma_plan_and_run(attn_args &a, const req_info *reqs, int32_t num_reqs) {
  int32_t bm = FA_BM;
  UPF_TRY(fa2_tile_rows(a, &bm));
  int sched = FA2_SCHED_GRID;
  UPF_TRY(fa2_schedule_selected(a, &sched));
  int prefill = 0; /* 0: the FA2 kernel; else a Hopper kernel, see prefill_kernel_selected */
  if (!PAGED && a.d == WA_D)
    UPF_TRY(prefill_kernel_selected(&prefill));
  int64_t ntiles = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    ntiles += (reqs[r].q_len + bm - 1) / bm;
  if (ntiles == 0)
    return UPF_OK;
  if (ntiles > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn (cuda): %lld tiles exceed the grid", (long long)ntiles);
  attn_tile *tiles = (attn_tile *)malloc((size_t)ntiles * sizeof *tiles);
  if (!tiles)
    return upf_fail(UPF_ERR_NOMEM, "attn (cuda): plan of %lld tiles", (long long)ntiles);
  int64_t n = 0;
  for (int32_t r = 0; r < num_reqs; r++) {
    const req_info &q = reqs[r];
    const int32_t off = q.kv_len - q.q_len;
    for (int32_t row0 = 0; row0 < q.q_len; row0 += bm) {
      const int32_t last = (row0 + bm < q.q_len ? row0 + bm : q.q_len) - 1;
      int32_t lo = a.window > 0 ? row0 + off - a.window + 1 : 0;
      lo = lo < 0 ? 0 : lo;
      tiles[n++] = attn_tile{q.q0, q.q_len, q.kv_len, q.kv_base, q.req, row0, lo, last + off + 1, -1};
    }
  }
  qsort(tiles, (size_t)ntiles, sizeof *tiles, tile_heavier_first);
  /* the tile list, then (persistent schedule) the work counter in a 256-byte slot of its own */
  const size_t tiles_bytes = align256((size_t)ntiles * sizeof(attn_tile));
  void *ws = NULL;
  upf_status st = upf_cuda_workspace(tiles_bytes + 256, &ws);
  if (st == UPF_OK)
    st = upf_cuda_upload_async(ws, tiles, (size_t)ntiles * sizeof(attn_tile));
  free(tiles);
  UPF_TRY(st);
  a.tiles = (const attn_tile *)ws;
  if (sched != FA2_SCHED_GRID) { /* D = 64 or 256 (fa2_schedule_selected) */
    int32_t *work_next = (int32_t *)((char *)ws + tiles_bytes);
    const int max_ctas = sched == FA2_SCHED_PERSISTENT_2CTA ? 2 : 0;
    if (bm == FA_SWA_BM)
      return a.d == 64 ? launch_fa2_persistent<64, 64, 3, PAGED, FA_SWA_BM>(a, (int)ntiles, max_ctas, work_next)
                       : launch_fa2_persistent<256, 32, 2, PAGED, FA_SWA_BM>(a, (int)ntiles, max_ctas, work_next);
    return a.d == 64 ? launch_fa2_persistent<64, 128, 3, PAGED>(a, (int)ntiles, max_ctas, work_next)
                     : launch_fa2_persistent<256, 64, 2, PAGED>(a, (int)ntiles, max_ctas, work_next);
  }
  /* 64-row tiles: two CTAs an SM (D = 256: 99 KB of shared memory each, 32-key ring stages; D = 64: 63 KB) */
  if (bm == FA_SWA_BM)
    return a.d == 64 ? launch_fa2<64, 64, 3, PAGED, FA_SWA_BM>(a, (int)ntiles)
                     : launch_fa2<256, 32, 2, PAGED, FA_SWA_BM>(a, (int)ntiles);
  if (prefill)
    return prefill == 4   ? launch_wgmma2<false>(a, (int)ntiles)
           : prefill == 3 ? launch_wgmma2<true>(a, (int)ntiles)
           : prefill == 2 ? launch_wgmma<true>(a, (int)ntiles)
                          : launch_wgmma<false>(a, (int)ntiles);
  if (a.d == 64)
    return launch_fa2<64, 128, 3, PAGED>(a, (int)ntiles);
  if (a.d == 128)
    return launch_fa2<128, 64, 3, PAGED>(a, (int)ntiles);
  return launch_fa2<256, 64, 2, PAGED>(a, (int)ntiles);
}

/* The mma path takes bf16 with D = 64/128/256 and 16-byte rows: every base pointer 16-byte aligned,
 * every stride a multiple of 8 elements. */
bool mma_ok(const upf_tensor *q, const upf_tensor *k, const upf_tensor *v, const upf_tensor *out) {
  if (q->dtype != UPF_DTYPE_BF16 || (q->shape[2] != 64 && q->shape[2] != 128 && q->shape[2] != 256))
    return false;
  if (q->shape[1] > 65535)
    return false;
  const upf_tensor *ts[4] = {q, k, v, out};
  for (int i = 0; i < 4; i++) {
    if ((uintptr_t)ts[i]->data % 16 != 0)
      return false;
    for (int j = 0; j < ts[i]->ndim - 1; j++) /* every outer stride: the paged caches have three */
      if (ts[i]->stride[j] % 8 != 0)
        return false;
  }
  return true;
}

/* UPF_ATTN_DECODE (read once per process; any value but these is an error naming it): unset or "mma"
 * sends the paged rows that the FFMA kernel takes (decode steps and chunks of fewer than MMA_MIN_Q_ROWS
 * query rows) to attn_decode_mma_kernel wherever the mma path's layout conditions hold (bf16, D =
 * 64/128/256, 16-byte rows) — the default since the H200 run at 2d560e6 (full verify 147/147,
 * sanitizers clean; 0.83-0.93 of copy bandwidth against v2's 0.47-0.54); "v2" sends the same rows to
 * attn_decode_v2_kernel (FFMA dot products, the default before); "ffma" keeps them on the FFMA kernel,
 * which every other shape takes anyway. Indexed as dec_kernel. */
const char *const DECODE_KERNELS[] = {"ffma", "v2", "mma"};
static_assert(DEC_FFMA == 0 && DEC_V2 == 1 && DEC_MMA == 2, "DECODE_KERNELS is indexed by dec_kernel");
upf_status decode_kernel_selected(dec_kernel *k) {
  static int cache = -1;
  int index = DEC_MMA;
  UPF_TRY(upf_env_choice_once("UPF_ATTN_DECODE", DECODE_KERNELS, 3, DEC_MMA, &cache, &index));
  *k = (dec_kernel)index;
  return UPF_OK;
}

/* Paged requests with at least this many query rows (prefill against the cache) take the mma path
 * when it applies; decode rows and short chunks stay on the FFMA kernel's GQA-packed tiles. */
constexpr int MMA_MIN_Q_ROWS = 16;

void args_common(attn_args &a, const upf_tensor *q, const upf_attn_params *p, const upf_tensor *out,
                 const upf_tensor *lse, int64_t hkv) {
  a.q = q->data, a.q_s0 = q->stride[0], a.q_s1 = q->stride[1];
  a.out = out->data, a.o_s0 = out->stride[0], a.o_s1 = out->stride[1];
  a.lse = lse ? (float *)lse->data : nullptr;
  a.hq = (int)q->shape[1], a.hkv = (int)hkv, a.group = (int)(q->shape[1] / hkv), a.d = (int)q->shape[2];
  a.scale = (float)upf_attn_scale(p, q->shape[2]);
  a.softcap = p->softcap;
  a.window = p->window;
}

/* Every K/V row of the FFMA kernel starts 16-byte aligned and holds whole runs of 8 bf16. */
bool kv_vec8(const upf_tensor *k, const upf_tensor *v) {
  if (k->dtype != UPF_DTYPE_BF16 || k->shape[k->ndim - 1] % 8 != 0)
    return false;
  const upf_tensor *ts[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    if ((uintptr_t)ts[i]->data % 16 != 0 || ts[i]->stride[ts[i]->ndim - 1] != 1)
      return false;
    for (int j = 0; j < ts[i]->ndim - 1; j++)
      if (ts[i]->stride[j] % 8 != 0)
        return false;
  }
  return true;
}

upf_status check_dims(const char *op, const upf_tensor *q, int64_t hkv) {
  if (q->shape[2] > UPF_CUDA_ATTN_MAX_D)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): head dim D=%lld above the kernel's %d", op,
                    (long long)q->shape[2], UPF_CUDA_ATTN_MAX_D);
  if (hkv > 65535)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): Hkv=%lld exceeds the grid", op, (long long)hkv);
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                            const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                                            const upf_tensor *lse) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_attn_prefill_check(b, q, k, v, p, out, lse));
  UPF_TRY(check_dims("attn.prefill", q, k->shape[1]));
  if (q->shape[0] == 0)
    return UPF_OK;
  req_info *reqs = (req_info *)malloc((size_t)b->num_reqs * sizeof *reqs);
  if (!reqs)
    return upf_fail(UPF_ERR_NOMEM, "attn.prefill (cuda): %d requests", b->num_reqs);
  for (int32_t r = 0; r < b->num_reqs; r++) {
    const int32_t *cq = b->cu_seqlens_q_host, *ck = b->cu_seqlens_kv_host;
    reqs[r] = req_info{cq[r], cq[r + 1] - cq[r], ck[r + 1] - ck[r], ck[r], r};
  }
  attn_args a = {};
  args_common(a, q, p, out, lse, k->shape[1]);
  a.k = k->data, a.k_s0 = k->stride[0], a.k_s1 = k->stride[1];
  a.v = v->data, a.v_s0 = v->stride[0], a.v_s1 = v->stride[1];
  a.vec8 = kv_vec8(k, v);
  upf_status st = mma_ok(q, k, v, out) ? mma_plan_and_run<false>(a, reqs, b->num_reqs)
                                       : attn_plan_and_run(a, reqs, b->num_reqs, q->dtype, false, DEC_FFMA);
  free(reqs);
  return st;
}

extern "C" upf_status upf_cuda_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                                          const upf_tensor *v_cache, const upf_attn_params *p,
                                          const upf_tensor *out, const upf_tensor *lse) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_attn_paged_check(b, q, k_cache, v_cache, p, out, lse));
  UPF_TRY(check_dims("attn.paged", q, k_cache->shape[2]));
  if (q->shape[0] == 0)
    return UPF_OK;
  req_info *reqs = (req_info *)malloc((size_t)b->num_reqs * sizeof *reqs);
  if (!reqs)
    return upf_fail(UPF_ERR_NOMEM, "attn.paged (cuda): %d requests", b->num_reqs);
  /* Long query runs first (mma path when it applies), then the rest (FFMA): the two launches write
   * disjoint rows. Both plans share the workspace; the stream orders the second upload after the
   * first kernel. */
  const bool mma = mma_ok(q, k_cache, v_cache, out);
  const int32_t *cq = b->cu_seqlens_q_host;
  int32_t n_long = 0, n = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int32_t r = 0; r < b->num_reqs; r++) {
      const bool is_long = mma && cq[r + 1] - cq[r] >= MMA_MIN_Q_ROWS;
      if (is_long == (pass == 0))
        reqs[n++] = req_info{cq[r], cq[r + 1] - cq[r], b->kv_lens_host[r], 0, r};
      n_long += is_long && pass == 0;
    }
  attn_args a = {};
  args_common(a, q, p, out, lse, k_cache->shape[2]);
  a.k = k_cache->data, a.k_s0 = k_cache->stride[0], a.k_s1 = k_cache->stride[1], a.k_s2 = k_cache->stride[2];
  a.v = v_cache->data, a.v_s0 = v_cache->stride[0], a.v_s1 = v_cache->stride[1], a.v_s2 = v_cache->stride[2];
  a.block_table = b->block_table, a.max_blocks = b->max_blocks, a.page_size = b->page_size;
  a.vec8 = kv_vec8(k_cache, v_cache);
  dec_kernel decode = DEC_FFMA;
  upf_status st = mma ? decode_kernel_selected(&decode) : UPF_OK;
  if (st == UPF_OK && n_long)
    st = mma_plan_and_run<true>(a, reqs, n_long);
  if (st == UPF_OK && n_long < b->num_reqs)
    st = attn_plan_and_run(a, reqs + n_long, b->num_reqs - n_long, q->dtype, true, decode);
  free(reqs);
  return st;
}

extern "C" upf_status upf_cuda_kv_cache_write(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping,
                                              const int32_t *slot_mapping_host, const upf_tensor *k_cache,
                                              const upf_tensor *v_cache) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_kv_cache_write_check(k, v, slot_mapping_host, k_cache, v_cache));
  const int64_t T = k->shape[0];
  if (T == 0)
    return UPF_OK;
  if (T > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "kv_cache.write (cuda): T=%lld exceeds the grid", (long long)T);
  cudaStream_t stream = upf_cuda_stream();
  const int hkv = (int)k->shape[1], d = (int)k->shape[2], P = (int)k_cache->shape[1];
  const int threads = hkv * d >= 256 ? 256 : hkv * d <= 32 ? 32 : (hkv * d + 31) / 32 * 32;
  if (k->dtype == UPF_DTYPE_BF16)
    kv_cache_write_kernel<bf16_t><<<(unsigned)T, threads, 0, stream>>>(
        (const bf16_t *)k->data, k->stride[0], k->stride[1], (const bf16_t *)v->data, v->stride[0], v->stride[1],
        slot_mapping, (bf16_t *)k_cache->data, k_cache->stride[0], k_cache->stride[1], k_cache->stride[2],
        (bf16_t *)v_cache->data, v_cache->stride[0], v_cache->stride[1], v_cache->stride[2], hkv, d, P);
  else
    kv_cache_write_kernel<float><<<(unsigned)T, threads, 0, stream>>>(
        (const float *)k->data, k->stride[0], k->stride[1], (const float *)v->data, v->stride[0], v->stride[1],
        slot_mapping, (float *)k_cache->data, k_cache->stride[0], k_cache->stride[1], k_cache->stride[2],
        (float *)v_cache->data, v_cache->stride[0], v_cache->stride[1], v_cache->stride[2], hkv, d, P);
  UPF_CUDA_LAUNCH_TRY("kv_cache_write_kernel");
  return UPF_OK;
}

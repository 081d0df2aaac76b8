/* Private header of the CUDA attention sources (cuda/attn*.cu; C++ only, not part of the C API of
 * cuda/attn.cuh): the work plan every kernel reads (tiles, split groups, one argument block), the
 * device helpers that more than one kernel family shares, and the launch functions through which
 * cuda/attn.cu, the dispatch, reaches each family.
 *
 * Rows: a "row" of the FFMA and decode kernels is a (query token, q head of the kv head's GQA group)
 * pair in token-major order, so a decode step's whole GQA group shares one CTA and one read of each K/V
 * tile; the prefill kernels (FA2, wgmma) take one q head a CTA and a row is a query token.
 * Layouts: q, out (Tq, Hq, D); contiguous K/V (Tkv, Hkv, D); paged K/V (pages, P, Hkv, D) through a
 * block table (B, max_blocks); lse (Tq, Hq); strides in elements. */
#ifndef UNIPREFILL_CUDA_ATTN_KERNELS_CUH
#define UNIPREFILL_CUDA_ATTN_KERNELS_CUH

#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/mma_sync.cuh"
#include "uniprefill/status.h"
#include "uniprefill/tensor.h"

namespace upf_attn {

typedef __nv_bfloat16 bf16_t;

/* ---- The FFMA and decode kernels' tiles ---- */
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
};

/* ---- The prefill plan's constants (FA2 and wgmma kernels) ---- */
constexpr int FA_BM = 128; /* query rows a prefill tile */
constexpr float FA_LOG2E = 1.4426950408889634f;
constexpr float FA_LN2 = 0.6931471805599453f;

/* ---- The mma decode kernel's split-KV plan (cuda/attn_decode.cu) ---- */
constexpr int MD_SPLIT_WAVES = 4; /* split-KV target: rounds of resident CTAs */
/* Resident CTAs an SM of the decode kernel at head dim d (its launch bounds and shared memory). */
constexpr int md_ctas_per_sm(int d) { return d <= 128 ? 2 : 1; }

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float x) { return __float2bfloat16_rn(x); }

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

/* ---- Shared by the mma.sync kernels (FA2 prefill, mma decode) and the wgmma prefill ----
 * The fragment helpers (pack_bf16, mma_bf16, ldmatrix, cp.async) are cuda/mma_sync.cuh's. */
using upf_mma::cp_async16;
using upf_mma::cp_async_commit;
using upf_mma::cp_async_wait;
using upf_mma::ldsm_x4;
using upf_mma::ldsm_x4_trans;
using upf_mma::mma_bf16;
using upf_mma::pack_bf16;

/* The parts of the FlashAttention-2 step that attn_fa2_kernel, attn_decode_mma_kernel (mma.sync) and
 * attn_wgmma2_kernel share: all hold S, P and O in the m16n8 accumulator layout, where this thread owns
 * rows g and g + 8 (i = c >> 1) of the warp's 16 and, in n-block j, keys kv0 + 8j + 2 t4 + (c & 1). */

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

/* One key tile of attn_fa2_kernel (BN keys) and of attn_decode_mma_kernel (16 keys), in two halves.
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

/* ---- Launches (one function a family; `a` holds the uploaded plan) ---- */

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

/* cuda/attn_ffma.cu: the FFMA kernel over the plan's ATT_BR-row tiles (f32 or bf16, any D <= 256;
 * K/V through the block table when paged), and the fixed-order merge of split tiles' parts (none when
 * ngroups is 0). */
upf_status launch_ffma(attn_args &a, upf_dtype dtype, bool paged, int ntiles);
upf_status launch_combine(attn_args &a, upf_dtype dtype, int ngroups);
/* cuda/attn_fa2.cu: the FA2 mma.sync prefill over FA_BM-row tiles, bf16, D = 64/128/256. */
upf_status launch_fa2(attn_args &a, bool paged, int ntiles);
/* cuda/attn_hopper.cu: the wgmma prefill over FA_BM-row tiles, bf16, contiguous K/V, for the shapes
 * wgmma2_takes accepts (D = 128; D = 256 without soft-cap). */
bool wgmma2_takes(const attn_args &a);
upf_status launch_wgmma2(attn_args &a, int ntiles);
/* cuda/attn_decode.cu: the mma decode kernel over the plan's ATT_BR-row tiles (paged, bf16, D =
 * 64/128/256); it takes the caches only where md_strides_ok. */
upf_status launch_decode_mma(attn_args &a, int ntiles);
bool md_strides_ok(const attn_args &a);

} // namespace upf_attn
#endif

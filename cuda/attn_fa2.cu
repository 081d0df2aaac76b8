/* The bf16 tensor-core prefill on mma.sync (FlashAttention-2 forward): attn.prefill for bf16 at D = 64,
 * 128 (paged, or the attn.prefill=fa2 variant) and 256 with 16-byte aligned rows, and attn.paged for
 * requests of at least 16 query rows (prefill against the cache).
 *
 * Per KV tile of BN keys each warp computes S (16 x BN) = Q K^T by mma.sync m16n8k16 (bf16 in, fp32
 * accumulate), scale, soft-cap and masks in registers, the online softmax on the accumulator layout (a
 * row's 4 owner lanes reduce by xor 1, 2), then P (rounded to bf16, as FlashAttention does) times V
 * by mma into O (16 x D per warp, fp32). The S accumulator layout is exactly the A-operand layout of
 * the P.V mma, so P never leaves registers. Q, K, V tiles sit in shared memory with rows padded by 16
 * bytes: an ldmatrix phase's 8 row addresses hit 8 distinct 16-byte bank groups.
 * Fragment layouts (PTX ISA, mma.m16n8k16 .bf16): g = lane / 4, t = lane % 4;
 *   A regs {row g, cols 2t..2t+1}, {row g+8, same}, {row g, cols 2t+8..}, {row g+8, cols 2t+8..};
 *   B regs {k 2t..2t+1, col g}, {k 2t+8.., col g};  C {row g, cols 2t, 2t+1}, {row g+8, same}.
 * The tile step (fa2_scores, fa2_softmax_pv) and the row store are cuda/attn_kernels.cuh's, shared with
 * the mma decode kernel and the wgmma prefill. */
#include <math.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"

namespace upf_attn {
namespace {

/* attn_fa2_kernel<D, BN, STAGES, PAGED>: a CTA of 8 warps owns FA_BM = 128 query rows of one request and
 * one q head; warp w owns rows [16w, 16w + 16).
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
 * 128-row tiles for sliding windows too: 64-row tiles (less excess at a window's edges, two CTAs an SM)
 * measured slower, their 32-key ring stages doubling the per-key overhead; one CTA a tile rather than a
 * persistent loop over tiles, which measured the same bits ~4% slower (perf/NOTES.md). */
template <int D, int BN, int STAGES, bool PAGED>
__global__ void __launch_bounds__(FA_BM / 16 * 32, 1) attn_fa2_kernel(const __grid_constant__ attn_args a) {
  constexpr int BM = FA_BM, LD = D + 8, NT = BN / 8, DT = D / 8, KS = D / 16, CH = D / 8, NTHREADS = BM / 16 * 32;
  constexpr bool Q_IN_REGS = D <= 128;
  static_assert(NT % 2 == 0 && DT % 2 == 0 && STAGES >= 2, "tile shape");
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

template <int D, int BN, int STAGES, bool PAGED> upf_status launch_fa2_kernel(attn_args &a, int ntiles) {
  constexpr size_t smem = (size_t)(FA_BM + 2 * STAGES * BN) * (D + 8) * sizeof(bf16_t);
  static bool attr_set;
  return launch_prefill_tiles(attn_fa2_kernel<D, BN, STAGES, PAGED>, FA_BM / 16 * 32, smem, false, &attr_set,
                              "attn_fa2_kernel", a, ntiles);
}

template <bool PAGED> upf_status launch_fa2_d(attn_args &a, int ntiles) {
  if (a.d == 64)
    return launch_fa2_kernel<64, 128, 3, PAGED>(a, ntiles);
  if (a.d == 128)
    return launch_fa2_kernel<128, 64, 3, PAGED>(a, ntiles);
  return launch_fa2_kernel<256, 64, 2, PAGED>(a, ntiles);
}

} // namespace

upf_status launch_fa2(attn_args &a, bool paged, int ntiles) {
  return paged ? launch_fa2_d<true>(a, ntiles) : launch_fa2_d<false>(a, ntiles);
}

} // namespace upf_attn

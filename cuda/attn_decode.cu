/* Paged decode on tensor cores: attn.paged's rows that are decode steps or short query runs (fewer than
 * 16 query rows a request), bf16, D = 64/128/256, 16-byte rows (the attn.paged=mma variant, the
 * default; attn.paged=ffma leaves them on the FFMA kernel).
 *
 * attn_decode_mma_kernel<D>: the FFMA kernel's tiles (ATT_BR = 16 (token, group head) rows of one
 * request and one kv head over keys [kv_lo, kv_hi), cuda/attn_kernels.cuh) and split-KV plan, with the
 * dot products on mma.sync (FlashInfer's tensor-core decode): the tile's 16 rows are the M dimension of
 * m16n8k16 (a Llama decode step fills 4 of them: decode is memory-bound, the idle rows cost nothing that
 * matters, and every row of a multi-token step fits in one pass).
 *  - Q (16 rows x D) is copied once into shared memory (rows past the tile zero-filled) and, at D <= 128,
 *    held as A fragments in registers for the whole kernel; at D = 256 it is read by ldmatrix each step.
 *  - MD_WARPS = 4 warps, each over its own contiguous slice of the tile's keys in steps of MD_BN = 16
 *    keys; a step's K and V rows ([16][D + 8] each, the FA2 kernel's padded layout) reach a ring of
 *    md_shape::STAGES steps private to the warp by cp.async: 8 lanes a key, lane l the 16-byte chunks
 *    l % 8 + 8 h of key l / 8 + 4 j (each instruction reads four whole 128-byte runs and writes shared
 *    memory in 4 wavefronts: conflict-free). The block table is read 32 entries at a time (one per lane)
 *    and shuffled to the key's lanes; a lane advances its (block, slot) pair by adds, no division in
 *    the loop. cp.async.wait_group then __syncwarp make the step's rows visible to the warp and retire
 *    the reads of the stage refilled next: no block barrier in the loop.
 *  - S (16 x 16) = Q K^T by ldmatrix of K (no transpose) exactly as attn_fa2_kernel; logits to base-2
 *    exponents by fa_exponents (masks only on steps crossing a row's position, window start or the
 *    slice end); online softmax per row on the accumulator (quad reductions xor 1, 2; O rescaled only
 *    when some row's max grew); P packed from the C layout into the A layout and O += P V with V by
 *    ldmatrix.trans, as attn_fa2_kernel.
 *  - Rows past the tile borrow the last row's position (their Q is zero; never written), as in
 *    attn_fa2_kernel. Keys past the slice are zero-filled by cp.async (src-size 0) and masked.
 *  - End: the 4 warps' rows (m, l, O in the accumulator layout) go through shared memory (over the
 *    ring) and merge in warp order by dec_merge_store: a fixed order, so the result does not depend on
 *    scheduling. Split parts merge in attn_combine_kernel (cuda/attn_ffma.cu).
 * 2 CTAs per SM at D <= 128 (8 warps; 2 steps of 8 KB in flight per warp at D 128: 128 KB per SM): the
 * loop is not issue-bound (~47 SASS instructions a KB of K/V), so the bytes in flight set the speed.
 * The default over the FFMA kernel because it runs at 0.83-0.93 of copy bandwidth on the Llama decode
 * shapes where the FFMA kernel, its dot products on FFMA, stays below 0.2 (perf/NOTES.md). */
#include <math.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/wgmma.cuh"

namespace upf_attn {
namespace {

constexpr int MD_WARPS = 4;
constexpr int MD_THREADS = MD_WARPS * 32;
constexpr int MD_BN = 16; /* keys per warp step: one k16 block of P V */

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
static_assert(md_shape<64>::MIN_CTAS == md_ctas_per_sm(64) && md_shape<128>::MIN_CTAS == md_ctas_per_sm(128) &&
                  md_shape<256>::MIN_CTAS == md_ctas_per_sm(256),
              "the split plan counts the resident CTAs the launch bounds ask for");

/* cp.async issue (cuda/wgmma.cuh's cp_async16_to) and wait with a "memory" clobber: with no block
 * barrier in the loop, these are what keeps the compiler from moving the ring's shared loads across the
 * copies that fill it. */
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
template <int N> __device__ __forceinline__ void cp_async_wait_ordered() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
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

  /* Issue state: this lane's next key to issue (its keys are w_lo + kq + 4 m), its block and
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

template <int D> upf_status launch_decode_mma_kernel(attn_args &a, int ntiles) {
  constexpr size_t smem = md_shape<D>::smem;
  /* all of the SM's unified memory as shared memory: MIN_CTAS resident CTAs need it at D = 128 */
  static bool attr_set;
  UPF_TRY(upf_cuda_smem_prepare(attn_decode_mma_kernel<D>, smem, true, &attr_set, "attn_decode_mma_kernel"));
  attn_decode_mma_kernel<D><<<dim3((unsigned)ntiles, (unsigned)a.hkv), MD_THREADS, smem, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("attn_decode_mma_kernel");
  return UPF_OK;
}

} // namespace

/* The kernel's row offsets are page * s0 + slot * s1 in 32-bit factors (the (pages, P, Hkv, D) caches of
 * any real size); others take the FFMA kernel. */
bool md_strides_ok(const attn_args &a) {
  const int64_t lim = 0xffffffffLL;
  return a.k_s0 >= 0 && a.k_s0 <= lim && a.v_s0 >= 0 && a.v_s0 <= lim && a.k_s1 >= 0 && a.v_s1 >= 0 &&
         a.k_s1 * (a.page_size - 1) <= lim && a.v_s1 * (a.page_size - 1) <= lim;
}

upf_status launch_decode_mma(attn_args &a, int ntiles) {
  return a.d == 64    ? launch_decode_mma_kernel<64>(a, ntiles)
         : a.d == 128 ? launch_decode_mma_kernel<128>(a, ntiles)
                      : launch_decode_mma_kernel<256>(a, ntiles);
}

} // namespace upf_attn

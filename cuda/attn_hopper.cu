/* The Hopper prefill (sm_90a: wgmma, warp-specialised producer and consumers; the FlashAttention-3
 * form): attn.prefill for bf16, D = 128 and D = 256 (without soft-cap), over contiguous K/V with 16-byte
 * rows (the attn.prefill=wgmma2-nopp variant, the default; attn.prefill=fa2 sends the same shapes to the
 * FA2 kernel, which every other bf16 head dim, soft-capped D = 256 and the paged rows take).
 *
 * attn_wgmma2_kernel<D>: one kernel body, its tile shape a function of D (w2_tile); described below at
 * D = 128, then what changes at D = 256. The FA2 kernel's plan (FA_BM = 128 query rows of one request
 * and one q head, heaviest tiles first; cuda/attn.cu). CTA = 2 consumer warpgroups (64 rows each) + a producer
 * warpgroup; setmaxnreg moves registers from the producer (24) to the consumers (240): with the
 * launch's 384 threads ptxas caps every thread at 168.
 *  - the producer's 4 warps copy K and V tiles of W2_BN = 128 keys by cp.async into a W2_NS = 3 stage
 *    ring (64 KB a stage) in the 128-byte-swizzle layout wgmma reads (per 64 dims: 128 rows x 128
 *    bytes, 16-byte chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16); the second 64 dims W2_BN * 128
 *    bytes further: the layout of cuda/select_score.cu's score kernel), per lane and tile 8 rows x 2 chunks of
 *    K and of V, the two chunks of a row off one pointer, one 64-bit add a row, no predicates but on a
 *    range's last tile (rows past it are zero-filled, src-size 0). Full and empty barriers for K and
 *    for V apart: S(t) waits for K(t) only, and K(t) is released as soon as S(t) completes, so K(t + 3)
 *    is copied while P V(t) still reads V(t) (K and V each ~2 rounds ahead).
 *  - Q lives in shared memory (copied once by the producer with tile 0, in the K tiles' swizzled
 *    K-major layout: per warpgroup and per 64 dims 64 rows x 128 bytes) and QK^T is an all-shared-memory
 *    wgmma: S (64 x 128 per warpgroup) by 8 wgmma m64n128k16. P rounded to bf16 becomes the register A
 *    operand of 8 wgmma m64n128k16 with the V tile as an MN-major B (imm-trans-b), O += P V in fp32.
 *    The fixed per-tile costs (barrier waits, fences, commits, shuffles, the O rescale) are paid once
 *    per 128 keys.
 *  - softmax: the running max is kept on the raw logits (no multiply before the max); exponents are
 *    one FFMA, s * mul - m * mul, and ex2.approx (MUFU, no range fix-up); alpha = exp2 of the
 *    difference of the stored scaled maxima (exactly 1 while the max holds). Soft-cap: tanh first,
 *    then mul = 1. Masks only on tiles crossing a warp's diagonal, window edge or the end.
 *  - intra-warpgroup overlap (FA3 section 3.2): round t issues S(t) and P(t - 1) V(t - 1) as two commit
 *    groups, waits for S(t) only, runs the softmax of tile t while P V(t - 1) is on the tensor cores,
 *    then waits for P V(t - 1), rescales O (only where a row of the warpgroup raised its max) and packs
 *    P(t). Live: S 64 + P 32 + O 64 fp32 registers. No ping-pong between the two warpgroups (FA3
 *    section 3.1): once each warpgroup overlaps its own softmax, the hand-over by named barriers
 *    measured no faster (perf/NOTES.md).
 *  - every mbarrier wait gives up after W2_WAIT_LIMIT_NS of wall time; a consumer that gave up stops
 *    waiting and writes NaN (out and LSE), so a protocol error reads as a NaN verify failure and a
 *    slow but finished kernel, not a hang. (__trap() in a setmaxnreg kernel would make ptxas allocate
 *    the whole kernel at the launch's 168 registers, with spills.)
 * Shared memory: Q 32 KB + 3 x 64 KB ring + 12 barriers + 1 KB alignment slack = 230,496 bytes (of
 * 232,448). The default over the FA2 kernel because it runs at about 1.0x of cuDNN's rate at 32K and
 * 128K where the FA2 kernel reaches 0.45x (perf/NOTES.md).
 *
 * D = 256 (Gemma-3's global layers; FlashAttention-3's hdim-256 shape: 128 x 80 tiles, 2 consumer
 * warpgroups, P V with P from registers, intra-warpgroup overlap):
 *  - registers decide the tile. A consumer thread holds O (64 x 256 fp32 per warpgroup: 128
 *    registers), S (64 x BN: BN / 2) and P (BN / 4) at once (P V(t - 1) runs while S(t) is computed
 *    and softmaxed), within setmaxnreg's 240: BN = 80 leaves 52 for the rest (BN = 128 would need
 *    224). The query block stays FA_BM = 128 rows (the plan's; 64-row warpgroups as at D = 128).
 *  - shared memory decides the ring: Q 64 KB (128 x 256 bf16) + W2_NS = 2 stages of K and V (80 x
 *    256 bf16 = 40 KB a tile) + 8 barriers + 1 KB slack = 230,464 bytes; a third stage (+80 KB) does
 *    not fit, nor does BN = 96 with two. Two stages keep each of K and V one round ahead: the
 *    producer copies V(t + 1) once P V(t - 1) released its stage (end of round t) and K(t + 2) right
 *    after, S(t) having released K(t)'s stage early in round t.
 *  - per 64 dims a tile is BN rows x 128 bytes (10 swizzle atoms of 1024 bytes at BN = 80), the four
 *    64-dim blocks W2_BLOCK_BYTES apart; a producer lane copies 5 rows x 4 chunks of each K and V
 *    tile and 8 rows x 4 chunks of Q. S by 16 wgmma m64n80k16 (both operands in shared memory), P V
 *    by 5 m64n256k16 (P from registers, V MN-major: the next 64 dims W2_BLOCK_BYTES further).
 *  - no soft-cap: tanhf's temporaries on top of those 188 accumulator registers spill (24 bytes);
 *    soft-capped D = 256 (Gemma-2) stays on the FA2 kernel (wgmma2_takes). Sliding windows are the
 *    same masks and plan as at D = 128. */
#include <math.h>

#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/wgmma.cuh"

namespace upf_attn {
namespace {

constexpr int W2_THREADS = 3 * 128; /* 2 consumer warpgroups + the producer's */
constexpr int W2_CONSUMER_REGS = 240, W2_PRODUCER_REGS = 24;
constexpr uint64_t W2_WAIT_LIMIT_NS = 4000000000ull; /* a wait takes microseconds; 4 s: something is wrong */
constexpr size_t W2_SMEM_MAX = 232448;               /* sm_90's opt-in shared memory a CTA (227 KB) */
static_assert(2 * 128 * W2_CONSUMER_REGS + 128 * W2_PRODUCER_REGS == W2_THREADS * 168, "setmaxnreg budget");
static_assert(FA_BM == 2 * 64, "the two consumer warpgroups of 64 rows cover the plan's tiles");

/* The shape of the kernel at head dim D: BN keys a K/V tile, NS ring stages (see the file header). */
template <int D> struct w2_tile;
template <> struct w2_tile<128> { static constexpr int BN = 128, NS = 3; };
template <> struct w2_tile<256> { static constexpr int BN = 80, NS = 2; };

/* Whether the kernel at head dim D takes soft-capped logits: not at D = 256, where tanhf's temporaries
 * beside the 188 accumulator registers (O 128, S 40, P 20) spill; soft-capped D = 256 (Gemma-2) takes
 * the FA2 kernel (wgmma2_takes). */
template <int D> constexpr bool w2_softcap() { return D == 128; }

template <int D> struct w2_shape {
  static constexpr int BN = w2_tile<D>::BN, NS = w2_tile<D>::NS;
  static constexpr int DB = D / 64;                          /* 64-dim (128-byte) blocks of a row */
  static constexpr int NJ = BN / 16;                         /* rows a producer lane copies of a tile */
  static constexpr uint32_t Q_WG_BYTES = 64 * D * 2;         /* one warpgroup's 64 Q rows */
  static constexpr uint32_t Q_BYTES = 2 * Q_WG_BYTES;
  static constexpr uint32_t BLOCK_BYTES = BN * 128;          /* one 64-dim block of a K (or V) tile */
  static constexpr uint32_t TILE_BYTES = BN * D * 2;         /* one K (or V) tile */
  static constexpr uint32_t STAGE_BYTES = 2 * TILE_BYTES;    /* K then V */
  static constexpr size_t SMEM = 1024 + Q_BYTES + (size_t)NS * STAGE_BYTES + 4 * NS * 8;
  static_assert(D % 64 == 0 && BN % 16 == 0, "whole 128-byte rows of a block, whole 16-key k-steps");
  static_assert(BN <= 256 && BN % 8 == 0, "a wgmma N of the S tile (8-row swizzle atoms, 1024 bytes)");
  static_assert(NS >= 2, "a round holds tiles t - 1 and t");
  static_assert(SMEM <= W2_SMEM_MAX, "shared memory");
  /* every shared address (past the 1 KB the system reserves) fits the descriptors' 14-bit addr >> 4 */
  static_assert(1024 + SMEM <= (1u << 18), "descriptor address field");
};

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

/* f(std::integral_constant<int, b>{}) for b = 0 .. N - 1, unrolled in the source: the producer's
 * per-row chunks (a #pragma unroll loop is unrolled later in the compiler and changed the D = 128
 * kernel's code). */
template <typename F, int... B> __device__ __forceinline__ void w2_each_impl(F &&f, std::integer_sequence<int, B...>) {
  (f(std::integral_constant<int, B>{}), ...);
}
template <int N, typename F> __device__ __forceinline__ void w2_each(F &&f) {
  w2_each_impl(f, std::make_integer_sequence<int, N>{});
}

/* 2^x by one MUFU.EX2 (flushes subnormal results to 0; 2^-inf = 0). */
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <int D>
__global__ void __launch_bounds__(W2_THREADS, 1) attn_wgmma2_kernel(const __grid_constant__ attn_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace upf_wgmma;
  using W = w2_shape<D>;
  constexpr int W2_BN = W::BN, W2_NS = W::NS, DB = W::DB, NJ = W::NJ;
  constexpr uint32_t W2_Q_WG_BYTES = W::Q_WG_BYTES, W2_Q_BYTES = W::Q_BYTES, W2_BLOCK_BYTES = W::BLOCK_BYTES;
  constexpr uint32_t W2_TILE_BYTES = W::TILE_BYTES, W2_STAGE_BYTES = W::STAGE_BYTES;
  constexpr int KS = D / 16, NT = W2_BN / 8, DT = D / 8, PK = W2_BN / 16;
  static_assert((D == 128 && W2_BN == 128) || (D == 256 && W2_BN == 80), "the wgmma shapes of issue_s, issue_pv");
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
    /* Producer lane pl copies rows r + 16 j (r = pl / 8; j < 8 of Q, the CTA's 128 rows; j < NJ of
     * every K and V tile of W2_BN keys), and of each row the 16-byte chunks c + 8 b (c = pl % 8, block
     * b < DB: dims 64 b + 8c .. 64 b + 8c + 7), 128 bytes apart in global memory (immediate offsets off
     * one pointer) and one 64-dims block apart in shared memory (Q: 64 * 128 bytes, a tile:
     * W2_BLOCK_BYTES). With 128-byte rows and 1024-byte 8-row groups, row R lands at (R / 8) * 1024 +
     * (R % 8) * 128, chunk c ^ (R % 8) (the 128-byte swizzle); rows 16 apart keep R % 8 = r % 8, so row
     * r + 16 j lands at kvoff + j * 2048 (Q: in warpgroup j / 4's block, at kvoff + (j % 4) * 2048). */
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
        w2_each<DB>([&](auto b) { cp_async16_to(qdst + b * (64 * 128), ok ? qp + b * 128 : (const char *)Q, ok); });
        advance(qp, qstep);
      }
    }
    const int64_t row = (int64_t)tile.kv_base + kv_lo + r;
    const char *kp = (const char *)(K + row * a.k_s0 + (int64_t)hk * a.k_s1 + c * 8);
    const char *vp = (const char *)(V + row * a.v_s0 + (int64_t)hk * a.v_s1 + c * 8);
    const int64_t kstep = 16 * 2 * a.k_s0, vstep = 16 * 2 * a.v_s0;
    int nin = tile.kv_hi - (kv_lo + r); /* of tile t: row r + 16 j is a key iff 16 j < nin */
    /* Tile t's ring stage, and the parity its empty barriers' wait needs, (t / W2_NS - 1) & 1: flipped on
     * entering stage 0, so 1 for t < W2_NS (never waited on), 0 from t = W2_NS (eph starting at 1 would
     * let the first real waits pass at once, and tile W2_NS overwrite a stage still being read). */
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
       * rows of a range's last tile lie before the next tile's first, which the NJ adds reach anyway). */
      const bool full = nin > 16 * (NJ - 1);
      auto copy_tile = [&](uint32_t dst, const char *&p, int64_t step, const bf16_t *base) {
        if (full) {
#pragma unroll
          for (int j = 0; j < NJ; j++) {
            w2_each<DB>([&](auto b) { cp_async16_full(dst + j * 2048 + b * W2_BLOCK_BYTES, p + b * 128); });
            advance(p, step);
          }
        } else {
#pragma unroll
          for (int j = 0; j < NJ; j++) {
            const bool in = 16 * j < nin;
            w2_each<DB>([&](auto b) {
              cp_async16_to(dst + j * 2048 + b * W2_BLOCK_BYTES, in ? p + b * 128 : (const char *)base, in);
            });
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
  /* w2_softcap<D>() false: wgmma2_takes keeps soft-capped cases away, and the tanh path is compiled out. */
  const bool capped = w2_softcap<D>() && a.softcap > 0.0f;
  const float mul = capped ? a.scale / a.softcap : a.scale * FA_LOG2E;
  const float cap2 = a.softcap * FA_LOG2E;
  const float mul2 = capped ? 1.0f : mul; /* logit (after fa_logits_masked) -> base-2 exponent */
  const uint32_t qwg = qbase + (uint32_t)wg * W2_Q_WG_BYTES;

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
  /* k-step ks = dims 16 ks .. 16 ks + 15: 64-dim block ks / 4, 32 bytes a step inside its 128-byte rows. */
  auto issue_s = [&](uint32_t st) { /* S = Q K^T of the tile in stage st, one commit group */
    const uint64_t desc_k = desc_kmajor_sw128(ring + st * W2_STAGE_BYTES);
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      const uint64_t dq = desc_q + (uint64_t)(((ks >> 2) * (64 * 128) + (ks & 3) * 32) >> 4);
      const uint64_t dk = desc_k + (uint64_t)(((ks >> 2) * W2_BLOCK_BYTES + (ks & 3) * 32) >> 4);
      if constexpr (D == 128)
        wgmma_m64n128k16_ss(s, dq, dk, ks);
      else
        wgmma_m64n80k16_ss(s, dq, dk, ks);
    }
    wg_commit();
  };
  /* O += P V (stage st), one commit group; k-step kk = keys 16 kk .. 16 kk + 15 (two 8-row groups, 2048
   * bytes); the MN-major V's next 64 dims are a block (W2_BLOCK_BYTES) further. */
  auto issue_pv = [&](uint32_t st) {
    const uint64_t desc_v = desc_mnmajor_sw128(ring + st * W2_STAGE_BYTES + W2_TILE_BYTES, W2_BLOCK_BYTES);
#pragma unroll
    for (int kk = 0; kk < PK; kk++) {
      if constexpr (D == 128)
        wgmma_m64n128k16_tb(o, pa[kk], desc_v + (uint64_t)((kk * 2048) >> 4), 1);
      else
        wgmma_m64n256k16_tb(o, pa[kk], desc_v + (uint64_t)((kk * 2048) >> 4), 1);
    }
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

  /* round 0: S(0) */
  uint32_t st = 0, ph = 0; /* tile t's ring stage and full-barrier parity */
  wait_k(st, ph);
  fence_proxy_async();
  wg_fence();
  issue_s(st);
  wg_wait<0>();
  release(emptyk, st);
  softmax(0); /* O is still 0: no rescale */
  pack_p();
  /* round t: S(t) and P V(t - 1) issued back to back; the softmax of t runs under P V(t - 1) and under
   * the other warpgroup's wgmma. Commit order S(t), P V(t - 1): wait_group 1 = S(t) complete. */
  for (int t = 1; t < ntiles; t++) {
    const uint32_t sp = st, pp = ph; /* tile t - 1's */
    st = st == W2_NS - 1 ? 0 : st + 1;
    ph ^= st == 0 ? 1u : 0u;
    wait_k(st, ph);
    wait_v(sp, pp);
    fence_proxy_async();
    wg_fence();
    issue_s(st);
    issue_pv(sp);
    wg_wait<1>();
    release(emptyk, st);
    softmax(t);
    /* x 1 is exact: where no row of the warpgroup raised its max, skipping the rescale changes nothing.
     * The wait sits in both arms of the branch on purpose: as one wait after the softmax, ptxas 13.0
     * hoisted its WARPGROUP.DEPBAR above the whole softmax (nothing in the softmax depends on it), so
     * the softmax of tile t ran after P V(t - 1) had completed instead of under it. Behind the branch
     * the DEPBAR stays after the last EX2 (checked in the SASS). The two arms' waits are two
     * instructions, and wgmma.wait_group is warpgroup-collective (.aligned: all 4 warps at the same
     * one), so the branch must be uniform over the warpgroup, not only the warp: the vote is over its
     * 128 threads (named barrier 1 + wg; a warp vote would let its warps take different arms). Every
     * consumer warp runs every round, live or not, so the barrier always fills. */
    const bool rescale = named_bar_any(1 + wg, 128, alpha[0] != 1.0f || alpha[1] != 1.0f);
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
  wg_fence();
  issue_pv(st);
  wg_wait<0>();
  release(emptyv, st);

  if (!live)
    l[0] = l[1] = NAN;
  fa_store_rows<DT>(a, tile, hq, wrow0, g, t4, msc, l, o);
#else
  __trap(); /* built without sm_90a: the host never launches this */
#endif
}

template <int D> upf_status launch_wgmma2_d(attn_args &a, int ntiles) {
  static bool attr_set;
  return launch_prefill_tiles(attn_wgmma2_kernel<D>, W2_THREADS, w2_shape<D>::SMEM, false, &attr_set,
                              "attn_wgmma2_kernel", a, ntiles);
}

} // namespace

bool wgmma2_takes(const attn_args &a) { return a.d == 128 || (a.d == 256 && a.softcap == 0.0f); }

upf_status launch_wgmma2(attn_args &a, int ntiles) {
  if (!wgmma2_takes(a))
    return upf_fail(UPF_ERR_UNSUPPORTED, "attn.prefill (cuda): the wgmma kernel takes D = 128, or 256 without "
                    "soft-cap, not D=%d softcap=%g", a.d, (double)a.softcap);
  return a.d == 128 ? launch_wgmma2_d<128>(a, ntiles) : launch_wgmma2_d<256>(a, ntiles);
}

} // namespace upf_attn

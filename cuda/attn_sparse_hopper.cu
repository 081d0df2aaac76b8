/* The Hopper block-sparse prefill (sm_90a; attn.block_sparse for bf16, D = 128 and 256, contiguous or
 * paged K/V, with or without mean correction), and at the end its FP8 form (the fp8 variant, D = 128):
 * the FlashAttention-3 form of cuda/attn_hopper.cu (wgmma,
 * a warp-specialised cp.async producer, 2 consumer warpgroups of 64 rows, an mbarrier ring with K and V
 * barriers apart, the softmax of S(t) under P V(t - 1)), walking a segment's CSR list of kept blocks.
 *
 * What differs from the dense kernel (read its header first):
 *  - a CTA is 128 PackGQA packed rows of one query tile and one KV head (a chunk of the tile: the tile's
 *    block_m rows in 128-row chunks): Q row p is gathered from (position P / g, q head h g + P % g) with
 *    P = the chunk's first packed row + p, so one K/V tile serves all g heads of the group; output rows
 *    are scattered the same way. Each row masks by its own position.
 *  - the producer walks the list: the key sequence is the list's blocks cut into 64-key sub-blocks (one
 *    or two a block of block_n = 64 or 128), and a kernel tile is SUBS = BN / 64 consecutive sub-blocks
 *    (D = 128: BN = 128, two sub-blocks - two kept 64-blocks, however far apart, fill one tile; D = 256:
 *    BN = 64, one). Each sub-block is one contiguous run of keys with its own source pointer; rows at or
 *    past kv_len are zero-filled. Sub-blocks that start after the CTA's last row are dropped (the list
 *    ascends: they are its tail), so both roles agree on the tile count without talking.
 *  - masks: a tile is masked when one of its sub-blocks reaches past the first position of a warp's rows
 *    (key <= the row's position; keys of a dropped or padding half are never visible).
 *  - mean correction: after the kept tiles, tiles of BN candidate blocks c0 .. c0 + BN - 1 (< corr_hi):
 *    the producer gathers their kbar rows as "keys" and vbar rows as "values" ((B, max_key_blocks, Hkv, D),
 *    hkv D elements from one block to the next), the consumers add ln(block_n) to the logit (in raw-logit
 *    units: log2(block_n) / (scale log2 e)) and mask the blocks the list keeps (each warp reads the list's
 *    run of [c0, c0 + BN) from a cursor: ascending entries, a ballot of 32 a step).
 *  - no soft-cap, no window, no LSE (the op has none).
 *  - the FP8 form (FP8 = true, the fp8 variant; inputs quantised by cuda/attn_sparse_fp8.cu): one 128-byte
 *    row holds a whole E4M3 row of Q or K, so Q is 16 KB and a stage 32 KB (the K tile and the transposed
 *    V tile, 128 dims x 128 keys), 4 stages; both products are m64n128k32 in E4M3 (S from two descriptors,
 *    P V with P from registers and V^T K-major); the logit scale takes q's and k's scales, the output v's
 *    over BS_FP8_P_SCALE. Its producer copies K rows from k8 at the tile's kv_base, and for V each
 *    sub-block's 64 keys of every dim row of vt8; the bf16 forms' code is untouched by it (same SASS).
 * Shared memory: D = 128: Q 32 KB + 3 stages x 64 KB + barriers = 230,512 bytes; D = 256 (BN = 64 keeps O
 * 128 + S 32 + P 16 accumulator registers): Q 64 KB + 2 stages x 64 KB + barriers = 197,712 bytes.
 * Bound: a CTA's 128 rows do 128 FLOP per byte of K/V at D = 128, under the H100's ridge, so lists that
 * neighbouring tiles do not share stream their blocks from DRAM and cannot reach (dense time x kept share);
 * lists that share blocks (vertical stripes) are served by L2 as dense attention is (perf/NOTES.md, the
 * block-sparse outcomes). The bf16 grid is in KV-head-major order (HEAD_MAJOR) so that the CTAs in flight
 * share one head's blocks in L2: 0.74-0.90x the time of the order that put a tile's heads side by side at
 * 128K, random lists and stripes alike (perf/NOTES.md); the FP8 form keeps that older order (not measured). */
#include <math.h>

#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/attn_sparse_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/mma_sync.cuh"
#include "cuda/wgmma.cuh"
#include "uniprefill/fp8.h"

namespace upf_bsattn {
namespace {

typedef __nv_bfloat16 bf16_t;

constexpr int BW_THREADS = 3 * 128; /* 2 consumer warpgroups + the producer's */
constexpr uint64_t BW_WAIT_LIMIT_NS = 4000000000ull; /* a wait takes microseconds; 4 s: something is wrong */
constexpr size_t BW_SMEM_MAX = 232448;
constexpr int BW_NOKEY = 0x3fff0000; /* the key base of a padding or dropped sub-block: past every position */
constexpr float BW_LOG2E = 1.4426950408889634f;
static_assert(BS_WG_ROWS == 2 * 64, "two consumer warpgroups of 64 rows");

/* FP8: the E4M3 form (D = 128), one byte an element, so one 128-byte row holds a whole row of Q or K. */
template <int D, bool FP8 = false> struct bw_shape {
  static constexpr int EB = FP8 ? 1 : 2;           /* bytes an element */
  static constexpr int BN = D == 128 ? 128 : 64;   /* keys a tile */
  static constexpr int NS = FP8 ? 4 : D == 128 ? 3 : 2; /* ring stages */
  static constexpr int SUBS = BN / 64;             /* 64-key sub-blocks a tile */
  static constexpr int DB = D * EB / 128;          /* 128-byte blocks of a row */
  static constexpr int NJ = BN / 16;               /* rows a producer lane copies of a tile */
  static constexpr uint32_t Q_WG_BYTES = 64 * D * EB;
  static constexpr uint32_t Q_BYTES = 2 * Q_WG_BYTES;
  static constexpr uint32_t BLOCK_BYTES = BN * 128;
  static constexpr uint32_t TILE_BYTES = BN * D * EB;
  static constexpr uint32_t STAGE_BYTES = 2 * TILE_BYTES;
  /* setmaxnreg: the FP8 producer's extra pointers and lookups spill at 24 registers; its consumers, with
   * half the P operand of bf16, fit in fewer */
  static constexpr int CONSUMER_REGS = FP8 ? 232 : 240, PRODUCER_REGS = FP8 ? 40 : 24;
  static constexpr size_t SMEM = 1024 + Q_BYTES + (size_t)NS * STAGE_BYTES + 4 * NS * 8 + 16;
  static_assert(D == 128 || D == 256, "the wgmma shapes below");
  static_assert(!FP8 || D == 128, "the FP8 form: D = 128");
  static_assert(SMEM <= BW_SMEM_MAX, "shared memory");
  static_assert(1024 + SMEM <= (1u << 18), "descriptor address field");
  static_assert(2 * 128 * CONSUMER_REGS + 128 * PRODUCER_REGS == BW_THREADS * 168, "setmaxnreg budget");
};

template <typename F, int... B> __device__ __forceinline__ void bw_each_impl(F &&f, std::integer_sequence<int, B...>) {
  (f(std::integral_constant<int, B>{}), ...);
}
template <int N, typename F> __device__ __forceinline__ void bw_each(F &&f) {
  bw_each_impl(f, std::make_integer_sequence<int, N>{});
}

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

/* The key base of sub-block u of the segment's list (entries from e0), or BW_NOKEY where no row of the
 * CTA sees it (a negative id, or a first key past maxpos). */
__device__ __forceinline__ int bw_sub_kb(const bs_args &a, int e0, int u, int maxpos) {
  /* block_n is 64 or 128 (the host checks): a block holds 1 << lgs sub-blocks, so a shift and a mask
   * instead of a division on the path of every tile; a block id is below kv_len / block_n (or -1), so
   * its first key fits an int */
  const int lgs = a.block_n >> 7;
  const int kb = a.blocks[e0 + (u >> lgs)] * a.block_n + ((u & lgs) << 6);
  return kb >= 0 && kb <= maxpos ? kb : BW_NOKEY;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* D (64 x 64, f32) (+)= A (64 x 16, K-major descriptor) * B (K-major, 64 x 16, descriptor)^T: the D = 256
 * kernel's S, both operands in shared memory. */
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1, 0, 0;\n"
               "}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
                 "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                 "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
                 "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
                 "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
                 "+f"(d[7][2]), "+f"(d[7][3])
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
#endif

/* Four floats times BS_FP8_P_SCALE as E4M3 bytes, x0 in the low byte. */
__device__ __forceinline__ uint32_t f8x4(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0 * BS_FP8_P_SCALE, x1 * BS_FP8_P_SCALE), __NV_SATFINITE,
                                               __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2 * BS_FP8_P_SCALE, x3 * BS_FP8_P_SCALE), __NV_SATFINITE,
                                               __NV_E4M3);
  return (lo & 0xffffu) | (hi << 16);
}

/* The softmax's base-2 exponent per raw logit, and the output's factor: FP8 takes the scales of q and k,
 * and of v over BS_FP8_P_SCALE, from the words the quantising pass wrote. */
template <bool FP8> __device__ __forceinline__ float bw_logit_mul(const bs_args &a) {
  if constexpr (FP8)
    return a.scale * upf_fp8_pow2_scale(__uint_as_float(a.f8.amax[0])) *
           upf_fp8_pow2_scale(__uint_as_float(a.f8.amax[1])) * BW_LOG2E;
  return a.scale * BW_LOG2E;
}
template <bool FP8> __device__ __forceinline__ float bw_out_mul(const bs_args &a) {
  if constexpr (FP8)
    return upf_fp8_pow2_scale(__uint_as_float(a.f8.amax[2])) / BS_FP8_P_SCALE;
  return 1.0f;
}

/* HEAD_MAJOR (the bf16 forms): CTA b is chunk b % chunks of tile (b / chunks) % ntiles of KV head
 * b / (chunks ntiles), so the CTAs running together are tiles of one head (heaviest first); else (the FP8 form)
 * the KV heads of a tile are neighbours (b / chunks % hkv). */
template <int D, bool PAGED, bool FP8 = false, bool HEAD_MAJOR = false>
__global__ void __launch_bounds__(BW_THREADS, 1) bs_wgmma_kernel(const __grid_constant__ bs_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace upf_wgmma;
  using W = bw_shape<D, FP8>;
  constexpr int BN = W::BN, NS = W::NS, SUBS = W::SUBS, DB = W::DB, NJ = W::NJ;
  constexpr uint32_t Q_WG_BYTES = W::Q_WG_BYTES, Q_BYTES = W::Q_BYTES, BLOCK_BYTES = W::BLOCK_BYTES;
  constexpr uint32_t TILE_BYTES = W::TILE_BYTES, STAGE_BYTES = W::STAGE_BYTES;
  constexpr int KS = D * W::EB / 32, NT = BN / 8, DT = D / 8, PK = BN * W::EB / 32, KW = BN / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t sbase = (sraw + 1023u) & ~1023u;
  const uint32_t qbase = sbase, ring = sbase + Q_BYTES;
  const uint32_t fullk = ring + NS * STAGE_BYTES, fullv = fullk + NS * 8;
  const uint32_t emptyk = fullv + NS * 8, emptyv = emptyk + NS * 8;
  int *info = (int *)(smem_raw + (emptyv + NS * 8 - sraw)); /* [0]: the CTA's sub-block count */

  const unsigned per_head = gridDim.x / a.hkv; /* HEAD_MAJOR: chunks x tiles */
  const int chunk = blockIdx.x % a.chunks, hk = HEAD_MAJOR ? blockIdx.x / per_head : (blockIdx.x / a.chunks) % a.hkv;
  const bs_tile tile = a.tiles[HEAD_MAJOR ? blockIdx.x % per_head / a.chunks : blockIdx.x / (a.chunks * a.hkv)];
  const int crow0 = tile.row0 + chunk * BS_WG_ROWS;
  if (crow0 >= tile.row_end) /* block_m not a multiple of 128: the tile has fewer chunks; uniform */
    return;
  const int crow_end = min(crow0 + BS_WG_ROWS, tile.row_end);
  const int G = a.group, prefix = tile.kv_len - tile.q_len;
  const int maxpos = prefix + (crow_end - 1) / G; /* the CTA's last row sees keys <= maxpos (< kv_len) */
  const int64_t seg = (int64_t)hk * a.total_q_tiles + tile.tile;
  const int e0 = a.row_ptr[seg], e1 = a.row_ptr[seg + 1];
  const bf16_t *Q = (const bf16_t *)a.q, *K = (const bf16_t *)a.k, *V = (const bf16_t *)a.v;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < NS; i++) {
      mbar_init(fullk + 8 * i, 128);
      mbar_init(fullv + 8 * i, 128);
      mbar_init(emptyk + 8 * i, 8);
      mbar_init(emptyv + 8 * i, 8);
    }
    /* The list's sub-blocks less its tail that starts past the CTA's last row. */
    int nsub = (e1 - e0) * (a.block_n >> 6);
    while (nsub > 0 && bw_sub_kb(a, e0, nsub - 1, maxpos) == BW_NOKEY)
      nsub--;
    info[0] = nsub;
  }
  __syncthreads();
  /* Broadcasts make role and loop bounds provably warp-uniform for ptxas (else it serialises the wgmma). */
  const int warp = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int nsub = __shfl_sync(0xffffffffu, info[0], 0);
  const int ntr = (nsub + SUBS - 1) / SUBS;
  const int ntm = tile.corr_hi > 0 ? (tile.corr_hi + BN - 1) / BN : 0;
  const int ntiles = __shfl_sync(0xffffffffu, ntr + ntm, 0);
  const int64_t mstride = (int64_t)a.hkv * D; /* kbar, vbar: one block to the next */
  const int64_t mbase = ((int64_t)tile.req * a.max_key_blocks * a.hkv + hk) * D;

  if (warp >= 8) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W::PRODUCER_REGS));
    if (ntiles == 0)
      return;
    /* Lane pl copies rows r + 16 j and of each row the 16-byte chunks c + 8 b (the dense kernel's
     * scheme; row R of a tile lands at (R / 8) 1024 + (R % 8) 128, chunk c ^ (R % 8)). */
    const int pl = (int)threadIdx.x - 256, c = pl & 7, r = pl >> 3;
    const uint32_t kvoff = (uint32_t)(r >> 3) * 1024 + (uint32_t)(r & 7) * 128 + ((uint32_t)(c ^ (r & 7)) << 4);
#pragma unroll
    for (int j = 0; j < 8; j++) { /* Q: packed row crow0 + r + 16 j, gathered from its position and head */
      const int P = crow0 + r + 16 * j;
      const bool ok = P < crow_end;
      if constexpr (FP8) {
        const uint8_t *qp = a.f8.q8 + ((int64_t)(tile.q0 + P / G) * a.hq + hk * G + P % G) * 128 + c * 16;
        cp_async16_to(qbase + (uint32_t)(j >> 2) * Q_WG_BYTES + (uint32_t)(j & 3) * 2048 + kvoff, ok ? qp : a.f8.q8,
                      ok);
      } else {
        const char *qp = (const char *)(Q + (int64_t)(tile.q0 + P / G) * a.q_s0 + (int64_t)(hk * G + P % G) * a.q_s1 +
                                        c * 8);
        const uint32_t qdst = qbase + (uint32_t)(j >> 2) * Q_WG_BYTES + (uint32_t)(j & 3) * 2048 + kvoff;
        bw_each<DB>([&](auto b) { cp_async16_to(qdst + b * (64 * 128), ok ? qp + b * 128 : (const char *)Q, ok); });
      }
    }
    /* Rows jj (< 4) of a 64-key sub-block from key kb of K (is_v: V) into dst + jj 2048. */
    auto copy_sub = [&](uint32_t dst, int kb, bool is_v) {
      const bf16_t *base = is_v ? V : K;
      const int nin = kb == BW_NOKEY ? 0 : tile.kv_len - (kb + r); /* row r + 16 jj is a key iff 16 jj < nin */
      if (PAGED) { /* whole 64-key blocks a page (smaller pages are gathered first): the sub-block is in one */
        const int64_t s0 = is_v ? a.v_s0 : a.k_s0, s1 = is_v ? a.v_s1 : a.k_s1, s2 = is_v ? a.v_s2 : a.k_s2;
        const char *p = (const char *)base;
        if (nin > 0) {
          const int64_t page = a.block_table[(int64_t)tile.req * a.max_blocks + kb / a.page_size];
          p = (const char *)(base + page * s0 + (int64_t)(kb % a.page_size + r) * s1 + (int64_t)hk * s2 + c * 8);
        }
        const int64_t step = 16 * 2 * s1;
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
          const bool in = 16 * jj < nin;
          const char *pr = in ? p + jj * step : (const char *)base;
          bw_each<DB>([&](auto b) { cp_async16_to(dst + jj * 2048 + b * BLOCK_BYTES, in ? pr + b * 128 : pr, in); });
        }
      } else {
        const int64_t s0 = is_v ? a.v_s0 : a.k_s0, s1 = is_v ? a.v_s1 : a.k_s1;
        const int64_t row = (int64_t)tile.kv_base + (nin > 0 ? kb + r : 0);
        const char *p = (const char *)(base + row * s0 + (int64_t)hk * s1 + c * 8);
        const int64_t step = 16 * 2 * s0;
        if (nin > 48) { /* every row a key: no predicates */
#pragma unroll
          for (int jj = 0; jj < 4; jj++)
            bw_each<DB>([&](auto b) { cp_async16_full(dst + jj * 2048 + b * BLOCK_BYTES, p + jj * step + b * 128); });
        } else {
#pragma unroll
          for (int jj = 0; jj < 4; jj++) {
            const bool in = 16 * jj < nin;
            const char *pr = in ? p + jj * step : (const char *)base;
            bw_each<DB>([&](auto b) { cp_async16_to(dst + jj * 2048 + b * BLOCK_BYTES, in ? pr + b * 128 : pr, in); });
          }
        }
      }
    };
    /* Mean tile: candidate block c0 + r + 16 j (< corr_hi) of kbar (is_v: vbar). */
    auto copy_means = [&](uint32_t dst, int c0, bool is_v) {
      const bf16_t *base = (const bf16_t *)(is_v ? a.vbar : a.kbar);
      const char *p = (const char *)(base + mbase + (int64_t)(c0 + r) * mstride + c * 8);
      const int nin = tile.corr_hi - (c0 + r);
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        const bool in = 16 * j < nin;
        const char *pr = in ? p + (int64_t)j * 16 * 2 * mstride : (const char *)base;
        bw_each<DB>([&](auto b) { cp_async16_to(dst + j * 2048 + b * BLOCK_BYTES, in ? pr + b * 128 : pr, in); });
      }
    };
    /* FP8: K rows from k8 at the tile's kv_base (padded per request to 64 keys, zero past kv_len: no
     * predicate but a dropped sub-block); V^T dim rows dr0 + 32 i, each sub-block's 64 keys into bytes
     * 64 hh .. 64 hh + 63 (16-byte chunk cc of four); a mean tile: kbar8 rows (zero from corr_hi) and 128
     * candidates of every dim row of vbart8 (chunk c8 of eight, rows dr0 + 16 i). */
    const int64_t krow8 = (int64_t)a.hkv * 128; /* k8, kbar8: one row (key or block) to the next */
    auto copy_k8_sub = [&](uint32_t dst, int kb) {
      const bool in = kb != BW_NOKEY;
      const uint8_t *p = a.f8.k8 + ((int64_t)tile.kv_base + (in ? kb + r : 0)) * krow8 + (int64_t)hk * 128 + c * 16;
#pragma unroll
      for (int jj = 0; jj < 4; jj++)
        cp_async16_to(dst + jj * 2048, in ? p + jj * 16 * krow8 : a.f8.k8, in);
    };
    auto copy_v8_sub = [&](uint32_t tdst, int hh, int kb) {
      const bool in = kb != BW_NOKEY;
      const int cc = pl & 3, dr0 = pl >> 2;
      const uint8_t *p = a.f8.vt8 + ((int64_t)hk * 128 + dr0) * a.f8.kvp + tile.kv_base + (in ? kb : 0) + cc * 16;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int dr = dr0 + 32 * i;
        const uint32_t dst = tdst + (uint32_t)(dr >> 3) * 1024 + (uint32_t)(dr & 7) * 128 +
                             ((uint32_t)((4 * hh + cc) ^ (dr & 7)) << 4);
        cp_async16_to(dst, in ? p + (int64_t)32 * i * a.f8.kvp : a.f8.vt8, in);
      }
    };
    auto copy_k8_means = [&](uint32_t dst, int c0) {
      const uint8_t *p = a.f8.kbar8 + ((int64_t)tile.req * a.f8.mkbp + c0 + r) * krow8 + (int64_t)hk * 128 + c * 16;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const bool in = c0 + r + 16 * j < tile.corr_hi;
        cp_async16_to(dst + j * 2048, in ? p + j * 16 * krow8 : a.f8.kbar8, in);
      }
    };
    auto copy_v8_means = [&](uint32_t tdst, int c0) {
      const int c8 = pl & 7, dr0 = pl >> 3;
      const uint8_t *p = a.f8.vbart8 + (((int64_t)tile.req * a.hkv + hk) * 128 + dr0) * a.f8.mkbp + c0 + c8 * 16;
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const int dr = dr0 + 16 * i;
        cp_async16_full(tdst + (uint32_t)(dr >> 3) * 1024 + (uint32_t)(dr & 7) * 128 + ((uint32_t)(c8 ^ (dr & 7)) << 4),
                        p + (int64_t)16 * i * a.f8.mkbp);
      }
    };
    auto copy_tile = [&](uint32_t dst, int t, bool is_v) {
      if constexpr (FP8) {
        if (t < ntr) {
#pragma unroll
          for (int hh = 0; hh < SUBS; hh++) {
            const int u = t * SUBS + hh;
            const int kb = u < nsub ? bw_sub_kb(a, e0, u, maxpos) : BW_NOKEY;
            if (is_v)
              copy_v8_sub(dst - kvoff, hh, kb);
            else
              copy_k8_sub(dst + hh * 4 * 2048, kb);
          }
        } else if (is_v) {
          copy_v8_means(dst - kvoff, (t - ntr) * BN);
        } else {
          copy_k8_means(dst, (t - ntr) * BN);
        }
      } else {
        if (t < ntr) {
#pragma unroll
          for (int hh = 0; hh < SUBS; hh++) {
            const int u = t * SUBS + hh;
            copy_sub(dst + hh * 4 * 2048, u < nsub ? bw_sub_kb(a, e0, u, maxpos) : BW_NOKEY, is_v);
          }
        } else {
          copy_means(dst, (t - ntr) * BN, is_v);
        }
      }
    };
    uint32_t st = 0, eph = 0;
    bool live = true;
    for (int t = 0; t < ntiles; t++) {
      if (st == 0)
        eph ^= 1;
      const bool wait = t >= NS && live;
      if (wait)
        live = mbar_wait_bounded(emptyk + 8 * st, eph, BW_WAIT_LIMIT_NS);
      const uint32_t kdst = ring + st * STAGE_BYTES + kvoff, vdst = kdst + TILE_BYTES;
      copy_tile(kdst, t, false);
      cp_async_mbar_arrive(fullk + 8 * st);
      if (wait && live)
        live = mbar_wait_bounded(emptyv + 8 * st, eph, BW_WAIT_LIMIT_NS);
      copy_tile(vdst, t, true);
      cp_async_mbar_arrive(fullv + 8 * st);
      st = st == NS - 1 ? 0 : st + 1;
    }
    cp_async_wait_all();
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(W::CONSUMER_REGS));
  const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
  const int wrow0 = crow0 + wg * 64 + w4 * 16; /* the warp's first packed row */
  int pos[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int P = min(wrow0 + g + 8 * i, crow_end - 1); /* rows past the chunk: the last row's (never stored) */
    pos[i] = prefix + P / G;
  }
  const int wpos_first = prefix + min(wrow0, crow_end - 1) / G;
  const float mul2 = bw_logit_mul<FP8>(a);             /* raw logit -> base-2 exponent */
  const float biasr = log2f((float)a.block_n) / mul2;   /* ln(block_n) in raw-logit units */
  const uint32_t qwg = qbase + (uint32_t)wg * Q_WG_BYTES;

  float m[2] = {-INFINITY, -INFINITY}, msc[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; n++)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float s[NT][4];
  uint32_t pa[PK][4];
  float alpha[2];
  bool live = true;
  int mcur = e0; /* mean tiles: the first list entry not below the tile's c0 */

  if (ntiles > 0) {
    auto wait_k = [&](uint32_t st, uint32_t ph) {
      if (live)
        live = mbar_wait_bounded(fullk + 8 * st, ph, BW_WAIT_LIMIT_NS);
    };
    auto wait_v = [&](uint32_t st, uint32_t ph) {
      if (live)
        live = mbar_wait_bounded(fullv + 8 * st, ph, BW_WAIT_LIMIT_NS);
    };
    const uint64_t desc_q = desc_kmajor_sw128(qwg);
    auto issue_s = [&](uint32_t st) {
      const uint64_t desc_k = desc_kmajor_sw128(ring + st * STAGE_BYTES);
#pragma unroll
      for (int ks = 0; ks < KS; ks++) {
        const uint64_t dq = desc_q + (uint64_t)(((ks >> 2) * (64 * 128) + (ks & 3) * 32) >> 4);
        const uint64_t dk = desc_k + (uint64_t)(((ks >> 2) * BLOCK_BYTES + (ks & 3) * 32) >> 4);
        if constexpr (FP8)
          wgmma_m64n128k32_e4m3_ss(s, dq, dk, ks);
        else if constexpr (D == 128)
          wgmma_m64n128k16_ss(s, dq, dk, ks);
        else
          wgmma_m64n64k16_ss(s, dq, dk, ks);
      }
      wg_commit();
    };
    auto issue_pv = [&](uint32_t st) {
      if constexpr (FP8) { /* V^T K-major: 32 keys (bytes) a step */
        const uint64_t desc_v = desc_kmajor_sw128(ring + st * STAGE_BYTES + TILE_BYTES);
#pragma unroll
        for (int kk = 0; kk < PK; kk++)
          wgmma_m64n128k32_e4m3_rs(o, pa[kk], desc_v + (uint64_t)((kk * 32) >> 4), 1);
      } else {
        const uint64_t desc_v = desc_mnmajor_sw128(ring + st * STAGE_BYTES + TILE_BYTES, BLOCK_BYTES);
#pragma unroll
        for (int kk = 0; kk < PK; kk++) {
          if constexpr (D == 128)
            wgmma_m64n128k16_tb(o, pa[kk], desc_v + (uint64_t)((kk * 2048) >> 4), 1);
          else
            wgmma_m64n256k16_tb(o, pa[kk], desc_v + (uint64_t)((kk * 2048) >> 4), 1);
        }
      }
      wg_commit();
    };
    auto release = [&](uint32_t bars, uint32_t st) {
      __syncwarp();
      if (lane == 0)
        mbar_arrive(bars + 8 * st);
    };
    /* Logits of tile t (complete) to -inf where not visible (and + the bias on a mean tile). */
    /* The key bases of tile t's sub-blocks (BW_NOKEY past the list, and for a mean tile): read at the top
     * of the round that softmaxes tile t, so the list's load latency hides under the barrier waits and
     * the wgmma. */
    auto tile_kb = [&](int t, int (&kb)[SUBS]) {
#pragma unroll
      for (int hh = 0; hh < SUBS; hh++) {
        const int u = t * SUBS + hh;
        kb[hh] = t < ntr && u < nsub ? bw_sub_kb(a, e0, u, maxpos) : BW_NOKEY;
      }
    };
    auto mask_tile = [&](int t, const int (&kb)[SUBS]) {
      if (t < ntr) {
        bool masked = false;
#pragma unroll
        for (int hh = 0; hh < SUBS; hh++)
          masked |= kb[hh] + 63 > wpos_first;
        if (masked) {
#pragma unroll
          for (int j = 0; j < NT; j++)
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
              const int key = kb[j / 8] + (j % 8) * 8 + t4 * 2 + (cc & 1);
              s[j][cc] = key <= pos[cc >> 1] ? s[j][cc] : -INFINITY;
            }
        }
      } else {
        const int c0 = (t - ntr) * BN;
        uint32_t kw[KW];
#pragma unroll
        for (int w = 0; w < KW; w++)
          kw[w] = 0u;
        for (;;) { /* the list's entries in [c0, c0 + BN): a run from the cursor (it ascends) */
          const int idx = mcur + lane;
          const int b = idx < e1 ? a.blocks[idx] : INT32_MAX;
          const bool below = b < c0 + BN;
          if (below && b >= c0) {
#pragma unroll
            for (int w = 0; w < KW; w++)
              kw[w] |= (b - c0) >> 5 == w ? 1u << ((b - c0) & 31) : 0u;
          }
          const int n = __popc(__ballot_sync(0xffffffffu, below));
          mcur += n;
          if (n < 32)
            break;
        }
#pragma unroll
        for (int w = 0; w < KW; w++)
          kw[w] = __reduce_or_sync(0xffffffffu, kw[w]);
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
          for (int cc = 0; cc < 4; cc++) {
            const int col = j * 8 + t4 * 2 + (cc & 1);
            const bool ok = c0 + col < tile.corr_hi && !((kw[j >> 2] >> (col & 31)) & 1u);
            s[j][cc] = ok ? s[j][cc] + biasr : -INFINITY;
          }
      }
    };
    auto softmax = [&](int t, const int (&kb)[SUBS]) {
      mask_tile(t, kb);
      float mt[2] = {m[0], m[1]};
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++)
          mt[cc >> 1] = fmaxf(mt[cc >> 1], s[j][cc]);
      float ref[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 2; i++) {
        mt[i] = quad_max(mt[i]);
        const float mn = mt[i] * mul2;
        ref[i] = mn == -INFINITY ? 0.0f : mn;
        alpha[i] = ex2_approx(msc[i] - ref[i]);
        m[i] = mt[i];
        msc[i] = mn;
      }
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++) {
          s[j][cc] = ex2_approx(fmaf(s[j][cc], mul2, -ref[cc >> 1]));
          rs[cc >> 1] += s[j][cc];
        }
#pragma unroll
      for (int i = 0; i < 2; i++)
        l[i] = fmaf(l[i], alpha[i], rs[i]);
    };
    /* FP8: the A operand of k-step kk (keys 32 kk ..): bytes 4t .. 4t + 3 of row g are the accumulator's
     * columns 2t, 2t + 1 of n-blocks 4 kk and 4 kk + 1 (bs_fp8_key_at: V^T holds its keys in that order) */
    auto pack_p = [&] {
#pragma unroll
      for (int kk = 0; kk < PK; kk++) {
        if constexpr (FP8) {
          pa[kk][0] = f8x4(s[4 * kk][0], s[4 * kk][1], s[4 * kk + 1][0], s[4 * kk + 1][1]);
          pa[kk][1] = f8x4(s[4 * kk][2], s[4 * kk][3], s[4 * kk + 1][2], s[4 * kk + 1][3]);
          pa[kk][2] = f8x4(s[4 * kk + 2][0], s[4 * kk + 2][1], s[4 * kk + 3][0], s[4 * kk + 3][1]);
          pa[kk][3] = f8x4(s[4 * kk + 2][2], s[4 * kk + 2][3], s[4 * kk + 3][2], s[4 * kk + 3][3]);
        } else {
          pa[kk][0] = upf_mma::pack_bf16(s[2 * kk][0], s[2 * kk][1]);
          pa[kk][1] = upf_mma::pack_bf16(s[2 * kk][2], s[2 * kk][3]);
          pa[kk][2] = upf_mma::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          pa[kk][3] = upf_mma::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
      }
    };
    auto rescale_o = [&] {
#pragma unroll
      for (int n = 0; n < DT; n++) {
        o[n][0] *= alpha[0], o[n][1] *= alpha[0];
        o[n][2] *= alpha[1], o[n][3] *= alpha[1];
      }
    };

    uint32_t st = 0, ph = 0;
    int kb[SUBS];
    tile_kb(0, kb);
    wait_k(st, ph);
    fence_proxy_async();
    wg_fence();
    issue_s(st);
    wg_wait<0>();
    release(emptyk, st);
    softmax(0, kb);
    pack_p();
    for (int t = 1; t < ntiles; t++) {
      const uint32_t sp = st, pp = ph;
      tile_kb(t, kb);
      st = st == NS - 1 ? 0 : st + 1;
      ph ^= st == 0 ? 1u : 0u;
      wait_k(st, ph);
      wait_v(sp, pp);
      fence_proxy_async();
      wg_fence();
      issue_s(st);
      issue_pv(sp);
      wg_wait<1>();
      release(emptyk, st);
      softmax(t, kb);
      /* The dense kernel's warpgroup-uniform vote: the wait in both arms keeps ptxas from hoisting it
       * above the softmax (cuda/attn_hopper.cu). */
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
    wait_v(st, ph);
    fence_proxy_async();
    wg_fence();
    issue_pv(st);
    wg_wait<0>();
    release(emptyv, st);
  }

  /* Store through the packed-row mapping; l = 0 only for a row that sees no key (an index without the
   * row's own block): 0. A wait that gave up: NaN. */
#pragma unroll
  for (int i = 0; i < 2; i++) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int P = wrow0 + g + 8 * i;
    if (P >= crow_end)
      continue;
    const float inv = !live ? NAN : l[i] > 0.0f ? bw_out_mul<FP8>(a) / l[i] : 0.0f;
    bf16_t *orow = (bf16_t *)a.out + (int64_t)(tile.q0 + P / G) * a.o_s0 + (int64_t)(hk * G + P % G) * a.o_s1;
#pragma unroll
    for (int n = 0; n < DT; n++)
      *reinterpret_cast<__nv_bfloat162 *>(orow + n * 8 + t4 * 2) =
          __floats2bfloat162_rn(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
  }
#else
  __trap(); /* built without sm_90a: the host never launches this */
#endif
}

template <int D, bool PAGED> upf_status launch_d(const bs_args &a, int ntiles) {
  static bool attr_set;
  const int64_t grid = (int64_t)ntiles * a.hkv * a.chunks;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn.block_sparse (cuda): %lld CTAs exceed the grid", (long long)grid);
  UPF_TRY(upf_cuda_smem_prepare(bs_wgmma_kernel<D, PAGED, false, true>, bw_shape<D>::SMEM, false, &attr_set,
                                "bs_wgmma_kernel"));
  bs_wgmma_kernel<D, PAGED, false, true><<<(unsigned)grid, BW_THREADS, bw_shape<D>::SMEM, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("bs_wgmma_kernel");
  return UPF_OK;
}

} // namespace

bool bs_hopper_takes(int d) { return d == 128 || d == 256; }

bool bs_fp8_takes(int d) { return d == 128; }

upf_status bs_launch_fp8(const bs_args &a, int ntiles) {
  static bool attr_set;
  const int64_t grid = (int64_t)ntiles * a.hkv * a.chunks;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn.block_sparse (cuda, fp8): %lld CTAs exceed the grid", (long long)grid);
  using W = bw_shape<128, true>;
  UPF_TRY(upf_cuda_smem_prepare(bs_wgmma_kernel<128, false, true>, W::SMEM, false, &attr_set, "bs_wgmma_kernel (fp8)"));
  bs_wgmma_kernel<128, false, true><<<(unsigned)grid, BW_THREADS, W::SMEM, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("bs_wgmma_kernel (fp8)");
  return UPF_OK;
}

upf_status bs_launch_hopper(const bs_args &a, bool paged, int ntiles) {
  if (paged && a.page_size % 64 != 0)
    return upf_fail(UPF_ERR_UNSUPPORTED, "attn.block_sparse (cuda): the wgmma kernel reads pages of whole 64-key "
                    "blocks, not of %d keys (cuda/kv_gather.cuh gathers those)", a.page_size);
  if (a.d == 128)
    return paged ? launch_d<128, true>(a, ntiles) : launch_d<128, false>(a, ntiles);
  if (a.d == 256)
    return paged ? launch_d<256, true>(a, ntiles) : launch_d<256, false>(a, ntiles);
  return upf_fail(UPF_ERR_UNSUPPORTED, "attn.block_sparse (cuda): the wgmma kernel takes D = 128 or 256, not %d", a.d);
}

} // namespace upf_bsattn

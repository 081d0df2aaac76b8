/* CUDA MoE FFN of Qwen3-Next (uniprefill/moe.h): router, top-K, counting sort of the (token, rank)
 * pairs by expert, grouped expert GEMMs through cuBLAS, SwiGLU, shared expert, weighted un-permute.
 *
 * moe_ffn, in stream order:
 *   1. Router GEMM (cublasGemmEx, fp32 logits (T, E)), then moe_topk_kernel: one warp per token
 *      holds its E logits in registers; max, sum of exp (per-lane sums in a fixed order, then an
 *      xor tree: every lane ends with the same bits), then the top K by (logit, lower index): the
 *      few logits at or above a bound from the lanes' maxima, rank-sorted across the warp once (or
 *      K rounds of a warp argmax when there are more than 32 of them), each winner's probability
 *      p = exp(l - max)/sum, renormalised by the sum of the K.
 *      A non-finite logit sets an integer flag (the lowest such token wins an atomicMin).
 *   2. Counting sort in 512-pair tiles, a warp a tile: per-tile histograms (moe_tile_count_kernel),
 *      their per-expert prefix sums and the expert offsets (moe_scan_rows_kernel, cub::BlockScan),
 *      then moe_scatter_kernel places each pair (__match_any_sync ranks within a step, a running
 *      per-expert counter in shared memory across steps) and records its slot; stable, so within an
 *      expert the pairs stay in ascending (token, rank) order, on every run (the order the CUB radix
 *      sort it replaces gave, so the permutation is the same).
 *   3. One device-to-host read: the flags and the E counts. The host sizes the expert GEMMs from them
 *      (cuBLAS takes the per-GEMM row counts on the host) and picks the GEMM variant.
 *   4. moe_gather_kernel: one warp per token loads its row of x once and copies it into the permuted
 *      matrix xp at the rows of its K pairs, records the rows for the SwiGLU and the un-permute, and
 *      computes the shared expert's gate g = sigmoid(x . shared_gate) (per-lane partial sums in a
 *      fixed order, then an xor tree). Each expert's rows start at a multiple of 8 (16-byte aligned
 *      matrices for cuBLAS).
 *   5. Expert GEMM 1: h (rows, 2I) = xp . gate_up_e^T per expert; the dense FFN's act_mul_kernel:
 *      a (rows, I) = silu(h[:, :I]) * h[:, I:]; expert GEMM 2: y (rows, H) = a . down_e^T. Variants
 *      (the moe.ffn lines of uniprefill/variants.def, upf_variant_current):
 *        GROUPED  cublasGemmGroupedBatchedEx, experts with equal counts form one group (LOOP where
 *                 cuBLAS refuses the grouped call);
 *        PADDED   cublasGemmStridedBatchedEx over E slabs of `cap` rows (the largest count rounded up
 *                 to 8); slab e holds expert e's rows first, the rest is never read;
 *        LOOP     one cublasGemmEx per expert that has tokens;
 *        BUCKETED experts sorted by count, cut into a few buckets (plan_buckets), one
 *                 cublasGemmBatchedEx a bucket over slabs of the bucket's largest count; the buckets
 *                 of a GEMM alternate between the backend stream and a second one, so that a bucket's
 *                 tail wave runs beside the next one's start;
 *      BUCKETED is the default: the fastest on the H200 at 8K and 32K (PADDED and GROUPED slower,
 *                 perf/NOTES.md). A CUTLASS 4.2 grouped GEMM
 *                 (one persistent launch a GEMM, weights as M) measured slower than BUCKETED in every
 *                 tile configuration (tag h200-moe-cutlass-98374c5, perf/NOTES.md).
 *   6. Shared expert: two cublasGemmEx over all T tokens with the same SwiGLU kernel between, on a
 *      side stream (its own cuBLAS handle) forked after the sort is queued and joined before the
 *      combine: it depends on x alone, so it fills the GPU while the host reads the counts.
 *   7. moe_combine_kernel: one CTA per token: out = sum over k in rank order of w_k * y[row(t, k)]
 *      + g * ys[t], fp32, rounded once to out's dtype.
 * No float atomics anywhere and every reduction has a fixed order, so the same inputs give the
 * same bits on every run (cuBLAS GEMMs are deterministic on one stream and device).
 *
 * Numerics: bf16 inputs -> fp32 accumulation in every GEMM; logits, softmax, weights and the
 * combine in fp32; the GEMM outputs h, y, ys and the SwiGLU output are stored in bf16 (the GEMM
 * operands of the next step), as the frameworks do. f32 inputs: everything fp32, no TF32 (the
 * handle's math mode is set to CUBLAS_DEFAULT_MATH for the op's calls and restored after).
 *
 * Floors for Qwen3-Next (H=2048, E=512, K=10, I=Is=512), bf16, H200 (about 790 TFLOP/s bf16 dense,
 * 4.3 TB/s copy): 71.3 MFLOP per token (router 2.1, experts 62.9, shared 6.3); all weights 3.2 GB.
 *   T = 8K:  0.58 TFLOP -> 0.74 ms, but every expert's weights (3.2 GB) are read once -> 0.75 ms:
 *            the expert GEMMs sit at the ridge point (about 160 tokens per expert, 160 FLOP/byte).
 *   T = 32K: 2.34 TFLOP -> 2.96 ms; weights 0.75 ms; activations through HBM (xp, h, a, y at
 *            T*K rows, each written and read once) about 6 GB -> 1.4 ms unless overlapped.
 */
#include <algorithm>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>
#include <vector>

#include <cub/block/block_scan.cuh>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/ffn.cuh"
#include "cuda/moe.cuh"
#include "uniprefill/variant.h"

namespace {

using bf16 = __nv_bfloat16;

constexpr int MOE_MAX_EXPERTS = 1024; /* moe_topk_kernel keeps a token's logits in its warp's registers, 32 a lane */
constexpr int MOE_MAX_TOPK = 4096;     /* the combine kernel's (row, weight) list in shared memory */
constexpr uint32_t MOE_NONE = 0xFFFFFFFFu;
/* The info array read back by moe_ffn: [0] first token with a non-finite logit, [1] first pair
 * whose expert index is out of range (MOE_NONE: none), [2..3] unused, then the E counts. */
constexpr int INFO_HEAD = 4;
constexpr int TOPK_WARPS = 8;

/* ---------------------------------------------------------------------------------------------- */
/* Element helpers                                                                                  */

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float v) { return __float2bfloat16_rn(v); }

template <int BYTES> struct raw_vec;
template <> struct raw_vec<2> { using type = unsigned short; };
template <> struct raw_vec<4> { using type = unsigned int; };
template <> struct raw_vec<8> { using type = uint2; };
template <> struct raw_vec<16> { using type = uint4; };

/* V consecutive elements at p (aligned to V * sizeof(T)) as floats, in one access. */
template <typename T, int V> __device__ __forceinline__ void load_f(const T *p, float (&o)[V]) {
  using R = typename raw_vec<V * (int)sizeof(T)>::type;
  R r = *reinterpret_cast<const R *>(p);
  const T *e = reinterpret_cast<const T *>(&r);
#pragma unroll
  for (int i = 0; i < V; i++)
    o[i] = to_f(e[i]);
}

template <typename T, int V> __device__ __forceinline__ void store_f(T *p, const float (&v)[V]) {
  using R = typename raw_vec<V * (int)sizeof(T)>::type;
  R r;
  T *e = reinterpret_cast<T *>(&r);
#pragma unroll
  for (int i = 0; i < V; i++)
    e[i] = from_f<T>(v[i]);
  *reinterpret_cast<R *>(p) = r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* ---------------------------------------------------------------------------------------------- */
/* Kernels                                                                                          */

/* Pair (v, i) ranks before (w, j) in the top-K order: larger logit first, the lower expert index of equals. */
__device__ __forceinline__ bool ranks_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

/* Sorts one (v, i) pair a lane across the warp into rank order (lane 0 first): a bitonic network of
 * 15 compare-exchange steps through shuffles. */
__device__ __forceinline__ void warp_rank_sort(float &v, int &i, int lane) {
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1)
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, stride);
      const int oi = __shfl_xor_sync(0xffffffffu, i, stride);
      /* blocks of `size` lanes alternate: rank order where lane & size == 0 (the whole warp at 32), reversed
       * in the others; the lower lane of a pair keeps the first-ranked of the two in a rank-order block */
      const bool lower = (lane & stride) == 0, in_order = (lane & size) == 0;
      if (lower == in_order ? ranks_before(ov, oi, v, i) : ranks_before(v, i, ov, oi))
        v = ov, i = oi;
    }
}

/* One warp per token; lane l holds logits l + 32 j (j < NV, E <= 32 NV) in registers. Softmax max and
 * sum (per-lane sums in ascending j, then an xor tree: every lane ends with the same bits). Selection:
 * tau = the K-th largest of the 32 lane maxima bounds the K-th largest logit from below (the K lanes
 * with the largest maxima hold K logits >= tau), so the top K are among the logits >= tau; when there
 * are at most 32 of them (K <= 32; ties can make more) they are gathered one a lane and rank-sorted
 * once. Otherwise K rounds of a warp argmax over every logit left. Both give the exact top K in rank
 * order (ties: the lower index). Scratch: 32 (logit, index) pairs a warp in shared memory. */
template <int NV>
__global__ void moe_topk_kernel(const float *__restrict__ logits, // (T, E)
                                int64_t T, int E, int K, int norm,
                                int32_t *__restrict__ topk_index, // (T, K)
                                float *__restrict__ topk_weight,  // (T, K)
                                uint32_t *__restrict__ flags) {   // (INFO_HEAD)
  __shared__ float cand_v[TOPK_WARPS][32];
  __shared__ int cand_i[TOPK_WARPS][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = (int64_t)blockIdx.x * TOPK_WARPS + warp;
  if (t >= T)
    return; /* the whole warp leaves together */
  const float *row = logits + t * E;
  int32_t *idx = topk_index + t * K;
  float *wt = topk_weight + t * K;
  float v[NV];
  float m = -INFINITY;
  int bad = 0;
#pragma unroll
  for (int j = 0; j < NV; j++) {
    const int e = lane + 32 * j;
    v[j] = e < E ? row[e] : -INFINITY; /* -inf past E: never selected, since K <= E logits are finite */
    bad |= e < E && !isfinite(v[j]);
    m = fmaxf(m, v[j]);
  }
  if (__any_sync(0xffffffffu, bad)) {
    if (lane == 0)
      atomicMin(&flags[0], (uint32_t)t);
    for (int k = lane; k < K; k += 32)
      idx[k] = 0, wt[k] = 0.0f;
    return;
  }
  m = warp_max(m);
  float s = 0.0f, lm = -INFINITY;
#pragma unroll
  for (int j = 0; j < NV; j++)
    if (lane + 32 * j < E) {
      s += expf(v[j] - m);
      lm = fmaxf(lm, v[j]);
    }
  s = warp_sum(s);

  /* tau and the candidates >= tau; `total` starts above the 32 a warp can rank-sort, which sends
   * K > 32 (no tau) to the argmax rounds below as well */
  constexpr int TOO_MANY = 33;
  float tau = -INFINITY;
  int total = TOO_MANY;
  if (K <= 32) {
    float sv = lm;
    int si = lane;
    warp_rank_sort(sv, si, lane);
    tau = __shfl_sync(0xffffffffu, sv, K - 1);
    int mine = 0;
#pragma unroll
    for (int j = 0; j < NV; j++)
      mine += v[j] >= tau;
    int before = mine; /* inclusive prefix over the lanes */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o)
        before += up;
    }
    total = __shfl_sync(0xffffffffu, before, 31);
    if (total <= 32) {
      int at = before - mine;
#pragma unroll
      for (int j = 0; j < NV; j++)
        if (v[j] >= tau) {
          cand_v[warp][at] = v[j], cand_i[warp][at] = lane + 32 * j;
          at++;
        }
    }
  }
  float chosen = 0.0f;
  if (total <= 32) {
    __syncwarp();
    float cv = lane < total ? cand_v[warp][lane] : -INFINITY;
    int ci = lane < total ? cand_i[warp][lane] : INT_MAX;
    warp_rank_sort(cv, ci, lane);
    const float p = expf(cv - m) / s;
    for (int k = 0; k < K; k++) /* the sum in rank order, as the rounds below add it */
      chosen += __shfl_sync(0xffffffffu, p, k);
    if (lane < K)
      idx[lane] = ci, wt[lane] = norm ? p / chosen : p;
    return;
  }
  for (int k = 0; k < K; k++) {
    float best = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < NV; j++)
      if (v[j] > best) /* ascending j: the first of equal values, the lower index, stays */
        best = v[j], bi = lane + 32 * j;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      float ob = __shfl_xor_sync(0xffffffffu, best, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi))
        best = ob, bi = oi;
    }
    if (lane == (bi & 31)) {
#pragma unroll
      for (int j = 0; j < NV; j++)
        if (j == (bi >> 5))
          v[j] = -INFINITY; /* taken: every logit left is finite, so it never wins again */
    }
    float p = expf(best - m) / s;
    chosen += p;
    if (lane == 0)
      idx[k] = bi, wt[k] = p;
  }
  __syncwarp();
  if (norm)
    for (int k = lane; k < K; k += 32)
      wt[k] = wt[k] / chosen;
}

/* The counting sort of the n = T*K (token, rank) pairs by expert, in SORT_TILE-pair tiles, one warp
 * a tile; every step has a fixed order and no atomics decide a slot, so it is stable (within an
 * expert the pairs keep ascending (token, rank) order) and gives the same permutation on every run. */
constexpr int SORT_STEPS = 16;              /* 32-pair steps of a tile, loaded into registers up front */
constexpr int SORT_TILE = 32 * SORT_STEPS; /* pairs a warp */

/* The tile's expert indices, lane + 32 k, all loads in flight at once (-1 past n). */
__device__ __forceinline__ void load_tile(const int32_t *__restrict__ topk_index, int64_t n, int tile, int lane,
                                          int32_t (&ex)[SORT_STEPS]) {
#pragma unroll
  for (int k = 0; k < SORT_STEPS; k++) {
    const int64_t i = (int64_t)tile * SORT_TILE + 32 * k + lane;
    ex[k] = i < n ? topk_index[i] : -1;
  }
}

/* Warps a CTA of the tile kernels: each keeps E 32-bit counters in shared memory (48 KB at most). */
int sort_warps(int E) { return std::max(1, std::min(8, (48 * 1024) / (E * (int)sizeof(uint32_t)))); }

/* tile_count[e * tiles + tile] = pairs of the tile routed to e (a per-warp shared-memory histogram;
 * integer adds: exact); the first pair with an index outside [0, E) lands in flags[1]. */
__global__ void moe_tile_count_kernel(const int32_t *__restrict__ topk_index, int64_t n, int E, int tiles,
                                      uint32_t *__restrict__ tile_count, // (E, tiles)
                                      uint32_t *__restrict__ flags) {
  extern __shared__ uint32_t hist[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x * warps + warp;
  if (tile >= tiles)
    return; /* the whole warp; the kernel has no CTA barrier */
  int32_t ex[SORT_STEPS];
  load_tile(topk_index, n, tile, lane, ex);
  uint32_t *h = hist + (size_t)warp * E;
  for (int e = lane; e < E; e += 32)
    h[e] = 0;
  __syncwarp();
#pragma unroll
  for (int k = 0; k < SORT_STEPS; k++) {
    const int64_t i = (int64_t)tile * SORT_TILE + 32 * k + lane;
    if (i >= n)
      continue;
    if (ex[k] < 0 || ex[k] >= E)
      atomicMin(&flags[1], (uint32_t)i);
    else
      atomicAdd(&h[ex[k]], 1u);
  }
  __syncwarp();
  for (int e = lane; e < E; e += 32)
    tile_count[(int64_t)e * tiles + tile] = h[e];
}

/* Row blockIdx.x of `in` (len values, rows `len` apart): out = its exclusive prefix sum, total[row]
 * = its sum; in place allowed. One CTA a row (cub::BlockScan, rounds of 256 with a carry). Serves
 * the per-expert tile bases (E rows of `tiles`) and the expert offsets (one row of E). */
__global__ void moe_scan_rows_kernel(const uint32_t *in, int len, uint32_t *out, uint32_t *__restrict__ total) {
  using scan_t = cub::BlockScan<uint32_t, 256>;
  __shared__ typename scan_t::TempStorage tmp;
  const int64_t row = (int64_t)blockIdx.x * len;
  uint32_t carry = 0;
  for (int base = 0; base < len; base += 256) {
    const int i = base + threadIdx.x;
    uint32_t c = i < len ? in[row + i] : 0u, excl = 0, sum = 0;
    scan_t(tmp).ExclusiveSum(c, excl, sum);
    if (i < len)
      out[row + i] = carry + excl;
    carry += sum;
    __syncthreads(); /* tmp is reused by the next round */
  }
  if (threadIdx.x == 0)
    total[blockIdx.x] = carry;
}

/* One warp a tile, 32 pairs at a time in ascending order: a pair's slot is offsets[e] + the pairs
 * of e in earlier tiles (tile_base) + those earlier in this tile (a shared-memory counter per
 * expert, advanced once a step by the lowest lane of each __match_any_sync group) + its rank among
 * the lanes of its group. It writes both directions of the permutation: sorted_pair[slot] = pair and
 * slot_of_pair[pair] = slot. Pairs outside [0, E) (flagged by the count) are skipped. */
__global__ void moe_scatter_kernel(const int32_t *__restrict__ topk_index, int64_t n, int E, int tiles,
                                   const uint32_t *__restrict__ tile_base, // (E, tiles)
                                   const int32_t *__restrict__ offsets,    // (E+1)
                                   int32_t *__restrict__ sorted_pair,      // (n)
                                   int32_t *__restrict__ slot_of_pair) {   // (n)
  extern __shared__ uint32_t next[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x * warps + warp;
  if (tile >= tiles)
    return;
  int32_t ex[SORT_STEPS];
  load_tile(topk_index, n, tile, lane, ex);
  uint32_t *slot = next + (size_t)warp * E;
  for (int e = lane; e < E; e += 32)
    slot[e] = (uint32_t)offsets[e] + tile_base[(int64_t)e * tiles + tile];
  __syncwarp();
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int k = 0; k < SORT_STEPS; k++) {
    const int64_t i = (int64_t)tile * SORT_TILE + 32 * k + lane;
    const int32_t e = i < n && ex[k] < E ? ex[k] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const uint32_t base = e >= 0 ? slot[e] : 0u;
    __syncwarp();
    if (e >= 0 && (peers & below) == 0)
      slot[e] = base + (uint32_t)__popc(peers);
    __syncwarp();
    if (e >= 0) {
      const uint32_t at = base + (uint32_t)__popc(peers & below);
      sorted_pair[at] = (int32_t)i;
      slot_of_pair[i] = (int32_t)at;
    }
  }
}

/* One warp a token t, in token order: x[t] is loaded once (R-typed accesses, EPV elements of T each)
 * and written to the permuted rows of its K pairs, r = row_base[e] + (slot - offsets[e]) for pair
 * p = t K + k of expert e and sorted slot `slot`; r lands in row_of_pair[p] and row_of_sorted[slot]
 * for the SwiGLU and the combine. In token order x crosses HBM once, where the expert-sorted order
 * re-read each row K times. With shared_gate, gate[t] = sigmoid(x[t] . shared_gate) as well (the
 * shared expert's gate, for the combine), while the row is in registers. */
template <typename T, typename R>
__global__ void moe_gather_kernel(const T *__restrict__ x, int64_t x_ld, int64_t vpr, // x (T, x_ld), vpr R per row
                                  const int32_t *__restrict__ topk_index,   // (T, K)
                                  const int32_t *__restrict__ slot_of_pair, // (T, K)
                                  const int32_t *__restrict__ offsets,      // (E+1)
                                  const int32_t *__restrict__ row_base,     // (E)
                                  int64_t num_tokens, int K,
                                  const T *__restrict__ shared_gate, // (H) or NULL
                                  float *__restrict__ gate,          // (T) when shared_gate
                                  int32_t *__restrict__ row_of_pair,   // (T, K)
                                  int32_t *__restrict__ row_of_sorted, // (T K)
                                  R *__restrict__ xp) {                // (rows, vpr)
  constexpr int EPV = (int)(sizeof(R) / sizeof(T));
  static_assert(EPV >= 1 && sizeof(R) % sizeof(T) == 0, "a vector holds whole elements");
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int64_t t = (int64_t)blockIdx.x * warps + threadIdx.x / 32;
  if (t >= num_tokens)
    return;
  const R *src = reinterpret_cast<const R *>(x + t * x_ld);
  const R *gsrc = reinterpret_cast<const R *>(shared_gate);
  float dot = 0.0f;
  constexpr int UNROLL = 8; /* a 4 KB bf16 row of H = 2048 in one round: every load in flight at once */
  for (int64_t c0 = 0; c0 < vpr; c0 += 32 * UNROLL) { /* uniform over the warp: the shuffles below need every lane */
    const int64_t j0 = c0 + lane;
    R v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
      if (j0 + 32 * u < vpr)
        v[u] = src[j0 + 32 * u];
    if (gsrc) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++)
        if (j0 + 32 * u < vpr) {
          const R gv = gsrc[j0 + 32 * u];
          const T *xe = reinterpret_cast<const T *>(&v[u]), *ge = reinterpret_cast<const T *>(&gv);
#pragma unroll
          for (int q = 0; q < EPV; q++)
            dot += to_f(xe[q]) * to_f(ge[q]);
        }
    }
    /* the rows of pairs k0 .. k0 + 31: lane k - k0 finds row k, the warp writes them one by one */
    for (int k0 = 0; k0 < K; k0 += 32) {
      int32_t r = 0;
      if (k0 + lane < K) {
        const int64_t p = t * K + k0 + lane;
        const int32_t e = topk_index[p], slot = slot_of_pair[p];
        r = row_base[e] + (slot - offsets[e]);
        if (c0 == 0) /* the first round records it */
          row_of_pair[p] = r, row_of_sorted[slot] = r;
      }
      const int kn = min(32, K - k0);
      for (int k = 0; k < kn; k++) {
        R *dst = xp + (int64_t)__shfl_sync(0xffffffffu, r, k) * vpr;
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
          if (j0 + 32 * u < vpr)
            dst[j0 + 32 * u] = v[u];
      }
    }
  }
  if (gsrc) {
    dot = warp_sum(dot);
    if (lane == 0)
      gate[t] = 1.0f / (1.0f + expf(-dot));
  }
}

/* One CTA per token t: out[t] = sum_k w[t,k] * y[row(t,k)] (k ascending) + gate[t] * ys[t] (when ys
 * is not NULL; gate from moe_gather_kernel). Shared memory: K ints, K floats. */
template <typename T, typename TO, int V>
__global__ void moe_combine_kernel(const float *__restrict__ gate,         // (T) or NULL
                                   const T *__restrict__ y,                // (rows, H)
                                   const T *__restrict__ ys,               // (T, H) or NULL
                                   const int32_t *__restrict__ row_of_pair, // (T, K)
                                   const float *__restrict__ topk_weight,   // (T, K)
                                   int H, int K,
                                   TO *__restrict__ out, int64_t out_ld) { // (T, out_ld)
  extern __shared__ int32_t cmb[];
  int32_t *rows = cmb;
  float *wts = reinterpret_cast<float *>(cmb + K);
  const int64_t t = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    rows[k] = row_of_pair[t * K + k];
    wts[k] = topk_weight[t * K + k];
  }
  __syncthreads();
  const float g = ys ? gate[t] : 0.0f;
  for (int h0 = threadIdx.x * V; h0 < H; h0 += blockDim.x * V) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; j++)
      acc[j] = 0.0f;
    for (int k = 0; k < K; k++) {
      float yv[V];
      load_f<T, V>(y + (int64_t)rows[k] * H + h0, yv);
      const float wk = wts[k];
#pragma unroll
      for (int j = 0; j < V; j++)
        acc[j] += wk * yv[j];
    }
    if (ys) {
      float sv[V];
      load_f<T, V>(ys + t * H + h0, sv);
#pragma unroll
      for (int j = 0; j < V; j++)
        acc[j] += g * sv[j];
    }
    store_f<TO, V>(out + t * out_ld + h0, acc);
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Host state: grow-only device buffers (routing/sort scratch, the expert activations, the shared
 * expert's), the side streams and the host image of the plan.                                     */

struct dev_buffer {
  void *ptr = nullptr;
  size_t bytes = 0;
};

/* A stream beside the backend's, forked from it (fork) and joined back to it (join), with its own cuBLAS
 * handle (a handle's workspace serves one stream); made on first use by aux_ready. */
struct aux_stream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  cublasHandle_t blas = nullptr;
};

struct moe_state {
  dev_buffer route, act, shared;
  aux_stream side; /* the shared expert's */
  aux_stream lane; /* BUCKETED's odd buckets */
  std::vector<unsigned char> blob; /* host image of the per-call plan uploaded to the device */
};

moe_state ms;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Grows b to at least `bytes` (whole MiB, at least 1.25x the old size). Waits for the stream first:
 * queued work may still use the old allocation. New memory is zeroed when asked, so that padded
 * rows the GEMMs read but nobody wrote hold finite values. */
upf_status reserve(dev_buffer &b, size_t bytes, bool zero) {
  if (bytes <= b.bytes)
    return UPF_OK;
  cudaStream_t s = upf_cuda_stream();
  size_t want = std::max(bytes, b.bytes + b.bytes / 4);
  want = align_up(want, (size_t)1 << 20);
  UPF_CUDA_TRY(cudaStreamSynchronize(s));
  for (cudaStream_t aux : {ms.side.stream, ms.lane.stream})
    if (aux)
      UPF_CUDA_TRY(cudaStreamSynchronize(aux));
  if (b.ptr) {
    UPF_CUDA_TRY(cudaFree(b.ptr));
    b.ptr = nullptr;
    b.bytes = 0;
  }
  cudaError_t err = cudaMalloc(&b.ptr, want);
  if (err != cudaSuccess) {
    b.ptr = nullptr;
    (void)cudaGetLastError();
    return upf_fail(err == cudaErrorMemoryAllocation ? UPF_ERR_NOMEM : UPF_ERR_CUDA,
                    "moe (cuda): cannot allocate %zu bytes of scratch: %s", want, cudaGetErrorString(err));
  }
  b.bytes = want;
  if (zero)
    UPF_CUDA_TRY(cudaMemsetAsync(b.ptr, 0, want, s));
  return UPF_OK;
}

/* Bump layout of one buffer: offsets first, then pointers once the buffer is reserved. */
struct carve {
  size_t at = 0;
  size_t take(size_t bytes) {
    size_t off = align_up(at, 256);
    at = off + bytes;
    return off;
  }
};

template <typename P> P *ptr_at(const dev_buffer &b, size_t off) {
  return reinterpret_cast<P *>(static_cast<char *>(b.ptr) + off);
}

/* Copies `bytes` of device memory to the host in reads of at most 4096 bytes (waits). */
upf_status download(void *dst, const void *src, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 4096)
    UPF_TRY(upf_cuda_download_small((char *)dst + at, (const char *)src + at, std::min<size_t>(4096, bytes - at)));
  return UPF_OK;
}

/* The backend's cuBLAS handle, with host pointer mode and CUBLAS_DEFAULT_MATH (no TF32) for this
 * op's calls; the handle's previous settings come back when the guard goes. */
struct cublas_guard {
  cublasHandle_t h = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t mode = CUBLAS_POINTER_MODE_HOST;
  bool saved = false;
  upf_status acquire() {
    h = upf_cuda_cublas();
    if (!h) {
      char why[256];
      snprintf(why, sizeof why, "%s", upf_last_error());
      return upf_fail(UPF_ERR_CUDA, "moe (cuda): no cuBLAS handle: %s", why);
    }
    UPF_CUBLAS_TRY(cublasGetMathMode(h, &math));
    UPF_CUBLAS_TRY(cublasGetPointerMode(h, &mode));
    saved = true;
    UPF_CUBLAS_TRY(cublasSetStream(h, upf_cuda_stream()));
    UPF_CUBLAS_TRY(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    UPF_CUBLAS_TRY(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
    return UPF_OK;
  }
  ~cublas_guard() {
    if (saved) {
      cublasSetMathMode(h, math);
      cublasSetPointerMode(h, mode);
    }
  }
};

template <typename T> constexpr upf_dtype upf_dtype_of() {
  return std::is_same<T, bf16>::value ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
}

template <typename T> constexpr cudaDataType_t cuda_type() {
  return std::is_same<T, bf16>::value ? CUDA_R_16BF : CUDA_R_32F;
}

/* out (rows, cols; ld_out) = in (rows, k; ld_in) . W^T with W (cols, k) contiguous: cuBLAS sees the
 * column-major product out^T = W^T' . in^T, i.e. op(A) = W^T (TN). */
upf_status linear(cublasHandle_t h, int64_t rows, int64_t cols, int64_t k, const void *W, const void *in,
                  int64_t ld_in, void *out, int64_t ld_out, cudaDataType_t ab, cudaDataType_t c) {
  if (rows > INT_MAX || cols > INT_MAX || k > INT_MAX || ld_in > INT_MAX || ld_out > INT_MAX)
    return upf_fail(UPF_ERR_UNSUPPORTED, "moe (cuda): GEMM extent beyond int32 (%lld x %lld x %lld)",
                    (long long)rows, (long long)cols, (long long)k);
  const float one = 1.0f, zero = 0.0f;
  UPF_CUBLAS_TRY(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)cols, (int)rows, (int)k, &one, W, ab, (int)k, in, ab,
                              (int)ld_in, &zero, out, c, (int)ld_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  cudaStream_t stream = nullptr;
  UPF_CUBLAS_TRY(cublasGetStream(h, &stream));
  const int64_t es = c == CUDA_R_16BF ? 2 : 4;
  upf_cuda_mark_written(stream, out, rows, cols * es, ld_out * es);
  return UPF_OK;
}

upf_status check_limits(const upf_moe_config *cfg) {
  if (cfg->num_experts > MOE_MAX_EXPERTS || cfg->top_k > MOE_MAX_TOPK)
    return upf_fail(UPF_ERR_UNSUPPORTED, "moe (cuda): E=%d, K=%d beyond this implementation's E <= %d, K <= %d",
                    cfg->num_experts, cfg->top_k, MOE_MAX_EXPERTS, MOE_MAX_TOPK);
  return UPF_OK;
}

/* CTAs for a grid-stride loop over `items`: one item per thread, at most per_sm CTAs per SM. */
int grid_for(int64_t items, int threads, int per_sm = 32) {
  int64_t g = (items + threads - 1) / threads;
  int cap = std::max(1, upf_cuda_num_sms()) * per_sm;
  return (int)std::max<int64_t>(1, std::min<int64_t>(g, cap));
}

/* ---- stage launches shared by the three entries ---- */

/* logits (T, E) fp32 = x . router^T, then top-K; flags[0] gets the first non-finite token. */
template <typename T>
upf_status launch_route(cublasHandle_t h, const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                        float *logits, int32_t *topk_index, float *topk_weight, uint32_t *flags) {
  cudaStream_t s = upf_cuda_stream();
  const int64_t T_ = x->shape[0];
  const int E = cfg->num_experts, K = cfg->top_k;
  UPF_TRY(linear(h, T_, E, cfg->hidden, w->router, x->data, x->stride[0], logits, E, cuda_type<T>(), CUDA_R_32F));
  const unsigned blocks = (unsigned)((T_ + TOPK_WARPS - 1) / TOPK_WARPS);
  const int nv = (E + 31) / 32; /* logits a lane; check_limits keeps E <= 32 * 32 */
  if (nv <= 4)
    moe_topk_kernel<4><<<blocks, TOPK_WARPS * 32, 0, s>>>(logits, T_, E, K, cfg->norm_topk, topk_index, topk_weight,
                                                          flags);
  else if (nv <= 16)
    moe_topk_kernel<16><<<blocks, TOPK_WARPS * 32, 0, s>>>(logits, T_, E, K, cfg->norm_topk, topk_index, topk_weight,
                                                           flags);
  else
    moe_topk_kernel<32><<<blocks, TOPK_WARPS * 32, 0, s>>>(logits, T_, E, K, cfg->norm_topk, topk_index, topk_weight,
                                                           flags);
  UPF_CUDA_LAUNCH_TRY("moe_topk_kernel");
  return UPF_OK;
}

int sort_tiles(int64_t n) { return (int)((n + SORT_TILE - 1) / SORT_TILE); }

size_t tile_count_bytes(int64_t n, int E) { return (size_t)E * (size_t)sort_tiles(n) * sizeof(uint32_t); }

/* counts (E), offsets (E+1), sorted_pair (n) and its inverse slot_of_pair (n) from topk_index (n);
 * tile_count (tile_count_bytes) is scratch; flags[1] gets the first out-of-range pair (flags reset by
 * the caller). Four launches, no host wait. */
upf_status launch_sort(const upf_moe_config *cfg, int64_t n, const int32_t *topk_index, uint32_t *counts,
                       int32_t *offsets, int32_t *sorted_pair, int32_t *slot_of_pair, uint32_t *flags,
                       uint32_t *tile_count) {
  cudaStream_t s = upf_cuda_stream();
  const int E = cfg->num_experts, tiles = sort_tiles(n), warps = sort_warps(E);
  const size_t smem = (size_t)warps * E * sizeof(uint32_t);
  const unsigned grid = (unsigned)((tiles + warps - 1) / warps);
  moe_tile_count_kernel<<<grid, warps * 32, smem, s>>>(topk_index, n, E, tiles, tile_count, flags);
  UPF_CUDA_LAUNCH_TRY("moe_tile_count_kernel");
  moe_scan_rows_kernel<<<(unsigned)E, 256, 0, s>>>(tile_count, tiles, tile_count, counts);
  UPF_CUDA_LAUNCH_TRY("moe_scan_rows_kernel (tiles)");
  moe_scan_rows_kernel<<<1, 256, 0, s>>>(counts, E, reinterpret_cast<uint32_t *>(offsets),
                                         reinterpret_cast<uint32_t *>(offsets) + E);
  UPF_CUDA_LAUNCH_TRY("moe_scan_rows_kernel (offsets)");
  moe_scatter_kernel<<<grid, warps * 32, smem, s>>>(topk_index, n, E, tiles, tile_count, offsets, sorted_pair,
                                                    slot_of_pair);
  UPF_CUDA_LAUNCH_TRY("moe_scatter_kernel");
  return UPF_OK;
}

/* ---- the expert GEMMs ---- */

/* The plan of one call's expert GEMMs, built on the host from the counts. */
/* The expert-GEMM variants of moe.ffn (variants.def), as the plan uses them. */
enum gemm_variant { GEMM_BUCKETED, GEMM_GROUPED, GEMM_PADDED, GEMM_LOOP };

struct gemm_plan {
  gemm_variant variant;
  int64_t rows; /* rows of the permuted layout */
  int32_t cap;  /* PADDED slab rows */
  std::vector<int32_t> count, offset, row_base; /* (E), (E+1), (E) */
  std::vector<int32_t> order;                   /* experts with tokens, by (count, index) */
  std::vector<int> group_n, group_size;         /* GROUPED: per group of equal counts */
  std::vector<int> bucket_start, bucket_size, bucket_cap; /* BUCKETED: ranges of `order`, slab rows */
};

/* BUCKETED: the experts with tokens, in ascending count order, cut into B buckets of equal expert
 * counts (B = 1..MAX_BUCKETS, the one with the fewest slab rows plus BUCKET_COST_ROWS a bucket: a
 * launch and its tail wave); each bucket's slabs hold its largest count rounded up to 8. */
constexpr int MAX_BUCKETS = 8;
constexpr int64_t BUCKET_COST_ROWS = 1024;

void plan_buckets(gemm_plan &p) {
  const int m = (int)p.order.size();
  p.bucket_start.clear(), p.bucket_size.clear(), p.bucket_cap.clear();
  if (m == 0)
    return;
  int best_b = 1;
  int64_t best_cost = INT64_MAX;
  for (int b = 1; b <= std::min(MAX_BUCKETS, m); b++) {
    int64_t cost = b * BUCKET_COST_ROWS;
    for (int i = 0; i < b; i++) {
      const int lo = (int)((int64_t)m * i / b), hi = (int)((int64_t)m * (i + 1) / b);
      cost += (int64_t)(hi - lo) * (int64_t)align_up((size_t)p.count[p.order[hi - 1]], 8);
    }
    if (cost < best_cost)
      best_cost = cost, best_b = b;
  }
  for (int i = 0; i < best_b; i++) {
    const int lo = (int)((int64_t)m * i / best_b), hi = (int)((int64_t)m * (i + 1) / best_b);
    p.bucket_start.push_back(lo);
    p.bucket_size.push_back(hi - lo);
    p.bucket_cap.push_back((int)align_up((size_t)p.count[p.order[hi - 1]], 8));
  }
}

void plan_gemms(const upf_moe_config *cfg, int64_t T, const uint32_t *counts, gemm_variant v, gemm_plan &p) {
  const int E = cfg->num_experts;
  const int64_t n = T * cfg->top_k;
  p.count.assign(E, 0);
  p.offset.assign((size_t)E + 1, 0);
  p.row_base.assign(E, 0);
  p.order.clear();
  p.group_n.clear();
  p.group_size.clear();
  int32_t max_count = 0;
  for (int e = 0; e < E; e++) {
    p.count[e] = (int32_t)counts[e];
    p.offset[e + 1] = p.offset[e] + p.count[e];
    max_count = std::max(max_count, p.count[e]);
    if (p.count[e] > 0)
      p.order.push_back(e);
  }
  p.cap = (int32_t)align_up((size_t)max_count, 8);
  double padded_rows = (double)E * p.cap;
  if (v == GEMM_PADDED && padded_rows > (double)(INT_MAX / 2))
    v = GEMM_GROUPED;
  p.variant = v;
  std::stable_sort(p.order.begin(), p.order.end(), [&](int a, int b) { return p.count[a] < p.count[b]; });
  if (v == GEMM_PADDED) {
    p.rows = (int64_t)E * p.cap;
    for (int e = 0; e < E; e++)
      p.row_base[e] = e * p.cap;
  } else if (v == GEMM_BUCKETED) {
    plan_buckets(p);
    int64_t at = 0;
    for (size_t b = 0; b < p.bucket_start.size(); b++)
      for (int i = p.bucket_start[b]; i < p.bucket_start[b] + p.bucket_size[b]; i++) {
        p.row_base[p.order[i]] = (int32_t)std::min<int64_t>(at, INT32_MAX);
        at += p.bucket_cap[b];
      }
    p.rows = at;
  } else {
    /* Each expert's rows start at a multiple of 8 rows, so every matrix pointer the GEMMs get is
     * 16-byte aligned (cuBLAS requires it of grouped bf16 GEMMs whose rows are 16-byte multiples). */
    int64_t at = 0;
    for (int e = 0; e < E; e++) {
      p.row_base[e] = (int32_t)at;
      at += (int64_t)align_up((size_t)p.count[e], 8);
    }
    p.rows = at;
  }
  for (size_t i = 0; i < p.order.size(); i++) {
    int c = p.count[p.order[i]];
    if (p.group_n.empty() || p.group_n.back() != c) {
      p.group_n.push_back(c);
      p.group_size.push_back(0);
    }
    p.group_size.back()++;
  }
}

/* Makes a's stream, events and cuBLAS handle where missing. */
upf_status aux_ready(aux_stream &a) {
  if (a.blas)
    return UPF_OK;
  if (!a.stream)
    UPF_CUDA_TRY(cudaStreamCreate(&a.stream));
  if (!a.fork)
    UPF_CUDA_TRY(cudaEventCreateWithFlags(&a.fork, cudaEventDisableTiming));
  if (!a.join)
    UPF_CUDA_TRY(cudaEventCreateWithFlags(&a.join, cudaEventDisableTiming));
  cublasHandle_t h = nullptr;
  UPF_CUBLAS_TRY(cublasCreate(&h));
  cublasStatus_t st = cublasSetStream(h, a.stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(h);
    return upf_fail(UPF_ERR_CUDA, "cuda: cublasSetStream failed: %s", cublasGetStatusString(st));
  }
  a.blas = h; /* defaults: host pointer mode, CUBLAS_DEFAULT_MATH (no TF32) */
  return UPF_OK;
}

/* a's stream waits for everything queued on the backend stream so far. */
upf_status aux_fork(aux_stream &a) {
  UPF_CUDA_TRY(cudaEventRecord(a.fork, upf_cuda_stream()));
  UPF_CUDA_TRY(cudaStreamWaitEvent(a.stream, a.fork, 0));
  return UPF_OK;
}

/* One of the two expert GEMMs: out rows (count_e, cols) = in rows (count_e, k) . W_e^T for every
 * expert e with tokens; W_e = W + e * cols * k. in/out are the permuted activations with row
 * strides k and cols. dev_ptrs (3 * experts) are the device pointer arrays of GROUPED. */
struct expert_gemm {
  const void *W;
  const void *in;
  void *out;
  int64_t cols, k;
  const void **dev_ptrs;
};

/* BUCKETED: bucket b of one expert GEMM, one cublasGemmBatchedEx over its slabs, on h's stream. */
template <typename T> upf_status bucket_gemm(cublasHandle_t h, const gemm_plan &p, const expert_gemm &g, size_t b) {
  const cudaDataType_t dt = cuda_type<T>();
  const float one = 1.0f, zero = 0.0f;
  const size_t E_used = p.order.size(), at = (size_t)p.bucket_start[b];
  const int cols = (int)g.cols, k = (int)g.k; /* run_expert_gemm's callers checked the int32 extents */
  UPF_CUBLAS_TRY(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, cols, p.bucket_cap[b], k, &one, g.dev_ptrs + at, dt,
                                     k, g.dev_ptrs + E_used + at, dt, k, &zero,
                                     const_cast<void *const *>(g.dev_ptrs + 2 * E_used + at), dt, cols,
                                     p.bucket_size[b], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return UPF_OK;
}

template <typename T>
upf_status expert_gemm_calls(cublasHandle_t h, const gemm_plan &p, const expert_gemm &g, int num_experts,
                             gemm_variant *ran) {
  const cudaDataType_t dt = cuda_type<T>();
  const float one = 1.0f, zero = 0.0f;
  const size_t es = sizeof(T);
  if (g.cols > INT_MAX || g.k > INT_MAX || p.rows > INT_MAX)
    return upf_fail(UPF_ERR_UNSUPPORTED, "moe (cuda): expert GEMM extents beyond int32");
  const int cols = (int)g.cols, k = (int)g.k;
  if (p.variant == GEMM_PADDED) {
    UPF_CUBLAS_TRY(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, cols, p.cap, k, &one, g.W, dt, k,
                                              (long long)cols * k, g.in, dt, k, (long long)p.cap * k, &zero, g.out,
                                              dt, cols, (long long)p.cap * cols, num_experts, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT));
    *ran = GEMM_PADDED;
    return UPF_OK;
  }
  if (p.variant == GEMM_BUCKETED && p.bucket_start.size() < 2) {
    for (size_t b = 0; b < p.bucket_start.size(); b++)
      UPF_TRY(bucket_gemm<T>(h, p, g, b));
    *ran = GEMM_BUCKETED;
    return UPF_OK;
  }
  /* Two lanes: even buckets here, odd ones on ms.lane (its own cuBLAS handle), joined before what
   * follows, so that a bucket's tail wave runs beside the next one's start; one lane measured slower. */
  if (p.variant == GEMM_BUCKETED) {
    UPF_TRY(aux_ready(ms.lane));
    UPF_TRY(aux_fork(ms.lane));
    upf_status st = UPF_OK;
    for (size_t b = 0; b < p.bucket_start.size() && st == UPF_OK; b++)
      st = bucket_gemm<T>((b & 1) ? ms.lane.blas : h, p, g, b);
    /* joined also after a failed launch: whatever the lane queued stays ordered before what follows */
    UPF_CUDA_TRY(cudaEventRecord(ms.lane.join, ms.lane.stream));
    UPF_CUDA_TRY(cudaStreamWaitEvent(upf_cuda_stream(), ms.lane.join, 0));
    UPF_TRY(st);
    *ran = GEMM_BUCKETED;
    return UPF_OK;
  }
  if (p.variant == GEMM_GROUPED && !p.group_n.empty()) {
    const int G = (int)p.group_n.size();
    std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
    std::vector<int> m(G, cols), kk(G, k), lda(G, k), ldb(G, k), ldc(G, cols);
    std::vector<float> alpha(G, 1.0f), beta(G, 0.0f);
    const size_t E_used = p.order.size();
    cublasStatus_t st = cublasGemmGroupedBatchedEx(
        h, ta.data(), tb.data(), m.data(), p.group_n.data(), kk.data(), alpha.data(), g.dev_ptrs, dt, lda.data(),
        g.dev_ptrs + E_used, dt, ldb.data(), beta.data(), const_cast<void *const *>(g.dev_ptrs + 2 * E_used), dt,
        ldc.data(), G, p.group_size.data(), CUBLAS_COMPUTE_32F);
    if (st == CUBLAS_STATUS_SUCCESS) {
      *ran = GEMM_GROUPED;
      return UPF_OK;
    }
    if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
      return upf_fail(UPF_ERR_CUDA, "cuda: cublasGemmGroupedBatchedEx failed: %s (%d)", cublasGetStatusString(st),
                      (int)st);
    /* This cuBLAS refuses the grouped call for these types or shapes (it checks them before it
     * queues anything): one GEMM per expert instead, reported as LOOP. */
  }
  for (int e : p.order) {
    const char *W = static_cast<const char *>(g.W) + (size_t)e * g.cols * g.k * es;
    const char *in = static_cast<const char *>(g.in) + (size_t)p.row_base[e] * g.k * es;
    char *out = static_cast<char *>(g.out) + (size_t)p.row_base[e] * g.cols * es;
    UPF_CUBLAS_TRY(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, cols, p.count[e], k, &one, W, dt, k, in, dt, k, &zero,
                                out, dt, cols, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  *ran = GEMM_LOOP;
  return UPF_OK;
}

/* The expert GEMM in p's form; the permuted output rows it wrote (every slab row) marked for initcheck. */
template <typename T>
upf_status run_expert_gemm(cublasHandle_t h, const gemm_plan &p, const expert_gemm &g, int num_experts,
                           gemm_variant *ran) {
  UPF_TRY(expert_gemm_calls<T>(h, p, g, num_experts, ran));
  const int64_t row_bytes = g.cols * (int64_t)sizeof(T);
  upf_cuda_mark_written(upf_cuda_stream(), g.out, p.rows, row_bytes, row_bytes);
  return UPF_OK;
}

/* ---- launch helpers that pick the vector width ---- */

bool aligned(const void *p, size_t a) { return ((uintptr_t)p % a) == 0; }

/* moe_gather_kernel's device arrays (see there); shared_gate and gate NULL without a shared expert. */
template <typename T> struct gather_io {
  const int32_t *topk_index, *slot_of_pair, *offsets, *row_base;
  const T *shared_gate;
  float *gate;
  int32_t *row_of_pair, *row_of_sorted;
  T *xp;
};

template <typename T, typename R> upf_status launch_gather_as(const upf_tensor *x, int K, const gather_io<T> &g) {
  const int64_t vpr = x->shape[1] * (int64_t)sizeof(T) / (int64_t)sizeof(R), T_ = x->shape[0];
  const int warps = 8;
  moe_gather_kernel<T, R><<<(unsigned)((T_ + warps - 1) / warps), warps * 32, 0, upf_cuda_stream()>>>(
      static_cast<const T *>(x->data), x->stride[0], vpr, g.topk_index, g.slot_of_pair, g.offsets, g.row_base, T_, K,
      g.shared_gate, g.gate, g.row_of_pair, g.row_of_sorted, reinterpret_cast<R *>(g.xp));
  UPF_CUDA_LAUNCH_TRY("moe_gather_kernel");
  return UPF_OK;
}

/* The widest access (16 bytes down to one element) that x's rows, its stride, its base and the shared
 * gate allow. */
template <typename T> upf_status launch_gather(const upf_tensor *x, int K, const gather_io<T> &g) {
  const size_t row_bytes = (size_t)x->shape[1] * sizeof(T), ld_bytes = (size_t)x->stride[0] * sizeof(T);
  auto fits = [&](size_t a) {
    return row_bytes % a == 0 && ld_bytes % a == 0 && aligned(x->data, a) && aligned(g.shared_gate, a);
  };
  if (fits(16))
    return launch_gather_as<T, uint4>(x, K, g);
  if (fits(8))
    return launch_gather_as<T, uint2>(x, K, g);
  if (fits(4))
    return launch_gather_as<T, unsigned int>(x, K, g);
  return launch_gather_as<T, typename raw_vec<sizeof(T)>::type>(x, K, g);
}

/* act[r] = silu(hg[r, :I]) * hg[r, I:] for r = rows[i] (i < n), or r = i when rows is NULL: the dense
 * FFN's act-and-multiply kernel, a grid-stride loop over (row, vector), 0.95 of copy bandwidth on the
 * H200 at 32K. (A kernel of the MoE's own, one CTA a few rows, ran at 0.77 in three forms; perf/NOTES.md.) */
template <typename T>
upf_status launch_swiglu(const T *hg, const int32_t *rows, int64_t n, int I, T *act, cudaStream_t s) {
  return upf_cuda_act_mul_rows(hg, 2 * (int64_t)I, act, I, rows, n, I, upf_dtype_of<T>(), UPF_ACT_SILU, s);
}

/* The shared expert on the side stream: hs (T, 2Is) = x . shared_gate_up^T, as = SwiGLU(hs),
 * ys (T, H) = as . shared_down^T. Forked from the backend stream after everything queued so far and
 * joined back by ms.side.join, so it overlaps the routing, the host read of the counts and the gather. */
template <typename T>
upf_status launch_shared_expert(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, T *hs,
                                T *as, T *ys) {
  UPF_TRY(aux_ready(ms.side));
  const int64_t T_ = x->shape[0], H = cfg->hidden, Is = cfg->shared_inter;
  const cudaDataType_t dt = cuda_type<T>();
  UPF_TRY(aux_fork(ms.side));
  upf_status st = linear(ms.side.blas, T_, 2 * Is, H, w->shared_gate_up, x->data, x->stride[0], hs, 2 * Is, dt, dt);
  if (st == UPF_OK)
    st = launch_swiglu<T>(hs, nullptr, T_, (int)Is, as, ms.side.stream);
  if (st == UPF_OK)
    st = linear(ms.side.blas, T_, H, Is, w->shared_down, as, Is, ys, H, dt, dt);
  UPF_CUDA_TRY(cudaEventRecord(ms.side.join, ms.side.stream)); /* also after a failed launch: whatever was queued */
  return st;
}

template <typename T, typename TO, int V>
upf_status launch_combine_as(int64_t T_, const float *gate, const T *y, const T *ys, const int32_t *row_of_pair,
                             const float *topk_weight, int H, int K, const upf_tensor *out) {
  int threads = (int)std::min<int64_t>(256, std::max<int64_t>(32, align_up((size_t)((H + V - 1) / V), 32)));
  size_t smem = (size_t)K * (sizeof(int32_t) + sizeof(float));
  moe_combine_kernel<T, TO, V><<<(unsigned)T_, threads, smem, upf_cuda_stream()>>>(
      gate, y, ys, row_of_pair, topk_weight, H, K, static_cast<TO *>(out->data), out->stride[0]);
  UPF_CUDA_LAUNCH_TRY("moe_combine_kernel");
  return UPF_OK;
}

template <typename T, typename TO>
upf_status launch_combine_to(int64_t T_, const float *gate, const T *y, const T *ys, const int32_t *row_of_pair,
                             const float *topk_weight, int H, int K, const upf_tensor *out) {
  constexpr int VM = 16 / (int)(sizeof(T) > sizeof(TO) ? sizeof(T) : sizeof(TO));
  if (H % VM == 0 && out->stride[0] % VM == 0 && aligned(out->data, VM * sizeof(TO)))
    return launch_combine_as<T, TO, VM>(T_, gate, y, ys, row_of_pair, topk_weight, H, K, out);
  return launch_combine_as<T, TO, 1>(T_, gate, y, ys, row_of_pair, topk_weight, H, K, out);
}

/* out = the routed rows' weighted sum (+ gate * ys with a shared expert: ys not NULL). */
template <typename T>
upf_status launch_combine(int64_t T_, const float *gate, const T *y, const T *ys, const int32_t *row_of_pair,
                          const float *topk_weight, int H, int K, const upf_tensor *out) {
  if (out->dtype == UPF_DTYPE_BF16)
    return launch_combine_to<T, bf16>(T_, gate, y, ys, row_of_pair, topk_weight, H, K, out);
  return launch_combine_to<T, float>(T_, gate, y, ys, row_of_pair, topk_weight, H, K, out);
}

upf_status nonfinite_error(uint32_t token) {
  return upf_fail(UPF_ERR_NONFINITE,
                  "moe: router logits of token %u are not finite (NaN/Inf in x row %u or in the router weights)",
                  token, token);
}

/* ---- the entries ---- */

template <typename T>
upf_status route_run(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                     upf_moe_routing *routing) {
  cublas_guard cg;
  UPF_TRY(cg.acquire());
  const int64_t T_ = x->shape[0];
  carve c;
  size_t o_logits = routing->logits ? 0 : c.take((size_t)T_ * cfg->num_experts * sizeof(float));
  size_t o_flags = c.take(INFO_HEAD * sizeof(uint32_t));
  UPF_TRY(reserve(ms.route, c.at, false));
  float *logits = routing->logits ? routing->logits : ptr_at<float>(ms.route, o_logits);
  uint32_t *flags = ptr_at<uint32_t>(ms.route, o_flags);
  UPF_CUDA_TRY(cudaMemsetAsync(flags, 0xFF, INFO_HEAD * sizeof(uint32_t), upf_cuda_stream()));
  UPF_TRY(launch_route<T>(cg.h, cfg, x, w, logits, routing->topk_index, routing->topk_weight, flags));
  uint32_t bad = MOE_NONE;
  UPF_TRY(download(&bad, flags, sizeof bad));
  return bad == MOE_NONE ? UPF_OK : nonfinite_error(bad);
}

/* Makes the backend stream wait for the shared expert on every way out of moe_ffn, so that no
 * caller's later work on the stream can race with it, an error return included. */
struct join_guard {
  bool armed = false;
  ~join_guard() {
    if (armed)
      (void)cudaStreamWaitEvent(upf_cuda_stream(), ms.side.join, 0);
  }
};

/* Offsets of the route buffer of one moe_ffn call. */
struct ffn_route_layout {
  size_t logits, index, weight, info, offsets, tile_count, sorted_pair, slot_of_pair, row_of_pair, row_of_sorted,
      plan, plan_bytes;
};

template <typename T>
upf_status ffn_run(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, const upf_tensor *out,
                   upf_moe_routing *routing) {
  upf_variant chosen;
  UPF_TRY(upf_variant_current(UPF_OP_MOE_FFN, &chosen));
  const gemm_variant variant = chosen == UPF_VARIANT_MOE_FFN_GROUPED ? GEMM_GROUPED
                               : chosen == UPF_VARIANT_MOE_FFN_PADDED ? GEMM_PADDED
                               : chosen == UPF_VARIANT_MOE_FFN_LOOP   ? GEMM_LOOP
                                                                      : GEMM_BUCKETED;
  cudaStream_t s = upf_cuda_stream();
  cublas_guard cg;
  UPF_TRY(cg.acquire());
  const int64_t T_ = x->shape[0], H = cfg->hidden, I = cfg->inter, Is = cfg->shared_inter;
  const int E = cfg->num_experts, K = cfg->top_k;
  const int64_t n = T_ * K;
  const size_t es = sizeof(T);

  /* Routing and sort scratch; the plan region holds row_base (E) and 6 pointer arrays (E each). */
  upf_moe_routing rt = routing ? *routing : upf_moe_routing{nullptr, nullptr, nullptr};
  ffn_route_layout L;
  carve c;
  L.logits = rt.logits ? 0 : c.take((size_t)T_ * E * sizeof(float));
  L.index = rt.topk_index ? 0 : c.take((size_t)n * sizeof(int32_t));
  L.weight = rt.topk_weight ? 0 : c.take((size_t)n * sizeof(float));
  L.info = c.take((size_t)(INFO_HEAD + E) * sizeof(uint32_t));
  L.offsets = c.take((size_t)(E + 1) * sizeof(int32_t));
  L.tile_count = c.take(tile_count_bytes(n, E));
  L.sorted_pair = c.take((size_t)n * sizeof(int32_t));
  L.slot_of_pair = c.take((size_t)n * sizeof(int32_t));
  L.row_of_pair = c.take((size_t)n * sizeof(int32_t));
  L.row_of_sorted = c.take((size_t)n * sizeof(int32_t));
  L.plan_bytes = align_up((size_t)E * sizeof(int32_t), 256) + (size_t)6 * E * sizeof(void *);
  L.plan = c.take(L.plan_bytes);
  UPF_TRY(reserve(ms.route, c.at, false));
  carve sh; /* shared expert: hs (T, 2Is), as (T, Is), ys (T, H), its gate (T) */
  const size_t o_hs = sh.take((size_t)T_ * 2 * Is * es), o_as = sh.take((size_t)T_ * Is * es);
  const size_t o_ys = sh.take((size_t)T_ * H * es), o_gate = sh.take((size_t)T_ * sizeof(float));
  if (Is > 0)
    UPF_TRY(reserve(ms.shared, sh.at, false));
  const dev_buffer &rb = ms.route;
  float *logits = rt.logits ? rt.logits : ptr_at<float>(rb, L.logits);
  int32_t *topk_index = rt.topk_index ? rt.topk_index : ptr_at<int32_t>(rb, L.index);
  float *topk_weight = rt.topk_weight ? rt.topk_weight : ptr_at<float>(rb, L.weight);
  uint32_t *info = ptr_at<uint32_t>(rb, L.info);
  int32_t *offsets = ptr_at<int32_t>(rb, L.offsets);
  int32_t *sorted_pair = ptr_at<int32_t>(rb, L.sorted_pair), *slot_of_pair = ptr_at<int32_t>(rb, L.slot_of_pair);
  int32_t *row_of_pair = ptr_at<int32_t>(rb, L.row_of_pair);
  int32_t *row_of_sorted = ptr_at<int32_t>(rb, L.row_of_sorted);
  int32_t *row_base = ptr_at<int32_t>(rb, L.plan);
  const void **ptrs = ptr_at<const void *>(rb, L.plan + align_up((size_t)E * sizeof(int32_t), 256));

  T *hs = Is > 0 ? ptr_at<T>(ms.shared, o_hs) : nullptr, *as = Is > 0 ? ptr_at<T>(ms.shared, o_as) : nullptr;
  T *ys = Is > 0 ? ptr_at<T>(ms.shared, o_ys) : nullptr;
  float *token_gate = Is > 0 ? ptr_at<float>(ms.shared, o_gate) : nullptr; /* sigmoid(x . shared_gate) a token */
  UPF_CUDA_TRY(cudaMemsetAsync(info, 0xFF, INFO_HEAD * sizeof(uint32_t), s));
  UPF_TRY(launch_route<T>(cg.h, cfg, x, w, logits, topk_index, topk_weight, info));
  UPF_TRY(launch_sort(cfg, n, topk_index, info + INFO_HEAD, offsets, sorted_pair, slot_of_pair, info,
                      ptr_at<uint32_t>(rb, L.tile_count)));
  /* The shared expert forks here, after the routing: it fills the GPU while the host reads the
   * counts below, instead of slowing the routing kernels it would share the GPU with. */
  join_guard joined;
  if (Is > 0) {
    joined.armed = true;
    UPF_TRY(launch_shared_expert<T>(cfg, x, w, hs, as, ys));
  }

  /* The one wait: flags and counts. */
  std::vector<uint32_t> host_info((size_t)INFO_HEAD + E);
  UPF_TRY(download(host_info.data(), info, host_info.size() * sizeof(uint32_t)));
  if (host_info[0] != MOE_NONE)
    return nonfinite_error(host_info[0]);
  if (host_info[1] != MOE_NONE) /* cannot happen: the indices come from the top-K kernel */
    return upf_fail(UPF_ERR_CUDA, "moe.ffn (cuda): internal error, pair %u routed outside [0, E)", host_info[1]);
  gemm_plan plan;
  plan_gemms(cfg, T_, host_info.data() + INFO_HEAD, variant, plan);
  if (plan.rows > INT_MAX)
    return upf_fail(UPF_ERR_UNSUPPORTED, "moe.ffn (cuda): %lld permuted rows exceed the int32 row index",
                    (long long)plan.rows);

  /* Routed activations: xp (rows, H), hg (rows, 2I), act (rows, I), y (rows, H). */
  carve a;
  const int64_t R = plan.rows;
  size_t o_xp = a.take((size_t)R * H * es), o_hg = a.take((size_t)R * 2 * I * es), o_act = a.take((size_t)R * I * es);
  size_t o_y = a.take((size_t)R * H * es);
  UPF_TRY(reserve(ms.act, a.at, true));
  T *xp = ptr_at<T>(ms.act, o_xp), *hg = ptr_at<T>(ms.act, o_hg), *act = ptr_at<T>(ms.act, o_act);
  T *y = ptr_at<T>(ms.act, o_y);

  /* Upload row_base and, for GROUPED, the pointer arrays (A, B, C of GEMM 1, then of GEMM 2), in
   * the (count, index) order of the groups. */
  const size_t used = plan.order.size();
  const size_t ptr_off = align_up((size_t)E * sizeof(int32_t), 256);
  ms.blob.assign(ptr_off + 6 * used * sizeof(void *), 0);
  memcpy(ms.blob.data(), plan.row_base.data(), (size_t)E * sizeof(int32_t));
  const void **hp = reinterpret_cast<const void **>(ms.blob.data() + ptr_off);
  for (size_t i = 0; i < used; i++) {
    const int e = plan.order[i];
    const size_t rbase = (size_t)plan.row_base[e];
    hp[i] = static_cast<const char *>(w->gate_up) + (size_t)e * 2 * I * H * es;
    hp[used + i] = xp + rbase * H;
    hp[2 * used + i] = hg + rbase * 2 * I;
    hp[3 * used + i] = static_cast<const char *>(w->down) + (size_t)e * H * I * es;
    hp[4 * used + i] = act + rbase * I;
    hp[5 * used + i] = y + rbase * H;
  }
  UPF_TRY(upf_cuda_upload_async(row_base, ms.blob.data(), ms.blob.size()));

  const gather_io<T> gio = {topk_index, slot_of_pair, offsets, row_base,
                            Is > 0 ? static_cast<const T *>(w->shared_gate) : nullptr, token_gate, row_of_pair,
                            row_of_sorted, xp};
  UPF_TRY(launch_gather<T>(x, K, gio));
  gemm_variant ran = plan.variant;
  expert_gemm g1 = {w->gate_up, xp, hg, 2 * I, H, ptrs};
  expert_gemm g2 = {w->down, act, y, H, I, ptrs + 3 * used};
  UPF_TRY(run_expert_gemm<T>(cg.h, plan, g1, E, &ran));
  if (ran == GEMM_LOOP)
    plan.variant = GEMM_LOOP; /* GROUPED unsupported here: the second GEMM loops too */
  UPF_TRY(launch_swiglu<T>(hg, row_of_sorted, n, (int)I, act, s));
  UPF_TRY(run_expert_gemm<T>(cg.h, plan, g2, E, &ran));
  if (Is > 0) {
    joined.armed = false;
    UPF_CUDA_TRY(cudaStreamWaitEvent(s, ms.side.join, 0));
  }
  UPF_TRY(launch_combine<T>(T_, token_gate, y, ys, row_of_pair, topk_weight, (int)H, K, out));
  return UPF_OK;
}

} // namespace

/* ---- extern "C" entries ---- */

extern "C" upf_status upf_cuda_moe_route(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                                         upf_moe_routing *routing) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_moe_validate(cfg, x, w, NULL));
  if (!routing || !routing->topk_index || !routing->topk_weight)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.route: routing->topk_index and topk_weight must be set");
  UPF_TRY(check_limits(cfg));
  if (x->shape[0] == 0)
    return UPF_OK;
  if (x->dtype == UPF_DTYPE_BF16)
    return route_run<bf16>(cfg, x, w, routing);
  return route_run<float>(cfg, x, w, routing);
}

extern "C" upf_status upf_cuda_moe_permute(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                                           upf_moe_permutation *perm) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_moe_config_check(cfg));
  if (num_tokens < 0 || num_tokens * (int64_t)cfg->top_k > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "moe.permute: T=%lld tokens (T*K must fit in int32)", (long long)num_tokens);
  if (!perm || !perm->expert_count || !perm->expert_offset || !perm->sorted_pair || !perm->pair_row ||
      (num_tokens > 0 && !topk_index))
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.permute: topk_index and all four permutation outputs must be set");
  UPF_TRY(check_limits(cfg));
  cudaStream_t s = upf_cuda_stream();
  const int E = cfg->num_experts;
  const int64_t n = num_tokens * cfg->top_k;
  if (n == 0) {
    UPF_CUDA_TRY(cudaMemsetAsync(perm->expert_count, 0, (size_t)E * sizeof(int32_t), s));
    UPF_CUDA_TRY(cudaMemsetAsync(perm->expert_offset, 0, (size_t)(E + 1) * sizeof(int32_t), s));
    return UPF_OK;
  }
  carve c;
  size_t o_flags = c.take(INFO_HEAD * sizeof(uint32_t)), o_tiles = c.take(tile_count_bytes(n, E));
  UPF_TRY(reserve(ms.route, c.at, false));
  uint32_t *flags = ptr_at<uint32_t>(ms.route, o_flags);
  UPF_CUDA_TRY(cudaMemsetAsync(flags, 0xFF, INFO_HEAD * sizeof(uint32_t), s));
  UPF_TRY(launch_sort(cfg, n, topk_index, reinterpret_cast<uint32_t *>(perm->expert_count), perm->expert_offset,
                      perm->sorted_pair, perm->pair_row, flags, ptr_at<uint32_t>(ms.route, o_tiles)));
  /* The sort skips out-of-range pairs (sorted_pair and pair_row then have unwritten entries): an error. */
  uint32_t host_flags[INFO_HEAD];
  UPF_TRY(download(host_flags, flags, sizeof host_flags));
  if (host_flags[1] != MOE_NONE) {
    int32_t value = 0;
    UPF_TRY(download(&value, topk_index + host_flags[1], sizeof value));
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.permute: topk_index[%u] (token %u, rank %u) = %d outside [0, E=%d)",
                    host_flags[1], host_flags[1] / (uint32_t)cfg->top_k, host_flags[1] % (uint32_t)cfg->top_k, value,
                    E);
  }
  return UPF_OK;
}

extern "C" upf_status upf_cuda_moe_ffn(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                                       const upf_tensor *out, upf_moe_routing *routing) {
  UPF_TRY(upf_cuda_init());
  if (!out)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.ffn: out must be set");
  UPF_TRY(upf_moe_validate(cfg, x, w, out));
  UPF_TRY(check_limits(cfg));
  if (x->shape[0] == 0)
    return UPF_OK;
  if (x->dtype == UPF_DTYPE_BF16)
    return ffn_run<bf16>(cfg, x, w, out, routing);
  return ffn_run<float>(cfg, x, w, out, routing);
}

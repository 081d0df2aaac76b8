/* CUDA block-sparse prefill attention (attn.block_sparse, FlashPrefill V2; uniprefill/sparse.h): the
 * backend entry, the launch plan, the choice of kernel, and the generic FFMA kernel that takes every case.
 *
 * Plan: one entry a query tile (every request's tiles), sorted by decreasing visible key blocks (last_k +
 * 1), so the latest (heaviest) segments of the causal triangle start first and the grid ends on light
 * ones; the index itself stays on the device (no download, no sync). A CTA takes a chunk of one tile's
 * packed rows for one KV head; the grid is (tile rank, KV head, chunk), chunk fastest (the Hopper bf16
 * kernel reads it as (KV head, tile rank, chunk): cuda/attn_sparse_hopper.cu).
 * Choice: bf16 with D = 128 or 256 and 16-byte rows (q, k, v, out and the means) takes the Hopper wgmma
 * kernel (cuda/attn_sparse_hopper.cu, 128-row chunks), contiguous or paged, with or without mean
 * correction; everything else (f32, other head dims, unaligned views) the generic kernel below.
 *
 * bs_generic_kernel<T, DPL, PAGED>: the FFMA scheme of cuda/attn_ffma.cu over the sparse key set. A CTA
 * (8 warps, 2 rows each) owns BS_GEN_ROWS = 16 packed rows of one tile and one KV head; it walks the
 * segment's kept blocks in list order, each in 32-key sub-tiles staged as fp32 in shared memory (rows
 * padded to D + 1: conflict-free), keys past the CTA's last row skipped; then, with mean correction, the
 * candidate blocks b < corr_hi in groups of 32 (kbar_b, vbar_b staged the same way), each a key of logit
 * scale q.kbar_b + ln(block_n) unless b is kept (the group's kept bits come from the same ascending list,
 * by a cursor that warp 0 advances). Lane j takes key j's logit; max and sum by xor butterflies (a fixed
 * order); fp32 online softmax; lane e accumulates dims e + 32 i. Deterministic. */
#include <math.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn.cuh"
#include "cuda/attn_sparse_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/kv_gather.cuh"
#include "cuda/sparse.cuh"
#include "uniprefill/dense.h"
#include "uniprefill/variant.h"

namespace upf_bsattn {

namespace {

typedef __nv_bfloat16 bf16_t;

constexpr int GEN_KT = 32;   /* keys a shared-memory sub-tile = lanes of a warp */
constexpr int GEN_WARPS = 8; /* BS_GEN_ROWS / GEN_WARPS rows a warp */
constexpr int GEN_RPW = BS_GEN_ROWS / GEN_WARPS;

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

template <typename T, int DPL, bool PAGED>
__global__ void __launch_bounds__(GEN_WARPS * 32) bs_generic_kernel(const __grid_constant__ bs_args a) {
  extern __shared__ float smem[];
  __shared__ uint32_t kept_bits; /* mean group: bit j = block c0 + j is kept */
  const int d = a.d, ds = d + 1;
  float *qs = smem;                  /* [BS_GEN_ROWS][d] */
  float *ks = qs + BS_GEN_ROWS * d;  /* [GEN_KT][d + 1] */
  float *vs = ks + GEN_KT * ds;      /* [GEN_KT][d + 1] */
  const int chunk = blockIdx.x % a.chunks, hk = (blockIdx.x / a.chunks) % a.hkv;
  const bs_tile tile = a.tiles[blockIdx.x / (a.chunks * a.hkv)];
  const int crow0 = tile.row0 + chunk * BS_GEN_ROWS;
  if (crow0 >= tile.row_end) /* the tile's last chunk may be short of block_m rows: uniform */
    return;
  const int crow_end = min(crow0 + BS_GEN_ROWS, tile.row_end);
  const int G = a.group, prefix = tile.kv_len - tile.q_len;
  const int maxpos = prefix + (crow_end - 1) / G; /* the CTA's last row sees keys <= maxpos */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T *Q = (const T *)a.q, *K = (const T *)a.k, *V = (const T *)a.v;
  const T *KB = (const T *)a.kbar, *VB = (const T *)a.vbar;

  for (int i = threadIdx.x; i < BS_GEN_ROWS * d; i += blockDim.x) {
    const int r = i / d, e = i - r * d, P = crow0 + r;
    float x = 0.0f;
    if (P < crow_end)
      x = to_f(Q[(int64_t)(tile.q0 + P / G) * a.q_s0 + (int64_t)(hk * G + P % G) * a.q_s1 + e]);
    qs[i] = x;
  }

  float m[GEN_RPW], l[GEN_RPW], o[GEN_RPW][DPL];
  int pos[GEN_RPW];
  bool valid[GEN_RPW];
#pragma unroll
  for (int rr = 0; rr < GEN_RPW; rr++) {
    const int P = crow0 + warp * GEN_RPW + rr;
    valid[rr] = P < crow_end;
    pos[rr] = prefix + P / G;
    m[rr] = -INFINITY, l[rr] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++)
      o[rr][i] = 0.0f;
  }

  /* One sub-tile of GEN_KT keys already staged: lane's key visible to row rr iff vis(rr); logit bias. */
  auto step = [&](auto vis, float bias) {
#pragma unroll
    for (int rr = 0; rr < GEN_RPW; rr++) {
      if (!valid[rr]) /* warp-uniform */
        continue;
      const float *qr = qs + (warp * GEN_RPW + rr) * d, *kr = ks + lane * ds;
      float dot = 0.0f;
#pragma unroll 8
      for (int e = 0; e < d; e++)
        dot = fmaf(qr[e], kr[e], dot);
      const bool vi = vis(rr);
      const float s = vi ? fmaf(dot, a.scale, bias) : -INFINITY;
      const float mn = fmaxf(m[rr], warp_max(s));
      if (mn == -INFINITY) /* warp-uniform: nothing visible yet to this row */
        continue;
      const float p = vi ? expf(s - mn) : 0.0f;
      const float alpha = expf(m[rr] - mn); /* 0 on the first visible sub-tile (m = -inf) */
      l[rr] = l[rr] * alpha + warp_sum(p);
#pragma unroll
      for (int i = 0; i < DPL; i++)
        o[rr][i] *= alpha;
      for (int j = 0; j < GEN_KT; j++) {
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
  };
  /* Stages GEN_KT rows into ks, vs: row j from element offsets (ko, vo) of K, V (src) when ok(j) says so,
   * zeros elsewhere. */
  auto stage = [&](const T *kbase, const T *vbase, auto rowoff) {
    if (sizeof(T) == 2 && a.vec8) { /* 16-byte loads: 8 bf16 a thread and load */
      const int cpr = d / 8;
      for (int i = threadIdx.x; i < GEN_KT * cpr; i += blockDim.x) {
        const int j = i / cpr, e = (i - j * cpr) * 8;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
        int64_t ko, vo;
        if (rowoff(j, &ko, &vo)) {
          kx = *reinterpret_cast<const uint4 *>(kbase + ko + e);
          vx = *reinterpret_cast<const uint4 *>(vbase + vo + e);
        }
        const bf16_t *kh = reinterpret_cast<const bf16_t *>(&kx), *vh = reinterpret_cast<const bf16_t *>(&vx);
#pragma unroll
        for (int u = 0; u < 8; u++) {
          ks[j * ds + e + u] = to_f(kh[u]);
          vs[j * ds + e + u] = to_f(vh[u]);
        }
      }
    } else {
      for (int i = threadIdx.x; i < GEN_KT * d; i += blockDim.x) {
        const int j = i / d, e = i - j * d;
        float kx = 0.0f, vx = 0.0f;
        int64_t ko, vo;
        if (rowoff(j, &ko, &vo))
          kx = to_f(kbase[ko + e]), vx = to_f(vbase[vo + e]);
        ks[j * ds + e] = kx;
        vs[j * ds + e] = vx;
      }
    }
  };

  const int64_t seg = (int64_t)hk * a.total_q_tiles + tile.tile;
  const int e0 = a.row_ptr[seg], e1 = a.row_ptr[seg + 1];
  for (int e = e0; e < e1; e++) {
    const int b = a.blocks[e];
    const int64_t kb64 = (int64_t)b * a.block_n;
    if (b < 0 || kb64 > maxpos) /* invisible to every row of the CTA (an ascending list: the tail) */
      continue;
    const int kb = (int)kb64, khi = min(kb + a.block_n, maxpos + 1); /* maxpos < kv_len */
    for (int kv0 = kb; kv0 < khi; kv0 += GEN_KT) {
      __syncthreads(); /* the previous sub-tile is consumed (first pass: q is staged) */
      stage(K, V, [&](int j, int64_t *ko, int64_t *vo) {
        const int kj = kv0 + j;
        if (kj >= khi)
          return false;
        if (PAGED) {
          const int64_t page = a.block_table[(int64_t)tile.req * a.max_blocks + kj / a.page_size];
          const int64_t slot = kj % a.page_size;
          *ko = page * a.k_s0 + slot * a.k_s1 + (int64_t)hk * a.k_s2;
          *vo = page * a.v_s0 + slot * a.v_s1 + (int64_t)hk * a.v_s2;
        } else {
          const int64_t row = (int64_t)tile.kv_base + kj;
          *ko = row * a.k_s0 + (int64_t)hk * a.k_s1;
          *vo = row * a.v_s0 + (int64_t)hk * a.v_s1;
        }
        return true;
      });
      __syncthreads();
      const int kj = kv0 + lane;
      step([&](int rr) { return kj < khi && kj <= pos[rr]; }, 0.0f);
    }
  }

  if (tile.corr_hi > 0) {
    const float bias = logf((float)a.block_n);
    const int64_t mstride = (int64_t)a.hkv * d; /* one block to the next in kbar, vbar */
    const int64_t mbase = ((int64_t)tile.req * a.max_key_blocks * a.hkv + hk) * d;
    int cursor = e0; /* warp 0: the first list entry not below the group's c0 */
    for (int c0 = 0; c0 < tile.corr_hi; c0 += GEN_KT) {
      __syncthreads();
      if (warp == 0) {
        /* Entries of [c0, c0 + 32) are a run of the ascending list from the cursor (at most 32). */
        const int idx = cursor + lane;
        const int b = idx < e1 ? a.blocks[idx] : INT32_MAX;
        const bool below = b < c0 + GEN_KT;
        const uint32_t bit = below && b >= c0 ? 1u << (b - c0) : 0u;
        const uint32_t bits = __reduce_or_sync(0xffffffffu, bit);
        cursor += __popc(__ballot_sync(0xffffffffu, below));
        if (lane == 0)
          kept_bits = bits;
      }
      stage(KB, VB, [&](int j, int64_t *ko, int64_t *vo) {
        const int bj = c0 + j;
        if (bj >= tile.corr_hi)
          return false;
        *ko = *vo = mbase + bj * mstride;
        return true;
      });
      __syncthreads();
      const int bj = c0 + lane;
      const bool vis = bj < tile.corr_hi && !((kept_bits >> lane) & 1u);
      step([&](int) { return vis; }, bias);
    }
  }

#pragma unroll
  for (int rr = 0; rr < GEN_RPW; rr++) {
    if (!valid[rr])
      continue;
    const int P = crow0 + warp * GEN_RPW + rr;
    const int64_t tok = (int64_t)tile.q0 + P / G;
    const int hq = hk * G + P % G;
    /* l = 0 only for a row that sees no key of the index (an index missing the row's own block): 0 */
    const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
    T *orow = (T *)a.out + tok * a.o_s0 + (int64_t)hq * a.o_s1;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      const int e = lane + 32 * i;
      if (e < d)
        orow[e] = from_f<T>(o[rr][i] * inv);
    }
  }
}

template <typename T, int DPL, bool PAGED> upf_status launch_generic_kernel(const bs_args &a, int ntiles) {
  const size_t smem = (size_t)(BS_GEN_ROWS * a.d + 2 * GEN_KT * (a.d + 1)) * sizeof(float);
  /* The attribute is raised once, to the largest size of this instantiation (D = 32 DPL): DPL = 8 only
   * passes the default 48 KB. */
  constexpr size_t most = (size_t)(BS_GEN_ROWS * 32 * DPL + 2 * GEN_KT * (32 * DPL + 1)) * sizeof(float);
  static bool attr_set;
  if (most > 48 * 1024)
    UPF_TRY(upf_cuda_smem_prepare(bs_generic_kernel<T, DPL, PAGED>, most, false, &attr_set, "bs_generic_kernel"));
  const int64_t grid = (int64_t)ntiles * a.hkv * a.chunks;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn.block_sparse (cuda): %lld CTAs exceed the grid", (long long)grid);
  bs_generic_kernel<T, DPL, PAGED><<<(unsigned)grid, GEN_WARPS * 32, smem, upf_cuda_stream()>>>(a);
  UPF_CUDA_LAUNCH_TRY("bs_generic_kernel");
  return UPF_OK;
}

template <typename T, bool PAGED> upf_status launch_generic_d(const bs_args &a, int ntiles) {
  if (a.d <= 64)
    return launch_generic_kernel<T, 2, PAGED>(a, ntiles);
  if (a.d <= 128)
    return launch_generic_kernel<T, 4, PAGED>(a, ntiles);
  return launch_generic_kernel<T, 8, PAGED>(a, ntiles);
}

/* Every base pointer 16-byte aligned, every outer stride a multiple of 8 elements (bf16 16-byte rows). */
bool rows16(const upf_tensor *t) {
  if (!t)
    return true;
  if ((uintptr_t)t->data % 16 != 0)
    return false;
  for (int j = 0; j < t->ndim - 1; j++)
    if (t->stride[j] % 8 != 0)
      return false;
  return true;
}

/* The plan's tiles, heaviest (most visible key blocks) first, ties in batch order. */
upf_status make_tiles(const upf_sparse_batch *b, const upf_sparse_plan *plan, const upf_sparse_params *p,
                      bs_tile **out) {
  const int32_t n = plan->total_q_tiles;
  bs_tile *tiles = (bs_tile *)malloc((size_t)n * sizeof *tiles);
  int32_t *weight = (int32_t *)malloc((size_t)n * sizeof *weight);
  int32_t *order = (int32_t *)malloc((size_t)n * sizeof *order);
  bs_tile *sorted = (bs_tile *)malloc((size_t)n * sizeof *sorted);
  if (!tiles || !weight || !order || !sorted) {
    free(tiles), free(weight), free(order), free(sorted);
    return upf_fail(UPF_ERR_NOMEM, "attn.block_sparse (cuda): plan of %d tiles", n);
  }
  const int32_t *cu = upf_sparse_cu_q_host(b);
  for (int32_t r = 0; r < plan->num_reqs; r++) {
    const int32_t q_len = cu[r + 1] - cu[r], kv_len = upf_sparse_kv_len_host(b, r);
    const int64_t rows = (int64_t)q_len * plan->group;
    for (int32_t m = 0; m < plan->cu_q_tiles[r + 1] - plan->cu_q_tiles[r]; m++) {
      const upf_sparse_tile t = upf_sparse_tile_at(r, m, q_len, kv_len, plan->group, p);
      const int32_t i = plan->cu_q_tiles[r] + m;
      const int64_t row0 = (int64_t)m * p->block_m, row_end = std::min<int64_t>(row0 + p->block_m, rows);
      tiles[i] = bs_tile{i, cu[r], q_len, kv_len, b->contiguous ? b->contiguous->cu_seqlens_kv_host[r] : 0, r,
                         (int32_t)row0, (int32_t)row_end, p->mean_correction ? t.corr_hi : 0};
      weight[i] = t.last_k + 1;
      order[i] = i;
    }
  }
  std::stable_sort(order, order + n, [&](int32_t x, int32_t y) { return weight[x] > weight[y]; });
  for (int32_t i = 0; i < n; i++)
    sorted[i] = tiles[order[i]];
  free(tiles), free(weight), free(order);
  *out = sorted;
  return UPF_OK;
}

/* The paged Hopper call with pages that do not hold whole 64-key blocks: the wgmma producer would look
 * a page up for every row, so each group of requests (kv_gather_plan) has its keys gathered into
 * contiguous rows first (cuda/kv_gather.cuh), then runs the contiguous kernel on its own tiles. */
upf_status bs_run_gathered(const bs_args &pa, const bs_tile *tiles, int ntiles, int32_t nreq, const int32_t *kv_len) {
  std::vector<int32_t> row(nreq), start(nreq, 0), len(kv_len, kv_len + nreq);
  for (int32_t r = 0; r < nreq; r++)
    row[r] = r;
  const kv_paged_view src = {pa.k,    pa.v,           pa.k_s0,       pa.k_s1,      pa.k_s2, pa.v_s0, pa.v_s1,
                             pa.v_s2, pa.block_table, pa.max_blocks, pa.page_size, pa.hkv,  pa.d};
  const size_t row_bytes = (size_t)pa.hkv * pa.d * 2;
  std::vector<bs_tile> sub;
  for (int32_t r = 0; r < nreq;) {
    kv_gather_group g;
    const int n = kv_gather_plan(row.data(), start.data(), len.data(), r, nreq, row_bytes, &g);
    sub.clear();
    for (int i = 0; i < ntiles; i++) /* the heaviest-first order kept */
      if (tiles[i].req >= r && tiles[i].req < r + n) {
        sub.push_back(tiles[i]);
        sub.back().kv_base = g.base[tiles[i].req - r];
      }
    r += n;
    if (sub.empty())
      continue;
    void *k = nullptr, *v = nullptr, *ws = nullptr;
    UPF_TRY(kv_gather(src, g, &k, &v));
    UPF_TRY(upf_cuda_workspace(sub.size() * sizeof(bs_tile), &ws));
    UPF_TRY(upf_cuda_upload_async(ws, sub.data(), sub.size() * sizeof(bs_tile)));
    bs_args a = pa;
    a.k = k, a.k_s0 = (int64_t)pa.hkv * pa.d, a.k_s1 = pa.d, a.k_s2 = 0;
    a.v = v, a.v_s0 = (int64_t)pa.hkv * pa.d, a.v_s1 = pa.d, a.v_s2 = 0;
    a.block_table = nullptr, a.max_blocks = 0, a.page_size = 0;
    a.tiles = (const bs_tile *)ws;
    UPF_TRY(bs_launch_hopper(a, false, (int)sub.size()));
  }
  return UPF_OK;
}

} // namespace

upf_status bs_launch_generic(const bs_args &a, upf_dtype dtype, bool paged, int ntiles) {
  if (dtype == UPF_DTYPE_BF16)
    return paged ? launch_generic_d<bf16_t, true>(a, ntiles) : launch_generic_d<bf16_t, false>(a, ntiles);
  return paged ? launch_generic_d<float, true>(a, ntiles) : launch_generic_d<float, false>(a, ntiles);
}

} // namespace upf_bsattn

using namespace upf_bsattn;

extern "C" upf_status upf_cuda_attn_block_sparse(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                                 const upf_tensor *v, const upf_sparse_params *p,
                                                 const upf_sparse_index *index, const upf_tensor *kbar,
                                                 const upf_tensor *vbar, const upf_tensor *out) {
  static const char *op = "attn.block_sparse";
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_sparse_params_check(p));
  if (!k || !v)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL %s", op, !k ? "k" : "v");
  UPF_TRY(upf_sparse_batch_check(op, b, q, k, v));
  const int64_t want_out[3] = {q->shape[0], q->shape[1], q->shape[2]};
  UPF_TRY(upf_dense_check(out, op, "out", 3, want_out));
  UPF_TRY(upf_dense_same_dtype(q, out, op, "q", "out"));
  if (!index || !index->row_ptr || !index->blocks)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL index (row_ptr and blocks are required)", op);
  const int64_t hq = q->shape[1], d = q->shape[2], hkv = b->contiguous ? k->shape[1] : k->shape[2];
  if (d > UPF_CUDA_ATTN_MAX_D)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): head dim D=%lld above the kernel's %d", op, (long long)d,
                    UPF_CUDA_ATTN_MAX_D);
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(b, (int32_t)hq, (int32_t)hkv, p, &plan));
  upf_status st = UPF_OK;
  if (p->mean_correction) {
    if (!vbar)
      st = upf_fail(UPF_ERR_INVALID_ARG, "%s: mean_correction needs vbar (NULL)", op);
    else
      st = upf_sparse_means_check(op, &plan, k, kbar, vbar);
  }
  const int32_t *cu = upf_sparse_cu_q_host(b);
  for (int32_t r = 0; st == UPF_OK && r < plan.num_reqs; r++)
    if ((int64_t)(cu[r + 1] - cu[r]) * plan.group > INT32_MAX)
      st = upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): request %d has %lld packed rows (q_len x %d), above 2^31", op,
                    r, (long long)(cu[r + 1] - cu[r]) * plan.group, plan.group);
  if (st != UPF_OK || q->shape[0] == 0 || plan.total_q_tiles == 0) {
    upf_sparse_plan_free(&plan);
    return st;
  }

  const bool paged = b->paged != NULL;
  const bool hopper_ok = q->dtype == UPF_DTYPE_BF16 && bs_hopper_takes((int)d) && rows16(q) && rows16(k) &&
                         rows16(v) && rows16(out) && (!p->mean_correction || (rows16(kbar) && rows16(vbar)));
  /* attn.block_sparse's variants: wgmma (the default: the tensor cores) where it takes the call, or generic;
   * fp8 where its kernel takes the call (D = 128), the default's choice elsewhere */
  upf_variant variant = UPF_VARIANT_ATTN_BLOCK_SPARSE_WGMMA;
  if (st == UPF_OK)
    st = upf_variant_current(UPF_OP_ATTN_BLOCK_SPARSE, &variant);
  const bool fp8 = hopper_ok && variant == UPF_VARIANT_ATTN_BLOCK_SPARSE_FP8 && bs_fp8_takes((int)d);
  const bool hopper = hopper_ok && !fp8 && variant != UPF_VARIANT_ATTN_BLOCK_SPARSE_GENERIC;

  bs_args a = {};
  a.q = q->data, a.q_s0 = q->stride[0], a.q_s1 = q->stride[1];
  a.out = out->data, a.o_s0 = out->stride[0], a.o_s1 = out->stride[1];
  a.k = k->data, a.v = v->data;
  a.k_s0 = k->stride[0], a.k_s1 = k->stride[1], a.v_s0 = v->stride[0], a.v_s1 = v->stride[1];
  if (paged) {
    a.k_s2 = k->stride[2], a.v_s2 = v->stride[2];
    a.block_table = b->paged->block_table, a.max_blocks = b->paged->max_blocks, a.page_size = b->paged->page_size;
  }
  a.kbar = p->mean_correction ? kbar->data : nullptr;
  a.vbar = p->mean_correction ? vbar->data : nullptr;
  a.max_key_blocks = plan.max_key_blocks;
  a.row_ptr = index->row_ptr, a.blocks = index->blocks;
  a.total_q_tiles = plan.total_q_tiles;
  const int rows_cta = hopper || fp8 ? BS_WG_ROWS : BS_GEN_ROWS;
  a.chunks = (p->block_m + rows_cta - 1) / rows_cta;
  a.hq = (int32_t)hq, a.hkv = (int32_t)hkv, a.group = plan.group, a.d = (int32_t)d, a.block_n = p->block_n;
  a.scale = upf_sparse_scale(p, d);
  a.vec8 = q->dtype == UPF_DTYPE_BF16 && d % 8 == 0 && rows16(k) && rows16(v) &&
           (!p->mean_correction || (rows16(kbar) && rows16(vbar)));

  bs_tile *tiles = NULL;
  if (st == UPF_OK)
    st = make_tiles(b, &plan, p, &tiles);
  const int ntiles = plan.total_q_tiles;
  const int32_t nreq = plan.num_reqs;
  upf_sparse_plan_free(&plan);
  if (fp8 && st == UPF_OK) {
    int32_t *kv_len = (int32_t *)malloc((size_t)nreq * sizeof *kv_len);
    st = kv_len ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s (cuda, fp8): %d requests", op, nreq);
    for (int32_t r = 0; st == UPF_OK && r < nreq; r++)
      kv_len[r] = upf_sparse_kv_len_host(b, r);
    if (st == UPF_OK)
      st = bs_run_fp8(a, paged, tiles, ntiles, nreq, kv_len, b->contiguous ? b->contiguous->cu_seqlens_kv_host : NULL,
                      q->shape[0]);
    free(kv_len);
    free(tiles);
    return st;
  }
  if (hopper && paged && a.page_size % 64 != 0 && st == UPF_OK) {
    std::vector<int32_t> kv_len(nreq);
    for (int32_t r = 0; r < nreq; r++)
      kv_len[r] = upf_sparse_kv_len_host(b, r);
    st = bs_run_gathered(a, tiles, ntiles, nreq, kv_len.data());
    free(tiles);
    return st;
  }
  void *ws = NULL;
  if (st == UPF_OK)
    st = upf_cuda_workspace((size_t)ntiles * sizeof(bs_tile), &ws);
  if (st == UPF_OK)
    st = upf_cuda_upload_async(ws, tiles, (size_t)ntiles * sizeof(bs_tile));
  free(tiles);
  UPF_TRY(st);
  a.tiles = (const bs_tile *)ws;
  return hopper ? bs_launch_hopper(a, paged, ntiles) : bs_launch_generic(a, q->dtype, paged, ntiles);
}

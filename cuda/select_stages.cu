/* Stages 2-5 of the CUDA selection pipeline (cuda/select.cu's header describes it whole): row statistics
 * and block mass, top-p / top-k, expansion, the stage-alone kernels of the verification entries and the
 * non-finite scan, each with the host function that launches it. */
#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <vector>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/select_common.cuh"
#include "uniprefill/variant.h"

namespace upf_select {
namespace {

/* ---------------------------------------------------------------------------------------------- */
/* 2-3. Combine: row statistics, then block mass.                                                   */

__global__ void sel_row_stats_kernel(const sel_req *__restrict__ reqs, int S, int64_t Rn,
                                     const float *__restrict__ MC, // (c_len)
                                     const float *__restrict__ LC, // (c_len)
                                     float *__restrict__ row_m,    // (S, Rn)
                                     float *__restrict__ row_il) { // (S, Rn)
  int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)S * Rn)
    return;
  int s = (int)(idx / Rn);
  int64_t R = idx - (int64_t)s * Rn;
  const sel_req rq = reqs[s];
  const float *mc = MC + rq.c0 + R;
  const float *lc = LC + rq.c0 + R;
  float m = -INFINITY;
  for (int x = 0; x < rq.nchunk; x++)
    m = fmaxf(m, mc[(int64_t)x * Rn]);
  float l = 0.f;
  for (int x = 0; x < rq.nchunk; x++)
    l += lc[(int64_t)x * Rn] * ex2(mc[(int64_t)x * Rn] - m);
  row_m[idx] = m;
  row_il[idx] = 1.0f / l;
}

constexpr int BM_THREADS = 256;

/* One CTA per block: threads stride over the rows (coalesced U/M reads), each sums its rows in a
 * fixed order, then a fixed-shape block reduction. */
__global__ void __launch_bounds__(BM_THREADS) sel_block_mass_kernel(sel_dev_plan plan, int B, int64_t Rn, int G,
                                                                    int SG, int UG, const float *__restrict__ M,
                                                                    const float *__restrict__ U,
                                                                    const float *__restrict__ row_m,
                                                                    const float *__restrict__ row_il,
                                                                    float *__restrict__ block_score) { // (num_blocks)
  using reduce = cub::BlockReduce<float, BM_THREADS>;
  __shared__ typename reduce::TempStorage tmp;
  const int64_t c = blockIdx.x;
  const int r = upper_bound_dev(plan.blk_off, B + 1, c) - 1;
  const int s = plan.sidx[r];
  if (s < 0) {
    if (threadIdx.x == 0)
      block_score[c] = 0.f;
    return;
  }
  const sel_req rq = plan.reqs[s];
  const int64_t cl = c - rq.blk0;
  const int spb = G > SG ? G / SG : 1;
  const int64_t seg0 = cl * spb;
  const int64_t seg1 = imin64(rq.nseg, seg0 + spb);
  const float *wm = row_m + (int64_t)s * Rn, *wi = row_il + (int64_t)s * Rn;
  float acc = 0.f;
  for (int64_t sg = seg0; sg < seg1; sg++) {
    const float *u = U + rq.u0 + sg * Rn;
    const float *m = M + rq.m0 + (sg * SG / UG) * Rn;
#pragma unroll 8
    for (int64_t R = threadIdx.x; R < Rn; R += BM_THREADS)
      acc += u[R] * ex2(m[R] - wm[R]) * wi[R];
  }
  acc = reduce(tmp).Sum(acc);
  if (threadIdx.x == 0)
    block_score[c] = acc;
}

/* ---------------------------------------------------------------------------------------------- */
/* 4. Top-p / top-k                                                                                 */

/* A CTA of TP_THREADS sorts TP_THREADS * ITEMS keys: 256 (ITEMS 1) or 1024 (4) where every request has at
 * most that many blocks (T <= 32K or 128K at block 128), else 4096 (16), the segmented form's chunk too. */
constexpr int TP_THREADS = 256, TP_ITEMS = 16, TP_CHUNK = TP_THREADS * TP_ITEMS;

using tp_reduce = cub::BlockReduce<float, TP_THREADS>;
using tp_scan = cub::BlockScan<float, TP_THREADS>;

template <int ITEMS>
union tp_temp {
  typename cub::BlockRadixSort<unsigned long long, TP_THREADS, ITEMS>::TempStorage sort;
  typename tp_reduce::TempStorage reduce;
  typename tp_scan::TempStorage scan;
};

struct topp_args {
  const float *block_score; /* (num_blocks) */
  uint8_t *block_mask;      /* (num_blocks) */
  int ib;                   /* index bits of the sort key */
  float p;
  int topk;
  float keep_ratio; /* > 0: per-request top-k, ceil(keep_ratio * nb) (upf_select_topk_of) */
  unsigned long long *bad_score; /* (1) min (r << 32 | block) with a NaN/Inf/negative score */
};

__device__ __forceinline__ float key_score(unsigned long long key, int ib) {
  return __uint_as_float((unsigned)(key >> ib));
}

/* Builds the sort key of block cl of request r: b's bits (b >= 0 orders like its bits) above the
 * block index, so a descending sort puts ties at the larger index first. */
__device__ __forceinline__ unsigned long long make_key(const topp_args &a, int r, int64_t blk0, int cl) {
  float b = a.block_score[blk0 + cl];
  if (!isfinite(b) || b < 0.f)
    atomicMin(a.bad_score, ((unsigned long long)(unsigned)r << 32) | (unsigned)cl);
  return ((unsigned long long)__float_as_uint(b) << a.ib) | (unsigned long long)cl;
}

/* Sum of one chunk of sorted keys (blocked arrangement, ranks rank0 + tid*ITEMS + i); thread 0 gets it. */
template <int ITEMS>
__device__ __forceinline__ float chunk_sum(tp_temp<ITEMS> &tmp, const unsigned long long (&keys)[ITEMS], int64_t rank0,
                                           int64_t nb, int ib) {
  float part = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * ITEMS + i;
    if (rank < nb)
      part += key_score(keys[i], ib);
  }
  float sum = tp_reduce(tmp.reduce).Sum(part);
  __syncthreads();
  return sum;
}

/* Decisions for one chunk of sorted keys; carry = exclusive prefix of pi before this chunk. */
template <int ITEMS>
__device__ __forceinline__ void chunk_decide(tp_temp<ITEMS> &tmp, const topp_args &a,
                                             const unsigned long long (&keys)[ITEMS], int64_t rank0, int64_t nb,
                                             int64_t blk0, float total, float &carry) {
  float pi[ITEMS], excl[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * ITEMS + i;
    pi[i] = (rank < nb && total > 0.f) ? key_score(keys[i], a.ib) / total : 0.f;
  }
  float aggregate;
  tp_scan(tmp.scan).ExclusiveSum(pi, excl, aggregate);
  __syncthreads();
  const int64_t topk = a.keep_ratio > 0.f ? (int64_t)ceil((double)a.keep_ratio * (double)nb) : a.topk;
#pragma unroll
  for (int i = 0; i < ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * ITEMS + i;
    if (rank < nb) {
      float before = carry + excl[i];
      bool keep = topk > 0 ? rank < topk : (rank == 0 || before <= a.p);
      unsigned cl = (unsigned)(keys[i] & ((1ull << a.ib) - 1));
      a.block_mask[blk0 + cl] = keep ? 1 : 0;
    }
  }
  carry = carry + aggregate;
}

/* One CTA per scored request with nb <= TP_THREADS * ITEMS: sort in shared memory, then decide. */
template <int ITEMS>
__global__ void __launch_bounds__(TP_THREADS) sel_topp_fused_kernel(const sel_req *__restrict__ reqs, topp_args a) {
  __shared__ tp_temp<ITEMS> tmp;
  __shared__ float s_total;
  const sel_req rq = reqs[blockIdx.x];
  const int nb = rq.nb;
  unsigned long long keys[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; i++) {
    int cl = threadIdx.x * ITEMS + i;
    keys[i] = cl < nb ? make_key(a, rq.r, rq.blk0, cl) : 0ull;
  }
  cub::BlockRadixSort<unsigned long long, TP_THREADS, ITEMS>(tmp.sort).SortDescending(keys, 0, 32 + a.ib);
  __syncthreads();
  float sum = chunk_sum(tmp, keys, 0, nb, a.ib);
  if (threadIdx.x == 0)
    s_total = 0.f + sum;
  __syncthreads();
  float total = s_total, carry = 0.f;
  chunk_decide(tmp, a, keys, 0, nb, rq.blk0, total, carry);
}

/* Segmented form, step 1: keys of every block of every scored request. */
__global__ void sel_topp_keys_kernel(sel_dev_plan plan, int B, int64_t num_blocks, topp_args a,
                                     unsigned long long *__restrict__ keys) { // (num_blocks)
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= num_blocks)
    return;
  int r = upper_bound_dev(plan.blk_off, B + 1, c) - 1;
  int s = plan.sidx[r];
  if (s < 0)
    return;
  const sel_req rq = plan.reqs[s];
  keys[c] = make_key(a, rq.r, rq.blk0, (int)(c - rq.blk0));
}

/* This thread's TP_ITEMS keys of the chunk at rank0 of a request's nb sorted keys k (0 past the end). */
__device__ __forceinline__ void load_sorted_keys(unsigned long long (&keys)[TP_ITEMS], const unsigned long long *k,
                                                 int64_t rank0, int64_t nb) {
#pragma unroll
  for (int i = 0; i < TP_ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * TP_ITEMS + i;
    keys[i] = rank < nb ? k[rank] : 0ull;
  }
}

/* Segmented form, step 3: one CTA per scored request walks its sorted keys chunk by chunk. */
__global__ void __launch_bounds__(TP_THREADS) sel_topp_decide_kernel(const sel_req *__restrict__ reqs, topp_args a,
                                                                     const unsigned long long *__restrict__ sorted) {
  __shared__ tp_temp<TP_ITEMS> tmp;
  __shared__ float s_total;
  const sel_req rq = reqs[blockIdx.x];
  const int64_t nb = rq.nb;
  const unsigned long long *k = sorted + rq.blk0;
  unsigned long long keys[TP_ITEMS];
  float total = 0.f;
  for (int64_t rank0 = 0; rank0 < nb; rank0 += TP_CHUNK) {
    load_sorted_keys(keys, k, rank0, nb);
    float sum = chunk_sum(tmp, keys, rank0, nb, a.ib);
    total = total + sum; /* meaningful in thread 0 only */
  }
  if (threadIdx.x == 0)
    s_total = total;
  __syncthreads();
  total = s_total;
  float carry = 0.f;
  for (int64_t rank0 = 0; rank0 < nb; rank0 += TP_CHUNK) {
    load_sorted_keys(keys, k, rank0, nb);
    chunk_decide(tmp, a, keys, rank0, nb, rq.blk0, total, carry);
  }
}

/* Blocks of requests that are not scored: mask 1 (and score 0 when asked). */
__global__ void sel_unscored_blocks_kernel(sel_dev_plan plan, int B, int64_t num_blocks,
                                           uint8_t *__restrict__ block_mask,  // (num_blocks) or NULL
                                           float *__restrict__ block_score) { // (num_blocks) or NULL
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= num_blocks)
    return;
  int r = upper_bound_dev(plan.blk_off, B + 1, c) - 1;
  if (plan.sidx[r] >= 0)
    return;
  if (block_mask)
    block_mask[c] = 1;
  if (block_score)
    block_score[c] = 0.f;
}

/* ---------------------------------------------------------------------------------------------- */
/* 5. Expansion                                                                                     */

__global__ void sel_token_mask_kernel(const int32_t *__restrict__ cu, // (B+1) device
                                      int B, int64_t T, sel_dev_plan plan, int G, int sink, int L,
                                      const uint8_t *__restrict__ block_mask, // (num_blocks)
                                      uint8_t *__restrict__ token_mask,       // (T)
                                      int32_t *__restrict__ flag) {           // (T+1)
  int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t > T)
    return;
  if (t == T) {
    flag[T] = 0;
    return;
  }
  int r = upper_bound_dev(cu, B + 1, t) - 1;
  int64_t j = t - cu[r];
  int64_t n = (int64_t)cu[r + 1] - cu[r];
  bool keep = true;
  if (plan.sidx[r] >= 0)
    keep = j < sink || j >= n - L || block_mask[plan.blk_off[r] + j / G] != 0;
  token_mask[t] = keep ? 1 : 0;
  flag[t] = keep ? 1 : 0;
}

__global__ void sel_scatter_kernel(int64_t T, const uint8_t *__restrict__ token_mask, // (T)
                                   const int32_t *__restrict__ pos,                   // (T+1)
                                   int32_t *__restrict__ kept_index) {                // (T)
  int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t < T && token_mask[t])
    kept_index[pos[t]] = (int32_t)t;
}

__global__ void sel_request_counts_kernel(const int32_t *__restrict__ cu, int B, const int32_t *__restrict__ pos,
                                          int32_t *__restrict__ new_cu,     // (B+1) or NULL
                                          int32_t *__restrict__ kept_count, // (B) or NULL
                                          int32_t *__restrict__ total_out) { // (1) or NULL
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r > B)
    return;
  int32_t at = pos[cu[r]];
  if (new_cu)
    new_cu[r] = at;
  if (r < B && kept_count)
    kept_count[r] = pos[cu[r + 1]] - at;
  if (r == B && total_out)
    *total_out = at;
}

/* ---------------------------------------------------------------------------------------------- */
/* Stage-alone kernels                                                                              */

template <typename T>
__global__ void sel_part_gemm_kernel(const T *__restrict__ q, // (T, Hq, D)
                                     const T *__restrict__ k, // (T, Hkv, D)
                                     int64_t qs0, int64_t qs1, int64_t ks0, int64_t ks1, int D, int L, int grp,
                                     int64_t Rn, float scale, const sel_req *__restrict__ reqs, int S, int64_t total,
                                     float *__restrict__ scores) { // (total)
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    int lo = 0, hi = S;
    while (hi - lo > 1) {
      int mid = (lo + hi) >> 1;
      if (reqs[mid].sc0 <= e)
        lo = mid;
      else
        hi = mid;
    }
    const sel_req rq = reqs[lo];
    int64_t rem = e - rq.sc0;
    int64_t R = rem / rq.n, j = rem % rq.n;
    int h = (int)(R / L), i = (int)(R % L);
    float v = -INFINITY;
    if (j <= rq.n - L + i) {
      const T *qr = q + (rq.tok0 + rq.n - L + i) * qs0 + (int64_t)h * qs1;
      const T *kr = k + (rq.tok0 + j) * ks0 + (int64_t)(h / grp) * ks1;
      float part[4] = {0.f, 0.f, 0.f, 0.f}; /* four interleaved sums: shorter chains, less error */
      for (int d = 0; d < D; d++)
        part[d & 3] = fmaf(to_float(qr[d]), to_float(kr[d]), part[d & 3]);
      v = scale * ((part[0] + part[1]) + (part[2] + part[3]));
    }
    scores[e] = v;
  }
}

/* One CTA per (scored request, row): max and sum of exp over the row's n scores. */
__global__ void __launch_bounds__(256) sel_softmax_rows_kernel(const sel_req *__restrict__ reqs, int64_t Rn,
                                                              const float *__restrict__ scores,
                                                              float *__restrict__ row_m,   // (S, Rn)
                                                              float *__restrict__ row_l) { // (S, Rn)
  using reduce = cub::BlockReduce<float, 256>;
  __shared__ typename reduce::TempStorage tmp;
  __shared__ float s_m;
  int64_t idx = blockIdx.x;
  int s = (int)(idx / Rn);
  int64_t R = idx - (int64_t)s * Rn;
  const sel_req rq = reqs[s];
  const float *row = scores + rq.sc0 + R * rq.n;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < rq.n; j += 256)
    m = fmaxf(m, row[j]);
  m = reduce(tmp).Reduce(m, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0)
    s_m = m;
  __syncthreads();
  m = s_m;
  float l = 0.f;
  for (int j = threadIdx.x; j < rq.n; j += 256)
    l += expf(row[j] - m);
  l = reduce(tmp).Sum(l);
  if (threadIdx.x == 0) {
    row_m[idx] = m;
    row_l[idx] = l;
  }
}

/* One thread per token: t[j] = sum over rows (fixed order) of exp(s - m) / l; 0 if not scored. */
__global__ void sel_token_mass_kernel(const int32_t *__restrict__ cu, int B, int64_t T, sel_dev_plan plan, int64_t Rn,
                                      const float *__restrict__ scores, const float *__restrict__ row_m,
                                      const float *__restrict__ row_l,
                                      float *__restrict__ token_mass) { // (T)
  int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T)
    return;
  int r = upper_bound_dev(cu, B + 1, t) - 1;
  int s = plan.sidx[r];
  if (s < 0) {
    token_mass[t] = 0.f;
    return;
  }
  const sel_req rq = plan.reqs[s];
  int64_t j = t - rq.tok0;
  const float *col = scores + rq.sc0 + j;
  const float *m = row_m + (int64_t)s * Rn, *l = row_l + (int64_t)s * Rn;
  float acc = 0.f;
  for (int64_t R = 0; R < Rn; R++)
    acc += expf(col[R * rq.n] - m[R]) / l[R];
  token_mass[t] = acc;
}

__global__ void sel_block_reduce_kernel(sel_dev_plan plan, int B, int64_t num_blocks, int G,
                                        const float *__restrict__ token_mass, // (T)
                                        float *__restrict__ block_score) {    // (num_blocks)
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= num_blocks)
    return;
  int r = upper_bound_dev(plan.blk_off, B + 1, c) - 1;
  int s = plan.sidx[r];
  if (s < 0) {
    block_score[c] = 0.f;
    return;
  }
  const sel_req rq = plan.reqs[s];
  int64_t j0 = (c - rq.blk0) * G, j1 = imin64(rq.n, j0 + G);
  float acc = 0.f;
  for (int64_t j = j0; j < j1; j++)
    acc += token_mass[rq.tok0 + j];
  block_score[c] = acc;
}

/* Finds the first NaN/Inf of each (scored request, tensor) job: q's last L rows, k's n rows. */
struct scan_job {
  int64_t tok0, ntok;
  int32_t tensor; /* 0 q, 1 k */
  int32_t cta0;
};

template <typename T>
__global__ void sel_nonfinite_scan_kernel(const T *__restrict__ q, const T *__restrict__ k, int64_t qs0, int64_t qs1,
                                          int64_t ks0, int64_t ks1, int Hq, int Hkv, int D,
                                          const scan_job *__restrict__ jobs, int njobs,
                                          unsigned long long *__restrict__ first) { // (njobs) min(e*2 + isinf)
  int lo = 0, hi = njobs;
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (jobs[mid].cta0 <= (int)blockIdx.x)
      lo = mid;
    else
      hi = mid;
  }
  const scan_job jb = jobs[lo];
  const int H = jb.tensor ? Hkv : Hq;
  const T *x = jb.tensor ? k : q;
  const int64_t s0 = jb.tensor ? ks0 : qs0, s1 = jb.tensor ? ks1 : qs1;
  const int64_t total = jb.ntok * H * D;
  const int64_t e0 = (int64_t)((int)blockIdx.x - jb.cta0) * 4096;
  for (int64_t e = e0 + threadIdx.x; e < imin64(total, e0 + 4096); e += blockDim.x) {
    int64_t tok = e / ((int64_t)H * D);
    int64_t rem = e - tok * H * D;
    int64_t h = rem / D, d = rem % D;
    float v = to_float(x[(jb.tok0 + tok) * s0 + h * s1 + d]);
    if (!isfinite(v))
      atomicMin(&first[lo], (unsigned long long)e * 2 + (isinf(v) ? 1 : 0));
  }
}

} // namespace

/* ---------------------------------------------------------------------------------------------- */
/* Host side                                                                                        */

upf_status launch_combine(const sel_plan &p, const sel_dev_plan &dp, const float *M, const float *U, const float *MC,
                          const float *LC, float *row_m, float *row_il, float *block_score, cudaStream_t stream) {
  int64_t rows = (int64_t)p.S * p.Rn;
  sel_row_stats_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(dp.reqs, p.S, p.Rn, MC, LC, row_m, row_il);
  UPF_CUDA_LAUNCH_TRY("sel_row_stats_kernel");
  sel_block_mass_kernel<<<(unsigned)p.num_blocks, BM_THREADS, 0, stream>>>(dp, p.B, p.Rn, p.G, p.SG, p.UG, M, U,
                                                                          row_m, row_il, block_score);
  UPF_CUDA_LAUNCH_TRY("sel_block_mass_kernel");
  return UPF_OK;
}

upf_status launch_unscored_blocks(const sel_plan &p, const sel_dev_plan &dp, uint8_t *block_mask, float *block_score,
                                  cudaStream_t stream) {
  if (p.num_blocks == 0)
    return UPF_OK;
  sel_unscored_blocks_kernel<<<grid_for(p.num_blocks, 256), 256, 0, stream>>>(dp, p.B, p.num_blocks, block_mask,
                                                                               block_score);
  UPF_CUDA_LAUNCH_TRY("sel_unscored_blocks_kernel");
  return UPF_OK;
}

/* Scans q/k rows of the scored requests for NaN/Inf; names the first like the CPU reference does. */
upf_status find_nonfinite(const upf_select_inputs *in, const sel_plan &p, cudaStream_t stream, const char *op,
                          bool *found) {
  *found = false;
  if (p.S == 0)
    return UPF_OK;
  std::vector<scan_job> jobs;
  int64_t cta = 0;
  for (const sel_req &rq : p.reqs) {
    for (int tensor = 0; tensor < 2; tensor++) {
      scan_job j;
      j.tensor = tensor;
      j.tok0 = tensor ? rq.tok0 : rq.tok0 + rq.n - p.L;
      j.ntok = tensor ? rq.n : p.L;
      j.cta0 = (int32_t)cta;
      int64_t elems = j.ntok * (tensor ? p.Hkv : p.Hq) * (int64_t)p.D;
      cta += (elems + 4095) / 4096;
      jobs.push_back(j);
    }
  }
  if (cta > INT32_MAX)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): non-finite scan too large", op);
  ws_carver wc;
  size_t o_jobs = wc.take(sizeof(scan_job) * jobs.size());
  size_t o_first = wc.take(sizeof(unsigned long long) * jobs.size());
  void *ws;
  UPF_TRY(upf_cuda_workspace(wc.at, &ws));
  uint8_t *base = (uint8_t *)ws;
  scan_job *d_jobs = (scan_job *)(base + o_jobs);
  unsigned long long *d_first = (unsigned long long *)(base + o_first);
  UPF_TRY(upf_cuda_upload_async(d_jobs, jobs.data(), sizeof(scan_job) * jobs.size()));
  UPF_CUDA_TRY(cudaMemsetAsync(d_first, 0xFF, sizeof(unsigned long long) * jobs.size(), stream));
  if (in->q.dtype == UPF_DTYPE_BF16)
    sel_nonfinite_scan_kernel<__nv_bfloat16><<<(unsigned)cta, 256, 0, stream>>>(
        (const __nv_bfloat16 *)in->q.data, (const __nv_bfloat16 *)in->k.data, in->q.stride[0], in->q.stride[1],
        in->k.stride[0], in->k.stride[1], p.Hq, p.Hkv, p.D, d_jobs, (int)jobs.size(), d_first);
  else
    sel_nonfinite_scan_kernel<float><<<(unsigned)cta, 256, 0, stream>>>(
        (const float *)in->q.data, (const float *)in->k.data, in->q.stride[0], in->q.stride[1], in->k.stride[0],
        in->k.stride[1], p.Hq, p.Hkv, p.D, d_jobs, (int)jobs.size(), d_first);
  UPF_CUDA_LAUNCH_TRY("sel_nonfinite_scan_kernel");
  std::vector<unsigned long long> first(jobs.size());
  UPF_CUDA_TRY(cudaMemcpyAsync(first.data(), d_first, sizeof(unsigned long long) * jobs.size(),
                               cudaMemcpyDeviceToHost, stream));
  UPF_CUDA_TRY(cudaStreamSynchronize(stream));
  for (size_t j = 0; j < jobs.size(); j++) {
    if (first[j] == ~0ull)
      continue;
    int64_t e = (int64_t)(first[j] >> 1);
    bool is_inf = first[j] & 1;
    int64_t H = jobs[j].tensor ? p.Hkv : p.Hq;
    int64_t tok = jobs[j].tok0 + e / (H * p.D);
    int64_t h = (e / p.D) % H, d = e % p.D;
    *found = true;
    return upf_fail(UPF_ERR_NONFINITE, "%s: %s at token %lld, head %lld, dim %lld", jobs[j].tensor ? "k" : "q",
                    is_inf ? "Inf" : "NaN", (long long)tok, (long long)h, (long long)d);
  }
  return UPF_OK;
}

/* Top-p over the scored requests' block scores (device), then mask 1 on unscored blocks. */
upf_status run_topp(const sel_plan &p, const sel_dev_plan &dp, const upf_select_params *params,
                    const float *block_score, uint8_t *block_mask, unsigned long long *bad_score, uint8_t *ws_topp,
                    cudaStream_t stream) {
  if (p.num_blocks == 0)
    return UPF_OK;
  UPF_TRY(launch_unscored_blocks(p, dp, block_mask, nullptr, stream));
  if (p.S == 0)
    return UPF_OK;
  topp_args a;
  a.block_score = block_score;
  a.block_mask = block_mask;
  a.p = params->p;
  a.topk = params->topk;
  a.keep_ratio = params->keep_ratio;
  a.bad_score = bad_score;
  bool segmented = p.max_nb > TP_CHUNK;
  if (!segmented) { /* the sort sized to the longest request: fewer keys and radix passes up to 128K */
    if (p.max_nb <= TP_THREADS) {
      a.ib = 8; /* 256 keys = 2^8 */
      sel_topp_fused_kernel<1><<<p.S, TP_THREADS, 0, stream>>>(dp.reqs, a);
    } else if (p.max_nb <= 4 * TP_THREADS) {
      a.ib = 10; /* 1024 keys = 2^10 */
      sel_topp_fused_kernel<4><<<p.S, TP_THREADS, 0, stream>>>(dp.reqs, a);
    } else {
      a.ib = 12; /* TP_CHUNK = 4096 = 2^12 */
      sel_topp_fused_kernel<TP_ITEMS><<<p.S, TP_THREADS, 0, stream>>>(dp.reqs, a);
    }
    UPF_CUDA_LAUNCH_TRY("sel_topp_fused_kernel");
    return UPF_OK;
  }
  int ib = 1;
  while ((1ll << ib) < (int64_t)p.max_nb)
    ib++;
  a.ib = ib;
  unsigned long long *keys_in = (unsigned long long *)ws_topp;
  unsigned long long *keys_out = keys_in + align_up((size_t)p.num_blocks, 32);
  void *temp = keys_out + align_up((size_t)p.num_blocks, 32);
  size_t temp_bytes = 0;
  UPF_CUDA_TRY(cub::DeviceSegmentedSort::SortKeysDescending(nullptr, temp_bytes, keys_in, keys_out, p.num_blocks,
                                                            p.S, dp.seg_begin, dp.seg_end, stream));
  sel_topp_keys_kernel<<<grid_for(p.num_blocks, 256), 256, 0, stream>>>(dp, p.B, p.num_blocks, a, keys_in);
  UPF_CUDA_LAUNCH_TRY("sel_topp_keys_kernel");
  UPF_CUDA_TRY(cub::DeviceSegmentedSort::SortKeysDescending(temp, temp_bytes, keys_in, keys_out, p.num_blocks, p.S,
                                                            dp.seg_begin, dp.seg_end, stream));
  sel_topp_decide_kernel<<<p.S, TP_THREADS, 0, stream>>>(dp.reqs, a, keys_out);
  UPF_CUDA_LAUNCH_TRY("sel_topp_decide_kernel");
  return UPF_OK;
}

size_t topp_ws_bytes(const sel_plan &p) {
  size_t temp_bytes = 0;
  unsigned long long *nul = nullptr;
  const int64_t *off = nullptr;
  if (p.S && p.num_blocks)
    (void)cub::DeviceSegmentedSort::SortKeysDescending(nullptr, temp_bytes, nul, nul, p.num_blocks, p.S, off, off,
                                                       (cudaStream_t)0);
  return 2 * sizeof(unsigned long long) * align_up((size_t)p.num_blocks, 32) + temp_bytes + 256;
}

size_t expand_ws_bytes(const sel_plan &p) {
  size_t temp_bytes = 0;
  int32_t *nul = nullptr;
  (void)cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, nul, nul, p.T + 1, (cudaStream_t)0);
  return 2 * sizeof(int32_t) * align_up((size_t)p.T + 1, 64) + align_up((size_t)p.T, 256) + temp_bytes + 256;
}

/* Expansion: token mask, kept index, new cu_seqlens, counts. Writes kept_total (device int32). */
upf_status run_expand(const upf_select_inputs *in, const sel_plan &p, const sel_dev_plan &dp,
                      const upf_select_params *params, const uint8_t *block_mask, upf_select_outputs *out,
                      uint8_t *ws_exp, int32_t *d_total, cudaStream_t stream) {
  int32_t *flag = (int32_t *)ws_exp;
  int32_t *pos = flag + align_up((size_t)p.T + 1, 64);
  uint8_t *tm_ws = (uint8_t *)(pos + align_up((size_t)p.T + 1, 64));
  void *temp = tm_ws + align_up((size_t)p.T, 256);
  uint8_t *token_mask = out->token_mask ? out->token_mask : tm_ws;
  size_t temp_bytes = 0;
  UPF_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, flag, pos, p.T + 1, stream));
  sel_token_mask_kernel<<<grid_for(p.T + 1, 256), 256, 0, stream>>>(in->cu_seqlens, p.B, p.T, dp, p.G, params->sink,
                                                                     params->last_q, block_mask, token_mask, flag);
  UPF_CUDA_LAUNCH_TRY("sel_token_mask_kernel");
  UPF_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, flag, pos, p.T + 1, stream));
  if (out->kept_index && p.T > 0) {
    sel_scatter_kernel<<<grid_for(p.T, 256), 256, 0, stream>>>(p.T, token_mask, pos, out->kept_index);
    UPF_CUDA_LAUNCH_TRY("sel_scatter_kernel");
  }
  sel_request_counts_kernel<<<grid_for(p.B + 1, 256), 256, 0, stream>>>(in->cu_seqlens, p.B, pos,
                                                                         out->new_cu_seqlens, out->kept_count, d_total);
  UPF_CUDA_LAUNCH_TRY("sel_request_counts_kernel");
  return UPF_OK;
}

upf_status launch_part_gemm(const upf_select_inputs *in, const sel_plan &p, const sel_dev_plan &dp, float scale,
                            float *scores, cudaStream_t stream) {
  int64_t total = p.score_len;
  unsigned grid = (unsigned)std::min<int64_t>((total + 255) / 256, 1 << 20);
  if (in->q.dtype == UPF_DTYPE_BF16)
    sel_part_gemm_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        (const __nv_bfloat16 *)in->q.data, (const __nv_bfloat16 *)in->k.data, in->q.stride[0], in->q.stride[1],
        in->k.stride[0], in->k.stride[1], p.D, p.L, p.grp, p.Rn, scale, dp.reqs, p.S, total, scores);
  else
    sel_part_gemm_kernel<float><<<grid, 256, 0, stream>>>(
        (const float *)in->q.data, (const float *)in->k.data, in->q.stride[0], in->q.stride[1], in->k.stride[0],
        in->k.stride[1], p.D, p.L, p.grp, p.Rn, scale, dp.reqs, p.S, total, scores);
  UPF_CUDA_LAUNCH_TRY("sel_part_gemm_kernel");
  return UPF_OK;
}

upf_status launch_block_softmax(const upf_select_inputs *in, const sel_plan &p, const sel_dev_plan &dp,
                                const float *scores, float *row_m, float *row_l, float *token_mass,
                                cudaStream_t stream) {
  const int64_t rows = (int64_t)p.S * p.Rn;
  if (rows > 0) {
    if (rows > INT32_MAX)
      return upf_fail(UPF_ERR_UNSUPPORTED, "select.block_softmax (cuda): %lld score rows exceed one grid",
                      (long long)rows);
    sel_softmax_rows_kernel<<<(unsigned)rows, 256, 0, stream>>>(dp.reqs, p.Rn, scores, row_m, row_l);
    UPF_CUDA_LAUNCH_TRY("sel_softmax_rows_kernel");
  }
  sel_token_mass_kernel<<<grid_for(p.T, 256), 256, 0, stream>>>(in->cu_seqlens, p.B, p.T, dp, p.Rn, scores, row_m,
                                                                 row_l, token_mass);
  UPF_CUDA_LAUNCH_TRY("sel_token_mass_kernel");
  return UPF_OK;
}

upf_status launch_block_reduce(const sel_plan &p, const sel_dev_plan &dp, const float *token_mass, float *block_score,
                               cudaStream_t stream) {
  sel_block_reduce_kernel<<<grid_for(p.num_blocks, 256), 256, 0, stream>>>(dp, p.B, p.num_blocks, p.G, token_mass,
                                                                           block_score);
  UPF_CUDA_LAUNCH_TRY("sel_block_reduce_kernel");
  return UPF_OK;
}

} // namespace upf_select

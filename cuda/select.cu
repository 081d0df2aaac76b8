/* CUDA selection pipeline of UniPrefill (SPEC.md section 2): the fused select_run and the
 * stage-alone kernels that exist for verification.
 *
 * Why one pass: at T = 128K, Hq = 32, Hkv = 8, D = 128, L = 128, bf16 (perf/NOTES.md "Selection"), one
 * pass of QK^T is 2*L*T*D*Hq = 137 GFLOP (0.17 ms at the cuBLAS bf16 rate) with L*T*Hq = 0.54 G
 * exponentials (0.13-0.14 ms of MUFU), while K is read once in 268 MB (0.06 ms): arithmetic-bound. The
 * two-pass design (softmax normaliser first) doubles both, so the score kernel keeps per row an online
 * max and writes per-segment partial sums that are rescaled after the fact.
 *
 * select_run, fused (no score tensor is materialised):
 *   1. sel_score_kernel<MmaBf16<D,NW,MT,PIPE> | Ffma<T>, MODE>: grid over (key chunk of KC keys, kv
 *      head, row group, scored request). A CTA owns RPC = NW*16*MT of the g*L query rows of its
 *      kv-head group and streams the chunk's K through shared memory in tiles of 64 keys (cp.async
 *      double buffer, 16-byte chunks XOR-swizzled per row, ldmatrix.x4; Q stays in registers as
 *      mma.sync m16n8k16 A fragments, fp32 accumulators). Per query row it keeps an online max and
 *      exp2(dot*scale*log2e - max) (one FFMA + ex2.approx) and writes per (row, segment) the pair
 *      (M = reference max, U = sum of exp2 over the segment); a segment is the part of a selection
 *      block inside one chunk. G < 64 (MODE 0) writes one max per 64-key tile and U per block. It
 *      also writes per (row, chunk) the online-softmax pair (MC, LC). KC is chosen from the batch
 *      shape to fill the device in few waves (plan_fused).
 *      MmaBf16 (bf16, D = 64/128/256, 16-byte aligned rows): 8 warps x 2 m-tiles (256 rows per CTA,
 *      1 CTA/SM; 8 x 1 for D = 256), PIPE = half-tile software pipeline for G >= 64 (the MMAs of the
 *      next 32 keys are issued before the exponentials of the current 32). Ffma<T>: fp32 FFMA (no
 *      TF32) for fp32 inputs, and the bf16 fallback for other D <= 256 or unaligned rows.
 *      Hopper (sm_90a build, G >= 64, bf16 D = 64/128/256; the default there, the fastest measured):
 *      sel_score_wgmma_kernel, section 1b. CTA = 2 consumer warpgroups x 64 query rows (Q in
 *      registers as the wgmma A operand) + 1 producer warp streaming 64-key K tiles by cp.async into
 *      a 4-stage (D = 64: 8) ring in the 128-byte-swizzle layout, full/empty mbarriers; wgmma
 *      m64n64k16 (B = K tile from smem), two accumulator sets per warpgroup: the wgmma of tile t+1
 *      runs while the warpgroup does the exponentials of tile t (epi_big, same (M, U, MC, LC)
 *      outputs and per-thread order, so the same bits run to run). The mma.sync kernel is the
 *      fallback (sm_90 builds, G < 64).
 *   2. sel_row_stats_kernel: per row: m = max MC, l = sum LC*exp2(MC-m) over chunks (fixed order).
 *   3. sel_block_mass_kernel: one CTA per block: b = sum_rows sum_segments U*exp2(M-m)/l, threads
 *      strided over rows, then cub::BlockReduce. Every float reduction in 1-3 has a fixed order:
 *      results are bitwise identical run to run (no float atomics).
 *   4. sel_topp_fused_kernel: one CTA per scored request; keys (float bits of b << IB | block) sorted
 *      descending by cub::BlockRadixSort (ties: larger index first), then BlockReduce for the sum and
 *      BlockScan for the exclusive prefix of pi = b/sum. Requests with more than 4096 blocks go to
 *      the segmented form: cub::DeviceSegmentedSort over all scored requests, then
 *      sel_topp_decide_kernel walks each request's sorted keys 4096 at a time (same arithmetic, so
 *      both forms give the same bits where both apply).
 *   5. Expansion: sel_token_mask_kernel, cub::DeviceScan::ExclusiveSum of the 0/1 mask, scatter of
 *      kept_index, new cu_seqlens and counts; one 16-byte device-to-host read at the end (kept_total
 *      and the non-finite flags).
 * Non-finite inputs: the PIPE and wgmma kernels check their operands (x*0 + chk in bf16x2 over the q
 * fragments once and over each K tile once per kv group: exactly the rows SPEC's check reads); the
 * other kernels check every score. Only when flagged (slow path) sel_nonfinite_scan_kernel names the
 * tensor, token, head and dim, as the CPU reference does.
 *
 * Stage-alone entries (simple, correct on every shape, for verification): sel_part_gemm_kernel
 * (one thread per score, fp32 FMA over D), sel_softmax_rows_kernel + sel_token_mass_kernel,
 * sel_block_reduce_kernel; select_topp and select_expand share the kernels of steps 4 and 5.
 */
#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <string.h>
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
#include "cuda/mma_sync.cuh"
#include "cuda/select.cuh"
#include "cuda/wgmma.cuh"

namespace {

/* ---------------------------------------------------------------------------------------------- */
/* Plan: per-request layout computed on the host from cu_seqlens_host, uploaded once per call.      */

struct sel_req {    /* one scored request */
  int64_t tok0;     /* first token in the packed batch */
  int64_t blk0;     /* first block in the batch's block arrays */
  int64_t sc0;      /* stage-1 score slab offset (upf_select_score_offsets) */
  int64_t u0;       /* U (nseg, Rn) offset */
  int64_t m0;       /* M (nunit, Rn) offset */
  int64_t c0;       /* MC, LC (nchunk, Rn) offset */
  int32_t n;        /* tokens */
  int32_t r;        /* request index */
  int32_t nb;       /* blocks */
  int32_t nseg, nunit, nchunk;
  int32_t cta0;     /* first CTA of this request in the score kernel's grid */
  int32_t pad;
};

struct sel_dev_plan {       /* device pointers into the uploaded plan */
  const sel_req *reqs;      /* (S) */
  const int64_t *blk_off;   /* (B+1) */
  const int32_t *sidx;      /* (B) scored index or -1 */
  const int64_t *seg_begin; /* (S) for the segmented sort */
  const int64_t *seg_end;   /* (S) */
};

struct sel_plan {
  int32_t B = 0, S = 0;
  int64_t T = 0, num_blocks = 0;
  int32_t Hq = 1, Hkv = 1, grp = 1, L = 1, D = 1, G = 1, sink = 0;
  int64_t Rn = 0; /* rows per request: Hq * L */
  int32_t max_nb = 0;
  /* fused geometry */
  int32_t KC = 0, SG = 0, UG = 0, RG = 0, RPC = 0, ctas = 0;
  int64_t u_len = 0, m_len = 0, c_len = 0, score_len = 0;
  std::vector<sel_req> reqs;
  std::vector<int64_t> blk_off;
  std::vector<int32_t> sidx;
  std::vector<int64_t> seg_begin, seg_end;
  size_t blob_bytes = 0;
};

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Layout of the uploaded blob. */
struct blob_offsets {
  size_t reqs, blk_off, sidx, seg_begin, seg_end, total;
};

blob_offsets blob_layout(const sel_plan &p) {
  blob_offsets o;
  size_t at = 0;
  o.reqs = at;
  at = align_up(at + sizeof(sel_req) * (size_t)p.S, 16);
  o.blk_off = at;
  at = align_up(at + sizeof(int64_t) * (size_t)(p.B + 1), 16);
  o.sidx = at;
  at = align_up(at + sizeof(int32_t) * (size_t)p.B, 16);
  o.seg_begin = at;
  at = align_up(at + sizeof(int64_t) * (size_t)p.S, 16);
  o.seg_end = at;
  at = align_up(at + sizeof(int64_t) * (size_t)p.S, 16);
  o.total = at;
  return o;
}

void plan_build(const upf_select_inputs *in, const upf_select_params *params, sel_plan &p) {
  const int32_t *cu = in->cu_seqlens_host;
  p.B = in->num_reqs;
  p.T = cu[p.B];
  p.Hq = (int32_t)in->q.shape[1];
  p.Hkv = in->k.ndim == 3 && in->k.shape[1] > 0 ? (int32_t)in->k.shape[1] : 1;
  p.grp = p.Hq / p.Hkv > 0 ? p.Hq / p.Hkv : 1;
  p.D = (int32_t)in->q.shape[2];
  p.L = params->last_q;
  p.G = params->block;
  p.sink = params->sink;
  p.Rn = (int64_t)p.Hq * p.L;
  p.blk_off.assign((size_t)p.B + 1, 0);
  upf_select_block_offsets(cu, p.B, p.G, p.blk_off.data());
  p.num_blocks = p.blk_off[(size_t)p.B];
  p.sidx.assign((size_t)p.B, -1);
  p.reqs.clear();
  p.seg_begin.clear();
  p.seg_end.clear();
  p.max_nb = 0;
  int64_t sc = 0;
  for (int32_t r = 0; r < p.B; r++) {
    int64_t n = (int64_t)cu[r + 1] - cu[r];
    if (!upf_select_is_scored(n, params))
      continue;
    sel_req q;
    memset(&q, 0, sizeof q);
    q.tok0 = cu[r];
    q.blk0 = p.blk_off[(size_t)r];
    q.sc0 = sc;
    sc += p.Rn * n;
    q.n = (int32_t)n;
    q.r = r;
    q.nb = (int32_t)(p.blk_off[(size_t)r + 1] - p.blk_off[(size_t)r]);
    p.max_nb = std::max(p.max_nb, q.nb);
    p.sidx[(size_t)r] = (int32_t)p.reqs.size();
    p.reqs.push_back(q);
    p.seg_begin.push_back(q.blk0);
    p.seg_end.push_back(q.blk0 + q.nb);
  }
  p.S = (int32_t)p.reqs.size();
  p.score_len = sc;
  p.blob_bytes = blob_layout(p).total;
}

/* Chooses the key chunk and fills the fused-kernel layout. `slots` = CTAs resident on the device. */
void plan_fused(sel_plan &p, int32_t rows_per_cta, int64_t slots) {
  p.RPC = rows_per_cta;
  int64_t group_rows = (int64_t)p.grp * p.L;
  p.RG = (int32_t)((group_rows + rows_per_cta - 1) / rows_per_cta);
  int64_t max_n = 0;
  for (const sel_req &q : p.reqs)
    max_n = std::max<int64_t>(max_n, q.n);
  int32_t best = 1024;
  double best_cost = 0;
  for (int32_t kc = 256; kc <= 8192; kc *= 2) {
    int64_t ctas = 0;
    for (const sel_req &q : p.reqs)
      ctas += (q.n + kc - 1) / kc * (int64_t)p.Hkv * p.RG;
    int64_t waves = (ctas + slots - 1) / slots;
    double cost = (double)waves * (double)(std::min<int64_t>(kc, max_n) + 96);
    if (kc == 256 || cost <= best_cost) {
      best_cost = cost;
      best = kc;
    }
  }
  p.KC = best;
  p.SG = std::min(p.G, p.KC);
  p.UG = std::max(p.SG, 64);
  int64_t u = 0, m = 0, c = 0, cta = 0;
  for (sel_req &q : p.reqs) {
    q.nseg = (int32_t)((q.n + p.SG - 1) / p.SG);
    q.nunit = (int32_t)((q.n + p.UG - 1) / p.UG);
    q.nchunk = (int32_t)((q.n + p.KC - 1) / p.KC);
    q.u0 = u;
    q.m0 = m;
    q.c0 = c;
    q.cta0 = (int32_t)cta;
    u += (int64_t)q.nseg * p.Rn;
    m += (int64_t)q.nunit * p.Rn;
    c += (int64_t)q.nchunk * p.Rn;
    cta += (int64_t)q.nchunk * p.Hkv * p.RG;
  }
  p.u_len = u;
  p.m_len = m;
  p.c_len = c;
  p.ctas = (int32_t)cta;
}

void plan_pack(const sel_plan &p, std::vector<uint8_t> &blob) {
  blob_offsets o = blob_layout(p);
  blob.assign(o.total ? o.total : 16, 0);
  if (p.S)
    memcpy(blob.data() + o.reqs, p.reqs.data(), sizeof(sel_req) * (size_t)p.S);
  memcpy(blob.data() + o.blk_off, p.blk_off.data(), sizeof(int64_t) * (size_t)(p.B + 1));
  memcpy(blob.data() + o.sidx, p.sidx.data(), sizeof(int32_t) * (size_t)p.B);
  if (p.S) {
    memcpy(blob.data() + o.seg_begin, p.seg_begin.data(), sizeof(int64_t) * (size_t)p.S);
    memcpy(blob.data() + o.seg_end, p.seg_end.data(), sizeof(int64_t) * (size_t)p.S);
  }
}

sel_dev_plan plan_device(const sel_plan &p, const uint8_t *dev_blob) {
  blob_offsets o = blob_layout(p);
  sel_dev_plan d;
  d.reqs = (const sel_req *)(dev_blob + o.reqs);
  d.blk_off = (const int64_t *)(dev_blob + o.blk_off);
  d.sidx = (const int32_t *)(dev_blob + o.sidx);
  d.seg_begin = (const int64_t *)(dev_blob + o.seg_begin);
  d.seg_end = (const int64_t *)(dev_blob + o.seg_end);
  return d;
}

/* Bump allocator over the grow-only workspace: first collect sizes, then carve. */
struct ws_carver {
  size_t at = 0;
  size_t take(size_t bytes) {
    size_t o = at;
    at += align_up(bytes ? bytes : 1, 256);
    return o;
  }
};

/* ---------------------------------------------------------------------------------------------- */
/* Device helpers                                                                                   */

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

/* First index i in [0, n) with a[i] > x (n if none). */
template <typename T>
__device__ __forceinline__ int upper_bound_dev(const T *a, int n, int64_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if ((int64_t)a[mid] <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Scored request whose CTA range holds `cta`. */
__device__ __forceinline__ int find_req_by_cta(const sel_req *reqs, int S, int cta) {
  int lo = 0, hi = S;
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (reqs[mid].cta0 <= cta)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/* ---------------------------------------------------------------------------------------------- */
/* 1. Fused score kernel                                                                            */

struct score_args {
  const void *q;  /* (T, Hq, D) bf16 or f32 */
  const void *k;  /* (T, Hkv, D) */
  int64_t qs0, qs1, ks0, ks1; /* token and head strides, elements */
  int32_t Hq, Hkv, grp, L, D, G, SG, UG, KC, RG, RPC, S;
  int64_t Rn;
  float c; /* scale * log2(e) */
  const sel_req *reqs;
  float *M;  /* (m_len) per (unit, row) reference max, log2 units */
  float *U;  /* (u_len) per (segment, row) sum of exp2(s - M) */
  float *MC; /* (c_len) per (chunk, row) online max */
  float *LC; /* (c_len) per (chunk, row) online sum */
  unsigned *bad_req; /* (1) smallest scored index with a non-finite score */
};

constexpr int KT = 64; /* keys per tile */

/* bf16 tensor-core policy: Q rows in registers as A fragments, K tiles in swizzled smem. */
template <int D_, int NW_, int MT_, bool PIPE_>
struct MmaBf16 {
  static constexpr int D = D_;
  static constexpr int MT = MT_;       /* m16 tiles per warp */
  static constexpr int NW = NW_;       /* warps per CTA */
  static constexpr bool PIPE = PIPE_;  /* half-tile software pipeline (G >= 64 only) */
  static constexpr int MINB = 1; /* CTAs per SM in the launch bounds: one, all its registers for the tile */
  static constexpr int THREADS = NW * 32;
  static constexpr int RPC = NW * 16 * MT;
  static constexpr int KBUF = 2;
  static constexpr int KS = D / 16;
  static size_t smem_bytes(int) { return (size_t)KBUF * KT * D * 2; }

  uint32_t a[MT][KS][4];
  /* Fast K-tile issue: this thread copies chunks (kk0 + j*KSTEP, ch0) of every tile. */
  static constexpr int CPR = D / 8;              /* 16-byte chunks per key row */
  static constexpr int KSTEP = THREADS / CPR;    /* key rows between a thread's chunks */
  static constexpr int KJ = KT * CPR / THREADS;  /* chunks per thread per tile */
  const __nv_bfloat16 *kbase;                    /* k + tok0*ks0 + kvh*ks1 + ch0*8 */
  int64_t ks0;
  int kk0, ch0;
  __nv_bfloat162 chk2; /* NaN once a checked q or k value is NaN/Inf */

  __device__ __forceinline__ void init_k(const score_args &x, int64_t tok0, int kvh) {
    kk0 = threadIdx.x / CPR;
    ch0 = threadIdx.x % CPR;
    ks0 = x.ks0;
    kbase = (const __nv_bfloat16 *)x.k + tok0 * x.ks0 + (int64_t)kvh * x.ks1 + ch0 * 8;
    chk2 = __floats2bfloat162_rn(0.f, 0.f);
  }

  __device__ __forceinline__ void issue_fast(uint8_t *smem, int buf, int n, int kb) {
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem + (size_t)buf * KT * D * 2);
    const __nv_bfloat16 *src0 = kbase + (int64_t)(kb + kk0) * ks0;
    const int64_t step = (int64_t)KSTEP * ks0;
#pragma unroll
    for (int j = 0; j < KJ; j++) {
      const int kk = kk0 + j * KSTEP;
      const bool in = kb + kk < n;
      const __nv_bfloat16 *src = in ? src0 + j * step : kbase;
      uint32_t dst = base + kk * D * 2 + ((ch0 ^ (kk & 7)) << 4);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0));
    }
    upf_mma::cp_async_commit();
  }

  /* x*0 + chk is NaN for x = NaN or +-Inf: checks this thread's slice of the tile in buffer buf. */
  __device__ __forceinline__ void check_tile(const uint8_t *smem, int buf) {
    const uint4 *t = (const uint4 *)(smem + (size_t)buf * KT * D * 2);
    const __nv_bfloat162 zero = __floats2bfloat162_rn(0.f, 0.f);
#pragma unroll
    for (int j = 0; j < KJ; j++) {
      uint4 v = t[threadIdx.x + j * THREADS];
      chk2 = __hfma2(*(__nv_bfloat162 *)&v.x, zero, chk2);
      chk2 = __hfma2(*(__nv_bfloat162 *)&v.y, zero, chk2);
      chk2 = __hfma2(*(__nv_bfloat162 *)&v.z, zero, chk2);
      chk2 = __hfma2(*(__nv_bfloat162 *)&v.w, zero, chk2);
    }
  }

  __device__ __forceinline__ void check_q() {
    const __nv_bfloat162 zero = __floats2bfloat162_rn(0.f, 0.f);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          chk2 = __hfma2(*(const __nv_bfloat162 *)&a[mt][ks][e], zero, chk2);
  }

  __device__ __forceinline__ bool bad() const { return __hisnan(chk2.x) || __hisnan(chk2.y); }

  __device__ __forceinline__ void load_q(const score_args &x, uint8_t *smem, const int64_t qrow_off[MT][2],
                                         const bool valid[MT][2]) {
    const int lane = threadIdx.x & 31, tq = lane & 3;
    const __nv_bfloat16 *q = (const __nv_bfloat16 *)x.q;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const uint32_t *ra = (const uint32_t *)(q + qrow_off[mt][0]);
      const uint32_t *rb = (const uint32_t *)(q + qrow_off[mt][1]);
#pragma unroll
      for (int ks = 0; ks < KS; ks++) {
        a[mt][ks][0] = valid[mt][0] ? __ldg(ra + ks * 8 + tq) : 0u;
        a[mt][ks][1] = valid[mt][1] ? __ldg(rb + ks * 8 + tq) : 0u;
        a[mt][ks][2] = valid[mt][0] ? __ldg(ra + ks * 8 + 4 + tq) : 0u;
        a[mt][ks][3] = valid[mt][1] ? __ldg(rb + ks * 8 + 4 + tq) : 0u;
      }
    }
  }

  /* Issues the cp.async copies of 64 keys starting at request key kb into buffer buf. */
  __device__ __forceinline__ void issue_k(const score_args &x, uint8_t *smem, int buf, int64_t tok0, int n, int kvh,
                                          int kb) {
    const __nv_bfloat16 *k = (const __nv_bfloat16 *)x.k;
    uint8_t *base = smem + (size_t)buf * KT * D * 2;
    constexpr int CPR = D / 8; /* 16-byte chunks per key row */
    for (int ci = threadIdx.x; ci < KT * CPR; ci += THREADS) {
      int kk = ci / CPR, ch = ci % CPR;
      int key = kb + kk;
      const __nv_bfloat16 *src = k;
      int bytes = 0;
      if (key < n) {
        src = k + (tok0 + key) * x.ks0 + (int64_t)kvh * x.ks1 + ch * 8;
        bytes = 16;
      }
      uint32_t dst = (uint32_t)__cvta_generic_to_shared(base + kk * D * 2 + ((ch ^ (kk & 7)) << 4));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
    }
    upf_mma::cp_async_commit();
  }

  __device__ __forceinline__ void wait_k() { upf_mma::cp_async_wait<0>(); }

  /* Keys [16 np0, 16 (np0 + NP)) of the tile in buffer buf: 2 NP n8 tiles, acc zeroed first. */
  template <int NP>
  __device__ __forceinline__ void compute_keys(const uint8_t *smem, int buf, int np0, float (&acc)[MT][2 * NP][4]) {
    const int lane = threadIdx.x & 31;
    const uint8_t *base = smem + (size_t)buf * KT * D * 2;
    const int mi = lane >> 3, rr = lane & 7;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < 2 * NP; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          acc[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
#pragma unroll
      for (int np = 0; np < NP; np++) {
        int kk = (np0 + np) * 16 + rr + ((mi & 2) ? 8 : 0);
        int ch = ks * 2 + (mi & 1);
        uint32_t b0, b1, b2, b3;
        upf_mma::ldsm_x4(b0, b1, b2, b3, (const __nv_bfloat16 *)(base + kk * D * 2 + ((ch ^ rr) << 4)));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma(acc[mt][2 * np], a[mt][ks], b0, b1);
          mma(acc[mt][2 * np + 1], a[mt][ks], b2, b3);
        }
      }
    }
  }

  /* The whole tile: 64 keys, eight n8 tiles. */
  __device__ __forceinline__ void compute(const uint8_t *smem, int buf, float (&acc)[MT][8][4]) {
    compute_keys<4>(smem, buf, 0, acc);
  }

  /* Keys [32*half, 32*half + 32) of the tile in buffer buf: four n8 tiles. */
  __device__ __forceinline__ void compute_half(const uint8_t *smem, int buf, int half, float (&acc)[MT][4][4]) {
    compute_keys<2>(smem, buf, 2 * half, acc);
  }

  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    upf_mma::mma_bf16(d, a[0], a[1], a[2], a[3], b0, b1);
  }
};

/* FFMA policy (fp32 inputs, and bf16 where the tensor-core policy does not apply): Q rows (d-major)
 * and one K tile (d-major) in smem as fp32; each thread computes the same (row, key) positions as an
 * mma.sync C fragment, so the epilogue is shared. Any D <= 256. */
template <typename T>
struct Ffma {
  static constexpr bool PIPE = false;
  static constexpr int MINB = 1;
  static constexpr int MT = 2;
  static constexpr int NW = 4;
  static constexpr int THREADS = NW * 32;
  static constexpr int RPC = NW * 16 * MT; /* 128 */
  static constexpr int KBUF = 1;
  static constexpr int QLD = RPC + 1; /* padded: transposed stores spread over banks */
  static constexpr int KLD = KT + 2;  /* even: float2 loads stay aligned */
  /* The K tile starts 16-byte aligned whatever D is (odd D once made its float2 loads misaligned). */
  static __host__ __device__ size_t q_floats(int D) { return ((size_t)D * QLD + 3) & ~(size_t)3; }
  static size_t smem_bytes(int D) { return (q_floats(D) + (size_t)D * KLD) * sizeof(float); }

  int D;

  __device__ __forceinline__ void load_q(const score_args &x, uint8_t *smem, int rg, int kvh, int64_t tok0, int n) {
    D = x.D;
    float *qs = (float *)smem;
    const T *q = (const T *)x.q;
    const int group_rows = x.grp * x.L;
    for (int e = threadIdx.x; e < RPC * D; e += THREADS) {
      int row = e / D, d = e % D;
      int r_loc = rg * RPC + row;
      float v = 0.f;
      if (r_loc < group_rows) {
        int hh = r_loc / x.L, i = r_loc % x.L;
        int64_t tok = tok0 + n - x.L + i;
        v = to_float(q[tok * x.qs0 + (int64_t)(kvh * x.grp + hh) * x.qs1 + d]);
      }
      qs[d * QLD + row] = v;
    }
  }

  __device__ __forceinline__ void issue_k(const score_args &x, uint8_t *smem, int, int64_t tok0, int n, int kvh,
                                          int kb) {
    float *ks = (float *)smem + q_floats(D);
    const T *k = (const T *)x.k;
    for (int e = threadIdx.x; e < KT * D; e += THREADS) {
      int kk = e / D, d = e % D;
      int key = kb + kk;
      float v = 0.f;
      if (key < n)
        v = to_float(k[(tok0 + key) * x.ks0 + (int64_t)kvh * x.ks1 + d]);
      ks[d * KLD + kk] = v;
    }
  }

  __device__ __forceinline__ void wait_k() {}

  __device__ __forceinline__ void compute(const uint8_t *smem, int, float (&acc)[MT][8][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const float *qs = (const float *)smem;
    const float *ks = (const float *)smem + q_floats(D);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          acc[mt][nt][e] = 0.f;
    const int row0 = warp * 32 + gq;
#pragma unroll 2
    for (int d = 0; d < D; d++) {
      float qv[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        qv[mt][0] = qs[d * QLD + row0 + mt * 16];
        qv[mt][1] = qs[d * QLD + row0 + mt * 16 + 8];
      }
#pragma unroll
      for (int nt = 0; nt < 8; nt++) {
        float2 kv = *(const float2 *)(ks + d * KLD + nt * 8 + 2 * tq);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          acc[mt][nt][0] = fmaf(qv[mt][0], kv.x, acc[mt][nt][0]);
          acc[mt][nt][1] = fmaf(qv[mt][0], kv.y, acc[mt][nt][1]);
          acc[mt][nt][2] = fmaf(qv[mt][1], kv.x, acc[mt][nt][2]);
          acc[mt][nt][3] = fmaf(qv[mt][1], kv.y, acc[mt][nt][3]);
        }
      }
    }
  }
};

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

/* Merges (m, s) into the running (mc, lc) of online softmax, in log2 units. */
__device__ __forceinline__ void merge_stats(float &mc, float &lc, float m, float s) {
  float mn = fmaxf(mc, m);
  if (mn != -INFINITY) {
    lc = lc * ex2(mc - mn) + s * ex2(m - mn);
    mc = mn;
  }
}

/* Per-thread state of the G >= 64 epilogue: 2*MT rows. */
template <int MT>
struct big_state {
  float mrun[2 * MT], usum[2 * MT], mc[2 * MT], lc[2 * MT];
};

/* G >= 64 epilogue of one piece of NTL n8 tiles (keys kb ..): finite check, causal mask, piece max,
 * online update of the segment sum; at a segment end writes (M, U) and folds it into (MC, LC). */
template <int MT, int NTL>
__device__ __forceinline__ void epi_big(float (&acc)[MT][NTL][4], int kb, bool need_mask, bool seg_end,
                                        const int (&lim)[MT][2], const bool (&valid)[MT][2],
                                        const int64_t (&R)[MT][2], big_state<MT> &st, const score_args &x,
                                        const sel_req &rq, int tq) {
  const float c = x.c;
  if (need_mask) { /* only the tiles that reach the last L keys or the request's end */
    const int key0 = kb + 2 * tq;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < NTL; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (key0 + nt * 8 + (e & 1) > lim[mt][e >> 1])
            acc[mt][nt][e] = -INFINITY;
  }
  float mx[2 * MT];
#pragma unroll
  for (int j = 0; j < 2 * MT; j++)
    mx[j] = -INFINITY;
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int nt = 0; nt < NTL; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        mx[mt * 2 + (e >> 1)] = fmaxf(mx[mt * 2 + (e >> 1)], acc[mt][nt][e]);
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) {
    mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 1));
    mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 2));
    mx[j] *= c;
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int j = mt * 2 + h;
      float mnew = fmaxf(st.mrun[j], mx[j]);
      float ref = mnew == -INFINITY ? 0.f : mnew;
      float alpha = ex2(st.mrun[j] - ref);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NTL; nt++) {
        sum += ex2(fmaf(acc[mt][nt][2 * h], c, -ref));
        sum += ex2(fmaf(acc[mt][nt][2 * h + 1], c, -ref));
      }
      st.usum[j] = st.usum[j] * alpha + sum;
      st.mrun[j] = mnew;
    }
  if (seg_end) {
    /* rows of this thread are R[0][0] + 16*mt + 8*h: one base pointer, immediate offsets */
    const int64_t at = (int64_t)(kb / x.SG) * x.Rn + R[0][0];
    float *Mp = x.M + rq.m0 + at, *Up = x.U + rq.u0 + at;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int j = mt * 2 + h;
        float uq = quad_sum(st.usum[j]);
        if (tq == 0 && valid[mt][h]) {
          Mp[mt * 16 + 8 * h] = st.mrun[j];
          Up[mt * 16 + 8 * h] = uq;
        }
        merge_stats(st.mc[j], st.lc[j], st.mrun[j], uq);
        st.mrun[j] = -INFINITY;
        st.usum[j] = 0.f;
      }
  }
}

/* MODE 0: G < 64 (several blocks per tile, one reference max per tile). MODE 1: G >= 64. */
template <class P, int MODE>
__global__ void __launch_bounds__(P::THREADS, P::MINB) sel_score_kernel(const score_args x) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int MT = P::MT, NR = 2 * MT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;

  const int s = find_req_by_cta(x.reqs, x.S, (int)blockIdx.x);
  const sel_req rq = x.reqs[s];
  int local = (int)blockIdx.x - rq.cta0;
  const int rg = local % x.RG;
  local /= x.RG;
  const int kvh = local % x.Hkv;
  const int chunk = local / x.Hkv;
  const int n = rq.n;
  const int k0 = chunk * x.KC;
  const int k1 = min(n, k0 + x.KC);
  const int ntile = (k1 - k0 + KT - 1) / KT;
  const int group_rows = x.grp * x.L;

  /* This thread's rows: (mt, half) -> row gq + 8*half of m-tile mt of this warp. */
  int64_t R[MT][2];
  int lim[MT][2];
  bool valid[MT][2];
  int64_t qrow_off[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int r_loc = rg * P::RPC + warp * 16 * MT + mt * 16 + gq + 8 * h;
      valid[mt][h] = r_loc < group_rows;
      int rl = valid[mt][h] ? r_loc : 0;
      int hh = rl / x.L, i = rl % x.L;
      R[mt][h] = (int64_t)kvh * group_rows + rl;
      lim[mt][h] = valid[mt][h] ? n - x.L + i : -1;
      qrow_off[mt][h] = (rq.tok0 + n - x.L + i) * x.qs0 + (int64_t)(kvh * x.grp + hh) * x.qs1;
    }

  P pol;
  if constexpr (P::PIPE && MODE == 1) {
    /* Half-tile software pipeline: the MMAs of the next 32 keys are issued before the epilogue of
     * the current 32, so the tensor pipe works while the warp does the exponentials. Non-finite
     * inputs are caught on the operands (q fragments once, each K tile once per kv group) rather
     * than on every score. */
    pol.init_k(x, rq.tok0, kvh);
    pol.issue_fast(smem, 0, n, k0);
    if (ntile > 1)
      pol.issue_fast(smem, 1, n, k0 + KT);
    pol.load_q(x, smem, qrow_off, valid);
    pol.check_q();
    if (ntile > 1)
      upf_mma::cp_async_wait<1>();
    else
      upf_mma::cp_async_wait<0>();
    __syncthreads();
    const bool check_k = rg == 0; /* the other row groups read the same K tiles */
    if (check_k)
      pol.check_tile(smem, 0);
    big_state<MT> st;
#pragma unroll
    for (int j = 0; j < NR; j++) {
      st.mrun[j] = -INFINITY;
      st.usum[j] = 0.f;
      st.mc[j] = -INFINITY;
      st.lc[j] = 0.f;
    }
    float acc0[MT][4][4], acc1[MT][4][4];
    pol.compute_half(smem, 0, 0, acc0);
    for (int t = 0; t < ntile; t++) {
      const int kb = k0 + t * KT;
      pol.compute_half(smem, t & 1, 1, acc1);
      epi_big<MT, 4>(acc0, kb, kb + 31 > n - x.L, (kb + 32) % x.SG == 0, lim, valid, R, st, x, rq, tq);
      upf_mma::cp_async_wait<0>();
      __syncthreads();
      if (t + 2 < ntile)
        pol.issue_fast(smem, t & 1, n, kb + 2 * KT);
      if (t + 1 < ntile) {
        if (check_k)
          pol.check_tile(smem, (t + 1) & 1);
        pol.compute_half(smem, (t + 1) & 1, 0, acc0);
      }
      epi_big<MT, 4>(acc1, kb + 32, kb + 63 > n - x.L, (kb + 64) % x.SG == 0 || t == ntile - 1, lim, valid, R,
                     st, x, rq, tq);
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int h = 0; h < 2; h++)
        if (tq == 0 && valid[mt][h]) {
          x.MC[rq.c0 + (int64_t)chunk * x.Rn + R[mt][h]] = st.mc[mt * 2 + h];
          x.LC[rq.c0 + (int64_t)chunk * x.Rn + R[mt][h]] = st.lc[mt * 2 + h];
        }
    if (pol.bad())
      atomicMin(x.bad_req, (unsigned)s);
    return;
  }
  if constexpr (P::KBUF == 2) {
    pol.issue_k(x, smem, 0, rq.tok0, n, kvh, k0);
    pol.load_q(x, smem, qrow_off, valid);
  } else {
    pol.load_q(x, smem, rg, kvh, rq.tok0, n);
  }

  float mrun[NR], usum[NR], mc[NR], lc[NR];
#pragma unroll
  for (int j = 0; j < NR; j++) {
    mrun[j] = -INFINITY;
    usum[j] = 0.f;
    mc[j] = -INFINITY;
    lc[j] = 0.f;
  }
  float chk = 0.f;
  const float c = x.c;

  for (int t = 0; t < ntile; t++) {
    const int kb = k0 + t * KT;
    if constexpr (P::KBUF == 2) {
      pol.wait_k();
      __syncthreads();
      if (t + 1 < ntile)
        pol.issue_k(x, smem, (t + 1) & 1, rq.tok0, n, kvh, kb + KT);
    } else {
      __syncthreads();
      pol.issue_k(x, smem, 0, rq.tok0, n, kvh, kb);
      __syncthreads();
    }
    float acc[MT][8][4];
    pol.compute(smem, t & 1, acc);

    /* finite check, causal mask (a uniform branch: only tiles that reach the last L keys or the
     * request's end), row max */
    if (kb + KT - 1 > n - x.L) {
      const int key0 = kb + 2 * tq;
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            chk = fmaf(acc[mt][nt][e], 0.f, chk);
            if (key0 + nt * 8 + (e & 1) > lim[mt][e >> 1])
              acc[mt][nt][e] = -INFINITY;
          }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++)
            chk = fmaf(acc[mt][nt][e], 0.f, chk);
    }
    float mx[NR];
#pragma unroll
    for (int j = 0; j < NR; j++)
      mx[j] = -INFINITY;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          mx[mt * 2 + (e >> 1)] = fmaxf(mx[mt * 2 + (e >> 1)], acc[mt][nt][e]);
    /* c > 0, so the max of the raw dots times c is the max of the scaled scores; the exponent is
     * then one FFMA, exp2(fma(dot, c, -max)). */
#pragma unroll
    for (int j = 0; j < NR; j++) {
      mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 1));
      mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 2));
      mx[j] *= c;
    }

    if constexpr (MODE == 1) {
      /* G >= 64: online max across the tiles of a segment. */
      const bool seg_end = ((kb + KT) % x.SG == 0) || (t == ntile - 1);
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int j = mt * 2 + h;
          float mnew = fmaxf(mrun[j], mx[j]);
          float ref = mnew == -INFINITY ? 0.f : mnew;
          float alpha = ex2(mrun[j] - ref);
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < 8; nt++) {
            sum += ex2(fmaf(acc[mt][nt][2 * h], c, -ref));
            sum += ex2(fmaf(acc[mt][nt][2 * h + 1], c, -ref));
          }
          usum[j] = usum[j] * alpha + sum;
          mrun[j] = mnew;
        }
      if (seg_end) {
        const int64_t seg = kb / x.SG;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const int j = mt * 2 + h;
            float uq = quad_sum(usum[j]);
            if (tq == 0 && valid[mt][h]) {
              x.M[rq.m0 + seg * x.Rn + R[mt][h]] = mrun[j];
              x.U[rq.u0 + seg * x.Rn + R[mt][h]] = uq;
            }
            merge_stats(mc[j], lc[j], mrun[j], uq);
            mrun[j] = -INFINITY;
            usum[j] = 0.f;
          }
      }
    } else {
      /* G < 64: one reference max per tile; U per block of G keys. */
      const int64_t unit = kb / KT;
      const int G = x.G;
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int j = mt * 2 + h;
          float ref = mx[j] == -INFINITY ? 0.f : mx[j];
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < 8; nt++) {
            acc[mt][nt][2 * h] = ex2(fmaf(acc[mt][nt][2 * h], c, -ref));
            acc[mt][nt][2 * h + 1] = ex2(fmaf(acc[mt][nt][2 * h + 1], c, -ref));
            sum += acc[mt][nt][2 * h];
            sum += acc[mt][nt][2 * h + 1];
          }
          float tot = quad_sum(sum);
          if (tq == 0 && valid[mt][h])
            x.M[rq.m0 + unit * x.Rn + R[mt][h]] = mx[j];
          merge_stats(mc[j], lc[j], mx[j], tot);

          float *Urow = x.U + rq.u0 + R[mt][h];
          const bool ok = valid[mt][h];
          if (G >= 8) {
            const int tiles_per_seg = G / 8;
            for (int sg = 0; sg < KT / G; sg++) {
              float part = 0.f;
#pragma unroll
              for (int nt = 0; nt < 8; nt++)
                if (nt / tiles_per_seg == sg)
                  part += acc[mt][nt][2 * h] + acc[mt][nt][2 * h + 1];
              part = quad_sum(part);
              int key0 = kb + sg * G;
              if (tq == 0 && ok && key0 < n)
                Urow[(int64_t)(key0 / G) * x.Rn] = part;
            }
          } else if (G == 4) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
              float part = acc[mt][nt][2 * h] + acc[mt][nt][2 * h + 1];
              part += __shfl_xor_sync(0xffffffffu, part, 1);
              int key0 = kb + nt * 8 + 2 * tq;
              if ((tq & 1) == 0 && ok && key0 < n)
                Urow[(int64_t)(key0 / 4) * x.Rn] = part;
            }
          } else if (G == 2) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
              int key0 = kb + nt * 8 + 2 * tq;
              if (ok && key0 < n)
                Urow[(int64_t)(key0 / 2) * x.Rn] = acc[mt][nt][2 * h] + acc[mt][nt][2 * h + 1];
            }
          } else {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
              for (int e = 0; e < 2; e++) {
                int key0 = kb + nt * 8 + 2 * tq + e;
                if (ok && key0 < n)
                  Urow[(int64_t)key0 * x.Rn] = acc[mt][nt][2 * h + e];
              }
          }
        }
    }
  }

#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++)
      if (tq == 0 && valid[mt][h]) {
        x.MC[rq.c0 + (int64_t)chunk * x.Rn + R[mt][h]] = mc[mt * 2 + h];
        x.LC[rq.c0 + (int64_t)chunk * x.Rn + R[mt][h]] = lc[mt * 2 + h];
      }
  if (chk != chk)
    atomicMin(x.bad_req, (unsigned)s);
}

/* ---------------------------------------------------------------------------------------------- */
/* 1b. Hopper score kernel (sm_90a): wgmma, producer warp, mbarrier pipeline (MODE 1, G >= 64).     */
/*                                                                                                  */
/* CTA = NCW consumer warpgroups (64 query rows each, Q in registers as the wgmma A operand) and */
/* one producer warp that streams the chunk's K tiles (64 keys) into a WG_NS-stage ring with         */
/* cp.async (16-byte chunks, written in the 128-byte-swizzle K-major layout wgmma reads: D/64 atoms */
/* of 64 rows x 128 bytes) and signals `full[s]` with cp.async.mbarrier.arrive.noinc; consumers     */
/* release a stage on `empty[s]` once the wgmma that read it has completed. Each consumer WG keeps  */
/* two accumulator sets: it issues the wgmma of tile t+1 (async) and then runs the epilogue of tile */
/* t (epi_big, the same (M, U, MC, LC) arithmetic as the mma.sync kernel) while the tensor cores    */
/* work. Every reduction is per thread or per quad in a fixed order: deterministic.                 */

template <int D_>
struct WgCfg {
  static constexpr int D = D_;
  static constexpr int NCW = 2;                     /* consumer warpgroups */
  static constexpr int KS = D / 16;                 /* k16 steps */
  static constexpr int NS = D == 64 ? 8 : 4; /* ring stages */
  static constexpr int STAGE = KT * D * 2;          /* bytes per stage */
  static constexpr int THREADS = NCW * 128 + 32; /* + producer warp */
  static constexpr int RPC = NCW * 64;
  static size_t smem_bytes() { return 1024 + (size_t)NS * STAGE + 2 * NS * 8; }
};

template <int D>
__global__ void __launch_bounds__(WgCfg<D>::THREADS, 1) sel_score_wgmma_kernel(const score_args x) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace upf_wgmma;
  using C = WgCfg<D>;
  constexpr int NS = C::NS, KS = C::KS, STAGE = C::STAGE, NCW = C::NCW;
  extern __shared__ __align__(16) uint8_t smem[];
  const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t sbase = (sraw + 1023u) & ~1023u; /* swizzle atoms need 1024-byte alignment */
  const uint32_t full = sbase + NS * STAGE, empty = full + NS * 8;
  const uint8_t *tiles = smem + (sbase - sraw);

  const int s = find_req_by_cta(x.reqs, x.S, (int)blockIdx.x);
  const sel_req rq = x.reqs[s];
  int local = (int)blockIdx.x - rq.cta0;
  const int rg = local % x.RG;
  local /= x.RG;
  const int kvh = local % x.Hkv;
  const int chunk = local / x.Hkv;
  /* Broadcasts make the loop bounds and role provably warp-uniform for ptxas (otherwise it
   * serialises the wgmma: C7518). */
  const int n = __shfl_sync(0xffffffffu, rq.n, 0);
  const int k0 = chunk * x.KC;
  const int k1 = min(n, k0 + x.KC);
  const int ntile = __shfl_sync(0xffffffffu, (k1 - k0 + KT - 1) / KT, 0);
  const int warp = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < NS; i++) {
      mbar_init(full + 8 * i, 32);
      mbar_init(empty + 8 * i, NCW * 4);
    }
  }
  __syncthreads();

  if (warp == NCW * 4) {
    /* Producer: lane copies 16-byte chunk c of rows r0, r0 + RPI, ... of every tile. */
    constexpr int CPR = D / 8, RPI = 32 / CPR, J = KT / RPI;
    const int c = lane % CPR, r0 = lane / CPR, cc = c & 7;
    const __nv_bfloat16 *kb0 =
        (const __nv_bfloat16 *)x.k + rq.tok0 * x.ks0 + (int64_t)kvh * x.ks1 + c * 8;
    const uint32_t coff = (uint32_t)(c >> 3) * (KT * 128);
    for (int t = 0; t < ntile; t++) {
      const int st = t % NS;
      if (t >= NS)
        mbar_wait(empty + 8 * st, (uint32_t)((t / NS - 1) & 1));
      const int kb = k0 + t * KT;
      const uint32_t dst0 = sbase + st * STAGE + coff;
#pragma unroll
      for (int j = 0; j < J; j++) {
        const int kk = r0 + j * RPI, key = kb + kk;
        const bool in = key < n;
        const __nv_bfloat16 *src = in ? kb0 + (int64_t)key * x.ks0 : kb0;
        cp_async16_to(dst0 + kk * 128 + ((cc ^ (kk & 7)) << 4), src, in);
      }
      cp_async_mbar_arrive(full + 8 * st);
    }
    cp_async_wait_all();
    return;
  }

  /* Consumers: warpgroup wg, warp w4 of it; this thread's rows gq and gq + 8 of the warp's 16. */
  const int wg = warp >> 2, w4 = warp & 3, gq = lane >> 2, tq = lane & 3;
  const int group_rows = x.grp * x.L;
  int64_t R[1][2];
  int lim[1][2];
  bool valid[1][2];
  uint32_t a[KS][4];
  {
    const __nv_bfloat16 *q = (const __nv_bfloat16 *)x.q;
    const uint32_t *rp[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int r_loc = rg * C::RPC + wg * 64 + w4 * 16 + gq + 8 * h;
      valid[0][h] = r_loc < group_rows;
      int rl = valid[0][h] ? r_loc : 0;
      int hh = rl / x.L, i = rl % x.L;
      R[0][h] = (int64_t)kvh * group_rows + rl;
      lim[0][h] = valid[0][h] ? n - x.L + i : -1;
      rp[h] = (const uint32_t *)(q + (rq.tok0 + n - x.L + i) * x.qs0 + (int64_t)(kvh * x.grp + hh) * x.qs1);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      a[ks][0] = valid[0][0] ? __ldg(rp[0] + ks * 8 + tq) : 0u;
      a[ks][1] = valid[0][1] ? __ldg(rp[1] + ks * 8 + tq) : 0u;
      a[ks][2] = valid[0][0] ? __ldg(rp[0] + ks * 8 + 4 + tq) : 0u;
      a[ks][3] = valid[0][1] ? __ldg(rp[1] + ks * 8 + 4 + tq) : 0u;
    }
  }
  /* Non-finite inputs: x*0 + chk turns NaN on NaN/Inf operands (q fragments; K tiles in row group 0,
   * which reads the same tiles as the others). */
  const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.f, 0.f);
  __nv_bfloat162 chk2 = zero2;
#pragma unroll
  for (int ks = 0; ks < KS; ks++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      chk2 = __hfma2(*(const __nv_bfloat162 *)&a[ks][e], zero2, chk2);
  const bool check_k = rg == 0;

  big_state<1> st;
#pragma unroll
  for (int j = 0; j < 2; j++) {
    st.mrun[j] = -INFINITY;
    st.usum[j] = 0.f;
    st.mc[j] = -INFINITY;
    st.lc[j] = 0.f;
  }

  /* Tile t has landed (full barrier) and its generic-proxy (cp.async) writes are ordered before the
   * async-proxy reads of the wgmma that follow. */
  auto ready = [&](int t) {
    mbar_wait(full + 8 * (t % NS), (uint32_t)((t / NS) & 1));
    fence_proxy_async();
  };
  auto issue = [&](float (&acc)[8][4], int t) {
    wg_fence();
    const uint32_t base = sbase + (t % NS) * STAGE;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      wgmma_m64n64k16(acc, a[ks], desc_kmajor_sw128(base + (ks >> 2) * (KT * 128) + (ks & 3) * 32), ks);
    }
    wg_commit();
  };
  /* After the wgmma wait of tile t: the fence for tile t+2 (the tile the next issue reads), here rather
   * than before each issue, so that the proxy fence does not directly follow the epilogue's global
   * stores. */
  auto mid = [&](int t) {
    if (t + 2 < ntile)
      ready(t + 2);
  };
  /* Epilogue of tile t, whose wgmma has completed: K check, stage release, then epi_big on a copy of
   * the accumulators (no non-wgmma instruction may define accumulator registers while a wgmma is in
   * flight, or ptxas serialises them: C7515). */
  auto epi = [&](const float (&cur)[1][8][4], int t) {
    const int stg = t % NS;
    if (check_k) {
      const uint4 *tv = (const uint4 *)(tiles + stg * STAGE);
#pragma unroll
      for (int j = 0; j < STAGE / 16 / (NCW * 128); j++) {
        uint4 v = tv[threadIdx.x + j * NCW * 128];
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.x, zero2, chk2);
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.y, zero2, chk2);
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.z, zero2, chk2);
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.w, zero2, chk2);
      }
    }
    __syncwarp();
    if (lane == 0)
      mbar_arrive(empty + 8 * stg);
    float sv[1][8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        sv[0][j][e] = cur[0][j][e];
    const int kb = k0 + t * KT;
    epi_big<1, 8>(sv, kb, kb + KT - 1 > n - x.L, (kb + KT) % x.SG == 0 || t == ntile - 1, lim, valid, R, st, x,
                  rq, tq);
  };

  /* Steady state without branches around the wgmma (ptxas tracks the in-flight groups through it):
   * issue tile t+1, wait for tile t, epilogue of tile t. ntile >= 1: a chunk holds at least one key. */
  float accA[1][8][4], accB[1][8][4];
  ready(0);
  if (ntile > 1)
    ready(1);
  issue(accA[0], 0);
  int t = 0;
  for (; t + 2 < ntile; t += 2) {
    issue(accB[0], t + 1);
    wg_wait<1>();
    mid(t);
    epi(accA, t);
    issue(accA[0], t + 2);
    wg_wait<1>();
    mid(t + 1);
    epi(accB, t + 1);
  }
  if (t + 1 < ntile) {
    issue(accB[0], t + 1);
    wg_wait<1>();
    mid(t);
    epi(accA, t);
    wg_wait<0>();
    mid(t + 1);
    epi(accB, t + 1);
  } else {
    wg_wait<0>();
    mid(t);
    epi(accA, t);
  }
#pragma unroll
  for (int h = 0; h < 2; h++)
    if (tq == 0 && valid[0][h]) {
      x.MC[rq.c0 + (int64_t)chunk * x.Rn + R[0][h]] = st.mc[h];
      x.LC[rq.c0 + (int64_t)chunk * x.Rn + R[0][h]] = st.lc[h];
    }
  if (__hisnan(chk2.x) || __hisnan(chk2.y))
    atomicMin(x.bad_req, (unsigned)s);
#else
  __trap(); /* built without sm_90a: the host never launches this */
#endif
}

/* Writes 1 when this binary's device code was built for sm_90a (wgmma available). */
__global__ void sel_wgmma_probe_kernel(int *out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

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

constexpr int TP_THREADS = 256, TP_ITEMS = 16, TP_CHUNK = TP_THREADS * TP_ITEMS;

using tp_sort = cub::BlockRadixSort<unsigned long long, TP_THREADS, TP_ITEMS>;
using tp_reduce = cub::BlockReduce<float, TP_THREADS>;
using tp_scan = cub::BlockScan<float, TP_THREADS>;

union tp_temp {
  typename tp_sort::TempStorage sort;
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
__device__ __forceinline__ float chunk_sum(tp_temp &tmp, const unsigned long long (&keys)[TP_ITEMS], int64_t rank0,
                                           int64_t nb, int ib) {
  float part = 0.f;
#pragma unroll
  for (int i = 0; i < TP_ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * TP_ITEMS + i;
    if (rank < nb)
      part += key_score(keys[i], ib);
  }
  float sum = tp_reduce(tmp.reduce).Sum(part);
  __syncthreads();
  return sum;
}

/* Decisions for one chunk of sorted keys; carry = exclusive prefix of pi before this chunk. */
__device__ __forceinline__ void chunk_decide(tp_temp &tmp, const topp_args &a, const unsigned long long (&keys)[TP_ITEMS],
                                             int64_t rank0, int64_t nb, int64_t blk0, float total, float &carry) {
  float pi[TP_ITEMS], excl[TP_ITEMS];
#pragma unroll
  for (int i = 0; i < TP_ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * TP_ITEMS + i;
    pi[i] = (rank < nb && total > 0.f) ? key_score(keys[i], a.ib) / total : 0.f;
  }
  float aggregate;
  tp_scan(tmp.scan).ExclusiveSum(pi, excl, aggregate);
  __syncthreads();
  const int64_t topk = a.keep_ratio > 0.f ? (int64_t)ceil((double)a.keep_ratio * (double)nb) : a.topk;
#pragma unroll
  for (int i = 0; i < TP_ITEMS; i++) {
    int64_t rank = rank0 + threadIdx.x * TP_ITEMS + i;
    if (rank < nb) {
      float before = carry + excl[i];
      bool keep = topk > 0 ? rank < topk : (rank == 0 || before <= a.p);
      unsigned cl = (unsigned)(keys[i] & ((1ull << a.ib) - 1));
      a.block_mask[blk0 + cl] = keep ? 1 : 0;
    }
  }
  carry = carry + aggregate;
}

/* One CTA per scored request with nb <= TP_CHUNK: sort in shared memory, then decide. */
__global__ void __launch_bounds__(TP_THREADS) sel_topp_fused_kernel(const sel_req *__restrict__ reqs, topp_args a) {
  __shared__ tp_temp tmp;
  __shared__ float s_total;
  const sel_req rq = reqs[blockIdx.x];
  const int nb = rq.nb;
  unsigned long long keys[TP_ITEMS];
#pragma unroll
  for (int i = 0; i < TP_ITEMS; i++) {
    int cl = threadIdx.x * TP_ITEMS + i;
    keys[i] = cl < nb ? make_key(a, rq.r, rq.blk0, cl) : 0ull;
  }
  tp_sort(tmp.sort).SortDescending(keys, 0, 32 + a.ib);
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
  __shared__ tp_temp tmp;
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

/* ---------------------------------------------------------------------------------------------- */
/* Host side                                                                                        */

upf_status check_head_dim(const upf_select_inputs *in, const char *op) {
  int64_t D = in->q.shape[2];
  if (D > 256)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): head dim D=%lld is not supported (D <= 256)", op, (long long)D);
  return UPF_OK;
}

/* The checks the CPU backend's stage entries make when they read only the layout. */
upf_status check_layout(const upf_select_inputs *in, const upf_select_params *params) {
  UPF_TRY(upf_select_params_check(params));
  if (in->q.ndim != 3)
    return upf_fail(UPF_ERR_SHAPE, "q: the descriptor must give (T, Hq, D) even when only the layout is used");
  if (!in->cu_seqlens_host)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: host copy missing");
  return upf_cu_seqlens_check(in->cu_seqlens_host, in->num_reqs, in->q.shape[0]);
}

unsigned grid_for(int64_t items, int per_cta) { return (unsigned)((items + per_cta - 1) / per_cta); }

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

struct kernel_cfg {
  const void *fn;
  int threads;
  size_t smem;
  int rows_per_cta;
};

template <class P, int MODE>
upf_status prepare_score_kernel(kernel_cfg &cfg, int D) {
  cfg.fn = (const void *)sel_score_kernel<P, MODE>;
  cfg.threads = P::THREADS;
  cfg.smem = P::smem_bytes(D);
  cfg.rows_per_cta = P::RPC;
  if (cfg.smem > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "select (cuda): the score kernel needs %zu bytes of shared memory, the "
                    "device allows %zu", cfg.smem, upf_cuda_smem_optin());
  UPF_CUDA_TRY(cudaFuncSetAttribute(sel_score_kernel<P, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)cfg.smem));
  return UPF_OK;
}

template <int D>
upf_status prepare_wgmma(kernel_cfg &cfg) {
  cfg.fn = (const void *)sel_score_wgmma_kernel<D>;
  cfg.threads = WgCfg<D>::THREADS;
  cfg.smem = WgCfg<D>::smem_bytes();
  cfg.rows_per_cta = WgCfg<D>::RPC;
  if (cfg.smem > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "select (cuda): the wgmma score kernel needs %zu bytes of shared memory, "
                    "the device allows %zu", cfg.smem, upf_cuda_smem_optin());
  UPF_CUDA_TRY(cudaFuncSetAttribute(sel_score_wgmma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)cfg.smem));
  return UPF_OK;
}

/* Whether the wgmma kernel can run: a compute-capability 9.0 device and device code built for
 * sm_90a (asked once of the device through a probe kernel). */
int g_wgmma_ok = -1;

upf_status wgmma_available(bool *ok) {
  if (g_wgmma_ok < 0) {
    int dev = 0, major = 0, minor = 0;
    UPF_CUDA_TRY(cudaGetDevice(&dev));
    UPF_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    UPF_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    int v = 0;
    if (major == 9 && minor == 0) {
      void *ws;
      UPF_TRY(upf_cuda_workspace(256, &ws));
      sel_wgmma_probe_kernel<<<1, 1, 0, upf_cuda_stream()>>>((int *)ws);
      UPF_CUDA_LAUNCH_TRY("sel_wgmma_probe_kernel");
      UPF_TRY(upf_cuda_download_small(&v, ws, sizeof v));
    }
    g_wgmma_ok = v == 1 ? 1 : 0;
  }
  *ok = g_wgmma_ok == 1;
  return UPF_OK;
}

/* The score kernel: for bf16 rows that mma_applies to, the wgmma kernel where G >= 64 on an sm_90a
 * build and device (the fastest measured), else the mma.sync kernel (8 warps x 2 m-tiles, 8 x 1 at
 * D = 256, whose A fragments take 64 registers an m-tile; the half-tile pipeline where G >= 64); the
 * FFMA kernel for everything else. */
template <int MODE>
upf_status pick_score_kernel(const upf_select_inputs *in, int D, bool use_mma, kernel_cfg &cfg) {
  if constexpr (MODE == 1) {
    if (use_mma) {
      bool ok = false;
      UPF_TRY(wgmma_available(&ok));
      if (ok) {
        if (D == 64)
          return prepare_wgmma<64>(cfg);
        if (D == 256)
          return prepare_wgmma<256>(cfg);
        return prepare_wgmma<128>(cfg);
      }
    }
  }
  constexpr bool PIPE = MODE == 1;
  if (use_mma) {
    if (D == 64)
      return prepare_score_kernel<MmaBf16<64, 8, 2, PIPE>, MODE>(cfg, D);
    if (D == 128)
      return prepare_score_kernel<MmaBf16<128, 8, 2, PIPE>, MODE>(cfg, D);
    return prepare_score_kernel<MmaBf16<256, 8, 1, PIPE>, MODE>(cfg, D);
  }
  if (in->q.dtype == UPF_DTYPE_BF16)
    return prepare_score_kernel<Ffma<__nv_bfloat16>, MODE>(cfg, D);
  return prepare_score_kernel<Ffma<float>, MODE>(cfg, D);
}

bool mma_applies(const upf_select_inputs *in) {
  if (in->q.dtype != UPF_DTYPE_BF16)
    return false;
  int64_t D = in->q.shape[2];
  if (D != 64 && D != 128 && D != 256)
    return false;
  if ((uintptr_t)in->q.data % 16 || (uintptr_t)in->k.data % 16)
    return false;
  return in->q.stride[0] % 8 == 0 && in->q.stride[1] % 8 == 0 && in->k.stride[0] % 8 == 0 &&
         in->k.stride[1] % 8 == 0;
}

/* Top-p over the scored requests' block scores (device), then mask 1 on unscored blocks. */
upf_status run_topp(const sel_plan &p, const sel_dev_plan &dp, const upf_select_params *params,
                    const float *block_score, uint8_t *block_mask, unsigned long long *bad_score, uint8_t *ws_topp,
                    cudaStream_t stream) {
  if (p.num_blocks == 0)
    return UPF_OK;
  sel_unscored_blocks_kernel<<<grid_for(p.num_blocks, 256), 256, 0, stream>>>(dp, p.B, p.num_blocks, block_mask,
                                                                               nullptr);
  UPF_CUDA_LAUNCH_TRY("sel_unscored_blocks_kernel");
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
  if (!segmented) {
    a.ib = 12; /* TP_CHUNK = 4096 = 2^12 */
    sel_topp_fused_kernel<<<p.S, TP_THREADS, 0, stream>>>(dp.reqs, a);
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

/* Small device results read back at the end of a call. */
struct sel_result {
  int32_t kept_total;
  unsigned bad_req;
  unsigned long long bad_score;
};

upf_status report_bad_score(const sel_plan &p, const float *block_score, unsigned long long code, const char *op) {
  int r = (int)(code >> 32);
  int64_t cl = (int64_t)(code & 0xffffffffu);
  float v = 0.f;
  UPF_TRY(upf_cuda_download_small(&v, block_score + p.blk_off[(size_t)r] + cl, sizeof v));
  if (!isfinite(v))
    return upf_fail(UPF_ERR_NONFINITE, "%s: block score %lld of request %d is %s", op, (long long)cl, r,
                    isnan(v) ? "NaN" : "Inf");
  return upf_fail(UPF_ERR_INVALID_ARG, "%s: block score %lld of request %d is negative (%g)", op, (long long)cl, r,
                  (double)v);
}

upf_status upload_plan(const sel_plan &p, uint8_t *dev_blob) {
  std::vector<uint8_t> blob;
  plan_pack(p, blob);
  return upf_cuda_upload_async(dev_blob, blob.data(), blob.size());
}

/* Stages 1-3 of select_run and select_block_scores, one code path for both: the score kernel picked
 * and the fused plan laid out (prepare), the workspace pieces carved after the caller's (take), the
 * score, row-stats and block-mass kernels launched (launch). */
struct score_stage {
  kernel_cfg cfg = {};
  size_t o_M = 0, o_U = 0, o_MC = 0, o_LC = 0, o_rm = 0, o_ri = 0;

  upf_status prepare(const upf_select_inputs *in, sel_plan &p) {
    bool use_mma = mma_applies(in);
    if (p.S > 0) {
      if (p.G >= 64)
        UPF_TRY(pick_score_kernel<1>(in, p.D, use_mma, cfg));
      else
        UPF_TRY(pick_score_kernel<0>(in, p.D, use_mma, cfg));
      int occ = 1;
      UPF_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, cfg.fn, cfg.threads, cfg.smem));
      plan_fused(p, cfg.rows_per_cta, (int64_t)upf_cuda_num_sms() * std::max(occ, 1));
    }
    return UPF_OK;
  }

  void take(ws_carver &wc, const sel_plan &p) {
    o_M = wc.take(sizeof(float) * (size_t)p.m_len);
    o_U = wc.take(sizeof(float) * (size_t)p.u_len);
    o_MC = wc.take(sizeof(float) * (size_t)p.c_len);
    o_LC = wc.take(sizeof(float) * (size_t)p.c_len);
    o_rm = wc.take(sizeof(float) * (size_t)p.S * (size_t)p.Rn);
    o_ri = wc.take(sizeof(float) * (size_t)p.S * (size_t)p.Rn);
  }

  /* block_score (num_blocks) on the stream; bad_req (device) receives the first scored request whose
   * scores were not finite. */
  upf_status launch(const upf_select_inputs *in, const upf_select_params *params, const sel_plan &p,
                    const sel_dev_plan &dp, uint8_t *base, float *block_score, unsigned *bad_req,
                    cudaStream_t stream) const {
    if (p.S > 0) {
      score_args x;
      x.q = in->q.data;
      x.k = in->k.data;
      x.qs0 = in->q.stride[0];
      x.qs1 = in->q.stride[1];
      x.ks0 = in->k.stride[0];
      x.ks1 = in->k.stride[1];
      x.Hq = p.Hq;
      x.Hkv = p.Hkv;
      x.grp = p.grp;
      x.L = p.L;
      x.D = p.D;
      x.G = p.G;
      x.SG = p.SG;
      x.UG = p.UG;
      x.KC = p.KC;
      x.RG = p.RG;
      x.RPC = p.RPC;
      x.S = p.S;
      x.Rn = p.Rn;
      x.c = (float)((double)upf_select_scale(params, p.D) * 1.4426950408889634);
      x.reqs = dp.reqs;
      x.M = (float *)(base + o_M);
      x.U = (float *)(base + o_U);
      x.MC = (float *)(base + o_MC);
      x.LC = (float *)(base + o_LC);
      x.bad_req = bad_req;
      void *args[] = {&x};
      UPF_CUDA_TRY(cudaLaunchKernel(cfg.fn, dim3((unsigned)p.ctas), dim3(cfg.threads), args, cfg.smem, stream));
      UPF_CUDA_LAUNCH_TRY("sel_score_kernel");
      int64_t rows = (int64_t)p.S * p.Rn;
      sel_row_stats_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(dp.reqs, p.S, p.Rn, x.MC, x.LC,
                                                                    (float *)(base + o_rm), (float *)(base + o_ri));
      UPF_CUDA_LAUNCH_TRY("sel_row_stats_kernel");
      sel_block_mass_kernel<<<(unsigned)p.num_blocks, BM_THREADS, 0, stream>>>(
          dp, p.B, p.Rn, p.G, p.SG, p.UG, x.M, x.U, (const float *)(base + o_rm), (const float *)(base + o_ri),
          block_score);
      UPF_CUDA_LAUNCH_TRY("sel_block_mass_kernel");
    } else if (p.num_blocks > 0) {
      sel_unscored_blocks_kernel<<<grid_for(p.num_blocks, 256), 256, 0, stream>>>(dp, p.B, p.num_blocks, nullptr,
                                                                                   block_score);
      UPF_CUDA_LAUNCH_TRY("sel_unscored_blocks_kernel");
    }
    return UPF_OK;
  }
};

/* A scored request whose fp32 scores were not finite: the input that is NaN/Inf, else an overflow. */
upf_status report_bad_scores(const upf_select_inputs *in, const sel_plan &p, int r, const char *op) {
  bool found = false;
  UPF_TRY(find_nonfinite(in, p, upf_cuda_stream(), op, &found));
  return upf_fail(UPF_ERR_NONFINITE, "%s (cuda): request %d: scores overflowed fp32 (q and k are finite)", op, r);
}

} // namespace

/* ---------------------------------------------------------------------------------------------- */
/* Entries                                                                                          */

extern "C" upf_status upf_cuda_select_run(const upf_select_inputs *in, const upf_select_params *params,
                                          upf_select_outputs *out) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(check_head_dim(in, "select"));
  cudaStream_t stream = upf_cuda_stream();
  sel_plan p;
  plan_build(in, params, p);
  score_stage sc;
  UPF_TRY(sc.prepare(in, p));

  ws_carver wc;
  size_t o_blob = wc.take(p.blob_bytes);
  size_t o_res = wc.take(sizeof(sel_result));
  sc.take(wc, p);
  size_t o_bs = wc.take(out->block_score ? 0 : sizeof(float) * (size_t)p.num_blocks);
  size_t o_bm = wc.take(out->block_mask ? 0 : (size_t)p.num_blocks);
  size_t o_tp = wc.take(topp_ws_bytes(p));
  size_t o_ex = wc.take(expand_ws_bytes(p));
  void *ws;
  UPF_TRY(upf_cuda_workspace(wc.at, &ws));
  uint8_t *base = (uint8_t *)ws;
  sel_result *d_res = (sel_result *)(base + o_res);
  float *block_score = out->block_score ? out->block_score : (float *)(base + o_bs);
  uint8_t *block_mask = out->block_mask ? out->block_mask : base + o_bm;

  UPF_TRY(upload_plan(p, base + o_blob));
  sel_dev_plan dp = plan_device(p, base + o_blob);
  UPF_CUDA_TRY(cudaMemsetAsync(d_res, 0xFF, sizeof(sel_result), stream));

  UPF_TRY(sc.launch(in, params, p, dp, base, block_score, &d_res->bad_req, stream));
  UPF_TRY(run_topp(p, dp, params, block_score, block_mask, &d_res->bad_score, base + o_tp, stream));
  UPF_TRY(run_expand(in, p, dp, params, block_mask, out, base + o_ex, &d_res->kept_total, stream));

  sel_result res;
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  if (res.bad_req != ~0u || res.bad_score != ~0ull)
    return report_bad_scores(in, p, res.bad_req != ~0u ? p.reqs[res.bad_req].r : (int)(res.bad_score >> 32), "select");
  out->kept_total = res.kept_total;
  return UPF_OK;
}

/* Stages 1-3 of select_run alone: the same plan, kernels and workspace layout up to block_score. */
extern "C" upf_status upf_cuda_select_block_scores(const upf_select_inputs *in, const upf_select_params *params,
                                                   float *block_score) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(check_head_dim(in, "select.block_scores"));
  cudaStream_t stream = upf_cuda_stream();
  sel_plan p;
  plan_build(in, params, p);
  score_stage sc;
  UPF_TRY(sc.prepare(in, p));
  ws_carver wc;
  size_t o_blob = wc.take(p.blob_bytes);
  size_t o_res = wc.take(sizeof(sel_result));
  sc.take(wc, p);
  void *ws;
  UPF_TRY(upf_cuda_workspace(wc.at, &ws));
  uint8_t *base = (uint8_t *)ws;
  sel_result *d_res = (sel_result *)(base + o_res);
  UPF_TRY(upload_plan(p, base + o_blob));
  sel_dev_plan dp = plan_device(p, base + o_blob);
  UPF_CUDA_TRY(cudaMemsetAsync(d_res, 0xFF, sizeof(sel_result), stream));
  UPF_TRY(sc.launch(in, params, p, dp, base, block_score, &d_res->bad_req, stream));
  sel_result res;
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  if (res.bad_req != ~0u)
    return report_bad_scores(in, p, p.reqs[res.bad_req].r, "select.block_scores");
  return UPF_OK;
}

/* The frame of the stage-alone entries that read only the layout: begin (the device, the layout checks,
 * the host plan, and the plan blob as the workspace's first piece), the entry's own pieces by wc.take,
 * then map (the workspace, with the plan uploaded into it). */
struct stage_call {
  sel_plan p;
  cudaStream_t stream = nullptr;
  ws_carver wc;
  uint8_t *base = nullptr;
  sel_dev_plan dp = {};

  upf_status begin(const upf_select_inputs *in, const upf_select_params *params) {
    UPF_TRY(upf_cuda_init());
    UPF_TRY(check_layout(in, params));
    stream = upf_cuda_stream();
    plan_build(in, params, p);
    wc.take(p.blob_bytes);
    return UPF_OK;
  }
  upf_status map() {
    void *ws;
    UPF_TRY(upf_cuda_workspace(wc.at, &ws));
    base = (uint8_t *)ws;
    UPF_TRY(upload_plan(p, base));
    dp = plan_device(p, base);
    return UPF_OK;
  }
};

extern "C" upf_status upf_cuda_select_part_gemm(const upf_select_inputs *in, const upf_select_params *params,
                                                float *scores) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_select_validate(in, params));
  cudaStream_t stream = upf_cuda_stream();
  sel_plan p;
  plan_build(in, params, p);
  if (p.S == 0)
    return UPF_OK;
  bool found = false;
  UPF_TRY(find_nonfinite(in, p, stream, "select.part_gemm", &found));
  void *ws; /* after the scan, which uses the workspace too */
  UPF_TRY(upf_cuda_workspace(p.blob_bytes, &ws));
  UPF_TRY(upload_plan(p, (uint8_t *)ws));
  sel_dev_plan dp = plan_device(p, (const uint8_t *)ws);
  float scale = upf_select_scale(params, p.D);
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

extern "C" upf_status upf_cuda_select_block_softmax(const upf_select_inputs *in, const upf_select_params *params,
                                                    const float *scores, float *token_mass) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  const sel_plan &p = c.p;
  if (p.T == 0)
    return UPF_OK;
  const int64_t rows = (int64_t)p.S * p.Rn;
  const size_t o_m = c.wc.take(sizeof(float) * (size_t)rows), o_l = c.wc.take(sizeof(float) * (size_t)rows);
  UPF_TRY(c.map());
  float *row_m = (float *)(c.base + o_m), *row_l = (float *)(c.base + o_l);
  if (rows > 0) {
    if (rows > INT32_MAX)
      return upf_fail(UPF_ERR_UNSUPPORTED, "select.block_softmax (cuda): %lld score rows exceed one grid",
                      (long long)rows);
    sel_softmax_rows_kernel<<<(unsigned)rows, 256, 0, c.stream>>>(c.dp.reqs, p.Rn, scores, row_m, row_l);
    UPF_CUDA_LAUNCH_TRY("sel_softmax_rows_kernel");
  }
  sel_token_mass_kernel<<<grid_for(p.T, 256), 256, 0, c.stream>>>(in->cu_seqlens, p.B, p.T, c.dp, p.Rn, scores, row_m,
                                                                   row_l, token_mass);
  UPF_CUDA_LAUNCH_TRY("sel_token_mass_kernel");
  return UPF_OK;
}

extern "C" upf_status upf_cuda_select_block_reduce(const upf_select_inputs *in, const upf_select_params *params,
                                                   const float *token_mass, float *block_score) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  if (c.p.num_blocks == 0)
    return UPF_OK;
  UPF_TRY(c.map());
  sel_block_reduce_kernel<<<grid_for(c.p.num_blocks, 256), 256, 0, c.stream>>>(c.dp, c.p.B, c.p.num_blocks, c.p.G,
                                                                               token_mass, block_score);
  UPF_CUDA_LAUNCH_TRY("sel_block_reduce_kernel");
  return UPF_OK;
}

extern "C" upf_status upf_cuda_select_topp(const upf_select_inputs *in, const upf_select_params *params,
                                           const float *block_score, uint8_t *block_mask) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  if (c.p.num_blocks == 0)
    return UPF_OK;
  const size_t o_res = c.wc.take(sizeof(sel_result)), o_tp = c.wc.take(topp_ws_bytes(c.p));
  UPF_TRY(c.map());
  sel_result *d_res = (sel_result *)(c.base + o_res), res;
  UPF_CUDA_TRY(cudaMemsetAsync(d_res, 0xFF, sizeof(sel_result), c.stream));
  UPF_TRY(run_topp(c.p, c.dp, params, block_score, block_mask, &d_res->bad_score, c.base + o_tp, c.stream));
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  if (res.bad_score != ~0ull)
    return report_bad_score(c.p, block_score, res.bad_score, "select.topp");
  return UPF_OK;
}

extern "C" upf_status upf_cuda_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                                             const uint8_t *block_mask, upf_select_outputs *out) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  const size_t o_res = c.wc.take(sizeof(sel_result)), o_ex = c.wc.take(expand_ws_bytes(c.p));
  UPF_TRY(c.map());
  sel_result *d_res = (sel_result *)(c.base + o_res), res;
  UPF_TRY(run_expand(in, c.p, c.dp, params, block_mask, out, c.base + o_ex, &d_res->kept_total, c.stream));
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  out->kept_total = res.kept_total;
  return UPF_OK;
}

/* Stage 1 of the CUDA selection pipeline (cuda/select.cu's header describes it whole): the fused score
 * kernels of select_run and select.block_scores, sel_score_kernel with its mma.sync (MmaBf16) and FFMA
 * policies and the Hopper wgmma kernel, and the picker that chooses one for a call. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/mma_sync.cuh"
#include "cuda/select_common.cuh"
#include "cuda/wgmma.cuh"

namespace upf_select {
namespace {

/* ---------------------------------------------------------------------------------------------- */
/* 1. Fused score kernel                                                                            */

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
/* Segments of SG keys: SG is a power of two (min of the block size G and the key chunk, both powers of
 * two), so the test of a segment's end and its index take a mask and a shift, not a runtime division (a
 * software sequence of ~20 instructions) on every tile's path. k >= 0. */
__device__ __forceinline__ bool sg_boundary(int k, int SG) { return (k & (SG - 1)) == 0; }
__device__ __forceinline__ int sg_index(int k, int SG) { return k >> (__ffs(SG) - 1); }

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

/* Pairwise (fixed-order, so deterministic) reductions: log2(N) dependent steps instead of N. Written as
 * template recursion so that every index is a constant (a runtime-halved loop would put the array in
 * local memory). */
template <int W, int N>
__device__ __forceinline__ void tree_step_sum(float (&v)[N]) {
  if constexpr (W >= 1) {
#pragma unroll
    for (int i = 0; i < W; i++)
      v[i] += v[i + W];
    tree_step_sum<W / 2>(v);
  }
}

template <int W, int N>
__device__ __forceinline__ void tree_step_max(float (&v)[N]) {
  if constexpr (W >= 1) {
#pragma unroll
    for (int i = 0; i < W; i++)
      v[i] = fmaxf(v[i], v[i + W]);
    tree_step_max<W / 2>(v);
  }
}

/* Max of the row-half h (elements 2h, 2h+1) of NTL n8 accumulator tiles. */
template <int NTL>
__device__ __forceinline__ float tree_max(const float (&acc)[NTL][4], int h) {
  float m[2 * NTL];
#pragma unroll
  for (int nt = 0; nt < NTL; nt++) {
    m[2 * nt] = acc[nt][2 * h];
    m[2 * nt + 1] = acc[nt][2 * h + 1];
  }
  tree_step_max<NTL>(m);
  return m[0];
}

/* G >= 64 epilogue of one piece of NTL n8 tiles (keys kb ..): finite check, causal mask, piece max,
 * online update of the segment sum; at a segment end writes (M, U) and folds it into (MC, LC). */
template <int MT, int NTL, bool TREE = false>
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
  if constexpr (TREE) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int h = 0; h < 2; h++)
        mx[mt * 2 + h] = tree_max<NTL>(acc[mt], h);
  } else {
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
  }
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
      if constexpr (TREE) {
        float e[2 * NTL];
#pragma unroll
        for (int nt = 0; nt < NTL; nt++) {
          e[2 * nt] = ex2(fmaf(acc[mt][nt][2 * h], c, -ref));
          e[2 * nt + 1] = ex2(fmaf(acc[mt][nt][2 * h + 1], c, -ref));
        }
        tree_step_sum<NTL>(e);
        sum = e[0];
      } else {
#pragma unroll
        for (int nt = 0; nt < NTL; nt++) {
          sum += ex2(fmaf(acc[mt][nt][2 * h], c, -ref));
          sum += ex2(fmaf(acc[mt][nt][2 * h + 1], c, -ref));
        }
      }
      st.usum[j] = st.usum[j] * alpha + sum;
      st.mrun[j] = mnew;
    }
  if (seg_end) {
    /* rows of this thread are R[0][0] + 16*mt + 8*h: one base pointer, immediate offsets */
    const int64_t at = (int64_t)sg_index(kb, x.SG) * x.Rn + R[0][0];
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
      epi_big<MT, 4>(acc0, kb, kb + 31 > n - x.L, sg_boundary(kb + 32, x.SG), lim, valid, R, st, x, rq, tq);
      upf_mma::cp_async_wait<0>();
      __syncthreads();
      if (t + 2 < ntile)
        pol.issue_fast(smem, t & 1, n, kb + 2 * KT);
      if (t + 1 < ntile) {
        if (check_k)
          pol.check_tile(smem, (t + 1) & 1);
        pol.compute_half(smem, (t + 1) & 1, 0, acc0);
      }
      epi_big<MT, 4>(acc1, kb + 32, kb + 63 > n - x.L, sg_boundary(kb + 64, x.SG) || t == ntile - 1, lim, valid, R,
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
      const bool seg_end = sg_boundary(kb + KT, x.SG) || (t == ntile - 1);
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
        const int64_t seg = sg_index(kb, x.SG);
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
/* CTA = NCW consumer warpgroups (64 query rows each, Q in registers as the wgmma A operand) and a
 * producer warp that streams the chunk's K tiles (64 keys) into an NS-stage ring in the 128-byte-swizzle
 * K-major layout wgmma reads (D/64 atoms of 64 rows x 128 bytes), signalling `full[s]`; consumers release a
 * stage on `empty[s]` once the wgmma that read it has completed. TMA (the default, D 64 and 128): one
 * producer thread brings each tile as D/64 TMA boxes of 64 keys x 64 dims, the full barrier expecting their
 * bytes, and no proxy fence (0.82-0.86x the cp.async form's time from 32K up, perf/NOTES.md). cp.async
 * (D = 256, until its TMA form, the same code with four boxes a tile, has run verify on a GPU): the warp's
 * 16-byte copies, arriving with cp.async.mbarrier.arrive.noinc, and a proxy fence before each tile's wgmma.
 * At D <= 128 four consumer WGs with one accumulator set each: issue tile t, wait, epilogue of tile t
 * (epi_big, the same (M, U, MC, LC) arithmetic as the mma.sync kernel, max and sum pairwise), the other WGs'
 * wgmma running meanwhile. At D = 256 two WGs with two sets each: the wgmma of tile t+1 is issued before the
 * epilogue of tile t. Every reduction is per thread or per quad in a fixed order: deterministic. */

template <int D_>
struct WgCfg {
  static constexpr int D = D_;
  /* Consumer warpgroups: four where one accumulator set and the Q fragments fit the 96 registers a thread
   * of 544 gets (D <= 128; faster than two, perf/NOTES.md), their epilogues hidden by
   * each other's wgmma; two at D = 256, each with two accumulator sets (tile t+1's wgmma in flight
   * during tile t's epilogue). */
  static constexpr int NCW = D <= 128 ? 4 : 2;
  static constexpr int NACC = NCW == 2 ? 2 : 1;
  static constexpr bool TREE = NCW == 4;            /* pairwise max and sum in the epilogue */
  static constexpr int KS = D / 16;                 /* k16 steps */
  static constexpr int NS = D == 64 ? 8 : 4; /* ring stages */
  static constexpr int STAGE = KT * D * 2;          /* bytes per stage */
  static constexpr int THREADS = NCW * 128 + 32; /* + producer warp */
  static constexpr int RPC = NCW * 64;
  static size_t smem_bytes() { return 1024 + (size_t)NS * STAGE + 2 * NS * 8; }
};

template <class C, bool TMA>
__global__ void __launch_bounds__(C::THREADS, 1)
    sel_score_wgmma_kernel(const score_args x, const __grid_constant__ CUtensorMap kmap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace upf_wgmma;
  constexpr int D = C::D, NS = C::NS, KS = C::KS, STAGE = C::STAGE, NCW = C::NCW;
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
      mbar_init(full + 8 * i, TMA ? 1 : 32);
      mbar_init(empty + 8 * i, NCW * 4);
    }
    if constexpr (TMA)
      fence_mbar_init();
  }
  __syncthreads();

  if constexpr (TMA) {
    if (warp == NCW * 4) {
      /* Producer thread: tile t is the boxes at (64 c, kvh, tok0 + kb) for c < D/64; rows past the tensor's
       * end arrive as zeros, rows past the request's end are other requests' keys (masked: key >= n). */
      if (lane == 0)
        for (int t = 0; t < ntile; t++) {
          const int st = t % NS;
          if (t >= NS)
            mbar_wait(empty + 8 * st, (uint32_t)((t / NS - 1) & 1));
          mbar_arrive_expect_tx(full + 8 * st, STAGE);
#pragma unroll
          for (int c = 0; c < D / 64; c++)
            tma_load_3d(sbase + st * STAGE + c * (KT * 128), &kmap, 64 * c, kvh, (int)(rq.tok0 + k0 + t * KT),
                        full + 8 * st);
        }
      return;
    }
  }

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
    if constexpr (!TMA)
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
        const int u = threadIdx.x + j * NCW * 128;
        /* the TMA's rows past the request's end hold other requests' keys (cp.async zero-fills them) */
        if (TMA && k0 + t * KT + ((u >> 3) & (KT - 1)) >= n)
          continue;
        uint4 v = tv[u];
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.x, zero2, chk2);
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.y, zero2, chk2);
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.z, zero2, chk2);
        chk2 = __hfma2(*(__nv_bfloat162 *)&v.w, zero2, chk2);
      }
    }
    __syncwarp();
    if (lane == 0)
      mbar_arrive(empty + 8 * stg);
    const int kb = k0 + t * KT;
    float sv[1][8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        sv[0][j][e] = cur[0][j][e];
    epi_big<1, 8, C::TREE>(sv, kb, kb + KT - 1 > n - x.L, sg_boundary(kb + KT, x.SG) || t == ntile - 1, lim, valid, R,
                           st, x, rq, tq);
  };

  if constexpr (C::NACC == 1) {
    /* One set: issue tile t, wait for it, ready tile t+1, epilogue of tile t. */
    float acc[1][8][4];
    ready(0);
    for (int t = 0; t < ntile; t++) {
      issue(acc[0], t);
      wg_wait<0>();
      if (t + 1 < ntile)
        ready(t + 1);
      epi(acc, t);
    }
  } else {
    /* Two sets, steady state without branches around the wgmma (ptxas tracks the in-flight groups through
     * it): issue tile t+1, wait for tile t, epilogue of tile t. ntile >= 1: a chunk holds at least one key. */
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
/* Picker                                                                                           */

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

/* The TMA's view of k: (rows, Hkv, D) bf16 with k's token and head strides, boxes of 64 dims x 1 head x
 * 64 keys, 128-byte swizzle (the ring's layout), zeros past the last row. The driver's encoder is found
 * through the runtime (no link against libcuda). */
upf_status encode_k_map(const upf_select_inputs *in, CUtensorMap *map) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode;
  if (!encode) {
    cudaDriverEntryPointQueryResult found;
    void *fn = nullptr;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn)
      return upf_fail(UPF_ERR_CUDA, "select (cuda): the driver has no cuTensorMapEncodeTiled for the TMA score "
                      "kernel (%s)", cudaGetErrorString(e));
    encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
  }
  const upf_tensor &k = in->k;
  const cuuint64_t dims[3] = {(cuuint64_t)k.shape[2], (cuuint64_t)k.shape[1], (cuuint64_t)k.shape[0]};
  const cuuint64_t strides[2] = {(cuuint64_t)k.stride[1] * 2, (cuuint64_t)k.stride[0] * 2};
  const cuuint32_t box[3] = {64, 1, 64}, unit[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, k.data, dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return upf_fail(UPF_ERR_CUDA, "select (cuda): cuTensorMapEncodeTiled refused k (error %d; %lld rows, "
                    "strides %lld / %lld elements)", (int)r, (long long)k.shape[0], (long long)k.stride[0],
                    (long long)k.stride[1]);
  return UPF_OK;
}

template <class C, bool TMA>
upf_status prepare_wgmma(const upf_select_inputs *in, kernel_cfg &cfg) {
  cfg.fn = (const void *)sel_score_wgmma_kernel<C, TMA>;
  cfg.threads = C::THREADS;
  cfg.smem = C::smem_bytes();
  cfg.rows_per_cta = C::RPC;
  memset(&cfg.kmap, 0, sizeof cfg.kmap);
  if (cfg.smem > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "select (cuda): the wgmma score kernel needs %zu bytes of shared memory, "
                    "the device allows %zu", cfg.smem, upf_cuda_smem_optin());
  UPF_CUDA_TRY(cudaFuncSetAttribute(sel_score_wgmma_kernel<C, TMA>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)cfg.smem));
  if constexpr (TMA)
    UPF_TRY(encode_k_map(in, &cfg.kmap));
  return UPF_OK;
}

/* The tensor map's limits: a row coordinate is an int32, a stride under 2^40 bytes (mma_applies has
 * checked the 16-byte alignment of the base and both strides). */
bool tma_applies(const upf_select_inputs *in) {
  return in->k.shape[0] <= INT32_MAX && in->k.stride[0] < ((int64_t)1 << 39) && in->k.stride[1] < ((int64_t)1 << 39);
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
 * build and device (the fastest measured; its K tiles by TMA at D 64 and 128, by cp.async at 256), else the
 * mma.sync kernel (8 warps x 2 m-tiles, 8 x 1 at D = 256, whose A fragments take 64 registers an m-tile;
 * the half-tile pipeline where G >= 64); the FFMA kernel for everything else. */
template <int MODE>
upf_status pick_score_kernel(const upf_select_inputs *in, int D, bool use_mma, kernel_cfg &cfg) {
  if constexpr (MODE == 1) {
    if (use_mma) {
      bool ok = false;
      UPF_TRY(wgmma_available(&ok));
      /* D = 256 keeps cp.async until its TMA form (the same code, four boxes a tile) has run verify on a GPU */
      if (ok && D <= 128 && tma_applies(in))
        return D == 64 ? prepare_wgmma<WgCfg<64>, true>(in, cfg) : prepare_wgmma<WgCfg<128>, true>(in, cfg);
      if (ok) {
        if (D == 64)
          return prepare_wgmma<WgCfg<64>, false>(in, cfg);
        if (D == 256)
          return prepare_wgmma<WgCfg<256>, false>(in, cfg);
        return prepare_wgmma<WgCfg<128>, false>(in, cfg);
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

} // namespace

upf_status choose_score_kernel(const upf_select_inputs *in, const sel_plan &p, kernel_cfg &cfg) {
  bool use_mma = mma_applies(in);
  if (p.G >= 64)
    return pick_score_kernel<1>(in, p.D, use_mma, cfg);
  return pick_score_kernel<0>(in, p.D, use_mma, cfg);
}

} // namespace upf_select

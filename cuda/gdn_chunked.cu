/* The chunked (WY / UT-transform) form of the gated delta-rule scan on bf16 tensor cores: the prefill
 * fast path of gdn.scan for bf16 inputs with Dk = Dv = 128 (Qwen3-Next). The math is the CPU reference
 * ref_gdn_scan_chunked's (ref_cpu/gdn.c), over chunks of CH = 64 tokens of one request:
 *   G = cumsum(g) within the chunk (rows past the request's end repeat the last G and carry beta = 0,
 *       k = q = v = 0, so they add nothing);
 *   A = strictly-lower(diag(beta) K K^T * exp(G_i - G_j)),  T = (I + A)^-1 (forward substitution);
 *   W = T diag(beta exp(G)) K,  U = T diag(beta) V,  P = lower(Q K^T * exp(G_i - G_j)) (q carries scale);
 * then, in chunk order, with the fp32 state S (Dk x Dv):
 *   V' = U - W S;  O = diag(exp(G)) Q S + P V';  S <- exp(G_last) S + K^T diag(exp(G_last - G)) V'.
 * Every exponent is <= 0: nothing overflows, and an exp that underflows to 0 is the true value.
 *
 * Three launches, FLA's split (O computed apart from the serial state pass, over stored states):
 *   chunk_prep_kernel   one CTA (8 warps, two an SM) per (chunk, value head), all independent: gates,
 *                       cumsum, L2 norms (xor-tree sums), K K^T and Q K^T by mma.sync (bf16 in, fp32
 *                       accumulate), T in fp32 by 16 x 16 blocks (each diagonal block by forward
 *                       substitution in one warp, then the block rows in turn; every sum in index
 *                       order), W and U by mma with T rounded to bf16. Writes W, U, P (bf16), G (fp32)
 *                       and, once per key head, the normalised q (scaled) and k^T (bf16) to the workspace.
 *   chunk_state_kernel  one CTA (8 warps) per (request, value head, block of BV = 32 value columns), the
 *                       chunks in order: the state block (128 x 32 fp32) lives in the accumulators (warp
 *                       w owns rows 16w..16w+15); per chunk all 8 warps compute V' = U - W S (a 16 x 16
 *                       block each) and S <- exp(G_last) S + K^T diag(..) V', and the chunk's S^T and V'^T
 *                       (bf16, the operands it rounds anyway) go to the workspace. The next two chunks'
 *                       W, K^T, U, G stream in by cp.async (three stages). 4 x 32 CTAs per request at 32
 *                       value heads fill the 132 SMs with a single long request.
 *   chunk_out_kernel    one CTA (8 warps) per (chunk, value head), all independent: O = diag(exp(G)) Q S
 *                       + P V' from the stored S^T and V'^T.
 * Why this form: the state pass is the serial chain of the scan, so everything that need not be in it
 * (Q S, P V', the O stores) moves to the parallel out kernel, and the prep is scheduled for latency
 * (all loads in flight at once, two CTAs an SM); the forms measured slower are in perf/NOTES.md
 * ("Retired GDN and selection variants").
 * Precision: bf16 operands, fp32 accumulation and fp32 state (FLA's chunk_gated_delta_rule makes the same
 * choices); the long-reduction rule of SPEC 7 applies (see verify/verify_gdn.c). No atomics and every sum
 * in a fixed order: the same inputs give the same bits on every run. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/gdn.cuh"
#include "cuda/mma_sync.cuh"

namespace {

using upf_mma::bf16;
using upf_mma::pack_bf16;
using upf_mma::warp_mma;

constexpr int CH = 64;       /* tokens per chunk */
constexpr int D = 128;       /* Dk = Dv */
constexpr int LDA = D + 8;   /* bf16 row stride of 128-wide tiles (272 bytes: 4 mod 32 words) */
constexpr int LDB = CH + 8;  /* bf16 row stride of 64-wide tiles (144 bytes) */
constexpr int LDF = CH + 8;  /* fp32 row stride of the 64 x 64 matrices */
constexpr int BV = 32;       /* value columns of one state CTA */

__device__ __forceinline__ float ld(const bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16 *p, float v) { *p = __float2bfloat16_rn(v); }

struct chunk_ws {
  const int2 *chunks;        /* (n_chunks) {first token, length} */
  const int32_t *req_chunk0; /* (B+1) first chunk of each request */
  bf16 *w, *u;               /* (n_chunks, Hv, CH, D) */
  bf16 *p;                   /* (n_chunks, Hv, CH, CH) */
  float *gcum;               /* (n_chunks, Hv, CH) */
  bf16 *qn;                  /* (n_chunks, Hk, CH, D) normalised q times scale */
  bf16 *kt;                  /* (n_chunks, Hk, D, CH) normalised k, transposed */
  bf16 *st;                  /* (n_chunks, Hv, D, D) S^T before the chunk, bf16 */
  bf16 *vpt;                 /* (n_chunks, Hv, D, CH) V'^T, bf16 */
};

struct prep_args {
  const void *q, *k, *v, *a, *b;
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, a_s0, b_s0;
  const float *a_log, *dt_bias;
  int hk, hv;
  float scale;
  int rows16; /* bit 0, 1, 2 set where q, k, v rows may be copied in 16-byte pieces */
  chunk_ws ws;
};

constexpr int TB = 16; /* block size of the triangular inverse */

/* A 16 x 8NT block of (T times B) to global bf16: rows `xrows` of T (fp32 shared, rounded to bf16 as it is
 * loaded, stride LDF) times B given as Bt (8NT rows of `bt`, CH contiguous, stride LDB); the calling warp
 * writes its 16 rows x 8NT columns at `out` (row stride D). */
template <int NT> __device__ __forceinline__ void product_t_times(const float *xrows, const bf16 *bt, bf16 *out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float acc[NT][4] = {};
  warp_mma<NT, CH>(acc, xrows, LDF, bt, LDB); /* T rows: fp32, rounded as loaded */
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int i = g + 8 * half, c = 8 * nt + 2 * t4;
      *reinterpret_cast<uint32_t *>(out + i * D + c) = pack_bf16(acc[nt][2 * half], acc[nt][2 * half + 1]);
    }
}

/* Gate g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) of token t, value head h. */
__device__ __forceinline__ void gate_beta(const prep_args &a, int h, int64_t t, float &gv, float &beta) {
  const float x = ld((const bf16 *)a.a + t * a.a_s0 + h) + a.dt_bias[h];
  const float sp = x > 20.0f ? x : log1pf(expf(x)); /* softplus, torch's threshold */
  gv = -expf(a.a_log[h]) * sp;
  beta = 1.0f / (1.0f + expf(-ld((const bf16 *)a.b + t * a.b_s0 + h)));
}

/* Threads 0..CH-1: the gate and beta of chunk row tid into gs, bs (rows past the request's end: 0, 0). */
__device__ __forceinline__ void gates_to_smem(const prep_args &a, int h, int64_t tok0, int len, float *gs, float *bs) {
  const int tid = threadIdx.x;
  if (tid < CH) {
    float gv = 0.0f, beta = 0.0f;
    if (tid < len)
      gate_beta(a, h, tok0 + tid, gv, beta);
    gs[tid] = gv, bs[tid] = beta;
  }
}

/* From the calling warp's K K^T and Q K^T blocks (rows i0 + g (+8), columns j1 + 8 nt + 2 t4 (+1)): A (fp32,
 * shared, strictly lower, row i scaled by beta_i) and P (bf16, global, lower), both decayed by exp(G_i - G_j). */
template <int NT>
__device__ __forceinline__ void store_a_p(const float (&kk)[NT][4], const float (&qk)[NT][4], int i0, int j1,
                                          const float *Gs, const float *bs, float *Am, bf16 *po) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int i = i0 + g + 8 * half, j0 = j1 + 8 * nt + 2 * t4;
      float av[2], pv[2];
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const int j = j0 + c;
        const float dec = expf(fminf(Gs[i] - Gs[j], 0.0f)); /* used only for j <= i, where it is <= 0 */
        av[c] = j < i ? bs[i] * kk[nt][2 * half + c] * dec : 0.0f;
        pv[c] = j <= i ? qk[nt][2 * half + c] * dec : 0.0f;
      }
      Am[i * LDF + j0] = av[0], Am[i * LDF + j0 + 1] = av[1];
      *reinterpret_cast<uint32_t *>(po + i * CH + j0) = pack_bf16(pv[0], pv[1]);
    }
}

/* Column c of the inverse of the unit lower-triangular diagonal block at (b0, b0) of I + A, by forward
 * substitution (x_i = -sum_{j<i} A_ij x_j, in index order), into Xm. */
__device__ __forceinline__ void invert_diagonal_column(const float *Am, float *Xm, int b0, int c) {
  float x[TB];
#pragma unroll
  for (int i = 0; i < TB; i++) {
    float s = 0.0f; /* x_j = 0 for j < c: those terms add exact zeros */
#pragma unroll
    for (int j = 0; j < i; j++)
      s += Am[(b0 + i) * LDF + b0 + j] * x[j];
    x[i] = i < c ? 0.0f : i == c ? 1.0f : -s;
  }
#pragma unroll
  for (int i = 0; i < TB; i++)
    Xm[(b0 + i) * LDF + b0 + c] = x[i];
}

/* The L2-norm scales of one row of q and k held 4 dims a lane (dims lane + 32 e): rq = scale / |q|,
 * rk = 1 / |k|; squares summed in e order, then an xor tree over the lanes. */
__device__ __forceinline__ void row_norm_scales(const float (&qx)[4], const float (&kx)[4], float scale, float &rq,
                                                float &rk) {
  float qq = 0.0f, kk = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; e++) {
    qq += qx[e] * qx[e];
    kk += kx[e] * kx[e];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    qq += __shfl_xor_sync(0xffffffffu, qq, off);
    kk += __shfl_xor_sync(0xffffffffu, kk, off);
  }
  rq = scale / sqrtf(qq + UPF_GDN_L2_EPS), rk = 1.0f / sqrtf(kk + UPF_GDN_L2_EPS);
}

/* The normalised q tile (CH x D, shared, stride LDA) to the workspace by NTHREADS threads, 16 bytes each. */
template <int NTHREADS> __device__ __forceinline__ void copy_q_rows(const bf16 *Qn, bf16 *qo) {
  for (int e = threadIdx.x; e < CH * D / 8; e += NTHREADS) {
    const int r = e / (D / 8), c = (e % (D / 8)) * 8;
    *reinterpret_cast<uint4 *>(qo + r * D + c) = *reinterpret_cast<const uint4 *>(Qn + r * LDA + c);
  }
}

/* The prep kernel, 8 warps. Scheduled for latency (every sum and rounding is fixed by the math above;
 * only the spreading of the work is a choice):
 *   - the raw q, k, v tiles arrive by cp.async, all 12 pieces of a thread in flight at once and while
 *     the gates and the cumsum run;
 *   - the cumsum reads the 64 gates unrolled;
 *   - the block rows of the inverse run with compile-time bounds (unrolled, loads off the FMA chain);
 *   - each warp takes a 16-row x half-width block of K K^T, Q K^T, W and U;
 *   - the transposed tiles are written two rows at a time (32-bit stores), k^T to the workspace
 *     through a conflict-free (8 dims x 4 row pairs) lane map;
 *   - shared memory 88.8 KB, so that two CTAs share an SM, by reusing regions whose lifetimes do not
 *     overlap:
 *       R0 = [Kn | Qn] (2 CH LDA bf16), then T (CH LDF fp32) and the block-row sums Ys after K K^T, Q K^T;
 *       R1 = [KbT | VbT] (2 D LDB bf16);  R2 = raw v (CH LDA bf16), then A (CH LDF fp32) after the norms.
 * A tensor whose rows are not 16-byte aligned (verify's padded q/k views) is read by 2-byte loads into
 * the same pieces instead (a.rows16). */
constexpr int PREP_THREADS = 256;
constexpr size_t PREP_R0 = (size_t)2 * CH * LDA * sizeof(bf16);
constexpr size_t PREP_R1 = (size_t)2 * D * LDB * sizeof(bf16);
constexpr size_t PREP_R2 = (size_t)CH * LDF * sizeof(float);
constexpr size_t PREP_SMEM = PREP_R0 + PREP_R1 + PREP_R2 + 3 * CH * sizeof(float);
static_assert((size_t)(CH * LDF + (CH / TB - 1) * TB * TB) * sizeof(float) <= PREP_R0, "T and Ys fit in R0");
static_assert((size_t)CH * LDA * sizeof(bf16) <= PREP_R2, "raw v fits in R2");
static_assert(PREP_R0 % 16 == 0 && PREP_R1 % 16 == 0 && PREP_R2 % 16 == 0, "16-byte aligned regions");
static_assert(PREP_THREADS == TB * TB && CH / 16 * 2 == PREP_THREADS / 32, "block-row and warp maps");

/* 8 bf16 from global to a 16-byte aligned shared piece: by cp.async where the source is 16-byte aligned,
 * else by 2-byte loads. */
__device__ __forceinline__ void load_piece(bf16 *dst, const bf16 *src, bool aligned16) {
  if (aligned16) {
    upf_mma::cp_async16(dst, src);
  } else {
    const unsigned short *p = reinterpret_cast<const unsigned short *>(src);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
      w[i] = (uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 16;
    *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__global__ void __launch_bounds__(PREP_THREADS, 2) chunk_prep_kernel(const __grid_constant__ prep_args a) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16 *Kn = reinterpret_cast<bf16 *>(smem); /* [CH][LDA] raw, then normalised k */
  bf16 *Qn = Kn + CH * LDA;                  /* [CH][LDA] raw, then normalised q * scale */
  float *Xm = reinterpret_cast<float *>(smem); /* [CH][LDF] T, over Kn and Qn once they are read */
  float *Ys = Xm + CH * LDF;                   /* [(CH/TB - 1) TB TB] partial sums of one block row of T */
  bf16 *KbT = reinterpret_cast<bf16 *>(smem + PREP_R0); /* [D][LDB] (beta exp(G) k)^T */
  bf16 *VbT = KbT + D * LDB;                               /* [D][LDB] (beta v)^T */
  bf16 *Vr = reinterpret_cast<bf16 *>(smem + PREP_R0 + PREP_R1); /* [CH][LDA] raw v */
  float *Am = reinterpret_cast<float *>(smem + PREP_R0 + PREP_R1); /* [CH][LDF] A, over Vr */
  float *gs = reinterpret_cast<float *>(smem + PREP_R0 + PREP_R1 + PREP_R2), *Gs = gs + CH, *bs = Gs + CH;
  const int n = blockIdx.x, h = blockIdx.y, ratio = a.hv / a.hk, kh = h / ratio;
  const int2 chunk = a.ws.chunks[n];
  const int64_t tok0 = chunk.x;
  const int len = chunk.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int mt = warp & 3, nh = warp >> 2; /* this warp's 16-row block and column half in the products */
  const int64_t ch_h = (int64_t)n * a.hv + h, ch_k = (int64_t)n * a.hk + kh;

  /* Raw rows in flight first; rows past the request's end are zeros. */
  for (int e = tid; e < CH * D / 8; e += PREP_THREADS) {
    const int j = e / (D / 8), c = (e % (D / 8)) * 8;
    if (j < len) {
      const int64_t t = tok0 + j;
      load_piece(Qn + j * LDA + c, (const bf16 *)a.q + t * a.q_s0 + (int64_t)kh * a.q_s1 + c, a.rows16 & 1);
      load_piece(Kn + j * LDA + c, (const bf16 *)a.k + t * a.k_s0 + (int64_t)kh * a.k_s1 + c, a.rows16 & 2);
      load_piece(Vr + j * LDA + c, (const bf16 *)a.v + t * a.v_s0 + (int64_t)h * a.v_s1 + c, a.rows16 & 4);
    } else {
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4 *>(Qn + j * LDA + c) = zero;
      *reinterpret_cast<uint4 *>(Kn + j * LDA + c) = zero;
      *reinterpret_cast<uint4 *>(Vr + j * LDA + c) = zero;
    }
  }
  upf_mma::cp_async_commit();

  gates_to_smem(a, h, tok0, len, gs, bs);
  __syncthreads();
  if (tid < CH) { /* the serial cumsum's bits: the prefix left to right, the trips past tid predicated off */
    float G = 0.0f;
#pragma unroll
    for (int j = 0; j < CH; j++)
      if (j <= tid)
        G += gs[j];
    Gs[tid] = G;
    a.ws.gcum[ch_h * CH + tid] = G;
  }
  upf_mma::cp_async_wait<0>();
  __syncthreads(); /* raw tiles and G visible to every warp */

  /* Norms in place: warp w takes the 4 consecutive row pairs (j, j + 1), j = 8w + 2m; lane holds dims
   * lane + 32 e. The transposed words of (beta exp(G) k)^T and (beta v)^T wait in registers until all 4
   * pairs are done, then lane l stores pair (k + l / 8) mod 4 in round k: word (d, j / 2) sits on bank
   * (36 d + j / 2) mod 32 = 4 (l mod 8) + 4 w + m, so each store hits 32 banks (one pair for the whole
   * warp at a time would hit 8: a 4-way conflict). */
  uint32_t kbw[4][4], vbw[4][4]; /* [pair m][e]: rows (j, j + 1) of dim lane + 32 e, packed */
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const int j = 8 * warp + 2 * m;
    float qx[2][4], kx[2][4], vx[2][4], kb[2][4], vbv[2][4];
#pragma unroll
    for (int rr = 0; rr < 2; rr++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int o = (j + rr) * LDA + lane + 32 * e;
        qx[rr][e] = __bfloat162float(Qn[o]), kx[rr][e] = __bfloat162float(Kn[o]), vx[rr][e] = __bfloat162float(Vr[o]);
      }
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
      float rq, rk;
      row_norm_scales(qx[rr], kx[rr], a.scale, rq, rk);
      const float wb = bs[j + rr] * expf(Gs[j + rr]), vb = bs[j + rr];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int o = (j + rr) * LDA + lane + 32 * e;
        const float kn = kx[rr][e] * rk;
        Kn[o] = __float2bfloat16_rn(kn);
        Qn[o] = __float2bfloat16_rn(qx[rr][e] * rq);
        kb[rr][e] = wb * kn;
        vbv[rr][e] = vb * vx[rr][e];
      }
    }
#pragma unroll
    for (int e = 0; e < 4; e++) {
      kbw[m][e] = pack_bf16(kb[0][e], kb[1][e]);
      vbw[m][e] = pack_bf16(vbv[0][e], vbv[1][e]);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int m = (k + (lane >> 3)) & 3, j = 8 * warp + 2 * m;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int d = lane + 32 * e;
      const uint32_t kw = m == 0 ? kbw[0][e] : m == 1 ? kbw[1][e] : m == 2 ? kbw[2][e] : kbw[3][e];
      const uint32_t vw = m == 0 ? vbw[0][e] : m == 1 ? vbw[1][e] : m == 2 ? vbw[2][e] : vbw[3][e];
      *reinterpret_cast<uint32_t *>(KbT + d * LDB + j) = kw;
      *reinterpret_cast<uint32_t *>(VbT + d * LDB + j) = vw;
    }
  }
  __syncthreads();

  if (h % ratio == 0) { /* the first value head of a key head writes the shared q and k^T */
    copy_q_rows<PREP_THREADS>(Qn, a.ws.qn + ch_k * CH * D);
    bf16 *ko = a.ws.kt + ch_k * D * CH;
    /* a warp covers 8 dims x 4 row pairs: the shared reads hit 16 banks, 2 lanes a word */
    for (int e = tid; e < D * CH / 2; e += PREP_THREADS) {
      const int blk = e >> 5, l = e & 31;
      const int d = (blk & 15) * 8 + (l & 7), j = 2 * ((blk >> 4) * 4 + (l >> 3));
      *reinterpret_cast<__nv_bfloat162 *>(ko + d * CH + j) = __halves2bfloat162(Kn[j * LDA + d], Kn[(j + 1) * LDA + d]);
    }
  }

  { /* A (fp32, shared, over the raw v) and P (bf16, global): warp (mt, nh) owns rows 16mt.., columns 32nh.. */
    float kk[4][4] = {}, qk[4][4] = {};
    warp_mma<4, D>(kk, Kn + 16 * mt * LDA, LDA, Kn + 32 * nh * LDA, LDA);
    warp_mma<4, D>(qk, Qn + 16 * mt * LDA, LDA, Kn + 32 * nh * LDA, LDA);
    store_a_p<4>(kk, qk, 16 * mt, 32 * nh, Gs, bs, Am, a.ws.p + ch_h * CH * CH);
  }
  __syncthreads(); /* A complete; Kn and Qn free for T */

  /* T = (I + A)^-1: the blocks above the diagonal zeroed while warps 0-3 invert the diagonal
   * blocks, then block rows I = 1, 2, 3 (thread = (row r, column c) of each 16 x 16 block). */
  for (int e = tid; e < CH * CH; e += PREP_THREADS) {
    const int i = e / CH, j = e % CH;
    if (j / TB > i / TB)
      Xm[i * LDF + j] = 0.0f;
  }
  if (warp < CH / TB && lane < TB)
    invert_diagonal_column(Am, Xm, TB * warp, lane);
  __syncthreads();
  /* Each A (and T_II) element is loaded once for all the blocks J it multiplies; every sum runs over k
   * in index order. */
  const int r = tid / TB, c = tid % TB;
#pragma unroll
  for (int I = 1; I < CH / TB; I++) {
    const float *ar = Am + (TB * I + r) * LDF;
    float y[CH / TB - 1] = {};
#pragma unroll
    for (int k = 0; k < TB * I; k++) {
      const float av = ar[k];
#pragma unroll
      for (int J = 0; J <= k / TB; J++)
        y[J] += av * Xm[k * LDF + TB * J + c];
    }
#pragma unroll
    for (int J = 0; J < I; J++)
      Ys[J * TB * TB + r * TB + c] = y[J];
    __syncthreads();
    const float *tr = Xm + (TB * I + r) * LDF + TB * I; /* row r of T_II */
    float t[CH / TB - 1] = {};
#pragma unroll
    for (int k = 0; k < TB; k++)
      if (k <= r) {
        const float tv = tr[k];
#pragma unroll
        for (int J = 0; J < I; J++)
          t[J] += tv * Ys[J * TB * TB + k * TB + c];
      }
#pragma unroll
    for (int J = 0; J < I; J++)
      Xm[(TB * I + r) * LDF + TB * J + c] = -t[J];
    __syncthreads();
  }

  /* W = T (beta exp(G) K) and U = T (beta V): warp (mt, nh) writes rows 16mt.., columns 64nh.. */
  const int64_t wu0 = ch_h * CH * D + 16 * mt * D + 64 * nh;
  product_t_times<8>(Xm + 16 * mt * LDF, KbT + 64 * nh * LDB, a.ws.w + wu0);
  product_t_times<8>(Xm + 16 * mt * LDF, VbT + 64 * nh * LDB, a.ws.u + wu0);
}

struct state_args {
  const float *state_in; /* (B, Hv, D, D) or NULL */
  float *state_out;      /* (B, Hv, D, D) or NULL; may be state_in */
  void *o;
  int64_t o_s0, o_s1;
  int hk, hv;
  int o_rows16; /* o's base and strides allow 16-byte row pieces (chunk_out_kernel's coalesced store) */
  chunk_ws ws;
};

constexpr int LDU = BV + 8;
/* O rows i0 + g (+8) of the calling warp's Q S block times exp(G_i). */
template <int NT> __device__ __forceinline__ void scale_rows_exp_g(float (&o)[NT][4], int i0, int g, const float *Gs) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const float eg = expf(Gs[i0 + g + 8 * half]);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
      o[nt][2 * half] *= eg, o[nt][2 * half + 1] *= eg;
  }
}

/* The calling warp's O block (chunk rows i0 + g (+8), those inside the chunk; value columns col0 + 8 nt +
 * 2 t4 (+1)) of value head h to the output. */
template <typename TO, int NT>
__device__ __forceinline__ void store_o_rows(const state_args &a, int2 chunk, int h, int i0, int col0,
                                             const float (&o)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const int i = i0 + g + 8 * half;
    if (i < chunk.y) {
      TO *orow = (TO *)a.o + (int64_t)(chunk.x + i) * a.o_s0 + (int64_t)h * a.o_s1 + col0;
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 2; c++)
          st(orow + 8 * nt + 2 * t4 + c, o[nt][2 * half + c]);
    }
  }
}

/* The state pass. What keeps the serial step per chunk short:
 *   - a stage holds only what the pass reads (W, K^T, U, G: 41.2 KB), so three fit (the next two chunks
 *     in flight) with S^T double-buffered, in 146.8 KB;
 *   - loads and copies are unrolled straight-line code with the per-thread offsets hoisted (generic
 *     runtime loops would cost about 200 instructions a thread a chunk before the first barrier);
 *   - fragments by ldmatrix, S^T, V'^T and (diag .. V')^T stored by stmatrix .trans, U read by ldmatrix
 *     (perf/gdn_state_split_lanes.py checks these lane maps against the scalar fragment maps);
 *   - two barriers a chunk: the next stage is issued after the first barrier, when every warp is past
 *     the previous chunk's reads of that stage, and S^T alternates between two buffers, so its copy to
 *     the workspace sits behind the second barrier (off the W S phase) with nothing to guard.
 * Per chunk n (stage n % 3, S^T buffer n % 2): S^T to shared; wait for stage n; barrier 1; issue stage
 * n + 2; V' = U - W S to VpT, VdT; barrier 2; S^T and V'^T to the workspace, S <- e^G_L S + K^T VdT.
 * Hazards, each write against the last read of its buffer: stage (n + 2) % 3 was last read in chunk
 * n - 1 (before barrier 1 of n); S^T buffer n % 2 in chunk n - 2 (before barrier 1 of n - 1); VpT, VdT
 * in chunk n - 1's second phase (before barrier 1 of n, and the writes come after it). */
constexpr int STATE_STAGES = 3;
constexpr size_t STATE_STAGE_BYTES = (size_t)(CH * LDA + D * LDB + CH * LDU) * sizeof(bf16) + CH * sizeof(float);
constexpr size_t STATE_SMEM = STATE_STAGES * STATE_STAGE_BYTES + (size_t)(2 * BV * LDA + 2 * BV * LDB) * sizeof(bf16);
constexpr int STATE_THREADS = 256;
static_assert(STATE_STAGE_BYTES % 16 == 0, "stages must keep 16-byte alignment");
static_assert(CH * D / 8 % STATE_THREADS == 0 && D * CH / 8 % STATE_THREADS == 0 && CH * BV / 8 == STATE_THREADS,
              "whole 16-byte pieces a thread: W, K^T four each, U one");
static_assert(BV * D / 8 % STATE_THREADS == 0 && BV * CH / 8 % STATE_THREADS == 0, "whole copy pieces a thread");

/* A thread's 16-byte pieces of one stage and of the two workspace copies: offsets in elements, fixed for
 * the kernel (piece i of W adds 16 rows, of K^T 32 rows, of S^T 16 rows). */
struct state_lane_map {
  int w_s, w_g;   /* W: row tid / 16, col 8 (tid % 16); shared (stride LDA) and global (stride D) */
  int k_s, k_g;   /* K^T: row tid / 8, col 8 (tid % 8); LDB, CH */
  int u_s, u_g;   /* U: row tid / 4, col 8 (tid % 4); LDU, D */
  int st_s, st_g; /* S^T copy: row tid / 16, col 8 (tid % 16); LDA, D */
  int vp_s, vp_g; /* V'^T copy: row tid / 8, col 8 (tid % 8); LDB, CH */
};

__device__ __forceinline__ state_lane_map state_lanes() {
  const int t = threadIdx.x;
  state_lane_map m;
  m.w_s = (t >> 4) * LDA + (t & 15) * 8, m.w_g = (t >> 4) * D + (t & 15) * 8;
  m.k_s = (t >> 3) * LDB + (t & 7) * 8, m.k_g = (t >> 3) * CH + (t & 7) * 8;
  m.u_s = (t >> 2) * LDU + (t & 3) * 8, m.u_g = (t >> 2) * D + (t & 3) * 8;
  m.st_s = m.w_s, m.st_g = m.w_g;
  m.vp_s = m.k_s, m.vp_g = m.k_g;
  return m;
}

/* The global rows of the next chunk to load (this thread's pieces): W, K^T, U (columns v0..), G of
 * value head h, key head kh; `next` steps them one chunk on. */
struct state_src {
  const bf16 *w, *k, *u;
  const float *g;
  int64_t dw, dk, dg; /* elements a chunk: Hv CH D, Hk D CH, Hv CH */
  __device__ __forceinline__ void next() { w += dw, k += dk, u += dw, g += dg; }
};

__device__ __forceinline__ state_src state_source(const state_args &a, const state_lane_map &m, int64_t n, int h,
                                                  int kh, int v0) {
  const int64_t ch_h = n * a.hv + h, ch_k = n * a.hk + kh;
  state_src src;
  src.w = a.ws.w + ch_h * CH * D + m.w_g, src.k = a.ws.kt + ch_k * D * CH + m.k_g;
  src.u = a.ws.u + ch_h * CH * D + v0 + m.u_g, src.g = a.ws.gcum + ch_h * CH + 4 * threadIdx.x;
  src.dw = (int64_t)a.hv * CH * D, src.dk = (int64_t)a.hk * D * CH, src.dg = (int64_t)a.hv * CH;
  return src;
}

/* cp.async of one chunk's W, K^T, U, G (src) into one stage: ten 16-byte pieces a thread (G: threads 0-15). */
__device__ __forceinline__ void load_stage(const state_src &src, const state_lane_map &m, unsigned char *stage) {
  bf16 *Ws = reinterpret_cast<bf16 *>(stage), *Ks = Ws + CH * LDA, *Us = Ks + D * LDB;
  float *Gs = reinterpret_cast<float *>(Us + CH * LDU);
#pragma unroll
  for (int i = 0; i < CH * D / 8 / STATE_THREADS; i++)
    upf_mma::cp_async16(Ws + m.w_s + i * 16 * LDA, src.w + i * 16 * D);
#pragma unroll
  for (int i = 0; i < D * CH / 8 / STATE_THREADS; i++)
    upf_mma::cp_async16(Ks + m.k_s + i * 32 * LDB, src.k + i * 32 * CH);
  upf_mma::cp_async16(Us + m.u_s, src.u);
  if (threadIdx.x < CH / 4)
    upf_mma::cp_async16(Gs + 4 * threadIdx.x, src.g);
}

/* V' = U - W S (vp = W S of the calling warp's rows i0 + g (+8), columns cw + 8 nt + 2 t4 (+1)) as bf16 into
 * VpT and, decayed by exp(G_last - G_i), into VdT, both [column][LDB]; U by one ldmatrix, each transposed
 * tile by one stmatrix. */
__device__ __forceinline__ void store_vprime(const float (&vp)[2][4], int i0, int cw, const bf16 *Us,
                                                   const float *Gs, float GL, bf16 *VpT, bf16 *VdT) {
  const int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 7, mi = lane >> 3; /* matrix mi: nt mi/2, half mi%2 */
  uint32_t u[4];
  upf_mma::ldsm_x4(u, Us + (i0 + 8 * (mi & 1) + j) * LDU + cw + 8 * (mi >> 1)); /* u[2 nt + half]: row g, cols 2t4.. */
  uint32_t pv[4], pd[4];
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const float ed = expf(GL - Gs[i0 + g + 8 * half]);
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
      const uint32_t uu = u[2 * nt + half];
      const float v0 = __uint_as_float(uu << 16) - vp[nt][2 * half];          /* bf16 -> fp32, exact */
      const float v1 = __uint_as_float(uu & 0xffff0000u) - vp[nt][2 * half + 1];
      pv[2 * nt + half] = pack_bf16(v0, v1);
      pd[2 * nt + half] = pack_bf16(v0 * ed, v1 * ed);
    }
  }
  const int off = (cw + 8 * (mi >> 1) + j) * LDB + i0 + 8 * (mi & 1); /* row = value column, 8 chunk rows */
  upf_mma::stsm_x4_trans(VpT + off, pv[0], pv[1], pv[2], pv[3]);
  upf_mma::stsm_x4_trans(VdT + off, pd[0], pd[1], pd[2], pd[3]);
}

__global__ void __launch_bounds__(STATE_THREADS, 1) chunk_state_kernel(const __grid_constant__ state_args a) {
  constexpr int NT = BV / 8, NVB = D / BV;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16 *St2 = reinterpret_cast<bf16 *>(smem + STATE_STAGES * STATE_STAGE_BYTES); /* 2 x [BV][LDA] S^T, bf16 */
  bf16 *VpT = St2 + 2 * BV * LDA;                                                  /* [BV][LDB] V'^T */
  bf16 *VdT = VpT + BV * LDB;                                    /* [BV][LDB] (diag(exp(G_L - G)) V')^T */
  const int vb = blockIdx.x % NVB, h = (blockIdx.x / NVB) % a.hv, r = blockIdx.x / (NVB * a.hv);
  const int kh = h / (a.hv / a.hk), v0 = vb * BV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int j = lane & 7, mi = lane >> 3;
  const int64_t soff = ((int64_t)r * a.hv + h) * D * D;
  const state_lane_map m = state_lanes();

  float s[NT][4]; /* S rows 16 warp + g (+8), columns v0 + 8 nt + 2 t4 (+1) */
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      const int d = 16 * warp + g + 8 * (c >> 1), v = v0 + 8 * nt + 2 * t4 + (c & 1);
      s[nt][c] = a.state_in ? a.state_in[soff + (int64_t)d * D + v] : 0.0f;
    }

  const int c0 = a.ws.req_chunk0[r], c1 = a.ws.req_chunk0[r + 1];
  state_src src = state_source(a, m, c0, h, kh, v0);
#pragma unroll
  for (int p = 0; p < STATE_STAGES - 1; p++) { /* one group a stage, empty past the request's end */
    if (c0 + p < c1)
      load_stage(src, m, smem + p * STATE_STAGE_BYTES);
    src.next();
    upf_mma::cp_async_commit();
  }
  const int i0 = 16 * (warp & 3), cw = 16 * (warp >> 2);
  const int64_t ch_h0 = (int64_t)c0 * a.hv + h, dst = (int64_t)a.hv * D * D, dvp = (int64_t)a.hv * D * CH;
  bf16 *sto = a.ws.st + (ch_h0 * D + v0) * D + m.st_g, *vpo = a.ws.vpt + (ch_h0 * D + v0) * CH + m.vp_g;
  /* stmatrix rows of this lane: matrix mi = (n-tile 2 p + mi / 2, row half mi % 2) of the S block */
  const int st_lane = (8 * (mi >> 1) + j) * LDA + 16 * warp + 8 * (mi & 1);
  for (int n = c0, it = 0, sl = 0; n < c1; n++, it++, sl = sl + 1 == STATE_STAGES ? 0 : sl + 1) {
    bf16 *St = St2 + (it & 1) * BV * LDA;
#pragma unroll
    for (int p = 0; p < NT / 2; p++) /* S^T rounded to bf16: n-tiles 2p, 2p + 1, rows g and g + 8 */
      upf_mma::stsm_x4_trans(St + st_lane + 16 * p * LDA, pack_bf16(s[2 * p][0], s[2 * p][1]),
                             pack_bf16(s[2 * p][2], s[2 * p][3]), pack_bf16(s[2 * p + 1][0], s[2 * p + 1][1]),
                             pack_bf16(s[2 * p + 1][2], s[2 * p + 1][3]));
    upf_mma::cp_async_wait<STATE_STAGES - 2>(); /* this thread's pieces of chunk n's stage */
    __syncthreads(); /* chunk n's stage and S^T visible; every warp past chunk n - 1 */
    const unsigned char *stage = smem + (size_t)sl * STATE_STAGE_BYTES;
    const bf16 *Ws = reinterpret_cast<const bf16 *>(stage), *Ks = Ws + CH * LDA, *Us = Ks + D * LDB;
    const float *Gs = reinterpret_cast<const float *>(Us + CH * LDU);
    const float GL = Gs[CH - 1];
    {
      float vp[2][4] = {};
      upf_mma::warp_mma_ldsm<2, D>(vp, Ws + i0 * LDA, LDA, St + cw * LDA, LDA); /* W S, columns cw..cw+15 */
      /* chunk n + 2 into the stage chunk n - 1 used, issued behind the W S chain's loads */
      if (n + STATE_STAGES - 1 < c1)
        load_stage(src, m, smem + (size_t)(sl == 0 ? STATE_STAGES - 1 : sl - 1) * STATE_STAGE_BYTES);
      src.next();
      upf_mma::cp_async_commit();
      store_vprime(vp, i0, cw, Us, Gs, GL, VpT, VdT);
    }
    __syncthreads(); /* V' complete */
    const float eL = expf(GL);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int c = 0; c < 4; c++)
        s[nt][c] *= eL;
    upf_mma::warp_mma_ldsm<NT, CH>(s, Ks + 16 * warp * LDB, LDB, VdT, LDB); /* + K^T diag(..) V' */
    /* S^T (as rounded for W S) and V'^T to the workspace for chunk_out_kernel: rows v0.. of chunk n */
#pragma unroll
    for (int i = 0; i < BV * D / 8 / STATE_THREADS; i++)
      *reinterpret_cast<uint4 *>(sto + i * 16 * D) = *reinterpret_cast<const uint4 *>(St + m.st_s + i * 16 * LDA);
    *reinterpret_cast<uint4 *>(vpo) = *reinterpret_cast<const uint4 *>(VpT + m.vp_s);
    sto += dst, vpo += dvp;
  }
  upf_mma::cp_async_wait<0>(); /* nothing may land after the CTA exits (only empty groups are left) */
  if (a.state_out)
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int d = 16 * warp + g + 8 * (c >> 1), v = v0 + 8 * nt + 2 * t4 + (c & 1);
        a.state_out[soff + (int64_t)d * D + v] = s[nt][c];
      }
}

/* O, one CTA (8 warps) per (chunk, value head), all independent: O = diag(exp(G)) Q S + P V' from the
 * workspace's normalised q, P, G and the state pass's S^T and V'^T (bf16, the operands as the state pass
 * rounded them). Warp (mt, nh) owns rows 16mt.., columns 64nh... */
constexpr int OUT_THREADS = 256;
constexpr size_t OUT_SMEM = (size_t)(CH * LDA + D * LDA + CH * LDB + D * LDB) * sizeof(bf16) + CH * sizeof(float);

template <typename TO> __global__ void __launch_bounds__(OUT_THREADS, 2) chunk_out_kernel(const __grid_constant__ state_args a) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16 *Qs = reinterpret_cast<bf16 *>(smem); /* [CH][LDA] */
  bf16 *St = Qs + CH * LDA;                  /* [D][LDA] S^T */
  bf16 *Ps = St + D * LDA;                   /* [CH][LDB] */
  bf16 *VpT = Ps + CH * LDB;                 /* [D][LDB] V'^T */
  float *Gs = reinterpret_cast<float *>(VpT + D * LDB);
  const int n = blockIdx.x, h = blockIdx.y, kh = h / (a.hv / a.hk);
  const int64_t ch_h = (int64_t)n * a.hv + h, ch_k = (int64_t)n * a.hk + kh;
  const bf16 *q = a.ws.qn + ch_k * CH * D, *sT = a.ws.st + ch_h * D * D;
  const bf16 *p = a.ws.p + ch_h * CH * CH, *vpt = a.ws.vpt + ch_h * D * CH;
  for (int e = threadIdx.x; e < D * D / 8; e += OUT_THREADS) {
    const int r = e >> 4, c = (e & 15) * 8;
    upf_mma::cp_async16(St + r * LDA + c, sT + r * D + c);
    if (r < CH)
      upf_mma::cp_async16(Qs + r * LDA + c, q + r * D + c);
  }
  for (int e = threadIdx.x; e < D * CH / 8; e += OUT_THREADS) {
    const int r = e >> 3, c = (e & 7) * 8;
    upf_mma::cp_async16(VpT + r * LDB + c, vpt + r * CH + c);
    if (r < CH)
      upf_mma::cp_async16(Ps + r * LDB + c, p + r * CH + c);
  }
  if (threadIdx.x < CH / 4)
    upf_mma::cp_async16(Gs + 4 * threadIdx.x, a.ws.gcum + ch_h * CH + 4 * threadIdx.x);
  upf_mma::cp_async_commit();
  upf_mma::cp_async_wait<0>();
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int i0 = 16 * (warp & 3), c0 = 64 * (warp >> 2);
  float o[8][4] = {};
  warp_mma<8, D>(o, Qs + i0 * LDA, LDA, St + c0 * LDA, LDA); /* Q S */
  scale_rows_exp_g<8>(o, i0, g, Gs);
  warp_mma<8, CH>(o, Ps + i0 * LDB, LDB, VpT + c0 * LDB, LDB); /* + P V' */
  const int2 chunk = a.ws.chunks[n];
  if (!a.o_rows16) {
    store_o_rows<TO, 8>(a, chunk, h, i0, c0, o);
    return;
  }
  /* The O tile through shared memory (over Qs and St, read by every warp before the barrier), then
   * rows of 16-byte pieces to global: whole sectors, where store_o_rows writes one element a lane. */
  constexpr int LDO = D + 8; /* 16-byte rows, conflict-free fragment writes */
  static_assert((size_t)CH * LDO * sizeof(TO) <= OUT_SMEM, "the O tile fits in the shared memory");
  TO *Os = reinterpret_cast<TO *>(smem);
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < 8; nt++)
#pragma unroll
    for (int c = 0; c < 4; c++)
      st(Os + (i0 + g + 8 * (c >> 1)) * LDO + c0 + 8 * nt + 2 * t4 + (c & 1), o[nt][c]);
  __syncthreads();
  constexpr int PPR = D * (int)sizeof(TO) / 16; /* 16-byte pieces per row */
  for (int e = threadIdx.x; e < chunk.y * PPR; e += OUT_THREADS) {
    const int i = e / PPR, pc = e % PPR;
    TO *orow = (TO *)a.o + (int64_t)(chunk.x + i) * a.o_s0 + (int64_t)h * a.o_s1;
    reinterpret_cast<uint4 *>(orow)[pc] = reinterpret_cast<const uint4 *>(Os + i * LDO)[pc];
  }
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* The state pass (chunk_state_kernel), then chunk_out_kernel over (chunk, value head). */
template <typename TO> upf_status launch_state(const state_args &s, unsigned grid, int64_t nch) {
  static bool state_attr_set;
  UPF_TRY(upf_cuda_smem_prepare(chunk_state_kernel, STATE_SMEM, false, &state_attr_set,
                                "chunk_state_kernel"));
  chunk_state_kernel<<<grid, STATE_THREADS, STATE_SMEM, upf_cuda_stream()>>>(s);
  UPF_CUDA_LAUNCH_TRY("chunk_state_kernel");
  static bool attr_set;
  UPF_TRY(upf_cuda_smem_prepare(chunk_out_kernel<TO>, OUT_SMEM, false, &attr_set, "chunk_out_kernel"));
  if (nch > 0) {
    chunk_out_kernel<TO><<<dim3((unsigned)nch, (unsigned)s.hv), OUT_THREADS, OUT_SMEM, upf_cuda_stream()>>>(s);
    UPF_CUDA_LAUNCH_TRY("chunk_out_kernel");
  }
  return UPF_OK;
}

/* prep_args.rows16: which of q, k, v (bits 0, 1, 2) have 16-byte aligned rows (base, token and head
 * strides), so that the prep kernel may copy them by cp.async. */
int rows_16byte_aligned(const upf_gdn_scan_inputs *in) {
  const upf_tensor *t[3] = {in->q, in->k, in->v};
  int mask = 0;
  for (int i = 0; i < 3; i++)
    if (((uintptr_t)t[i]->data & 15) == 0 && t[i]->stride[0] % 8 == 0 && t[i]->stride[1] % 8 == 0)
      mask |= 1 << i;
  return mask;
}

} // namespace

extern "C" int upf_cuda_gdn_scan_chunked_fits(const upf_gdn_scan_inputs *in) {
  return in->v->dtype == UPF_DTYPE_BF16 && in->q->shape[2] == D && in->v->shape[2] == D &&
         upf_cuda_smem_optin() >= PREP_SMEM && upf_cuda_smem_optin() >= OUT_SMEM &&
         upf_cuda_smem_optin() >= STATE_SMEM;
}

extern "C" upf_status upf_cuda_gdn_scan_chunked(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in,
                                                const upf_tensor *o, const upf_tensor *state_out) {
  const int32_t B = batch->num_reqs;
  const int64_t Hk = in->q->shape[1], Hv = in->v->shape[1];
  const int32_t *cu = batch->cu_seqlens_host;
  /* The plan: every request's chunks in order, and each request's first chunk. */
  std::vector<int2> chunks;
  std::vector<int32_t> req_chunk0((size_t)B + 1);
  for (int32_t r = 0; r < B; r++) {
    req_chunk0[r] = (int32_t)chunks.size();
    for (int32_t s0 = cu[r]; s0 < cu[r + 1]; s0 += CH)
      chunks.push_back(make_int2(s0, cu[r + 1] - s0 < CH ? cu[r + 1] - s0 : CH));
  }
  req_chunk0[B] = (int32_t)chunks.size();
  const int64_t nch = (int64_t)chunks.size();
  if ((int64_t)B * Hv * (D / BV) > INT32_MAX || Hv > 65535)
    return upf_fail(UPF_ERR_SHAPE, "gdn.scan (cuda, chunked): %d requests x %lld heads exceed the grid", B,
                    (long long)Hv);
  const size_t plan_bytes = align256(chunks.size() * sizeof(int2)) + align256(req_chunk0.size() * sizeof(int32_t));
  const size_t wu_bytes = align256((size_t)nch * Hv * CH * D * sizeof(bf16));
  const size_t p_bytes = align256((size_t)nch * Hv * CH * CH * sizeof(bf16));
  const size_t g_bytes = align256((size_t)nch * Hv * CH * sizeof(float));
  const size_t qk_bytes = align256((size_t)nch * Hk * CH * D * sizeof(bf16));
  const size_t st_bytes = align256((size_t)nch * Hv * D * D * sizeof(bf16));
  const size_t vpt_bytes = align256((size_t)nch * Hv * D * CH * sizeof(bf16));
  void *wsp = nullptr;
  UPF_TRY(upf_cuda_workspace(plan_bytes + 2 * wu_bytes + p_bytes + g_bytes + 2 * qk_bytes + st_bytes + vpt_bytes, &wsp));
  unsigned char *base = (unsigned char *)wsp;
  std::vector<unsigned char> plan(plan_bytes, 0);
  memcpy(plan.data(), chunks.data(), chunks.size() * sizeof(int2));
  memcpy(plan.data() + align256(chunks.size() * sizeof(int2)), req_chunk0.data(), req_chunk0.size() * sizeof(int32_t));
  UPF_TRY(upf_cuda_upload_async(base, plan.data(), plan_bytes));
  chunk_ws ws;
  ws.chunks = (const int2 *)base;
  ws.req_chunk0 = (const int32_t *)(base + align256(chunks.size() * sizeof(int2)));
  unsigned char *cur = base + plan_bytes;
  ws.w = (bf16 *)cur, cur += wu_bytes;
  ws.u = (bf16 *)cur, cur += wu_bytes;
  ws.p = (bf16 *)cur, cur += p_bytes;
  ws.gcum = (float *)cur, cur += g_bytes;
  ws.qn = (bf16 *)cur, cur += qk_bytes;
  ws.kt = (bf16 *)cur, cur += qk_bytes;
  ws.st = (bf16 *)cur, cur += st_bytes;
  ws.vpt = (bf16 *)cur;

  if (nch > 0) {
    prep_args pa = {};
    pa.q = in->q->data, pa.q_s0 = in->q->stride[0], pa.q_s1 = in->q->stride[1];
    pa.k = in->k->data, pa.k_s0 = in->k->stride[0], pa.k_s1 = in->k->stride[1];
    pa.v = in->v->data, pa.v_s0 = in->v->stride[0], pa.v_s1 = in->v->stride[1];
    pa.a = in->a->data, pa.a_s0 = in->a->stride[0];
    pa.b = in->b->data, pa.b_s0 = in->b->stride[0];
    pa.a_log = (const float *)in->a_log->data, pa.dt_bias = (const float *)in->dt_bias->data;
    pa.hk = (int)Hk, pa.hv = (int)Hv, pa.scale = in->scale;
    pa.ws = ws;
    if (nch > INT32_MAX)
      return upf_fail(UPF_ERR_SHAPE, "gdn.scan (cuda, chunked): %lld chunks exceed the grid", (long long)nch);
    const dim3 grid((unsigned)nch, (unsigned)Hv);
    pa.rows16 = rows_16byte_aligned(in);
    static bool attr_set;
    UPF_TRY(upf_cuda_smem_prepare(chunk_prep_kernel, PREP_SMEM, false, &attr_set, "chunk_prep_kernel"));
    chunk_prep_kernel<<<grid, PREP_THREADS, PREP_SMEM, upf_cuda_stream()>>>(pa);
    UPF_CUDA_LAUNCH_TRY("chunk_prep_kernel");
  }
  state_args sa = {};
  sa.state_in = in->state_in ? (const float *)in->state_in->data : nullptr;
  sa.state_out = state_out ? (float *)state_out->data : nullptr;
  sa.o = o->data, sa.o_s0 = o->stride[0], sa.o_s1 = o->stride[1];
  const int64_t per16 = 16 / (int64_t)upf_dtype_size(o->dtype); /* elements in 16 bytes */
  sa.o_rows16 = ((uintptr_t)o->data & 15) == 0 && sa.o_s0 % per16 == 0 && sa.o_s1 % per16 == 0;
  sa.hk = (int)Hk, sa.hv = (int)Hv;
  sa.ws = ws;
  const unsigned grid = (unsigned)((int64_t)B * Hv * (D / BV));
  if (grid == 0)
    return UPF_OK;
  return o->dtype == UPF_DTYPE_BF16 ? launch_state<bf16>(sa, grid, nch)
                                    : launch_state<float>(sa, grid, nch);
}

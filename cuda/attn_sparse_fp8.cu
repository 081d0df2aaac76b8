/* The FP8 variant of attn.block_sparse (attn.block_sparse=fp8; bf16 in and out, D = 128): the E4M3 copies
 * its kernel (cuda/attn_sparse_hopper.cu, bs_wgmma_kernel<128, false, true>) reads, made on the stream
 * before it runs, with no host round trip. Two passes over q, the requests' K/V rows (contiguous or through the page table; a cache slot
 * no request owns is never read) and, with mean correction, the means of each request's key blocks: the
 * first takes max |x| per tensor (q; k with kbar; v with vbar) into device words, the second reads the
 * power-of-two scales from them (uniprefill/fp8.h) and writes x / scale rounded to E4M3 (saturating):
 *   q8 (Tq, Hq, 128);
 *   k8 (KVP, Hkv, 128), request r's rows from base8[r] = the sum of the earlier requests' kv_len rounded up
 *     to 64, rows past kv_len zero;
 *   vt8 (Hkv, 128, KVP): the same rows as columns, each aligned 16 in bs_fp8_key_at order;
 *   kbar8 (B, MKBP, Hkv, 128) and vbart8 (B, Hkv, 128, MKBP) the same way, zero past a request's blocks.
 * The rows pass is one CTA a 64-row block and KV head: K-like rows go straight out, V-like rows through
 * shared memory to be written as 64-byte column runs. The tiles' kv_base becomes base8[r] for the kernel. */
#include <stdlib.h>

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/attn_sparse_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "uniprefill/fp8.h"

namespace upf_bsattn {
namespace {

typedef __nv_bfloat16 bf16_t;

constexpr int QZ_THREADS = 256;
constexpr int QZ_ROWS = 64; /* rows (keys or key blocks) a rows-pass CTA */

/* Where the quantised copies go and what the rows pass walks. */
struct fp8_prep {
  uint8_t *q8, *k8, *vt8, *kbar8, *vbart8;
  uint32_t *amax;
  const int32_t *base8;    /* (B + 1) */
  const int32_t *kv_start; /* (B): contiguous K/V, the request's first row */
  const int32_t *kv_len;   /* (B) */
  int64_t kvp, tq;
  int32_t nreq, mkb, mkbp;
};

/* 16 bf16 from a 16-byte aligned address. */
__device__ __forceinline__ void load16(const bf16_t *p, float (&x)[16]) {
  const uint4 u0 = *reinterpret_cast<const uint4 *>(p), u1 = *reinterpret_cast<const uint4 *>(p + 8);
  const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162 *>(&w[i]);
    x[2 * i] = __low2float(b), x[2 * i + 1] = __high2float(b);
  }
}

/* 16 values times inv as E4M3, first value in the low byte. */
__device__ __forceinline__ uint4 quant16(const float (&x)[16], float inv) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i] * inv, x[4 * i + 1] * inv), __NV_SATFINITE,
                                                 __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i + 2] * inv, x[4 * i + 3] * inv), __NV_SATFINITE,
                                                 __NV_E4M3);
    w[i] = (lo & 0xffffu) | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float absmax16(const float (&x)[16], float m) {
#pragma unroll
  for (int i = 0; i < 16; i++)
    m = fmaxf(m, fabsf(x[i])); /* fmaxf drops a NaN */
  return m;
}

/* One warp's max into amax[i] (non-negative floats order as their bits). */
__device__ __forceinline__ void amax_commit(uint32_t *amax, int i, float m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0 && m > 0.0f)
    atomicMax(amax + i, __float_as_uint(m));
}

__device__ __forceinline__ float inv_scale(const uint32_t *amax, int i) {
  return 1.0f / upf_fp8_pow2_scale(__uint_as_float(amax[i]));
}

/* q: 16 elements a thread (8 a row of D = 128). QUANT = false: max |q| into amax[0]. */
template <bool QUANT>
__global__ void fp8_q_kernel(const __grid_constant__ bs_args a, const __grid_constant__ fp8_prep f) {
  const int64_t n = f.tq * a.hq * 8;
  const float inv = QUANT ? inv_scale(f.amax, 0) : 0.0f;
  float m = 0.0f;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / (a.hq * 8), h = (i / 8) % a.hq, c = i % 8;
    float x[16];
    load16((const bf16_t *)a.q + t * a.q_s0 + h * a.q_s1 + c * 16, x);
    if (QUANT)
      *reinterpret_cast<uint4 *>(f.q8 + i * 16) = quant16(x, inv);
    else
      m = absmax16(x, m);
  }
  if (!QUANT)
    amax_commit(f.amax, 0, m);
}

/* Rows of one 64-row block and KV head: K/V rows of a request (MEANS = false; the block's request by a
 * search of base8) or candidate blocks of one request (MEANS; MKBP / 64 blocks a request). Thread tid takes
 * row tid / 4, dims 32 (tid % 4) .. + 31. QUANT = false: the maxima into amax[1] and amax[2]. */
template <bool QUANT, bool MEANS, bool PAGED>
__global__ void __launch_bounds__(QZ_THREADS) fp8_rows_kernel(const __grid_constant__ bs_args a,
                                                             const __grid_constant__ fp8_prep f) {
  __shared__ __align__(16) uint8_t vs[QZ_ROWS][128 + 16];
  const int blk = blockIdx.x, h = blockIdx.y, rr = threadIdx.x >> 2, d0 = (threadIdx.x & 3) * 32;
  int req, row, nrows; /* the request, the block's first row within it, its rows (kv_len or key blocks) */
  if (MEANS) {
    req = blk / (f.mkbp / QZ_ROWS), row = (blk % (f.mkbp / QZ_ROWS)) * QZ_ROWS;
    nrows = (f.kv_len[req] + a.block_n - 1) / a.block_n;
  } else {
    int lo = 0, hi = f.nreq - 1; /* the last request with base8 <= blk 64 */
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (f.base8[mid] <= blk * QZ_ROWS)
        lo = mid;
      else
        hi = mid - 1;
    }
    req = lo, row = blk * QZ_ROWS - f.base8[req], nrows = f.kv_len[req];
  }
  const int at = row + rr;
  const bool valid = at < nrows;
  const bf16_t *kp = nullptr, *vp = nullptr;
  if (valid) {
    if (MEANS) {
      const int64_t off = (((int64_t)req * f.mkb + at) * a.hkv + h) * 128 + d0;
      kp = (const bf16_t *)a.kbar + off, vp = (const bf16_t *)a.vbar + off;
    } else if (PAGED) {
      const int64_t page = a.block_table[(int64_t)req * a.max_blocks + at / a.page_size], slot = at % a.page_size;
      kp = (const bf16_t *)a.k + page * a.k_s0 + slot * a.k_s1 + (int64_t)h * a.k_s2 + d0;
      vp = (const bf16_t *)a.v + page * a.v_s0 + slot * a.v_s1 + (int64_t)h * a.v_s2 + d0;
    } else {
      const int64_t kr = (int64_t)f.kv_start[req] + at;
      kp = (const bf16_t *)a.k + kr * a.k_s0 + (int64_t)h * a.k_s1 + d0;
      vp = (const bf16_t *)a.v + kr * a.v_s0 + (int64_t)h * a.v_s1 + d0;
    }
  }
  if (!QUANT) {
    float mk = 0.0f, mv = 0.0f;
    if (valid) {
#pragma unroll
      for (int half = 0; half < 2; half++) {
        float x[16];
        load16(kp + 16 * half, x);
        mk = absmax16(x, mk);
        load16(vp + 16 * half, x);
        mv = absmax16(x, mv);
      }
    }
    amax_commit(f.amax, 1, mk);
    amax_commit(f.amax, 2, mv);
    return;
  }
  const float ik = inv_scale(f.amax, 1), iv = inv_scale(f.amax, 2);
  uint8_t *kdst = MEANS ? f.kbar8 + (((int64_t)req * f.mkbp + at) * a.hkv + h) * 128 + d0
                        : f.k8 + ((int64_t)blk * QZ_ROWS + rr) * a.hkv * 128 + (int64_t)h * 128 + d0;
#pragma unroll
  for (int half = 0; half < 2; half++) {
    uint4 kq = make_uint4(0, 0, 0, 0), vq = make_uint4(0, 0, 0, 0);
    if (valid) {
      float x[16];
      load16(kp + 16 * half, x);
      kq = quant16(x, ik);
      load16(vp + 16 * half, x);
      vq = quant16(x, iv);
    }
    *reinterpret_cast<uint4 *>(kdst + 16 * half) = kq;
    *reinterpret_cast<uint4 *>(&vs[rr][d0 + 16 * half]) = vq;
  }
  __syncthreads();
  /* V^T: dim row d, 16 keys (slot-ordered) a store; 128 x 4 stores, two a thread */
  const int64_t ld = MEANS ? f.mkbp : f.kvp;
  uint8_t *vt = MEANS ? f.vbart8 + ((int64_t)req * a.hkv + h) * 128 * ld + row
                      : f.vt8 + (int64_t)h * 128 * ld + (int64_t)blk * QZ_ROWS;
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int idx = threadIdx.x + QZ_THREADS * j, d = idx >> 2, cc = idx & 3;
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; b++)
        word |= (uint32_t)vs[16 * cc + bs_fp8_key_at(4 * q + b)][d] << (8 * b);
      w[q] = word;
    }
    *reinterpret_cast<uint4 *>(vt + (int64_t)d * ld + 16 * cc) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <bool QUANT> upf_status launch_passes(const bs_args &a, const fp8_prep &f, bool paged, bool means) {
  const int64_t qchunks = f.tq * a.hq * 8;
  const unsigned qgrid =
      (unsigned)std::min<int64_t>((qchunks + QZ_THREADS - 1) / QZ_THREADS, 8 * (int64_t)upf_cuda_num_sms());
  if (qchunks > 0) {
    fp8_q_kernel<QUANT><<<qgrid, QZ_THREADS, 0, upf_cuda_stream()>>>(a, f);
    UPF_CUDA_LAUNCH_TRY("fp8_q_kernel");
  }
  const dim3 kvgrid((unsigned)(f.kvp / QZ_ROWS), (unsigned)a.hkv);
  if (f.kvp > 0) {
    if (paged)
      fp8_rows_kernel<QUANT, false, true><<<kvgrid, QZ_THREADS, 0, upf_cuda_stream()>>>(a, f);
    else
      fp8_rows_kernel<QUANT, false, false><<<kvgrid, QZ_THREADS, 0, upf_cuda_stream()>>>(a, f);
    UPF_CUDA_LAUNCH_TRY("fp8_rows_kernel (k, v)");
  }
  if (means) {
    const dim3 mgrid((unsigned)((int64_t)f.nreq * f.mkbp / QZ_ROWS), (unsigned)a.hkv);
    fp8_rows_kernel<QUANT, true, false><<<mgrid, QZ_THREADS, 0, upf_cuda_stream()>>>(a, f);
    UPF_CUDA_LAUNCH_TRY("fp8_rows_kernel (kbar, vbar)");
  }
  return UPF_OK;
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

} // namespace

upf_status bs_run_fp8(bs_args a, bool paged, bs_tile *tiles, int ntiles, int32_t nreq, const int32_t *kv_len,
                      const int32_t *kv_start, int64_t tq) {
  const bool means = a.kbar != nullptr;
  int32_t *ints = (int32_t *)malloc((size_t)(3 * nreq + 1) * sizeof(int32_t));
  if (!ints)
    return upf_fail(UPF_ERR_NOMEM, "attn.block_sparse (cuda, fp8): %d requests", nreq);
  int32_t *base8 = ints, *starts = ints + nreq + 1, *lens = starts + nreq;
  int64_t kvp = 0;
  for (int32_t r = 0; r < nreq; r++) {
    base8[r] = (int32_t)kvp;
    starts[r] = kv_start ? kv_start[r] : 0, lens[r] = kv_len[r];
    kvp += ((int64_t)kv_len[r] + QZ_ROWS - 1) / QZ_ROWS * QZ_ROWS;
  }
  if (kvp > INT32_MAX) {
    free(ints);
    return upf_fail(UPF_ERR_UNSUPPORTED, "attn.block_sparse (cuda, fp8): %lld padded K/V rows, above 2^31",
                    (long long)kvp);
  }
  base8[nreq] = (int32_t)kvp;
  for (int i = 0; i < ntiles; i++)
    tiles[i].kv_base = base8[tiles[i].req];

  const int32_t mkbp = (a.max_key_blocks + 127) / 128 * 128;
  const size_t b_tiles = align256((size_t)ntiles * sizeof(bs_tile)), b_ints = align256((size_t)(3 * nreq + 1) * 4);
  const size_t b_amax = 256, b_q8 = align256((size_t)tq * a.hq * 128), b_kv = align256((size_t)kvp * a.hkv * 128);
  const size_t b_means = means ? align256((size_t)nreq * mkbp * a.hkv * 128) : 0;
  char *ws = nullptr;
  upf_status st = upf_cuda_workspace(b_tiles + b_ints + b_amax + b_q8 + 2 * b_kv + 2 * b_means, (void **)&ws);
  fp8_prep f = {};
  if (st == UPF_OK) {
    char *p = ws + b_tiles;
    f.base8 = (const int32_t *)p, f.kv_start = f.base8 + nreq + 1, f.kv_len = f.kv_start + nreq;
    p += b_ints;
    f.amax = (uint32_t *)p, p += b_amax;
    f.q8 = (uint8_t *)p, p += b_q8;
    f.k8 = (uint8_t *)p, p += b_kv;
    f.vt8 = (uint8_t *)p, p += b_kv;
    f.kbar8 = means ? (uint8_t *)p : nullptr, p += b_means;
    f.vbart8 = means ? (uint8_t *)p : nullptr;
    f.kvp = kvp, f.tq = tq, f.nreq = nreq, f.mkb = a.max_key_blocks, f.mkbp = mkbp;
    st = upf_cuda_upload_async(ws, tiles, (size_t)ntiles * sizeof(bs_tile));
  }
  if (st == UPF_OK)
    st = upf_cuda_upload_async(ws + b_tiles, ints, (size_t)(3 * nreq + 1) * sizeof(int32_t));
  free(ints);
  UPF_TRY(st);
  UPF_CUDA_TRY(cudaMemsetAsync(f.amax, 0, 4 * sizeof(uint32_t), upf_cuda_stream()));
  UPF_TRY(launch_passes<false>(a, f, paged, means));
  UPF_TRY(launch_passes<true>(a, f, paged, means));
  a.tiles = (const bs_tile *)ws;
  a.f8 = bs_fp8_args{f.q8, f.k8, f.vt8, f.kbar8, f.vbart8, f.amax, kvp, mkbp};
  return bs_launch_fp8(a, ntiles);
}

} // namespace upf_bsattn

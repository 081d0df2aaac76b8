/* Warp-level bf16 tensor-core helpers (mma.sync m16n8k16, fp32 accumulate) for kernels that keep their
 * operands in shared memory with k contiguous. Fragment layouts (PTX ISA, mma.m16n8k16 .bf16), with
 * g = lane / 4 and t = lane % 4:
 *   A (16 x 16, row-major): {row g, k 2t..2t+1}, {row g+8, same}, {row g, k 2t+8..}, {row g+8, k 2t+8..}
 *   B (16 x 8) given as Bt (8 rows n, k contiguous): {n g, k 2t..2t+1}, {n g, k 2t+8..2t+9}
 *   C (16 x 8): c0, c1 = {row g, cols 2t, 2t+1}; c2, c3 = {row g+8, same}.
 * Rows padded by 16 bytes (row stride = 4 mod 32 words) make each fragment load hit 32 banks.
 * Used by cuda/attn_fa2.cu and cuda/attn_decode.cu (attention) and cuda/gdn_chunked.cu. */
#ifndef UNIPREFILL_CUDA_MMA_SYNC_CUH
#define UNIPREFILL_CUDA_MMA_SYNC_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace upf_mma {

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&h);
}

/* One 32-bit fragment register: two bf16 from shared memory, or two fp32 (8-byte aligned) rounded to bf16. */
__device__ __forceinline__ uint32_t lds32(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }
__device__ __forceinline__ uint32_t lds32(const float *p) {
  const float2 x = *reinterpret_cast<const float2 *>(p);
  return pack_bf16(x.x, x.y);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* c[NT] (a 16 x 8NT block) += A (16 x K rows of `a`, stride lda; bf16, or fp32 rounded to bf16 as it is
 * loaded) * B, B given as Bt (8NT rows n of `bt`, stride ldb, k contiguous). K a multiple of 16; k runs in
 * order 0, 16, ... (fixed summation order). */
template <int NT, int K, typename TA>
__device__ __forceinline__ void warp_mma(float (&c)[NT][4], const TA *a, int lda, const bf16 *bt, int ldb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < K; ks += 16) {
    const TA *ar = a + g * lda + ks + 2 * t;
    const uint32_t a0 = lds32(ar), a1 = lds32(ar + 8 * lda), a2 = lds32(ar + 8), a3 = lds32(ar + 8 * lda + 8);
#pragma unroll
    for (int n = 0; n < NT; n++) {
      const bf16 *br = bt + (8 * n + g) * ldb + ks + 2 * t;
      mma_bf16(c[n], a0, a1, a2, a3, lds32(br), lds32(br + 8));
    }
  }
}

/* ldmatrix .x4 (no transpose): lane l gives the row address of matrix l / 8, row l % 8; lane l
 * receives (row l / 4, cols 2(l % 4), 2(l % 4) + 1) of matrix i in register i. */
__device__ __forceinline__ void ldsm_x4(uint32_t &d0, uint32_t &d1, uint32_t &d2, uint32_t &d3, const bf16 *row) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16 *row) { ldsm_x4(r[0], r[1], r[2], r[3], row); }

/* ldmatrix .x4 .trans: lanes 8i..8i+7 give the 16-byte rows of 8x8 matrix i; lane l receives (row 2(l%4),
 * col l/4) and (row 2(l%4)+1, col l/4) of matrix i in register i - with rows = k and cols = n, exactly
 * the B fragment {k 2t..2t+1, col g} of an mma whose B is stored k-major (rows = k). */
__device__ __forceinline__ void ldsm_x4_trans(uint32_t &d0, uint32_t &d1, uint32_t &d2, uint32_t &d3,
                                              const bf16 *row) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}

/* stmatrix .x4 .trans, the inverse of ldsm_x4_trans: lanes 8i..8i+7 give the 16-byte rows of 8x8 matrix i,
 * and lane l's register i (two bf16, low half first) goes to (row 2(l%4), col l/4) and (row 2(l%4)+1,
 * col l/4) of matrix i: an mma C fragment {row g, cols 2t, 2t+1} packed to bf16x2 lands transposed
 * (row = C column, col = C row), 16 bytes a row. */
__device__ __forceinline__ void stsm_x4_trans(bf16 *row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

/* warp_mma for bf16 A with every fragment by ldmatrix .x4 (A: one a k-step; B: one per two n-tiles, so NT
 * even): the very registers warp_mma assembles from 32-bit loads, fed to the same mma.sync in the same k
 * order, with a quarter of the shared-memory instructions. Rows of a and bt 16-byte aligned. */
template <int NT, int K>
__device__ __forceinline__ void warp_mma_ldsm(float (&c)[NT][4], const bf16 *a, int lda, const bf16 *bt, int ldb) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "two n-tiles an ldmatrix, whole k-steps");
  const int lane = threadIdx.x & 31;
  const bf16 *al = a + (lane & 15) * lda + (lane >> 4) * 8;                 /* matrices: rows 0-7 / 8-15, k 0 / 8 */
  const bf16 *bl = bt + ((lane & 7) + ((lane >> 4) << 3)) * ldb + ((lane >> 3) & 1) * 8; /* n 0-7 / 8-15, k 0 / 8 */
#pragma unroll
  for (int ks = 0; ks < K; ks += 16) {
    uint32_t a0, a1, a2, a3;
    ldsm_x4(a0, a1, a2, a3, al + ks);
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3, bl + n * 8 * ldb + ks);
      mma_bf16(c[n], a0, a1, a2, a3, b0, b1);
      mma_bf16(c[n + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

/* 16-byte asynchronous global -> shared copy (cp.async.cg, L2 only) and its group fences. */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
/* The same; valid = false zero-fills (src-size 0 reads nothing from gmem). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

} // namespace upf_mma

#endif

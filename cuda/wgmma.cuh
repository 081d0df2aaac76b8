/* Hopper (sm_90a) building blocks of the wgmma kernels (cuda/attn_hopper.cu's prefill, cuda/select_score.cu's
 * score kernel): mbarriers, cp.async into the swizzled ring, wgmma fences, shared-memory descriptors and
 * the two wgmma shapes they use (A from registers, B from a shared-memory descriptor). Include only from
 * .cu files built for sm_90a with the wgmma code inside #if defined(__CUDA_ARCH_FEAT_SM90_ALL). The
 * prefill's wgmma2 variant adds all-shared-memory shapes (m64n128k16 and, for D = 256, m64n80k16: A and B
 * descriptors), the D = 256 P V shape (m64n256k16), named barriers (with a warpgroup-wide vote) and a
 * time-bounded mbarrier wait. */
#ifndef UNIPREFILL_CUDA_WGMMA_CUH
#define UNIPREFILL_CUDA_WGMMA_CUH

#include <stdint.h>

namespace upf_wgmma {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* Waits until the phase of parity `parity` of the barrier has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n"
               ".reg .pred P1;\n"
               "WAIT_LOOP:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
               "@!P1 bra WAIT_LOOP;\n"
               "}\n" ::"r"(bar),
               "r"(parity)
               : "memory");
}
/* One poll of the same phase: true once it has completed. */
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n"
               ".reg .pred P1;\n"
               "mbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\n"
               "selp.u32 %0, 1, 0, P1;\n"
               "}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
  return done != 0;
}
/* mbar_wait bounded in wall time (%globaltimer, read only once the first poll has failed): false when it
 * gave up after limit_ns. A caller that stops waiting turns a barrier protocol error into wrong (NaN)
 * results and a finished kernel instead of a hang. (__trap() would do it more plainly, but any trap in
 * a kernel makes ptxas 13.0 drop the setmaxnreg register regions: spills at 168 registers.) */
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ bool mbar_wait_bounded(uint32_t bar, uint32_t parity, uint64_t limit_ns) {
  if (mbar_try_wait(bar, parity))
    return true;
  const uint64_t t0 = globaltimer_ns();
  while (!mbar_try_wait(bar, parity))
    if (globaltimer_ns() - t0 > limit_ns)
      return false;
  return true;
}
/* Named barriers 1..15 over n threads (a multiple of 32): sync waits, arrive only counts. */
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
/* bar.sync over the same n threads that also ORs pred across them: true in every thread iff it was true
 * in one. The vote that keeps a branch around a wgmma instruction uniform over a warpgroup (n = 128),
 * which __any_sync (one warp) does not. */
__device__ __forceinline__ bool named_bar_any(uint32_t id, uint32_t n, bool pred) {
  uint32_t r;
  asm volatile("{\n"
               ".reg .pred p, q;\n"
               "setp.ne.u32 p, %1, 0;\n"
               "bar.red.or.pred q, %2, %3, p;\n"
               "selp.u32 %0, 1, 0, q;\n"
               "}\n"
               : "=r"(r)
               : "r"((uint32_t)pred), "r"(id), "r"(n)
               : "memory");
  return r != 0;
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n"
               ".reg .b64 st;\n"
               "mbarrier.arrive.shared::cta.b64 st, [%0];\n"
               "}\n" ::"r"(bar)
               : "memory");
}
/* One arrival on `bar` once every cp.async this thread issued before has landed. */
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/* 16-byte cp.async to a shared address; valid = false zero-fills. */
__device__ __forceinline__ void cp_async16_to(uint32_t dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
/* The same, always 16 bytes (no src-size operand: no predicate in the SASS). */
__device__ __forceinline__ void cp_async16_full(uint32_t dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
/* Waits for every cp.async this thread issued (a producer's last step: no copy outlives the CTA). */
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

/* The TMA (the selection score kernel's producer at D 64 and 128): one arrival on `bar` that also expects
 * `bytes` of transactions in this phase; a 3-D tiled copy of the box at (c0, c1, c2) of the tensor map
 * at generic address `map` (a __grid_constant__ kernel parameter) into shared memory at `dst`, which
 * completes those bytes on `bar`; the fence that makes mbarrier.init visible to the async proxy before
 * the TMA signals the barrier. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void *map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
               "%4}], [%5];\n" ::"r"(dst),
               "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* generic-proxy writes (cp.async) before async-proxy reads (wgmma) of shared memory */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* Shared-memory matrix descriptors, 128-byte swizzle (bits 62-63 = 1), address field = addr >> 4.
 * K-major B (rows = N, 64 K-elements = 128 bytes per row, 8-row groups 1024 bytes apart): LBO unused (1).
 * MN-major B (rows = K, 64 N-elements = 128 bytes per row, 8-row groups 1024 bytes apart, the next 64
 * N-elements `mn_block_bytes` further). */
__device__ __forceinline__ uint64_t desc_kmajor_sw128(uint32_t addr) {
  return ((uint64_t)1 << 62) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 16) | (uint64_t)((addr & 0x3FFFFu) >> 4);
}
__device__ __forceinline__ uint64_t desc_mnmajor_sw128(uint32_t addr, uint32_t mn_block_bytes) {
  return ((uint64_t)1 << 62) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)((mn_block_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t)((addr & 0x3FFFFu) >> 4);
}

/* The accumulator operands: D4 the 4 floats of n-block n, D32 the 32 of n-blocks n .. n + 7 (64 columns). */
#define UPF_WGMMA_D4(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define UPF_WGMMA_D32(d, n)                                                                                  \
  UPF_WGMMA_D4(d, n), UPF_WGMMA_D4(d, n + 1), UPF_WGMMA_D4(d, n + 2), UPF_WGMMA_D4(d, n + 3),              \
      UPF_WGMMA_D4(d, n + 4), UPF_WGMMA_D4(d, n + 5), UPF_WGMMA_D4(d, n + 6), UPF_WGMMA_D4(d, n + 7)

/* D (64 x 64, f32) (+)= A (64 x 16 bf16, registers) * B (K-major, 64 x 16, descriptor)^T; scale_d = 0: D = A B. */
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc,
                                                int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
/* D (64 x 128, f32) (+)= A (64 x 16 bf16, registers) * B (16 x 128, MN-major descriptor: imm-trans-b 1). */
__device__ __forceinline__ void wgmma_m64n128k16_tb(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc,
                                                    int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0), UPF_WGMMA_D32(d, 8)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
/* D (64 x 128, f32) (+)= A (64 x 16, K-major descriptor) * B (K-major, 128 x 16, descriptor)^T: both
 * operands from shared memory (imm-trans-a = imm-trans-b = 0). */
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                                    int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "%64, %65, p, 1, 1, 0, 0;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0), UPF_WGMMA_D32(d, 8)
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
/* The D = 256 prefill's two shapes. S: D (64 x 80, f32) (+)= A (64 x 16, K-major descriptor) * B (K-major,
 * 80 x 16, descriptor)^T, both operands from shared memory. */
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[10][4], uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %42, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39}, "
               "%40, %41, p, 1, 1, 0, 0;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0), UPF_WGMMA_D4(d, 8), UPF_WGMMA_D4(d, 9)
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
/* O: D (64 x 256, f32) (+)= A (64 x 16 bf16, registers) * B (16 x 256, MN-major descriptor: imm-trans-b 1). */
__device__ __forceinline__ void wgmma_m64n256k16_tb(float (&d)[32][4], const uint32_t (&a)[4], uint64_t desc,
                                                    int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
               "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
               "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
               "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
               "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
               "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0), UPF_WGMMA_D32(d, 8), UPF_WGMMA_D32(d, 16), UPF_WGMMA_D32(d, 24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
/* E4M3 (attn.block_sparse's fp8 variant). FP8 operands are K-major only (no imm-trans), 32 K-elements (32
 * bytes) a step: the K-major descriptors above serve unchanged, one 128-byte row holding 128 elements.
 * S: D (64 x 128, f32) (+)= A (64 x 32, descriptor) * B (128 x 32, descriptor)^T. */
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                                         int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "%64, %65, p, 1, 1;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0), UPF_WGMMA_D32(d, 8)
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
/* O: D (64 x 128, f32) (+)= A (64 x 32 e4m3, registers: a[0] row g k 4t..4t+3, a[1] row g + 8, a[2] and a[3]
 * the same at k + 16, low byte first) * B (128 x 32, K-major descriptor)^T. */
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc,
                                                         int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
               "}\n"
               : UPF_WGMMA_D32(d, 0), UPF_WGMMA_D32(d, 8)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
#undef UPF_WGMMA_D32
#undef UPF_WGMMA_D4
#endif

} // namespace upf_wgmma
#endif

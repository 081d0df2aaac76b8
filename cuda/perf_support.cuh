/* Device timing and ceilings for the benchmarks: event timers on the CUDA backend's stream, an L2
 * flush, and the measured device-to-device copy bandwidth that TB/s figures are compared with.
 * Plain C header. Built only when CUDA=1, so C callers guard with #ifdef UPF_HAVE_CUDA. */
#ifndef UNIPREFILL_CUDA_PERF_SUPPORT_CUH
#define UNIPREFILL_CUDA_PERF_SUPPORT_CUH

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A pair of events recorded on upf_cuda_stream(): the device time of what the stream ran between
 * start and stop, without host launch gaps before start. */
typedef struct upf_cuda_timer upf_cuda_timer;

upf_status upf_cuda_timer_create(upf_cuda_timer **timer);
upf_status upf_cuda_timer_start(upf_cuda_timer *timer);
/* Records the stop event, waits for it, and returns the elapsed device time in seconds
 * (resolution about 0.5 us). */
upf_status upf_cuda_timer_stop(upf_cuda_timer *timer, double *seconds);
void upf_cuda_timer_destroy(upf_cuda_timer *timer);

/* L2 size of the current device in bytes. */
upf_status upf_cuda_l2_bytes(int64_t *bytes);

/* A buffer twice the L2 size; each run writes all of it on the backend stream, which evicts
 * whatever an earlier iteration left in L2. */
typedef struct upf_cuda_l2_flush upf_cuda_l2_flush;

upf_status upf_cuda_l2_flush_create(upf_cuda_l2_flush **flush);
upf_status upf_cuda_l2_flush_run(upf_cuda_l2_flush *flush);
void upf_cuda_l2_flush_destroy(upf_cuda_l2_flush *flush);

/* dst = src, `bytes` bytes of device memory, enqueued on the backend stream. */
upf_status upf_cuda_copy_async(void *dst, const void *src, size_t bytes);

/* The ceiling for memory-bound kernels: copies a buffer of `bytes` (make it far larger than L2)
 * `reps` times after a warm-up, each copy timed alone, and returns bytes read plus written per
 * second of the median copy: 2 * bytes / median seconds. */
upf_status upf_cuda_copy_bandwidth(size_t bytes, int reps, double *bytes_per_second);

/* A compute ceiling: C (M, N) = A (M, K) . B (N, K)^T, bf16 in and out, fp32 accumulation, one
 * cublasGemmEx (TN) on the backend's stream and cuBLAS handle (no wait). bench_moe's dense
 * equivalent of the MoE layer, its weights in the layer's (out, in) layout. */
upf_status upf_cuda_gemm_bf16_nt(int64_t M, int64_t N, int64_t K, const void *A, const void *B, void *C);

#ifdef __cplusplus
}
#endif
#endif

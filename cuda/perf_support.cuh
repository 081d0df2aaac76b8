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

/* The projections' GEMM (upf_cuda_gemm_raw's NN form: c (M, N) = a (M, K) . b (K, N), bf16, fp32
 * accumulation) through cublasLt's fastest algorithm for the shape, as the gemm variant lt-tuned chooses it
 * (cuda/gemm.cu: up to 16 heuristic candidates, the median of 5 calls each after a warm-up, on the case's
 * own buffers, beside cublasGemmEx timed the same way), checked element by element against cublasGemmEx
 * before it is timed. The question it answers: does the library pick the fastest kernel it has for our
 * shapes (issue 25, perf/NOTES.md). */
typedef struct upf_gemm_lt_plan upf_gemm_lt_plan;
upf_status upf_cuda_gemm_lt_plan_create(int64_t M, int64_t K, int64_t N, const void *a, const void *b, void *c,
                                        upf_gemm_lt_plan **plan);
upf_status upf_cuda_gemm_lt_plan_run(const upf_gemm_lt_plan *plan); /* no wait */
/* algorithms tried, the best one's heuristic rank (0: the heuristic's first), the best median and the
 * cublasGemmEx median, seconds */
void upf_cuda_gemm_lt_plan_stats(const upf_gemm_lt_plan *plan, int *algos, int *best_rank, double *best_s,
                                 double *gemmex_s);
void upf_cuda_gemm_lt_plan_destroy(upf_gemm_lt_plan *plan);

#ifdef __cplusplus
}
#endif
#endif

/* Shared state of the CUDA backend (plain C header): the one stream every op of the backend runs on,
 * the grow-only device workspace, pinned host staging for small transfers, and device facts. Kernels
 * of the cuda/ sources reach these here; benchmarks record their events on upf_cuda_stream(). */
#ifndef UNIPREFILL_CUDA_BACKEND_CUH
#define UNIPREFILL_CUDA_BACKEND_CUH

#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend's stream (a blocking stream: it orders with the legacy default stream). Created on
 * first use; NULL (the default stream) only if that creation failed, with the error recorded. */
cudaStream_t upf_cuda_stream(void);

/* Initialises the device context and the stream once; UPF_ERR_NO_DEVICE / UPF_ERR_CUDA otherwise.
 * Every CUDA entry point calls this first. Fails without a CUDA call when UPF_BACKENDS excludes cuda. */
upf_status upf_cuda_init(void);

/* Evaluates a cuBLAS or cuBLASLt call (both return cublasStatus_t); on failure records the call, the
 * library's message and the place, and returns UPF_ERR_CUDA. */
#define UPF_CUBLAS_TRY(call)                                                                                   \
  do {                                                                                                         \
    cublasStatus_t upf_cublas_st_ = (call);                                                                    \
    if (upf_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                               \
      return upf_fail(UPF_ERR_CUDA, "cublas: %s failed: %s (%d) at %s:%d", #call,                              \
                      cublasGetStatusString(upf_cublas_st_), (int)upf_cublas_st_, __FILE__, __LINE__);         \
  } while (0)

/* The backend's one cuBLAS handle, bound to upf_cuda_stream(); created on first use. NULL (with the
 * error recorded) when the device or cuBLAS cannot be initialised. Callers that change its math or
 * pointer mode put the previous setting back. */
cublasHandle_t upf_cuda_cublas(void);
/* The device workspace of that handle (NULL with 0 bytes when cuBLAS runs on its own default), for
 * cublasLt calls on the same stream. Valid after upf_cuda_cublas() succeeded. */
void *upf_cuda_cublas_workspace(size_t *bytes);

/* Tells compute-sanitizer's initcheck (through the NVTX memory API; nothing happens without a tool
 * attached) that `rows` rows of `row_bytes`, `ld_bytes` apart from `ptr`, were written by the work queued
 * on `stream` so far. initcheck does not see the stores of cuBLAS's Hopper kernels and would report our
 * kernels' reads of a GEMM's output as reads of uninitialised memory; each entry that runs cuBLAS marks
 * the region it asked cuBLAS to write, and no other, once after its calls. */
void upf_cuda_mark_written(cudaStream_t stream, const void *ptr, int64_t rows, int64_t row_bytes, int64_t ld_bytes);

/* Multiprocessor count and opt-in shared memory per block of the current device (after init). */
int upf_cuda_num_sms(void);
size_t upf_cuda_smem_optin(void);

/* Grow-only device workspace of at least `bytes`, 256-byte aligned. Growing synchronises the stream
 * first (queued kernels may still use the old buffer). The pointer stays valid until the next call. */
upf_status upf_cuda_workspace(size_t bytes, void **ptr);

/* Copies `bytes` of host memory to device memory `dst` asynchronously on the stream through pinned
 * staging; `src` may be reused as soon as this returns. */
upf_status upf_cuda_upload_async(void *dst, const void *src, size_t bytes);

/* Copies `bytes` (at most 4096) of device memory to host `dst` and waits for the stream. */
upf_status upf_cuda_download_small(void *dst, const void *src, size_t bytes);

#ifdef __cplusplus
}
#endif
#ifdef __cplusplus
#include "cuda_check.cuh"

/* The first time a launch site asks (*done: that site's static flag; its size is fixed): fails with
 * UPF_ERR_UNSUPPORTED naming `what` when `bytes` of dynamic shared memory exceed the device's opt-in
 * limit, else raises `kernel`'s limit to `bytes` (and, with max_carveout, asks for all of the SM's
 * unified memory as shared memory, which more than one resident CTA of a large footprint needs).
 * Afterwards a launch on a hot path (a decode step, a layer's scan) makes no driver call for it.
 * Threads racing on *done only repeat a harmless check and attribute set. */
template <typename Kernel>
static inline upf_status upf_cuda_smem_prepare(Kernel *kernel, size_t bytes, bool max_carveout, bool *done,
                                               const char *what) {
  if (*done)
    return UPF_OK;
  if (bytes > upf_cuda_smem_optin())
    return upf_fail(UPF_ERR_UNSUPPORTED, "cuda: %s needs %zu bytes of shared memory a CTA, the device offers %zu",
                    what, bytes, upf_cuda_smem_optin());
  UPF_CUDA_TRY(cudaFuncSetAttribute((const void *)kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  if (max_carveout)
    UPF_CUDA_TRY(cudaFuncSetAttribute((const void *)kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      (int)cudaSharedmemCarveoutMaxShared));
  *done = true;
  return UPF_OK;
}
#endif
#endif

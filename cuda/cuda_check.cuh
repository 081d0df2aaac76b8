/* Status plumbing for CUDA code: turn a failing cudaError_t into upf_fail(UPF_ERR_CUDA, ...) naming
 * the call, the error string and file:line, and return that status. Library code never exits or
 * prints; callers see the message through upf_last_error(). */
#ifndef UNIPREFILL_CUDA_CHECK_CUH
#define UNIPREFILL_CUDA_CHECK_CUH

#include <cuda_runtime_api.h>

#include "uniprefill/status.h"

/* Evaluates a CUDA runtime call; on failure records the message and returns UPF_ERR_CUDA
 * (UPF_ERR_NOMEM for an out-of-memory error) from the enclosing function. */
#define UPF_CUDA_TRY(call)                                                                          \
  do {                                                                                              \
    cudaError_t upf_cuda_err_ = (call);                                                             \
    if (upf_cuda_err_ != cudaSuccess)                                                               \
      return upf_cuda_fail(upf_cuda_err_, #call, __FILE__, __LINE__);                               \
  } while (0)

/* After a kernel launch: checks the launch error (bad configuration, missing image, ...). */
#define UPF_CUDA_LAUNCH_TRY(kernel_name)                                                            \
  do {                                                                                              \
    cudaError_t upf_cuda_err_ = cudaGetLastError();                                                 \
    if (upf_cuda_err_ != cudaSuccess)                                                               \
      return upf_cuda_fail(upf_cuda_err_, "launch of " kernel_name, __FILE__, __LINE__);           \
  } while (0)

/* For functions that cannot return a status (release): records the message, keeps going. */
#define UPF_CUDA_NOTE(call)                                                                         \
  do {                                                                                              \
    cudaError_t upf_cuda_err_ = (call);                                                             \
    if (upf_cuda_err_ != cudaSuccess)                                                               \
      (void)upf_cuda_fail(upf_cuda_err_, #call, __FILE__, __LINE__);                                \
  } while (0)

static inline upf_status upf_cuda_fail(cudaError_t err, const char *what, const char *file, int line) {
  upf_status st = err == cudaErrorMemoryAllocation ? UPF_ERR_NOMEM : UPF_ERR_CUDA;
  return upf_fail(st, "cuda: %s failed: %s (%s) at %s:%d", what, cudaGetErrorString(err), cudaGetErrorName(err),
                  file, line);
}

#endif

/* CUDA compaction gather: dst[i, :] = src[kept_index[i], :] for i < kept_total.
 *
 * Kernels:
 *   compact_check_kernel     one thread per index; the first out-of-range position wins an integer
 *                            atomicMin, so the error names the same index the CPU reference names.
 *   compact_rows_kernel<V>   gather with V-byte accesses (V = 16, 8, 4 or 1, the widest that
 *                            row_bytes and both pointers allow). A row is handled by TPR threads
 *                            (TPR = the power of two >= the row's V-vectors, at most 256), so short
 *                            rows share a CTA and long rows stream with coalesced 16-byte accesses.
 * Memory-bound: the floor is 2 * kept_total * row_bytes bytes over device bandwidth. */
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/compact.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"

namespace {

struct alignas(16) vec16 {
  uint4 v;
};

__global__ void compact_check_kernel(const int32_t *__restrict__ kept_index, // (kept_total)
                                     int64_t kept_total, int64_t num_rows,
                                     unsigned long long *__restrict__ first_bad) { // (1) min bad position
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= kept_total)
    return;
  int32_t idx = kept_index[i];
  if (idx < 0 || (int64_t)idx >= num_rows)
    atomicMin(first_bad, (unsigned long long)i);
}

template <typename V>
__global__ void compact_rows_kernel(const V *__restrict__ src,          // (num_rows, vpr)
                                    const int32_t *__restrict__ kept_index, // (kept_total)
                                    int64_t kept_total, int64_t vpr, int tpr,
                                    V *__restrict__ dst) { // (kept_total, vpr)
  int rows_per_cta = blockDim.x / tpr;
  int64_t row = (int64_t)blockIdx.x * rows_per_cta + threadIdx.x / tpr;
  if (row >= kept_total)
    return;
  const V *s = src + (int64_t)kept_index[row] * vpr;
  V *d = dst + row * vpr;
  for (int64_t v = threadIdx.x % tpr; v < vpr; v += tpr)
    d[v] = s[v];
}

template <typename V>
upf_status launch_gather(const void *src, const int32_t *kept_index, int64_t kept_total, int64_t row_bytes,
                         void *dst, cudaStream_t stream) {
  int64_t vpr = row_bytes / (int64_t)sizeof(V);
  int tpr = 1;
  while (tpr < 256 && tpr < vpr)
    tpr *= 2;
  int rows_per_cta = 256 / tpr;
  int64_t grid = (kept_total + rows_per_cta - 1) / rows_per_cta;
  compact_rows_kernel<V><<<(unsigned)grid, 256, 0, stream>>>((const V *)src, kept_index, kept_total, vpr, tpr,
                                                              (V *)dst);
  UPF_CUDA_LAUNCH_TRY("compact_rows_kernel");
  return UPF_OK;
}

bool aligned_to(const void *p, int64_t bytes, size_t a) { return ((uintptr_t)p % a) == 0 && bytes % (int64_t)a == 0; }

} // namespace

extern "C" upf_status upf_cuda_compact_rows(const void *src, int64_t num_rows, int64_t row_bytes,
                                            const int32_t *kept_index, int64_t kept_total, void *dst) {
  UPF_TRY(upf_cuda_init());
  if (row_bytes < 0 || kept_total < 0 || kept_total > num_rows)
    return upf_fail(UPF_ERR_INVALID_ARG, "compact.rows: kept_total=%lld, num_rows=%lld, row_bytes=%lld out of range",
                    (long long)kept_total, (long long)num_rows, (long long)row_bytes);
  if (kept_total > INT32_MAX)
    return upf_fail(UPF_ERR_INVALID_ARG, "compact.rows: kept_total=%lld exceeds the int32 index range",
                    (long long)kept_total);
  if (kept_total == 0)
    return UPF_OK;
  cudaStream_t stream = upf_cuda_stream();

  void *ws;
  UPF_TRY(upf_cuda_workspace(sizeof(unsigned long long), &ws));
  unsigned long long *first_bad = (unsigned long long *)ws;
  UPF_CUDA_TRY(cudaMemsetAsync(first_bad, 0xFF, sizeof *first_bad, stream));
  compact_check_kernel<<<(unsigned)((kept_total + 255) / 256), 256, 0, stream>>>(kept_index, kept_total, num_rows,
                                                                                  first_bad);
  UPF_CUDA_LAUNCH_TRY("compact_check_kernel");
  unsigned long long bad = 0;
  UPF_TRY(upf_cuda_download_small(&bad, first_bad, sizeof bad));
  if (bad != ~0ull) {
    int32_t value = 0;
    UPF_TRY(upf_cuda_download_small(&value, kept_index + bad, sizeof value));
    return upf_fail(UPF_ERR_INVALID_ARG, "compact.rows: kept_index[%llu]=%d outside [0, %lld)", bad, value,
                    (long long)num_rows);
  }
  if (row_bytes == 0)
    return UPF_OK;

  if (aligned_to(src, row_bytes, 16) && aligned_to(dst, row_bytes, 16))
    return launch_gather<vec16>(src, kept_index, kept_total, row_bytes, dst, stream);
  if (aligned_to(src, row_bytes, 8) && aligned_to(dst, row_bytes, 8))
    return launch_gather<uint2>(src, kept_index, kept_total, row_bytes, dst, stream);
  if (aligned_to(src, row_bytes, 4) && aligned_to(dst, row_bytes, 4))
    return launch_gather<uint32_t>(src, kept_index, kept_total, row_bytes, dst, stream);
  return launch_gather<uint8_t>(src, kept_index, kept_total, row_bytes, dst, stream);
}

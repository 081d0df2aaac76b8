/* CUDA paged KV metadata ops.
 * Kernels:
 *   kv_slot_mapping_kernel   one thread per token of the step: its row by binary search over
 *                            cu_seqlens (B+1 entries, cached in L1), then the block-table lookup.
 *                            The whole batch in one launch, no host round trip per request.
 *   scatter_rows_kernel<V>   dst[index[i]] = src[i] with V-byte accesses (16, 4 or 1, the widest
 *                            row_bytes and both pointers allow), one CTA per source row.
 * Both are memory-bound and tiny next to the layers they serve. */
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/kv.cuh"

namespace {

__global__ void kv_slot_mapping_kernel(const int32_t *__restrict__ cu,          // (B+1)
                                       int32_t num_reqs,
                                       const int32_t *__restrict__ start,       // (B)
                                       const int32_t *__restrict__ block_table, // (B, max_blocks)
                                       int32_t max_blocks, int32_t page_size,
                                       int64_t num_tokens,
                                       int32_t *__restrict__ slot_mapping) {    // (T)
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_tokens)
    return;
  int32_t lo = 0, hi = num_reqs - 1; /* the row r with cu[r] <= t < cu[r+1] (empty rows skipped) */
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t i = (int64_t)start[lo] + (t - cu[lo]);
  slot_mapping[t] = (int32_t)((int64_t)block_table[(int64_t)lo * max_blocks + i / page_size] * page_size +
                              i % page_size);
}

template <typename V>
__global__ void scatter_rows_kernel(const V *__restrict__ src,     // (num_src, vpr)
                                    const int32_t *__restrict__ index, // (num_src)
                                    int64_t vpr,
                                    V *__restrict__ dst) {         // (num_dst_rows, vpr)
  const int64_t row = blockIdx.x;
  const V *s = src + row * vpr;
  V *d = dst + (int64_t)index[row] * vpr;
  for (int64_t v = threadIdx.x; v < vpr; v += blockDim.x)
    d[v] = s[v];
}

bool aligned_to(const void *p, int64_t bytes, size_t a) { return ((uintptr_t)p % a) == 0 && bytes % (int64_t)a == 0; }

} // namespace

extern "C" upf_status upf_cuda_kv_slot_mapping(const upf_kv_slot_batch *b, int32_t *slot_mapping) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_kv_slot_mapping_check(b));
  const int64_t T = b->cu_seqlens_host[b->num_reqs];
  if (T == 0)
    return UPF_OK;
  const int threads = 256;
  const int64_t grid = (T + threads - 1) / threads;
  if (grid > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "kv.slot_mapping (cuda): T=%lld exceeds the grid", (long long)T);
  kv_slot_mapping_kernel<<<(unsigned)grid, threads, 0, upf_cuda_stream()>>>(
      b->cu_seqlens, b->num_reqs, b->start, b->block_table, b->max_blocks, b->page_size, T, slot_mapping);
  UPF_CUDA_LAUNCH_TRY("kv_slot_mapping_kernel");
  return UPF_OK;
}

extern "C" upf_status upf_cuda_scatter_rows(const void *src, int64_t num_src, int64_t row_bytes,
                                            const int32_t *index, const int32_t *index_host, void *dst,
                                            int64_t num_dst_rows) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_scatter_rows_check(num_src, row_bytes, index_host, num_dst_rows));
  if (num_src == 0 || row_bytes == 0)
    return UPF_OK;
  if (num_src > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "compact.scatter_rows (cuda): %lld rows exceed the grid", (long long)num_src);
  cudaStream_t stream = upf_cuda_stream();
  const unsigned grid = (unsigned)num_src;
  if (aligned_to(src, row_bytes, 16) && aligned_to(dst, row_bytes, 16))
    scatter_rows_kernel<uint4><<<grid, 256, 0, stream>>>((const uint4 *)src, index, row_bytes / 16, (uint4 *)dst);
  else if (aligned_to(src, row_bytes, 4) && aligned_to(dst, row_bytes, 4))
    scatter_rows_kernel<uint32_t><<<grid, 256, 0, stream>>>((const uint32_t *)src, index, row_bytes / 4,
                                                            (uint32_t *)dst);
  else
    scatter_rows_kernel<uint8_t><<<grid, 256, 0, stream>>>((const uint8_t *)src, index, row_bytes, (uint8_t *)dst);
  UPF_CUDA_LAUNCH_TRY("scatter_rows_kernel");
  return UPF_OK;
}

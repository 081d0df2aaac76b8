/* Paged K/V gathered into contiguous rows (cuda/kv_gather.cuh). */
#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/kv_gather.cuh"

namespace {

constexpr int GATHER_ROWS = 16; /* key rows a CTA copies */

/* grid (ceil(max len / GATHER_ROWS), requests); a thread copies 16-byte chunks of (key, kv head, dims). */
__global__ void kv_gather_kernel(const kv_paged_view s, const kv_gather_group g, int4 *dst_k, int4 *dst_v) {
  const int i = blockIdx.y;
  const int32_t len = g.len[i], j0 = blockIdx.x * GATHER_ROWS;
  if (j0 >= len)
    return;
  const int chunks = s.d / 8, per_row = s.hkv * chunks;
  const int rows = len - j0 < GATHER_ROWS ? len - j0 : GATHER_ROWS;
  const int32_t *bt = s.block_table + (int64_t)g.row[i] * s.max_blocks;
  const char *k = (const char *)s.k, *v = (const char *)s.v;
  for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
    const int r = e / per_row, h = (e % per_row) / chunks, c = e % chunks;
    const int32_t key = g.start[i] + j0 + r;
    const int64_t page = bt[key / s.page_size], slot = key % s.page_size;
    const int64_t dst = ((int64_t)g.base[i] + j0 + r) * per_row + h * chunks + c;
    dst_k[dst] = *(const int4 *)(k + 2 * (page * s.k_s0 + slot * s.k_s1 + h * s.k_s2 + c * 8));
    dst_v[dst] = *(const int4 *)(v + 2 * (page * s.v_s0 + slot * s.v_s1 + h * s.v_s2 + c * 8));
  }
}

/* The gather buffer, grow-only, kept for the process (as the cuBLAS workspace). */
struct gather_buffer {
  void *ptr = nullptr;
  size_t bytes = 0;
};
gather_buffer buf;

upf_status reserve(size_t bytes) {
  if (bytes <= buf.bytes)
    return UPF_OK;
  UPF_CUDA_TRY(cudaStreamSynchronize(upf_cuda_stream())); /* queued kernels may still read the old one */
  if (buf.ptr)
    UPF_CUDA_TRY(cudaFree(buf.ptr));
  buf.ptr = nullptr, buf.bytes = 0;
  const size_t want = (bytes + 0xFFFFF) & ~(size_t)0xFFFFF;
  const cudaError_t err = cudaMalloc(&buf.ptr, want);
  if (err != cudaSuccess) {
    cudaGetLastError();
    buf.ptr = nullptr;
    return upf_fail(UPF_ERR_NOMEM, "kv gather (cuda): %.2f GiB to gather paged K/V for the wgmma kernel: %s",
                    want / 1073741824.0, cudaGetErrorString(err));
  }
  buf.bytes = want;
  return UPF_OK;
}

} // namespace

int kv_gather_plan(const int32_t *row, const int32_t *start, const int32_t *len, int first, int count,
                   size_t row_bytes, kv_gather_group *g) {
  g->n = 0, g->rows = 0;
  int i = first;
  for (; i < count && g->n < KV_GATHER_REQS; i++) {
    if (g->n > 0 && 2 * (size_t)(g->rows + len[i]) * row_bytes > KV_GATHER_CAP)
      break;
    g->row[g->n] = row[i], g->start[g->n] = start[i], g->len[g->n] = len[i], g->base[g->n] = (int32_t)g->rows;
    g->rows += len[i], g->n++;
  }
  return i - first;
}

upf_status kv_gather(const kv_paged_view &src, const kv_gather_group &g, void **k_rows, void **v_rows) {
  if (g.rows > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "kv gather (cuda): %lld keys in one group, above 2^31", (long long)g.rows);
  const size_t row_bytes = (size_t)src.hkv * src.d * 2;
  UPF_TRY(reserve(2 * (size_t)g.rows * row_bytes));
  char *k = (char *)buf.ptr, *v = k + (size_t)g.rows * row_bytes;
  int32_t max_len = 0;
  for (int i = 0; i < g.n; i++)
    max_len = g.len[i] > max_len ? g.len[i] : max_len;
  if (max_len > 0) {
    const dim3 grid((unsigned)((max_len + GATHER_ROWS - 1) / GATHER_ROWS), (unsigned)g.n);
    kv_gather_kernel<<<grid, 256, 0, upf_cuda_stream()>>>(src, g, (int4 *)k, (int4 *)v);
    UPF_CUDA_LAUNCH_TRY("kv_gather_kernel");
  }
  *k_rows = k, *v_rows = v;
  return UPF_OK;
}

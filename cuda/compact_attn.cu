/* CUDA CompactAttention ops (cuda/compact_attn.cuh; semantics in uniprefill/compact_attn.h).
 *
 * Kernels:
 *   union_kernel    one CTA per (request, KV head): writes the forced blocks of the row, then marks every
 *                   block of the request's CSR segments of that head (racing writes all store 1), then
 *                   counts the row. A block id outside the row wins an atomicMin of its CSR position so
 *                   the error names the same entry the CPU reference names.
 *   tables_kernel   one warp per pseudo-request (r, h): 32 blocks of the table row at a time, a ballot
 *                   gives each kept block its rank among the kept, and its pages go to rank * pages a
 *                   block (every kept block but the request's tail block is whole pages, and the tail
 *                   comes last), then -1 to the end of the row.
 * Both are tiny next to the attention they feed (bytes of the table and of the block tables). */
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>
#include <vector>

#include "cuda/compact_attn.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"

namespace {

constexpr int UNION_THREADS = 256;
constexpr int TABLES_THREADS = 128;

struct union_req {
  int32_t tile0, tile1; /* the request's query tiles [tile0, tile1) */
  int32_t lo, hi;       /* forced blocks [lo, hi] */
};

__global__ void union_kernel(const int32_t *__restrict__ row_ptr, // (S + 1)
                             const int32_t *__restrict__ blocks,  // (kept_total)
                             const union_req *__restrict__ reqs,  // (B)
                             int32_t hkv, int32_t total_q_tiles, int32_t nb,
                             uint8_t *__restrict__ table,  // (B, Hkv, nb)
                             int32_t *__restrict__ counts, // (B, Hkv)
                             int32_t *__restrict__ bad) {  // (1) first bad CSR position
  const int32_t item = blockIdx.x, r = item / hkv, h = item % hkv;
  uint8_t *row = table + (int64_t)item * nb;
  const union_req q = reqs[r];
  for (int32_t b = threadIdx.x; b < nb; b += blockDim.x)
    row[b] = b >= q.lo && b <= q.hi;
  __syncthreads();
  for (int32_t tile = q.tile0; tile < q.tile1; tile++) {
    const int64_t s = (int64_t)h * total_q_tiles + tile;
    for (int32_t i = row_ptr[s] + threadIdx.x; i < row_ptr[s + 1]; i += blockDim.x) {
      const int32_t b = blocks[i];
      if (b < 0 || b >= nb)
        atomicMin(bad, i);
      else
        row[b] = 1;
    }
  }
  __syncthreads();
  int32_t n = 0;
  for (int32_t b = threadIdx.x; b < nb; b += blockDim.x)
    n += row[b];
  for (int off = 16; off > 0; off >>= 1)
    n += __shfl_down_sync(0xffffffffu, n, off);
  __shared__ int32_t warp_sum[UNION_THREADS / 32];
  if ((threadIdx.x & 31) == 0)
    warp_sum[threadIdx.x / 32] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < (int)(blockDim.x / 32); w++)
      total += warp_sum[w];
    counts[item] = total;
  }
}

__global__ void tables_kernel(const int32_t *__restrict__ kv_lens,  // (B)
                              const int32_t *__restrict__ src_bt,   // (B, src_max)
                              int32_t src_max,
                              const uint8_t *__restrict__ table,    // (B, Hkv, nb)
                              int32_t hkv, int32_t B, int32_t nb, int32_t block_n, int32_t P,
                              int32_t *__restrict__ out_bt, // (Hkv, B, out_max)
                              int32_t out_max,
                              int32_t *__restrict__ out_kv) { // (Hkv, B)
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= (int64_t)B * hkv)
    return; /* whole warps: the grid is a multiple of 32 threads */
  const int32_t h = (int32_t)(warp / B), r = (int32_t)(warp % B);
  const int64_t kv_len = kv_lens[r];
  const int64_t nb_r_full = (kv_len + block_n - 1) / block_n;
  const int32_t nb_r = (int32_t)(nb_r_full < nb ? nb_r_full : nb);
  const int32_t per = block_n / P;
  const uint8_t *row = table + ((int64_t)r * hkv + h) * nb;
  const int32_t *src = src_bt + (int64_t)r * src_max;
  int32_t *dst = out_bt + warp * out_max;
  int64_t rank0 = 0, kept = 0;
  for (int32_t c = 0; c < nb_r; c += 32) {
    const int32_t b = c + lane;
    const bool keep = b < nb_r && row[b];
    const unsigned mask = __ballot_sync(0xffffffffu, keep);
    if (keep) {
      const int64_t rank = rank0 + __popc(mask & ((1u << lane) - 1u));
      const int64_t left = kv_len - (int64_t)b * block_n;
      const int64_t keys = left < block_n ? left : block_n;
      for (int64_t i = 0; i < (keys + P - 1) / P; i++)
        dst[rank * per + i] = src[(int64_t)b * per + i];
      kept += keys;
    }
    rank0 += __popc(mask);
  }
  for (int off = 16; off > 0; off >>= 1)
    kept += __shfl_xor_sync(0xffffffffu, kept, off);
  const int64_t pages = (kept + P - 1) / P;
  for (int64_t i = pages + lane; i < out_max; i += 32)
    dst[i] = -1;
  if (lane == 0)
    out_kv[warp] = (int32_t)kept;
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

} // namespace

extern "C" upf_status upf_cuda_compact_block_union(const upf_sparse_batch *b, int32_t hq, const upf_sparse_params *p,
                                                   const upf_sparse_index *index, const upf_compact_params *cp,
                                                   const upf_tensor *table, int32_t *counts) {
  UPF_TRY(upf_cuda_init());
  upf_sparse_plan plan;
  UPF_TRY(upf_compact_union_check(b, hq, p, index, cp, table, counts, &plan));
  const int32_t B = plan.num_reqs, hkv = plan.hkv, T = plan.total_q_tiles;
  const int32_t nb = (int32_t)table->shape[2];
  const int32_t *cu = upf_sparse_cu_q_host(b);
  std::vector<union_req> reqs((size_t)B);
  for (int32_t r = 0; r < B; r++) {
    reqs[(size_t)r].tile0 = plan.cu_q_tiles[r], reqs[(size_t)r].tile1 = plan.cu_q_tiles[r + 1];
    upf_compact_forced(cu[r + 1] - cu[r], upf_sparse_kv_len_host(b, r), p->block_n, cp->recent, &reqs[(size_t)r].lo,
                       &reqs[(size_t)r].hi);
  }
  upf_sparse_plan_free(&plan);
  const size_t o_bad = align256((size_t)B * sizeof(union_req));
  void *ws = nullptr;
  UPF_TRY(upf_cuda_workspace(o_bad + sizeof(int32_t), &ws));
  unsigned char *w8 = static_cast<unsigned char *>(ws);
  std::vector<unsigned char> blob(o_bad + sizeof(int32_t));
  memcpy(blob.data(), reqs.data(), (size_t)B * sizeof(union_req));
  const int32_t none = INT32_MAX;
  memcpy(blob.data() + o_bad, &none, sizeof none);
  UPF_TRY(upf_cuda_upload_async(w8, blob.data(), blob.size()));
  int32_t *bad = reinterpret_cast<int32_t *>(w8 + o_bad);
  union_kernel<<<(unsigned)((int64_t)B * hkv), UNION_THREADS, 0, upf_cuda_stream()>>>(
      index->row_ptr, index->blocks, reinterpret_cast<const union_req *>(w8), hkv, T, nb,
      static_cast<uint8_t *>(table->data), counts, bad);
  UPF_CUDA_LAUNCH_TRY("union_kernel");
  int32_t first_bad = INT32_MAX;
  UPF_TRY(upf_cuda_download_small(&first_bad, bad, sizeof first_bad));
  if (first_bad != INT32_MAX) {
    int32_t value = 0;
    UPF_TRY(upf_cuda_download_small(&value, index->blocks + first_bad, sizeof value));
    return upf_fail(UPF_ERR_INVALID_ARG, "compact.block_union: index blocks[%d]=%d outside [0, %d)", first_bad, value,
                    nb);
  }
  return UPF_OK;
}

extern "C" upf_status upf_cuda_compact_block_tables(const upf_attn_paged *batch, const upf_tensor *table,
                                                    int32_t block_n, const upf_compact_tables *out) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_compact_tables_check(batch, table, block_n, out));
  const int32_t B = batch->num_reqs, hkv = (int32_t)table->shape[1], nb = (int32_t)table->shape[2];
  const int64_t threads = (int64_t)B * hkv * 32;
  tables_kernel<<<(unsigned)((threads + TABLES_THREADS - 1) / TABLES_THREADS), TABLES_THREADS, 0,
                  upf_cuda_stream()>>>(batch->kv_lens, batch->block_table, batch->max_blocks,
                                       static_cast<const uint8_t *>(table->data), hkv, B, nb, block_n,
                                       batch->page_size, out->block_table, out->max_blocks, out->kv_lens);
  UPF_CUDA_LAUNCH_TRY("tables_kernel");
  return UPF_OK;
}

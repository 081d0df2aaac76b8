/* CPU reference of CompactAttention's ops (ref_cpu/compact_attn.h): the union of a chunk's kept key
 * blocks per (request, KV head) and the block tables of the kept blocks' pages. */
#include "ref_cpu/compact_attn.h"

#include <string.h>

upf_status cpu_compact_block_union(const upf_sparse_batch *b, int32_t hq, const upf_sparse_params *p,
                                   const upf_sparse_index *index, const upf_compact_params *cp,
                                   const upf_tensor *table, int32_t *counts) {
  const char *op = "compact.block_union";
  upf_sparse_plan plan;
  UPF_TRY(upf_compact_union_check(b, hq, p, index, cp, table, counts, &plan));
  const int64_t nb = table->shape[2], hkv = plan.hkv;
  const int32_t *cu = upf_sparse_cu_q_host(b);
  uint8_t *t = table->data;
  upf_status st = UPF_OK;
  memset(t, 0, (size_t)(plan.num_reqs * hkv * nb));
  for (int32_t r = 0; r < plan.num_reqs && st == UPF_OK; r++) {
    int32_t lo, hi;
    upf_compact_forced(cu[r + 1] - cu[r], upf_sparse_kv_len_host(b, r), p->block_n, cp->recent, &lo, &hi);
    for (int64_t h = 0; h < hkv && st == UPF_OK; h++) {
      uint8_t *row = t + (r * hkv + h) * nb;
      for (int32_t blk = lo; blk <= hi; blk++)
        row[blk] = 1;
      for (int64_t tile = plan.cu_q_tiles[r]; tile < plan.cu_q_tiles[r + 1]; tile++) {
        const int64_t s = h * plan.total_q_tiles + tile;
        for (int32_t i = index->row_ptr[s]; i < index->row_ptr[s + 1]; i++) {
          if (index->blocks[i] < 0 || index->blocks[i] >= nb) {
            st = upf_fail(UPF_ERR_INVALID_ARG, "%s: index blocks[%d]=%d (segment %lld) outside [0, %lld)", op, i,
                          index->blocks[i], (long long)s, (long long)nb);
            break;
          }
          row[index->blocks[i]] = 1;
        }
      }
      int32_t n = 0;
      for (int64_t blk = 0; blk < nb; blk++)
        n += row[blk];
      counts[r * hkv + h] = n;
    }
  }
  upf_sparse_plan_free(&plan);
  return st;
}

upf_status cpu_compact_block_tables(const upf_attn_paged *batch, const upf_tensor *table, int32_t block_n,
                                    const upf_compact_tables *out) {
  UPF_TRY(upf_compact_tables_check(batch, table, block_n, out));
  const int64_t B = batch->num_reqs, hkv = table->shape[1], nb = table->shape[2], P = batch->page_size;
  const int64_t per = block_n / P; /* pages a whole block */
  const uint8_t *t = table->data;
  for (int64_t h = 0; h < hkv; h++)
    for (int64_t r = 0; r < B; r++) {
      const int64_t kv_len = batch->kv_lens_host[r];
      const int64_t nb_r = (kv_len + block_n - 1) / block_n;
      const uint8_t *row = t + (r * hkv + h) * nb;
      const int32_t *src = batch->block_table + r * batch->max_blocks;
      int32_t *dst = out->block_table + (h * B + r) * out->max_blocks;
      int64_t pages = 0, kept = 0;
      for (int64_t blk = 0; blk < nb_r; blk++) {
        if (!row[blk])
          continue;
        const int64_t keys = kv_len - blk * block_n < block_n ? kv_len - blk * block_n : block_n;
        for (int64_t i = 0; i < (keys + P - 1) / P; i++)
          dst[pages++] = src[blk * per + i];
        kept += keys;
      }
      for (int64_t i = pages; i < out->max_blocks; i++)
        dst[i] = -1;
      out->kv_lens[h * B + r] = (int32_t)kept;
    }
  return UPF_OK;
}

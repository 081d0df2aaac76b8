/* CPU reference of the paged KV metadata ops: the slot mapping and the row scatter. */
#include "ref_cpu/kv.h"

#include <string.h>

upf_status cpu_kv_slot_mapping(const upf_kv_slot_batch *b, int32_t *slot_mapping) {
  UPF_TRY(upf_kv_slot_mapping_check(b));
  const int64_t P = b->page_size;
  for (int32_t r = 0; r < b->num_reqs; r++)
    for (int64_t t = b->cu_seqlens[r]; t < b->cu_seqlens[r + 1]; t++) {
      const int64_t i = b->start[r] + (t - b->cu_seqlens[r]);
      slot_mapping[t] = (int32_t)(b->block_table[(int64_t)r * b->max_blocks + i / P] * P + i % P);
    }
  return UPF_OK;
}

upf_status cpu_scatter_rows(const void *src, int64_t num_src, int64_t row_bytes, const int32_t *index,
                            const int32_t *index_host, void *dst, int64_t num_dst_rows) {
  UPF_TRY(upf_scatter_rows_check(num_src, row_bytes, index_host, num_dst_rows));
  for (int64_t i = 0; i < num_src; i++)
    memcpy((char *)dst + (int64_t)index[i] * row_bytes, (const char *)src + i * row_bytes, (size_t)row_bytes);
  return UPF_OK;
}

/* Checks shared by the backends of the paged KV metadata ops (uniprefill/kv.h). */
#include <stdlib.h>

#include "uniprefill/kv.h"
#include "uniprefill/select.h"

upf_status upf_kv_slot_mapping_check(const upf_kv_slot_batch *b) {
  const char *op = "kv.slot_mapping";
  if (b->num_reqs < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: num_reqs=%d, needs at least one row", op, b->num_reqs);
  if (b->page_size < 1 || b->max_blocks < 0 || b->num_pages < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: page_size=%d, max_blocks=%d, num_pages=%lld out of range", op,
                    b->page_size, b->max_blocks, (long long)b->num_pages);
  if (!b->cu_seqlens_host || !b->start_host || (b->max_blocks && !b->block_table_host))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL host copy of cu_seqlens, start or block_table", op);
  const int32_t *cu = b->cu_seqlens_host;
  UPF_TRY(upf_cu_seqlens_check(cu, b->num_reqs, cu[b->num_reqs]));
  if ((int64_t)b->num_pages * b->page_size > INT32_MAX)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: %lld pages of %d exceed the int32 slot range", op,
                    (long long)b->num_pages, b->page_size);
  for (int32_t r = 0; r < b->num_reqs; r++) {
    const int64_t n = cu[r + 1] - cu[r], s = b->start_host[r];
    if (s < 0)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: start[%d]=%lld is negative", op, r, (long long)s);
    if (n == 0)
      continue;
    const int64_t last_block = (s + n - 1) / b->page_size;
    if (last_block >= b->max_blocks)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: row %d reaches logical index %lld, page %lld of a %d-page block table",
                      op, r, (long long)(s + n - 1), (long long)last_block, b->max_blocks);
    for (int64_t p = s / b->page_size; p <= last_block; p++) {
      const int32_t page = b->block_table_host[(int64_t)r * b->max_blocks + p];
      if (page < 0 || page >= b->num_pages)
        return upf_fail(UPF_ERR_INVALID_ARG, "%s: block_table[%d][%lld]=%d outside [0, %lld)", op, r, (long long)p,
                        page, (long long)b->num_pages);
    }
  }
  return UPF_OK;
}

upf_status upf_scatter_rows_check(int64_t num_src, int64_t row_bytes, const int32_t *index_host,
                                  int64_t num_dst_rows) {
  const char *op = "compact.scatter_rows";
  if (num_src < 0 || row_bytes < 0 || num_dst_rows < 0 || num_src > num_dst_rows)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: num_src=%lld, row_bytes=%lld, num_dst_rows=%lld out of range", op,
                    (long long)num_src, (long long)row_bytes, (long long)num_dst_rows);
  if (num_src && !index_host)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL index", op);
  unsigned char *seen = calloc((size_t)(num_dst_rows + 7) / 8 + 1, 1);
  if (!seen)
    return upf_fail(UPF_ERR_NOMEM, "%s: duplicate bitmap of %lld rows", op, (long long)num_dst_rows);
  for (int64_t i = 0; i < num_src; i++) {
    const int32_t d = index_host[i];
    if (d < 0 || d >= num_dst_rows) {
      free(seen);
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: index[%lld]=%d outside [0, %lld)", op, (long long)i, d,
                      (long long)num_dst_rows);
    }
    if (seen[d / 8] & (1u << (d % 8))) {
      free(seen);
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: index[%lld]=%d repeats an earlier row's destination", op,
                      (long long)i, d);
    }
    seen[d / 8] |= (unsigned char)(1u << (d % 8));
  }
  free(seen);
  return UPF_OK;
}

/* CPU reference of the compaction gather. */
#include "ref_cpu/compact.h"

#include <string.h>

upf_status cpu_compact_rows(const void *src, int64_t num_rows, int64_t row_bytes, const int32_t *kept_index,
                            int64_t kept_total, void *dst) {
  if (row_bytes < 0 || kept_total < 0 || kept_total > num_rows)
    return upf_fail(UPF_ERR_INVALID_ARG, "compact.rows: kept_total=%lld, num_rows=%lld, row_bytes=%lld out of range",
                    (long long)kept_total, (long long)num_rows, (long long)row_bytes);
  for (int64_t i = 0; i < kept_total; i++)
    if (kept_index[i] < 0 || kept_index[i] >= num_rows)
      return upf_fail(UPF_ERR_INVALID_ARG, "compact.rows: kept_index[%lld]=%d outside [0, %lld)", (long long)i,
                      kept_index[i], (long long)num_rows);
  for (int64_t i = 0; i < kept_total; i++)
    memcpy((char *)dst + i * row_bytes, (const char *)src + (int64_t)kept_index[i] * row_bytes, (size_t)row_bytes);
  return UPF_OK;
}

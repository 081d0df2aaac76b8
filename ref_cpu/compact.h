/* CPU reference of the compaction gather: rows of any [T, ...] tensor picked by the kept index. */
#ifndef UNIPREFILL_REF_COMPACT_H
#define UNIPREFILL_REF_COMPACT_H

#include <stdint.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst (kept_total, row_bytes) = src (num_rows, row_bytes)[kept_index]; every index must be in
 * [0, num_rows) (UPF_ERR_INVALID_ARG otherwise, before anything is written). */
upf_status cpu_compact_rows(const void *src, int64_t num_rows, int64_t row_bytes, const int32_t *kept_index,
                            int64_t kept_total, void *dst);

#ifdef __cplusplus
}
#endif
#endif

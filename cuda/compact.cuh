/* CUDA compaction gather (plain C header): dst[i, :] = src[kept_index[i], :]. */
#ifndef UNIPREFILL_CUDA_COMPACT_CUH
#define UNIPREFILL_CUDA_COMPACT_CUH

#include <stdint.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst (kept_total, row_bytes) = src (num_rows, row_bytes)[kept_index] (device pointers). Every index
 * must be in [0, num_rows): checked on the device before anything is written (UPF_ERR_INVALID_ARG),
 * which costs one small device-to-host read. Copies 16 bytes per access when row_bytes and both
 * pointers allow, else 8, 4 or 1. */
upf_status upf_cuda_compact_rows(const void *src, int64_t num_rows, int64_t row_bytes, const int32_t *kept_index,
                                 int64_t kept_total, void *dst);

#ifdef __cplusplus
}
#endif
#endif

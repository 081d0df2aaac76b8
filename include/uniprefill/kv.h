/* Paged KV metadata ops (SPEC.md section 4): the slot of every token of a step in a cache group's
 * pages, from the step's (possibly compacted) cu_seqlens, each row's first logical KV index and the
 * rows' block tables, and the row scatter that puts per-request states back in their slots. Types and
 * the checks both backends share; the entries are in the backend ops table (uniprefill/backend.h). */
#ifndef UNIPREFILL_KV_H
#define UNIPREFILL_KV_H

#include <stdint.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One step's rows over one cache group: token i (0-based) of row r sits at logical KV index
 * start[r] + i (0 for a prefill row, kv_len for a decode row), so its slot is
 * block_table[r * max_blocks + (start[r] + i) / P] * P + (start[r] + i) % P. */
typedef struct {
  int32_t num_reqs;                 /* B >= 1 */
  const int32_t *cu_seqlens;        /* (B+1) backend memory: the step's rows (after the drops so far) */
  const int32_t *cu_seqlens_host;   /* (B+1) host copy */
  const int32_t *start;             /* (B) backend memory: logical index of each row's first token */
  const int32_t *start_host;        /* (B) host copy */
  const int32_t *block_table;       /* (B, max_blocks) backend memory */
  const int32_t *block_table_host;  /* (B, max_blocks) host copy: every page reached is range-checked */
  int32_t max_blocks;               /* row stride of block_table */
  int32_t page_size;                /* P >= 1 */
  int64_t num_pages;                /* pages of the group's caches */
} upf_kv_slot_batch;

/* cu_seqlens valid, start >= 0, every row's last index inside its block-table row
 * ((start + n - 1) / P < max_blocks) and every page it reaches in [0, num_pages), slots < 2^31. */
upf_status upf_kv_slot_mapping_check(const upf_kv_slot_batch *b);

/* dst (num_dst_rows, row_bytes)[index[i]] = src (num_src, row_bytes)[i] for i < num_src: every index
 * in [0, num_dst_rows) and no two equal (index_host is the host copy the check reads). */
upf_status upf_scatter_rows_check(int64_t num_src, int64_t row_bytes, const int32_t *index_host,
                                  int64_t num_dst_rows);

#ifdef __cplusplus
}
#endif
#endif

/* CompactAttention's parameters and the shape checks of its two ops, shared by every backend so the CPU
 * reference and CUDA reject the same inputs with the same message (uniprefill/compact_attn.h). */
#include "uniprefill/compact_attn.h"

#include <stdlib.h>

upf_compact_params upf_compact_params_default(void) {
  upf_compact_params cp = {2};
  return cp;
}

upf_status upf_compact_params_check(const upf_compact_params *cp) {
  if (!cp)
    return upf_fail(UPF_ERR_INVALID_ARG, "compact: NULL params");
  if (cp->recent < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "compact: recent=%d must be >= 0 (blocks)", cp->recent);
  return UPF_OK;
}

/* table (B, Hkv, nb) u8, contiguous. want_nb < 0: any nb >= min_nb. */
static upf_status check_table(const char *op, const upf_tensor *table, int64_t B, int64_t hkv, int64_t want_nb,
                              int64_t min_nb) {
  if (!table || !table->data)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL table", op);
  if (table->dtype != UPF_DTYPE_U8)
    return upf_fail(UPF_ERR_DTYPE, "%s: table must be u8 (|u1), got %s", op, upf_dtype_name(table->dtype));
  if (table->ndim != 3 || table->shape[0] != B || (hkv >= 0 && table->shape[1] != hkv) || table->shape[1] < 1 ||
      (want_nb >= 0 && table->shape[2] != want_nb) || table->shape[2] < min_nb)
    return upf_fail(UPF_ERR_SHAPE, "%s: table must be (B=%lld, Hkv, key_blocks=%lld%s), got ndim %d (%lld, %lld, %lld)",
                    op, (long long)B, (long long)(want_nb >= 0 ? want_nb : min_nb), want_nb >= 0 ? "" : " or more",
                    table->ndim, (long long)(table->ndim > 0 ? table->shape[0] : -1),
                    (long long)(table->ndim > 1 ? table->shape[1] : -1),
                    (long long)(table->ndim > 2 ? table->shape[2] : -1));
  if (!upf_tensor_is_contiguous(table))
    return upf_fail(UPF_ERR_SHAPE, "%s: table must be contiguous", op);
  return UPF_OK;
}

upf_status upf_compact_union_check(const upf_sparse_batch *b, int32_t hq, const upf_sparse_params *p,
                                   const upf_sparse_index *index, const upf_compact_params *cp,
                                   const upf_tensor *table, const int32_t *counts, upf_sparse_plan *plan) {
  const char *op = "compact.block_union";
  *plan = (upf_sparse_plan){0};
  UPF_TRY(upf_compact_params_check(cp));
  if (!b || (!b->contiguous) == (!b->paged))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: the batch must give exactly one of contiguous or paged K/V", op);
  if (!index || !index->row_ptr || !index->blocks)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL index (row_ptr and blocks are required)", op);
  if (!counts)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL counts", op);
  if (!table || table->ndim != 3)
    return upf_fail(UPF_ERR_SHAPE, "%s: table must be (B, Hkv, key_blocks)%s", op, table ? "" : " (NULL)");
  if (table->shape[1] < 1 || table->shape[1] > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: table has Hkv=%lld (dim 1)", op, (long long)table->shape[1]);
  const int32_t B = upf_sparse_num_reqs(b);
  const int32_t *cu = upf_sparse_cu_q_host(b);
  if (B < 1 || !cu)
    return upf_fail(UPF_ERR_CU_SEQLENS, "%s: a batch needs >= 1 request and host cu_seqlens_q (B=%d)", op, B);
  if (cu[0] != 0)
    return upf_fail(UPF_ERR_CU_SEQLENS, "%s: cu_seqlens_q[0]=%d must be 0", op, cu[0]);
  for (int32_t r = 0; r < B; r++) {
    if (cu[r + 1] < cu[r])
      return upf_fail(UPF_ERR_CU_SEQLENS, "%s: cu_seqlens_q decreases at request %d", op, r);
    if (upf_sparse_kv_len_host(b, r) < cu[r + 1] - cu[r])
      return upf_fail(UPF_ERR_CU_SEQLENS, "%s: request %d has kv_len=%d < q_len=%d (queries are the last kv rows)",
                      op, r, upf_sparse_kv_len_host(b, r), cu[r + 1] - cu[r]);
  }
  upf_status st = upf_sparse_plan_make(b, hq, (int32_t)table->shape[1], p, plan);
  if (st != UPF_OK)
    return upf_fail_context(st, "compact.block_union: ");
  st = check_table(op, table, B, -1, plan->max_key_blocks, 0);
  if (st != UPF_OK)
    upf_sparse_plan_free(plan);
  return st;
}

upf_status upf_compact_tables_check(const upf_attn_paged *batch, const upf_tensor *table, int32_t block_n,
                                    const upf_compact_tables *out) {
  const char *op = "compact.block_tables";
  if (!batch)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL batch", op);
  if (!out || !out->block_table || !out->kv_lens)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL out (block_table and kv_lens are required)", op);
  const int32_t B = batch->num_reqs, P = batch->page_size;
  if (B < 1 || !batch->cu_seqlens_q_host || !batch->kv_lens || !batch->kv_lens_host || !batch->block_table ||
      !batch->block_table_host)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: batch needs B >= 1 (B=%d), host cu_seqlens_q, kv_lens and block_table",
                    op, B);
  if (P < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: page_size=%d must be >= 1", op, P);
  if (block_n < 1 || block_n % P != 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: block_n=%d must be a positive multiple of page_size=%d", op, block_n, P);
  int64_t max_kv = 0;
  for (int32_t r = 0; r < B; r++) {
    const int64_t q_len = (int64_t)batch->cu_seqlens_q_host[r + 1] - batch->cu_seqlens_q_host[r];
    const int64_t kv_len = batch->kv_lens_host[r];
    if (q_len < 0 || kv_len < q_len)
      return upf_fail(UPF_ERR_CU_SEQLENS, "%s: request %d has q_len=%lld, kv_len=%lld (need 0 <= q_len <= kv_len)",
                      op, r, (long long)q_len, (long long)kv_len);
    if ((kv_len + P - 1) / P > batch->max_blocks)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: request %d needs %lld pages for kv_len=%lld but max_blocks=%d", op, r,
                      (long long)((kv_len + P - 1) / P), (long long)kv_len, batch->max_blocks);
    max_kv = kv_len > max_kv ? kv_len : max_kv;
  }
  UPF_TRY(check_table(op, table, B, -1, -1, (max_kv + block_n - 1) / block_n));
  if (table->shape[1] * B > INT32_MAX || (int64_t)out->max_blocks * table->shape[1] * B > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: Hkv * B * max_blocks passes 2^31", op);
  if (out->max_blocks < (max_kv + P - 1) / P)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: out max_blocks=%d < %lld pages of the longest request", op,
                    out->max_blocks, (long long)((max_kv + P - 1) / P));
  return UPF_OK;
}

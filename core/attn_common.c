/* Parameter, shape and index checks of the attention ops, shared by every backend so the CPU reference
 * and CUDA reject the same inputs with the same status and message; the exact causal/window FLOPs. */
#include "uniprefill/attn.h"

#include <math.h>
#include <stdlib.h>

#include "uniprefill/dense.h"
#include "uniprefill/select.h"

upf_status upf_attn_params_check(const upf_attn_params *p) {
  if (!p)
    return upf_fail(UPF_ERR_INVALID_ARG, "attn: NULL params");
  if (!isfinite(p->scale) || p->scale < 0.0f)
    return upf_fail(UPF_ERR_INVALID_ARG, "attn: scale=%g must be finite and >= 0 (0: 1/sqrt(D))", (double)p->scale);
  if (!isfinite(p->softcap) || p->softcap < 0.0f)
    return upf_fail(UPF_ERR_INVALID_ARG, "attn: softcap=%g must be finite and >= 0 (0: off)", (double)p->softcap);
  if (p->window < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "attn: window=%d must be >= 0 (0: full causal)", p->window);
  return UPF_OK;
}

double upf_attn_scale(const upf_attn_params *p, int64_t head_dim) {
  return p->scale > 0.0f ? (double)p->scale : 1.0 / sqrt((double)head_dim);
}

float upf_attn_gemma_scale(double query_pre_attn_scalar) { return (float)(1.0 / sqrt(query_pre_attn_scalar)); }

/* q, out (Tq, Hq, D) and lse (Tq, Hq); k and v already checked, (.., Hkv, D) as their last two dims. */
static upf_status check_q_out_lse(const char *op, const upf_tensor *q, const upf_tensor *k, const upf_tensor *out,
                                  const upf_tensor *lse) {
  int kd = k->ndim;
  const int64_t want_q[3] = {-1, -1, k->shape[kd - 1]};
  UPF_TRY(upf_dense_check(q, op, "q", 3, want_q));
  UPF_TRY(upf_dense_same_dtype(q, k, op, "q", "k"));
  int64_t hq = q->shape[1], hkv = k->shape[kd - 2];
  if (hkv < 1 || hq % hkv != 0)
    return upf_fail(UPF_ERR_SHAPE, "%s: Hq=%lld is not a multiple of Hkv=%lld (GQA)", op, (long long)hq,
                    (long long)hkv);
  if (q->shape[2] < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: head dim D=%lld must be >= 1", op, (long long)q->shape[2]);
  UPF_TRY(upf_dense_check(out, op, "out", 3, q->shape));
  UPF_TRY(upf_dense_same_dtype(q, out, op, "q", "out"));
  if (lse) {
    const int64_t want_lse[2] = {q->shape[0], hq};
    UPF_TRY(upf_dense_check(lse, op, "lse", 2, want_lse));
    if (lse->dtype != UPF_DTYPE_F32)
      return upf_fail(UPF_ERR_DTYPE, "%s: lse is %s, must be f32", op, upf_dtype_name(lse->dtype));
    if (lse->stride[0] != hq)
      return upf_fail(UPF_ERR_SHAPE, "%s: lse must be contiguous (Tq, Hq) (row stride %lld)", op,
                      (long long)lse->stride[0]);
  }
  return UPF_OK;
}

static upf_status check_lens(const char *op, int32_t r, int64_t q_len, int64_t kv_len) {
  if (kv_len < q_len)
    return upf_fail(UPF_ERR_CU_SEQLENS, "%s: request %d has kv_len=%lld < q_len=%lld (queries are the last kv rows)",
                    op, r, (long long)kv_len, (long long)q_len);
  return UPF_OK;
}

upf_status upf_attn_prefill_check(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                  const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                                  const upf_tensor *lse) {
  const char *op = "attn.prefill";
  if (!b)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL batch", op);
  UPF_TRY(upf_attn_params_check(p));
  UPF_TRY(upf_dense_check(k, op, "k", 3, NULL));
  UPF_TRY(upf_dense_check(v, op, "v", 3, k->shape));
  UPF_TRY(upf_dense_same_dtype(k, v, op, "k", "v"));
  UPF_TRY(check_q_out_lse(op, q, k, out, lse));
  if (upf_cu_seqlens_check(b->cu_seqlens_q_host, b->num_reqs, q->shape[0]) != UPF_OK)
    return upf_fail_context(UPF_ERR_CU_SEQLENS, "attn.prefill: q ");
  if (upf_cu_seqlens_check(b->cu_seqlens_kv_host, b->num_reqs, k->shape[0]) != UPF_OK)
    return upf_fail_context(UPF_ERR_CU_SEQLENS, "attn.prefill: kv ");
  if (!b->cu_seqlens_q || !b->cu_seqlens_kv)
    return upf_fail(UPF_ERR_CU_SEQLENS, "%s: NULL backend cu_seqlens", op);
  for (int32_t r = 0; r < b->num_reqs; r++)
    UPF_TRY(check_lens(op, r, b->cu_seqlens_q_host[r + 1] - b->cu_seqlens_q_host[r],
                       b->cu_seqlens_kv_host[r + 1] - b->cu_seqlens_kv_host[r]));
  return UPF_OK;
}

/* k_cache and v_cache (num_pages, P, Hkv, D) of one dtype. */
static upf_status check_cache(const char *op, const upf_tensor *k_cache, const upf_tensor *v_cache) {
  UPF_TRY(upf_dense_check(k_cache, op, "k_cache", 4, NULL));
  UPF_TRY(upf_dense_check(v_cache, op, "v_cache", 4, k_cache->shape));
  UPF_TRY(upf_dense_same_dtype(k_cache, v_cache, op, "k_cache", "v_cache"));
  if (k_cache->shape[1] < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: page size (dim 1 of k_cache) must be >= 1", op);
  return UPF_OK;
}

upf_status upf_attn_paged_check(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                                const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                                const upf_tensor *lse) {
  const char *op = "attn.paged";
  if (!b)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL batch", op);
  UPF_TRY(upf_attn_params_check(p));
  UPF_TRY(check_cache(op, k_cache, v_cache));
  UPF_TRY(check_q_out_lse(op, q, k_cache, out, lse));
  if (b->page_size != k_cache->shape[1])
    return upf_fail(UPF_ERR_SHAPE, "%s: page_size=%d but the cache holds pages of %lld tokens", op, b->page_size,
                    (long long)k_cache->shape[1]);
  if (upf_cu_seqlens_check(b->cu_seqlens_q_host, b->num_reqs, q->shape[0]) != UPF_OK)
    return upf_fail_context(UPF_ERR_CU_SEQLENS, "attn.paged: q ");
  if (!b->cu_seqlens_q || !b->kv_lens || !b->kv_lens_host || !b->block_table || !b->block_table_host)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL kv_lens or block_table", op);
  if (b->max_blocks < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: max_blocks=%d must be >= 0", op, b->max_blocks);
  int64_t num_pages = k_cache->shape[0], P = b->page_size;
  for (int32_t r = 0; r < b->num_reqs; r++) {
    int64_t kv_len = b->kv_lens_host[r];
    UPF_TRY(check_lens(op, r, b->cu_seqlens_q_host[r + 1] - b->cu_seqlens_q_host[r], kv_len));
    int64_t pages = (kv_len + P - 1) / P;
    if (pages > b->max_blocks)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: request %d needs %lld pages for kv_len=%lld but max_blocks=%d", op,
                      r, (long long)pages, (long long)kv_len, b->max_blocks);
    for (int64_t i = 0; i < pages; i++) {
      int32_t page = b->block_table_host[(int64_t)r * b->max_blocks + i];
      if (page < 0 || page >= num_pages)
        return upf_fail(UPF_ERR_INVALID_ARG, "%s: block_table[%d][%lld]=%d outside [0, %lld) pages", op, r,
                        (long long)i, page, (long long)num_pages);
    }
  }
  return UPF_OK;
}

upf_status upf_kv_cache_write_check(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping_host,
                                    const upf_tensor *k_cache, const upf_tensor *v_cache) {
  const char *op = "kv_cache.write";
  UPF_TRY(check_cache(op, k_cache, v_cache));
  const int64_t want[3] = {-1, k_cache->shape[2], k_cache->shape[3]};
  UPF_TRY(upf_dense_check(k, op, "k", 3, want));
  UPF_TRY(upf_dense_check(v, op, "v", 3, k->shape));
  UPF_TRY(upf_dense_same_dtype(k_cache, k, op, "k_cache", "k"));
  UPF_TRY(upf_dense_same_dtype(k_cache, v, op, "k_cache", "v"));
  int64_t T = k->shape[0], slots = k_cache->shape[0] * k_cache->shape[1];
  if (T > 0 && !slot_mapping_host)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL slot_mapping", op);
  for (int64_t t = 0; t < T; t++) {
    int32_t s = slot_mapping_host[t];
    if (s < -1 || s >= slots)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: slot_mapping[%lld]=%d outside [0, %lld) (or -1: skip)", op,
                      (long long)t, s, (long long)slots);
  }
  /* Two rows into one slot would race on a GPU: the last writer is not defined. Sorting a copy would
   * allocate; T is a step's token count, so a quadratic scan is avoided by a bitmap over the slots. */
  if (T > 1) {
    unsigned char *seen = calloc((size_t)(slots + 7) / 8, 1);
    if (!seen)
      return upf_fail(UPF_ERR_NOMEM, "%s: cannot allocate the duplicate-slot bitmap (%lld slots)", op,
                      (long long)slots);
    for (int64_t t = 0; t < T; t++) {
      int32_t s = slot_mapping_host[t];
      if (s < 0)
        continue;
      if (seen[s / 8] & (1u << (s % 8))) {
        free(seen);
        return upf_fail(UPF_ERR_INVALID_ARG, "%s: slot_mapping[%lld]=%d repeats an earlier row's slot", op,
                        (long long)t, s);
      }
      seen[s / 8] |= (unsigned char)(1u << (s % 8));
    }
    free(seen);
  }
  return UPF_OK;
}

double upf_attn_flops(const int32_t *q_lens, const int32_t *kv_lens, int32_t num_reqs, int64_t hq, int64_t d,
                      int32_t window) {
  double pairs = 0.0;
  for (int32_t r = 0; r < num_reqs; r++) {
    int64_t off = (int64_t)kv_lens[r] - q_lens[r];
    for (int64_t t = 0; t < q_lens[r]; t++) {
      int64_t pos = t + off, seen = pos + 1;
      if (window > 0 && seen > window)
        seen = window;
      pairs += (double)seen;
    }
  }
  return 4.0 * (double)d * (double)hq * pairs;
}

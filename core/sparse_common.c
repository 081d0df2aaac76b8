/* FlashPrefill V2's parameters, launch plan, shape checks and exact FLOPs, shared by every backend so
 * the CPU reference and CUDA plan alike and reject the same inputs with the same message. */
#include "uniprefill/sparse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "uniprefill/dense.h"
#include "uniprefill/select.h"

upf_sparse_params upf_sparse_params_default(void) {
  upf_sparse_params p = {1.0f, 128, 64, 2, 4, 2, 0, 0, 0.0f};
  return p;
}

upf_status upf_sparse_params_check(const upf_sparse_params *p) {
  if (!p)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: NULL params");
  if (!(p->alpha >= 0.0f && p->alpha <= 1.0f))
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: alpha=%g must be in [0, 1]", (double)p->alpha);
  if (p->block_m < 16 || p->block_m % 16 != 0 || p->block_m > 4096)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: block_m=%d must be a multiple of 16 in [16, 4096]", p->block_m);
  if (p->block_n != 64 && p->block_n != 128)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: block_n=%d must be 64 or 128", p->block_n);
  if (p->sink < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: sink=%d must be >= 0 (blocks)", p->sink);
  if (p->window < 1)
    return upf_fail(UPF_ERR_INVALID_ARG,
                    "sparse: window=%d must be >= 1 (blocks; the window keeps each row's own block)", p->window);
  if (p->last_n < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: last_n=%d must be >= 0 (query tiles)", p->last_n);
  if (p->min_sparse_q_len < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: min_sparse_q_len=%d must be >= 0", p->min_sparse_q_len);
  if (p->mean_correction != 0 && p->mean_correction != 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: mean_correction=%d must be 0 or 1", p->mean_correction);
  if (!isfinite(p->scale) || p->scale < 0.0f)
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: scale=%g must be finite and >= 0 (0: 1/sqrt(D))", (double)p->scale);
  return UPF_OK;
}

float upf_sparse_scale(const upf_sparse_params *p, int64_t head_dim) {
  return p->scale > 0.0f ? p->scale : (float)(1.0 / sqrt((double)head_dim));
}

int32_t upf_sparse_num_reqs(const upf_sparse_batch *b) {
  return b->contiguous ? b->contiguous->num_reqs : b->paged->num_reqs;
}

const int32_t *upf_sparse_cu_q_host(const upf_sparse_batch *b) {
  return b->contiguous ? b->contiguous->cu_seqlens_q_host : b->paged->cu_seqlens_q_host;
}

int32_t upf_sparse_kv_len_host(const upf_sparse_batch *b, int32_t r) {
  if (b->contiguous)
    return b->contiguous->cu_seqlens_kv_host[r + 1] - b->contiguous->cu_seqlens_kv_host[r];
  return b->paged->kv_lens_host[r];
}

upf_status upf_sparse_plan_make(const upf_sparse_batch *b, int32_t hq, int32_t hkv, const upf_sparse_params *p,
                                upf_sparse_plan *plan) {
  *plan = (upf_sparse_plan){0};
  if (!b || (!b->contiguous) == (!b->paged))
    return upf_fail(UPF_ERR_INVALID_ARG, "sparse: the batch must give exactly one of contiguous or paged K/V");
  UPF_TRY(upf_sparse_params_check(p));
  if (hkv < 1 || hq < 1 || hq % hkv != 0)
    return upf_fail(UPF_ERR_SHAPE, "sparse: Hq=%d is not a multiple of Hkv=%d (GQA)", hq, hkv);
  const int32_t B = upf_sparse_num_reqs(b);
  const int32_t *cu = upf_sparse_cu_q_host(b);
  if (B < 1 || !cu)
    return upf_fail(UPF_ERR_CU_SEQLENS, "sparse: a batch needs >= 1 request and host cu_seqlens_q (B=%d)", B);
  plan->cu_q_tiles = malloc((size_t)(B + 1) * sizeof *plan->cu_q_tiles);
  if (!plan->cu_q_tiles)
    return upf_fail(UPF_ERR_NOMEM, "sparse: plan of %d requests", B);
  plan->num_reqs = B, plan->group = hq / hkv, plan->hkv = hkv;
  int64_t tiles = 0, max_kv = 0;
  plan->cu_q_tiles[0] = 0;
  for (int32_t r = 0; r < B; r++) {
    const int64_t q_len = (int64_t)cu[r + 1] - cu[r], kv_len = upf_sparse_kv_len_host(b, r);
    tiles += (q_len * plan->group + p->block_m - 1) / p->block_m;
    if (tiles * hkv > INT32_MAX) {
      upf_sparse_plan_free(plan);
      return upf_fail(UPF_ERR_SHAPE, "sparse: more than 2^31 (KV head, query tile) segments");
    }
    plan->cu_q_tiles[r + 1] = (int32_t)tiles;
    max_kv = kv_len > max_kv ? kv_len : max_kv;
  }
  plan->total_q_tiles = (int32_t)tiles;
  plan->num_segments = (int32_t)(tiles * hkv);
  plan->max_key_blocks = max_kv > 0 ? (int32_t)((max_kv + p->block_n - 1) / p->block_n) : 1;
  /* the index holds int32 offsets into (segments, max_key_blocks) arrays (row_ptr, blocks, scores) */
  const int64_t cells = (int64_t)plan->num_segments * plan->max_key_blocks;
  if (cells > INT32_MAX) {
    const int32_t S = plan->num_segments, nb = plan->max_key_blocks;
    upf_sparse_plan_free(plan);
    return upf_fail(UPF_ERR_SHAPE,
                    "sparse: the index of this batch would hold %lld (segment, key block) cells (%d segments x %d key "
                    "blocks), past the 2^31 its int32 offsets address: split the batch, or raise block_m or block_n",
                    (long long)cells, S, nb);
  }
  return UPF_OK;
}

void upf_sparse_plan_free(upf_sparse_plan *plan) {
  if (plan) {
    free(plan->cu_q_tiles);
    plan->cu_q_tiles = NULL;
  }
}

upf_status upf_sparse_batch_check(const char *op, const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                  const upf_tensor *v) {
  if (!b || (!b->contiguous) == (!b->paged))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: the batch must give exactly one of contiguous or paged K/V", op);
  if (!q)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL q", op);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  const upf_status st = !k ? UPF_OK
                        : b->contiguous ? upf_attn_prefill_check(b->contiguous, q, k, v ? v : k, &ap, q, NULL)
                                        : upf_attn_paged_check(b->paged, q, k, v ? v : k, &ap, q, NULL);
  if (st != UPF_OK) {
    char context[64];
    snprintf(context, sizeof context, "%s: ", op);
    return upf_fail_context(st, context);
  }
  if (!k) { /* the index reads no K: the lengths alone */
    UPF_TRY(upf_dense_check(q, op, "q", 3, NULL));
    const int32_t B = upf_sparse_num_reqs(b);
    const int32_t *cu = upf_sparse_cu_q_host(b);
    if (upf_cu_seqlens_check(cu, B, q->shape[0]) != UPF_OK) {
      char context[64];
      snprintf(context, sizeof context, "%s: q ", op);
      return upf_fail_context(UPF_ERR_CU_SEQLENS, context);
    }
    for (int32_t r = 0; r < B; r++)
      if (upf_sparse_kv_len_host(b, r) < cu[r + 1] - cu[r])
        return upf_fail(UPF_ERR_CU_SEQLENS, "%s: request %d has kv_len=%d < q_len=%d (queries are the last kv rows)",
                        op, r, upf_sparse_kv_len_host(b, r), cu[r + 1] - cu[r]);
  }
  return UPF_OK;
}

upf_status upf_sparse_kv_check(const char *op, const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v) {
  if (!k)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL k", op);
  if (!b || (!b->contiguous) == (!b->paged))
    return upf_sparse_batch_check(op, b, k, k, v);
  UPF_TRY(upf_dense_check(k, op, "k", b->contiguous ? 3 : 4, NULL));
  const int32_t B = upf_sparse_num_reqs(b);
  const int32_t *cu = upf_sparse_cu_q_host(b);
  if (B < 1 || !cu)
    return upf_fail(UPF_ERR_CU_SEQLENS, "%s: a batch needs >= 1 request and host cu_seqlens_q (B=%d)", op, B);
  /* a contiguous (cu_q[B], Hkv, D) view over k stands in for q */
  upf_tensor q;
  const int64_t shape[3] = {cu[B] > 0 ? cu[B] : 0, k->shape[k->ndim - 2], k->shape[k->ndim - 1]};
  UPF_TRY(upf_tensor_init(&q, k->data, k->dtype, 3, shape));
  return upf_sparse_batch_check(op, b, &q, k, v);
}

upf_status upf_sparse_means_check(const char *op, const upf_sparse_plan *plan, const upf_tensor *k,
                                  const upf_tensor *kbar, const upf_tensor *vbar) {
  if (!kbar)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL kbar", op);
  const int64_t d = kbar->ndim == 4 ? kbar->shape[3] : -1;
  const int64_t want[4] = {plan->num_reqs, plan->max_key_blocks, plan->hkv, k ? k->shape[k->ndim - 1] : d};
  UPF_TRY(upf_dense_check(kbar, op, "kbar", 4, want));
  if (!upf_tensor_is_contiguous(kbar))
    return upf_fail(UPF_ERR_SHAPE, "%s: kbar must be contiguous", op);
  if (k)
    UPF_TRY(upf_dense_same_dtype(k, kbar, op, "k", "kbar"));
  if (vbar) {
    UPF_TRY(upf_dense_check(vbar, op, "vbar", 4, want));
    if (!upf_tensor_is_contiguous(vbar))
      return upf_fail(UPF_ERR_SHAPE, "%s: vbar must be contiguous", op);
    UPF_TRY(upf_dense_same_dtype(kbar, vbar, op, "kbar", "vbar"));
  }
  return UPF_OK;
}

/* Runs the statement for every query tile of the batch, in segment order within a KV head. */
#define FOR_EACH_TILE(b, plan, p, t, ...)                                                                    \
  do {                                                                                                       \
    const int32_t *cu_ = upf_sparse_cu_q_host(b);                                                            \
    for (int32_t r_ = 0; r_ < (plan)->num_reqs; r_++) {                                                      \
      const int32_t q_len_ = cu_[r_ + 1] - cu_[r_], kv_len_ = upf_sparse_kv_len_host(b, r_);                 \
      for (int32_t m_ = 0; m_ < (plan)->cu_q_tiles[r_ + 1] - (plan)->cu_q_tiles[r_]; m_++) {                 \
        const upf_sparse_tile t = upf_sparse_tile_at(r_, m_, q_len_, kv_len_, (plan)->group, p);             \
        __VA_ARGS__;                                                                                         \
      }                                                                                                      \
    }                                                                                                        \
  } while (0)

double upf_sparse_attn_flops(const upf_sparse_batch *b, const upf_sparse_plan *plan, const upf_sparse_params *p,
                             int64_t d, const int32_t *row_ptr_host, const int32_t *blocks_host) {
  double pairs = 0.0;
  for (int32_t h = 0; h < plan->hkv; h++) {
    int32_t tile_index = 0;
    FOR_EACH_TILE(b, plan, p, t, {
      const int32_t s = h * plan->total_q_tiles + tile_index++;
      const int64_t prefix = (int64_t)t.kv_len - t.q_len;
      const int64_t rows = (int64_t)t.q_len * plan->group;
      const int64_t r0 = (int64_t)t.m * p->block_m, r1 = r0 + p->block_m < rows ? r0 + p->block_m : rows;
      for (int32_t i = row_ptr_host[s]; i < row_ptr_host[s + 1]; i++) {
        const int64_t k0 = (int64_t)blocks_host[i] * p->block_n;
        const int64_t k1 = k0 + p->block_n < t.kv_len ? k0 + p->block_n : t.kv_len;
        for (int64_t row = r0; row < r1; row++) {
          const int64_t pos = prefix + row / plan->group; /* sees keys <= pos */
          const int64_t hi = pos + 1 < k1 ? pos + 1 : k1;
          if (hi > k0)
            pairs += (double)(hi - k0);
        }
      }
    });
  }
  return 4.0 * (double)d * pairs;
}

void upf_sparse_neighbour_blocks(const upf_sparse_plan *plan, const int32_t *row_ptr_host, const int32_t *blocks_host,
                                 int64_t *shared, int64_t *total) {
  int64_t sh = 0, tot = 0;
  for (int32_t h = 0; h < plan->hkv; h++)
    for (int32_t r = 0; r < plan->num_reqs; r++)
      for (int32_t m = plan->cu_q_tiles[r] + 1; m < plan->cu_q_tiles[r + 1]; m++) {
        const int64_t s = (int64_t)h * plan->total_q_tiles + m; /* its predecessor: s - 1 */
        int32_t i = row_ptr_host[s], j = row_ptr_host[s - 1];
        const int32_t i1 = row_ptr_host[s + 1], j1 = row_ptr_host[s];
        tot += i1 - i;
        while (i < i1 && j < j1) { /* both lists ascend */
          if (blocks_host[i] == blocks_host[j])
            sh++, i++, j++;
          else if (blocks_host[i] < blocks_host[j])
            i++;
          else
            j++;
        }
      }
  *shared = sh, *total = tot;
}

int64_t upf_sparse_visible_blocks(const upf_sparse_batch *b, const upf_sparse_plan *plan, const upf_sparse_params *p) {
  int64_t n = 0;
  FOR_EACH_TILE(b, plan, p, t, n += t.last_k + 1);
  return n * plan->hkv;
}

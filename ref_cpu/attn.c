/* CPU reference of the attention ops (see attn.h). */
#include "ref_cpu/attn.h"

#include <math.h>
#include <stdlib.h>

#include "ref_cpu/dense_util.h"

/* Where request r's K/V rows live: contiguous rows from `base`, or pages through its block-table row. */
typedef struct {
  const upf_tensor *k, *v; /* (Tkv, Hkv, D) or (num_pages, P, Hkv, D) */
  int paged;
  int64_t base;            /* contiguous: first kv row of the request */
  const int32_t *bt_row;   /* paged: (max_blocks) page ids of the request */
  int64_t page_size;
} ref_kv;

/* Element offset of head h of logical kv row j in t (k or v). */
static int64_t kv_off(const ref_kv *s, const upf_tensor *t, int64_t j, int64_t h) {
  if (!s->paged)
    return (s->base + j) * t->stride[0] + h * t->stride[1];
  int64_t page = s->bt_row[j / s->page_size], slot = j % s->page_size;
  return page * t->stride[0] + slot * t->stride[1] + h * t->stride[2];
}

/* Scratch of one query row: logits of up to kv_len keys and a D accumulator. */
typedef struct {
  double *s, *acc, *qrow;
} ref_scratch;

/* Rows [q0, q0 + q_len) of q attend over kv_len keys of `src` (bottom-right aligned). Writes out
 * (rounded) or truth (unrounded, row-major (Tq, Hq, D)), and lse when given. */
static void attn_request(const upf_tensor *q, const ref_kv *src, int64_t q0, int64_t q_len, int64_t kv_len,
                         const upf_attn_params *p, const upf_tensor *out, const upf_tensor *lse, double *truth,
                         ref_scratch *w) {
  int64_t hq = q->shape[1], d = q->shape[2], hkv = src->k->shape[src->k->ndim - 2], group = hq / hkv;
  double scale = upf_attn_scale(p, d), cap = p->softcap;
  for (int64_t t = 0; t < q_len; t++) {
    int64_t pos = t + kv_len - q_len;
    int64_t lo = p->window > 0 && pos - p->window + 1 > 0 ? pos - p->window + 1 : 0;
    for (int64_t h = 0; h < hq; h++) {
      int64_t kh = h / group, qoff = (q0 + t) * q->stride[0] + h * q->stride[1];
      for (int64_t e = 0; e < d; e++)
        w->qrow[e] = ref_get(q, qoff + e);
      /* pass 1: logits and their max */
      double m = -INFINITY;
      for (int64_t j = lo; j <= pos; j++) {
        int64_t koff = kv_off(src, src->k, j, kh);
        double dot = 0.0;
        for (int64_t e = 0; e < d; e++)
          dot += w->qrow[e] * ref_get(src->k, koff + e);
        double s = scale * dot;
        if (cap > 0.0)
          s = cap * tanh(s / cap);
        w->s[j - lo] = s;
        m = s > m ? s : m;
      }
      /* pass 2: exponentials relative to the max (no overflow), their sum, the weighted values */
      double l = 0.0;
      for (int64_t e = 0; e < d; e++)
        w->acc[e] = 0.0;
      for (int64_t j = lo; j <= pos; j++) {
        double pj = exp(w->s[j - lo] - m);
        l += pj;
        int64_t voff = kv_off(src, src->v, j, kh);
        for (int64_t e = 0; e < d; e++)
          w->acc[e] += pj * ref_get(src->v, voff + e);
      }
      for (int64_t e = 0; e < d; e++) {
        double o = w->acc[e] / l;
        if (truth)
          truth[((q0 + t) * hq + h) * d + e] = o;
        else
          ref_put(out, (q0 + t) * out->stride[0] + h * out->stride[1] + e, o);
      }
      if (lse)
        ((float *)lse->data)[(q0 + t) * hq + h] = (float)(m + log(l));
    }
  }
}

static upf_status scratch_alloc(ref_scratch *w, int64_t max_kv, int64_t d, const char *op) {
  w->s = malloc((size_t)(max_kv + 2 * d + 1) * sizeof(double));
  if (!w->s)
    return upf_fail(UPF_ERR_NOMEM, "%s (cpu): cannot allocate scratch for kv_len %lld", op, (long long)max_kv);
  w->acc = w->s + max_kv + 1;
  w->qrow = w->acc + d;
  return UPF_OK;
}

static upf_status prefill_run(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                              const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                              const upf_tensor *lse, double *truth) {
  UPF_TRY(upf_attn_prefill_check(b, q, k, v, p, out, lse));
  int64_t max_kv = 0;
  for (int32_t r = 0; r < b->num_reqs; r++) {
    int64_t n = b->cu_seqlens_kv_host[r + 1] - b->cu_seqlens_kv_host[r];
    max_kv = n > max_kv ? n : max_kv;
  }
  ref_scratch w;
  UPF_TRY(scratch_alloc(&w, max_kv, q->shape[2], "attn.prefill"));
  for (int32_t r = 0; r < b->num_reqs; r++) {
    ref_kv src = {.k = k, .v = v, .base = b->cu_seqlens_kv_host[r]};
    int64_t q0 = b->cu_seqlens_q_host[r], q_len = b->cu_seqlens_q_host[r + 1] - q0;
    attn_request(q, &src, q0, q_len, b->cu_seqlens_kv_host[r + 1] - src.base, p, out, lse, truth, &w);
  }
  free(w.s);
  return UPF_OK;
}

static upf_status paged_run(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                            const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                            const upf_tensor *lse, double *truth) {
  UPF_TRY(upf_attn_paged_check(b, q, k_cache, v_cache, p, out, lse));
  int64_t max_kv = 0;
  for (int32_t r = 0; r < b->num_reqs; r++)
    max_kv = b->kv_lens_host[r] > max_kv ? b->kv_lens_host[r] : max_kv;
  ref_scratch w;
  UPF_TRY(scratch_alloc(&w, max_kv, q->shape[2], "attn.paged"));
  for (int32_t r = 0; r < b->num_reqs; r++) {
    ref_kv src = {.k = k_cache, .v = v_cache, .paged = 1, .page_size = b->page_size,
                  .bt_row = b->block_table_host + (int64_t)r * b->max_blocks};
    int64_t q0 = b->cu_seqlens_q_host[r], q_len = b->cu_seqlens_q_host[r + 1] - q0;
    attn_request(q, &src, q0, q_len, b->kv_lens_host[r], p, out, lse, truth, &w);
  }
  free(w.s);
  return UPF_OK;
}

upf_status cpu_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k, const upf_tensor *v,
                            const upf_attn_params *p, const upf_tensor *out, const upf_tensor *lse) {
  return prefill_run(b, q, k, v, p, out, lse, NULL);
}

upf_status cpu_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                          const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                          const upf_tensor *lse) {
  return paged_run(b, q, k_cache, v_cache, p, out, lse, NULL);
}

upf_status ref_attn_prefill_f64(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                const upf_tensor *v, const upf_attn_params *p, double *truth) {
  /* out is only shape-checked on this path: q stands in for it */
  return prefill_run(b, q, k, v, p, q, NULL, truth);
}

upf_status ref_attn_paged_f64(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                              const upf_tensor *v_cache, const upf_attn_params *p, double *truth) {
  return paged_run(b, q, k_cache, v_cache, p, q, NULL, truth);
}

upf_status cpu_kv_cache_write(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping,
                              const int32_t *slot_mapping_host, const upf_tensor *k_cache, const upf_tensor *v_cache) {
  UPF_TRY(upf_kv_cache_write_check(k, v, slot_mapping_host, k_cache, v_cache));
  int64_t P = k_cache->shape[1], hkv = k->shape[1], d = k->shape[2];
  for (int64_t t = 0; t < k->shape[0]; t++) {
    int32_t s = slot_mapping[t];
    if (s < 0)
      continue;
    int64_t page = s / P, slot = s % P;
    for (int64_t h = 0; h < hkv; h++)
      for (int64_t e = 0; e < d; e++) {
        ref_put(k_cache, page * k_cache->stride[0] + slot * k_cache->stride[1] + h * k_cache->stride[2] + e,
                ref_get(k, t * k->stride[0] + h * k->stride[1] + e));
        ref_put(v_cache, page * v_cache->stride[0] + slot * v_cache->stride[1] + h * v_cache->stride[2] + e,
                ref_get(v, t * v->stride[0] + h * v->stride[1] + e));
      }
  }
  return UPF_OK;
}

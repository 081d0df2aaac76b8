/* CPU reference of the attention ops (see attn.h). */
#include "ref_cpu/attn.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
 * (rounded) or truth (unrounded, row-major (Tq, Hq, D)), and lse when given. The plain loops, one
 * query row and head at a time: the oracle the blocked path is tested against. */
static void attn_request_naive(const upf_tensor *q, const ref_kv *src, int64_t q0, int64_t q_len, int64_t kv_len,
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


/* First key a query at position pos sees (window counts the query's own key). */
static int64_t key_lo(const upf_attn_params *p, int64_t pos) {
  return p->window > 0 && pos - p->window + 1 > 0 ? pos - p->window + 1 : 0;
}

/* Doubles of the score block S of one query block; the block has fewer queries when the key range is
 * long, so the scratch stays bounded (32 MB) at any kv_len. */
#define BLOCK_SCORES (4 << 20)
#define BLOCK_QUERIES 64

/* Scratch of the blocked path: one kv head's K and V rows of a request in double, and one query
 * block's Q, scores / probabilities and output. */
typedef struct {
  double *k, *v;     /* (kv rows, D) */
  double *q, *s, *o; /* (group * bq, D), (group * bq, nk), (group * bq, D) */
  int64_t bq;        /* queries per block */
} blk_scratch;

/* The same as attn_request_naive, through cblas_dgemm: for each kv head, K and V of the keys the
 * request's queries can see are widened to double once; for each block of bq queries the group of
 * query heads sharing that kv head forms one (group * bq, D) matrix, S = Q K^T over the keys the
 * block can see (causal and sliding-window aware: key blocks no query of the block sees are never
 * computed), then per row the scale, soft-cap, mask, max, exponentials and their sum in double, and
 * O = P V by a second dgemm, divided by the sum. Every product and sum is in double, as in the
 * naive loops; only the order of the additions differs. */
static void attn_request_blocked(const upf_tensor *q, const ref_kv *src, int64_t q0, int64_t q_len, int64_t kv_len,
                                 const upf_attn_params *p, const upf_tensor *out, const upf_tensor *lse,
                                 double *truth, blk_scratch *w) {
  const int64_t hq = q->shape[1], d = q->shape[2], hkv = src->k->shape[src->k->ndim - 2], group = hq / hkv;
  const double scale = upf_attn_scale(p, d), cap = p->softcap;
  if (q_len == 0)
    return;
  const int64_t shift = kv_len - q_len;          /* position of query t: t + shift */
  const int64_t kv0 = key_lo(p, shift);          /* first key any query of the request sees */
  for (int64_t kh = 0; kh < hkv; kh++) {
    for (int64_t j = kv0; j < kv_len; j++) {
      const int64_t koff = kv_off(src, src->k, j, kh), voff = kv_off(src, src->v, j, kh);
      double *kr = w->k + (j - kv0) * d, *vr = w->v + (j - kv0) * d;
      for (int64_t e = 0; e < d; e++)
        kr[e] = ref_get(src->k, koff + e), vr[e] = ref_get(src->v, voff + e);
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += w->bq) {
      const int64_t nq = q_len - t0 < w->bq ? q_len - t0 : w->bq, rows = group * nq;
      const int64_t lo = key_lo(p, t0 + shift), hi = t0 + nq - 1 + shift, nk = hi - lo + 1;
      for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < nq; i++) {
          const int64_t qoff = (q0 + t0 + i) * q->stride[0] + (kh * group + g) * q->stride[1];
          double *qr = w->q + (g * nq + i) * d;
          for (int64_t e = 0; e < d; e++)
            qr[e] = ref_get(q, qoff + e);
        }
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)nk, (int)d, 1.0, w->q, (int)d,
                  w->k + (lo - kv0) * d, (int)d, 0.0, w->s, (int)nk);
      double *lsum = w->q; /* Q is consumed: its first rows hold each row's sum, then its max */
      for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < nq; i++) {
          const int64_t r = g * nq + i, pos = t0 + i + shift, a = key_lo(p, pos) - lo, b = pos - lo; /* [a, b] */
          double *sr = w->s + r * nk, m = -INFINITY;
          for (int64_t j = a; j <= b; j++) {
            double x = scale * sr[j];
            if (cap > 0.0)
              x = cap * tanh(x / cap);
            sr[j] = x;
            m = x > m ? x : m;
          }
          double l = 0.0;
          for (int64_t j = a; j <= b; j++) {
            sr[j] = exp(sr[j] - m);
            l += sr[j];
          }
          memset(sr, 0, (size_t)a * sizeof *sr);
          memset(sr + b + 1, 0, (size_t)(nk - b - 1) * sizeof *sr);
          lsum[2 * r] = l, lsum[2 * r + 1] = m;
        }
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)d, (int)nk, 1.0, w->s, (int)nk,
                  w->v + (lo - kv0) * d, (int)d, 0.0, w->o, (int)d);
      for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < nq; i++) {
          const int64_t r = g * nq + i, t = q0 + t0 + i, h = kh * group + g;
          const double l = lsum[2 * r], m = lsum[2 * r + 1];
          for (int64_t e = 0; e < d; e++) {
            const double o = w->o[r * d + e] / l;
            if (truth)
              truth[(t * hq + h) * d + e] = o;
            else
              ref_put(out, t * out->stride[0] + h * out->stride[1] + e, o);
          }
          if (lse)
            ((float *)lse->data)[t * hq + h] = (float)(m + log(l));
        }
    }
  }
}

static void blk_free(blk_scratch *w) {
  free(w->k), free(w->v), free(w->q), free(w->s), free(w->o);
  memset(w, 0, sizeof *w);
}

/* Scratch for requests of up to max_kv keys. The per-row (sum, max) pairs reuse Q's buffer, which
 * holds at least 2 doubles a row (D >= 2 or the buffer is sized for it). */
static upf_status blk_alloc(blk_scratch *w, int64_t max_kv, int64_t d, int64_t group, const char *op) {
  memset(w, 0, sizeof *w);
  const int64_t kv = max_kv > 0 ? max_kv : 1;
  int64_t bq = BLOCK_SCORES / (group * kv);
  bq = bq < 1 ? 1 : bq > BLOCK_QUERIES ? BLOCK_QUERIES : bq;
  const int64_t rows = group * bq, dq = d > 2 ? d : 2;
  w->bq = bq;
  w->k = malloc((size_t)(kv * d) * sizeof(double)), w->v = malloc((size_t)(kv * d) * sizeof(double));
  w->q = malloc((size_t)(rows * dq) * sizeof(double)), w->o = malloc((size_t)(rows * d) * sizeof(double));
  w->s = malloc((size_t)(rows * kv) * sizeof(double));
  if (!w->k || !w->v || !w->q || !w->o || !w->s) {
    blk_free(w);
    return upf_fail(UPF_ERR_NOMEM, "%s (cpu): cannot allocate scratch for kv_len %lld, D %lld", op,
                    (long long)max_kv, (long long)d);
  }
  return UPF_OK;
}

static upf_status scratch_alloc(ref_scratch *w, int64_t max_kv, int64_t d, const char *op) {
  w->s = malloc((size_t)(max_kv + 2 * d + 1) * sizeof(double));
  if (!w->s)
    return upf_fail(UPF_ERR_NOMEM, "%s (cpu): cannot allocate scratch for kv_len %lld", op, (long long)max_kv);
  w->acc = w->s + max_kv + 1;
  w->qrow = w->acc + d;
  return UPF_OK;
}

/* One request's attention by the chosen core: the blocked dgemm path (every entry) or the naive loops
 * (the test oracle). */
typedef struct {
  int naive;
  ref_scratch nw;
  blk_scratch bw;
} run_scratch;

static upf_status run_alloc(run_scratch *w, int naive, int64_t max_kv, const upf_tensor *q, const upf_tensor *k,
                            const char *op) {
  memset(w, 0, sizeof *w);
  w->naive = naive;
  if (naive)
    return scratch_alloc(&w->nw, max_kv, q->shape[2], op);
  return blk_alloc(&w->bw, max_kv, q->shape[2], q->shape[1] / k->shape[k->ndim - 2], op);
}

static void run_free(run_scratch *w) {
  if (w->naive)
    free(w->nw.s);
  else
    blk_free(&w->bw);
}

static void run_request(run_scratch *w, const upf_tensor *q, const ref_kv *src, int64_t q0, int64_t q_len,
                        int64_t kv_len, const upf_attn_params *p, const upf_tensor *out, const upf_tensor *lse,
                        double *truth) {
  if (w->naive)
    attn_request_naive(q, src, q0, q_len, kv_len, p, out, lse, truth, &w->nw);
  else
    attn_request_blocked(q, src, q0, q_len, kv_len, p, out, lse, truth, &w->bw);
}

static upf_status prefill_run(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                              const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                              const upf_tensor *lse, double *truth, int naive) {
  UPF_TRY(upf_attn_prefill_check(b, q, k, v, p, out, lse));
  int64_t max_kv = 0;
  for (int32_t r = 0; r < b->num_reqs; r++) {
    int64_t n = b->cu_seqlens_kv_host[r + 1] - b->cu_seqlens_kv_host[r];
    max_kv = n > max_kv ? n : max_kv;
  }
  run_scratch w;
  UPF_TRY(run_alloc(&w, naive, max_kv, q, k, "attn.prefill"));
  for (int32_t r = 0; r < b->num_reqs; r++) {
    ref_kv src = {.k = k, .v = v, .base = b->cu_seqlens_kv_host[r]};
    int64_t q0 = b->cu_seqlens_q_host[r], q_len = b->cu_seqlens_q_host[r + 1] - q0;
    run_request(&w, q, &src, q0, q_len, b->cu_seqlens_kv_host[r + 1] - src.base, p, out, lse, truth);
  }
  run_free(&w);
  return UPF_OK;
}

static upf_status paged_run(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                            const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                            const upf_tensor *lse, double *truth, int naive) {
  UPF_TRY(upf_attn_paged_check(b, q, k_cache, v_cache, p, out, lse));
  int64_t max_kv = 0;
  for (int32_t r = 0; r < b->num_reqs; r++)
    max_kv = b->kv_lens_host[r] > max_kv ? b->kv_lens_host[r] : max_kv;
  run_scratch w;
  UPF_TRY(run_alloc(&w, naive, max_kv, q, k_cache, "attn.paged"));
  for (int32_t r = 0; r < b->num_reqs; r++) {
    ref_kv src = {.k = k_cache, .v = v_cache, .paged = 1, .page_size = b->page_size,
                  .bt_row = b->block_table_host + (int64_t)r * b->max_blocks};
    int64_t q0 = b->cu_seqlens_q_host[r], q_len = b->cu_seqlens_q_host[r + 1] - q0;
    run_request(&w, q, &src, q0, q_len, b->kv_lens_host[r], p, out, lse, truth);
  }
  run_free(&w);
  return UPF_OK;
}

upf_status cpu_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k, const upf_tensor *v,
                            const upf_attn_params *p, const upf_tensor *out, const upf_tensor *lse) {
  return prefill_run(b, q, k, v, p, out, lse, NULL, 0);
}

upf_status cpu_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                          const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                          const upf_tensor *lse) {
  return paged_run(b, q, k_cache, v_cache, p, out, lse, NULL, 0);
}

/* out is only shape-checked on the truth paths: q stands in for it */
upf_status ref_attn_prefill_f64(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                const upf_tensor *v, const upf_attn_params *p, double *truth) {
  return prefill_run(b, q, k, v, p, q, NULL, truth, 0);
}

upf_status ref_attn_paged_f64(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                              const upf_tensor *v_cache, const upf_attn_params *p, double *truth) {
  return paged_run(b, q, k_cache, v_cache, p, q, NULL, truth, 0);
}

upf_status ref_attn_prefill_naive(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                  const upf_tensor *v, const upf_attn_params *p, double *truth, const upf_tensor *lse) {
  return prefill_run(b, q, k, v, p, q, lse, truth, 1);
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

/* CPU reference of FlashPrefill V2 (ref_cpu/sparse.h): block means, the block-sparse index and
 * block-sparse attention with optional mean correction, every sum in double. The index and the
 * attention run through cblas_dgemm per (segment, kept block); plain loops remain as the oracle. */
#include "ref_cpu/sparse.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "uniprefill/dense.h"

/* Doubles of one score block of the attention: the rows of a tile are taken in chunks so the block
 * stays bounded (32 MB) at any kv_len. */
#define SCORE_DOUBLES (4 << 20)

/* Where request r's K/V rows live: contiguous rows from `base`, or pages through its block-table row. */
typedef struct {
  int paged;
  int64_t base;          /* contiguous: first kv row of the request */
  const int32_t *bt_row; /* paged: (max_blocks) page ids of the request */
  int64_t page_size;
} kv_src;

static kv_src kv_src_of(const upf_sparse_batch *b, int32_t r) {
  kv_src s = {0};
  if (b->contiguous) {
    s.base = b->contiguous->cu_seqlens_kv_host[r];
  } else {
    s.paged = 1;
    s.page_size = b->paged->page_size;
    s.bt_row = b->paged->block_table_host + (int64_t)r * b->paged->max_blocks;
  }
  return s;
}

/* Element offset of head h of logical kv row j in t (k or v, (Tkv, Hkv, D) or (pages, P, Hkv, D)). */
static int64_t kv_off(const kv_src *s, const upf_tensor *t, int64_t j, int64_t h) {
  if (!s->paged)
    return (s->base + j) * t->stride[0] + h * t->stride[1];
  const int64_t page = s->bt_row[j / s->page_size], slot = j % s->page_size;
  return page * t->stride[0] + slot * t->stride[1] + h * t->stride[2];
}

static int64_t mean_off(const upf_tensor *t, int64_t r, int64_t blk, int64_t h) {
  return r * t->stride[0] + blk * t->stride[1] + h * t->stride[2];
}

static int64_t max_kv_len(const upf_sparse_batch *b, int32_t num_reqs) {
  int64_t m = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    m = upf_sparse_kv_len_host(b, r) > m ? upf_sparse_kv_len_host(b, r) : m;
  return m;
}

/* ---- sparse.block_means ---- */


upf_status cpu_sparse_block_means(const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v,
                                  const upf_sparse_params *p, const upf_tensor *kbar, const upf_tensor *vbar) {
  const char *op = "sparse.block_means";
  if (vbar && !v)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: vbar given but v is NULL", op);
  UPF_TRY(upf_sparse_kv_check(op, b, k, vbar ? v : NULL));
  const int64_t hkv = k->shape[k->ndim - 2], d = k->shape[k->ndim - 1];
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(b, (int32_t)hkv, (int32_t)hkv, p, &plan));
  upf_status st = upf_sparse_means_check(op, &plan, k, kbar, vbar);
  double *acc = st == UPF_OK ? malloc((size_t)(2 * d) * sizeof *acc) : NULL;
  if (st == UPF_OK && !acc)
    st = upf_fail(UPF_ERR_NOMEM, "%s (cpu): scratch of D=%lld", op, (long long)d);
  if (st != UPF_OK) {
    upf_sparse_plan_free(&plan);
    return st;
  }
  double *vacc = acc + d;
  for (int32_t r = 0; r < plan.num_reqs; r++) {
    const int64_t kv_len = upf_sparse_kv_len_host(b, r);
    const kv_src src = kv_src_of(b, r);
    for (int64_t blk = 0; blk < plan.max_key_blocks; blk++) {
      const int64_t j0 = blk * p->block_n, j1 = j0 + p->block_n < kv_len ? j0 + p->block_n : kv_len;
      for (int64_t h = 0; h < hkv; h++) {
        memset(acc, 0, (size_t)(2 * d) * sizeof *acc);
        for (int64_t j = j0; j < j1; j++) {
          const int64_t ko = kv_off(&src, k, j, h);
          for (int64_t e = 0; e < d; e++)
            acc[e] += ref_get(k, ko + e);
          if (vbar) {
            const int64_t vo = kv_off(&src, v, j, h);
            for (int64_t e = 0; e < d; e++)
              vacc[e] += ref_get(v, vo + e);
          }
        }
        /* blocks at or past kv_len: zeros (their sums are 0 and n is taken as 1) */
        const double n = j1 > j0 ? (double)(j1 - j0) : 1.0;
        for (int64_t e = 0; e < d; e++) {
          ref_put(kbar, mean_off(kbar, r, blk, h) + e, acc[e] / n);
          if (vbar)
            ref_put(vbar, mean_off(vbar, r, blk, h) + e, vacc[e] / n);
        }
      }
    }
  }
  free(acc);
  upf_sparse_plan_free(&plan);
  return UPF_OK;
}

/* ---- sparse.index ---- */

upf_status cpu_sparse_index(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *kbar,
                            const upf_sparse_params *p, upf_sparse_index *index) {
  const char *op = "sparse.index";
  UPF_TRY(upf_sparse_batch_check(op, b, q, NULL, NULL));
  UPF_TRY(upf_dense_check(kbar, op, "kbar", 4, NULL));
  UPF_TRY(upf_dense_same_dtype(q, kbar, op, "q", "kbar"));
  if (!index || !index->row_ptr || !index->blocks)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL index (row_ptr and blocks are required)", op);
  if (kbar->shape[2] < 1 || kbar->shape[2] > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: kbar has Hkv=%lld (dim 2)", op, (long long)kbar->shape[2]);
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(b, (int32_t)q->shape[1], (int32_t)kbar->shape[2], p, &plan));
  upf_status st = upf_sparse_means_check(op, &plan, q, kbar, NULL);
  const int64_t d = q->shape[2], g = plan.group, nbmax = plan.max_key_blocks;
  const int64_t rows_max = p->block_m;
  /* kb: one request's kbar of one head (nb, D); qt: a tile's rows (block_m, D); l: their logits */
  double *kb = NULL, *qt = NULL, *l = NULL, *S = NULL;
  if (st == UPF_OK) {
    kb = malloc((size_t)(nbmax * d) * sizeof *kb);
    qt = malloc((size_t)(rows_max * d) * sizeof *qt);
    l = malloc((size_t)(rows_max * nbmax) * sizeof *l);
    S = malloc((size_t)nbmax * sizeof *S);
    if (!kb || !qt || !l || !S)
      st = upf_fail(UPF_ERR_NOMEM, "%s (cpu): scratch of %lld blocks, block_m %lld", op, (long long)nbmax,
                    (long long)rows_max);
  }
  if (st != UPF_OK) {
    free(kb), free(qt), free(l), free(S);
    upf_sparse_plan_free(&plan);
    return st;
  }
  const double l2scale = (double)upf_sparse_scale(p, d) * 1.4426950408889634; /* log2(e) */
  const int32_t *cu = upf_sparse_cu_q_host(b);
  int64_t kept = 0;
  index->row_ptr[0] = 0;
  for (int64_t h = 0; h < plan.hkv; h++)
    for (int32_t r = 0; r < plan.num_reqs; r++) {
      const int32_t q_len = cu[r + 1] - cu[r], kv_len = upf_sparse_kv_len_host(b, r);
      const int32_t tiles = plan.cu_q_tiles[r + 1] - plan.cu_q_tiles[r];
      int kb_loaded = 0; /* a request whose every tile is dense reads no kbar */
      for (int32_t m = 0; m < tiles; m++) {
        const upf_sparse_tile t = upf_sparse_tile_at(r, m, q_len, kv_len, (int32_t)g, p);
        const int64_t seg = h * plan.total_q_tiles + plan.cu_q_tiles[r] + m;
        const int64_t prefix = (int64_t)kv_len - q_len, p0 = (int64_t)m * p->block_m;
        const int64_t p1 = p0 + p->block_m < (int64_t)q_len * g ? p0 + p->block_m : (int64_t)q_len * g;
        const int64_t nr = p1 - p0, active = t.dense ? 0 : t.active;
        for (int64_t blk = 0; blk < nbmax; blk++)
          S[blk] = 0.0;
        double smax = 0.0;
        if (active > 0) {
          if (!kb_loaded) {
            for (int64_t blk = 0; blk < nbmax; blk++)
              for (int64_t e = 0; e < d; e++)
                kb[blk * d + e] = ref_get(kbar, mean_off(kbar, r, blk, h) + e);
            kb_loaded = 1;
          }
          for (int64_t i = 0; i < nr; i++) {
            const int64_t row = p0 + i, qo = (cu[r] + row / g) * q->stride[0] + (h * g + row % g) * q->stride[1];
            for (int64_t e = 0; e < d; e++)
              qt[i * d + e] = ref_get(q, qo + e);
          }
          cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nr, (int)active, (int)d, l2scale, qt, (int)d, kb,
                      (int)d, 0.0, l, (int)active);
          /* row i contributes to block blk iff the block's first key is visible to it */
          double mt = -INFINITY;
          for (int64_t i = 0; i < nr; i++) {
            const int64_t pos = prefix + (p0 + i) / g;
            for (int64_t blk = 0; blk < active && blk * p->block_n <= pos; blk++)
              mt = l[i * active + blk] > mt ? l[i * active + blk] : mt;
          }
          for (int64_t i = 0; i < nr; i++) {
            const int64_t pos = prefix + (p0 + i) / g;
            for (int64_t blk = 0; blk < active && blk * p->block_n <= pos; blk++)
              S[blk] += exp2(l[i * active + blk] - mt);
          }
          for (int64_t blk = 0; blk < active; blk++)
            smax = S[blk] > smax ? S[blk] : smax;
        }
        if (index->scores)
          for (int64_t blk = 0; blk < nbmax; blk++)
            index->scores[seg * nbmax + blk] = (float)S[blk];
        const double thresh = (double)p->alpha * smax;
        for (int64_t blk = 0; blk <= t.last_k; blk++)
          if (t.dense || (blk < active && S[blk] >= thresh) || blk < p->sink || blk >= t.first_k - p->window + 1)
            index->blocks[kept++] = (int32_t)blk;
        index->row_ptr[seg + 1] = (int32_t)kept;
      }
    }
  index->kept_total = kept;
  free(kb), free(qt), free(l), free(S);
  upf_sparse_plan_free(&plan);
  return UPF_OK;
}

/* ---- attn.block_sparse ---- */

/* Checks of the attention (shared by the fast path and the oracle); fills the plan. The index is
 * read on the host: its row_ptr must be a CSR of num_segments rows and every segment's blocks
 * strictly ascending in [0, last_k] of its tile, so no key outside the request is ever read. */
static upf_status block_sparse_check(const char *op, const upf_sparse_batch *b, const upf_tensor *q,
                                     const upf_tensor *k, const upf_tensor *v, const upf_sparse_params *p,
                                     const upf_sparse_index *index, const upf_tensor *kbar, const upf_tensor *vbar,
                                     const upf_tensor *out, upf_sparse_plan *plan) {
  *plan = (upf_sparse_plan){0};
  if (!k || !v)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL %s", op, !k ? "k" : "v");
  UPF_TRY(upf_sparse_batch_check(op, b, q, k, v));
  UPF_TRY(upf_dense_check(out, op, "out", 3, q->shape));
  UPF_TRY(upf_dense_same_dtype(q, out, op, "q", "out"));
  if (!index || !index->row_ptr || !index->blocks)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL index (row_ptr and blocks are required)", op);
  UPF_TRY(upf_sparse_plan_make(b, (int32_t)q->shape[1], (int32_t)k->shape[k->ndim - 2], p, plan));
  upf_status st = UPF_OK;
  if (p->mean_correction && (!kbar || !vbar))
    st = upf_fail(UPF_ERR_INVALID_ARG, "%s: mean_correction needs kbar and vbar (%s is NULL)", op,
                  !kbar ? "kbar" : "vbar");
  if (st == UPF_OK && p->mean_correction)
    st = upf_sparse_means_check(op, plan, k, kbar, vbar);
  if (st == UPF_OK && index->row_ptr[0] != 0)
    st = upf_fail(UPF_ERR_INVALID_ARG, "%s: index row_ptr[0]=%d must be 0", op, index->row_ptr[0]);
  const int32_t *cu = upf_sparse_cu_q_host(b);
  for (int32_t r = 0; st == UPF_OK && r < plan->num_reqs; r++) {
    const int32_t q_len = cu[r + 1] - cu[r], kv_len = upf_sparse_kv_len_host(b, r);
    for (int32_t m = 0; st == UPF_OK && m < plan->cu_q_tiles[r + 1] - plan->cu_q_tiles[r]; m++) {
      const upf_sparse_tile t = upf_sparse_tile_at(r, m, q_len, kv_len, plan->group, p);
      for (int64_t h = 0; st == UPF_OK && h < plan->hkv; h++) {
        const int64_t s = h * plan->total_q_tiles + plan->cu_q_tiles[r] + m;
        const int32_t lo = index->row_ptr[s], hi = index->row_ptr[s + 1];
        if (hi < lo || hi - lo > t.last_k + 1) {
          st = upf_fail(UPF_ERR_INVALID_ARG, "%s: index row_ptr[%lld..%lld] = %d..%d is not a segment of at most %d blocks",
                        op, (long long)s, (long long)s + 1, lo, hi, t.last_k + 1);
          break;
        }
        for (int32_t i = lo; i < hi; i++)
          if (index->blocks[i] < 0 || index->blocks[i] > t.last_k || (i > lo && index->blocks[i] <= index->blocks[i - 1])) {
            st = upf_fail(UPF_ERR_INVALID_ARG,
                          "%s: index blocks[%d]=%d of segment %lld must ascend within [0, last_k=%d]", op, i,
                          index->blocks[i], (long long)s, t.last_k);
            break;
          }
      }
    }
  }
  if (st != UPF_OK)
    upf_sparse_plan_free(plan);
  return st;
}

/* Writes one output row (of q's (t, head)) as out or into the truth array. */
static void put_row(const upf_tensor *out, double *truth, int64_t t, int64_t head, int64_t hq, int64_t d,
                    const double *acc, double l) {
  for (int64_t e = 0; e < d; e++) {
    const double o = l > 0.0 ? acc[e] / l : 0.0;
    if (truth)
      truth[(t * hq + head) * d + e] = o;
    else
      ref_put(out, t * out->stride[0] + head * out->stride[1] + e, o);
  }
}

/* Marks the blocks of a segment: kept[blk] = 1 for each listed block (kept has nb entries). */
static void mark_kept(const upf_sparse_index *index, int64_t s, unsigned char *kept, int64_t nb) {
  memset(kept, 0, (size_t)nb);
  for (int32_t i = index->row_ptr[s]; i < index->row_ptr[s + 1]; i++)
    kept[index->blocks[i]] = 1;
}

upf_status ref_attn_block_sparse_naive(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                       const upf_tensor *v, const upf_sparse_params *p,
                                       const upf_sparse_index *index, const upf_tensor *kbar,
                                       const upf_tensor *vbar, const upf_tensor *out, double *truth) {
  const char *op = "attn.block_sparse";
  upf_sparse_plan plan;
  UPF_TRY(block_sparse_check(op, b, q, k, v, p, index, kbar, vbar, out, &plan));
  const int64_t hq = q->shape[1], d = q->shape[2], g = plan.group, nbmax = plan.max_key_blocks;
  const int64_t kvmax = max_kv_len(b, plan.num_reqs);
  double *s = malloc((size_t)(kvmax + nbmax + 1) * sizeof *s), *acc = malloc((size_t)(2 * d) * sizeof *acc);
  unsigned char *kept = malloc((size_t)nbmax);
  if (!s || !acc || !kept) {
    free(s), free(acc), free(kept);
    upf_sparse_plan_free(&plan);
    return upf_fail(UPF_ERR_NOMEM, "%s (cpu): scratch of kv_len %lld", op, (long long)kvmax);
  }
  double *qrow = acc + d;
  const double scale = (double)upf_sparse_scale(p, d), corr_bias = log((double)p->block_n);
  const int32_t *cu = upf_sparse_cu_q_host(b);
  for (int32_t r = 0; r < plan.num_reqs; r++) {
    const int32_t q_len = cu[r + 1] - cu[r], kv_len = upf_sparse_kv_len_host(b, r);
    const kv_src src = kv_src_of(b, r);
    for (int32_t m = 0; m < plan.cu_q_tiles[r + 1] - plan.cu_q_tiles[r]; m++) {
      const upf_sparse_tile t = upf_sparse_tile_at(r, m, q_len, kv_len, (int32_t)g, p);
      const int64_t prefix = (int64_t)kv_len - q_len, p0 = (int64_t)m * p->block_m;
      const int64_t p1 = p0 + p->block_m < (int64_t)q_len * g ? p0 + p->block_m : (int64_t)q_len * g;
      for (int64_t h = 0; h < plan.hkv; h++) {
        const int64_t seg = h * plan.total_q_tiles + plan.cu_q_tiles[r] + m;
        mark_kept(index, seg, kept, nbmax);
        for (int64_t row = p0; row < p1; row++) {
          const int64_t tq = cu[r] + row / g, head = h * g + row % g, pos = prefix + row / g;
          const int64_t qo = tq * q->stride[0] + head * q->stride[1];
          for (int64_t e = 0; e < d; e++)
            qrow[e] = ref_get(q, qo + e);
          /* pass 1: the logits in list order (kept keys, then the mean terms) and their max */
          int64_t n = 0;
          double mx = -INFINITY;
          for (int32_t i = index->row_ptr[seg]; i < index->row_ptr[seg + 1]; i++)
            for (int64_t j = (int64_t)index->blocks[i] * p->block_n;
                 j < ((int64_t)index->blocks[i] + 1) * p->block_n && j < kv_len && j <= pos; j++) {
              const int64_t ko = kv_off(&src, k, j, h);
              double dot = 0.0;
              for (int64_t e = 0; e < d; e++)
                dot += qrow[e] * ref_get(k, ko + e);
              s[n] = scale * dot;
              mx = s[n] > mx ? s[n] : mx;
              n++;
            }
          if (p->mean_correction)
            for (int64_t blk = 0; blk < t.corr_hi; blk++)
              if (!kept[blk]) {
                double dot = 0.0;
                for (int64_t e = 0; e < d; e++)
                  dot += qrow[e] * ref_get(kbar, mean_off(kbar, r, blk, h) + e);
                s[n] = scale * dot + corr_bias;
                mx = s[n] > mx ? s[n] : mx;
                n++;
              }
          /* pass 2: the same walk, weights exp(s - max) on the values */
          double l = 0.0;
          memset(acc, 0, (size_t)d * sizeof *acc);
          n = 0;
          for (int32_t i = index->row_ptr[seg]; i < index->row_ptr[seg + 1]; i++)
            for (int64_t j = (int64_t)index->blocks[i] * p->block_n;
                 j < ((int64_t)index->blocks[i] + 1) * p->block_n && j < kv_len && j <= pos; j++) {
              const double w = exp(s[n++] - mx);
              const int64_t vo = kv_off(&src, v, j, h);
              l += w;
              for (int64_t e = 0; e < d; e++)
                acc[e] += w * ref_get(v, vo + e);
            }
          if (p->mean_correction)
            for (int64_t blk = 0; blk < t.corr_hi; blk++)
              if (!kept[blk]) {
                const double w = exp(s[n++] - mx);
                l += w;
                for (int64_t e = 0; e < d; e++)
                  acc[e] += w * ref_get(vbar, mean_off(vbar, r, blk, h) + e);
              }
          put_row(out, truth, tq, head, hq, d, acc, l);
        }
      }
    }
  }
  free(s), free(acc), free(kept);
  upf_sparse_plan_free(&plan);
  return UPF_OK;
}

/* Scratch of the fast path. Columns of a tile's score block: the keys of its kept blocks (up to the
 * tile's last visible key), then one column per mean term. */
typedef struct {
  double *k, *v;     /* (max kv_len, D): one request's K, V of one KV head */
  double *kb, *vb;   /* (max_key_blocks, D): its kbar, vbar */
  double *kc, *vc;   /* (max_key_blocks, D): the mean terms' kbar, vbar of one tile, packed */
  double *q, *s, *o; /* (rc, D), (rc, ncols), (rc, D): a chunk of a tile's rows */
  double *lm;        /* (rc): each row's sum of exponentials */
  int64_t *col_key;  /* (ncols): key position of a column, -1 for a mean term */
  int64_t *runs;     /* (max_key_blocks, 2): first key and length of each run of consecutive kept blocks */
  unsigned char *kept;
  int64_t rc, ncols; /* rows a chunk, columns at most */
} fast_scratch;

static void fast_free(fast_scratch *w) {
  free(w->k), free(w->v), free(w->kb), free(w->vb), free(w->kc), free(w->vc);
  free(w->q), free(w->s), free(w->o), free(w->lm), free(w->col_key), free(w->runs), free(w->kept);
  memset(w, 0, sizeof *w);
}

static upf_status fast_alloc(fast_scratch *w, int64_t kvmax, int64_t nb, int64_t d, int64_t block_m,
                             const char *op) {
  memset(w, 0, sizeof *w);
  w->ncols = kvmax + nb > 0 ? kvmax + nb : 1;
  w->rc = SCORE_DOUBLES / w->ncols;
  w->rc = w->rc < 1 ? 1 : w->rc > block_m ? block_m : w->rc;
  const size_t kvd = (size_t)((kvmax > 0 ? kvmax : 1) * d) * sizeof(double), nbd = (size_t)(nb * d) * sizeof(double);
  w->k = malloc(kvd), w->v = malloc(kvd);
  w->kb = malloc(nbd), w->vb = malloc(nbd), w->kc = malloc(nbd), w->vc = malloc(nbd);
  w->q = malloc((size_t)(w->rc * d) * sizeof(double)), w->o = malloc((size_t)(w->rc * d) * sizeof(double));
  w->s = malloc((size_t)(w->rc * w->ncols) * sizeof(double)), w->lm = malloc((size_t)w->rc * sizeof(double));
  w->col_key = malloc((size_t)w->ncols * sizeof(int64_t)), w->kept = malloc((size_t)nb);
  w->runs = malloc((size_t)(2 * nb) * sizeof(int64_t));
  if (!w->k || !w->v || !w->kb || !w->vb || !w->kc || !w->vc || !w->q || !w->o || !w->s || !w->lm || !w->col_key ||
      !w->runs || !w->kept) {
    fast_free(w);
    return upf_fail(UPF_ERR_NOMEM, "%s (cpu): cannot allocate scratch for kv_len %lld, D %lld", op,
                    (long long)kvmax, (long long)d);
  }
  return UPF_OK;
}

/* One segment (KV head h, tile t of request r) through dgemm: for each chunk of rows, S = Q K^T per run
 * of consecutive kept blocks (a dense tile is one run) and one dgemm for the mean terms, into the
 * columns of one score block; then per row the scale, the causal mask, max, exponentials and their sum
 * in double, and O = P V by the same pieces. w->k, w->v (and kb, vb) hold the request's head h. */
static void fast_segment(fast_scratch *w, const upf_sparse_batch *b, const upf_tensor *q, const upf_sparse_params *p,
                         const upf_sparse_index *index, const upf_sparse_plan *plan, const upf_sparse_tile *t,
                         int64_t h, int64_t seg, const upf_tensor *out) {
  const int64_t hq = q->shape[1], d = q->shape[2], g = plan->group;
  const int32_t *cu = upf_sparse_cu_q_host(b);
  const int64_t prefix = (int64_t)t->kv_len - t->q_len, p0 = (int64_t)t->m * p->block_m;
  const int64_t rows = (int64_t)t->q_len * g, p1 = p0 + p->block_m < rows ? p0 + p->block_m : rows;
  const int64_t key_hi = prefix + t->q_last + 1; /* no row of the tile sees a key at or past this */
  const double scale = (double)upf_sparse_scale(p, d), corr_bias = log((double)p->block_n);
  /* the columns: kept keys (below key_hi) in runs, then the mean terms (kbar, vbar packed into kc, vc) */
  int64_t nc = 0, nm = 0, nruns = 0;
  for (int32_t i = index->row_ptr[seg]; i < index->row_ptr[seg + 1]; i++) {
    const int64_t j0 = (int64_t)index->blocks[i] * p->block_n;
    const int64_t j1 = j0 + p->block_n < key_hi ? j0 + p->block_n : key_hi;
    if (j1 <= j0)
      continue;
    if (nruns > 0 && w->runs[2 * (nruns - 1)] + w->runs[2 * (nruns - 1) + 1] == j0)
      w->runs[2 * (nruns - 1) + 1] += j1 - j0;
    else
      w->runs[2 * nruns] = j0, w->runs[2 * nruns + 1] = j1 - j0, nruns++;
    for (int64_t j = j0; j < j1; j++)
      w->col_key[nc++] = j;
  }
  const int64_t nkeys = nc;
  if (p->mean_correction) {
    mark_kept(index, seg, w->kept, plan->max_key_blocks);
    for (int64_t blk = 0; blk < t->corr_hi; blk++)
      if (!w->kept[blk]) {
        memcpy(w->kc + nm * d, w->kb + blk * d, (size_t)d * sizeof(double));
        memcpy(w->vc + nm * d, w->vb + blk * d, (size_t)d * sizeof(double));
        w->col_key[nc++] = -1, nm++;
      }
  }
  for (int64_t c0 = p0; c0 < p1; c0 += w->rc) {
    const int64_t nr = p1 - c0 < w->rc ? p1 - c0 : w->rc;
    for (int64_t i = 0; i < nr; i++) {
      const int64_t row = c0 + i, qo = (cu[t->req] + row / g) * q->stride[0] + (h * g + row % g) * q->stride[1];
      for (int64_t e = 0; e < d; e++)
        w->q[i * d + e] = ref_get(q, qo + e);
    }
    /* S = Q K^T run by run: a run's keys are consecutive rows of w->k */
    for (int64_t x = 0, col = 0; x < nruns; col += w->runs[2 * x + 1], x++)
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nr, (int)w->runs[2 * x + 1], (int)d, scale, w->q,
                  (int)d, w->k + w->runs[2 * x] * d, (int)d, 0.0, w->s + col, (int)nc);
    if (nm > 0)
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nr, (int)nm, (int)d, scale, w->q, (int)d, w->kc,
                  (int)d, 0.0, w->s + nkeys, (int)nc);
    for (int64_t i = 0; i < nr; i++) {
      const int64_t pos = prefix + (c0 + i) / g;
      double *sr = w->s + i * nc, mx = -INFINITY, l = 0.0;
      for (int64_t c = 0; c < nc; c++) {
        if (w->col_key[c] < 0)
          sr[c] += corr_bias;
        if (w->col_key[c] <= pos)
          mx = sr[c] > mx ? sr[c] : mx;
      }
      for (int64_t c = 0; c < nc; c++) {
        sr[c] = w->col_key[c] <= pos ? exp(sr[c] - mx) : 0.0;
        l += sr[c];
      }
      w->lm[i] = l;
    }
    /* O = P V by the same pieces */
    double beta = 0.0;
    for (int64_t x = 0, col = 0; x < nruns; col += w->runs[2 * x + 1], x++, beta = 1.0)
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nr, (int)d, (int)w->runs[2 * x + 1], 1.0, w->s + col,
                  (int)nc, w->v + w->runs[2 * x] * d, (int)d, beta, w->o, (int)d);
    if (nm > 0) {
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nr, (int)d, (int)nm, 1.0, w->s + nkeys, (int)nc,
                  w->vc, (int)d, beta, w->o, (int)d);
      beta = 1.0;
    }
    if (beta == 0.0)
      memset(w->o, 0, (size_t)(nr * d) * sizeof(double));
    for (int64_t i = 0; i < nr; i++) {
      const int64_t row = c0 + i;
      put_row(out, NULL, cu[t->req] + row / g, h * g + row % g, hq, d, w->o + i * d, w->lm[i]);
    }
  }
}

upf_status cpu_attn_block_sparse(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                 const upf_tensor *v, const upf_sparse_params *p, const upf_sparse_index *index,
                                 const upf_tensor *kbar, const upf_tensor *vbar, const upf_tensor *out) {
  const char *op = "attn.block_sparse";
  upf_sparse_plan plan;
  UPF_TRY(block_sparse_check(op, b, q, k, v, p, index, kbar, vbar, out, &plan));
  const int64_t d = q->shape[2], nb = plan.max_key_blocks, kvmax = max_kv_len(b, plan.num_reqs);
  fast_scratch w;
  upf_status st = fast_alloc(&w, kvmax, nb, d, p->block_m, op);
  if (st != UPF_OK) {
    upf_sparse_plan_free(&plan);
    return st;
  }
  const int32_t *cu = upf_sparse_cu_q_host(b);
  for (int32_t r = 0; r < plan.num_reqs; r++) {
    const int32_t q_len = cu[r + 1] - cu[r], kv_len = upf_sparse_kv_len_host(b, r);
    const int32_t tiles = plan.cu_q_tiles[r + 1] - plan.cu_q_tiles[r];
    if (tiles == 0)
      continue;
    const kv_src src = kv_src_of(b, r);
    for (int64_t h = 0; h < plan.hkv; h++) {
      /* the request's K, V (and means) of head h widened once for all its tiles */
      for (int64_t j = 0; j < kv_len; j++) {
        const int64_t ko = kv_off(&src, k, j, h), vo = kv_off(&src, v, j, h);
        for (int64_t e = 0; e < d; e++)
          w.k[j * d + e] = ref_get(k, ko + e), w.v[j * d + e] = ref_get(v, vo + e);
      }
      if (p->mean_correction)
        for (int64_t blk = 0; blk < nb; blk++)
          for (int64_t e = 0; e < d; e++) {
            w.kb[blk * d + e] = ref_get(kbar, mean_off(kbar, r, blk, h) + e);
            w.vb[blk * d + e] = ref_get(vbar, mean_off(vbar, r, blk, h) + e);
          }
      for (int32_t m = 0; m < tiles; m++) {
        const upf_sparse_tile t = upf_sparse_tile_at(r, m, q_len, kv_len, plan.group, p);
        fast_segment(&w, b, q, p, index, &plan, &t, h, h * plan.total_q_tiles + plan.cu_q_tiles[r] + m, out);
      }
    }
  }
  fast_free(&w);
  upf_sparse_plan_free(&plan);
  return UPF_OK;
}

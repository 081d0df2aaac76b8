/* CPU reference of UniPrefill selection: plain loops, double accumulators, OpenBLAS dgemm for the
 * part-GEMM (dot products accumulate in double). One request and one head at a time, so memory is
 * L*n doubles per head rather than the whole Hq x L x T score tensor. */
#include "ref_cpu/select.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "uniprefill/bf16.h"

void ref_load_rows_f64(const upf_tensor *x, int64_t tok0, int64_t ntok, int64_t head, double *dst) {
  int64_t D = x->shape[2];
  for (int64_t t = 0; t < ntok; t++) {
    int64_t base = (tok0 + t) * x->stride[0] + head * x->stride[1];
    double *row = dst + t * D;
    if (x->dtype == UPF_DTYPE_BF16) {
      const uint16_t *src = (const uint16_t *)x->data + base;
      for (int64_t d = 0; d < D; d++)
        row[d] = upf_bf16_to_f32(src[d]);
    } else {
      const float *src = (const float *)x->data + base;
      for (int64_t d = 0; d < D; d++)
        row[d] = src[d];
    }
  }
}

void ref_select_part_gemm_head(const double *q_last, const double *k, int64_t L, int64_t n, int64_t D,
                               double scale, double *s) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)L, (int)n, (int)D, scale, q_last, (int)D, k, (int)D,
              0.0, s, (int)n);
  for (int64_t i = 0; i < L; i++) {
    int64_t pos = n - L + i; /* query i sits at this position of the request */
    for (int64_t j = pos + 1; j < n; j++)
      s[i * n + j] = -INFINITY;
  }
}

/* Stage 2 in two phases that give the same bits for every thread count: each row's max and sum of
 * exponentials (in key order, a row per job), then each key's mass over the rows (in row order, a
 * range of keys per job). That is the order of the one-thread loop "for each row, for each key". */
typedef struct {
  const double *s;
  int64_t L, n, begin, end; /* rows (phase 1) or keys (phase 2) [begin, end) */
  double *m, *l, *token_mass;
} softmax_job;

static void *softmax_rows(void *arg) {
  const softmax_job *j = arg;
  for (int64_t i = j->begin; i < j->end; i++) {
    const double *row = j->s + i * j->n;
    double m = -INFINITY;
    for (int64_t c = 0; c < j->n; c++)
      m = row[c] > m ? row[c] : m;
    double l = 0.0;
    for (int64_t c = 0; c < j->n; c++)
      l += exp(row[c] - m);
    j->m[i] = m;
    j->l[i] = l;
  }
  return NULL;
}

static void *softmax_keys(void *arg) {
  const softmax_job *j = arg;
  for (int64_t i = 0; i < j->L; i++) {
    const double *row = j->s + i * j->n;
    for (int64_t c = j->begin; c < j->end; c++)
      j->token_mass[c] += exp(row[c] - j->m[i]) / j->l[i];
  }
  return NULL;
}

enum { SOFTMAX_MAX_THREADS = 16 };

/* Runs fn over [0, count) split into `threads` ranges (the caller's thread takes the first). */
static void softmax_split(void *(*fn)(void *), softmax_job base, int64_t count, int threads) {
  softmax_job jobs[SOFTMAX_MAX_THREADS];
  pthread_t th[SOFTMAX_MAX_THREADS];
  int started[SOFTMAX_MAX_THREADS] = {0};
  const int64_t per = (count + threads - 1) / threads;
  for (int k = 0; k < threads; k++) {
    jobs[k] = base;
    jobs[k].begin = k * per < count ? k * per : count;
    jobs[k].end = (k + 1) * per < count ? (k + 1) * per : count;
    started[k] = k > 0 && jobs[k].begin < jobs[k].end && pthread_create(&th[k], NULL, fn, &jobs[k]) == 0;
  }
  for (int k = 0; k < threads; k++)
    if (!started[k])
      fn(&jobs[k]); /* the first range, and any whose thread could not start */
  for (int k = 0; k < threads; k++)
    if (started[k])
      pthread_join(th[k], NULL);
}

int ref_select_threads(void) {
  const char *env = getenv("OPENBLAS_NUM_THREADS"); /* the share of the cores the BLAS calls get */
  long t = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
  return t < 1 ? 1 : (t > SOFTMAX_MAX_THREADS ? SOFTMAX_MAX_THREADS : (int)t);
}

upf_status ref_select_block_softmax_head_threads(const double *s, int64_t L, int64_t n, double *token_mass,
                                                 int threads) {
  double *ml = malloc((size_t)(2 * (L > 0 ? L : 1)) * sizeof *ml);
  if (!ml)
    return upf_fail(UPF_ERR_NOMEM, "select (cpu): cannot allocate the row statistics of %lld queries", (long long)L);
  threads = threads < 1 ? 1 : (threads > SOFTMAX_MAX_THREADS ? SOFTMAX_MAX_THREADS : threads);
  const softmax_job base = {s, L, n, 0, 0, ml, ml + L, token_mass};
  softmax_split(softmax_rows, base, L, threads);
  softmax_split(softmax_keys, base, n, threads);
  free(ml);
  return UPF_OK;
}

upf_status ref_select_block_softmax_head(const double *s, int64_t L, int64_t n, double *token_mass) {
  /* threads only where they pay: a head of 4M scores and more (128 queries x 32K keys) */
  const int threads = L * n >= ((int64_t)1 << 22) ? ref_select_threads() : 1;
  return ref_select_block_softmax_head_threads(s, L, n, token_mass, threads);
}

void ref_select_block_reduce(const double *token_mass, int64_t n, int32_t block, double *block_score) {
  int64_t nb = upf_select_blocks_of(n, block);
  for (int64_t c = 0; c < nb; c++) {
    double sum = 0.0;
    int64_t end = (c + 1) * block < n ? (c + 1) * block : n;
    for (int64_t j = c * block; j < end; j++)
      sum += token_mass[j];
    block_score[c] = sum;
  }
}

typedef struct {
  double pi;
  int64_t index;
} ranked_block;

/* Descending pi; equal pi: larger block index first (SPEC section 2, rule 5). */
static int rank_order(const void *a, const void *b) {
  const ranked_block *x = a, *y = b;
  if (x->pi != y->pi)
    return x->pi > y->pi ? -1 : 1;
  return x->index > y->index ? -1 : (x->index < y->index ? 1 : 0);
}

void ref_select_topp(const double *block_score, int64_t nb, const upf_select_params *params, uint8_t *block_mask,
                     double *prefix, double *pi) {
  const int64_t topk = upf_select_topk_of(params, nb);
  double total = 0.0;
  for (int64_t c = 0; c < nb; c++)
    total += block_score[c];
  ranked_block *order = malloc((size_t)nb * sizeof *order);
  for (int64_t c = 0; c < nb; c++) {
    order[c].pi = total > 0.0 ? block_score[c] / total : 0.0;
    order[c].index = c;
  }
  qsort(order, (size_t)nb, sizeof *order, rank_order);
  double before = 0.0; /* mass of the blocks ranked ahead */
  for (int64_t rank = 0; rank < nb; rank++) {
    int64_t c = order[rank].index;
    int keep = topk > 0 ? rank < topk : (rank == 0 || before <= (double)params->p);
    block_mask[c] = (uint8_t)keep;
    if (prefix)
      prefix[c] = before;
    if (pi)
      pi[c] = order[rank].pi;
    before += order[rank].pi;
  }
  free(order);
}

void ref_select_expand_request(const uint8_t *block_mask, int64_t n, const upf_select_params *params,
                               uint8_t *token_mask) {
  for (int64_t j = 0; j < n; j++)
    token_mask[j] = (uint8_t)(block_mask[j / params->block] || j < params->sink || j >= n - params->last_q);
}

upf_status ref_select_request_scores(const upf_select_inputs *in, int64_t tok0, int64_t n,
                                     const upf_select_params *params, double *block_score) {
  int64_t hq = in->q.shape[1], hkv = in->k.shape[1], D = in->q.shape[2], L = params->last_q;
  int64_t group = hq / hkv;
  double scale = upf_select_scale(params, (int32_t)D);
  double *k = malloc((size_t)(n * D) * sizeof *k);
  double *q_last = malloc((size_t)(L * D) * sizeof *q_last);
  double *s = malloc((size_t)(L * n) * sizeof *s);
  double *token_mass = calloc((size_t)n, sizeof *token_mass);
  if (!k || !q_last || !s || !token_mass) {
    free(k), free(q_last), free(s), free(token_mass);
    return upf_fail(UPF_ERR_NOMEM, "select (cpu): cannot allocate scratch for a request of %lld tokens",
                    (long long)n);
  }
  upf_status st = UPF_OK;
  for (int64_t kvh = 0; kvh < hkv && st == UPF_OK; kvh++) {
    ref_load_rows_f64(&in->k, tok0, n, kvh, k);
    for (int64_t h = kvh * group; h < (kvh + 1) * group && st == UPF_OK; h++) {
      ref_load_rows_f64(&in->q, tok0 + n - L, L, h, q_last);
      ref_select_part_gemm_head(q_last, k, L, n, D, scale, s);
      st = ref_select_block_softmax_head(s, L, n, token_mass);
    }
  }
  if (st == UPF_OK)
    ref_select_block_reduce(token_mass, n, params->block, block_score);
  free(k), free(q_last), free(s), free(token_mass);
  return st;
}

static upf_status check_rows_finite(const upf_tensor *x, const char *name, int64_t tok0, int64_t ntok) {
  int64_t H = x->shape[1], D = x->shape[2];
  for (int64_t t = tok0; t < tok0 + ntok; t++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t d = 0; d < D; d++) {
        int64_t at = t * x->stride[0] + h * x->stride[1] + d;
        float v = x->dtype == UPF_DTYPE_BF16 ? upf_bf16_to_f32(((const uint16_t *)x->data)[at])
                                             : ((const float *)x->data)[at];
        if (!isfinite(v))
          return upf_fail(UPF_ERR_NONFINITE, "%s: %s at token %lld, head %lld, dim %lld", name,
                          isnan(v) ? "NaN" : "Inf", (long long)t, (long long)h, (long long)d);
      }
  return UPF_OK;
}

upf_status ref_select_check_finite(const upf_select_inputs *in, const upf_select_params *params) {
  for (int32_t r = 0; r < in->num_reqs; r++) {
    int64_t tok0 = in->cu_seqlens_host[r], n = in->cu_seqlens_host[r + 1] - tok0;
    if (!upf_select_is_scored(n, params))
      continue;
    UPF_TRY(check_rows_finite(&in->q, "q", tok0 + n - params->last_q, params->last_q));
    UPF_TRY(check_rows_finite(&in->k, "k", tok0, n));
  }
  return UPF_OK;
}

upf_status ref_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                             const uint8_t *block_mask, upf_select_outputs *out) {
  const int32_t *cu = in->cu_seqlens_host;
  int64_t kept_total = 0, block_base = 0;
  out->new_cu_seqlens[0] = 0;
  for (int32_t r = 0; r < in->num_reqs; r++) {
    int64_t tok0 = cu[r], n = cu[r + 1] - cu[r];
    uint8_t *mask = out->token_mask + tok0;
    if (upf_select_is_scored(n, params))
      ref_select_expand_request(block_mask + block_base, n, params, mask);
    else
      memset(mask, 1, (size_t)n);
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++) {
      if (mask[j])
        out->kept_index[kept_total + kept++] = (int32_t)(tok0 + j);
    }
    kept_total += kept;
    out->kept_count[r] = (int32_t)kept;
    out->new_cu_seqlens[r + 1] = (int32_t)kept_total;
    block_base += upf_select_blocks_of(n, params->block);
  }
  out->kept_total = kept_total;
  return UPF_OK;
}

upf_status ref_select_run(const upf_select_inputs *in, const upf_select_params *params, upf_select_outputs *out,
                          double *block_score_f64) {
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(ref_select_check_finite(in, params));
  const int32_t *cu = in->cu_seqlens_host;
  int64_t *block_offset = malloc((size_t)(in->num_reqs + 1) * sizeof *block_offset);
  if (!block_offset)
    return upf_fail(UPF_ERR_NOMEM, "select (cpu): cannot allocate block offsets");
  upf_select_block_offsets(cu, in->num_reqs, params->block, block_offset);
  int64_t num_blocks = block_offset[in->num_reqs];
  double *scores = block_score_f64 ? block_score_f64 : malloc((size_t)(num_blocks ? num_blocks : 1) * sizeof *scores);
  uint8_t *block_mask = out->block_mask ? out->block_mask : malloc((size_t)(num_blocks ? num_blocks : 1));
  upf_status st = (scores && block_mask) ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "select (cpu): cannot allocate blocks");
  for (int32_t r = 0; st == UPF_OK && r < in->num_reqs; r++) {
    int64_t tok0 = cu[r], n = cu[r + 1] - cu[r], nb = block_offset[r + 1] - block_offset[r];
    double *b = scores + block_offset[r];
    uint8_t *bm = block_mask + block_offset[r];
    if (!upf_select_is_scored(n, params)) {
      memset(b, 0, (size_t)nb * sizeof *b);
      memset(bm, 1, (size_t)nb);
      continue;
    }
    st = ref_select_request_scores(in, tok0, n, params, b);
    if (st == UPF_OK)
      ref_select_topp(b, nb, params, bm, NULL, NULL);
  }
  if (st == UPF_OK && out->block_score)
    for (int64_t c = 0; c < num_blocks; c++)
      out->block_score[c] = (float)scores[c];
  if (st == UPF_OK)
    st = ref_select_expand(in, params, block_mask, out);
  if (!block_score_f64)
    free(scores);
  if (!out->block_mask)
    free(block_mask);
  free(block_offset);
  return st;
}

/* ---- CPU backend entries: the packed fp32 interface of backend.h over the stages above. ---- */

static upf_status check_layout(const upf_select_inputs *in, const upf_select_params *params) {
  UPF_TRY(upf_select_params_check(params));
  if (in->q.ndim != 3)
    return upf_fail(UPF_ERR_SHAPE, "q: the descriptor must give (T, Hq, D) even when only the layout is used");
  return upf_cu_seqlens_check(in->cu_seqlens_host, in->num_reqs, in->q.shape[0]);
}

upf_status cpu_select_part_gemm(const upf_select_inputs *in, const upf_select_params *params, float *scores) {
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(ref_select_check_finite(in, params));
  int64_t hq = in->q.shape[1], hkv = in->k.shape[1], D = in->q.shape[2], L = params->last_q;
  double scale = upf_select_scale(params, (int32_t)D);
  int64_t offset = 0;
  for (int32_t r = 0; r < in->num_reqs; r++) {
    int64_t tok0 = in->cu_seqlens_host[r], n = in->cu_seqlens_host[r + 1] - tok0;
    if (!upf_select_is_scored(n, params))
      continue;
    double *k = malloc((size_t)(n * D) * sizeof *k), *q = malloc((size_t)(L * D) * sizeof *q);
    double *s = malloc((size_t)(L * n) * sizeof *s);
    if (!k || !q || !s) {
      free(k), free(q), free(s);
      return upf_fail(UPF_ERR_NOMEM, "select.part_gemm (cpu): cannot allocate scratch");
    }
    for (int64_t h = 0; h < hq; h++) {
      ref_load_rows_f64(&in->k, tok0, n, h / (hq / hkv), k);
      ref_load_rows_f64(&in->q, tok0 + n - L, L, h, q);
      ref_select_part_gemm_head(q, k, L, n, D, scale, s);
      for (int64_t e = 0; e < L * n; e++)
        scores[offset + h * L * n + e] = (float)s[e];
    }
    offset += hq * L * n;
    free(k), free(q), free(s);
  }
  return UPF_OK;
}

upf_status cpu_select_block_softmax(const upf_select_inputs *in, const upf_select_params *params,
                                    const float *scores, float *token_mass) {
  UPF_TRY(check_layout(in, params));
  int64_t hq = in->q.shape[1], L = params->last_q, offset = 0;
  for (int32_t r = 0; r < in->num_reqs; r++) {
    int64_t tok0 = in->cu_seqlens_host[r], n = in->cu_seqlens_host[r + 1] - tok0;
    if (!upf_select_is_scored(n, params)) {
      memset(token_mass + tok0, 0, (size_t)n * sizeof *token_mass);
      continue;
    }
    double *s = malloc((size_t)(L * n) * sizeof *s), *t = calloc((size_t)n, sizeof *t);
    if (!s || !t) {
      free(s), free(t);
      return upf_fail(UPF_ERR_NOMEM, "select.block_softmax (cpu): cannot allocate scratch");
    }
    upf_status st = UPF_OK;
    for (int64_t h = 0; h < hq && st == UPF_OK; h++) {
      for (int64_t e = 0; e < L * n; e++)
        s[e] = scores[offset + h * L * n + e];
      st = ref_select_block_softmax_head(s, L, n, t);
    }
    for (int64_t j = 0; j < n; j++)
      token_mass[tok0 + j] = (float)t[j];
    offset += hq * L * n;
    free(s), free(t);
    UPF_TRY(st);
  }
  return UPF_OK;
}

upf_status cpu_select_block_reduce(const upf_select_inputs *in, const upf_select_params *params,
                                   const float *token_mass, float *block_score) {
  UPF_TRY(check_layout(in, params));
  int64_t block_base = 0;
  for (int32_t r = 0; r < in->num_reqs; r++) {
    int64_t tok0 = in->cu_seqlens_host[r], n = in->cu_seqlens_host[r + 1] - tok0;
    int64_t nb = upf_select_blocks_of(n, params->block);
    double *t = malloc((size_t)(n ? n : 1) * sizeof *t), *b = malloc((size_t)(nb ? nb : 1) * sizeof *b);
    if (!t || !b) {
      free(t), free(b);
      return upf_fail(UPF_ERR_NOMEM, "select.block_reduce (cpu): cannot allocate scratch");
    }
    int scored = upf_select_is_scored(n, params);
    for (int64_t j = 0; j < n; j++)
      t[j] = scored ? token_mass[tok0 + j] : 0.0;
    ref_select_block_reduce(t, n, params->block, b);
    for (int64_t c = 0; c < nb; c++)
      block_score[block_base + c] = (float)b[c];
    block_base += nb;
    free(t), free(b);
  }
  return UPF_OK;
}

/* Stages 1-3 by the code ref_select_run uses (double throughout, rounded once), so the block scores
 * equal select_run's bit for bit. */
upf_status cpu_select_block_scores(const upf_select_inputs *in, const upf_select_params *params,
                                   float *block_score) {
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(ref_select_check_finite(in, params));
  int64_t block_base = 0;
  upf_status st = UPF_OK;
  for (int32_t r = 0; st == UPF_OK && r < in->num_reqs; r++) {
    int64_t tok0 = in->cu_seqlens_host[r], n = in->cu_seqlens_host[r + 1] - tok0;
    int64_t nb = upf_select_blocks_of(n, params->block);
    if (!upf_select_is_scored(n, params)) {
      memset(block_score + block_base, 0, (size_t)nb * sizeof *block_score);
      block_base += nb;
      continue;
    }
    double *b = malloc((size_t)(nb ? nb : 1) * sizeof *b);
    st = b ? ref_select_request_scores(in, tok0, n, params, b)
           : upf_fail(UPF_ERR_NOMEM, "select.block_scores (cpu): cannot allocate scratch");
    for (int64_t c = 0; st == UPF_OK && c < nb; c++)
      block_score[block_base + c] = (float)b[c];
    block_base += nb;
    free(b);
  }
  return st;
}

upf_status cpu_select_topp(const upf_select_inputs *in, const upf_select_params *params, const float *block_score,
                           uint8_t *block_mask) {
  UPF_TRY(check_layout(in, params));
  int64_t block_base = 0;
  for (int32_t r = 0; r < in->num_reqs; r++) {
    int64_t n = in->cu_seqlens_host[r + 1] - in->cu_seqlens_host[r];
    int64_t nb = upf_select_blocks_of(n, params->block);
    if (!upf_select_is_scored(n, params)) {
      memset(block_mask + block_base, 1, (size_t)nb);
      block_base += nb;
      continue;
    }
    double *b = malloc((size_t)nb * sizeof *b);
    if (!b)
      return upf_fail(UPF_ERR_NOMEM, "select.topp (cpu): cannot allocate scratch");
    for (int64_t c = 0; c < nb; c++) {
      double v = b[c] = block_score[block_base + c];
      if (!isfinite(v) || v < 0.0) {
        free(b);
        if (!isfinite(v))
          return upf_fail(UPF_ERR_NONFINITE, "select.topp: block score %lld of request %d is %s", (long long)c, r,
                          isnan(v) ? "NaN" : "Inf");
        return upf_fail(UPF_ERR_INVALID_ARG, "select.topp: block score %lld of request %d is negative (%g)",
                        (long long)c, r, v);
      }
    }
    ref_select_topp(b, nb, params, block_mask + block_base, NULL, NULL);
    block_base += nb;
    free(b);
  }
  return UPF_OK;
}

upf_status cpu_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                             const uint8_t *block_mask, upf_select_outputs *out) {
  UPF_TRY(check_layout(in, params));
  return ref_select_expand(in, params, block_mask, out);
}

upf_status cpu_select_run(const upf_select_inputs *in, const upf_select_params *params, upf_select_outputs *out) {
  return ref_select_run(in, params, out, NULL);
}

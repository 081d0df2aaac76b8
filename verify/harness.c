/* The long-reduction rule and the verify harness every op family uses (see harness.h). */
#include "verify/harness.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"

void upf_compare_long_reduction(const float *got, const float *baseline, const double *truth, int64_t n,
                                upf_tolerance tol, upf_check *check) {
  double err_got = 0.0, err_base = 0.0, err2 = 0.0, ref2 = 0.0;
  int64_t first_bad = -1;
  const char *bad_kind = NULL;
  for (int64_t i = 0; i < n; i++) {
    double a = got[i], b = baseline[i], t = truth[i];
    if (upf_compare_nonfinite(a, t, 1, i, &first_bad, &bad_kind))
      continue;
    double e = fabs(a - t);
    err_got = e > err_got ? e : err_got;
    if (isfinite(b) && fabs(b - t) > err_base)
      err_base = fabs(b - t);
    err2 += e * e;
    ref2 += t * t;
  }
  double bound = 2.0 * err_base + tol.atol;
  check->nmse = ref2 > 0.0 ? err2 / ref2 : err2;
  check->max_abs_err = err_got;
  check->budget = err_got / bound;
  if (first_bad >= 0) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "%s at %lld (got %g, truth %g)", bad_kind, (long long)first_bad,
             (double)got[first_bad], truth[first_bad]);
  } else {
    check->passed = err_got <= bound;
    snprintf(check->detail, sizeof check->detail,
             "long-reduction rule: max|got-fp64| %.3g vs 2 x cpu baseline %.3g + atol %.0e", err_got, err_base,
             tol.atol);
  }
}

void upf_dcase_init(upf_dcase *dc, upf_dtype in_dtype) {
  memset(dc, 0, sizeof *dc);
  dc->in_dtype = in_dtype;
}

void upf_dcase_free(upf_dcase *dc) {
  for (int i = 0; i < dc->nbufs; i++)
    free(dc->buf[i].host);
  memset(dc, 0, sizeof *dc);
}

static void set_view(upf_tensor *t, upf_dtype dtype, int ndim, const int64_t *shape, const int64_t *stride) {
  upf_tensor_init(t, NULL, dtype, ndim, shape);
  if (stride)
    for (int i = 0; i < ndim; i++)
      t->stride[i] = stride[i];
}

upf_dbuf *upf_dcase_add(upf_dcase *dc, const char *name, upf_dtype dtype, int64_t numel, int output) {
  if (dc->nbufs >= UPF_DCASE_BUFS)
    return NULL;
  upf_dbuf *b = &dc->buf[dc->nbufs];
  memset(b, 0, sizeof *b);
  b->name = name;
  b->dtype = dtype;
  b->numel = numel;
  b->output = output;
  b->host = malloc((size_t)(numel ? numel : 1) * upf_dtype_size(dtype));
  if (!b->host)
    return NULL;
  dc->nbufs++;
  upf_dbuf_view(b, 0, name, 1, &numel, NULL, 0);
  return b;
}

void upf_dbuf_view(upf_dbuf *b, int i, const char *name, int ndim, const int64_t *shape, const int64_t *stride,
                   int64_t offset) {
  set_view(&b->view[i], b->dtype, ndim, shape, stride);
  b->cmp[i].ndim = 0;
  b->offset[i] = offset;
  b->view_name[i] = name;
  if (b->nviews < i + 1)
    b->nviews = i + 1;
}

void upf_dbuf_cmp_last(upf_dbuf *b, int i, int64_t last) {
  b->cmp[i] = b->view[i];
  b->cmp[i].shape[b->cmp[i].ndim - 1] = last;
}

/* Large buffers (weights at model shapes: 10^8 elements) draw from a pool of normals by random
 * index: one generator step per element instead of the twelve of upf_rng_normal. */
#define NORMAL_POOL 65521 /* prime */

void upf_dbuf_fill_normal(upf_dbuf *b, upf_rng *rng, float mean, float std) {
  if (b->numel <= NORMAL_POOL) {
    for (int64_t i = 0; i < b->numel; i++)
      upf_dbuf_set(b, i, mean + std * upf_rng_normal(rng));
    return;
  }
  float *pool = malloc(NORMAL_POOL * sizeof *pool);
  if (!pool) { /* slow but correct */
    for (int64_t i = 0; i < b->numel; i++)
      upf_dbuf_set(b, i, mean + std * upf_rng_normal(rng));
    return;
  }
  for (int i = 0; i < NORMAL_POOL; i++)
    pool[i] = mean + std * upf_rng_normal(rng);
  for (int64_t i = 0; i < b->numel; i++)
    upf_dbuf_set(b, i, pool[(upf_rng_next(rng) >> 16) % NORMAL_POOL]);
  free(pool);
}

void upf_dbuf_fill_poison(upf_dbuf *b) { memset(b->host, 0xFF, (size_t)b->numel * upf_dtype_size(b->dtype)); }

double upf_dbuf_get(const upf_dbuf *b, int64_t i) {
  if (b->dtype == UPF_DTYPE_BF16)
    return upf_bf16_to_f32(((const uint16_t *)b->host)[i]);
  if (b->dtype == UPF_DTYPE_I32)
    return ((const int32_t *)b->host)[i];
  return ((const float *)b->host)[i];
}

void upf_dbuf_set(upf_dbuf *b, int64_t i, float v) {
  if (b->dtype == UPF_DTYPE_BF16)
    ((uint16_t *)b->host)[i] = upf_bf16_from_f32(v);
  else if (b->dtype == UPF_DTYPE_I32)
    ((int32_t *)b->host)[i] = (int32_t)v;
  else
    ((float *)b->host)[i] = v;
}

void upf_dcase_bind(const upf_dcase *dc, void *const *parents, upf_dviews v) {
  for (int i = 0; i < dc->nbufs; i++) {
    const upf_dbuf *b = &dc->buf[i];
    size_t es = upf_dtype_size(b->dtype);
    for (int j = 0; j < b->nviews; j++) {
      v[i][j] = b->view[j];
      v[i][j].data = (char *)parents[i] + (size_t)b->offset[j] * es;
    }
  }
}

void upf_dense_check_init(upf_check *check, const char *op, const char *variant, upf_dtype dtype,
                          const char *shape_fmt, ...) {
  memset(check, 0, sizeof *check);
  snprintf(check->op, sizeof check->op, "%s", op);
  snprintf(check->variant, sizeof check->variant, "%s", variant);
  snprintf(check->dtype, sizeof check->dtype, "%s", upf_dtype_name(dtype));
  va_list ap;
  va_start(ap, shape_fmt);
  vsnprintf(check->shape, sizeof check->shape, shape_fmt, ap);
  va_end(ap);
}

/* ---- the harness ---- */

/* Parent indices of every element of region `r` (at offset `off`), in row-major order, into out. */
static void region_indices(const upf_tensor *r, int64_t off, int64_t *out, int64_t *count) {
  int64_t idx[UPF_MAX_DIMS] = {0};
  int64_t n = upf_tensor_numel(r);
  for (int64_t e = 0; e < n; e++) {
    int64_t p = off;
    for (int d = 0; d < r->ndim; d++)
      p += idx[d] * r->stride[d];
    out[(*count)++] = p;
    for (int d = r->ndim - 1; d >= 0; d--) {
      if (++idx[d] < r->shape[d])
        break;
      idx[d] = 0;
    }
  }
}

static const upf_tensor *cmp_region(const upf_dbuf *b, int j) { return b->cmp[j].ndim ? &b->cmp[j] : &b->view[j]; }

static float elem_f(const void *parent, upf_dtype dt, int64_t i) {
  return dt == UPF_DTYPE_BF16 ? upf_bf16_to_f32(((const uint16_t *)parent)[i]) : ((const float *)parent)[i];
}

/* Parent elements outside every compared region must be bit-for-bit what went in. */
static int64_t untouched_mismatch(const upf_dbuf *b, const void *got, const void *orig, int64_t *first) {
  unsigned char *in_region = calloc((size_t)(b->numel ? b->numel : 1), 1);
  int64_t bad = 0;
  *first = -1;
  if (!in_region)
    return -1;
  for (int j = 0; j < b->nviews; j++) {
    const upf_tensor *r = cmp_region(b, j);
    int64_t n = upf_tensor_numel(r), count = 0;
    int64_t *ix = malloc((size_t)(n ? n : 1) * sizeof *ix);
    if (!ix) {
      free(in_region);
      return -1;
    }
    region_indices(r, b->offset[j], ix, &count);
    for (int64_t e = 0; e < count; e++)
      in_region[ix[e]] = 1;
    free(ix);
  }
  size_t es = upf_dtype_size(b->dtype);
  for (int64_t i = 0; i < b->numel; i++)
    if (!in_region[i] && memcmp((const char *)got + i * es, (const char *)orig + i * es, es) != 0) {
      if (*first < 0)
        *first = i;
      bad++;
    }
  free(in_region);
  return bad;
}

static void record_failure(upf_verify_ctx *ctx, const upf_check *proto, const char *what, upf_status st) {
  upf_check check = *proto;
  check.passed = 0;
  snprintf(check.detail, sizeof check.detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, &check);
}

static void compare_view(upf_verify_ctx *ctx, const upf_dcase *dc, int bi, int j, const void *got_parent,
                         const void *ref_parent, upf_dcase_truth_fn truth, upf_dviews host_views, const void *op_ctx,
                         const upf_check *proto, int many) {
  const upf_dbuf *b = &dc->buf[bi];
  upf_check check = *proto;
  if (many) {
    size_t len = strlen(check.variant);
    snprintf(check.variant + len, sizeof check.variant - len, " [%s]", b->view_name[j] ? b->view_name[j] : b->name);
  }
  const upf_tensor *r = cmp_region(b, j);
  int64_t n = upf_tensor_numel(r), count = 0;
  int64_t *ix = malloc((size_t)(n ? n : 1) * sizeof *ix);
  float *got = malloc((size_t)(n ? n : 1) * sizeof *got), *base = malloc((size_t)(n ? n : 1) * sizeof *base);
  double *ref = malloc((size_t)(n ? n : 1) * sizeof *ref);
  if (!ix || !got || !base || !ref) {
    free(ix), free(got), free(base), free(ref);
    record_failure(ctx, &check, "compare", upf_fail(UPF_ERR_NOMEM, "verify: %lld elements", (long long)n));
    return;
  }
  region_indices(r, b->offset[j], ix, &count);
  for (int64_t e = 0; e < count; e++) {
    got[e] = elem_f(got_parent, b->dtype, ix[e]);
    base[e] = elem_f(ref_parent, b->dtype, ix[e]);
    ref[e] = base[e];
  }
  upf_tolerance tol = dc->tol ? *dc->tol : upf_tolerance_for(dc->in_dtype);
  upf_compare_f32(got, ref, count, tol, &check);
  int first_out = 0;
  while (first_out < dc->nbufs && !dc->buf[first_out].output)
    first_out++;
  if (!check.passed && truth && bi == first_out && j == 0 && count == upf_tensor_numel(&b->view[0])) {
    double plain_budget = check.budget;
    upf_status st = truth(host_views, op_ctx, ref);
    if (st != UPF_OK) {
      free(ix), free(got), free(base), free(ref);
      record_failure(ctx, &check, "fp64 truth", st);
      return;
    }
    upf_compare_long_reduction(got, base, ref, count, tol, &check);
    size_t len = strlen(check.detail);
    snprintf(check.detail + len, sizeof check.detail - len, " (plain budget %.0f%%)", 100.0 * plain_budget);
  }
  if (check.passed) {
    int64_t first;
    int64_t bad = untouched_mismatch(b, got_parent, b->host, &first);
    int64_t ref_bad = untouched_mismatch(b, ref_parent, b->host, &first);
    if (bad != 0 || ref_bad != 0) {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail,
               "%lld elements of %s outside the compared regions changed (reference: %lld), first at %lld",
               (long long)bad, b->name, (long long)ref_bad, (long long)first);
    }
  }
  upf_verify_record(ctx, &check);
  free(ix), free(got), free(base), free(ref);
}

void upf_dcase_verify(upf_verify_ctx *ctx, const upf_dcase *dc, upf_dcase_fn fn, upf_dcase_truth_fn truth,
                      const void *op_ctx, const upf_check *proto) {
  const upf_backend *be = ctx->backend, *cpu = upf_backend_cpu();
  void *ref[UPF_DCASE_BUFS] = {0}, *got[UPF_DCASE_BUFS] = {0}, *dev[UPF_DCASE_BUFS] = {0};
  upf_guarded g[UPF_DCASE_BUFS];
  memset(g, 0, sizeof g);
  upf_dviews hv, dv;
  upf_status st = UPF_OK;
  const char *what = "setup";
  for (int i = 0; st == UPF_OK && i < dc->nbufs; i++) {
    size_t bytes = (size_t)dc->buf[i].numel * upf_dtype_size(dc->buf[i].dtype);
    ref[i] = malloc(bytes ? bytes : 1);
    got[i] = malloc(bytes ? bytes : 1);
    if (!ref[i] || !got[i])
      st = upf_fail(UPF_ERR_NOMEM, "verify: host copies of %s (%zu bytes)", dc->buf[i].name, bytes);
    else
      memcpy(ref[i], dc->buf[i].host, bytes);
    if (st == UPF_OK)
      st = upf_guarded_alloc(be, bytes, &g[i]);
    if (st == UPF_OK)
      st = be->upload(g[i].ptr, dc->buf[i].host, bytes);
    dev[i] = g[i].ptr;
  }
  if (st == UPF_OK) {
    what = "cpu reference";
    upf_dcase_bind(dc, ref, hv);
    st = fn(cpu, hv, op_ctx);
  }
  if (st == UPF_OK) {
    what = be->name;
    upf_dcase_bind(dc, dev, dv);
    st = fn(be, dv, op_ctx);
  }
  if (st == UPF_OK)
    st = be->synchronize();
  for (int i = 0; st == UPF_OK && i < dc->nbufs; i++) {
    what = "guard bytes";
    st = upf_guarded_check(&g[i], dc->buf[i].name);
    if (st == UPF_OK) {
      what = "download";
      st = be->download(got[i], g[i].ptr, g[i].bytes);
    }
  }
  if (st != UPF_OK) {
    record_failure(ctx, proto, what, st);
  } else {
    int outputs = 0;
    for (int i = 0; i < dc->nbufs; i++)
      outputs += dc->buf[i].output ? dc->buf[i].nviews : 0;
    for (int i = 0; i < dc->nbufs; i++) {
      if (!dc->buf[i].output)
        continue;
      for (int j = 0; j < dc->buf[i].nviews; j++)
        compare_view(ctx, dc, i, j, got[i], ref[i], truth, hv, op_ctx, proto, outputs > 1);
    }
    /* Inputs the op must not write: every byte as uploaded. */
    for (int i = 0; i < dc->nbufs; i++) {
      size_t bytes = (size_t)dc->buf[i].numel * upf_dtype_size(dc->buf[i].dtype);
      if (!dc->buf[i].output && memcmp(got[i], dc->buf[i].host, bytes) != 0) {
        upf_check check = *proto;
        check.passed = 0;
        snprintf(check.detail, sizeof check.detail, "input %s was modified by the op", dc->buf[i].name);
        upf_verify_record(ctx, &check);
      }
    }
  }
  for (int i = 0; i < dc->nbufs; i++) {
    upf_guarded_free(&g[i]);
    free(ref[i]), free(got[i]);
  }
}

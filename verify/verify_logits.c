/* Verify cases of logits.rows. On every backend: a hand-computed golden case (a tie broken to the
 * lowest id, a row chosen twice, a row without a target, one full row) and bad inputs that must come
 * back as their status. For the CPU reference itself: its rows equal logits.last on the last rows
 * and its reductions equal plain loops over those logits. For a backend under test: seeded cases
 * (ragged row sets, the shapes of SmolLM2-135M and Gemma-3-270M's heads, more rows than one chunk),
 * f32 and bf16, against the CPU reference: argmax equal except where the reference's two largest
 * logits are within the tolerance (a near tie), log-sum-exp and target logits within the f32 logits'
 * tolerance, full rows through upf_compare_f32. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/logits.h"
#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"
#include "verify/harness.h"
#include "verify/verify.h"

#define OP "logits.rows"

/* Host and backend copies of one call's buffers. */
typedef struct {
  const upf_backend *be;
  upf_tensor hidden, norm_w, w_lm;       /* backend */
  upf_logits_rows_out out;               /* backend */
  int64_t R, F, V;
} lr_call;

static upf_status upload_tensor(const upf_backend *be, const upf_tensor *host, upf_tensor *dev) {
  *dev = *host;
  const size_t bytes = (size_t)upf_tensor_numel(host) * upf_dtype_size(host->dtype);
  UPF_TRY(be->alloc(&dev->data, bytes ? bytes : 1));
  return be->upload(dev->data, host->data, bytes);
}

static void call_free(lr_call *c) {
  void *p[] = {c->hidden.data, c->norm_w.data, c->w_lm.data, c->out.argmax, c->out.lse, c->out.target, c->out.full};
  for (size_t i = 0; i < sizeof p / sizeof *p; i++)
    if (p[i])
      c->be->release(p[i]);
  memset(c, 0, sizeof *c);
}

/* Uploads the inputs, runs the op on be, downloads into the host outputs (argmax (R), lse (R), target
 * (R) when targets are given, full (F, V)). */
static upf_status run_on(const upf_backend *be, const upf_tensor *hidden, const upf_tensor *norm_w,
                         const upf_tensor *w_lm, const upf_logits_rows_sel *sel, const upf_norm_params *p,
                         int32_t *argmax, double *lse, double *target, float *full) {
  lr_call c;
  memset(&c, 0, sizeof c);
  c.be = be, c.R = sel->num_rows, c.F = sel->num_full, c.V = w_lm->shape[1];
  upf_status st = upload_tensor(be, hidden, &c.hidden);
  if (st == UPF_OK)
    st = upload_tensor(be, norm_w, &c.norm_w);
  if (st == UPF_OK)
    st = upload_tensor(be, w_lm, &c.w_lm);
  const size_t R = (size_t)(c.R ? c.R : 1);
  if (st == UPF_OK)
    st = be->alloc((void **)&c.out.argmax, R * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->alloc((void **)&c.out.lse, R * sizeof(double));
  if (st == UPF_OK && sel->targets_host)
    st = be->alloc((void **)&c.out.target, R * sizeof(double));
  if (st == UPF_OK && c.F)
    st = be->alloc((void **)&c.out.full, (size_t)(c.F * c.V) * sizeof(float));
  if (st == UPF_OK)
    st = be->logits_rows(&c.hidden, sel, &c.norm_w, p, &c.w_lm, &c.out);
  if (st == UPF_OK)
    st = be->synchronize();
  if (st == UPF_OK)
    st = be->download(argmax, c.out.argmax, (size_t)c.R * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->download(lse, c.out.lse, (size_t)c.R * sizeof(double));
  if (st == UPF_OK && sel->targets_host)
    st = be->download(target, c.out.target, (size_t)c.R * sizeof(double));
  if (st == UPF_OK && c.F)
    st = be->download(full, c.out.full, (size_t)(c.F * c.V) * sizeof(float));
  call_free(&c);
  return st;
}

static void record_failure(upf_verify_ctx *ctx, upf_check *check, upf_status st) {
  check->passed = 0;
  snprintf(check->detail, sizeof check->detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, check);
}

/* ---- golden ---- */

/* hidden rows [3,4], [9,9], [0,5]; norm w = 1; w_lm (2, 4) = [[1,0,1,0],[0,1,1,1]]. Normalised:
 * row 0 -> (a, b) = (3, 4)/sqrt(12.5), row 2 -> (0, c) = (0, 5)/sqrt(12.5), each rounded to the dtype.
 * Logits: row 0 (a, b, a+b, b): argmax 2; row 2 (0, c, c, c): a three-way tie, argmax 1.
 * Rows asked [2, 0, 2] with targets [3, -1, 0] and the whole logits of output row 1. */
static void golden(upf_verify_ctx *ctx, upf_dtype dt) {
  const float hv[6] = {3, 4, 9, 9, 0, 5}, nv[2] = {1, 1}, wv[8] = {1, 0, 1, 0, 0, 1, 1, 1};
  const int32_t rows[3] = {2, 0, 2}, targets[3] = {3, -1, 0}, full_rows[1] = {1};
  const double a = ref_round_to(dt, 3.0 / sqrt(12.5 + 1e-6)), b = ref_round_to(dt, 4.0 / sqrt(12.5 + 1e-6));
  const double c = ref_round_to(dt, 5.0 / sqrt(12.5 + 1e-6));
  const int32_t want_arg[3] = {1, 2, 1};
  const double want_lse[3] = {log(1 + 3 * exp(c)), log(exp(a) + 2 * exp(b) + exp(a + b)), log(1 + 3 * exp(c))};
  const double want_tgt[3] = {c, NAN, 0};
  const double want_full[4] = {a, b, a + b, b};
  upf_check check;
  upf_dense_check_init(&check, OP, "golden: tie, repeated row, no target, full row", dt, "R=3 H=2 V=4");
  upf_tensor h, n, w;
  const int64_t sh[2] = {3, 2}, sn[1] = {2}, sw[2] = {2, 4};
  upf_status st = upf_tensor_alloc(&h, dt, 2, sh);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&n, dt, 1, sn);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&w, dt, 2, sw);
  if (st != UPF_OK)
    return record_failure(ctx, &check, st);
  for (int i = 0; i < 6; i++)
    ref_put(&h, i, hv[i]);
  for (int i = 0; i < 2; i++)
    ref_put(&n, i, nv[i]);
  for (int i = 0; i < 8; i++)
    ref_put(&w, i, wv[i]);
  const upf_logits_rows_sel sel = {rows, 3, targets, full_rows, 1};
  const upf_norm_params p = {1e-6f, 0};
  int32_t arg[3];
  double lse[3], tgt[3];
  float full[4];
  st = run_on(ctx->backend, &h, &n, &w, &sel, &p, arg, lse, tgt, full);
  upf_tensor_free(&h), upf_tensor_free(&n), upf_tensor_free(&w);
  if (st != UPF_OK)
    return record_failure(ctx, &check, st);
  upf_compare_f32(full, want_full, 4, upf_tolerance_for(UPF_DTYPE_F32), &check);
  int bad = 0;
  for (int i = 0; i < 3; i++) {
    bad += arg[i] != want_arg[i];
    bad += fabs(lse[i] - want_lse[i]) > 1e-6 * (1 + fabs(want_lse[i]));
    bad += isnan(want_tgt[i]) ? !isnan(tgt[i]) : fabs(tgt[i] - want_tgt[i]) > 1e-6;
  }
  if (bad) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail,
             "%d of the 9 reductions differ: argmax %d %d %d (want 1 2 1), lse %.7g %.7g %.7g (want %.7g %.7g %.7g)",
             bad, arg[0], arg[1], arg[2], lse[0], lse[1], lse[2], want_lse[0], want_lse[1], want_lse[2]);
  }
  upf_verify_record(ctx, &check);
}

/* ---- bad inputs ---- */

static void errors(upf_verify_ctx *ctx) {
  const upf_backend *be = ctx->backend;
  void *buf = NULL;
  if (be->alloc(&buf, 4096 * sizeof(double)) != UPF_OK) {
    upf_check check;
    upf_dense_check_init(&check, OP, "errors", UPF_DTYPE_F32, "-");
    return record_failure(ctx, &check, UPF_ERR_NOMEM);
  }
  upf_tensor h, n, n_bad, w, w_bf;
  upf_tensor_init(&h, buf, UPF_DTYPE_F32, 2, (const int64_t[2]){4, 8});
  upf_tensor_init(&n, buf, UPF_DTYPE_F32, 1, (const int64_t[1]){8});
  upf_tensor_init(&n_bad, buf, UPF_DTYPE_F32, 1, (const int64_t[1]){7});
  upf_tensor_init(&w, buf, UPF_DTYPE_F32, 2, (const int64_t[2]){8, 6});
  upf_tensor_init(&w_bf, buf, UPF_DTYPE_BF16, 2, (const int64_t[2]){8, 6});
  const upf_norm_params p = {1e-6f, 0};
  upf_logits_rows_out out = {(int32_t *)buf, (double *)buf + 1024, (double *)buf + 2048, (float *)buf + 6144};
  const int32_t rows_ok[2] = {0, 3}, rows_bad[2] = {0, 4}, tgt_bad[2] = {1, 6}, full_bad[1] = {2}, full_ok[1] = {1};
  const upf_logits_rows_sel s_row = {rows_bad, 2, NULL, NULL, 0}, s_tgt = {rows_ok, 2, tgt_bad, NULL, 0};
  const upf_logits_rows_sel s_full = {rows_ok, 2, NULL, full_bad, 1}, s_ok = {rows_ok, 2, rows_ok, full_ok, 1};
  upf_verify_expect_status(ctx, OP, "row 4 of 4", be->logits_rows(&h, &s_row, &n, &p, &w, &out), UPF_ERR_INVALID_ARG);
  upf_verify_expect_status(ctx, OP, "target 6 of V 6", be->logits_rows(&h, &s_tgt, &n, &p, &w, &out),
                           UPF_ERR_INVALID_ARG);
  upf_verify_expect_status(ctx, OP, "full row 2 of R 2", be->logits_rows(&h, &s_full, &n, &p, &w, &out),
                           UPF_ERR_INVALID_ARG);
  upf_verify_expect_status(ctx, OP, "norm_w (7) for H 8", be->logits_rows(&h, &s_ok, &n_bad, &p, &w, &out),
                           UPF_ERR_SHAPE);
  upf_verify_expect_status(ctx, OP, "w_lm bf16, hidden f32", be->logits_rows(&h, &s_ok, &n, &p, &w_bf, &out),
                           UPF_ERR_DTYPE);
  upf_logits_rows_out no_target = out;
  no_target.target = NULL;
  upf_verify_expect_status(ctx, OP, "targets without out->target", be->logits_rows(&h, &s_ok, &n, &p, &w, &no_target),
                           UPF_ERR_INVALID_ARG);
  be->release(buf);
}

/* ---- seeded: the reference's own invariants, or a backend against the reference ---- */

typedef struct {
  const char *name;
  int quick;
  int64_t T, H, V;
  int zero_centred;
} lr_case;

static const lr_case cases[] = {
    {"odd sizes", 1, 37, 48, 1000, 0},
    {"SmolLM2-135M head", 0, 513, 576, 49152, 0},
    {"Gemma-3-270M head, > 1 chunk", 0, 300, 640, 262144, 1},
};

typedef struct {
  upf_tensor h, n, w;
  int32_t *rows, *targets, *full;
  int64_t R, F;
} lr_inputs;

/* Rows: every other row, then the last 5 again (so rows repeat and are not sorted); targets spread
 * over [0, V) with every 7th -1; full rows: the first, the last and one in the middle. */
static upf_status make_inputs(const lr_case *c, upf_dtype dt, uint64_t seed, lr_inputs *x) {
  memset(x, 0, sizeof *x);
  const int64_t sh[2] = {c->T, c->H}, sn[1] = {c->H}, sw[2] = {c->H, c->V};
  UPF_TRY(upf_tensor_alloc(&x->h, dt, 2, sh));
  UPF_TRY(upf_tensor_alloc(&x->n, dt, 1, sn));
  UPF_TRY(upf_tensor_alloc(&x->w, dt, 2, sw));
  x->R = (c->T + 1) / 2 + 5, x->F = 3;
  x->rows = malloc((size_t)x->R * sizeof(int32_t)), x->targets = malloc((size_t)x->R * sizeof(int32_t));
  x->full = malloc((size_t)x->F * sizeof(int32_t));
  if (!x->rows || !x->targets || !x->full)
    return upf_fail(UPF_ERR_NOMEM, "%s: host inputs", OP);
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  for (int64_t i = 0; i < c->T * c->H; i++)
    ref_put(&x->h, i, 2.0 * upf_rng_normal(&rng));
  for (int64_t i = 0; i < c->H; i++)
    ref_put(&x->n, i, (c->zero_centred ? 0.0 : 1.0) + 0.1 * upf_rng_normal(&rng));
  const double sd = 3.0 / sqrt((double)c->H); /* logits of a few units: a softmax neither flat nor one-hot */
  for (int64_t i = 0; i < c->H * c->V; i++)
    ref_put(&x->w, i, sd * upf_rng_normal(&rng));
  for (int64_t i = 0; i < x->R; i++) {
    x->rows[i] = i < (c->T + 1) / 2 ? (int32_t)(2 * i) : (int32_t)(c->T - 1 - (i - (c->T + 1) / 2));
    x->targets[i] = i % 7 == 3 ? -1 : (int32_t)((i * 2654435761u) % (uint64_t)c->V);
  }
  x->full[0] = 0, x->full[1] = (int32_t)(x->R / 2), x->full[2] = (int32_t)(x->R - 1);
  return UPF_OK;
}

static void free_inputs(lr_inputs *x) {
  upf_tensor_free(&x->h), upf_tensor_free(&x->n), upf_tensor_free(&x->w);
  free(x->rows), free(x->targets), free(x->full);
}

typedef struct {
  int32_t *arg;
  double *lse, *tgt;
  float *full;
} lr_outputs;

static upf_status alloc_outputs(const lr_inputs *x, int64_t V, lr_outputs *o) {
  o->arg = malloc((size_t)x->R * sizeof(int32_t));
  o->lse = malloc((size_t)x->R * sizeof(double)), o->tgt = malloc((size_t)x->R * sizeof(double));
  o->full = malloc((size_t)(x->F * V) * sizeof(float));
  return o->arg && o->lse && o->tgt && o->full ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s: host outputs", OP);
}

static void free_outputs(lr_outputs *o) { free(o->arg), free(o->lse), free(o->tgt), free(o->full); }

/* Backend against the reference. */
static void compare_case(upf_verify_ctx *ctx, const lr_case *c, upf_dtype dt, int index) {
  upf_check check;
  upf_dense_check_init(&check, OP, c->name, dt, "R=%lld H=%lld V=%lld", (long long)((c->T + 1) / 2 + 5),
                       (long long)c->H, (long long)c->V);
  lr_inputs x;
  lr_outputs want = {0}, got = {0};
  upf_status st = make_inputs(c, dt, upf_verify_case_seed(OP, index, (uint64_t)dt), &x);
  if (st == UPF_OK)
    st = alloc_outputs(&x, c->V, &want);
  if (st == UPF_OK)
    st = alloc_outputs(&x, c->V, &got);
  const upf_logits_rows_sel sel = {x.rows, x.R, x.targets, x.full, x.F};
  const upf_norm_params p = {1e-6f, c->zero_centred};
  if (st == UPF_OK)
    st = run_on(upf_backend_cpu(), &x.h, &x.n, &x.w, &sel, &p, want.arg, want.lse, want.tgt, want.full);
  if (st == UPF_OK)
    st = run_on(ctx->backend, &x.h, &x.n, &x.w, &sel, &p, got.arg, got.lse, got.tgt, got.full);
  if (st != UPF_OK) {
    record_failure(ctx, &check, st);
  } else {
    /* the f32 logits' tolerance: a logit of a few units, GEMM over H in fp32 on both sides */
    const upf_tolerance tol = upf_tolerance_for(UPF_DTYPE_F32);
    double *ref_full = malloc((size_t)(x.F * c->V) * sizeof(double));
    for (int64_t i = 0; ref_full && i < x.F * c->V; i++)
      ref_full[i] = want.full[i];
    if (ref_full)
      upf_compare_f32(got.full, ref_full, x.F * c->V, tol, &check);
    free(ref_full);
    int64_t bad_lse = 0, bad_tgt = 0, bad_arg = 0, near_ties = 0;
    for (int64_t i = 0; i < x.R; i++) {
      bad_lse += !(fabs(got.lse[i] - want.lse[i]) <= tol.atol + tol.rtol * fabs(want.lse[i]));
      bad_tgt += x.targets[i] < 0 ? !isnan(got.tgt[i])
                                  : !(fabs(got.tgt[i] - want.tgt[i]) <= tol.atol + tol.rtol * fabs(want.tgt[i]));
      if (got.arg[i] != want.arg[i]) {
        /* a near tie: the backend's pick is within the tolerance of the reference's maximum */
        const float *row = NULL;
        for (int64_t f = 0; f < x.F; f++)
          if (x.full[f] == i)
            row = want.full + f * c->V;
        const double gap = row ? (double)row[want.arg[i]] - row[got.arg[i]] : INFINITY;
        if (got.arg[i] >= 0 && got.arg[i] < c->V && gap <= tol.atol + tol.rtol * fabs(want.lse[i]))
          near_ties++;
        else
          bad_arg++;
      }
    }
    if (bad_lse || bad_tgt || bad_arg) {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "of %lld rows: %lld argmax, %lld lse, %lld target logits differ",
               (long long)x.R, (long long)bad_arg, (long long)bad_lse, (long long)bad_tgt);
    } else if (near_ties) {
      snprintf(check.detail, sizeof check.detail, "%lld near ties picked otherwise", (long long)near_ties);
    }
    upf_verify_record(ctx, &check);
  }
  free_inputs(&x), free_outputs(&want), free_outputs(&got);
}

/* The reference's rows equal logits.last on the last rows of two requests, and its reductions equal
 * plain loops over those logits. */
static void reference_invariant(upf_verify_ctx *ctx, upf_dtype dt) {
  const lr_case c = {"cpu: equals logits.last + plain reductions", 1, 12, 40, 300, 1};
  upf_check check;
  upf_dense_check_init(&check, OP, c.name, dt, "R=2 H=40 V=300");
  lr_inputs x;
  lr_outputs o = {0};
  upf_tensor lg;
  const int64_t sl[2] = {2, c.V};
  const int32_t cu[3] = {0, 5, 12}, rows[2] = {4, 11}, targets[2] = {17, 299}, full[2] = {0, 1};
  upf_status st = make_inputs(&c, dt, 77 + (uint64_t)dt, &x);
  if (st == UPF_OK)
    st = alloc_outputs(&x, c.V, &o);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&lg, UPF_DTYPE_F32, 2, sl);
  const upf_norm_params p = {1e-6f, 1};
  const upf_logits_rows_sel sel = {rows, 2, targets, full, 2};
  upf_logits_rows_out out = {o.arg, o.lse, o.tgt, o.full};
  if (st == UPF_OK)
    st = cpu_logits_rows(&x.h, &sel, &x.n, &p, &x.w, &out);
  if (st == UPF_OK)
    st = cpu_logits_last(&x.h, cu, 2, &x.n, &p, &x.w, &lg);
  if (st != UPF_OK) {
    record_failure(ctx, &check, st);
  } else {
    double ref[600];
    const float *l = lg.data;
    for (int i = 0; i < 2 * c.V; i++)
      ref[i] = l[i];
    upf_compare_f32(o.full, ref, 2 * c.V, upf_tolerance_for(UPF_DTYPE_F32), &check);
    int bad = 0;
    for (int r = 0; r < 2; r++) {
      int32_t arg = 0;
      double m = -INFINITY, s = 0;
      for (int j = 0; j < c.V; j++)
        if (o.full[r * c.V + j] > m)
          m = o.full[r * c.V + j], arg = j;
      for (int j = 0; j < c.V; j++)
        s += exp(o.full[r * c.V + j] - m);
      bad += arg != o.arg[r] || fabs(m + log(s) - o.lse[r]) > 1e-12 * (1 + fabs(o.lse[r]));
      bad += o.tgt[r] != (double)o.full[r * c.V + targets[r]];
    }
    if (bad) {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "%d reductions differ from plain loops over the rows", bad);
    }
    upf_verify_record(ctx, &check);
    upf_tensor_free(&lg);
  }
  free_inputs(&x), free_outputs(&o);
}

void upf_verify_logits_rows(upf_verify_ctx *ctx) {
  golden(ctx, UPF_DTYPE_F32);
  golden(ctx, UPF_DTYPE_BF16);
  errors(ctx);
  if (upf_verify_on_reference(ctx)) {
    reference_invariant(ctx, UPF_DTYPE_F32);
    reference_invariant(ctx, UPF_DTYPE_BF16);
    return;
  }
  static const upf_dtype dts[2] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};
  for (int i = 0; i < (int)(sizeof cases / sizeof *cases); i++)
    if (upf_verify_case_wanted(ctx, cases[i].name, cases[i].quick))
      for (int d = 0; d < 2; d++)
        compare_case(ctx, &cases[i], dts[d], i);
}

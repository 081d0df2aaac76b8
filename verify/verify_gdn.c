/* Verify cases of the Gated DeltaNet ops. On every backend: hand-computed golden cases, bad inputs
 * that must come back as their status, and the prefill/decode boundary (a prefill of n tokens then m
 * single steps, conv and scan, equals the CPU reference's prefill of n+m; a batch equals its requests
 * run one by one; and the scan alone in bf16 at D = 128, where the CUDA prefill is the chunked form and
 * the steps the recurrent one). For a backend under test: seeded ragged batches (1, 17, 64, 65, 577, 4096, 32K
 * tokens) at Qwen3-Next head shapes and odd ones, f32 and bf16, with and without initial states,
 * gates drawn as in real use (g in [-20, -1e-4], beta in [0, 1]), q/k/v as strided views into the
 * conv output, compared with the CPU reference through the dense harness (the scan's output falls
 * back on the long-reduction rule against the fp64 recurrence). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/gdn.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model_config.h"
#include "verify/harness.h"
#include "verify/verify.h"

enum { GC_QUICK = 1 }; /* in the quick set (valgrind, CI, the GPU test suite) */

static const upf_dtype both_dtypes[] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};
#define NUM_DTYPES 2

static void record_status(upf_verify_ctx *ctx, const char *op, const char *variant, const char *what, upf_status st) {
  upf_check check;
  upf_dense_check_init(&check, op, variant, UPF_DTYPE_F32, "-");
  check.passed = 0;
  snprintf(check.detail, sizeof check.detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, &check);
}

/* ---- backend memory for the small cases ---- */

typedef struct {
  const upf_backend *be;
  void *ptr[24];
  int n;
} bmem;

/* A backend copy of `bytes` of host data (NULL: poisoned with 0xFF). */
static upf_status bm_put(bmem *m, const void *host, size_t bytes, void **dev) {
  if (m->n >= 24)
    return upf_fail(UPF_ERR_NOMEM, "verify gdn: too many buffers");
  UPF_TRY(m->be->alloc(&m->ptr[m->n], bytes));
  *dev = m->ptr[m->n++];
  return host ? m->be->upload(*dev, host, bytes) : m->be->fill(*dev, 0xFF, bytes);
}

static upf_status bm_tensor(bmem *m, const float *host, int ndim, const int64_t *shape, upf_tensor *t) {
  UPF_TRY(upf_tensor_init(t, NULL, UPF_DTYPE_F32, ndim, shape));
  return bm_put(m, host, (size_t)upf_tensor_numel(t) * sizeof(float), &t->data);
}

static void bm_free(bmem *m) {
  for (int i = 0; i < m->n; i++)
    m->be->release(m->ptr[i]);
  m->n = 0;
}

static void record_values(upf_verify_ctx *ctx, const char *op, const char *variant, const char *shape, upf_status st,
                          const float *got, const double *want, int64_t n, upf_tolerance tol) {
  upf_check check;
  upf_dense_check_init(&check, op, variant, UPF_DTYPE_F32, "%s", shape);
  if (st != UPF_OK) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  } else {
    upf_compare_f32(got, want, n, tol, &check);
  }
  upf_verify_record(ctx, &check);
}

/* ================================================================================================ */
/* Golden cases (f32; values chosen so the hand arithmetic is exact).                               */

/* K = 3, C = 1, w = [1, 2, 4] (w[K-1] multiplies the current token). Sums are large, so silu is the
 * identity in double and fp32. Request 0: state [100, 1000], tokens [1, 10]. Request 1: state [20, 30],
 * token [3]. Request 2: no tokens, state [5, 6] passes through. */
static void golden_conv(upf_verify_ctx *ctx) {
  bmem m = {.be = ctx->backend};
  const float x[3] = {1, 10, 3}, w[3] = {1, 2, 4}, s0[6] = {100, 1000, 20, 30, 5, 6};
  const int32_t cu[4] = {0, 2, 3, 3};
  const double want[9] = {2104, 1042, 92, /* final states */ 1, 10, 30, 3, 5, 6};
  const int64_t sx[2] = {3, 1}, sw[2] = {1, 3}, ss[3] = {3, 2, 1};
  upf_tensor tx, tw, tsi, tso, ty;
  void *dcu = NULL;
  float got[9];
  upf_status st = bm_tensor(&m, x, 2, sx, &tx);
  if (st == UPF_OK)
    st = bm_tensor(&m, w, 2, sw, &tw);
  if (st == UPF_OK)
    st = bm_tensor(&m, s0, 3, ss, &tsi);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 3, ss, &tso);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 2, sx, &ty);
  if (st == UPF_OK)
    st = bm_put(&m, cu, sizeof cu, &dcu);
  upf_gdn_batch batch = {dcu, cu, 3};
  if (st == UPF_OK)
    st = ctx->backend->gdn_conv(&batch, &tx, &tw, &tsi, &tso, &ty);
  if (st == UPF_OK)
    st = ctx->backend->download(got, ty.data, 3 * sizeof(float));
  if (st == UPF_OK)
    st = ctx->backend->download(got + 3, tso.data, 6 * sizeof(float));
  record_values(ctx, "gdn.conv", "golden: states in and out, empty request", "B=3 T=3 C=1 K=3", st, got, want, 9,
                upf_tolerance_for(UPF_DTYPE_F32));
  bm_free(&m);
}

/* The step from request 0's final state [1, 10] with token 100: 1 + 20 + 400 = 421; state [10, 100].
 * A second row with token -1 and state [0, 0]: silu(-4). */
static void golden_conv_step(upf_verify_ctx *ctx) {
  bmem m = {.be = ctx->backend};
  const float x[2] = {100, -1}, w[3] = {1, 2, 4}, s0[4] = {1, 10, 0, 0};
  const double want[6] = {421, upf_gdn_silu(-4.0), 10, 100, 0, -1};
  const int64_t sx[2] = {2, 1}, sw[2] = {1, 3}, ss[3] = {2, 2, 1};
  upf_tensor tx, tw, ts, ty;
  float got[6];
  upf_status st = bm_tensor(&m, x, 2, sx, &tx);
  if (st == UPF_OK)
    st = bm_tensor(&m, w, 2, sw, &tw);
  if (st == UPF_OK)
    st = bm_tensor(&m, s0, 3, ss, &ts);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 2, sx, &ty);
  if (st == UPF_OK)
    st = ctx->backend->gdn_conv_step(&tx, &tw, &ts, &ty);
  if (st == UPF_OK)
    st = ctx->backend->download(got, ty.data, 2 * sizeof(float));
  if (st == UPF_OK)
    st = ctx->backend->download(got + 2, ts.data, 4 * sizeof(float));
  record_values(ctx, "gdn.conv_step", "golden: output and shifted state", "B=2 C=1 K=3", st, got, want, 6,
                upf_tolerance_for(UPF_DTYPE_F32));
  bm_free(&m);
}

/* Dk = Dv = 1, one key head shared by two value heads, scale 1. |q| = |k| = 1000 normalise to +-1 (the
 * eps moves them by 5e-13). a + dt_bias = 0 with A_log = 0 gives g = -ln 2 (decay 1/2); a = -100 gives
 * decay 1 to fp32 precision; b = 0, 100, -100 give beta 1/2, 1, 0. Head 0 from S = 2:
 *   t0 decay 1/2, beta 1/2, v 4:  S = 1 + (4 - 1)/2 = 2.5,  o = 2.5
 *   t1 decay 1,   beta 1,   v -3: S = -3 (overwritten along k), o = -3
 *   t2 decay 1,   beta 0,   v 7:  S = -3 (kept), q = -1 gives o = 3
 * Head 1 (from S = 0, its own a, b, v) : t0 decay 1/2, beta 1, v 1: S = 1, o = 1; t1 beta 0: o = 1;
 * t2 beta 1/2, v 5, decay 1: S = 1 + 2 = 3, o = -3. */
static void golden_scan(upf_verify_ctx *ctx) {
  bmem m = {.be = ctx->backend};
  const float q[3] = {1000, 1000, -1000}, k[3] = {1000, 1000, 1000};
  const float v[6] = {4, 1, -3, 9, 7, 5};
  const float a[6] = {0, 0, -100, -100, -100, -100}, b[6] = {0, 100, 100, -100, -100, 0};
  const float a_log[2] = {0, 0}, dt_bias[2] = {0, 0}, s0[2] = {2, 0};
  const int32_t cu[2] = {0, 3};
  const double want[8] = {2.5, 1, -3, 1, 3, -3, /* final states */ -3, 3};
  const int64_t sq[3] = {3, 1, 1}, sv[3] = {3, 2, 1}, sab[2] = {3, 2}, sh[1] = {2}, ss[4] = {1, 2, 1, 1};
  upf_tensor tq, tk, tv, ta, tb, tal, tdt, tsi, to;
  void *dcu = NULL;
  float got[8];
  upf_status st = bm_tensor(&m, q, 3, sq, &tq);
  if (st == UPF_OK)
    st = bm_tensor(&m, k, 3, sq, &tk);
  if (st == UPF_OK)
    st = bm_tensor(&m, v, 3, sv, &tv);
  if (st == UPF_OK)
    st = bm_tensor(&m, a, 2, sab, &ta);
  if (st == UPF_OK)
    st = bm_tensor(&m, b, 2, sab, &tb);
  if (st == UPF_OK)
    st = bm_tensor(&m, a_log, 1, sh, &tal);
  if (st == UPF_OK)
    st = bm_tensor(&m, dt_bias, 1, sh, &tdt);
  if (st == UPF_OK)
    st = bm_tensor(&m, s0, 4, ss, &tsi);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 3, sv, &to);
  if (st == UPF_OK)
    st = bm_put(&m, cu, sizeof cu, &dcu);
  upf_gdn_batch batch = {dcu, cu, 1};
  upf_gdn_scan_inputs in = {&tq, &tk, &tv, &ta, &tb, &tal, &tdt, &tsi, 1.0f};
  if (st == UPF_OK) /* in place: the final state overwrites the initial one */
    st = ctx->backend->gdn_scan(&batch, &in, &to, &tsi);
  if (st == UPF_OK)
    st = ctx->backend->download(got, to.data, 6 * sizeof(float));
  if (st == UPF_OK)
    st = ctx->backend->download(got + 6, tsi.data, 2 * sizeof(float));
  upf_tolerance tol = {1e-5, 1e-5, 1e-7};
  record_values(ctx, "gdn.scan", "golden: decay 1/2, beta 0/1/2 and 1, shared key head, in place", "Hk=1 Hv=2 D=1",
                st, got, want, 8, tol);
  bm_free(&m);
}

/* o = [3, 4] / sqrt(12.5 + eps) * w [1, 2] * silu(z), z = [100, 0] (silu 100 and 0). */
static void golden_gated_norm(upf_verify_ctx *ctx) {
  bmem m = {.be = ctx->backend};
  const float o[4] = {3, 4, 0, 5}, z[4] = {100, 0, 100, 100}, w[2] = {1, 2};
  double r = sqrt(12.5 + 1e-6), r2 = sqrt(12.5 + 1e-6);
  const double want[4] = {300.0 / r, 0.0, 0.0, 1000.0 / r2};
  const int64_t so[3] = {1, 2, 2}, sw[1] = {2};
  upf_norm_params p = {1e-6f, 0};
  upf_tensor to, tz, tw, ty;
  float got[4];
  upf_status st = bm_tensor(&m, o, 3, so, &to);
  if (st == UPF_OK)
    st = bm_tensor(&m, z, 3, so, &tz);
  if (st == UPF_OK)
    st = bm_tensor(&m, w, 1, sw, &tw);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 3, so, &ty);
  if (st == UPF_OK)
    st = ctx->backend->gdn_gated_norm(&to, &tz, &tw, &p, &ty);
  if (st == UPF_OK)
    st = ctx->backend->download(got, ty.data, sizeof got);
  record_values(ctx, "gdn.gated_norm", "golden: two heads", "T=1 H=2 D=2", st, got, want, 4,
                upf_tolerance_for(UPF_DTYPE_F32));
  bm_free(&m);
}

/* ================================================================================================ */
/* Bad inputs.                                                                                      */

static void errors_for(upf_verify_ctx *ctx, upf_op op) {
  const upf_backend *be = ctx->backend;
  void *buf = NULL;
  if (be->alloc(&buf, 4096 * sizeof(float)) != UPF_OK) {
    record_status(ctx, upf_op_name(op), "errors", "setup", UPF_ERR_NOMEM);
    return;
  }
  be->fill(buf, 0, 4096 * sizeof(float));
  const char *name = upf_op_name(op);
  const int32_t cu_ok[3] = {0, 2, 4}, cu_bad[3] = {0, 3, 2};
  upf_gdn_batch batch = {(const int32_t *)buf, cu_ok, 2}, bad_batch = {(const int32_t *)buf, cu_bad, 2};
  upf_tensor x, w, s, y, s2;
  const int64_t sx[2] = {4, 8}, sw[2] = {8, 4}, ss[3] = {2, 3, 8}, sw1[2] = {8, 1}, sxb[2] = {2, 8};
  switch (op) {
  case UPF_OP_GDN_CONV:
    upf_tensor_init(&x, buf, UPF_DTYPE_F32, 2, sx), upf_tensor_init(&w, buf, UPF_DTYPE_F32, 2, sw);
    upf_tensor_init(&s, buf, UPF_DTYPE_F32, 3, ss), upf_tensor_init(&y, (float *)buf + 64, UPF_DTYPE_F32, 2, sx);
    upf_tensor_init(&s2, (float *)buf + 128, UPF_DTYPE_F32, 3, ss);
    upf_verify_expect_status(ctx, name, "cu_seqlens not monotone", be->gdn_conv(&bad_batch, &x, &w, &s, &s2, &y),
                  UPF_ERR_CU_SEQLENS);
    upf_verify_expect_status(ctx, name, "state_out is state_in", be->gdn_conv(&batch, &x, &w, &s, &s, &y), UPF_ERR_INVALID_ARG);
    upf_verify_expect_status(ctx, name, "y is x", be->gdn_conv(&batch, &x, &w, NULL, NULL, &x), UPF_ERR_INVALID_ARG);
    upf_tensor_init(&s2, buf, UPF_DTYPE_BF16, 3, ss);
    upf_verify_expect_status(ctx, name, "bf16 state", be->gdn_conv(&batch, &x, &w, &s2, NULL, &y), UPF_ERR_DTYPE);
    upf_tensor_init(&w, buf, UPF_DTYPE_F32, 2, sw1);
    upf_verify_expect_status(ctx, name, "K=1", be->gdn_conv(&batch, &x, &w, NULL, NULL, &y), UPF_ERR_SHAPE);
    break;
  case UPF_OP_GDN_CONV_STEP:
    upf_tensor_init(&x, buf, UPF_DTYPE_F32, 2, sxb), upf_tensor_init(&w, buf, UPF_DTYPE_F32, 2, sw);
    upf_tensor_init(&y, (float *)buf + 64, UPF_DTYPE_F32, 2, sxb);
    upf_verify_expect_status(ctx, name, "no state", be->gdn_conv_step(&x, &w, NULL, &y), UPF_ERR_INVALID_ARG);
    upf_tensor_init(&s, buf, UPF_DTYPE_F32, 3, (const int64_t[3]){2, 2, 8});
    upf_verify_expect_status(ctx, name, "state (B, K-2, C)", be->gdn_conv_step(&x, &w, &s, &y), UPF_ERR_SHAPE);
    break;
  case UPF_OP_GDN_SCAN: {
    upf_tensor q, k, v, a, b, al, dt, o;
    const int64_t sq[3] = {4, 2, 8}, sv[3] = {4, 3, 8}, sab[2] = {4, 3}, sh[1] = {3};
    upf_tensor_init(&q, buf, UPF_DTYPE_F32, 3, sq), upf_tensor_init(&k, buf, UPF_DTYPE_F32, 3, sq);
    upf_tensor_init(&v, buf, UPF_DTYPE_F32, 3, sv), upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, sab);
    upf_tensor_init(&b, buf, UPF_DTYPE_F32, 2, sab), upf_tensor_init(&al, buf, UPF_DTYPE_F32, 1, sh);
    upf_tensor_init(&dt, buf, UPF_DTYPE_F32, 1, sh), upf_tensor_init(&o, buf, UPF_DTYPE_F32, 3, sv);
    upf_gdn_scan_inputs in = {&q, &k, &v, &a, &b, &al, &dt, NULL, 0.25f};
    upf_verify_expect_status(ctx, name, "Hv=3 not a multiple of Hk=2", be->gdn_scan(&batch, &in, &o, NULL), UPF_ERR_SHAPE);
    const int64_t sv4[3] = {4, 4, 8}, sab4[2] = {4, 4}, sh4[1] = {4};
    upf_tensor_init(&v, buf, UPF_DTYPE_F32, 3, sv4), upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, sab4);
    upf_tensor_init(&b, buf, UPF_DTYPE_F32, 2, sab4), upf_tensor_init(&al, buf, UPF_DTYPE_F32, 1, sh4);
    upf_tensor_init(&dt, buf, UPF_DTYPE_F32, 1, sh4), upf_tensor_init(&o, buf, UPF_DTYPE_F32, 3, sv4);
    upf_verify_expect_status(ctx, name, "valid shapes but cu_seqlens ends at 2, T=4", be->gdn_scan(&bad_batch, &in, &o, NULL),
                  UPF_ERR_CU_SEQLENS);
    in.scale = 0.0f;
    upf_verify_expect_status(ctx, name, "scale 0", be->gdn_scan(&batch, &in, &o, NULL), UPF_ERR_INVALID_ARG);
    in.scale = 0.25f;
    upf_tensor_init(&s, buf, UPF_DTYPE_F32, 4, (const int64_t[4]){2, 4, 8, 4});
    in.state_in = &s;
    upf_verify_expect_status(ctx, name, "state (B, Hv, Dk, Dk/2)", be->gdn_scan(&batch, &in, &o, NULL), UPF_ERR_SHAPE);
    in.state_in = NULL;
    upf_tensor_init(&al, buf, UPF_DTYPE_BF16, 1, sh4);
    upf_verify_expect_status(ctx, name, "a_log bf16", be->gdn_scan(&batch, &in, &o, NULL), UPF_ERR_DTYPE);
    upf_tensor_init(&al, buf, UPF_DTYPE_F32, 1, sh4), upf_tensor_init(&k, buf, UPF_DTYPE_BF16, 3, sq);
    upf_verify_expect_status(ctx, name, "k bf16, q f32", be->gdn_scan(&batch, &in, &o, NULL), UPF_ERR_DTYPE);
    break;
  }
  case UPF_OP_GDN_GATED_NORM: {
    upf_norm_params p = {1e-6f, 0};
    const int64_t s3[3] = {4, 2, 8}, s1[1] = {4};
    upf_tensor_init(&x, buf, UPF_DTYPE_F32, 3, s3), upf_tensor_init(&y, buf, UPF_DTYPE_F32, 3, s3);
    upf_tensor_init(&w, buf, UPF_DTYPE_F32, 1, s1);
    upf_verify_expect_status(ctx, name, "w (D/2)", be->gdn_gated_norm(&x, &y, &w, &p, &y), UPF_ERR_SHAPE);
    upf_tensor_init(&w, buf, UPF_DTYPE_F32, 1, (const int64_t[1]){8});
    p.eps = 0.0f;
    upf_verify_expect_status(ctx, name, "eps 0", be->gdn_gated_norm(&x, &y, &w, &p, &y), UPF_ERR_INVALID_ARG);
    break;
  }
  default:
    break;
  }
  be->release(buf);
}

/* ================================================================================================ */
/* Seeded inputs shared by the boundary check and the harness cases.                                */

/* A gate pair (a, b) as in real use: g log-uniform in [-20, -1e-4] and beta uniform in [0, 1] (the
 * ends included through a clamped b), inverted through g = -exp(a_log) softplus(a + dt_bias). */
static void draw_gate(upf_rng *rng, double a_log, double dt_bias, float *a, float *b) {
  double lg = log(1e-4) + (log(20.0) - log(1e-4)) * upf_rng_uniform(rng);
  double sp = exp(lg) / exp(a_log); /* softplus(a + dt_bias) */
  double x = sp > 20.0 ? sp : log(expm1(sp));
  *a = (float)(x - dt_bias);
  double beta = upf_rng_uniform(rng);
  double bb = log(beta / (1.0 - beta));
  *b = (float)(bb > 12.0 ? 12.0 : bb < -12.0 ? -12.0 : bb);
}

/* ================================================================================================ */
/* The prefill/decode boundary, on the backend under test: conv prefill of n_r tokens, then m steps of */
/* gdn.conv_step and one-token gdn.scan rows (states in place), against the CPU reference's prefill of */
/* n_r + m tokens. Also: the batch equals its requests run one at a time (CPU reference).           */

#define BD_B 3
#define BD_M 3
#define BD_HK 1
#define BD_HV 2
#define BD_DK 8
#define BD_DV 4
#define BD_K 4
#define BD_C (2 * BD_HK * BD_DK + BD_HV * BD_DV)

typedef struct {
  int32_t n[BD_B];
  float *x;      /* (B, n+m, C) every token of every request */
  float *w;      /* (C, K) */
  float *cs0;    /* (B, K-1, C) initial conv states */
  float *ab;     /* (B, n+m, 2 Hv): a then b */
  float a_log[BD_HV], dt_bias[BD_HV];
  float *ss0;    /* (B, Hv, Dk, Dv) initial scan states */
} bd_data;

/* Views of q, k, v into a conv output y (T, C) and of a, b into ab (T, 2 Hv). */
static void bd_views(void *y, void *ab, int64_t T, upf_tensor *q, upf_tensor *k, upf_tensor *v, upf_tensor *a,
                     upf_tensor *b) {
  const int64_t sq[3] = {T, BD_HK, BD_DK}, sv[3] = {T, BD_HV, BD_DV}, sab[2] = {T, BD_HV};
  upf_tensor_init(q, y, UPF_DTYPE_F32, 3, sq), upf_tensor_init(k, (float *)y + BD_HK * BD_DK, UPF_DTYPE_F32, 3, sq);
  upf_tensor_init(v, (float *)y + 2 * BD_HK * BD_DK, UPF_DTYPE_F32, 3, sv);
  q->stride[0] = k->stride[0] = v->stride[0] = BD_C;
  upf_tensor_init(a, ab, UPF_DTYPE_F32, 2, sab), upf_tensor_init(b, (float *)ab + BD_HV, UPF_DTYPE_F32, 2, sab);
  a->stride[0] = b->stride[0] = 2 * BD_HV;
}

/* Runs conv then scan over the packed tokens [from, from + len_r) of each request on `be`:
 * o (sum len, Hv, Dv) and the final states; conv and scan states in (may be NULL) and out. */
static upf_status bd_prefill(const upf_backend *be, const bd_data *d, const int32_t *from, const int32_t *len,
                             int with_state, float *o, float *cs_out, float *ss_out) {
  bmem m = {.be = be};
  int32_t cu[BD_B + 1] = {0};
  for (int r = 0; r < BD_B; r++)
    cu[r + 1] = cu[r] + len[r];
  int64_t T = cu[BD_B];
  float *x = malloc((size_t)(T ? T : 1) * BD_C * sizeof *x), *ab = malloc((size_t)(T ? T : 1) * 2 * BD_HV * sizeof *ab);
  upf_status st = x && ab ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "boundary");
  for (int r = 0; st == UPF_OK && r < BD_B; r++) {
    int64_t base = 0; /* request r's first token in d->x */
    for (int q = 0; q < r; q++)
      base += d->n[q] + BD_M;
    memcpy(x + (int64_t)cu[r] * BD_C, d->x + (base + from[r]) * BD_C, (size_t)len[r] * BD_C * sizeof *x);
    memcpy(ab + (int64_t)cu[r] * 2 * BD_HV, d->ab + (base + from[r]) * 2 * BD_HV, (size_t)len[r] * 2 * BD_HV * sizeof *ab);
  }
  upf_tensor tx, tw, tcs, tcso, ty, tab, tal, tdt, tss, tsso, to, q, k, v, a, b;
  void *dcu = NULL;
  const int64_t sx[2] = {T, BD_C}, sw[2] = {BD_C, BD_K}, scs[3] = {BD_B, BD_K - 1, BD_C}, sab[2] = {T, 2 * BD_HV};
  const int64_t sh[1] = {BD_HV}, sss[4] = {BD_B, BD_HV, BD_DK, BD_DV}, so[3] = {T, BD_HV, BD_DV};
  if (st == UPF_OK)
    st = bm_tensor(&m, x, 2, sx, &tx);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->w, 2, sw, &tw);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->cs0, 3, scs, &tcs);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 3, scs, &tcso);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 2, sx, &ty);
  if (st == UPF_OK)
    st = bm_tensor(&m, ab, 2, sab, &tab);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->a_log, 1, sh, &tal);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->dt_bias, 1, sh, &tdt);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->ss0, 4, sss, &tss);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 4, sss, &tsso);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 3, so, &to);
  if (st == UPF_OK)
    st = bm_put(&m, cu, sizeof cu, &dcu);
  upf_gdn_batch batch = {dcu, cu, BD_B};
  if (st == UPF_OK)
    st = be->gdn_conv(&batch, &tx, &tw, with_state ? &tcs : NULL, &tcso, &ty);
  bd_views(ty.data, tab.data, T, &q, &k, &v, &a, &b);
  upf_gdn_scan_inputs in = {&q, &k, &v, &a, &b, &tal, &tdt, with_state ? &tss : NULL, 1.0f / sqrtf((float)BD_DK)};
  if (st == UPF_OK)
    st = be->gdn_scan(&batch, &in, &to, &tsso);
  if (st == UPF_OK)
    st = be->download(o, to.data, (size_t)T * BD_HV * BD_DV * sizeof(float));
  if (st == UPF_OK && cs_out)
    st = be->download(cs_out, tcso.data, sizeof(float) * BD_B * (BD_K - 1) * BD_C);
  if (st == UPF_OK && ss_out)
    st = be->download(ss_out, tsso.data, sizeof(float) * BD_B * BD_HV * BD_DK * BD_DV);
  free(x), free(ab);
  bm_free(&m);
  return st;
}

/* m decode steps on `be` from the given conv and scan states: o_steps (m, B, Hv, Dv). */
static upf_status bd_decode(const upf_backend *be, const bd_data *d, const float *cs, const float *ss, float *o_steps,
                            float *ss_out) {
  bmem m = {.be = be};
  int32_t cu[BD_B + 1];
  for (int r = 0; r <= BD_B; r++)
    cu[r] = r;
  upf_tensor tx, tw, tcs, ty, tab, tal, tdt, tss, to, q, k, v, a, b;
  void *dcu = NULL;
  const int64_t sx[2] = {BD_B, BD_C}, sw[2] = {BD_C, BD_K}, scs[3] = {BD_B, BD_K - 1, BD_C}, sab[2] = {BD_B, 2 * BD_HV};
  const int64_t sh[1] = {BD_HV}, sss[4] = {BD_B, BD_HV, BD_DK, BD_DV}, so[3] = {BD_B, BD_HV, BD_DV};
  upf_status st = bm_tensor(&m, NULL, 2, sx, &tx);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->w, 2, sw, &tw);
  if (st == UPF_OK)
    st = bm_tensor(&m, cs, 3, scs, &tcs);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 2, sx, &ty);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 2, sab, &tab);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->a_log, 1, sh, &tal);
  if (st == UPF_OK)
    st = bm_tensor(&m, d->dt_bias, 1, sh, &tdt);
  if (st == UPF_OK)
    st = bm_tensor(&m, ss, 4, sss, &tss);
  if (st == UPF_OK)
    st = bm_tensor(&m, NULL, 3, so, &to);
  if (st == UPF_OK)
    st = bm_put(&m, cu, sizeof cu, &dcu);
  upf_gdn_batch batch = {dcu, cu, BD_B};
  bd_views(ty.data, tab.data, BD_B, &q, &k, &v, &a, &b);
  upf_gdn_scan_inputs in = {&q, &k, &v, &a, &b, &tal, &tdt, &tss, 1.0f / sqrtf((float)BD_DK)};
  float xs[BD_B * BD_C], abs_[BD_B * 2 * BD_HV];
  for (int s = 0; st == UPF_OK && s < BD_M; s++) {
    int64_t base = 0;
    for (int r = 0; r < BD_B; r++) {
      int64_t t = base + d->n[r] + s;
      memcpy(xs + r * BD_C, d->x + t * BD_C, sizeof(float) * BD_C);
      memcpy(abs_ + r * 2 * BD_HV, d->ab + t * 2 * BD_HV, sizeof(float) * 2 * BD_HV);
      base += d->n[r] + BD_M;
    }
    st = be->upload(tx.data, xs, sizeof xs);
    if (st == UPF_OK)
      st = be->upload(tab.data, abs_, sizeof abs_);
    if (st == UPF_OK)
      st = be->gdn_conv_step(&tx, &tw, &tcs, &ty);
    if (st == UPF_OK) /* decode rows are one-token requests; the state updates in place */
      st = be->gdn_scan(&batch, &in, &to, &tss);
    if (st == UPF_OK)
      st = be->download(o_steps + (int64_t)s * BD_B * BD_HV * BD_DV, to.data, sizeof(float) * BD_B * BD_HV * BD_DV);
  }
  if (st == UPF_OK)
    st = be->download(ss_out, tss.data, sizeof(float) * BD_B * BD_HV * BD_DK * BD_DV);
  bm_free(&m);
  return st;
}

static void boundary_check(upf_verify_ctx *ctx, int with_state) {
  const char *variant = with_state ? "prefill n + m steps == prefill n+m, initial states"
                                   : "prefill n + m steps == prefill n+m, from zero";
  bd_data d = {.n = {5, 1, 0}}; /* a request shorter than K-1 and one that only decodes */
  int64_t total = 0;
  for (int r = 0; r < BD_B; r++)
    total += d.n[r] + BD_M;
  upf_rng rng;
  upf_rng_seed(&rng, 4242 + with_state);
  d.x = malloc((size_t)total * BD_C * sizeof *d.x);
  d.w = malloc(BD_C * BD_K * sizeof *d.w);
  d.cs0 = malloc(BD_B * (BD_K - 1) * BD_C * sizeof *d.cs0);
  d.ab = malloc((size_t)total * 2 * BD_HV * sizeof *d.ab);
  d.ss0 = malloc(BD_B * BD_HV * BD_DK * BD_DV * sizeof *d.ss0);
  int64_t no_full = total * BD_HV * BD_DV, ns = BD_B * BD_HV * BD_DK * BD_DV;
  float *o_full = malloc((size_t)no_full * sizeof *o_full), *o_pre = malloc((size_t)no_full * sizeof *o_pre);
  float *o_steps = malloc((size_t)BD_M * BD_B * BD_HV * BD_DV * sizeof *o_steps);
  float *cs = malloc(BD_B * (BD_K - 1) * BD_C * sizeof *cs), *ss = malloc((size_t)ns * sizeof *ss);
  float *ss_full = malloc((size_t)ns * sizeof *ss_full), *ss_dec = malloc((size_t)ns * sizeof *ss_dec);
  float *got = malloc((size_t)(no_full + ns) * sizeof *got);
  double *want = malloc((size_t)(no_full + ns) * sizeof *want);
  upf_status st = UPF_OK;
  if (!d.x || !d.w || !d.cs0 || !d.ab || !d.ss0 || !o_full || !o_pre || !o_steps || !cs || !ss || !ss_full ||
      !ss_dec || !got || !want)
    st = upf_fail(UPF_ERR_NOMEM, "boundary check");
  if (st == UPF_OK) {
    upf_rng_fill_normal(&rng, d.x, total * BD_C, 0.0f, 1.0f);
    upf_rng_fill_normal(&rng, d.w, BD_C * BD_K, 0.0f, 0.5f);
    upf_rng_fill_normal(&rng, d.cs0, BD_B * (BD_K - 1) * BD_C, 0.0f, 1.0f);
    upf_rng_fill_normal(&rng, d.ss0, ns, 0.0f, 0.5f);
    for (int h = 0; h < BD_HV; h++)
      d.a_log[h] = upf_rng_uniform(&rng) * 3.0f - 1.0f, d.dt_bias[h] = upf_rng_uniform(&rng) * 4.0f - 2.0f;
    for (int64_t t = 0; t < total; t++)
      for (int h = 0; h < BD_HV; h++)
        draw_gate(&rng, d.a_log[h], d.dt_bias[h], &d.ab[t * 2 * BD_HV + h], &d.ab[t * 2 * BD_HV + BD_HV + h]);
    /* Without initial states the decode path still needs the prefill's final states: zeros in. */
    if (!with_state) {
      memset(d.cs0, 0, BD_B * (BD_K - 1) * BD_C * sizeof *d.cs0);
      memset(d.ss0, 0, (size_t)ns * sizeof *d.ss0);
    }
  }
  int32_t zero[BD_B] = {0}, full[BD_B], pre[BD_B];
  for (int r = 0; r < BD_B; r++)
    full[r] = d.n[r] + BD_M, pre[r] = d.n[r];
  if (st == UPF_OK)
    st = bd_prefill(upf_backend_cpu(), &d, zero, full, with_state, o_full, NULL, ss_full);
  if (st == UPF_OK)
    st = bd_prefill(ctx->backend, &d, zero, pre, with_state, o_pre, cs, ss);
  if (st == UPF_OK)
    st = bd_decode(ctx->backend, &d, cs, ss, o_steps, ss_dec);
  if (st == UPF_OK) {
    /* Reassemble the backend's outputs in the full run's token order. */
    int64_t tf = 0, tp = 0, per = BD_HV * BD_DV;
    for (int r = 0; r < BD_B; r++) {
      for (int t = 0; t < d.n[r]; t++, tf++, tp++)
        for (int64_t e = 0; e < per; e++)
          got[tf * per + e] = o_pre[tp * per + e], want[tf * per + e] = o_full[tf * per + e];
      for (int s = 0; s < BD_M; s++, tf++)
        for (int64_t e = 0; e < per; e++)
          got[tf * per + e] = o_steps[((int64_t)s * BD_B + r) * per + e], want[tf * per + e] = o_full[tf * per + e];
    }
    for (int64_t i = 0; i < ns; i++)
      got[no_full + i] = ss_dec[i], want[no_full + i] = ss_full[i];
  }
  char shape[96];
  snprintf(shape, sizeof shape, "n={5,1,0} m=%d Hk=%d Hv=%d Dk=%d Dv=%d K=%d", BD_M, BD_HK, BD_HV, BD_DK, BD_DV, BD_K);
  record_values(ctx, "gdn.scan", variant, shape, st, got, want, no_full + ns, upf_tolerance_for(UPF_DTYPE_F32));

  /* The batch equals its requests run one at a time (each alone, others given 0 tokens). */
  if (st == UPF_OK && with_state) {
    int64_t per = BD_HV * BD_DV, off = 0;
    for (int r = 0; st == UPF_OK && r < BD_B; r++) {
      int32_t one[BD_B] = {0};
      one[r] = full[r];
      st = bd_prefill(ctx->backend, &d, zero, one, 1, o_pre, NULL, ss);
      for (int64_t e = 0; st == UPF_OK && e < (int64_t)full[r] * per; e++)
        got[off + e] = o_pre[e], want[off + e] = o_full[off + e];
      for (int64_t e = 0; st == UPF_OK && e < BD_HV * BD_DK * BD_DV; e++) {
        int64_t i = (int64_t)r * BD_HV * BD_DK * BD_DV + e;
        got[no_full + i] = ss[i], want[no_full + i] = ss_full[i];
      }
      off += (int64_t)full[r] * per;
    }
    record_values(ctx, "gdn.scan", "batch == requests one by one", shape, st, got, want, no_full + ns,
                  upf_tolerance_for(UPF_DTYPE_F32));
  }
  free(d.x), free(d.w), free(d.cs0), free(d.ab), free(d.ss0), free(o_full), free(o_pre), free(o_steps);
  free(cs), free(ss), free(ss_full), free(ss_dec), free(got), free(want);
}

/* ================================================================================================ */
/* The same boundary for the scan alone at Qwen3-Next head size in bf16 (Dk = Dv = 128, two value heads */
/* per key head): the prefill takes the backend's prefill path (on CUDA the chunked tensor-core form,   */
/* requests of 130 and 64 tokens), the m steps its decode path (one-token requests, the recurrent step), */
/* against the CPU reference's prefill of n+m. bf16 tolerances.                                        */

#define SB_B 4
#define SB_M 3
#define SB_HK 2
#define SB_HV 4
#define SB_D 128

typedef struct {
  int32_t n[SB_B];
  int64_t first[SB_B + 1]; /* request r's tokens [first[r], first[r+1]) in the host arrays */
  uint16_t *qk;            /* (total, 2 Hk D): q then k, bf16 */
  uint16_t *v;             /* (total, Hv D) */
  uint16_t *ab;            /* (total, 2 Hv): a then b */
  float a_log[SB_HV], dt_bias[SB_HV];
  float *s0; /* (B, Hv, D, D) */
} sb_data;

/* Scans tokens [from_r, from_r + len_r) of each request on `be`, states in (NULL: zeros) and out (may
 * be the same host array): o (sum len, Hv, D) as floats. */
static upf_status sb_scan(const upf_backend *be, const sb_data *d, const int32_t *from, const int32_t *len,
                          const float *s_in, float *s_out, float *o) {
  bmem m = {.be = be};
  int32_t cu[SB_B + 1] = {0};
  for (int r = 0; r < SB_B; r++)
    cu[r + 1] = cu[r] + len[r];
  const int64_t T = cu[SB_B], rows = T ? T : 1, nqk = 2 * SB_HK * SB_D, nv = SB_HV * SB_D;
  const int64_t ns = (int64_t)SB_B * SB_HV * SB_D * SB_D;
  uint16_t *qk = malloc((size_t)rows * nqk * 2), *v = malloc((size_t)rows * nv * 2);
  uint16_t *ab = malloc((size_t)rows * 2 * SB_HV * 2), *ob = malloc((size_t)rows * nv * 2);
  upf_status st = qk && v && ab && ob ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "scan boundary");
  for (int r = 0; st == UPF_OK && r < SB_B; r++) {
    int64_t src = d->first[r] + from[r];
    memcpy(qk + (int64_t)cu[r] * nqk, d->qk + src * nqk, (size_t)len[r] * nqk * 2);
    memcpy(v + (int64_t)cu[r] * nv, d->v + src * nv, (size_t)len[r] * nv * 2);
    memcpy(ab + (int64_t)cu[r] * 2 * SB_HV, d->ab + src * 2 * SB_HV, (size_t)len[r] * 2 * SB_HV * 2);
  }
  const int64_t sq[3] = {T, SB_HK, SB_D}, sv[3] = {T, SB_HV, SB_D}, sab[2] = {T, SB_HV}, sh[1] = {SB_HV};
  const int64_t sst[4] = {SB_B, SB_HV, SB_D, SB_D};
  upf_tensor q, k, tv, a, b, al, dt, ss, to;
  void *dqk = NULL, *dv = NULL, *dab = NULL, *dal = NULL, *ddt = NULL, *dss = NULL, *dto = NULL, *dcu = NULL;
  if (st == UPF_OK)
    st = bm_put(&m, qk, (size_t)rows * nqk * 2, &dqk);
  if (st == UPF_OK)
    st = bm_put(&m, v, (size_t)rows * nv * 2, &dv);
  if (st == UPF_OK)
    st = bm_put(&m, ab, (size_t)rows * 2 * SB_HV * 2, &dab);
  if (st == UPF_OK)
    st = bm_put(&m, d->a_log, sizeof d->a_log, &dal);
  if (st == UPF_OK)
    st = bm_put(&m, d->dt_bias, sizeof d->dt_bias, &ddt);
  if (st == UPF_OK)
    st = bm_put(&m, s_in, (size_t)ns * sizeof(float), &dss); /* NULL s_in: poisoned, not read */
  if (st == UPF_OK)
    st = bm_put(&m, NULL, (size_t)rows * nv * 2, &dto);
  if (st == UPF_OK)
    st = bm_put(&m, cu, sizeof cu, &dcu);
  if (st == UPF_OK) {
    upf_tensor_init(&q, dqk, UPF_DTYPE_BF16, 3, sq), upf_tensor_init(&k, (uint16_t *)dqk + SB_HK * SB_D, UPF_DTYPE_BF16, 3, sq);
    q.stride[0] = k.stride[0] = nqk;
    upf_tensor_init(&tv, dv, UPF_DTYPE_BF16, 3, sv), upf_tensor_init(&to, dto, UPF_DTYPE_BF16, 3, sv);
    upf_tensor_init(&a, dab, UPF_DTYPE_BF16, 2, sab), upf_tensor_init(&b, (uint16_t *)dab + SB_HV, UPF_DTYPE_BF16, 2, sab);
    a.stride[0] = b.stride[0] = 2 * SB_HV;
    upf_tensor_init(&al, dal, UPF_DTYPE_F32, 1, sh), upf_tensor_init(&dt, ddt, UPF_DTYPE_F32, 1, sh);
    upf_tensor_init(&ss, dss, UPF_DTYPE_F32, 4, sst);
    upf_gdn_batch batch = {dcu, cu, SB_B};
    upf_gdn_scan_inputs in = {&q, &k, &tv, &a, &b, &al, &dt, s_in ? &ss : NULL, 1.0f / sqrtf((float)SB_D)};
    st = be->gdn_scan(&batch, &in, &to, &ss); /* the final states overwrite the initial ones in place */
  }
  if (st == UPF_OK && T > 0)
    st = be->download(ob, dto, (size_t)T * nv * 2);
  if (st == UPF_OK)
    st = be->download(s_out, dss, (size_t)ns * sizeof(float));
  for (int64_t i = 0; st == UPF_OK && i < T * nv; i++)
    o[i] = upf_bf16_to_f32(ob[i]);
  free(qk), free(v), free(ab), free(ob);
  bm_free(&m);
  return st;
}

static void scan_boundary_bf16(upf_verify_ctx *ctx, int with_state) {
  const char *variant = with_state ? "bf16 D=128: prefill n + m steps == prefill n+m, initial states"
                                   : "bf16 D=128: prefill n + m steps == prefill n+m, from zero";
  sb_data d = {.n = {130, 64, 1, 0}};
  d.first[0] = 0;
  for (int r = 0; r < SB_B; r++)
    d.first[r + 1] = d.first[r] + d.n[r] + SB_M;
  const int64_t total = d.first[SB_B], nqk = 2 * SB_HK * SB_D, nv = SB_HV * SB_D;
  const int64_t ns = (int64_t)SB_B * SB_HV * SB_D * SB_D, per = nv;
  upf_rng rng;
  upf_rng_seed(&rng, 5151 + with_state);
  d.qk = malloc((size_t)total * nqk * 2), d.v = malloc((size_t)total * nv * 2), d.ab = malloc((size_t)total * 2 * SB_HV * 2);
  d.s0 = malloc((size_t)ns * sizeof *d.s0);
  float *tmp = malloc((size_t)total * nqk * sizeof *tmp), *o_full = malloc((size_t)total * nv * sizeof *o_full);
  float *o_pre = malloc((size_t)total * nv * sizeof *o_pre), *o_step = malloc((size_t)SB_B * nv * sizeof *o_step);
  float *s_full = malloc((size_t)ns * sizeof *s_full), *s_dev = malloc((size_t)ns * sizeof *s_dev);
  float *got = malloc((size_t)(total * nv + ns) * sizeof *got);
  double *want = malloc((size_t)(total * nv + ns) * sizeof *want);
  upf_status st = d.qk && d.v && d.ab && d.s0 && tmp && o_full && o_pre && o_step && s_full && s_dev && got && want
                      ? UPF_OK
                      : upf_fail(UPF_ERR_NOMEM, "scan boundary");
  if (st == UPF_OK) {
    upf_rng_fill_normal(&rng, tmp, total * nqk, 0.0f, 1.0f);
    upf_bf16_from_f32_array(d.qk, tmp, total * nqk);
    upf_rng_fill_normal(&rng, tmp, total * nv, 0.0f, 1.0f);
    upf_bf16_from_f32_array(d.v, tmp, total * nv);
    upf_rng_fill_normal(&rng, d.s0, ns, 0.0f, 0.5f);
    if (!with_state)
      memset(d.s0, 0, (size_t)ns * sizeof *d.s0);
    for (int h = 0; h < SB_HV; h++)
      d.a_log[h] = upf_rng_uniform(&rng) * 3.0f - 1.0f, d.dt_bias[h] = upf_rng_uniform(&rng) * 4.0f - 2.0f;
    for (int64_t t = 0; t < total; t++)
      for (int h = 0; h < SB_HV; h++) {
        float a, b;
        draw_gate(&rng, d.a_log[h], d.dt_bias[h], &a, &b);
        d.ab[t * 2 * SB_HV + h] = upf_bf16_from_f32(a), d.ab[t * 2 * SB_HV + SB_HV + h] = upf_bf16_from_f32(b);
      }
  }
  int32_t zero[SB_B] = {0}, full[SB_B], pre[SB_B], one[SB_B];
  for (int r = 0; r < SB_B; r++)
    full[r] = d.n[r] + SB_M, pre[r] = d.n[r], one[r] = 1;
  if (st == UPF_OK)
    st = sb_scan(upf_backend_cpu(), &d, zero, full, with_state ? d.s0 : NULL, s_full, o_full);
  if (st == UPF_OK)
    st = sb_scan(ctx->backend, &d, zero, pre, with_state ? d.s0 : NULL, s_dev, o_pre);
  /* Reassemble in the full run's token order: each request's prefill rows, then its m steps. */
  int64_t tp = 0, tf[SB_B];
  for (int r = 0; r < SB_B; r++) {
    tf[r] = d.first[r]; /* the full run packs requests in the same order */
    for (int t = 0; st == UPF_OK && t < d.n[r]; t++, tp++)
      for (int64_t e = 0; e < per; e++)
        got[(tf[r] + t) * per + e] = o_pre[tp * per + e];
  }
  for (int s = 0; st == UPF_OK && s < SB_M; s++) {
    int32_t from[SB_B];
    for (int r = 0; r < SB_B; r++)
      from[r] = d.n[r] + s;
    st = sb_scan(ctx->backend, &d, from, one, s_dev, s_dev, o_step);
    for (int r = 0; st == UPF_OK && r < SB_B; r++)
      for (int64_t e = 0; e < per; e++)
        got[(tf[r] + d.n[r] + s) * per + e] = o_step[r * per + e];
  }
  for (int64_t i = 0; st == UPF_OK && i < total * per; i++)
    want[i] = o_full[i];
  for (int64_t i = 0; st == UPF_OK && i < ns; i++)
    got[total * per + i] = s_dev[i], want[total * per + i] = s_full[i];
  char shape[96];
  snprintf(shape, sizeof shape, "n={130,64,1,0} m=%d Hk=%d Hv=%d D=%d", SB_M, SB_HK, SB_HV, SB_D);
  record_values(ctx, "gdn.scan", variant, shape, st, got, want, total * per + ns, upf_tolerance_for(UPF_DTYPE_BF16));
  free(d.qk), free(d.v), free(d.ab), free(d.s0), free(tmp), free(o_full), free(o_pre), free(o_step), free(s_full);
  free(s_dev), free(got), free(want);
}

/* ================================================================================================ */
/* Seeded cases through the dense harness (backend under test vs the CPU reference).                */

typedef struct {
  const char *name;
  int32_t lens[8];
  int32_t num_reqs;
  int64_t hk, hv, dk, dv;
  int with_state;
  unsigned flags;
} gdn_case;

#define QK UPF_QWEN3N_80B_LINEAR_KEY_HEADS
#define QV UPF_QWEN3N_80B_LINEAR_VALUE_HEADS
#define QDK UPF_QWEN3N_80B_LINEAR_KEY_DIM
#define QDV UPF_QWEN3N_80B_LINEAR_VALUE_DIM

static const gdn_case gdn_cases[] = {
    {"qwen3-next heads/4, ragged", {1, 17, 64, 65}, 4, QK / 4, QV / 4, QDK, QDV, 1, GC_QUICK},
    {"qwen3-next heads/4, ragged, zero states", {1, 17, 64, 65}, 4, QK / 4, QV / 4, QDK, QDV, 0, GC_QUICK},
    {"odd Dk=20 Dv=12, decode rows", {1, 1, 3, 1, 0, 2}, 6, 3, 6, 20, 12, 1, GC_QUICK},
    {"qwen3-next, ragged", {1, 17, 64, 65, 577}, 5, QK, QV, QDK, QDV, 1, 0},
    {"qwen3-next, one long request", {4096}, 1, QK, QV, QDK, QDV, 1, 0},
    {"qwen3-next heads/8, 32K", {32768}, 1, QK / 8, QV / 8, QDK, QDV, 1, 0},
    {"qwen3-next heads/8, 32K + ragged, zero states", {32768, 577, 1}, 3, QK / 8, QV / 8, QDK, QDV, 0, 0},
};

typedef struct {
  const int32_t *cu_host;
  int32_t num_reqs;
  int64_t hk, hv, dk, dv;
  int with_state, ksize;
  float scale;
  upf_norm_params np;
} gdn_ctx;

/* Scan buffers: o, state_out, qkv (q and k views; v in buffer 3), v, ab (a, b views), a_log, dt_bias,
 * state_in / cu. */
enum { SB_O, SB_SOUT, SB_QK, SB_V, SB_AB, SB_ALOG, SB_DT, SB_MISC };

static upf_status scan_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const gdn_ctx *g = ctx;
  upf_gdn_batch batch = {(const int32_t *)v[SB_MISC][0].data, g->cu_host, g->num_reqs};
  upf_gdn_scan_inputs in = {&v[SB_QK][0], &v[SB_QK][1], &v[SB_V][0],       &v[SB_AB][0], &v[SB_AB][1],
                            &v[SB_ALOG][0], &v[SB_DT][0], g->with_state ? &v[SB_DT][1] : NULL, g->scale};
  return be->gdn_scan(&batch, &in, &v[SB_O][0], &v[SB_SOUT][0]);
}

static upf_status scan_truth(upf_dviews v, const void *ctx, double *truth) {
  const gdn_ctx *g = ctx;
  upf_gdn_batch batch = {g->cu_host, g->cu_host, g->num_reqs};
  upf_gdn_scan_inputs in = {&v[SB_QK][0], &v[SB_QK][1], &v[SB_V][0],       &v[SB_AB][0], &v[SB_AB][1],
                            &v[SB_ALOG][0], &v[SB_DT][0], g->with_state ? &v[SB_DT][1] : NULL, g->scale};
  return ref_gdn_scan_f64(&batch, &in, truth);
}

static void scan_run(upf_verify_ctx *ctx, int index, upf_dtype dt) {
  const gdn_case *c = &gdn_cases[index];
  const char *op = "gdn.scan";
  int32_t cu[9] = {0};
  for (int32_t r = 0; r < c->num_reqs; r++)
    cu[r + 1] = cu[r] + c->lens[r];
  int64_t T = cu[c->num_reqs], B = c->num_reqs, nk = c->hk * c->dk, nv = c->hv * c->dv;
  int64_t ns = B * c->hv * c->dk * c->dv;
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)dt));
  upf_dbuf *o = upf_dcase_add(&dc, "o", dt, T * nv, 1);
  upf_dbuf *so = o ? upf_dcase_add(&dc, "state_out", UPF_DTYPE_F32, ns, 1) : NULL;
  upf_dbuf *qk = so ? upf_dcase_add(&dc, "qk", dt, T * (2 * nk + 3), 0) : NULL;
  upf_dbuf *vb = qk ? upf_dcase_add(&dc, "v", dt, T * nv, 0) : NULL;
  upf_dbuf *ab = vb ? upf_dcase_add(&dc, "ab", dt, T * 2 * c->hv, 0) : NULL;
  upf_dbuf *al = ab ? upf_dcase_add(&dc, "a_log", UPF_DTYPE_F32, c->hv, 0) : NULL;
  /* dt_bias and, as its second view, state_in share one f32 parent. */
  upf_dbuf *dtb = al ? upf_dcase_add(&dc, "dt_bias+state_in", UPF_DTYPE_F32, c->hv + ns, 0) : NULL;
  upf_dbuf *cub = dtb ? upf_dcase_add(&dc, "cu_seqlens", UPF_DTYPE_I32, B + 1, 0) : NULL;
  if (!cub) {
    record_status(ctx, op, c->name, "setup", UPF_ERR_NOMEM);
    upf_dcase_free(&dc);
    return;
  }
  const int64_t s_o[3] = {T, c->hv, c->dv}, s_s[4] = {B, c->hv, c->dk, c->dv}, s_q[3] = {T, c->hk, c->dk};
  const int64_t st_q[3] = {2 * nk + 3, c->dk, 1}, s_ab[2] = {T, c->hv}, st_ab[2] = {2 * c->hv, 1}, s_h[1] = {c->hv};
  const int64_t s_cu[1] = {B + 1};
  upf_dbuf_view(o, 0, "o", 3, s_o, NULL, 0);
  upf_dbuf_view(so, 0, "state_out", 4, s_s, NULL, 0);
  /* q and k inside a padded (T, 2 Hk Dk + 3) row: strides that are not the packed ones. */
  upf_dbuf_view(qk, 0, "q", 3, s_q, st_q, 0);
  upf_dbuf_view(qk, 1, "k", 3, s_q, st_q, nk);
  upf_dbuf_view(vb, 0, "v", 3, s_o, NULL, 0);
  upf_dbuf_view(ab, 0, "a", 2, s_ab, st_ab, 0);
  upf_dbuf_view(ab, 1, "b", 2, s_ab, st_ab, c->hv);
  upf_dbuf_view(al, 0, "a_log", 1, s_h, NULL, 0);
  upf_dbuf_view(dtb, 0, "dt_bias", 1, s_h, NULL, 0);
  upf_dbuf_view(dtb, 1, "state_in", 4, s_s, NULL, c->hv);
  upf_dbuf_view(cub, 0, "cu_seqlens", 1, s_cu, NULL, 0);
  upf_dbuf_fill_poison(o);
  upf_dbuf_fill_poison(so);
  upf_dbuf_fill_normal(qk, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(vb, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(dtb, &rng, 0.0f, 0.5f); /* states; dt_bias overwritten below */
  for (int64_t h = 0; h < c->hv; h++) {
    upf_dbuf_set(al, h, upf_rng_uniform(&rng) * 3.0f - 1.0f);
    upf_dbuf_set(dtb, h, upf_rng_uniform(&rng) * 4.0f - 2.0f);
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < c->hv; h++) {
      float a, b;
      draw_gate(&rng, upf_dbuf_get(al, h), upf_dbuf_get(dtb, h), &a, &b);
      upf_dbuf_set(ab, t * 2 * c->hv + h, a);
      upf_dbuf_set(ab, t * 2 * c->hv + c->hv + h, b);
    }
  for (int64_t r = 0; r <= B; r++)
    ((int32_t *)cub->host)[r] = cu[r];
  gdn_ctx g = {cu, c->num_reqs, c->hk, c->hv, c->dk, c->dv, c->with_state, 0, 1.0f / sqrtf((float)c->dk), {0}};
  upf_check proto;
  upf_dense_check_init(&proto, op, c->name, dt, "B=%d T=%lld Hk=%lld Hv=%lld Dk=%lld Dv=%lld%s", c->num_reqs,
                       (long long)T, (long long)c->hk, (long long)c->hv, (long long)c->dk, (long long)c->dv,
                       c->with_state ? " +state" : "");
  upf_dcase_verify(ctx, &dc, scan_fn, scan_truth, &g, &proto);
  upf_dcase_free(&dc);
}

/* Conv buffers: y, state_out, x, w, state_in, cu. */
static upf_status conv_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const gdn_ctx *g = ctx;
  upf_gdn_batch batch = {(const int32_t *)v[5][0].data, g->cu_host, g->num_reqs};
  return be->gdn_conv(&batch, &v[2][0], &v[3][0], g->with_state ? &v[4][0] : NULL, &v[1][0], &v[0][0]);
}

static void conv_run(upf_verify_ctx *ctx, int index, upf_dtype dt) {
  const gdn_case *c = &gdn_cases[index];
  const char *op = "gdn.conv";
  int32_t cu[9] = {0};
  for (int32_t r = 0; r < c->num_reqs; r++)
    cu[r + 1] = cu[r] + c->lens[r];
  int64_t T = cu[c->num_reqs], B = c->num_reqs, C = 2 * c->hk * c->dk + c->hv * c->dv, K = 4;
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)dt));
  upf_dbuf *y = upf_dcase_add(&dc, "y", dt, T * C, 1);
  upf_dbuf *so = y ? upf_dcase_add(&dc, "state_out", UPF_DTYPE_F32, B * (K - 1) * C, 1) : NULL;
  /* x is the conv slice of the in_proj output (T, C + Hv Dv): the z columns follow it. */
  upf_dbuf *x = so ? upf_dcase_add(&dc, "mixed_qkvz", dt, T * (C + c->hv * c->dv), 0) : NULL;
  upf_dbuf *w = x ? upf_dcase_add(&dc, "w", dt, C * K, 0) : NULL;
  upf_dbuf *si = w ? upf_dcase_add(&dc, "state_in", UPF_DTYPE_F32, B * (K - 1) * C, 0) : NULL;
  upf_dbuf *cub = si ? upf_dcase_add(&dc, "cu_seqlens", UPF_DTYPE_I32, B + 1, 0) : NULL;
  if (!cub) {
    record_status(ctx, op, c->name, "setup", UPF_ERR_NOMEM);
    upf_dcase_free(&dc);
    return;
  }
  const int64_t s_y[2] = {T, C}, s_s[3] = {B, K - 1, C}, st_x[2] = {C + c->hv * c->dv, 1}, s_w[2] = {C, K};
  const int64_t s_cu[1] = {B + 1};
  upf_dbuf_view(y, 0, "y", 2, s_y, NULL, 0);
  upf_dbuf_view(so, 0, "state_out", 3, s_s, NULL, 0);
  upf_dbuf_view(x, 0, "x", 2, s_y, st_x, 0);
  upf_dbuf_view(w, 0, "w", 2, s_w, NULL, 0);
  upf_dbuf_view(si, 0, "state_in", 3, s_s, NULL, 0);
  upf_dbuf_view(cub, 0, "cu_seqlens", 1, s_cu, NULL, 0);
  upf_dbuf_fill_poison(y);
  upf_dbuf_fill_poison(so);
  upf_dbuf_fill_normal(x, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(w, &rng, 0.0f, 0.5f);
  upf_dbuf_fill_normal(si, &rng, 0.0f, 1.0f);
  if (dt == UPF_DTYPE_BF16) /* states hold past inputs: values the input dtype can hold */
    for (int64_t i = 0; i < si->numel; i++)
      upf_dbuf_set(si, i, upf_round_bf16((float)upf_dbuf_get(si, i)));
  for (int64_t r = 0; r <= B; r++)
    ((int32_t *)cub->host)[r] = cu[r];
  gdn_ctx g = {cu, c->num_reqs, c->hk, c->hv, c->dk, c->dv, c->with_state, (int)K, 0.0f, {0}};
  upf_check proto;
  upf_dense_check_init(&proto, op, c->name, dt, "B=%d T=%lld C=%lld K=%lld%s", c->num_reqs, (long long)T,
                       (long long)C, (long long)K, c->with_state ? " +state" : "");
  upf_dcase_verify(ctx, &dc, conv_fn, NULL, &g, &proto);
  upf_dcase_free(&dc);
}

/* Conv-step buffers: y, state (in/out), x, w. The expected state is the reference's. */
static upf_status step_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->gdn_conv_step(&v[2][0], &v[3][0], &v[1][0], &v[0][0]);
}

static void step_run(upf_verify_ctx *ctx, int index, upf_dtype dt) {
  const gdn_case *c = &gdn_cases[index];
  const char *op = "gdn.conv_step";
  int64_t B = c->num_reqs, C = 2 * c->hk * c->dk + c->hv * c->dv, K = 4;
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)dt));
  upf_dbuf *y = upf_dcase_add(&dc, "y", dt, B * C, 1);
  upf_dbuf *s = y ? upf_dcase_add(&dc, "state", UPF_DTYPE_F32, B * (K - 1) * C, 1) : NULL;
  upf_dbuf *x = s ? upf_dcase_add(&dc, "x", dt, B * C, 0) : NULL;
  upf_dbuf *w = x ? upf_dcase_add(&dc, "w", dt, C * K, 0) : NULL;
  if (!w) {
    record_status(ctx, op, c->name, "setup", UPF_ERR_NOMEM);
    upf_dcase_free(&dc);
    return;
  }
  const int64_t s_y[2] = {B, C}, s_s[3] = {B, K - 1, C}, s_w[2] = {C, K};
  upf_dbuf_view(y, 0, "y", 2, s_y, NULL, 0);
  upf_dbuf_view(s, 0, "state", 3, s_s, NULL, 0);
  upf_dbuf_view(x, 0, "x", 2, s_y, NULL, 0);
  upf_dbuf_view(w, 0, "w", 2, s_w, NULL, 0);
  upf_dbuf_fill_poison(y);
  upf_dbuf_fill_normal(s, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(x, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(w, &rng, 0.0f, 0.5f);
  upf_check proto;
  upf_dense_check_init(&proto, op, c->name, dt, "B=%lld C=%lld K=%lld", (long long)B, (long long)C, (long long)K);
  upf_dcase_verify(ctx, &dc, step_fn, NULL, NULL, &proto);
  upf_dcase_free(&dc);
}

/* Gated-norm buffers: y, o, z (a view inside the (T, C + Hv Dv) in_proj output), w. */
typedef struct {
  upf_norm_params p;
  int inplace;
} gnorm_ctx;

static upf_status gnorm_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const gnorm_ctx *g = ctx;
  if (g->inplace)
    return be->gdn_gated_norm(&v[0][0], &v[1][0], &v[2][0], &g->p, &v[0][0]);
  return be->gdn_gated_norm(&v[1][0], &v[2][0], &v[3][0], &g->p, &v[0][0]);
}

static void gnorm_run(upf_verify_ctx *ctx, int index, upf_dtype dt, int inplace) {
  const gdn_case *c = &gdn_cases[index];
  const char *op = "gdn.gated_norm";
  int64_t T = 0, H = c->hv, D = c->dv, zrow = 2 * c->hk * c->dk + 2 * H * D;
  for (int32_t r = 0; r < c->num_reqs; r++)
    T += c->lens[r];
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index + 100 * inplace, (uint64_t)dt));
  upf_dbuf *y = upf_dcase_add(&dc, inplace ? "o (in place)" : "y", dt, T * H * D, 1);
  upf_dbuf *o = y && !inplace ? upf_dcase_add(&dc, "o", dt, T * H * D, 0) : y;
  upf_dbuf *z = o ? upf_dcase_add(&dc, "mixed_qkvz", dt, T * zrow, 0) : NULL;
  upf_dbuf *w = z ? upf_dcase_add(&dc, "w", dt, D, 0) : NULL;
  if (!w) {
    record_status(ctx, op, c->name, "setup", UPF_ERR_NOMEM);
    upf_dcase_free(&dc);
    return;
  }
  const int64_t s3[3] = {T, H, D}, stz[3] = {zrow, D, 1}, sw[1] = {D};
  upf_dbuf_view(y, 0, y->name, 3, s3, NULL, 0);
  if (!inplace) {
    upf_dbuf_view(o, 0, "o", 3, s3, NULL, 0);
    upf_dbuf_fill_poison(y);
  }
  upf_dbuf_fill_normal(o, &rng, 0.0f, 0.3f);
  upf_dbuf_view(z, 0, "z", 3, s3, stz, zrow - H * D);
  upf_dbuf_view(w, 0, "w", 1, sw, NULL, 0);
  upf_dbuf_fill_normal(z, &rng, 0.0f, 2.0f);
  upf_dbuf_fill_normal(w, &rng, 1.0f, 0.1f);
  gnorm_ctx g = {{UPF_QWEN3N_80B_LINEAR_NORM_EPS, 0}, inplace};
  upf_check proto;
  upf_dense_check_init(&proto, op, c->name, dt, "T=%lld H=%lld D=%lld%s", (long long)T, (long long)H, (long long)D,
                       inplace ? " in place" : "");
  upf_dcase_verify(ctx, &dc, gnorm_fn, NULL, &g, &proto);
  upf_dcase_free(&dc);
}

#define NUM_CASES ((int)(sizeof gdn_cases / sizeof gdn_cases[0]))

void upf_verify_gdn_conv(upf_verify_ctx *ctx) {
  golden_conv(ctx);
  errors_for(ctx, UPF_OP_GDN_CONV);
  for (int i = 0; i < NUM_CASES; i++)
    if (upf_verify_case_wanted(ctx, gdn_cases[i].name, gdn_cases[i].flags & GC_QUICK))
      for (int d = 0; d < NUM_DTYPES; d++)
        conv_run(ctx, i, both_dtypes[d]);
}

void upf_verify_gdn_conv_step(upf_verify_ctx *ctx) {
  golden_conv_step(ctx);
  errors_for(ctx, UPF_OP_GDN_CONV_STEP);
  for (int i = 0; i < NUM_CASES; i++)
    if (upf_verify_case_wanted(ctx, gdn_cases[i].name, gdn_cases[i].flags & GC_QUICK) && gdn_cases[i].num_reqs > 1)
      for (int d = 0; d < NUM_DTYPES; d++)
        step_run(ctx, i, both_dtypes[d]);
}

void upf_verify_gdn_scan(upf_verify_ctx *ctx) {
  golden_scan(ctx);
  errors_for(ctx, UPF_OP_GDN_SCAN);
  boundary_check(ctx, 1);
  boundary_check(ctx, 0);
  scan_boundary_bf16(ctx, 1);
  scan_boundary_bf16(ctx, 0);
  for (int i = 0; i < NUM_CASES; i++)
    if (upf_verify_case_wanted(ctx, gdn_cases[i].name, gdn_cases[i].flags & GC_QUICK))
      for (int d = 0; d < NUM_DTYPES; d++)
        scan_run(ctx, i, both_dtypes[d]);
}

void upf_verify_gdn_gated_norm(upf_verify_ctx *ctx) {
  golden_gated_norm(ctx);
  errors_for(ctx, UPF_OP_GDN_GATED_NORM);
  for (int i = 0; i < NUM_CASES; i++)
    if (upf_verify_case_wanted(ctx, gdn_cases[i].name, gdn_cases[i].flags & GC_QUICK))
      for (int d = 0; d < NUM_DTYPES; d++)
        for (int inplace = 0; inplace < 2; inplace++)
          gnorm_run(ctx, i, both_dtypes[d], inplace);
}

/* Verify cases of the dense ops. On every backend: hand-computed golden cases and bad inputs that
 * must come back as their status. For the CPU reference itself: its invariants (GEMM against the
 * fp64 truth, the FFN against its own GEMM/activation/GEMM chain, the fused norm against add then
 * norm, the per-head norm against the row norm, RoPE's relative-position property, the logits
 * against gather/norm/GEMM). For a backend under test: seeded cases over ragged token counts
 * (1, 17, 577, 4096, 32K), f32 and bf16, model shapes (Llama-3.1-8B, Gemma-3-12B, Qwen3-Next) and
 * odd ones, strided views into fused buffers, positions with gaps, compared with the CPU reference
 * through the dense harness (verify/harness.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/ffn.h"
#include "ref_cpu/gemm.h"
#include "ref_cpu/logits.h"
#include "ref_cpu/norm.h"
#include "ref_cpu/rope.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model_config.h"
#include "verify/harness.h"
#include "verify/verify.h"

enum { DC_QUICK = 1 }; /* in the quick set (valgrind, CI, the GPU test suite) */

static const upf_dtype both_dtypes[] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};
#define NUM_DTYPES 2

static void record_setup_failure(upf_verify_ctx *ctx, const char *op, const char *variant, upf_dtype dt) {
  upf_check check;
  upf_dense_check_init(&check, op, variant, dt, "-");
  check.passed = 0;
  snprintf(check.detail, sizeof check.detail, "setup: %.200s", upf_last_error());
  upf_verify_record(ctx, &check);
}

/* ================================================================================================ */
/* Golden cases: tiny inputs, outputs worked out by hand (values exactly representable in bf16).    */

typedef struct {
  const upf_backend *be;
  void *ptr[12];
  int n;
} gmem;

/* A backend tensor of `vals` (NULL: poisoned output) in dtype. */
static upf_status g_tensor(gmem *m, upf_dtype dt, int ndim, const int64_t *shape, const float *vals, upf_tensor *t) {
  UPF_TRY(upf_tensor_init(t, NULL, dt, ndim, shape));
  int64_t n = upf_tensor_numel(t);
  size_t bytes = (size_t)n * upf_dtype_size(dt);
  UPF_TRY(m->be->alloc(&m->ptr[m->n], bytes));
  t->data = m->ptr[m->n++];
  if (!vals)
    return m->be->fill(t->data, 0xFF, bytes);
  void *host = malloc(bytes ? bytes : 1);
  if (!host)
    return upf_fail(UPF_ERR_NOMEM, "golden: host staging");
  if (dt == UPF_DTYPE_BF16)
    upf_bf16_from_f32_array(host, vals, n);
  else
    memcpy(host, vals, bytes);
  upf_status st = m->be->upload(t->data, host, bytes);
  free(host);
  return st;
}

static upf_status g_ints(gmem *m, const int32_t *vals, int64_t n, int32_t **dev) {
  UPF_TRY(m->be->alloc(&m->ptr[m->n], (size_t)n * sizeof(int32_t)));
  *dev = m->ptr[m->n++];
  return m->be->upload(*dev, vals, (size_t)n * sizeof(int32_t));
}

static upf_status g_fetch(const gmem *m, const upf_tensor *t, float *out) {
  int64_t n = upf_tensor_numel(t);
  size_t bytes = (size_t)n * upf_dtype_size(t->dtype);
  UPF_TRY(m->be->synchronize());
  if (t->dtype == UPF_DTYPE_F32)
    return m->be->download(out, t->data, bytes);
  uint16_t *tmp = malloc(bytes ? bytes : 1);
  if (!tmp)
    return upf_fail(UPF_ERR_NOMEM, "golden: host staging");
  upf_status st = m->be->download(tmp, t->data, bytes);
  if (st == UPF_OK)
    upf_bf16_to_f32_array(out, tmp, n);
  free(tmp);
  return st;
}

static void g_free(gmem *m) {
  for (int i = 0; i < m->n; i++)
    m->be->release(m->ptr[i]);
  m->n = 0;
}

/* Records the comparison of got (n) with the expected values, or the failing status. */
static void g_record(upf_verify_ctx *ctx, const char *op, const char *variant, upf_dtype dt, upf_status st,
                     const float *got, const double *want, int64_t n) {
  upf_check check;
  char name[64];
  snprintf(name, sizeof name, "golden: %s", variant);
  upf_dense_check_init(&check, op, name, dt, "hand-computed, n=%lld", (long long)n);
  if (st != UPF_OK) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  } else {
    upf_compare_f32(got, want, n, upf_tolerance_for(dt), &check);
  }
  upf_verify_record(ctx, &check);
}

static void golden_gemm(upf_verify_ctx *ctx, upf_dtype dt, upf_dtype out_dt) {
  gmem m = {.be = ctx->backend};
  const float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
  const double want[4] = {4, 5, 10, 11};
  const int64_t sa[2] = {2, 3}, sb[2] = {3, 2}, sc[2] = {2, 2};
  upf_tensor ta, tb, tc;
  float got[4];
  upf_status st = g_tensor(&m, dt, 2, sa, a, &ta);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, sb, b, &tb);
  if (st == UPF_OK)
    st = g_tensor(&m, out_dt, 2, sc, NULL, &tc);
  if (st == UPF_OK)
    st = ctx->backend->gemm(&ta, &tb, &tc);
  if (st == UPF_OK)
    st = g_fetch(&m, &tc, got);
  g_record(ctx, "gemm", out_dt == dt ? "2x3 . 3x2" : "2x3 . 3x2 -> f32", dt, st, got, want, 4);
  g_free(&m);
}

static void golden_act_mul(upf_verify_ctx *ctx, upf_dtype dt, upf_act act) {
  gmem m = {.be = ctx->backend};
  /* gate | up */
  const float gu[8] = {0, 1, -1, 2, 1, 2, 3, 0.5f};
  static const double want_silu[4] = {0.0, 1.4621171572600098, -0.8068242641099853, 0.8807970779778823};
  static const double want_gelu[4] = {0.0, 1.6823839812165535, -0.4764240281751697, 0.9772988470438875};
  const int64_t s_in[2] = {1, 8}, s_out[2] = {1, 4};
  upf_tensor tin, tout;
  float got[4];
  upf_status st = g_tensor(&m, dt, 2, s_in, gu, &tin);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, s_out, NULL, &tout);
  if (st == UPF_OK)
    st = ctx->backend->ffn_act_mul(&tin, act, &tout);
  if (st == UPF_OK)
    st = g_fetch(&m, &tout, got);
  g_record(ctx, "ffn.act_mul", upf_act_name(act), dt, st, got, act == UPF_ACT_SILU ? want_silu : want_gelu, 4);
  g_free(&m);
}

static void golden_ffn(upf_verify_ctx *ctx, upf_dtype dt) {
  gmem m = {.be = ctx->backend};
  /* H=2, I=1: gate = x.[1,0] = 1, up = x.[1,1] = 3, h = silu(1)*3, y = h*[1, -2]. */
  const float x[2] = {1, 2}, wgu[4] = {1, 1, 0, 1}, wd[2] = {1, -2};
  static const double want[2] = {2.193175735890015, -4.38635147178003};
  const int64_t sx[2] = {1, 2}, sgu[2] = {2, 2}, sd[2] = {1, 2};
  upf_tensor tx, tgu, td, ty;
  float got[2];
  upf_status st = g_tensor(&m, dt, 2, sx, x, &tx);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, sgu, wgu, &tgu);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, sd, wd, &td);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, sx, NULL, &ty);
  if (st == UPF_OK)
    st = ctx->backend->ffn_gated(&tx, &tgu, &td, UPF_ACT_SILU, &ty);
  if (st == UPF_OK)
    st = g_fetch(&m, &ty, got);
  /* h is stored in the input dtype: bf16(2.1932) = 2.1875 scales the bf16 expectation. */
  double w2[2] = {want[0], want[1]};
  if (dt == UPF_DTYPE_BF16)
    w2[0] = upf_round_bf16(2.193175735890015f), w2[1] = -2.0 * w2[0];
  g_record(ctx, "ffn.gated", "H=2 I=1 swiglu", dt, st, got, w2, 2);
  g_free(&m);
}

/* rms of [3, 4] with eps 1e-6 is sqrt(12.5 + 1e-6); gains [1, 2] as w (plain) or 1 + w (zero-centred). */
static const double golden_norm_want[2] = {0.8485281034827336, 2.2627416092872896};

static void golden_rms(upf_verify_ctx *ctx, upf_dtype dt) {
  const double *want = golden_norm_want;
  for (int zc = 0; zc < 2; zc++) {
    gmem m = {.be = ctx->backend};
    const float x[2] = {3, 4}, w[2] = {zc ? 0.0f : 1.0f, zc ? 1.0f : 2.0f};
    const int64_t sx[2] = {1, 2}, sw[1] = {2};
    upf_norm_params p = {1e-6f, zc};
    upf_tensor tx, tw, ty;
    float got[2];
    upf_status st = g_tensor(&m, dt, 2, sx, x, &tx);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 1, sw, w, &tw);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 2, sx, NULL, &ty);
    if (st == UPF_OK)
      st = ctx->backend->rmsnorm(&tx, &tw, &p, &ty);
    if (st == UPF_OK)
      st = g_fetch(&m, &ty, got);
    g_record(ctx, "norm.rms", zc ? "[3,4] zero-centred w=[0,1]" : "[3,4] w=[1,2]", dt, st, got, want, 2);
    g_free(&m);
  }
}

static void golden_rms_add(upf_verify_ctx *ctx, upf_dtype dt) {
  const double *want = golden_norm_want;
  { /* residual [2,3] + x [1,1] = [3,4]: the new residual, then the same norm */
    gmem m = {.be = ctx->backend};
    const float x[2] = {1, 1}, r[2] = {2, 3}, w[2] = {1, 2};
    const int64_t sx[2] = {1, 2}, sw[1] = {2};
    upf_norm_params p = {1e-6f, 0};
    upf_tensor tx, tr, tw, ty;
    float got[4];
    upf_status st = g_tensor(&m, dt, 2, sx, x, &tx);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 2, sx, r, &tr);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 1, sw, w, &tw);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 2, sx, NULL, &ty);
    if (st == UPF_OK)
      st = ctx->backend->rmsnorm_add(&tx, &tr, &tw, &p, &ty);
    if (st == UPF_OK)
      st = g_fetch(&m, &ty, got);
    if (st == UPF_OK)
      st = g_fetch(&m, &tr, got + 2);
    const double want4[4] = {want[0], want[1], 3, 4};
    g_record(ctx, "norm.rms_add", "[1,1]+[2,3] w=[1,2]", dt, st, got, want4, 4);
    g_free(&m);
  }
}

static void golden_qk(upf_verify_ctx *ctx, upf_dtype dt) {
  const double *want = golden_norm_want;
  { /* two heads [3,4] and [0,5], w = [1, 1] */
    gmem m = {.be = ctx->backend};
    const float x[4] = {3, 4, 0, 5}, w[2] = {1, 1};
    const int64_t sx[3] = {1, 2, 2}, sw[1] = {2};
    upf_norm_params p = {1e-6f, 0};
    upf_tensor tx, tw, ty;
    float got[4];
    upf_status st = g_tensor(&m, dt, 3, sx, x, &tx);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 1, sw, w, &tw);
    if (st == UPF_OK)
      st = g_tensor(&m, dt, 3, sx, NULL, &ty);
    if (st == UPF_OK)
      st = ctx->backend->qk_norm(&tx, &tw, &p, &ty);
    if (st == UPF_OK)
      st = g_fetch(&m, &ty, got);
    const double want4[4] = {want[0], 1.1313708046436448, 0.0, 1.414213505804556};
    g_record(ctx, "norm.qk", "heads [3,4] [0,5]", dt, st, got, want4, 4);
    g_free(&m);
  }
}

/* D = 4, theta = 10^4: inv_freq = [1, 0.01]. Token 0 at position 1, token 1 at position 0. */
static void golden_rope(upf_verify_ctx *ctx, upf_dtype dt) {
  gmem m = {.be = ctx->backend};
  const float q[8] = {1, 2, 3, 4, 1, 2, 3, 4};
  const int32_t pos[2] = {1, 0};
  static const double want[8] = {-1.9841106485555495, 1.959900667496664, 2.4623779024123156, 4.019799668334994,
                                 1, 2, 3, 4};
  const int64_t sq[3] = {2, 1, 4};
  upf_rope_params p = {10000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0, 0, 0};
  upf_tensor tq;
  int32_t *dpos = NULL;
  float got[8];
  upf_status st = g_tensor(&m, dt, 3, sq, q, &tq);
  if (st == UPF_OK)
    st = g_ints(&m, pos, 2, &dpos);
  if (st == UPF_OK)
    st = ctx->backend->rope(&tq, NULL, dpos, &p);
  if (st == UPF_OK)
    st = g_fetch(&m, &tq, got);
  g_record(ctx, "rope", "D=4 positions 1, 0", dt, st, got, want, 8);
  g_free(&m);
}

static void golden_gated_output(upf_verify_ctx *ctx, upf_dtype dt) {
  gmem m = {.be = ctx->backend};
  /* sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4 */
  const float o[4] = {2, -1, 8, 0}, g[4] = {0, (float)log(3.0), (float)-log(3.0), 5};
  const int64_t s[3] = {1, 2, 2};
  upf_tensor to, tg, ty;
  float got[4];
  upf_status st = g_tensor(&m, dt, 3, s, o, &to);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 3, s, g, &tg);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 3, s, NULL, &ty);
  if (st == UPF_OK)
    st = ctx->backend->gated_output(&to, &tg, &ty);
  if (st == UPF_OK)
    st = g_fetch(&m, &ty, got);
  /* ln 3 rounded to the dtype moves sigmoid a little: take it from the stored gate */
  double l3 = dt == UPF_DTYPE_BF16 ? upf_round_bf16((float)log(3.0)) : (double)(float)log(3.0);
  const double want[4] = {1.0, -1.0 / (1.0 + exp(-l3)), 8.0 / (1.0 + exp(l3)), 0.0};
  g_record(ctx, "attn.gated_output", "sigmoid 0, +-ln 3", dt, st, got, want, 4);
  g_free(&m);
}

static void golden_embed(upf_verify_ctx *ctx, upf_dtype dt) {
  gmem m = {.be = ctx->backend};
  const float table[6] = {1, 2, 3, 4, 5, 6};
  const int32_t ids[3] = {2, 0, 2};
  static const double want[6] = {10, 12, 2, 4, 10, 12};
  const int64_t st_[2] = {3, 2}, sy[2] = {3, 2};
  upf_tensor tt, ty;
  int32_t *dids = NULL;
  float got[6];
  upf_status st = g_tensor(&m, dt, 2, st_, table, &tt);
  if (st == UPF_OK)
    st = g_ints(&m, ids, 3, &dids);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, sy, NULL, &ty);
  if (st == UPF_OK)
    st = ctx->backend->embed(dids, 3, &tt, 2.0f, &ty);
  if (st == UPF_OK)
    st = g_fetch(&m, &ty, got);
  g_record(ctx, "embed", "ids [2,0,2] scale 2", dt, st, got, want, 6);
  g_free(&m);
}

static void golden_logits(upf_verify_ctx *ctx, upf_dtype dt) {
  gmem m = {.be = ctx->backend};
  /* Two requests of 2 and 1 tokens: last rows [3,4] and [0,5]; norm w = [1,1]; w_lm = [[1,0,1],[0,1,1]]. */
  const float hidden[6] = {9, 9, 3, 4, 0, 5}, nw[2] = {1, 1}, wlm[6] = {1, 0, 1, 0, 1, 1};
  const int32_t cu[3] = {0, 2, 3};
  const double a = 0.8485281034827336, b = 1.1313708046436448, c = 1.414213505804556;
  /* The normalised rows are stored in the hidden dtype before the LM head. */
  double ra = ref_round_to(dt, a), rb = ref_round_to(dt, b), rc = ref_round_to(dt, c);
  const double want[6] = {ra, rb, ra + rb, 0, rc, rc};
  const int64_t sh[2] = {3, 2}, sw[1] = {2}, sl[2] = {2, 3}, sout[2] = {2, 3};
  upf_norm_params p = {1e-6f, 0};
  upf_tensor th, tw, tl, to;
  float got[6];
  upf_status st = g_tensor(&m, dt, 2, sh, hidden, &th);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 1, sw, nw, &tw);
  if (st == UPF_OK)
    st = g_tensor(&m, dt, 2, sl, wlm, &tl);
  if (st == UPF_OK)
    st = g_tensor(&m, UPF_DTYPE_F32, 2, sout, NULL, &to);
  if (st == UPF_OK)
    st = ctx->backend->logits_last(&th, cu, 2, &tw, &p, &tl, &to);
  if (st == UPF_OK)
    st = g_fetch(&m, &to, got);
  g_record(ctx, "logits.last", "B=2 last rows", dt, st, got, want, 6);
  g_free(&m);
}

/* ================================================================================================ */
/* Bad inputs: each must come back as its status on the backend under test.                         */

/* A small f32 backend buffer to hang descriptors on (contents irrelevant: checks fail first). */
static void errors_for(upf_verify_ctx *ctx, upf_op op) {
  const upf_backend *be = ctx->backend;
  void *buf = NULL;
  if (be->alloc(&buf, 4096 * sizeof(float)) != UPF_OK) {
    record_setup_failure(ctx, upf_op_name(op), "errors", UPF_DTYPE_F32);
    return;
  }
  be->fill(buf, 0, 4096 * sizeof(float));
  const char *name = upf_op_name(op);
  upf_tensor a, b, c, d;
  const int64_t s4x8[2] = {4, 8}, s8x6[2] = {8, 6}, s4x6[2] = {4, 6}, s7x6[2] = {7, 6}, s8[1] = {8};
  const int64_t s3[3] = {4, 2, 8}, s8x12[2] = {8, 12}, s12x8[2] = {12, 8}, s4x12[2] = {4, 12};
  upf_norm_params np = {1e-5f, 0};
  upf_rope_params rp = upf_llama31_8b_rope();
  switch (op) {
  case UPF_OP_GEMM:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, s4x8), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 2, s7x6);
    upf_tensor_init(&c, buf, UPF_DTYPE_F32, 2, s4x6);
    upf_verify_expect_status(ctx, name, "K of a != rows of b", be->gemm(&a, &b, &c), UPF_ERR_SHAPE);
    upf_tensor_init(&b, buf, UPF_DTYPE_BF16, 2, s8x6);
    upf_verify_expect_status(ctx, name, "a f32, b bf16", be->gemm(&a, &b, &c), UPF_ERR_DTYPE);
    upf_tensor_init(&b, buf, UPF_DTYPE_F32, 2, s8x6), upf_tensor_init(&c, buf, UPF_DTYPE_BF16, 2, s4x6);
    upf_verify_expect_status(ctx, name, "f32 inputs, bf16 output", be->gemm(&a, &b, &c), UPF_ERR_DTYPE);
    upf_tensor_init(&c, buf, UPF_DTYPE_F32, 2, s4x6), a.stride[1] = 2;
    upf_verify_expect_status(ctx, name, "a last dim strided", be->gemm(&a, &b, &c), UPF_ERR_SHAPE);
    break;
  case UPF_OP_FFN_ACT_MUL:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, s4x8), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 2, s4x6);
    upf_verify_expect_status(ctx, name, "h not (T, I)", be->ffn_act_mul(&a, UPF_ACT_SILU, &b), UPF_ERR_SHAPE);
    upf_verify_expect_status(ctx, name, "unknown activation", be->ffn_act_mul(&a, UPF_ACT_COUNT, &b), UPF_ERR_INVALID_ARG);
    break;
  case UPF_OP_FFN_GATED:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, s4x8), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 2, s8x12);
    upf_tensor_init(&c, buf, UPF_DTYPE_F32, 2, s12x8), upf_tensor_init(&d, buf, UPF_DTYPE_F32, 2, s4x8);
    upf_verify_expect_status(ctx, name, "w_down (2I, H) instead of (I, H)", be->ffn_gated(&a, &b, &c, UPF_ACT_SILU, &d),
                  UPF_ERR_SHAPE);
    upf_tensor_init(&c, buf, UPF_DTYPE_BF16, 2, (const int64_t[2]){6, 8});
    upf_verify_expect_status(ctx, name, "w_down bf16, x f32", be->ffn_gated(&a, &b, &c, UPF_ACT_SILU, &d), UPF_ERR_DTYPE);
    break;
  case UPF_OP_RMSNORM:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, s4x8), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 1, s8);
    upf_tensor_init(&c, buf, UPF_DTYPE_F32, 2, s4x6);
    upf_verify_expect_status(ctx, name, "y shape differs from x", be->rmsnorm(&a, &b, &np, &c), UPF_ERR_SHAPE);
    np.eps = 0.0f;
    upf_verify_expect_status(ctx, name, "eps = 0", be->rmsnorm(&a, &b, &np, &a), UPF_ERR_INVALID_ARG);
    break;
  case UPF_OP_RMSNORM_ADD:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, s4x8), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 1, s8);
    upf_tensor_init(&c, buf, UPF_DTYPE_BF16, 2, s4x8);
    upf_verify_expect_status(ctx, name, "residual bf16, x f32", be->rmsnorm_add(&a, &c, &b, &np, &a), UPF_ERR_DTYPE);
    upf_tensor_init(&c, buf, UPF_DTYPE_F32, 2, s4x12);
    upf_verify_expect_status(ctx, name, "residual (T, N') N' != N", be->rmsnorm_add(&a, &c, &b, &np, &a), UPF_ERR_SHAPE);
    break;
  case UPF_OP_QK_NORM:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 3, s3), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 1, (const int64_t[1]){6});
    upf_verify_expect_status(ctx, name, "w (D') D' != D", be->qk_norm(&a, &b, &np, &a), UPF_ERR_SHAPE);
    break;
  case UPF_OP_ROPE:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 3, s3);
    upf_tensor_init(&b, buf, UPF_DTYPE_F32, 3, (const int64_t[3]){4, 1, 6});
    upf_verify_expect_status(ctx, name, "k head dim != q head dim", be->rope(&a, &b, (const int32_t *)buf, &rp), UPF_ERR_SHAPE);
    rp.rotary_dim = 7;
    upf_verify_expect_status(ctx, name, "rotary_dim odd", be->rope(&a, NULL, (const int32_t *)buf, &rp), UPF_ERR_INVALID_ARG);
    rp.rotary_dim = 0, rp.low_freq_factor = 5.0;
    upf_verify_expect_status(ctx, name, "llama3 low >= high freq factor", be->rope(&a, NULL, (const int32_t *)buf, &rp),
                  UPF_ERR_INVALID_ARG);
    break;
  case UPF_OP_GATED_OUTPUT:
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 3, s3), upf_tensor_init(&b, buf, UPF_DTYPE_BF16, 3, s3);
    upf_verify_expect_status(ctx, name, "gate bf16, o f32", be->gated_output(&a, &b, &a), UPF_ERR_DTYPE);
    break;
  case UPF_OP_EMBED: {
    int32_t ids[3] = {0, 5, 1}, *dids = (int32_t *)((float *)buf + 2048);
    be->upload(dids, ids, sizeof ids);
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, (const int64_t[2]){5, 8});
    upf_tensor_init(&b, (float *)buf + 64, UPF_DTYPE_F32, 2, (const int64_t[2]){3, 8});
    upf_verify_expect_status(ctx, name, "id 5 outside [0, 5)", be->embed(dids, 3, &a, 1.0f, &b), UPF_ERR_INVALID_ARG);
    if (strstr(upf_last_error(), "ids[1]=5") == NULL)
      upf_verify_expect_status(ctx, name, "message names ids[1]=5", UPF_ERR_INVALID_ARG, UPF_OK);
    break;
  }
  case UPF_OP_LOGITS_LAST: {
    const int32_t cu_empty[3] = {0, 4, 4}, cu_bad[3] = {0, 3, 2};
    upf_tensor_init(&a, buf, UPF_DTYPE_F32, 2, s4x8), upf_tensor_init(&b, buf, UPF_DTYPE_F32, 1, s8);
    upf_tensor_init(&c, buf, UPF_DTYPE_F32, 2, s8x6);
    upf_tensor_init(&d, buf, UPF_DTYPE_F32, 2, (const int64_t[2]){2, 6});
    upf_verify_expect_status(ctx, name, "request with no tokens", be->logits_last(&a, cu_empty, 2, &b, &np, &c, &d),
                  UPF_ERR_CU_SEQLENS);
    upf_verify_expect_status(ctx, name, "cu_seqlens not monotone", be->logits_last(&a, cu_bad, 2, &b, &np, &c, &d),
                  UPF_ERR_CU_SEQLENS);
    break;
  }
  default:
    break;
  }
  be->release(buf);
}

/* ================================================================================================ */
/* Seeded cases against the CPU reference (backend under test only).                               */

/* Every op's seeded cases are a table of shapes and parameters; one runner, dense_cases, walks a
 * table: for each case in the run's set and each (input, output) dtype pair it seeds the inputs
 * (upf_verify_case_seed of the op, the case index and the dtypes), lets the op's build function lay
 * out the buffers, and verifies through the harness. */

/* The head of every case: its name (the check's variant column) and whether it is in the quick set. */
typedef struct {
  const char *name;
  unsigned flags;
} dense_head;

/* Parameters of an op call that a case derives rather than holds. */
typedef enum { NORM_RMS, NORM_RMS_ADD, NORM_QK } norm_kind;

typedef struct {
  norm_kind kind;
  upf_norm_params p;
  int inplace;
} norm_ctx;

typedef struct {
  upf_rope_params p;
  int no_k;
} rope_ctx;

typedef struct {
  int32_t cu[7];
  int32_t num_reqs;
  upf_norm_params p;
} logits_ctx;

/* What a build hands the runner: the op call, its fp64 truth where a reduction is long (else NULL),
 * the call's parameters (in the table or in `own`) and the check's shape column. */
typedef struct {
  upf_dcase_fn fn;
  upf_dcase_truth_fn truth;
  const void *params;
  union {
    norm_ctx norm;
    rope_ctx rope;
    logits_ctx logits;
    float scale;
  } own;
  char shape[96];
} dense_run;

/* Lays out case `c` for input dtype `in` (output `out`) in dc, filling from rng in a fixed order. */
typedef upf_status (*dense_build_fn)(const void *c, upf_dtype in, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                                     dense_run *run);

typedef struct {
  const char *op;
  const void *cases; /* an array of case structs, each opening with a dense_head */
  size_t size;       /* of one case */
  int count;
  const upf_dtype (*dtypes)[2]; /* the (input, output) pairs every case runs with */
  int ndtypes;
  int seed_out;                 /* the seed's variant number is in + 4 * out (else in) */
  int (*runs_in)(const void *c, upf_dtype in); /* NULL: every pair */
  dense_build_fn build;
} dense_kind;

#define DENSE_CASES(table) (table), sizeof(table)[0], (int)(sizeof(table) / sizeof(table)[0])
#define DENSE_DTYPES(pairs) (pairs), (int)(sizeof(pairs) / sizeof(pairs)[0])

static const upf_dtype same_dtypes[][2] = {{UPF_DTYPE_F32, UPF_DTYPE_F32}, {UPF_DTYPE_BF16, UPF_DTYPE_BF16}};

static void dense_cases(upf_verify_ctx *ctx, const dense_kind *k) {
  for (int i = 0; i < k->count; i++) {
    const void *c = (const char *)k->cases + (size_t)i * k->size;
    const dense_head *head = c;
    if (!upf_verify_case_wanted(ctx, head->name, head->flags & DC_QUICK))
      continue;
    for (int d = 0; d < k->ndtypes; d++) {
      upf_dtype in = k->dtypes[d][0], out = k->dtypes[d][1];
      if (k->runs_in && !k->runs_in(c, in))
        continue;
      upf_dcase dc;
      upf_dcase_init(&dc, in);
      upf_rng rng;
      upf_rng_seed(&rng, upf_verify_case_seed(k->op, i, (uint64_t)(k->seed_out ? in + 4 * out : in)));
      dense_run run;
      memset(&run, 0, sizeof run);
      if (k->build(c, in, out, &rng, &dc, &run) != UPF_OK) {
        record_setup_failure(ctx, k->op, head->name, in);
      } else {
        upf_check proto;
        char variant[64];
        snprintf(variant, sizeof variant, "%s%s%s", head->name, out != in ? " -> " : "",
                 out != in ? upf_dtype_name(out) : "");
        upf_dense_check_init(&proto, k->op, variant, in, "%s", run.shape);
        upf_dcase_verify(ctx, &dc, run.fn, run.truth, run.params, &proto);
      }
      upf_dcase_free(&dc);
    }
  }
}

/* ---- GEMM ---- */

typedef struct {
  dense_head head;
  int64_t T, K, N;
  int64_t pad_a, pad_c; /* a and c as views into wider parents (row stride K+pad, column offset pad/2) */
} gemm_case;

static const gemm_case gemm_cases[] = {
    {{"llama qkv_proj", DC_QUICK}, 1, 4096, 6144, 0, 0},
    {{"llama qkv_proj", 0}, 17, 4096, 6144, 0, 0},
    {{"llama qkv_proj", 0}, 577, 4096, 6144, 0, 0},
    {{"llama o_proj", 0}, 4096, 4096, 4096, 0, 0},
    {{"llama gate_up_proj", 0}, 577, 4096, 28672, 0, 0},
    {{"llama down_proj", 0}, 577, 14336, 4096, 0, 0},
    {{"llama down_proj", 0}, 4096, 14336, 4096, 0, 0},
    {{"gemma gate_up_proj", 0}, 17, 3840, 30720, 0, 0},
    {{"qwen3-next o_proj", 0}, 577, 4096, 2048, 0, 0},
    {{"ragged T=32K, small dims", 0}, 32768, 512, 768, 0, 0},
    {{"odd, strided a and c", DC_QUICK}, 33, 100, 72, 28, 24},
    {{"decode row, odd", DC_QUICK}, 1, 17, 5, 0, 3},
};

static upf_status gemm_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->gemm(&v[0][0], &v[1][0], &v[2][0]);
}

static upf_status gemm_truth(upf_dviews v, const void *ctx, double *truth) {
  return ref_gemm_f64(&v[0][0], &v[1][0], truth);
}

static upf_status gemm_build(const void *cv, upf_dtype in, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                             dense_run *run) {
  const gemm_case *c = cv;
  int64_t wa = c->K + c->pad_a, wc = c->N + c->pad_c;
  upf_dbuf *a = upf_dcase_add(dc, "a", in, c->T * wa, 0);
  upf_dbuf *b = a ? upf_dcase_add(dc, "b", in, c->K * c->N, 0) : NULL;
  upf_dbuf *cc = b ? upf_dcase_add(dc, "c", out, c->T * wc, 1) : NULL;
  if (!cc)
    return upf_fail(UPF_ERR_NOMEM, "gemm case buffers");
  const int64_t sa[2] = {c->T, c->K}, ss_a[2] = {wa, 1}, sb[2] = {c->K, c->N}, sc[2] = {c->T, c->N}, ss_c[2] = {wc, 1};
  upf_dbuf_view(a, 0, "a", 2, sa, ss_a, c->pad_a / 2);
  upf_dbuf_view(b, 0, "b", 2, sb, NULL, 0);
  upf_dbuf_view(cc, 0, "c", 2, sc, ss_c, c->pad_c / 2);
  upf_dbuf_fill_normal(a, rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(b, rng, 0.0f, 1.0f / sqrtf((float)c->K)); /* outputs of unit scale, as trained weights give */
  upf_dbuf_fill_normal(cc, rng, 0.0f, 1.0f); /* the padding must come back untouched */
  for (int64_t t = 0; t < c->T; t++)
    for (int64_t j = 0; j < c->N; j++) /* poison what the op must write */
      upf_dbuf_set(cc, t * wc + c->pad_c / 2 + j, NAN);
  run->fn = gemm_fn;
  run->truth = c->K >= 4096 ? gemm_truth : NULL;
  snprintf(run->shape, sizeof run->shape, "M=%lld K=%lld N=%lld", (long long)c->T, (long long)c->K, (long long)c->N);
  return UPF_OK;
}

static const upf_dtype gemm_dtypes[][2] = {
    {UPF_DTYPE_F32, UPF_DTYPE_F32}, {UPF_DTYPE_BF16, UPF_DTYPE_BF16}, {UPF_DTYPE_BF16, UPF_DTYPE_F32}};

static const dense_kind gemm_kind = {"gemm", DENSE_CASES(gemm_cases), DENSE_DTYPES(gemm_dtypes), 1, NULL, gemm_build};

void upf_verify_gemm(upf_verify_ctx *ctx) {
  golden_gemm(ctx, UPF_DTYPE_F32, UPF_DTYPE_F32);
  golden_gemm(ctx, UPF_DTYPE_BF16, UPF_DTYPE_BF16);
  golden_gemm(ctx, UPF_DTYPE_BF16, UPF_DTYPE_F32);
  errors_for(ctx, UPF_OP_GEMM);
  if (upf_verify_on_reference(ctx)) { /* the reference against the fp64 truth: short reductions meet the plain fp32 rule */
    for (int d = 0; d < NUM_DTYPES; d++) {
      upf_dtype dt = both_dtypes[d];
      upf_rng rng;
      upf_rng_seed(&rng, 404 + d);
      const int64_t sa[2] = {17, 300}, sb[2] = {300, 40}, sc[2] = {17, 40};
      upf_tensor a, b, c;
      upf_check check;
      upf_dense_check_init(&check, "gemm", "cpu vs fp64 dgemm truth", dt, "M=17 K=300 N=40");
      double *truth = malloc(17 * 40 * sizeof *truth);
      float *got = malloc(17 * 40 * sizeof *got);
      upf_status st = upf_tensor_alloc(&a, dt, 2, sa);
      if (st == UPF_OK)
        st = upf_tensor_alloc(&b, dt, 2, sb);
      if (st == UPF_OK)
        st = upf_tensor_alloc(&c, UPF_DTYPE_F32, 2, sc);
      if (st == UPF_OK && truth && got) {
        for (int64_t i = 0; i < 17 * 300; i++)
          ref_put(&a, i, upf_rng_normal(&rng));
        for (int64_t i = 0; i < 300 * 40; i++)
          ref_put(&b, i, upf_rng_normal(&rng) / sqrt(300.0));
        st = cpu_gemm(&a, &b, &c);
        if (st == UPF_OK)
          st = ref_gemm_f64(&a, &b, truth);
        if (st == UPF_OK)
          upf_compare_f32(c.data, truth, 17 * 40, upf_tolerance_for(UPF_DTYPE_F32), &check);
      }
      if (st != UPF_OK) {
        check.passed = 0;
        snprintf(check.detail, sizeof check.detail, "%.200s", upf_last_error());
      }
      upf_verify_record(ctx, &check);
      free(truth), free(got);
      upf_tensor_free(&a), upf_tensor_free(&b), upf_tensor_free(&c);
    }
    return;
  }
  dense_cases(ctx, &gemm_kind);
}

/* ---- activation-and-multiply ---- */

typedef struct {
  dense_head head;
  int64_t T, inter;
  upf_act act;
  float std;   /* of gate and up */
  int64_t pad; /* gate_up and h as views into wider parents */
} act_case;

static const act_case act_cases[] = {
    {{"llama swiglu", DC_QUICK}, 1, 14336, UPF_ACT_SILU, 2.5f, 0},
    {{"llama swiglu", DC_QUICK}, 17, 14336, UPF_ACT_SILU, 2.5f, 0},
    {{"llama swiglu", 0}, 577, 14336, UPF_ACT_SILU, 2.5f, 0},
    {{"llama swiglu", 0}, 4096, 14336, UPF_ACT_SILU, 2.5f, 0},
    {{"gemma geglu", DC_QUICK}, 17, 15360, UPF_ACT_GELU_TANH, 2.5f, 0},
    {{"gemma geglu", 0}, 577, 15360, UPF_ACT_GELU_TANH, 2.5f, 0},
    {{"gemma geglu", 0}, 4096, 15360, UPF_ACT_GELU_TANH, 2.5f, 0},
    {{"ragged T=32K swiglu", 0}, 32768, 1024, UPF_ACT_SILU, 2.5f, 0},
    {{"ragged T=32K geglu", 0}, 32768, 1024, UPF_ACT_GELU_TANH, 2.5f, 0},
    {{"wide range (exp overflow) swiglu", DC_QUICK}, 577, 512, UPF_ACT_SILU, 40.0f, 0},
    {{"wide range geglu", DC_QUICK}, 577, 512, UPF_ACT_GELU_TANH, 40.0f, 0},
    {{"odd I=20, strided", DC_QUICK}, 17, 20, UPF_ACT_SILU, 2.5f, 6},
    {{"odd I=20, strided", DC_QUICK}, 17, 20, UPF_ACT_GELU_TANH, 2.5f, 6},
};

static upf_status act_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->ffn_act_mul(&v[0][0], *(const upf_act *)ctx, &v[1][0]);
}

static upf_status act_build(const void *cv, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                            dense_run *run) {
  const act_case *c = cv;
  int64_t win = 2 * c->inter + c->pad, wout = c->inter + c->pad;
  upf_dbuf *gu = upf_dcase_add(dc, "gate_up", dt, c->T * win, 0);
  upf_dbuf *h = gu ? upf_dcase_add(dc, "h", dt, c->T * wout, 1) : NULL;
  if (!h)
    return upf_fail(UPF_ERR_NOMEM, "ffn.act_mul case buffers");
  const int64_t sin_[2] = {c->T, 2 * c->inter}, ssin[2] = {win, 1}, sout[2] = {c->T, c->inter}, ssout[2] = {wout, 1};
  upf_dbuf_view(gu, 0, "gate_up", 2, sin_, ssin, c->pad);
  upf_dbuf_view(h, 0, "h", 2, sout, ssout, c->pad / 2);
  upf_dbuf_fill_normal(gu, rng, 0.0f, c->std);
  upf_dbuf_fill_normal(h, rng, 0.0f, 1.0f);
  for (int64_t t = 0; t < c->T; t++)
    for (int64_t i = 0; i < c->inter; i++)
      upf_dbuf_set(h, t * wout + c->pad / 2 + i, NAN);
  run->fn = act_fn;
  run->params = &c->act;
  snprintf(run->shape, sizeof run->shape, "T=%lld I=%lld", (long long)c->T, (long long)c->inter);
  return UPF_OK;
}

static const dense_kind act_kind = {"ffn.act_mul", DENSE_CASES(act_cases), DENSE_DTYPES(same_dtypes), 0, NULL,
                                    act_build};

void upf_verify_ffn_act_mul(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++) {
    golden_act_mul(ctx, both_dtypes[d], UPF_ACT_SILU);
    golden_act_mul(ctx, both_dtypes[d], UPF_ACT_GELU_TANH);
  }
  errors_for(ctx, UPF_OP_FFN_ACT_MUL);
  dense_cases(ctx, &act_kind);
}

/* ---- the gated FFN ---- */

typedef struct {
  dense_head head;
  int64_t T, H, inter;
  upf_act act;
  int out_f32; /* bf16 inputs, f32 output */
  int64_t pad; /* x and y as views into wider parents */
} ffn_case;

static const ffn_case ffn_cases[] = {
    {{"llama swiglu", 0}, 1, 4096, 14336, UPF_ACT_SILU, 0, 0},
    {{"llama swiglu", 0}, 17, 4096, 14336, UPF_ACT_SILU, 0, 0},
    {{"llama swiglu", 0}, 577, 4096, 14336, UPF_ACT_SILU, 0, 0},
    {{"llama swiglu", 0}, 4096, 4096, 14336, UPF_ACT_SILU, 0, 0},
    {{"llama swiglu -> f32", 0}, 577, 4096, 14336, UPF_ACT_SILU, 1, 0},
    {{"gemma geglu", 0}, 17, 3840, 15360, UPF_ACT_GELU_TANH, 0, 0},
    {{"gemma geglu", 0}, 577, 3840, 15360, UPF_ACT_GELU_TANH, 0, 0},
    {{"ragged T=32K swiglu, small dims", 0}, 32768, 256, 512, UPF_ACT_SILU, 0, 0},
    {{"ragged T=32K geglu, small dims", 0}, 32768, 256, 512, UPF_ACT_GELU_TANH, 0, 0},
    {{"small swiglu", DC_QUICK}, 17, 512, 1024, UPF_ACT_SILU, 0, 0},
    {{"small geglu -> f32", DC_QUICK}, 33, 256, 512, UPF_ACT_GELU_TANH, 1, 0},
    {{"odd H=24 I=20, strided x y", DC_QUICK}, 5, 24, 20, UPF_ACT_SILU, 0, 8},
    {{"odd H=24 I=20, strided x y", DC_QUICK}, 5, 24, 20, UPF_ACT_GELU_TANH, 0, 8},
};

static upf_status ffn_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->ffn_gated(&v[1][0], &v[2][0], &v[3][0], *(const upf_act *)ctx, &v[0][0]);
}

static upf_status ffn_truth(upf_dviews v, const void *ctx, double *truth) {
  return ref_ffn_f64(&v[1][0], &v[2][0], &v[3][0], *(const upf_act *)ctx, truth);
}

static upf_status ffn_build(const void *cv, upf_dtype dt, upf_dtype out_pair, upf_rng *rng, upf_dcase *dc,
                            dense_run *run) {
  const ffn_case *c = cv;
  upf_dtype out = c->out_f32 ? UPF_DTYPE_F32 : dt;
  int64_t w = c->H + c->pad;
  upf_dbuf *y = upf_dcase_add(dc, "y", out, c->T * w, 1);
  upf_dbuf *x = y ? upf_dcase_add(dc, "x", dt, c->T * w, 0) : NULL;
  upf_dbuf *wgu = x ? upf_dcase_add(dc, "w_gate_up", dt, c->H * 2 * c->inter, 0) : NULL;
  upf_dbuf *wd = wgu ? upf_dcase_add(dc, "w_down", dt, c->inter * c->H, 0) : NULL;
  if (!wd)
    return upf_fail(UPF_ERR_NOMEM, "ffn.gated case buffers");
  const int64_t sx[2] = {c->T, c->H}, ssx[2] = {w, 1}, sgu[2] = {c->H, 2 * c->inter}, sd[2] = {c->inter, c->H};
  upf_dbuf_view(y, 0, "y", 2, sx, ssx, c->pad / 2);
  upf_dbuf_view(x, 0, "x", 2, sx, ssx, c->pad / 2);
  upf_dbuf_view(wgu, 0, "w_gate_up", 2, sgu, NULL, 0);
  upf_dbuf_view(wd, 0, "w_down", 2, sd, NULL, 0);
  upf_dbuf_fill_normal(x, rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(wgu, rng, 0.0f, 1.0f / sqrtf((float)c->H));
  upf_dbuf_fill_normal(wd, rng, 0.0f, 1.0f / sqrtf((float)c->inter));
  upf_dbuf_fill_normal(y, rng, 0.0f, 1.0f);
  for (int64_t t = 0; t < c->T; t++)
    for (int64_t i = 0; i < c->H; i++)
      upf_dbuf_set(y, t * w + c->pad / 2 + i, NAN);
  run->fn = ffn_fn;
  run->truth = c->H >= 4096 || c->inter >= 4096 ? ffn_truth : NULL;
  run->params = &c->act;
  snprintf(run->shape, sizeof run->shape, "T=%lld H=%lld I=%lld %s", (long long)c->T, (long long)c->H,
           (long long)c->inter, upf_act_name(c->act));
  return UPF_OK;
}

/* A case with an f32 output takes bf16 inputs only. */
static int ffn_runs_in(const void *cv, upf_dtype in) {
  const ffn_case *c = cv;
  return !c->out_f32 || in == UPF_DTYPE_BF16;
}

static const upf_dtype ffn_dtypes[][2] = {{UPF_DTYPE_BF16, UPF_DTYPE_BF16}, {UPF_DTYPE_F32, UPF_DTYPE_F32}};

static const dense_kind ffn_kind = {"ffn.gated", DENSE_CASES(ffn_cases), DENSE_DTYPES(ffn_dtypes), 0, ffn_runs_in,
                                    ffn_build};

/* The reference's FFN equals its own gemm -> act_mul -> gemm chain. */
static void ffn_chain_invariant(upf_verify_ctx *ctx, upf_dtype dt) {
  const int64_t T = 9, H = 40, I = 24;
  upf_check check;
  upf_dense_check_init(&check, "ffn.gated", "cpu: equals gemm + act_mul + gemm", dt, "T=9 H=40 I=24");
  upf_tensor x, wgu, wd, y, gu, h, y2;
  const int64_t sx[2] = {T, H}, sgu[2] = {H, 2 * I}, sd[2] = {I, H}, sg[2] = {T, 2 * I}, sh[2] = {T, I};
  upf_rng rng;
  upf_rng_seed(&rng, 77 + dt);
  memset(&x, 0, sizeof x), memset(&wgu, 0, sizeof wgu), memset(&wd, 0, sizeof wd), memset(&y, 0, sizeof y);
  memset(&gu, 0, sizeof gu), memset(&h, 0, sizeof h), memset(&y2, 0, sizeof y2);
  upf_status st = upf_tensor_alloc(&x, dt, 2, sx);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&wgu, dt, 2, sgu);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&wd, dt, 2, sd);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&y, UPF_DTYPE_F32, 2, sx);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&y2, UPF_DTYPE_F32, 2, sx);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&gu, dt, 2, sg);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&h, dt, 2, sh);
  if (st == UPF_OK) {
    for (int64_t i = 0; i < T * H; i++)
      ref_put(&x, i, upf_rng_normal(&rng));
    for (int64_t i = 0; i < H * 2 * I; i++)
      ref_put(&wgu, i, upf_rng_normal(&rng) / sqrt((double)H));
    for (int64_t i = 0; i < I * H; i++)
      ref_put(&wd, i, upf_rng_normal(&rng) / sqrt((double)I));
    st = cpu_ffn_gated(&x, &wgu, &wd, UPF_ACT_SILU, &y);
  }
  if (st == UPF_OK)
    st = cpu_gemm(&x, &wgu, &gu);
  if (st == UPF_OK)
    st = cpu_ffn_act_mul(&gu, UPF_ACT_SILU, &h);
  if (st == UPF_OK)
    st = cpu_gemm(&h, &wd, &y2);
  if (st == UPF_OK) {
    double *ref = malloc((size_t)(T * H) * sizeof *ref);
    for (int64_t i = 0; ref && i < T * H; i++)
      ref[i] = ((float *)y2.data)[i];
    if (ref)
      upf_compare_f32(y.data, ref, T * H, upf_tolerance_for(UPF_DTYPE_F32), &check);
    else
      st = upf_fail(UPF_ERR_NOMEM, "verify");
    free(ref);
  }
  if (st != UPF_OK) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%.200s", upf_last_error());
  }
  upf_verify_record(ctx, &check);
  upf_tensor_free(&x), upf_tensor_free(&wgu), upf_tensor_free(&wd), upf_tensor_free(&y);
  upf_tensor_free(&y2), upf_tensor_free(&gu), upf_tensor_free(&h);
}

void upf_verify_ffn_gated(upf_verify_ctx *ctx) {
  golden_ffn(ctx, UPF_DTYPE_F32);
  golden_ffn(ctx, UPF_DTYPE_BF16);
  errors_for(ctx, UPF_OP_FFN_GATED);
  if (upf_verify_on_reference(ctx)) {
    ffn_chain_invariant(ctx, UPF_DTYPE_F32);
    ffn_chain_invariant(ctx, UPF_DTYPE_BF16);
    return;
  }
  dense_cases(ctx, &ffn_kind);
}

/* ---- norms ---- */

typedef struct {
  dense_head head;
  int64_t T, N;   /* rows and the normalised extent (QK: N = D) */
  int64_t Hq, Hkv; /* QK: heads of q and k inside a fused qkv row with Hkv more heads of v */
  int zero_centred;
  float eps;
  float x_std;
  int64_t pad;    /* x as a view into a wider parent (RMS, RMS_ADD) */
  int inplace;    /* y = x */
} norm_case;

static const norm_case rms_cases[] = {
    {{"llama", DC_QUICK}, 1, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1.0f, 0, 0},
    {{"llama", DC_QUICK}, 17, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1.0f, 0, 0},
    {{"llama", DC_QUICK}, 577, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1.0f, 0, 0},
    {{"llama", 0}, 4096, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1.0f, 0, 0},
    {{"llama", 0}, 32768, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1.0f, 0, 0},
    {{"llama in place", DC_QUICK}, 577, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1.0f, 0, 1},
    {{"gemma zero-centred", DC_QUICK}, 17, 3840, 0, 0, 1, UPF_GEMMA3_12B_RMS_EPS, 1.0f, 0, 0},
    {{"gemma zero-centred", 0}, 4096, 3840, 0, 0, 1, UPF_GEMMA3_12B_RMS_EPS, 1.0f, 0, 0},
    {{"qwen3-next zero-centred", 0}, 577, 2048, 0, 0, 1, UPF_QWEN3N_80B_RMS_EPS, 1.0f, 0, 0},
    {{"qwen3-next zero-centred", 0}, 32768, 2048, 0, 0, 1, UPF_QWEN3N_80B_RMS_EPS, 1.0f, 0, 0},
    {{"tiny rows (eps matters)", DC_QUICK}, 577, 4096, 0, 0, 0, UPF_LLAMA31_8B_RMS_EPS, 1e-3f, 0, 0},
    {{"odd N=100, strided", DC_QUICK}, 17, 100, 0, 0, 1, 1e-6f, 1.0f, 12, 0},
};

static const norm_case qk_cases[] = {
    {{"gemma q/k", DC_QUICK}, 1, 256, 16, 8, 1, UPF_GEMMA3_12B_RMS_EPS, 1.0f, 0, 1},
    {{"gemma q/k", DC_QUICK}, 17, 256, 16, 8, 1, UPF_GEMMA3_12B_RMS_EPS, 1.0f, 0, 1},
    {{"gemma q/k", 0}, 577, 256, 16, 8, 1, UPF_GEMMA3_12B_RMS_EPS, 1.0f, 0, 1},
    {{"gemma q/k", 0}, 4096, 256, 16, 8, 1, UPF_GEMMA3_12B_RMS_EPS, 1.0f, 0, 1},
    {{"qwen3-next q/k", DC_QUICK}, 577, 256, 16, 2, 1, UPF_QWEN3N_80B_RMS_EPS, 1.0f, 0, 1},
    {{"qwen3-next q/k", 0}, 32768, 256, 16, 2, 1, UPF_QWEN3N_80B_RMS_EPS, 1.0f, 0, 1},
    {{"D=128 plain, out of place", 0}, 577, 128, 32, 8, 0, 1e-5f, 1.0f, 0, 0},
    {{"odd D=40, out of place", DC_QUICK}, 17, 40, 3, 1, 0, 1e-6f, 1.0f, 0, 0},
};

/* Buffers: RMS: x, w, [y]; RMS_ADD: x, residual, w, [y]; QK: qkv (q and k views), wq, wk, [y (q, k)]. */
static upf_status norm_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const norm_ctx *nc = ctx;
  switch (nc->kind) {
  case NORM_RMS:
    return be->rmsnorm(&v[0][0], &v[1][0], &nc->p, nc->inplace ? &v[0][0] : &v[2][0]);
  case NORM_RMS_ADD:
    return be->rmsnorm_add(&v[0][0], &v[1][0], &v[2][0], &nc->p, nc->inplace ? &v[0][0] : &v[3][0]);
  default:
    UPF_TRY(be->qk_norm(&v[0][0], &v[1][0], &nc->p, nc->inplace ? &v[0][0] : &v[3][0]));
    return be->qk_norm(&v[0][1], &v[2][0], &nc->p, nc->inplace ? &v[0][1] : &v[3][1]);
  }
}

static upf_status norm_build(const norm_case *c, norm_kind kind, upf_dtype dt, upf_rng *rng, upf_dcase *dc,
                             dense_run *run) {
  run->own.norm = (norm_ctx){kind, {c->eps, c->zero_centred}, c->inplace};
  upf_dbuf *bufs[6] = {0};
  int ok = 1;
  float w_mean = c->zero_centred ? 0.0f : 1.0f;
  if (kind == NORM_QK) {
    int64_t D = c->N, W = (c->Hq + 2 * c->Hkv) * D;
    const int64_t sq[3] = {c->T, c->Hq, D}, sk[3] = {c->T, c->Hkv, D}, ss[3] = {W, D, 1}, sw[1] = {D};
    ok = (bufs[0] = upf_dcase_add(dc, "qkv", dt, c->T * W, c->inplace)) &&
         (bufs[1] = upf_dcase_add(dc, "q_norm.w", dt, D, 0)) && (bufs[2] = upf_dcase_add(dc, "k_norm.w", dt, D, 0));
    if (ok && !c->inplace)
      ok = (bufs[3] = upf_dcase_add(dc, "y", dt, c->T * W, 1)) != NULL;
    if (ok) {
      for (int b = 0; b < (c->inplace ? 1 : 2); b++) {
        upf_dbuf *t = bufs[b == 0 ? 0 : 3];
        upf_dbuf_view(t, 0, "q", 3, sq, ss, 0);
        upf_dbuf_view(t, 1, "k", 3, sk, ss, c->Hq * D);
      }
      upf_dbuf_view(bufs[1], 0, "q_norm.w", 1, sw, NULL, 0);
      upf_dbuf_view(bufs[2], 0, "k_norm.w", 1, sw, NULL, 0);
      upf_dbuf_fill_normal(bufs[0], rng, 0.0f, c->x_std);
      upf_dbuf_fill_normal(bufs[1], rng, w_mean, 0.1f);
      upf_dbuf_fill_normal(bufs[2], rng, w_mean, 0.1f);
      if (bufs[3])
        upf_dbuf_fill_normal(bufs[3], rng, 0.0f, 1.0f);
    }
  } else {
    int64_t W = c->N + c->pad;
    const int64_t sx[2] = {c->T, c->N}, ss[2] = {W, 1}, sw[1] = {c->N};
    int add = kind == NORM_RMS_ADD;
    int ix = 0;
    ok = (bufs[ix++] = upf_dcase_add(dc, "x", dt, c->T * W, c->inplace)) != NULL;
    if (ok && add)
      ok = (bufs[ix++] = upf_dcase_add(dc, "residual", dt, c->T * W, 1)) != NULL;
    if (ok)
      ok = (bufs[ix++] = upf_dcase_add(dc, "w", dt, c->N, 0)) != NULL;
    if (ok && !c->inplace)
      ok = (bufs[ix++] = upf_dcase_add(dc, "y", dt, c->T * W, 1)) != NULL;
    if (ok) {
      for (int b = 0; b < ix; b++) {
        int is_w = !strcmp(bufs[b]->name, "w");
        if (is_w)
          upf_dbuf_view(bufs[b], 0, "w", 1, sw, NULL, 0);
        else
          upf_dbuf_view(bufs[b], 0, bufs[b]->name, 2, sx, ss, c->pad / 2);
        upf_dbuf_fill_normal(bufs[b], rng, is_w ? w_mean : 0.0f, is_w ? 0.1f : c->x_std);
      }
    }
  }
  if (!ok)
    return upf_fail(UPF_ERR_NOMEM, "norm case buffers");
  run->fn = norm_fn;
  run->params = &run->own.norm;
  if (kind == NORM_QK)
    snprintf(run->shape, sizeof run->shape, "T=%lld Hq=%lld Hkv=%lld D=%lld", (long long)c->T, (long long)c->Hq,
             (long long)c->Hkv, (long long)c->N);
  else
    snprintf(run->shape, sizeof run->shape, "T=%lld N=%lld", (long long)c->T, (long long)c->N);
  return UPF_OK;
}

static upf_status rms_build(const void *c, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc, dense_run *run) {
  return norm_build(c, NORM_RMS, dt, rng, dc, run);
}

static upf_status rms_add_build(const void *c, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                                dense_run *run) {
  return norm_build(c, NORM_RMS_ADD, dt, rng, dc, run);
}

static upf_status qk_build(const void *c, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc, dense_run *run) {
  return norm_build(c, NORM_QK, dt, rng, dc, run);
}

/* norm.rms and norm.rms_add run the same table. */
static const dense_kind rms_kind = {"norm.rms", DENSE_CASES(rms_cases), DENSE_DTYPES(same_dtypes), 0, NULL, rms_build};
static const dense_kind rms_add_kind = {"norm.rms_add", DENSE_CASES(rms_cases), DENSE_DTYPES(same_dtypes), 0, NULL,
                                        rms_add_build};
static const dense_kind qk_kind = {"norm.qk", DENSE_CASES(qk_cases), DENSE_DTYPES(same_dtypes), 0, NULL, qk_build};

/* norm.rms_add equals an add (rounded to the dtype) followed by norm.rms, bit for bit. */
static void rms_add_invariant(upf_verify_ctx *ctx, upf_dtype dt) {
  const int64_t T = 5, N = 64, s[2] = {T, N}, sw[1] = {N};
  upf_check check;
  upf_dense_check_init(&check, "norm.rms_add", "cpu: equals add then norm.rms", dt, "T=5 N=64");
  upf_tensor x, r, w, y, sum, y2;
  upf_norm_params p = {1e-6f, 1};
  upf_rng rng;
  upf_rng_seed(&rng, 909 + dt);
  upf_status st = upf_tensor_alloc(&x, dt, 2, s);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&r, dt, 2, s);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&w, dt, 1, sw);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&y, dt, 2, s);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&sum, dt, 2, s);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&y2, dt, 2, s);
  if (st == UPF_OK) {
    for (int64_t i = 0; i < T * N; i++) {
      ref_put(&x, i, upf_rng_normal(&rng));
      ref_put(&r, i, 3.0f * upf_rng_normal(&rng));
      ref_put(&sum, i, (double)ref_get(&x, i) + (double)ref_get(&r, i));
    }
    for (int64_t i = 0; i < N; i++)
      ref_put(&w, i, 0.1f * upf_rng_normal(&rng));
    st = cpu_rmsnorm_add(&x, &r, &w, &p, &y);
  }
  if (st == UPF_OK)
    st = cpu_rmsnorm(&sum, &w, &p, &y2);
  if (st == UPF_OK) {
    size_t bytes = (size_t)(T * N) * upf_dtype_size(dt);
    upf_compare_exact(y.data, y2.data, T * N, upf_dtype_size(dt), &check);
    if (check.passed && memcmp(r.data, sum.data, bytes) != 0) {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "the updated residual differs from round(x + residual)");
    }
  } else {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%.200s", upf_last_error());
  }
  upf_verify_record(ctx, &check);
  upf_tensor_free(&x), upf_tensor_free(&r), upf_tensor_free(&w), upf_tensor_free(&y), upf_tensor_free(&sum),
      upf_tensor_free(&y2);
}

/* norm.qk on a strided (T, H, D) view equals norm.rms over its (T*H, D) rows. */
static void qk_invariant(upf_verify_ctx *ctx, upf_dtype dt) {
  const int64_t T = 4, H = 3, D = 32, W = 5 * D;
  upf_check check;
  upf_dense_check_init(&check, "norm.qk", "cpu: equals norm.rms per head", dt, "T=4 H=3 D=32 in a (4, 160) row");
  upf_tensor parent, rows, w, y, y2;
  const int64_t sp[2] = {T, W}, sr[2] = {T * H, D}, sw[1] = {D}, s3[3] = {T, H, D};
  upf_norm_params p = {1e-6f, 0};
  upf_rng rng;
  upf_rng_seed(&rng, 313 + dt);
  upf_status st = upf_tensor_alloc(&parent, dt, 2, sp);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&rows, dt, 2, sr);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&w, dt, 1, sw);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&y, dt, 3, s3);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&y2, dt, 2, sr);
  if (st == UPF_OK) {
    for (int64_t i = 0; i < T * W; i++)
      ref_put(&parent, i, upf_rng_normal(&rng));
    for (int64_t i = 0; i < D; i++)
      ref_put(&w, i, 1.0 + 0.1 * upf_rng_normal(&rng));
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) /* heads start one head in: (T, H, D) at offset D */
          ref_put(&rows, (t * H + h) * D + d, ref_get(&parent, t * W + D + h * D + d));
    upf_tensor view = parent;
    view.ndim = 3, view.shape[0] = T, view.shape[1] = H, view.shape[2] = D;
    view.stride[0] = W, view.stride[1] = D, view.stride[2] = 1;
    view.data = (char *)parent.data + D * upf_dtype_size(dt);
    st = cpu_qk_norm(&view, &w, &p, &y);
  }
  if (st == UPF_OK)
    st = cpu_rmsnorm(&rows, &w, &p, &y2);
  if (st == UPF_OK) {
    upf_compare_exact(y.data, y2.data, T * H * D, upf_dtype_size(dt), &check);
  } else {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%.200s", upf_last_error());
  }
  upf_verify_record(ctx, &check);
  upf_tensor_free(&parent), upf_tensor_free(&rows), upf_tensor_free(&w), upf_tensor_free(&y), upf_tensor_free(&y2);
}

void upf_verify_rmsnorm(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++)
    golden_rms(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_RMSNORM);
  dense_cases(ctx, &rms_kind);
}

void upf_verify_rmsnorm_add(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++)
    golden_rms_add(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_RMSNORM_ADD);
  if (upf_verify_on_reference(ctx)) {
    rms_add_invariant(ctx, UPF_DTYPE_F32);
    rms_add_invariant(ctx, UPF_DTYPE_BF16);
  }
  dense_cases(ctx, &rms_add_kind);
}

void upf_verify_qk_norm(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++)
    golden_qk(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_QK_NORM);
  if (upf_verify_on_reference(ctx)) {
    qk_invariant(ctx, UPF_DTYPE_F32);
    qk_invariant(ctx, UPF_DTYPE_BF16);
  }
  dense_cases(ctx, &qk_kind);
}

/* ---- RoPE ---- */

typedef enum { ROPE_LLAMA, ROPE_GEMMA_LOCAL, ROPE_GEMMA_GLOBAL, ROPE_QWEN, ROPE_ODD, ROPE_ODD_PARTIAL } rope_family;

typedef struct {
  dense_head head;
  int64_t T;
  rope_family fam;
  int no_k;
} rope_case;

static const rope_case rope_cases[] = {
    {{"llama3 scaling, decode row", DC_QUICK}, 1, ROPE_LLAMA, 0},
    {{"llama3 scaling", DC_QUICK}, 17, ROPE_LLAMA, 0},
    {{"llama3 scaling", DC_QUICK}, 577, ROPE_LLAMA, 0},
    {{"llama3 scaling", 0}, 4096, ROPE_LLAMA, 0},
    {{"llama3 scaling", 0}, 32768, ROPE_LLAMA, 0},
    {{"llama3 scaling, q only", DC_QUICK}, 577, ROPE_LLAMA, 1},
    {{"gemma local base 1e4", DC_QUICK}, 17, ROPE_GEMMA_LOCAL, 0},
    {{"gemma local base 1e4", 0}, 4096, ROPE_GEMMA_LOCAL, 0},
    {{"gemma global 1e6 linear x8", DC_QUICK}, 17, ROPE_GEMMA_GLOBAL, 0},
    {{"gemma global 1e6 linear x8", 0}, 4096, ROPE_GEMMA_GLOBAL, 0},
    {{"gemma global 1e6 linear x8", 0}, 32768, ROPE_GEMMA_GLOBAL, 0},
    {{"qwen3-next partial 64/256", DC_QUICK}, 17, ROPE_QWEN, 0},
    {{"qwen3-next partial 64/256", 0}, 577, ROPE_QWEN, 0},
    {{"qwen3-next partial 64/256", 0}, 32768, ROPE_QWEN, 0},
    {{"odd D=40", DC_QUICK}, 17, ROPE_ODD, 0},
    {{"odd D=40 partial 24", DC_QUICK}, 17, ROPE_ODD_PARTIAL, 0},
};

static void rope_family_shape(rope_family f, int64_t *hq, int64_t *hkv, int64_t *d, upf_rope_params *p) {
  switch (f) {
  case ROPE_LLAMA:
    *hq = UPF_LLAMA31_8B_Q_HEADS, *hkv = UPF_LLAMA31_8B_KV_HEADS, *d = UPF_LLAMA31_8B_HEAD_DIM;
    *p = upf_llama31_8b_rope();
    break;
  case ROPE_GEMMA_LOCAL:
  case ROPE_GEMMA_GLOBAL:
    *hq = UPF_GEMMA3_12B_Q_HEADS, *hkv = UPF_GEMMA3_12B_KV_HEADS, *d = UPF_GEMMA3_12B_HEAD_DIM;
    *p = f == ROPE_GEMMA_LOCAL ? upf_gemma3_12b_rope_local() : upf_gemma3_12b_rope_global();
    break;
  case ROPE_QWEN:
    *hq = UPF_QWEN3N_80B_Q_HEADS, *hkv = UPF_QWEN3N_80B_KV_HEADS, *d = UPF_QWEN3N_80B_HEAD_DIM;
    *p = upf_qwen3n_80b_rope();
    break;
  default:
    *hq = 3, *hkv = 1, *d = 40;
    *p = (upf_rope_params){10000.0, f == ROPE_ODD_PARTIAL ? 24 : 0, UPF_ROPE_DEFAULT, 1.0, 0, 0, 0};
    break;
  }
}

/* Positions as a ragged batch looks after a drop: requests of random length, each counting from 0
 * (or, for some, from a cached prefix of up to 120K), with gaps where tokens were dropped; a batch
 * of one token is a decode row at position ~131K. */
static void gapped_positions(upf_rng *rng, int32_t *pos, int64_t T) {
  if (T == 1) {
    pos[0] = 131071;
    return;
  }
  int64_t t = 0;
  while (t < T) {
    int64_t len = 1 + (int64_t)upf_rng_below(rng, (uint64_t)(T < 2048 ? T : 2048));
    int32_t p = upf_rng_uniform(rng) < 0.3f ? (int32_t)upf_rng_below(rng, 120000) : 0;
    for (int64_t j = 0; j < len && t < T; j++, t++) {
      pos[t] = p;
      p += 1 + (upf_rng_uniform(rng) < 0.4f ? (int32_t)upf_rng_below(rng, 64) : 0);
    }
  }
}

static upf_status rope_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const rope_ctx *rc = ctx;
  return be->rope(&v[0][0], rc->no_k ? NULL : &v[0][1], (const int32_t *)v[1][0].data, &rc->p);
}

static upf_status rope_build(const void *cv, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                             dense_run *run) {
  const rope_case *c = cv;
  int64_t hq, hkv, D;
  rope_ctx *rc = &run->own.rope;
  rc->no_k = c->no_k;
  rope_family_shape(c->fam, &hq, &hkv, &D, &rc->p);
  int64_t W = (hq + 2 * hkv) * D, rot = upf_rope_rotary_dim(&rc->p, D);
  upf_dbuf *qkv = upf_dcase_add(dc, "qkv", dt, c->T * W, 1);
  upf_dbuf *pos = qkv ? upf_dcase_add(dc, "positions", UPF_DTYPE_I32, c->T, 0) : NULL;
  if (!pos)
    return upf_fail(UPF_ERR_NOMEM, "rope case buffers");
  const int64_t sq[3] = {c->T, hq, D}, sk[3] = {c->T, hkv, D}, ss[3] = {W, D, 1};
  upf_dbuf_view(qkv, 0, "q", 3, sq, ss, 0);
  upf_dbuf_cmp_last(qkv, 0, rot);
  if (!c->no_k) {
    upf_dbuf_view(qkv, 1, "k", 3, sk, ss, hq * D);
    upf_dbuf_cmp_last(qkv, 1, rot);
  }
  upf_dbuf_fill_normal(qkv, rng, 0.0f, 1.0f);
  gapped_positions(rng, pos->host, c->T);
  run->fn = rope_fn;
  run->params = rc;
  snprintf(run->shape, sizeof run->shape, "T=%lld Hq=%lld Hkv=%lld D=%lld rot=%lld", (long long)c->T, (long long)hq,
           (long long)hkv, (long long)D, (long long)rot);
  return UPF_OK;
}

static const dense_kind rope_kind = {"rope", DENSE_CASES(rope_cases), DENSE_DTYPES(same_dtypes), 0, NULL, rope_build};

/* The reference against RoPE's defining properties: llama3 keeps the high frequencies and divides
 * the low ones by the factor; a rotation keeps each pair's norm; q.k depends only on p_q - p_k. */
static void rope_invariants(upf_verify_ctx *ctx) {
  upf_check check;
  upf_dense_check_init(&check, "rope", "cpu: llama3 bands, norms, relative positions", UPF_DTYPE_F32, "D=128");
  upf_rope_params p = upf_llama31_8b_rope();
  double inv[64], base[64];
  upf_rope_inv_freq(&p, 128, inv);
  upf_rope_params plain = p;
  plain.scaling = UPF_ROPE_DEFAULT;
  upf_rope_inv_freq(&plain, 128, base);
  double worst = 0.0;
  const char *why = NULL;
  const double two_pi = 6.283185307179586;
  for (int i = 0; i < 64 && !why; i++) {
    double wl = two_pi / base[i];
    if (wl < 8192.0 / 4.0 && inv[i] != base[i])
      why = "a high frequency (wavelength < 2048) was scaled";
    if (wl > 8192.0 && fabs(inv[i] - base[i] / 8.0) > 1e-18)
      why = "a low frequency (wavelength > 8192) was not divided by 8";
    if (wl >= 2048.0 && wl <= 8192.0 && !(inv[i] <= base[i] && inv[i] >= base[i] / 8.0))
      why = "a medium frequency left the [f/8, f] band";
  }
  upf_rng rng;
  upf_rng_seed(&rng, 1234);
  double q[128], k[128], q2[128], k2[128];
  for (int trial = 0; trial < 8 && !why; trial++) {
    for (int d = 0; d < 128; d++)
      q[d] = upf_rng_normal(&rng), k[d] = upf_rng_normal(&rng);
    int64_t pq = (int64_t)upf_rng_below(&rng, 100000), pk = (int64_t)upf_rng_below(&rng, 100000);
    int64_t shift = (int64_t)upf_rng_below(&rng, 30000);
    double dot1 = 0, dot2 = 0, n0 = 0, n1 = 0;
    memcpy(q2, q, sizeof q), memcpy(k2, k, sizeof k);
    for (int d = 0; d < 128; d++)
      n0 += q[d] * q[d];
    ref_rope_row(q, 128, inv, pq), ref_rope_row(k, 128, inv, pk);
    ref_rope_row(q2, 128, inv, pq + shift), ref_rope_row(k2, 128, inv, pk + shift);
    for (int d = 0; d < 128; d++)
      dot1 += q[d] * k[d], dot2 += q2[d] * k2[d], n1 += q[d] * q[d];
    worst = fmax(worst, fabs(dot1 - dot2));
    if (fabs(n1 - n0) > 1e-9 * n0)
      why = "a rotation changed the norm";
    if (fabs(dot1 - dot2) > 1e-8)
      why = "q.k changed under a common shift of positions";
  }
  check.passed = why == NULL;
  check.max_abs_err = worst;
  snprintf(check.detail, sizeof check.detail, "%s", why ? why : "");
  upf_verify_record(ctx, &check);
}

void upf_verify_rope(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++)
    golden_rope(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_ROPE);
  if (upf_verify_on_reference(ctx))
    rope_invariants(ctx);
  dense_cases(ctx, &rope_kind);
}

/* ---- gated attention output ---- */

typedef struct {
  dense_head head;
  int64_t T, H, D;
  int inplace;
} gated_case;

static const gated_case gated_cases[] = {
    {{"qwen3-next", DC_QUICK}, 1, 16, 256, 0},
    {{"qwen3-next", DC_QUICK}, 17, 16, 256, 0},
    {{"qwen3-next", DC_QUICK}, 577, 16, 256, 1},
    {{"qwen3-next", 0}, 4096, 16, 256, 0},
    {{"qwen3-next", 0}, 32768, 16, 256, 1},
    {{"odd D=20", DC_QUICK}, 17, 3, 20, 0},
};

/* Buffers: o, q_proj (gate view), [y]. */
static upf_status gated_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  int inplace = *(const int *)ctx;
  return be->gated_output(&v[0][0], &v[1][0], inplace ? &v[0][0] : &v[2][0]);
}

static upf_status gated_build(const void *cv, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                              dense_run *run) {
  const gated_case *c = cv;
  upf_dbuf *o = upf_dcase_add(dc, "o", dt, c->T * c->H * c->D, c->inplace);
  upf_dbuf *qp = o ? upf_dcase_add(dc, "q_proj", dt, c->T * c->H * 2 * c->D, 0) : NULL;
  upf_dbuf *y = qp && !c->inplace ? upf_dcase_add(dc, "y", dt, c->T * c->H * c->D, 1) : NULL;
  if (!qp || (!c->inplace && !y))
    return upf_fail(UPF_ERR_NOMEM, "attn.gated_output case buffers");
  /* q_proj emits (query | gate) per head: the gate of head h is dims [D, 2D) of its 2D block. */
  const int64_t s[3] = {c->T, c->H, c->D}, sg[3] = {c->H * 2 * c->D, 2 * c->D, 1};
  upf_dbuf_view(o, 0, "o", 3, s, NULL, 0);
  upf_dbuf_view(qp, 0, "gate", 3, s, sg, c->D);
  upf_dbuf_fill_normal(o, rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(qp, rng, 0.0f, 3.0f);
  if (y) {
    upf_dbuf_view(y, 0, "y", 3, s, NULL, 0);
    upf_dbuf_fill_poison(y);
  }
  run->fn = gated_fn;
  run->params = &c->inplace;
  snprintf(run->shape, sizeof run->shape, "T=%lld H=%lld D=%lld%s", (long long)c->T, (long long)c->H,
           (long long)c->D, c->inplace ? " in place" : "");
  return UPF_OK;
}

static const dense_kind gated_kind = {"attn.gated_output", DENSE_CASES(gated_cases), DENSE_DTYPES(same_dtypes), 0,
                                      NULL, gated_build};

void upf_verify_gated_output(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++)
    golden_gated_output(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_GATED_OUTPUT);
  dense_cases(ctx, &gated_kind);
}

/* ---- embedding ---- */

typedef struct {
  dense_head head;
  int64_t T, V, H;
  int gemma_scale;
} embed_case;

static const embed_case embed_cases[] = {
    {{"llama", DC_QUICK}, 1, 4096, 4096, 0},
    {{"llama", DC_QUICK}, 17, 4096, 4096, 0},
    {{"llama", 0}, 577, 4096, 4096, 0},
    {{"llama", 0}, 4096, 4096, 4096, 0},
    {{"gemma scaled sqrt(3840)", DC_QUICK}, 577, 3000, 3840, 1},
    {{"gemma scaled sqrt(3840)", 0}, 32768, 3000, 3840, 1},
    {{"odd H=100", DC_QUICK}, 17, 50, 100, 0},
};

static upf_status embed_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->embed((const int32_t *)v[1][0].data, v[1][0].shape[0], &v[0][0], *(const float *)ctx, &v[2][0]);
}

static upf_status embed_build(const void *cv, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                              dense_run *run) {
  const embed_case *c = cv;
  upf_dbuf *table = upf_dcase_add(dc, "table", dt, c->V * c->H, 0);
  upf_dbuf *ids = table ? upf_dcase_add(dc, "ids", UPF_DTYPE_I32, c->T, 0) : NULL;
  upf_dbuf *y = ids ? upf_dcase_add(dc, "y", dt, c->T * c->H, 1) : NULL;
  if (!y)
    return upf_fail(UPF_ERR_NOMEM, "embed case buffers");
  const int64_t st_[2] = {c->V, c->H}, sy[2] = {c->T, c->H}, si[1] = {c->T};
  upf_dbuf_view(table, 0, "table", 2, st_, NULL, 0);
  upf_dbuf_view(ids, 0, "ids", 1, si, NULL, 0);
  upf_dbuf_view(y, 0, "y", 2, sy, NULL, 0);
  upf_dbuf_fill_normal(table, rng, 0.0f, 0.05f);
  upf_dbuf_fill_poison(y);
  int32_t *id = ids->host;
  for (int64_t t = 0; t < c->T; t++) /* both ends of the table appear */
    id[t] = t == 0 ? (int32_t)(c->V - 1) : t == 1 ? 0 : (int32_t)upf_rng_below(rng, (uint64_t)c->V);
  run->own.scale = c->gemma_scale ? (dt == UPF_DTYPE_BF16 ? upf_round_bf16((float)UPF_GEMMA3_12B_EMBED_SCALE)
                                                       : (float)UPF_GEMMA3_12B_EMBED_SCALE)
                                     : 1.0f;
  run->fn = embed_fn;
  run->params = &run->own.scale;
  snprintf(run->shape, sizeof run->shape, "T=%lld V=%lld H=%lld", (long long)c->T, (long long)c->V, (long long)c->H);
  return UPF_OK;
}

static const dense_kind embed_kind = {"embed", DENSE_CASES(embed_cases), DENSE_DTYPES(same_dtypes), 0, NULL,
                                      embed_build};

void upf_verify_embed(upf_verify_ctx *ctx) {
  for (int d = 0; d < NUM_DTYPES; d++)
    golden_embed(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_EMBED);
  dense_cases(ctx, &embed_kind);
}

/* ---- last-token logits ---- */

typedef struct {
  dense_head head;
  int32_t lens[6];
  int32_t num_reqs;
  int64_t H, V;
  int gemma; /* zero-centred norm */
} logits_case;

static const logits_case logits_cases[] = {
    {{"llama, ragged batch", 0}, {1, 17, 577}, 3, 4096, 32000, 0},
    {{"llama, one long request", 0}, {4096}, 1, 4096, 32000, 0},
    {{"gemma zero-centred, ragged", 0}, {17, 1, 1, 600, 2, 9}, 6, 3840, 8000, 1},
    {{"small, ragged", DC_QUICK}, {1, 17, 5}, 3, 256, 1000, 0},
    {{"small zero-centred, decode rows", DC_QUICK}, {1, 1, 1, 1}, 4, 256, 1000, 1},
};

/* Buffers: logits, hidden, norm_w, w_lm. */
static upf_status logits_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const logits_ctx *lc = ctx;
  return be->logits_last(&v[1][0], lc->cu, lc->num_reqs, &v[2][0], &lc->p, &v[3][0], &v[0][0]);
}

/* Truth: the normalised rows in double (no rounding), then dgemm against w_lm. */
static upf_status logits_truth(upf_dviews v, const void *ctx, double *truth) {
  const logits_ctx *lc = ctx;
  const upf_tensor *hidden = &v[1][0], *nw = &v[2][0], *wlm = &v[3][0];
  int64_t H = hidden->shape[1], B = lc->num_reqs;
  double *row = malloc((size_t)H * sizeof *row), *rowsd = malloc((size_t)(B * H) * sizeof *rowsd);
  upf_status st = row && rowsd ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "logits truth");
  for (int64_t r = 0; st == UPF_OK && r < B; r++) {
    int64_t off = (int64_t)(lc->cu[r + 1] - 1) * hidden->stride[0];
    for (int64_t i = 0; i < H; i++)
      row[i] = ref_get(hidden, off + i);
    double inv = ref_rms_inv(row, H, lc->p.eps);
    for (int64_t i = 0; i < H; i++)
      rowsd[r * H + i] = row[i] * inv * ref_norm_gain(&lc->p, ref_get(nw, i));
  }
  if (st == UPF_OK) { /* B is a handful of rows: a plain loop in double */
    int64_t V = wlm->shape[1];
    double *wd = malloc((size_t)(H * V) * sizeof *wd);
    if (!wd) {
      st = upf_fail(UPF_ERR_NOMEM, "logits truth: w_lm");
    } else {
      for (int64_t i = 0; i < H; i++)
        for (int64_t j = 0; j < V; j++)
          wd[i * V + j] = ref_get(wlm, i * wlm->stride[0] + j);
      for (int64_t r = 0; r < B; r++)
        for (int64_t j = 0; j < V; j++)
          truth[r * V + j] = 0.0;
      for (int64_t r = 0; r < B; r++)
        for (int64_t i = 0; i < H; i++) {
          double a = rowsd[r * H + i];
          const double *w = wd + i * V;
          double *out = truth + r * V;
          for (int64_t j = 0; j < V; j++)
            out[j] += a * w[j];
        }
      free(wd);
    }
  }
  free(row), free(rowsd);
  return st;
}

static upf_status logits_build(const void *cv, upf_dtype dt, upf_dtype out, upf_rng *rng, upf_dcase *dc,
                               dense_run *run) {
  const logits_case *c = cv;
  logits_ctx *lc = &run->own.logits;
  *lc = (logits_ctx){{0}, c->num_reqs, {c->gemma ? UPF_GEMMA3_12B_RMS_EPS : UPF_LLAMA31_8B_RMS_EPS, c->gemma}};
  for (int32_t r = 0; r < c->num_reqs; r++)
    lc->cu[r + 1] = lc->cu[r] + c->lens[r];
  int64_t T = lc->cu[c->num_reqs];
  upf_dbuf *lg = upf_dcase_add(dc, "logits", out, c->num_reqs * c->V, 1);
  upf_dbuf *hid = lg ? upf_dcase_add(dc, "hidden", dt, T * c->H, 0) : NULL;
  upf_dbuf *nw = hid ? upf_dcase_add(dc, "norm_w", dt, c->H, 0) : NULL;
  upf_dbuf *wlm = nw ? upf_dcase_add(dc, "w_lm", dt, c->H * c->V, 0) : NULL;
  if (!wlm)
    return upf_fail(UPF_ERR_NOMEM, "logits.last case buffers");
  const int64_t sl[2] = {c->num_reqs, c->V}, sh[2] = {T, c->H}, sn[1] = {c->H}, sw[2] = {c->H, c->V};
  upf_dbuf_view(lg, 0, "logits", 2, sl, NULL, 0);
  upf_dbuf_view(hid, 0, "hidden", 2, sh, NULL, 0);
  upf_dbuf_view(nw, 0, "norm_w", 1, sn, NULL, 0);
  upf_dbuf_view(wlm, 0, "w_lm", 2, sw, NULL, 0);
  upf_dbuf_fill_poison(lg);
  upf_dbuf_fill_normal(hid, rng, 0.0f, 2.0f);
  upf_dbuf_fill_normal(nw, rng, c->gemma ? 0.0f : 1.0f, 0.1f);
  upf_dbuf_fill_normal(wlm, rng, 0.0f, 1.0f / sqrtf((float)c->H));
  run->fn = logits_fn;
  run->truth = c->H >= 4096 ? logits_truth : NULL;
  run->params = lc;
  snprintf(run->shape, sizeof run->shape, "B=%d T=%lld H=%lld V=%lld", c->num_reqs, (long long)T, (long long)c->H,
           (long long)c->V);
  return UPF_OK;
}

static const upf_dtype logits_dtypes[][2] = {
    {UPF_DTYPE_F32, UPF_DTYPE_F32}, {UPF_DTYPE_BF16, UPF_DTYPE_F32}, {UPF_DTYPE_BF16, UPF_DTYPE_BF16}};

static const dense_kind logits_kind = {"logits.last", DENSE_CASES(logits_cases), DENSE_DTYPES(logits_dtypes), 1, NULL,
                                       logits_build};

/* The reference's logits equal its own gather, norm.rms and gemm. */
static void logits_chain_invariant(upf_verify_ctx *ctx, upf_dtype dt) {
  const int32_t cu[4] = {0, 3, 4, 9};
  const int64_t T = 9, H = 48, V = 20, B = 3;
  upf_check check;
  upf_dense_check_init(&check, "logits.last", "cpu: equals gather + norm.rms + gemm", dt, "B=3 T=9 H=48 V=20");
  upf_tensor hid, nw, wlm, lg, rows, normed, lg2;
  const int64_t sh[2] = {T, H}, sn[1] = {H}, sw[2] = {H, V}, sl[2] = {B, V}, sr[2] = {B, H};
  upf_norm_params p = {1e-6f, 1};
  upf_rng rng;
  upf_rng_seed(&rng, 515 + dt);
  upf_status st = upf_tensor_alloc(&hid, dt, 2, sh);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&nw, dt, 1, sn);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&wlm, dt, 2, sw);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&lg, UPF_DTYPE_F32, 2, sl);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&lg2, UPF_DTYPE_F32, 2, sl);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&rows, dt, 2, sr);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&normed, dt, 2, sr);
  if (st == UPF_OK) {
    for (int64_t i = 0; i < T * H; i++)
      ref_put(&hid, i, upf_rng_normal(&rng));
    for (int64_t i = 0; i < H; i++)
      ref_put(&nw, i, 0.1f * upf_rng_normal(&rng));
    for (int64_t i = 0; i < H * V; i++)
      ref_put(&wlm, i, upf_rng_normal(&rng) / sqrt((double)H));
    for (int64_t r = 0; r < B; r++)
      for (int64_t i = 0; i < H; i++)
        ref_put(&rows, r * H + i, ref_get(&hid, (cu[r + 1] - 1) * H + i));
    st = cpu_logits_last(&hid, cu, 3, &nw, &p, &wlm, &lg);
  }
  if (st == UPF_OK)
    st = cpu_rmsnorm(&rows, &nw, &p, &normed);
  if (st == UPF_OK)
    st = cpu_gemm(&normed, &wlm, &lg2);
  if (st == UPF_OK) {
    double ref[60];
    for (int i = 0; i < B * V; i++)
      ref[i] = ((float *)lg2.data)[i];
    upf_compare_f32(lg.data, ref, B * V, upf_tolerance_for(UPF_DTYPE_F32), &check);
  } else {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%.200s", upf_last_error());
  }
  upf_verify_record(ctx, &check);
  upf_tensor_free(&hid), upf_tensor_free(&nw), upf_tensor_free(&wlm), upf_tensor_free(&lg);
  upf_tensor_free(&lg2), upf_tensor_free(&rows), upf_tensor_free(&normed);
}

void upf_verify_logits_last(upf_verify_ctx *ctx) {
  golden_logits(ctx, UPF_DTYPE_F32);
  golden_logits(ctx, UPF_DTYPE_BF16);
  errors_for(ctx, UPF_OP_LOGITS_LAST);
  if (upf_verify_on_reference(ctx)) {
    logits_chain_invariant(ctx, UPF_DTYPE_F32);
    logits_chain_invariant(ctx, UPF_DTYPE_BF16);
    return;
  }
  dense_cases(ctx, &logits_kind);
}

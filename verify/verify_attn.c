/* Verify cases of the attention ops. On every backend: a hand-computed golden case per op and bad
 * inputs that must come back as their status. For a backend under test: seeded ragged batches
 * (lengths 1, 17, 37, 97, 577, 4096, 512 = a multiple of every tile size, one long row), windows
 * smaller and larger than the sequence, soft-cap, cached prefill (kv_len > q_len), page sizes 1, 16
 * and 64 with shuffled block tables and NaN in every cache slot a request does not own, GQA 1/4/8,
 * D = 64/128/256 and an odd one, compared with the CPU reference through the dense harness (guard
 * bytes, untouched padding, the long-reduction rule for kv >= 4096). Each seeded case runs under the
 * variant of its op in effect (upf verify iterates them), and where that variant picks the case's kernel
 * the check line names it ("fa2: ragged, GQA 1"). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/attn.h"
#include "uniprefill/bf16.h"
#include "uniprefill/variant.h"
#include "verify/harness.h"
#include "verify/verify.h"

enum { AC_QUICK = 1 }; /* in the quick set (valgrind, CI, the GPU test suite) */

static void record_failure(upf_verify_ctx *ctx, const char *op, const char *variant, upf_dtype dt) {
  upf_check check;
  upf_dense_check_init(&check, op, variant, dt, "-");
  check.passed = 0;
  snprintf(check.detail, sizeof check.detail, "setup: %.200s", upf_last_error());
  upf_verify_record(ctx, &check);
}

/* ================================================================================================ */
/* Golden: T = 2, one head, D = 2, scale 1. Row 0 sees key 0 only: out = v0, lse = q0.k0 = 0. Row 1
 * has logits (1, 0): weights e/(e+1), 1/(e+1), so out = (2e/(e+1), 4/(e+1)), lse = log(e + 1). With
 * window 1 every row is its own value and lse its own logit (0 for both). Values exact in bf16. The paged form
 * stores the two rows in page 1 of two pages of size 2 (page 0 holds NaN: never read). */

static const float g_q[4] = {0, 0, 1, 0}, g_k[4] = {1, 0, 0, 1}, g_v[4] = {2, 0, 0, 4};

static void golden_want(int window, double *out, double *lse) {
  double e = exp(1.0);
  out[0] = 2, out[1] = 0, lse[0] = 0;
  if (window == 1) { /* row 1 sees key 1 only: logit q1.k1 = 0 */
    out[2] = 0, out[3] = 4, lse[1] = 0;
  } else {
    out[2] = 2 * e / (e + 1), out[3] = 4 / (e + 1), lse[1] = log(e + 1);
  }
}

typedef struct {
  const upf_backend *be;
  void *ptr[10];
  int n;
} gmem;

static upf_status g_put(gmem *m, const void *host, size_t bytes, void **dev) {
  UPF_TRY(m->be->alloc(&m->ptr[m->n], bytes));
  *dev = m->ptr[m->n++];
  return host ? m->be->upload(*dev, host, bytes) : m->be->fill(*dev, 0xFF, bytes);
}

static upf_status g_floats(gmem *m, upf_dtype dt, const float *vals, int64_t n, void **dev) {
  if (!vals)
    return g_put(m, NULL, (size_t)n * upf_dtype_size(dt), dev);
  uint16_t h16[16];
  if (dt == UPF_DTYPE_BF16) {
    upf_bf16_from_f32_array(h16, vals, n);
    return g_put(m, h16, (size_t)n * 2, dev);
  }
  return g_put(m, vals, (size_t)n * 4, dev);
}

static void g_free(gmem *m) {
  for (int i = 0; i < m->n; i++)
    m->be->release(m->ptr[i]);
  m->n = 0;
}

/* Downloads out (4) and lse (2) and compares them with the golden values. */
static void g_check(upf_verify_ctx *ctx, gmem *m, const char *op, const char *variant, upf_dtype dt, upf_status st,
                    void *out, void *lse, int window) {
  upf_check check;
  upf_dense_check_init(&check, op, variant, dt, "hand-computed, T=2 D=2");
  float got[6];
  uint16_t o16[4];
  if (st == UPF_OK)
    st = m->be->synchronize();
  if (st == UPF_OK)
    st = dt == UPF_DTYPE_BF16 ? m->be->download(o16, out, sizeof o16) : m->be->download(got, out, 4 * sizeof(float));
  if (st == UPF_OK)
    st = m->be->download(got + 4, lse, 2 * sizeof(float));
  if (st != UPF_OK) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  } else {
    if (dt == UPF_DTYPE_BF16)
      upf_bf16_to_f32_array(got, o16, 4);
    double want[6];
    golden_want(window, want, want + 4);
    upf_compare_f32(got, want, 6, upf_tolerance_for(dt), &check);
  }
  upf_verify_record(ctx, &check);
}

static void golden_prefill(upf_verify_ctx *ctx, upf_dtype dt, int window) {
  gmem m = {.be = ctx->backend};
  const int32_t cu[2] = {0, 2};
  void *q = NULL, *k = NULL, *v = NULL, *o = NULL, *lse = NULL, *dcu = NULL;
  upf_status st = g_floats(&m, dt, g_q, 4, &q);
  if (st == UPF_OK)
    st = g_floats(&m, dt, g_k, 4, &k);
  if (st == UPF_OK)
    st = g_floats(&m, dt, g_v, 4, &v);
  if (st == UPF_OK)
    st = g_floats(&m, dt, NULL, 4, &o);
  if (st == UPF_OK)
    st = g_put(&m, NULL, 2 * sizeof(float), &lse);
  if (st == UPF_OK)
    st = g_put(&m, cu, sizeof cu, &dcu);
  if (st == UPF_OK) {
    const int64_t s3[3] = {2, 1, 2}, s2[2] = {2, 1};
    upf_tensor tq, tk, tv, to, tl;
    upf_tensor_init(&tq, q, dt, 3, s3), upf_tensor_init(&tk, k, dt, 3, s3), upf_tensor_init(&tv, v, dt, 3, s3);
    upf_tensor_init(&to, o, dt, 3, s3), upf_tensor_init(&tl, lse, UPF_DTYPE_F32, 2, s2);
    upf_attn_varlen b = {1, dcu, cu, dcu, cu};
    upf_attn_params p = {1.0f, 0.0f, window};
    st = ctx->backend->attn_prefill(&b, &tq, &tk, &tv, &p, &to, &tl);
  }
  g_check(ctx, &m, "attn.prefill", window ? "golden: window 1" : "golden: causal", dt, st, o, lse, window);
  g_free(&m);
}

static void golden_paged(upf_verify_ctx *ctx, upf_dtype dt, int window) {
  gmem m = {.be = ctx->backend};
  const int32_t cu[2] = {0, 2}, kv_len[1] = {2}, bt[2] = {1, 0};
  float kc[8], vc[8];
  for (int i = 0; i < 4; i++)
    kc[i] = vc[i] = NAN, kc[4 + i] = g_k[i], vc[4 + i] = g_v[i];
  void *q = NULL, *k = NULL, *v = NULL, *o = NULL, *lse = NULL, *dcu = NULL, *dkv = NULL, *dbt = NULL;
  upf_status st = g_floats(&m, dt, g_q, 4, &q);
  if (st == UPF_OK)
    st = g_floats(&m, dt, kc, 8, &k);
  if (st == UPF_OK)
    st = g_floats(&m, dt, vc, 8, &v);
  if (st == UPF_OK)
    st = g_floats(&m, dt, NULL, 4, &o);
  if (st == UPF_OK)
    st = g_put(&m, NULL, 2 * sizeof(float), &lse);
  if (st == UPF_OK)
    st = g_put(&m, cu, sizeof cu, &dcu);
  if (st == UPF_OK)
    st = g_put(&m, kv_len, sizeof kv_len, &dkv);
  if (st == UPF_OK)
    st = g_put(&m, bt, sizeof bt, &dbt);
  if (st == UPF_OK) {
    const int64_t s3[3] = {2, 1, 2}, s2[2] = {2, 1}, sc[4] = {2, 2, 1, 2};
    upf_tensor tq, tk, tv, to, tl;
    upf_tensor_init(&tq, q, dt, 3, s3), upf_tensor_init(&tk, k, dt, 4, sc), upf_tensor_init(&tv, v, dt, 4, sc);
    upf_tensor_init(&to, o, dt, 3, s3), upf_tensor_init(&tl, lse, UPF_DTYPE_F32, 2, s2);
    upf_attn_paged b = {1, dcu, cu, dkv, kv_len, dbt, bt, 2, 2};
    upf_attn_params p = {1.0f, 0.0f, window};
    st = ctx->backend->attn_paged(&b, &tq, &tk, &tv, &p, &to, &tl);
  }
  g_check(ctx, &m, "attn.paged", window ? "golden: page 1 of 2, window 1" : "golden: page 1 of 2", dt, st, o, lse,
          window);
  g_free(&m);
}

/* Rows 0 and 1 of (k, v) = (1..4, 5..8) into slots 3 and 0 of one page of 4; row 2 skipped (-1). */
static void golden_cache_write(upf_verify_ctx *ctx, upf_dtype dt) {
  gmem m = {.be = ctx->backend};
  const float kr[6] = {1, 2, 3, 4, 9, 9}, vr[6] = {5, 6, 7, 8, 9, 9}, zero[8] = {0};
  const int32_t slots[3] = {3, 0, -1};
  void *k = NULL, *v = NULL, *kc = NULL, *vc = NULL, *ds = NULL;
  upf_status st = g_floats(&m, dt, kr, 6, &k);
  if (st == UPF_OK)
    st = g_floats(&m, dt, vr, 6, &v);
  if (st == UPF_OK)
    st = g_floats(&m, dt, zero, 8, &kc);
  if (st == UPF_OK)
    st = g_floats(&m, dt, zero, 8, &vc);
  if (st == UPF_OK)
    st = g_put(&m, slots, sizeof slots, &ds);
  upf_tensor tk, tv, tkc, tvc;
  if (st == UPF_OK) {
    const int64_t sr[3] = {3, 1, 2}, sc[4] = {1, 4, 1, 2};
    upf_tensor_init(&tk, k, dt, 3, sr), upf_tensor_init(&tv, v, dt, 3, sr);
    upf_tensor_init(&tkc, kc, dt, 4, sc), upf_tensor_init(&tvc, vc, dt, 4, sc);
    st = ctx->backend->kv_cache_write(&tk, &tv, ds, slots, &tkc, &tvc);
  }
  upf_check check;
  upf_dense_check_init(&check, "kv_cache.write", "golden: slots 3, 0, -1", dt, "hand-computed, page 4, D=2");
  float got[16];
  uint16_t g16[16];
  if (st == UPF_OK)
    st = m.be->synchronize();
  size_t es = upf_dtype_size(dt);
  if (st == UPF_OK)
    st = m.be->download(dt == UPF_DTYPE_BF16 ? (void *)g16 : (void *)got, kc, 8 * es);
  if (st == UPF_OK)
    st = m.be->download(dt == UPF_DTYPE_BF16 ? (void *)(g16 + 8) : (void *)(got + 8), vc, 8 * es);
  if (st != UPF_OK) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  } else {
    if (dt == UPF_DTYPE_BF16)
      upf_bf16_to_f32_array(got, g16, 16);
    const double want[16] = {3, 4, 0, 0, 0, 0, 1, 2, 7, 8, 0, 0, 0, 0, 5, 6};
    upf_compare_f32(got, want, 16, upf_tolerance_for(dt), &check);
  }
  upf_verify_record(ctx, &check);
  g_free(&m);
}

/* ================================================================================================ */
/* Bad inputs: each must come back as its status on the backend under test.                         */

static void errors_for(upf_verify_ctx *ctx, upf_op op) {
  const upf_backend *be = ctx->backend;
  void *buf = NULL;
  if (be->alloc(&buf, 4096 * sizeof(float)) != UPF_OK) {
    record_failure(ctx, upf_op_name(op), "errors", UPF_DTYPE_F32);
    return;
  }
  be->fill(buf, 0, 4096 * sizeof(float));
  const char *name = upf_op_name(op);
  const int64_t sq[3] = {4, 4, 8}, skv[3] = {4, 2, 8}, sk3[3] = {4, 3, 8}, sc[4] = {4, 2, 2, 8};
  upf_tensor q, k, v, o, kc, vc;
  upf_tensor_init(&q, buf, UPF_DTYPE_F32, 3, sq), upf_tensor_init(&o, buf, UPF_DTYPE_F32, 3, sq);
  upf_tensor_init(&k, buf, UPF_DTYPE_F32, 3, skv), upf_tensor_init(&v, buf, UPF_DTYPE_F32, 3, skv);
  upf_tensor_init(&kc, buf, UPF_DTYPE_F32, 4, sc), upf_tensor_init(&vc, buf, UPF_DTYPE_F32, 4, sc);
  const int32_t cu[3] = {0, 2, 4}, cu_bad[3] = {0, 3, 2}, cu_long[3] = {0, 1, 4};
  int32_t *dev = (int32_t *)buf; /* zeros: only the host copies are read before the checks fail */
  upf_attn_params p = {0.0f, 0.0f, 0};
  switch (op) {
  case UPF_OP_ATTN_PREFILL: {
    upf_attn_varlen b = {2, dev, cu, dev, cu};
    upf_tensor k3;
    upf_tensor_init(&k3, buf, UPF_DTYPE_F32, 3, sk3);
    upf_verify_expect_status(ctx, name, "Hq=4 not a multiple of Hkv=3", be->attn_prefill(&b, &q, &k3, &k3, &p, &o, NULL),
                  UPF_ERR_SHAPE);
    b.cu_seqlens_q_host = cu_bad;
    upf_verify_expect_status(ctx, name, "cu_seqlens_q not monotone", be->attn_prefill(&b, &q, &k, &v, &p, &o, NULL),
                  UPF_ERR_CU_SEQLENS);
    b.cu_seqlens_q_host = cu, b.cu_seqlens_kv_host = cu_long;
    upf_verify_expect_status(ctx, name, "kv_len 1 < q_len 2", be->attn_prefill(&b, &q, &k, &v, &p, &o, NULL),
                  UPF_ERR_CU_SEQLENS);
    b.cu_seqlens_kv_host = cu;
    p.window = -1;
    upf_verify_expect_status(ctx, name, "window -1", be->attn_prefill(&b, &q, &k, &v, &p, &o, NULL), UPF_ERR_INVALID_ARG);
    p.window = 0, p.softcap = NAN;
    upf_verify_expect_status(ctx, name, "softcap NaN", be->attn_prefill(&b, &q, &k, &v, &p, &o, NULL), UPF_ERR_INVALID_ARG);
    p.softcap = 0.0f, p.scale = INFINITY;
    upf_verify_expect_status(ctx, name, "scale Inf", be->attn_prefill(&b, &q, &k, &v, &p, &o, NULL), UPF_ERR_INVALID_ARG);
    p.scale = 0.0f;
    upf_tensor_init(&v, buf, UPF_DTYPE_BF16, 3, skv);
    upf_verify_expect_status(ctx, name, "v bf16, k f32", be->attn_prefill(&b, &q, &k, &v, &p, &o, NULL), UPF_ERR_DTYPE);
    upf_tensor lse;
    upf_tensor_init(&lse, buf, UPF_DTYPE_F32, 2, (const int64_t[2]){4, 2});
    upf_verify_expect_status(ctx, name, "lse (Tq, 2) with Hq=4", be->attn_prefill(&b, &q, &k, &k, &p, &o, &lse), UPF_ERR_SHAPE);
    break;
  }
  case UPF_OP_ATTN_PAGED: {
    const int32_t kv_lens[2] = {2, 4}, bt[4] = {0, 1, 3, 4}, kv_short[2] = {1, 4};
    upf_attn_paged b = {2, dev, cu, dev, kv_lens, dev, bt, 2, 2};
    upf_verify_expect_status(ctx, name, "block_table[1][1]=4 outside 4 pages", be->attn_paged(&b, &q, &kc, &vc, &p, &o, NULL),
                  UPF_ERR_INVALID_ARG);
    const int32_t bt_ok[4] = {0, 1, 3, 2};
    b.block_table_host = bt_ok, b.kv_lens_host = kv_short;
    upf_verify_expect_status(ctx, name, "kv_len 1 < q_len 2", be->attn_paged(&b, &q, &kc, &vc, &p, &o, NULL),
                  UPF_ERR_CU_SEQLENS);
    b.kv_lens_host = kv_lens, b.page_size = 16;
    upf_verify_expect_status(ctx, name, "page_size 16, cache pages of 2", be->attn_paged(&b, &q, &kc, &vc, &p, &o, NULL),
                  UPF_ERR_SHAPE);
    b.page_size = 2;
    const int32_t kv_big[2] = {2, 6};
    b.kv_lens_host = kv_big;
    upf_verify_expect_status(ctx, name, "kv_len 6 needs 3 pages, max_blocks 2", be->attn_paged(&b, &q, &kc, &vc, &p, &o, NULL),
                  UPF_ERR_INVALID_ARG);
    break;
  }
  case UPF_OP_KV_CACHE_WRITE: {
    const int32_t slots_bad[4] = {0, 1, 8, 2}, slots_dup[4] = {0, 5, 5, -1};
    upf_verify_expect_status(ctx, name, "slot 8 outside 4 pages of 2", be->kv_cache_write(&k, &v, dev, slots_bad, &kc, &vc),
                  UPF_ERR_INVALID_ARG);
    if (strstr(upf_last_error(), "slot_mapping[2]=8") == NULL)
      upf_verify_expect_status(ctx, name, "message names slot_mapping[2]=8", UPF_ERR_INVALID_ARG, UPF_OK);
    upf_verify_expect_status(ctx, name, "two rows into slot 5", be->kv_cache_write(&k, &v, dev, slots_dup, &kc, &vc),
                  UPF_ERR_INVALID_ARG);
    upf_tensor_init(&k, buf, UPF_DTYPE_F32, 3, (const int64_t[3]){4, 2, 6});
    upf_verify_expect_status(ctx, name, "k head dim 6, cache 8", be->kv_cache_write(&k, &k, dev, slots_dup, &kc, &vc),
                  UPF_ERR_SHAPE);
    break;
  }
  default:
    break;
  }
  be->release(buf);
}

/* ================================================================================================ */
/* Seeded cases against the CPU reference (backend under test only).                               */

#define MAX_REQS 12

typedef struct {
  const char *name;
  int nreq;
  int32_t q_lens[MAX_REQS];
  int32_t kv_extra[MAX_REQS]; /* kv_len = q_len + extra (cached context) */
  int64_t hq, hkv, d;
  int32_t window;
  float softcap;
  float scale;   /* 0: 1/sqrt(D) */
  int32_t page;  /* paged cases: tokens per page */
  unsigned flags;
} attn_case;

static const attn_case prefill_cases[] = {
    {"ragged, GQA 1", 5, {1, 17, 37, 97, 577}, {0}, 8, 8, 128, 0, 0, 0, 0, AC_QUICK},
    {"ragged, GQA 4", 5, {1, 17, 37, 97, 577}, {0}, 16, 4, 64, 0, 0, 0, 0, 0},
    {"ragged, GQA 8, D=256", 3, {17, 512, 37}, {0}, 16, 2, 256, 0, 0, 0, 0, 0},
    {"short, GQA 8, D=256, cached", 2, {17, 70}, {0, 30}, 8, 1, 256, 0, 0, 0, 0, AC_QUICK},
    {"tile multiple 512, GQA 8", 2, {512, 512}, {0}, 8, 1, 128, 0, 0, 0, 0, AC_QUICK},
    {"n=4096", 1, {4096}, {0}, 4, 1, 64, 0, 0, 0, 0, 0},
    {"long row 16384, window 512", 1, {16384}, {0}, 2, 1, 128, 512, 0, 0, 0, 0},
    {"window 1 (itself only)", 3, {1, 17, 37}, {0}, 4, 2, 64, 1, 0, 0, 0, AC_QUICK},
    {"window 16 < lengths", 4, {1, 17, 37, 97}, {0}, 8, 2, 128, 16, 0, 0, 0, AC_QUICK},
    {"window 1000 > lengths", 4, {1, 17, 37, 97}, {0}, 8, 2, 128, 1000, 0, 0, 0, 0},
    {"gemma: window 1024, scale 256^-0.5", 2, {1500, 97}, {0}, 8, 4, 256, 1024, 0, 0.0625f, 0, 0},
    {"softcap 50, scale 0.5", 3, {17, 97, 37}, {0}, 4, 4, 64, 0, 50.0f, 0.5f, 0, AC_QUICK},
    {"cached prefill kv > q", 4, {1, 17, 37, 64}, {99, 300, 0, 1000}, 8, 2, 128, 0, 0, 0, 0, AC_QUICK},
    {"cached prefill, window 64", 3, {17, 37, 5}, {500, 3, 200}, 8, 2, 64, 64, 0, 0, 0, 0},
    {"odd D=80, GQA 3", 2, {17, 97}, {0, 20}, 6, 2, 80, 0, 0, 0, 0, AC_QUICK},
    {"softcap 30, D=128, GQA 2, cached", 2, {200, 77}, {0, 50}, 8, 4, 128, 0, 30.0f, 0, 0, AC_QUICK},
    /* windowed D = 256 in the quick set (the sanitizers' run): the FA2 kernel's window masks at D = 256 */
    {"window 100, softcap 30, D=256, GQA 2, cached", 3, {17, 200, 130}, {0, 50, 300}, 8, 4, 256, 100, 30.0f, 0, 0,
     AC_QUICK},
    /* D = 256 without soft-cap (the wgmma kernel's 128-row query and 80-key tiles under the default
     * variant): single tokens, lengths at, one past and between tile multiples, kv > q, a window, one
     * long row */
    {"D=256, GQA 2, ragged 1..300, cached", 6, {1, 80, 81, 129, 161, 300}, {0, 0, 7, 0, 160, 1}, 8, 4, 256, 0, 0,
     0.0625f, 0, AC_QUICK},
    {"D=256, window 100, GQA 4, cached", 3, {17, 200, 130}, {0, 50, 300}, 8, 2, 256, 100, 0, 0, 0, AC_QUICK},
    {"D=256, long row 4200, GQA 2", 1, {4200}, {0}, 2, 1, 256, 0, 0, 0, 0, 0},
};

static const attn_case paged_cases[] = {
    {"decode, mixed lengths, page 16", 6, {1, 1, 1, 1, 1, 1}, {0, 16, 36, 96, 576, 4095}, 32, 8, 128, 0, 0, 0, 16,
     AC_QUICK},
    {"decode, page 1", 4, {1, 1, 1, 1}, {0, 16, 36, 300}, 8, 1, 64, 0, 0, 0, 1, AC_QUICK},
    {"decode, page 64, GQA 4, D=256", 3, {1, 1, 1}, {63, 64, 1000}, 16, 4, 256, 0, 0, 0, 64, 0},
    {"decode, one long row 32768 (split-KV)", 1, {1}, {32767}, 8, 1, 128, 0, 0, 0, 16, 0},
    {"decode, window 16 and 1000", 3, {1, 1, 1}, {5, 100, 2000}, 8, 2, 128, 16, 0, 0, 16, AC_QUICK},
    {"mixed decode + cached prefill, page 16", 4, {1, 37, 1, 97}, {576, 100, 17, 0}, 8, 2, 128, 0, 0, 0, 16,
     AC_QUICK},
    {"cached prefill, page 64, softcap 30", 2, {17, 577}, {200, 64}, 4, 4, 64, 0, 30.0f, 0, 64, 0},
    {"mixed, window 64, page 1, GQA 8", 3, {1, 17, 1}, {300, 40, 0}, 8, 1, 64, 64, 0, 0, 1, 0},
    {"mixed, window 100, page 16, D=256, softcap 30", 3, {17, 1, 150}, {200, 50, 40}, 8, 2, 256, 100, 30.0f, 0, 16,
     AC_QUICK},
    /* decode with split-KV at the GQA extremes (the mma decode kernel packs the group into one m16 tile) */
    {"decode, GQA 1, P 1, row 5000 split-KV, softcap 20", 2, {1, 1}, {4999, 300}, 4, 4, 128, 0, 20.0f,
     0, 1, AC_QUICK},
    {"decode, GQA 8, P 64, window 3000, row 9000 split-KV", 2, {1, 1}, {8999, 100}, 16, 2, 64, 3000, 0,
     0, 64, 0},
    /* query runs of 2..15 tokens (speculative decode) stay on the decode kernels: masks per row */
    {"multi-token steps q 2-7, softcap 30, page 16", 3, {2, 7, 5}, {100, 40, 3000}, 8, 2, 128, 0, 30.0f, 0, 16,
     AC_QUICK},
    {"multi-token steps q 3-9, window 600, GQA 8, page 1", 3, {3, 1, 9}, {50, 7, 2000}, 16, 2, 64, 600, 0, 0, 1, 0},
    /* chunked prefill (query runs of >= 16 over cached context): at D = 128 and D = 256 without soft-cap the
     * visible keys are gathered from the pages for the wgmma kernel (cuda/attn.cu), from the window's first
     * key under a window (windows whose first key is not a multiple of 16; pages of 1, 8, 16, 32, 48); more
     * requests than a gather launch takes (KV_GATHER_REQS) */
    {"chunks over cached context, page 16, GQA 4", 4, {512, 16, 300, 1}, {4000, 0, 129, 77}, 16, 4, 128, 0, 0, 0, 16,
     AC_QUICK},
    {"chunks, window 1024, D=256, page 16, GQA 2", 3, {200, 130, 1}, {3000, 1000, 50}, 8, 4, 256, 1024, 0, 0.0625f,
     16, AC_QUICK},
    {"chunks, page 1, window 64, GQA 8", 2, {40, 17}, {300, 3}, 16, 2, 128, 64, 0, 0, 1, 0},
    {"10 chunks and 2 decodes, page 16", 12, {17, 33, 16, 64, 1, 100, 20, 18, 16, 40, 1, 129},
     {100, 0, 500, 1000, 9, 3, 2000, 17, 64, 640, 300, 31}, 8, 2, 128, 0, 0, 0, 16, AC_QUICK},
    {"chunk 2048 over 30000 cached, page 16, GQA 4", 1, {2048}, {30000}, 32, 8, 128, 0, 0, 0, 16, 0},
    {"chunks, window 300, page 48, GQA 4", 2, {100, 250}, {1000, 37}, 16, 4, 128, 300, 0, 0, 48, AC_QUICK},
    {"chunks, page 8, GQA 2", 3, {64, 20, 9}, {700, 5, 30}, 8, 4, 128, 0, 0, 0, 8, AC_QUICK},
    {"chunks, window 77, D=256, page 32, GQA 4", 2, {150, 33}, {500, 90}, 8, 2, 256, 77, 0, 0.0625f, 32, 0},
};

#define NCASES(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Query rows below which a paged request takes attn.paged's decode kernel (cuda/attn.cu's
 * MMA_MIN_Q_ROWS); longer ones take the prefill kernels (the wgmma kernel where it takes the shape, the
 * FA2 kernel elsewhere), whatever attn.paged's variant. */
#define PAGED_DECODE_ROWS 16

/* Whether the variant of op in effect picks the kernel of case c in dtype dt: attn.prefill's for bf16
 * at D = 128 and at D = 256 without soft-cap (cuda/attn.cu's wgmma2_takes), attn.paged's for bf16 requests of short query runs (decode steps) at D = 64/128/256. */
static int variant_picks_kernel(upf_op op, const attn_case *c, upf_dtype dt) {
  if (dt != UPF_DTYPE_BF16)
    return 0;
  if (op == UPF_OP_ATTN_PREFILL)
    return c->d == 128 || (c->d == 256 && c->softcap == 0.0f);
  if (c->d != 64 && c->d != 128 && c->d != 256)
    return 0;
  for (int r = 0; r < c->nreq; r++)
    if (c->q_lens[r] < PAGED_DECODE_ROWS)
      return 1;
  return 0;
}

/* The check's variant column: "<variant in effect>: <case>" where the variant picks the case's kernel,
 * the case's name elsewhere. (A bad UPF_VARIANT names nothing here: the op's call fails with it.) */
static void case_label(upf_op op, const attn_case *c, upf_dtype dt, char *buf, size_t cap) {
  upf_variant v;
  if (variant_picks_kernel(op, c, dt) && upf_variant_current(op, &v) == UPF_OK && v != UPF_VARIANT_COUNT)
    snprintf(buf, cap, "%s: %s", upf_variant_name(v), c->name);
  else
    snprintf(buf, cap, "%s", c->name);
}

/* Host copies of the index arrays the op takes besides its device buffers. */
typedef struct {
  int32_t nreq;
  int32_t cu_q[MAX_REQS + 1], cu_kv[MAX_REQS + 1], kv_lens[MAX_REQS];
  int32_t *block_table; /* (nreq, max_blocks) */
  int32_t max_blocks, page;
  upf_attn_params p;
} attn_ctx;

/* Buffers: q, k, v, cu_q, cu_kv, [out, lse]. */
static upf_status prefill_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const attn_ctx *a = ctx;
  upf_attn_varlen b = {a->nreq, v[3][0].data, a->cu_q, v[4][0].data, a->cu_kv};
  return be->attn_prefill(&b, &v[0][0], &v[1][0], &v[2][0], &a->p, &v[5][0], &v[6][0]);
}
static upf_status prefill_truth(upf_dviews v, const void *ctx, double *truth) {
  const attn_ctx *a = ctx;
  upf_attn_varlen b = {a->nreq, a->cu_q, a->cu_q, a->cu_kv, a->cu_kv};
  return ref_attn_prefill_f64(&b, &v[0][0], &v[1][0], &v[2][0], &a->p, truth);
}

/* Buffers: q, k_cache, v_cache, cu_q, kv_lens, block_table, [out, lse]. */
static upf_status paged_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const attn_ctx *a = ctx;
  upf_attn_paged b = {a->nreq,        v[3][0].data,   a->cu_q, v[4][0].data, a->kv_lens,
                      v[5][0].data,   a->block_table, a->max_blocks, a->page};
  return be->attn_paged(&b, &v[0][0], &v[1][0], &v[2][0], &a->p, &v[6][0], &v[7][0]);
}
static upf_status paged_truth(upf_dviews v, const void *ctx, double *truth) {
  const attn_ctx *a = ctx;
  upf_attn_paged b = {a->nreq, a->cu_q, a->cu_q, a->kv_lens, a->kv_lens, a->block_table, a->block_table,
                      a->max_blocks, a->page};
  return ref_attn_paged_f64(&b, &v[0][0], &v[1][0], &v[2][0], &a->p, truth);
}

static void fill_ctx(const attn_case *c, attn_ctx *a) {
  memset(a, 0, sizeof *a);
  a->nreq = c->nreq;
  for (int r = 0; r < c->nreq; r++) {
    a->kv_lens[r] = c->q_lens[r] + c->kv_extra[r];
    a->cu_q[r + 1] = a->cu_q[r] + c->q_lens[r];
    a->cu_kv[r + 1] = a->cu_kv[r] + a->kv_lens[r];
  }
  a->p = (upf_attn_params){c->scale, c->softcap, c->window};
}

static void shape_str(const attn_case *c, const attn_ctx *a, char *buf, size_t cap) {
  int n = snprintf(buf, cap, "Hq=%lld Hkv=%lld D=%lld q/kv=", (long long)c->hq, (long long)c->hkv, (long long)c->d);
  for (int r = 0; r < c->nreq && n > 0 && (size_t)n < cap; r++)
    n += snprintf(buf + n, cap - (size_t)n, "%s%d/%d", r ? "," : "", c->q_lens[r], a->kv_lens[r]);
}

static void set_ints(upf_dbuf *b, const int32_t *vals, int64_t n) { memcpy(b->host, vals, (size_t)n * sizeof *vals); }

static int64_t max_kv(const attn_ctx *a) {
  int64_t m = 0;
  for (int r = 0; r < a->nreq; r++)
    m = a->kv_lens[r] > m ? a->kv_lens[r] : m;
  return m;
}

static void prefill_run(upf_verify_ctx *ctx, int index, upf_dtype dt) {
  const attn_case *c = &prefill_cases[index];
  const char *op = "attn.prefill";
  attn_ctx a;
  fill_ctx(c, &a);
  int64_t Tq = a.cu_q[c->nreq], Tkv = a.cu_kv[c->nreq];
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)dt));
  upf_dbuf *q = upf_dcase_add(&dc, "q", dt, Tq * c->hq * c->d, 0);
  upf_dbuf *k = q ? upf_dcase_add(&dc, "k", dt, Tkv * c->hkv * c->d, 0) : NULL;
  upf_dbuf *v = k ? upf_dcase_add(&dc, "v", dt, Tkv * c->hkv * c->d, 0) : NULL;
  upf_dbuf *cq = v ? upf_dcase_add(&dc, "cu_seqlens_q", UPF_DTYPE_I32, c->nreq + 1, 0) : NULL;
  upf_dbuf *ck = cq ? upf_dcase_add(&dc, "cu_seqlens_kv", UPF_DTYPE_I32, c->nreq + 1, 0) : NULL;
  upf_dbuf *o = ck ? upf_dcase_add(&dc, "out", dt, Tq * c->hq * c->d, 1) : NULL;
  upf_dbuf *l = o ? upf_dcase_add(&dc, "lse", UPF_DTYPE_F32, Tq * c->hq, 1) : NULL;
  if (!l) {
    upf_fail(UPF_ERR_NOMEM, "attn case buffers");
    record_failure(ctx, op, c->name, dt);
    upf_dcase_free(&dc);
    return;
  }
  const int64_t sq[3] = {Tq, c->hq, c->d}, skv[3] = {Tkv, c->hkv, c->d}, sl[2] = {Tq, c->hq};
  upf_dbuf_view(q, 0, "q", 3, sq, NULL, 0);
  upf_dbuf_view(k, 0, "k", 3, skv, NULL, 0);
  upf_dbuf_view(v, 0, "v", 3, skv, NULL, 0);
  upf_dbuf_view(o, 0, "out", 3, sq, NULL, 0);
  upf_dbuf_view(l, 0, "lse", 2, sl, NULL, 0);
  /* q, k of unit scale: logits of order sqrt(D) * scale = 1, a softmax that is neither flat nor one-hot */
  upf_dbuf_fill_normal(q, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(k, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(v, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_poison(o);
  upf_dbuf_fill_poison(l);
  set_ints(cq, a.cu_q, c->nreq + 1);
  set_ints(ck, a.cu_kv, c->nreq + 1);
  char shape[96];
  shape_str(c, &a, shape, sizeof shape);
  char label[64];
  case_label(UPF_OP_ATTN_PREFILL, c, dt, label, sizeof label);
  upf_check proto;
  upf_dense_check_init(&proto, op, label, dt, "%s", shape);
  upf_dcase_verify(ctx, &dc, prefill_fn, max_kv(&a) >= 4096 ? prefill_truth : NULL, &a, &proto);
  upf_dcase_free(&dc);
}

static void paged_run(upf_verify_ctx *ctx, int index, upf_dtype dt) {
  const attn_case *c = &paged_cases[index];
  const char *op = "attn.paged";
  attn_ctx a;
  fill_ctx(c, &a);
  a.page = c->page;
  int64_t Tq = a.cu_q[c->nreq], P = c->page;
  a.max_blocks = (int32_t)((max_kv(&a) + P - 1) / P);
  int64_t pages_used = 0;
  for (int r = 0; r < c->nreq; r++)
    pages_used += (a.kv_lens[r] + P - 1) / P;
  int64_t num_pages = pages_used + 3; /* spare pages: never read */
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)dt));
  /* Pages handed out in a shuffled order, so a kernel that ignores the block table reads NaN. */
  int32_t *perm = malloc((size_t)num_pages * sizeof *perm);
  a.block_table = calloc((size_t)(c->nreq * (a.max_blocks ? a.max_blocks : 1)), sizeof *a.block_table);
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  int64_t row = c->hkv * c->d, cache_n = num_pages * P * row;
  upf_dbuf *q = perm && a.block_table ? upf_dcase_add(&dc, "q", dt, Tq * c->hq * c->d, 0) : NULL;
  upf_dbuf *kc = q ? upf_dcase_add(&dc, "k_cache", dt, cache_n, 0) : NULL;
  upf_dbuf *vc = kc ? upf_dcase_add(&dc, "v_cache", dt, cache_n, 0) : NULL;
  upf_dbuf *cq = vc ? upf_dcase_add(&dc, "cu_seqlens_q", UPF_DTYPE_I32, c->nreq + 1, 0) : NULL;
  upf_dbuf *kl = cq ? upf_dcase_add(&dc, "kv_lens", UPF_DTYPE_I32, c->nreq, 0) : NULL;
  upf_dbuf *bt = kl ? upf_dcase_add(&dc, "block_table", UPF_DTYPE_I32, c->nreq * (a.max_blocks ? a.max_blocks : 1),
                                    0)
                    : NULL;
  upf_dbuf *o = bt ? upf_dcase_add(&dc, "out", dt, Tq * c->hq * c->d, 1) : NULL;
  upf_dbuf *l = o ? upf_dcase_add(&dc, "lse", UPF_DTYPE_F32, Tq * c->hq, 1) : NULL;
  if (!l) {
    upf_fail(UPF_ERR_NOMEM, "attn case buffers");
    record_failure(ctx, op, c->name, dt);
    upf_dcase_free(&dc);
    free(perm), free(a.block_table);
    return;
  }
  for (int64_t i = 0; i < num_pages; i++)
    perm[i] = (int32_t)i;
  for (int64_t i = num_pages - 1; i > 0; i--) {
    int64_t j = (int64_t)upf_rng_below(&rng, (uint64_t)i + 1);
    int32_t t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  int64_t next = 0;
  for (int r = 0; r < c->nreq; r++)
    for (int64_t i = 0; i < (a.kv_lens[r] + P - 1) / P; i++)
      a.block_table[(int64_t)r * a.max_blocks + i] = perm[next++];
  const int64_t sq[3] = {Tq, c->hq, c->d}, sc[4] = {num_pages, P, c->hkv, c->d}, sl[2] = {Tq, c->hq};
  upf_dbuf_view(q, 0, "q", 3, sq, NULL, 0);
  upf_dbuf_view(kc, 0, "k_cache", 4, sc, NULL, 0);
  upf_dbuf_view(vc, 0, "v_cache", 4, sc, NULL, 0);
  upf_dbuf_view(o, 0, "out", 3, sq, NULL, 0);
  upf_dbuf_view(l, 0, "lse", 2, sl, NULL, 0);
  upf_dbuf_fill_normal(q, &rng, 0.0f, 1.0f);
  /* Every slot NaN, then each request's kv_len rows: a read past kv_len or through a wrong page shows. */
  upf_dbuf_fill_poison(kc);
  upf_dbuf_fill_poison(vc);
  for (int r = 0; r < c->nreq; r++)
    for (int64_t j = 0; j < a.kv_lens[r]; j++) {
      int64_t base = ((int64_t)a.block_table[(int64_t)r * a.max_blocks + j / P] * P + j % P) * row;
      for (int64_t e = 0; e < row; e++) {
        upf_dbuf_set(kc, base + e, upf_rng_normal(&rng));
        upf_dbuf_set(vc, base + e, upf_rng_normal(&rng));
      }
    }
  upf_dbuf_fill_poison(o);
  upf_dbuf_fill_poison(l);
  set_ints(cq, a.cu_q, c->nreq + 1);
  set_ints(kl, a.kv_lens, c->nreq);
  set_ints(bt, a.block_table, c->nreq * (a.max_blocks ? a.max_blocks : 1));
  char shape[96];
  shape_str(c, &a, shape, sizeof shape);
  upf_check proto;
  char label[64];
  case_label(UPF_OP_ATTN_PAGED, c, dt, label, sizeof label);
  upf_dense_check_init(&proto, op, label, dt, "%s P=%lld", shape, (long long)P);
  upf_dcase_verify(ctx, &dc, paged_fn, max_kv(&a) >= 4096 ? paged_truth : NULL, &a, &proto);
  upf_dcase_free(&dc);
  free(perm), free(a.block_table);
}

typedef struct {
  int64_t T, hkv, d, page, num_pages;
  unsigned flags;
} write_case;

static const write_case write_cases[] = {
    {1, 8, 128, 16, 4, AC_QUICK},  /* a decode row */
    {577, 8, 128, 16, 40, AC_QUICK},
    {97, 4, 256, 1, 120, 0},
    {4096, 2, 64, 64, 70, 0},
};

typedef struct {
  const int32_t *slots_host;
} write_ctx;

/* Buffers: k, v, slots, [k_cache, v_cache]. */
static upf_status write_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const write_ctx *w = ctx;
  return be->kv_cache_write(&v[0][0], &v[1][0], v[2][0].data, w->slots_host, &v[3][0], &v[4][0]);
}

static void write_run(upf_verify_ctx *ctx, int index, upf_dtype dt) {
  const write_case *c = &write_cases[index];
  const char *op = "kv_cache.write";
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)dt));
  int64_t slots_n = c->num_pages * c->page, row = c->hkv * c->d;
  upf_dcase dc;
  upf_dcase_init(&dc, dt);
  upf_dbuf *k = upf_dcase_add(&dc, "k", dt, c->T * row, 0);
  upf_dbuf *v = k ? upf_dcase_add(&dc, "v", dt, c->T * row, 0) : NULL;
  upf_dbuf *s = v ? upf_dcase_add(&dc, "slot_mapping", UPF_DTYPE_I32, c->T, 0) : NULL;
  upf_dbuf *kc = s ? upf_dcase_add(&dc, "k_cache", dt, slots_n * row, 1) : NULL;
  upf_dbuf *vc = kc ? upf_dcase_add(&dc, "v_cache", dt, slots_n * row, 1) : NULL;
  int32_t *perm = malloc((size_t)slots_n * sizeof *perm);
  if (!vc || !perm) {
    upf_fail(UPF_ERR_NOMEM, "kv_cache.write case buffers");
    record_failure(ctx, op, "seeded", dt);
    upf_dcase_free(&dc);
    free(perm);
    return;
  }
  const int64_t sr[3] = {c->T, c->hkv, c->d}, sc[4] = {c->num_pages, c->page, c->hkv, c->d};
  upf_dbuf_view(k, 0, "k", 3, sr, NULL, 0);
  upf_dbuf_view(v, 0, "v", 3, sr, NULL, 0);
  upf_dbuf_view(kc, 0, "k_cache", 4, sc, NULL, 0);
  upf_dbuf_view(vc, 0, "v_cache", 4, sc, NULL, 0);
  upf_dbuf_fill_normal(k, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(v, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(kc, &rng, 0.0f, 1.0f); /* slots not written must come back as they were */
  upf_dbuf_fill_normal(vc, &rng, 0.0f, 1.0f);
  for (int64_t i = 0; i < slots_n; i++)
    perm[i] = (int32_t)i;
  for (int64_t i = slots_n - 1; i > 0; i--) {
    int64_t j = (int64_t)upf_rng_below(&rng, (uint64_t)i + 1);
    int32_t t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  for (int64_t t = 0; t < c->T; t++) /* distinct slots; every 7th row is padding */
    perm[t] = t % 7 == 6 ? -1 : perm[t];
  set_ints(s, perm, c->T);
  write_ctx w = {s->host};
  upf_check proto;
  upf_dense_check_init(&proto, op, "shuffled slots, padding rows", dt, "T=%lld Hkv=%lld D=%lld P=%lld pages=%lld",
                       (long long)c->T, (long long)c->hkv, (long long)c->d, (long long)c->page,
                       (long long)c->num_pages);
  upf_dcase_verify(ctx, &dc, write_fn, NULL, &w, &proto);
  upf_dcase_free(&dc);
  free(perm);
}

static const upf_dtype both_dtypes[2] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};

void upf_verify_attn_prefill(upf_verify_ctx *ctx) {
  for (int d = 0; d < 2; d++) {
    golden_prefill(ctx, both_dtypes[d], 0);
    golden_prefill(ctx, both_dtypes[d], 1);
  }
  errors_for(ctx, UPF_OP_ATTN_PREFILL);
  for (int i = 0; i < NCASES(prefill_cases); i++)
    if (upf_verify_case_wanted(ctx, prefill_cases[i].name, prefill_cases[i].flags & AC_QUICK))
      for (int d = 0; d < 2; d++)
        prefill_run(ctx, i, both_dtypes[d]);
}

void upf_verify_attn_paged(upf_verify_ctx *ctx) {
  for (int d = 0; d < 2; d++) {
    golden_paged(ctx, both_dtypes[d], 0);
    golden_paged(ctx, both_dtypes[d], 1);
  }
  errors_for(ctx, UPF_OP_ATTN_PAGED);
  for (int i = 0; i < NCASES(paged_cases); i++)
    if (upf_verify_case_wanted(ctx, paged_cases[i].name, paged_cases[i].flags & AC_QUICK))
      for (int d = 0; d < 2; d++)
        paged_run(ctx, i, both_dtypes[d]);
}

void upf_verify_kv_cache_write(upf_verify_ctx *ctx) {
  for (int d = 0; d < 2; d++)
    golden_cache_write(ctx, both_dtypes[d]);
  errors_for(ctx, UPF_OP_KV_CACHE_WRITE);
  for (int i = 0; i < NCASES(write_cases); i++)
    if (upf_verify_case_wanted(ctx, NULL, write_cases[i].flags & AC_QUICK))
      for (int d = 0; d < 2; d++)
        write_run(ctx, i, both_dtypes[d]);
}

/* The attention ops on the CPU reference: hand-computed tiny cases (one and two keys, uniform scores,
 * window 1, the soft-cap bound, LSE, the default and Gemma scales), invariants (paged == contiguous on
 * the same data, prefill against a cache == the last rows of a full prefill, a window longer than the
 * sequence == full causal, cache write then paged == contiguous), the exact FLOP count, bad inputs
 * returning their statuses, and the verify entries and seeded cases through the harness, each check line
 * naming the kernel variant in effect where it picks the case's kernel. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/attn.h"
#include "tests/test_util.h"
#include "uniprefill/backend.h"
#include "uniprefill/rng.h"
#include "uniprefill/variant.h"
#include "verify/verify.h"

static upf_tensor view_of(void *data, upf_dtype dt, int ndim, const int64_t *shape) {
  upf_tensor t;
  upf_tensor_init(&t, data, dt, ndim, shape);
  return t;
}

/* Self-attention prefill of one request over f32 arrays; out (T, Hq, D), lse (T, Hq). */
static upf_status prefill1(const float *q, const float *k, const float *v, int64_t T, int64_t hq, int64_t hkv,
                           int64_t d, upf_attn_params p, float *out, float *lse) {
  const int32_t cu[2] = {0, (int32_t)T};
  const int64_t sq[3] = {T, hq, d}, sk[3] = {T, hkv, d}, sl[2] = {T, hq};
  upf_tensor tq = view_of((void *)q, UPF_DTYPE_F32, 3, sq), tk = view_of((void *)k, UPF_DTYPE_F32, 3, sk);
  upf_tensor tv = view_of((void *)v, UPF_DTYPE_F32, 3, sk), to = view_of(out, UPF_DTYPE_F32, 3, sq);
  upf_tensor tl = view_of(lse, UPF_DTYPE_F32, 2, sl);
  upf_attn_varlen b = {1, cu, cu, cu, cu};
  return cpu_attn_prefill(&b, &tq, &tk, &tv, &p, &to, &tl);
}

static void test_attn_by_hand(void) {
  float out[8], lse[4];
  /* one key: the output is its value, the lse its logit (q.k / sqrt(D) = 4 / 2) */
  const float q1[4] = {1, 1, 1, 1}, v1[4] = {3, -1, 0.5f, 7};
  CU_ASSERT_EQUAL_FATAL(prefill1(q1, q1, v1, 1, 1, 1, 4, (upf_attn_params){0}, out, lse), UPF_OK);
  CU_ASSERT(memcmp(out, v1, sizeof v1) == 0);
  CU_ASSERT_DOUBLE_EQUAL(lse[0], 2.0, 1e-6);
  /* two keys: logits (1, 0) at scale 1 for row 1 */
  const float q2[4] = {0, 0, 1, 0}, k2[4] = {1, 0, 0, 1}, v2[4] = {2, 0, 0, 4};
  CU_ASSERT_EQUAL_FATAL(prefill1(q2, k2, v2, 2, 1, 1, 2, (upf_attn_params){1.0f, 0, 0}, out, lse), UPF_OK);
  double e = exp(1.0);
  CU_ASSERT_DOUBLE_EQUAL(out[0], 2.0, 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(out[1], 0.0, 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(out[2], 2 * e / (e + 1), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(out[3], 4 / (e + 1), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(lse[0], 0.0, 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(lse[1], log(e + 1), 1e-6);
  /* window 1: each row attends to itself only */
  CU_ASSERT_EQUAL_FATAL(prefill1(q2, k2, v2, 2, 1, 1, 2, (upf_attn_params){1.0f, 0, 1}, out, lse), UPF_OK);
  CU_ASSERT(memcmp(out, v2, sizeof v2) == 0);
  CU_ASSERT_DOUBLE_EQUAL(lse[1], 0.0, 1e-7);
  /* uniform scores (q = 0): the mean of the visible values, lse = log(row + 1) */
  const float qz[4] = {0}, kz[4] = {5, -3, 2, 9}, vz[4] = {1, 2, 4, 8};
  CU_ASSERT_EQUAL_FATAL(prefill1(qz, kz, vz, 4, 1, 1, 1, (upf_attn_params){0}, out, lse), UPF_OK);
  const double mean[4] = {1, 1.5, 7.0 / 3, 15.0 / 4};
  for (int i = 0; i < 4; i++) {
    CU_ASSERT_DOUBLE_EQUAL(out[i], mean[i], 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(lse[i], log(i + 1.0), 1e-6);
  }
  /* soft-cap: logits q.k = 64 capped at 2 * tanh(32) ~ 2, so lse <= cap + log(keys) */
  const float qc[2] = {8, 8}, kc[2] = {8, 8}, vc[2] = {1, 3};
  CU_ASSERT_EQUAL_FATAL(prefill1(qc, kc, vc, 2, 1, 1, 1, (upf_attn_params){1.0f, 2.0f, 0}, out, lse), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(lse[0], 2.0 * tanh(32.0), 1e-6);
  CU_ASSERT(lse[1] <= 2.0 + log(2.0) + 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(out[1], 2.0, 1e-6); /* equal capped logits: the mean */
  /* GQA: two q heads share one kv head; q head 1 = 0 gives the uniform mean */
  const float qg[4] = {1, 0, 0, 0}, kg[2] = {1, 0}, vg[2] = {4, 6};
  CU_ASSERT_EQUAL_FATAL(prefill1(qg, kg, vg, 2, 2, 1, 1, (upf_attn_params){1.0f, 0, 0}, out, lse), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(out[1], 4.0, 1e-7); /* row 0, head 1 */
  CU_ASSERT_DOUBLE_EQUAL(out[3], 5.0, 1e-6); /* row 1, head 1: logits 0, 0 */
  /* scales */
  upf_attn_params p = {0};
  CU_ASSERT_DOUBLE_EQUAL(upf_attn_scale(&p, 128), 1.0 / sqrt(128.0), 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(upf_attn_gemma_scale(256.0), 0.0625, 0.0);
  /* exact FLOPs: causal rows see 1..4 keys (10 pairs), window 2 sees 1, 2, 2, 2 (7) */
  const int32_t ql[1] = {4}, kl[1] = {4}, kl6[1] = {6};
  CU_ASSERT_DOUBLE_EQUAL(upf_attn_flops(ql, kl, 1, 2, 8, 0), 4.0 * 8 * 2 * 10, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(upf_attn_flops(ql, kl, 1, 2, 8, 2), 4.0 * 8 * 2 * 7, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(upf_attn_flops(ql, kl6, 1, 1, 1, 0), 4.0 * (3 + 4 + 5 + 6), 0.0);
}

/* ---- invariants on seeded data ---- */

typedef struct {
  int nreq;
  int32_t cu_q[5], cu_kv[5], kv_lens[4];
  int64_t Tq, Tkv, hq, hkv, d;
  float *q, *k, *v;
} inv_data;

static void inv_make(inv_data *x, const int32_t *q_lens, const int32_t *kv_lens, int nreq, int64_t hq, int64_t hkv,
                     int64_t d, uint64_t seed) {
  memset(x, 0, sizeof *x);
  x->nreq = nreq, x->hq = hq, x->hkv = hkv, x->d = d;
  for (int r = 0; r < nreq; r++) {
    x->kv_lens[r] = kv_lens[r];
    x->cu_q[r + 1] = x->cu_q[r] + q_lens[r];
    x->cu_kv[r + 1] = x->cu_kv[r] + kv_lens[r];
  }
  x->Tq = x->cu_q[nreq], x->Tkv = x->cu_kv[nreq];
  x->q = malloc((size_t)(x->Tq * hq * d) * sizeof(float));
  x->k = malloc((size_t)(x->Tkv * hkv * d) * sizeof(float));
  x->v = malloc((size_t)(x->Tkv * hkv * d) * sizeof(float));
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  upf_rng_fill_normal(&rng, x->q, x->Tq * hq * d, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, x->k, x->Tkv * hkv * d, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, x->v, x->Tkv * hkv * d, 0.0f, 1.0f);
}

static void inv_free(inv_data *x) { free(x->q), free(x->k), free(x->v); }

static upf_status inv_prefill(const inv_data *x, const upf_attn_params *p, float *out, float *lse) {
  const int64_t sq[3] = {x->Tq, x->hq, x->d}, sk[3] = {x->Tkv, x->hkv, x->d}, sl[2] = {x->Tq, x->hq};
  upf_tensor tq = view_of(x->q, UPF_DTYPE_F32, 3, sq), tk = view_of(x->k, UPF_DTYPE_F32, 3, sk);
  upf_tensor tv = view_of(x->v, UPF_DTYPE_F32, 3, sk), to = view_of(out, UPF_DTYPE_F32, 3, sq);
  upf_tensor tl = view_of(lse, UPF_DTYPE_F32, 2, sl);
  upf_attn_varlen b = {x->nreq, x->cu_q, x->cu_q, x->cu_kv, x->cu_kv};
  return cpu_attn_prefill(&b, &tq, &tk, &tv, p, &to, &tl);
}

/* Writes every request's K/V through the cache-write op into pages of P handed out back to front,
 * then runs paged attention. */
static upf_status inv_paged(const inv_data *x, int64_t P, const upf_attn_params *p, float *out, float *lse) {
  int32_t max_blocks = 0, pages = 0;
  for (int r = 0; r < x->nreq; r++) {
    int32_t n = (int32_t)((x->kv_lens[r] + P - 1) / P);
    max_blocks = n > max_blocks ? n : max_blocks;
    pages += n;
  }
  int64_t row = x->hkv * x->d;
  int32_t *bt = calloc((size_t)(x->nreq * (max_blocks ? max_blocks : 1)), sizeof *bt);
  int32_t *slots = malloc((size_t)(x->Tkv ? x->Tkv : 1) * sizeof *slots);
  float *kc = malloc((size_t)((pages + 1) * P * row) * sizeof(float));
  float *vc = malloc((size_t)((pages + 1) * P * row) * sizeof(float));
  upf_status st = bt && slots && kc && vc ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "test: paged buffers");
  if (st == UPF_OK) {
    for (int64_t i = 0; i < (pages + 1) * P * row; i++)
      kc[i] = vc[i] = NAN; /* unused slots: a stray read shows */
    int32_t next = pages;    /* page ids from the top down: the block table matters */
    for (int r = 0; r < x->nreq; r++) {
      for (int32_t i = 0; i < (x->kv_lens[r] + P - 1) / P; i++)
        bt[r * max_blocks + i] = next--;
      for (int32_t j = 0; j < x->kv_lens[r]; j++)
        slots[x->cu_kv[r] + j] = bt[r * max_blocks + j / P] * (int32_t)P + (int32_t)(j % P);
    }
    const int64_t sk[3] = {x->Tkv, x->hkv, x->d}, sc[4] = {pages + 1, P, x->hkv, x->d};
    const int64_t sq[3] = {x->Tq, x->hq, x->d}, sl[2] = {x->Tq, x->hq};
    upf_tensor tk = view_of(x->k, UPF_DTYPE_F32, 3, sk), tv = view_of(x->v, UPF_DTYPE_F32, 3, sk);
    upf_tensor tkc = view_of(kc, UPF_DTYPE_F32, 4, sc), tvc = view_of(vc, UPF_DTYPE_F32, 4, sc);
    st = cpu_kv_cache_write(&tk, &tv, slots, slots, &tkc, &tvc);
    upf_tensor tq = view_of(x->q, UPF_DTYPE_F32, 3, sq), to = view_of(out, UPF_DTYPE_F32, 3, sq);
    upf_tensor tl = view_of(lse, UPF_DTYPE_F32, 2, sl);
    upf_attn_paged b = {x->nreq, x->cu_q, x->cu_q, x->kv_lens, x->kv_lens, bt, bt, max_blocks, (int32_t)P};
    if (st == UPF_OK)
      st = cpu_attn_paged(&b, &tq, &tkc, &tvc, p, &to, &tl);
  }
  free(bt), free(slots), free(kc), free(vc);
  return st;
}

static void test_attn_paged_equals_contiguous(void) {
  const int32_t q_lens[4] = {1, 17, 5, 1}, kv_lens[4] = {37, 17, 40, 1};
  inv_data x;
  inv_make(&x, q_lens, kv_lens, 4, 8, 2, 16, 11);
  size_t no = (size_t)(x.Tq * x.hq * x.d), nl = (size_t)(x.Tq * x.hq);
  float *o1 = malloc(no * sizeof(float)), *o2 = malloc(no * sizeof(float));
  float *l1 = malloc(nl * sizeof(float)), *l2 = malloc(nl * sizeof(float));
  CU_ASSERT_FATAL(o1 && o2 && l1 && l2);
  const int64_t pages[3] = {1, 16, 64};
  const int32_t windows[2] = {0, 7};
  for (int w = 0; w < 2; w++) {
    upf_attn_params p = {0.0f, 0.0f, windows[w]};
    CU_ASSERT_EQUAL_FATAL(inv_prefill(&x, &p, o1, l1), UPF_OK);
    for (int i = 0; i < 3; i++) {
      CU_ASSERT_EQUAL_FATAL(inv_paged(&x, pages[i], &p, o2, l2), UPF_OK);
      CU_ASSERT(memcmp(o1, o2, no * sizeof(float)) == 0);
      CU_ASSERT(memcmp(l1, l2, nl * sizeof(float)) == 0);
    }
  }
  free(o1), free(o2), free(l1), free(l2);
  inv_free(&x);
}

/* A prefill of the last q rows against kv = the full sequence equals those rows of the full prefill;
 * a window at least as long as the sequence equals full causal. */
static void test_attn_cached_prefill_and_long_window(void) {
  const int32_t full[2] = {37, 20}, tail_q[2] = {5, 1};
  inv_data all, tail;
  inv_make(&all, full, full, 2, 4, 1, 8, 21);
  inv_make(&tail, tail_q, full, 2, 4, 1, 8, 22);
  memcpy(tail.k, all.k, (size_t)(all.Tkv * all.hkv * all.d) * sizeof(float));
  memcpy(tail.v, all.v, (size_t)(all.Tkv * all.hkv * all.d) * sizeof(float));
  int64_t row = all.hq * all.d;
  for (int r = 0; r < 2; r++) /* tail's queries = the last rows of each request */
    memcpy(tail.q + (int64_t)tail.cu_q[r] * row, all.q + (int64_t)(all.cu_q[r + 1] - tail_q[r]) * row,
           (size_t)(tail_q[r] * row) * sizeof(float));
  float *o_all = malloc((size_t)(all.Tq * row) * sizeof(float)), *l_all = malloc((size_t)(all.Tq * 4) * sizeof(float));
  float *o_w = malloc((size_t)(all.Tq * row) * sizeof(float)), *l_w = malloc((size_t)(all.Tq * 4) * sizeof(float));
  float *o_t = malloc((size_t)(tail.Tq * row) * sizeof(float)), *l_t = malloc((size_t)(tail.Tq * 4) * sizeof(float));
  CU_ASSERT_FATAL(o_all && l_all && o_w && l_w && o_t && l_t);
  const int32_t windows[2] = {0, 6};
  for (int w = 0; w < 2; w++) {
    upf_attn_params p = {0.0f, 0.0f, windows[w]};
    CU_ASSERT_EQUAL_FATAL(inv_prefill(&all, &p, o_all, l_all), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(inv_prefill(&tail, &p, o_t, l_t), UPF_OK);
    for (int r = 0; r < 2; r++) {
      int64_t src = all.cu_q[r + 1] - tail_q[r], dst = tail.cu_q[r];
      CU_ASSERT(memcmp(o_t + dst * row, o_all + src * row, (size_t)(tail_q[r] * row) * sizeof(float)) == 0);
      CU_ASSERT(memcmp(l_t + dst * 4, l_all + src * 4, (size_t)(tail_q[r] * 4) * sizeof(float)) == 0);
    }
  }
  upf_attn_params full_p = {0}, long_w = {0.0f, 0.0f, 37}, huge_w = {0.0f, 0.0f, 1 << 30};
  CU_ASSERT_EQUAL_FATAL(inv_prefill(&all, &full_p, o_all, l_all), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(inv_prefill(&all, &long_w, o_w, l_w), UPF_OK);
  CU_ASSERT(memcmp(o_all, o_w, (size_t)(all.Tq * row) * sizeof(float)) == 0);
  CU_ASSERT(memcmp(l_all, l_w, (size_t)(all.Tq * 4) * sizeof(float)) == 0);
  CU_ASSERT_EQUAL_FATAL(inv_prefill(&all, &huge_w, o_w, l_w), UPF_OK);
  CU_ASSERT(memcmp(o_all, o_w, (size_t)(all.Tq * row) * sizeof(float)) == 0);
  free(o_all), free(l_all), free(o_w), free(l_w), free(o_t), free(l_t);
  inv_free(&all), inv_free(&tail);
}

/* The reference's truth path equals its rounded path to within one f32 rounding. */
static void test_attn_truth_matches(void) {
  const int32_t lens[2] = {9, 30};
  inv_data x;
  inv_make(&x, lens, lens, 2, 2, 2, 8, 31);
  size_t n = (size_t)(x.Tq * x.hq * x.d);
  float *o = malloc(n * sizeof(float)), *l = malloc((size_t)(x.Tq * x.hq) * sizeof(float));
  double *truth = malloc(n * sizeof(double));
  CU_ASSERT_FATAL(o && l && truth);
  upf_attn_params p = {0.0f, 30.0f, 0};
  CU_ASSERT_EQUAL_FATAL(inv_prefill(&x, &p, o, l), UPF_OK);
  const int64_t sq[3] = {x.Tq, x.hq, x.d}, sk[3] = {x.Tkv, x.hkv, x.d};
  upf_tensor tq = view_of(x.q, UPF_DTYPE_F32, 3, sq), tk = view_of(x.k, UPF_DTYPE_F32, 3, sk);
  upf_tensor tv = view_of(x.v, UPF_DTYPE_F32, 3, sk);
  upf_attn_varlen b = {x.nreq, x.cu_q, x.cu_q, x.cu_kv, x.cu_kv};
  CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_f64(&b, &tq, &tk, &tv, &p, truth), UPF_OK);
  for (size_t i = 0; i < n; i++)
    CU_ASSERT_EQUAL(o[i], (float)truth[i]);
  free(o), free(l), free(truth);
  inv_free(&x);
}


/* The blocked dgemm path equals the naive loops (the oracle) to within the reordering of double sums:
 * GQA groups of 1, 3 and 6, requests longer than one query block (64), windows shorter and longer than
 * a block, soft-cap, a prefill against cached keys (kv_len > q_len) and one-token requests. */
static void test_attn_blocked_equals_naive(void) {
  const int32_t q_lens[4] = {150, 1, 70, 9}, kv_lens[4] = {150, 33, 200, 9};
  const int64_t groups[3][2] = {{6, 6}, {6, 2}, {6, 1}};
  const upf_attn_params params[4] = {{0.0f, 0.0f, 0}, {0.0f, 0.0f, 7}, {0.3f, 5.0f, 70}, {0.0f, 30.0f, 0}};
  for (int g = 0; g < 3; g++) {
    inv_data x;
    inv_make(&x, q_lens, kv_lens, 4, groups[g][0], groups[g][1], 16, 41 + (uint64_t)g);
    const size_t n = (size_t)(x.Tq * x.hq * x.d), nl = (size_t)(x.Tq * x.hq);
    double *fast = malloc(n * sizeof(double)), *slow = malloc(n * sizeof(double));
    float *o = malloc(n * sizeof(float)), *l_fast = malloc(nl * sizeof(float)), *l_slow = malloc(nl * sizeof(float));
    CU_ASSERT_FATAL(fast && slow && o && l_fast && l_slow);
    const int64_t sq[3] = {x.Tq, x.hq, x.d}, sk[3] = {x.Tkv, x.hkv, x.d}, sl[2] = {x.Tq, x.hq};
    upf_tensor tq = view_of(x.q, UPF_DTYPE_F32, 3, sq), tk = view_of(x.k, UPF_DTYPE_F32, 3, sk);
    upf_tensor tv = view_of(x.v, UPF_DTYPE_F32, 3, sk), tl = view_of(l_slow, UPF_DTYPE_F32, 2, sl);
    upf_attn_varlen b = {x.nreq, x.cu_q, x.cu_q, x.cu_kv, x.cu_kv};
    for (int i = 0; i < 4; i++) {
      CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_f64(&b, &tq, &tk, &tv, &params[i], fast), UPF_OK);
      CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_naive(&b, &tq, &tk, &tv, &params[i], slow, &tl), UPF_OK);
      CU_ASSERT_EQUAL_FATAL(inv_prefill(&x, &params[i], o, l_fast), UPF_OK);
      double worst = 0.0, worst_lse = 0.0;
      for (size_t e = 0; e < n; e++) {
        const double err = fabs(fast[e] - slow[e]) / (fabs(slow[e]) + 1e-3);
        worst = err > worst ? err : worst;
        CU_ASSERT_EQUAL(o[e], (float)fast[e]); /* the rounded path is the truth rounded */
      }
      for (size_t e = 0; e < nl; e++) {
        const double err = fabs((double)l_fast[e] - l_slow[e]) / (fabs(l_slow[e]) + 1.0);
        worst_lse = err > worst_lse ? err : worst_lse;
      }
      CU_ASSERT(worst < 1e-12);
      CU_ASSERT(worst_lse < 2e-7); /* one f32 rounding of the same double */
      if (worst >= 1e-12 || worst_lse >= 2e-7)
        fprintf(stderr, "blocked vs naive: group %lld, case %d: out %.3g, lse %.3g\n",
                (long long)(x.hq / x.hkv), i, worst, worst_lse);
    }
    free(fast), free(slow), free(o), free(l_fast), free(l_slow);
    inv_free(&x);
  }
  /* 70 queries against 11000 keys, 6 query heads on one kv head: the score block's budget (4M doubles)
   * holds fewer than 64 queries (63), so the request spans two blocks of a smaller size */
  if (upf_test_quick()) {
    printf("(long-kv case skipped under UPF_TEST_QUICK) ");
    return;
  }
  const int32_t q_long[1] = {70}, kv_long[1] = {11000};
  inv_data y;
  inv_make(&y, q_long, kv_long, 1, 6, 1, 4, 51);
  const size_t n = (size_t)(y.Tq * y.hq * y.d);
  double *fast = malloc(n * sizeof(double)), *slow = malloc(n * sizeof(double));
  CU_ASSERT_FATAL(fast && slow);
  const int64_t sq[3] = {y.Tq, y.hq, y.d}, sk[3] = {y.Tkv, y.hkv, y.d};
  upf_tensor tq = view_of(y.q, UPF_DTYPE_F32, 3, sq), tk = view_of(y.k, UPF_DTYPE_F32, 3, sk);
  upf_tensor tv = view_of(y.v, UPF_DTYPE_F32, 3, sk);
  upf_attn_varlen b = {y.nreq, y.cu_q, y.cu_q, y.cu_kv, y.cu_kv};
  for (int i = 0; i < 2; i++) {
    const upf_attn_params p = {0.0f, 0.0f, i ? 5000 : 0};
    CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_f64(&b, &tq, &tk, &tv, &p, fast), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_naive(&b, &tq, &tk, &tv, &p, slow, NULL), UPF_OK);
    double worst = 0.0;
    for (size_t e = 0; e < n; e++)
      worst = fmax(worst, fabs(fast[e] - slow[e]) / (fabs(slow[e]) + 1e-3));
    CU_ASSERT(worst < 1e-12);
  }
  free(fast), free(slow);
  inv_free(&y);
}

/* ---- the verify entries ---- */

/* Goldens and bad inputs (each expecting its status) on the CPU. */
static void test_attn_verify_entries_cpu(void) {
  upf_test_verify_op(UPF_OP_ATTN_PREFILL, upf_backend_cpu(), 4);
  upf_test_verify_op(UPF_OP_ATTN_PAGED, upf_backend_cpu(), 4);
  upf_test_verify_op(UPF_OP_KV_CACHE_WRITE, upf_backend_cpu(), 4);
}

/* The quick seeded cases through the harness with the CPU reference standing in for the backend under
 * test (case set-up, paging, poison, guard bytes, without a GPU). Too slow for Valgrind. */
static void test_attn_verify_cases_on_cpu_twin(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK) ");
    return;
  }
  const upf_op ops[] = {UPF_OP_ATTN_PREFILL, UPF_OP_ATTN_PAGED, UPF_OP_KV_CACHE_WRITE};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    upf_test_verify_op(ops[i], upf_test_cpu_twin(), 8);
}

static int count_of(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p++)
    n++;
  return n;
}

/* Under a selected variant the quick seeded cases pass and name it on the bf16 lines whose kernel it
 * picks (each case: out and lse), nowhere else: not on f32 lines, not at other head dims. */
static void test_attn_verify_names_variant(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK) ");
    return;
  }
  const struct {
    upf_variant variant;
    const char *named;   /* bf16 lines: "<variant>: <case>" */
    const char *bare;    /* a case the variant does not pick (NULL: none in the quick set): never named */
  } runs[] = {
      {UPF_VARIANT_ATTN_PREFILL_FA2, "fa2: ragged, GQA 1 [", "odd D=80, GQA 3 ["},
      {UPF_VARIANT_ATTN_PAGED_FFMA, "ffma: decode, mixed lengths, page 16 [", NULL},
  };
  for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
    const upf_op op = upf_variant_op(runs[i].variant);
    char *text = NULL;
    size_t len = 0;
    FILE *log = open_memstream(&text, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(log);
    upf_variant_select(runs[i].variant);
    upf_verify_ctx ctx = {.backend = upf_test_cpu_twin(), .log = log, .quick = 1};
    upf_verify_fn_for(op)(&ctx);
    upf_variant_reset(op);
    fclose(log);
    CU_ASSERT_EQUAL(ctx.failed, 0);
    CU_ASSERT_EQUAL(count_of(text, runs[i].named), 2);                 /* bf16: out and lse */
    CU_ASSERT_EQUAL(count_of(text, runs[i].named + strlen(upf_variant_name(runs[i].variant)) + 2), 4);
    if (runs[i].bare) {
      CU_ASSERT_EQUAL(count_of(text, runs[i].bare), 4); /* f32 and bf16, out and lse */
      char named_bare[96];
      snprintf(named_bare, sizeof named_bare, ": %s", runs[i].bare);
      CU_ASSERT_EQUAL(count_of(text, named_bare), 0);
    }
    free(text);
  }
}

static CU_TestInfo attn_tests[] = {
    {"by hand: one and two keys, uniform, window 1, soft-cap, GQA, scales, flops", test_attn_by_hand},
    {"paged (P = 1, 16, 64) == contiguous, via the cache write", test_attn_paged_equals_contiguous},
    {"cached prefill == last rows; window >= length == causal", test_attn_cached_prefill_and_long_window},
    {"rounded output == fp64 truth rounded", test_attn_truth_matches},
    {"blocked dgemm path == naive loops: GQA, windows, soft-cap, cached keys, > 1 query block",
     test_attn_blocked_equals_naive},
    {"attention verify entries pass on the cpu (goldens, bad inputs)", test_attn_verify_entries_cpu},
    {"attention verify cases through the harness (cpu twin)", test_attn_verify_cases_on_cpu_twin},
    {"verify lines name the attn.prefill / attn.paged variant in effect where it picks the kernel",
     test_attn_verify_names_variant},
    CU_TEST_INFO_NULL,
};

void upf_register_attn_tests(void) { upf_test_suite("attention (cpu reference)", NULL, NULL, attn_tests); }

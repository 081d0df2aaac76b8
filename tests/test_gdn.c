/* The Gated DeltaNet ops on the CPU reference: hand-computed tiny cases (a Dk = Dv = 2 scan, the gate
 * math, the L2 norm, conv1d), the invariants (g = 0 and beta = 0 keep the state, beta = 1 with a unit
 * k overwrites the memory along k, a prefill of n then m single steps equals a prefill of n+m, a
 * batch equals its requests one by one), bad inputs returning their statuses, the model constants,
 * and the verify entries (on the CPU, and their seeded cases through the harness on a CPU twin); host
 * replays of the CUDA scans' arithmetic (recurrent fp32, chunked bf16) through the verify cases. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/gdn.h"
#include "tests/test_util.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model_config.h"
#include "uniprefill/rng.h"

static upf_tensor view_of(void *data, upf_dtype dt, int ndim, const int64_t *shape) {
  upf_tensor t;
  upf_tensor_init(&t, data, dt, ndim, shape);
  return t;
}

static void test_gates_and_l2norm(void) {
  double g, beta;
  /* a + dt_bias = 0, A_log = 0: g = -softplus(0) = -ln 2, beta = sigmoid(0) = 1/2. */
  ref_gdn_gates(0.5, 0.0, 0.0, -0.5, &g, &beta);
  CU_ASSERT_DOUBLE_EQUAL(g, -log(2.0), 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(beta, 0.5, 0.0);
  /* A_log = ln 3 triples the decay rate; softplus above torch's threshold 20 is the identity. */
  ref_gdn_gates(30.0, 2.0, log(3.0), 0.0, &g, &beta);
  CU_ASSERT_DOUBLE_EQUAL(g, -90.0, 1e-12);
  CU_ASSERT_DOUBLE_EQUAL(beta, 1.0 / (1.0 + exp(-2.0)), 1e-15);
  ref_gdn_gates(-800.0, -800.0, 0.0, 0.0, &g, &beta); /* no NaN at the ends */
  CU_ASSERT(g <= 0.0 && g > -1e-300 && beta >= 0.0 && beta < 1e-300);
  double x[2] = {3, 4};
  ref_gdn_l2norm(x, 2);
  CU_ASSERT_DOUBLE_EQUAL(x[0], 3.0 / sqrt(25.0 + 1e-6), 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(x[1], 4.0 / sqrt(25.0 + 1e-6), 1e-15);
  double z[2] = {0, 0}; /* eps keeps a zero row finite */
  ref_gdn_l2norm(z, 2);
  CU_ASSERT(z[0] == 0.0 && z[1] == 0.0);
}

/* Scan inputs for one request of Dk = Dv = 2, one key head, Hv value heads, host f32. */
typedef struct {
  float q[8], k[8], v[16], a[8], b[8], a_log[2], dt_bias[2], s[16], o[16];
  upf_tensor tq, tk, tv, ta, tb, tal, tdt, ts, to;
} scan2;

static void scan2_init(scan2 *c, int64_t T, int64_t Hv) {
  const int64_t sq[3] = {T, 1, 2}, sv[3] = {T, Hv, 2}, sab[2] = {T, Hv}, sh[1] = {Hv}, ss[4] = {1, Hv, 2, 2};
  c->tq = view_of(c->q, UPF_DTYPE_F32, 3, sq), c->tk = view_of(c->k, UPF_DTYPE_F32, 3, sq);
  c->tv = view_of(c->v, UPF_DTYPE_F32, 3, sv), c->to = view_of(c->o, UPF_DTYPE_F32, 3, sv);
  c->ta = view_of(c->a, UPF_DTYPE_F32, 2, sab), c->tb = view_of(c->b, UPF_DTYPE_F32, 2, sab);
  c->tal = view_of(c->a_log, UPF_DTYPE_F32, 1, sh), c->tdt = view_of(c->dt_bias, UPF_DTYPE_F32, 1, sh);
  c->ts = view_of(c->s, UPF_DTYPE_F32, 4, ss);
}

static upf_status scan2_run(scan2 *c, int32_t T, float scale) {
  const int32_t cu[2] = {0, T};
  upf_gdn_batch batch = {cu, cu, 1};
  upf_gdn_scan_inputs in = {&c->tq, &c->tk, &c->tv, &c->ta, &c->tb, &c->tal, &c->tdt, &c->ts, scale};
  return cpu_gdn_scan(&batch, &in, &c->to, &c->ts);
}

/* S = [[1, 2], [3, 4]] (rows: key dim, columns: value dim). Decay 1 (a = -100), beta 1 (b = 100).
 * t0: k = e0, v = (5, 6): S^T k = (1, 2), delta = (4, 4): row 0 becomes (5, 6); q = e1 reads row 1 = (3, 4).
 * t1: k = e1, v = (7, 8): row 1 becomes (7, 8); q = e0 reads row 0 = (5, 6). scale 1/2 halves o. */
static void test_scan_by_hand_2x2(void) {
  scan2 c;
  memset(&c, 0, sizeof c);
  scan2_init(&c, 2, 1);
  const float s0[4] = {1, 2, 3, 4};
  memcpy(c.s, s0, sizeof s0);
  const float q[4] = {0, 1000, 1000, 0}, k[4] = {1000, 0, 0, 1000}, v[4] = {5, 6, 7, 8};
  memcpy(c.q, q, sizeof q), memcpy(c.k, k, sizeof k), memcpy(c.v, v, sizeof v);
  c.a[0] = c.a[1] = -100.0f, c.b[0] = c.b[1] = 100.0f;
  CU_ASSERT_EQUAL_FATAL(scan2_run(&c, 2, 0.5f), UPF_OK);
  const double o[4] = {1.5, 2, 2.5, 3}, s[4] = {5, 6, 7, 8};
  for (int i = 0; i < 4; i++) {
    CU_ASSERT_DOUBLE_EQUAL(c.o[i], o[i], 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(c.s[i], s[i], 1e-6);
  }
}

/* g = 0 (decay 1) and beta = 0 leave the state exactly as it was; o = S^T q. */
static void test_scan_keeps_state(void) {
  scan2 c;
  memset(&c, 0, sizeof c);
  scan2_init(&c, 3, 2);
  for (int i = 0; i < 8; i++)
    c.s[i] = (float)(i + 1) * 0.25f;
  for (int t = 0; t < 3; t++) {
    c.q[2 * t] = 1000.0f, c.k[2 * t] = (float)(t + 1), c.k[2 * t + 1] = -2.0f;
    for (int h = 0; h < 2; h++) {
      c.a[t * 2 + h] = -100.0f, c.b[t * 2 + h] = -100.0f;
      c.v[(t * 2 + h) * 2] = 50.0f, c.v[(t * 2 + h) * 2 + 1] = -50.0f;
    }
  }
  float before[8];
  memcpy(before, c.s, sizeof before);
  CU_ASSERT_EQUAL_FATAL(scan2_run(&c, 3, 1.0f), UPF_OK);
  CU_ASSERT(memcmp(before, c.s, sizeof before) == 0);
  /* q = e0 reads row 0 of each head's state: head 0 (0.25, 0.5), head 1 (1.25, 1.5). */
  CU_ASSERT_DOUBLE_EQUAL(c.o[4 * 2 + 0], 0.25, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(c.o[4 * 2 + 3], 1.5, 1e-6);
}

/* beta = 1 with a unit k: afterwards S^T k = v exactly (the memory along k is overwritten), and the
 * directions orthogonal to k are untouched. */
static void test_scan_overwrites_along_k(void) {
  scan2 c;
  memset(&c, 0, sizeof c);
  scan2_init(&c, 1, 1);
  const float s0[4] = {1, -2, 3, 0.5f};
  memcpy(c.s, s0, sizeof s0);
  const double kx = 0.6, ky = 0.8; /* unit: L2 norm changes it by 5e-7 relative only */
  c.k[0] = 0.6f, c.k[1] = 0.8f, c.q[0] = 1.0f;
  c.v[0] = 9.0f, c.v[1] = -7.0f;
  c.a[0] = -100.0f, c.b[0] = 100.0f;
  CU_ASSERT_EQUAL_FATAL(scan2_run(&c, 1, 1.0f), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(c.s[0] * kx + c.s[2] * ky, 9.0, 1e-4);
  CU_ASSERT_DOUBLE_EQUAL(c.s[1] * kx + c.s[3] * ky, -7.0, 1e-4);
  /* the orthogonal direction (-0.8, 0.6) reads what it read before */
  CU_ASSERT_DOUBLE_EQUAL(-0.8 * c.s[0] + 0.6 * c.s[2], -0.8 * 1 + 0.6 * 3, 1e-4);
  CU_ASSERT_DOUBLE_EQUAL(-0.8 * c.s[1] + 0.6 * c.s[3], -0.8 * -2 + 0.6 * 0.5, 1e-4);
}

/* Depthwise conv, K = 4, two channels, one request of 5 tokens from zeros: y_t = silu(sum_j w_j x_{t-3+j}).
 * Channel 0: w = (0, 0, 0, 1) passes x through silu; channel 1: w = (1, 1, 1, 1) is a moving sum. */
static void test_conv_by_hand(void) {
  float x[10], w[8] = {0, 0, 0, 1, 1, 1, 1, 1}, y[10], so[6];
  for (int t = 0; t < 5; t++)
    x[2 * t] = (float)(t + 1), x[2 * t + 1] = (float)(10 * (t + 1));
  const int64_t sx[2] = {5, 2}, sw[2] = {2, 4}, ss[3] = {1, 3, 2};
  upf_tensor tx = view_of(x, UPF_DTYPE_F32, 2, sx), tw = view_of(w, UPF_DTYPE_F32, 2, sw);
  upf_tensor ty = view_of(y, UPF_DTYPE_F32, 2, sx), ts = view_of(so, UPF_DTYPE_F32, 3, ss);
  const int32_t cu[2] = {0, 5};
  upf_gdn_batch batch = {cu, cu, 1};
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_conv(&batch, &tx, &tw, NULL, &ts, &ty), UPF_OK);
  const double sums[5] = {10, 30, 60, 100, 140};
  for (int t = 0; t < 5; t++) {
    CU_ASSERT_DOUBLE_EQUAL(y[2 * t], upf_gdn_silu(t + 1), 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(y[2 * t + 1], upf_gdn_silu(sums[t]), 1e-4);
  }
  const float want_state[6] = {3, 30, 4, 40, 5, 50}; /* the last three inputs, oldest first */
  CU_ASSERT(memcmp(so, want_state, sizeof so) == 0);
  /* The step from that state with token (6, 60): moving sum 30 + 40 + 50 + 60. */
  float xs[2] = {6, 60}, ys[2];
  const int64_t s12[2] = {1, 2};
  upf_tensor txs = view_of(xs, UPF_DTYPE_F32, 2, s12), tys = view_of(ys, UPF_DTYPE_F32, 2, s12);
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_conv_step(&txs, &tw, &ts, &tys), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(ys[1], upf_gdn_silu(180.0), 1e-4);
  CU_ASSERT_DOUBLE_EQUAL(ys[0], upf_gdn_silu(6.0), 1e-6);
  CU_ASSERT(so[0] == 4 && so[1] == 40 && so[4] == 6 && so[5] == 60);
}

/* A conv prefill of n tokens then m steps equals a prefill of n+m, bit for bit (same double sums). */
static void test_conv_prefill_then_steps(void) {
  enum { N = 2, M = 4, C = 3, K = 4 };
  float x[(N + M) * C], w[C * K], y_full[(N + M) * C], y_pre[N * C], y_step[C], s_in[(K - 1) * C], s[(K - 1) * C],
      s_full[(K - 1) * C];
  for (int i = 0; i < (N + M) * C; i++)
    x[i] = (float)((i * 37) % 11) - 5.0f;
  for (int i = 0; i < C * K; i++)
    w[i] = (float)((i * 5) % 7) * 0.25f - 0.5f;
  for (int i = 0; i < (K - 1) * C; i++)
    s_in[i] = (float)i - 4.0f;
  const int64_t sx[2] = {N + M, C}, sp[2] = {N, C}, sw[2] = {C, K}, ss[3] = {1, K - 1, C}, s1[2] = {1, C};
  upf_tensor tx = view_of(x, UPF_DTYPE_F32, 2, sx), tw = view_of(w, UPF_DTYPE_F32, 2, sw);
  upf_tensor tyf = view_of(y_full, UPF_DTYPE_F32, 2, sx), tsi = view_of(s_in, UPF_DTYPE_F32, 3, ss);
  upf_tensor tsf = view_of(s_full, UPF_DTYPE_F32, 3, ss), ts = view_of(s, UPF_DTYPE_F32, 3, ss);
  const int32_t cu_full[2] = {0, N + M}, cu_pre[2] = {0, N};
  upf_gdn_batch bf = {cu_full, cu_full, 1}, bp = {cu_pre, cu_pre, 1};
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_conv(&bf, &tx, &tw, &tsi, &tsf, &tyf), UPF_OK);
  upf_tensor txp = view_of(x, UPF_DTYPE_F32, 2, sp), typ = view_of(y_pre, UPF_DTYPE_F32, 2, sp);
  /* N = 2 < K-1: the final state still holds one entry of the initial state. */
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_conv(&bp, &txp, &tw, &tsi, &ts, &typ), UPF_OK);
  CU_ASSERT(memcmp(y_pre, y_full, sizeof y_pre) == 0);
  for (int t = N; t < N + M; t++) {
    upf_tensor txs = view_of(x + t * C, UPF_DTYPE_F32, 2, s1), tys = view_of(y_step, UPF_DTYPE_F32, 2, s1);
    CU_ASSERT_EQUAL_FATAL(cpu_gdn_conv_step(&txs, &tw, &ts, &tys), UPF_OK);
    CU_ASSERT(memcmp(y_step, y_full + t * C, sizeof y_step) == 0);
  }
  CU_ASSERT(memcmp(s, s_full, sizeof s) == 0);
}

static void test_gated_norm_by_hand(void) {
  /* (T=1, H=1, D=2) o = [3, 4], z = [1, -1], w = [1, 2]: y = o / rms * w * silu(z). */
  float o[2] = {3, 4}, z[2] = {1, -1}, w[2] = {1, 2}, y[2];
  const int64_t s3[3] = {1, 1, 2}, s1[1] = {2};
  upf_tensor to = view_of(o, UPF_DTYPE_F32, 3, s3), tz = view_of(z, UPF_DTYPE_F32, 3, s3);
  upf_tensor tw = view_of(w, UPF_DTYPE_F32, 1, s1), ty = view_of(y, UPF_DTYPE_F32, 3, s3);
  upf_norm_params p = {UPF_QWEN3N_80B_LINEAR_NORM_EPS, 0};
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_gated_norm(&to, &tz, &tw, &p, &ty), UPF_OK);
  double r = sqrt(12.5 + 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(y[0], 3.0 / r * upf_gdn_silu(1.0), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(y[1], 8.0 / r * upf_gdn_silu(-1.0), 1e-6);
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_gated_norm(&to, &tz, &tw, &p, &to), UPF_OK); /* in place */
  CU_ASSERT(memcmp(o, y, sizeof y) == 0);
}

static void test_bad_inputs(void) {
  float buf[256] = {0};
  const int64_t sq[3] = {4, 2, 8}, sv[3] = {4, 4, 8}, sab[2] = {4, 4}, sh[1] = {4};
  upf_tensor q = view_of(buf, UPF_DTYPE_F32, 3, sq), k = q, v = view_of(buf, UPF_DTYPE_F32, 3, sv);
  upf_tensor a = view_of(buf, UPF_DTYPE_F32, 2, sab), b = a, al = view_of(buf, UPF_DTYPE_F32, 1, sh), dt = al;
  upf_tensor o = v;
  const int32_t cu[3] = {0, 2, 4}, cu_short[3] = {0, 2, 3};
  upf_gdn_batch batch = {cu, cu, 2}, bad = {cu_short, cu_short, 2}, neg = {cu, cu, -1};
  upf_gdn_scan_inputs in = {&q, &k, &v, &a, &b, &al, &dt, NULL, 0.125f};
  CU_ASSERT_EQUAL(cpu_gdn_scan(&batch, &in, &o, NULL), UPF_OK);
  CU_ASSERT_EQUAL(cpu_gdn_scan(&bad, &in, &o, NULL), UPF_ERR_CU_SEQLENS);
  CU_ASSERT(strstr(upf_last_error(), "gdn.scan") != NULL);
  CU_ASSERT_EQUAL(cpu_gdn_scan(&neg, &in, &o, NULL), UPF_ERR_CU_SEQLENS);
  CU_ASSERT_EQUAL(cpu_gdn_scan(NULL, &in, &o, NULL), UPF_ERR_INVALID_ARG);
  in.scale = NAN;
  CU_ASSERT_EQUAL(cpu_gdn_scan(&batch, &in, &o, NULL), UPF_ERR_INVALID_ARG);
  in.scale = 0.125f;
  upf_tensor v_odd = view_of(buf, UPF_DTYPE_F32, 3, (const int64_t[3]){4, 3, 8});
  in.v = &v_odd;
  CU_ASSERT_EQUAL(cpu_gdn_scan(&batch, &in, &o, NULL), UPF_ERR_SHAPE);
  CU_ASSERT(strstr(upf_last_error(), "a (T, Hv)") != NULL); /* a no longer matches Hv = 3 */
  in.v = &v;
  upf_tensor o16 = v;
  o16.dtype = UPF_DTYPE_BF16;
  CU_ASSERT_EQUAL(cpu_gdn_scan(&batch, &in, &o16, NULL), UPF_ERR_DTYPE); /* f32 inputs give f32 o */
  upf_tensor st = view_of(buf, UPF_DTYPE_F32, 4, (const int64_t[4]){2, 4, 8, 8});
  st.data = NULL;
  in.state_in = &st;
  CU_ASSERT_EQUAL(cpu_gdn_scan(&batch, &in, &o, NULL), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "state_in") != NULL);
  in.state_in = NULL;
  upf_tensor qs = q;
  qs.stride[2] = 2;
  in.q = &qs;
  CU_ASSERT_EQUAL(cpu_gdn_scan(&batch, &in, &o, NULL), UPF_ERR_SHAPE);
}

static void test_model_constants(void) {
  CU_ASSERT_EQUAL(UPF_QWEN3N_80B_LINEAR_VALUE_HEADS % UPF_QWEN3N_80B_LINEAR_KEY_HEADS, 0);
  CU_ASSERT_EQUAL(UPF_QWEN3N_80B_LINEAR_CONV_DIM, 8192);
  CU_ASSERT_EQUAL(UPF_QWEN3N_80B_LINEAR_CONV_KERNEL, 4);
}

/* Each op's own verify entry on the CPU: golden cases, bad inputs, the boundary invariants. */
static void test_verify_entries_cpu(void) {
  for (int op = UPF_OP_GDN_CONV; op <= UPF_OP_GDN_GATED_NORM; op++)
    upf_test_verify_op((upf_op)op, upf_backend_cpu(), 2);
}

/* The quick seeded cases through the harness with the CPU reference as the backend under test. */
static void test_verify_cases_on_cpu_twin(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK) ");
    return;
  }
  for (int op = UPF_OP_GDN_CONV; op <= UPF_OP_GDN_GATED_NORM; op++)
    upf_test_verify_op((upf_op)op, upf_test_cpu_twin(), 2);
}

/* The chunked (WY / UT-transform) form equals the recurrence: ragged requests around the chunk size
 * (1, 63, 64, 65, 150 tokens, an empty one), chunks of 64 and 16, initial states, gates as in real use. */
static void test_chunked_equals_recurrent(void) {
  enum { HK = 1, HV = 2, DK = 16, DV = 8, B = 6 };
  const int32_t lens[B] = {1, 63, 64, 0, 65, 150};
  int32_t cu[B + 1] = {0};
  for (int r = 0; r < B; r++)
    cu[r + 1] = cu[r] + lens[r];
  const int64_t T = cu[B], ns = (int64_t)B * HV * DK * DV;
  float *qk = malloc((size_t)T * 2 * HK * DK * sizeof *qk), *v = malloc((size_t)T * HV * DV * sizeof *v);
  float *ab = malloc((size_t)T * 2 * HV * sizeof *ab), *s0 = malloc((size_t)ns * sizeof *s0);
  float *o = malloc((size_t)T * HV * DV * sizeof *o), *s1 = malloc((size_t)ns * sizeof *s1);
  double *o_rec = malloc((size_t)T * HV * DV * sizeof *o_rec), *o_chk = malloc((size_t)T * HV * DV * sizeof *o_chk);
  double *s_chk = malloc((size_t)ns * sizeof *s_chk);
  CU_ASSERT_FATAL(qk && v && ab && s0 && o && s1 && o_rec && o_chk && s_chk);
  upf_rng rng;
  upf_rng_seed(&rng, 99);
  upf_rng_fill_normal(&rng, qk, T * 2 * HK * DK, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, v, T * HV * DV, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, s0, ns, 0.0f, 0.5f);
  float a_log[HV] = {0.5f, -0.25f}, dt_bias[HV] = {1.0f, -1.5f};
  for (int64_t t = 0; t < T; t++)
    for (int h = 0; h < HV; h++) {
      /* g log-uniform in [-20, -1e-4], inverted through g = -exp(a_log) softplus(a + dt_bias) */
      double g = -exp(log(1e-4) + (log(20.0) - log(1e-4)) * upf_rng_uniform(&rng));
      double sp = -g / exp(a_log[h]);
      ab[t * 2 * HV + h] = (float)((sp > 20.0 ? sp : log(expm1(sp))) - dt_bias[h]);
      ab[t * 2 * HV + HV + h] = 8.0f * upf_rng_uniform(&rng) - 4.0f;
    }
  const int64_t sq[3] = {T, HK, DK}, sv[3] = {T, HV, DV}, sab[2] = {T, HV}, sh[1] = {HV}, ss[4] = {B, HV, DK, DV};
  upf_tensor tq = view_of(qk, UPF_DTYPE_F32, 3, sq), tk = view_of(qk + HK * DK, UPF_DTYPE_F32, 3, sq);
  tq.stride[0] = tk.stride[0] = 2 * HK * DK;
  upf_tensor tv = view_of(v, UPF_DTYPE_F32, 3, sv), to = view_of(o, UPF_DTYPE_F32, 3, sv);
  upf_tensor ta = view_of(ab, UPF_DTYPE_F32, 2, sab), tb = view_of(ab + HV, UPF_DTYPE_F32, 2, sab);
  ta.stride[0] = tb.stride[0] = 2 * HV;
  upf_tensor tal = view_of(a_log, UPF_DTYPE_F32, 1, sh), tdt = view_of(dt_bias, UPF_DTYPE_F32, 1, sh);
  upf_tensor ts0 = view_of(s0, UPF_DTYPE_F32, 4, ss), ts1 = view_of(s1, UPF_DTYPE_F32, 4, ss);
  upf_gdn_batch batch = {cu, cu, B};
  upf_gdn_scan_inputs in = {&tq, &tk, &tv, &ta, &tb, &tal, &tdt, &ts0, 1.0f / sqrtf((float)DK)};
  CU_ASSERT_EQUAL_FATAL(ref_gdn_scan_f64(&batch, &in, o_rec), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(cpu_gdn_scan(&batch, &in, &to, &ts1), UPF_OK);
  const int64_t chunks[2] = {64, 16};
  for (int c = 0; c < 2; c++) {
    CU_ASSERT_EQUAL_FATAL(ref_gdn_scan_chunked(&batch, &in, chunks[c], o_chk, s_chk), UPF_OK);
    double worst_o = 0.0, worst_s = 0.0;
    for (int64_t i = 0; i < T * HV * DV; i++)
      worst_o = fmax(worst_o, fabs(o_chk[i] - o_rec[i]) / (1e-6 + fabs(o_rec[i])));
    for (int64_t i = 0; i < ns; i++) /* the recurrence's states as stored (f32) */
      worst_s = fmax(worst_s, fabs(s_chk[i] - (double)s1[i]) / (1e-6 + fabs((double)s1[i])));
    if (worst_o > 1e-9 || worst_s > 1e-6)
      printf("\n    chunk %lld: worst relative difference o %.3g, state %.3g\n", (long long)chunks[c], worst_o,
             worst_s);
    CU_ASSERT(worst_o <= 1e-9);
    CU_ASSERT(worst_s <= 1e-6);
  }
  CU_ASSERT_EQUAL(ref_gdn_scan_chunked(&batch, &in, 0, o_chk, NULL), UPF_ERR_INVALID_ARG);
  free(qk), free(v), free(ab), free(s0), free(o), free(s1), free(o_rec), free(o_chk), free(s_chk);
}

/* The CUDA scan kernel's arithmetic, replayed on the host in fp32 in the kernel's order (one column
 * of the state at a time, the same sums, the same gate formulas): run through the verify cases, it
 * shows on a machine without a GPU whether an fp32 state meets the tolerances the device will face. */
static float emu_get(const upf_tensor *t, int64_t off) {
  return t->dtype == UPF_DTYPE_BF16 ? upf_bf16_to_f32(((const uint16_t *)t->data)[off]) : ((const float *)t->data)[off];
}

static upf_status emu_scan(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                           const upf_tensor *state_out) {
  UPF_TRY(upf_gdn_scan_check(batch, in, o, state_out));
  const upf_tensor *q = in->q, *k = in->k, *v = in->v;
  int64_t Hk = q->shape[1], Dk = q->shape[2], Hv = v->shape[1], Dv = v->shape[2];
  float *S = malloc((size_t)(Dk * Dv) * sizeof *S), *sq = malloc((size_t)Dk * sizeof *sq);
  float *sk = malloc((size_t)Dk * sizeof *sk);
  if (!S || !sq || !sk) {
    free(S), free(sq), free(sk);
    return upf_fail(UPF_ERR_NOMEM, "emu scan");
  }
  for (int32_t r = 0; r < batch->num_reqs; r++)
    for (int64_t h = 0; h < Hv; h++) {
      int64_t kh = h / (Hv / Hk), soff = ((int64_t)r * Hv + h) * Dk * Dv;
      for (int64_t i = 0; i < Dk * Dv; i++)
        S[i] = in->state_in ? ((const float *)in->state_in->data)[soff + i] : 0.0f;
      float ea = expf(((const float *)in->a_log->data)[h]), dtb = ((const float *)in->dt_bias->data)[h];
      for (int64_t t = batch->cu_seqlens_host[r]; t < batch->cu_seqlens_host[r + 1]; t++) {
        for (int64_t i = 0; i < Dk; i++)
          sq[i] = emu_get(q, t * q->stride[0] + kh * q->stride[1] + i),
          sk[i] = emu_get(k, t * k->stride[0] + kh * k->stride[1] + i);
        float qq = 0.0f, kk = 0.0f;
        for (int64_t i = 0; i < Dk; i++)
          qq += sq[i] * sq[i], kk += sk[i] * sk[i];
        float rq = in->scale / sqrtf(qq + UPF_GDN_L2_EPS), rk = 1.0f / sqrtf(kk + UPF_GDN_L2_EPS);
        float x = emu_get(in->a, t * in->a->stride[0] + h) + dtb;
        float sp = x > 20.0f ? x : log1pf(expf(x));
        float decay = expf(-ea * sp), beta = 1.0f / (1.0f + expf(-emu_get(in->b, t * in->b->stride[0] + h)));
        for (int64_t j = 0; j < Dv; j++) {
          float m = 0.0f;
          for (int64_t i = 0; i < Dk; i++)
            m += S[i * Dv + j] * sk[i];
          m *= decay * rk;
          float delta = beta * (emu_get(v, t * v->stride[0] + h * v->stride[1] + j) - m), kd = rk * delta, acc = 0.0f;
          for (int64_t i = 0; i < Dk; i++) {
            float sv = S[i * Dv + j] * decay + sk[i] * kd;
            S[i * Dv + j] = sv;
            acc += sv * sq[i];
          }
          float out = acc * rq;
          int64_t oo = t * o->stride[0] + h * o->stride[1] + j;
          if (o->dtype == UPF_DTYPE_BF16)
            ((uint16_t *)o->data)[oo] = upf_bf16_from_f32(out);
          else
            ((float *)o->data)[oo] = out;
        }
      }
      if (state_out)
        memcpy((float *)state_out->data + soff, S, (size_t)(Dk * Dv) * sizeof *S);
    }
  free(S), free(sq), free(sk);
  return UPF_OK;
}

static void test_fp32_state_meets_tolerances(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK) ");
    return;
  }
  upf_backend emulation = *upf_backend_cpu();
  emulation.name = "cpu-fp32-emulation";
  emulation.gdn_scan = emu_scan;
  upf_test_verify_op(UPF_OP_GDN_SCAN, &emulation, 2);
}

/* The CUDA chunked scan's arithmetic (cuda/gdn_chunked.cu), replayed on the host: bf16 operands where
 * the kernel rounds to bf16 (normalised q and k, beta exp(G) k, beta v, T, W, U, P, the state as a
 * matrix operand, V'), fp32 sums and an fp32 state. Run through the verify cases, it shows without a
 * GPU whether that precision meets the tolerances the device will face. Batches the CUDA backend gives
 * to the recurrent kernel go to emu_scan. */
static float rb(float x) { return upf_round_bf16(x); }

static upf_status emu_chunked_scan(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                                   const upf_tensor *state_out) {
  UPF_TRY(upf_gdn_scan_check(batch, in, o, state_out));
  const upf_tensor *q = in->q, *k = in->k, *v = in->v;
  enum { C = 64, D = 128 };
  int32_t longest = 0;
  for (int32_t r = 0; r < batch->num_reqs; r++)
    if (batch->cu_seqlens_host[r + 1] - batch->cu_seqlens_host[r] > longest)
      longest = batch->cu_seqlens_host[r + 1] - batch->cu_seqlens_host[r];
  if (v->dtype != UPF_DTYPE_BF16 || q->shape[2] != D || v->shape[2] != D || longest < 64)
    return emu_scan(batch, in, o, state_out);
  int64_t Hk = q->shape[1], Hv = v->shape[1];
  float *S = malloc(D * D * sizeof *S), *Kn = malloc(C * D * sizeof *Kn), *Qn = malloc(C * D * sizeof *Qn);
  float *Kb = malloc(C * D * sizeof *Kb), *Vb = malloc(C * D * sizeof *Vb), *A = malloc(C * C * sizeof *A);
  float *X = malloc(C * C * sizeof *X), *P = malloc(C * C * sizeof *P), *W = malloc(C * D * sizeof *W);
  float *U = malloc(C * D * sizeof *U), *Vp = malloc(C * D * sizeof *Vp), *Sb = malloc(D * D * sizeof *Sb);
  float G[C], beta[C], gv[C];
  if (!S || !Kn || !Qn || !Kb || !Vb || !A || !X || !P || !W || !U || !Vp || !Sb) {
    free(S), free(Kn), free(Qn), free(Kb), free(Vb), free(A), free(X), free(P), free(W), free(U), free(Vp), free(Sb);
    return upf_fail(UPF_ERR_NOMEM, "emu chunked scan");
  }
  for (int32_t r = 0; r < batch->num_reqs; r++)
    for (int64_t h = 0; h < Hv; h++) {
      int64_t kh = h / (Hv / Hk), soff = ((int64_t)r * Hv + h) * D * D;
      for (int64_t i = 0; i < D * D; i++)
        S[i] = in->state_in ? ((const float *)in->state_in->data)[soff + i] : 0.0f;
      float ea = expf(((const float *)in->a_log->data)[h]), dtb = ((const float *)in->dt_bias->data)[h];
      for (int64_t t0 = batch->cu_seqlens_host[r]; t0 < batch->cu_seqlens_host[r + 1]; t0 += C) {
        int len = (int)(batch->cu_seqlens_host[r + 1] - t0 < C ? batch->cu_seqlens_host[r + 1] - t0 : C);
        for (int j = 0; j < C; j++) {
          gv[j] = beta[j] = 0.0f;
          if (j < len) {
            float x = emu_get(in->a, (t0 + j) * in->a->stride[0] + h) + dtb;
            gv[j] = -ea * (x > 20.0f ? x : log1pf(expf(x)));
            beta[j] = 1.0f / (1.0f + expf(-emu_get(in->b, (t0 + j) * in->b->stride[0] + h)));
          }
          G[j] = (j ? G[j - 1] : 0.0f) + gv[j];
        }
        for (int j = 0; j < C; j++) {
          float qx[D], kx[D], qq = 0.0f, kk = 0.0f;
          for (int d = 0; d < D; d++) {
            int64_t tok = t0 + j;
            qx[d] = j < len ? emu_get(q, tok * q->stride[0] + kh * q->stride[1] + d) : 0.0f;
            kx[d] = j < len ? emu_get(k, tok * k->stride[0] + kh * k->stride[1] + d) : 0.0f;
            qq += qx[d] * qx[d], kk += kx[d] * kx[d];
            Vb[j * D + d] = rb(beta[j] * (j < len ? emu_get(v, tok * v->stride[0] + h * v->stride[1] + d) : 0.0f));
          }
          float rq = in->scale / sqrtf(qq + UPF_GDN_L2_EPS), rk = 1.0f / sqrtf(kk + UPF_GDN_L2_EPS);
          for (int d = 0; d < D; d++) {
            Kn[j * D + d] = rb(kx[d] * rk), Qn[j * D + d] = rb(qx[d] * rq);
            Kb[j * D + d] = rb(beta[j] * expf(G[j]) * kx[d] * rk);
          }
        }
        for (int i = 0; i < C; i++)
          for (int j = 0; j < C; j++) {
            float kk = 0.0f, qk = 0.0f;
            for (int d = 0; d < D; d++)
              kk += Kn[i * D + d] * Kn[j * D + d], qk += Qn[i * D + d] * Kn[j * D + d];
            float dec = expf(fminf(G[i] - G[j], 0.0f));
            A[i * C + j] = j < i ? beta[i] * kk * dec : 0.0f;
            P[i * C + j] = j <= i ? rb(qk * dec) : 0.0f;
          }
        for (int m = 0; m < C; m++)
          for (int i = 0; i < C; i++) {
            float s = 0.0f;
            for (int j = m; j < i; j++)
              s += A[i * C + j] * X[j * C + m];
            X[i * C + m] = i < m ? 0.0f : i == m ? 1.0f : -s;
          }
        for (int i = 0; i < C; i++)
          for (int d = 0; d < D; d++) {
            float w = 0.0f, u = 0.0f;
            for (int j = 0; j < C; j++)
              w += rb(X[i * C + j]) * Kb[j * D + d], u += rb(X[i * C + j]) * Vb[j * D + d];
            W[i * D + d] = rb(w), U[i * D + d] = rb(u);
          }
        for (int64_t e = 0; e < D * D; e++)
          Sb[e] = rb(S[e]);
        for (int i = 0; i < C; i++)
          for (int c = 0; c < D; c++) {
            float ws = 0.0f;
            for (int d = 0; d < D; d++)
              ws += W[i * D + d] * Sb[d * D + c];
            Vp[i * D + c] = U[i * D + c] - ws;
          }
        for (int i = 0; i < len; i++)
          for (int c = 0; c < D; c++) {
            float qs = 0.0f, pv = 0.0f;
            for (int d = 0; d < D; d++)
              qs += Qn[i * D + d] * Sb[d * D + c];
            for (int j = 0; j < C; j++)
              pv += P[i * C + j] * rb(Vp[j * D + c]);
            float out = qs * expf(G[i]) + pv;
            int64_t oo = (t0 + i) * o->stride[0] + h * o->stride[1] + c;
            if (o->dtype == UPF_DTYPE_BF16)
              ((uint16_t *)o->data)[oo] = upf_bf16_from_f32(out);
            else
              ((float *)o->data)[oo] = out;
          }
        float eL = expf(G[C - 1]);
        for (int d = 0; d < D; d++)
          for (int c = 0; c < D; c++) {
            float acc = 0.0f;
            for (int j = 0; j < C; j++)
              acc += Kn[j * D + d] * rb(Vp[j * D + c] * expf(G[C - 1] - G[j]));
            S[d * D + c] = S[d * D + c] * eL + acc;
          }
      }
      if (state_out)
        memcpy((float *)state_out->data + soff, S, (size_t)(D * D) * sizeof *S);
    }
  free(S), free(Kn), free(Qn), free(Kb), free(Vb), free(A), free(X), free(P), free(W), free(U), free(Vp), free(Sb);
  return UPF_OK;
}

static void test_chunked_bf16_meets_tolerances(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK) ");
    return;
  }
  upf_backend emulation = *upf_backend_cpu();
  emulation.name = "cpu-chunked-bf16-emulation";
  emulation.gdn_scan = emu_chunked_scan;
  upf_test_verify_op(UPF_OP_GDN_SCAN, &emulation, 2);
}

static CU_TestInfo gdn_tests[] = {
    {"gates g, beta and the l2 norm by hand", test_gates_and_l2norm},
    {"scan Dk=Dv=2 by hand", test_scan_by_hand_2x2},
    {"scan g=0 beta=0 keeps the state", test_scan_keeps_state},
    {"scan beta=1 unit k overwrites the memory along k", test_scan_overwrites_along_k},
    {"conv1d and its step by hand", test_conv_by_hand},
    {"conv prefill n then m steps == prefill n+m", test_conv_prefill_then_steps},
    {"gated norm by hand, in place", test_gated_norm_by_hand},
    {"chunked (WY) scan == recurrent scan", test_chunked_equals_recurrent},
    {"scan bad inputs", test_bad_inputs},
    {"qwen3-next linear-attention constants", test_model_constants},
    {"gdn verify entries pass on the cpu", test_verify_entries_cpu},
    {"gdn verify cases through the harness (cpu twin)", test_verify_cases_on_cpu_twin},
    {"the cuda chunked scan's bf16 arithmetic on the host meets the verify tolerances",
     test_chunked_bf16_meets_tolerances},
    {"the cuda scan's fp32 arithmetic on the host meets the verify tolerances", test_fp32_state_meets_tolerances},
    CU_TEST_INFO_NULL,
};

void upf_register_gdn_tests(void) { upf_test_suite("gated deltanet (cpu reference)", NULL, NULL, gdn_tests); }

/* The dense ops on the CPU reference: hand-computed small cases per op, their invariants, bad inputs
 * returning their status, the model constants, and the verify harness itself (it must pass a correct
 * backend and catch a wrong value, a write outside the view and a clobbered input). */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/embed.h"
#include "ref_cpu/ffn.h"
#include "ref_cpu/gated_out.h"
#include "ref_cpu/gemm.h"
#include "ref_cpu/logits.h"
#include "ref_cpu/norm.h"
#include "ref_cpu/rope.h"
#include "tests/test_util.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model_config.h"
#include "verify/harness.h"
#include "verify/verify.h"

/* A host tensor over a caller's array. */
static upf_tensor view_of(void *data, upf_dtype dt, int ndim, const int64_t *shape) {
  upf_tensor t;
  upf_tensor_init(&t, data, dt, ndim, shape);
  return t;
}

/* ---- GEMM ---- */

static void test_gemm_by_hand(void) {
  /* a (2, 3) inside a (2, 5) parent at column 1; c (2, 2) inside a (2, 4) parent at column 2. */
  float ap[10] = {9, 1, 2, 3, 9, 9, 4, 5, 6, 9}, b[6] = {1, 0, 0, 1, 1, 1}, cp[8];
  for (int i = 0; i < 8; i++)
    cp[i] = -7.0f;
  const int64_t sa[2] = {2, 3}, sb[2] = {3, 2}, sc[2] = {2, 2};
  upf_tensor a = view_of(ap + 1, UPF_DTYPE_F32, 2, sa), tb = view_of(b, UPF_DTYPE_F32, 2, sb);
  upf_tensor c = view_of(cp + 2, UPF_DTYPE_F32, 2, sc);
  a.stride[0] = 5, c.stride[0] = 4;
  CU_ASSERT_EQUAL_FATAL(cpu_gemm(&a, &tb, &c), UPF_OK);
  const float want[8] = {-7, -7, 4, 5, -7, -7, 10, 11};
  CU_ASSERT(memcmp(cp, want, sizeof want) == 0);
  /* bf16 in, bf16 out: 1/3 sums round once. */
  uint16_t a16[2] = {upf_bf16_from_f32(1.0f), upf_bf16_from_f32(1.0f)}, b16[2], c16[1];
  b16[0] = upf_bf16_from_f32(1.0f / 3.0f), b16[1] = upf_bf16_from_f32(1.0f / 3.0f);
  const int64_t s12[2] = {1, 2}, s21[2] = {2, 1}, s11[2] = {1, 1};
  upf_tensor x = view_of(a16, UPF_DTYPE_BF16, 2, s12), w = view_of(b16, UPF_DTYPE_BF16, 2, s21);
  upf_tensor y = view_of(c16, UPF_DTYPE_BF16, 2, s11);
  CU_ASSERT_EQUAL(cpu_gemm(&x, &w, &y), UPF_OK);
  CU_ASSERT_EQUAL(c16[0], upf_bf16_from_f32(2.0f * upf_bf16_to_f32(b16[0])));
  /* M = 0 is a no-op. */
  const int64_t s03[2] = {0, 3};
  upf_tensor empty_a = view_of(ap, UPF_DTYPE_F32, 2, s03), empty_c = view_of(cp, UPF_DTYPE_F32, 2, (int64_t[2]){0, 2});
  CU_ASSERT_EQUAL(cpu_gemm(&empty_a, &tb, &empty_c), UPF_OK);
}

static void test_gemm_bad_inputs(void) {
  float buf[64] = {0};
  const int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s42[2] = {4, 2}, s22[2] = {2, 2}, s20[2] = {2, 0};
  upf_tensor a = view_of(buf, UPF_DTYPE_F32, 2, s23), b = view_of(buf, UPF_DTYPE_F32, 2, s32);
  upf_tensor c = view_of(buf, UPF_DTYPE_F32, 2, s22), bad;
  bad = view_of(buf, UPF_DTYPE_F32, 2, s42);
  CU_ASSERT_EQUAL(cpu_gemm(&a, &bad, &c), UPF_ERR_SHAPE);
  CU_ASSERT(strstr(upf_last_error(), "b (K, N)") != NULL);
  bad = view_of(buf, UPF_DTYPE_F64, 2, s32);
  CU_ASSERT_EQUAL(cpu_gemm(&a, &bad, &c), UPF_ERR_DTYPE);
  upf_tensor a0 = view_of(buf, UPF_DTYPE_F32, 2, s20), b0 = view_of(buf, UPF_DTYPE_F32, 2, (int64_t[2]){0, 2});
  CU_ASSERT_EQUAL(cpu_gemm(&a0, &b0, &c), UPF_ERR_SHAPE); /* K = 0 */
  bad = a, bad.data = NULL;
  CU_ASSERT_EQUAL(cpu_gemm(&bad, &b, &c), UPF_ERR_INVALID_ARG);
  bad = a, bad.stride[0] = 2; /* rows overlap */
  CU_ASSERT_EQUAL(cpu_gemm(&bad, &b, &c), UPF_ERR_SHAPE);
}

/* ---- activation and FFN ---- */

static void test_activations_by_hand(void) {
  CU_ASSERT_DOUBLE_EQUAL(ref_act(UPF_ACT_SILU, 0.0), 0.0, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(ref_act(UPF_ACT_SILU, 1.0), 1.0 / (1.0 + exp(-1.0)), 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(ref_act(UPF_ACT_SILU, -800.0), 0.0, 1e-300); /* exp overflow gives -0, not NaN */
  CU_ASSERT_DOUBLE_EQUAL(ref_act(UPF_ACT_GELU_TANH, 1.0), 0.8411919906082768, 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(ref_act(UPF_ACT_GELU_TANH, -1.0), -0.15880800939172324, 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(ref_act(UPF_ACT_GELU_TANH, 30.0), 30.0, 1e-12);
  /* act_mul on a (2, 2I) row pair with I = 2. */
  float gu[8] = {1, -1, 2, 3, 0, 2, 5, 7}, h[4];
  const int64_t s24[2] = {2, 4}, s22[2] = {2, 2};
  upf_tensor tgu = view_of(gu, UPF_DTYPE_F32, 2, s24), th = view_of(h, UPF_DTYPE_F32, 2, s22);
  CU_ASSERT_EQUAL_FATAL(cpu_ffn_act_mul(&tgu, UPF_ACT_SILU, &th), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(h[0], 2.0 / (1.0 + exp(-1.0)), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(h[1], -3.0 / (1.0 + exp(1.0)), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(h[2], 0.0, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(h[3], 14.0 / (1.0 + exp(-2.0)), 1e-5);
  CU_ASSERT_EQUAL(cpu_ffn_act_mul(&tgu, UPF_ACT_COUNT, &th), UPF_ERR_INVALID_ARG);
  upf_tensor odd = view_of(gu, UPF_DTYPE_F32, 2, (int64_t[2]){1, 7});
  CU_ASSERT_EQUAL(cpu_ffn_act_mul(&odd, UPF_ACT_SILU, &th), UPF_ERR_SHAPE);
}

static void test_ffn_by_hand(void) {
  /* H = 2, I = 2: gate = [x0, x1], up = [x0 + x1, 1 * x1]; down sums h0 - h1. */
  float x[2] = {1, 2}, wgu[8] = {1, 0, 1, 0, 0, 1, 1, 1}, wd[4] = {1, 0, -1, 0}, y[2];
  const int64_t sx[2] = {1, 2}, sgu[2] = {2, 4}, sd[2] = {2, 2};
  upf_tensor tx = view_of(x, UPF_DTYPE_F32, 2, sx), tgu = view_of(wgu, UPF_DTYPE_F32, 2, sgu);
  upf_tensor td = view_of(wd, UPF_DTYPE_F32, 2, sd), ty = view_of(y, UPF_DTYPE_F32, 2, sx);
  CU_ASSERT_EQUAL_FATAL(cpu_ffn_gated(&tx, &tgu, &td, UPF_ACT_GELU_TANH, &ty), UPF_OK);
  double h0 = ref_act(UPF_ACT_GELU_TANH, 1.0) * 3.0, h1 = ref_act(UPF_ACT_GELU_TANH, 2.0) * 2.0;
  CU_ASSERT_DOUBLE_EQUAL(y[0], h0 - h1, 1e-5);
  CU_ASSERT_DOUBLE_EQUAL(y[1], 0.0, 0.0);
  /* The fp64 truth agrees. */
  double truth[2];
  CU_ASSERT_EQUAL(ref_ffn_f64(&tx, &tgu, &td, UPF_ACT_GELU_TANH, truth), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(truth[0], h0 - h1, 1e-12);
  upf_tensor wrong = view_of(wd, UPF_DTYPE_F32, 2, (int64_t[2]){1, 2});
  CU_ASSERT_EQUAL(cpu_ffn_gated(&tx, &tgu, &wrong, UPF_ACT_SILU, &ty), UPF_ERR_SHAPE);
}

/* ---- norms ---- */

static void test_norms_by_hand(void) {
  float x[4] = {3, 4, 1, 1}, w[2] = {1, 2}, wz[2] = {0, 1}, y[4], y2[4];
  const int64_t sx[2] = {2, 2}, sw[1] = {2};
  upf_norm_params plain = {1e-6f, 0}, zc = {1e-6f, 1};
  upf_tensor tx = view_of(x, UPF_DTYPE_F32, 2, sx), tw = view_of(w, UPF_DTYPE_F32, 1, sw);
  upf_tensor twz = view_of(wz, UPF_DTYPE_F32, 1, sw), ty = view_of(y, UPF_DTYPE_F32, 2, sx);
  upf_tensor ty2 = view_of(y2, UPF_DTYPE_F32, 2, sx);
  CU_ASSERT_EQUAL_FATAL(cpu_rmsnorm(&tx, &tw, &plain, &ty), UPF_OK);
  double r = sqrt(12.5 + 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(y[0], 3.0 / r, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(y[1], 8.0 / r, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(y[2], 1.0 / sqrt(1.0 + 1e-6), 1e-6);
  /* zero-centred w is an offset from 1: w = [0, 1] is the plain [1, 2]. */
  CU_ASSERT_EQUAL_FATAL(cpu_rmsnorm(&tx, &twz, &zc, &ty2), UPF_OK);
  CU_ASSERT(memcmp(y, y2, sizeof y) == 0);
  /* eps matters for tiny rows: x = 1e-4 gives 1e-4 / sqrt(1e-8 + 1e-6). */
  float tiny[2] = {1e-4f, 1e-4f}, out[2];
  upf_tensor tt = view_of(tiny, UPF_DTYPE_F32, 2, (int64_t[2]){1, 2});
  upf_tensor to = view_of(out, UPF_DTYPE_F32, 2, (int64_t[2]){1, 2});
  CU_ASSERT_EQUAL(cpu_rmsnorm(&tt, &tw, &plain, &to), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(out[0], 1e-4 / sqrt(1e-8 + 1e-6), 1e-6);
  /* In place. */
  CU_ASSERT_EQUAL(cpu_rmsnorm(&tx, &tw, &plain, &tx), UPF_OK);
  CU_ASSERT(memcmp(x, y, sizeof y) == 0);
  /* The fused add: residual [2, 3] + [1, 1] = [3, 4], y normalises it. */
  float xa[2] = {1, 1}, res[2] = {2, 3}, ya[2];
  upf_tensor txa = view_of(xa, UPF_DTYPE_F32, 2, (int64_t[2]){1, 2});
  upf_tensor tres = view_of(res, UPF_DTYPE_F32, 2, (int64_t[2]){1, 2});
  upf_tensor tya = view_of(ya, UPF_DTYPE_F32, 2, (int64_t[2]){1, 2});
  CU_ASSERT_EQUAL_FATAL(cpu_rmsnorm_add(&txa, &tres, &tw, &plain, &tya), UPF_OK);
  CU_ASSERT(res[0] == 3.0f && res[1] == 4.0f);
  CU_ASSERT_DOUBLE_EQUAL(ya[1], 8.0 / r, 1e-6);
  /* Bad inputs. */
  upf_norm_params bad = {-1.0f, 0};
  CU_ASSERT_EQUAL(cpu_rmsnorm(&tx, &tw, &bad, &ty), UPF_ERR_INVALID_ARG);
  bad.eps = NAN;
  CU_ASSERT_EQUAL(cpu_rmsnorm(&tx, &tw, &bad, &ty), UPF_ERR_INVALID_ARG);
  upf_tensor w3 = view_of(w, UPF_DTYPE_F32, 1, (int64_t[1]){3});
  CU_ASSERT_EQUAL(cpu_rmsnorm(&tx, &w3, &plain, &ty), UPF_ERR_SHAPE);
  CU_ASSERT(strstr(upf_last_error(), "w (N)") != NULL);
}

/* bf16: the new residual is rounded before the norm reads it, as a separate add would store it. */
static void test_rms_add_rounds_residual(void) {
  uint16_t x[2] = {upf_bf16_from_f32(1.0f), upf_bf16_from_f32(1.0f)};
  uint16_t res[2] = {upf_bf16_from_f32(1.0f / 256.0f), upf_bf16_from_f32(0.0f)}, w[2], y[2];
  w[0] = w[1] = upf_bf16_from_f32(1.0f);
  upf_tensor tx = view_of(x, UPF_DTYPE_BF16, 2, (int64_t[2]){1, 2});
  upf_tensor tr = view_of(res, UPF_DTYPE_BF16, 2, (int64_t[2]){1, 2});
  upf_tensor tw = view_of(w, UPF_DTYPE_BF16, 1, (int64_t[1]){2});
  upf_tensor ty = view_of(y, UPF_DTYPE_BF16, 2, (int64_t[2]){1, 2});
  upf_norm_params p = {1e-6f, 0};
  CU_ASSERT_EQUAL_FATAL(cpu_rmsnorm_add(&tx, &tr, &tw, &p, &ty), UPF_OK);
  /* 1 + 2^-8 is a bf16 tie between 1 and 1 + 2^-7: even wins, the residual is exactly 1. */
  CU_ASSERT_EQUAL(res[0], upf_bf16_from_f32(1.0f));
  CU_ASSERT_EQUAL(y[0], y[1]);
}

static void test_qk_norm_by_hand(void) {
  /* (T=1, H=2, D=2) heads [3, 4] and [0, 5] inside a row of 6 (a third head untouched). */
  float row[6] = {3, 4, 0, 5, 7, 7}, w[2] = {1, 1};
  upf_tensor x = view_of(row, UPF_DTYPE_F32, 3, (int64_t[3]){1, 2, 2});
  upf_tensor tw = view_of(w, UPF_DTYPE_F32, 1, (int64_t[1]){2});
  x.stride[0] = 6;
  upf_norm_params p = {1e-6f, 0};
  CU_ASSERT_EQUAL_FATAL(cpu_qk_norm(&x, &tw, &p, &x), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(row[0], 3.0 / sqrt(12.5 + 1e-6), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(row[3], 5.0 / sqrt(12.5 + 1e-6), 1e-6);
  CU_ASSERT(row[4] == 7.0f && row[5] == 7.0f);
}

/* ---- RoPE ---- */

static void test_rope_frequencies(void) {
  double inv[128];
  upf_rope_params p = {10000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0, 0, 0};
  upf_rope_inv_freq(&p, 4, inv);
  CU_ASSERT_DOUBLE_EQUAL(inv[0], 1.0, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(inv[1], 0.01, 1e-15);
  /* Linear scaling divides everything by the factor (Gemma-3 global: 1e6 base, factor 8). */
  upf_rope_params g = upf_gemma3_12b_rope_global();
  upf_rope_inv_freq(&g, 256, inv);
  CU_ASSERT_DOUBLE_EQUAL(inv[0], 1.0 / 8.0, 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(inv[1], pow(1e6, -2.0 / 256.0) / 8.0, 1e-15);
  /* Llama-3.1: the highest frequency is kept, the lowest divided by 8; the medium band (wavelength
   * 2048..8192, here i = 41..48 of 64) interpolates. */
  upf_rope_params l = upf_llama31_8b_rope();
  upf_rope_inv_freq(&l, 128, inv);
  CU_ASSERT_DOUBLE_EQUAL(inv[0], 1.0, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(inv[63], pow(500000.0, -126.0 / 128.0) / 8.0, 1e-20);
  for (int i = 0; i < 64; i++) {
    double base = 1.0 / pow(500000.0, (double)(2 * i) / 128.0), wl = 2.0 * M_PI / base;
    if (wl < 2048.0)
      CU_ASSERT_EQUAL(inv[i], base);
    if (wl > 8192.0)
      CU_ASSERT_DOUBLE_EQUAL(inv[i], base / 8.0, 1e-22);
    if (wl >= 2048.0 && wl <= 8192.0) {
      double smooth = (8192.0 / wl - 1.0) / 3.0;
      CU_ASSERT_DOUBLE_EQUAL(inv[i], (1.0 - smooth) * base / 8.0 + smooth * base, 1e-18);
    }
  }
  /* Qwen3-Next rotates 25% of a 256-dim head. */
  upf_rope_params q = upf_qwen3n_80b_rope();
  CU_ASSERT_EQUAL(upf_rope_rotary_dim(&q, 256), (int32_t)(UPF_QWEN3N_80B_PARTIAL_ROTARY * 256));
  CU_ASSERT_EQUAL(upf_rope_params_check(&q, 256), UPF_OK);
  CU_ASSERT_EQUAL(upf_rope_params_check(&q, 32), UPF_ERR_INVALID_ARG); /* 64 > head dim */
  upf_rope_params bad = l;
  bad.original_max_position = 0;
  CU_ASSERT_EQUAL(upf_rope_params_check(&bad, 128), UPF_ERR_INVALID_ARG);
  bad = g, bad.factor = 0.5;
  CU_ASSERT_EQUAL(upf_rope_params_check(&bad, 256), UPF_ERR_INVALID_ARG);
  bad = p, bad.theta = INFINITY;
  CU_ASSERT_EQUAL(upf_rope_params_check(&bad, 4), UPF_ERR_INVALID_ARG);
}

static void test_rope_by_hand(void) {
  /* D = 4 at position 1: pairs (0, 2) turn by 1 rad, (1, 3) by 0.01 rad. Position 0 is the identity.
   * Partial rotary (rot 2 of D 4) leaves dims 2 and 3 alone. */
  float q[12] = {1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4};
  int32_t pos[3] = {1, 0, 7};
  upf_tensor tq = view_of(q, UPF_DTYPE_F32, 3, (int64_t[3]){2, 1, 4});
  upf_rope_params p = {10000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0, 0, 0};
  CU_ASSERT_EQUAL_FATAL(cpu_rope(&tq, NULL, pos, &p), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(q[0], cos(1.0) - 3.0 * sin(1.0), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(q[2], 3.0 * cos(1.0) + sin(1.0), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(q[1], 2.0 * cos(0.01) - 4.0 * sin(0.01), 1e-6);
  CU_ASSERT(q[4] == 1 && q[5] == 2 && q[6] == 3 && q[7] == 4);
  upf_tensor tk = view_of(q + 8, UPF_DTYPE_F32, 3, (int64_t[3]){1, 1, 4});
  upf_tensor tq1 = view_of(q + 4, UPF_DTYPE_F32, 3, (int64_t[3]){1, 1, 4});
  p.rotary_dim = 2;
  CU_ASSERT_EQUAL_FATAL(cpu_rope(&tq1, &tk, pos + 2, &p), UPF_OK); /* both at position 7 */
  CU_ASSERT_DOUBLE_EQUAL(q[8], cos(7.0) - 2.0 * sin(7.0), 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(q[9], 2.0 * cos(7.0) + sin(7.0), 1e-6);
  CU_ASSERT(q[10] == 3 && q[11] == 4);
  CU_ASSERT_EQUAL(cpu_rope(&tq, NULL, NULL, &p), UPF_ERR_INVALID_ARG);
}

/* Large positions: the angle is taken in double, so position 131071 rotates exactly as the double
 * formula says (an fp32 angle would be off by ~4e-3 rad). */
static void test_rope_large_positions(void) {
  float q[2] = {1, 0};
  int32_t pos = 131071;
  upf_tensor tq = view_of(q, UPF_DTYPE_F32, 3, (int64_t[3]){1, 1, 2});
  upf_rope_params p = {10000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0, 0, 0};
  CU_ASSERT_EQUAL_FATAL(cpu_rope(&tq, NULL, &pos, &p), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(q[0], cos(131071.0), 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(q[1], sin(131071.0), 1e-7);
}

/* ---- gated output, embedding, logits ---- */

static void test_gated_output_by_hand(void) {
  /* The gate is the second half of each head's (query | gate) block. */
  float qp[8] = {0, 0, 0, (float)log(3.0), 0, 0, -100, 100}, o[4] = {2, 4, 8, 8}, y[4];
  upf_tensor to = view_of(o, UPF_DTYPE_F32, 3, (int64_t[3]){1, 2, 2});
  upf_tensor ty = view_of(y, UPF_DTYPE_F32, 3, (int64_t[3]){1, 2, 2});
  upf_tensor tg = view_of(qp + 2, UPF_DTYPE_F32, 3, (int64_t[3]){1, 2, 2});
  tg.stride[0] = 8, tg.stride[1] = 4;
  CU_ASSERT_EQUAL_FATAL(cpu_gated_output(&to, &tg, &ty), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(y[0], 1.0, 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(y[1], 3.0, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(y[2], 0.0, 1e-30);
  CU_ASSERT_DOUBLE_EQUAL(y[3], 8.0, 1e-6);
  CU_ASSERT_EQUAL(cpu_gated_output(&to, &tg, &to), UPF_OK); /* in place */
  CU_ASSERT(memcmp(o, y, sizeof y) == 0);
}

static void test_embed_by_hand(void) {
  float table[6] = {1, 2, 3, 4, 5, 6}, y[4] = {-1, -1, -1, -1};
  int32_t ids[2] = {2, 0}, bad[2] = {1, 3};
  upf_tensor tt = view_of(table, UPF_DTYPE_F32, 2, (int64_t[2]){3, 2});
  upf_tensor ty = view_of(y, UPF_DTYPE_F32, 2, (int64_t[2]){2, 2});
  CU_ASSERT_EQUAL_FATAL(cpu_embed(ids, 2, &tt, 0.5f, &ty), UPF_OK);
  CU_ASSERT(y[0] == 2.5f && y[1] == 3.0f && y[2] == 0.5f && y[3] == 1.0f);
  float before[4];
  memcpy(before, y, sizeof y);
  CU_ASSERT_EQUAL(cpu_embed(bad, 2, &tt, 1.0f, &ty), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "ids[1]=3") != NULL);
  CU_ASSERT(memcmp(before, y, sizeof y) == 0); /* nothing written */
  CU_ASSERT_EQUAL(cpu_embed(ids, 2, &tt, NAN, &ty), UPF_ERR_INVALID_ARG);
  /* Gemma-3's scale as HF applies it to a bf16 table: sqrt(3840) cast to bf16 is 62. */
  CU_ASSERT_EQUAL(upf_round_bf16((float)UPF_GEMMA3_12B_EMBED_SCALE), 62.0f);
}

static void test_logits_by_hand(void) {
  /* Requests of 2 and 1 tokens; last rows [3, 4] and [0, 5]; LM head [[1, 0, 1], [0, 1, 1]]. */
  float hidden[6] = {9, 9, 3, 4, 0, 5}, nw[2] = {1, 1}, wlm[6] = {1, 0, 1, 0, 1, 1}, out[6];
  int32_t cu[3] = {0, 2, 3};
  upf_tensor th = view_of(hidden, UPF_DTYPE_F32, 2, (int64_t[2]){3, 2});
  upf_tensor tn = view_of(nw, UPF_DTYPE_F32, 1, (int64_t[1]){2});
  upf_tensor tw = view_of(wlm, UPF_DTYPE_F32, 2, (int64_t[2]){2, 3});
  upf_tensor to = view_of(out, UPF_DTYPE_F32, 2, (int64_t[2]){2, 3});
  upf_norm_params p = {1e-6f, 0};
  CU_ASSERT_EQUAL_FATAL(cpu_logits_last(&th, cu, 2, &tn, &p, &tw, &to), UPF_OK);
  double r = sqrt(12.5 + 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(out[0], 3.0 / r, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(out[2], 7.0 / r, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(out[3], 0.0, 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(out[5], 5.0 / r, 1e-6);
  int32_t empty[3] = {0, 3, 3}, short_cu[2] = {0, 2};
  CU_ASSERT_EQUAL(cpu_logits_last(&th, empty, 2, &tn, &p, &tw, &to), UPF_ERR_CU_SEQLENS);
  CU_ASSERT_EQUAL(cpu_logits_last(&th, short_cu, 1, &tn, &p, &tw, &to), UPF_ERR_CU_SEQLENS); /* cu[B] != T */
  upf_tensor bf = to;
  bf.dtype = UPF_DTYPE_BF16;
  CU_ASSERT_EQUAL(cpu_logits_last(&th, cu, 2, &tn, &p, &tw, &bf), UPF_ERR_DTYPE); /* f32 inputs give f32 */
}

/* ---- rounding and constants ---- */

static void test_single_rounding(void) {
  /* 1 + 2^-8 + 2^-30 is just above the bf16 midpoint of 1 and 1 + 2^-7; through fp32 it would land on
   * the midpoint and round to even (1). One rounding gives 1 + 2^-7. */
  double v = 1.0 + ldexp(1.0, -8) + ldexp(1.0, -30);
  CU_ASSERT_EQUAL(upf_bf16_from_f32((float)v), upf_bf16_from_f32(1.0f));
  CU_ASSERT_EQUAL(ref_bf16_from_f64(v), upf_bf16_from_f32(1.0f + 1.0f / 128.0f));
  CU_ASSERT_EQUAL(ref_bf16_from_f64(-v), upf_bf16_from_f32(-1.0f - 1.0f / 128.0f));
  CU_ASSERT_EQUAL(ref_bf16_from_f64(1.0 + ldexp(1.0, -8) - ldexp(1.0, -30)), upf_bf16_from_f32(1.0f));
  CU_ASSERT_EQUAL(ref_bf16_from_f64(1.0 + ldexp(1.0, -8)), upf_bf16_from_f32(1.0f)); /* a true tie: even */
}

static void test_model_constants(void) {
  CU_ASSERT_EQUAL(UPF_LLAMA31_8B_HIDDEN, UPF_LLAMA31_8B_Q_HEADS * UPF_LLAMA31_8B_HEAD_DIM);
  CU_ASSERT_EQUAL(UPF_QWEN3N_80B_ROTARY_DIM, (int)(UPF_QWEN3N_80B_HEAD_DIM * UPF_QWEN3N_80B_PARTIAL_ROTARY));
  CU_ASSERT_DOUBLE_EQUAL(UPF_GEMMA3_12B_EMBED_SCALE, sqrt((double)UPF_GEMMA3_12B_HIDDEN), 1e-12);
  upf_norm_params g = upf_gemma3_12b_norm(), l = upf_llama31_8b_norm();
  CU_ASSERT(g.zero_centred && !l.zero_centred);
  CU_ASSERT_EQUAL(upf_norm_params_check(&g), UPF_OK);
  CU_ASSERT_EQUAL(upf_rope_params_check(&(upf_rope_params){0}, 128), UPF_ERR_INVALID_ARG);
  upf_rope_params r = upf_llama31_8b_rope();
  CU_ASSERT_EQUAL(upf_rope_params_check(&r, UPF_LLAMA31_8B_HEAD_DIM), UPF_OK);
}

/* ---- the verify harness ---- */


/* Sabotaged entries the harness must catch. */
static upf_status rms_off_by_a_bit(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p,
                                   const upf_tensor *y) {
  UPF_TRY(cpu_rmsnorm(x, w, p, y));
  ((float *)y->data)[3] *= 1.001f; /* only valid for f32 outputs, which is all this test uses */
  return UPF_OK;
}
static upf_status rms_writes_past_view(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p,
                                       const upf_tensor *y) {
  UPF_TRY(cpu_rmsnorm(x, w, p, y));
  ((float *)y->data)[y->shape[1]] = 0.0f; /* the padding after row 0 */
  return UPF_OK;
}
static upf_status rms_clobbers_input(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p,
                                     const upf_tensor *y) {
  UPF_TRY(cpu_rmsnorm(x, w, p, y));
  ((float *)w->data)[0] += 1.0f;
  return UPF_OK;
}

static upf_status rms_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->rmsnorm(&v[0][0], &v[1][0], ctx, &v[2][0]);
}

/* Runs a small padded norm case on `be`; returns the number of failed checks. */
static int harness_run(const upf_backend *be) {
  upf_verify_ctx ctx = {.backend = be, .log = NULL, .quick = 1};
  upf_dcase dc;
  upf_dcase_init(&dc, UPF_DTYPE_F32);
  upf_rng rng;
  upf_rng_seed(&rng, 3);
  const int64_t T = 5, N = 24, W = 32, sx[2] = {T, N}, ss[2] = {W, 1}, sw[1] = {N};
  upf_dbuf *x = upf_dcase_add(&dc, "x", UPF_DTYPE_F32, T * W, 0);
  upf_dbuf *w = upf_dcase_add(&dc, "w", UPF_DTYPE_F32, N, 0);
  upf_dbuf *y = upf_dcase_add(&dc, "y", UPF_DTYPE_F32, T * W, 1);
  CU_ASSERT_FATAL(x && w && y);
  upf_dbuf_view(x, 0, "x", 2, sx, ss, 4);
  upf_dbuf_view(w, 0, "w", 1, sw, NULL, 0);
  upf_dbuf_view(y, 0, "y", 2, sx, ss, 4);
  upf_dbuf_fill_normal(x, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(w, &rng, 1.0f, 0.1f);
  upf_dbuf_fill_normal(y, &rng, 0.0f, 1.0f);
  upf_norm_params p = {1e-5f, 0};
  upf_check proto;
  upf_dense_check_init(&proto, "norm.rms", "harness self-test", UPF_DTYPE_F32, "T=5 N=24 in (5, 32)");
  upf_dcase_verify(&ctx, &dc, rms_fn, NULL, &p, &proto);
  upf_dcase_free(&dc);
  CU_ASSERT(ctx.passed + ctx.failed > 0);
  return ctx.failed;
}

static void test_harness_catches_errors(void) {
  upf_backend bad = *upf_test_cpu_twin();
  CU_ASSERT_EQUAL(harness_run(&bad), 0);
  bad.rmsnorm = rms_off_by_a_bit;
  CU_ASSERT(harness_run(&bad) > 0);
  bad.rmsnorm = rms_writes_past_view;
  CU_ASSERT(harness_run(&bad) > 0);
  bad.rmsnorm = rms_clobbers_input;
  CU_ASSERT(harness_run(&bad) > 0);
  /* The long-reduction rule: within 2x the baseline's error passes, beyond fails. */
  const double truth[3] = {1.0, 2.0, 3.0};
  const float base[3] = {1.0f, 2.001f, 3.0f}, near[3] = {1.0f, 2.0f, 3.0015f}, far[3] = {1.0f, 2.0f, 3.01f};
  upf_check check;
  upf_tolerance tol = upf_tolerance_for(UPF_DTYPE_F32);
  upf_compare_long_reduction(near, base, truth, 3, tol, &check);
  CU_ASSERT(check.passed);
  upf_compare_long_reduction(far, base, truth, 3, tol, &check);
  CU_ASSERT(!check.passed);
  const float nan_got[3] = {1.0f, NAN, 3.0f};
  upf_compare_long_reduction(nan_got, base, truth, 3, tol, &check);
  CU_ASSERT(!check.passed);
}

/* The long-reduction fallback through the harness: a device result off by 3e-5 everywhere fails
 * the plain fp32 rule; against a truth 2e-5 from the CPU baseline it is within 2x the baseline's
 * error and passes, against a truth equal to the baseline it fails. */
static double truth_offset;
static upf_status gemm_shifted(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c) {
  UPF_TRY(cpu_gemm(a, b, c));
  for (int64_t i = 0; i < c->shape[0]; i++)
    for (int64_t j = 0; j < c->shape[1]; j++)
      ((float *)c->data)[i * c->stride[0] + j] += 3e-5f;
  return UPF_OK;
}
static upf_status gemm_call(const upf_backend *be, upf_dviews v, const void *ctx) {
  return be->gemm(&v[0][0], &v[1][0], &v[2][0]);
}
static upf_status gemm_offset_truth(upf_dviews v, const void *ctx, double *truth) {
  float c[32];
  upf_tensor tc = view_of(c, UPF_DTYPE_F32, 2, (int64_t[2]){4, 8});
  UPF_TRY(cpu_gemm(&v[0][0], &v[1][0], &tc));
  for (int i = 0; i < 32; i++)
    truth[i] = (double)c[i] + truth_offset;
  return UPF_OK;
}
static int long_rule_run(double offset, char *detail, size_t cap) {
  upf_backend shifted = *upf_test_cpu_twin();
  shifted.gemm = gemm_shifted;
  upf_verify_ctx ctx = {.backend = &shifted, .log = NULL, .quick = 1};
  upf_dcase dc;
  upf_dcase_init(&dc, UPF_DTYPE_F32);
  upf_rng rng;
  upf_rng_seed(&rng, 8);
  upf_dbuf *a = upf_dcase_add(&dc, "a", UPF_DTYPE_F32, 4 * 16, 0);
  upf_dbuf *b = upf_dcase_add(&dc, "b", UPF_DTYPE_F32, 16 * 8, 0);
  upf_dbuf *c = upf_dcase_add(&dc, "c", UPF_DTYPE_F32, 4 * 8, 1);
  CU_ASSERT_FATAL(a && b && c);
  upf_dbuf_view(a, 0, "a", 2, (int64_t[2]){4, 16}, NULL, 0);
  upf_dbuf_view(b, 0, "b", 2, (int64_t[2]){16, 8}, NULL, 0);
  upf_dbuf_view(c, 0, "c", 2, (int64_t[2]){4, 8}, NULL, 0);
  upf_dbuf_fill_normal(a, &rng, 0.0f, 1.0f);
  upf_dbuf_fill_normal(b, &rng, 0.0f, 0.01f); /* small outputs: 3e-5 is far outside the plain budget */
  upf_dbuf_fill_poison(c);
  upf_check proto;
  upf_dense_check_init(&proto, "gemm", "long-reduction self-test", UPF_DTYPE_F32, "M=4 K=16 N=8");
  truth_offset = offset;
  /* capture the check line through a memory stream */
  char *buf = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&buf, &len);
  ctx.log = mem;
  upf_dcase_verify(&ctx, &dc, gemm_call, gemm_offset_truth, NULL, &proto);
  fclose(mem);
  snprintf(detail, cap, "%s", buf ? buf : "");
  free(buf);
  upf_dcase_free(&dc);
  return ctx.failed;
}

static void test_harness_long_reduction(void) {
  char detail[512];
  CU_ASSERT_EQUAL(long_rule_run(2e-5, detail, sizeof detail), 0);
  CU_ASSERT(strstr(detail, "long-reduction rule") != NULL);
  CU_ASSERT(strstr(detail, "plain budget") != NULL);
  CU_ASSERT_EQUAL(long_rule_run(0.0, detail, sizeof detail), 1);
}

/* Every dense op's quick verify set through the harness, with the CPU reference standing in for the
 * backend under test: exercises the case set-up (views, padding, poison, truths) without a GPU. Too
 * slow for Valgrind, so only in the plain run. */
static void test_verify_cases_on_cpu_twin(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK) ");
    return;
  }
  const upf_op ops[] = {UPF_OP_GEMM,         UPF_OP_FFN_ACT_MUL, UPF_OP_FFN_GATED, UPF_OP_RMSNORM,
                        UPF_OP_RMSNORM_ADD,  UPF_OP_QK_NORM,     UPF_OP_ROPE,      UPF_OP_GATED_OUTPUT,
                        UPF_OP_EMBED,        UPF_OP_LOGITS_LAST};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    upf_test_verify_op(ops[i], upf_test_cpu_twin(), 3);
}

/* Each op's own verify entry on the CPU: golden cases, bad inputs, invariants. */
static void test_verify_entries_cpu(void) {
  for (int op = UPF_OP_GEMM; op <= UPF_OP_LOGITS_LAST; op++)
    upf_test_verify_op((upf_op)op, upf_backend_cpu(), 0);
}

static CU_TestInfo dense_tests[] = {
    {"gemm by hand, strided views, M=0", test_gemm_by_hand},
    {"gemm bad inputs", test_gemm_bad_inputs},
    {"silu / tanh gelu and act_mul by hand", test_activations_by_hand},
    {"gated ffn by hand and its fp64 truth", test_ffn_by_hand},
    {"rmsnorm plain, zero-centred, eps, in place, fused add", test_norms_by_hand},
    {"rms_add rounds the residual before the norm", test_rms_add_rounds_residual},
    {"qk norm on a strided view", test_qk_norm_by_hand},
    {"rope frequencies: default, linear, llama3, partial", test_rope_frequencies},
    {"rope by hand, partial, q+k", test_rope_by_hand},
    {"rope at position 131071", test_rope_large_positions},
    {"gated output by hand (strided gate)", test_gated_output_by_hand},
    {"embed by hand, bad id names its position", test_embed_by_hand},
    {"logits of the last tokens by hand", test_logits_by_hand},
    {"double to bf16 rounds once", test_single_rounding},
    {"model constants", test_model_constants},
    {"verify harness catches wrong values, stray writes, clobbered inputs", test_harness_catches_errors},
    {"long-reduction fallback through the harness", test_harness_long_reduction},
    {"dense verify entries pass on the cpu", test_verify_entries_cpu},
    {"dense verify cases through the harness (cpu twin)", test_verify_cases_on_cpu_twin},
    CU_TEST_INFO_NULL,
};

void upf_register_dense_tests(void) { upf_test_suite("dense ops (cpu reference)", NULL, NULL, dense_tests); }

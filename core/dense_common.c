/* Parameters and shape rules of the dense ops, shared by every backend: activation names, norm and
 * RoPE parameter checks, the RoPE inverse frequencies (llama3 and linear scaling), and the per-op
 * shape checks, so the CPU reference and CUDA reject the same inputs with the same status. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "uniprefill/dense.h"
#include "uniprefill/select.h"

const char *upf_act_name(upf_act act) {
  switch (act) {
  case UPF_ACT_SILU:
    return "silu";
  case UPF_ACT_GELU_TANH:
    return "gelu_tanh";
  default:
    return "invalid";
  }
}

upf_status upf_norm_params_check(const upf_norm_params *p) {
  if (!p)
    return upf_fail(UPF_ERR_INVALID_ARG, "norm params: NULL");
  if (!(p->eps > 0.0f) || !isfinite(p->eps))
    return upf_fail(UPF_ERR_INVALID_ARG, "norm params: eps=%g must be finite and > 0", (double)p->eps);
  if (p->zero_centred != 0 && p->zero_centred != 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "norm params: zero_centred=%d must be 0 or 1", p->zero_centred);
  return UPF_OK;
}

int32_t upf_rope_rotary_dim(const upf_rope_params *p, int64_t head_dim) {
  return p->rotary_dim ? p->rotary_dim : (int32_t)head_dim;
}

upf_status upf_rope_params_check(const upf_rope_params *p, int64_t head_dim) {
  if (!p)
    return upf_fail(UPF_ERR_INVALID_ARG, "rope params: NULL");
  if (!(p->theta > 1.0) || !isfinite(p->theta))
    return upf_fail(UPF_ERR_INVALID_ARG, "rope params: theta=%g must be finite and > 1", p->theta);
  int64_t rot = upf_rope_rotary_dim(p, head_dim);
  if (rot < 2 || rot % 2 || rot > head_dim)
    return upf_fail(UPF_ERR_INVALID_ARG, "rope params: rotary_dim=%lld must be even, >= 2 and <= head_dim=%lld",
                    (long long)rot, (long long)head_dim);
  if ((unsigned)p->scaling >= UPF_ROPE_SCALING_COUNT)
    return upf_fail(UPF_ERR_INVALID_ARG, "rope params: unknown scaling %d", (int)p->scaling);
  if (p->scaling != UPF_ROPE_DEFAULT && (!(p->factor >= 1.0) || !isfinite(p->factor)))
    return upf_fail(UPF_ERR_INVALID_ARG, "rope params: scaling factor=%g must be finite and >= 1", p->factor);
  if (p->scaling == UPF_ROPE_LLAMA3) {
    if (!(p->low_freq_factor > 0.0) || !(p->high_freq_factor > p->low_freq_factor) || !isfinite(p->high_freq_factor))
      return upf_fail(UPF_ERR_INVALID_ARG,
                      "rope params: llama3 needs 0 < low_freq_factor (%g) < high_freq_factor (%g)",
                      p->low_freq_factor, p->high_freq_factor);
    if (p->original_max_position < 1)
      return upf_fail(UPF_ERR_INVALID_ARG, "rope params: llama3 original_max_position=%d must be >= 1",
                      p->original_max_position);
  }
  return UPF_OK;
}

/* As transformers' _compute_default/_linear/_llama3_parameters (modeling_rope_utils.py), in double. */
void upf_rope_inv_freq(const upf_rope_params *p, int32_t rotary_dim, double *inv_freq) {
  const double two_pi = 6.283185307179586476925286766559;
  for (int32_t i = 0; i < rotary_dim / 2; i++) {
    double f = 1.0 / pow(p->theta, (double)(2 * i) / (double)rotary_dim);
    if (p->scaling == UPF_ROPE_LINEAR) {
      f /= p->factor;
    } else if (p->scaling == UPF_ROPE_LLAMA3) {
      double old_len = p->original_max_position;
      double low_wavelen = old_len / p->low_freq_factor, high_wavelen = old_len / p->high_freq_factor;
      double wavelen = two_pi / f;
      if (wavelen > low_wavelen) {
        f /= p->factor;
      } else if (!(wavelen < high_wavelen)) { /* medium band: interpolate */
        double smooth = (old_len / wavelen - p->low_freq_factor) / (p->high_freq_factor - p->low_freq_factor);
        f = (1.0 - smooth) * f / p->factor + smooth * f;
      }
    }
    inv_freq[i] = f;
  }
}

/* ---- shape checks ---- */

/* Prefixes a failure's message with the op name. */
static upf_status with_op(upf_status st, const char *op) {
  char ctx[48];
  if (st == UPF_OK)
    return st;
  snprintf(ctx, sizeof ctx, "%s: ", op);
  return upf_fail_context(st, ctx);
}

upf_status upf_dense_check(const upf_tensor *t, const char *op, const char *name, int ndim, const int64_t *want) {
  char shape[96];
  if (!t)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: %s: NULL tensor", op, name);
  if (t->dtype != UPF_DTYPE_F32 && t->dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "%s: %s: dtype %s not supported (f32 or bf16)", op, name, upf_dtype_name(t->dtype));
  if (t->ndim != ndim)
    return upf_fail(UPF_ERR_SHAPE, "%s: %s: expected %d dims, got shape %s", op, name, ndim,
                    upf_tensor_shape_str(t, shape, sizeof shape));
  for (int i = 0; i < ndim; i++) {
    if (t->shape[i] < 0 || (want && want[i] >= 0 && t->shape[i] != want[i]))
      return upf_fail(UPF_ERR_SHAPE, "%s: %s: extent %lld of dim %d should be %lld (shape %s)", op, name,
                      (long long)t->shape[i], i, (long long)(want ? want[i] : 0),
                      upf_tensor_shape_str(t, shape, sizeof shape));
  }
  if (t->stride[ndim - 1] != 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: %s: last dim must be contiguous (stride %lld)", op, name,
                    (long long)t->stride[ndim - 1]);
  for (int i = 0; i < ndim - 1; i++)
    if (t->stride[i] < t->shape[i + 1] * t->stride[i + 1])
      return upf_fail(UPF_ERR_SHAPE, "%s: %s: stride %lld of dim %d overlaps the %lld elements of dim %d", op, name,
                      (long long)t->stride[i], i, (long long)(t->shape[i + 1] * t->stride[i + 1]), i + 1);
  if (!t->data && upf_tensor_numel(t) > 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: %s: NULL data for a non-empty tensor", op, name);
  return UPF_OK;
}

upf_status upf_dense_same_dtype(const upf_tensor *a, const upf_tensor *b, const char *op, const char *an,
                                const char *bn) {
  if (a->dtype != b->dtype)
    return upf_fail(UPF_ERR_DTYPE, "%s: %s is %s but %s is %s (must match)", op, bn, upf_dtype_name(b->dtype), an,
                    upf_dtype_name(a->dtype));
  return UPF_OK;
}

/* Output dtype rule of the projections: bf16 inputs give bf16 or f32, f32 inputs give f32. */
static upf_status check_out_dtype(const upf_tensor *in, const upf_tensor *out, const char *op, const char *in_name,
                                  const char *out_name) {
  if (in->dtype == UPF_DTYPE_F32 && out->dtype != UPF_DTYPE_F32)
    return upf_fail(UPF_ERR_DTYPE, "%s: %s is %s but %s is f32 (f32 inputs give f32 outputs)", op, out_name,
                    upf_dtype_name(out->dtype), in_name);
  return UPF_OK;
}

/* cuBLAS and CBLAS take int extents and leading dimensions. */
static upf_status check_int_range(int64_t v, const char *op, const char *what) {
  if (v > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: %s=%lld exceeds the int32 range of the BLAS interfaces", op, what,
                    (long long)v);
  return UPF_OK;
}

upf_status upf_gemm_check(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c) {
  const char *op = "gemm";
  UPF_TRY(upf_dense_check(a, op, "a (M, K)", 2, NULL));
  int64_t M = a->shape[0], K = a->shape[1];
  const int64_t wb[2] = {K, -1};
  UPF_TRY(upf_dense_check(b, op, "b (K, N)", 2, wb));
  int64_t N = b->shape[1];
  const int64_t wc[2] = {M, N};
  UPF_TRY(upf_dense_check(c, op, "c (M, N)", 2, wc));
  UPF_TRY(upf_dense_same_dtype(a, b, op, "a", "b"));
  UPF_TRY(check_out_dtype(a, c, op, "a", "c"));
  if (K < 1)
    return upf_fail(UPF_ERR_SHAPE, "gemm: a (M, K) has K=0: nothing to reduce over");
  UPF_TRY(check_int_range(K, op, "K"));
  UPF_TRY(check_int_range(N, op, "N"));
  UPF_TRY(check_int_range(a->stride[0], op, "a row stride"));
  UPF_TRY(check_int_range(b->stride[0], op, "b row stride"));
  return check_int_range(c->stride[0], op, "c row stride");
}

upf_status upf_gated_act_check(const upf_tensor *gate_up, upf_act act, const upf_tensor *h) {
  const char *op = "ffn.act_mul";
  if ((unsigned)act >= UPF_ACT_COUNT)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: unknown activation %d", op, (int)act);
  UPF_TRY(upf_dense_check(gate_up, op, "gate_up (T, 2I)", 2, NULL));
  if (gate_up->shape[1] % 2)
    return upf_fail(UPF_ERR_SHAPE, "%s: gate_up (T, 2I) has an odd last extent %lld", op,
                    (long long)gate_up->shape[1]);
  const int64_t wh[2] = {gate_up->shape[0], gate_up->shape[1] / 2};
  UPF_TRY(upf_dense_check(h, op, "h (T, I)", 2, wh));
  return upf_dense_same_dtype(gate_up, h, op, "gate_up", "h");
}

upf_status upf_ffn_check(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                         const upf_tensor *y) {
  const char *op = "ffn.gated";
  if ((unsigned)act >= UPF_ACT_COUNT)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: unknown activation %d", op, (int)act);
  UPF_TRY(upf_dense_check(x, op, "x (T, H)", 2, NULL));
  int64_t T = x->shape[0], H = x->shape[1];
  const int64_t wgu[2] = {H, -1};
  UPF_TRY(upf_dense_check(w_gate_up, op, "w_gate_up (H, 2I)", 2, wgu));
  int64_t I2 = w_gate_up->shape[1];
  if (I2 < 2 || I2 % 2)
    return upf_fail(UPF_ERR_SHAPE, "%s: w_gate_up (H, 2I) needs an even last extent >= 2, got %lld", op,
                    (long long)I2);
  const int64_t wd[2] = {I2 / 2, H}, wy[2] = {T, H};
  UPF_TRY(upf_dense_check(w_down, op, "w_down (I, H)", 2, wd));
  UPF_TRY(upf_dense_check(y, op, "y (T, H)", 2, wy));
  UPF_TRY(upf_dense_same_dtype(x, w_gate_up, op, "x", "w_gate_up"));
  UPF_TRY(upf_dense_same_dtype(x, w_down, op, "x", "w_down"));
  UPF_TRY(check_out_dtype(x, y, op, "x", "y"));
  if (H < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: x (T, H) has H=0", op);
  UPF_TRY(check_int_range(I2, op, "2I"));
  UPF_TRY(check_int_range(x->stride[0], op, "x row stride"));
  UPF_TRY(check_int_range(w_gate_up->stride[0], op, "w_gate_up row stride"));
  UPF_TRY(check_int_range(w_down->stride[0], op, "w_down row stride"));
  return check_int_range(y->stride[0], op, "y row stride");
}

upf_status upf_rmsnorm_check(const char *op, const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                             const upf_norm_params *p, const upf_tensor *y) {
  UPF_TRY(upf_dense_check(x, op, "x (T, N)", 2, NULL));
  const int64_t wn[1] = {x->shape[1]};
  UPF_TRY(upf_dense_check(w, op, "w (N)", 1, wn));
  UPF_TRY(upf_dense_check(y, op, "y (T, N)", 2, x->shape));
  if (residual) {
    UPF_TRY(upf_dense_check(residual, op, "residual (T, N)", 2, x->shape));
    UPF_TRY(upf_dense_same_dtype(x, residual, op, "x", "residual"));
  }
  UPF_TRY(upf_dense_same_dtype(x, w, op, "x", "w"));
  UPF_TRY(upf_dense_same_dtype(x, y, op, "x", "y"));
  if (x->shape[1] < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: x (T, N) has N=0: no mean to take", op);
  return with_op(upf_norm_params_check(p), op);
}

upf_status upf_qk_norm_check(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y) {
  const char *op = "norm.qk";
  UPF_TRY(upf_dense_check(x, op, "x (T, H, D)", 3, NULL));
  const int64_t wd[1] = {x->shape[2]};
  UPF_TRY(upf_dense_check(w, op, "w (D)", 1, wd));
  UPF_TRY(upf_dense_check(y, op, "y (T, H, D)", 3, x->shape));
  UPF_TRY(upf_dense_same_dtype(x, w, op, "x", "w"));
  UPF_TRY(upf_dense_same_dtype(x, y, op, "x", "y"));
  if (x->shape[2] < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: x (T, H, D) has D=0", op);
  return with_op(upf_norm_params_check(p), op);
}

upf_status upf_rope_check(const upf_tensor *q, const upf_tensor *k, const int32_t *positions,
                          const upf_rope_params *p) {
  const char *op = "rope";
  UPF_TRY(upf_dense_check(q, op, "q (T, Hq, D)", 3, NULL));
  if (k) {
    const int64_t wk[3] = {q->shape[0], -1, q->shape[2]};
    UPF_TRY(upf_dense_check(k, op, "k (T, Hkv, D)", 3, wk));
    UPF_TRY(upf_dense_same_dtype(q, k, op, "q", "k"));
  }
  if (!positions && q->shape[0] > 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: positions: NULL for T=%lld tokens", op, (long long)q->shape[0]);
  return with_op(upf_rope_params_check(p, q->shape[2]), op);
}

upf_status upf_gated_output_check(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y) {
  const char *op = "attn.gated_output";
  UPF_TRY(upf_dense_check(o, op, "o (T, H, D)", 3, NULL));
  UPF_TRY(upf_dense_check(gate, op, "gate (T, H, D)", 3, o->shape));
  UPF_TRY(upf_dense_check(y, op, "y (T, H, D)", 3, o->shape));
  UPF_TRY(upf_dense_same_dtype(o, gate, op, "o", "gate"));
  return upf_dense_same_dtype(o, y, op, "o", "y");
}

upf_status upf_embed_check(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                           const upf_tensor *y) {
  const char *op = "embed";
  if (num_tokens < 0)
    return upf_fail(UPF_ERR_SHAPE, "%s: num_tokens=%lld is negative", op, (long long)num_tokens);
  if (!ids && num_tokens > 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: ids: NULL for %lld tokens", op, (long long)num_tokens);
  UPF_TRY(upf_dense_check(table, op, "table (V, H)", 2, NULL));
  const int64_t wy[2] = {num_tokens, table->shape[1]};
  UPF_TRY(upf_dense_check(y, op, "y (T, H)", 2, wy));
  UPF_TRY(upf_dense_same_dtype(table, y, op, "table", "y"));
  if (!isfinite(scale))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: scale=%g is not finite", op, (double)scale);
  return UPF_OK;
}

upf_status upf_logits_last_check(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                                 const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                                 const upf_tensor *logits) {
  const char *op = "logits.last";
  UPF_TRY(upf_dense_check(hidden, op, "hidden (T, H)", 2, NULL));
  int64_t T = hidden->shape[0], H = hidden->shape[1];
  upf_status st = upf_cu_seqlens_check(cu_seqlens_host, num_reqs, T);
  if (st != UPF_OK)
    return upf_fail_context(st, "logits.last: ");
  for (int32_t r = 0; r < num_reqs; r++)
    if (cu_seqlens_host[r + 1] == cu_seqlens_host[r])
      return upf_fail(UPF_ERR_CU_SEQLENS, "%s: cu_seqlens: request %d has no tokens, so no last token", op, r);
  const int64_t wn[1] = {H}, ww[2] = {H, -1};
  UPF_TRY(upf_dense_check(norm_w, op, "norm_w (H)", 1, wn));
  UPF_TRY(upf_dense_check(w_lm, op, "w_lm (H, V)", 2, ww));
  const int64_t wl[2] = {num_reqs, w_lm->shape[1]};
  UPF_TRY(upf_dense_check(logits, op, "logits (B, V)", 2, wl));
  UPF_TRY(upf_dense_same_dtype(hidden, norm_w, op, "hidden", "norm_w"));
  UPF_TRY(upf_dense_same_dtype(hidden, w_lm, op, "hidden", "w_lm"));
  UPF_TRY(check_out_dtype(hidden, logits, op, "hidden", "logits"));
  if (H < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: hidden (T, H) has H=0", op);
  UPF_TRY(check_int_range(w_lm->shape[1], op, "V"));
  UPF_TRY(check_int_range(w_lm->stride[0], op, "w_lm row stride"));
  UPF_TRY(check_int_range(logits->stride[0], op, "logits row stride"));
  return with_op(upf_norm_params_check(p), op);
}

upf_status upf_logits_rows_check(const upf_tensor *hidden, const upf_logits_rows_sel *sel, const upf_tensor *norm_w,
                                 const upf_norm_params *p, const upf_tensor *w_lm, const upf_logits_rows_out *out) {
  const char *op = "logits.rows";
  if (!sel || !out)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: sel or out is NULL", op);
  UPF_TRY(upf_dense_check(hidden, op, "hidden (T, H)", 2, NULL));
  const int64_t T = hidden->shape[0], H = hidden->shape[1];
  if (H < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: hidden (T, H) has H=0", op);
  const int64_t wn[1] = {H}, ww[2] = {H, -1};
  UPF_TRY(upf_dense_check(norm_w, op, "norm_w (H)", 1, wn));
  UPF_TRY(upf_dense_check(w_lm, op, "w_lm (H, V)", 2, ww));
  UPF_TRY(upf_dense_same_dtype(hidden, norm_w, op, "hidden", "norm_w"));
  UPF_TRY(upf_dense_same_dtype(hidden, w_lm, op, "hidden", "w_lm"));
  const int64_t V = w_lm->shape[1];
  if (V < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: w_lm (H, V) has V=0", op);
  UPF_TRY(check_int_range(V, op, "V"));
  UPF_TRY(check_int_range(w_lm->stride[0], op, "w_lm row stride"));
  if (sel->num_rows < 0 || sel->num_full < 0)
    return upf_fail(UPF_ERR_SHAPE, "%s: num_rows=%lld, num_full=%lld: negative", op, (long long)sel->num_rows,
                    (long long)sel->num_full);
  if (sel->num_rows > 0 && (!sel->rows_host || !out->argmax || !out->lse))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: rows_host, out->argmax and out->lse are needed for %lld rows", op,
                    (long long)sel->num_rows);
  if (sel->targets_host && sel->num_rows > 0 && !out->target)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: targets given but out->target is NULL", op);
  if (sel->num_full > 0 && (!sel->full_host || !out->full))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: full_host and out->full are needed for %lld full rows", op,
                    (long long)sel->num_full);
  for (int64_t i = 0; i < sel->num_rows; i++) {
    if (sel->rows_host[i] < 0 || sel->rows_host[i] >= T)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: rows_host[%lld]=%d is outside hidden's rows [0, %lld)", op,
                      (long long)i, sel->rows_host[i], (long long)T);
    if (sel->targets_host && (sel->targets_host[i] < -1 || sel->targets_host[i] >= V))
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: targets_host[%lld]=%d is outside [0, %lld) (or -1: none)", op,
                      (long long)i, sel->targets_host[i], (long long)V);
  }
  for (int64_t i = 0; i < sel->num_full; i++)
    if (sel->full_host[i] < 0 || sel->full_host[i] >= sel->num_rows)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: full_host[%lld]=%d is outside the output rows [0, %lld)", op,
                      (long long)i, sel->full_host[i], (long long)sel->num_rows);
  return with_op(upf_norm_params_check(p), op);
}

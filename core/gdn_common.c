/* Shape rules of the Gated DeltaNet ops (uniprefill/gdn.h), shared by every backend so the CPU
 * reference and CUDA reject the same inputs with the same status and a message naming the input. */
#include <stdint.h>
#include <stdio.h>

#include "uniprefill/gdn.h"
#include "uniprefill/select.h"

/* An fp32 state tensor of exactly `want` (ndim dims), contiguous: kernels index it densely. */
static upf_status state_check(const upf_tensor *t, const char *op, const char *name, int ndim, const int64_t *want) {
  UPF_TRY(upf_dense_check(t, op, name, ndim, want));
  if (t->dtype != UPF_DTYPE_F32)
    return upf_fail(UPF_ERR_DTYPE, "%s: %s: states are f32, got %s", op, name, upf_dtype_name(t->dtype));
  if (!upf_tensor_is_contiguous(t))
    return upf_fail(UPF_ERR_SHAPE, "%s: %s: must be contiguous", op, name);
  return UPF_OK;
}

static upf_status batch_check(const upf_gdn_batch *batch, const char *op, int64_t T) {
  if (!batch)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: batch: NULL", op);
  if (batch->num_reqs < 0)
    return upf_fail(UPF_ERR_CU_SEQLENS, "%s: num_reqs=%d is negative", op, batch->num_reqs);
  if (!batch->cu_seqlens || !batch->cu_seqlens_host)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: cu_seqlens: NULL (both the backend array and its host copy are needed)",
                    op);
  upf_status st = upf_cu_seqlens_check(batch->cu_seqlens_host, batch->num_reqs, T);
  if (st != UPF_OK) {
    char ctx[48];
    snprintf(ctx, sizeof ctx, "%s: ", op);
    return upf_fail_context(st, ctx);
  }
  return UPF_OK;
}

/* w (C, K) in x's dtype with K >= 2. */
static upf_status conv_weight_check(const upf_tensor *x, const upf_tensor *w, const char *op, int64_t C) {
  const int64_t ww[2] = {C, -1};
  UPF_TRY(upf_dense_check(w, op, "w (C, K)", 2, ww));
  UPF_TRY(upf_dense_same_dtype(x, w, op, "x", "w"));
  if (w->shape[1] < 2)
    return upf_fail(UPF_ERR_SHAPE, "%s: w (C, K) has K=%lld: the kernel needs >= 2 taps", op, (long long)w->shape[1]);
  if (C < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: x has C=0 channels", op);
  return UPF_OK;
}

upf_status upf_gdn_conv_check(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                              const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y) {
  const char *op = "gdn.conv";
  UPF_TRY(upf_dense_check(x, op, "x (T, C)", 2, NULL));
  int64_t T = x->shape[0], C = x->shape[1];
  UPF_TRY(conv_weight_check(x, w, op, C));
  UPF_TRY(upf_dense_check(y, op, "y (T, C)", 2, x->shape));
  UPF_TRY(upf_dense_same_dtype(x, y, op, "x", "y"));
  if (y->data == x->data && T > 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: y is x: each output reads the K-1 inputs before it; pass a separate y", op);
  UPF_TRY(batch_check(batch, op, T));
  const int64_t ws[3] = {batch->num_reqs, w->shape[1] - 1, C};
  if (state_in)
    UPF_TRY(state_check(state_in, op, "state_in (B, K-1, C)", 3, ws));
  if (state_out)
    UPF_TRY(state_check(state_out, op, "state_out (B, K-1, C)", 3, ws));
  if (state_in && state_out && state_in->data == state_out->data && batch->num_reqs > 0)
    return upf_fail(UPF_ERR_INVALID_ARG,
                    "%s: state_out is state_in: the prefill reads every initial state while it writes final ones; "
                    "pass a separate buffer",
                    op);
  return UPF_OK;
}

upf_status upf_gdn_conv_step_check(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state,
                                   const upf_tensor *y) {
  const char *op = "gdn.conv_step";
  UPF_TRY(upf_dense_check(x, op, "x (B, C)", 2, NULL));
  int64_t B = x->shape[0], C = x->shape[1];
  UPF_TRY(conv_weight_check(x, w, op, C));
  UPF_TRY(upf_dense_check(y, op, "y (B, C)", 2, x->shape));
  UPF_TRY(upf_dense_same_dtype(x, y, op, "x", "y"));
  if (!state)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: state (B, K-1, C): NULL (the step reads and updates it)", op);
  const int64_t ws[3] = {B, w->shape[1] - 1, C};
  return state_check(state, op, "state (B, K-1, C)", 3, ws);
}

upf_status upf_gdn_scan_check(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                              const upf_tensor *state_out) {
  const char *op = "gdn.scan";
  if (!in)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: inputs: NULL", op);
  UPF_TRY(upf_dense_check(in->q, op, "q (T, Hk, Dk)", 3, NULL));
  int64_t T = in->q->shape[0], Hk = in->q->shape[1], Dk = in->q->shape[2];
  UPF_TRY(upf_dense_check(in->k, op, "k (T, Hk, Dk)", 3, in->q->shape));
  const int64_t wv[3] = {T, -1, -1};
  UPF_TRY(upf_dense_check(in->v, op, "v (T, Hv, Dv)", 3, wv));
  int64_t Hv = in->v->shape[1], Dv = in->v->shape[2];
  const int64_t wab[2] = {T, Hv}, wh[1] = {Hv};
  UPF_TRY(upf_dense_check(in->a, op, "a (T, Hv)", 2, wab));
  UPF_TRY(upf_dense_check(in->b, op, "b (T, Hv)", 2, wab));
  UPF_TRY(upf_dense_same_dtype(in->q, in->k, op, "q", "k"));
  UPF_TRY(upf_dense_same_dtype(in->q, in->v, op, "q", "v"));
  UPF_TRY(upf_dense_same_dtype(in->q, in->a, op, "q", "a"));
  UPF_TRY(upf_dense_same_dtype(in->q, in->b, op, "q", "b"));
  UPF_TRY(state_check(in->a_log, op, "a_log (Hv)", 1, wh));
  UPF_TRY(state_check(in->dt_bias, op, "dt_bias (Hv)", 1, wh));
  if (Hk < 1 || Dk < 1 || Dv < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: empty heads: Hk=%lld Dk=%lld Dv=%lld", op, (long long)Hk, (long long)Dk,
                    (long long)Dv);
  if (Hv < Hk || Hv % Hk)
    return upf_fail(UPF_ERR_SHAPE, "%s: Hv=%lld value heads is not a multiple of Hk=%lld key heads", op,
                    (long long)Hv, (long long)Hk);
  const int64_t wo[3] = {T, Hv, Dv};
  UPF_TRY(upf_dense_check(o, op, "o (T, Hv, Dv)", 3, wo));
  if (o->dtype != in->v->dtype && o->dtype != UPF_DTYPE_F32)
    return upf_fail(UPF_ERR_DTYPE, "%s: o is %s: f32 or v's dtype %s", op, upf_dtype_name(o->dtype),
                    upf_dtype_name(in->v->dtype));
  UPF_TRY(batch_check(batch, op, T));
  const int64_t ws[4] = {batch->num_reqs, Hv, Dk, Dv};
  if (in->state_in)
    UPF_TRY(state_check(in->state_in, op, "state_in (B, Hv, Dk, Dv)", 4, ws));
  if (state_out)
    UPF_TRY(state_check(state_out, op, "state_out (B, Hv, Dk, Dv)", 4, ws));
  if (!(in->scale > 0.0f) || !isfinite(in->scale))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: scale=%g must be finite and > 0", op, (double)in->scale);
  return UPF_OK;
}

upf_status upf_gdn_gated_norm_check(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w,
                                    const upf_norm_params *p, const upf_tensor *y) {
  const char *op = "gdn.gated_norm";
  UPF_TRY(upf_dense_check(o, op, "o (T, H, D)", 3, NULL));
  UPF_TRY(upf_dense_check(z, op, "z (T, H, D)", 3, o->shape));
  const int64_t wd[1] = {o->shape[2]};
  UPF_TRY(upf_dense_check(w, op, "w (D)", 1, wd));
  UPF_TRY(upf_dense_check(y, op, "y (T, H, D)", 3, o->shape));
  UPF_TRY(upf_dense_same_dtype(o, z, op, "o", "z"));
  UPF_TRY(upf_dense_same_dtype(o, w, op, "o", "w"));
  UPF_TRY(upf_dense_same_dtype(o, y, op, "o", "y"));
  if (o->shape[2] < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: o (T, H, D) has D=0: no mean to take", op);
  upf_status st = upf_norm_params_check(p);
  return st == UPF_OK ? st : upf_fail_context(st, "gdn.gated_norm: ");
}

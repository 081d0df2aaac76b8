/* MoE configuration, input validation and work counts shared by every backend (uniprefill/moe.h). */
#include <stdio.h>

#include "uniprefill/moe.h"

upf_moe_config upf_moe_config_qwen3_next(void) {
  upf_moe_config c = {.hidden = 2048, .num_experts = 512, .top_k = 10, .inter = 512, .shared_inter = 512,
                      .norm_topk = 1};
  return c;
}

upf_status upf_moe_config_check(const upf_moe_config *cfg) {
  if (!cfg)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe config: NULL");
  if (cfg->hidden < 1 || cfg->inter < 1 || cfg->shared_inter < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe config: hidden=%d, inter=%d must be >= 1 and shared_inter=%d >= 0",
                    cfg->hidden, cfg->inter, cfg->shared_inter);
  if (cfg->num_experts < 1 || cfg->num_experts > 65536)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe config: num_experts=%d outside [1, 65536]", cfg->num_experts);
  if (cfg->top_k < 1 || cfg->top_k > cfg->num_experts)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe config: top_k=%d outside [1, num_experts=%d]", cfg->top_k,
                    cfg->num_experts);
  if (cfg->norm_topk != 0 && cfg->norm_topk != 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe config: norm_topk=%d must be 0 or 1", cfg->norm_topk);
  return UPF_OK;
}

static upf_status check_rows(const upf_tensor *t, const char *name, int64_t hidden) {
  char shape[96];
  if (t->ndim != 2)
    return upf_fail(UPF_ERR_SHAPE, "%s: expected 2 dims (T, H=%lld), got shape %s", name, (long long)hidden,
                    upf_tensor_shape_str(t, shape, sizeof shape));
  if (t->dtype != UPF_DTYPE_F32 && t->dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "%s: dtype %s not supported (f32 or bf16)", name, upf_dtype_name(t->dtype));
  if (t->shape[1] != hidden)
    return upf_fail(UPF_ERR_SHAPE, "%s: shape %s, expected (T, H=%lld)", name,
                    upf_tensor_shape_str(t, shape, sizeof shape), (long long)hidden);
  if (t->shape[0] < 0)
    return upf_fail(UPF_ERR_SHAPE, "%s: negative token count %lld", name, (long long)t->shape[0]);
  if (t->stride[1] != 1 || t->stride[0] < hidden)
    return upf_fail(UPF_ERR_SHAPE, "%s: rows must be contiguous with stride[0] >= H (strides %lld, %lld)", name,
                    (long long)t->stride[0], (long long)t->stride[1]);
  if (t->shape[0] > 0 && !t->data)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL data for %lld tokens", name, (long long)t->shape[0]);
  return UPF_OK;
}

upf_status upf_moe_validate(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                            const upf_tensor *out) {
  UPF_TRY(upf_moe_config_check(cfg));
  if (!x || !w)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe: x and weights must not be NULL");
  UPF_TRY(check_rows(x, "x", cfg->hidden));
  int64_t T = x->shape[0];
  if (T * (int64_t)cfg->top_k > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "x: T=%lld tokens times K=%d pairs exceed the int32 pair index", (long long)T,
                    cfg->top_k);
  if (w->dtype != x->dtype)
    return upf_fail(UPF_ERR_DTYPE, "weights: dtype %s differs from x's %s", upf_dtype_name(w->dtype),
                    upf_dtype_name(x->dtype));
  if (!w->router || !w->gate_up || !w->down)
    return upf_fail(UPF_ERR_INVALID_ARG, "weights: router=%p gate_up=%p down=%p must all be set", w->router,
                    w->gate_up, w->down);
  if (cfg->shared_inter > 0 && (!w->shared_gate_up || !w->shared_down || !w->shared_gate))
    return upf_fail(UPF_ERR_INVALID_ARG,
                    "weights: shared_inter=%d needs shared_gate_up=%p, shared_down=%p and shared_gate=%p",
                    cfg->shared_inter, w->shared_gate_up, w->shared_down, w->shared_gate);
  if (out) {
    UPF_TRY(check_rows(out, "out", cfg->hidden));
    if (out->shape[0] != T)
      return upf_fail(UPF_ERR_SHAPE, "out: %lld tokens, x has %lld", (long long)out->shape[0], (long long)T);
  }
  return UPF_OK;
}

double upf_moe_flops(const upf_moe_config *cfg, int64_t num_tokens) {
  double T = (double)num_tokens, H = cfg->hidden, E = cfg->num_experts, K = cfg->top_k;
  double In = cfg->inter, Is = cfg->shared_inter;
  double f = 2.0 * T * H * E + 2.0 * T * K * (2.0 * In * H + In * H);
  if (cfg->shared_inter > 0)
    f += 2.0 * T * (2.0 * Is * H + Is * H) + 2.0 * T * H;
  return f;
}

double upf_moe_weight_bytes(const upf_moe_config *cfg, upf_dtype dtype) {
  double H = cfg->hidden, E = cfg->num_experts, In = cfg->inter, Is = cfg->shared_inter;
  double elems = E * H + E * 3.0 * In * H;
  if (cfg->shared_inter > 0)
    elems += 3.0 * Is * H + H;
  return elems * (double)upf_dtype_size(dtype);
}

double upf_moe_unfused_traffic_bytes(const upf_moe_config *cfg, int64_t num_tokens, upf_dtype dtype,
                                     upf_dtype out_dtype) {
  const double T = (double)num_tokens, H = cfg->hidden, E = cfg->num_experts, In = cfg->inter;
  const double Is = cfg->shared_inter, n = T * cfg->top_k, a = (double)upf_dtype_size(dtype);
  const double o = (double)upf_dtype_size(out_dtype), f32 = 4.0, i32 = 4.0;
  double b = 0.0;
  b += T * H * a + E * H * a + T * E * f32;         /* router GEMM: x, router weights; logits out */
  b += T * E * f32 + n * (i32 + f32);               /* top-K: logits in; index and weight out */
  b += n * 4.0 * i32;                               /* counting sort: index reads, pair and slot writes */
  b += T * H * a + n * H * a;                       /* gather: x in, xp out */
  b += E * 2.0 * In * H * a + n * H * a + n * 2.0 * In * a; /* GEMM 1: weights, xp; h out */
  b += n * 2.0 * In * a + n * In * a;               /* SwiGLU: h in, a out */
  b += E * H * In * a + n * In * a + n * H * a;     /* GEMM 2: weights, a; y out */
  b += n * H * a + n * (i32 + f32) + T * H * o;     /* combine: y, rows and weights; out */
  if (cfg->shared_inter > 0) {
    b += H * a + T * f32;                           /* the shared gate's weights (gather), its value a token */
    b += T * H * a + 3.0 * Is * H * a;              /* shared expert: x, its weights */
    b += 2.0 * T * 2.0 * Is * a + 2.0 * T * Is * a; /* hs and as, each written and read */
    b += 2.0 * T * H * a + T * f32;                 /* ys written and read by the combine, the gate read */
  }
  return b;
}

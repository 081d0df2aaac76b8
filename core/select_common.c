/* Selection parameters, input validation and batch layout helpers shared by every backend. */
#include <math.h>
#include <stdio.h>

#include "uniprefill/select.h"

upf_select_params upf_select_params_default(void) {
  upf_select_params p = {.block = 64, .sink = 128, .last_q = 128, .p = 0.99f, .topk = 0, .scale = 0.0f, .keep_ratio = 0.0f};
  return p;
}

upf_status upf_select_params_check(const upf_select_params *params) {
  if (!params)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: NULL");
  int32_t g = params->block;
  if (g < 1 || g > (1 << 20) || (g & (g - 1)) != 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: block size G=%d is not a power of two in [1, 2^20]", g);
  if (params->sink < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: sink=%d is negative", params->sink);
  if (params->last_q < 1 || params->last_q > 4096)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: last_q=%d outside [1, 4096]", params->last_q);
  if (!(params->p > 0.0f && params->p <= 1.0f))
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: p=%g outside (0, 1]", (double)params->p);
  if (params->topk < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: topk=%d is negative", params->topk);
  if (!(params->keep_ratio == 0.0f || (params->keep_ratio > 0.0f && params->keep_ratio <= 1.0f)))
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: keep_ratio=%g outside (0, 1] (0 = off)",
                    (double)params->keep_ratio);
  if (params->keep_ratio > 0.0f && params->topk > 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: topk=%d and keep_ratio=%g both set", params->topk,
                    (double)params->keep_ratio);
  if (!isfinite(params->scale) || params->scale < 0.0f)
    return upf_fail(UPF_ERR_INVALID_ARG, "select params: scale=%g must be finite and >= 0 (0 = 1/sqrt(D))",
                    (double)params->scale);
  return UPF_OK;
}

int64_t upf_select_topk_of(const upf_select_params *params, int64_t nb) {
  if (params->keep_ratio > 0.0f)
    return (int64_t)ceil((double)params->keep_ratio * (double)nb);
  return params->topk;
}

upf_status upf_cu_seqlens_check(const int32_t *cu, int32_t num_reqs, int64_t num_tokens) {
  if (num_reqs < 1)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: needs at least 2 entries (B >= 1), got B=%d", num_reqs);
  if (!cu)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: NULL");
  if (cu[0] != 0)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: cu[0]=%d, must be 0", cu[0]);
  for (int32_t r = 0; r < num_reqs; r++) {
    if (cu[r + 1] < cu[r])
      return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: not monotone at %d: cu[%d]=%d > cu[%d]=%d", r + 1, r,
                      cu[r], r + 1, cu[r + 1]);
  }
  if ((int64_t)cu[num_reqs] != num_tokens)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: cu[B=%d]=%d does not match T=%lld tokens of q/k", num_reqs,
                    cu[num_reqs], (long long)num_tokens);
  return UPF_OK;
}

static upf_status check_qk(const upf_tensor *t, const char *name, const char *head_name) {
  char shape[96];
  if (t->ndim != 3)
    return upf_fail(UPF_ERR_SHAPE, "%s: expected 3 dims (T, %s, D), got shape %s", name, head_name,
                    upf_tensor_shape_str(t, shape, sizeof shape));
  if (t->dtype != UPF_DTYPE_F32 && t->dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "%s: dtype %s not supported (f32 or bf16)", name, upf_dtype_name(t->dtype));
  if (t->stride[2] != 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: last dim must be contiguous (stride %lld)", name, (long long)t->stride[2]);
  if (t->shape[1] < 1 || t->shape[2] < 1)
    return upf_fail(UPF_ERR_SHAPE, "%s: empty head or head-dim extent in shape %s", name,
                    upf_tensor_shape_str(t, shape, sizeof shape));
  if (t->shape[0] > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: %lld tokens exceed the int32 range of cu_seqlens", name,
                    (long long)t->shape[0]);
  return UPF_OK;
}

upf_status upf_select_validate(const upf_select_inputs *in, const upf_select_params *params) {
  UPF_TRY(upf_select_params_check(params));
  UPF_TRY(check_qk(&in->q, "q", "Hq"));
  UPF_TRY(check_qk(&in->k, "k", "Hkv"));
  char qs[96], ks[96];
  upf_tensor_shape_str(&in->q, qs, sizeof qs);
  upf_tensor_shape_str(&in->k, ks, sizeof ks);
  if (in->q.dtype != in->k.dtype)
    return upf_fail(UPF_ERR_DTYPE, "q is %s but k is %s: both must share one dtype", upf_dtype_name(in->q.dtype),
                    upf_dtype_name(in->k.dtype));
  if (in->q.shape[0] != in->k.shape[0])
    return upf_fail(UPF_ERR_SHAPE, "q %s and k %s disagree on the token count T", qs, ks);
  if (in->q.shape[2] != in->k.shape[2])
    return upf_fail(UPF_ERR_SHAPE, "q %s and k %s disagree on the head dim D", qs, ks);
  if (in->q.shape[1] % in->k.shape[1] != 0)
    return upf_fail(UPF_ERR_SHAPE, "Hq=%lld (q %s) is not a multiple of Hkv=%lld (k %s)",
                    (long long)in->q.shape[1], qs, (long long)in->k.shape[1], ks);
  if (!in->cu_seqlens_host)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: host copy missing");
  return upf_cu_seqlens_check(in->cu_seqlens_host, in->num_reqs, in->q.shape[0]);
}

void upf_select_block_offsets(const int32_t *cu_host, int32_t num_reqs, int32_t block, int64_t *block_offset) {
  block_offset[0] = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    block_offset[r + 1] = block_offset[r] + upf_select_blocks_of(cu_host[r + 1] - cu_host[r], block);
}

void upf_select_score_offsets(const int32_t *cu_host, int32_t num_reqs, int32_t num_q_heads,
                              const upf_select_params *params, int64_t *score_offset) {
  score_offset[0] = 0;
  for (int32_t r = 0; r < num_reqs; r++) {
    int64_t n = cu_host[r + 1] - cu_host[r];
    int64_t slab = upf_select_is_scored(n, params) ? (int64_t)num_q_heads * params->last_q * n : 0;
    score_offset[r + 1] = score_offset[r] + slab;
  }
}

float upf_select_scale(const upf_select_params *params, int32_t head_dim) {
  return params->scale > 0.0f ? params->scale : (float)(1.0 / sqrt((double)head_dim));
}

/* The Gated DeltaNet block of Qwen3-Next:
 *   proj (T, C + Hv Dv) = hidden . ssm_in: [q (Hk Dk) | k (Hk Dk) | v (Hv Dv) | z (Hv Dv)]
 *   ba (T, 2 Hv)        = hidden . ssm_ba: [b | a]
 *   conv (T, C)         = silu(causal conv1d of proj[:, :C]) over each request (compacted order, as if
 *                         contiguous: a dropped token leaves the window)
 *   o (T, Hv, Dv)       = gated delta rule over q, k, v of conv with beta = sigmoid(b), g from a
 *   o                  <- rmsnorm(o) * ssm_norm * silu(z)
 *   out (T, H)          = o . ssm_out;  residual += out;  hidden = ffn_norm(residual) */
#include <math.h>

#include "layers/layers.h"

upf_status upf_layer_gdn(const upf_model *m, int32_t layer, upf_tokens *tok, upf_layer_scratch *s) {
  const upf_model_config *c = m->cfg;
  const upf_backend *be = m->be;
  const upf_layer_weights *w = &m->layers[layer];
  const int64_t T = tok->num_tokens, H = c->hidden, C = upf_model_gdn_conv_dim(c);
  const int64_t Hk = c->gdn_key_heads, Hv = c->gdn_value_heads, Dk = c->gdn_key_dim, Dv = c->gdn_value_dim;

  const upf_tensor hidden = upf_mat(tok->hidden, m->dtype, T, H);
  const upf_tensor proj = upf_mat(s->proj, m->dtype, T, C + Hv * Dv);
  const upf_tensor ba = upf_mat(s->ba, m->dtype, T, 2 * Hv);
  UPF_TRY(be->gemm(&hidden, &w->ssm_in, &proj));
  UPF_TRY(be->gemm(&hidden, &w->ssm_ba, &ba));

  const upf_gdn_batch batch = {tok->cu_seqlens, tok->cu_seqlens_host, tok->num_reqs};
  const upf_tensor x = upf_cols(&proj, 0, C);
  const upf_tensor conv = upf_mat(s->conv, m->dtype, T, C);
  /* A session step carries each request's conv and recurrent state in and out (gathered from and
   * scattered back to its pool slot); a plain prefill starts from zeros and keeps nothing. */
  const upf_layer_cache *kc = s->cache;
  const int64_t K1 = c->gdn_conv_kernel - 1, B = tok->num_reqs;
  const int64_t conv_shape[3] = {B, K1, C}, rec_shape[4] = {B, Hv, Dk, Dv};
  upf_tensor conv_in, conv_out, rec;
  if (kc) {
    upf_tensor_init(&conv_in, kc->conv_in, UPF_DTYPE_F32, 3, conv_shape);
    upf_tensor_init(&conv_out, kc->conv_out, UPF_DTYPE_F32, 3, conv_shape);
    upf_tensor_init(&rec, kc->rec, UPF_DTYPE_F32, 4, rec_shape);
    UPF_TRY(be->compact_rows(kc->conv_pool, kc->pool_rows, K1 * C * 4, kc->gather, B, kc->conv_in));
    UPF_TRY(be->compact_rows(kc->rec_pool, kc->pool_rows, Hv * Dk * Dv * 4, kc->gather, B, kc->rec));
  }
  UPF_TRY(be->gdn_conv(&batch, &x, &w->ssm_conv1d, kc ? &conv_in : NULL, kc ? &conv_out : NULL, &conv));

  const upf_tensor q = upf_heads(&conv, 0, Hk, Dk, Dk);
  const upf_tensor k = upf_heads(&conv, Hk * Dk, Hk, Dk, Dk);
  const upf_tensor v = upf_heads(&conv, 2 * Hk * Dk, Hv, Dv, Dv);
  const upf_tensor b = upf_cols(&ba, 0, Hv), a = upf_cols(&ba, Hv, Hv);
  const upf_gdn_scan_inputs in = {&q, &k, &v, &a, &b, &w->ssm_a, &w->ssm_dt, kc ? &rec : NULL, (float)(1.0 / sqrt((double)Dk))};
  const upf_tensor o2 = upf_mat(s->mix, m->dtype, T, Hv * Dv);
  const upf_tensor o = upf_heads(&o2, 0, Hv, Dv, Dv);
  UPF_TRY(be->gdn_scan(&batch, &in, &o, kc ? &rec : NULL));
  if (kc) {
    UPF_TRY(be->scatter_rows(kc->conv_out, B, K1 * C * 4, kc->scatter, kc->scatter_host, kc->conv_pool, kc->pool_rows));
    UPF_TRY(be->scatter_rows(kc->rec, B, Hv * Dk * Dv * 4, kc->scatter, kc->scatter_host, kc->rec_pool, kc->pool_rows));
  }
  const upf_tensor z = upf_heads(&proj, C, Hv, Dv, Dv);
  UPF_TRY(be->gdn_gated_norm(&o, &z, &w->ssm_norm, &c->gdn_norm, &o));

  const upf_tensor out = upf_mat(s->out, m->dtype, T, H);
  UPF_TRY(be->gemm(&o2, &w->ssm_out, &out));
  UPF_TRY(upf_layer_allreduce(m, &out));
  return upf_layer_add_norm(m, tok, s, &w->ffn_norm);
}

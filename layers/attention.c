/* The attention block (full or sliding-window), shared by the three families:
 *   qkv (T, Nqkv)       = hidden (T, H) . attn_qkv (H, Nqkv)
 *   q (T, Hq, D), gate (T, Hq, D) [Qwen3-Next], k, v (T, Hkv, D)   views of qkv
 *   q, k               <- q/k RMSNorm per head [Gemma-3, Qwen3-Next], then RoPE at the original positions
 *   o (T, Hq, D)        = causal attention (sliding window on local layers, counted in compacted indices)
 *   o                  <- o * sigmoid(gate) [Qwen3-Next]
 *   out (T, H)          = o . attn_output (Hq D, H), post-attention norm [Gemma-3]
 *   residual += out;  hidden = ffn_norm(residual) */
#include "layers/layers.h"

upf_status upf_layer_add_norm(const upf_model *m, upf_tokens *tok, upf_layer_scratch *s, const upf_tensor *norm_w) {
  const int64_t T = tok->num_tokens, H = m->cfg->hidden;
  const upf_tensor out = upf_mat(s->out, m->dtype, T, H);
  const upf_tensor residual = upf_mat(tok->residual, m->dtype, T, H);
  const upf_tensor hidden = upf_mat(tok->hidden, m->dtype, T, H);
  return m->be->rmsnorm_add(&out, &residual, norm_w, &m->cfg->norm, &hidden);
}

upf_status upf_layer_attention(const upf_model *m, int32_t layer, upf_tokens *tok, upf_layer_scratch *s,
                               upf_attn_qk *qk) {
  const upf_model_config *c = m->cfg;
  const upf_backend *be = m->be;
  const upf_layer_weights *w = &m->layers[layer];
  const int64_t T = tok->num_tokens, H = c->hidden, D = c->head_dim, Hq = c->q_heads, Hkv = c->kv_heads;
  const int64_t q_head_stride = D * (1 + c->attn_gate); /* Qwen3-Next: [query | gate] per head */
  const upf_mixer_kind kind = upf_model_mixer(c, layer);

  const upf_tensor hidden = upf_mat(tok->hidden, m->dtype, T, H);
  const upf_tensor qkv = upf_mat(s->proj, m->dtype, T, upf_model_qkv_cols(c));
  UPF_TRY(be->gemm(&hidden, &w->attn_qkv, &qkv));
  const upf_tensor q = upf_heads(&qkv, 0, Hq, D, q_head_stride);
  const upf_tensor k = upf_heads(&qkv, Hq * q_head_stride, Hkv, D, D);
  const upf_tensor v = upf_heads(&qkv, Hq * q_head_stride + Hkv * D, Hkv, D, D);
  if (c->qk_norm) {
    UPF_TRY(be->qk_norm(&q, &w->attn_q_norm, &c->norm, &q));
    UPF_TRY(be->qk_norm(&k, &w->attn_k_norm, &c->norm, &k));
  }
  UPF_TRY(be->rope(&q, &k, tok->positions, kind == UPF_MIXER_SLIDING ? &c->rope_sliding : &c->rope_full));

  const upf_attn_varlen batch = {tok->num_reqs, tok->cu_seqlens, tok->cu_seqlens_host, tok->cu_seqlens,
                                 tok->cu_seqlens_host};
  upf_attn_params p = c->attn;
  p.window = kind == UPF_MIXER_SLIDING ? c->window : 0;
  const upf_tensor o2 = upf_mat(s->mix, m->dtype, T, Hq * D);
  const upf_tensor o = upf_heads(&o2, 0, Hq, D, D);
  UPF_TRY(be->attn_prefill(&batch, &q, &k, &v, &p, &o, NULL));
  if (c->attn_gate) {
    const upf_tensor gate = upf_heads(&qkv, D, Hq, D, q_head_stride);
    UPF_TRY(be->gated_output(&o, &gate, &o));
  }
  const upf_tensor out = upf_mat(s->out, m->dtype, T, H);
  UPF_TRY(be->gemm(&o2, &w->attn_output, &out));
  UPF_TRY(upf_layer_allreduce(m, &out));
  if (c->sandwich_norm)
    UPF_TRY(be->rmsnorm(&out, &w->post_attn_norm, &c->norm, &out));
  UPF_TRY(upf_layer_add_norm(m, tok, s, &w->ffn_norm));
  if (qk)
    qk->q = q, qk->k = k;
  return UPF_OK;
}

/* The FFN block: out (T, H) = FFN(hidden), the dense gated FFN (SwiGLU, GeGLU) or the MoE layer with
 * its shared expert, then the post-FFN norm (Gemma-3 sandwich). Per token, so it runs unchanged on a
 * compacted batch. */
#include "layers/layers.h"

upf_status upf_layer_ffn(const upf_model *m, int32_t layer, upf_tokens *tok, upf_layer_scratch *s) {
  const upf_model_config *c = m->cfg;
  const upf_backend *be = m->be;
  const upf_layer_weights *w = &m->layers[layer];
  const upf_tensor hidden = upf_mat(tok->hidden, m->dtype, tok->num_tokens, c->hidden);
  const upf_tensor out = upf_mat(s->out, m->dtype, tok->num_tokens, c->hidden);
  if (c->ffn == UPF_FFN_MOE) {
    const upf_moe_weights mw = {m->dtype,
                                w->moe_router.data,
                                w->moe_gate_up.data,
                                w->moe_down.data,
                                w->moe_shared_gate_up.data,
                                w->moe_shared_down.data,
                                w->moe_shared_gate.data};
    UPF_TRY(be->moe_ffn(&c->moe, &hidden, &mw, &out, NULL));
  } else {
    UPF_TRY(be->ffn_gated(&hidden, &w->ffn_gate_up, &w->ffn_down, c->act, &out));
  }
  UPF_TRY(upf_layer_allreduce(m, &out));
  if (c->sandwich_norm)
    UPF_TRY(be->rmsnorm(&out, &w->post_ffn_norm, &c->norm, &out));
  return UPF_OK;
}

/* Tensor parallelism of the model (SPEC.md section 5): the shapes one rank holds. Heads split as in
 * upf_head_split_of (kv heads replicated when Hkv < R; Gated DeltaNet value heads split like query
 * heads and key heads like kv heads); the dense FFN and the MoE split by intermediate size: every rank
 * holds I / R of the FFN, of every expert and of the shared expert, and the replicated router sends
 * each token to the same experts on every rank. Splitting MoE by intermediate rather than by experts
 * keeps every rank's work equal whatever the routing (an expert split would load the rank that holds
 * the popular experts) and needs only the one all-reduce after the down projections that the dense
 * FFN needs; the weights (models/weights.c) take their values from the whole model at these indices. */
#include "uniprefill/model.h"

static upf_status split_size(const char *model, const char *what, int32_t total, int32_t size, int32_t *out) {
  if (total % size)
    return upf_fail(UPF_ERR_SHAPE, "model %s: %s %d does not divide over %d tensor-parallel ranks", model, what, total,
                    size);
  *out = total / size;
  return UPF_OK;
}

upf_status upf_model_config_tp_slice(const upf_model_config *cfg, int32_t rank, int32_t size, upf_model_config *out) {
  *out = *cfg;
  if (size == 1 && rank == 0)
    return UPF_OK;
  upf_head_split hs;
  upf_status st = upf_head_split_of(cfg->q_heads, cfg->kv_heads, rank, size, &hs);
  if (st != UPF_OK)
    return upf_fail_context(st, cfg->name);
  out->q_heads = hs.nq, out->kv_heads = hs.nkv;
  if (cfg->other_mixer == UPF_MIXER_GDN) {
    upf_head_split gs;
    st = upf_head_split_of(cfg->gdn_value_heads, cfg->gdn_key_heads, rank, size, &gs);
    if (st != UPF_OK)
      return upf_fail_context(st, "Gated DeltaNet value/key heads");
    out->gdn_value_heads = gs.nq, out->gdn_key_heads = gs.nkv;
  }
  if (cfg->ffn == UPF_FFN_MOE) {
    UPF_TRY(split_size(cfg->name, "expert intermediate size", cfg->moe.inter, size, &out->moe.inter));
    UPF_TRY(split_size(cfg->name, "shared-expert intermediate size", cfg->moe.shared_inter, size,
                       &out->moe.shared_inter));
  } else {
    UPF_TRY(split_size(cfg->name, "FFN intermediate size", cfg->inter, size, &out->inter));
  }
  return UPF_OK;
}

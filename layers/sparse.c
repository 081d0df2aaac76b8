/* FlashPrefill V2 in place of dense attention in a full-attention layer (SPEC section 8): block means,
 * the index of kept key blocks, block-sparse attention over it, over the step's own K/V (whole prompts)
 * or the paged cache (prefill chunks over their cached context). The synchronizes around the two phases
 * let the step report the index's cost apart from the attention's. */
#include <time.h>

#include "layers/layers.h"

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

upf_status upf_layer_sparse_attend(const upf_model *m, upf_layer_sparse *sp, const upf_sparse_batch *batch,
                                   const upf_tensor *q, const upf_tensor *k, const upf_tensor *v, const upf_tensor *o) {
  const upf_backend *be = m->be;
  const upf_model_config *c = m->cfg;
  const upf_sparse_batch b = *batch;
  const int64_t shape[4] = {sp->plan.num_reqs, sp->plan.max_key_blocks, c->kv_heads, c->head_dim};
  upf_tensor kbar, vbar;
  upf_tensor_init(&kbar, sp->kbar, m->dtype, 4, shape);
  upf_tensor_init(&vbar, sp->vbar, m->dtype, 4, shape);
  const upf_tensor *vb = sp->vbar ? &vbar : NULL; /* vbar is read by the mean correction only */
  UPF_TRY(be->synchronize()); /* the projections and RoPE before are not the index's time */
  const double t0 = now_seconds();
  UPF_TRY(be->sparse_block_means(&b, k, v, &sp->params, &kbar, vb));
  UPF_TRY(be->sparse_index(&b, q, &kbar, &sp->params, &sp->index));
  UPF_TRY(be->synchronize());
  const double t1 = now_seconds();
  UPF_TRY(be->attn_block_sparse(&b, q, k, v, &sp->params, &sp->index, &kbar, vb, o));
  UPF_TRY(be->synchronize());
  sp->rec.kept_blocks = sp->index.kept_total;
  sp->rec.visible_blocks = sp->visible_blocks;
  sp->rec.index_seconds = t1 - t0;
  sp->rec.attn_seconds = now_seconds() - t1;
  return UPF_OK;
}

/* FlashPrefill V2 in place of dense attention in a full-attention layer (SPEC section 8): block means,
 * the index of kept key blocks, block-sparse attention over it, over the step's own K/V (whole prompts)
 * or the paged cache (prefill chunks over their cached context). The synchronizes around the two phases
 * let the step report the index's cost apart from the attention's. */
#include <stdlib.h>
#include <time.h>

#include "layers/layers.h"

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* rec.neighbour_*: the index's row_ptr and kept blocks copied to the host and compared tile by tile. */
static upf_status index_sharing(const upf_backend *be, upf_layer_sparse *sp) {
  const int64_t S = sp->plan.num_segments, kept = sp->index.kept_total;
  int32_t *row_ptr = malloc((size_t)(S + 1) * sizeof *row_ptr);
  int32_t *blocks = malloc((size_t)(kept ? kept : 1) * sizeof *blocks);
  upf_status st = row_ptr && blocks ? UPF_OK
                                    : upf_fail(UPF_ERR_NOMEM, "prefill: a host copy of the index (%lld kept blocks)",
                                               (long long)kept);
  if (st == UPF_OK)
    st = be->download(row_ptr, sp->index.row_ptr, (size_t)(S + 1) * sizeof *row_ptr);
  if (st == UPF_OK && kept)
    st = be->download(blocks, sp->index.blocks, (size_t)kept * sizeof *blocks);
  if (st == UPF_OK && row_ptr[S] != kept)
    st = upf_fail(UPF_ERR_INVALID_ARG, "prefill: the index holds %d blocks, its kept_total says %lld", row_ptr[S],
                  (long long)kept);
  if (st == UPF_OK)
    upf_sparse_neighbour_blocks(&sp->plan, row_ptr, blocks, &sp->rec.neighbour_shared, &sp->rec.neighbour_total);
  free(row_ptr), free(blocks);
  return st;
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
  sp->rec.neighbour_total = sp->rec.neighbour_shared = 0;
  return sp->sharing ? index_sharing(be, sp) : UPF_OK;
}

/* The layer walk of models/prefill.c as one step of a session (models/session.c): given positions and a
 * hook that, before each layer, points the scratch's cache at what the session keeps (paged K/V, slot
 * mapping, Gated DeltaNet state slots). upf_model_prefill is this walk with neither. */
#ifndef UNIPREFILL_MODELS_STEP_H
#define UNIPREFILL_MODELS_STEP_H

#include "layers/layers.h"

typedef struct {
  int32_t num_prefill_rows; /* rows [0, Bp) whole prompts (the rows that may drop) */
  int32_t num_chunk_rows;   /* rows [Bp, Bp + Bc) prefill chunks over the paged cache; the rest decode rows */
  const int32_t *chunk_kv_lens; /* (Bc) host: each chunk's cached context plus itself (FlashPrefill's plan) */
  /* Called before each layer's mixer with the tokens entering it (after the drops so far). */
  upf_status (*before_layer)(void *user, int32_t layer, const upf_tokens *tok, upf_layer_scratch *s);
  void *user;
} upf_step_hooks;

/* upf_model_prefill with positions (T) host (NULL: 0.. within each request) and hooks (NULL: none). */
upf_status upf_model_run_step(const upf_model *m, const int32_t *ids, const int32_t *cu_seqlens,
                              const int32_t *positions, int32_t num_reqs, const upf_prefill_options *opt,
                              const upf_step_hooks *hooks, upf_prefill_result *res);

#endif

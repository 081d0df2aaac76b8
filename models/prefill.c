/* The prefill of a packed batch: embedding, the layers in order with the drop step after each drop
 * layer's attention block (UniPrefill mode) or block-sparse full attention (FlashPrefill mode), the
 * final norm and the last-position logits of each request. The walk over the layers is the model;
 * buffers, timing and validation sit around it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "layers/layers.h"
#include "models/step.h"
#include "uniprefill/bf16.h"

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Widest columns any layer of the model writes into each scratch buffer. */
typedef struct {
  int64_t proj, mix, conv, ba;
} scratch_cols;

static scratch_cols scratch_widths(const upf_model_config *c) {
  scratch_cols w = {upf_model_qkv_cols(c), (int64_t)c->q_heads * c->head_dim, 0, 0};
  if (c->other_mixer == UPF_MIXER_GDN) {
    const int64_t HvDv = (int64_t)c->gdn_value_heads * c->gdn_value_dim, C = upf_model_gdn_conv_dim(c);
    w.proj = w.proj > C + HvDv ? w.proj : C + HvDv;
    w.mix = w.mix > HvDv ? w.mix : HvDv;
    w.conv = C, w.ba = 2 * (int64_t)c->gdn_value_heads;
  }
  return w;
}

const char *upf_prefill_mode_name(upf_prefill_mode mode) {
  return mode == UPF_PREFILL_UNIPREFILL      ? "uniprefill"
         : mode == UPF_PREFILL_FLASHPREFILL ? "flashprefill"
         : mode == UPF_PREFILL_COMPACT      ? "compact"
                                            : "dense";
}

upf_sparse_params upf_prefill_sparse_default(void) {
  upf_sparse_params p = upf_sparse_params_default();
  p.alpha = 0.18f, p.block_n = 128;
  return p;
}

double upf_prefill_kept_share(const upf_prefill_result *res) {
  int64_t kept = 0, visible = 0;
  for (int32_t i = 0; i < res->num_sparse; i++)
    kept += res->sparse[i].kept_blocks, visible += res->sparse[i].visible_blocks;
  return visible > 0 ? (double)kept / (double)visible : 1.0;
}

/* The parameters a step runs: the model's attention scale unless one is given. */
static upf_sparse_params sparse_params(const upf_model_config *c, const upf_prefill_options *opt) {
  upf_sparse_params p = opt->sparse;
  if (p.scale == 0.0f)
    p.scale = c->attn.scale; /* 0 there too: 1/sqrt(D), the same convention */
  return p;
}

/* The plan of the prefill rows [0, Bp) of cu (host) over their own K/V, and its visible blocks. */
static upf_status sparse_plan(const upf_model *m, const int32_t *cu, int32_t Bp, const upf_sparse_params *p,
                              upf_sparse_plan *plan, int64_t *visible) {
  const upf_attn_varlen v = {Bp, NULL, cu, NULL, cu};
  const upf_sparse_batch b = {&v, NULL};
  UPF_TRY(upf_sparse_plan_make(&b, m->cfg->q_heads, m->cfg->kv_heads, p, plan));
  *visible = upf_sparse_visible_blocks(&b, plan, p);
  return UPF_OK;
}

/* Bytes of the sparse scratch: kbar (vbar the same), row_ptr, blocks. */
static void sparse_bytes(const upf_model *m, const upf_sparse_plan *plan, size_t *means, size_t *row_ptr,
                         size_t *blocks) {
  *means = (size_t)plan->num_reqs * (size_t)plan->max_key_blocks * (size_t)m->cfg->kv_heads *
           (size_t)m->cfg->head_dim * upf_dtype_size(m->dtype);
  *row_ptr = ((size_t)plan->num_segments + 1) * sizeof(int32_t);
  *blocks = (size_t)plan->num_segments * (size_t)plan->max_key_blocks * sizeof(int32_t);
}

/* The scratch of a plan made (sp->params, sp->plan set). */
static upf_status sparse_alloc(const upf_model *m, upf_layer_sparse *sp) {
  const upf_backend *be = m->be;
  size_t means, row_ptr, blocks;
  sparse_bytes(m, &sp->plan, &means, &row_ptr, &blocks);
  UPF_TRY(be->alloc(&sp->kbar, means ? means : 1));
  if (sp->params.mean_correction)
    UPF_TRY(be->alloc(&sp->vbar, means ? means : 1));
  UPF_TRY(be->alloc((void **)&sp->index.row_ptr, row_ptr));
  return be->alloc((void **)&sp->index.blocks, blocks ? blocks : 1);
}

static upf_status sparse_setup(const upf_model *m, const int32_t *cu, int32_t Bp, const upf_prefill_options *opt,
                               upf_layer_sparse *sp) {
  sp->params = sparse_params(m->cfg, opt);
  sp->sharing = opt->sparse_sharing;
  UPF_TRY(sparse_plan(m, cu, Bp, &sp->params, &sp->plan, &sp->visible_blocks));
  return sparse_alloc(m, sp);
}

/* The plan of a session step's prefill chunks (rows [Bp, Bp + Bc) of cu, host) over the paged cache:
 * kv_lens (Bc) their cached context plus themselves. */
static upf_status sparse_setup_chunks(const upf_model *m, const int32_t *cu, int32_t Bp, int32_t Bc,
                                      const int32_t *kv_lens, const upf_prefill_options *opt, upf_layer_sparse *sp) {
  int32_t *cu_c = malloc((size_t)(Bc + 1) * sizeof *cu_c);
  if (!cu_c)
    return upf_fail(UPF_ERR_NOMEM, "prefill: chunk plan");
  for (int32_t r = 0; r <= Bc; r++)
    cu_c[r] = cu[Bp + r] - cu[Bp];
  const upf_attn_paged pg = {Bc, NULL, cu_c, NULL, kv_lens, NULL, NULL, 0, 0};
  const upf_sparse_batch b = {NULL, &pg};
  sp->params = sparse_params(m->cfg, opt);
  sp->sharing = opt->sparse_sharing;
  upf_status st = upf_sparse_plan_make(&b, m->cfg->q_heads, m->cfg->kv_heads, &sp->params, &sp->plan);
  if (st == UPF_OK)
    sp->visible_blocks = upf_sparse_visible_blocks(&b, &sp->plan, &sp->params);
  free(cu_c);
  return st == UPF_OK ? sparse_alloc(m, sp) : st;
}

static void sparse_free(const upf_backend *be, upf_layer_sparse *sp) {
  void *list[] = {sp->kbar, sp->vbar, sp->index.row_ptr, sp->index.blocks};
  for (size_t i = 0; i < sizeof list / sizeof *list; i++)
    if (list[i])
      be->release(list[i]);
  upf_sparse_plan_free(&sp->plan);
  memset(sp, 0, sizeof *sp);
}

/* Host checks of the FlashPrefill parameters against the model. */
static upf_status sparse_check(const upf_model *m, const upf_prefill_options *opt) {
  const upf_sparse_params p = sparse_params(m->cfg, opt);
  UPF_TRY(upf_sparse_params_check(&p));
  if (m->cfg->attn.softcap > 0.0f)
    return upf_fail(UPF_ERR_UNSUPPORTED, "prefill: flashprefill: %s soft-caps its attention logits (%g), which "
                    "attn.block_sparse does not", m->cfg->name, (double)m->cfg->attn.softcap);
  return UPF_OK;
}

/* COMPACT: the selector's parameters (last_n 0: the default 2 would make the chunk's last tiles, and so
 * the union, dense) and the union's; the same refusals as FlashPrefill's selector. */
static upf_sparse_params compact_sparse_params(const upf_model_config *c, const upf_prefill_options *opt) {
  upf_sparse_params p = sparse_params(c, opt);
  p.last_n = 0;
  return p;
}

static upf_status compact_check(const upf_model *m, const upf_prefill_options *opt) {
  const upf_sparse_params p = compact_sparse_params(m->cfg, opt);
  UPF_TRY(upf_sparse_params_check(&p));
  UPF_TRY(upf_compact_params_check(&opt->compact));
  if (m->cfg->attn.softcap > 0.0f)
    return upf_fail(UPF_ERR_UNSUPPORTED, "prefill: compact: %s soft-caps its attention logits (%g), which the "
                    "block-sparse selector does not", m->cfg->name, (double)m->cfg->attn.softcap);
  return UPF_OK;
}

/* The compact state of a step's chunks (rows [Bp, Bp + Bc)); *use 0 when none has cached context (the
 * chunks then run dense). kv_lens (Bc) host. */
static upf_status compact_setup(const upf_model *m, const int32_t *cu, int32_t Bp, int32_t Bc, const int32_t *kv_lens,
                                const upf_prefill_options *opt, upf_layer_compact *cc, int *use) {
  *use = 0;
  int32_t max_kv = 1;
  for (int32_t r = 0; r < Bc; r++) {
    *use |= kv_lens[r] > cu[Bp + r + 1] - cu[Bp + r];
    max_kv = kv_lens[r] > max_kv ? kv_lens[r] : max_kv;
  }
  if (!*use)
    return UPF_OK;
  cc->params = compact_sparse_params(m->cfg, opt), cc->cp = opt->compact;
  cc->key_blocks = (max_kv + cc->params.block_n - 1) / cc->params.block_n;
  cc->table = calloc((size_t)Bc * (size_t)m->cfg->kv_heads * (size_t)cc->key_blocks, 1);
  return cc->table ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "prefill: compact union tables");
}

upf_status upf_model_memory_plan_batch(const upf_model *m, const int32_t *cu, int32_t B, const upf_prefill_options *opt,
                                       upf_memory_plan *plan) {
  *plan = upf_model_memory_plan(m, cu[B], B);
  if (opt->mode != UPF_PREFILL_FLASHPREFILL)
    return UPF_OK;
  UPF_TRY(sparse_check(m, opt));
  const upf_sparse_params p = sparse_params(m->cfg, opt);
  upf_sparse_plan sp;
  int64_t visible;
  UPF_TRY(sparse_plan(m, cu, B, &p, &sp, &visible));
  size_t means, row_ptr, blocks;
  sparse_bytes(m, &sp, &means, &row_ptr, &blocks);
  plan->sparse = (double)means * (p.mean_correction ? 2 : 1) + (double)row_ptr + (double)blocks;
  upf_sparse_plan_free(&sp);
  return UPF_OK;
}

upf_memory_plan upf_model_memory_plan(const upf_model *m, int64_t T, int32_t B) {
  const upf_model_config *c = m->cfg;
  const double e = (double)upf_dtype_size(m->dtype), H = c->hidden;
  const scratch_cols w = scratch_widths(c);
  upf_memory_plan p = {m->weight_bytes, 0, 0, 0, 0};
  /* residual, hidden, out, spare; proj, mix, conv, ba; ids, positions, origin, spare_i32 */
  p.activations = (double)T * (e * (4 * H + (double)(w.proj + w.mix + w.conv + w.ba)) + 4 * 4);
  /* the backend's own scratch of the widest op: the dense FFN's (T, 2I) and (T, I), or the MoE layer's
   * (T*K rows of 2I, I and H) */
  const double ffn_ws = c->ffn == UPF_FFN_MOE
                            ? (double)T * c->moe.top_k * e * (3.0 * c->moe.inter + H) + (double)T * e * 3 * c->moe.shared_inter
                            : (double)T * e * 3 * c->inter;
  p.activations += ffn_ws;
  p.selection = (double)T * (1 + 4) + (double)(2 * B + 1) * 4 + (double)B * c->vocab * 4;
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    if (upf_model_mixer(c, l) != UPF_MIXER_GDN)
      p.kv_dense += 2.0 * (double)T * c->kv_heads * c->head_dim * e;
  return p;
}

/* Host checks of the batch, before any device work. */
static upf_status check_batch(const upf_model *m, const int32_t *ids, const int32_t *cu, int32_t B,
                              const upf_prefill_options *opt) {
  if (B < 1)
    return upf_fail(UPF_ERR_CU_SEQLENS, "prefill: needs at least one request");
  UPF_TRY(upf_cu_seqlens_check(cu, B, cu[B]));
  for (int32_t r = 0; r < B; r++)
    if (cu[r + 1] == cu[r])
      return upf_fail(UPF_ERR_CU_SEQLENS, "prefill: request %d has no tokens", r);
  for (int64_t t = 0; t < cu[B]; t++)
    if (ids[t] < 0 || ids[t] >= m->cfg->vocab)
      return upf_fail(UPF_ERR_INVALID_ARG, "prefill: token id %d at position %lld is outside the vocabulary [0, %d)",
                      ids[t], (long long)t, m->cfg->vocab);
  if (opt->mode == UPF_PREFILL_UNIPREFILL)
    UPF_TRY(upf_select_params_check(&opt->select));
  if (opt->mode == UPF_PREFILL_FLASHPREFILL)
    UPF_TRY(sparse_check(m, opt));
  else if (opt->mode == UPF_PREFILL_COMPACT)
    UPF_TRY(compact_check(m, opt));
  else if (opt->mode != UPF_PREFILL_DENSE && opt->mode != UPF_PREFILL_UNIPREFILL)
    return upf_fail(UPF_ERR_INVALID_ARG, "prefill: mode %d is not a prefill mode", (int)opt->mode);
  for (int64_t t = 0; opt->targets && t < cu[B]; t++)
    if (opt->targets[t] < -1 || opt->targets[t] >= m->cfg->vocab)
      return upf_fail(UPF_ERR_INVALID_ARG, "prefill: target %d at position %lld is outside the vocabulary [0, %d) (or -1)",
                      opt->targets[t], (long long)t, m->cfg->vocab);
  if (opt->tail_logits < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "prefill: tail_logits %d is negative", opt->tail_logits);
  return UPF_OK;
}

/* Per-position outputs through logits.rows over the final hidden rows `last` (T', H): the rows of every
 * position (per_position or targets) or only the tails, the tails' whole logits. */
static upf_status position_outputs(const upf_model *m, const upf_prefill_options *opt, const upf_tokens *tok,
                                   const upf_tensor *last, upf_prefill_result *res) {
  const upf_backend *be = m->be;
  const int64_t T = tok->num_tokens, V = m->cfg->vocab, N = opt->tail_logits;
  const int32_t B = tok->num_reqs, *cu = tok->cu_seqlens_host;
  const int all = opt->per_position || opt->targets;
  for (int32_t r = 0; r < B; r++)
    if (cu[r + 1] - cu[r] < N)
      return upf_fail(UPF_ERR_INVALID_ARG, "prefill: tail_logits %lld but request %d has %d positions at the LM head",
                      (long long)N, r, cu[r + 1] - cu[r]);
  const int64_t R = all ? T : (int64_t)B * N, F = (int64_t)B * N;
  int32_t *origin = malloc((size_t)(T ? T : 1) * sizeof *origin), *rows = malloc((size_t)(R ? R : 1) * sizeof *rows);
  int32_t *targets = malloc((size_t)(R ? R : 1) * sizeof *targets), *full = malloc((size_t)(F ? F : 1) * sizeof *full);
  double *lse = malloc((size_t)(R ? R : 1) * sizeof *lse), *tlogit = malloc((size_t)(R ? R : 1) * sizeof *tlogit);
  upf_logits_rows_out out = {0};
  upf_status st = origin && rows && targets && full && lse && tlogit ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "prefill: position outputs");
  if (st == UPF_OK)
    st = be->download(origin, tok->origin, (size_t)T * sizeof *origin);
  for (int32_t r = 0, k = 0; st == UPF_OK && r < B; r++)
    for (int64_t i = 0; i < N; i++, k++) { /* tail rows: packed rows cu[r+1]-N .. cu[r+1]-1 */
      full[k] = all ? (int32_t)(cu[r + 1] - N + i) : k;
      if (!all)
        rows[k] = (int32_t)(cu[r + 1] - N + i);
    }
  for (int64_t i = 0; all && i < R; i++)
    rows[i] = (int32_t)i;
  for (int64_t i = 0; i < R && st == UPF_OK; i++)
    targets[i] = opt->targets ? opt->targets[origin[rows[i]]] : -1;
  if (st == UPF_OK)
    st = be->alloc((void **)&out.argmax, (size_t)(R ? R : 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->alloc((void **)&out.lse, (size_t)(R ? R : 1) * sizeof(double));
  if (st == UPF_OK && opt->targets)
    st = be->alloc((void **)&out.target, (size_t)(R ? R : 1) * sizeof(double));
  if (st == UPF_OK && F)
    st = be->alloc((void **)&out.full, (size_t)(F * V) * sizeof(float));
  const upf_logits_rows_sel sel = {rows, R, opt->targets ? targets : NULL, full, F};
  if (st == UPF_OK)
    st = be->logits_rows(last, &sel, &m->output_norm, &m->cfg->norm, &m->output, &out);
  if (st == UPF_OK && all) {
    res->num_positions = T;
    res->position_origin = origin, origin = NULL;
    res->argmax = malloc((size_t)(T ? T : 1) * sizeof *res->argmax);
    st = res->argmax ? be->download(res->argmax, out.argmax, (size_t)T * sizeof(int32_t))
                     : upf_fail(UPF_ERR_NOMEM, "prefill: argmax");
  }
  if (st == UPF_OK && opt->targets) {
    res->nll = malloc((size_t)(T ? T : 1) * sizeof *res->nll);
    st = res->nll ? be->download(lse, out.lse, (size_t)R * sizeof(double)) : upf_fail(UPF_ERR_NOMEM, "prefill: nll");
    if (st == UPF_OK)
      st = be->download(tlogit, out.target, (size_t)R * sizeof(double));
    for (int64_t i = 0; st == UPF_OK && i < R; i++)
      res->nll[i] = targets[i] < 0 ? NAN : lse[i] - tlogit[i];
  }
  if (st == UPF_OK && F) {
    res->tail_n = (int32_t)N;
    res->tail_logits = malloc((size_t)(F * V) * sizeof(float));
    st = res->tail_logits ? be->download(res->tail_logits, out.full, (size_t)(F * V) * sizeof(float))
                          : upf_fail(UPF_ERR_NOMEM, "prefill: tail logits (%lld x %lld)", (long long)F, (long long)V);
  }
  void *dev[] = {out.argmax, out.lse, out.target, out.full};
  for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
    if (dev[i])
      be->release(dev[i]);
  free(origin), free(rows), free(targets), free(full), free(lse), free(tlogit);
  return st;
}

typedef struct {
  upf_tokens tok;
  upf_layer_scratch s;
  int32_t *ids;    /* (T) */
  float *logits;   /* (B, V) */
} run_buffers;

static upf_status alloc_buffers(const upf_model *m, int64_t T, int32_t B, run_buffers *b) {
  const upf_backend *be = m->be;
  const upf_model_config *c = m->cfg;
  const size_t e = upf_dtype_size(m->dtype), rows = (size_t)(T ? T : 1);
  const scratch_cols w = scratch_widths(c);
  struct {
    void **p;
    size_t bytes;
  } list[] = {
      {&b->tok.residual, rows * c->hidden * e}, {&b->tok.hidden, rows * c->hidden * e},
      {(void **)&b->tok.positions, rows * 4},   {(void **)&b->tok.origin, rows * 4},
      {(void **)&b->tok.cu_seqlens, (size_t)(B + 1) * 4},
      {&b->s.out, rows * c->hidden * e},        {&b->s.proj, rows * (size_t)w.proj * e},
      {&b->s.mix, rows * (size_t)w.mix * e},    {&b->s.conv, rows * (size_t)w.conv * e},
      {&b->s.ba, rows * (size_t)w.ba * e},      {&b->s.spare, rows * c->hidden * e},
      {(void **)&b->s.spare_i32, rows * 4},     {(void **)&b->s.token_mask, rows},
      {(void **)&b->s.kept_index, rows * 4},    {(void **)&b->s.new_cu, (size_t)(B + 1) * 4},
      {(void **)&b->s.kept_count, (size_t)B * 4}, {(void **)&b->ids, rows * 4},
      {(void **)&b->logits, (size_t)B * c->vocab * 4},
  };
  for (size_t i = 0; i < sizeof list / sizeof *list; i++)
    UPF_TRY(be->alloc(list[i].p, list[i].bytes));
  b->tok.cu_seqlens_host = malloc((size_t)(B + 1) * sizeof(int32_t));
  return b->tok.cu_seqlens_host ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "prefill: cu_seqlens");
}

static void free_buffers(const upf_backend *be, run_buffers *b) {
  void *list[] = {b->tok.residual, b->tok.hidden, b->tok.positions, b->tok.origin, b->tok.cu_seqlens,
                  b->s.out,        b->s.proj,     b->s.mix,         b->s.conv,     b->s.ba,
                  b->s.spare,      b->s.spare_i32, b->s.token_mask, b->s.kept_index, b->s.new_cu,
                  b->s.kept_count, b->ids,        b->logits};
  for (size_t i = 0; i < sizeof list / sizeof *list; i++)
    if (list[i])
      be->release(list[i]);
  free(b->tok.cu_seqlens_host);
}

/* Token ids, positions (within each request, or the given ones), the packed index of each token and
 * cu_seqlens. */
static upf_status upload_batch(const upf_backend *be, const int32_t *ids, const int32_t *cu, const int32_t *positions,
                               int32_t B, run_buffers *b) {
  const int64_t T = cu[B];
  int32_t *pos = malloc((size_t)(T ? T : 1) * 2 * sizeof *pos);
  if (!pos)
    return upf_fail(UPF_ERR_NOMEM, "prefill: positions");
  int32_t *origin = pos + T;
  for (int32_t r = 0; r < B; r++)
    for (int32_t t = cu[r]; t < cu[r + 1]; t++)
      pos[t] = positions ? positions[t] : t - cu[r], origin[t] = t;
  upf_status st = be->upload(b->ids, ids, (size_t)T * 4);
  if (st == UPF_OK)
    st = be->upload(b->tok.positions, pos, (size_t)T * 4);
  if (st == UPF_OK)
    st = be->upload(b->tok.origin, origin, (size_t)T * 4);
  if (st == UPF_OK)
    st = be->upload(b->tok.cu_seqlens, cu, (size_t)(B + 1) * 4);
  free(pos);
  memcpy(b->tok.cu_seqlens_host, cu, (size_t)(B + 1) * sizeof *cu);
  b->tok.num_tokens = b->tok.max_tokens = T, b->tok.num_reqs = B;
  return st;
}

/* Per-layer timing marks (backend events), created once per backend and kept for the process: an event
 * takes microseconds to create and a decode step would pay that per layer. Prefill runs one at a
 * time in a process. Per layer: start, mixer done, FFN start (after a drop), FFN done. */
enum { MARK_START, MARK_MIXER, MARK_FFN, MARK_END, MARKS_PER_LAYER };
static struct {
  /* the functions that made them, not the backend: a backend table may be a caller's short-lived copy */
  upf_status (*create)(void **mark);
  void (*destroy)(void *mark);
  void *m[UPF_MODEL_MAX_LAYERS][MARKS_PER_LAYER];
} marks;

static void destroy_marks(void) {
  for (int l = 0; marks.destroy && l < UPF_MODEL_MAX_LAYERS; l++)
    for (int k = 0; k < MARKS_PER_LAYER; k++)
      if (marks.m[l][k])
        marks.destroy(marks.m[l][k]);
  memset(&marks, 0, sizeof marks);
}

static upf_status layer_marks(const upf_backend *be) {
  if (marks.create == be->mark_create)
    return UPF_OK;
  destroy_marks();
  marks.destroy = be->mark_destroy;
  for (int l = 0; l < UPF_MODEL_MAX_LAYERS; l++)
    for (int k = 0; k < MARKS_PER_LAYER; k++) {
      const upf_status st = be->mark_create(&marks.m[l][k]);
      if (st != UPF_OK) {
        destroy_marks();
        return st;
      }
    }
  marks.create = be->mark_create;
  return UPF_OK;
}

/* Layer l's times from its marks (waits for its last one). */
static upf_status layer_times(const upf_backend *be, int32_t l, upf_prefill_result *res) {
  void *const *k = marks.m[l];
  UPF_TRY(be->mark_elapsed(k[MARK_START], k[MARK_MIXER], &res->mixer_seconds[l]));
  UPF_TRY(be->mark_elapsed(k[MARK_FFN], k[MARK_END], &res->ffn_seconds[l]));
  return be->mark_elapsed(k[MARK_START], k[MARK_END], &res->layer_seconds[l]);
}

/* UPF_PREFILL_SYNC_LAYERS=1: the host waits for the device after each mixer and FFN, as the timing did
 * before marks (the A side of that lever's A/B/A). */
static int sync_layers(void) {
  const char *v = getenv("UPF_PREFILL_SYNC_LAYERS");
  return v && *v && *v != '0';
}

/* The layers [begin, end) over the batch in b, dropping at the drop layers in UniPrefill mode. The host
 * does not wait for the device between sub-layers (only a drop's kept counts and the outputs bring
 * data back); each layer's times come from backend marks, read after the last layer, or after each
 * layer when opt->on_layer reports progress. */
static upf_status run_layers(const upf_model *m, const upf_prefill_options *opt, const upf_step_hooks *hooks,
                             run_buffers *b, upf_prefill_result *res) {
  const upf_model_config *c = m->cfg;
  const upf_backend *be = m->be;
  upf_tokens *tok = &b->tok;
  /* the step's prefill tokens decide whether it drops (decode rows do not make a step long) */
  const int64_t step_tokens = tok->cu_seqlens_host[hooks ? hooks->num_prefill_rows : tok->num_reqs];
  const int dropping = opt->mode == UPF_PREFILL_UNIPREFILL && step_tokens > c->drop_min_step_tokens;
  int drop_index = 0; /* position in cfg->drop_layers */

  const upf_tensor residual = upf_mat(tok->residual, m->dtype, tok->num_tokens, c->hidden);
  const upf_tensor hidden = upf_mat(tok->hidden, m->dtype, tok->num_tokens, c->hidden);
  const float embed_scale = m->dtype == UPF_DTYPE_BF16 ? upf_round_bf16(c->embed_scale) : c->embed_scale;
  UPF_TRY(layer_marks(be));
  const int sync = sync_layers();
  UPF_TRY(be->embed(b->ids, tok->num_tokens, &m->token_embd, embed_scale, &residual));
  UPF_TRY(be->rmsnorm(&residual, &m->layers[m->layer_begin].attn_norm, &c->norm, &hidden));

  for (int32_t l = m->layer_begin; l < m->layer_end; l++) {
    UPF_TRY(be->mark_record(marks.m[l][MARK_START]));
    res->layer_tokens[l] = tok->num_tokens;
    if (l > m->layer_begin)
      UPF_TRY(upf_layer_add_norm(m, tok, &b->s, &m->layers[l].attn_norm));
    upf_attn_qk qk;
    if (hooks)
      UPF_TRY(hooks->before_layer(hooks->user, l, tok, &b->s));
    if (upf_model_mixer(c, l) == UPF_MIXER_GDN)
      UPF_TRY(upf_layer_gdn(m, l, tok, &b->s));
    else
      UPF_TRY(upf_layer_attention(m, l, tok, &b->s, &qk));
    UPF_TRY(be->mark_record(marks.m[l][MARK_MIXER]));
    if (sync)
      UPF_TRY(be->synchronize());
    if ((b->s.sparse || b->s.sparse_chunks) && upf_model_mixer(c, l) == UPF_MIXER_FULL) {
      /* one record per layer: the whole prompts' and the chunks' calls together */
      upf_sparse_record *rec = &res->sparse[res->num_sparse++];
      memset(rec, 0, sizeof *rec);
      const upf_layer_sparse *parts[2] = {b->s.sparse, b->s.sparse_chunks};
      for (int i = 0; i < 2; i++)
        if (parts[i]) {
          rec->kept_blocks += parts[i]->rec.kept_blocks, rec->visible_blocks += parts[i]->rec.visible_blocks;
          rec->index_seconds += parts[i]->rec.index_seconds, rec->attn_seconds += parts[i]->rec.attn_seconds;
          rec->neighbour_total += parts[i]->rec.neighbour_total;
          rec->neighbour_shared += parts[i]->rec.neighbour_shared;
        }
      rec->layer = l;
    }
    if (b->s.compact && upf_model_mixer(c, l) == UPF_MIXER_FULL) {
      const upf_layer_compact *cc = b->s.compact;
      upf_sparse_record *rec = &res->sparse[res->num_sparse++];
      memset(rec, 0, sizeof *rec);
      rec->layer = l, rec->kept_blocks = cc->kept_blocks, rec->visible_blocks = cc->visible_blocks;
      rec->attn_seconds = cc->seconds;
      if (opt->on_compact_table)
        opt->on_compact_table(opt->compact_user, l, cc->table, hooks->num_chunk_rows, c->kv_heads, cc->key_blocks);
    }
    while (drop_index < c->num_drop_layers && c->drop_layers[drop_index] < l)
      drop_index++;
    if (dropping && drop_index < c->num_drop_layers && c->drop_layers[drop_index] == l) {
      UPF_TRY(be->synchronize());
      const double s0 = now_seconds();
      upf_drop_record *rec = &res->drops[res->num_drops];
      rec->layer = l;
      const uint8_t *replay = opt->replay_masks ? opt->replay_masks[drop_index] : NULL;
      const int64_t replay_len = opt->replay_mask_len ? opt->replay_mask_len[drop_index] : 0;
      UPF_TRY(upf_layer_drop(m, &opt->select, &qk, replay, replay_len, tok, &b->s, rec));
      UPF_TRY(be->synchronize());
      rec->select_seconds = now_seconds() - s0;
      res->num_drops++;
    }
    UPF_TRY(be->mark_record(marks.m[l][MARK_FFN]));
    UPF_TRY(upf_layer_ffn(m, l, tok, &b->s));
    UPF_TRY(be->mark_record(marks.m[l][MARK_END]));
    if (sync)
      UPF_TRY(be->synchronize());
    if (opt->on_layer) {
      UPF_TRY(layer_times(be, l, res));
      opt->on_layer(opt->user, l, res->layer_seconds[l], res->layer_tokens[l]);
    }
  }

  /* residual += the last FFN's output (the norm written to `out` is not used), then the final norm and
   * the LM head on the last token of each request */
  UPF_TRY(upf_layer_add_norm(m, tok, &b->s, &m->output_norm));
  const upf_tensor last = upf_mat(tok->residual, m->dtype, tok->num_tokens, c->hidden);
  const upf_tensor logits = upf_mat(b->logits, UPF_DTYPE_F32, tok->num_reqs, c->vocab);
  UPF_TRY(be->logits_last(&last, tok->cu_seqlens_host, tok->num_reqs, &m->output_norm, &c->norm, &m->output, &logits));
  if (opt->per_position || opt->targets || opt->tail_logits > 0)
    UPF_TRY(position_outputs(m, opt, tok, &last, res));
  UPF_TRY(be->download(res->logits, b->logits, (size_t)tok->num_reqs * c->vocab * sizeof(float)));
  for (int32_t l = m->layer_begin; l < m->layer_end && !opt->on_layer; l++)
    UPF_TRY(layer_times(be, l, res));
  return UPF_OK;
}

upf_status upf_model_prefill(const upf_model *m, const int32_t *ids, const int32_t *cu_seqlens, int32_t num_reqs,
                             const upf_prefill_options *opt, upf_prefill_result *res) {
  return upf_model_run_step(m, ids, cu_seqlens, NULL, num_reqs, opt, NULL, res);
}

upf_status upf_model_run_step(const upf_model *m, const int32_t *ids, const int32_t *cu_seqlens,
                              const int32_t *positions, int32_t num_reqs, const upf_prefill_options *opt,
                              const upf_step_hooks *hooks, upf_prefill_result *res) {
  memset(res, 0, sizeof *res);
  UPF_TRY(check_batch(m, ids, cu_seqlens, num_reqs, opt));
  res->num_reqs = num_reqs, res->vocab = m->cfg->vocab;
  res->logits = malloc((size_t)num_reqs * m->cfg->vocab * sizeof(float));
  if (!res->logits)
    return upf_fail(UPF_ERR_NOMEM, "prefill: logits (%d x %d)", num_reqs, m->cfg->vocab);
  run_buffers b;
  memset(&b, 0, sizeof b);
  upf_layer_sparse sparse, sparse_chunks;
  upf_layer_compact compact;
  memset(&compact, 0, sizeof compact);
  memset(&sparse, 0, sizeof sparse);
  memset(&sparse_chunks, 0, sizeof sparse_chunks);
  upf_status st = alloc_buffers(m, cu_seqlens[num_reqs], num_reqs, &b);
  const int32_t Bp = hooks ? hooks->num_prefill_rows : num_reqs, Bc = hooks ? hooks->num_chunk_rows : 0;
  if (st == UPF_OK && opt->mode == UPF_PREFILL_FLASHPREFILL && Bp > 0) {
    st = sparse_setup(m, cu_seqlens, Bp, opt, &sparse);
    b.s.sparse = &sparse;
  }
  if (st == UPF_OK && opt->mode == UPF_PREFILL_FLASHPREFILL && Bc > 0) {
    st = sparse_setup_chunks(m, cu_seqlens, Bp, Bc, hooks->chunk_kv_lens, opt, &sparse_chunks);
    b.s.sparse_chunks = &sparse_chunks;
  }
  if (st == UPF_OK && opt->mode == UPF_PREFILL_COMPACT && Bc > 0) {
    int use = 0;
    st = compact_setup(m, cu_seqlens, Bp, Bc, hooks->chunk_kv_lens, opt, &compact, &use);
    b.s.compact = use ? &compact : NULL;
  }
  if (st == UPF_OK)
    st = upload_batch(m->be, ids, cu_seqlens, positions, num_reqs, &b);
  if (st == UPF_OK)
    st = m->be->synchronize();
  const double t0 = now_seconds();
  const upf_comm_stats c0 = upf_comm_get_stats(m->comm);
  if (st == UPF_OK)
    st = run_layers(m, opt, hooks, &b, res);
  const upf_comm_stats c1 = upf_comm_get_stats(m->comm); /* every all-reduce, the selection's included */
  res->comm_calls = c1.calls - c0.calls, res->comm_bytes = c1.bytes - c0.bytes, res->comm_seconds = c1.seconds - c0.seconds;
  if (st == UPF_OK)
    st = m->be->synchronize();
  res->total_seconds = now_seconds() - t0;
  free_buffers(m->be, &b);
  sparse_free(m->be, &sparse);
  sparse_free(m->be, &sparse_chunks);
  free(compact.table);
  upf_compact_workspace_free(&compact.ws);
  if (st != UPF_OK)
    upf_prefill_result_free(res);
  return st;
}

int upf_prefill_result_identical(const upf_prefill_result *a, const upf_prefill_result *b, char *where, size_t cap) {
  if (a->num_reqs != b->num_reqs || a->vocab != b->vocab || a->num_drops != b->num_drops) {
    snprintf(where, cap, "shapes: %d requests x %d ids and %d drops vs %d x %d and %d", a->num_reqs, a->vocab,
             a->num_drops, b->num_reqs, b->vocab, b->num_drops);
    return 0;
  }
  for (int64_t i = 0; i < (int64_t)a->num_reqs * a->vocab; i++)
    if (memcmp(&a->logits[i], &b->logits[i], sizeof(float)) != 0) { /* bits: NaN and -0 count */
      snprintf(where, cap, "logits of request %lld at id %lld: %.9g vs %.9g", (long long)(i / a->vocab),
               (long long)(i % a->vocab), (double)a->logits[i], (double)b->logits[i]);
      return 0;
    }
  for (int k = 0; k < a->num_drops; k++) {
    const upf_drop_record *x = &a->drops[k], *y = &b->drops[k];
    if (x->layer != y->layer || x->tokens_in != y->tokens_in || x->tokens_kept != y->tokens_kept) {
      snprintf(where, cap, "drop %d: layer %d, %lld -> %lld tokens vs layer %d, %lld -> %lld", k, x->layer,
               (long long)x->tokens_in, (long long)x->tokens_kept, y->layer, (long long)y->tokens_in,
               (long long)y->tokens_kept);
      return 0;
    }
    for (int64_t t = 0; x->mask && y->mask && t < x->tokens_in; t++)
      if (x->mask[t] != y->mask[t]) {
        snprintf(where, cap, "drop %d (layer %d): mask entry %lld: %d vs %d", k, x->layer, (long long)t, x->mask[t],
                 y->mask[t]);
        return 0;
      }
  }
  return 1;
}

void upf_prefill_result_free(upf_prefill_result *res) {
  free(res->logits);
  free(res->position_origin), free(res->argmax), free(res->nll), free(res->tail_logits);
  for (int i = 0; i < res->num_drops; i++)
    free(res->drops[i].mask), free(res->drops[i].kept_per_req);
  memset(res, 0, sizeof *res);
}

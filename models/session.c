/* A session (uniprefill/session.h): per-request state (prompt, pages of each cache group, Gated
 * DeltaNet state slot, drop history, decoded count, chunked-prefill progress) in one structure, the page
 * allocator (a free list per cache group), the caches and state pools on the model's backend, and the
 * step: it packs whole-prompt rows, then prefill chunks, then decode rows, runs the layer walk of
 * models/prefill.c, and before each layer points the layers at the cache: at the first attention layer
 * of each group it allocates the pages the rows' lengths there need (known after the drop before the
 * group) and computes the slot mapping of the whole batch with one kv.slot_mapping call. */
#include <stdlib.h>
#include <string.h>

#include "models/step.h"
#include "uniprefill/session.h"

typedef struct {
  int32_t *pages; /* (num) page ids in the group, logical order */
  int32_t num, cap;
} page_list;

typedef struct {
  int32_t id;
  int32_t *prompt;     /* (prompt_len) */
  int32_t prompt_len;
  int32_t decoded, prefilled;
  int32_t done;        /* prompt tokens in the cache: the chunks so far, the prompt once prefilled */
  int32_t chunks;      /* prefill rows taken (1: one whole-prompt row) */
  int32_t state_slot;  /* Gated DeltaNet pool row */
  int32_t group_len[UPF_SESSION_MAX_GROUPS]; /* prompt tokens each group holds (kept after the drop before it) */
  page_list pages[UPF_SESSION_MAX_GROUPS];
  int32_t num_drops;
  upf_kv_drop drops[UPF_MODEL_MAX_LAYERS];
} session_req;

typedef struct {
  int32_t num_attn;    /* attention layers of the model's range in the group */
  int64_t pages_total;
  int32_t *free_pages; /* (pages_total) stack of free page ids */
  int64_t num_free;
} session_group;

struct upf_session {
  const upf_model *m;
  upf_session_config cfg;
  int32_t num_groups;
  session_group groups[UPF_SESSION_MAX_GROUPS];
  upf_tensor k_cache[UPF_MODEL_MAX_LAYERS], v_cache[UPF_MODEL_MAX_LAYERS]; /* (pages, P, Hkv, D) */
  void *conv_pool[UPF_MODEL_MAX_LAYERS];  /* (S, K-1, C) f32; row S-1 stays zero */
  void *rec_pool[UPF_MODEL_MAX_LAYERS];   /* (S, Hv, Dk, Dv) f32; row S-1 stays zero */
  int64_t pool_rows;                      /* S = max_requests + 1 */
  int32_t *free_slots;                    /* (max_requests) */
  int32_t num_free_slots;
  session_req **reqs;                     /* (num_ids) by id; NULL once released */
  int32_t num_ids, cap_ids, live;
};

static int32_t group_of(const upf_model_config *c, int32_t layer) {
  int32_t g = 0;
  while (g < c->num_drop_layers && c->drop_layers[g] < layer)
    g++;
  return g;
}

upf_session_config upf_session_config_default(const upf_model *m) {
  upf_session_config c;
  memset(&c, 0, sizeof c);
  c.mode = UPF_PREFILL_DENSE;
  c.select = m->cfg->select;
  c.sparse = upf_prefill_sparse_default();
  c.compact = upf_compact_params_default();
  c.page_size = 16, c.max_requests = 64, c.pages_per_group = 1024;
  return c;
}

void upf_session_free(upf_session *s) {
  if (!s)
    return;
  const upf_backend *be = s->m->be;
  for (int32_t l = 0; l < UPF_MODEL_MAX_LAYERS; l++) {
    void *list[] = {s->k_cache[l].data, s->v_cache[l].data, s->conv_pool[l], s->rec_pool[l]};
    for (int i = 0; i < 4; i++)
      if (list[i])
        be->release(list[i]);
  }
  for (int32_t g = 0; g < s->num_groups; g++)
    free(s->groups[g].free_pages);
  for (int32_t i = 0; i < s->num_ids; i++)
    if (s->reqs[i]) {
      for (int32_t g = 0; g < s->num_groups; g++)
        free(s->reqs[i]->pages[g].pages);
      free(s->reqs[i]->prompt), free(s->reqs[i]);
    }
  free(s->reqs), free(s->free_slots), free(s);
}

static upf_status create(upf_session *s) {
  const upf_model *m = s->m;
  const upf_model_config *c = m->cfg;
  const upf_backend *be = m->be;
  const int64_t P = s->cfg.page_size;
  s->num_groups = c->num_drop_layers + 1;
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    if (upf_model_mixer(c, l) != UPF_MIXER_GDN)
      s->groups[group_of(c, l)].num_attn++;
  for (int32_t g = 0; g < s->num_groups; g++) {
    session_group *gr = &s->groups[g];
    gr->pages_total = !gr->num_attn ? 0 : s->cfg.group_pages[g] > 0 ? s->cfg.group_pages[g] : s->cfg.pages_per_group;
    if (gr->pages_total * P > INT32_MAX)
      return upf_fail(UPF_ERR_INVALID_ARG, "session: %lld pages of %lld tokens in group %d exceed the int32 slots",
                      (long long)gr->pages_total, (long long)P, g);
    gr->free_pages = malloc((size_t)(gr->pages_total ? gr->pages_total : 1) * sizeof(int32_t));
    if (!gr->free_pages)
      return upf_fail(UPF_ERR_NOMEM, "session: free list of group %d", g);
    for (int64_t i = 0; i < gr->pages_total; i++) /* page 0 on top */
      gr->free_pages[i] = (int32_t)(gr->pages_total - 1 - i);
    gr->num_free = gr->pages_total;
  }
  s->pool_rows = (int64_t)s->cfg.max_requests + 1;
  s->free_slots = malloc((size_t)s->cfg.max_requests * sizeof(int32_t));
  if (!s->free_slots)
    return upf_fail(UPF_ERR_NOMEM, "session: state slots");
  for (int32_t i = 0; i < s->cfg.max_requests; i++)
    s->free_slots[i] = s->cfg.max_requests - 1 - i;
  s->num_free_slots = s->cfg.max_requests;
  const int64_t C = c->other_mixer == UPF_MIXER_GDN ? upf_model_gdn_conv_dim(c) : 0;
  const size_t conv_bytes = (size_t)(s->pool_rows * (c->gdn_conv_kernel - 1) * C * 4);
  const size_t rec_bytes =
      (size_t)s->pool_rows * (size_t)c->gdn_value_heads * (size_t)c->gdn_key_dim * (size_t)c->gdn_value_dim * 4;
  for (int32_t l = m->layer_begin; l < m->layer_end; l++) {
    if (upf_model_mixer(c, l) == UPF_MIXER_GDN) {
      UPF_TRY(be->alloc(&s->conv_pool[l], conv_bytes));
      UPF_TRY(be->alloc(&s->rec_pool[l], rec_bytes));
      UPF_TRY(be->fill(s->conv_pool[l], 0, conv_bytes));
      UPF_TRY(be->fill(s->rec_pool[l], 0, rec_bytes));
      continue;
    }
    const int64_t shape[4] = {s->groups[group_of(c, l)].pages_total, P, c->kv_heads, c->head_dim};
    const size_t bytes = (size_t)(shape[0] * P * c->kv_heads * c->head_dim) * upf_dtype_size(m->dtype);
    void *k = NULL, *v = NULL;
    UPF_TRY(be->alloc(&k, bytes));
    upf_tensor_init(&s->k_cache[l], k, m->dtype, 4, shape);
    UPF_TRY(be->alloc(&v, bytes));
    upf_tensor_init(&s->v_cache[l], v, m->dtype, 4, shape);
  }
  return UPF_OK;
}

upf_status upf_session_create(const upf_model *m, const upf_session_config *cfg, upf_session **out) {
  *out = NULL;
  if (cfg->page_size < 1 || cfg->max_requests < 1 || cfg->pages_per_group < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "session: page_size=%d, max_requests=%d, pages_per_group=%lld out of range",
                    cfg->page_size, cfg->max_requests, (long long)cfg->pages_per_group);
  if (cfg->mode == UPF_PREFILL_UNIPREFILL)
    UPF_TRY(upf_select_params_check(&cfg->select));
  if (cfg->mode == UPF_PREFILL_FLASHPREFILL || cfg->mode == UPF_PREFILL_COMPACT)
    UPF_TRY(upf_sparse_params_check(&cfg->sparse));
  if (cfg->mode == UPF_PREFILL_COMPACT)
    UPF_TRY(upf_compact_params_check(&cfg->compact));
  upf_session *s = calloc(1, sizeof *s);
  if (!s)
    return upf_fail(UPF_ERR_NOMEM, "session");
  s->m = m, s->cfg = *cfg;
  upf_status st = create(s);
  if (st != UPF_OK) {
    upf_session_free(s);
    return st;
  }
  *out = s;
  return UPF_OK;
}

static upf_status find(const upf_session *s, int32_t req, session_req **r) {
  if (req < 0 || req >= s->num_ids || !s->reqs[req])
    return upf_fail(UPF_ERR_INVALID_ARG, "session: request %d is unknown (never added, or released)", req);
  *r = s->reqs[req];
  return UPF_OK;
}

upf_status upf_session_add_request(upf_session *s, const int32_t *ids, int32_t len, int32_t *req) {
  if (len < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "session: a prompt of %d tokens (needs at least one)", len);
  for (int32_t i = 0; i < len; i++)
    if (ids[i] < 0 || ids[i] >= s->m->cfg->vocab)
      return upf_fail(UPF_ERR_INVALID_ARG, "session: prompt token %d is %d, outside the vocabulary [0, %d)", i, ids[i],
                      s->m->cfg->vocab);
  if (!s->num_free_slots)
    return upf_fail(UPF_ERR_NOMEM, "session: %d requests are live, the max_requests of the session",
                    s->cfg.max_requests);
  if (s->num_ids == s->cap_ids) {
    const int32_t cap = s->cap_ids ? 2 * s->cap_ids : 64;
    session_req **grown = realloc(s->reqs, (size_t)cap * sizeof *grown);
    if (!grown)
      return upf_fail(UPF_ERR_NOMEM, "session: request table");
    s->reqs = grown, s->cap_ids = cap;
  }
  session_req *r = calloc(1, sizeof *r);
  int32_t *prompt = malloc((size_t)len * sizeof *prompt);
  if (!r || !prompt) {
    free(r), free(prompt);
    return upf_fail(UPF_ERR_NOMEM, "session: request of %d tokens", len);
  }
  memcpy(prompt, ids, (size_t)len * sizeof *prompt);
  r->id = s->num_ids, r->prompt = prompt, r->prompt_len = len;
  r->state_slot = s->free_slots[--s->num_free_slots];
  s->reqs[s->num_ids++] = r;
  s->live++;
  *req = r->id;
  return UPF_OK;
}

/* Returns the request's pages of group g beyond `keep` to the free list. */
static void pages_truncate(upf_session *s, session_req *r, int32_t g, int32_t keep) {
  page_list *pl = &r->pages[g];
  while (pl->num > keep)
    s->groups[g].free_pages[s->groups[g].num_free++] = pl->pages[--pl->num];
}

static upf_status pages_grow(upf_session *s, session_req *r, int32_t g, int32_t want) {
  page_list *pl = &r->pages[g];
  session_group *gr = &s->groups[g];
  if (want > pl->cap) {
    const int32_t cap = want > 2 * pl->cap ? want : 2 * pl->cap;
    int32_t *grown = realloc(pl->pages, (size_t)cap * sizeof *grown);
    if (!grown)
      return upf_fail(UPF_ERR_NOMEM, "session: page list of request %d", r->id);
    pl->pages = grown, pl->cap = cap;
  }
  if (want - pl->num > gr->num_free)
    return upf_fail(UPF_ERR_NOMEM, "session: cache group %d is out of pages (request %d needs %d, %lld free)", g, r->id,
                    want - pl->num, (long long)gr->num_free);
  while (pl->num < want)
    pl->pages[pl->num++] = gr->free_pages[--gr->num_free];
  return UPF_OK;
}

upf_status upf_session_release(upf_session *s, int32_t req) {
  session_req *r = NULL;
  UPF_TRY(find(s, req, &r));
  const upf_model *m = s->m;
  /* the state slot is returned zeroed: a later request's prefill reads zeros there too */
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    if (s->conv_pool[l]) {
      const upf_model_config *c = m->cfg;
      const size_t conv_row = (size_t)(c->gdn_conv_kernel - 1) * (size_t)upf_model_gdn_conv_dim(c) * 4;
      const size_t rec_row = (size_t)c->gdn_value_heads * (size_t)c->gdn_key_dim * (size_t)c->gdn_value_dim * 4;
      UPF_TRY(m->be->fill((char *)s->conv_pool[l] + (size_t)r->state_slot * conv_row, 0, conv_row));
      UPF_TRY(m->be->fill((char *)s->rec_pool[l] + (size_t)r->state_slot * rec_row, 0, rec_row));
    }
  for (int32_t g = 0; g < s->num_groups; g++) {
    pages_truncate(s, r, g, 0);
    free(r->pages[g].pages);
  }
  s->free_slots[s->num_free_slots++] = r->state_slot;
  s->reqs[req] = NULL, s->live--;
  free(r->prompt), free(r);
  return UPF_OK;
}

/* ---- the step ---- */

typedef struct {
  upf_session *s;
  const upf_session_row *rows;
  session_req **req; /* (B) */
  int32_t *len;      /* (B) tokens of each row */
  int32_t B, Bp, Bc; /* rows; whole prompts [0, Bp), chunks [Bp, Bp + Bc), decode rows after */
  int32_t group;     /* the group whose slots are current, -1 before the first */
  upf_layer_cache cache;
  /* per group: the rows' starts, block tables and slots (host), their device copies */
  int32_t *start, *table, *slots, *dec_cu, *dec_len; /* host: (B), (B, max_blocks), (T), (Bd+1), (Bd) */
  int32_t *chunk_cu, *chunk_len; /* host (Bc+1), (Bc): the chunks' query rows and cached context + chunk */
  int32_t max_blocks;
  void *d_start, *d_table, *d_slots, *d_dec_cu, *d_dec_len, *d_gather, *d_scatter, *d_chunk_cu, *d_chunk_len;
  int32_t *scatter_host;
  int32_t *pages_before; /* (B, groups) each row's pages before the step, for a rollback */
} step_ctx;

static upf_status prepare_group(step_ctx *x, int32_t g, const upf_tokens *tok) {
  upf_session *s = x->s;
  const upf_backend *be = s->m->be;
  const int32_t B = x->B, Bpc = x->Bp + x->Bc, Bd = B - Bpc, P = s->cfg.page_size;
  const int32_t *cu = tok->cu_seqlens_host;
  int32_t max_blocks = 1;
  for (int32_t r = 0; r < B; r++) {
    session_req *q = x->req[r];
    if (r < x->Bp) {
      q->group_len[g] = cu[r + 1] - cu[r];
      x->start[r] = 0;
    } else if (r < Bpc) { /* a chunk never drops: every group holds the prompt's first `done` tokens */
      x->start[r] = q->done;
    } else {
      x->start[r] = q->group_len[g] + q->decoded;
    }
    const int32_t need = (x->start[r] + cu[r + 1] - cu[r] + P - 1) / P;
    UPF_TRY(pages_grow(s, q, g, need));
    max_blocks = need > max_blocks ? need : max_blocks;
  }
  free(x->table);
  const size_t table_len = (size_t)(uint32_t)B * (size_t)(uint32_t)max_blocks;
  x->table = calloc(table_len, sizeof *x->table);
  if (!x->table)
    return upf_fail(UPF_ERR_NOMEM, "session step: block tables");
  x->max_blocks = max_blocks;
  for (int32_t r = 0; r < B; r++)
    memcpy(x->table + (size_t)r * max_blocks, x->req[r]->pages[g].pages, (size_t)x->req[r]->pages[g].num * 4);
  if (x->d_table)
    be->release(x->d_table), x->d_table = NULL;
  UPF_TRY(be->alloc(&x->d_table, table_len * 4));
  UPF_TRY(be->upload(x->d_table, x->table, table_len * 4));
  UPF_TRY(be->upload(x->d_start, x->start, (size_t)B * 4));
  const upf_kv_slot_batch sb = {B, tok->cu_seqlens, cu, x->d_start, x->start, x->d_table, x->table, max_blocks, P,
                                s->groups[g].pages_total};
  UPF_TRY(be->kv_slot_mapping(&sb, x->d_slots));
  UPF_TRY(be->download(x->slots, x->d_slots, (size_t)tok->num_tokens * 4));
  for (int32_t d = 0; d < Bd; d++)
    x->dec_cu[d + 1] = d + 1, x->dec_len[d] = x->start[Bpc + d] + 1;
  if (Bd) {
    UPF_TRY(be->upload(x->d_dec_cu, x->dec_cu, (size_t)(Bd + 1) * 4));
    UPF_TRY(be->upload(x->d_dec_len, x->dec_len, (size_t)Bd * 4));
  }
  upf_layer_cache *kc = &x->cache;
  kc->slots = x->d_slots, kc->slots_host = x->slots;
  const upf_attn_paged chunks = {x->Bc, x->d_chunk_cu, x->chunk_cu, x->d_chunk_len, x->chunk_len,
                                 (const int32_t *)x->d_table + (size_t)x->Bp * max_blocks,
                                 x->table + (size_t)x->Bp * max_blocks, max_blocks, P};
  const upf_attn_paged dec = {Bd, x->d_dec_cu, x->dec_cu, x->d_dec_len, x->dec_len,
                              (const int32_t *)x->d_table + (size_t)Bpc * max_blocks,
                              x->table + (size_t)Bpc * max_blocks, max_blocks, P};
  kc->chunks = chunks;
  kc->decode = dec;
  x->group = g;
  return UPF_OK;
}

static upf_status before_layer(void *user, int32_t layer, const upf_tokens *tok, upf_layer_scratch *sc) {
  step_ctx *x = user;
  upf_session *s = x->s;
  upf_layer_cache *kc = &x->cache;
  if (upf_model_mixer(s->m->cfg, layer) == UPF_MIXER_GDN) {
    kc->conv_pool = s->conv_pool[layer], kc->rec_pool = s->rec_pool[layer];
  } else {
    const int32_t g = group_of(s->m->cfg, layer);
    if (g != x->group)
      UPF_TRY(prepare_group(x, g, tok));
    kc->k_cache = s->k_cache[layer], kc->v_cache = s->v_cache[layer];
  }
  sc->cache = kc;
  return UPF_OK;
}

/* Rows, requests, pages and the tail logits asked for checked before any work; fills x->req, x->len, x->Bp
 * and x->Bc. */
static upf_status check_rows(upf_session *s, const upf_session_row *rows, int32_t B, int32_t tail, step_ctx *x) {
  if (B < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "session step: needs at least one row");
  static const char *const class_name[3] = {"a whole-prompt prefill row", "a prefill chunk", "a decode row"};
  int64_t need[UPF_SESSION_MAX_GROUPS] = {0}, T = 0;
  int last = 0; /* the class of the previous row: 0 whole prompt, 1 chunk, 2 decode */
  x->Bp = x->Bc = 0;
  for (int32_t i = 0; i < B; i++) {
    session_req *r = NULL;
    UPF_TRY(find(s, rows[i].req, &r));
    for (int32_t j = 0; j < i; j++)
      if (x->req[j] == r)
        return upf_fail(UPF_ERR_INVALID_ARG, "session step: request %d appears in rows %d and %d", r->id, j, i);
    x->req[i] = r;
    int cls = 2;
    if (rows[i].kind == UPF_ROW_PREFILL) {
      if (r->prefilled)
        return upf_fail(UPF_ERR_INVALID_ARG, "session step: row %d prefills request %d, which is already prefilled",
                        i, r->id);
      const int32_t left = r->prompt_len - r->done, n = rows[i].num_tokens ? rows[i].num_tokens : left;
      if (n < 1 || n > left)
        return upf_fail(UPF_ERR_INVALID_ARG, "session step: row %d prefills %d tokens of request %d, which has %d of "
                        "its %d prompt tokens left (want 1..%d, or 0 for all of them)", i, rows[i].num_tokens, r->id,
                        left, r->prompt_len, left);
      cls = n == r->prompt_len ? 0 : 1;
      x->len[i] = n;
      T += n;
      for (int32_t g = 0; g < s->num_groups; g++)
        need[g] += upf_session_pages_for(s, (int64_t)r->done + n) - r->pages[g].num;
    } else if (rows[i].kind == UPF_ROW_DECODE) {
      if (!r->prefilled)
        return upf_fail(UPF_ERR_INVALID_ARG, "session step: row %d decodes request %d, which is not prefilled yet", i,
                        r->id);
      if (rows[i].token < 0 || rows[i].token >= s->m->cfg->vocab)
        return upf_fail(UPF_ERR_INVALID_ARG, "session step: row %d feeds token %d to request %d, outside [0, %d)", i,
                        rows[i].token, r->id, s->m->cfg->vocab);
      x->len[i] = 1;
      T++;
      for (int32_t g = 0; g < s->num_groups; g++)
        need[g] += (r->group_len[g] + r->decoded) % s->cfg.page_size == 0;
    } else {
      return upf_fail(UPF_ERR_INVALID_ARG, "session step: row %d has kind %d", i, (int)rows[i].kind);
    }
    if (cls < last)
      return upf_fail(UPF_ERR_INVALID_ARG, "session step: row %d (request %d) is %s after %s; the rows go whole-prompt "
                      "prefill rows first, then prefill chunks, then decode rows", i, r->id, class_name[cls],
                      class_name[last]);
    last = cls;
    x->Bp += cls == 0, x->Bc += cls == 1;
  }
  if (T > INT32_MAX)
    return upf_fail(UPF_ERR_INVALID_ARG, "session step: %lld tokens exceed the int32 cu_seqlens", (long long)T);
  for (int32_t i = 0; i < B; i++)
    if (tail < 0 || x->len[i] < tail)
      return upf_fail(UPF_ERR_INVALID_ARG, "session step: tail_logits %d but row %d (request %d) holds %d tokens "
                      "(want 0 .. the shortest row's tokens)", tail, i, x->req[i]->id, x->len[i]);
  for (int32_t g = 0; g < s->num_groups; g++)
    if (s->groups[g].num_attn && need[g] > s->groups[g].num_free)
      return upf_fail(UPF_ERR_NOMEM, "session step: cache group %d has %lld free pages, the rows may need %lld", g,
                      (long long)s->groups[g].num_free, (long long)need[g]);
  return UPF_OK;
}

static void step_free(const upf_backend *be, step_ctx *x) {
  void *dev[] = {x->d_start, x->d_table, x->d_slots, x->d_dec_cu, x->d_dec_len, x->d_gather, x->d_scatter,
                 x->d_chunk_cu, x->d_chunk_len,
                 (void *)x->cache.conv_in, (void *)x->cache.conv_out, (void *)x->cache.rec};
  for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
    if (dev[i])
      be->release(dev[i]);
  free(x->req), free(x->len), free(x->start), free(x->table), free(x->slots), free(x->dec_cu), free(x->dec_len);
  free(x->chunk_cu), free(x->chunk_len), free(x->scatter_host), free(x->pages_before);
}

/* The step's host arrays, device arrays and state buffers; ids, cu and positions of the packed batch. */
static upf_status step_setup(step_ctx *x, int32_t *ids, int32_t *cu, int32_t *pos, int64_t T) {
  upf_session *s = x->s;
  const upf_model_config *c = s->m->cfg;
  const upf_backend *be = s->m->be;
  const int32_t B = x->B;
  x->start = malloc((size_t)B * 4), x->slots = malloc((size_t)T * 4);
  x->dec_cu = calloc((size_t)B + 1, 4), x->dec_len = malloc((size_t)B * 4);
  x->chunk_cu = calloc((size_t)x->Bc + 1, 4), x->chunk_len = malloc((size_t)(x->Bc ? x->Bc : 1) * 4);
  x->scatter_host = malloc((size_t)B * 4);
  int32_t *gather = malloc((size_t)B * 4);
  upf_status st = x->start && x->slots && x->dec_cu && x->dec_len && x->chunk_cu && x->chunk_len && x->scatter_host &&
                          gather
                      ? UPF_OK
                      : upf_fail(UPF_ERR_NOMEM, "session step: host arrays");
  cu[0] = 0;
  for (int32_t r = 0; st == UPF_OK && r < B; r++) {
    session_req *q = x->req[r];
    /* a prefill row's tokens continue the prompt where the cache ends (0 for a whole prompt), at their
     * positions in it; RoPE and the cache index agree because a chunk never drops */
    if (r < x->Bp + x->Bc) {
      memcpy(ids + cu[r], q->prompt + q->done, (size_t)x->len[r] * 4);
      for (int32_t i = 0; i < x->len[r]; i++)
        pos[cu[r] + i] = q->done + i;
    } else {
      ids[cu[r]] = x->rows[r].token, pos[cu[r]] = q->prompt_len + q->decoded;
    }
    cu[r + 1] = cu[r] + x->len[r];
    if (r >= x->Bp && r < x->Bp + x->Bc) {
      const int32_t c = r - x->Bp;
      x->chunk_cu[c + 1] = x->chunk_cu[c] + x->len[r], x->chunk_len[c] = q->done + x->len[r];
    }
    /* the Gated DeltaNet states: zeros where the prompt starts, else the request's own */
    gather[r] = r < x->Bp + x->Bc && q->done == 0 ? (int32_t)(s->pool_rows - 1) : q->state_slot;
    x->scatter_host[r] = q->state_slot;
  }
  const int64_t C = c->other_mixer == UPF_MIXER_GDN ? upf_model_gdn_conv_dim(c) : 0;
  const size_t conv_bytes = (size_t)B * (size_t)((c->gdn_conv_kernel > 1 ? c->gdn_conv_kernel - 1 : 0) * C * 4);
  const size_t rec_bytes = (size_t)B * (size_t)c->gdn_value_heads * (size_t)c->gdn_key_dim * (size_t)c->gdn_value_dim * 4;
  struct {
    void **p;
    size_t bytes;
  } dev[] = {{&x->d_start, (size_t)B * 4},       {&x->d_slots, (size_t)T * 4},
             {&x->d_dec_cu, (size_t)(B + 1) * 4}, {&x->d_dec_len, (size_t)B * 4},
             {&x->d_gather, (size_t)B * 4},      {&x->d_scatter, (size_t)B * 4},
             {&x->d_chunk_cu, (size_t)(x->Bc + 1) * 4}, {&x->d_chunk_len, (size_t)(x->Bc ? x->Bc : 1) * 4},
             {&x->cache.conv_in, conv_bytes},    {&x->cache.conv_out, conv_bytes},
             {&x->cache.rec, rec_bytes}};
  for (size_t i = 0; st == UPF_OK && i < sizeof dev / sizeof *dev; i++)
    st = be->alloc(dev[i].p, dev[i].bytes);
  if (st == UPF_OK)
    st = be->upload(x->d_gather, gather, (size_t)B * 4);
  if (st == UPF_OK)
    st = be->upload(x->d_scatter, x->scatter_host, (size_t)B * 4);
  if (st == UPF_OK && x->Bc) {
    st = be->upload(x->d_chunk_cu, x->chunk_cu, (size_t)(x->Bc + 1) * 4);
    if (st == UPF_OK)
      st = be->upload(x->d_chunk_len, x->chunk_len, (size_t)x->Bc * 4);
  }
  free(gather);
  x->cache.num_prefill_rows = x->Bp, x->cache.num_chunk_rows = x->Bc;
  x->cache.pool_rows = s->pool_rows;
  x->cache.gather = x->d_gather, x->cache.scatter = x->d_scatter, x->cache.scatter_host = x->scatter_host;
  return st;
}

/* After a successful step: the prefill rows' lengths per group and drop history, the decoded counts. */
static void step_commit(step_ctx *x, const upf_prefill_result *res) {
  upf_session *s = x->s;
  const upf_model_config *c = s->m->cfg;
  for (int32_t r = 0; r < x->B; r++) {
    session_req *q = x->req[r];
    if (r >= x->Bp + x->Bc) {
      q->decoded++;
      continue;
    }
    q->chunks++;
    if (r >= x->Bp) { /* a chunk: dense, every group holds the prompt so far */
      q->done += x->len[r];
      for (int32_t g = 0; g < s->num_groups; g++)
        q->group_len[g] = q->done;
      q->prefilled = q->done == q->prompt_len;
      continue;
    }
    q->prefilled = 1, q->done = q->prompt_len;
    int32_t len = q->prompt_len;
    q->group_len[0] = len;
    for (int32_t g = 1; g < s->num_groups; g++) {
      for (int32_t d = 0; d < res->num_drops; d++)
        if (res->drops[d].layer == c->drop_layers[g - 1]) {
          len = res->drops[d].kept_per_req[r];
          q->drops[q->num_drops].layer = res->drops[d].layer;
          q->drops[q->num_drops++].kept_len = len;
        }
      q->group_len[g] = len;
    }
  }
}

upf_status upf_session_step(upf_session *s, const upf_session_row *rows, int32_t num_rows,
                            const upf_session_step_options *opt, upf_prefill_result *res) {
  memset(res, 0, sizeof *res);
  step_ctx x;
  memset(&x, 0, sizeof x);
  x.s = s, x.rows = rows, x.B = num_rows, x.group = -1;
  x.req = calloc((size_t)(num_rows > 0 ? num_rows : 1), sizeof *x.req);
  x.len = calloc((size_t)(num_rows > 0 ? num_rows : 1), sizeof *x.len);
  if (!x.req || !x.len) {
    free(x.req), free(x.len);
    return upf_fail(UPF_ERR_NOMEM, "session step: rows");
  }
  upf_status st = check_rows(s, rows, num_rows, opt ? opt->tail_logits : 0, &x);
  if (st != UPF_OK) {
    free(x.req), free(x.len);
    return st;
  }
  int64_t T = 0;
  for (int32_t r = 0; r < num_rows; r++)
    T += x.len[r];
  int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *cu = malloc((size_t)(num_rows + 1) * 4);
  x.pages_before = malloc((size_t)num_rows * (size_t)s->num_groups * 4);
  st = ids && pos && cu && x.pages_before ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "session step: batch");
  for (int32_t r = 0; st == UPF_OK && r < num_rows; r++)
    for (int32_t g = 0; g < s->num_groups; g++)
      x.pages_before[r * s->num_groups + g] = x.req[r]->pages[g].num;
  if (st == UPF_OK)
    st = step_setup(&x, ids, cu, pos, T);
  upf_prefill_options po;
  memset(&po, 0, sizeof po);
  po.mode = s->cfg.mode, po.select = s->cfg.select, po.sparse = s->cfg.sparse, po.compact = s->cfg.compact;
  if (opt)
    po.replay_masks = opt->replay_masks, po.replay_mask_len = opt->replay_mask_len, po.on_layer = opt->on_layer,
    po.user = opt->user, po.on_compact_table = opt->on_compact_table, po.compact_user = opt->compact_user,
    po.tail_logits = opt->tail_logits;
  const upf_step_hooks hooks = {x.Bp, x.Bc, x.chunk_len, before_layer, &x};
  if (st == UPF_OK)
    st = upf_model_run_step(s->m, ids, cu, pos, num_rows, &po, &hooks, res);
  if (st == UPF_OK) {
    step_commit(&x, res);
  } else if (x.pages_before) {
    for (int32_t r = 0; r < num_rows; r++)
      for (int32_t g = 0; g < s->num_groups; g++)
        pages_truncate(s, x.req[r], g, x.pages_before[r * s->num_groups + g]);
  }
  step_free(s->m->be, &x);
  free(ids), free(pos), free(cu);
  return st;
}

/* ---- queries ---- */

int32_t upf_session_num_groups(const upf_session *s) { return s->num_groups; }
int32_t upf_session_page_size(const upf_session *s) { return s->cfg.page_size; }

int32_t upf_session_group_of_layer(const upf_session *s, int32_t layer) {
  const upf_model *m = s->m;
  if (layer < m->layer_begin || layer >= m->layer_end || upf_model_mixer(m->cfg, layer) == UPF_MIXER_GDN)
    return -1;
  return group_of(m->cfg, layer);
}

int64_t upf_session_pages_total(const upf_session *s, int32_t g) {
  return g >= 0 && g < s->num_groups ? s->groups[g].pages_total : 0;
}
int64_t upf_session_pages_free(const upf_session *s, int32_t g) {
  return g >= 0 && g < s->num_groups ? s->groups[g].num_free : 0;
}
int64_t upf_session_pages_for(const upf_session *s, int64_t tokens) {
  return (tokens + s->cfg.page_size - 1) / s->cfg.page_size;
}

void upf_session_memory_usage(const upf_session *s, upf_session_memory *mem) {
  const upf_model *m = s->m;
  memset(mem, 0, sizeof *mem);
  const double per_layer_page =
      2.0 * s->cfg.page_size * m->cfg->kv_heads * m->cfg->head_dim * (double)upf_dtype_size(m->dtype);
  for (int32_t g = 0; g < s->num_groups; g++) {
    const session_group *gr = &s->groups[g];
    if (!gr->num_attn)
      continue;
    const double page_bytes = per_layer_page * gr->num_attn;
    int64_t used = 0, dense = 0;
    for (int32_t i = 0; i < s->num_ids; i++) {
      const session_req *r = s->reqs[i];
      if (!r)
        continue;
      used += r->pages[g].num;
      dense += upf_session_pages_for(s, r->prefilled ? (int64_t)r->prompt_len + r->decoded : r->done);
    }
    mem->pages_in_use += used, mem->pages_dense += dense;
    mem->bytes_in_use += page_bytes * (double)used, mem->bytes_dense += page_bytes * (double)dense;
    mem->bytes_capacity += page_bytes * (double)gr->pages_total;
  }
  mem->bytes_saved = mem->bytes_dense - mem->bytes_in_use;
}

upf_status upf_session_request(const upf_session *s, int32_t req, upf_session_request_info *info) {
  session_req *r = NULL;
  UPF_TRY(find(s, req, &r));
  info->prompt_len = r->prompt_len, info->decoded = r->decoded, info->prefilled = r->prefilled;
  info->num_drops = r->num_drops, info->drops = r->drops;
  info->prefill_done = r->done, info->chunks = r->chunks;
  return UPF_OK;
}

upf_status upf_session_kv_len(const upf_session *s, int32_t req, int32_t layer, int64_t *len) {
  session_req *r = NULL;
  UPF_TRY(find(s, req, &r));
  const int32_t g = upf_session_group_of_layer(s, layer);
  if (g < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "session: layer %d is not an attention layer of the model's range", layer);
  *len = r->prefilled ? (int64_t)r->group_len[g] + r->decoded : r->done;
  return UPF_OK;
}

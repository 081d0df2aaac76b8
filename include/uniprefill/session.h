/* The model state that outlives a prefill (SPEC.md section 4): a session holds a model's paged KV
 * cache, the Gated DeltaNet conv and recurrent states and the drop history of every live request, and
 * runs steps that mix prefill rows (a whole prompt) and decode rows (one token) over the same layer
 * walk as upf_model_prefill. A continuous-batching engine drives it: add requests, pick the rows of
 * each step, sample from the returned logits, release finished requests.
 *
 * Cache groups. The attention layers that share a KV length form a cache group: group 0 holds the
 * layers up to and including the first drop layer (they keep the whole prompt), group g > 0 the layers
 * after drop layer g-1 up to and including drop layer g (they keep what drop g-1 kept), the last group
 * the layers after the last drop layer. A model with D drop layers has D+1 groups, in dense mode too
 * (every group then holds the prompt). Each group has its own pages of P tokens (one (pages, P, Hkv, D)
 * K and V cache per attention layer of the group), its own page budget and free list, and one block
 * table per request; a request's pages in group g are allocated once its length there is known (after
 * drop g-1's kept counts), so pages beyond the kept length never exist.
 *
 * Lengths: kv_len(r, l) = len_g(r) + decoded(r) for l in group g, where len_0 is the prompt length and
 * len_g the kept count after drop layer g-1 (the prompt length when that drop did not run). A decode
 * row writes its token at logical index kv_len(r, l) of each attention layer and attends over
 * kv_len(r, l) + 1 entries, at RoPE position prompt length + decoded(r).
 *
 * Chunked prefill (SPEC section 9): a prefill row may carry the next num_tokens tokens of the prompt
 * instead of all of it; such a chunk writes its K/V at logical indices done .. done + n - 1 (done: the
 * prompt tokens its earlier chunks left in the cache, the same in every group) and attends over the
 * cache, its cached context and itself (bottom-right causal; a sliding window reaches across the
 * chunk boundary), at RoPE positions done .. done + n - 1; Gated DeltaNet layers carry the conv and
 * recurrent states from one chunk to the next. A chunk never drops (SPEC section 4: every chunk of a
 * prompt split in more than one chunk runs dense, the first too), so UniPrefill drops only from
 * whole-prompt rows, and FlashPrefill runs a chunk block-sparse over its cached context too. The
 * request is prefilled once its last chunk ran; that chunk's logits are its prefill logits.
 *
 * Every call returns a upf_status with a message naming the input at fault (unknown request, a decode
 * row for a request not yet prefilled, out of pages, ...); a call refused by its checks changes
 * nothing (a backend failure half way through a step leaves that step's requests to be released). */
#ifndef UNIPREFILL_SESSION_H
#define UNIPREFILL_SESSION_H

#include <stdint.h>

#include "uniprefill/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct upf_session upf_session;

#define UPF_SESSION_MAX_GROUPS (UPF_MODEL_MAX_LAYERS + 1)

typedef struct {
  upf_prefill_mode mode;    /* dense, UniPrefill or FlashPrefill prefill rows (decode rows are dense) */
  upf_select_params select; /* the selection at every drop layer */
  int32_t page_size;        /* P, tokens per page (default 16) */
  int32_t max_requests;     /* live requests at once (the Gated DeltaNet state slots; default 64) */
  int64_t pages_per_group;  /* page budget of every cache group (default 1024) ... */
  int64_t group_pages[UPF_SESSION_MAX_GROUPS]; /* ... unless group_pages[g] > 0, group g's own budget */
  upf_sparse_params sparse; /* FlashPrefill mode: the prefill rows' block-sparse full attention (model.h);
                             * COMPACT mode: the chunks' selector (last_n taken as 0) */
  upf_compact_params compact; /* COMPACT mode: the union's recent blocks (default upf_compact_params_default) */
} upf_session_config;

/* Dense mode, the model's selection, FlashPrefill's model defaults (upf_prefill_sparse_default), P = 16,
 * 64 requests, 1024 pages per group. */
upf_session_config upf_session_config_default(const upf_model *m);

/* Allocates the caches and state slots on m's backend. m must outlive the session. */
upf_status upf_session_create(const upf_model *m, const upf_session_config *cfg, upf_session **out);
void upf_session_free(upf_session *s);

/* Registers a request with its prompt ids (len >= 1, copied) and returns its id (ids are never reused).
 * No pages are taken until its prefill row runs. Fails when max_requests are live. */
upf_status upf_session_add_request(upf_session *s, const int32_t *ids, int32_t len, int32_t *req);
/* Frees the request's pages in every group and its state slot; the id becomes unknown. */
upf_status upf_session_release(upf_session *s, int32_t req);

typedef enum {
  UPF_ROW_PREFILL = 0, /* the request's prompt, or its next chunk; the request must not be prefilled yet */
  UPF_ROW_DECODE,      /* one token appended to a prefilled request */
} upf_row_kind;

typedef struct {
  int32_t req;
  upf_row_kind kind;
  int32_t token;      /* UPF_ROW_DECODE: the token fed (the one sampled from the request's last logits) */
  int32_t num_tokens; /* UPF_ROW_PREFILL: 0, the rest of the prompt; n >= 1, its next n tokens (a chunk).
                       * A row that holds the whole prompt at once is a whole-prompt row, any other a chunk. */
} upf_session_row;

typedef struct {
  /* Replay, as in upf_prefill_options: per drop layer, a host token mask over the step's tokens
   * entering that layer (rows in step order; prefill chunks and decode rows all 1: they never drop);
   * NULL entries select. */
  const uint8_t *const *replay_masks;
  const int64_t *replay_mask_len;
  void (*on_layer)(void *user, int32_t layer, double seconds, int64_t tokens);
  void *user;
  /* COMPACT mode: upf_prefill_options.on_compact_table for this step (rows of the table: the chunks) */
  void (*on_compact_table)(void *user, int32_t layer, const uint8_t *table, int32_t num_chunks, int32_t kv_heads,
                           int32_t key_blocks);
  void *compact_user;
  /* N >= 0: upf_prefill_options.tail_logits for this step: res->tail_logits (num_rows, N, V) holds the
   * logits of the last N tokens of every row, in row order (every row must hold N tokens: a decode row
   * holds one). A chunked prefill wanting the last N positions of a prompt asks each chunk for the part
   * of them it holds (upf_eval_prefill_last_chunked gathers them so). */
  int32_t tail_logits;
} upf_session_step_options;

/* Runs one step over rows (each request at most once; whole-prompt prefill rows first, then prefill
 * chunks, then decode rows: the step packs the batch in that order, and a row out of it is refused).
 * Before any work the step checks that every group has the pages the rows could need at their dense
 * length (prefill rows: ceil(prompt / P); decode rows: one more page where the length sits on a page
 * boundary; chunks: the pages up to the chunk's end), so a step never runs out of pages half way; it
 * fails with UPF_ERR_NOMEM naming the group otherwise. res is filled as upf_model_prefill fills it
 * with one entry per row: logits (num_rows, V) host f32 of each row's last token (a chunk's: the
 * request's prefill logits only when the chunk ends the prompt), the drops that ran (kept_per_req per
 * row, chunks and decode rows whole, masks over the step's tokens in row order), the times; in
 * FlashPrefill mode one sparse record per full-attention layer, the whole prompts' and the chunks'
 * blocks together. opt may be NULL. Free res with upf_prefill_result_free. */
upf_status upf_session_step(upf_session *s, const upf_session_row *rows, int32_t num_rows,
                            const upf_session_step_options *opt, upf_prefill_result *res);

/* ---- Queries (host values, no device work) ---- */

int32_t upf_session_num_groups(const upf_session *s);
/* The cache group of an attention layer, -1 for a Gated DeltaNet layer or a layer outside the model. */
int32_t upf_session_group_of_layer(const upf_session *s, int32_t layer);
int32_t upf_session_page_size(const upf_session *s);
int64_t upf_session_pages_total(const upf_session *s, int32_t group);
int64_t upf_session_pages_free(const upf_session *s, int32_t group);
/* Pages a request of `tokens` tokens holds in one group at its dense length: ceil(tokens / P), the
 * upper bound admission control uses for every group. */
int64_t upf_session_pages_for(const upf_session *s, int64_t tokens);

/* KV memory over the live requests. in_use: the pages they hold; dense: the pages the same requests
 * would hold in dense mode (ceil((prompt + decoded) / P) in every group; ceil(done / P) during a
 * chunked prefill); bytes weigh each group's
 * pages by its attention layers (2 * P * Hkv * D * dtype size per layer and page). */
typedef struct {
  int64_t pages_in_use, pages_dense;
  double bytes_in_use, bytes_dense, bytes_saved, bytes_capacity;
} upf_session_memory;
void upf_session_memory_usage(const upf_session *s, upf_session_memory *mem);

/* One drop that a request's prefill went through: the drop layer and the tokens it kept. */
typedef struct {
  int32_t layer;
  int32_t kept_len;
} upf_kv_drop;

typedef struct {
  int32_t prompt_len;
  int32_t decoded;      /* decode rows run so far */
  int32_t prefilled;    /* 1 once its prefill row (or its last chunk) ran */
  int32_t num_drops;
  const upf_kv_drop *drops; /* (num_drops) the session's copy, valid until the request is released */
  int32_t prefill_done; /* prompt tokens prefilled: the chunks so far, the prompt once prefilled */
  int32_t chunks;       /* prefill rows run: 1 for a whole-prompt row, the chunks of a chunked prefill */
} upf_session_request_info;
upf_status upf_session_request(const upf_session *s, int32_t req, upf_session_request_info *info);
/* kv_len(r, l): the entries attention layer l holds for the request (0 before its prefill; the prompt
 * tokens its chunks wrote so far during a chunked prefill). */
upf_status upf_session_kv_len(const upf_session *s, int32_t req, int32_t layer, int64_t *len);

#ifdef __cplusplus
}
#endif
#endif

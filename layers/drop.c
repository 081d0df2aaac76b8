/* The drop step (SPEC.md section 3): after a drop layer's attention block, select on its q and k (or
 * replay a given token mask), then gather every per-token array of upf_tokens by the kept index and
 * rebuild cu_seqlens. Decode rows and short rows are never touched: the selection keeps them whole,
 * and a replayed mask that drops from them is refused. Nor are a session step's prefill chunks (a
 * chunk runs dense, SPEC section 4): the selection then runs over the whole prompts before them only. */
#include <stdlib.h>
#include <string.h>

#include "layers/layers.h"

/* Kept index, new cu_seqlens and counts of a replayed host mask, after checking it fits the batch
 * (rows from `whole` on are kept whole). */
static upf_status replay_plan(const upf_select_params *params, const uint8_t *mask, int64_t len, const upf_tokens *tok,
                              int32_t whole, int32_t *kept_index, int32_t *new_cu, int64_t *kept_total) {
  const int32_t *cu = tok->cu_seqlens_host;
  if (len != tok->num_tokens)
    return upf_fail(UPF_ERR_SHAPE, "replay mask: %lld entries, the layer has %lld tokens", (long long)len,
                    (long long)tok->num_tokens);
  int64_t n_kept = 0;
  new_cu[0] = 0;
  for (int32_t r = 0; r < tok->num_reqs; r++) {
    const int64_t n = cu[r + 1] - cu[r];
    for (int64_t j = cu[r]; j < cu[r + 1]; j++) {
      if (mask[j] > 1)
        return upf_fail(UPF_ERR_INVALID_ARG, "replay mask: entry %lld is %d, not 0 or 1", (long long)j, mask[j]);
      if (!mask[j] && r >= whole)
        return upf_fail(UPF_ERR_INVALID_ARG, "replay mask: drops token %lld of request %d, which is a prefill chunk "
                        "or a decode row after the chunks (kept whole)", (long long)(j - cu[r]), r);
      if (!mask[j] && (j == cu[r + 1] - 1 || !upf_select_is_scored(n, params)))
        return upf_fail(UPF_ERR_INVALID_ARG,
                        "replay mask: drops token %lld of request %d, which %s", (long long)(j - cu[r]), r,
                        j == cu[r + 1] - 1 ? "is its last token" : "is not scored (decode or short row)");
      if (mask[j])
        kept_index[n_kept++] = (int32_t)j;
    }
    new_cu[r + 1] = (int32_t)n_kept;
  }
  *kept_total = n_kept;
  return UPF_OK;
}

/* *a (T rows of row_bytes) = rows of *a at kept_index, through `spare`, which takes *a's old buffer. */
static upf_status compact(const upf_backend *be, void **a, void **spare, int64_t rows, int64_t row_bytes,
                          const int32_t *kept_index, int64_t kept_total) {
  UPF_TRY(be->compact_rows(*a, rows, row_bytes, kept_index, kept_total, *spare));
  void *t = *a;
  *a = *spare, *spare = t;
  return UPF_OK;
}

/* The selection over rows [0, Bs) only; rows [Bs, B) appended whole: mask 1, kept index the identity,
 * their lengths in new_cu (host). */
static upf_status select_head(const upf_model *m, const upf_select_params *params, const upf_attn_qk *qk,
                              int32_t Bs, upf_tokens *tok, upf_layer_scratch *s, int32_t *new_cu,
                              upf_drop_record *rec, int64_t *kept_total) {
  const upf_backend *be = m->be;
  const int32_t B = tok->num_reqs, *cu = tok->cu_seqlens_host;
  const int64_t T = tok->num_tokens, Ts = cu[Bs];
  int64_t kept = 0;
  new_cu[0] = 0;
  if (Bs > 0) {
    const upf_select_inputs in = {upf_rows(&qk->q, 0, Ts), upf_rows(&qk->k, 0, Ts), tok->cu_seqlens, cu, Bs};
    upf_select_outputs out = {NULL, NULL, s->token_mask, s->kept_index, s->new_cu, s->kept_count, 0};
    if (m->comm) {
      upf_select_tp_stats ts;
      UPF_TRY(upf_select_tp_run(m->comm, be, &in, params, &out, NULL, &ts));
      rec->allreduce_bytes = ts.allreduce_bytes, rec->allreduce_seconds = ts.allreduce_seconds;
      rec->tp_select_seconds = ts.seconds, rec->disagreeing_ranks = ts.disagreeing_ranks, rec->tp = ts;
    } else {
      UPF_TRY(be->select_run(&in, params, &out));
    }
    kept = out.kept_total;
    UPF_TRY(be->download(new_cu, s->new_cu, (size_t)(Bs + 1) * sizeof *new_cu));
  }
  int32_t *tail = malloc((size_t)(T - Ts > 0 ? T - Ts : 1) * sizeof *tail);
  if (!tail)
    return upf_fail(UPF_ERR_NOMEM, "drop: kept index of %lld whole tokens", (long long)(T - Ts));
  for (int64_t j = Ts; j < T; j++)
    tail[j - Ts] = (int32_t)j;
  for (int32_t r = Bs; r < B; r++)
    new_cu[r + 1] = new_cu[r] + (cu[r + 1] - cu[r]);
  upf_status st = be->fill(s->token_mask + Ts, 1, (size_t)(T - Ts));
  if (st == UPF_OK && T > Ts)
    st = be->upload(s->kept_index + kept, tail, (size_t)(T - Ts) * sizeof *tail);
  free(tail);
  *kept_total = kept + (T - Ts);
  return st;
}

upf_status upf_layer_drop(const upf_model *m, const upf_select_params *params, const upf_attn_qk *qk,
                          const uint8_t *replay_mask, int64_t replay_len, upf_tokens *tok, upf_layer_scratch *s,
                          upf_drop_record *rec) {
  const upf_backend *be = m->be;
  const int64_t T = tok->num_tokens;
  const int32_t B = tok->num_reqs;
  /* a session step with prefill chunks: only its whole prompts (rows [0, Bp)) may drop */
  const int32_t whole = s->cache && s->cache->num_chunk_rows > 0 ? s->cache->num_prefill_rows : B;
  int32_t *new_cu = malloc((size_t)(B + 1) * sizeof *new_cu);
  uint8_t *mask = malloc((size_t)(T ? T : 1));
  int32_t *kept_host = replay_mask ? malloc((size_t)(T ? T : 1) * sizeof *kept_host) : NULL;
  upf_status st = new_cu && mask && (kept_host || !replay_mask) ? UPF_OK
                                                                 : upf_fail(UPF_ERR_NOMEM, "drop: host arrays");
  int64_t kept_total = 0;
  if (st == UPF_OK && replay_mask) {
    st = replay_plan(params, replay_mask, replay_len, tok, whole, kept_host, new_cu, &kept_total);
    if (st == UPF_OK)
      memcpy(mask, replay_mask, (size_t)T);
    if (st == UPF_OK && kept_total)
      st = be->upload(s->kept_index, kept_host, (size_t)kept_total * sizeof *kept_host);
  } else if (st == UPF_OK && whole < B) {
    st = select_head(m, params, qk, whole, tok, s, new_cu, rec, &kept_total);
    if (st == UPF_OK)
      st = be->download(mask, s->token_mask, (size_t)T);
  } else if (st == UPF_OK) {
    const upf_select_inputs in = {qk->q, qk->k, tok->cu_seqlens, tok->cu_seqlens_host, B};
    upf_select_outputs out = {NULL, NULL, s->token_mask, s->kept_index, s->new_cu, s->kept_count, 0};
    if (m->comm) { /* tensor parallelism: partial scores of this rank's heads, all-reduced */
      upf_select_tp_stats ts;
      st = upf_select_tp_run(m->comm, be, &in, params, &out, NULL, &ts);
      rec->allreduce_bytes = ts.allreduce_bytes, rec->allreduce_seconds = ts.allreduce_seconds;
      rec->tp_select_seconds = ts.seconds, rec->disagreeing_ranks = ts.disagreeing_ranks, rec->tp = ts;
    } else {
      st = be->select_run(&in, params, &out);
    }
    kept_total = out.kept_total;
    if (st == UPF_OK)
      st = be->download(mask, s->token_mask, (size_t)T);
    if (st == UPF_OK)
      st = be->download(new_cu, s->new_cu, (size_t)(B + 1) * sizeof *new_cu);
  }
  const int64_t row_bytes = (int64_t)m->cfg->hidden * (int64_t)upf_dtype_size(m->dtype);
  if (st == UPF_OK)
    st = compact(be, &tok->residual, &s->spare, T, row_bytes, s->kept_index, kept_total);
  if (st == UPF_OK)
    st = compact(be, &tok->hidden, &s->spare, T, row_bytes, s->kept_index, kept_total);
  if (st == UPF_OK)
    st = compact(be, (void **)&tok->positions, (void **)&s->spare_i32, T, 4, s->kept_index, kept_total);
  if (st == UPF_OK)
    st = compact(be, (void **)&tok->origin, (void **)&s->spare_i32, T, 4, s->kept_index, kept_total);
  if (st == UPF_OK)
    st = be->upload(tok->cu_seqlens, new_cu, (size_t)(B + 1) * sizeof *new_cu);
  free(kept_host);
  if (st != UPF_OK) {
    free(new_cu), free(mask);
    return st;
  }
  memcpy(tok->cu_seqlens_host, new_cu, (size_t)(B + 1) * sizeof *new_cu);
  tok->num_tokens = kept_total;
  rec->tokens_in = T, rec->tokens_kept = kept_total, rec->mask = mask;
  for (int32_t r = 0; r < B; r++) /* new_cu becomes the per-request counts in place */
    new_cu[r] = new_cu[r + 1] - new_cu[r];
  rec->kept_per_req = new_cu;
  return UPF_OK;
}

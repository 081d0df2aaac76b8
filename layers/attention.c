/* The attention block (full or sliding-window), shared by the three families:
 *   qkv (T, Nqkv)       = hidden (T, H) . attn_qkv (H, Nqkv)
 *   q (T, Hq, D), gate (T, Hq, D) [Qwen3-Next], k, v (T, Hkv, D)   views of qkv
 *   q, k               <- q/k RMSNorm per head [Gemma-3, Qwen3-Next], then RoPE at the original positions
 *   o (T, Hq, D)        = causal attention (sliding window on local layers, counted in compacted indices;
 *                         FlashPrefill mode: block-sparse on full layers over the prefill rows); in a
 *                         session step whole prompts attend over their own K/V, prefill chunks and
 *                         decode rows over the paged cache (bottom-right causal); COMPACT mode: chunks
 *                         over the kept blocks of their block union (layers/compact_attn.c)
 *   o                  <- o * sigmoid(gate) [Qwen3-Next]
 *   out (T, H)          = o . attn_output (Hq D, H), post-attention norm [Gemma-3]
 *   residual += out;  hidden = ffn_norm(residual) */
#include <string.h>
#include <time.h>

#include "layers/layers.h"
#include "uniprefill/compact_attn.h"

upf_status upf_layer_add_norm(const upf_model *m, upf_tokens *tok, upf_layer_scratch *s, const upf_tensor *norm_w) {
  const int64_t T = tok->num_tokens, H = m->cfg->hidden;
  const upf_tensor out = upf_mat(s->out, m->dtype, T, H);
  const upf_tensor residual = upf_mat(tok->residual, m->dtype, T, H);
  const upf_tensor hidden = upf_mat(tok->hidden, m->dtype, T, H);
  return m->be->rmsnorm_add(&out, &residual, norm_w, &m->cfg->norm, &hidden);
}

/* Prefill rows over their own contiguous K/V: block-sparse when sp is set, else dense. */
static upf_status attend_prefill(const upf_model *m, upf_layer_sparse *sp, const upf_attn_varlen *batch,
                                 const upf_tensor *q, const upf_tensor *k, const upf_tensor *v,
                                 const upf_attn_params *p, const upf_tensor *o) {
  if (sp) {
    const upf_sparse_batch b = {batch, NULL};
    return upf_layer_sparse_attend(m, sp, &b, q, k, v, o);
  }
  return m->be->attn_prefill(batch, q, k, v, p, o, NULL);
}

/* CompactAttention over the chunk rows; the table's columns past a chunk's own blocks are zeroed (the op
 * leaves them unspecified) so that the counts and the dumped tables read only real blocks. */
static upf_status attend_compact(const upf_model *m, const upf_layer_cache *kc, upf_layer_compact *cc,
                                 const upf_tensor *q, const upf_attn_params *p, const upf_tensor *o) {
  const upf_backend *be = m->be;
  const upf_attn_paged *ch = &kc->chunks;
  const int64_t hkv = m->cfg->kv_heads, nb = cc->key_blocks, bn = cc->params.block_n;
  UPF_TRY(be->synchronize()); /* the projections before are not the attention's time */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  UPF_TRY(upf_compact_attend_ws(be, ch, q, &kc->k_cache, &kc->v_cache, &cc->params, &cc->cp, p, 0, o, &cc->ws));
  clock_gettime(CLOCK_MONOTONIC, &t1);
  cc->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  memcpy(cc->table, cc->ws.table_host.ptr, (size_t)ch->num_reqs * (size_t)hkv * (size_t)nb);
  cc->kept_blocks = 0, cc->visible_blocks = 0;
  for (int32_t r = 0; r < ch->num_reqs; r++) {
    const int64_t kv = ch->kv_lens_host[r], ql = ch->cu_seqlens_q_host[r + 1] - ch->cu_seqlens_q_host[r];
    const int64_t own = (kv + bn - 1) / bn;
    for (int64_t h = 0; h < hkv; h++) {
      uint8_t *row = cc->table + ((int64_t)r * hkv + h) * nb;
      memset(row + own, 0, (size_t)(nb - own));
      for (int64_t b = 0; kv > ql && b < own; b++)
        cc->kept_blocks += row[b] != 0;
    }
    if (kv > ql)
      cc->visible_blocks += hkv * own;
  }
  return UPF_OK;
}

/* A session step: K/V into the cache, then whole prompts over the step's own K/V, prefill chunks over
 * the cache (their cached context and themselves, block-sparse when sc is set), decode rows over the
 * cache (their kv_len + 1 entries, this step's included). Chunks and decode rows run as two calls: a
 * batch of one-token rows keeps the decode path it has without chunks. */
static upf_status attend_cached(const upf_model *m, const upf_tokens *tok, const upf_layer_cache *kc,
                                upf_layer_sparse *sp, upf_layer_sparse *sc, upf_layer_compact *cc, const upf_tensor *q,
                                const upf_tensor *k, const upf_tensor *v, const upf_attn_params *p, const upf_tensor *o) {
  const upf_backend *be = m->be;
  UPF_TRY(be->kv_cache_write(k, v, kc->slots, kc->slots_host, &kc->k_cache, &kc->v_cache));
  const int32_t Bp = kc->num_prefill_rows, Bc = kc->num_chunk_rows;
  const int64_t Tp = tok->cu_seqlens_host[Bp], Tc = tok->cu_seqlens_host[Bp + Bc], T = tok->num_tokens;
  if (Bp > 0) {
    const upf_attn_varlen prefill = {Bp, tok->cu_seqlens, tok->cu_seqlens_host, tok->cu_seqlens, tok->cu_seqlens_host};
    const upf_tensor qp = upf_rows(q, 0, Tp), kp = upf_rows(k, 0, Tp), vp = upf_rows(v, 0, Tp), op = upf_rows(o, 0, Tp);
    UPF_TRY(attend_prefill(m, sp, &prefill, &qp, &kp, &vp, p, &op));
  }
  if (Bc > 0) {
    const upf_tensor qc = upf_rows(q, Tp, Tc - Tp), oc = upf_rows(o, Tp, Tc - Tp);
    if (sc) {
      const upf_sparse_batch b = {NULL, &kc->chunks};
      UPF_TRY(upf_layer_sparse_attend(m, sc, &b, &qc, &kc->k_cache, &kc->v_cache, &oc));
    } else if (cc) {
      UPF_TRY(attend_compact(m, kc, cc, &qc, p, &oc));
    } else {
      UPF_TRY(be->attn_paged(&kc->chunks, &qc, &kc->k_cache, &kc->v_cache, p, &oc, NULL));
    }
  }
  if (Bp + Bc < tok->num_reqs) {
    const upf_tensor qd = upf_rows(q, Tc, T - Tc), od = upf_rows(o, Tc, T - Tc);
    UPF_TRY(be->attn_paged(&kc->decode, &qd, &kc->k_cache, &kc->v_cache, p, &od, NULL));
  }
  return UPF_OK;
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
  upf_layer_sparse *sp = kind == UPF_MIXER_FULL ? s->sparse : NULL;
  upf_layer_sparse *sc = kind == UPF_MIXER_FULL ? s->sparse_chunks : NULL;
  upf_layer_compact *cc = kind == UPF_MIXER_FULL ? s->compact : NULL;
  if (s->cache)
    UPF_TRY(attend_cached(m, tok, s->cache, sp, sc, cc, &q, &k, &v, &p, &o));
  else
    UPF_TRY(attend_prefill(m, sp, &batch, &q, &k, &v, &p, &o));
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

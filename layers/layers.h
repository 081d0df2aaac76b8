/* The sub-layers of a transformer block, each a short composition of backend-table calls, and the
 * state they share. A sub-layer never branches on the backend and does not know whether tokens were
 * dropped before it: it sees a (possibly compacted) varlen batch with its original positions. */
#ifndef UNIPREFILL_LAYERS_H
#define UNIPREFILL_LAYERS_H

#include "uniprefill/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every per-token array the layers carry, in one place, so the drop step compacts all of them.
 * Activations are in the model's dtype; buffers hold max_tokens rows, of which num_tokens are live.
 * Backend memory unless named _host. */
typedef struct {
  int64_t num_tokens, max_tokens; /* T (after the drops so far), and the step's tokens */
  int32_t num_reqs;               /* B */
  void *residual;                 /* (T, H) the residual stream */
  void *hidden;                   /* (T, H) the normalised input of the next sub-layer */
  int32_t *positions;             /* (T) original position of each token in its request (RoPE) */
  int32_t *origin;                /* (T) index of each token in the step's packed input */
  int32_t *cu_seqlens;            /* (B+1) */
  int32_t *cu_seqlens_host;       /* (B+1) */
} upf_tokens;

/* What a session step (models/session.c) keeps beyond the step, set before each layer; a plain
 * prefill has none. The step's rows are whole-prompt prefill rows first, then prefill chunks (part of a
 * prompt, chunked prefill), then decode rows of one token each. */
typedef struct {
  int32_t num_prefill_rows;        /* Bp: rows [0, Bp) are whole prompts */
  int32_t num_chunk_rows;          /* Bc: rows [Bp, Bp + Bc) are chunks; [Bp + Bc, B) decode rows */
  /* attention layers: write K/V through the slot mapping, then whole prompts attend over the step's
   * contiguous K/V, chunks and decode rows over the paged cache (their cached context and themselves) */
  upf_tensor k_cache, v_cache;     /* (pages, P, Hkv, D) this layer's cache */
  const int32_t *slots;            /* (T) slot of each current token, backend memory */
  const int32_t *slots_host;       /* (T) host copy */
  upf_attn_paged chunks;           /* the chunk rows over the cache (Bc rows, q_len >= 1 each) */
  upf_attn_paged decode;           /* the decode rows over the cache (B - Bp - Bc rows) */
  /* Gated DeltaNet layers: per-request states in slots of a pool */
  void *conv_pool;                 /* (S, K-1, C) f32 this layer's conv states */
  void *rec_pool;                  /* (S, Hv, Dk, Dv) f32 this layer's recurrent states */
  int64_t pool_rows;               /* S */
  const int32_t *gather;           /* (B) pool row each row's state is read from (a zero row for a row
                                    * that starts its prompt) */
  const int32_t *scatter;          /* (B) pool row each row's state is written to */
  const int32_t *scatter_host;     /* (B) host copy */
  void *conv_in, *conv_out;        /* (B, K-1, C) f32 step buffers */
  void *rec;                       /* (B, Hv, Dk, Dv) f32 step buffer, updated in place by the scan */
} upf_layer_cache;

/* FlashPrefill mode (models/prefill.c sets it for a step with prefill rows): the parameters, the plan
 * of one batch of prefill rows (the whole prompts over their own K/V, or the chunks over the paged
 * cache) and the scratch it sizes, reused by every full-attention layer, which fills `rec` (its layer
 * excepted) when it runs sparse. */
typedef struct {
  upf_sparse_params params;  /* scale resolved: the model's attention scale unless given */
  upf_sparse_plan plan;      /* of the whole prompts [0, Bp), or of the chunks [Bp, Bp + Bc) */
  int64_t visible_blocks;    /* upf_sparse_visible_blocks of that batch */
  void *kbar;                /* (Bp, max_key_blocks, Hkv, D) model dtype */
  void *vbar;                /* (Bp, max_key_blocks, Hkv, D) model dtype; NULL without mean correction */
  upf_sparse_index index;    /* row_ptr (S+1), blocks (S * max_key_blocks); scores NULL */
  upf_sparse_record rec;     /* the last sparse layer's counts and times */
  int32_t sharing;           /* upf_prefill_options.sparse_sharing: fill rec.neighbour_* */
} upf_layer_sparse;

/* COMPACT mode (models/prefill.c sets it for a step with a chunk with cached context): the chunks of
 * every full-attention layer run upf_compact_attend, which fills table (and the layer's counts here). */
typedef struct {
  upf_sparse_params params;   /* the selector's: scale resolved, last_n 0 */
  upf_compact_params cp;
  int32_t key_blocks;         /* ceil(max chunk kv_len / block_n): the table's dim 2 */
  uint8_t *table;             /* (Bc, Hkv, key_blocks) host: the last layer's union, 0 past a chunk's blocks */
  int64_t kept_blocks;        /* the last layer's: table entries set over the chunks with cached context */
  int64_t visible_blocks;     /* Hkv ceil(kv_len / block_n) summed over those chunks */
  double seconds;             /* the last layer's upf_compact_attend, bracketed by synchronizes */
  upf_compact_workspace ws;   /* the layers' shared scratch: allocated by the first, reused by the rest */
} upf_layer_compact;

/* Buffers a layer writes and a later one overwrites, sized by the step's tokens (Tmax rows). */
typedef struct {
  void *out;            /* (Tmax, H) a sub-layer's output, before the residual add */
  void *proj;           /* (Tmax, max(Nqkv, C + Hv Dv)) fused input projection */
  void *mix;            /* (Tmax, max(Hq D, Hv Dv)) attention / scan output */
  void *conv;           /* (Tmax, C) Gated DeltaNet conv output (GDN models only) */
  void *ba;             /* (Tmax, 2 Hv) Gated DeltaNet b and a (GDN models only) */
  void *spare;          /* (Tmax, H) compaction target */
  int32_t *spare_i32;   /* (Tmax) compaction target */
  uint8_t *token_mask;  /* (Tmax) selection outputs */
  int32_t *kept_index;  /* (Tmax) */
  int32_t *new_cu;      /* (B+1) */
  int32_t *kept_count;  /* (B) */
  const upf_layer_cache *cache; /* NULL: nothing outlives the step (plain prefill) */
  upf_layer_sparse *sparse;     /* NULL: full-attention layers run dense attention (whole prompts) */
  upf_layer_sparse *sparse_chunks; /* the chunk rows' plan over the paged cache; NULL: they run dense */
  upf_layer_compact *compact;   /* COMPACT mode: the chunk rows' union; NULL: they run dense */
} upf_layer_scratch;

/* Views of a drop layer's q and k (after q/k norm and RoPE): the drop step's input. */
typedef struct {
  upf_tensor q; /* (T, Hq, D) view into scratch.proj */
  upf_tensor k; /* (T, Hkv, D) view into scratch.proj */
} upf_attn_qk;

/* A contiguous (rows, cols) matrix over buffer memory. */
upf_tensor upf_mat(void *data, upf_dtype dtype, int64_t rows, int64_t cols);
/* Columns [col0, col0 + cols) of a 2-D matrix (same rows, same row stride). */
upf_tensor upf_cols(const upf_tensor *mat, int64_t col0, int64_t cols);
/* Rows [row0, row0 + rows) of a tensor (any dims, same strides). */
upf_tensor upf_rows(const upf_tensor *t, int64_t row0, int64_t rows);
/* A (rows, heads, dim) view of columns [col0, ...) of a 2-D matrix, heads head_stride apart (dim, or
 * 2*dim where each head interleaves with another tensor: Qwen3-Next's query and gate). */
upf_tensor upf_heads(const upf_tensor *mat, int64_t col0, int64_t heads, int64_t dim, int64_t head_stride);

/* Attention block: hidden (T, H) = norm(residual) in; q/k/v projection, q/k norm, RoPE at the original
 * positions, full or sliding-window causal attention (full layers block-sparse over the prefill rows
 * when s->sparse is set), the output gate, the output projection, the post-attention norm (sandwich),
 * then residual += out and hidden = ffn_norm(residual). qk receives the layer's q and k for the drop
 * step. */
upf_status upf_layer_attention(const upf_model *m, int32_t layer, upf_tokens *tok, upf_layer_scratch *s,
                               upf_attn_qk *qk);
/* FlashPrefill V2 over a batch of contiguous or paged K/V (layers/sparse.c): sp->kbar (and vbar) =
 * block means, the index, then o = block-sparse attention; sp->rec gets the kept and visible block
 * counts and the times of means + index and of the attention (each bracketed by a synchronize). q, o
 * (T, Hq, D) views; k, v (T, Hkv, D) views or the (pages, P, Hkv, D) caches, in the batch's form; the
 * batch must be the one sp->plan was made for. */
upf_status upf_layer_sparse_attend(const upf_model *m, upf_layer_sparse *sp, const upf_sparse_batch *batch,
                                   const upf_tensor *q, const upf_tensor *k, const upf_tensor *v, const upf_tensor *o);
/* Gated DeltaNet block: the same contract, with the linear-attention mixer in place of attention. */
upf_status upf_layer_gdn(const upf_model *m, int32_t layer, upf_tokens *tok, upf_layer_scratch *s);
/* FFN block: s->out (T, H) = FFN(hidden) (dense gated or MoE), post-FFN norm (sandwich). The residual
 * add is the next block's pre-norm (upf_layer_add_norm). */
upf_status upf_layer_ffn(const upf_model *m, int32_t layer, upf_tokens *tok, upf_layer_scratch *s);
/* Tensor parallelism: out (T, H) in place = the sum over ranks of every rank's partial out (the output of
 * a row-parallel projection); nothing without a communicator. */
upf_status upf_layer_allreduce(const upf_model *m, const upf_tensor *out);
/* residual += s->out; hidden = norm_w(residual). */
upf_status upf_layer_add_norm(const upf_model *m, upf_tokens *tok, upf_layer_scratch *s, const upf_tensor *norm_w);

/* The drop step (SPEC.md section 3): selection on the layer's q and k (or a replayed host token mask
 * of T entries), then every per-token array of tok compacted by the kept index and cu_seqlens
 * rebuilt. Fills rec (its mask and kept_per_req allocated here, host). */
upf_status upf_layer_drop(const upf_model *m, const upf_select_params *params, const upf_attn_qk *qk,
                          const uint8_t *replay_mask, int64_t replay_len, upf_tokens *tok, upf_layer_scratch *s,
                          upf_drop_record *rec);

#ifdef __cplusplus
}
#endif
#endif

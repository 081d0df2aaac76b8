/* Attention layers: varlen causal prefill attention (full or sliding window, GQA, optional logit
 * soft-cap, per-row log-sum-exp), paged attention over a KV cache addressed through a block table
 * (decode rows and prefill rows whose KV already lives in the cache), and the op that writes a step's
 * K and V into the cache through a slot mapping. Parameter and batch types, and the checks every
 * backend shares; the entries themselves are in the backend ops table (uniprefill/backend.h).
 *
 * Alignment: a request has q_len query rows and kv_len >= q_len keys; its query rows are the LAST
 * q_len of its kv_len positions (bottom-right causal alignment), so query t (0-based in the request)
 * sits at kv position t + kv_len - q_len and sees keys j <= that position. With a window w > 0 it
 * sees only i - w < j <= i (i its kv position), counted in token indices of the packed, possibly
 * compacted, sequence (SPEC section 3). Every query row sees at least itself, so no row is empty.
 *
 * Numerics: logits s = scale * q.k, then softcap * tanh(s / softcap) when softcap > 0; softmax over
 * the visible keys; out = softmax . v rounded once to out's dtype; lse = log(sum_j exp(s_j)) in the
 * natural log, f32. */
#ifndef UNIPREFILL_ATTN_H
#define UNIPREFILL_ATTN_H

#include <stdint.h>

#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  float scale;    /* logit scale; 0 means 1/sqrt(D). Gemma-3: query_pre_attn_scalar^-0.5 (upf_attn_gemma_scale) */
  float softcap;  /* 0: off; else s -> softcap * tanh(s / softcap) (Gemma-2 style attn_logit_softcapping) */
  int32_t window; /* 0: full causal; else sliding window of `window` keys including the query's own */
} upf_attn_params;

/* Range checks: scale and softcap finite and >= 0, window >= 0 (UPF_ERR_INVALID_ARG). */
upf_status upf_attn_params_check(const upf_attn_params *p);
/* The scale in effect for a head of head_dim. */
double upf_attn_scale(const upf_attn_params *p, int64_t head_dim);
/* Gemma's convention: scale = query_pre_attn_scalar^-0.5 (256 on Gemma-3 12B, its head dim). */
float upf_attn_gemma_scale(double query_pre_attn_scalar);

/* A varlen batch of contiguous K/V: request r has queries q[cu_q[r] : cu_q[r+1]] and keys/values
 * k, v[cu_kv[r] : cu_kv[r+1]], with kv_len >= q_len. Self-attention prefill passes the same array
 * for both. Device arrays for the kernels, host copies (the same values) for the checks and the
 * launch plan. */
typedef struct {
  int32_t num_reqs;                  /* B >= 1 */
  const int32_t *cu_seqlens_q;       /* (B+1) backend memory */
  const int32_t *cu_seqlens_q_host;  /* (B+1) host copy */
  const int32_t *cu_seqlens_kv;      /* (B+1) backend memory */
  const int32_t *cu_seqlens_kv_host; /* (B+1) host copy */
} upf_attn_varlen;

/* A batch over the paged cache (SPEC section 4): request r has q_len = cu_q[r+1] - cu_q[r] query rows
 * (1 for a decode row) and kv_lens[r] >= q_len cached entries (this step's rows included: the cache
 * write runs first); logical KV index i of r lives in page block_table[r * max_blocks + i / page_size]
 * at offset i % page_size. */
typedef struct {
  int32_t num_reqs;                 /* B >= 1 */
  const int32_t *cu_seqlens_q;      /* (B+1) backend memory */
  const int32_t *cu_seqlens_q_host; /* (B+1) host copy */
  const int32_t *kv_lens;           /* (B) backend memory */
  const int32_t *kv_lens_host;      /* (B) host copy */
  const int32_t *block_table;       /* (B, max_blocks) backend memory */
  const int32_t *block_table_host;  /* (B, max_blocks) host copy: the page ids are range-checked */
  int32_t max_blocks;               /* row stride of block_table */
  int32_t page_size;                /* P: tokens per page, the cache's dim 1 */
} upf_attn_paged;

/* ---- Shape checks shared by the backends (messages name op and operand) ---- */

/* q (Tq, Hq, D), k and v (Tkv, Hkv, D) with Hq % Hkv == 0, out (Tq, Hq, D), all f32 or bf16 of q's
 * dtype, last dim contiguous; lse (Tq, Hq) f32 contiguous or NULL; cu_seqlens as described. */
upf_status upf_attn_prefill_check(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                  const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                                  const upf_tensor *lse);
/* q (Tq, Hq, D), k_cache and v_cache (num_pages, P, Hkv, D), out, lse as for prefill; every page a
 * request reaches (the first ceil(kv_len / P) of its block-table row) in [0, num_pages). */
upf_status upf_attn_paged_check(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                                const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                                const upf_tensor *lse);
/* k and v (T, Hkv, D) in the caches' dtype; slot_mapping (T): slot = page * P + offset in
 * [0, num_pages * P), or -1 for a row that is not stored (padding); no two rows share a slot. */
upf_status upf_kv_cache_write_check(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping_host,
                                    const upf_tensor *k_cache, const upf_tensor *v_cache);

/* Exact FLOPs of one call (2 * D per q.k and per p.v product over the visible (query, key) pairs,
 * times Hq), from host lengths: q_lens (B) and kv_lens (B). */
double upf_attn_flops(const int32_t *q_lens, const int32_t *kv_lens, int32_t num_reqs, int64_t hq, int64_t d,
                      int32_t window);

#ifdef __cplusplus
}
#endif
#endif

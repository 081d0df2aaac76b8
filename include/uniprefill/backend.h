/* The backend ops table. layers/, models/, verify/ and perf/ are written once against this table,
 * so the same code runs on the CPU reference and on CUDA and can be compared whole. Every pointer
 * an entry takes lives in that backend's memory (host for cpu, device for cuda). */
#ifndef UNIPREFILL_BACKEND_H
#define UNIPREFILL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/attn.h"
#include "uniprefill/dense.h"
#include "uniprefill/gdn.h"
#include "uniprefill/moe.h"
#include "uniprefill/select.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct upf_backend {
  const char *name; /* "cpu", "cuda" */

  /* UPF_OK when usable here; otherwise UPF_ERR_NO_DEVICE / UPF_ERR_UNSUPPORTED with the reason. */
  upf_status (*probe)(void);
  /* One line naming the device ("NVIDIA H200, driver 580.x, CUDA 13.0"), "" if unknown. */
  const char *(*describe)(void);

  upf_status (*alloc)(void **ptr, size_t bytes);
  void (*release)(void *ptr);
  upf_status (*upload)(void *dst, const void *src, size_t bytes);   /* host -> backend */
  upf_status (*download)(void *dst, const void *src, size_t bytes); /* backend -> host */
  upf_status (*fill)(void *dst, int byte, size_t bytes);
  upf_status (*synchronize)(void);

  /* Stage 1. scores: one (Hq, L, n_r) slab per scored request at upf_select_score_offsets. */
  upf_status (*select_part_gemm)(const upf_select_inputs *in, const upf_select_params *params,
                                 float *scores);
  /* Stage 2. token_mass (T): sum over heads and the L rows of the row-softmaxed scores; 0 for
   * tokens of requests that are not scored. Only in->cu_seqlens*, num_reqs and q's Hq are read. */
  upf_status (*select_block_softmax)(const upf_select_inputs *in, const upf_select_params *params,
                                     const float *scores, float *token_mass);
  /* Stage 3. block_score (num_blocks) from token_mass (T); 0 for requests that are not scored. */
  upf_status (*select_block_reduce)(const upf_select_inputs *in, const upf_select_params *params,
                                    const float *token_mass, float *block_score);
  /* Stage 4. block_mask (num_blocks) from block_score; all 1 for requests that are not scored.
   * Fails with UPF_ERR_NONFINITE if a scored request has a NaN/Inf block score. */
  upf_status (*select_topp)(const upf_select_inputs *in, const upf_select_params *params,
                            const float *block_score, uint8_t *block_mask);
  /* Mask expansion: token_mask, kept_index, new_cu_seqlens, kept_count and kept_total from the
   * block mask (out->block_score/block_mask are not touched). */
  upf_status (*select_expand)(const upf_select_inputs *in, const upf_select_params *params,
                              const uint8_t *block_mask, upf_select_outputs *out);
  /* The whole selection (stages 1-4 fused as the backend sees fit, then expansion). Fills every
   * non-NULL array of `out`. Validates inputs; UPF_ERR_NONFINITE when q or k hold NaN/Inf. */
  upf_status (*select_run)(const upf_select_inputs *in, const upf_select_params *params,
                           upf_select_outputs *out);
  /* dst[i, :] = src[kept_index[i], :] for i < kept_total; rows of row_bytes bytes. */
  upf_status (*compact_rows)(const void *src, int64_t num_rows, int64_t row_bytes,
                             const int32_t *kept_index, int64_t kept_total, void *dst);

  /* ---- Dense sub-layers (uniprefill/dense.h). Tensors are 2-D (T, N) or 3-D (T, H, D) with a
   * contiguous last dim and any outer strides (views into fused buffers are fine); outputs are
   * written through the descriptor's data. f32 or bf16 throughout; math in fp32 or better, each
   * output rounded once. Shapes are checked with the upf_*_check rules of dense.h. ---- */
  /* c (M, N) = a (M, K) . b (K, N): weights in the (in, out) layout. a and b share a dtype; c is f32
   * or bf16 (bf16 inputs), f32 (f32 inputs). CPU: cblas_sgemm; CUDA: cublasGemmEx, CUBLAS_COMPUTE_32F. */
  upf_status (*gemm)(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c);
  /* h (T, I) = act(gate_up[:, :I]) * gate_up[:, I:], gate_up (T, 2I); same dtype. */
  upf_status (*ffn_act_mul)(const upf_tensor *gate_up, upf_act act, const upf_tensor *h);
  /* y (T, H) = (act(x Wg) * (x Wu)) Wd with w_gate_up (H, 2I) = [Wg | Wu] and w_down (I, H), all in
   * x's dtype; y in x's dtype or f32. The (T, 2I) and (T, I) intermediates are stored in x's dtype
   * (backend scratch). */
  upf_status (*ffn_gated)(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                          const upf_tensor *y);
  /* y (T, N) = rmsnorm(x (T, N)) with w (N); y may be x (in place). */
  upf_status (*rmsnorm)(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);
  /* residual (T, N) = round(x + residual) in place, then y = rmsnorm(residual); y may be x. */
  upf_status (*rmsnorm_add)(const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                            const upf_norm_params *p, const upf_tensor *y);
  /* y (T, H, D) = rmsnorm of every head row of x (T, H, D) with w (D); y may be x. */
  upf_status (*qk_norm)(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);
  /* Rotates q (T, Hq, D) and k (T, Hkv, D) in place at positions (T) (int32, any values, gaps
   * allowed); k may be NULL. Dims at and after rotary_dim are not touched. */
  upf_status (*rope)(const upf_tensor *q, const upf_tensor *k, const int32_t *positions, const upf_rope_params *p);
  /* y (T, H, D) = o * sigmoid(gate); y may be o. */
  upf_status (*gated_output)(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y);
  /* y (T, H) = table (V, H)[ids (T)] * scale; UPF_ERR_INVALID_ARG naming the first id outside [0, V). */
  upf_status (*embed)(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                      const upf_tensor *y);
  /* logits (B, V) = rmsnorm(hidden[cu[r+1]-1]) . w_lm (H, V) for each request r: the final norm and
   * the LM head of the last token of each request. cu_seqlens_host (B+1) is a host array; every
   * request needs a token. logits f32 or bf16 (bf16 inputs). */
  upf_status (*logits_last)(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                            const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                            const upf_tensor *logits);

  /* ---- MoE FFN of Qwen3-Next (uniprefill/moe.h): x (T, H), weights in x's dtype, (out, in) layout.
   * Deterministic: the same inputs give the same bits on every run. ---- */
  /* routing->topk_index, topk_weight (T, K) and, when not NULL, logits (T, E) fp32. UPF_ERR_NONFINITE
   * names the first token with a NaN/Inf logit. */
  upf_status (*moe_route)(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                          upf_moe_routing *routing);
  /* Stable counting sort of the pairs of topk_index (T, K) by expert; all four outputs required.
   * UPF_ERR_INVALID_ARG names the first index outside [0, E). */
  upf_status (*moe_permute)(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                            upf_moe_permutation *perm);
  /* out (T, H), f32 or bf16: the whole layer. routing may be NULL; its non-NULL arrays receive the
   * routing the layer used. */
  upf_status (*moe_ffn)(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                        const upf_tensor *out, upf_moe_routing *routing);
  /* ---- Gated DeltaNet of Qwen3-Next (uniprefill/gdn.h): varlen batches, fp32 states, deterministic.
   * Shapes are checked with the upf_gdn_*_check rules. ---- */
  /* y (T, C) = silu(causal depthwise conv of x (T, C) with w (C, K)) within each request, the K-1
   * inputs before a request's first token taken from state_in (B, K-1, C) (NULL: zeros); state_out
   * (B, K-1, C), when not NULL, receives the last K-1 inputs of each request (its initial state
   * included when it has fewer than K-1 tokens). state_out must not be state_in. */
  upf_status (*gdn_conv)(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                         const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y);
  /* One decode token per request: y (B, C) from x (B, C) and state (B, K-1, C), then the state
   * shifts by one in place. Equal to gdn_conv over one-token requests. */
  upf_status (*gdn_conv_step)(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state, const upf_tensor *y);
  /* The gated delta rule over each request of the batch (decode rows are one-token requests):
   * o (T, Hv, Dv); state_out (B, Hv, Dk, Dv) f32 or NULL, and may be in->state_in (in place). */
  upf_status (*gdn_scan)(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                         const upf_tensor *state_out);
  /* y (T, H, D) = rmsnorm(o) * w * silu(z) per head row; y may be o. */
  upf_status (*gdn_gated_norm)(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w, const upf_norm_params *p,
                               const upf_tensor *y);
  /* ---- Attention (uniprefill/attn.h): q (Tq, Hq, D), out (Tq, Hq, D) in q's dtype, lse (Tq, Hq) f32 or
   * NULL, f32 or bf16 inputs, D >= 1 (CUDA: D <= 256). Deterministic: no float atomics, a fixed order of
   * every sum. Sliding window and soft-cap are parameters. ---- */
  /* Varlen causal prefill over contiguous k, v (Tkv, Hkv, D), queries bottom-right aligned to their
   * request's keys (kv_len >= q_len: a prefill against an existing cache passes the cached rows too). */
  upf_status (*attn_prefill)(const upf_attn_varlen *batch, const upf_tensor *q, const upf_tensor *k,
                             const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                             const upf_tensor *lse);
  /* The same over the paged cache k_cache, v_cache (num_pages, P, Hkv, D): decode rows (q_len 1) and
   * prefill rows whose KV is already in the cache, mixed in one batch. */
  upf_status (*attn_paged)(const upf_attn_paged *batch, const upf_tensor *q, const upf_tensor *k_cache,
                           const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out,
                           const upf_tensor *lse);
  /* k_cache, v_cache [slot_mapping[t]] = k, v (T, Hkv, D)[t]; slot -1 skips the row. slot_mapping (T)
   * in backend memory, slot_mapping_host its host copy (range and duplicate checks). */
  upf_status (*kv_cache_write)(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping,
                               const int32_t *slot_mapping_host, const upf_tensor *k_cache,
                               const upf_tensor *v_cache);
} upf_backend;

const upf_backend *upf_backend_cpu(void);
/* Always returns the table; in a CUDA=0 build every entry fails with UPF_ERR_UNSUPPORTED.
 * Setting UPF_BACKENDS=cpu in the environment makes probe() fail without touching CUDA. */
const upf_backend *upf_backend_cuda(void);
/* "cpu" or "cuda"; NULL (with a message) for anything else. */
const upf_backend *upf_backend_by_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif

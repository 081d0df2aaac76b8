/* CPU reference of the Qwen3-Next MoE FFN (uniprefill/moe.h): router, top-K, stable counting-sort
 * permutation and the expert/shared-expert FFN, all in double (OpenBLAS dgemm for the products).
 * The ref_moe_* functions are the stages, usable alone by verify and tests; the cpu_moe_* functions
 * are the CPU backend's ops-table entries (host pointers, fp32/bf16 outputs). */
#ifndef UNIPREFILL_REF_MOE_H
#define UNIPREFILL_REF_MOE_H

#include <stdint.h>

#include "uniprefill/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst (n) = the n f32 or bf16 values at src, as double. */
void ref_moe_load_f64(const void *src, upf_dtype dtype, int64_t n, double *dst);

/* Routing of one token from its logits (E): index (K) the top-K experts by descending logit (equal
 * logits: lower expert index first), weight (K) their softmax probabilities, renormalised to sum 1
 * when cfg->norm_topk. prob (E, may be NULL) receives the whole softmax. */
void ref_moe_route_token(const double *logits, const upf_moe_config *cfg, int32_t *index, double *weight,
                         double *prob);

/* logits (T, E) = x . router^T in double. UPF_ERR_NONFINITE names the first token whose logits are
 * NaN/Inf (from NaN/Inf in its x row or in the router weights). */
upf_status ref_moe_logits(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *logits);

/* logits (T, E) as above, then topk_index (T, K) and topk_weight (T, K) per token. */
upf_status ref_moe_route(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *logits,
                         int32_t *topk_index, double *topk_weight);

/* Stable counting sort of the T*K pairs of topk_index (T, K) by expert; all four outputs required.
 * UPF_ERR_INVALID_ARG (before writing anything) when an index is outside [0, E). */
upf_status ref_moe_permute(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                           upf_moe_permutation *perm);

/* out (T, H) = the layer for the given routing (topk_index, topk_weight: (T, K)), in double, with
 * the intermediates every backend stores (gate/up projections, SwiGLU output, each expert's and the
 * shared expert's down projection) rounded to x's dtype where they are stored (moe.h, Numerics).
 * Routed contributions are added expert by expert, then the gated shared expert. */
upf_status ref_moe_ffn(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                       const int32_t *topk_index, const double *topk_weight, double *out);

/* CPU backend entries (host pointers; see uniprefill/backend.h). */
upf_status cpu_moe_route(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                         upf_moe_routing *routing);
upf_status cpu_moe_permute(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                           upf_moe_permutation *perm);
upf_status cpu_moe_ffn(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                       const upf_tensor *out, upf_moe_routing *routing);

#ifdef __cplusplus
}
#endif
#endif

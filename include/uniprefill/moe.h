/* Mixture-of-experts FFN of Qwen3-Next (issue item 3): configuration, weights, the routing and
 * permutation outputs, validation and FLOP counts shared by every backend. The functions themselves
 * (moe_route, moe_permute, moe_ffn) live in the backend ops table (uniprefill/backend.h).
 *
 * The layer, for each token t with hidden state x (H):
 *   logits = x . router^T                     (E) fp32 (double on the CPU reference), never rounded
 *   p      = softmax(logits)
 *   top-K  = the K experts with the largest logits, in descending order; equal logits: the lower
 *            expert index ranks first
 *   w_k    = p_k / sum_j p_j over the K chosen (norm_topk), else p_k
 *   out    = sum_k w_k * down_e(silu(gate_e . x) * (up_e . x))           (summed in rank order)
 *          + sigmoid(shared_gate . x) * shared_down(silu(sg . x) * (su . x))   (when Is > 0)
 *
 * Numerics shared by every backend: products accumulate in fp32 or better; the router logits,
 * softmax, weights, the sigmoid gate and the final weighted sum stay in fp32 or better (out is
 * rounded once). The intermediates (gate/up projections, SwiGLU output, each expert's down
 * projection, and the same three of the shared expert) are stored in x's dtype, as the frameworks
 * do, and every backend rounds them at the same points (to nearest even), the CPU reference too.
 */
#ifndef UNIPREFILL_MOE_H
#define UNIPREFILL_MOE_H

#include <stdint.h>

#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int32_t hidden;       /* H */
  int32_t num_experts;  /* E */
  int32_t top_k;        /* K, 1 <= K <= E */
  int32_t inter;        /* I: intermediate size of a routed expert */
  int32_t shared_inter; /* Is: intermediate size of the shared expert; 0 = no shared expert */
  int32_t norm_topk;    /* 1: renormalise the K weights to sum 1 (Qwen3-Next); 0: raw probabilities */
} upf_moe_config;

/* Qwen3-Next-80B-A3B: H=2048, E=512, K=10, I=512, Is=512, norm_topk=1. */
upf_moe_config upf_moe_config_qwen3_next(void);
upf_status upf_moe_config_check(const upf_moe_config *cfg);

/* All weights of one layer, contiguous, in one dtype (f32 or bf16), the dtype of x. Linear layers
 * keep the (out_features, in_features) layout of their checkpoints. Pointers live in the memory of
 * the backend they are passed to. */
typedef struct {
  upf_dtype dtype;
  const void *router;         /* (E, H) */
  const void *gate_up;        /* (E, 2I, H) rows [0, I) gate, [I, 2I) up */
  const void *down;           /* (E, H, I) */
  const void *shared_gate_up; /* (2Is, H) rows [0, Is) gate, [Is, 2Is) up; unused when Is == 0 */
  const void *shared_down;    /* (H, Is) */
  const void *shared_gate;    /* (H) the [H, 1] sigmoid gate of the shared expert's output */
} upf_moe_weights;

/* Routing of T tokens (backend memory). Rank order: descending logit, ties to the lower index. */
typedef struct {
  int32_t *topk_index; /* (T, K) expert of each (token, rank) */
  float *topk_weight;  /* (T, K) its weight (renormalised when norm_topk) */
  float *logits;       /* (T, E) router logits in fp32; may be NULL when not wanted */
} upf_moe_routing;

/* The (token, rank) pairs grouped by expert: pair p = t*K + k. A stable counting sort, so within
 * an expert the pairs keep ascending p (ascending token). Backend memory. */
typedef struct {
  int32_t *expert_count;  /* (E) pairs routed to each expert (0 for an expert no token chose) */
  int32_t *expert_offset; /* (E+1) exclusive prefix sum of expert_count; [E] = T*K */
  int32_t *sorted_pair;   /* (T*K) pair indices in expert-grouped order */
  int32_t *pair_row;      /* (T*K) inverse: position of pair p in sorted_pair */
} upf_moe_permutation;

/* Config, x (T, H) and out (T, H) descriptors and weight pointers, shared by all backends; reads no
 * data. x: f32 or bf16, rows contiguous (stride[1] == 1, stride[0] >= H); weights in x's dtype;
 * out (may be NULL for route-only callers): f32 or bf16, same rules. T*K must fit in int32.
 * Returns UPF_ERR_INVALID_ARG / UPF_ERR_SHAPE / UPF_ERR_DTYPE naming the input. */
upf_status upf_moe_validate(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                            const upf_tensor *out);

/* Useful FLOPs of one layer over T tokens (multiply-adds count 2): router 2THE, routed experts
 * 2TK(2IH + IH), shared expert 2T(2IsH + IsH) + 2TH for its gate. Elementwise work is not counted. */
double upf_moe_flops(const upf_moe_config *cfg, int64_t num_tokens);

/* Bytes of all weights of one layer in `dtype`. */
double upf_moe_weight_bytes(const upf_moe_config *cfg, upf_dtype dtype);

/* DRAM bytes of one layer over T tokens computed as separate passes, as the CUDA backend does
 * (cuda/moe.cu): every weight read once, x read by the router, the gather and the shared expert, and
 * each intermediate (logits, top-K, xp, h, a, y, the shared expert's hs, as, ys) written once and read
 * once; the sort's index arrays at 16 bytes a pair. Activations in `dtype` (logits, routing weights and
 * the shared gate in fp32), out in `out_dtype`. No padding rows, no cache reuse: a floor for that pass
 * structure, which time / (bytes / copy bandwidth) measures a run against. */
double upf_moe_unfused_traffic_bytes(const upf_moe_config *cfg, int64_t num_tokens, upf_dtype dtype,
                                     upf_dtype out_dtype);

#ifdef __cplusplus
}
#endif
#endif

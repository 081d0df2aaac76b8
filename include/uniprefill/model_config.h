/* Per-model constants of the three model families (SPEC.md section 6), copied from each model's
 * published Hugging Face config.json; the comment after each value names the config field it comes
 * from. Real shapes for benchmarks and verify cases, and the exact RoPE and norm parameters, are
 * built from these and nothing else.
 *   Llama-3.1-8B:        meta-llama/Llama-3.1-8B/config.json
 *   Gemma-3-12B:         google/gemma-3-12b-it/config.json, "text_config"
 *   Qwen3-Next-80B-A3B:  Qwen/Qwen3-Next-80B-A3B-Instruct/config.json */
#ifndef UNIPREFILL_MODEL_CONFIG_H
#define UNIPREFILL_MODEL_CONFIG_H

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Llama-3.1-8B ---- */
#define UPF_LLAMA31_8B_HIDDEN 4096            /* hidden_size */
#define UPF_LLAMA31_8B_INTERMEDIATE 14336     /* intermediate_size; hidden_act "silu" (SwiGLU) */
#define UPF_LLAMA31_8B_LAYERS 32              /* num_hidden_layers */
#define UPF_LLAMA31_8B_Q_HEADS 32             /* num_attention_heads */
#define UPF_LLAMA31_8B_KV_HEADS 8             /* num_key_value_heads */
#define UPF_LLAMA31_8B_HEAD_DIM 128           /* head_dim (= hidden_size / num_attention_heads) */
#define UPF_LLAMA31_8B_VOCAB 128256           /* vocab_size */
#define UPF_LLAMA31_8B_RMS_EPS 1e-5f          /* rms_norm_eps; weight multiplies (not 1 + w) */
#define UPF_LLAMA31_8B_ROPE_THETA 500000.0    /* rope_theta */
#define UPF_LLAMA31_8B_ROPE_FACTOR 8.0        /* rope_scaling.factor, rope_type "llama3" */
#define UPF_LLAMA31_8B_ROPE_LOW_FREQ 1.0      /* rope_scaling.low_freq_factor */
#define UPF_LLAMA31_8B_ROPE_HIGH_FREQ 4.0     /* rope_scaling.high_freq_factor */
#define UPF_LLAMA31_8B_ROPE_ORIG_MAX_POS 8192 /* rope_scaling.original_max_position_embeddings */

/* ---- Gemma-3-12B (text model) ---- */
#define UPF_GEMMA3_12B_HIDDEN 3840              /* hidden_size */
#define UPF_GEMMA3_12B_INTERMEDIATE 15360       /* intermediate_size; hidden_activation "gelu_pytorch_tanh" */
#define UPF_GEMMA3_12B_LAYERS 48                /* num_hidden_layers */
#define UPF_GEMMA3_12B_Q_HEADS 16               /* num_attention_heads */
#define UPF_GEMMA3_12B_KV_HEADS 8               /* num_key_value_heads */
#define UPF_GEMMA3_12B_HEAD_DIM 256             /* head_dim */
#define UPF_GEMMA3_12B_QUERY_PRE_ATTN_SCALAR 256 /* query_pre_attn_scalar: softmax scale 256^-1/2 */
#define UPF_GEMMA3_12B_VOCAB 262208             /* vocab_size */
#define UPF_GEMMA3_12B_SLIDING_WINDOW 1024      /* sliding_window */
#define UPF_GEMMA3_12B_RMS_EPS 1e-6f            /* rms_norm_eps; Gemma3RMSNorm is zero-centred: x/rms * (1 + w) */
#define UPF_GEMMA3_12B_ROPE_LOCAL_BASE 10000.0  /* rope_local_base_freq (sliding-window layers, no scaling) */
#define UPF_GEMMA3_12B_ROPE_GLOBAL_BASE 1000000.0 /* rope_theta (full-attention layers) */
#define UPF_GEMMA3_12B_ROPE_GLOBAL_FACTOR 8.0   /* rope_scaling.factor, rope_type "linear" (global layers) */
/* Gemma3TextScaledWordEmbedding multiplies embeddings by sqrt(hidden_size), cast to the weight dtype
 * first (bf16: 61.9677 -> 62.0); pass upf_round_bf16(UPF_GEMMA3_12B_EMBED_SCALE) for bf16 tables. */
#define UPF_GEMMA3_12B_EMBED_SCALE 61.967733539318672 /* sqrt(3840) */

/* ---- Qwen3-Next-80B-A3B ---- */
#define UPF_QWEN3N_80B_HIDDEN 2048               /* hidden_size */
#define UPF_QWEN3N_80B_LAYERS 48                 /* num_hidden_layers */
#define UPF_QWEN3N_80B_Q_HEADS 16                /* num_attention_heads */
#define UPF_QWEN3N_80B_KV_HEADS 2                /* num_key_value_heads */
#define UPF_QWEN3N_80B_HEAD_DIM 256              /* head_dim; q_proj emits 2*head_dim per head: query and output gate */
#define UPF_QWEN3N_80B_VOCAB 151936              /* vocab_size */
#define UPF_QWEN3N_80B_RMS_EPS 1e-6f             /* rms_norm_eps; Qwen3NextRMSNorm is zero-centred: x/rms * (1 + w) */
#define UPF_QWEN3N_80B_ROPE_THETA 10000000.0     /* rope_theta */
#define UPF_QWEN3N_80B_PARTIAL_ROTARY 0.25       /* partial_rotary_factor: rotary_dim = 0.25 * 256 = 64 */
#define UPF_QWEN3N_80B_ROTARY_DIM 64
#define UPF_QWEN3N_80B_FULL_ATTN_INTERVAL 4      /* full_attention_interval */
#define UPF_QWEN3N_80B_NUM_EXPERTS 512           /* num_experts */
#define UPF_QWEN3N_80B_EXPERTS_PER_TOK 10        /* num_experts_per_tok */
#define UPF_QWEN3N_80B_MOE_INTERMEDIATE 512      /* moe_intermediate_size */
#define UPF_QWEN3N_80B_SHARED_INTERMEDIATE 512   /* shared_expert_intermediate_size */
/* Gated DeltaNet (linear-attention) layers: the layers i with (i+1) % 4 != 0. */
#define UPF_QWEN3N_80B_LINEAR_KEY_HEADS 16       /* linear_num_key_heads */
#define UPF_QWEN3N_80B_LINEAR_VALUE_HEADS 32     /* linear_num_value_heads */
#define UPF_QWEN3N_80B_LINEAR_KEY_DIM 128        /* linear_key_head_dim; scan scale 1/sqrt(128) */
#define UPF_QWEN3N_80B_LINEAR_VALUE_DIM 128      /* linear_value_head_dim */
#define UPF_QWEN3N_80B_LINEAR_CONV_KERNEL 4      /* linear_conv_kernel_dim */
/* The gated norm (Qwen3NextRMSNormGated) is a plain RMSNorm, weight multiplies (not 1 + w), eps = rms_norm_eps. */
#define UPF_QWEN3N_80B_LINEAR_NORM_EPS 1e-6f     /* rms_norm_eps */
/* conv channels: q and k (key heads) then v (value heads) */
#define UPF_QWEN3N_80B_LINEAR_CONV_DIM \
  (2 * UPF_QWEN3N_80B_LINEAR_KEY_HEADS * UPF_QWEN3N_80B_LINEAR_KEY_DIM + \
   UPF_QWEN3N_80B_LINEAR_VALUE_HEADS * UPF_QWEN3N_80B_LINEAR_VALUE_DIM)

/* ---- Parameter builders ---- */

static inline upf_rope_params upf_llama31_8b_rope(void) {
  upf_rope_params p = {UPF_LLAMA31_8B_ROPE_THETA, 0, UPF_ROPE_LLAMA3, UPF_LLAMA31_8B_ROPE_FACTOR,
                       UPF_LLAMA31_8B_ROPE_LOW_FREQ, UPF_LLAMA31_8B_ROPE_HIGH_FREQ, UPF_LLAMA31_8B_ROPE_ORIG_MAX_POS};
  return p;
}
/* Sliding-window layers. */
static inline upf_rope_params upf_gemma3_12b_rope_local(void) {
  upf_rope_params p = {UPF_GEMMA3_12B_ROPE_LOCAL_BASE, 0, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0};
  return p;
}
/* Full-attention layers ((i+1) % 6 == 0). */
static inline upf_rope_params upf_gemma3_12b_rope_global(void) {
  upf_rope_params p = {UPF_GEMMA3_12B_ROPE_GLOBAL_BASE, 0, UPF_ROPE_LINEAR, UPF_GEMMA3_12B_ROPE_GLOBAL_FACTOR,
                       0.0, 0.0, 0};
  return p;
}
static inline upf_rope_params upf_qwen3n_80b_rope(void) {
  upf_rope_params p = {UPF_QWEN3N_80B_ROPE_THETA, UPF_QWEN3N_80B_ROTARY_DIM, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0};
  return p;
}

static inline upf_norm_params upf_llama31_8b_norm(void) {
  upf_norm_params p = {UPF_LLAMA31_8B_RMS_EPS, 0};
  return p;
}
/* Every Gemma-3 norm: input/post-attention/pre- and post-feedforward (sandwich), q/k, final. */
static inline upf_norm_params upf_gemma3_12b_norm(void) {
  upf_norm_params p = {UPF_GEMMA3_12B_RMS_EPS, 1};
  return p;
}
/* Qwen3-Next layer norms, q/k norms and the final norm. */
static inline upf_norm_params upf_qwen3n_80b_norm(void) {
  upf_norm_params p = {UPF_QWEN3N_80B_RMS_EPS, 1};
  return p;
}

#ifdef __cplusplus
}
#endif
#endif

/* The dense sub-layers whose cost per token UniPrefill removes when it drops tokens: projections
 * (GEMM), the gated FFN (SwiGLU, GeGLU with tanh GELU), RMSNorm in its plain, zero-centred, per-head
 * and fused add-residual forms, RoPE at arbitrary positions, the gated attention output, embedding
 * lookup and the last-token logits. Parameter types and the shape checks every backend shares; the
 * entries themselves are in the backend ops table (uniprefill/backend.h).
 *
 * Numerics shared by every backend: math in fp32 or better, every output rounded once to its dtype
 * (round to nearest even). Where an op has an intermediate tensor (the FFN's gate/up projection and
 * activation, the normalised last rows before the LM head) it is stored in the input dtype, as the
 * frameworks do, and both backends round it the same way. */
#ifndef UNIPREFILL_DENSE_H
#define UNIPREFILL_DENSE_H

#include <stdint.h>

#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Activation of the gated FFN: h = act(gate) * up. */
typedef enum {
  UPF_ACT_SILU = 0,  /* SwiGLU: silu(x) = x * sigmoid(x) (Llama-3.1, Qwen3-Next) */
  UPF_ACT_GELU_TANH, /* GeGLU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma-3 gelu_pytorch_tanh) */
  UPF_ACT_COUNT
} upf_act;

const char *upf_act_name(upf_act act); /* "silu", "gelu_tanh" */

/* RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, or * (1 + w) when zero_centred (Gemma-3, Qwen3-Next:
 * the weight is stored as an offset from 1). The mean is over the last dim. */
typedef struct {
  float eps;
  int zero_centred;
} upf_norm_params;

upf_status upf_norm_params_check(const upf_norm_params *p);

/* RoPE frequency scaling (the HF `rope_scaling.rope_type` values). */
typedef enum {
  UPF_ROPE_DEFAULT = 0, /* inv_freq[i] = theta^(-2i/rotary_dim) */
  UPF_ROPE_LINEAR,      /* inv_freq / factor (Gemma-3 global layers, factor 8) */
  UPF_ROPE_LLAMA3,      /* Llama-3.1: long wavelengths / factor, short kept, smooth in between */
  UPF_ROPE_SCALING_COUNT
} upf_rope_scaling;

/* Rotary embedding, neox (rotate-half) layout: within the first rotary_dim dims of a head, dim i
 * pairs with dim i + rotary_dim/2 and both turn by angle position * inv_freq[i]; dims at and after
 * rotary_dim pass through (Qwen3-Next partial rotary: 25% of 256 = 64). */
typedef struct {
  double theta;                /* base (rope_theta) */
  int32_t rotary_dim;          /* even, <= head dim; 0 means the whole head */
  upf_rope_scaling scaling;
  double factor;               /* LINEAR, LLAMA3 */
  double low_freq_factor;      /* LLAMA3 */
  double high_freq_factor;     /* LLAMA3 */
  int32_t original_max_position; /* LLAMA3: original_max_position_embeddings */
} upf_rope_params;

/* Range checks (theta > 0, rotary_dim even and <= head_dim, scaling factors), UPF_ERR_INVALID_ARG. */
upf_status upf_rope_params_check(const upf_rope_params *p, int64_t head_dim);
/* rotary_dim in effect for a head of head_dim. */
int32_t upf_rope_rotary_dim(const upf_rope_params *p, int64_t head_dim);
/* inv_freq (rotary_dim/2), in double, exactly as HF computes it (the llama3 rule included). Both
 * backends use these values; the angle position * inv_freq[i] and its sine and cosine are taken in
 * double, so large positions (128K and beyond) lose nothing to fp32 argument rounding. */
void upf_rope_inv_freq(const upf_rope_params *p, int32_t rotary_dim, double *inv_freq);

/* ---- Shape checks shared by the backends (descriptors only; messages name op and operand) ---- */

/* t is f32 or bf16 with `ndim` dims; want[i] >= 0 pins extent i (-1: any); the last dim is
 * contiguous and the outer strides do not overlap rows (stride[i] >= shape[i+1] * stride[i+1]). */
upf_status upf_dense_check(const upf_tensor *t, const char *op, const char *name, int ndim, const int64_t *want);
/* UPF_ERR_DTYPE unless b has a's dtype. */
upf_status upf_dense_same_dtype(const upf_tensor *a, const upf_tensor *b, const char *op, const char *an,
                                const char *bn);

/* The shape rules of each op (what its backend entry in backend.h documents), shared so that the CPU
 * reference and CUDA reject the same inputs with the same status. */
upf_status upf_gemm_check(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c);
upf_status upf_gated_act_check(const upf_tensor *gate_up, upf_act act, const upf_tensor *h);
upf_status upf_ffn_check(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                         const upf_tensor *y);
upf_status upf_rmsnorm_check(const char *op, const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                             const upf_norm_params *p, const upf_tensor *y);
upf_status upf_qk_norm_check(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y);
upf_status upf_rope_check(const upf_tensor *q, const upf_tensor *k, const int32_t *positions,
                          const upf_rope_params *p);
upf_status upf_gated_output_check(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y);
upf_status upf_embed_check(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                           const upf_tensor *y);
upf_status upf_logits_last_check(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                                 const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                                 const upf_tensor *logits);

/* logits.rows: which rows of the final hidden state go through the final norm and the LM head, and
 * what comes back of each. The logits are those of logits.last in f32 (the normed row rounded to the
 * hidden dtype, fp32 GEMM accumulation); every reduction over a row is in double. Host index arrays. */
typedef struct {
  const int32_t *rows_host;    /* (R) row of hidden for each output row */
  int64_t num_rows;            /* R >= 0 */
  const int32_t *targets_host; /* (R) token whose logit is wanted, in [0, V) or -1 (none); NULL: none */
  const int32_t *full_host;    /* (F) output rows (indices into [0, R)) whose whole logits are wanted */
  int64_t num_full;            /* F >= 0 */
} upf_logits_rows_sel;

/* Outputs in the backend's memory. */
typedef struct {
  int32_t *argmax; /* (R) the id of the largest logit, the lowest such id on ties */
  double *lse;     /* (R) log-sum-exp of the row's logits (natural log); log-softmax(x)_i = x_i - lse */
  double *target;  /* (R) the target's logit (NaN where the target is -1); NULL when targets_host is NULL */
  float *full;     /* (F, V) the logits of the rows of full_host; NULL when F = 0 */
} upf_logits_rows_out;

upf_status upf_logits_rows_check(const upf_tensor *hidden, const upf_logits_rows_sel *sel, const upf_tensor *norm_w,
                                 const upf_norm_params *p, const upf_tensor *w_lm, const upf_logits_rows_out *out);

#ifdef __cplusplus
}
#endif
#endif

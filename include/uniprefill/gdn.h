/* Gated DeltaNet, the linear-attention layer of Qwen3-Next, as separately verifiable ops: the causal
 * depthwise conv1d with SiLU over the q/k/v channels (varlen prefill and the one-token decode step,
 * with a conv state carried between steps), the gated delta-rule scan (per-head L2 norm of q and k,
 * beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the recurrence with key heads shared
 * across value heads, per-request initial and final fp32 states), and the gated RMSNorm
 * norm(o) * silu(z). The input and output projections are the `gemm` op. Parameter types and the
 * shape checks every backend shares; the entries are in the backend ops table (backend.h).
 *
 * Numerics shared by every backend: math in fp32 or better, every output rounded once to its dtype;
 * states are fp32. The CPU reference accumulates in double (the scan's state update included). */
#ifndef UNIPREFILL_GDN_H
#define UNIPREFILL_GDN_H

#include <math.h>
#include <stdint.h>

#include "uniprefill/dense.h"

#ifdef __cplusplus
extern "C" {
#endif

/* eps of the per-head L2 norm of q and k: x * rsqrt(sum x^2 + eps), as FLA's l2norm and HF's
 * torch_chunk_gated_delta_rule (use_qk_l2norm_in_kernel=True) take it. */
#define UPF_GDN_L2_EPS 1e-6f

/* A varlen batch. cu_seqlens lives in the memory of the backend it is passed to; cu_seqlens_host is
 * the host copy every backend reads to validate and plan its launches. */
typedef struct {
  const int32_t *cu_seqlens;      /* (B+1) backend memory */
  const int32_t *cu_seqlens_host; /* (B+1) host copy of the same values */
  int32_t num_reqs;               /* B */
} upf_gdn_batch;

/* Inputs of the delta-rule scan. Tensors are f32 or bf16 (q, k, v, a, b share a dtype), last dim
 * contiguous, any outer strides (views into the conv output and the projection outputs are fine).
 * Value head h reads key head h / (Hv / Hk) (repeat_interleave, as GQA). */
typedef struct {
  const upf_tensor *q;        /* (T, Hk, Dk) after the conv; L2-normalised by the op */
  const upf_tensor *k;        /* (T, Hk, Dk) after the conv; L2-normalised by the op */
  const upf_tensor *v;        /* (T, Hv, Dv) after the conv */
  const upf_tensor *a;        /* (T, Hv) decay input: g = -exp(A_log) * softplus(a + dt_bias) */
  const upf_tensor *b;        /* (T, Hv) write strength input: beta = sigmoid(b) */
  const upf_tensor *a_log;    /* (Hv) f32 */
  const upf_tensor *dt_bias;  /* (Hv) f32 */
  const upf_tensor *state_in; /* (B, Hv, Dk, Dv) f32, or NULL: every request starts from S = 0 */
  float scale;                /* o = scale * S^T q; Qwen3-Next: 1/sqrt(Dk) */
} upf_gdn_scan_inputs;

/* ---- the math both backends share (double) ---- */

static inline double upf_gdn_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); } /* torch threshold 20 */
static inline double upf_gdn_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static inline double upf_gdn_silu(double x) { return x / (1.0 + exp(-x)); }

/* ---- shape checks (descriptors and cu_seqlens_host only; messages name op and operand) ---- */

/* x (T, C), w (C, K) in x's dtype, K >= 2; state_in / state_out (B, K-1, C) f32 or NULL, not the same
 * memory (the prefill reads every initial state while it writes final ones); y (T, C) in x's dtype. */
upf_status upf_gdn_conv_check(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                              const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y);
/* x (B, C) one token per request, w (C, K), state (B, K-1, C) f32 read and updated in place, y (B, C). */
upf_status upf_gdn_conv_step_check(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state,
                                   const upf_tensor *y);
/* The scan's inputs (see upf_gdn_scan_inputs), o (T, Hv, Dv) f32 or v's dtype, state_out (B, Hv, Dk, Dv)
 * f32 or NULL; state_out may be in->state_in itself (decode updates in place). Hv % Hk == 0. */
upf_status upf_gdn_scan_check(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                              const upf_tensor *state_out);
/* o (T, H, D), z (T, H, D), w (D), y (T, H, D), one dtype; y may be o. */
upf_status upf_gdn_gated_norm_check(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w,
                                    const upf_norm_params *p, const upf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif

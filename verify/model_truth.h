/* The fp64 truth of a prefill (verify/model_truth.c): an independent naive forward pass that masks
 * dropped tokens instead of compacting them. */
#ifndef UNIPREFILL_VERIFY_MODEL_TRUTH_H
#define UNIPREFILL_VERIFY_MODEL_TRUTH_H

#include "uniprefill/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Masking rules a pass can break on purpose, for negative controls: the compacted path must not match
 * a pass that breaks a rule the data exercises. */
enum {
  UPF_TRUTH_WINDOW_BY_POSITION = 1, /* sliding windows count positions, not alive keys */
  UPF_TRUTH_CONV_ZERO_HOLE = 2,     /* the GDN conv reads a dead token as zero instead of skipping it */
};

/* logits (B, V), double: the last token of each request of the step (ids (T), cu (B+1), host) through
 * m, a whole model of f32 weights on the CPU backend. uni: the drops to apply (a UniPrefill run's
 * records; NULL: dense). broken: UPF_TRUTH_* flags of a negative control (0: the truth). Returns 0 when
 * a drop record does not fit the alive tokens or memory runs out. */
int upf_model_truth(const upf_model *m, const int32_t *ids, const int32_t *cu, int32_t B,
                    const upf_prefill_result *uni, int broken, double *logits);

/* The causal conv1d + SiLU of channels [0, C) over the alive tokens of [begin, end): each token's
 * window is the previous K-1 alive tokens of its request (the compacted order, as if contiguous).
 * x rows ld apart; w (C, K) oldest tap first; dead tokens' outputs untouched. */
void upf_truth_conv_alive(const double *x, int64_t ld, const uint8_t *alive, int64_t begin, int64_t end, const float *w,
                          int64_t C, int64_t K, int zero_hole, double *y);

#ifdef __cplusplus
}
#endif
#endif

/* Checks of the MoE ops shared by verify and the CUnit suites: routing agreement under the marginal
 * rule, permutation invariants, an independent per-token evaluation of the layer (plain loops, no
 * BLAS, no permutation) that the CPU reference is checked against, and hand-computed golden cases. */
#ifndef UNIPREFILL_VERIFY_MOE_CHECKS_H
#define UNIPREFILL_VERIFY_MOE_CHECKS_H

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/moe.h"
#include "verify/compare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Relative closeness under which two router probabilities may be decided either way: 1e-5 for f32
 * inputs, 1e-3 for bf16 (SPEC section 2's tau). */
double upf_moe_tau(upf_dtype input_dtype);

/* Compares got_index (T, K) with the reference routing ref_index (T, K) chosen from ref_logits
 * (T, E, double). Per token: the same set of experts agrees; a different set passes only when it is
 * marginal, i.e. the largest reference probability among the experts the reference chose and got did
 * not exceeds the smallest among those got chose instead by at most tau relative. Within a token the
 * order must descend in reference probability (ties within tau allowed). agree (T, may be NULL)
 * receives 1 for tokens whose sets agree. detail counts marginal tokens and tie-order differences. */
void upf_moe_compare_routing(const upf_moe_config *cfg, int64_t num_tokens, const double *ref_logits,
                             const int32_t *ref_index, const int32_t *got_index, double tau, uint8_t *agree,
                             upf_check *check);

/* Checks a permutation of topk_index (T, K) against its definition (counts, exclusive offsets,
 * grouping by expert, ascending pairs within an expert, pair_row the inverse of sorted_pair). Host. */
void upf_moe_check_permutation(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                               const upf_moe_permutation *perm, upf_check *check);

/* The layer token by token in plain double loops (host): logits (T, E), routing by insertion sort,
 * each chosen expert and the shared expert evaluated directly, intermediates rounded where moe.h
 * says they are stored. Any output may be NULL. */
void upf_moe_naive(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *logits,
                   int32_t *topk_index, double *topk_weight, double *out);

/* Golden cases worked out by hand (closed forms in the comments of moe_checks.c), run on `be`. */
typedef enum {
  UPF_MOE_GOLDEN_ROUTE = 0,   /* logits, a tie broken to the lower index, renormalised weights */
  UPF_MOE_GOLDEN_PERMUTE,     /* the golden routing's permutation */
  UPF_MOE_GOLDEN_PERMUTE_SKEW,/* an expert with no pair and one that every token chose */
  UPF_MOE_GOLDEN_FFN,         /* the whole layer with the shared expert */
  UPF_MOE_GOLDEN_COUNT
} upf_moe_golden;

const char *upf_moe_golden_name(upf_moe_golden golden);
/* Fills check (op, variant, dtype, shape, result). */
void upf_moe_golden_run(const upf_backend *be, upf_moe_golden golden, upf_dtype dtype, upf_check *check);

#ifdef __cplusplus
}
#endif
#endif

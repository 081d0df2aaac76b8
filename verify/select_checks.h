/* Checks on selection outputs shared by verify and the CUnit tests: the invariants every correct
 * selection satisfies, the marginal-decision rule of SPEC section 2, and hand-computed golden cases. */
#ifndef UNIPREFILL_VERIFY_SELECT_CHECKS_H
#define UNIPREFILL_VERIFY_SELECT_CHECKS_H

#include "uniprefill/backend.h"
#include "verify/compare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* tau of SPEC section 2: 1e-5 for fp32 inputs, 1e-3 for bf16. */
double upf_select_tau(upf_dtype input_dtype);

/* Invariants of one selection's host outputs, judged with its own block scores (num_blocks):
 * unscored rows keep every token; sink and last L always kept; top-p kept mass >= p - tau and
 * minimal (the kept blocks are a prefix of the ranking and without the lowest-ranked one the mass is
 * <= p + tau); top-k keeps min(K, nb); token mask = expansion of the block mask; kept_index,
 * kept_count, new_cu_seqlens and kept_total consistent with the token mask. */
void upf_select_check_invariants(const upf_select_inputs *in, const upf_select_params *params,
                                 const upf_select_outputs *out, const float *block_score, double tau,
                                 upf_check *check);

/* Compares block decisions `got` with the reference decisions `ref` (num_blocks), made from the
 * double block scores ref_score. A differing block passes only if it is marginal. detail counts
 * the marginal differences. */
void upf_select_compare_decisions(const upf_select_inputs *in, const upf_select_params *params,
                                  const double *ref_score, const uint8_t *ref, const uint8_t *got, double tau,
                                  upf_check *check);

/* Token masks equal except on tokens of blocks that differ marginally (block_ok[c] = 1 when the
 * decisions agree or the difference is marginal, as computed by upf_select_compare_decisions). */
void upf_select_compare_token_masks(const upf_select_inputs *in, const upf_select_params *params,
                                    const uint8_t *ref_block, const uint8_t *got_block, const uint8_t *ref_mask,
                                    const uint8_t *got_mask, upf_check *check);

/* Hand-computed golden cases for each stage, run through `backend` (pointers handled inside).
 * Each fills `check` (op/variant set) and returns nothing; a failure says what differed. */
typedef enum {
  UPF_GOLDEN_PART_GEMM = 0,
  UPF_GOLDEN_BLOCK_SOFTMAX,
  UPF_GOLDEN_BLOCK_REDUCE,
  UPF_GOLDEN_TOPP,
  UPF_GOLDEN_TOPP_TIES,
  UPF_GOLDEN_TOPP_BOUNDARY,
  UPF_GOLDEN_TOPK,
  UPF_GOLDEN_EXPAND,
  UPF_GOLDEN_PIPELINE,
  UPF_GOLDEN_COMPACT,
  UPF_GOLDEN_COUNT
} upf_golden;

const char *upf_golden_name(upf_golden golden);
void upf_select_golden_run(const upf_backend *backend, upf_golden golden, upf_check *check);

#ifdef __cplusplus
}
#endif
#endif

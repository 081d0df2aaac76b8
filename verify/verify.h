/* The verify harness: runs every op of the op table on a backend under test against the CPU
 * reference (or, when the backend under test is the CPU, the reference against its invariants,
 * hand-computed golden cases and its own stage chain). One line per check; never stops early. */
#ifndef UNIPREFILL_VERIFY_H
#define UNIPREFILL_VERIFY_H

#include <stdio.h>

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/ops.h"
#include "verify/compare.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const upf_backend *backend; /* under test */
  FILE *log;                  /* one line per check */
  int quick;                  /* smaller shape set (valgrind, CI) */
  int passed, failed;
} upf_verify_ctx;

/* Records and prints one check. */
void upf_verify_record(upf_verify_ctx *ctx, const upf_check *check);

/* Records one bad-input check: passes iff the call returned `want` (variant "error: <what>"). */
void upf_verify_expect_status(upf_verify_ctx *ctx, const char *op, const char *what, upf_status got,
                              upf_status want);

/* Whether ctx checks the CPU reference itself (its golden cases and invariants) rather than a backend
 * under test against it. */
int upf_verify_on_reference(const upf_verify_ctx *ctx);

/* Whether a seeded case runs: only against a backend under test (the CPU is its reference), and in a
 * quick run only if the case is in the quick set. */
int upf_verify_case_wanted(const upf_verify_ctx *ctx, int in_quick_set);

/* The RNG seed of a seeded case: FNV-1a of the op name, mixed with the case index and a variant
 * number (a dtype, or a code of the case's shape). Frozen: a change gives every case new inputs. */
uint64_t upf_verify_case_seed(const char *op, int index, uint64_t variant);

/* Per-op verify entry: runs all of the op's cases. */
typedef void (*upf_verify_fn)(upf_verify_ctx *ctx);

/* The registry, indexed by op (see verify/verify.c). */
upf_verify_fn upf_verify_fn_for(upf_op op);

/* Runs the ops whose name starts with `filter` ("select", "all" or NULL for every op). Returns the
 * number of failed checks. */
int upf_verify_run(upf_verify_ctx *ctx, const char *filter);

/* Op entries (verify/verify_select.c). */
void upf_verify_select_part_gemm(upf_verify_ctx *ctx);
void upf_verify_select_block_softmax(upf_verify_ctx *ctx);
void upf_verify_select_block_reduce(upf_verify_ctx *ctx);
void upf_verify_select_topp(upf_verify_ctx *ctx);
void upf_verify_select_expand(upf_verify_ctx *ctx);
void upf_verify_select_pipeline(upf_verify_ctx *ctx);
void upf_verify_compact_rows(upf_verify_ctx *ctx);
/* Op entries of the dense sub-layers (verify/verify_dense.c). */
void upf_verify_gemm(upf_verify_ctx *ctx);
void upf_verify_ffn_act_mul(upf_verify_ctx *ctx);
void upf_verify_ffn_gated(upf_verify_ctx *ctx);
void upf_verify_rmsnorm(upf_verify_ctx *ctx);
void upf_verify_rmsnorm_add(upf_verify_ctx *ctx);
void upf_verify_qk_norm(upf_verify_ctx *ctx);
void upf_verify_rope(upf_verify_ctx *ctx);
void upf_verify_gated_output(upf_verify_ctx *ctx);
void upf_verify_embed(upf_verify_ctx *ctx);
void upf_verify_logits_last(upf_verify_ctx *ctx);
/* Op entries of the MoE FFN (verify/verify_moe.c). */
void upf_verify_moe_route(upf_verify_ctx *ctx);
void upf_verify_moe_permute(upf_verify_ctx *ctx);
void upf_verify_moe_ffn(upf_verify_ctx *ctx);
/* Op entries of the Gated DeltaNet (verify/verify_gdn.c). */
void upf_verify_gdn_conv(upf_verify_ctx *ctx);
void upf_verify_gdn_conv_step(upf_verify_ctx *ctx);
void upf_verify_gdn_scan(upf_verify_ctx *ctx);
void upf_verify_gdn_gated_norm(upf_verify_ctx *ctx);
/* Op entries of the attention layers (verify/verify_attn.c). */
void upf_verify_attn_prefill(upf_verify_ctx *ctx);
void upf_verify_attn_paged(upf_verify_ctx *ctx);
void upf_verify_kv_cache_write(upf_verify_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif

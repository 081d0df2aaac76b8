/* The verify harness: runs every op of the op table on a backend under test against the CPU
 * reference (or, when the backend under test is the CPU, the reference against its invariants,
 * hand-computed golden cases and its own stage chain). One line per check; never stops early. */
#ifndef UNIPREFILL_VERIFY_H
#define UNIPREFILL_VERIFY_H

#include <stdio.h>

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/ops.h"
#include "uniprefill/variant.h"
#include "verify/compare.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const upf_backend *backend; /* under test */
  FILE *log;                  /* one line per check */
  int quick;                  /* smaller shape set (valgrind, CI) */
  const char *case_filter;    /* non-NULL: only the seeded cases whose name holds it (upf verify --case) */
  /* 0: upf_verify_run runs an op's checks once per kernel variant (uniprefill/variant.h) on a backend
   * under test; 1: once, with the variant in effect (upf_variant_select, UPF_VARIANT or the default). */
  int variant_in_effect_only;
  /* Set by upf_verify_run while it iterates an op's variants: the variant whose checks run, named at
   * the head of each line's variant column ("fa2/causal ..."). NULL otherwise. */
  const char *kernel_variant;
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

/* Whether a seeded case runs: only against a backend under test (the CPU is its reference), in a quick
 * run only if the case is in the quick set, and under a case filter only if its name (NULL: a nameless
 * seeded set) holds the filter. */
int upf_verify_case_wanted(const upf_verify_ctx *ctx, const char *name, int in_quick_set);

/* The RNG seed of a seeded case: FNV-1a of the op name, mixed with the case index and a variant
 * number (a dtype, or a code of the case's shape). Frozen: a change gives every case new inputs. */
uint64_t upf_verify_case_seed(const char *op, int index, uint64_t variant);

/* Per-op verify entry: runs all of the op's cases. */
typedef void (*upf_verify_fn)(upf_verify_ctx *ctx);

/* The registry, indexed by op (see verify/verify.c). */
upf_verify_fn upf_verify_fn_for(upf_op op);

/* Whether `filter` ("all", an op or check name, or a prefix of one) names anything to verify. */
int upf_verify_filter_known(const char *filter);

/* Runs the ops (then the end-to-end checks, model.prefill) whose name starts with `filter` ("select",
 * "model", "all" or NULL for all). On a backend
 * under test, an op with kernel variants runs once per variant (selected before, reset after) unless
 * ctx->variant_in_effect_only; on the reference there is one kernel. Returns the number of failed
 * checks. */
int upf_verify_run(upf_verify_ctx *ctx, const char *filter);

/* Op entries: upf_verify_<entry> for each op of ops.def (entry: its backend-table entry), in the
 * verify_<family>.c files. */
#define UPF_OP(id, name, summary, entry, params) void upf_verify_##entry(upf_verify_ctx *ctx);
#include "uniprefill/ops.def"
#undef UPF_OP

#ifdef __cplusplus
}
#endif
#endif

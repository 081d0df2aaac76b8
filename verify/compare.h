/* The verification contract of SPEC.md section 7: tolerances per input dtype, the float comparison
 * (NaN/Inf first, then NMSE and the scaled max error), guard bytes after every output buffer, and
 * the one-line report each check prints. */
#ifndef UNIPREFILL_VERIFY_COMPARE_H
#define UNIPREFILL_VERIFY_COMPARE_H

#include <stdint.h>
#include <stdio.h>

#include "uniprefill/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  double rtol, atol, nmse_max;
} upf_tolerance;

/* SPEC table: f32 inputs 1e-5/1e-5/1e-7, bf16 inputs 1.6e-2/1e-2/5e-4. */
upf_tolerance upf_tolerance_for(upf_dtype input_dtype);

/* An attention that rounds P to E4M3 (attn.block_sparse's fp8 variant), against the reference on the same
 * E4M3-grid inputs: each p off by at most 2^-4 relative (3 mantissa bits), so an output moves by at most
 * 2^-4 of its spread of values, in practice much less (the errors of many keys average out); rtol 2^-4,
 * atol 2^-3 for values of spread ~2, NMSE 2e-3 (a mislaid key or dim shows at 1e-1 and above). */
upf_tolerance upf_tolerance_fp8_attention(void);

typedef struct {
  char op[48];
  char variant[64];
  char dtype[8];
  char shape[96];
  double nmse;
  double max_abs_err; /* max |a - r| */
  double budget;      /* max |a-r| / (atol + rtol |r|): share of the budget used, must be <= 1 */
  int passed;
  char detail[256]; /* why it failed, or extra facts ("12 marginal blocks") */
} upf_check;

/* Compares got (n) against ref (n, higher precision). Fills nmse, max_abs_err, budget, passed
 * and detail; does not touch op/variant/dtype/shape. */
void upf_compare_f32(const float *got, const double *ref, int64_t n, upf_tolerance tol, upf_check *check);

/* SPEC 7's NaN/Inf rule for element i against its reference: 0 when both are finite (their values
 * are compared), else 1; a breach (NaN on either side, or an Inf the reference does not have) at the
 * first such i sets *first_bad = i and *fault to its name ("NaN in result", "NaN in <reference>",
 * "Inf where the <reference> differs", the reference named "truth" when ref_is_truth). */
int upf_compare_nonfinite(double got, double ref, int ref_is_truth, int64_t i, int64_t *first_bad,
                          const char **fault);

/* Exact comparison of byte/int arrays; detail names the first mismatch. */
void upf_compare_exact(const void *got, const void *ref, int64_t n, size_t elem_size, upf_check *check);

/* Prints "PASS|FAIL op variant dtype shape nmse=.. max_err=.. budget=..% detail". */
void upf_check_print(FILE *out, const upf_check *check);

/* A backend buffer of `bytes` followed by UPF_GUARD_BYTES of a known pattern, poisoned with 0xFF
 * (NaN for floats) before use so that an element the kernel forgot stands out. */
#define UPF_GUARD_BYTES 256
typedef struct {
  const upf_backend *backend;
  void *ptr;
  size_t bytes;
} upf_guarded;

upf_status upf_guarded_alloc(const upf_backend *backend, size_t bytes, upf_guarded *buf);
/* UPF_OK if the guard region is intact; otherwise a message with the first changed offset. */
upf_status upf_guarded_check(const upf_guarded *buf, const char *name);
void upf_guarded_free(upf_guarded *buf);

#ifdef __cplusplus
}
#endif
#endif

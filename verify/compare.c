/* Implementation of the SPEC section 7 comparison, guard bytes and check lines. */
#include "verify/compare.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GUARD_PATTERN 0xA5

upf_tolerance upf_tolerance_for(upf_dtype input_dtype) {
  if (input_dtype == UPF_DTYPE_BF16)
    return (upf_tolerance){.rtol = 1.6e-2, .atol = 1e-2, .nmse_max = 5e-4};
  return (upf_tolerance){.rtol = 1e-5, .atol = 1e-5, .nmse_max = 1e-7};
}

upf_tolerance upf_tolerance_fp8_attention(void) {
  return (upf_tolerance){.rtol = 6.25e-2, .atol = 1.25e-1, .nmse_max = 2e-3};
}

int upf_compare_nonfinite(double got, double ref, int ref_is_truth, int64_t i, int64_t *first_bad,
                          const char **fault) {
  const char *what = NULL;
  if (isnan(got) || isnan(ref))
    what = isnan(got) ? "NaN in result" : ref_is_truth ? "NaN in truth" : "NaN in reference";
  else if (isinf(got) || isinf(ref))
    what = got == ref ? NULL : ref_is_truth ? "Inf where the truth differs" : "Inf where the reference differs";
  else
    return 0;
  if (what && *first_bad < 0)
    *first_bad = i, *fault = what;
  return 1;
}

void upf_compare_f32(const float *got, const double *ref, int64_t n, upf_tolerance tol, upf_check *check) {
  double err2 = 0.0, ref2 = 0.0, max_abs = 0.0, budget = 0.0;
  int64_t worst = -1, first_bad = -1;
  const char *bad_kind = NULL;
  for (int64_t i = 0; i < n; i++) {
    double a = got[i], r = ref[i];
    if (upf_compare_nonfinite(a, r, 0, i, &first_bad, &bad_kind))
      continue;
    double e = fabs(a - r);
    err2 += e * e;
    ref2 += r * r;
    double ratio = e / (tol.atol + tol.rtol * fabs(r));
    if (e > max_abs)
      max_abs = e;
    if (ratio > budget)
      budget = ratio, worst = i;
  }
  check->nmse = ref2 > 0.0 ? err2 / ref2 : err2;
  check->max_abs_err = max_abs;
  check->budget = budget;
  check->detail[0] = '\0';
  if (first_bad >= 0) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "%s at %lld (got %g, ref %g)", bad_kind, (long long)first_bad,
             (double)got[first_bad], ref[first_bad]);
  } else if (check->nmse > tol.nmse_max) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "nmse %.3g > %.3g", check->nmse, tol.nmse_max);
  } else if (budget > 1.0) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "worst at %lld: got %.9g ref %.9g", (long long)worst,
             (double)got[worst], ref[worst]);
  } else {
    check->passed = 1;
  }
}

void upf_compare_exact(const void *got, const void *ref, int64_t n, size_t elem_size, upf_check *check) {
  const unsigned char *a = got, *r = ref;
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < n; i++) {
    if (memcmp(a + i * elem_size, r + i * elem_size, elem_size) != 0) {
      if (first < 0)
        first = i;
      mismatches++;
    }
  }
  check->nmse = 0.0;
  check->max_abs_err = (double)mismatches;
  check->budget = mismatches ? INFINITY : 0.0;
  check->passed = mismatches == 0;
  if (mismatches)
    snprintf(check->detail, sizeof check->detail, "%lld of %lld elements differ, first at %lld", (long long)mismatches,
             (long long)n, (long long)first);
  else
    check->detail[0] = '\0';
}

void upf_check_print(FILE *out, const upf_check *c) {
  fprintf(out, "%s %-22s %-34s %-5s %-28s nmse=%-9.2e max_err=%-9.2e budget=%6.1f%%%s%s\n",
          c->passed ? "PASS" : "FAIL", c->op, c->variant, c->dtype, c->shape, c->nmse, c->max_abs_err,
          100.0 * (isfinite(c->budget) ? c->budget : 999.9), c->detail[0] ? "  " : "", c->detail);
}

upf_status upf_guarded_alloc(const upf_backend *backend, size_t bytes, upf_guarded *buf) {
  buf->backend = backend;
  buf->bytes = bytes;
  buf->ptr = NULL;
  UPF_TRY(backend->alloc(&buf->ptr, bytes + UPF_GUARD_BYTES));
  upf_status st = backend->fill(buf->ptr, 0xFF, bytes);
  if (st == UPF_OK)
    st = backend->fill((char *)buf->ptr + bytes, GUARD_PATTERN, UPF_GUARD_BYTES);
  if (st != UPF_OK)
    upf_guarded_free(buf);
  return st;
}

upf_status upf_guarded_check(const upf_guarded *buf, const char *name) {
  unsigned char guard[UPF_GUARD_BYTES];
  UPF_TRY(buf->backend->download(guard, (const char *)buf->ptr + buf->bytes, UPF_GUARD_BYTES));
  for (int i = 0; i < UPF_GUARD_BYTES; i++)
    if (guard[i] != GUARD_PATTERN)
      return upf_fail(UPF_ERR_INVALID_ARG, "%s: guard byte %d after the %zu-byte buffer was overwritten (0x%02x)", name,
                      i, buf->bytes, guard[i]);
  return UPF_OK;
}

void upf_guarded_free(upf_guarded *buf) {
  if (buf->ptr)
    buf->backend->release(buf->ptr);
  buf->ptr = NULL;
}

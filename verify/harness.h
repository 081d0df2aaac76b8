/* The verify harness every op family uses: the long-reduction rule of SPEC section 7, and a runner
 * that runs one op on the CPU reference and on a backend under test from the same seeded inputs and
 * compares them. Inputs and outputs live in
 * "parent" buffers that the op sees through views (a q view inside a fused qkv buffer, a gate inside
 * a q_proj output), so the harness also checks that every parent element outside the compared
 * regions comes back bit-for-bit untouched, besides NaN/Inf, NMSE, the scaled max error and the
 * guard bytes after every buffer. */
#ifndef UNIPREFILL_VERIFY_HARNESS_H
#define UNIPREFILL_VERIFY_HARNESS_H

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/rng.h"
#include "verify/compare.h"
#include "verify/verify.h"

#ifdef __cplusplus
extern "C" {
#endif

/* SPEC 7 long reductions: passes iff no NaN, Inf only where the truth has the same Inf, and
 * max|got - truth| <= 2 * max|baseline - truth| + atol, where baseline is the same-dtype CPU
 * reference. budget = max|got - truth| / (2 * max|baseline - truth| + atol); nmse against truth. */
void upf_compare_long_reduction(const float *got, const float *baseline, const double *truth, int64_t n,
                                upf_tolerance tol, upf_check *check);

#define UPF_DBUF_VIEWS 2
#define UPF_DCASE_BUFS 8

/* One parent buffer of a case and the views an op sees of it. */
typedef struct {
  const char *name;
  upf_dtype dtype;
  int64_t numel;                     /* parent elements */
  void *host;                        /* (numel) host: the inputs as generated (outputs: poison) */
  int output;                        /* the op writes through this buffer's views */
  int nviews;
  upf_tensor view[UPF_DBUF_VIEWS];   /* descriptors relative to the parent; data unused */
  int64_t offset[UPF_DBUF_VIEWS];    /* element offset of each view in the parent */
  upf_tensor cmp[UPF_DBUF_VIEWS];    /* region compared (same offset); ndim 0: the whole view */
  const char *view_name[UPF_DBUF_VIEWS];
} upf_dbuf;

typedef struct {
  int nbufs;
  upf_dbuf buf[UPF_DCASE_BUFS];
  upf_dtype in_dtype; /* picks the tolerance (SPEC 7: by input dtype) */
  const upf_tolerance *tol; /* a kernel that rounds below its input dtype (FP8): this instead; NULL: none */
} upf_dcase;

/* Views bound to one set of parent pointers: v[buf][view]. */
typedef upf_tensor upf_dviews[UPF_DCASE_BUFS][UPF_DBUF_VIEWS];

/* Runs the op of a case on `be` with the views bound to that backend's memory. */
typedef upf_status (*upf_dcase_fn)(const upf_backend *be, upf_dviews v, const void *ctx);
/* fp64 truth of the first output view from host views (the long-reduction rule); NULL when the case
 * has no long reduction. */
typedef upf_status (*upf_dcase_truth_fn)(upf_dviews v, const void *ctx, double *truth);

void upf_dcase_init(upf_dcase *dc, upf_dtype in_dtype);
void upf_dcase_free(upf_dcase *dc);
/* Adds a parent buffer of `numel` elements; returns it (NULL when out of memory or full). Its first
 * view is the whole buffer as a 1-D tensor until upf_dbuf_view replaces it. */
upf_dbuf *upf_dcase_add(upf_dcase *dc, const char *name, upf_dtype dtype, int64_t numel, int output);
/* Sets view `i` of the buffer: shape, strides (NULL: row-major contiguous) and element offset. */
void upf_dbuf_view(upf_dbuf *b, int i, const char *name, int ndim, const int64_t *shape, const int64_t *stride,
                   int64_t offset);
/* Restricts the compared region of view `i` to its first `last` elements of the last dim. */
void upf_dbuf_cmp_last(upf_dbuf *b, int i, int64_t last);
/* Fills the whole parent with N(mean, std) rounded to the dtype (f32/bf16), or poisons it (0xFF). */
void upf_dbuf_fill_normal(upf_dbuf *b, upf_rng *rng, float mean, float std);
void upf_dbuf_fill_poison(upf_dbuf *b);
/* Host element of a float buffer as a double. */
double upf_dbuf_get(const upf_dbuf *b, int64_t i);
void upf_dbuf_set(upf_dbuf *b, int64_t i, float v);

/* Binds the views of every buffer to parents[buf]. */
void upf_dcase_bind(const upf_dcase *dc, void *const *parents, upf_dviews v);

/* The whole check: reference on the CPU, the op on `be`, one check per output view (op and variant
 * from `proto`, with the view's name appended when a case has several). When the plain tolerance
 * fails and `truth` is given (a reduction of length >= 4096), the long-reduction rule decides and
 * the detail says so. */
void upf_dcase_verify(upf_verify_ctx *ctx, const upf_dcase *dc, upf_dcase_fn fn, upf_dcase_truth_fn truth,
                      const void *op_ctx, const upf_check *proto);

/* Fills op/variant/dtype/shape of a check. */
void upf_dense_check_init(upf_check *check, const char *op, const char *variant, upf_dtype dtype,
                          const char *shape_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif

/* Backend lookup by name, and the CUDA table of a CUDA=0 build: every entry answers
 * UPF_ERR_UNSUPPORTED, so callers need no #ifdefs. */
#include "uniprefill/backend.h"

#include <string.h>

const upf_backend *upf_backend_by_name(const char *name) {
  if (name && !strcmp(name, "cpu"))
    return upf_backend_cpu();
  if (name && !strcmp(name, "cuda"))
    return upf_backend_cuda();
  upf_fail(UPF_ERR_INVALID_ARG, "backend: unknown name '%s' (expected cpu or cuda)", name ? name : "(null)");
  return NULL;
}

#ifndef UPF_HAVE_CUDA
static upf_status no_cuda(void) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "cuda: this build has no CUDA backend (built with CUDA=0)");
}
static const char *no_cuda_describe(void) { return ""; }
static upf_status no_cuda_alloc(void **ptr, size_t bytes) {
  *ptr = NULL;
  return no_cuda();
}
static void no_cuda_release(void *ptr) {}
static upf_status no_cuda_copy(void *dst, const void *src, size_t bytes) { return no_cuda(); }
static upf_status no_cuda_fill(void *dst, int byte, size_t bytes) { return no_cuda(); }
static upf_status no_cuda_mark_create(void **mark) {
  *mark = NULL;
  return no_cuda();
}
static void no_cuda_mark_destroy(void *mark) {}
static upf_status no_cuda_mark_record(void *mark) { return no_cuda(); }
static upf_status no_cuda_mark_elapsed(void *start, void *end, double *seconds) { return no_cuda(); }

#define UPF_OP(id, name, summary, entry, params) \
  static upf_status no_cuda_##entry params { return no_cuda(); }
#include "uniprefill/ops.def"
#undef UPF_OP

static const upf_backend cuda_unavailable = {
    .name = "cuda", .probe = no_cuda, .describe = no_cuda_describe, .synchronize = no_cuda,
    .alloc = no_cuda_alloc, .release = no_cuda_release, .fill = no_cuda_fill,
    .upload = no_cuda_copy, .download = no_cuda_copy,
    .mark_create = no_cuda_mark_create, .mark_destroy = no_cuda_mark_destroy, .mark_record = no_cuda_mark_record,
    .mark_elapsed = no_cuda_mark_elapsed,
#define UPF_OP(id, name, summary, entry, params) .entry = no_cuda_##entry,
#include "uniprefill/ops.def"
#undef UPF_OP
};

const upf_backend *upf_backend_cuda(void) { return &cuda_unavailable; }
#endif

/* The CPU backend's ops table: the reference of every op of ops.def (cpu_<entry> of ref_cpu/), host
 * memory for the buffers. */
#include "uniprefill/backend.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref_cpu/attn.h"
#include "ref_cpu/compact.h"
#include "ref_cpu/compact_attn.h"
#include "ref_cpu/embed.h"
#include "ref_cpu/ffn.h"
#include "ref_cpu/gated_out.h"
#include "ref_cpu/gdn.h"
#include "ref_cpu/gemm.h"
#include "ref_cpu/kv.h"
#include "ref_cpu/logits.h"
#include "ref_cpu/moe.h"
#include "ref_cpu/norm.h"
#include "ref_cpu/rope.h"
#include "ref_cpu/select.h"
#include "ref_cpu/sparse.h"

static upf_status cpu_probe(void) { return UPF_OK; }
static const char *cpu_describe(void) { return "CPU reference (double accumulation, OpenBLAS)"; }

static upf_status cpu_alloc(void **ptr, size_t bytes) {
  *ptr = malloc(bytes ? bytes : 1);
  return *ptr ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "cpu: cannot allocate %zu bytes", bytes);
}
static void cpu_release(void *ptr) { free(ptr); }
static upf_status cpu_copy(void *dst, const void *src, size_t bytes) {
  if (bytes)
    memcpy(dst, src, bytes);
  return UPF_OK;
}
static upf_status cpu_fill(void *dst, int byte, size_t bytes) {
  memset(dst, byte, bytes);
  return UPF_OK;
}
static upf_status cpu_synchronize(void) { return UPF_OK; }

static upf_status cpu_mark_create(void **mark) {
  *mark = calloc(1, sizeof(double));
  return *mark ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "cpu: a timing mark");
}
static void cpu_mark_destroy(void *mark) { free(mark); }
static upf_status cpu_mark_record(void *mark) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  *(double *)mark = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
  return UPF_OK;
}
static upf_status cpu_mark_elapsed(void *start, void *end, double *seconds) {
  *seconds = *(const double *)end - *(const double *)start;
  return UPF_OK;
}

static const upf_backend cpu_backend = {
    .name = "cpu",
    .probe = cpu_probe,
    .describe = cpu_describe,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload = cpu_copy,
    .download = cpu_copy,
    .fill = cpu_fill,
    .synchronize = cpu_synchronize,
    .mark_create = cpu_mark_create,
    .mark_destroy = cpu_mark_destroy,
    .mark_record = cpu_mark_record,
    .mark_elapsed = cpu_mark_elapsed,
#define UPF_OP(id, name, summary, entry, params) .entry = cpu_##entry,
#include "uniprefill/ops.def"
#undef UPF_OP
};

const upf_backend *upf_backend_cpu(void) { return &cpu_backend; }

/* The CPU backend's ops table: the reference of every op of ops.def (cpu_<entry> of ref_cpu/), host
 * memory for the buffers. */
#include "uniprefill/backend.h"

#include <stdlib.h>
#include <string.h>

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
#define UPF_OP(id, name, summary, entry, params) .entry = cpu_##entry,
#include "uniprefill/ops.def"
#undef UPF_OP
};

const upf_backend *upf_backend_cpu(void) { return &cpu_backend; }

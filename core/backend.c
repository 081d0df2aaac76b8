/* The CPU backend's ops table, backend lookup by name, and the CUDA table of a CUDA=0 build (every
 * entry answers UPF_ERR_UNSUPPORTED, so callers need no #ifdefs). */
#include "uniprefill/backend.h"

#include <stdlib.h>
#include <string.h>

#include "ref_cpu/attn.h"
#include "ref_cpu/compact.h"
#include "ref_cpu/embed.h"
#include "ref_cpu/ffn.h"
#include "ref_cpu/gated_out.h"
#include "ref_cpu/gdn.h"
#include "ref_cpu/gemm.h"
#include "ref_cpu/logits.h"
#include "ref_cpu/moe.h"
#include "ref_cpu/norm.h"
#include "ref_cpu/rope.h"
#include "ref_cpu/select.h"

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
    .select_part_gemm = cpu_select_part_gemm,
    .select_block_softmax = cpu_select_block_softmax,
    .select_block_reduce = cpu_select_block_reduce,
    .select_topp = cpu_select_topp,
    .select_expand = cpu_select_expand,
    .select_run = cpu_select_run,
    .compact_rows = cpu_compact_rows,
    .gemm = cpu_gemm,
    .ffn_act_mul = cpu_gated_act,
    .ffn_gated = cpu_ffn_gated,
    .rmsnorm = cpu_rmsnorm,
    .rmsnorm_add = cpu_rmsnorm_add,
    .qk_norm = cpu_qk_norm,
    .rope = cpu_rope,
    .gated_output = cpu_gated_output,
    .embed = cpu_embed,
    .logits_last = cpu_logits_last,
    .moe_route = cpu_moe_route,
    .moe_permute = cpu_moe_permute,
    .moe_ffn = cpu_moe_ffn,
    .gdn_conv = cpu_gdn_conv,
    .gdn_conv_step = cpu_gdn_conv_step,
    .gdn_scan = cpu_gdn_scan,
    .gdn_gated_norm = cpu_gdn_gated_norm,
    .attn_prefill = cpu_attn_prefill,
    .attn_paged = cpu_attn_paged,
    .kv_cache_write = cpu_kv_cache_write,
};

const upf_backend *upf_backend_cpu(void) { return &cpu_backend; }

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
static upf_status no_cuda_scores(const upf_select_inputs *in, const upf_select_params *p, float *s) {
  return no_cuda();
}
static upf_status no_cuda_softmax(const upf_select_inputs *in, const upf_select_params *p, const float *s, float *t) {
  return no_cuda();
}
static upf_status no_cuda_topp(const upf_select_inputs *in, const upf_select_params *p, const float *b, uint8_t *m) {
  return no_cuda();
}
static upf_status no_cuda_expand(const upf_select_inputs *in, const upf_select_params *p, const uint8_t *m,
                                 upf_select_outputs *o) {
  return no_cuda();
}
static upf_status no_cuda_run(const upf_select_inputs *in, const upf_select_params *p, upf_select_outputs *o) {
  return no_cuda();
}
static upf_status no_cuda_compact(const void *src, int64_t rows, int64_t row_bytes, const int32_t *idx, int64_t kept,
                                  void *dst) {
  return no_cuda();
}

static upf_status no_cuda_gemm(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c) { return no_cuda(); }
static upf_status no_cuda_act_mul(const upf_tensor *gu, upf_act act, const upf_tensor *h) { return no_cuda(); }
static upf_status no_cuda_ffn(const upf_tensor *x, const upf_tensor *wgu, const upf_tensor *wd, upf_act act,
                              const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_rmsnorm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p,
                                  const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_rmsnorm_add(const upf_tensor *x, const upf_tensor *r, const upf_tensor *w,
                                      const upf_norm_params *p, const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_rope(const upf_tensor *q, const upf_tensor *k, const int32_t *pos, const upf_rope_params *p) {
  return no_cuda();
}
static upf_status no_cuda_gated_output(const upf_tensor *o, const upf_tensor *g, const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_embed(const int32_t *ids, int64_t n, const upf_tensor *table, float scale,
                                const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_logits(const upf_tensor *h, const int32_t *cu, int32_t b, const upf_tensor *nw,
                                 const upf_norm_params *p, const upf_tensor *w, const upf_tensor *l) {
  return no_cuda();
}

static upf_status no_cuda_moe_route(const upf_moe_config *c, const upf_tensor *x, const upf_moe_weights *w,
                                    upf_moe_routing *r) {
  return no_cuda();
}
static upf_status no_cuda_moe_permute(const upf_moe_config *c, int64_t t, const int32_t *idx, upf_moe_permutation *p) {
  return no_cuda();
}
static upf_status no_cuda_moe_ffn(const upf_moe_config *c, const upf_tensor *x, const upf_moe_weights *w,
                                  const upf_tensor *o, upf_moe_routing *r) {
  return no_cuda();
}

static upf_status no_cuda_gdn_conv(const upf_gdn_batch *b, const upf_tensor *x, const upf_tensor *w,
                                   const upf_tensor *si, const upf_tensor *so, const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_gdn_conv_step(const upf_tensor *x, const upf_tensor *w, const upf_tensor *s,
                                        const upf_tensor *y) {
  return no_cuda();
}
static upf_status no_cuda_gdn_scan(const upf_gdn_batch *b, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                                   const upf_tensor *so) {
  return no_cuda();
}
static upf_status no_cuda_gdn_gated_norm(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w,
                                         const upf_norm_params *p, const upf_tensor *y) {
  return no_cuda();
}

static upf_status no_cuda_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                       const upf_tensor *v, const upf_attn_params *p, const upf_tensor *o,
                                       const upf_tensor *lse) {
  return no_cuda();
}
static upf_status no_cuda_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *kc,
                                     const upf_tensor *vc, const upf_attn_params *p, const upf_tensor *o,
                                     const upf_tensor *lse) {
  return no_cuda();
}
static upf_status no_cuda_kv_write(const upf_tensor *k, const upf_tensor *v, const int32_t *slots,
                                   const int32_t *slots_host, const upf_tensor *kc, const upf_tensor *vc) {
  return no_cuda();
}

static const upf_backend cuda_unavailable = {
    .name = "cuda",
    .probe = no_cuda,
    .describe = no_cuda_describe,
    .alloc = no_cuda_alloc,
    .release = no_cuda_release,
    .upload = no_cuda_copy,
    .download = no_cuda_copy,
    .fill = no_cuda_fill,
    .synchronize = no_cuda,
    .select_part_gemm = no_cuda_scores,
    .select_block_softmax = no_cuda_softmax,
    .select_block_reduce = no_cuda_softmax,
    .select_topp = no_cuda_topp,
    .select_expand = no_cuda_expand,
    .select_run = no_cuda_run,
    .compact_rows = no_cuda_compact,
    .gemm = no_cuda_gemm,
    .ffn_act_mul = no_cuda_act_mul,
    .ffn_gated = no_cuda_ffn,
    .rmsnorm = no_cuda_rmsnorm,
    .rmsnorm_add = no_cuda_rmsnorm_add,
    .qk_norm = no_cuda_rmsnorm,
    .rope = no_cuda_rope,
    .gated_output = no_cuda_gated_output,
    .embed = no_cuda_embed,
    .logits_last = no_cuda_logits,
    .moe_route = no_cuda_moe_route,
    .moe_permute = no_cuda_moe_permute,
    .moe_ffn = no_cuda_moe_ffn,
    .gdn_conv = no_cuda_gdn_conv,
    .gdn_conv_step = no_cuda_gdn_conv_step,
    .gdn_scan = no_cuda_gdn_scan,
    .gdn_gated_norm = no_cuda_gdn_gated_norm,
    .attn_prefill = no_cuda_attn_prefill,
    .attn_paged = no_cuda_attn_paged,
    .kv_cache_write = no_cuda_kv_write,
};

const upf_backend *upf_backend_cuda(void) { return &cuda_unavailable; }
#endif

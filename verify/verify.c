/* Verify registry (one entry per op of ops.def) and the runner. */
#include "verify/verify.h"

#include <string.h>

static const upf_verify_fn verify_fns[UPF_OP_COUNT] = {
    [UPF_OP_SELECT_PART_GEMM] = upf_verify_select_part_gemm,
    [UPF_OP_SELECT_BLOCK_SOFTMAX] = upf_verify_select_block_softmax,
    [UPF_OP_SELECT_BLOCK_REDUCE] = upf_verify_select_block_reduce,
    [UPF_OP_SELECT_TOPP] = upf_verify_select_topp,
    [UPF_OP_SELECT_EXPAND] = upf_verify_select_expand,
    [UPF_OP_SELECT_PIPELINE] = upf_verify_select_pipeline,
    [UPF_OP_COMPACT_ROWS] = upf_verify_compact_rows,
    [UPF_OP_GEMM] = upf_verify_gemm,
    [UPF_OP_FFN_ACT_MUL] = upf_verify_ffn_act_mul,
    [UPF_OP_FFN_GATED] = upf_verify_ffn_gated,
    [UPF_OP_RMSNORM] = upf_verify_rmsnorm,
    [UPF_OP_RMSNORM_ADD] = upf_verify_rmsnorm_add,
    [UPF_OP_QK_NORM] = upf_verify_qk_norm,
    [UPF_OP_ROPE] = upf_verify_rope,
    [UPF_OP_GATED_OUTPUT] = upf_verify_gated_output,
    [UPF_OP_EMBED] = upf_verify_embed,
    [UPF_OP_LOGITS_LAST] = upf_verify_logits_last,
    [UPF_OP_MOE_ROUTE] = upf_verify_moe_route,
    [UPF_OP_MOE_PERMUTE] = upf_verify_moe_permute,
    [UPF_OP_MOE_FFN] = upf_verify_moe_ffn,
    [UPF_OP_GDN_CONV] = upf_verify_gdn_conv,
    [UPF_OP_GDN_CONV_STEP] = upf_verify_gdn_conv_step,
    [UPF_OP_GDN_SCAN] = upf_verify_gdn_scan,
    [UPF_OP_GDN_GATED_NORM] = upf_verify_gdn_gated_norm,
    [UPF_OP_ATTN_PREFILL] = upf_verify_attn_prefill,
    [UPF_OP_ATTN_PAGED] = upf_verify_attn_paged,
    [UPF_OP_KV_CACHE_WRITE] = upf_verify_kv_cache_write,
};

upf_verify_fn upf_verify_fn_for(upf_op op) { return (unsigned)op < UPF_OP_COUNT ? verify_fns[op] : NULL; }

void upf_verify_record(upf_verify_ctx *ctx, const upf_check *check) {
  if (check->passed)
    ctx->passed++;
  else
    ctx->failed++;
  if (ctx->log) {
    upf_check_print(ctx->log, check);
    fflush(ctx->log);
  }
}

int upf_verify_on_reference(const upf_verify_ctx *ctx) { return ctx->backend == upf_backend_cpu(); }

int upf_verify_case_wanted(const upf_verify_ctx *ctx, int in_quick_set) {
  if (upf_verify_on_reference(ctx))
    return 0;
  return !ctx->quick || in_quick_set;
}

uint64_t upf_verify_case_seed(const char *op, int index, uint64_t variant) {
  uint64_t h = 1469598103934665603ull;
  for (const char *c = op; *c; c++)
    h = (h ^ (unsigned char)*c) * 1099511628211ull;
  return h ^ ((uint64_t)index * 7919u) ^ (variant << 40);
}

void upf_verify_expect_status(upf_verify_ctx *ctx, const char *op, const char *what, upf_status got,
                              upf_status want) {
  upf_check check;
  memset(&check, 0, sizeof check);
  snprintf(check.op, sizeof check.op, "%s", op);
  snprintf(check.variant, sizeof check.variant, "error: %s", what);
  snprintf(check.dtype, sizeof check.dtype, "f32");
  snprintf(check.shape, sizeof check.shape, "-");
  check.passed = got == want;
  snprintf(check.detail, sizeof check.detail, "%s (want %s): %.160s", upf_status_name(got), upf_status_name(want),
           got == UPF_OK ? "" : upf_last_error());
  upf_verify_record(ctx, &check);
}

int upf_verify_run(upf_verify_ctx *ctx, const char *filter) {
  int all = !filter || !strcmp(filter, "all");
  for (int op = 0; op < UPF_OP_COUNT; op++) {
    const char *name = upf_op_name((upf_op)op);
    if (!all && strncmp(name, filter, strlen(filter)) != 0)
      continue;
    if (!verify_fns[op]) {
      /* An op without verify cases is a defect, not a pass. */
      upf_check missing = {.passed = 0};
      snprintf(missing.op, sizeof missing.op, "%s", name);
      snprintf(missing.variant, sizeof missing.variant, "registry");
      snprintf(missing.detail, sizeof missing.detail, "no verify entry registered for this op");
      upf_verify_record(ctx, &missing);
      continue;
    }
    verify_fns[op](ctx);
  }
  return ctx->failed;
}

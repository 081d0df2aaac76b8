/* Verify registry (one entry per op of ops.def) and the runner. */
#include "verify/verify.h"

#include <string.h>

#include "verify/verify_model.h"

static const upf_verify_fn verify_fns[UPF_OP_COUNT] = {
#define UPF_OP(id, name, summary, entry, params) [UPF_OP_##id] = upf_verify_##entry,
#include "uniprefill/ops.def"
#undef UPF_OP
};

/* End-to-end checks built from many ops, run after the ops (only against a backend under test: the
 * CPU reference's models are checked by the CUnit model suites). */
static const struct {
  const char *name;
  upf_verify_fn fn;
} verify_whole[] = {{"model.prefill", upf_verify_model}, {"model.generate", upf_verify_generate}};

static int filter_matches(const char *name, const char *filter) {
  return !filter || !strcmp(filter, "all") || !strncmp(name, filter, strlen(filter));
}

int upf_verify_filter_known(const char *filter) {
  for (int op = 0; op < UPF_OP_COUNT; op++)
    if (filter_matches(upf_op_name((upf_op)op), filter))
      return 1;
  for (size_t i = 0; i < sizeof verify_whole / sizeof *verify_whole; i++)
    if (filter_matches(verify_whole[i].name, filter))
      return 1;
  return 0;
}

upf_verify_fn upf_verify_fn_for(upf_op op) { return (unsigned)op < UPF_OP_COUNT ? verify_fns[op] : NULL; }

void upf_verify_record(upf_verify_ctx *ctx, const upf_check *check) {
  upf_check named;
  if (ctx->kernel_variant) {
    named = *check;
    snprintf(named.variant, sizeof named.variant, "%.16s/%.46s", ctx->kernel_variant, check->variant);
    check = &named;
  }
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

int upf_verify_case_wanted(const upf_verify_ctx *ctx, const char *name, int in_quick_set) {
  if (upf_verify_on_reference(ctx))
    return 0;
  if (ctx->case_filter && (!name || !strstr(name, ctx->case_filter)))
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
  for (int op = 0; op < UPF_OP_COUNT; op++) {
    if (!filter_matches(upf_op_name((upf_op)op), filter))
      continue;
    const int variants = ctx->variant_in_effect_only || upf_verify_on_reference(ctx) ? 0 : upf_variant_count((upf_op)op);
    if (variants == 0) {
      verify_fns[op](ctx);
      continue;
    }
    /* a variant chosen for this op (--variant, UPF_VARIANT) runs alone: one sanitizer process a variant */
    upf_variant chosen = UPF_VARIANT_COUNT;
    const upf_status st = upf_variant_chosen((upf_op)op, &chosen);
    if (st != UPF_OK) {
      upf_verify_expect_status(ctx, upf_op_name((upf_op)op), "the variant chosen by UPF_VARIANT", st, UPF_OK);
      continue;
    }
    if (chosen != UPF_VARIANT_COUNT) {
      ctx->kernel_variant = upf_variant_name(chosen);
      verify_fns[op](ctx);
      ctx->kernel_variant = NULL;
      continue;
    }
    for (int i = 0; i < variants; i++) {
      const upf_variant v = upf_variant_of((upf_op)op, i);
      upf_variant_select(v);
      ctx->kernel_variant = upf_variant_name(v);
      verify_fns[op](ctx);
      ctx->kernel_variant = NULL;
      upf_variant_reset((upf_op)op);
    }
  }
  for (size_t i = 0; i < sizeof verify_whole / sizeof *verify_whole; i++)
    if (filter_matches(verify_whole[i].name, filter) && !upf_verify_on_reference(ctx))
      verify_whole[i].fn(ctx);
  return ctx->failed;
}

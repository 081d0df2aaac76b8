/* The verify harness itself: it must catch what it exists to catch (NaN, a budget overrun, a
 * clobbered guard byte, a non-marginal decision flip), and the CPU reference must pass its own
 * verify run (golden cases, invariants, stage chain against the double pipeline). */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "verify/select_checks.h"
#include "verify/verify.h"
#include "verify/verify_model.h"

static void test_compare_catches_errors(void) {
  upf_tolerance tol = upf_tolerance_for(UPF_DTYPE_F32);
  const double ref[4] = {1.0, -2.0, 3.0, INFINITY};
  upf_check check;
  float ok[4] = {1.0f, -2.0f, 3.0f, INFINITY};
  upf_compare_f32(ok, ref, 4, tol, &check);
  CU_ASSERT(check.passed);
  float off[4] = {1.0f, -2.0f, 3.001f, INFINITY};
  upf_compare_f32(off, ref, 4, tol, &check);
  CU_ASSERT(!check.passed);
  float nan[4] = {1.0f, NAN, 3.0f, INFINITY};
  upf_compare_f32(nan, ref, 4, tol, &check);
  CU_ASSERT(!check.passed);
  CU_ASSERT(strstr(check.detail, "NaN") != NULL);
  float wrong_inf[4] = {1.0f, -2.0f, 3.0f, -INFINITY};
  upf_compare_f32(wrong_inf, ref, 4, tol, &check);
  CU_ASSERT(!check.passed);
  /* bf16 tolerances accept what fp32 ones reject. */
  upf_compare_f32(off, ref, 3, upf_tolerance_for(UPF_DTYPE_BF16), &check);
  CU_ASSERT(check.passed);
  CU_ASSERT(check.budget > 0.0 && check.budget < 1.0);
}

static void test_guard_bytes_catch_overrun(void) {
  const upf_backend *cpu = upf_backend_cpu();
  upf_guarded g;
  CU_ASSERT_FATAL(upf_guarded_alloc(cpu, 100, &g) == UPF_OK);
  CU_ASSERT_EQUAL(((unsigned char *)g.ptr)[99], 0xFF); /* poisoned */
  CU_ASSERT_EQUAL(upf_guarded_check(&g, "buf"), UPF_OK);
  ((unsigned char *)g.ptr)[100 + 17] = 0;
  CU_ASSERT_NOT_EQUAL(upf_guarded_check(&g, "buf"), UPF_OK);
  CU_ASSERT(strstr(upf_last_error(), "guard byte 17") != NULL);
  upf_guarded_free(&g);
}

static void test_decision_compare_marginal_rule(void) {
  /* One request of 4 blocks (G=1, sink 0, L=1): pi = [.1 .4 .2 .3], p = 0.5 keeps {1, 3}. */
  const int32_t cu[] = {0, 4};
  upf_select_inputs in = {.cu_seqlens_host = cu, .num_reqs = 1};
  upf_select_params p = {.block = 1, .sink = 0, .last_q = 1, .p = 0.5f};
  const double score[] = {1, 4, 2, 3};
  const uint8_t ref[] = {0, 1, 0, 1}, flip_top[] = {0, 0, 0, 1}, same[] = {0, 1, 0, 1};
  upf_check check;
  upf_select_compare_decisions(&in, &p, score, ref, same, 1e-5, &check);
  CU_ASSERT(check.passed);
  upf_select_compare_decisions(&in, &p, score, ref, flip_top, 1e-5, &check);
  CU_ASSERT(!check.passed);
  /* Block 2's exclusive prefix is 0.7: marginal only when p sits within tau of it. */
  const uint8_t flip_third[] = {0, 1, 1, 1};
  p.p = 0.6999995f;
  const uint8_t ref_near[] = {0, 1, 0, 1};
  upf_select_compare_decisions(&in, &p, score, ref_near, flip_third, 1e-5, &check);
  CU_ASSERT(check.passed);
  CU_ASSERT(strstr(check.detail, "marginal") != NULL);
  upf_select_compare_decisions(&in, &p, score, ref_near, flip_third, 1e-9, &check);
  CU_ASSERT(!check.passed);
}

/* Every op's quick set on the CPU reference; under Valgrind (quick mode) all but the MoE ops, whose
 * reference checks (E = 1000 routers, double-accumulated experts) take minutes there and whose CPU code
 * the suite "moe (cpu reference)" runs under Valgrind already. */
static int cpu_verify_pass(upf_verify_ctx *ctx) {
  if (!upf_test_quick())
    return upf_verify_run(ctx, "all");
  int failed = 0;
  for (int op = 0; op < UPF_OP_COUNT; op++)
    if (strncmp(upf_op_name((upf_op)op), "moe.", 4) != 0)
      failed += upf_verify_run(ctx, upf_op_name((upf_op)op));
  return failed + upf_verify_run(ctx, "model.");
}

static void test_cpu_verify_run(void) {
  upf_verify_ctx ctx = {.backend = upf_backend_cpu(), .log = NULL, .quick = 1};
  if (upf_test_quick())
    printf("(quick: the moe.* ops are left to the suite \"moe (cpu reference)\") ");
  int failed = cpu_verify_pass(&ctx);
  if (failed) {
    ctx.log = stdout;
    ctx.passed = ctx.failed = 0;
    cpu_verify_pass(&ctx);
  }
  CU_ASSERT_EQUAL(failed, 0);
  CU_ASSERT(ctx.passed > 20);
}

/* Runs op's checks on the CPU twin into a log; returns it (free it) with the context's counts in *ctx. */
static char *verify_logged(upf_op op, upf_verify_ctx *ctx) {
  char *text = NULL;
  size_t len = 0;
  FILE *log = open_memstream(&text, &len);
  CU_ASSERT_PTR_NOT_NULL_FATAL(log);
  ctx->backend = upf_test_cpu_twin(), ctx->log = log, ctx->quick = 1;
  upf_verify_run(ctx, upf_op_name(op));
  fclose(log);
  return text;
}

static int lines_naming(const char *text, upf_variant v) {
  char want[64];
  snprintf(want, sizeof want, " %s/", upf_variant_name(v));
  int lines = 0;
  for (const char *at = text; (at = strstr(at, want)) != NULL; at++)
    lines++;
  return lines;
}

/* On a backend under test, an op with variants runs once per variant, each line naming it, and the
 * default is in effect afterwards; a variant chosen for the op (upf verify --variant, UPF_VARIANT) runs
 * alone, named, and stays chosen; with variant_in_effect_only, once, unnamed. */
static void test_verify_iterates_variants(void) {
  const upf_op op = UPF_OP_GDN_SCAN; /* two variants, a quick set cheap enough for Valgrind */
  const int n = upf_variant_count(op);
  CU_ASSERT_FATAL(n >= 2);
  upf_verify_ctx ctx = {0};
  char *text = verify_logged(op, &ctx);
  CU_ASSERT_EQUAL(ctx.failed, 0);
  CU_ASSERT_PTR_NULL(ctx.kernel_variant);
  const int per_variant = ctx.passed / n;
  CU_ASSERT(per_variant > 5 && ctx.passed == per_variant * n);
  for (int i = 0; i < n; i++)
    CU_ASSERT_EQUAL(lines_naming(text, upf_variant_of(op, i)), per_variant);
  free(text);
  upf_variant current;
  CU_ASSERT_EQUAL(upf_variant_current(op, &current), UPF_OK);
  CU_ASSERT_EQUAL(current, upf_variant_of(op, 0));

  const upf_variant second = upf_variant_of(op, 1);
  upf_variant_select(second);
  upf_verify_ctx chosen = {0};
  text = verify_logged(op, &chosen);
  CU_ASSERT_EQUAL(chosen.failed, 0);
  CU_ASSERT_EQUAL(chosen.passed, per_variant);
  CU_ASSERT_EQUAL(lines_naming(text, second), per_variant);
  CU_ASSERT_EQUAL(lines_naming(text, upf_variant_of(op, 0)), 0);
  free(text);
  CU_ASSERT_EQUAL(upf_variant_current(op, &current), UPF_OK);
  CU_ASSERT_EQUAL(current, second);
  upf_variant_reset(op);

  upf_verify_ctx once = {.backend = upf_test_cpu_twin(), .log = NULL, .quick = 1, .variant_in_effect_only = 1};
  upf_verify_run(&once, upf_op_name(op));
  CU_ASSERT_EQUAL(once.failed, 0);
  CU_ASSERT_EQUAL(once.passed, per_variant);
}

/* UPF_VARIANT chooses as --variant does; a bad one is a failed check naming it, and no variant runs. */
static void test_verify_variant_from_env(void) {
  const upf_op op = UPF_OP_GDN_SCAN;
  const upf_variant second = upf_variant_of(op, 1);
  char spec[128];
  snprintf(spec, sizeof spec, "%s=%s", upf_op_name(op), upf_variant_name(second));
  CU_ASSERT_EQUAL_FATAL(setenv("UPF_VARIANT", spec, 1), 0);
  upf_verify_ctx env = {0};
  char *text = verify_logged(op, &env);
  CU_ASSERT_EQUAL(env.failed, 0);
  CU_ASSERT(env.passed > 5);
  CU_ASSERT_EQUAL(lines_naming(text, second), env.passed);
  free(text);
  CU_ASSERT_EQUAL_FATAL(setenv("UPF_VARIANT", "gdn.scan=no-such-kernel", 1), 0);
  upf_verify_ctx bad = {0};
  text = verify_logged(op, &bad);
  CU_ASSERT_EQUAL(bad.passed, 0);
  CU_ASSERT_EQUAL(bad.failed, 1);
  CU_ASSERT_PTR_NOT_NULL(strstr(text, "UPF_VARIANT"));
  CU_ASSERT_PTR_NOT_NULL(strstr(text, "no-such-kernel"));
  free(text);
  unsetenv("UPF_VARIANT");
}

/* --case: only the seeded cases whose name holds the text run (each dtype, out and lse); golden and bad-input
 * checks still run; a text no case holds leaves only those. */
static int checks_with_case(const char *filter, char **text) {
  size_t len = 0;
  FILE *log = open_memstream(text, &len);
  CU_ASSERT_PTR_NOT_NULL_FATAL(log);
  upf_verify_ctx ctx = {.backend = upf_test_cpu_twin(), .log = log, .quick = 1, .variant_in_effect_only = 1,
                        .case_filter = filter};
  upf_verify_run(&ctx, "attn.paged");
  fclose(log);
  CU_ASSERT_EQUAL(ctx.failed, 0);
  return ctx.passed;
}

static void test_verify_case_filter(void) {
  char *none = NULL, *one = NULL;
  const int n_none = checks_with_case("no case is named so", &none);
  const int n_one = checks_with_case("decode, page 1", &one);
  CU_ASSERT(n_none > 0);              /* the golden and bad-input checks */
  CU_ASSERT_EQUAL(n_one, n_none + 4); /* the one case: out and lse, f32 and bf16 */
  CU_ASSERT_PTR_NULL(strstr(none, "decode, page 1"));
  CU_ASSERT_PTR_NOT_NULL(strstr(one, "decode, page 1"));
  CU_ASSERT_PTR_NULL(strstr(one, "decode, mixed lengths")); /* another quick case, not so named */
  free(none), free(one);
}

/* --case on the model checks picks tiny models by name: one family a process under a slow sanitizer. */
static void test_verify_model_case_filter(void) {
  const upf_model_config *llama = upf_model_config_by_name("llama-tiny");
  const upf_model_config *qwen = upf_model_config_by_name("qwen3-next-tiny");
  const upf_model_config *qwen80 = upf_model_config_by_name("qwen3-next-80b-a3b");
  CU_ASSERT_PTR_NOT_NULL_FATAL(llama);
  CU_ASSERT_PTR_NOT_NULL_FATAL(qwen);
  CU_ASSERT_PTR_NOT_NULL_FATAL(qwen80);
  upf_verify_ctx all = {.backend = upf_test_cpu_twin()};
  upf_verify_ctx one = {.backend = upf_test_cpu_twin(), .case_filter = "qwen3-next"};
  CU_ASSERT_TRUE(upf_verify_model_wanted(&all, llama));
  CU_ASSERT_TRUE(upf_verify_model_wanted(&all, qwen));
  CU_ASSERT_FALSE(upf_verify_model_wanted(&all, qwen80)); /* not a tiny model: never checked whole */
  CU_ASSERT_FALSE(upf_verify_model_wanted(&one, llama));
  CU_ASSERT_TRUE(upf_verify_model_wanted(&one, qwen));
  CU_ASSERT_FALSE(upf_verify_model_wanted(&one, qwen80));
  /* a name no tiny model holds: the model checks record nothing */
  char *text = NULL;
  size_t len = 0;
  FILE *log = open_memstream(&text, &len);
  CU_ASSERT_PTR_NOT_NULL_FATAL(log);
  upf_verify_ctx none = {.backend = upf_test_cpu_twin(), .log = log, .quick = 1, .case_filter = "no model so named"};
  upf_verify_run(&none, "model.");
  fclose(log);
  CU_ASSERT_EQUAL(none.passed, 0);
  CU_ASSERT_EQUAL(none.failed, 0);
  free(text);
}

static CU_TestInfo verify_tests[] = {
    {"compare catches NaN, Inf and budget overruns", test_compare_catches_errors},
    {"guard bytes catch an overrun", test_guard_bytes_catch_overrun},
    {"decision compare applies the marginal rule", test_decision_compare_marginal_rule},
    {"cpu reference passes verify (quick)", test_cpu_verify_run},
    {"verify runs each variant of an op, or the one chosen, named", test_verify_iterates_variants},
    {"verify runs the variant UPF_VARIANT chooses; a bad one fails a check", test_verify_variant_from_env},
    {"verify --case runs the seeded cases so named", test_verify_case_filter},
    {"verify --case picks the model checks' tiny models by name", test_verify_model_case_filter},
    CU_TEST_INFO_NULL,
};

void upf_register_verify_tests(void) { upf_test_suite("verify harness", NULL, NULL, verify_tests); }

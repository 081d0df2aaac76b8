/* core/variant.c by hand: UPF_VARIANT and --variant specs (good, unknown op, unknown variant,
 * malformed), the precedence select > UPF_VARIANT > default, reset, and describe. The cases use the
 * moe.ffn variants (default bucketed; grouped, padded, loop) and gemm (a single kernel). */
#include <CUnit/CUnit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/variant.h"

static upf_variant current(upf_op op) {
  upf_variant v = UPF_VARIANT_COUNT;
  CU_ASSERT_EQUAL(upf_variant_current(op, &v), UPF_OK);
  return v;
}

/* Every test starts and ends with no selection and no UPF_VARIANT. */
static char saved_env[512];
static int had_env;

static int variant_suite_init(void) {
  const char *env = getenv("UPF_VARIANT");
  had_env = env != NULL;
  snprintf(saved_env, sizeof saved_env, "%s", env ? env : "");
  unsetenv("UPF_VARIANT");
  for (int op = 0; op < UPF_OP_COUNT; op++)
    upf_variant_reset((upf_op)op);
  return 0;
}

static int variant_suite_clean(void) {
  for (int op = 0; op < UPF_OP_COUNT; op++)
    upf_variant_reset((upf_op)op);
  if (had_env)
    setenv("UPF_VARIANT", saved_env, 1);
  else
    unsetenv("UPF_VARIANT");
  return 0;
}

static void test_table(void) {
  CU_ASSERT_EQUAL(upf_variant_count(UPF_OP_MOE_FFN), 4);
  CU_ASSERT_EQUAL(upf_variant_of(UPF_OP_MOE_FFN, 0), UPF_VARIANT_MOE_FFN_BUCKETED);
  CU_ASSERT_EQUAL(upf_variant_of(UPF_OP_MOE_FFN, 4), UPF_VARIANT_COUNT);
  CU_ASSERT_STRING_EQUAL(upf_variant_name(UPF_VARIANT_MOE_FFN_PADDED), "padded");
  CU_ASSERT_EQUAL(upf_variant_op(UPF_VARIANT_MOE_FFN_LOOP), UPF_OP_MOE_FFN);
  CU_ASSERT_EQUAL(upf_variant_by_name(UPF_OP_MOE_FFN, "grouped"), UPF_VARIANT_MOE_FFN_GROUPED);
  CU_ASSERT_EQUAL(upf_variant_by_name(UPF_OP_GEMM, "grouped"), UPF_VARIANT_COUNT); /* another op's name */
  CU_ASSERT_EQUAL(upf_variant_by_name(UPF_OP_MOE_FFN, NULL), UPF_VARIANT_COUNT);
  CU_ASSERT_EQUAL(upf_variant_count(UPF_OP_FFN_GATED), 0);
  CU_ASSERT_EQUAL(current(UPF_OP_FFN_GATED), UPF_VARIANT_COUNT); /* a single kernel */
  CU_ASSERT_EQUAL(upf_variant_count(UPF_OP_GEMM), 2);
  CU_ASSERT_EQUAL(current(UPF_OP_GEMM), UPF_VARIANT_GEMM_CUBLAS);
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_BUCKETED);
}

static void test_spec_good(void) {
  CU_ASSERT_EQUAL(upf_variant_select_spec("moe.ffn=padded"), UPF_OK);
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_PADDED);
  /* The last item for an op wins. */
  CU_ASSERT_EQUAL(upf_variant_select_spec("moe.ffn=grouped,moe.ffn=loop"), UPF_OK);
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_LOOP);
  upf_variant_reset(UPF_OP_MOE_FFN);
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_BUCKETED);
  CU_ASSERT_EQUAL(upf_variant_select_spec(""), UPF_OK); /* nothing to select */
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_BUCKETED);
}

/* spec fails with UPF_ERR_INVALID_ARG, a message holding `want`, and selects nothing. */
static void expect_bad_spec(const char *spec, const char *want) {
  CU_ASSERT_EQUAL(upf_variant_select_spec(spec), UPF_ERR_INVALID_ARG);
  if (!strstr(upf_last_error(), want))
    printf("\n    spec '%s': message '%s' lacks '%s'\n", spec, upf_last_error(), want);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), want));
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_BUCKETED);
}

static void test_spec_bad(void) {
  expect_bad_spec("moe.fft=padded", "'moe.fft' names no op");
  expect_bad_spec("moe.ffn=pad", "op moe.ffn has no variant 'pad' (accepted: bucketed|grouped|padded|loop)");
  expect_bad_spec("ffn.gated=padded", "op ffn.gated has no variant 'padded' (it has a single kernel)");
  expect_bad_spec("moe.ffn", "item 'moe.ffn' is not op=variant");
  expect_bad_spec("moe.ffn=padded,,gemm=x", "item '' is not op=variant");
  expect_bad_spec("moe.ffn=padded,", "item '' is not op=variant");
  /* A bad item after a good one: the good one is not selected either. */
  expect_bad_spec("moe.ffn=padded,moe.ffn=nope", "has no variant 'nope'");
}

static void test_env_and_precedence(void) {
  setenv("UPF_VARIANT", "moe.ffn=grouped", 1);
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_GROUPED);
  upf_variant_select(UPF_VARIANT_MOE_FFN_PADDED); /* select beats the environment */
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_PADDED);
  upf_variant_reset(UPF_OP_MOE_FFN); /* back to the environment, not the default */
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_GROUPED);
  setenv("UPF_VARIANT", "moe.ffn=loop,moe.ffn=padded", 1); /* the last item wins */
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_PADDED);
  unsetenv("UPF_VARIANT");
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_BUCKETED);
}

static void test_env_bad(void) {
  upf_variant v = UPF_VARIANT_MOE_FFN_LOOP;
  /* A typo anywhere in the variable fails every op with variants, so no default runs under its name. */
  setenv("UPF_VARIANT", "moe.ffn=loop,attn.nope=x", 1);
  CU_ASSERT_EQUAL(upf_variant_current(UPF_OP_MOE_FFN, &v), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "UPF_VARIANT: 'attn.nope' names no op"));
  setenv("UPF_VARIANT", "moe.ffn=Padded", 1); /* names are case-sensitive */
  CU_ASSERT_EQUAL(upf_variant_current(UPF_OP_MOE_FFN, &v), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "UPF_VARIANT: op moe.ffn has no variant 'Padded'"));
  char buf[256];
  CU_ASSERT_EQUAL(upf_variant_describe(buf, sizeof buf), UPF_ERR_INVALID_ARG);
  /* A selection does not read the variable. */
  upf_variant_select(UPF_VARIANT_MOE_FFN_GROUPED);
  CU_ASSERT_EQUAL(current(UPF_OP_MOE_FFN), UPF_VARIANT_MOE_FFN_GROUPED);
  upf_variant_reset(UPF_OP_MOE_FFN);
  unsetenv("UPF_VARIANT");
}

static void test_describe(void) {
  char buf[512];
  CU_ASSERT_EQUAL_FATAL(upf_variant_describe(buf, sizeof buf), UPF_OK);
  CU_ASSERT_PTR_NOT_NULL(strstr(buf, "moe.ffn=bucketed"));
  /* One op=name item for every op with variants, nothing for the others. */
  int with_variants = 0, items = 1;
  for (int op = 0; op < UPF_OP_COUNT; op++)
    with_variants += upf_variant_count((upf_op)op) > 0;
  for (const char *c = buf; *c; c++)
    items += *c == ',';
  CU_ASSERT_EQUAL(items, with_variants);
  CU_ASSERT_PTR_NULL(strstr(buf, "ffn.gated="));
  /* A describe is a spec: it selects what it says. */
  CU_ASSERT_EQUAL(upf_variant_select_spec(buf), UPF_OK);
  upf_variant_select(UPF_VARIANT_MOE_FFN_LOOP);
  CU_ASSERT_EQUAL(upf_variant_describe(buf, sizeof buf), UPF_OK);
  CU_ASSERT_PTR_NOT_NULL(strstr(buf, "moe.ffn=loop"));
  CU_ASSERT_PTR_NULL(strstr(buf, "moe.ffn=bucketed"));
  /* A short buffer holds a terminated prefix. */
  char small[8];
  memset(small, 'x', sizeof small);
  CU_ASSERT_EQUAL(upf_variant_describe(small, sizeof small), UPF_OK);
  CU_ASSERT(strlen(small) < sizeof small);
  CU_ASSERT_EQUAL(strncmp(small, buf, strlen(small)), 0);
  for (int op = 0; op < UPF_OP_COUNT; op++)
    upf_variant_reset((upf_op)op);
}

static CU_TestInfo variant_tests[] = {
    {"the variant table", test_table},
    {"a good spec selects", test_spec_good},
    {"a bad spec names its fault and selects nothing", test_spec_bad},
    {"select > UPF_VARIANT > default; reset", test_env_and_precedence},
    {"a bad UPF_VARIANT fails every read", test_env_bad},
    {"describe names every op with variants", test_describe},
    CU_TEST_INFO_NULL,
};

void upf_register_variant_tests(void) {
  CU_SuiteInfo suites[] = {{"variants", variant_suite_init, variant_suite_clean, NULL, NULL, variant_tests},
                           CU_SUITE_INFO_NULL};
  CU_register_suites(suites);
}

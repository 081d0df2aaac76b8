/* CUnit runner: registers every suite, runs them (or the suites named on the command line)
 * verbosely and ends with CUnit's run summary. Exit status is non-zero when any test, assert or
 * suite set-up failed. */
#include <CUnit/Basic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/backend.h"
#include "verify/verify.h"

void upf_register_core_tests(void);
void upf_register_variant_tests(void);
void upf_register_npy_tests(void);
void upf_register_gguf_tests(void);
void upf_register_tokenizer_tests(void);
void upf_register_select_tests(void);
void upf_register_dense_tests(void);
void upf_register_moe_tests(void);
void upf_register_gdn_tests(void);
void upf_register_attn_tests(void);
void upf_register_verify_tests(void);
void upf_register_cli_tests(void);
void upf_register_model_tests(void);
void upf_register_model_masked_tests(void);
void upf_register_cli_eval_tests(void);
void upf_register_cli_generate_tests(void);
void upf_register_cli_gguf_tests(void);
void upf_register_cli_serve_tests(void);
void upf_register_cli_tokenize_tests(void);
void upf_register_cli_hardening_tests(void);
void upf_register_decode_tests(void);
void upf_register_engine_tests(void);
void upf_register_chunked_tests(void);
void upf_register_model_compact_tests(void);
void upf_register_eval_tests(void);
void upf_register_gguf_model_tests(void);
void upf_register_logits_tests(void);
void upf_register_tp_tests(void);
void upf_register_sparse_tests(void);
void upf_register_compact_attn_tests(void);
void upf_register_cli_sparse_tests(void);
void upf_register_model_sparse_tests(void);
void upf_register_report_tests(void);
void upf_register_timeline_tests(void);
void upf_register_cuda_tests(void);

static void (*const suites[])(void) = {
    upf_register_core_tests,
    upf_register_variant_tests,
    upf_register_npy_tests,
    upf_register_gguf_tests,
    upf_register_tokenizer_tests,
    upf_register_select_tests,
    upf_register_dense_tests,
    upf_register_moe_tests,
    upf_register_gdn_tests,
    upf_register_attn_tests,
    upf_register_sparse_tests,
    upf_register_compact_attn_tests,
    upf_register_verify_tests,
    upf_register_cli_tests,
    upf_register_model_tests,
    upf_register_model_masked_tests,
    upf_register_cli_eval_tests,
    upf_register_cli_generate_tests,
    upf_register_cli_gguf_tests,
    upf_register_cli_serve_tests,
    upf_register_cli_tokenize_tests,
    upf_register_cli_hardening_tests,
    upf_register_decode_tests,
    upf_register_engine_tests,
    upf_register_chunked_tests,
    upf_register_model_compact_tests,
    upf_register_eval_tests,
    upf_register_gguf_model_tests,
    upf_register_logits_tests,
    upf_register_cli_sparse_tests,
    upf_register_model_sparse_tests,
    upf_register_tp_tests,
    upf_register_report_tests,
    upf_register_timeline_tests,
    upf_register_cuda_tests,
};

int upf_test_quick(void) {
  const char *q = getenv("UPF_TEST_QUICK");
  return q && *q && *q != '0';
}

const upf_backend *upf_test_cpu_twin(void) {
  static upf_backend twin;
  twin = *upf_backend_cpu();
  twin.name = "cpu-twin";
  return &twin;
}

void upf_test_verify_op(upf_op op, const upf_backend *be, int min_passed) {
  upf_verify_ctx ctx = {.backend = be, .log = NULL, .quick = 1};
  upf_verify_fn_for(op)(&ctx);
  if (ctx.failed) {
    ctx.log = stdout, ctx.passed = ctx.failed = 0;
    printf("\n");
    upf_verify_fn_for(op)(&ctx);
  }
  CU_ASSERT_EQUAL(ctx.failed, 0);
  CU_ASSERT(ctx.passed > min_passed);
}

CU_pSuite upf_test_suite(const char *name, CU_InitializeFunc init, CU_CleanupFunc clean, const CU_TestInfo *tests) {
  CU_pSuite suite = CU_add_suite(name, init, clean);
  for (const CU_TestInfo *t = tests; suite && t->pName; t++)
    CU_add_test(suite, t->pName, t->pTestFunc);
  return suite;
}

/* GPU tests found unusable at registration; reported after the suite filter, so that a run of
 * other suites says nothing about them. */
static struct {
  CU_pSuite suite;
  CU_pTest test;
} skipped[256];
static int num_skipped, skipped_lost;
static char skip_reason[512];

CU_pTest upf_test_add_gpu(CU_pSuite suite, const char *name, CU_TestFunc fn) {
  CU_pTest test = CU_add_test(suite, name, fn);
  const upf_backend *cuda = upf_backend_cuda();
  upf_status st = cuda->probe();
  if (test && st != UPF_OK) {
    CU_set_test_active(test, CU_FALSE);
    snprintf(skip_reason, sizeof skip_reason, "%s", upf_last_error());
    if (num_skipped < (int)(sizeof skipped / sizeof skipped[0]))
      skipped[num_skipped].suite = suite, skipped[num_skipped++].test = test;
    else
      skipped_lost++;
  }
  return test;
}

/* The reason once, then each skipped test of an active suite by name. */
static void report_skipped(void) {
  int shown = 0;
  for (int i = 0; i < num_skipped; i++) {
    if (!skipped[i].suite->fActive)
      continue;
    if (!shown++)
      printf("GPU tests skipped: %s\n", skip_reason);
    printf("SKIPPED %s/%s\n", skipped[i].suite->pName, skipped[i].test->pName);
  }
  if (skipped_lost)
    printf("SKIPPED %d more GPU tests\n", skipped_lost);
}

/* Arguments name the suites to run ("npy", "cli", "cuda backend"); none runs them all. With --except
 * first, they name the suites not to run (make test splits its Valgrind pass over two cores so). */
static int select_suites(int argc, char **argv) {
  const int except = argc > 1 && !strcmp(argv[1], "--except");
  for (int i = 1 + except; i < argc; i++)
    if (!CU_get_suite(argv[i])) {
      fprintf(stderr, "test_upf: no suite named '%s'; suites:", argv[i]);
      for (CU_pSuite s = CU_get_registry()->pSuite; s; s = s->pNext)
        fprintf(stderr, " '%s'", s->pName);
      fprintf(stderr, "\n");
      return 0;
    }
  if (argc < 2)
    return 1;
  for (CU_pSuite s = CU_get_registry()->pSuite; s; s = s->pNext) {
    int named = 0;
    for (int i = 1 + except; i < argc; i++)
      named |= !strcmp(s->pName, argv[i]);
    CU_set_suite_active(s, named != except ? CU_TRUE : CU_FALSE);
  }
  return 1;
}

int main(int argc, char **argv) {
  if (CU_initialize_registry() != CUE_SUCCESS) {
    fprintf(stderr, "test_upf: cannot initialise the CUnit registry: %s\n", CU_get_error_msg());
    return 2;
  }
  for (size_t i = 0; i < sizeof suites / sizeof suites[0]; i++)
    suites[i]();
  if (CU_get_error() != CUE_SUCCESS) {
    fprintf(stderr, "test_upf: registering tests failed: %s\n", CU_get_error_msg());
    CU_cleanup_registry();
    return 2;
  }
  if (!select_suites(argc, argv)) {
    CU_cleanup_registry();
    return 2;
  }
  report_skipped();
  /* Inactive tests are the GPU tests skipped on a machine without a device, and inactive suites
   * the ones not asked for: neither is a failure. */
  CU_set_fail_on_inactive(CU_FALSE);
  CU_basic_set_mode(CU_BRM_VERBOSE);
  CU_basic_run_tests();
  unsigned failed = CU_get_number_of_failures() + CU_get_number_of_suites_failed();
  unsigned tests_failed = CU_get_number_of_tests_failed();
  CU_cleanup_registry();
  printf("\n");
  return failed || tests_failed ? 1 : 0;
}

/* Tests that need a CUDA device: every golden case on the CUDA backend, and the verify run of each
 * op against the CPU reference (quick shape set). Skipped by name where no device is usable. */
#include <CUnit/CUnit.h>
#include <stdio.h>

#include "tests/test_util.h"
#include "verify/select_checks.h"
#include "verify/verify.h"

static void test_cuda_goldens(void) {
  for (int g = 0; g < UPF_GOLDEN_COUNT; g++) {
    upf_check check;
    upf_select_golden_run(upf_backend_cuda(), (upf_golden)g, &check);
    if (!check.passed)
      printf("\n    cuda %s: %s\n", upf_golden_name((upf_golden)g), check.detail);
    CU_ASSERT(check.passed);
  }
}

static void verify_op(upf_op op) {
  upf_verify_ctx ctx = {.backend = upf_backend_cuda(), .log = stdout, .quick = 1};
  upf_verify_fn fn = upf_verify_fn_for(op);
  CU_ASSERT_PTR_NOT_NULL_FATAL(fn);
  printf("\n");
  fn(&ctx);
  CU_ASSERT_EQUAL(ctx.failed, 0);
  CU_ASSERT(ctx.passed > 0);
}

#define UPF_OP(id, name, summary, ...) \
  static void test_cuda_verify_##id(void) { verify_op(UPF_OP_##id); }
#include "uniprefill/ops.def"
#undef UPF_OP

void upf_register_cuda_tests(void) {
  CU_pSuite suite = CU_add_suite("cuda backend", NULL, NULL);
  upf_test_add_gpu(suite, "cuda golden cases", test_cuda_goldens);
#define UPF_OP(id, name, summary, ...) upf_test_add_gpu(suite, "cuda verify " name, test_cuda_verify_##id);
#include "uniprefill/ops.def"
#undef UPF_OP
}

/* Helpers shared by the CUnit suites: registering tests that need a CUDA device (reported as
 * skipped, by name, where there is none) and the quick mode used under Valgrind. */
#ifndef UNIPREFILL_TEST_UTIL_H
#define UNIPREFILL_TEST_UTIL_H

#include <CUnit/CUnit.h>

/* Adds a test; if the CUDA backend is not usable here, the test is added inactive and a line
 * "SKIPPED suite/name: <reason>" is printed, so CUnit's summary counts it under Inactive. */
CU_pTest upf_test_add_gpu(CU_pSuite suite, const char *name, CU_TestFunc fn);

/* UPF_TEST_QUICK=1: smaller cases (the Valgrind run). */
int upf_test_quick(void);

#endif

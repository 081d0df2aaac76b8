/* Helpers shared by the CUnit suites: registering a suite from its table of tests, registering tests
 * that need a CUDA device (reported as skipped, by name, where there is none), the quick mode used
 * under Valgrind, and the real model files and gguf-py venv cached outside git (tests/test_util.c). */
#ifndef UNIPREFILL_TEST_UTIL_H
#define UNIPREFILL_TEST_UTIL_H

#include <CUnit/CUnit.h>
#include <stddef.h>

#include "uniprefill/backend.h"
#include "uniprefill/ops.h"

/* Adds a suite and the tests of `tests` (ended by CU_TEST_INFO_NULL) in order; returns the suite
 * (NULL when CUnit refused it) for tests added after. */
CU_pSuite upf_test_suite(const char *name, CU_InitializeFunc init, CU_CleanupFunc clean, const CU_TestInfo *tests);

/* Adds a test; if the CUDA backend is not usable here, the test is added inactive (CUnit's summary
 * counts it under Inactive), and before the run the reason is printed once, then a line
 * "SKIPPED suite/name" for each such test. */
CU_pTest upf_test_add_gpu(CU_pSuite suite, const char *name, CU_TestFunc fn);

/* UPF_TEST_QUICK=1: smaller cases (the Valgrind run). */
int upf_test_quick(void);

/* Prints the line that names a skipped test: "SKIPPED suite/test: " and the printf-style reason. */
void upf_test_skip(const char *suite, const char *test, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* In quick mode: prints "SKIPPED suite/test: quick mode: why" and returns 1; else 0. */
int upf_test_skip_quick(const char *suite, const char *test, const char *why);

/* A real model file as ci/fetch-models.sh caches it: $UPF_MODEL_DIR/file, else
 * $UPF_MODEL_CACHE/models/file, else ~/.cache/uniprefill/models/file, written into buf. Returns buf
 * when the file is readable, else NULL after printing the skip line of suite/test. */
const char *upf_test_model_file(char *buf, size_t cap, const char *file, const char *suite, const char *test);

/* The python of the venv with gguf-py: $UPF_GGUF_PYTHON, else $UPF_MODEL_CACHE/venv/bin/python, else
 * ~/.cache/uniprefill/venv/bin/python, written into buf. Returns buf when it is executable, else NULL
 * after printing the skip line of suite/test. */
const char *upf_test_gguf_python(char *buf, size_t cap, const char *suite, const char *test);

/* The number of entries of a directory other than . and .., -1 when it cannot be read (a failed write
 * must leave no temporary file behind). */
int upf_test_count_entries(const char *dir);

/* The CPU backend table under another address and name ("cpu-twin"): the verify harness treats it as
 * a backend under test, so its seeded cases run without a GPU. */
const upf_backend *upf_test_cpu_twin(void);

/* Element i of f32 or bf16 data, as a double; x stored into element i (bf16 rounded to nearest even). */
double upf_test_value(const void *data, upf_dtype dt, int64_t i);
void upf_test_store(void *data, upf_dtype dt, int64_t i, float x);
/* A tensor descriptor over host data (shapes the test chose: valid by construction). */
upf_tensor upf_test_view(void *data, upf_dtype dt, int ndim, const int64_t *shape);

/* Runs op's quick verify set on `be` and asserts that no check failed and that more than `min_passed`
 * passed; after a failure it runs the set again with every check printed. */
void upf_test_verify_op(upf_op op, const upf_backend *be, int min_passed);

#endif

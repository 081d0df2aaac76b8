/* PLACEHOLDER (being written) */
#include <CUnit/CUnit.h>
void upf_register_model_sparse_tests(void) {}

/* PLACEHOLDER (being written) */
#include <CUnit/CUnit.h>
void upf_register_sparse_tests(void) {}

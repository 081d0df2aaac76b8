/* PLACEHOLDER (being written) */
#include <CUnit/CUnit.h>
void upf_register_cli_sparse_tests(void) {}

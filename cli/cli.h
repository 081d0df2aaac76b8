/* Pieces of the upf CLI shared between its source files. */
#ifndef UNIPREFILL_CLI_H
#define UNIPREFILL_CLI_H

#include <stdio.h>

#include "uniprefill/backend.h"

/* Prints "upf: what: message (STATUS)" to stderr and returns exit code 1. */
int upf_cli_error(upf_status st, const char *what);
/* cuda when its probe passes, else cpu. */
const upf_backend *upf_cli_default_backend(void);
/* Runs verify with one line per check on `log`; returns the number of failed checks. */
int upf_cli_verify(const upf_backend *be, const char *filter, int quick, FILE *log);
/* `upf report`: verify + benchmarks + summary. */
int upf_cli_report(int argc, char **argv);

#endif

/* Pieces of the upf CLI shared between its source files (a subcommand in a file of its own adds its
 * entry point here and a row to the command table of cli/upf.c; cli/args.h parses its flags). */
#ifndef UNIPREFILL_CLI_H
#define UNIPREFILL_CLI_H

#include <stdio.h>

#include "uniprefill/backend.h"
#include "uniprefill/comm.h"

/* Prints "upf <what>: message (STATUS)" to stderr, what naming the command and the flag at fault
 * ("select: --q"), and returns exit code 1. */
int upf_cli_error(upf_status st, const char *what);
/* cuda when its probe passes, else cpu. */
const upf_backend *upf_cli_default_backend(void);
/* Runs verify with one line per check on `log`; returns the number of failed checks. */
int upf_cli_verify(const upf_backend *be, const char *filter, int quick, const char *case_filter, FILE *log);
/* `upf report`: verify + benchmarks + summary; its --help text. */
int upf_cli_report(int argc, char **argv);
extern const char upf_cli_report_usage[];
/* `upf models` and `upf prefill` (cli/prefill.c). */
int upf_cli_models(int argc, char **argv);
int upf_cli_prefill(int argc, char **argv);
extern const char upf_cli_models_usage[];
extern const char upf_cli_prefill_usage[];
/* `upf export` (cli/export.c). */
int upf_cli_export(int argc, char **argv);
extern const char upf_cli_export_usage[];
/* `upf serve-sim` (cli/serve.c). */
int upf_cli_serve(int argc, char **argv);
extern const char upf_cli_serve_usage[];
/* --comm KIND and --tp R of prefill and select (cli/tp.c): the communicator, NULL for one plain process
 * (single, R = 1). 0, with the message printed on this rank, when it cannot be created or R is not its
 * size. */
int upf_cli_tp_open(const char *cmd, const char *kind, int32_t tp, const upf_backend *be, upf_comm **out);
/* `upf generate` (cli/generate.c). */
int upf_cli_generate(int argc, char **argv);
extern const char upf_cli_generate_usage[];
/* `upf eval` (cli/eval.c): accuracy of UniPrefill against dense. */
int upf_cli_eval(int argc, char **argv);
extern const char upf_cli_eval_usage[];
/* `upf block-sparse` (cli/block_sparse.c): one FlashPrefill V2 attention layer on .npy inputs. */
int upf_cli_block_sparse(int argc, char **argv);
extern const char upf_cli_block_sparse_usage[];
/* `upf tokenize` (cli/tokenize.c). */
int upf_cli_tokenize(int argc, char **argv);
extern const char upf_cli_tokenize_usage[];

#endif

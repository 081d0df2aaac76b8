/* How a command that runs a prefill (upf prefill, upf generate, upf serve-sim) drops tokens, checked
 * alike by each: --mode dense|uniprefill, and in UniPrefill mode at most one of --p P (the top-p mass,
 * default the model's) and --keep R (top-k: the share of blocks kept), each in (0, 1]. A command puts
 * UPF_SELECT_ARG_FLAGS in its flag table and resolves them after parsing, before any work. */
#ifndef UNIPREFILL_CLI_SELECT_ARGS_H
#define UNIPREFILL_CLI_SELECT_ARGS_H

#include "cli/args.h"
#include "uniprefill/model.h"
#include "uniprefill/select.h"

typedef struct {
  /* the flags' values */
  const char *mode;
  float p, keep;
  /* set by upf_select_args_resolve */
  upf_prefill_mode prefill_mode;
  int p_given, keep_given;
} upf_select_args;

/* dense; the model's p. */
#define UPF_SELECT_ARGS_DEFAULT {.mode = "dense", .p = -1}

/* The entries of a command's upf_arg table (sa an lvalue of type upf_select_args). */
#define UPF_SELECT_ARG_FLAGS(sa) \
  {"--mode", UPF_ARG_STRING, &(sa).mode}, {"--p", UPF_ARG_FLOAT, &(sa).p}, {"--keep", UPF_ARG_FLOAT, &(sa).keep}

/* Checks the flags p parsed for `command` ("generate"): the mode's name, --p and --keep only with
 * --mode uniprefill and not both, each in (0, 1]. Returns 0 when all is well, else 2 after one line on
 * stderr naming the flag at fault. */
int upf_select_args_resolve(const char *command, const upf_arg_parser *p, upf_select_args *sa);

/* sel with the --p or --keep given in place of its own. */
void upf_select_args_apply(const upf_select_args *sa, upf_select_params *sel);

#endif

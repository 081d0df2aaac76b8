/* libFuzzer target: the CLI's argument parser (cli/args.c) over every command's own flag table. The
 * input is a command index byte, then NUL-separated arguments; cli/upf.c's main (built here as
 * upf_cli_main) dispatches to the command, whose upf_args_parse is wrapped (-Wl,--wrap): the real
 * parser runs, its result is checked against the table (values in range, required flags seen), and a
 * successful parse stops the command there (reported as --help), so no command does its work. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "cli/args.h"

int upf_cli_main(int argc, char **argv);
upf_args_result __real_upf_args_parse(upf_arg_parser *p, int argc, char **argv);

static const char *const commands[] = {"select",   "verify", "report", "ops",  "models",   "prefill",
                                       "export",   "serve-sim", "generate", "eval", "tokenize", "block-sparse"};

upf_args_result __wrap_upf_args_parse(upf_arg_parser *p, int argc, char **argv) {
  const upf_args_result r = __real_upf_args_parse(p, argc, argv);
  if (r != UPF_ARGS_OK)
    return r;
  if (p->num_positional < 0 || p->num_positional > p->max_positional)
    __builtin_trap();
  for (int i = 0; i < p->num_args; i++) {
    const upf_arg *a = &p->args[i];
    if (a->required && !a->seen)
      __builtin_trap();
    if (!a->seen)
      continue;
    if (a->kind == UPF_ARG_INT && (a->min || a->max)) {
      const int32_t v = *(const int32_t *)a->dest;
      if (v < a->min || v > a->max)
        __builtin_trap();
    } else if (a->kind == UPF_ARG_FLOAT && !isfinite(*(const float *)a->dest))
      __builtin_trap();
    else if (a->kind == UPF_ARG_STRING && !**(const char *const *)a->dest)
      __builtin_trap(); /* an empty value is refused */
  }
  return UPF_ARGS_HELP;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  enum { MAX_ARGS = 64 };
  if (size < 1 || size > 4096)
    return 0;
  char *buf = malloc(size); /* data[1..] with a NUL after the last argument */
  char *argv[MAX_ARGS + 3];
  int argc = 0;
  argv[argc++] = "upf";
  argv[argc++] = (char *)commands[data[0] % (sizeof commands / sizeof *commands)];
  memcpy(buf, data + 1, size - 1);
  buf[size - 1] = '\0';
  for (size_t i = 0; i < size - 1 && argc < MAX_ARGS + 2;) {
    argv[argc++] = buf + i;
    i += strlen(buf + i) + 1;
  }
  argv[argc] = NULL;
  (void)upf_cli_main(argc, argv);
  free(buf);
  return 0;
}

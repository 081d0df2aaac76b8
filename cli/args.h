/* The argument parser every upf subcommand uses, so that they all answer alike: --help prints the
 * command's usage on stdout and exits 0; a flag without its value, an unknown or repeated flag, a
 * number that is not one or is out of range, and a stray argument each get one line on stderr
 * naming the flag, and exit 2. Flags take their value as the next argument or as --flag=value. */
#ifndef UNIPREFILL_CLI_ARGS_H
#define UNIPREFILL_CLI_ARGS_H

#include <stdint.h>
#include <stdio.h>

typedef enum {
  UPF_ARG_SWITCH, /* no value; *(int *)dest = 1 */
  UPF_ARG_STRING, /* *(const char **)dest = the value */
  UPF_ARG_INT,    /* *(int32_t *)dest, within [min, max] */
  UPF_ARG_FLOAT,  /* *(float *)dest, finite and representable as a float */
} upf_arg_kind;

typedef struct {
  const char *name; /* "--q" */
  upf_arg_kind kind;
  void *dest;
  int required;
  int64_t min, max; /* UPF_ARG_INT only; both 0 means the whole int32 range */
  int seen;         /* set by the parser: 1 when the flag was given */
} upf_arg;

typedef struct {
  const char *command; /* "upf select": the prefix of every message */
  const char *usage;   /* the command's usage text, printed whole for --help */
  upf_arg *args;
  int num_args;
  /* Arguments that are not flags: at most max_positional of them are stored here, in order. */
  const char **positional;
  int max_positional;
  int num_positional; /* set by the parser */
} upf_arg_parser;

typedef enum {
  UPF_ARGS_OK = 0, /* parsed; the command runs */
  UPF_ARGS_HELP,   /* --help or -h: usage printed on stdout; exit 0 */
  UPF_ARGS_BAD,    /* message printed on stderr; exit 2 */
} upf_args_result;

upf_args_result upf_args_parse(upf_arg_parser *p, int argc, char **argv);
/* The exit code of a result other than UPF_ARGS_OK: 0 for help, 2 for a bad command line. */
int upf_args_exit_code(upf_args_result r);
/* The entry of p for `name`, or NULL. */
const upf_arg *upf_args_find(const upf_arg_parser *p, const char *name);

/* A path a command reads (is_output 0) or writes (is_output 1), and the flag that named it; is_dir:
 * a folder of files (--replay-masks, --dump-masks) rather than a file. */
typedef struct {
  const char *flag;
  const char *path; /* NULL when the flag was not given: skipped */
  int is_output;
  int is_dir;
} upf_arg_path;

/* Checks, before any work, that each output's directory exists and the output is not a directory,
 * and that no output names the same file as another output or an input: the same resolved path
 * (through links and ./ too) or the same file (device and inode: a hard link); nor lies inside an
 * input folder, nor is an output folder that holds an input. Prints a message naming both flags and
 * returns 0 on the first problem, 1 when all is well. */
int upf_args_check_paths(const char *command, const upf_arg_path *paths, int n);

/* Writes s to f as a JSON string: quotes and backslashes escaped, control characters as \u00XX. */
void upf_json_string(FILE *f, const char *s);

/* Writes the command line to f as one JSON string: prefix ("upf eval"), then each argument after a space. */
void upf_json_command(FILE *f, const char *prefix, int argc, char **argv);

/* Reads the whole file at path (a command's input given by flag) into a malloc'd buffer (not
 * terminated); 0 after one line on stderr naming the flag and the file when it cannot. */
int upf_args_read_file(const char *command, const char *flag, const char *path, char **text, int64_t *len);

#endif

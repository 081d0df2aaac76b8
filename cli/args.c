/* The subcommands' shared argument parser and the check of their input and output paths. */
#include "cli/args.h"

#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "uniprefill/output.h"

/* "upf select: <message> (see upf select --help)" on stderr; returns 0. */
static int bad(const upf_arg_parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(const upf_arg_parser *p, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", p->command);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, " (see %s --help)\n", p->command);
  va_end(ap);
  return 0;
}

static upf_arg *find(upf_arg_parser *p, const char *name, size_t len) {
  for (int i = 0; i < p->num_args; i++)
    if (strlen(p->args[i].name) == len && !strncmp(p->args[i].name, name, len))
      return &p->args[i];
  return NULL;
}

const upf_arg *upf_args_find(const upf_arg_parser *p, const char *name) {
  return find((upf_arg_parser *)p, name, strlen(name));
}

static int parse_int(const upf_arg_parser *p, upf_arg *a, const char *text) {
  char *end;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (end == text || *end)
    return bad(p, "%s: '%s' is not an integer", a->name, text);
  int64_t lo = a->min || a->max ? a->min : INT32_MIN, hi = a->min || a->max ? a->max : INT32_MAX;
  if (errno == ERANGE || v < lo || v > hi)
    return bad(p, "%s: %s is out of range [%lld, %lld]", a->name, text, (long long)lo, (long long)hi);
  *(int32_t *)a->dest = (int32_t)v;
  return 1;
}

static int parse_float(const upf_arg_parser *p, upf_arg *a, const char *text) {
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (end == text || *end)
    return bad(p, "%s: '%s' is not a number", a->name, text);
  if (isnan(v))
    return bad(p, "%s: '%s' is not a number", a->name, text);
  /* strtod's ERANGE is overflow, or underflow to a subnormal or zero: either way not the number given. */
  if (errno == ERANGE || isinf(v) || fabs(v) > FLT_MAX || (v != 0.0 && fabs(v) < FLT_MIN))
    return bad(p, "%s: %s is out of range (a float is about 1e-38 to 3e38 in magnitude, or 0)", a->name, text);
  *(float *)a->dest = (float)v;
  return 1;
}

static int is_help(const char *s) { return !strcmp(s, "--help") || !strcmp(s, "-h"); }

upf_args_result upf_args_parse(upf_arg_parser *p, int argc, char **argv) {
  p->num_positional = 0;
  for (int i = 0; i < p->num_args; i++)
    p->args[i].seen = 0;
  /* --help wins wherever it stands: whatever else is wrong, the user asked how to use the command. */
  for (int i = 0; i < argc; i++)
    if (is_help(argv[i])) {
      fputs(p->usage, stdout);
      return UPF_ARGS_HELP;
    }
  for (int i = 0; i < argc; i++) {
    const char *s = argv[i];
    if (s[0] != '-' || !strcmp(s, "-")) {
      if (p->num_positional == p->max_positional) {
        bad(p, "unexpected argument '%s'%s", s,
            p->max_positional ? "" : p->num_args ? " (this command takes only flags)" : " (this command takes none)");
        return UPF_ARGS_BAD;
      }
      p->positional[p->num_positional++] = s;
      continue;
    }
    const char *eq = s[1] == '-' ? strchr(s, '=') : NULL;
    upf_arg *a = find(p, s, eq ? (size_t)(eq - s) : strlen(s));
    if (!a) {
      bad(p, "unknown option %.*s", eq ? (int)(eq - s) : (int)strlen(s), s);
      return UPF_ARGS_BAD;
    }
    if (a->seen) {
      bad(p, "%s given twice", a->name);
      return UPF_ARGS_BAD;
    }
    a->seen = 1;
    if (a->kind == UPF_ARG_SWITCH) {
      if (eq) {
        bad(p, "%s takes no value (got '%s')", a->name, eq + 1);
        return UPF_ARGS_BAD;
      }
      *(int *)a->dest = 1;
      continue;
    }
    /* A following "--..." is the next flag, not this one's value: "--q --k k.npy" lacks q's value
     * (a value that starts with "--" can still be given as --q=--odd-name). */
    const int next_is_flag = i + 1 < argc && argv[i + 1][0] == '-' && argv[i + 1][1] == '-';
    const char *val = eq ? eq + 1 : i + 1 < argc && !next_is_flag ? argv[++i] : NULL;
    if (!val) {
      bad(p, "%s needs a value", a->name);
      return UPF_ARGS_BAD;
    }
    if (!*val) { /* given, as '' or --flag=: say so rather than call it missing */
      bad(p, "%s needs a value (the one given is empty)", a->name);
      return UPF_ARGS_BAD;
    }
    int ok = 1;
    if (a->kind == UPF_ARG_STRING)
      *(const char **)a->dest = val;
    else if (a->kind == UPF_ARG_INT)
      ok = parse_int(p, a, val);
    else
      ok = parse_float(p, a, val);
    if (!ok)
      return UPF_ARGS_BAD;
  }
  for (int i = 0; i < p->num_args; i++)
    if (p->args[i].required && !p->args[i].seen) {
      bad(p, "%s is required", p->args[i].name);
      return UPF_ARGS_BAD;
    }
  return UPF_ARGS_OK;
}

int upf_args_exit_code(upf_args_result r) { return r == UPF_ARGS_HELP ? 0 : 2; }

/* 1 when canonical path `inner` lies under the folder `outer`. */
static int inside(const char *inner, const char *outer) {
  const size_t n = strlen(outer);
  return !strncmp(inner, outer, n) && (inner[n] == '/' || (n == 1 && outer[0] == '/'));
}

int upf_args_check_paths(const char *command, const upf_arg_path *paths, int n) {
  char **canon = calloc((size_t)(n ? n : 1), sizeof *canon);
  struct stat *id = calloc((size_t)(n ? n : 1), sizeof *id);
  int *has_id = calloc((size_t)(n ? n : 1), sizeof *has_id);
  if (!canon || !id || !has_id) {
    fprintf(stderr, "%s: out of memory checking the paths\n", command);
    free(canon), free(id), free(has_id);
    return 0;
  }
  int ok = 1;
  for (int i = 0; i < n && ok; i++) {
    const upf_arg_path *a = &paths[i];
    if (!a->path)
      continue;
    canon[i] = upf_path_canonical(a->path);
    has_id[i] = stat(a->path, &id[i]) == 0;
    /* What the writers accept (uniprefill/output.h): a new path, a regular file or a link to one, a
     * FIFO or a character device. */
    struct stat ls, st;
    int exists = a->is_output && lstat(a->path, &ls) == 0, reaches = exists && stat(a->path, &st) == 0;
    if (a->is_output && !canon[i]) {
      fprintf(stderr, "%s: %s %s: its directory does not exist or cannot be searched (%s)\n", command, a->flag,
              a->path, strerror(errno));
      ok = 0;
    } else if (exists && !reaches) {
      fprintf(stderr, "%s: %s %s is a symbolic link that leads nowhere\n", command, a->flag, a->path);
      ok = 0;
    } else if (reaches && !a->is_dir && !S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) && !S_ISCHR(st.st_mode)) {
      fprintf(stderr, "%s: %s %s is %s, not a file\n", command, a->flag, a->path,
              S_ISDIR(st.st_mode) ? "a directory" : S_ISBLK(st.st_mode) ? "a block device" : "a socket");
      ok = 0;
    }
    /* A missing input is not an error here: reading it says so, naming it. */
    for (int j = 0; j < i && ok; j++) {
      const upf_arg_path *b = &paths[j];
      if (!b->path || (!a->is_output && !b->is_output))
        continue;
      /* a device (/dev/null given twice) is no file to overwrite */
      const int same_file = has_id[i] && has_id[j] && id[i].st_dev == id[j].st_dev && id[i].st_ino == id[j].st_ino &&
                            !S_ISCHR(id[i].st_mode) && !S_ISFIFO(id[i].st_mode);
      const int same_path = canon[i] && canon[j] && !strcmp(canon[i], canon[j]);
      if (same_file || same_path) {
        fprintf(stderr, "%s: %s %s and %s %s name one %s%s\n", command, b->flag, b->path, a->flag, a->path,
                a->is_dir ? "folder" : "file",
                a->is_output && b->is_output ? "" : ": the output would overwrite the input; refusing");
        ok = 0;
        continue;
      }
      if (!canon[i] || !canon[j])
        continue;
      const upf_arg_path *in = a->is_output ? b : a, *out = a->is_output ? a : b;
      const char *cin = a->is_output ? canon[j] : canon[i], *cout = a->is_output ? canon[i] : canon[j];
      if (a->is_output && b->is_output)
        continue;
      if (in->is_dir && inside(cout, cin)) {
        fprintf(stderr, "%s: %s %s lies inside the %s folder %s: the output could overwrite an input; refusing\n",
                command, out->flag, out->path, in->flag, in->path);
        ok = 0;
      } else if (out->is_dir && inside(cin, cout)) {
        fprintf(stderr, "%s: %s %s lies inside the %s folder %s, which the run writes into; refusing\n", command,
                in->flag, in->path, out->flag, out->path);
        ok = 0;
      }
    }
  }
  for (int i = 0; i < n; i++)
    free(canon[i]);
  free(canon), free(id), free(has_id);
  return ok;
}

int upf_args_read_file(const char *command, const char *flag, const char *path, char **text, int64_t *len) {
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) { /* fopen takes a directory; only its reads fail */
    fprintf(stderr, "%s: %s %s: is a directory, not a file\n", command, flag, path);
    return 0;
  }
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "%s: %s %s: cannot open it (%s)\n", command, flag, path, strerror(errno));
    return 0;
  }
  int64_t n = 0, cap = 1 << 16;
  char *buf = malloc((size_t)cap);
  size_t got;
  while (buf && (got = fread(buf + n, 1, (size_t)(cap - n), f)) > 0) {
    n += (int64_t)got;
    if (n == cap) {
      char *p = realloc(buf, (size_t)cap * 2);
      if (!p)
        free(buf);
      buf = p, cap *= 2;
    }
  }
  int bad = !buf || ferror(f);
  int err = errno;
  fclose(f);
  if (bad) {
    fprintf(stderr, "%s: %s %s: cannot read it (%s)\n", command, flag, path, buf ? strerror(err) : "out of memory");
    free(buf);
    return 0;
  }
  *text = buf, *len = n;
  return 1;
}

static void json_chars(FILE *f, const char *s) {
  for (; *s; s++) {
    if (*s == '"' || *s == '\\')
      fputc('\\', f), fputc(*s, f);
    else if ((unsigned char)*s < 0x20)
      fprintf(f, "\\u%04x", *s);
    else
      fputc(*s, f);
  }
}

void upf_json_string(FILE *f, const char *s) {
  fputc('"', f);
  json_chars(f, s);
  fputc('"', f);
}

void upf_json_command(FILE *f, const char *prefix, int argc, char **argv) {
  fputc('"', f);
  json_chars(f, prefix);
  for (int i = 0; i < argc; i++)
    fputc(' ', f), json_chars(f, argv[i]);
  fputc('"', f);
}

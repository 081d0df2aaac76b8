/* The harness of the CLI suites (tests/cli_harness.h). */
#include "tests/cli_harness.h"

#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "uniprefill/npy.h"

int cli_setup(cli_suite *s, const char *prefix) {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return 1;
  self[n] = '\0';
  snprintf(s->upf, sizeof s->upf, "%s/upf", dirname(self));
  snprintf(s->dir, sizeof s->dir, "/tmp/%s_XXXXXX", prefix);
  s->num_paths = 0;
  s->last_args[0] = '\0';
  return mkdtemp(s->dir) ? 0 : 1;
}

int cli_teardown(cli_suite *s) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
  return system(cmd) == 0 ? 0 : 1;
}

const char *cli_path(cli_suite *s, const char *name) {
  const size_t skip = strlen(s->dir) + 1;
  for (int i = 0; i < s->num_paths; i++)
    if (!strcmp(s->paths[i] + skip, name))
      return s->paths[i];
  if (s->num_paths == CLI_MAX_PATHS ||
      snprintf(s->paths[s->num_paths], sizeof s->paths[0], "%s/%s", s->dir, name) >= (int)sizeof s->paths[0]) {
    printf("\n    cli_path: no room for '%s'\n", name);
    return "/nonexistent/cli-path-too-long-or-too-many";
  }
  return s->paths[s->num_paths++];
}

int cli_run(cli_suite *s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->last_args, sizeof s->last_args, fmt, ap);
  va_end(ap);
  char cmd[PATH_MAX + sizeof s->last_args + 256];
  if (s->run_in_dir)
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s 2>stderr.txt >stdout.txt", s->dir, s->upf, s->last_args);
  else
    snprintf(cmd, sizeof cmd, "'%s' %s 2>'%s/stderr.txt' >'%s/stdout.txt'", s->upf, s->last_args, s->dir, s->dir);
  const int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

int cli_exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* The whole file as a terminated string (malloc'd), or NULL. */
static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    n += fread(buf + n, 1, cap - 1 - n, f);
    if (n < cap - 1)
      break;
    char *grown = realloc(buf, cap * 2);
    if (!grown)
      free(buf);
    buf = grown, cap *= 2;
  }
  fclose(f);
  if (buf)
    buf[n] = '\0';
  return buf;
}

int cli_file_contains(const char *path, const char *needle) {
  char *text = read_text(path);
  const int found = text && strstr(text, needle) != NULL;
  free(text);
  return found;
}

static const char *stream_path(cli_suite *s, const char *stream) {
  return cli_path(s, strcmp(stream, "stdout") ? "stderr.txt" : "stdout.txt");
}

int cli_stderr_has(cli_suite *s, const char *needle) { return cli_file_contains(stream_path(s, "stderr"), needle); }
int cli_stdout_has(cli_suite *s, const char *needle) { return cli_file_contains(stream_path(s, "stdout"), needle); }

int cli_expect(cli_suite *s, const char *stream, const char *needle) {
  char *text = read_text(stream_path(s, stream));
  const int found = text && strstr(text, needle) != NULL;
  if (!found)
    printf("\n    expected '%s' in the %s of: upf %s\n    got: %.2000s\n", needle, stream, s->last_args,
           text ? text : "(nothing)");
  free(text);
  return found;
}

int cli_same_npy(const char *a, const char *b) {
  upf_tensor x, y;
  if (upf_npy_read(a, &x) != UPF_OK)
    return 0;
  if (upf_npy_read(b, &y) != UPF_OK)
    return upf_tensor_free(&x), 0;
  int same = x.dtype == y.dtype && x.ndim == y.ndim;
  for (int d = 0; same && d < x.ndim; d++)
    same = x.shape[d] == y.shape[d];
  same = same && !memcmp(x.data, y.data, (size_t)upf_tensor_numel(&x) * upf_dtype_size(x.dtype));
  upf_tensor_free(&x), upf_tensor_free(&y);
  return same;
}

int cli_write_text(cli_suite *s, const char *name, const char *text) {
  FILE *f = fopen(cli_path(s, name), "w");
  if (!f)
    return 0;
  const int ok = fputs(text, f) >= 0;
  return (fclose(f) == 0) & ok;
}

int cli_write_i32(const char *path, const int32_t *v, int64_t n) {
  upf_tensor t;
  return upf_tensor_init(&t, (void *)v, UPF_DTYPE_I32, 1, &n) == UPF_OK && upf_npy_write(path, &t) == UPF_OK;
}

/* Test helpers shared by several suites: the real model files and gguf-py's venv that
 * ci/fetch-models.sh caches outside git, the line that names a skipped test, and the count of a
 * directory's entries. */
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/test_util.h"

#include "uniprefill/bf16.h"

void upf_test_skip(const char *suite, const char *test, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("\n  SKIPPED %s/%s: ", suite, test);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
}

int upf_test_skip_quick(const char *suite, const char *test, const char *why) {
  if (!upf_test_quick())
    return 0;
  upf_test_skip(suite, test, "quick mode: %s", why);
  return 1;
}

/* path under the cache of ci/fetch-models.sh: $UPF_MODEL_CACHE, default ~/.cache/uniprefill. */
static void in_cache(char *buf, size_t cap, const char *path) {
  const char *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
  if (cache && *cache)
    snprintf(buf, cap, "%s/%s", cache, path);
  else
    snprintf(buf, cap, "%s/.cache/uniprefill/%s", home ? home : "", path);
}

const char *upf_test_model_file(char *buf, size_t cap, const char *file, const char *suite, const char *test) {
  const char *dir = getenv("UPF_MODEL_DIR");
  if (dir && *dir)
    snprintf(buf, cap, "%s/%s", dir, file);
  else {
    char models[4096];
    snprintf(models, sizeof models, "models/%s", file);
    in_cache(buf, cap, models);
  }
  if (access(buf, R_OK) != 0) {
    upf_test_skip(suite, test, "%s is absent (ci/fetch-models.sh fetches it; UPF_MODEL_DIR or UPF_MODEL_CACHE choose "
                  "the directory)", buf);
    return NULL;
  }
  return buf;
}

const char *upf_test_gguf_python(char *buf, size_t cap, const char *suite, const char *test) {
  const char *env = getenv("UPF_GGUF_PYTHON");
  if (env && *env)
    snprintf(buf, cap, "%s", env);
  else
    in_cache(buf, cap, "venv/bin/python");
  if (access(buf, X_OK) != 0) {
    upf_test_skip(suite, test, "no gguf-py venv at %s (ci/fetch-models.sh creates it; UPF_GGUF_PYTHON or "
                  "UPF_MODEL_CACHE choose it)", buf);
    return NULL;
  }
  return buf;
}

int upf_test_count_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
  closedir(d);
  return n;
}

double upf_test_value(const void *data, upf_dtype dt, int64_t i) {
  return dt == UPF_DTYPE_BF16 ? (double)upf_bf16_to_f32(((const uint16_t *)data)[i]) : (double)((const float *)data)[i];
}

void upf_test_store(void *data, upf_dtype dt, int64_t i, float x) {
  if (dt == UPF_DTYPE_BF16)
    ((uint16_t *)data)[i] = upf_bf16_from_f32(x);
  else
    ((float *)data)[i] = x;
}

upf_tensor upf_test_view(void *data, upf_dtype dt, int ndim, const int64_t *shape) {
  upf_tensor t;
  upf_tensor_init(&t, data, dt, ndim, shape);
  return t;
}

/* `upf tokenize` end to end, on a tiny byte-level BPE GGUF written by the GGUF writer
 * (upf_test_tiny_tokenizer_gguf in tests/test_tokenizer.c: "hello world!" is <|im_start|> hello
 * Ġworld !, ids 1 13 18 19): the printed ids and the .npy agree with the library, --decode gives
 * the text back, and every bad input exits non-zero naming it and leaves no output file. Runs the
 * upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test_util.h"
#include "uniprefill/gguf.h"
#include "uniprefill/npy.h"

upf_gguf_writer *upf_test_tiny_tokenizer_gguf(const char *pre);

static char upf_path[PATH_MAX];
static char dir[64];
static char path_buf[8][192];

static const char *in_dir(int slot, const char *name) {
  snprintf(path_buf[slot], sizeof path_buf[slot], "%s/%s", dir, name);
  return path_buf[slot];
}

static int setup(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return 1;
  self[n] = '\0';
  snprintf(upf_path, sizeof upf_path, "%s/upf", dirname(self));
  snprintf(dir, sizeof dir, "/tmp/upf_cli_tok_XXXXXX");
  if (!mkdtemp(dir))
    return 1;
  upf_gguf_writer *w = upf_test_tiny_tokenizer_gguf("smollm");
  upf_gguf_writer *bare = NULL;
  int bad = !w || upf_gguf_writer_write(w, in_dir(0, "tiny.gguf")) != UPF_OK;
  bad = bad || upf_gguf_writer_create(&bare) != UPF_OK || upf_gguf_set_str(bare, "general.architecture", "llama") ||
        upf_gguf_writer_write(bare, in_dir(0, "notok.gguf")) != UPF_OK;
  upf_gguf_writer_free(w);
  upf_gguf_writer_free(bare);
  FILE *f = fopen(in_dir(0, "text.txt"), "w");
  FILE *g = fopen(in_dir(0, "plain.txt"), "w"), *e = fopen(in_dir(0, "empty.txt"), "w");
  if (e)
    fclose(e);
  bad = bad || !f || !g || !e || fputs("<|im_start|>hello world!", f) < 0 || fputs("not a gguf\n", g) < 0;
  if (f)
    fclose(f);
  if (g)
    fclose(g);
  return bad;
}

static int teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : 1;
}

static int run(const char *args) {
  char cmd[PATH_MAX + 2048];
  snprintf(cmd, sizeof cmd, "cd %s && '%s' tokenize %s 2>stderr.txt >stdout.txt", dir, upf_path, args);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int contains(const char *name, const char *needle) {
  static char buf[1 << 14];
  FILE *f = fopen(in_dir(7, name), "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = '\0';
  int ok = strstr(buf, needle) != NULL;
  if (!ok)
    printf("\n  %s lacks \"%s\": %s", name, needle, buf);
  return ok;
}

static int exists(const char *name) {
  struct stat st;
  return stat(in_dir(6, name), &st) == 0;
}

static void test_tokenize_text_and_file(void) {
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --text 'hello world!' --out ids.npy"), 0);
  CU_ASSERT(contains("stdout.txt", "count: 4\nids: 1 13 18 19\n"));
  upf_tensor t = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(in_dir(1, "ids.npy"), &t), UPF_OK);
  CU_ASSERT(t.dtype == UPF_DTYPE_I32 && t.ndim == 1 && t.shape[0] == 4);
  if (t.dtype == UPF_DTYPE_I32 && t.shape[0] == 4) {
    const int32_t *v = t.data;
    CU_ASSERT(v[0] == 1 && v[1] == 13 && v[2] == 18 && v[3] == 19);
  }
  upf_tensor_free(&t);
  /* the BOS the file asks for, left out; a special token in the file's text parsed, or not */
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --no-bos --file text.txt"), 0);
  CU_ASSERT(contains("stdout.txt", "count: 4\nids: 1 13 18 19\n"));
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --no-bos --no-parse-special --file text.txt"), 0);
  CU_ASSERT(contains("stdout.txt", "ids: 8 13 18 19\n")); /* "<|im_start|>" as text: only its r is a token */
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --file empty.txt"), 0);
  CU_ASSERT(contains("stdout.txt", "count: 1\nids: 1\n"));
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --decode ids.npy"), 0);
  CU_ASSERT(contains("stdout.txt", "<|im_start|>hello world!"));
}

static void test_bad_inputs(void) {
  static const struct {
    const char *args;
    int code;
    const char *message;
  } bad[] = {
      {"--gguf missing.gguf --text hi --out out.npy", 1, "--gguf"},
      {"--gguf plain.txt --text hi --out out.npy", 1, "--gguf"},
      {"--gguf notok.gguf --text hi --out out.npy", 1, "no tokenizer"},
      {"--gguf tiny.gguf --file missing.txt --out out.npy", 1, "--file missing.txt"},
      {"--gguf tiny.gguf --file . --out out.npy", 1, "--file"},
      {"--gguf tiny.gguf --text hi --file text.txt --out out.npy", 2, "exactly one of --text, --file and --decode"},
      {"--gguf tiny.gguf --out out.npy", 2, "exactly one of"},
      {"--gguf tiny.gguf --decode ids.npy --out out.npy", 2, "--decode takes no --out"},
      {"--gguf tiny.gguf --decode bad_ids.npy", 1, "ids[1] = 20"},
      {"--gguf tiny.gguf --decode text.txt", 1, "--decode"},
      {"--gguf tiny.gguf --text hi --out nodir/out.npy", 2, "--out"},
      {"--text hi", 2, "--gguf"},
  };
  int32_t v[2] = {13, 20};
  int64_t shape[1] = {2};
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_init(&t, v, UPF_DTYPE_I32, 1, shape), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_write(in_dir(1, "bad_ids.npy"), &t), UPF_OK);
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --text 'hello' --out ids.npy"), 0);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int code = run(bad[i].args);
    CU_ASSERT_EQUAL(code, bad[i].code);
    if (code != bad[i].code)
      printf("\n  upf tokenize %s: exit %d, want %d", bad[i].args, code, bad[i].code);
    CU_ASSERT(contains("stderr.txt", bad[i].message));
    CU_ASSERT(!exists("out.npy"));
  }
  CU_ASSERT_EQUAL(run("--help"), 0);
  CU_ASSERT(contains("stdout.txt", "usage: upf tokenize"));
}

static CU_TestInfo tests[] = {
    {"text, file, special tokens, .npy and --decode", test_tokenize_text_and_file},
    {"bad inputs exit non-zero, name the input and leave no file", test_bad_inputs},
    CU_TEST_INFO_NULL,
};

void upf_register_cli_tokenize_tests(void) { upf_test_suite("cli tokenize", setup, teardown, tests); }

/* `upf export` and `upf prefill --gguf` end to end: an exported seeded model prefills to the same
 * logits as the built-in one; every bad input exits non-zero naming the flag, and export leaves no
 * file behind. Runs the upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <libgen.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test_util.h"
#include "uniprefill/npy.h"

static char upf_path[PATH_MAX];
static char dir[64];

static int setup(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return 1;
  self[n] = '\0';
  snprintf(upf_path, sizeof upf_path, "%s/upf", dirname(self));
  snprintf(dir, sizeof dir, "/tmp/upf_cli_gguf_XXXXXX");
  return mkdtemp(dir) ? 0 : 1;
}

static int teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : 1;
}

static const char *in_dir(const char *name) {
  static char paths[16][128];
  static int next;
  char *p = paths[next++ % 16];
  snprintf(p, 128, "%s/%s", dir, name);
  return p;
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* Runs upf with printf-style arguments; stderr to dir/stderr.txt. Returns the exit status. */
static int run_upf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char last_args[4096];
static int run_upf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_args, sizeof last_args, fmt, ap);
  va_end(ap);
  char cmd[PATH_MAX + 4096 + 256];
  snprintf(cmd, sizeof cmd, "'%s' %s 2>%s/stderr.txt >%s/stdout.txt", upf_path, last_args, dir, dir);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int stderr_contains(const char *needle) {
  static char buf[1 << 16];
  FILE *f = fopen(in_dir("stderr.txt"), "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = '\0';
  if (!strstr(buf, needle))
    printf("\n    expected '%s' in the stderr of: upf %s (got: %s)", needle, last_args, buf);
  return strstr(buf, needle) != NULL;
}

static int same_file(const char *a, const char *b) {
  upf_tensor x, y;
  if (upf_npy_read(a, &x) != UPF_OK)
    return 0;
  if (upf_npy_read(b, &y) != UPF_OK)
    return upf_tensor_free(&x), 0;
  const int same = x.dtype == y.dtype && upf_tensor_numel(&x) == upf_tensor_numel(&y) &&
                   !memcmp(x.data, y.data, (size_t)upf_tensor_numel(&x) * upf_dtype_size(x.dtype));
  upf_tensor_free(&x), upf_tensor_free(&y);
  return same;
}

/* llama: every transform of the file is a move (transpose, permutation), so the file prefills to the
 * built-in model's logits bit for bit, in bf16 and f32 (dense: UniPrefill on the file uses the drop
 * layers and selection scaled for a file, not the tiny config's). */
static void test_export_then_prefill(void) {
  const char *dtypes[] = {"bf16", "f32"};
  for (int d = 0; d < (upf_test_quick() ? 1 : 2); d++) {
    char file[128];
    snprintf(file, sizeof file, "%s", in_dir(d ? "llama-f32.gguf" : "llama-bf16.gguf"));
    CU_ASSERT_EQUAL_FATAL(run_upf("export --model llama-tiny --seed 4 --dtype %s --out %s", dtypes[d], file), 0);
    CU_ASSERT(exists(file));
    for (int mode = 0; mode < 2; mode++) {
      const char *m = mode ? "--mode uniprefill" : "--mode dense";
      if (mode) { /* runs, with the file's drop layers */
        CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --lengths 150 --backend cpu --dtype %s %s --json %s", file,
                                dtypes[d], m, in_dir("u.json")), 0);
        continue;
      }
      CU_ASSERT_EQUAL(run_upf("prefill --model llama-tiny --seed 4 --lengths 150 --backend cpu --dtype %s %s "
                              "--out-logits %s", dtypes[d], m, in_dir("a.npy")), 0);
      /* --seed draws the same ids for --lengths; the file's weights replace the seeded ones */
      CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --seed 4 --lengths 150 --backend cpu --dtype %s %s --out-logits %s",
                              file, dtypes[d], m, in_dir("b.npy")), 0);
      CU_ASSERT(same_file(in_dir("a.npy"), in_dir("b.npy")));
    }
  }
}

static void test_export_bad_inputs(void) {
  char out[128];
  snprintf(out, sizeof out, "%s", in_dir("bad.gguf"));
  CU_ASSERT_EQUAL(run_upf("export --model no-such-model --out %s", out), 2);
  CU_ASSERT(stderr_contains("--model") && stderr_contains("llama-tiny"));
  CU_ASSERT_EQUAL(run_upf("export --model llama-tiny --dtype f16 --out %s", out), 2);
  CU_ASSERT(stderr_contains("--dtype 'f16'"));
  CU_ASSERT_EQUAL(run_upf("export --model llama-tiny"), 2);
  CU_ASSERT(stderr_contains("--out"));
  CU_ASSERT_EQUAL(run_upf("export --model llama-tiny --out %s/no/such/dir/x.gguf", dir), 2);
  CU_ASSERT(stderr_contains("--out"));
  CU_ASSERT_EQUAL(run_upf("export --model llama-tiny --out %s", dir), 2); /* a directory */
  CU_ASSERT(stderr_contains("--out"));
  CU_ASSERT(!exists(out));
  CU_ASSERT_EQUAL(run_upf("export --model llama-tiny --seed -1 --out %s", out), 2);
  CU_ASSERT(stderr_contains("--seed"));
  CU_ASSERT(!exists(out));
}

static void test_prefill_gguf_bad_inputs(void) {
  char file[128];
  snprintf(file, sizeof file, "%s", in_dir("ok.gguf"));
  CU_ASSERT_EQUAL_FATAL(run_upf("export --model gemma3-tiny --out %s", file), 0);
  CU_ASSERT_EQUAL(run_upf("prefill --model gemma3-tiny --gguf %s --lengths 10 --backend cpu", file), 2);
  CU_ASSERT(stderr_contains("exactly one of --model"));
  CU_ASSERT_EQUAL(run_upf("prefill --lengths 10 --backend cpu"), 2);
  CU_ASSERT(stderr_contains("exactly one of --model"));
  CU_ASSERT_NOT_EQUAL(run_upf("prefill --gguf %s/none.gguf --lengths 10 --backend cpu", dir), 0);
  CU_ASSERT(stderr_contains("prefill: --gguf") && stderr_contains("none.gguf"));
  FILE *f = fopen(in_dir("junk.gguf"), "w");
  CU_ASSERT_FATAL(f != NULL);
  fputs("GGUF but not really a model file", f);
  fclose(f);
  CU_ASSERT_NOT_EQUAL(run_upf("prefill --gguf %s --lengths 10 --backend cpu", in_dir("junk.gguf")), 0);
  CU_ASSERT(stderr_contains("prefill: --gguf") && stderr_contains("junk.gguf"));
  /* a file of an architecture the loader does not take */
  CU_ASSERT_EQUAL_FATAL(run_upf("export --model qwen3-next-tiny --out %s", in_dir("q.gguf")), 0);
  CU_ASSERT_NOT_EQUAL(run_upf("prefill --gguf %s --lengths 10 --backend cpu", in_dir("q.gguf")), 0);
  CU_ASSERT(stderr_contains("qwen3next"));
  /* ids beyond the file's vocabulary (512), and a layer range beyond its layers (9) */
  int32_t ids[3] = {1, 600, 2};
  upf_tensor t;
  const int64_t shape[1] = {3};
  upf_tensor_init(&t, ids, UPF_DTYPE_I32, 1, shape);
  CU_ASSERT_FATAL(upf_npy_write(in_dir("ids.npy"), &t) == UPF_OK);
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --token-ids %s --backend cpu", file, in_dir("ids.npy")), 2);
  CU_ASSERT(stderr_contains("id 600 at 1 is outside the vocabulary [0, 512)"));
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --lengths 10 --layers 0:12 --backend cpu", file), 2);
  CU_ASSERT(stderr_contains("0 <= A < B <= 9"));
  /* and a good partial run of the file */
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --lengths 40 --layers 2:5 --backend cpu --json %s", file,
                          in_dir("r.json")), 0);
  CU_ASSERT(exists(in_dir("r.json")));
}

/* The real SmolLM2 file (UPF_MODEL_DIR, else ~/.cache/uniprefill/models), NULL when absent or quick. */
static const char *smollm2_file(const char *test) {
  static char path[PATH_MAX];
  const char *d = getenv("UPF_MODEL_DIR"), *home = getenv("HOME");
  if (d && *d)
    snprintf(path, sizeof path, "%s/SmolLM2-135M-Instruct.Q4_1.gguf", d);
  else
    snprintf(path, sizeof path, "%s/.cache/uniprefill/models/SmolLM2-135M-Instruct.Q4_1.gguf", home ? home : "");
  if (upf_test_quick() || !exists(path)) {
    printf("SKIPPED cli gguf/%s: %s ", test, upf_test_quick() ? "quick mode" : "no SmolLM2 file (ci/fetch-models.sh)");
    return NULL;
  }
  return path;
}

/* --text / --file: the file's tokenizer then the model, equal to `upf tokenize` then --token-ids, for
 * prefill and generate; every misuse named. */
static void test_text_prompts(void) {
  char file[128];
  snprintf(file, sizeof file, "%s", in_dir("tiny.gguf"));
  CU_ASSERT_EQUAL_FATAL(run_upf("export --model llama-tiny --out %s", file), 0);
  CU_ASSERT_EQUAL(run_upf("prefill --model llama-tiny --text hello --backend cpu"), 2);
  CU_ASSERT(stderr_contains("--text needs --gguf"));
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --text hello --lengths 4 --backend cpu", file), 2);
  CU_ASSERT(stderr_contains("exactly one of --lengths, --token-ids, --text and --file"));
  CU_ASSERT_EQUAL(run_upf("generate --gguf %s --text hello --file %s --max-new 2 --backend cpu", file, file), 2);
  CU_ASSERT(stderr_contains("exactly one of --token-ids, --text and --file"));
  CU_ASSERT_NOT_EQUAL(run_upf("prefill --gguf %s --file %s/none.txt --backend cpu", file, dir), 0);
  CU_ASSERT(stderr_contains("--file") && stderr_contains("none.txt"));
  /* an exported seeded model has no usable tokenizer */
  CU_ASSERT_NOT_EQUAL(run_upf("generate --gguf %s --text hello --max-new 2 --backend cpu --out-tokens %s", file,
                              in_dir("t.npy")), 0);
  CU_ASSERT(stderr_contains("tokenizer"));
  CU_ASSERT(!exists(in_dir("t.npy")));

  const char *real = smollm2_file("text prompts");
  if (!real)
    return;
  const char *text = "The capital of France is";
  FILE *f = fopen(in_dir("prompt.txt"), "w");
  CU_ASSERT_FATAL(f != NULL);
  fputs(text, f);
  fclose(f);
  CU_ASSERT_EQUAL_FATAL(run_upf("tokenize --gguf %s --text '%s' --out %s", real, text, in_dir("ids.npy")), 0);
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --text '%s' --backend cpu --dtype f32 --out-logits %s", real, text,
                          in_dir("l1.npy")), 0);
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --file %s --backend cpu --dtype f32 --out-logits %s", real,
                          in_dir("prompt.txt"), in_dir("l2.npy")), 0);
  CU_ASSERT_EQUAL(run_upf("prefill --gguf %s --token-ids %s --backend cpu --dtype f32 --out-logits %s", real,
                          in_dir("ids.npy"), in_dir("l3.npy")), 0);
  CU_ASSERT(same_file(in_dir("l1.npy"), in_dir("l3.npy")));
  CU_ASSERT(same_file(in_dir("l2.npy"), in_dir("l3.npy")));
  CU_ASSERT_EQUAL(run_upf("generate --gguf %s --text '%s' --max-new 4 --backend cpu --dtype f32 --out-tokens %s", real,
                          text, in_dir("g1.npy")), 0);
  CU_ASSERT_EQUAL(run_upf("generate --gguf %s --token-ids %s --max-new 4 --backend cpu --dtype f32 --out-tokens %s",
                          real, in_dir("ids.npy"), in_dir("g2.npy")), 0);
  CU_ASSERT(same_file(in_dir("g1.npy"), in_dir("g2.npy")));
}

void upf_register_cli_gguf_tests(void) {
  static const CU_TestInfo tests[] = {
      {"export then prefill --gguf", test_export_then_prefill},
      {"export bad inputs", test_export_bad_inputs},
      {"prefill --gguf bad inputs", test_prefill_gguf_bad_inputs},
      {"--text and --file prompts", test_text_prompts},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("cli gguf", setup, teardown, tests);
}

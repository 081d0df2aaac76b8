/* The upf CLI end to end: a good `upf select` writes the mask the library computes; every bad
 * input exits non-zero with a message and leaves no output file behind. Runs the upf binary that
 * sits beside this test binary. */
#include <CUnit/CUnit.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ref_cpu/select.h"
#include "tests/test_util.h"
#include "uniprefill/npy.h"
#include "verify/select_inputs.h"

static char upf_path[PATH_MAX];
static char dir[64];

static int cli_setup(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return 1;
  self[n] = '\0';
  snprintf(upf_path, sizeof upf_path, "%s/upf", dirname(self));
  snprintf(dir, sizeof dir, "/tmp/upf_cli_XXXXXX");
  return mkdtemp(dir) ? 0 : 1;
}

static int cli_teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : 1;
}

/* dir/name in a slot of its own per name, so paths stay valid for the whole suite. */
static const char *in_dir(const char *name) {
  static char paths[24][128];
  static int used;
  for (int i = 0; i < used; i++)
    if (!strcmp(strrchr(paths[i], '/') + 1, name))
      return paths[i];
  if (used == 24)
    return "/nonexistent/too-many-paths";
  snprintf(paths[used], sizeof paths[used], "%s/%s", dir, name);
  return paths[used++];
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* Runs upf with the arguments; returns its exit status (stderr goes to dir/stderr.txt). */
static int run_upf(const char *args) {
  char cmd[PATH_MAX + 2048 + 128];
  snprintf(cmd, sizeof cmd, "'%s' %s 2>%s/stderr.txt >/dev/null", upf_path, args, dir);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int stderr_contains(const char *needle) {
  char buf[2048] = "";
  FILE *f = fopen(in_dir("stderr.txt"), "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = '\0';
  return strstr(buf, needle) != NULL;
}

static upf_select_problem problem;

static void write_inputs(void) {
  const int32_t lens[] = {1, 2000, 300};
  CU_ASSERT_FATAL(upf_select_problem_make(&problem, lens, 3, 4, 2, 64, UPF_DTYPE_BF16, UPF_DIST_HEAVY, 11) == UPF_OK);
  upf_tensor cu;
  int64_t shape[1] = {4};
  upf_tensor_init(&cu, problem.cu_seqlens, UPF_DTYPE_I32, 1, shape);
  CU_ASSERT_FATAL(upf_npy_write(in_dir("q.npy"), &problem.q) == UPF_OK);
  CU_ASSERT_FATAL(upf_npy_write(in_dir("k.npy"), &problem.k) == UPF_OK);
  CU_ASSERT_FATAL(upf_npy_write(in_dir("cu.npy"), &cu) == UPF_OK);
}

static void test_select_writes_the_library_mask(void) {
  write_inputs();
  char args[2048];
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s --out-blocks %s --out-kept %s",
           in_dir("q.npy"), in_dir("k.npy"), in_dir("cu.npy"), in_dir("mask.npy"), in_dir("blocks.npy"),
           in_dir("kept.npy"));
  CU_ASSERT_EQUAL_FATAL(run_upf(args), 0);
  upf_tensor mask = {0}, blocks = {0}, kept = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(in_dir("mask.npy"), &mask), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(in_dir("blocks.npy"), &blocks), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(in_dir("kept.npy"), &kept), UPF_OK);
  CU_ASSERT_EQUAL(mask.dtype, UPF_DTYPE_U8);
  CU_ASSERT_EQUAL(mask.ndim, 1);
  CU_ASSERT_EQUAL(mask.shape[0], 2301);
  CU_ASSERT_EQUAL(blocks.shape[0], 1 + 32 + 5);
  /* Same answer as the library call. */
  uint8_t want[2301];
  int32_t idx[2301], ncu[4], cnt[3];
  upf_select_inputs in = upf_select_problem_inputs(&problem);
  upf_select_params p = upf_select_params_default();
  upf_select_outputs out = {.token_mask = want, .kept_index = idx, .new_cu_seqlens = ncu, .kept_count = cnt};
  CU_ASSERT_EQUAL_FATAL(cpu_select_run(&in, &p, &out), UPF_OK);
  CU_ASSERT(memcmp(mask.data, want, sizeof want) == 0);
  CU_ASSERT_EQUAL(kept.shape[0], out.kept_total);
  CU_ASSERT(out.kept_total < 2301); /* something was dropped, so the comparison means something */
  upf_tensor_free(&mask), upf_tensor_free(&blocks), upf_tensor_free(&kept);
  unlink(in_dir("mask.npy")), unlink(in_dir("blocks.npy")), unlink(in_dir("kept.npy"));
}

/* Runs a select that must fail, then checks the exit code, the message and that no output exists. */
static void expect_failure(const char *q, const char *k, const char *cu, const char *extra, const char *message) {
  char args[2048];
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s %s", q, k, cu, in_dir("mask.npy"),
           extra);
  int code = run_upf(args);
  CU_ASSERT_NOT_EQUAL(code, 0);
  if (!stderr_contains(message))
    printf("\n    expected '%s' in the message of: upf %s\n", message, args);
  CU_ASSERT(stderr_contains(message));
  CU_ASSERT(!exists(in_dir("mask.npy")));
  CU_ASSERT(!exists(in_dir("blocks.npy")));
}

static void test_bad_inputs_leave_no_file(void) {
  const char *q = in_dir("q.npy"), *k = in_dir("k.npy"), *cu = in_dir("cu.npy");
  /* A truncated .npy. */
  FILE *f = fopen(in_dir("bad.npy"), "wb");
  fwrite("\x93NUMPY\x01\x00\x10\x00{'descr'", 1, 20, f);
  fclose(f);
  expect_failure(in_dir("bad.npy"), k, cu, "", "bad.npy");
  expect_failure(in_dir("missing.npy"), k, cu, "", "missing.npy");
  /* Non-monotone cu_seqlens. */
  int32_t bad_cu[4] = {0, 2001, 2000, 2301};
  upf_tensor t;
  int64_t shape[1] = {4};
  upf_tensor_init(&t, bad_cu, UPF_DTYPE_I32, 1, shape);
  upf_npy_write(in_dir("cu_bad.npy"), &t);
  expect_failure(q, k, in_dir("cu_bad.npy"), "", "monotone");
  /* cu_seqlens of the wrong dtype. */
  float cu_f[4] = {0, 1, 2001, 2301};
  upf_tensor_init(&t, cu_f, UPF_DTYPE_F32, 1, shape);
  upf_npy_write(in_dir("cu_f32.npy"), &t);
  expect_failure(q, k, in_dir("cu_f32.npy"), "", "<i4");
  /* k given as q: Hq=2 is not a multiple of Hkv=4. */
  expect_failure(k, q, cu, "", "multiple of Hkv");
  /* NaN in k (bf16 bits 0x7fc0). */
  uint16_t *kd = problem.k.data, saved = kd[1500 * 2 * 64 + 3];
  kd[1500 * 2 * 64 + 3] = 0x7fc0;
  upf_npy_write(in_dir("k_nan.npy"), &problem.k);
  kd[1500 * 2 * 64 + 3] = saved;
  expect_failure(q, in_dir("k_nan.npy"), cu, "", "NaN");
  expect_failure(q, k, cu, "--p 1.5", "p=1.5");
  expect_failure(q, k, cu, "--block 48", "power of two");
  expect_failure(q, k, cu, "--p banana", "not a number");
  expect_failure(q, k, cu, "--backend tpu", "unknown name");
  /* The second output cannot be written: the first one must not survive either. */
  char extra[PATH_MAX + 32];
  snprintf(extra, sizeof extra, "--out-blocks %s/no/such/dir/b.npy", dir);
  expect_failure(q, k, cu, extra, "b.npy");
  upf_select_problem_free(&problem);
}

void upf_register_cli_tests(void) {
  CU_pSuite suite = CU_add_suite("cli", cli_setup, cli_teardown);
  CU_add_test(suite, "select writes the library's mask", test_select_writes_the_library_mask);
  CU_add_test(suite, "bad inputs exit non-zero and leave no file", test_bad_inputs_leave_no_file);
}

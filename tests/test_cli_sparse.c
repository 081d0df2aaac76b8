/* `upf block-sparse` end to end on a ragged batch (requests of 1, 300 and 700 queries, Hq 4 over Hkv 2,
 * D 64): a good run on the cpu writes O and BLK equal, byte for byte, to the library's three calls
 * (block means, index, attention) with the same parameters, and drops some blocks so that the comparison
 * means something; every bad input (a missing flag, a bad alpha or block_n, Hq % Hkv, non-monotone or
 * non-<i4 cu_seqlens, mixed dtypes, a missing file, an output naming an input) exits non-zero naming the
 * flag and the file, and leaves no output behind. Runs the upf binary beside this test binary, in the
 * suite's directory (relative file names). */
#include <CUnit/CUnit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/npy.h"
#include "uniprefill/rng.h"
#include "uniprefill/sparse.h"

static cli_suite cli;

enum { B = 3, T = 1001, HQ = 4, HKV = 2, D = 64 };
static const int32_t cu[B + 1] = {0, 1, 301, 1001};

/* q (T, Hq, D), k, v (T, Hkv, D) of dtype dt: normals, the keys of every third block of 64 leaning on
 * the queries' direction, so that the index has blocks to drop. Values of the same seed in both dtypes. */
static int write_qkv(upf_dtype dt, const char *q_name, const char *k_name, const char *v_name, int64_t hkv) {
  upf_rng rng;
  upf_rng_seed(&rng, 0x5ba25e);
  const int64_t n[3] = {(int64_t)T * HQ * D, (int64_t)T * hkv * D, (int64_t)T * hkv * D};
  const char *names[3] = {q_name, k_name, v_name};
  int ok = 1;
  for (int i = 0; i < 3 && ok; i++) {
    float *x = malloc((size_t)n[i] * sizeof *x);
    uint16_t *h = malloc((size_t)n[i] * sizeof *h);
    ok = x && h;
    for (int64_t e = 0; ok && e < n[i]; e++) {
      const int64_t t = e / (n[i] / T), d = e % D;
      const float lean = i == 0 ? 1.0f : i == 1 && (t / 64) % 3 == 0 ? 2.0f : 0.0f;
      x[e] = upf_rng_normal(&rng) + (d < 8 ? lean : 0.0f);
    }
    if (ok && dt == UPF_DTYPE_BF16)
      upf_bf16_from_f32_array(h, x, n[i]);
    const int64_t shape[3] = {T, i == 0 ? HQ : hkv, D};
    upf_tensor tt;
    ok = ok && upf_tensor_init(&tt, dt == UPF_DTYPE_BF16 ? (void *)h : (void *)x, dt, 3, shape) == UPF_OK &&
         upf_npy_write(cli_path(&cli, names[i]), &tt) == UPF_OK;
    free(x), free(h);
  }
  return ok;
}

static int setup(void) {
  if (cli_setup(&cli, "upf_cli_sparse"))
    return 1;
  cli.run_in_dir = 1;
  const int32_t cu_bad[B + 1] = {0, 301, 300, 1001};
  const float cu_f[B + 1] = {0, 1, 301, 1001};
  int64_t n = B + 1;
  upf_tensor tf;
  int ok = write_qkv(UPF_DTYPE_BF16, "q.npy", "k.npy", "v.npy", HKV) &&
           write_qkv(UPF_DTYPE_F32, "q32.npy", "k32.npy", "v32.npy", HKV) &&
           write_qkv(UPF_DTYPE_BF16, "q_.npy", "k3.npy", "v3.npy", 3) &&
           cli_write_i32(cli_path(&cli, "cu.npy"), cu, n) &&
           cli_write_i32(cli_path(&cli, "cu_bad.npy"), cu_bad, n) &&
           upf_tensor_init(&tf, (void *)cu_f, UPF_DTYPE_F32, 1, &n) == UPF_OK &&
           upf_npy_write(cli_path(&cli, "cu_f32.npy"), &tf) == UPF_OK;
  return !ok;
}

static int teardown(void) { return cli_teardown(&cli); }

/* The library's answer on the cpu: out (T, Hq, D) in the inputs' dtype and the kept mask (Hkv, tiles, key
 * blocks); kept and visible key blocks. */
static upf_status library_layer(const upf_tensor *q, const upf_tensor *k, const upf_tensor *v,
                                const upf_sparse_params *p, upf_tensor *out, upf_tensor *blk, int64_t *kept,
                                int64_t *visible) {
  const upf_backend *cpu = upf_backend_cpu();
  upf_attn_varlen vb = {B, cu, cu, cu, cu};
  upf_sparse_batch b = {&vb, NULL};
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(&b, HQ, HKV, p, &plan));
  const int64_t S = plan.num_segments, nkb = plan.max_key_blocks;
  const int64_t sm[4] = {B, nkb, HKV, D}, sblk[3] = {HKV, plan.total_q_tiles, nkb};
  upf_tensor kbar = {0}, vbar = {0};
  int32_t *rp = malloc((size_t)(S + 1) * 4), *bl = malloc((size_t)(S * nkb) * 4);
  upf_status st = rp && bl ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "test: index");
  if (st == UPF_OK)
    st = upf_tensor_alloc(&kbar, q->dtype, 4, sm);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&vbar, q->dtype, 4, sm);
  if (st == UPF_OK)
    st = upf_tensor_alloc(out, q->dtype, 3, q->shape);
  if (st == UPF_OK)
    st = upf_tensor_alloc(blk, UPF_DTYPE_U8, 3, sblk);
  upf_sparse_index idx = {rp, bl, NULL, -1};
  if (st == UPF_OK)
    st = cpu->sparse_block_means(&b, k, v, p, &kbar, &vbar);
  if (st == UPF_OK)
    st = cpu->sparse_index(&b, q, &kbar, p, &idx);
  if (st == UPF_OK)
    st = cpu->attn_block_sparse(&b, q, k, v, p, &idx, p->mean_correction ? &kbar : NULL,
                                p->mean_correction ? &vbar : NULL, out);
  if (st == UPF_OK) {
    memset(blk->data, 0, (size_t)(S * nkb));
    for (int64_t s = 0; s < S; s++)
      for (int32_t i = rp[s]; i < rp[s + 1]; i++)
        ((uint8_t *)blk->data)[s * nkb + bl[i]] = 1;
    *kept = idx.kept_total;
    *visible = upf_sparse_visible_blocks(&b, &plan, p);
  }
  upf_tensor_free(&kbar), upf_tensor_free(&vbar);
  free(rp), free(bl);
  upf_sparse_plan_free(&plan);
  return st;
}

/* Runs `upf block-sparse` on the named inputs with `flags` and compares its outputs with the library's. */
static void good_run(const char *q_name, const char *k_name, const char *v_name, const char *flags,
                     const upf_sparse_params *p, int with_blocks) {
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "block-sparse --q %s --k %s --v %s --cu-seqlens cu.npy --out o.npy %s %s",
                                q_name, k_name, v_name, with_blocks ? "--out-blocks blk.npy" : "", flags),
                        0);
  CLI_ASSERT_STDERR(&cli, "visible key blocks"); /* the report line that failing runs must not print */
  upf_tensor q = {0}, k = {0}, v = {0}, o = {0}, blk = {0}, want_o = {0}, want_blk = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, q_name), &q), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, k_name), &k), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, v_name), &v), UPF_OK);
  int64_t kept = 0, visible = 0;
  CU_ASSERT_EQUAL_FATAL(library_layer(&q, &k, &v, p, &want_o, &want_blk, &kept, &visible), UPF_OK);
  CU_ASSERT(kept < visible); /* blocks were dropped: the attention differs from dense */
  CU_ASSERT(kept > 0);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "o.npy"), &o), UPF_OK);
  CU_ASSERT(o.dtype == q.dtype && o.ndim == 3 && o.shape[0] == T && o.shape[1] == HQ && o.shape[2] == D);
  if (o.dtype == q.dtype && upf_tensor_numel(&o) == upf_tensor_numel(&want_o))
    CU_ASSERT(memcmp(o.data, want_o.data, (size_t)upf_tensor_numel(&o) * upf_dtype_size(o.dtype)) == 0);
  if (with_blocks) {
    CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "blk.npy"), &blk), UPF_OK);
    CU_ASSERT(blk.dtype == UPF_DTYPE_U8 && blk.ndim == 3);
    CU_ASSERT(blk.shape[0] == want_blk.shape[0] && blk.shape[1] == want_blk.shape[1] &&
              blk.shape[2] == want_blk.shape[2]);
    if (upf_tensor_numel(&blk) == upf_tensor_numel(&want_blk))
      CU_ASSERT(memcmp(blk.data, want_blk.data, (size_t)upf_tensor_numel(&blk)) == 0);
    int64_t ones = 0;
    for (int64_t i = 0; i < upf_tensor_numel(&blk); i++)
      ones += ((const uint8_t *)blk.data)[i];
    CU_ASSERT_EQUAL(ones, kept);
  } else {
    CU_ASSERT(!cli_exists(cli_path(&cli, "blk.npy")));
  }
  upf_tensor_free(&q), upf_tensor_free(&k), upf_tensor_free(&v), upf_tensor_free(&o), upf_tensor_free(&blk);
  upf_tensor_free(&want_o), upf_tensor_free(&want_blk);
  unlink(cli_path(&cli, "o.npy")), unlink(cli_path(&cli, "blk.npy"));
}

static void test_good_runs_match_the_library(void) {
  /* bf16, every parameter given, mean correction */
  upf_sparse_params p = {0.5f, 64, 64, 1, 1, 1, 0, 1, 0.0f};
  good_run("q.npy", "k.npy", "v.npy",
           "--alpha 0.5 --block-m 64 --block-n 64 --sink 1 --window 1 --last-n 1 --min-sparse-q-len 0 "
           "--mean-correction --backend cpu",
           &p, 1);
  /* f32 at the published defaults (alpha 1), a scale of its own, no BLK */
  p = upf_sparse_params_default();
  p.scale = 0.2f;
  good_run("q32.npy", "k32.npy", "v32.npy", "--scale 0.2", &p, 0);
  /* short requests below min_sparse_q_len run dense, the long one sparse; block_n 128 */
  p = upf_sparse_params_default();
  p.min_sparse_q_len = 300, p.block_n = 128, p.window = 1, p.sink = 0, p.alpha = 0.6f;
  good_run("q.npy", "k.npy", "v.npy", "--min-sparse-q-len 300 --block-n 128 --window 1 --sink 0 --alpha 0.6", &p, 1);
  CU_ASSERT_EQUAL(cli_run(&cli, "block-sparse --help"), 0);
  CLI_ASSERT_STDOUT(&cli, "usage: upf block-sparse --q Q.npy --k K.npy --v V.npy --cu-seqlens CU.npy --out O.npy");
  CLI_ASSERT_STDOUT(&cli, "--mean-correction");
  CU_ASSERT_EQUAL(cli_run(&cli, "--help"), 0);
  CLI_ASSERT_STDOUT(&cli, "upf block-sparse");
}

/* A run that must fail: exit code, the flag and `message` in stderr, no report line, no output. */
static void expect_failure(const char *q, const char *k, const char *v, const char *cu_name, const char *extra,
                           const char *flag, const char *message) {
  int code = cli_run(&cli, "block-sparse --q %s --k %s --v %s --cu-seqlens %s --out o.npy --out-blocks blk.npy %s", q,
                     k, v, cu_name, extra);
  CU_ASSERT_NOT_EQUAL(code, 0);
  CLI_ASSERT_STDERR(&cli, flag);
  CLI_ASSERT_STDERR(&cli, message);
  CU_ASSERT(!cli_stderr_has(&cli, "visible key blocks"));
  CU_ASSERT(!cli_exists(cli_path(&cli, "o.npy")));
  CU_ASSERT(!cli_exists(cli_path(&cli, "blk.npy")));
}

static void test_bad_inputs_leave_no_file(void) {
  /* a missing flag */
  CU_ASSERT_EQUAL(cli_run(&cli, "block-sparse --q q.npy --k k.npy --cu-seqlens cu.npy --out o.npy"), 2);
  CLI_ASSERT_STDERR(&cli, "--v is required");
  CU_ASSERT(!cli_exists(cli_path(&cli, "o.npy")));
  CU_ASSERT_EQUAL(cli_run(&cli, "block-sparse --q q.npy --k k.npy --v v.npy --cu-seqlens cu.npy"), 2);
  CLI_ASSERT_STDERR(&cli, "--out is required");
  /* parameters out of range, each named */
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--alpha 1.5", "--alpha", "alpha=1.5");
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--alpha -0.1", "--alpha", "alpha=-0.1");
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--alpha banana", "--alpha", "not a number");
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--block-n 96", "--block-n", "64 or 128");
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--block-m 24", "--block-m", "multiple of 16");
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--window 0", "--window", "window=0");
  expect_failure("q.npy", "k.npy", "v.npy", "cu.npy", "--backend tpu", "--backend", "tpu");
  /* Hq = 4 over Hkv = 3: both inputs named */
  expect_failure("q.npy", "k3.npy", "v3.npy", "cu.npy", "", "--k", "not a multiple of Hkv=3");
  CLI_ASSERT_STDERR(&cli, "--q");
  CLI_ASSERT_STDERR(&cli, "k3.npy");
  /* K and V of different shapes */
  expect_failure("q.npy", "k.npy", "v3.npy", "cu.npy", "", "--v", "v3.npy");
  /* cu_seqlens not monotone, not <i4 */
  expect_failure("q.npy", "k.npy", "v.npy", "cu_bad.npy", "", "--cu-seqlens", "monotone");
  CLI_ASSERT_STDERR(&cli, "cu_bad.npy");
  expect_failure("q.npy", "k.npy", "v.npy", "cu_f32.npy", "", "--cu-seqlens", "<i4");
  CLI_ASSERT_STDERR(&cli, "cu_f32.npy");
  /* a dtype that does not match q's */
  expect_failure("q.npy", "k32.npy", "v32.npy", "cu.npy", "", "--k", "one dtype");
  CLI_ASSERT_STDERR(&cli, "k32.npy");
  /* a missing and a malformed file */
  expect_failure("missing.npy", "k.npy", "v.npy", "cu.npy", "", "--q", "missing.npy");
  CU_ASSERT(cli_write_text(&cli, "bad.npy", "\x93NUMPY\x01\x00\x10\x00{'descr'"));
  expect_failure("q.npy", "k.npy", "bad.npy", "cu.npy", "", "--v", "bad.npy");
  /* an output naming an input: refused before anything is read, the input untouched */
  struct stat before, after;
  CU_ASSERT_EQUAL_FATAL(stat(cli_path(&cli, "k.npy"), &before), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "block-sparse --q q.npy --k k.npy --v v.npy --cu-seqlens cu.npy --out k.npy"), 2);
  CLI_ASSERT_STDERR(&cli, "--out");
  CLI_ASSERT_STDERR(&cli, "would overwrite the input");
  CU_ASSERT(stat(cli_path(&cli, "k.npy"), &after) == 0 && after.st_ino == before.st_ino &&
            after.st_size == before.st_size && after.st_mtime == before.st_mtime);
  CU_ASSERT_EQUAL(cli_run(&cli, "block-sparse --q q.npy --k k.npy --v v.npy --cu-seqlens cu.npy --out o.npy "
                                "--out-blocks ./o.npy"),
                  2);
  CLI_ASSERT_STDERR(&cli, "name one file");
  CU_ASSERT(!cli_exists(cli_path(&cli, "o.npy")));
  /* an output directory that does not exist, found before any work */
  CU_ASSERT_EQUAL(cli_run(&cli, "block-sparse --q q.npy --k k.npy --v v.npy --cu-seqlens cu.npy --out o.npy "
                                "--out-blocks none/blk.npy"),
                  2);
  CLI_ASSERT_STDERR(&cli, "--out-blocks");
  CLI_ASSERT_STDERR(&cli, "does not exist");
  CU_ASSERT(!cli_stderr_has(&cli, "visible key blocks"));
  CU_ASSERT(!cli_exists(cli_path(&cli, "o.npy")));
}

static CU_TestInfo cli_sparse_tests[] = {
    {"block-sparse: O and BLK equal the library's", test_good_runs_match_the_library},
    {"block-sparse: bad inputs exit non-zero, name the flag and file, leave no file", test_bad_inputs_leave_no_file},
    CU_TEST_INFO_NULL,
};

void upf_register_cli_sparse_tests(void) { upf_test_suite("cli_sparse", setup, teardown, cli_sparse_tests); }

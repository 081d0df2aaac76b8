/* Core: bf16 rounding, the seeded RNG's portability, status messages, environment switches, tensor descriptors. */
#include <CUnit/CUnit.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/dl.h"
#include "perf/bench.h"
#include "tests/test_util.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/env.h"
#include "uniprefill/provenance.h"
#include "uniprefill/rng.h"
#include "uniprefill/tensor.h"

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void test_bf16_round_to_nearest_even(void) {
  CU_ASSERT_EQUAL(upf_bf16_from_f32(1.0f), 0x3f80);
  /* Exactly halfway: ties go to the even mantissa. */
  CU_ASSERT_EQUAL(upf_bf16_from_f32(from_bits(0x3f808000u)), 0x3f80);
  CU_ASSERT_EQUAL(upf_bf16_from_f32(from_bits(0x3f818000u)), 0x3f82);
  /* Just above / below halfway. */
  CU_ASSERT_EQUAL(upf_bf16_from_f32(from_bits(0x3f808001u)), 0x3f81);
  CU_ASSERT_EQUAL(upf_bf16_from_f32(from_bits(0x3f807fffu)), 0x3f80);
  CU_ASSERT_EQUAL(upf_bf16_from_f32(-2.0f), 0xc000);
  CU_ASSERT_EQUAL(upf_bf16_from_f32(-0.0f), 0x8000);
  /* The largest float rounds up to Inf, as RNE says. */
  CU_ASSERT_EQUAL(upf_bf16_from_f32(from_bits(0x7f7fffffu)), 0x7f80);
  CU_ASSERT_EQUAL(upf_bf16_from_f32(INFINITY), 0x7f80);
  CU_ASSERT_EQUAL(upf_bf16_from_f32(-INFINITY), 0xff80);
  /* NaN stays NaN even when its payload sits only in the low bits. */
  uint16_t nan_bits = upf_bf16_from_f32(from_bits(0x7f800001u));
  CU_ASSERT((nan_bits & 0x7f80) == 0x7f80 && (nan_bits & 0x007f) != 0);
  CU_ASSERT(isnan(upf_bf16_to_f32(nan_bits)));
  /* Subnormals round too. */
  CU_ASSERT_EQUAL(upf_bf16_from_f32(from_bits(0x00018000u)), 0x0002);
  CU_ASSERT_EQUAL(upf_bf16_to_f32(0x4049), 3.140625f);
}

static void test_rng_is_machine_independent(void) {
  /* Frozen values: these must come out the same on every machine and compiler. */
  upf_rng rng;
  upf_rng_seed(&rng, 42);
  uint64_t first = upf_rng_next(&rng);
  CU_ASSERT_EQUAL(first, 0x15780b2e0c2ec716ull);
  upf_rng_seed(&rng, 42);
  upf_rng_next(&rng);
  float u = upf_rng_uniform(&rng), n = upf_rng_normal(&rng);
  CU_ASSERT(u >= 0.0f && u < 1.0f);
  CU_ASSERT_EQUAL(u * 16777216.0f, floorf(u * 16777216.0f)); /* a multiple of 2^-24 */
  CU_ASSERT(fabsf(n) <= 6.0f);
  /* Moments of the normal over many draws. */
  double sum = 0, sum2 = 0;
  for (int i = 0; i < 100000; i++) {
    double x = upf_rng_normal(&rng);
    sum += x, sum2 += x * x;
  }
  CU_ASSERT(fabs(sum / 100000) < 0.02);
  CU_ASSERT(fabs(sum2 / 100000 - 1.0) < 0.02);
  for (int i = 0; i < 1000; i++)
    CU_ASSERT(upf_rng_below(&rng, 7) < 7);
}

static void test_status_messages(void) {
  upf_clear_error();
  CU_ASSERT_STRING_EQUAL(upf_last_error(), "");
  upf_status st = upf_fail(UPF_ERR_SHAPE, "q: expected %d dims", 3);
  CU_ASSERT_EQUAL(st, UPF_ERR_SHAPE);
  CU_ASSERT_STRING_EQUAL(upf_last_error(), "q: expected 3 dims");
  upf_fail_context(st, "select: ");
  CU_ASSERT_STRING_EQUAL(upf_last_error(), "select: q: expected 3 dims");
  CU_ASSERT_STRING_EQUAL(upf_status_name(UPF_ERR_CU_SEQLENS), "UPF_ERR_CU_SEQLENS");
  CU_ASSERT_STRING_EQUAL(upf_status_name((upf_status)999), "UPF_ERR_UNKNOWN");
}

static void test_env_switch(void) {
  static const char *const choices[] = {"fa2", "wgmma", "wgmma2-nopp"};
  int index = -1;
  unsetenv("UPF_TEST_SWITCH");
  CU_ASSERT_EQUAL(upf_env_choice("UPF_TEST_SWITCH", choices, 3, 2, &index), UPF_OK);
  CU_ASSERT_EQUAL(index, 2); /* unset: the fallback */
  setenv("UPF_TEST_SWITCH", "", 1);
  CU_ASSERT_EQUAL(upf_env_choice("UPF_TEST_SWITCH", choices, 3, 2, &index), UPF_OK);
  CU_ASSERT_EQUAL(index, 2); /* empty: the fallback */
  setenv("UPF_TEST_SWITCH", "wgmma", 1);
  CU_ASSERT_EQUAL(upf_env_choice("UPF_TEST_SWITCH", choices, 3, 2, &index), UPF_OK);
  CU_ASSERT_EQUAL(index, 1);
  setenv("UPF_TEST_SWITCH", "wgmma3", 1); /* a typo: an error, and index untouched */
  index = -7;
  CU_ASSERT_EQUAL(upf_env_choice("UPF_TEST_SWITCH", choices, 3, 2, &index), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(index, -7);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "UPF_TEST_SWITCH=wgmma3"));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "fa2|wgmma|wgmma2-nopp"));
  setenv("UPF_TEST_SWITCH", "WGMMA", 1); /* values are case-sensitive */
  CU_ASSERT_EQUAL(upf_env_choice("UPF_TEST_SWITCH", choices, 3, 2, &index), UPF_ERR_INVALID_ARG);
  unsetenv("UPF_TEST_SWITCH");
}

static void test_tensor_descriptor(void) {
  upf_tensor t;
  int64_t shape[3] = {4, 32, 128};
  CU_ASSERT_EQUAL(upf_tensor_alloc(&t, UPF_DTYPE_BF16, 3, shape), UPF_OK);
  CU_ASSERT_EQUAL(t.stride[0], 32 * 128);
  CU_ASSERT_EQUAL(t.stride[2], 1);
  CU_ASSERT_EQUAL(upf_tensor_numel(&t), 4 * 32 * 128);
  CU_ASSERT(upf_tensor_is_contiguous(&t));
  char buf[64];
  CU_ASSERT_STRING_EQUAL(upf_tensor_shape_str(&t, buf, sizeof buf), "(4, 32, 128)");
  t.stride[0] = 8192; /* a padded row: no longer contiguous */
  CU_ASSERT(!upf_tensor_is_contiguous(&t));
  upf_tensor_free(&t);
  int64_t bad[1] = {-1};
  CU_ASSERT_EQUAL(upf_tensor_init(&t, NULL, UPF_DTYPE_F32, 1, bad), UPF_ERR_SHAPE);
  upf_dtype d;
  CU_ASSERT_EQUAL(upf_dtype_parse("bf16", &d), UPF_OK);
  CU_ASSERT_EQUAL(d, UPF_DTYPE_BF16);
  CU_ASSERT_EQUAL(upf_dtype_parse("fp8", &d), UPF_ERR_DTYPE);
}

/* Strides and byte sizes are checked for overflow whatever the element count: a zero extent beside
 * huge ones holds nothing, but its strides are not representable (signed overflow before the fix). */
static void test_tensor_overflow(void) {
  upf_tensor t;
  const int64_t big = (int64_t)1 << 62;
  const int64_t zero_first[3] = {0, big, big}, zero_last[3] = {big, big, 0}, one_huge[1] = {big};
  CU_ASSERT_EQUAL(upf_tensor_init(&t, NULL, UPF_DTYPE_U8, 3, zero_first), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "(0, 4611686018427387904, 4611686018427387904)"));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "overflow"));
  CU_ASSERT_EQUAL(upf_tensor_init(&t, NULL, UPF_DTYPE_U8, 3, zero_last), UPF_ERR_SHAPE);
  /* 2^62 f32 elements are 2^64 bytes: refused, not wrapped to a 0-byte allocation. */
  CU_ASSERT_EQUAL(upf_tensor_alloc(&t, UPF_DTYPE_F32, 1, one_huge), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NULL(t.data);
  CU_ASSERT_EQUAL(upf_tensor_init(&t, NULL, UPF_DTYPE_U8, 1, one_huge), UPF_OK);
  /* The largest representable: strides exact, count 0 with a zero extent anywhere. */
  const int64_t edge[2] = {0, INT64_MAX}, edge_rev[3] = {INT64_MAX, 1, 0};
  CU_ASSERT_EQUAL_FATAL(upf_tensor_init(&t, NULL, UPF_DTYPE_U8, 2, edge), UPF_OK);
  CU_ASSERT_EQUAL(t.stride[0], INT64_MAX);
  CU_ASSERT_EQUAL(upf_tensor_numel(&t), 0);
  CU_ASSERT_EQUAL_FATAL(upf_tensor_init(&t, NULL, UPF_DTYPE_U8, 3, edge_rev), UPF_OK);
  CU_ASSERT_EQUAL(upf_tensor_numel(&t), 0);
  CU_ASSERT_EQUAL(upf_tensor_init(&t, NULL, UPF_DTYPE_BF16, 2, edge), UPF_ERR_SHAPE); /* 2 bytes each */
  /* A zero extent inside keeps the contiguous row-major strides (0 to its left). */
  const int64_t inner_zero[3] = {2, 0, 3};
  CU_ASSERT_EQUAL_FATAL(upf_tensor_init(&t, NULL, UPF_DTYPE_F32, 3, inner_zero), UPF_OK);
  CU_ASSERT(t.stride[0] == 0 && t.stride[1] == 3 && t.stride[2] == 1);
  CU_ASSERT(upf_tensor_is_contiguous(&t));
  /* A hand-built descriptor past 64 bits: numel says so instead of wrapping. */
  t.ndim = 2, t.shape[0] = big, t.shape[1] = 4;
  CU_ASSERT_EQUAL(upf_tensor_numel(&t), -1);
  t.shape[1] = 0;
  CU_ASSERT_EQUAL(upf_tensor_numel(&t), 0);
}

/* Where the CUDA backend cannot run, its probe says why in words a user can act on: on a machine
 * without an NVIDIA driver, that no CUDA device is present, not that the driver is "insufficient". */
static void test_cuda_probe_message(void) {
  const char *backends = getenv("UPF_BACKENDS");
  upf_status st = upf_backend_cuda()->probe();
  if (st == UPF_OK)
    return; /* a device is here: nothing to explain */
  const char *msg = upf_last_error();
  CU_ASSERT(!strncmp(msg, "cuda: ", 6));
  CU_ASSERT(st == UPF_ERR_NO_DEVICE || st == UPF_ERR_UNSUPPORTED);
  if (st == UPF_ERR_NO_DEVICE && !(backends && *backends) && access("/proc/driver/nvidia/version", F_OK) != 0) {
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "no CUDA device present"));
    CU_ASSERT_PTR_NULL(strstr(msg, "insufficient"));
  }
  if (st == UPF_ERR_UNSUPPORTED)
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "CUDA=0"));
}

/* The benches' median by hand: odd and even counts (the upper middle), unsorted input, none; and the
 * steady-state timer's reps bound, checked before any device is touched. */
static void test_bench_median(void) {
  double odd[5] = {3.0, 1.0, 5.0, 2.0, 4.0}, even[4] = {4.0, 1.0, 3.0, 2.0}, one[1] = {7.5};
  CU_ASSERT_DOUBLE_EQUAL(upf_bench_median(odd, 5), 3.0, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(upf_bench_median(even, 4), 3.0, 0.0);
  CU_ASSERT_DOUBLE_EQUAL(upf_bench_median(one, 1), 7.5, 0.0);
  CU_ASSERT(isnan(upf_bench_median(one, 0)));
  double m = -1.0;
  CU_ASSERT_EQUAL(upf_bench_steady_median(NULL, NULL, 0.1, 0, &m), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(upf_bench_steady_median(NULL, NULL, 0.1, UPF_BENCH_STEADY_MAX_REPS + 1, &m), UPF_ERR_INVALID_ARG);
  CU_ASSERT_DOUBLE_EQUAL(m, 0.0, 0.0);
}

/* $UPF_COMMIT wins, inside a checkout too (a staged bundle's binaries run in a copy whose git HEAD is not
 * their source); without it, outside a checkout nothing, inside this one git's short hash. */
static void test_source_commit(void) {
  char cwd[4096], buf[64];
  CU_ASSERT_PTR_NOT_NULL_FATAL(getcwd(cwd, sizeof cwd));
  int in_checkout = upf_source_commit(buf, sizeof buf);
  const char *saved = getenv("UPF_COMMIT");
  char keep[128];
  snprintf(keep, sizeof keep, "%s", saved ? saved : "");
  CU_ASSERT_EQUAL_FATAL(chdir("/"), 0);
  setenv("UPF_COMMIT", "abc1234", 1);
  CU_ASSERT_EQUAL(upf_source_commit(buf, sizeof buf), 1);
  CU_ASSERT_STRING_EQUAL(buf, "abc1234");
  unsetenv("UPF_COMMIT");
  CU_ASSERT_EQUAL(upf_source_commit(buf, sizeof buf), 0);
  CU_ASSERT_STRING_EQUAL(buf, "");
  if (saved)
    setenv("UPF_COMMIT", keep, 1);
  CU_ASSERT_EQUAL_FATAL(chdir(cwd), 0);
  if (in_checkout && !saved) { /* a short hash of hex digits, maybe "-dirty" */
    CU_ASSERT_EQUAL(upf_source_commit(buf, sizeof buf), 1);
    CU_ASSERT(strspn(buf, "0123456789abcdef") >= 7);
  }
  setenv("UPF_COMMIT", "abc1234", 1); /* in this checkout: the variable, not git's hash */
  CU_ASSERT_EQUAL(upf_source_commit(buf, sizeof buf), 1);
  CU_ASSERT_STRING_EQUAL(buf, "abc1234");
  if (saved)
    setenv("UPF_COMMIT", keep, 1);
  else
    unsetenv("UPF_COMMIT");
}

/* A library opened at run time: the first candidate that opens, each failed one named with its reason;
 * a symbol table resolved in full or the first missing name. */
static void test_dl_open_and_resolve(void) {
  char tried[512];
  const char *none[] = {NULL, "libupf-no-such-1.so", "libupf-no-such-2.so"};
  CU_ASSERT_PTR_NULL(upf_dl_open_first(none, 3, RTLD_NOW | RTLD_LOCAL, tried, sizeof tried));
  CU_ASSERT(strncmp(tried, "libupf-no-such-1.so (", 21) == 0);
  CU_ASSERT(strstr(tried, "; libupf-no-such-2.so (") != NULL);
  char tiny[8]; /* a short buffer truncates, never overflows */
  CU_ASSERT_PTR_NULL(upf_dl_open_first(none, 3, RTLD_NOW | RTLD_LOCAL, tiny, sizeof tiny));
  CU_ASSERT_EQUAL(strlen(tiny), sizeof tiny - 1);
  const char *some[] = {"libupf-no-such-1.so", "libm.so.6"};
  void *lib = upf_dl_open_first(some, 2, RTLD_NOW | RTLD_LOCAL, tried, sizeof tried);
  CU_ASSERT_PTR_NOT_NULL_FATAL(lib);
  double (*cos_fn)(double) = NULL, (*sqrt_fn)(double) = NULL;
  void *nothing = NULL;
  const upf_dl_symbol good[] = {{(void **)&cos_fn, "cos"}, {(void **)&sqrt_fn, "sqrt"}};
  CU_ASSERT_PTR_NULL(upf_dl_resolve(lib, good, 2));
  CU_ASSERT(cos_fn && cos_fn(0.0) == 1.0 && sqrt_fn && sqrt_fn(4.0) == 2.0);
  const upf_dl_symbol bad[] = {{(void **)&cos_fn, "cos"}, {&nothing, "upf_no_such_symbol"}};
  CU_ASSERT_STRING_EQUAL(upf_dl_resolve(lib, bad, 2), "upf_no_such_symbol");
  dlclose(lib);
}

static CU_TestInfo core_tests[] = {
    {"a library opened at run time: candidates and symbols", test_dl_open_and_resolve},
    {"bf16 round to nearest even", test_bf16_round_to_nearest_even},
    {"rng is machine independent", test_rng_is_machine_independent},
    {"status messages", test_status_messages},
    {"tensor descriptor", test_tensor_descriptor},
    {"tensor strides and sizes never overflow", test_tensor_overflow},
    {"env switch: values, fallback, typo named", test_env_switch},
    {"bench median and the steady timer's bounds", test_bench_median},
    {"cuda probe names a missing device plainly", test_cuda_probe_message},
    {"source commit: $UPF_COMMIT, else git, else none", test_source_commit},
    CU_TEST_INFO_NULL,
};

void upf_register_core_tests(void) { upf_test_suite("core", NULL, NULL, core_tests); }

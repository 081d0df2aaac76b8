/* CUnit suite "gguf": dequantisation of hand-built blocks of every supported type against values
 * worked out by hand from the ggml block layouts; writer -> reader round trips (versions 2 and 3,
 * several alignments, every value type); malformed images (each must fail cleanly, never crash; the
 * images are exact-size heap copies, so Valgrind sees any read past the end); a seeded fuzz loop;
 * the two real model files when present; and cross-checks against llama.cpp's gguf-py when its
 * venv exists (tests/gguf_check.py). */
#include <CUnit/CUnit.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/test_util.h"
#include "uniprefill/gguf.h"
#include "uniprefill/npy.h"
#include "uniprefill/rng.h"

static char tmpdir[64];

static void path_in(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", tmpdir, name); }

static int count_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
  closedir(d);
  return n;
}

static void remove_tree(const char *dir) {
  DIR *d = opendir(dir);
  if (!d)
    return;
  char p[512];
  for (struct dirent *e; (e = readdir(d));) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    struct stat sb;
    if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
      remove_tree(p);
    else
      unlink(p);
  }
  closedir(d);
  rmdir(dir);
}

static int suite_init(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/upf_gguf_XXXXXX");
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int suite_clean(void) {
  remove_tree(tmpdir);
  return 0;
}

#define ASSERT_OK(expr)                                                                                     \
  do {                                                                                                      \
    upf_status st_ = (expr);                                                                                \
    if (st_ != UPF_OK)                                                                                      \
      printf("\n  %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr, upf_status_name(st_), upf_last_error()); \
    CU_ASSERT_EQUAL_FATAL(st_, UPF_OK);                                                                     \
  } while (0)

/* Asserts a float equals its expected value exactly, naming the element on failure. */
static void expect_f(const float *got, int64_t i, float want, const char *label) {
  if (!(got[i] == want || (isnan(got[i]) && isnan(want)))) {
    char msg[200];
    snprintf(msg, sizeof msg, "%s[%" PRId64 "] = %.9g, want %.9g", label, i, got[i], want);
    CU_assertImplementation(CU_FALSE, __LINE__, msg, __FILE__, "", CU_FALSE);
  }
}

/* ---- ggml types and dequantisation ----------------------------------------------------------- */

static void test_type_table(void) {
  CU_ASSERT_STRING_EQUAL(upf_ggml_type_name(UPF_GGML_TYPE_Q4_K), "q4_K");
  CU_ASSERT_STRING_EQUAL(upf_ggml_type_name(UPF_GGML_TYPE_BF16), "bf16");
  CU_ASSERT_PTR_NULL(upf_ggml_type_name((upf_ggml_type)4)); /* removed Q4_2 */
  CU_ASSERT_PTR_NULL(upf_ggml_type_name((upf_ggml_type)31));
  CU_ASSERT_PTR_NULL(upf_ggml_type_name((upf_ggml_type)-1));
  CU_ASSERT_PTR_NULL(upf_ggml_type_name(UPF_GGML_TYPE_COUNT));
  CU_ASSERT_EQUAL(upf_ggml_block_size(UPF_GGML_TYPE_Q4_1), 32);
  CU_ASSERT_EQUAL(upf_ggml_type_size(UPF_GGML_TYPE_Q4_1), 20);
  CU_ASSERT_EQUAL(upf_ggml_type_size(UPF_GGML_TYPE_Q5_0), 22);
  CU_ASSERT_EQUAL(upf_ggml_type_size(UPF_GGML_TYPE_Q8_0), 34);
  CU_ASSERT_EQUAL(upf_ggml_block_size(UPF_GGML_TYPE_Q6_K), 256);
  CU_ASSERT_EQUAL(upf_ggml_type_size(UPF_GGML_TYPE_Q4_K), 144);
  CU_ASSERT_EQUAL(upf_ggml_type_size(UPF_GGML_TYPE_Q6_K), 210);
  CU_ASSERT_EQUAL(upf_ggml_row_size(UPF_GGML_TYPE_Q4_K, 512), 288);
  CU_ASSERT_EQUAL(upf_ggml_row_size(UPF_GGML_TYPE_Q4_K, 100), -1);
  CU_ASSERT_EQUAL(upf_ggml_row_size(UPF_GGML_TYPE_F32, 7), 28);
  CU_ASSERT_EQUAL(upf_ggml_row_size(UPF_GGML_TYPE_Q8_0, INT64_MAX / 32 * 32), -1); /* overflow */
  CU_ASSERT_EQUAL(upf_ggml_row_size((upf_ggml_type)5, 32), -1);
  CU_ASSERT_STRING_EQUAL(upf_gguf_type_name(UPF_GGUF_TYPE_FLOAT64), "float64");
  CU_ASSERT_EQUAL(upf_gguf_type_size(UPF_GGUF_TYPE_BOOL), 1);
  CU_ASSERT_EQUAL(upf_gguf_type_size(UPF_GGUF_TYPE_STRING), 0);
}

static void test_dequant_plain(void) {
  /* f16: 1, -2, 65504 (max), 2^-24 (smallest subnormal), -0, +inf, 0x3555 = 0.333251953125, 2^-14 */
  const uint8_t f16[] = {0x00, 0x3c, 0x00, 0xc0, 0xff, 0x7b, 0x01, 0x00, 0x00, 0x80, 0x00, 0x7c, 0x55, 0x35, 0x00, 0x04};
  float y[8];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_F16, f16, 8, y));
  const float want[8] = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-8f, -0.0f, INFINITY, 0.333251953125f, 6.103515625e-5f};
  for (int i = 0; i < 8; i++)
    expect_f(y, i, want[i], "f16");
  CU_ASSERT(signbit(y[4]));
  /* bf16: 1, -3, 3.140625, smallest normal 2^-126 */
  const uint8_t bf16[] = {0x80, 0x3f, 0x40, 0xc0, 0x49, 0x40, 0x80, 0x00};
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_BF16, bf16, 4, y));
  expect_f(y, 0, 1.0f, "bf16");
  expect_f(y, 1, -3.0f, "bf16");
  expect_f(y, 2, 3.140625f, "bf16");
  expect_f(y, 3, 0x1p-126f, "bf16");
  /* f32 from an unaligned source */
  uint8_t f32[1 + 8];
  const float src[2] = {1.5f, -0.25f};
  memcpy(f32 + 1, src, 8);
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_F32, f32 + 1, 2, y));
  expect_f(y, 0, 1.5f, "f32");
  expect_f(y, 1, -0.25f, "f32");
}

/* Q4_0, two blocks: d = 0.5 then d = 2; qs[j] = j | (15 - j) << 4. */
static void test_dequant_q4_0(void) {
  uint8_t b[2 * 18];
  b[0] = 0x00, b[1] = 0x38;   /* 0.5 */
  b[18] = 0x00, b[19] = 0x40; /* 2.0 */
  for (int j = 0; j < 16; j++)
    b[2 + j] = b[20 + j] = (uint8_t)(j | ((15 - j) << 4));
  float y[64];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q4_0, b, 64, y));
  expect_f(y, 0, -4.0f, "q4_0");  /* (0 - 8) * 0.5 */
  expect_f(y, 15, 3.5f, "q4_0");  /* (15 - 8) * 0.5 */
  expect_f(y, 16, 3.5f, "q4_0");  /* high nibble of qs[0] = 15 */
  expect_f(y, 31, -4.0f, "q4_0"); /* high nibble of qs[15] = 0 */
  expect_f(y, 5, -1.5f, "q4_0");
  expect_f(y, 32, -16.0f, "q4_0"); /* second block, d = 2 */
  expect_f(y, 63, -16.0f, "q4_0");
  expect_f(y, 40, 0.0f, "q4_0"); /* qs[8] low = 8 */
}

/* Q4_1: d = 0.25, m = -1; element = q * d + m. */
static void test_dequant_q4_1(void) {
  uint8_t b[20];
  b[0] = 0x00, b[1] = 0x34; /* 0.25 */
  b[2] = 0x00, b[3] = 0xbc; /* -1 */
  for (int j = 0; j < 16; j++)
    b[4 + j] = (uint8_t)(j | ((15 - j) << 4));
  float y[32];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q4_1, b, 32, y));
  expect_f(y, 0, -1.0f, "q4_1");
  expect_f(y, 3, -0.25f, "q4_1");
  expect_f(y, 15, 2.75f, "q4_1");
  expect_f(y, 16, 2.75f, "q4_1");
  expect_f(y, 31, -1.0f, "q4_1");
  expect_f(y, 20, 1.75f, "q4_1"); /* high nibble of qs[4] = 11 */
}

/* Q5_0: d = 2, qh = bytes 01 80 00 ff (bits 0, 15, 24..31), qs[j] = j | (15 - j) << 4;
 * element = d * (q5 - 16). */
static void test_dequant_q5_0(void) {
  uint8_t b[22];
  b[0] = 0x00, b[1] = 0x40;
  b[2] = 0x01, b[3] = 0x80, b[4] = 0x00, b[5] = 0xff;
  for (int j = 0; j < 16; j++)
    b[6 + j] = (uint8_t)(j | ((15 - j) << 4));
  float y[32];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q5_0, b, 32, y));
  expect_f(y, 0, 0.0f, "q5_0");    /* 0 + 16 - 16 */
  expect_f(y, 1, -30.0f, "q5_0");  /* 1 - 16 */
  expect_f(y, 15, 30.0f, "q5_0");  /* 15 + 16 - 16 */
  expect_f(y, 16, -2.0f, "q5_0");  /* 15 - 16 */
  expect_f(y, 20, -10.0f, "q5_0"); /* 11 - 16 */
  expect_f(y, 24, 14.0f, "q5_0");  /* 7 + 16 - 16 */
  expect_f(y, 31, 0.0f, "q5_0");   /* 0 + 16 - 16 */
}

/* Q5_1: d = 1, m = 0.5, qh bits 0 and 31; element = q5 * d + m. */
static void test_dequant_q5_1(void) {
  uint8_t b[24];
  b[0] = 0x00, b[1] = 0x3c, b[2] = 0x00, b[3] = 0x38;
  b[4] = 0x01, b[5] = 0x00, b[6] = 0x00, b[7] = 0x80;
  for (int j = 0; j < 16; j++)
    b[8 + j] = (uint8_t)(j | ((15 - j) << 4));
  float y[32];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q5_1, b, 32, y));
  expect_f(y, 0, 16.5f, "q5_1");
  expect_f(y, 1, 1.5f, "q5_1");
  expect_f(y, 16, 15.5f, "q5_1");
  expect_f(y, 31, 16.5f, "q5_1");
}

/* Q8_0: d = 0.125, qs[j] = 8j - 128 (int8). */
static void test_dequant_q8_0(void) {
  uint8_t b[34];
  b[0] = 0x00, b[1] = 0x30;
  for (int j = 0; j < 32; j++)
    b[2 + j] = (uint8_t)(int8_t)(8 * j - 128);
  float y[32];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q8_0, b, 32, y));
  expect_f(y, 0, -16.0f, "q8_0");
  expect_f(y, 16, 0.0f, "q8_0");
  expect_f(y, 31, 15.0f, "q8_0");
  expect_f(y, 1, -15.0f, "q8_0");
}

/* The 12 scale bytes of a K block with sub-block scales {1,2,3,4,17,33,50,63} and mins
 * {0,1,2,3,20,40,5,63}, packed by hand: bytes 0-3 scale[j] | (scale[j+4] >> 4) << 6, bytes 4-7
 * min[j] | (min[j+4] >> 4) << 6, bytes 8-11 (scale[j+4] & 15) | (min[j+4] & 15) << 4. */
static const uint8_t k_scales[12] = {0x41, 0x82, 0xc3, 0xc4, 0x40, 0x81, 0x02, 0xc3, 0x41, 0x81, 0x52, 0xff};

/* Q4_K: d = 1, dmin = 0.5, qs[i] = (i % 16) | ((7i) % 16) << 4. Element e lies in sub-block s = e/32,
 * byte (s/2)*32 + e%32, low nibble for even s; value = d*scale[s]*q - dmin*min[s]. */
static void test_dequant_q4_k(void) {
  uint8_t b[144];
  b[0] = 0x00, b[1] = 0x3c, b[2] = 0x00, b[3] = 0x38;
  memcpy(b + 4, k_scales, 12);
  for (int i = 0; i < 128; i++)
    b[16 + i] = (uint8_t)((i % 16) | (((7 * i) % 16) << 4));
  float y[256];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q4_K, b, 256, y));
  expect_f(y, 0, 0.0f, "q4_K");
  expect_f(y, 5, 5.0f, "q4_K");     /* 1*5 - 0 */
  expect_f(y, 33, 13.5f, "q4_K");   /* 2*7 - 0.5*1 */
  expect_f(y, 70, 17.0f, "q4_K");   /* 3*6 - 0.5*2 */
  expect_f(y, 127, 34.5f, "q4_K");  /* 4*9 - 0.5*3 */
  expect_f(y, 130, 24.0f, "q4_K");  /* 17*2 - 0.5*20 */
  expect_f(y, 191, 277.0f, "q4_K"); /* 33*9 - 0.5*40 */
  expect_f(y, 200, 397.5f, "q4_K"); /* 50*8 - 0.5*5 */
  expect_f(y, 255, 535.5f, "q4_K"); /* 63*9 - 0.5*63 */
}

/* Q5_K: the Q4_K block above with qh[32] inserted: qh[5] = 0x01 (fifth bit of element 5) and
 * qh[31] = 0x80 (fifth bit of element 255: second sub-block of the fourth pair). */
static void test_dequant_q5_k(void) {
  uint8_t b[176] = {0};
  b[0] = 0x00, b[1] = 0x3c, b[2] = 0x00, b[3] = 0x38;
  memcpy(b + 4, k_scales, 12);
  b[16 + 5] = 0x01;
  b[16 + 31] = 0x80;
  for (int i = 0; i < 128; i++)
    b[48 + i] = (uint8_t)((i % 16) | (((7 * i) % 16) << 4));
  float y[256];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q5_K, b, 256, y));
  expect_f(y, 5, 21.0f, "q5_K");      /* 1*(5+16) */
  expect_f(y, 33, 13.5f, "q5_K");     /* bit 1 of qh[1] clear */
  expect_f(y, 37, 5.5f, "q5_K");      /* high nibble of qs[5] = 3, bit 1 of qh[5] clear: 2*3 - 0.5*1 */
  expect_f(y, 255, 1543.5f, "q5_K");  /* 63*(9+16) - 31.5 */
}

/* Q6_K: ql[i] = (i % 16) | ((3i) % 16) << 4, qh[i] = i, scales[i] = i - 8, d = 0.5. Element e: half
 * h = e/128, k = (e%128)/32, l = e%32; low 4 bits from ql[64h + l + 32(k&1)] (low nibble for k < 2),
 * high 2 bits from bits 2k, 2k+1 of qh[32h + l], scale scales[8h + l/16 + 2k]; value d*scale*(q-32). */
static void test_dequant_q6_k(void) {
  uint8_t b[210];
  for (int i = 0; i < 128; i++)
    b[i] = (uint8_t)((i % 16) | (((3 * i) % 16) << 4));
  for (int i = 0; i < 64; i++)
    b[128 + i] = (uint8_t)i;
  for (int i = 0; i < 16; i++)
    b[192 + i] = (uint8_t)(int8_t)(i - 8);
  b[208] = 0x00, b[209] = 0x38;
  float y[256];
  ASSERT_OK(upf_ggml_dequantize(UPF_GGML_TYPE_Q6_K, b, 256, y));
  expect_f(y, 0, 128.0f, "q6_K");   /* q 0 - 32, scale -8 */
  expect_f(y, 17, 52.5f, "q6_K");   /* q 1|1<<4 = 17 - 32, scale -7 */
  expect_f(y, 40, -24.0f, "q6_K");  /* q 8|2<<4 = 40 - 32, scale -6 */
  expect_f(y, 95, 4.5f, "q6_K");    /* q 13|1<<4 = 29 - 32, scale -3 */
  expect_f(y, 127, 9.5f, "q6_K");   /* q 13 - 32, scale -1 */
  expect_f(y, 161, -31.0f, "q6_K"); /* q 1 - 32, scale 2 */
  expect_f(y, 255, -66.5f, "q6_K"); /* q 13 - 32, scale 7 */
}

static void test_dequant_errors(void) {
  uint8_t b[84] = {0};
  float y[256];
  CU_ASSERT_EQUAL(upf_ggml_dequantize(UPF_GGML_TYPE_Q2_K, b, 256, y), UPF_ERR_DTYPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "q2_K"));
  CU_ASSERT_EQUAL(upf_ggml_dequantize(UPF_GGML_TYPE_Q4_0, b, 33, y), UPF_ERR_SHAPE);
  CU_ASSERT_EQUAL(upf_ggml_dequantize((upf_ggml_type)77, b, 1, y), UPF_ERR_DTYPE);
  CU_ASSERT_EQUAL(upf_ggml_can_dequantize(UPF_GGML_TYPE_Q6_K), 1);
  CU_ASSERT_EQUAL(upf_ggml_can_dequantize(UPF_GGML_TYPE_IQ2_XXS), 0);
}

/* ---- the writer's specimen file -------------------------------------------------------------- */

/* IEEE half bits of a value exactly representable as a normal half (or zero). */
static uint16_t half_bits(float f) {
  if (f == 0.0f)
    return signbit(f) ? 0x8000 : 0;
  uint16_t s = f < 0 ? 0x8000 : 0;
  int e;
  float m = frexpf(fabsf(f), &e); /* |f| = m * 2^e, m in [0.5, 1) */
  return (uint16_t)(s | ((e - 1 + 15) << 10) | ((uint16_t)((m * 2.0f - 1.0f) * 1024.0f) & 0x3ff));
}

typedef struct {
  float f32[24];
  uint16_t f16[16];
  uint16_t bf16[32];
  uint8_t q8[68];
} specimen_data;

/* The metadata and tensors tests/gguf_check.py readback expects (EXPECTED_KV, expected_tensors). */
static void specimen(upf_gguf_writer *w, specimen_data *d, uint32_t alignment) {
  ASSERT_OK(upf_gguf_set_str(w, "general.architecture", "llama"));
  ASSERT_OK(upf_gguf_writer_set_alignment(w, alignment));
  ASSERT_OK(upf_gguf_set_u8(w, "t.u8", 200));
  ASSERT_OK(upf_gguf_set_i8(w, "t.i8", -5));
  ASSERT_OK(upf_gguf_set_u16(w, "t.u16", 60000));
  ASSERT_OK(upf_gguf_set_i16(w, "t.i16", -30000));
  ASSERT_OK(upf_gguf_set_u32(w, "t.u32", 4000000000u));
  ASSERT_OK(upf_gguf_set_i32(w, "t.i32", -2000000000));
  ASSERT_OK(upf_gguf_set_u64(w, "t.u64", (1ull << 63) + 5));
  ASSERT_OK(upf_gguf_set_i64(w, "t.i64", -(INT64_C(1) << 62)));
  ASSERT_OK(upf_gguf_set_f32(w, "t.f32", 1.5f));
  ASSERT_OK(upf_gguf_set_f64(w, "t.f64", -2.25e100));
  ASSERT_OK(upf_gguf_set_bool(w, "t.bool", 1));
  ASSERT_OK(upf_gguf_set_str(w, "t.str", "h\xc3\xa9llo w\xc3\xb6rld"));
  const int32_t ai[3] = {1, -2, 3};
  const float af[2] = {0.5f, -1.25f};
  const uint8_t au8[6] = {0, 51, 102, 153, 204, 255};
  const double ad[2] = {1e-300, 2.0};
  const uint8_t ab[2] = {1, 0};
  const char *as[3] = {"a", "", "\xc3\xbcn\xc3\xaf"};
  ASSERT_OK(upf_gguf_set_arr(w, "t.arr_i32", UPF_GGUF_TYPE_INT32, ai, 3));
  ASSERT_OK(upf_gguf_set_arr(w, "t.arr_f32", UPF_GGUF_TYPE_FLOAT32, af, 2));
  ASSERT_OK(upf_gguf_set_arr(w, "t.arr_u8", UPF_GGUF_TYPE_UINT8, au8, 6));
  ASSERT_OK(upf_gguf_set_arr(w, "t.arr_f64", UPF_GGUF_TYPE_FLOAT64, ad, 2));
  ASSERT_OK(upf_gguf_set_arr(w, "t.arr_bool", UPF_GGUF_TYPE_BOOL, ab, 2));
  ASSERT_OK(upf_gguf_set_arr_str(w, "t.arr_str", as, 3));
  ASSERT_OK(upf_gguf_set_arr(w, "t.arr_empty", UPF_GGUF_TYPE_INT64, NULL, 0));
  for (int i = 0; i < 24; i++)
    d->f32[i] = (float)i * 0.25f - 3.0f;
  for (int i = 0; i < 16; i++)
    d->f16[i] = half_bits((float)i - 7.5f);
  for (int i = 0; i < 32; i++) {
    float v = (float)(i - 16) * 0.5f;
    uint32_t u;
    memcpy(&u, &v, 4);
    d->bf16[i] = (uint16_t)(u >> 16);
  }
  d->q8[0] = 0x00, d->q8[1] = 0x38, d->q8[34] = 0x00, d->q8[35] = 0x38;
  for (int j = 0; j < 32; j++) {
    d->q8[2 + j] = (uint8_t)(int8_t)(j - 16);
    d->q8[36 + j] = (uint8_t)(int8_t)(15 - j);
  }
  const int64_t ne_f32[2] = {8, 3}, ne_f16[3] = {4, 2, 2}, ne_bf16[1] = {32}, ne_q8[2] = {32, 2};
  ASSERT_OK(upf_gguf_add_tensor(w, "w.f32", UPF_GGML_TYPE_F32, 2, ne_f32, d->f32, sizeof d->f32));
  ASSERT_OK(upf_gguf_add_tensor(w, "w.f16", UPF_GGML_TYPE_F16, 3, ne_f16, d->f16, sizeof d->f16));
  ASSERT_OK(upf_gguf_add_tensor_ref(w, "w.bf16", UPF_GGML_TYPE_BF16, 1, ne_bf16, d->bf16, sizeof d->bf16));
  ASSERT_OK(upf_gguf_add_tensor(w, "w.q8_0", UPF_GGML_TYPE_Q8_0, 2, ne_q8, d->q8, sizeof d->q8));
}

static void specimen_values(const char *name, float *want, int64_t *n) {
  *n = 0;
  if (!strcmp(name, "w.f32"))
    for (int i = 0; i < 24; i++)
      want[(*n)++] = (float)i * 0.25f - 3.0f;
  else if (!strcmp(name, "w.f16"))
    for (int i = 0; i < 16; i++)
      want[(*n)++] = (float)i - 7.5f;
  else if (!strcmp(name, "w.bf16"))
    for (int i = 0; i < 32; i++)
      want[(*n)++] = (float)(i - 16) * 0.5f;
  else if (!strcmp(name, "w.q8_0"))
    for (int i = 0; i < 64; i++)
      want[(*n)++] = i < 32 ? (float)(i - 16) * 0.5f : (float)(15 - (i - 32)) * 0.5f;
}

/* An image of the specimen in memory (malloc'd, exact size). */
static uint8_t *specimen_image(uint32_t version, uint32_t alignment, uint64_t *size) {
  upf_gguf_writer *w;
  specimen_data d;
  if (upf_gguf_writer_create(&w) != UPF_OK)
    return NULL;
  specimen(w, &d, alignment);
  upf_gguf_writer_set_version(w, version);
  void *img = NULL;
  upf_status st = upf_gguf_writer_to_memory(w, &img, size);
  upf_gguf_writer_free(w);
  return st == UPF_OK ? img : NULL;
}

/* Checks everything the specimen holds. */
static void check_specimen(const upf_gguf *g, uint32_t version, uint32_t alignment) {
  CU_ASSERT_EQUAL(upf_gguf_version(g), version);
  CU_ASSERT_EQUAL(upf_gguf_alignment(g), alignment);
  CU_ASSERT_EQUAL(upf_gguf_data_offset(g) % alignment, 0);
  CU_ASSERT_EQUAL(upf_gguf_kv_count(g), alignment == 32 ? 20 : 21);
  CU_ASSERT_STRING_EQUAL(upf_gguf_kv_key(upf_gguf_kv_at(g, 0)), "general.architecture");
  CU_ASSERT_PTR_NULL(upf_gguf_kv_at(g, upf_gguf_kv_count(g)));
  const char *s;
  uint64_t len;
  ASSERT_OK(upf_gguf_get_str(g, "general.architecture", &s, &len));
  CU_ASSERT_STRING_EQUAL(s, "llama");
  CU_ASSERT_EQUAL(len, 5);
  uint32_t u32;
  int32_t i32;
  uint64_t u64;
  int64_t i64;
  float f;
  double dd;
  int b;
  ASSERT_OK(upf_gguf_get_u32(g, "t.u8", &u32));
  CU_ASSERT_EQUAL(u32, 200);
  ASSERT_OK(upf_gguf_get_i32(g, "t.i8", &i32));
  CU_ASSERT_EQUAL(i32, -5);
  ASSERT_OK(upf_gguf_get_u32(g, "t.u16", &u32));
  CU_ASSERT_EQUAL(u32, 60000);
  ASSERT_OK(upf_gguf_get_i64(g, "t.i16", &i64));
  CU_ASSERT_EQUAL(i64, -30000);
  ASSERT_OK(upf_gguf_get_u32(g, "t.u32", &u32));
  CU_ASSERT_EQUAL(u32, 4000000000u);
  ASSERT_OK(upf_gguf_get_i32(g, "t.i32", &i32));
  CU_ASSERT_EQUAL(i32, -2000000000);
  ASSERT_OK(upf_gguf_get_u64(g, "t.u64", &u64));
  CU_ASSERT_EQUAL(u64, (1ull << 63) + 5);
  ASSERT_OK(upf_gguf_get_i64(g, "t.i64", &i64));
  CU_ASSERT_EQUAL(i64, -(INT64_C(1) << 62));
  ASSERT_OK(upf_gguf_get_f32(g, "t.f32", &f));
  CU_ASSERT_EQUAL(f, 1.5f);
  ASSERT_OK(upf_gguf_get_f64(g, "t.f64", &dd));
  CU_ASSERT_EQUAL(dd, -2.25e100);
  ASSERT_OK(upf_gguf_get_f32(g, "t.f64", &f));
  CU_ASSERT(isinf(f) && f < 0); /* a double outside the float range rounds to -inf */
  ASSERT_OK(upf_gguf_get_bool(g, "t.bool", &b));
  CU_ASSERT_EQUAL(b, 1);
  ASSERT_OK(upf_gguf_get_str(g, "t.str", &s, NULL));
  CU_ASSERT_STRING_EQUAL(s, "h\xc3\xa9llo w\xc3\xb6rld");
  CU_ASSERT_EQUAL(upf_gguf_kv_type(upf_gguf_kv_find(g, "t.i16")), UPF_GGUF_TYPE_INT16);

  /* values that do not fit, wrong types and absent keys name the key */
  u32 = 7;
  CU_ASSERT_EQUAL(upf_gguf_get_u32(g, "t.i8", &u32), UPF_ERR_FORMAT);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "t.i8"));
  CU_ASSERT_EQUAL(u32, 7);
  CU_ASSERT_EQUAL(upf_gguf_get_i32(g, "t.u32", &i32), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_i64(g, "t.u64", &i64), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_u32(g, "t.f32", &u32), UPF_ERR_FORMAT);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "float32"));
  CU_ASSERT_EQUAL(upf_gguf_get_f32(g, "t.u8", &f), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_bool(g, "t.u8", &b), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_str(g, "t.arr_str", &s, NULL), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_u32(g, "no.such.key", &u32), UPF_ERR_FORMAT);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "no.such.key"));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), upf_gguf_name(g)));
  ASSERT_OK(upf_gguf_get_u32_or(g, "no.such.key", 11, &u32));
  CU_ASSERT_EQUAL(u32, 11);
  ASSERT_OK(upf_gguf_get_f32_or(g, "t.f32", 9.0f, &f));
  CU_ASSERT_EQUAL(f, 1.5f);
  CU_ASSERT_EQUAL(upf_gguf_get_f32_or(g, "t.str", 9.0f, &f), UPF_ERR_FORMAT);
  ASSERT_OK(upf_gguf_get_bool_or(g, "nope", 1, &b));
  CU_ASSERT_EQUAL(b, 1);

  const upf_gguf_arr *a;
  ASSERT_OK(upf_gguf_get_arr(g, "t.arr_i32", &a));
  CU_ASSERT_EQUAL(a->type, UPF_GGUF_TYPE_INT32);
  CU_ASSERT_EQUAL_FATAL(a->n, 3);
  CU_ASSERT_EQUAL(((const int32_t *)a->data)[1], -2);
  int32_t ai[6];
  float af[6];
  ASSERT_OK(upf_gguf_get_arr_i32(g, "t.arr_i32", ai, 3));
  CU_ASSERT(ai[0] == 1 && ai[1] == -2 && ai[2] == 3);
  ASSERT_OK(upf_gguf_get_arr_i32(g, "t.arr_u8", ai, 6));
  CU_ASSERT(ai[0] == 0 && ai[5] == 255);
  CU_ASSERT_EQUAL(upf_gguf_get_arr_i32(g, "t.arr_i32", ai, 4), UPF_ERR_FORMAT); /* length */
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "3 elements"));
  CU_ASSERT_EQUAL(upf_gguf_get_arr_i32(g, "t.arr_f32", ai, 2), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_arr_i32(g, "t.arr_str", ai, 3), UPF_ERR_FORMAT);
  CU_ASSERT_EQUAL(upf_gguf_get_arr(g, "t.u8", &a), UPF_ERR_FORMAT);
  ASSERT_OK(upf_gguf_get_arr_f32(g, "t.arr_f32", af, 2));
  CU_ASSERT(af[0] == 0.5f && af[1] == -1.25f);
  ASSERT_OK(upf_gguf_get_arr_f32(g, "t.arr_f64", af, 2));
  CU_ASSERT(af[0] == (float)1e-300 && af[1] == 2.0f);
  ASSERT_OK(upf_gguf_get_arr_f32(g, "t.arr_i32", af, 3));
  CU_ASSERT(af[1] == -2.0f);
  ASSERT_OK(upf_gguf_get_arr(g, "t.arr_bool", &a));
  CU_ASSERT(a->type == UPF_GGUF_TYPE_BOOL && a->n == 2 && ((const uint8_t *)a->data)[0] == 1 &&
            ((const uint8_t *)a->data)[1] == 0);
  ASSERT_OK(upf_gguf_get_arr(g, "t.arr_str", &a));
  CU_ASSERT_EQUAL_FATAL(a->n, 3);
  CU_ASSERT(a->type == UPF_GGUF_TYPE_STRING && a->data == NULL && a->arrs == NULL);
  CU_ASSERT_STRING_EQUAL(a->strs[0].ptr, "a");
  CU_ASSERT_EQUAL(a->strs[1].len, 0);
  CU_ASSERT_STRING_EQUAL(a->strs[2].ptr, "\xc3\xbcn\xc3\xaf");
  CU_ASSERT_EQUAL(a->strs[2].len, 5);
  ASSERT_OK(upf_gguf_get_arr(g, "t.arr_empty", &a));
  CU_ASSERT(a->n == 0 && a->type == UPF_GGUF_TYPE_INT64 && !a->data);

  static const char *const names[4] = {"w.f32", "w.f16", "w.bf16", "w.q8_0"};
  static const upf_ggml_type types[4] = {UPF_GGML_TYPE_F32, UPF_GGML_TYPE_F16, UPF_GGML_TYPE_BF16, UPF_GGML_TYPE_Q8_0};
  static const int dims[4] = {2, 3, 1, 2};
  static const int64_t ne[4][4] = {{8, 3, 1, 1}, {4, 2, 2, 1}, {32, 1, 1, 1}, {32, 2, 1, 1}};
  static const uint64_t nbytes[4] = {96, 32, 64, 68};
  CU_ASSERT_EQUAL_FATAL(upf_gguf_tensor_count(g), 4);
  CU_ASSERT_PTR_NULL(upf_gguf_tensor_at(g, 4));
  CU_ASSERT_PTR_NULL(upf_gguf_tensor_find(g, "w.f64"));
  const upf_gguf_tensor *t;
  CU_ASSERT_EQUAL(upf_gguf_tensor_get(g, "w.missing", &t), UPF_ERR_FORMAT);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "w.missing"));
  for (int i = 0; i < 4; i++) {
    t = upf_gguf_tensor_at(g, i);
    CU_ASSERT_PTR_EQUAL(upf_gguf_tensor_find(g, names[i]), t);
    CU_ASSERT_STRING_EQUAL(t->name, names[i]);
    CU_ASSERT_EQUAL(t->type, types[i]);
    CU_ASSERT_EQUAL(t->n_dims, dims[i]);
    CU_ASSERT(!memcmp(t->ne, ne[i], sizeof ne[i]));
    CU_ASSERT_EQUAL(t->nbytes, nbytes[i]);
    CU_ASSERT_EQUAL(t->offset % alignment, 0);
    CU_ASSERT_EQUAL(((uintptr_t)t->data - (uintptr_t)upf_gguf_tensor_at(g, 0)->data) % alignment, 0);
    float want[64], got[64];
    int64_t n;
    specimen_values(names[i], want, &n);
    CU_ASSERT_EQUAL_FATAL(n, t->n_elements);
    ASSERT_OK(upf_gguf_tensor_to_f32(t, got));
    for (int64_t k = 0; k < n; k++)
      expect_f(got, k, want[k], names[i]);
  }
  t = upf_gguf_tensor_find(g, "w.q8_0");
  float row[32];
  ASSERT_OK(upf_gguf_tensor_rows_to_f32(t, 1, 1, row));
  expect_f(row, 0, 7.5f, "w.q8_0 row 1");
  CU_ASSERT_EQUAL(upf_gguf_tensor_rows_to_f32(t, 1, 2, row), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "w.q8_0"));
}

static void test_roundtrip(void) {
  static const uint32_t aligns[] = {32, 1, 64, 256};
  for (uint32_t version = 2; version <= 3; version++)
    for (size_t ai = 0; ai < sizeof aligns / sizeof aligns[0]; ai++) {
      uint32_t al = aligns[ai];
      upf_gguf_writer *w;
      specimen_data d;
      ASSERT_OK(upf_gguf_writer_create(&w));
      specimen(w, &d, al);
      ASSERT_OK(upf_gguf_writer_set_version(w, version));
      char path[128];
      path_in(path, sizeof path, "rt.gguf");
      ASSERT_OK(upf_gguf_writer_write(w, path));
      CU_ASSERT_EQUAL(count_entries(tmpdir), 1); /* no temporary left */
      void *mem;
      uint64_t size;
      ASSERT_OK(upf_gguf_writer_to_memory(w, &mem, &size));
      upf_gguf_writer_free(w);
      upf_gguf *g;
      ASSERT_OK(upf_gguf_open(path, &g));
      CU_ASSERT_EQUAL(upf_gguf_file_size(g), size);
      check_specimen(g, version, al);
      upf_gguf_close(g);
      /* the file and the memory image are the same bytes */
      FILE *fp = fopen(path, "rb");
      uint8_t *buf = malloc(size + 1);
      CU_ASSERT_EQUAL(fp && buf ? fread(buf, 1, size + 1, fp) : 0, size);
      CU_ASSERT(buf && !memcmp(buf, mem, size));
      if (fp)
        fclose(fp);
      free(buf);
      ASSERT_OK(upf_gguf_open_memory(mem, size, "mem.gguf", &g));
      check_specimen(g, version, al);
      upf_gguf_close(g);
      free(mem);
      unlink(path);
    }
}

static void test_writer(void) {
  upf_gguf_writer *w;
  ASSERT_OK(upf_gguf_writer_create(&w));
  CU_ASSERT_EQUAL(upf_gguf_writer_set_version(w, 1), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(upf_gguf_writer_set_alignment(w, 48), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(upf_gguf_writer_set_alignment(w, 0), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(upf_gguf_set_u32(w, "", 1), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(upf_gguf_set_arr(w, "k", UPF_GGUF_TYPE_STRING, "x", 1), UPF_ERR_INVALID_ARG);
  /* a key set twice keeps its place and takes the new value and type */
  ASSERT_OK(upf_gguf_set_u32(w, "a", 1));
  ASSERT_OK(upf_gguf_set_str(w, "b", "x"));
  ASSERT_OK(upf_gguf_set_f32(w, "a", 2.5f));
  ASSERT_OK(upf_gguf_writer_set_alignment(w, 16));
  ASSERT_OK(upf_gguf_writer_set_alignment(w, 32)); /* back to the default: the key goes */
  float x[64] = {0};
  const int64_t ne[2] = {16, 4}, bad[2] = {20, 1}, neg[1] = {-1};
  ASSERT_OK(upf_gguf_add_tensor(w, "x", UPF_GGML_TYPE_F32, 2, ne, x, sizeof x));
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "x", UPF_GGML_TYPE_F32, 2, ne, x, sizeof x), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "'x'"));
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "y", UPF_GGML_TYPE_F32, 2, ne, x, 100), UPF_ERR_SHAPE);
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "y", UPF_GGML_TYPE_Q8_0, 2, bad, x, 34), UPF_ERR_SHAPE);
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "y", UPF_GGML_TYPE_F32, 1, neg, x, 0), UPF_ERR_SHAPE);
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "y", UPF_GGML_TYPE_F32, 5, ne, x, 0), UPF_ERR_SHAPE);
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "y", (upf_ggml_type)4, 2, ne, x, sizeof x), UPF_ERR_DTYPE);
  CU_ASSERT_EQUAL(upf_gguf_add_tensor(w, "", UPF_GGML_TYPE_F32, 2, ne, x, sizeof x), UPF_ERR_INVALID_ARG);
  void *mem;
  uint64_t size;
  ASSERT_OK(upf_gguf_writer_to_memory(w, &mem, &size));
  upf_gguf *g;
  ASSERT_OK(upf_gguf_open_memory(mem, size, "w.gguf", &g));
  CU_ASSERT_EQUAL(upf_gguf_kv_count(g), 2);
  CU_ASSERT_STRING_EQUAL(upf_gguf_kv_key(upf_gguf_kv_at(g, 0)), "a");
  float f = 0;
  ASSERT_OK(upf_gguf_get_f32(g, "a", &f));
  CU_ASSERT_EQUAL(f, 2.5f);
  CU_ASSERT_EQUAL(upf_gguf_alignment(g), 32);
  CU_ASSERT_EQUAL(upf_gguf_tensor_count(g), 1);
  upf_gguf_close(g);
  free(mem);
  /* a failed write leaves nothing behind, an existing file is replaced whole */
  char path[160];
  path_in(path, sizeof path, "no/such/dir/x.gguf");
  CU_ASSERT_EQUAL(upf_gguf_writer_write(w, path), UPF_ERR_IO);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), path));
  path_in(path, sizeof path, "replace.gguf");
  FILE *fp = fopen(path, "wb");
  CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
  fputs("old contents, longer than nothing", fp);
  fclose(fp);
  ASSERT_OK(upf_gguf_writer_write(w, path));
  ASSERT_OK(upf_gguf_open(path, &g));
  CU_ASSERT_EQUAL(upf_gguf_file_size(g), size);
  upf_gguf_close(g);
  CU_ASSERT_EQUAL(count_entries(tmpdir), 1);
  unlink(path);
  upf_gguf_writer_free(w);
  /* opening what is not a regular file */
  CU_ASSERT_EQUAL(upf_gguf_open(tmpdir, &g), UPF_ERR_IO);
  CU_ASSERT_PTR_NULL(g);
  path_in(path, sizeof path, "absent.gguf");
  CU_ASSERT_EQUAL(upf_gguf_open(path, &g), UPF_ERR_IO);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "absent.gguf"));
}

/* ---- malformed images ------------------------------------------------------------------------ */

typedef struct {
  uint8_t *p;
  size_t len, cap;
} img;

static void img_put(img *m, const void *src, size_t n) {
  if (m->len + n > m->cap) {
    m->cap = (m->len + n) * 2 + 64;
    m->p = realloc(m->p, m->cap);
  }
  memcpy(m->p + m->len, src, n);
  m->len += n;
}
static void img_le(img *m, uint64_t v, int n) {
  for (int i = 0; i < n; i++) {
    uint8_t b = (uint8_t)(v >> (8 * i));
    img_put(m, &b, 1);
  }
}
static void img_str(img *m, const char *s) {
  img_le(m, strlen(s), 8);
  img_put(m, s, strlen(s));
}
static void img_header(img *m, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
  img_put(m, "GGUF", 4);
  img_le(m, version, 4);
  img_le(m, n_tensors, 8);
  img_le(m, n_kv, 8);
}
static void img_kv_u32(img *m, const char *key, uint32_t v) {
  img_str(m, key);
  img_le(m, UPF_GGUF_TYPE_UINT32, 4);
  img_le(m, v, 4);
}
/* A 1-D tensor info. */
static void img_tensor(img *m, const char *name, uint32_t type, uint64_t ne0, uint64_t offset) {
  img_str(m, name);
  img_le(m, 1, 4);
  img_le(m, ne0, 8);
  img_le(m, type, 4);
  img_le(m, offset, 8);
}
static void img_pad(img *m, size_t align) {
  while (m->len % align)
    img_le(m, 0, 1);
}

/* Opens an exact-size copy; checks the status, that the message names the image and holds
 * `needle`, and that a failure returns no handle. */
static void check_image(const img *m, upf_status want, const char *needle, const char *label) {
  uint8_t *copy = malloc(m->len ? m->len : 1);
  memcpy(copy, m->p, m->len);
  upf_gguf *g = (upf_gguf *)(uintptr_t)1;
  upf_clear_error();
  upf_status st = upf_gguf_open_memory(copy, m->len, "case.gguf", &g);
  char msg[700];
  snprintf(msg, sizeof msg, "%s: got %s (%s), want %s with \"%s\"", label, upf_status_name(st), upf_last_error(),
           upf_status_name(want), needle ? needle : "");
  int ok = st == want;
  if (st != UPF_OK)
    ok = ok && g == NULL && strstr(upf_last_error(), "case.gguf") && (!needle || strstr(upf_last_error(), needle));
  CU_assertImplementation(ok, __LINE__, msg, __FILE__, "", CU_FALSE);
  if (st == UPF_OK)
    upf_gguf_close(g);
  free(copy);
}

static void test_malformed(void) {
  img m = {0};
#define RESET() (m.len = 0)
  /* empty, short, bad magic */
  check_image(&m, UPF_ERR_FORMAT, "truncated", "empty");
  img_put(&m, "GGU", 3);
  check_image(&m, UPF_ERR_FORMAT, "magic", "3 bytes");
  RESET();
  img_header(&m, 3, 0, 0);
  m.p[0] = 'g';
  check_image(&m, UPF_ERR_FORMAT, "bad magic", "bad magic");
  /* versions */
  RESET();
  img_header(&m, 1, 0, 0);
  check_image(&m, UPF_ERR_FORMAT, "version 1", "v1");
  RESET();
  img_header(&m, 4, 0, 0);
  check_image(&m, UPF_ERR_FORMAT, "version 4", "v4");
  RESET();
  img_header(&m, 0x03000000u, 0, 0);
  check_image(&m, UPF_ERR_FORMAT, "big-endian", "big-endian");
  RESET();
  img_header(&m, 2, 0, 0);
  check_image(&m, UPF_OK, NULL, "empty v2");
  /* absurd counts are refused before any allocation */
  RESET();
  img_header(&m, 3, 0, UINT64_C(1) << 60);
  check_image(&m, UPF_ERR_FORMAT, "metadata entries", "absurd n_kv");
  RESET();
  img_header(&m, 3, UINT64_MAX, 0);
  check_image(&m, UPF_ERR_FORMAT, "tensors cannot fit", "absurd n_tensors");
  RESET();
  img_header(&m, 3, 0, 1);
  img_le(&m, UINT64_C(1) << 63, 8);
  img_put(&m, "abcdefghijklmnop", 16);
  check_image(&m, UPF_ERR_FORMAT, "length", "absurd key length");
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "k");
  img_le(&m, UPF_GGUF_TYPE_ARRAY, 4);
  img_le(&m, UPF_GGUF_TYPE_UINT32, 4);
  img_le(&m, UINT64_C(1) << 62, 8);
  img_le(&m, 0, 8);
  check_image(&m, UPF_ERR_FORMAT, "key 'k'", "absurd array length");
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "k");
  img_le(&m, UPF_GGUF_TYPE_ARRAY, 4);
  img_le(&m, UPF_GGUF_TYPE_STRING, 4);
  img_le(&m, 3, 8);
  img_str(&m, "x");
  img_str(&m, "y");
  check_image(&m, UPF_ERR_FORMAT, "key 'k'", "string array short by one");
  /* bad value types, bools */
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "k");
  img_le(&m, 13, 4);
  img_le(&m, 0, 8);
  check_image(&m, UPF_ERR_FORMAT, "value type", "type 13");
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "flag");
  img_le(&m, UPF_GGUF_TYPE_BOOL, 4);
  img_le(&m, 2, 1);
  check_image(&m, UPF_ERR_FORMAT, "key 'flag'", "bool 2");
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "");
  img_le(&m, UPF_GGUF_TYPE_UINT8, 4);
  img_le(&m, 2, 1);
  check_image(&m, UPF_ERR_FORMAT, "empty key", "empty key");
  RESET();
  img_header(&m, 3, 0, 2);
  img_kv_u32(&m, "dup", 1);
  img_kv_u32(&m, "dup", 2);
  check_image(&m, UPF_ERR_FORMAT, "duplicate key", "duplicate key");
  /* nested arrays: two levels read back; nine levels refused */
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "nest");
  img_le(&m, UPF_GGUF_TYPE_ARRAY, 4);
  img_le(&m, UPF_GGUF_TYPE_ARRAY, 4);
  img_le(&m, 2, 8);
  img_le(&m, UPF_GGUF_TYPE_INT16, 4);
  img_le(&m, 1, 8);
  img_le(&m, 0xfffe, 2);
  img_le(&m, UPF_GGUF_TYPE_STRING, 4);
  img_le(&m, 1, 8);
  img_str(&m, "deep");
  check_image(&m, UPF_OK, NULL, "nested arrays");
  {
    upf_gguf *g;
    ASSERT_OK(upf_gguf_open_memory(m.p, m.len, "nest.gguf", &g));
    const upf_gguf_arr *a;
    ASSERT_OK(upf_gguf_get_arr(g, "nest", &a));
    CU_ASSERT(a->type == UPF_GGUF_TYPE_ARRAY && a->n == 2 && a->arrs);
    if (a->arrs) {
      CU_ASSERT(a->arrs[0].type == UPF_GGUF_TYPE_INT16 && a->arrs[0].n == 1 && ((const int16_t *)a->arrs[0].data)[0] == -2);
      CU_ASSERT(a->arrs[1].type == UPF_GGUF_TYPE_STRING && !strcmp(a->arrs[1].strs[0].ptr, "deep"));
    }
    upf_gguf_close(g);
  }
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "deep");
  img_le(&m, UPF_GGUF_TYPE_ARRAY, 4);
  for (int i = 0; i < 10; i++) {
    img_le(&m, UPF_GGUF_TYPE_ARRAY, 4);
    img_le(&m, 1, 8);
  }
  img_le(&m, UPF_GGUF_TYPE_UINT8, 4);
  img_le(&m, 0, 8);
  check_image(&m, UPF_ERR_FORMAT, "nested deeper", "deep nesting");
  /* alignment key */
  RESET();
  img_header(&m, 3, 0, 1);
  img_kv_u32(&m, "general.alignment", 48);
  check_image(&m, UPF_ERR_FORMAT, "general.alignment", "alignment 48");
  RESET();
  img_header(&m, 3, 0, 1);
  img_str(&m, "general.alignment");
  img_le(&m, UPF_GGUF_TYPE_STRING, 4);
  img_str(&m, "32");
  check_image(&m, UPF_ERR_FORMAT, "general.alignment", "alignment string");

  /* tensors: a valid 2-tensor image first, then one defect at a time */
#define TENSORS(body)                       \
  do {                                      \
    RESET();                                \
    img_header(&m, 3, 2, 1);                \
    img_kv_u32(&m, "general.alignment", 16); \
    body;                                   \
    img_pad(&m, 16);                        \
    for (int i_ = 0; i_ < 64; i_++)         \
      img_le(&m, 0, 1);                     \
  } while (0)
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F16, 8, 16));
  check_image(&m, UPF_OK, NULL, "valid tensors");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F16, 8, 56));
  check_image(&m, UPF_ERR_FORMAT, "tensor 'b'", "misaligned offset");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F16, 8, 64));
  check_image(&m, UPF_ERR_FORMAT, "past the end", "out of bounds");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F16, 8, UINT64_MAX - 15));
  check_image(&m, UPF_ERR_FORMAT, "tensor 'b'", "offset wraps");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F16, 16, 0));
  check_image(&m, UPF_ERR_FORMAT, "overlap", "overlapping data");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "a", UPF_GGML_TYPE_F16, 8, 16));
  check_image(&m, UPF_ERR_FORMAT, "duplicate tensor name", "duplicate tensor");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", 4, 8, 16));
  check_image(&m, UPF_ERR_FORMAT, "ggml type 4", "unknown ggml type");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_Q4_0, 16, 16));
  check_image(&m, UPF_ERR_FORMAT, "block size", "partial block");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F32, UINT64_MAX, 16));
  check_image(&m, UPF_ERR_FORMAT, "negative", "negative extent");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "", UPF_GGML_TYPE_F32, 4, 16));
  check_image(&m, UPF_ERR_FORMAT, "empty tensor name", "empty tensor name");
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_str(&m, "b"); img_le(&m, 5, 4));
  check_image(&m, UPF_ERR_FORMAT, "dimensions", "5 dims");
  /* element count overflow: ne = (2^32, 2^32) */
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_str(&m, "b"); img_le(&m, 2, 4);
          img_le(&m, UINT64_C(1) << 32, 8); img_le(&m, UINT64_C(1) << 32, 8); img_le(&m, 0, 4); img_le(&m, 16, 8));
  check_image(&m, UPF_ERR_FORMAT, "overflow", "numel overflow");
  /* byte size overflow: 2^62 f32 elements */
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F32, UINT64_C(1) << 62, 16));
  check_image(&m, UPF_ERR_FORMAT, "overflow", "nbytes overflow");
  /* a zero-sized tensor anywhere aligned is fine */
  TENSORS(img_tensor(&m, "a", UPF_GGML_TYPE_F32, 4, 0); img_tensor(&m, "b", UPF_GGML_TYPE_F32, 0, 0));
  check_image(&m, UPF_OK, NULL, "empty tensor");
  free(m.p);
#undef TENSORS
#undef RESET
}

/* Every proper prefix of a valid file that cuts into its header or tensor data fails cleanly. */
static void test_truncation(void) {
  uint64_t size;
  uint8_t *full = specimen_image(3, 64, &size);
  CU_ASSERT_PTR_NOT_NULL_FATAL(full);
  upf_gguf *g;
  ASSERT_OK(upf_gguf_open_memory(full, size, "full", &g));
  const upf_gguf_tensor *last = upf_gguf_tensor_at(g, upf_gguf_tensor_count(g) - 1);
  uint64_t data_end = upf_gguf_data_offset(g) + last->offset + last->nbytes;
  upf_gguf_close(g);
  int bad = 0;
  for (uint64_t len = 0; len < size; len++) {
    uint8_t *copy = malloc(len ? len : 1);
    memcpy(copy, full, len);
    upf_status st = upf_gguf_open_memory(copy, len, "case.gguf", &g);
    upf_status want = len < data_end ? UPF_ERR_FORMAT : UPF_OK;
    if (st != want || (st != UPF_OK && !strstr(upf_last_error(), "case.gguf"))) {
      if (bad++ < 5)
        printf("\n  truncated to %" PRIu64 " of %" PRIu64 ": %s (%s)\n", len, size, upf_status_name(st), upf_last_error());
    }
    upf_gguf_close(st == UPF_OK ? g : NULL);
    free(copy);
  }
  CU_ASSERT_EQUAL(bad, 0);
  free(full);
}

/* Touches everything a handle exposes, as a consumer would. */
static void walk(const upf_gguf *g) {
  for (int64_t i = 0; i < upf_gguf_kv_count(g); i++) {
    const upf_gguf_kv *kv = upf_gguf_kv_at(g, i);
    const char *key = upf_gguf_kv_key(kv);
    CU_ASSERT_PTR_EQUAL(upf_gguf_kv_find(g, key), kv);
    const upf_gguf_arr *a;
    const char *s;
    uint64_t u;
    double d;
    int b;
    if (upf_gguf_get_arr(g, key, &a) == UPF_OK) {
      for (uint64_t k = 0; a->strs && k < a->n; k++)
        CU_ASSERT_EQUAL(strlen(a->strs[k].ptr) <= a->strs[k].len, 1);
      for (uint64_t k = 0; a->arrs && k < a->n; k++)
        CU_ASSERT(a->arrs[k].n == 0 || a->arrs[k].data || a->arrs[k].strs || a->arrs[k].arrs);
      if (a->n && a->n < 4096 && upf_gguf_type_size(a->type)) {
        float *f = malloc(a->n * sizeof *f);
        CU_ASSERT_EQUAL(upf_gguf_get_arr_f32(g, key, f, a->n), a->type == UPF_GGUF_TYPE_BOOL ? UPF_ERR_FORMAT : UPF_OK);
        free(f);
      }
    }
    (void)upf_gguf_get_str(g, key, &s, &u);
    (void)upf_gguf_get_u64(g, key, &u);
    (void)upf_gguf_get_f64(g, key, &d);
    (void)upf_gguf_get_bool(g, key, &b);
  }
  for (int64_t i = 0; i < upf_gguf_tensor_count(g); i++) {
    const upf_gguf_tensor *t = upf_gguf_tensor_at(g, i);
    CU_ASSERT_PTR_EQUAL(upf_gguf_tensor_find(g, t->name), t);
    if (upf_ggml_can_dequantize(t->type) && t->n_elements <= (1 << 16)) {
      float *f = malloc((size_t)(t->n_elements ? t->n_elements : 1) * sizeof *f);
      CU_ASSERT_EQUAL(upf_gguf_tensor_to_f32(t, f), UPF_OK);
      free(f);
    }
  }
}

/* Seeded mutations of a valid file: byte flips, random bytes, 64-bit fields set to edge values,
 * truncations; every result opens cleanly or fails with UPF_ERR_FORMAT naming the file. */
static void test_fuzz(void) {
  uint64_t size;
  uint8_t *full = specimen_image(3, 32, &size);
  CU_ASSERT_PTR_NOT_NULL_FATAL(full);
  upf_gguf *g;
  ASSERT_OK(upf_gguf_open_memory(full, size, "full", &g));
  uint64_t head = upf_gguf_data_offset(g); /* mutations mostly land in the header and directory */
  upf_gguf_close(g);
  static const uint64_t edge[] = {0, 1, 2, 31, 32, 0x7f, 0xff, 0xffff, 0xffffffffu, UINT64_C(1) << 31, UINT64_C(1) << 32,
                                  UINT64_C(1) << 62, INT64_MAX, UINT64_MAX};
  upf_rng rng;
  upf_rng_seed(&rng, 0x6775676675ull);
  int iters = upf_test_quick() ? 40 : 4000, opened = 0, bad = 0;
  uint8_t *buf = malloc(size);
  for (int it = 0; it < iters; it++) {
    memcpy(buf, full, size);
    uint64_t len = size;
    int nmut = 1 + (int)upf_rng_below(&rng, 4);
    for (int k = 0; k < nmut; k++) {
      uint64_t span = upf_rng_below(&rng, 8) ? head : len;
      if (span == 0 || span > len)
        span = len;
      uint64_t pos = upf_rng_below(&rng, span);
      switch (upf_rng_below(&rng, 5)) {
      case 0:
        buf[pos] ^= (uint8_t)(1u << upf_rng_below(&rng, 8));
        break;
      case 1:
        buf[pos] = (uint8_t)upf_rng_next(&rng);
        break;
      case 2: {
        uint64_t v = edge[upf_rng_below(&rng, sizeof edge / sizeof edge[0])];
        int n = upf_rng_below(&rng, 2) ? 8 : 4;
        for (int b = 0; b < n && pos + b < len; b++)
          buf[pos + b] = (uint8_t)(v >> (8 * b));
        break;
      }
      case 3:
        len = upf_rng_below(&rng, len + 1);
        break;
      default:
        buf[pos] = 0;
      }
    }
    uint8_t *copy = malloc(len ? len : 1);
    memcpy(copy, buf, len);
    upf_status st = upf_gguf_open_memory(copy, len, "case.gguf", &g);
    if (st == UPF_OK) {
      opened++;
      walk(g);
      upf_gguf_close(g);
    } else if (st != UPF_ERR_FORMAT || !strstr(upf_last_error(), "case.gguf") || g) {
      if (bad++ < 5)
        printf("\n  fuzz iteration %d: %s (%s)\n", it, upf_status_name(st), upf_last_error());
    }
    free(copy);
  }
  CU_ASSERT_EQUAL(bad, 0);
  CU_ASSERT(opened > 0 && opened < iters); /* the mutations reach both outcomes */
  free(buf);
  free(full);
}

/* ---- the real model files -------------------------------------------------------------------- */

/* UPF_MODEL_DIR, else the models/ of ci/fetch-models.sh's cache (UPF_MODEL_CACHE, default
 * ~/.cache/uniprefill). */
static const char *model_dir(char *buf, size_t cap) {
  const char *d = getenv("UPF_MODEL_DIR"), *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
  if (d && *d)
    return d;
  if (cache && *cache)
    snprintf(buf, cap, "%s/models", cache);
  else
    snprintf(buf, cap, "%s/.cache/uniprefill/models", home ? home : "");
  return buf;
}

/* The model file's path, or NULL after printing why the test is skipped. */
static const char *model_path(const char *file, const char *test, char *buf, size_t cap) {
  char dir[400];
  snprintf(buf, cap, "%s/%s", model_dir(dir, sizeof dir), file);
  if (access(buf, R_OK) != 0) {
    printf("\n  SKIPPED gguf/%s: %s is absent (ci/fetch-models.sh fetches it; UPF_MODEL_DIR or UPF_MODEL_CACHE choose the directory)\n",
           test, buf);
    return NULL;
  }
  return buf;
}

static int allowed_type(upf_ggml_type t) {
  return t == UPF_GGML_TYPE_F32 || t == UPF_GGML_TYPE_Q4_1 || t == UPF_GGML_TYPE_Q5_0 || t == UPF_GGML_TYPE_Q8_0 ||
         t == UPF_GGML_TYPE_Q4_K || t == UPF_GGML_TYPE_Q6_K;
}

typedef struct {
  const char *name;
  int64_t row0, nrows; /* nrows 0: the whole tensor */
  upf_ggml_type type;
  double rms_lo, rms_hi;
} probe;

/* Dequantises each probe: all finite, the type expected, the rms in range and the values not all one. */
static void check_probes(const upf_gguf *g, const probe *p, int n) {
  for (int i = 0; i < n; i++) {
    const upf_gguf_tensor *t;
    ASSERT_OK(upf_gguf_tensor_get(g, p[i].name, &t));
    CU_ASSERT_EQUAL(t->type, p[i].type);
    int64_t rows = p[i].nrows ? p[i].nrows : t->n_elements / t->ne[0], n_el = rows * t->ne[0];
    float *x = malloc((size_t)n_el * sizeof *x);
    ASSERT_OK(upf_gguf_tensor_rows_to_f32(t, p[i].row0, rows, x));
    double s = 0, s2 = 0;
    int64_t nonfinite = 0;
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t k = 0; k < n_el; k++) {
      if (!isfinite(x[k])) {
        nonfinite++;
        continue;
      }
      s += x[k], s2 += (double)x[k] * x[k];
      lo = fminf(lo, x[k]), hi = fmaxf(hi, x[k]);
    }
    double rms = sqrt(s2 / (double)n_el);
    if (nonfinite || !(rms > p[i].rms_lo && rms < p[i].rms_hi) || !(hi > lo))
      printf("\n  %s: %" PRId64 " non-finite, rms %g (want %g..%g), range [%g, %g]\n", p[i].name, nonfinite, rms,
             p[i].rms_lo, p[i].rms_hi, lo, hi);
    CU_ASSERT_EQUAL(nonfinite, 0);
    CU_ASSERT(rms > p[i].rms_lo && rms < p[i].rms_hi);
    CU_ASSERT(hi > lo);
    free(x);
  }
}

static void check_directory(const upf_gguf *g, int64_t n_tensors) {
  CU_ASSERT_EQUAL(upf_gguf_version(g), 3);
  CU_ASSERT_EQUAL(upf_gguf_tensor_count(g), n_tensors);
  uint64_t total = 0;
  for (int64_t i = 0; i < upf_gguf_tensor_count(g); i++) {
    const upf_gguf_tensor *t = upf_gguf_tensor_at(g, i);
    if (!allowed_type(t->type))
      printf("\n  %s: unexpected type %s\n", t->name, upf_ggml_type_name(t->type));
    CU_ASSERT(allowed_type(t->type));
    CU_ASSERT(t->n_dims >= 1 && t->n_dims <= 2);
    total += t->nbytes;
  }
  CU_ASSERT(upf_gguf_data_offset(g) + total <= upf_gguf_file_size(g));
  CU_ASSERT(upf_gguf_data_offset(g) + total + 32 * (uint64_t)n_tensors >= upf_gguf_file_size(g));
}

static void expect_u32(const upf_gguf *g, const char *key, uint32_t want) {
  uint32_t v = 0;
  ASSERT_OK(upf_gguf_get_u32(g, key, &v));
  if (v != want)
    printf("\n  %s = %" PRIu32 ", want %" PRIu32 "\n", key, v, want);
  CU_ASSERT_EQUAL(v, want);
}

static void expect_str(const upf_gguf *g, const char *key, const char *want) {
  const char *s = "";
  ASSERT_OK(upf_gguf_get_str(g, key, &s, NULL));
  CU_ASSERT_STRING_EQUAL(s, want);
}

static const probe smol_probes[] = {
    {"token_embd.weight", 0, 8, UPF_GGML_TYPE_Q8_0, 1e-3, 10},
    {"token_embd.weight", 49144, 8, UPF_GGML_TYPE_Q8_0, 1e-3, 10},
    {"blk.0.attn_q.weight", 0, 0, UPF_GGML_TYPE_Q4_1, 1e-2, 10},
    {"blk.29.ffn_down.weight", 0, 0, UPF_GGML_TYPE_Q4_1, 1e-2, 10},
    {"blk.0.attn_norm.weight", 0, 0, UPF_GGML_TYPE_F32, 1e-3, 100},
    {"output_norm.weight", 0, 0, UPF_GGML_TYPE_F32, 1e-3, 100},
};

static void test_real_smollm2(void) {
  char path[600];
  if (!model_path("SmolLM2-135M-Instruct.Q4_1.gguf", "real SmolLM2", path, sizeof path))
    return;
  upf_gguf *g;
  ASSERT_OK(upf_gguf_open(path, &g));
  CU_ASSERT_EQUAL(upf_gguf_file_size(g), 98362432);
  expect_str(g, "general.architecture", "llama");
  expect_u32(g, "llama.block_count", 30);
  expect_u32(g, "llama.embedding_length", 576);
  expect_u32(g, "llama.feed_forward_length", 1536);
  expect_u32(g, "llama.attention.head_count", 9);
  expect_u32(g, "llama.attention.head_count_kv", 3);
  expect_u32(g, "llama.rope.dimension_count", 64);
  expect_u32(g, "llama.vocab_size", 49152);
  expect_u32(g, "tokenizer.ggml.bos_token_id", 1);
  expect_str(g, "tokenizer.ggml.model", "gpt2");
  float f;
  ASSERT_OK(upf_gguf_get_f32(g, "llama.rope.freq_base", &f));
  CU_ASSERT_EQUAL(f, 100000.0f);
  const upf_gguf_arr *a;
  ASSERT_OK(upf_gguf_get_arr(g, "tokenizer.ggml.tokens", &a));
  CU_ASSERT(a->type == UPF_GGUF_TYPE_STRING && a->n == 49152);
  ASSERT_OK(upf_gguf_get_arr(g, "tokenizer.ggml.merges", &a));
  CU_ASSERT(a->type == UPF_GGUF_TYPE_STRING && a->n > 40000 && strchr(a->strs[0].ptr, ' '));
  check_directory(g, 272);
  const upf_gguf_tensor *t = upf_gguf_tensor_find(g, "token_embd.weight");
  CU_ASSERT(t && t->ne[0] == 576 && t->ne[1] == 49152);
  if (!upf_test_quick())
    check_probes(g, smol_probes, (int)(sizeof smol_probes / sizeof smol_probes[0]));
  upf_gguf_close(g);
}

static const probe gemma_probes[] = {
    {"token_embd.weight", 0, 4, UPF_GGML_TYPE_Q8_0, 1e-3, 10},
    {"token_embd.weight", 262140, 4, UPF_GGML_TYPE_Q8_0, 1e-3, 10},
    {"blk.0.attn_k.weight", 0, 0, UPF_GGML_TYPE_Q5_0, 1e-3, 10},
    {"blk.0.attn_output.weight", 0, 0, UPF_GGML_TYPE_Q4_K, 1e-3, 10},
    {"blk.0.ffn_down.weight", 0, 0, UPF_GGML_TYPE_Q6_K, 1e-3, 10},
    {"blk.0.attn_q_norm.weight", 0, 0, UPF_GGML_TYPE_F32, 1e-2, 1e3},
    {"output_norm.weight", 0, 0, UPF_GGML_TYPE_F32, 1e-2, 1e3},
};

static void test_real_gemma3(void) {
  char path[600];
  if (!model_path("gemma-3-270m-q4_k_m.gguf", "real Gemma-3", path, sizeof path))
    return;
  if (upf_test_quick()) {
    printf("\n  SKIPPED gguf/real Gemma-3 in quick mode: parsing its 262144-token vocabulary under Valgrind is slow; the native pass reads it\n");
    return;
  }
  upf_gguf *g;
  ASSERT_OK(upf_gguf_open(path, &g));
  CU_ASSERT_EQUAL(upf_gguf_file_size(g), 253113024);
  expect_str(g, "general.architecture", "gemma3");
  expect_u32(g, "gemma3.block_count", 18);
  expect_u32(g, "gemma3.embedding_length", 640);
  expect_u32(g, "gemma3.attention.head_count", 4);
  expect_u32(g, "gemma3.attention.head_count_kv", 1);
  expect_u32(g, "gemma3.attention.key_length", 256);
  expect_u32(g, "gemma3.attention.sliding_window", 512);
  expect_str(g, "tokenizer.ggml.model", "llama");
  const upf_gguf_arr *a;
  ASSERT_OK(upf_gguf_get_arr(g, "tokenizer.ggml.tokens", &a));
  CU_ASSERT(a->type == UPF_GGUF_TYPE_STRING && a->n == 262144);
  ASSERT_OK(upf_gguf_get_arr(g, "tokenizer.ggml.scores", &a));
  CU_ASSERT(a->type == UPF_GGUF_TYPE_FLOAT32 && a->n == 262144);
  check_directory(g, 236);
  check_probes(g, gemma_probes, (int)(sizeof gemma_probes / sizeof gemma_probes[0]));
  upf_gguf_close(g);
}

/* ---- cross-checks against gguf-py ------------------------------------------------------------ */

/* The venv's python and the check script, or NULL after printing why the test is skipped. */
static const char *gguf_py(const char *test, char *buf, size_t cap) {
  if (upf_test_quick()) {
    printf("\n  SKIPPED gguf/%s in quick mode: the gguf-py cross-check runs in the native pass\n", test);
    return NULL;
  }
  const char *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
  if (cache && *cache)
    snprintf(buf, cap, "%s/venv/bin/python", cache);
  else
    snprintf(buf, cap, "%s/.cache/uniprefill/venv/bin/python", home ? home : "");
  if (access(buf, X_OK) != 0) {
    printf("\n  SKIPPED gguf/%s: no gguf-py venv at %s (ci/fetch-models.sh creates it)\n", test, buf);
    return NULL;
  }
  if (access("tests/gguf_check.py", R_OK) != 0) {
    printf("\n  SKIPPED gguf/%s: tests/gguf_check.py not found (run from the repository root)\n", test);
    return NULL;
  }
  return buf;
}

/* Runs `python tests/gguf_check.py args`; prints its output when it fails. */
static int run_check(const char *python, const char *args) {
  char log[128], cmd[4096];
  path_in(log, sizeof log, "gguf_check.log");
  snprintf(cmd, sizeof cmd, "'%s' tests/gguf_check.py %s >'%s' 2>&1", python, args, log);
  int rc = system(cmd);
  if (rc != 0) {
    printf("\n  %s: exit status %d\n", cmd, rc);
    FILE *f = fopen(log, "r");
    char line[512];
    for (int n = 0; f && fgets(line, sizeof line, f) && n < 40; n++)
      printf("  | %s", line);
    if (f)
      fclose(f);
  }
  unlink(log);
  return rc;
}

static void test_py_sizes(void) {
  char py[600], out[128], args[256];
  if (!gguf_py("gguf-py type table", py, sizeof py))
    return;
  path_in(out, sizeof out, "sizes.npy");
  snprintf(args, sizeof args, "sizes '%s'", out);
  CU_ASSERT_EQUAL_FATAL(run_check(py, args), 0);
  upf_tensor t;
  ASSERT_OK(upf_npy_read(out, &t));
  CU_ASSERT_EQUAL_FATAL(t.dtype, UPF_DTYPE_I64);
  const int64_t *r = t.data;
  int matched = 0;
  for (int64_t i = 0; i < t.shape[0]; i++) {
    upf_ggml_type ty = (upf_ggml_type)r[3 * i];
    if (!upf_ggml_type_name(ty))
      continue; /* a type newer than this table */
    matched++;
    if (upf_ggml_block_size(ty) != r[3 * i + 1] || upf_ggml_type_size(ty) != r[3 * i + 2])
      printf("\n  %s: ours (%" PRId64 ", %" PRId64 "), gguf-py (%" PRId64 ", %" PRId64 ")\n", upf_ggml_type_name(ty),
             upf_ggml_block_size(ty), upf_ggml_type_size(ty), r[3 * i + 1], r[3 * i + 2]);
    CU_ASSERT_EQUAL(upf_ggml_block_size(ty), r[3 * i + 1]);
    CU_ASSERT_EQUAL(upf_ggml_type_size(ty), r[3 * i + 2]);
  }
  CU_ASSERT(matched >= 30);
  upf_tensor_free(&t);
  unlink(out);
}

/* Rows of the probes dequantised by gguf-py from the same bytes, compared bit for bit. */
static void py_dequant(const char *file, const char *test, const probe *p, int n) {
  char py[600], path[600];
  if (!gguf_py(test, py, sizeof py) || !model_path(file, test, path, sizeof path))
    return;
  upf_gguf *g;
  ASSERT_OK(upf_gguf_open(path, &g));
  char args[4096];
  int len = snprintf(args, sizeof args, "dequant '%s' '%s'", path, tmpdir);
  int64_t rows[16];
  for (int i = 0; i < n; i++) {
    const upf_gguf_tensor *t = upf_gguf_tensor_find(g, p[i].name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    /* two rows of each probe (a few thousand elements) keep the Python side fast */
    rows[i] = t->n_elements / t->ne[0] - p[i].row0 < 2 ? 1 : 2;
    uint64_t off = upf_gguf_data_offset(g) + t->offset + (uint64_t)p[i].row0 * (uint64_t)upf_ggml_row_size(t->type, t->ne[0]);
    len += snprintf(args + len, sizeof args - (size_t)len, " %" PRIu64 ":%d:%" PRId64 ":%" PRId64, off, (int)t->type,
                    t->ne[0], rows[i]);
  }
  if (run_check(py, args) == 0) {
    for (int i = 0; i < n; i++) {
      const upf_gguf_tensor *t = upf_gguf_tensor_find(g, p[i].name);
      char npy[160];
      snprintf(npy, sizeof npy, "%s/%d.npy", tmpdir, i);
      upf_tensor ref;
      ASSERT_OK(upf_npy_read(npy, &ref));
      CU_ASSERT_EQUAL(ref.shape[0] * ref.shape[1], rows[i] * t->ne[0]);
      float *ours = malloc((size_t)(rows[i] * t->ne[0]) * sizeof *ours);
      ASSERT_OK(upf_gguf_tensor_rows_to_f32(t, p[i].row0, rows[i], ours));
      const float *theirs = ref.data;
      int64_t diff = 0;
      for (int64_t k = 0; k < rows[i] * t->ne[0]; k++)
        if (memcmp(&ours[k], &theirs[k], sizeof(float)) && diff++ < 3)
          printf("\n  %s row %" PRId64 "+: element %" PRId64 " ours %.9g, gguf-py %.9g\n", p[i].name, p[i].row0, k,
                 ours[k], theirs[k]);
      CU_ASSERT_EQUAL(diff, 0);
      free(ours);
      upf_tensor_free(&ref);
      unlink(npy);
    }
  } else {
    CU_FAIL("tests/gguf_check.py dequant failed");
  }
  upf_gguf_close(g);
}

static void test_py_dequant_smollm2(void) {
  py_dequant("SmolLM2-135M-Instruct.Q4_1.gguf", "gguf-py dequant SmolLM2", smol_probes,
             (int)(sizeof smol_probes / sizeof smol_probes[0]));
}

static void test_py_dequant_gemma3(void) {
  py_dequant("gemma-3-270m-q4_k_m.gguf", "gguf-py dequant Gemma-3", gemma_probes,
             (int)(sizeof gemma_probes / sizeof gemma_probes[0]));
}

/* A file of our writer read by GGUFReader: every key, type, value, tensor type, shape and value. */
static void test_py_readback(void) {
  char py[600], path[128], args[256];
  if (!gguf_py("gguf-py readback", py, sizeof py))
    return;
  upf_gguf_writer *w;
  specimen_data d;
  ASSERT_OK(upf_gguf_writer_create(&w));
  specimen(w, &d, 64);
  path_in(path, sizeof path, "readback.gguf");
  ASSERT_OK(upf_gguf_writer_write(w, path));
  upf_gguf_writer_free(w);
  snprintf(args, sizeof args, "readback '%s'", path);
  CU_ASSERT_EQUAL(run_check(py, args), 0);
  unlink(path);
}

void upf_register_gguf_tests(void) {
  static const CU_TestInfo tests[] = {
      {"ggml type table", test_type_table},
      {"dequantize f32/f16/bf16", test_dequant_plain},
      {"dequantize q4_0", test_dequant_q4_0},
      {"dequantize q4_1", test_dequant_q4_1},
      {"dequantize q5_0", test_dequant_q5_0},
      {"dequantize q5_1", test_dequant_q5_1},
      {"dequantize q8_0", test_dequant_q8_0},
      {"dequantize q4_K", test_dequant_q4_k},
      {"dequantize q5_K", test_dequant_q5_k},
      {"dequantize q6_K", test_dequant_q6_k},
      {"dequantize errors", test_dequant_errors},
      {"writer -> reader round trip (v2, v3, alignments)", test_roundtrip},
      {"writer checks and atomic writes", test_writer},
      {"malformed images", test_malformed},
      {"truncated at every offset", test_truncation},
      {"seeded fuzz", test_fuzz},
      {"real SmolLM2", test_real_smollm2},
      {"real Gemma-3", test_real_gemma3},
      {"gguf-py type table", test_py_sizes},
      {"gguf-py dequant SmolLM2", test_py_dequant_smollm2},
      {"gguf-py dequant Gemma-3", test_py_dequant_gemma3},
      {"gguf-py readback", test_py_readback},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("gguf", suite_init, suite_clean, tests);
}

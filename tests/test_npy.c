/* CUnit suite "npy": round trips for every dtype, byte-exact comparison with numpy.save output,
 * version 2.0/3.0 headers, and malformed files (each must fail with the right status, never crash;
 * buffers are sized exactly so that valgrind catches any read past the end). */
#include <CUnit/CUnit.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "tests/test_util.h"
#include "uniprefill/npy.h"

static char tmpdir[64];

static void path_in(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", tmpdir, name); }

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* Whole file into a malloc'd buffer of exactly its size. */
static unsigned char *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  unsigned char *buf = malloc(1 << 16);
  *len = buf ? fread(buf, 1, 1 << 16, f) : 0;
  fclose(f);
  return buf;
}

/* An npy image with the given version and header dict text (used verbatim, no padding). */
static unsigned char *build(int major, const char *dict, const void *data, size_t ndata, size_t *len) {
  size_t hlen = strlen(dict), prefix = major == 1 ? 10 : 12;
  *len = prefix + hlen + ndata;
  unsigned char *b = malloc(*len);
  memcpy(b, "\x93NUMPY", 6);
  b[6] = (unsigned char)major;
  b[7] = 0;
  for (size_t i = 0; i < prefix - 8; i++)
    b[8 + i] = (unsigned char)(hlen >> (8 * i));
  memcpy(b + prefix, dict, hlen);
  if (ndata)
    memcpy(b + prefix + hlen, data, ndata);
  return b;
}

/* Parses a private exact-size copy and checks the status; on failure the tensor must be empty. */
static void check_parse(const void *bytes, size_t len, upf_status want, const char *needle, const char *label) {
  unsigned char *copy = malloc(len ? len : 1);
  if (len)
    memcpy(copy, bytes, len);
  upf_tensor t;
  upf_clear_error();
  upf_status st = upf_npy_parse(copy, len, "case.npy", &t);
  char msg[512];
  snprintf(msg, sizeof msg, "%s: got %s (%s), want %s", label, upf_status_name(st), upf_last_error(),
           upf_status_name(want));
  CU_assertImplementation(st == want, __LINE__, msg, __FILE__, "", CU_FALSE);
  if (st != UPF_OK) {
    CU_ASSERT_PTR_NULL(t.data);
    CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "case.npy"));
    if (needle)
      CU_assertImplementation(strstr(upf_last_error(), needle) != NULL, __LINE__, msg, __FILE__, "", CU_FALSE);
  }
  upf_tensor_free(&t);
  free(copy);
}

static void check_dict(const char *dict, const void *data, size_t ndata, upf_status want, const char *needle) {
  size_t len;
  unsigned char *b = build(1, dict, data, ndata, &len);
  check_parse(b, len, want, needle, dict);
  free(b);
}

static void test_roundtrip(void) {
  static const int64_t shapes[][3] = {{0}, {1}, {7}, {3, 5}, {2, 3, 4}};
  static const int ndims[] = {0, 1, 1, 2, 3};
  char path[128];
  path_in(path, sizeof path, "rt.npy");
  uint32_t seed = 12345;
  for (int d = 0; d < UPF_DTYPE_COUNT; d++) {
    for (int s = 0; s < 5; s++) {
      upf_tensor t, r;
      CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&t, (upf_dtype)d, ndims[s], shapes[s]), UPF_OK);
      size_t bytes = (size_t)upf_tensor_numel(&t) * upf_dtype_size(t.dtype);
      for (size_t i = 0; i < bytes; i++) {
        seed = seed * 1664525u + 1013904223u;
        ((unsigned char *)t.data)[i] = (unsigned char)(d == UPF_DTYPE_BOOL ? seed >> 31 : seed >> 24);
      }
      CU_ASSERT_EQUAL(upf_npy_write(path, &t), UPF_OK);
      CU_ASSERT_EQUAL(upf_npy_read(path, &r), UPF_OK);
      if (r.data) {
        CU_ASSERT_EQUAL(r.dtype, t.dtype);
        CU_ASSERT_EQUAL(r.ndim, t.ndim);
        CU_ASSERT_EQUAL(memcmp(r.shape, t.shape, sizeof t.shape), 0);
        CU_ASSERT_EQUAL(memcmp(r.stride, t.stride, sizeof t.stride), 0);
        CU_ASSERT_EQUAL((uintptr_t)r.data % 64, 0);
        CU_ASSERT_EQUAL(memcmp(r.data, t.data, bytes), 0);
      }
      /* The data must start on a 64-byte boundary right after a '\n'-terminated header. */
      size_t len = 0;
      unsigned char *raw = slurp(path, &len);
      CU_ASSERT_FATAL(raw != NULL && len > 10);
      size_t header = 10 + (size_t)(raw[8] | raw[9] << 8);
      CU_ASSERT_EQUAL(raw[6], 1);
      CU_ASSERT_EQUAL(header % 64, 0);
      CU_ASSERT_EQUAL(len, header + bytes);
      CU_ASSERT(header <= len && raw[header - 1] == '\n');
      free(raw);
      upf_tensor_free(&r);
      upf_tensor_free(&t);
      remove(path);
    }
  }
}

/* What numpy.save writes; the dict is padded with spaces to a '\n' at offset 127. */
static unsigned char *numpy_image(const char *dict, const void *data, size_t ndata, size_t *len) {
  *len = 128 + ndata;
  unsigned char *b = malloc(*len);
  memcpy(b, "\x93NUMPY\x01\x00\x76\x00", 10);
  memset(b + 10, ' ', 117);
  memcpy(b + 10, dict, strlen(dict));
  b[127] = '\n';
  memcpy(b + 128, data, ndata);
  return b;
}

static void check_numpy_bytes(const char *dict, upf_dtype dtype, int ndim, const int64_t *shape,
                              const void *data, size_t ndata) {
  char path[128];
  path_in(path, sizeof path, "known.npy");
  size_t want_len, got_len = 0;
  unsigned char *want = numpy_image(dict, data, ndata, &want_len);
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&t, dtype, ndim, shape), UPF_OK);
  memcpy(t.data, data, ndata);
  CU_ASSERT_EQUAL(upf_npy_write(path, &t), UPF_OK);
  unsigned char *got = slurp(path, &got_len);
  CU_ASSERT_EQUAL(got_len, want_len);
  CU_ASSERT(got && got_len == want_len && memcmp(got, want, want_len) == 0);
  upf_tensor r;
  CU_ASSERT_EQUAL(upf_npy_parse(want, want_len, "known", &r), UPF_OK);
  CU_ASSERT(r.data && r.dtype == dtype && r.ndim == ndim && memcmp(r.data, data, ndata) == 0);
  upf_tensor_free(&r);
  upf_tensor_free(&t);
  free(got);
  free(want);
  remove(path);
}

static void test_numpy_bytes(void) {
  /* np.save(f, np.arange(3, dtype='<i4')): numpy adds 20 spaces of growth room after the dict. */
  static const unsigned char i32[12] = {0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0};
  const int64_t three = 3;
  check_numpy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", UPF_DTYPE_I32, 1, &three,
                    i32, sizeof i32);
  /* np.save(f, np.float64(1.5)): a 0-d array. */
  static const unsigned char f64[8] = {0, 0, 0, 0, 0, 0, 0xf8, 0x3f};
  check_numpy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", UPF_DTYPE_F64, 0, NULL, f64,
                    sizeof f64);
}

static void test_parse_v2_v3(void) {
  const double vals[4] = {1.0, -2.5, 3.25, 1e300};
  const char *dict = "{\"shape\": (2, 2), \"descr\": \"<f8\",\n \"fortran_order\": False}   \n";
  for (int major = 2; major <= 3; major++) {
    size_t len;
    unsigned char *b = build(major, dict, vals, sizeof vals, &len);
    upf_tensor t;
    CU_ASSERT_EQUAL(upf_npy_parse(b, len, "v2", &t), UPF_OK);
    CU_ASSERT(t.data && t.dtype == UPF_DTYPE_F64 && t.ndim == 2 && t.shape[0] == 2 && t.shape[1] == 2 &&
              memcmp(t.data, vals, sizeof vals) == 0);
    upf_tensor_free(&t);
    check_parse(b, len - 1, UPF_ERR_FORMAT, "truncated", "v2 short by one");
    free(b);
  }
}

static void test_header_variants(void) {
  const unsigned char bytes[8] = {1, 0, 1, 1, 0, 1, 0, 0};
  check_dict("{'shape': (), 'fortran_order': False, 'descr': '<i8'}", bytes, 8, UPF_OK, NULL);
  check_dict("{ \"descr\" : \"|u1\" , \"fortran_order\":False,\"shape\":( 2 , 3 , ) , }\n \t ", bytes, 6,
             UPF_OK, NULL);
  check_dict("{'descr': '<u1', 'fortran_order': False, 'shape': (4,)}", bytes, 4, UPF_OK, NULL);
  check_dict("{'descr': '|b1', 'fortran_order': False, 'shape': (2, 4), }", bytes, 8, UPF_OK, NULL);
  check_dict("{'descr': '<u2', 'fortran_order': False, 'shape': (0, 7), }", NULL, 0, UPF_OK, NULL);
  check_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (2L,), }", bytes, 8, UPF_OK, NULL);

  size_t len;
  unsigned char *b = build(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), }", bytes, 6, &len);
  upf_tensor t;
  CU_ASSERT_EQUAL(upf_npy_parse(b, len, "u8", &t), UPF_OK);
  CU_ASSERT(t.data && t.dtype == UPF_DTYPE_U8 && t.ndim == 2 && t.shape[0] == 2 && t.shape[1] == 3 &&
            t.stride[0] == 3 && memcmp(t.data, bytes, 6) == 0);
  upf_tensor_free(&t);
  free(b);
}

static void test_malformed(void) {
  const unsigned char z[16] = {0};
  const unsigned char two[3] = {0, 2, 1};
  const char *ok = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }";
  size_t len;
  unsigned char *b = build(1, ok, z, 12, &len);
  check_parse(b, len, UPF_OK, NULL, "valid");

  unsigned char *m = malloc(len);
  memcpy(m, b, len);
  m[1] = 'n';
  check_parse(m, len, UPF_ERR_FORMAT, "magic", "bad magic");
  memcpy(m, b, len);
  m[6] = 4;
  check_parse(m, len, UPF_ERR_FORMAT, "version", "version 4.0");
  memcpy(m, b, len);
  m[7] = 1;
  check_parse(m, len, UPF_ERR_FORMAT, "version", "version 1.1");
  memcpy(m, b, len);
  m[8] = 0xe8, m[9] = 0x03;
  check_parse(m, len, UPF_ERR_FORMAT, "past the end", "header length past EOF");
  check_parse(b, 9, UPF_ERR_FORMAT, NULL, "truncated length field");
  check_parse(b, 40, UPF_ERR_FORMAT, NULL, "truncated header");
  free(m);
  free(b);

  check_dict(ok, z, 8, UPF_ERR_FORMAT, "truncated: expected 12 data bytes, found 8");
  check_dict(ok, z, 13, UPF_ERR_FORMAT, "trailing");
  check_dict("{'descr': '<i4', 'fortran_order': True, 'shape': (3,), }", z, 12, UPF_ERR_FORMAT,
             "Fortran order not supported");
  check_dict("{'descr': '<i4', 'fortran_order': 0, 'shape': (3,), }", z, 12, UPF_ERR_FORMAT, NULL);
  check_dict("{'descr': '>i4', 'fortran_order': False, 'shape': (3,), }", z, 12, UPF_ERR_DTYPE, "big-endian");
  check_dict("{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", z, 24, UPF_ERR_DTYPE, "'<f4'");
  check_dict("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", z, 12, UPF_ERR_DTYPE, NULL);
  check_dict("{'descr': '<i4', 'fortran_order': False, }", z, 4, UPF_ERR_FORMAT, "shape");
  check_dict("{'descr': '<i4', 'shape': (3,), }", z, 12, UPF_ERR_FORMAT, "fortran_order");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), 'x': 1}", z, 12, UPF_ERR_FORMAT, NULL);
  check_dict("{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (3,)}", z, 12, UPF_ERR_FORMAT,
             "twice");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (-3,), }", z, 12, UPF_ERR_FORMAT, "negative");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (3), }", z, 12, UPF_ERR_FORMAT, NULL);
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (1,,), }", z, 4, UPF_ERR_FORMAT, NULL);
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", z, 16,
             UPF_ERR_FORMAT, "overflow");
  check_dict("{'descr': '<i8', 'fortran_order': False, 'shape': (9223372036854775807,), }", z, 16,
             UPF_ERR_FORMAT, "overflow");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (99999999999999999999,), }", z, 16,
             UPF_ERR_FORMAT, "64 bits");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", z, 4, UPF_ERR_SHAPE,
             NULL);
  /* No data, but strides past 64 bits: refused with the file named, whichever dim holds the 0. */
  check_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (0, 4611686018427387904, 4611686018427387904), }", z,
             0, UPF_ERR_SHAPE, "overflow");
  check_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (9223372036854775807, 3, 0), }", z, 0,
             UPF_ERR_SHAPE, "overflow");
  check_dict("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 9223372036854775807), }", z, 0, UPF_ERR_SHAPE,
             "byte size");
  check_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (0, 9223372036854775807), }", z, 0, UPF_OK, NULL);
  check_dict("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", two, 3, UPF_ERR_FORMAT, "bool");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), ", z, 12, UPF_ERR_FORMAT, NULL);
  check_dict("{'descr': '<i4", z, 12, UPF_ERR_FORMAT, "unterminated");
  check_dict("{'descr': '<i4', 'fortran_order': False, 'shape': (3,)} x", z, 12, UPF_ERR_FORMAT, NULL);
  check_dict("", z, 12, UPF_ERR_FORMAT, NULL);
  check_parse("", 0, UPF_ERR_FORMAT, NULL, "empty");
}

/* Every proper prefix of a valid file, v1 (as written by upf_npy_write) and v2, must be refused. */
static void test_every_truncation(void) {
  char path[128];
  path_in(path, sizeof path, "trunc.npy");
  const int64_t shape[2] = {2, 3};
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&t, UPF_DTYPE_F32, 2, shape), UPF_OK);
  memset(t.data, 0x3f, 24);
  CU_ASSERT_EQUAL(upf_npy_write(path, &t), UPF_OK);
  upf_tensor_free(&t);
  size_t len = 0, len2;
  unsigned char *v1 = slurp(path, &len);
  CU_ASSERT_FATAL(v1 != NULL && len == 128 + 24);
  unsigned char *v2 = build(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", v1 + 128, 24, &len2);
  for (size_t n = 0; n < len; n++)
    check_parse(v1, n, UPF_ERR_FORMAT, NULL, "v1 prefix");
  for (size_t n = 0; n < len2; n++)
    check_parse(v2, n, UPF_ERR_FORMAT, NULL, "v2 prefix");

  /* Through the file reader too: drop the last data byte. */
  FILE *f = fopen(path, "wb");
  CU_ASSERT_FATAL(f != NULL);
  CU_ASSERT_EQUAL(fwrite(v1, 1, len - 1, f), len - 1);
  fclose(f);
  CU_ASSERT_EQUAL(upf_npy_read(path, &t), UPF_ERR_FORMAT);
  CU_ASSERT_PTR_NULL(t.data);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), path));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "truncated: expected 24 data bytes, found 23"));
  remove(path);
  free(v1);
  free(v2);
}

/* Single-byte corruptions of the header: any status is acceptable, a crash or bad read is not. */
static void test_corrupt_bytes(void) {
  static const unsigned char subs[] = {0, ' ', '\'', '"', '(', ')', '{', '}', ',', ':', '9', '-', 'L', 0xff};
  size_t len;
  unsigned char *b = build(1, "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", "0123456789abcdef",
                           16, &len);
  for (size_t pos = 0; pos < len - 16; pos++) {
    for (size_t k = 0; k < sizeof subs; k++) {
      unsigned char *c = malloc(len);
      memcpy(c, b, len);
      c[pos] = subs[k];
      upf_tensor t;
      upf_status st = upf_npy_parse(c, len, "corrupt", &t);
      CU_ASSERT((st == UPF_OK) == (t.data != NULL));
      upf_tensor_free(&t);
      free(c);
    }
  }
  free(b);
}

static void test_read_missing(void) {
  char path[128];
  path_in(path, sizeof path, "does_not_exist.npy");
  upf_tensor t;
  CU_ASSERT_EQUAL(upf_npy_read(path, &t), UPF_ERR_IO);
  CU_ASSERT_PTR_NULL(t.data);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), path));
  CU_ASSERT_EQUAL(upf_npy_parse("\x93NUMPX", 6, "blob_name", &t), UPF_ERR_FORMAT);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "blob_name"));
}

static void test_write_failures(void) {
  char path[128], dir[128];
  const int64_t shape[2] = {2, 3};
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&t, UPF_DTYPE_I32, 2, shape), UPF_OK);
  memset(t.data, 1, 24);

  path_in(dir, sizeof dir, "no_such_dir");
  path_in(path, sizeof path, "no_such_dir/x.npy");
  CU_ASSERT_EQUAL(upf_npy_write(path, &t), UPF_ERR_IO);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), path));
  CU_ASSERT(!exists(dir));
  CU_ASSERT_EQUAL(upf_test_count_entries(tmpdir), 0);

  /* A directory at the output path is refused before anything is written. */
  path_in(dir, sizeof dir, "a_dir");
  CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0700), 0);
  CU_ASSERT_EQUAL(upf_npy_write(dir, &t), UPF_ERR_IO);
  CU_ASSERT_EQUAL(upf_test_count_entries(tmpdir), 1);
  CU_ASSERT_EQUAL(upf_test_count_entries(dir), 0);
  rmdir(dir);

  /* A transposed view: shape (3, 2), strides (1, 3). */
  path_in(path, sizeof path, "t.npy");
  upf_tensor view = t;
  view.shape[0] = 3, view.shape[1] = 2, view.stride[0] = 1, view.stride[1] = 3;
  CU_ASSERT_EQUAL(upf_npy_write(path, &view), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), path));
  CU_ASSERT(!exists(path));
  CU_ASSERT_EQUAL(upf_test_count_entries(tmpdir), 0);

  /* Overwriting an existing file replaces it whole. */
  CU_ASSERT_EQUAL(upf_npy_write(path, &t), UPF_OK);
  upf_tensor small, r;
  const int64_t one = 1;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&small, UPF_DTYPE_U8, 1, &one), UPF_OK);
  *(unsigned char *)small.data = 7;
  CU_ASSERT_EQUAL(upf_npy_write(path, &small), UPF_OK);
  CU_ASSERT_EQUAL(upf_npy_read(path, &r), UPF_OK);
  CU_ASSERT(r.data && r.dtype == UPF_DTYPE_U8 && r.ndim == 1 && r.shape[0] == 1 &&
            *(unsigned char *)r.data == 7);
  CU_ASSERT_EQUAL(upf_test_count_entries(tmpdir), 1);
  remove(path);
  upf_tensor_free(&r);
  upf_tensor_free(&small);
  upf_tensor_free(&t);
}

/* Reads `path` back and checks it holds the 2x3 i32 tensor of test_output_kinds (value v). */
static int holds(const char *path, unsigned char v) {
  upf_tensor r;
  if (upf_npy_read(path, &r) != UPF_OK)
    return 0;
  int ok = r.dtype == UPF_DTYPE_I32 && r.ndim == 2 && r.shape[0] == 2 && r.shape[1] == 3 &&
           ((unsigned char *)r.data)[0] == v && ((unsigned char *)r.data)[23] == v;
  upf_tensor_free(&r);
  return ok;
}

/* What sits at the output path decides how it is written: a symbolic link to a file is followed
 * (the file replaced, the link kept), a FIFO is written through (never replaced by a regular file),
 * a socket, a directory or a dangling link are refused. No temporary survives any of them. */
static void test_output_kinds(void) {
  char target[128], link[128], link2[128], fifo[128], sock[128], dangling[128], sub[128];
  path_in(target, sizeof target, "target.npy");
  path_in(link, sizeof link, "link.npy");
  path_in(link2, sizeof link2, "link2.npy");
  path_in(fifo, sizeof fifo, "fifo.npy");
  path_in(sock, sizeof sock, "sock.npy");
  path_in(dangling, sizeof dangling, "dangling.npy");
  path_in(sub, sizeof sub, "sub");
  const int64_t shape[2] = {2, 3};
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&t, UPF_DTYPE_I32, 2, shape), UPF_OK);
  struct stat st;

  /* A link (relative, and a link to that link) to a regular file in another directory. */
  CU_ASSERT_EQUAL_FATAL(mkdir(sub, 0700), 0);
  char sub_target[160];
  snprintf(sub_target, sizeof sub_target, "%s/t.npy", sub);
  memset(t.data, 1, 24);
  CU_ASSERT_EQUAL_FATAL(upf_npy_write(sub_target, &t), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(chmod(sub_target, 0640), 0);
  CU_ASSERT_EQUAL_FATAL(symlink("sub/t.npy", link), 0);
  CU_ASSERT_EQUAL_FATAL(symlink("link.npy", link2), 0);
  memset(t.data, 2, 24);
  CU_ASSERT_EQUAL(upf_npy_write(link2, &t), UPF_OK);
  CU_ASSERT(lstat(link, &st) == 0 && S_ISLNK(st.st_mode));
  CU_ASSERT(lstat(link2, &st) == 0 && S_ISLNK(st.st_mode));
  CU_ASSERT(lstat(sub_target, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 07777) == 0640);
  CU_ASSERT(holds(sub_target, 2));
  CU_ASSERT_EQUAL(upf_test_count_entries(sub), 1); /* the temporary went beside the target and is gone */

  /* A FIFO with a reader: the bytes arrive through it and the FIFO stays a FIFO. */
  CU_ASSERT_EQUAL_FATAL(mkfifo(fifo, 0600), 0);
  int rd = open(fifo, O_RDONLY | O_NONBLOCK);
  CU_ASSERT_FATAL(rd >= 0);
  memset(t.data, 3, 24);
  CU_ASSERT_EQUAL(upf_npy_write(fifo, &t), UPF_OK);
  unsigned char buf[512];
  ssize_t got = read(rd, buf, sizeof buf);
  close(rd);
  CU_ASSERT_EQUAL(got, 128 + 24);
  upf_tensor r;
  CU_ASSERT_EQUAL(upf_npy_parse(buf, got > 0 ? (size_t)got : 0, "fifo", &r), UPF_OK);
  CU_ASSERT(r.data && ((unsigned char *)r.data)[0] == 3);
  upf_tensor_free(&r);
  CU_ASSERT(lstat(fifo, &st) == 0 && S_ISFIFO(st.st_mode));

  /* A socket and a dangling link: refused, left as they are. */
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  CU_ASSERT_FATAL(strlen(sock) < sizeof addr.sun_path);
  memcpy(addr.sun_path, sock, strlen(sock) + 1);
  CU_ASSERT_FATAL(fd >= 0 && bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0);
  CU_ASSERT_EQUAL(upf_npy_write(sock, &t), UPF_ERR_IO);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "socket"));
  CU_ASSERT(lstat(sock, &st) == 0 && S_ISSOCK(st.st_mode));
  close(fd);
  CU_ASSERT_EQUAL_FATAL(symlink("nowhere/x.npy", dangling), 0);
  CU_ASSERT_EQUAL(upf_npy_write(dangling, &t), UPF_ERR_IO);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "dangling.npy"));
  CU_ASSERT(lstat(dangling, &st) == 0 && S_ISLNK(st.st_mode));

  /* Nothing else appeared: sub, link, link2, fifo, sock, dangling. */
  CU_ASSERT_EQUAL(upf_test_count_entries(tmpdir), 6);
  CU_ASSERT(!exists(target));
  remove(sub_target), rmdir(sub), remove(link), remove(link2), remove(fifo), remove(sock), remove(dangling);
  upf_tensor_free(&t);
}

static int suite_init(void) {
  strcpy(tmpdir, "/tmp/upf_npy_XXXXXX");
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int suite_clean(void) {
  DIR *d = opendir(tmpdir);
  if (d) {
    char path[512];
    for (struct dirent *e; (e = readdir(d));) {
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
        snprintf(path, sizeof path, "%s/%s", tmpdir, e->d_name);
        remove(path);
      }
    }
    closedir(d);
  }
  return rmdir(tmpdir) == 0 ? 0 : -1;
}

static CU_TestInfo npy_tests[] = {
    {"round trip every dtype and shape", test_roundtrip},
    {"byte-exact numpy.save output", test_numpy_bytes},
    {"version 2.0 and 3.0 headers", test_parse_v2_v3},
    {"header spelling variants", test_header_variants},
    {"malformed files", test_malformed},
    {"every truncation length", test_every_truncation},
    {"corrupt header bytes", test_corrupt_bytes},
    {"missing file and error names", test_read_missing},
    {"write failures leave no file", test_write_failures},
    {"links followed, FIFOs written through, others refused", test_output_kinds},
    CU_TEST_INFO_NULL,
};

void upf_register_npy_tests(void) { upf_test_suite("npy", suite_init, suite_clean, npy_tests); }

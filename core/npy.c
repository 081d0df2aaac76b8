/* NumPy .npy reader and writer. The header is a Python dict literal; it is parsed here by a small
 * bounded scanner (the buffer is not NUL-terminated, so every step checks the end pointer), and
 * written byte-for-byte the way numpy.save writes it. */
#include "uniprefill/npy.h"

#include "uniprefill/output.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_ALIGN 64
/* numpy.save leaves room for the first axis to grow to this many digits in place. */
#define NPY_GROWTH_DIGITS 21

static const struct {
  const char *descr;
  upf_dtype dtype;
} descr_map[] = {
    {"<f4", UPF_DTYPE_F32}, {"<f8", UPF_DTYPE_F64}, {"<i4", UPF_DTYPE_I32},  {"<i8", UPF_DTYPE_I64},
    {"|u1", UPF_DTYPE_U8},  {"<u1", UPF_DTYPE_U8},  {"|b1", UPF_DTYPE_BOOL}, {"<u2", UPF_DTYPE_BF16},
};
#define DESCR_SUPPORTED "'<f4', '<f8', '<i4', '<i8', '|u1', '|b1', '<u2' (bf16 bits)"

/* Writer's descr per dtype: the first descr_map entry naming it. */
static const char *descr_of(upf_dtype dtype) {
  for (size_t i = 0; i < sizeof descr_map / sizeof descr_map[0]; i++)
    if (descr_map[i].dtype == dtype)
      return descr_map[i].descr;
  return NULL;
}

typedef struct {
  const char *p, *end;
  const char *what;
} scanner;

static void skip_ws(scanner *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
    s->p++;
}

static int accept(scanner *s, char c) {
  skip_ws(s);
  if (s->p < s->end && *s->p == c) {
    s->p++;
    return 1;
  }
  return 0;
}

static upf_status expect(scanner *s, char c, const char *where) {
  if (accept(s, c))
    return UPF_OK;
  if (s->p >= s->end)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy header ends early, expected '%c' %s", s->what, c, where);
  return upf_fail(UPF_ERR_FORMAT, "%s: npy header has '%c' where '%c' was expected %s", s->what, *s->p,
                  c, where);
}

/* A quoted string without escapes (no key or descr numpy writes needs them). */
static upf_status scan_string(scanner *s, const char **str, size_t *len) {
  skip_ws(s);
  if (s->p >= s->end || (*s->p != '\'' && *s->p != '"'))
    return upf_fail(UPF_ERR_FORMAT, "%s: npy header: expected a quoted string", s->what);
  char quote = *s->p++;
  const char *close = memchr(s->p, quote, (size_t)(s->end - s->p));
  if (!close)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy header: unterminated string", s->what);
  *str = s->p;
  *len = (size_t)(close - s->p);
  s->p = close + 1;
  return UPF_OK;
}

static int scan_word(scanner *s, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0)
    return 0;
  s->p += n;
  return 1;
}

static upf_status scan_extent(scanner *s, int64_t *out) {
  skip_ws(s);
  if (s->p < s->end && *s->p == '-')
    return upf_fail(UPF_ERR_FORMAT, "%s: npy shape has a negative extent", s->what);
  if (s->p >= s->end || *s->p < '0' || *s->p > '9')
    return upf_fail(UPF_ERR_FORMAT, "%s: npy shape: expected an integer extent", s->what);
  int64_t v = 0;
  while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
    int d = *s->p++ - '0';
    if (v > (INT64_MAX - d) / 10)
      return upf_fail(UPF_ERR_FORMAT, "%s: npy shape extent does not fit in 64 bits", s->what);
    v = v * 10 + d;
  }
  if (s->p < s->end && *s->p == 'L') /* Python 2 era writers put longs in the shape */
    s->p++;
  *out = v;
  return UPF_OK;
}

/* "()", "(5,)", "(2, 3)", "(2, 3,)". "(5)" is an int in Python, not a tuple, so it is refused. */
static upf_status scan_shape(scanner *s, int *ndim, int64_t *shape) {
  UPF_TRY(expect(s, '(', "to open 'shape'"));
  int n = 0, trailing_comma = 0;
  while (!accept(s, ')')) {
    if (n == UPF_MAX_DIMS)
      return upf_fail(UPF_ERR_SHAPE, "%s: npy shape has more than %d dims", s->what, UPF_MAX_DIMS);
    UPF_TRY(scan_extent(s, &shape[n++]));
    trailing_comma = accept(s, ',');
    if (!trailing_comma) {
      UPF_TRY(expect(s, ')', "to close 'shape'"));
      break;
    }
  }
  if (n == 1 && !trailing_comma)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy 'shape' is an int, not a tuple (expected '(N,)')", s->what);
  *ndim = n;
  return UPF_OK;
}

static upf_status scan_descr(scanner *s, upf_dtype *dtype) {
  skip_ws(s);
  if (s->p < s->end && *s->p == '[')
    return upf_fail(UPF_ERR_DTYPE, "%s: structured npy dtypes are not supported (supported: %s)", s->what,
                    DESCR_SUPPORTED);
  const char *str;
  size_t len;
  UPF_TRY(scan_string(s, &str, &len));
  int shown = len > 32 ? 32 : (int)len;
  if (len > 0 && str[0] == '>')
    return upf_fail(UPF_ERR_DTYPE, "%s: big-endian npy descr '%.*s' is not supported (supported: %s)",
                    s->what, shown, str, DESCR_SUPPORTED);
  for (size_t i = 0; i < sizeof descr_map / sizeof descr_map[0]; i++) {
    if (strlen(descr_map[i].descr) == len && memcmp(descr_map[i].descr, str, len) == 0) {
      *dtype = descr_map[i].dtype;
      return UPF_OK;
    }
  }
  return upf_fail(UPF_ERR_DTYPE, "%s: unsupported npy descr '%.*s' (supported: %s)", s->what, shown, str,
                  DESCR_SUPPORTED);
}

static upf_status parse_header(scanner *s, upf_dtype *dtype, int *ndim, int64_t *shape) {
  int have_descr = 0, have_order = 0, have_shape = 0;
  UPF_TRY(expect(s, '{', "at the start of the header dict"));
  while (!accept(s, '}')) {
    const char *key;
    size_t len;
    UPF_TRY(scan_string(s, &key, &len));
    UPF_TRY(expect(s, ':', "after a header key"));
    int *seen;
    if (len == 5 && !memcmp(key, "descr", 5)) {
      seen = &have_descr;
      UPF_TRY(scan_descr(s, dtype));
    } else if (len == 13 && !memcmp(key, "fortran_order", 13)) {
      seen = &have_order;
      skip_ws(s);
      if (scan_word(s, "True"))
        return upf_fail(UPF_ERR_FORMAT, "%s: Fortran order not supported", s->what);
      if (!scan_word(s, "False"))
        return upf_fail(UPF_ERR_FORMAT, "%s: npy 'fortran_order' is not True or False", s->what);
    } else if (len == 5 && !memcmp(key, "shape", 5)) {
      seen = &have_shape;
      UPF_TRY(scan_shape(s, ndim, shape));
    } else {
      return upf_fail(UPF_ERR_FORMAT, "%s: unexpected npy header key '%.*s'", s->what,
                      len > 32 ? 32 : (int)len, key);
    }
    if (*seen)
      return upf_fail(UPF_ERR_FORMAT, "%s: npy header key '%.*s' appears twice", s->what, (int)len, key);
    *seen = 1;
    if (!accept(s, ',')) {
      UPF_TRY(expect(s, '}', "to close the header dict"));
      break;
    }
  }
  skip_ws(s);
  if (s->p != s->end)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy header has text after the closing '}'", s->what);
  if (!have_descr || !have_order || !have_shape)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy header lacks '%s'", s->what,
                    !have_descr ? "descr" : !have_order ? "fortran_order" : "shape");
  return UPF_OK;
}

upf_status upf_npy_parse(const void *bytes, size_t size, const char *what, upf_tensor *out) {
  if (!what)
    what = "npy";
  if (!out)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: no output tensor", what);
  memset(out, 0, sizeof *out);
  if (!bytes && size)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: no input bytes", what);
  const unsigned char *b = bytes;
  if (size < NPY_MAGIC_LEN + 2 || memcmp(b, NPY_MAGIC, NPY_MAGIC_LEN) != 0)
    return upf_fail(UPF_ERR_FORMAT, "%s: not an npy file (bad magic)", what);
  unsigned major = b[6], minor = b[7];
  size_t prefix = major == 1 ? 10 : 12;
  if ((major < 1 || major > 3) || minor != 0)
    return upf_fail(UPF_ERR_FORMAT, "%s: unsupported npy format version %u.%u", what, major, minor);
  if (size < prefix)
    return upf_fail(UPF_ERR_FORMAT, "%s: truncated npy header length field", what);
  uint64_t hlen = major == 1 ? (uint64_t)b[8] | (uint64_t)b[9] << 8
                             : (uint64_t)b[8] | (uint64_t)b[9] << 8 | (uint64_t)b[10] << 16 |
                                   (uint64_t)b[11] << 24;
  if (hlen > size - prefix)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy header length %llu runs past the end of the file (%zu bytes)",
                    what, (unsigned long long)hlen, size);

  scanner s = {(const char *)b + prefix, (const char *)b + prefix + hlen, what};
  upf_dtype dtype = UPF_DTYPE_F32;
  int ndim = 0;
  int64_t shape[UPF_MAX_DIMS];
  UPF_TRY(parse_header(&s, &dtype, &ndim, shape));

  /* Extents are each <= INT64_MAX; a zero extent makes the rest irrelevant. */
  uint64_t numel = 1, itemsize = upf_dtype_size(dtype);
  for (int i = 0; i < ndim; i++)
    if (shape[i] == 0)
      numel = 0;
  for (int i = 0; i < ndim && numel; i++) {
    if ((uint64_t)shape[i] > (uint64_t)INT64_MAX / numel)
      return upf_fail(UPF_ERR_FORMAT, "%s: npy shape element count overflows 64 bits", what);
    numel *= (uint64_t)shape[i];
  }
  if (numel > (uint64_t)INT64_MAX / itemsize)
    return upf_fail(UPF_ERR_FORMAT, "%s: npy data size overflows 64 bits", what);
  uint64_t expected = numel * itemsize, found = size - prefix - hlen;
  if (found < expected)
    return upf_fail(UPF_ERR_FORMAT, "%s: truncated: expected %llu data bytes, found %llu", what,
                    (unsigned long long)expected, (unsigned long long)found);
  if (found > expected)
    return upf_fail(UPF_ERR_FORMAT, "%s: trailing bytes: expected %llu data bytes, found %llu", what,
                    (unsigned long long)expected, (unsigned long long)found);

  const unsigned char *data = b + prefix + hlen;
  if (dtype == UPF_DTYPE_BOOL) {
    for (uint64_t i = 0; i < expected; i++)
      if (data[i] > 1)
        return upf_fail(UPF_ERR_FORMAT, "%s: bool element %llu has byte value %u, not 0 or 1", what,
                        (unsigned long long)i, data[i]);
  }
  /* The element count fits; the strides must too, also when an extent is 0 and the count with it
   * ((0, 2^62, 2^62) holds no data but no stride of it is representable). */
  upf_status st = upf_tensor_init(out, NULL, dtype, ndim, shape);
  if (st != UPF_OK) {
    char why[256];
    snprintf(why, sizeof why, "%s", upf_last_error());
    memset(out, 0, sizeof *out);
    return upf_fail(st, "%s: npy shape refused: %s", what, why);
  }
  /* The shape is validated, so allocation can only fail for lack of memory. */
  if (upf_tensor_alloc(out, dtype, ndim, shape) != UPF_OK) {
    upf_tensor_free(out);
    return upf_fail(UPF_ERR_NOMEM, "%s: cannot allocate %llu bytes for the npy data", what,
                    (unsigned long long)expected);
  }
  if (expected)
    memcpy(out->data, data, (size_t)expected);
  return UPF_OK;
}

upf_status upf_npy_read(const char *path, upf_tensor *out) {
  if (!out)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: no output tensor", path ? path : "npy");
  memset(out, 0, sizeof *out);
  if (!path)
    return upf_fail(UPF_ERR_INVALID_ARG, "npy: no path");
  FILE *f = fopen(path, "rb");
  if (!f)
    return upf_fail(UPF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
    fclose(f);
    return upf_fail(UPF_ERR_IO, "%s: is a directory, not a .npy file", path);
  }
  /* Read by growing a buffer rather than trusting ftell, so pipes and /proc files work too. */
  size_t cap = 1 << 16, size = 0;
  unsigned char *buf = malloc(cap);
  upf_status st = UPF_OK;
  while (buf) {
    size += fread(buf + size, 1, cap - size, f);
    if (size < cap)
      break;
    unsigned char *grown = cap <= SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
    if (!grown) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = grown;
    cap *= 2;
  }
  if (!buf)
    st = upf_fail(UPF_ERR_NOMEM, "%s: cannot allocate a buffer for the file", path);
  else if (ferror(f))
    st = upf_fail(UPF_ERR_IO, "%s: cannot read it: %s", path, strerror(errno));
  fclose(f);
  if (st == UPF_OK)
    st = upf_npy_parse(buf, size, path, out);
  free(buf);
  return st;
}

/* The header numpy.save writes: sorted keys, ", " after each, growth spaces, then spaces and a
 * newline up to the next 64-byte boundary (a whole extra block when already aligned, as numpy does). */
static upf_status build_header(const upf_tensor *t, const char *path, char **out, size_t *out_len) {
  char dict[512], first[24] = "";
  int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (",
                   descr_of(t->dtype));
  for (int i = 0; i < t->ndim; i++)
    n += snprintf(dict + n, sizeof dict - (size_t)n, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  n += snprintf(dict + n, sizeof dict - (size_t)n, "%s), }", t->ndim == 1 ? "," : "");
  if (t->ndim > 0) {
    int digits = snprintf(first, sizeof first, "%lld", (long long)t->shape[0]);
    n += snprintf(dict + n, sizeof dict - (size_t)n, "%*s", NPY_GROWTH_DIGITS - digits, "");
  }
  size_t dict_len = (size_t)n, prefix = 10;
  size_t pad = NPY_ALIGN - (prefix + dict_len + 1) % NPY_ALIGN;
  if (dict_len + 1 + pad > 0xffff) { /* version 2.0: 4-byte length */
    prefix = 12;
    pad = NPY_ALIGN - (prefix + dict_len + 1) % NPY_ALIGN;
  }
  size_t hlen = dict_len + pad + 1, total = prefix + hlen;
  char *h = malloc(total);
  if (!h)
    return upf_fail(UPF_ERR_NOMEM, "%s: cannot allocate the npy header", path);
  memcpy(h, NPY_MAGIC, NPY_MAGIC_LEN);
  h[6] = prefix == 10 ? 1 : 2;
  h[7] = 0;
  for (size_t i = 0; i < prefix - 8; i++)
    h[8 + i] = (char)(hlen >> (8 * i) & 0xff);
  memcpy(h + prefix, dict, dict_len);
  memset(h + prefix + dict_len, ' ', pad);
  h[total - 1] = '\n';
  *out = h;
  *out_len = total;
  return UPF_OK;
}

/* The checks every write makes before any byte goes out; bytes set to the data's size. */
static upf_status check_tensor(const char *path, const upf_tensor *t, size_t *bytes_out) {
  if ((unsigned)t->dtype >= UPF_DTYPE_COUNT || !descr_of(t->dtype))
    return upf_fail(UPF_ERR_DTYPE, "%s: cannot write dtype %d to npy", path, (int)t->dtype);
  if (t->ndim < 0 || t->ndim > UPF_MAX_DIMS)
    return upf_fail(UPF_ERR_SHAPE, "%s: ndim %d outside [0, %d]", path, t->ndim, UPF_MAX_DIMS);
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0)
      return upf_fail(UPF_ERR_SHAPE, "%s: negative extent %lld in dim %d", path, (long long)t->shape[i], i);
  if (!upf_tensor_is_contiguous(t))
    return upf_fail(UPF_ERR_SHAPE, "%s: npy write needs a contiguous tensor", path);
  int64_t numel = upf_tensor_numel(t), itemsize = (int64_t)upf_dtype_size(t->dtype);
  if (numel < 0 || numel > INT64_MAX / itemsize || (uint64_t)(numel * itemsize) > SIZE_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: the byte size of the tensor overflows", path);
  *bytes_out = (size_t)(numel * itemsize);
  if (*bytes_out && !t->data)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: tensor has no data", path);
  return UPF_OK;
}

upf_status upf_npy_write_stream(FILE *f, const char *what, const upf_tensor *t) {
  if (!f || !what || !t)
    return upf_fail(UPF_ERR_INVALID_ARG, "npy: write needs a stream, a name and a tensor");
  size_t bytes;
  UPF_TRY(check_tensor(what, t, &bytes));
  char *header;
  size_t header_len;
  UPF_TRY(build_header(t, what, &header, &header_len));
  upf_status st = upf_output_put(f, header, header_len, what);
  free(header);
  return st == UPF_OK ? upf_output_put(f, t->data, bytes, what) : st;
}

upf_status upf_npy_write_to(upf_outputs *o, const char *path, const char *what, const upf_tensor *t) {
  if (!o || !path || !t)
    return upf_fail(UPF_ERR_INVALID_ARG, "npy: write needs an output set, a path and a tensor");
  size_t bytes;
  UPF_TRY(check_tensor(path, t, &bytes)); /* before the set holds a temporary for it */
  FILE *f;
  UPF_TRY(upf_outputs_open(o, path, what, &f));
  char label[4096];
  snprintf(label, sizeof label, "%s%s%s", what ? what : "", what ? " " : "", path);
  return upf_npy_write_stream(f, label, t);
}

upf_status upf_npy_write(const char *path, const upf_tensor *t) {
  if (!path || !t)
    return upf_fail(UPF_ERR_INVALID_ARG, "npy: write needs a path and a tensor");
  upf_outputs *o;
  UPF_TRY(upf_outputs_create(&o, 1));
  upf_status st = upf_npy_write_to(o, path, NULL, t);
  if (st == UPF_OK)
    st = upf_outputs_commit(o);
  upf_outputs_free(o);
  return st;
}

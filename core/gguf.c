/* GGUF reader: parses the header, every metadata value and the tensor directory of a version 2 or 3
 * file into memory the handle owns, and checks the tensor data against the file. All reads go
 * through one bounds-checked cursor; counts are checked against the bytes left before anything is
 * allocated, nesting of arrays is bounded, and every failure names the file, what was being read
 * (key, tensor) and the byte offset. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "uniprefill/gguf.h"

#define MAX_ARRAY_DEPTH 8

struct upf_gguf_kv {
  upf_gguf_str key;
  upf_gguf_type type;
  union {
    uint64_t u; /* UINT8..UINT64 and BOOL */
    int64_t i;  /* INT8..INT64 */
    double f;   /* FLOAT32 (exactly) and FLOAT64 */
    upf_gguf_str s;
    upf_gguf_arr a;
  } v;
};

/* Bump allocator: chunks never move, so pointers handed out stay valid until close. */
typedef struct chunk {
  struct chunk *next;
  size_t cap, used;
  alignas(max_align_t) unsigned char data[];
} chunk;

/* Open-addressing index of names (keys or tensor names): slot holds index + 1, 0 = empty. */
typedef struct {
  int64_t *slot;
  uint64_t mask;
} name_index;

struct upf_gguf {
  char *name;
  const uint8_t *base; /* (size,) the file image */
  uint64_t size;
  void *map;           /* the mapping when opened from a path */
  uint32_t version;
  uint64_t alignment, data_offset;
  int64_t n_kv, n_tensors;
  upf_gguf_kv *kv;           /* (n_kv,) */
  upf_gguf_tensor *tensors;  /* (n_tensors,) */
  upf_gguf_str *tensor_names; /* (n_tensors,) the names again, as the index compares them */
  name_index kv_index, tensor_index;
  chunk *chunks;
};

/* ---- memory -------------------------------------------------------------------------------- */

static void *arena_alloc(upf_gguf *g, uint64_t n) {
  n = (n + 15) & ~(uint64_t)15;
  if (n == 0)
    n = 16;
  chunk *c = g->chunks;
  if (!c || c->cap - c->used < n) {
    uint64_t cap = n > (1u << 16) ? n : (1u << 16);
    if (cap > SIZE_MAX - sizeof(chunk))
      return NULL;
    chunk *fresh = malloc(sizeof(chunk) + (size_t)cap);
    if (!fresh)
      return NULL;
    fresh->cap = (size_t)cap;
    fresh->used = 0;
    /* A big one-off block goes behind the current chunk so that the current one keeps filling. */
    if (c && n > (1u << 15)) {
      fresh->next = c->next;
      c->next = fresh;
    } else {
      fresh->next = c;
      g->chunks = fresh;
    }
    c = fresh;
  }
  void *p = c->data + c->used;
  c->used += (size_t)n;
  return p;
}

static uint64_t hash_bytes(const char *s, uint64_t len) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < len; i++)
    h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h;
}

static int index_init(upf_gguf *g, name_index *ix, int64_t n) {
  uint64_t cap = 16;
  while (cap < 2 * (uint64_t)n)
    cap <<= 1;
  ix->slot = arena_alloc(g, cap * sizeof(int64_t));
  if (!ix->slot)
    return 0;
  memset(ix->slot, 0, cap * sizeof(int64_t));
  ix->mask = cap - 1;
  return 1;
}

/* The index of `name` among `names` (stride bytes apart, a upf_gguf_str at `str_off`), or -1; when
 * absent and `insert` >= 0, stores `insert` in the free slot found. */
static int64_t index_lookup(const name_index *ix, const void *base, size_t stride, size_t str_off, const char *name,
                            uint64_t len, int64_t insert) {
  if (!ix->slot)
    return -1;
  for (uint64_t h = hash_bytes(name, len) & ix->mask;; h = (h + 1) & ix->mask) {
    int64_t s = ix->slot[h];
    if (!s) {
      if (insert >= 0)
        ix->slot[h] = insert + 1;
      return -1;
    }
    const upf_gguf_str *k = (const upf_gguf_str *)((const char *)base + (size_t)(s - 1) * stride + str_off);
    if (k->len == len && !memcmp(k->ptr, name, (size_t)len))
      return s - 1;
  }
}

/* ---- the cursor ------------------------------------------------------------------------------ */

typedef struct {
  upf_gguf *g;
  uint64_t pos;
  char ctx[200]; /* what is being read: "header", "key 'general.name'", "tensor 'x'" */
} cursor;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static upf_status fail_at(cursor *c, uint64_t pos, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return upf_fail(UPF_ERR_FORMAT, "%s: %s: %s (at byte offset %" PRIu64 ")", c->g->name, c->ctx, msg, pos);
}

static upf_status need(cursor *c, uint64_t n, const char *what) {
  uint64_t left = c->g->size - c->pos;
  if (n > left)
    return fail_at(c, c->pos, "truncated: %s needs %" PRIu64 " bytes, %" PRIu64 " left in the file", what, n, left);
  return UPF_OK;
}

static uint64_t left_of(const cursor *c) { return c->g->size - c->pos; }

static uint64_t le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--)
    v = (v << 8) | p[i];
  return v;
}

static upf_status rd_uint(cursor *c, int n, const char *what, uint64_t *out) {
  UPF_TRY(need(c, (uint64_t)n, what));
  *out = le(c->g->base + c->pos, n);
  c->pos += (uint64_t)n;
  return UPF_OK;
}

static upf_status rd_u32(cursor *c, const char *what, uint32_t *out) {
  uint64_t v;
  UPF_TRY(rd_uint(c, 4, what, &v));
  *out = (uint32_t)v;
  return UPF_OK;
}

/* A string: u64 length, then the bytes; copied NUL-terminated into the arena. */
static upf_status rd_str(cursor *c, const char *what, upf_gguf_str *out) {
  uint64_t start = c->pos, len;
  UPF_TRY(rd_uint(c, 8, what, &len));
  if (len > left_of(c))
    return fail_at(c, start, "%s: length %" PRIu64 " exceeds the %" PRIu64 " bytes left", what, len, left_of(c));
  char *s = arena_alloc(c->g, len + 1);
  if (!s)
    return upf_fail(UPF_ERR_NOMEM, "%s: %s: out of memory for a %" PRIu64 "-byte string", c->g->name, c->ctx, len);
  memcpy(s, c->g->base + c->pos, (size_t)len);
  s[len] = '\0';
  c->pos += len;
  out->ptr = s;
  out->len = len;
  return UPF_OK;
}

static int is_int_type(upf_gguf_type t) {
  return t == UPF_GGUF_TYPE_UINT8 || t == UPF_GGUF_TYPE_INT8 || t == UPF_GGUF_TYPE_UINT16 ||
         t == UPF_GGUF_TYPE_INT16 || t == UPF_GGUF_TYPE_UINT32 || t == UPF_GGUF_TYPE_INT32 ||
         t == UPF_GGUF_TYPE_UINT64 || t == UPF_GGUF_TYPE_INT64;
}

static int is_signed_type(upf_gguf_type t) {
  return t == UPF_GGUF_TYPE_INT8 || t == UPF_GGUF_TYPE_INT16 || t == UPF_GGUF_TYPE_INT32 || t == UPF_GGUF_TYPE_INT64;
}

size_t upf_gguf_type_size(upf_gguf_type type) {
  switch (type) {
  case UPF_GGUF_TYPE_UINT8:
  case UPF_GGUF_TYPE_INT8:
  case UPF_GGUF_TYPE_BOOL:
    return 1;
  case UPF_GGUF_TYPE_UINT16:
  case UPF_GGUF_TYPE_INT16:
    return 2;
  case UPF_GGUF_TYPE_UINT32:
  case UPF_GGUF_TYPE_INT32:
  case UPF_GGUF_TYPE_FLOAT32:
    return 4;
  case UPF_GGUF_TYPE_UINT64:
  case UPF_GGUF_TYPE_INT64:
  case UPF_GGUF_TYPE_FLOAT64:
    return 8;
  default:
    return 0;
  }
}

const char *upf_gguf_type_name(upf_gguf_type type) {
  static const char *const names[UPF_GGUF_TYPE_COUNT] = {
      "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
      "bool",  "string", "array", "uint64", "int64", "float64",
  };
  return (unsigned)type < UPF_GGUF_TYPE_COUNT ? names[type] : "?";
}

static upf_status rd_type(cursor *c, const char *what, upf_gguf_type *out) {
  uint64_t start = c->pos;
  uint32_t t;
  UPF_TRY(rd_u32(c, what, &t));
  if (t >= UPF_GGUF_TYPE_COUNT)
    return fail_at(c, start, "%s %" PRIu32 " is not a GGUF value type (0..%d)", what, t, UPF_GGUF_TYPE_COUNT - 1);
  *out = (upf_gguf_type)t;
  return UPF_OK;
}

static upf_status rd_array(cursor *c, int depth, upf_gguf_arr *out);

/* A scalar into the kv union (the array and string cases handled by the callers). */
static upf_status rd_scalar(cursor *c, upf_gguf_type type, upf_gguf_kv *kv) {
  uint64_t start = c->pos, bits;
  int n = (int)upf_gguf_type_size(type);
  UPF_TRY(rd_uint(c, n, upf_gguf_type_name(type), &bits));
  switch (type) {
  case UPF_GGUF_TYPE_INT8:
    kv->v.i = (int8_t)bits;
    break;
  case UPF_GGUF_TYPE_INT16:
    kv->v.i = (int16_t)bits;
    break;
  case UPF_GGUF_TYPE_INT32:
    kv->v.i = (int32_t)bits;
    break;
  case UPF_GGUF_TYPE_INT64:
    kv->v.i = (int64_t)bits;
    break;
  case UPF_GGUF_TYPE_FLOAT32: {
    uint32_t u = (uint32_t)bits;
    float f;
    memcpy(&f, &u, sizeof f);
    kv->v.f = f;
    break;
  }
  case UPF_GGUF_TYPE_FLOAT64:
    memcpy(&kv->v.f, &bits, sizeof bits);
    break;
  case UPF_GGUF_TYPE_BOOL:
    if (bits > 1)
      return fail_at(c, start, "bool value %" PRIu64 " is neither 0 nor 1", bits);
    kv->v.u = bits;
    break;
  default:
    kv->v.u = bits;
  }
  return UPF_OK;
}

/* An array: element type, u64 count, elements. Numeric elements are copied to aligned host-order
 * storage; strings and nested arrays get one entry each. */
static upf_status rd_array(cursor *c, int depth, upf_gguf_arr *out) {
  memset(out, 0, sizeof *out);
  uint64_t start = c->pos, n;
  UPF_TRY(rd_type(c, "array element type", &out->type));
  UPF_TRY(rd_uint(c, 8, "array length", &n));
  size_t esz = upf_gguf_type_size(out->type);
  /* The least bytes an element takes in the file bounds the count before any allocation. */
  uint64_t min_bytes = esz ? esz : out->type == UPF_GGUF_TYPE_STRING ? 8 : 12;
  if (n > left_of(c) / min_bytes)
    return fail_at(c, start, "array of %" PRIu64 " %s elements needs at least %" PRIu64 " bytes, %" PRIu64 " left", n,
                   upf_gguf_type_name(out->type), n > UINT64_MAX / min_bytes ? UINT64_MAX : n * min_bytes, left_of(c));
  out->n = n;
  if (n == 0)
    return UPF_OK;
  if (esz) {
    uint8_t *d = arena_alloc(c->g, n * esz);
    if (!d)
      return upf_fail(UPF_ERR_NOMEM, "%s: %s: out of memory for %" PRIu64 " array elements", c->g->name, c->ctx, n);
    const uint8_t *src = c->g->base + c->pos;
    for (uint64_t i = 0; out->type == UPF_GGUF_TYPE_BOOL && i < n; i++)
      if (src[i] > 1)
        return fail_at(c, c->pos + i, "bool array element %" PRIu64 " is %u, neither 0 nor 1", i, src[i]);
    /* the host is little-endian (checked at open), so the bytes copy as they are */
    memcpy(d, src, (size_t)(n * esz));
    c->pos += n * esz;
    out->data = d;
  } else if (out->type == UPF_GGUF_TYPE_STRING) {
    upf_gguf_str *s = arena_alloc(c->g, n * sizeof *s);
    if (!s)
      return upf_fail(UPF_ERR_NOMEM, "%s: %s: out of memory for %" PRIu64 " strings", c->g->name, c->ctx, n);
    for (uint64_t i = 0; i < n; i++)
      UPF_TRY(rd_str(c, "array string", &s[i]));
    out->strs = s;
  } else {
    if (depth >= MAX_ARRAY_DEPTH)
      return fail_at(c, start, "arrays nested deeper than %d levels", MAX_ARRAY_DEPTH);
    upf_gguf_arr *a = arena_alloc(c->g, n * sizeof *a);
    if (!a)
      return upf_fail(UPF_ERR_NOMEM, "%s: %s: out of memory for %" PRIu64 " nested arrays", c->g->name, c->ctx, n);
    for (uint64_t i = 0; i < n; i++)
      UPF_TRY(rd_array(c, depth + 1, &a[i]));
    out->arrs = a;
  }
  return UPF_OK;
}

static void set_ctx_name(cursor *c, const char *kind, const upf_gguf_str *s) {
  int shown = s->len > 120 ? 120 : (int)s->len;
  snprintf(c->ctx, sizeof c->ctx, "%s '%.*s%s'", kind, shown, s->ptr, s->len > 120 ? "..." : "");
}

static upf_status parse_kv(cursor *c, int64_t i) {
  upf_gguf *g = c->g;
  upf_gguf_kv *kv = &g->kv[i];
  uint64_t start = c->pos;
  snprintf(c->ctx, sizeof c->ctx, "metadata entry %" PRId64, i);
  UPF_TRY(rd_str(c, "key", &kv->key));
  if (kv->key.len == 0)
    return fail_at(c, start, "empty key");
  if (memchr(kv->key.ptr, '\0', (size_t)kv->key.len))
    return fail_at(c, start, "key holds a NUL byte");
  set_ctx_name(c, "key", &kv->key);
  if (index_lookup(&g->kv_index, g->kv, sizeof *kv, offsetof(upf_gguf_kv, key), kv->key.ptr, kv->key.len, i) >= 0)
    return fail_at(c, start, "duplicate key");
  UPF_TRY(rd_type(c, "value type", &kv->type));
  if (kv->type == UPF_GGUF_TYPE_STRING)
    return rd_str(c, "string value", &kv->v.s);
  if (kv->type == UPF_GGUF_TYPE_ARRAY)
    return rd_array(c, 0, &kv->v.a);
  return rd_scalar(c, kv->type, kv);
}

static upf_status parse_tensor(cursor *c, int64_t i) {
  upf_gguf *g = c->g;
  upf_gguf_tensor *t = &g->tensors[i];
  uint64_t start = c->pos;
  snprintf(c->ctx, sizeof c->ctx, "tensor info %" PRId64, i);
  upf_gguf_str name;
  UPF_TRY(rd_str(c, "tensor name", &name));
  if (name.len == 0)
    return fail_at(c, start, "empty tensor name");
  if (memchr(name.ptr, '\0', (size_t)name.len))
    return fail_at(c, start, "tensor name holds a NUL byte");
  t->name = name.ptr;
  g->tensor_names[i] = name;
  set_ctx_name(c, "tensor", &name);
  uint64_t pos = c->pos;
  uint32_t n_dims;
  UPF_TRY(rd_u32(c, "n_dims", &n_dims));
  if (n_dims > UPF_GGUF_MAX_DIMS)
    return fail_at(c, pos, "%" PRIu32 " dimensions (at most %d)", n_dims, UPF_GGUF_MAX_DIMS);
  t->n_dims = (int)n_dims;
  int64_t numel = 1;
  for (int d = 0; d < UPF_GGUF_MAX_DIMS; d++) {
    t->ne[d] = 1;
    if (d >= (int)n_dims)
      continue;
    pos = c->pos;
    uint64_t e;
    UPF_TRY(rd_uint(c, 8, "extent", &e));
    if (e > (uint64_t)INT64_MAX)
      return fail_at(c, pos, "extent ne[%d] = %" PRIu64 " is negative as int64", d, e);
    t->ne[d] = (int64_t)e;
  }
  for (int d = 0; d < UPF_GGUF_MAX_DIMS; d++) {
    if (t->ne[d] == 0) {
      numel = 0;
      break;
    }
  }
  for (int d = 0; numel && d < UPF_GGUF_MAX_DIMS; d++) {
    if (numel > INT64_MAX / t->ne[d])
      return fail_at(c, pos, "element count of shape (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ") overflows int64",
                     t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
    numel *= t->ne[d];
  }
  t->n_elements = numel;
  pos = c->pos;
  uint32_t type;
  UPF_TRY(rd_u32(c, "ggml type", &type));
  t->type = (upf_ggml_type)type;
  if (!upf_ggml_type_name(t->type))
    return fail_at(c, pos, "ggml type %" PRIu32 " is not one this reader knows", type);
  int64_t row = upf_ggml_row_size(t->type, t->ne[0]);
  if (row < 0 && t->ne[0] % upf_ggml_block_size(t->type))
    return fail_at(c, pos, "ne[0] = %" PRId64 " is not a multiple of the %s block size %" PRId64, t->ne[0],
                   upf_ggml_type_name(t->type), upf_ggml_block_size(t->type));
  if (row < 0)
    return fail_at(c, pos, "byte size of a row of %" PRId64 " %s elements overflows int64", t->ne[0],
                   upf_ggml_type_name(t->type));
  int64_t rows = t->ne[0] ? numel / t->ne[0] : 0;
  if (row && rows > INT64_MAX / row)
    return fail_at(c, pos, "byte size overflows int64");
  t->nbytes = (uint64_t)(row * rows);
  pos = c->pos;
  UPF_TRY(rd_uint(c, 8, "data offset", &t->offset));
  if (index_lookup(&g->tensor_index, g->tensor_names, sizeof name, 0, name.ptr, name.len, i) >= 0)
    return fail_at(c, start, "duplicate tensor name");
  return UPF_OK;
}

typedef struct {
  uint64_t offset, nbytes;
  int64_t index;
} extent;

static int cmp_extent(const void *a, const void *b) {
  const extent *x = a, *y = b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Each tensor's data aligned, inside the file and disjoint from every other tensor's. */
static upf_status check_tensor_data(cursor *c) {
  upf_gguf *g = c->g;
  uint64_t room = g->size >= g->data_offset ? g->size - g->data_offset : 0;
  extent *order = malloc((size_t)(g->n_tensors ? g->n_tensors : 1) * sizeof *order);
  if (!order)
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", g->name);
  int64_t m = 0;
  upf_status st = UPF_OK;
  for (int64_t i = 0; i < g->n_tensors && st == UPF_OK; i++) {
    upf_gguf_tensor *t = &g->tensors[i];
    snprintf(c->ctx, sizeof c->ctx, "tensor '%.120s'", t->name);
    if (t->offset % g->alignment)
      st = fail_at(c, g->data_offset, "data offset %" PRIu64 " is not a multiple of the alignment %" PRIu64, t->offset,
                   g->alignment);
    else if (t->offset > room || t->nbytes > room - t->offset)
      st = fail_at(c, g->data_offset, "data [%" PRIu64 ", +%" PRIu64 ") of the data section run past the end of the file "
                   "(%" PRIu64 " bytes of data)", t->offset, t->nbytes, room);
    else {
      /* an empty tensor may sit where the data section ends, even past a file with no padding */
      uint64_t at = g->data_offset + t->offset;
      t->data = g->base + (at < g->size ? at : g->size);
      if (t->nbytes)
        order[m++] = (extent){t->offset, t->nbytes, i};
    }
  }
  if (st == UPF_OK && m > 1) {
    qsort(order, (size_t)m, sizeof *order, cmp_extent);
    for (int64_t k = 1; k < m && st == UPF_OK; k++) {
      const upf_gguf_tensor *a = &g->tensors[order[k - 1].index], *b = &g->tensors[order[k].index];
      if (b->offset < a->offset + a->nbytes) {
        snprintf(c->ctx, sizeof c->ctx, "tensor '%.80s'", b->name);
        st = fail_at(c, g->data_offset + b->offset, "data overlap those of tensor '%.80s'", a->name);
      }
    }
  }
  free(order);
  return st;
}

static int host_is_little_endian(void) {
  const uint16_t one = 1;
  return *(const uint8_t *)&one == 1;
}

static upf_status parse(upf_gguf *g) {
  cursor c = {.g = g, .pos = 0};
  snprintf(c.ctx, sizeof c.ctx, "header");
  if (!host_is_little_endian())
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: the GGUF reader needs a little-endian host", g->name);
  UPF_TRY(need(&c, 4, "magic"));
  if (memcmp(g->base, UPF_GGUF_MAGIC, 4))
    return fail_at(&c, 0, "bad magic %02x %02x %02x %02x (want \"GGUF\")", g->base[0], g->base[1], g->base[2], g->base[3]);
  c.pos = 4;
  UPF_TRY(rd_u32(&c, "version", &g->version));
  uint32_t v = g->version, swapped = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
  if (v == 1)
    return fail_at(&c, 4, "GGUF version 1 is not supported (it has 32-bit counts; versions 2 and 3 are read)");
  if (v != 2 && v != 3) {
    if (swapped >= 1 && swapped <= 3)
      return fail_at(&c, 4, "big-endian GGUF (version %" PRIu32 " byte-swapped) is not supported", swapped);
    return fail_at(&c, 4, "GGUF version %" PRIu32 " is not supported (2 and 3 are)", v);
  }
  uint64_t n_tensors, n_kv;
  UPF_TRY(rd_uint(&c, 8, "tensor count", &n_tensors));
  UPF_TRY(rd_uint(&c, 8, "metadata count", &n_kv));
  /* A metadata entry takes at least 13 bytes (key length, type, one value byte), a tensor info 24. */
  if (n_kv > left_of(&c) / 13)
    return fail_at(&c, 16, "%" PRIu64 " metadata entries cannot fit in the %" PRIu64 " bytes left", n_kv, left_of(&c));
  if (n_tensors > (left_of(&c) - 13 * n_kv) / 24)
    return fail_at(&c, 8, "%" PRIu64 " tensors cannot fit in the %" PRIu64 " bytes left", n_tensors, left_of(&c));
  g->n_kv = (int64_t)n_kv;
  g->n_tensors = (int64_t)n_tensors;
  g->kv = arena_alloc(g, (n_kv ? n_kv : 1) * sizeof *g->kv);
  g->tensors = arena_alloc(g, (n_tensors ? n_tensors : 1) * sizeof *g->tensors);
  g->tensor_names = arena_alloc(g, (n_tensors ? n_tensors : 1) * sizeof *g->tensor_names);
  if (!g->kv || !g->tensors || !g->tensor_names || !index_init(g, &g->kv_index, g->n_kv) || !index_init(g, &g->tensor_index, g->n_tensors))
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory for %" PRIu64 " entries and %" PRIu64 " tensors", g->name, n_kv,
                    n_tensors);
  memset(g->kv, 0, (size_t)(n_kv ? n_kv : 1) * sizeof *g->kv);
  memset(g->tensors, 0, (size_t)(n_tensors ? n_tensors : 1) * sizeof *g->tensors);
  for (int64_t i = 0; i < g->n_kv; i++)
    UPF_TRY(parse_kv(&c, i));

  g->alignment = UPF_GGUF_DEFAULT_ALIGNMENT;
  if (upf_gguf_kv_find(g, "general.alignment")) {
    uint32_t a;
    UPF_TRY(upf_gguf_get_u32(g, "general.alignment", &a));
    if (a == 0 || (a & (a - 1)))
      return upf_fail(UPF_ERR_FORMAT, "%s: key 'general.alignment': %" PRIu32 " is not a power of two", g->name, a);
    g->alignment = a;
  }
  for (int64_t i = 0; i < g->n_tensors; i++)
    UPF_TRY(parse_tensor(&c, i));
  uint64_t pad = (g->alignment - c.pos % g->alignment) % g->alignment;
  g->data_offset = c.pos + pad;
  return check_tensor_data(&c);
}

static upf_status open_image(upf_gguf *g, upf_gguf **out) {
  upf_status st = parse(g);
  if (st != UPF_OK) {
    upf_gguf_close(g);
    return st;
  }
  *out = g;
  return UPF_OK;
}

static upf_gguf *new_handle(const char *what) {
  upf_gguf *g = calloc(1, sizeof *g);
  if (!g)
    return NULL;
  g->name = strdup(what ? what : "(memory)");
  if (!g->name) {
    free(g);
    return NULL;
  }
  return g;
}

upf_status upf_gguf_open_memory(const void *bytes, uint64_t size, const char *what, upf_gguf **out) {
  *out = NULL;
  upf_gguf *g = new_handle(what);
  if (!g)
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", what ? what : "(memory)");
  g->base = bytes;
  g->size = size;
  if (!bytes && size)
    return upf_gguf_close(g), upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL image of %" PRIu64 " bytes", g->name, size);
  return open_image(g, out);
}

upf_status upf_gguf_open(const char *path, upf_gguf **out) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return upf_fail(UPF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    close(fd);
    return upf_fail(UPF_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(sb.st_mode)) {
    close(fd);
    return upf_fail(UPF_ERR_IO, "%s: is %s, not a GGUF file", path, S_ISDIR(sb.st_mode) ? "a directory" : "not a regular file");
  }
  upf_gguf *g = new_handle(path);
  if (!g) {
    close(fd);
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", path);
  }
  g->size = (uint64_t)sb.st_size;
  if (g->size) {
    void *m = mmap(NULL, (size_t)g->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      close(fd);
      upf_gguf_close(g);
      return upf_fail(UPF_ERR_IO, "%s: cannot map %" PRIu64 " bytes: %s", path, (uint64_t)sb.st_size, strerror(e));
    }
    g->map = m;
    g->base = m;
  } else {
    static const uint8_t empty[1];
    g->base = empty;
  }
  close(fd);
  return open_image(g, out);
}

void upf_gguf_close(upf_gguf *g) {
  if (!g)
    return;
  if (g->map)
    munmap(g->map, (size_t)g->size);
  for (chunk *c = g->chunks, *next; c; c = next) {
    next = c->next;
    free(c);
  }
  free(g->name);
  free(g);
}

uint32_t upf_gguf_version(const upf_gguf *g) { return g->version; }
const char *upf_gguf_name(const upf_gguf *g) { return g->name; }
uint64_t upf_gguf_alignment(const upf_gguf *g) { return g->alignment; }
uint64_t upf_gguf_data_offset(const upf_gguf *g) { return g->data_offset; }
uint64_t upf_gguf_file_size(const upf_gguf *g) { return g->size; }

/* ---- metadata access ------------------------------------------------------------------------- */

int64_t upf_gguf_kv_count(const upf_gguf *g) { return g->n_kv; }

const upf_gguf_kv *upf_gguf_kv_at(const upf_gguf *g, int64_t i) {
  return i >= 0 && i < g->n_kv ? &g->kv[i] : NULL;
}

const upf_gguf_kv *upf_gguf_kv_find(const upf_gguf *g, const char *key) {
  int64_t i = index_lookup(&g->kv_index, g->kv, sizeof *g->kv, offsetof(upf_gguf_kv, key), key, strlen(key), -1);
  return i >= 0 ? &g->kv[i] : NULL;
}

const char *upf_gguf_kv_key(const upf_gguf_kv *kv) { return kv->key.ptr; }
upf_gguf_type upf_gguf_kv_type(const upf_gguf_kv *kv) { return kv->type; }

static upf_status find_typed(const upf_gguf *g, const char *key, const upf_gguf_kv **out) {
  *out = upf_gguf_kv_find(g, key);
  if (!*out)
    return upf_fail(UPF_ERR_FORMAT, "%s: key '%s' is missing", g->name, key);
  return UPF_OK;
}

static upf_status wrong_type(const upf_gguf *g, const upf_gguf_kv *kv, const char *want) {
  return upf_fail(UPF_ERR_FORMAT, "%s: key '%s' is %s, not %s", g->name, kv->key.ptr, upf_gguf_type_name(kv->type), want);
}

/* The integer value of `key` as two's-complement bits, when it lies in [min, max]. */
static upf_status int_value(const upf_gguf *g, const char *key, const char *want, int64_t min, uint64_t max,
                            uint64_t *bits) {
  const upf_gguf_kv *kv;
  UPF_TRY(find_typed(g, key, &kv));
  if (!is_int_type(kv->type))
    return wrong_type(g, kv, want);
  if (is_signed_type(kv->type)) {
    int64_t v = kv->v.i;
    if (v < min || (v > 0 && (uint64_t)v > max))
      return upf_fail(UPF_ERR_FORMAT, "%s: key '%s' = %" PRId64 " does not fit %s", g->name, key, v, want);
    *bits = (uint64_t)v;
  } else {
    if (kv->v.u > max)
      return upf_fail(UPF_ERR_FORMAT, "%s: key '%s' = %" PRIu64 " does not fit %s", g->name, key, kv->v.u, want);
    *bits = kv->v.u;
  }
  return UPF_OK;
}

upf_status upf_gguf_get_u32(const upf_gguf *g, const char *key, uint32_t *out) {
  uint64_t b;
  UPF_TRY(int_value(g, key, "uint32", 0, UINT32_MAX, &b));
  *out = (uint32_t)b;
  return UPF_OK;
}

upf_status upf_gguf_get_i32(const upf_gguf *g, const char *key, int32_t *out) {
  uint64_t b;
  UPF_TRY(int_value(g, key, "int32", INT32_MIN, INT32_MAX, &b));
  *out = (int32_t)(int64_t)b;
  return UPF_OK;
}

upf_status upf_gguf_get_u64(const upf_gguf *g, const char *key, uint64_t *out) {
  uint64_t b;
  UPF_TRY(int_value(g, key, "uint64", 0, UINT64_MAX, &b));
  *out = b;
  return UPF_OK;
}

upf_status upf_gguf_get_i64(const upf_gguf *g, const char *key, int64_t *out) {
  uint64_t b;
  UPF_TRY(int_value(g, key, "int64", INT64_MIN, INT64_MAX, &b));
  *out = (int64_t)b;
  return UPF_OK;
}

upf_status upf_gguf_get_f64(const upf_gguf *g, const char *key, double *out) {
  const upf_gguf_kv *kv;
  UPF_TRY(find_typed(g, key, &kv));
  if (kv->type != UPF_GGUF_TYPE_FLOAT32 && kv->type != UPF_GGUF_TYPE_FLOAT64)
    return wrong_type(g, kv, "float32 or float64");
  *out = kv->v.f;
  return UPF_OK;
}

upf_status upf_gguf_get_f32(const upf_gguf *g, const char *key, float *out) {
  double d = 0;
  UPF_TRY(upf_gguf_get_f64(g, key, &d));
  *out = (float)d;
  return UPF_OK;
}

upf_status upf_gguf_get_bool(const upf_gguf *g, const char *key, int *out) {
  const upf_gguf_kv *kv;
  UPF_TRY(find_typed(g, key, &kv));
  if (kv->type != UPF_GGUF_TYPE_BOOL)
    return wrong_type(g, kv, "bool");
  *out = (int)kv->v.u;
  return UPF_OK;
}

upf_status upf_gguf_get_str(const upf_gguf *g, const char *key, const char **out, uint64_t *len) {
  const upf_gguf_kv *kv;
  UPF_TRY(find_typed(g, key, &kv));
  if (kv->type != UPF_GGUF_TYPE_STRING)
    return wrong_type(g, kv, "string");
  *out = kv->v.s.ptr;
  if (len)
    *len = kv->v.s.len;
  return UPF_OK;
}

upf_status upf_gguf_get_u32_or(const upf_gguf *g, const char *key, uint32_t dflt, uint32_t *out) {
  if (!upf_gguf_kv_find(g, key)) {
    *out = dflt;
    return UPF_OK;
  }
  return upf_gguf_get_u32(g, key, out);
}

upf_status upf_gguf_get_f32_or(const upf_gguf *g, const char *key, float dflt, float *out) {
  if (!upf_gguf_kv_find(g, key)) {
    *out = dflt;
    return UPF_OK;
  }
  return upf_gguf_get_f32(g, key, out);
}

upf_status upf_gguf_get_bool_or(const upf_gguf *g, const char *key, int dflt, int *out) {
  if (!upf_gguf_kv_find(g, key)) {
    *out = dflt;
    return UPF_OK;
  }
  return upf_gguf_get_bool(g, key, out);
}

upf_status upf_gguf_get_arr(const upf_gguf *g, const char *key, const upf_gguf_arr **out) {
  const upf_gguf_kv *kv;
  UPF_TRY(find_typed(g, key, &kv));
  if (kv->type != UPF_GGUF_TYPE_ARRAY)
    return wrong_type(g, kv, "array");
  *out = &kv->v.a;
  return UPF_OK;
}

/* Element i of a numeric array as a double, and whether it is an exact integer value. */
static double arr_elem(const upf_gguf_arr *a, uint64_t i, int64_t *as_int, int *is_int) {
  const uint8_t *p = (const uint8_t *)a->data + i * upf_gguf_type_size(a->type);
  *is_int = 1;
  switch (a->type) {
  case UPF_GGUF_TYPE_UINT8:
    return (double)(*as_int = *p);
  case UPF_GGUF_TYPE_INT8:
    return (double)(*as_int = *(const int8_t *)p);
  case UPF_GGUF_TYPE_UINT16:
    return (double)(*as_int = *(const uint16_t *)(const void *)p);
  case UPF_GGUF_TYPE_INT16:
    return (double)(*as_int = *(const int16_t *)(const void *)p);
  case UPF_GGUF_TYPE_UINT32:
    return (double)(*as_int = *(const uint32_t *)(const void *)p);
  case UPF_GGUF_TYPE_INT32:
    return (double)(*as_int = *(const int32_t *)(const void *)p);
  case UPF_GGUF_TYPE_INT64:
    return (double)(*as_int = *(const int64_t *)(const void *)p);
  case UPF_GGUF_TYPE_UINT64: {
    uint64_t u = *(const uint64_t *)(const void *)p;
    *as_int = u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u; /* out of every int32 range either way */
    return (double)u;
  }
  case UPF_GGUF_TYPE_FLOAT32:
    *is_int = 0;
    return *(const float *)(const void *)p;
  default:
    *is_int = 0;
    return *(const double *)(const void *)p;
  }
}

static upf_status arr_for_copy(const upf_gguf *g, const char *key, uint64_t n, int want_int, const upf_gguf_arr **out) {
  UPF_TRY(upf_gguf_get_arr(g, key, out));
  const upf_gguf_arr *a = *out;
  int ok = want_int ? is_int_type(a->type)
                    : is_int_type(a->type) || a->type == UPF_GGUF_TYPE_FLOAT32 || a->type == UPF_GGUF_TYPE_FLOAT64;
  if (!ok)
    return upf_fail(UPF_ERR_FORMAT, "%s: key '%s' is an array of %s, not of %s", g->name, key,
                    upf_gguf_type_name(a->type), want_int ? "integers" : "numbers");
  if (a->n != n)
    return upf_fail(UPF_ERR_FORMAT, "%s: key '%s' has %" PRIu64 " elements, expected %" PRIu64, g->name, key, a->n, n);
  return UPF_OK;
}

upf_status upf_gguf_get_arr_i32(const upf_gguf *g, const char *key, int32_t *dst, uint64_t n) {
  const upf_gguf_arr *a;
  UPF_TRY(arr_for_copy(g, key, n, 1, &a));
  for (uint64_t i = 0; i < n; i++) {
    int64_t v;
    int is_int;
    double d = arr_elem(a, i, &v, &is_int);
    if (v < INT32_MIN || v > INT32_MAX)
      return upf_fail(UPF_ERR_FORMAT, "%s: key '%s': element %" PRIu64 " = %.0f does not fit int32", g->name, key, i, d);
    dst[i] = (int32_t)v;
  }
  return UPF_OK;
}

upf_status upf_gguf_get_arr_f32(const upf_gguf *g, const char *key, float *dst, uint64_t n) {
  const upf_gguf_arr *a;
  UPF_TRY(arr_for_copy(g, key, n, 0, &a));
  for (uint64_t i = 0; i < n; i++) {
    int64_t v;
    int is_int;
    dst[i] = (float)arr_elem(a, i, &v, &is_int);
  }
  return UPF_OK;
}

/* ---- tensors --------------------------------------------------------------------------------- */

int64_t upf_gguf_tensor_count(const upf_gguf *g) { return g->n_tensors; }

const upf_gguf_tensor *upf_gguf_tensor_at(const upf_gguf *g, int64_t i) {
  return i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const upf_gguf_tensor *upf_gguf_tensor_find(const upf_gguf *g, const char *name) {
  int64_t i = index_lookup(&g->tensor_index, g->tensor_names, sizeof *g->tensor_names, 0, name, strlen(name), -1);
  return i >= 0 ? &g->tensors[i] : NULL;
}

upf_status upf_gguf_tensor_get(const upf_gguf *g, const char *name, const upf_gguf_tensor **out) {
  *out = upf_gguf_tensor_find(g, name);
  if (!*out)
    return upf_fail(UPF_ERR_FORMAT, "%s: tensor '%s' is missing", g->name, name);
  return UPF_OK;
}

/* GGUF writer: metadata values are serialised when set (so a file is the header, the kept bytes of
 * each entry, the tensor directory, then the tensor data each padded to the alignment); the file goes
 * through an output set (uniprefill/output.h), and a large one can stream its tensors one by one. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "uniprefill/gguf.h"
#include "uniprefill/output.h"

typedef struct {
  uint8_t *p;
  uint64_t len, cap;
  int failed; /* an allocation failed: the bytes are incomplete */
} bytes;

typedef struct {
  char *key;
  upf_gguf_type type;
  bytes value; /* the value as it appears in the file after the type field */
} wkv;

typedef struct {
  char *name;
  upf_ggml_type type;
  int n_dims;
  int64_t ne[UPF_GGUF_MAX_DIMS];
  const void *data; /* (nbytes,) borrowed, or `owned` */
  void *owned;
  uint64_t nbytes;
} wtensor;

struct upf_gguf_writer {
  uint32_t version, alignment;
  wkv *kv;
  int64_t n_kv, cap_kv;
  wtensor *t;
  int64_t n_t, cap_t;
};

static void put(bytes *b, const void *src, uint64_t n) {
  if (b->failed)
    return;
  if (b->cap - b->len < n) {
    uint64_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < n)
      cap *= 2;
    uint8_t *p = realloc(b->p, (size_t)cap);
    if (!p) {
      b->failed = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  if (n)
    memcpy(b->p + b->len, src, (size_t)n);
  b->len += n;
}

static void put_le(bytes *b, uint64_t v, int n) {
  uint8_t tmp[8];
  for (int i = 0; i < n; i++)
    tmp[i] = (uint8_t)(v >> (8 * i));
  put(b, tmp, (uint64_t)n);
}

static void put_str(bytes *b, const char *s, uint64_t len) {
  put_le(b, len, 8);
  put(b, s, len);
}

upf_status upf_gguf_writer_create(upf_gguf_writer **out) {
  *out = calloc(1, sizeof **out);
  if (!*out)
    return upf_fail(UPF_ERR_NOMEM, "gguf writer: out of memory");
  (*out)->version = 3;
  (*out)->alignment = UPF_GGUF_DEFAULT_ALIGNMENT;
  return UPF_OK;
}

void upf_gguf_writer_free(upf_gguf_writer *w) {
  if (!w)
    return;
  for (int64_t i = 0; i < w->n_kv; i++) {
    free(w->kv[i].key);
    free(w->kv[i].value.p);
  }
  for (int64_t i = 0; i < w->n_t; i++) {
    free(w->t[i].name);
    free(w->t[i].owned);
  }
  free(w->kv);
  free(w->t);
  free(w);
}

upf_status upf_gguf_writer_set_version(upf_gguf_writer *w, uint32_t version) {
  if (version != 2 && version != 3)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: version %" PRIu32 " (2 or 3 can be written)", version);
  w->version = version;
  return UPF_OK;
}

static int64_t find_key(const upf_gguf_writer *w, const char *key) {
  for (int64_t i = 0; i < w->n_kv; i++)
    if (!strcmp(w->kv[i].key, key))
      return i;
  return -1;
}

/* Stores a serialised value under `key` (taking ownership of `value`), replacing an existing one. */
static upf_status set_value(upf_gguf_writer *w, const char *key, upf_gguf_type type, bytes value) {
  if (value.failed) {
    free(value.p);
    return upf_fail(UPF_ERR_NOMEM, "gguf writer: key '%s': out of memory", key ? key : "");
  }
  if (!key || !*key) {
    free(value.p);
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: empty metadata key");
  }
  int64_t i = find_key(w, key);
  if (i >= 0) {
    free(w->kv[i].value.p);
    w->kv[i].type = type;
    w->kv[i].value = value;
    return UPF_OK;
  }
  if (w->n_kv == w->cap_kv) {
    int64_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
    wkv *kv = realloc(w->kv, (size_t)cap * sizeof *kv);
    if (!kv) {
      free(value.p);
      return upf_fail(UPF_ERR_NOMEM, "gguf writer: key '%s': out of memory", key);
    }
    w->kv = kv;
    w->cap_kv = cap;
  }
  char *k = strdup(key);
  if (!k) {
    free(value.p);
    return upf_fail(UPF_ERR_NOMEM, "gguf writer: key '%s': out of memory", key);
  }
  w->kv[w->n_kv++] = (wkv){k, type, value};
  return UPF_OK;
}

static upf_status set_scalar(upf_gguf_writer *w, const char *key, upf_gguf_type type, uint64_t bits) {
  bytes b = {0};
  put_le(&b, bits, (int)upf_gguf_type_size(type));
  return set_value(w, key, type, b);
}

upf_status upf_gguf_set_u8(upf_gguf_writer *w, const char *key, uint8_t v) { return set_scalar(w, key, UPF_GGUF_TYPE_UINT8, v); }
upf_status upf_gguf_set_i8(upf_gguf_writer *w, const char *key, int8_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_INT8, (uint8_t)v);
}
upf_status upf_gguf_set_u16(upf_gguf_writer *w, const char *key, uint16_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_UINT16, v);
}
upf_status upf_gguf_set_i16(upf_gguf_writer *w, const char *key, int16_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_INT16, (uint16_t)v);
}
upf_status upf_gguf_set_u32(upf_gguf_writer *w, const char *key, uint32_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_UINT32, v);
}
upf_status upf_gguf_set_i32(upf_gguf_writer *w, const char *key, int32_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_INT32, (uint32_t)v);
}
upf_status upf_gguf_set_u64(upf_gguf_writer *w, const char *key, uint64_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_UINT64, v);
}
upf_status upf_gguf_set_i64(upf_gguf_writer *w, const char *key, int64_t v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_INT64, (uint64_t)v);
}
upf_status upf_gguf_set_f32(upf_gguf_writer *w, const char *key, float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return set_scalar(w, key, UPF_GGUF_TYPE_FLOAT32, u);
}
upf_status upf_gguf_set_f64(upf_gguf_writer *w, const char *key, double v) {
  uint64_t u;
  memcpy(&u, &v, sizeof u);
  return set_scalar(w, key, UPF_GGUF_TYPE_FLOAT64, u);
}
upf_status upf_gguf_set_bool(upf_gguf_writer *w, const char *key, int v) {
  return set_scalar(w, key, UPF_GGUF_TYPE_BOOL, v ? 1 : 0);
}

upf_status upf_gguf_set_str(upf_gguf_writer *w, const char *key, const char *v) {
  if (!v)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: key '%s': NULL string", key ? key : "");
  bytes b = {0};
  put_str(&b, v, strlen(v));
  return set_value(w, key, UPF_GGUF_TYPE_STRING, b);
}

upf_status upf_gguf_set_arr(upf_gguf_writer *w, const char *key, upf_gguf_type type, const void *data, uint64_t n) {
  size_t esz = upf_gguf_type_size(type);
  if (!esz)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: key '%s': array element type %s is not numeric", key ? key : "",
                    upf_gguf_type_name(type));
  if (n && !data)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: key '%s': NULL data for %" PRIu64 " elements", key ? key : "", n);
  if (n > (UINT64_MAX - 12) / esz)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: key '%s': %" PRIu64 " elements overflow", key ? key : "", n);
  bytes b = {0};
  put_le(&b, (uint64_t)type, 4);
  put_le(&b, n, 8);
  const uint8_t *src = data;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t bits;
    switch (esz) {
    case 1:
      bits = src[i];
      if (type == UPF_GGUF_TYPE_BOOL)
        bits = bits != 0;
      break;
    case 2: {
      uint16_t v;
      memcpy(&v, src + 2 * i, 2);
      bits = v;
      break;
    }
    case 4: {
      uint32_t v;
      memcpy(&v, src + 4 * i, 4);
      bits = v;
      break;
    }
    default:
      memcpy(&bits, src + 8 * i, 8);
    }
    put_le(&b, bits, (int)esz);
  }
  return set_value(w, key, UPF_GGUF_TYPE_ARRAY, b);
}

upf_status upf_gguf_set_arr_str(upf_gguf_writer *w, const char *key, const char *const *strs, uint64_t n) {
  if (n && !strs)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: key '%s': NULL strings", key ? key : "");
  bytes b = {0};
  put_le(&b, UPF_GGUF_TYPE_STRING, 4);
  put_le(&b, n, 8);
  for (uint64_t i = 0; i < n; i++) {
    if (!strs[i]) {
      free(b.p);
      return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: key '%s': string %" PRIu64 " is NULL", key ? key : "", i);
    }
    put_str(&b, strs[i], strlen(strs[i]));
  }
  return set_value(w, key, UPF_GGUF_TYPE_ARRAY, b);
}

upf_status upf_gguf_writer_set_alignment(upf_gguf_writer *w, uint32_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) || alignment > (1u << 16))
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: alignment %" PRIu32 " is not a power of two in 1..65536",
                    alignment);
  w->alignment = alignment;
  if (alignment != UPF_GGUF_DEFAULT_ALIGNMENT)
    return upf_gguf_set_u32(w, "general.alignment", alignment);
  int64_t i = find_key(w, "general.alignment");
  if (i >= 0) {
    free(w->kv[i].key);
    free(w->kv[i].value.p);
    memmove(&w->kv[i], &w->kv[i + 1], (size_t)(w->n_kv - i - 1) * sizeof *w->kv);
    w->n_kv--;
  }
  return UPF_OK;
}

static upf_status add_tensor(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims, const int64_t *ne,
                             const void *data, uint64_t nbytes, int copy) {
  if (!name || !*name)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: empty tensor name");
  const char *tn = upf_ggml_type_name(type);
  if (!tn)
    return upf_fail(UPF_ERR_DTYPE, "gguf writer: tensor '%s': ggml type %d is unknown", name, (int)type);
  if (n_dims < 1 || n_dims > UPF_GGUF_MAX_DIMS || !ne)
    return upf_fail(UPF_ERR_SHAPE, "gguf writer: tensor '%s': %d dimensions (1..%d)", name, n_dims, UPF_GGUF_MAX_DIMS);
  int64_t full[UPF_GGUF_MAX_DIMS] = {1, 1, 1, 1};
  int64_t numel = 1;
  for (int d = 0; d < n_dims; d++) {
    if (ne[d] < 0)
      return upf_fail(UPF_ERR_SHAPE, "gguf writer: tensor '%s': ne[%d] = %" PRId64 " is negative", name, d, ne[d]);
    full[d] = ne[d];
  }
  for (int d = 0; d < UPF_GGUF_MAX_DIMS; d++) {
    if (full[d] && numel > INT64_MAX / full[d])
      return upf_fail(UPF_ERR_SHAPE, "gguf writer: tensor '%s': element count overflows", name);
    numel *= full[d];
  }
  int64_t row = upf_ggml_row_size(type, full[0]);
  if (row < 0)
    return upf_fail(UPF_ERR_SHAPE, "gguf writer: tensor '%s': ne[0] = %" PRId64 " is not a multiple of the %s block size %" PRId64,
                    name, full[0], tn, upf_ggml_block_size(type));
  int64_t rows = full[0] ? numel / full[0] : 0;
  if (row && rows > INT64_MAX / row)
    return upf_fail(UPF_ERR_SHAPE, "gguf writer: tensor '%s': byte size overflows", name);
  if ((uint64_t)(row * rows) != nbytes)
    return upf_fail(UPF_ERR_SHAPE, "gguf writer: tensor '%s': %" PRIu64 " bytes given, %s (%" PRId64 ", %" PRId64 ", %" PRId64
                    ", %" PRId64 ") takes %" PRId64, name, nbytes, tn, full[0], full[1], full[2], full[3], row * rows);
  if (nbytes && !data && copy != 2)
    return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: tensor '%s': NULL data", name);
  for (int64_t i = 0; i < w->n_t; i++)
    if (!strcmp(w->t[i].name, name))
      return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: tensor '%s' added twice", name);
  if (w->n_t == w->cap_t) {
    int64_t cap = w->cap_t ? 2 * w->cap_t : 16;
    wtensor *t = realloc(w->t, (size_t)cap * sizeof *t);
    if (!t)
      return upf_fail(UPF_ERR_NOMEM, "gguf writer: tensor '%s': out of memory", name);
    w->t = t;
    w->cap_t = cap;
  }
  wtensor t = {.type = type, .n_dims = n_dims, .data = data, .nbytes = nbytes};
  memcpy(t.ne, full, sizeof full);
  t.name = strdup(name);
  if (copy == 1 && nbytes) {
    t.owned = malloc((size_t)nbytes);
    if (t.owned)
      memcpy(t.owned, data, (size_t)nbytes);
    t.data = t.owned;
  }
  if (!t.name || (copy == 1 && nbytes && !t.owned)) {
    free(t.name);
    free(t.owned);
    return upf_fail(UPF_ERR_NOMEM, "gguf writer: tensor '%s': out of memory for %" PRIu64 " bytes", name, nbytes);
  }
  w->t[w->n_t++] = t;
  return UPF_OK;
}

upf_status upf_gguf_add_tensor(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims, const int64_t *ne,
                               const void *data, uint64_t nbytes) {
  return add_tensor(w, name, type, n_dims, ne, data, nbytes, 1);
}

upf_status upf_gguf_add_tensor_ref(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims,
                                   const int64_t *ne, const void *data, uint64_t nbytes) {
  return add_tensor(w, name, type, n_dims, ne, data, nbytes, 0);
}

upf_status upf_gguf_add_tensor_info(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims,
                                    const int64_t *ne, uint64_t nbytes) {
  return add_tensor(w, name, type, n_dims, ne, NULL, nbytes, 2);
}

/* The tensors whose data the writer does not hold (upf_gguf_add_tensor_info) go through the
 * streaming calls only. */
static upf_status check_held(const upf_gguf_writer *w) {
  for (int64_t i = 0; i < w->n_t; i++)
    if (w->t[i].nbytes && !w->t[i].data)
      return upf_fail(UPF_ERR_INVALID_ARG, "gguf writer: tensor '%s' has no data here (its data are streamed with "
                      "upf_gguf_writer_write_tensor)", w->t[i].name);
  return UPF_OK;
}

static const uint8_t zero_pad[1 << 16]; /* the alignment is at most 2^16 */

static uint64_t pad_of(uint64_t pos, uint64_t align) { return (align - pos % align) % align; }

/* Header, metadata and tensor directory, padded to the alignment; tensor offsets assigned in order. */
static upf_status build_head(const upf_gguf_writer *w, bytes *h) {
  put(h, UPF_GGUF_MAGIC, 4);
  put_le(h, w->version, 4);
  put_le(h, (uint64_t)w->n_t, 8);
  put_le(h, (uint64_t)w->n_kv, 8);
  for (int64_t i = 0; i < w->n_kv; i++) {
    put_str(h, w->kv[i].key, strlen(w->kv[i].key));
    put_le(h, (uint64_t)w->kv[i].type, 4);
    put(h, w->kv[i].value.p, w->kv[i].value.len);
  }
  uint64_t offset = 0;
  for (int64_t i = 0; i < w->n_t; i++) {
    const wtensor *t = &w->t[i];
    put_str(h, t->name, strlen(t->name));
    put_le(h, (uint64_t)t->n_dims, 4);
    for (int d = 0; d < t->n_dims; d++)
      put_le(h, (uint64_t)t->ne[d], 8);
    put_le(h, (uint64_t)t->type, 4);
    put_le(h, offset, 8);
    offset += t->nbytes + pad_of(t->nbytes, w->alignment);
  }
  put(h, zero_pad, pad_of(h->len, w->alignment));
  if (h->failed) {
    free(h->p);
    return upf_fail(UPF_ERR_NOMEM, "gguf writer: out of memory for the file header");
  }
  return UPF_OK;
}

upf_status upf_gguf_writer_to_memory(const upf_gguf_writer *w, void **out, uint64_t *size) {
  bytes b = {0};
  UPF_TRY(check_held(w));
  UPF_TRY(build_head(w, &b));
  for (int64_t i = 0; i < w->n_t; i++) {
    put(&b, w->t[i].data, w->t[i].nbytes);
    put(&b, zero_pad, pad_of(w->t[i].nbytes, w->alignment));
  }
  if (b.failed) {
    free(b.p);
    return upf_fail(UPF_ERR_NOMEM, "gguf writer: out of memory for the file image");
  }
  *out = b.p;
  *size = b.len;
  return UPF_OK;
}

int64_t upf_gguf_writer_num_tensors(const upf_gguf_writer *w) { return w->n_t; }

upf_status upf_gguf_writer_write_head(const upf_gguf_writer *w, FILE *f, const char *what) {
  bytes head = {0};
  UPF_TRY(build_head(w, &head));
  char label[4096];
  snprintf(label, sizeof label, "%s (the GGUF header)", what);
  upf_status st = upf_output_put(f, head.p, (size_t)head.len, label);
  free(head.p);
  return st;
}

upf_status upf_gguf_writer_write_tensor(const upf_gguf_writer *w, FILE *f, int64_t i, const char *name,
                                        const void *data, uint64_t nbytes, const char *what) {
  if (i < 0 || i >= w->n_t || strcmp(w->t[i].name, name) || w->t[i].nbytes != nbytes)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: tensor '%s' (%" PRIu64 " bytes) is not entry %" PRId64
                    " of the tensor directory", what, name, nbytes, i);
  if (nbytes > SIZE_MAX || (nbytes && !data))
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: tensor '%s': no data", what, name);
  char label[4096];
  snprintf(label, sizeof label, "%s (tensor %s)", what, name);
  UPF_TRY(upf_output_put(f, data, (size_t)nbytes, label));
  return upf_output_put(f, zero_pad, (size_t)pad_of(nbytes, w->alignment), label);
}

upf_status upf_gguf_writer_write_stream(const upf_gguf_writer *w, FILE *f, const char *what) {
  UPF_TRY(check_held(w));
  UPF_TRY(upf_gguf_writer_write_head(w, f, what));
  for (int64_t i = 0; i < w->n_t; i++)
    UPF_TRY(upf_gguf_writer_write_tensor(w, f, i, w->t[i].name, w->t[i].data, w->t[i].nbytes, what));
  return UPF_OK;
}

upf_status upf_gguf_writer_write_to(const upf_gguf_writer *w, upf_outputs *o, const char *path, const char *what) {
  UPF_TRY(check_held(w)); /* before the set holds a temporary for it */
  FILE *f;
  UPF_TRY(upf_outputs_open(o, path, what, &f));
  char label[4096];
  snprintf(label, sizeof label, "%s%s%s", what ? what : "", what ? " " : "", path);
  return upf_gguf_writer_write_stream(w, f, label);
}

upf_status upf_gguf_writer_write(const upf_gguf_writer *w, const char *path) {
  upf_outputs *o;
  UPF_TRY(upf_outputs_create(&o, 1));
  upf_status st = upf_gguf_writer_write_to(w, o, path, NULL);
  if (st == UPF_OK)
    st = upf_outputs_commit(o);
  upf_outputs_free(o);
  return st;
}

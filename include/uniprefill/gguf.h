/* GGUF file format (versions 2 and 3, little-endian): a reader (mmap of a path, or a caller's buffer),
 * the ggml tensor types with dequantisation to f32, and a writer. This layer knows the format only;
 * mapping tensor names onto a model is the business of models/.
 *
 * Reader: every metadata value is parsed at open into memory the handle owns (strings are copied and
 * NUL-terminated, numeric arrays copied to aligned host-order storage, string arrays indexed), so
 * every access afterwards is O(1) and never touches the file bytes. Tensor data stay in the mapping:
 * a tensor's `data` points into it. A malformed or truncated file gives UPF_ERR_FORMAT (or UPF_ERR_IO
 * when it cannot be read) with a message naming the file and the key, tensor or offset at fault;
 * every count and length is checked against the bytes left before anything is allocated, so a bad
 * file can neither crash the reader nor make it allocate more than a small multiple of its size. */
#ifndef UNIPREFILL_GGUF_H
#define UNIPREFILL_GGUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "uniprefill/output.h"
#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define UPF_GGUF_MAGIC "GGUF"
#define UPF_GGUF_DEFAULT_ALIGNMENT 32
#define UPF_GGUF_MAX_DIMS 4

/* Metadata value types, numbered as in the file. */
typedef enum {
  UPF_GGUF_TYPE_UINT8 = 0,
  UPF_GGUF_TYPE_INT8 = 1,
  UPF_GGUF_TYPE_UINT16 = 2,
  UPF_GGUF_TYPE_INT16 = 3,
  UPF_GGUF_TYPE_UINT32 = 4,
  UPF_GGUF_TYPE_INT32 = 5,
  UPF_GGUF_TYPE_FLOAT32 = 6,
  UPF_GGUF_TYPE_BOOL = 7,
  UPF_GGUF_TYPE_STRING = 8,
  UPF_GGUF_TYPE_ARRAY = 9,
  UPF_GGUF_TYPE_UINT64 = 10,
  UPF_GGUF_TYPE_INT64 = 11,
  UPF_GGUF_TYPE_FLOAT64 = 12,
  UPF_GGUF_TYPE_COUNT
} upf_gguf_type;

/* "uint8", ..., "array"; "?" outside the enum. */
const char *upf_gguf_type_name(upf_gguf_type type);
/* Bytes of one scalar element in the file (1..8); 0 for STRING, ARRAY and unknown types. */
size_t upf_gguf_type_size(upf_gguf_type type);

/* ggml tensor types, numbered as in ggml.h (gaps are types ggml removed). */
typedef enum {
  UPF_GGML_TYPE_F32 = 0,
  UPF_GGML_TYPE_F16 = 1,
  UPF_GGML_TYPE_Q4_0 = 2,
  UPF_GGML_TYPE_Q4_1 = 3,
  UPF_GGML_TYPE_Q5_0 = 6,
  UPF_GGML_TYPE_Q5_1 = 7,
  UPF_GGML_TYPE_Q8_0 = 8,
  UPF_GGML_TYPE_Q8_1 = 9,
  UPF_GGML_TYPE_Q2_K = 10,
  UPF_GGML_TYPE_Q3_K = 11,
  UPF_GGML_TYPE_Q4_K = 12,
  UPF_GGML_TYPE_Q5_K = 13,
  UPF_GGML_TYPE_Q6_K = 14,
  UPF_GGML_TYPE_Q8_K = 15,
  UPF_GGML_TYPE_IQ2_XXS = 16,
  UPF_GGML_TYPE_IQ2_XS = 17,
  UPF_GGML_TYPE_IQ3_XXS = 18,
  UPF_GGML_TYPE_IQ1_S = 19,
  UPF_GGML_TYPE_IQ4_NL = 20,
  UPF_GGML_TYPE_IQ3_S = 21,
  UPF_GGML_TYPE_IQ2_S = 22,
  UPF_GGML_TYPE_IQ4_XS = 23,
  UPF_GGML_TYPE_I8 = 24,
  UPF_GGML_TYPE_I16 = 25,
  UPF_GGML_TYPE_I32 = 26,
  UPF_GGML_TYPE_I64 = 27,
  UPF_GGML_TYPE_F64 = 28,
  UPF_GGML_TYPE_IQ1_M = 29,
  UPF_GGML_TYPE_BF16 = 30,
  UPF_GGML_TYPE_TQ1_0 = 34,
  UPF_GGML_TYPE_TQ2_0 = 35,
  UPF_GGML_TYPE_MXFP4 = 39,
  UPF_GGML_TYPE_NVFP4 = 40,
  UPF_GGML_TYPE_Q1_0 = 41,
  UPF_GGML_TYPE_COUNT = 42
} upf_ggml_type;

/* "f32", "q4_K", ... (ggml's names); NULL for a number that is no known type. */
const char *upf_ggml_type_name(upf_ggml_type type);
/* Elements per block (1 for the plain types, 32 for Q4_0.., 256 for the K types); 0 if unknown. */
int64_t upf_ggml_block_size(upf_ggml_type type);
/* Bytes per block; 0 if unknown. */
int64_t upf_ggml_type_size(upf_ggml_type type);
/* Bytes of `n` elements (n a multiple of the block size); -1 if the type is unknown, n is not a
 * multiple of its block size, or the size overflows int64. */
int64_t upf_ggml_row_size(upf_ggml_type type, int64_t n);
/* Whether upf_ggml_dequantize handles the type: F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q4_K, Q5_K, Q6_K. */
int upf_ggml_can_dequantize(upf_ggml_type type);

/* Dequantises `n` elements (a multiple of the type's block size) of type `type` starting at `src`
 * (any alignment; the block layouts and formulas of ggml) into dst (n floats). UPF_ERR_DTYPE for a
 * type it does not handle, UPF_ERR_SHAPE when n is not a whole number of blocks. */
upf_status upf_ggml_dequantize(upf_ggml_type type, const void *src, int64_t n, float *dst);

/* ---- Reader ---------------------------------------------------------------------------------- */

typedef struct upf_gguf upf_gguf;       /* an open file */
typedef struct upf_gguf_kv upf_gguf_kv; /* one metadata entry, owned by its upf_gguf */

/* A string value: NUL-terminated copy; len excludes the terminator (the bytes may hold NULs). */
typedef struct {
  const char *ptr;
  uint64_t len;
} upf_gguf_str;

/* An array value. Exactly one of data/strs/arrs is non-NULL when n > 0 (all NULL when n == 0). */
typedef struct upf_gguf_arr {
  upf_gguf_type type;              /* element type */
  uint64_t n;                      /* element count */
  const void *data;                /* numeric/bool: (n,) elements of `type`, host order, aligned */
  const upf_gguf_str *strs;        /* STRING: (n,) */
  const struct upf_gguf_arr *arrs; /* ARRAY: (n,) nested arrays */
} upf_gguf_arr;

typedef struct {
  const char *name;    /* NUL-terminated copy */
  int n_dims;          /* 0..4 (0: a scalar) */
  int64_t ne[UPF_GGUF_MAX_DIMS]; /* extents in GGUF order: ne[0] is the contiguous dim; 1 past n_dims */
  int64_t n_elements;  /* product of ne */
  upf_ggml_type type;
  uint64_t offset;     /* of the data, from the start of the data section (a multiple of the alignment) */
  uint64_t nbytes;     /* upf_ggml_row_size(type, ne[0]) * ne[1] * ne[2] * ne[3] */
  const void *data;    /* (ne[3], ne[2], ne[1], row of ne[0]) inside the file image */
} upf_gguf_tensor;

/* Opens and parses a file (read-only mmap; the handle keeps the mapping until upf_gguf_close). */
upf_status upf_gguf_open(const char *path, upf_gguf **out);
/* Parses an image in memory, which the caller keeps alive and unchanged until upf_gguf_close.
 * `what` names it in messages. */
upf_status upf_gguf_open_memory(const void *bytes, uint64_t size, const char *what, upf_gguf **out);
void upf_gguf_close(upf_gguf *g); /* NULL is fine */

uint32_t upf_gguf_version(const upf_gguf *g);    /* 2 or 3 */
const char *upf_gguf_name(const upf_gguf *g);    /* the path or `what` */
uint64_t upf_gguf_alignment(const upf_gguf *g);  /* general.alignment, or 32 */
uint64_t upf_gguf_data_offset(const upf_gguf *g); /* file offset of the tensor data section */
uint64_t upf_gguf_file_size(const upf_gguf *g);

/* Metadata in file order. */
int64_t upf_gguf_kv_count(const upf_gguf *g);
const upf_gguf_kv *upf_gguf_kv_at(const upf_gguf *g, int64_t i); /* NULL out of range */
const upf_gguf_kv *upf_gguf_kv_find(const upf_gguf *g, const char *key); /* NULL if absent */
const char *upf_gguf_kv_key(const upf_gguf_kv *kv);
upf_gguf_type upf_gguf_kv_type(const upf_gguf_kv *kv);

/* Typed getters by key. Each returns UPF_ERR_FORMAT naming the file and key when the key is absent
 * or its value cannot be represented in the requested type, and leaves *out untouched then.
 * Integers: any integer type whose value fits (a uint8 5 reads as u32, an int32 -1 does not).
 * get_f32/get_f64: FLOAT32 or FLOAT64 (a double read as f32 is rounded). get_bool: BOOL only.
 * get_str: STRING only; the pointer lives as long as the handle; len may be NULL. */
upf_status upf_gguf_get_u32(const upf_gguf *g, const char *key, uint32_t *out);
upf_status upf_gguf_get_i32(const upf_gguf *g, const char *key, int32_t *out);
upf_status upf_gguf_get_u64(const upf_gguf *g, const char *key, uint64_t *out);
upf_status upf_gguf_get_i64(const upf_gguf *g, const char *key, int64_t *out);
upf_status upf_gguf_get_f32(const upf_gguf *g, const char *key, float *out);
upf_status upf_gguf_get_f64(const upf_gguf *g, const char *key, double *out);
upf_status upf_gguf_get_bool(const upf_gguf *g, const char *key, int *out);
upf_status upf_gguf_get_str(const upf_gguf *g, const char *key, const char **out, uint64_t *len);

/* The same, but an absent key stores `dflt` and returns UPF_OK (a present key of a wrong type is
 * still an error): for optional hyper-parameters. */
upf_status upf_gguf_get_u32_or(const upf_gguf *g, const char *key, uint32_t dflt, uint32_t *out);
upf_status upf_gguf_get_f32_or(const upf_gguf *g, const char *key, float dflt, float *out);
upf_status upf_gguf_get_bool_or(const upf_gguf *g, const char *key, int dflt, int *out);

/* Array value of `key` (UPF_ERR_FORMAT naming the key when absent or not an array). The pointers
 * live as long as the handle. */
upf_status upf_gguf_get_arr(const upf_gguf *g, const char *key, const upf_gguf_arr **out);
/* Copies an integer array (any integer element type whose every value fits int32) into dst (n
 * elements); n must equal the array length. Errors name the key, the lengths or the element. */
upf_status upf_gguf_get_arr_i32(const upf_gguf *g, const char *key, int32_t *dst, uint64_t n);
/* Copies a FLOAT32 or FLOAT64 array (or an integer one, converted) into dst (n floats). */
upf_status upf_gguf_get_arr_f32(const upf_gguf *g, const char *key, float *dst, uint64_t n);

/* Tensor directory in file order. */
int64_t upf_gguf_tensor_count(const upf_gguf *g);
const upf_gguf_tensor *upf_gguf_tensor_at(const upf_gguf *g, int64_t i);      /* NULL out of range */
const upf_gguf_tensor *upf_gguf_tensor_find(const upf_gguf *g, const char *name); /* NULL if absent */
/* As tensor_find, but UPF_ERR_FORMAT naming the file and tensor when absent. */
upf_status upf_gguf_tensor_get(const upf_gguf *g, const char *name, const upf_gguf_tensor **out);

/* Dequantises a whole tensor into dst (t->n_elements floats, in the tensor's own order: element
 * (i0, i1, i2, i3) at i0 + ne0*(i1 + ne1*(i2 + ne2*i3))). UPF_ERR_DTYPE naming the tensor and its type
 * when the type is not one upf_ggml_dequantize handles. */
upf_status upf_gguf_tensor_to_f32(const upf_gguf_tensor *t, float *dst);
/* Dequantises rows [row0, row0 + nrows) (a row is ne[0] elements; rows run over ne[1]*ne[2]*ne[3])
 * into dst (nrows * ne[0] floats): for a vocabulary embedding, one token's row. */
upf_status upf_gguf_tensor_rows_to_f32(const upf_gguf_tensor *t, int64_t row0, int64_t nrows, float *dst);

/* ---- Writer ---------------------------------------------------------------------------------- */

typedef struct upf_gguf_writer upf_gguf_writer;

/* A writer for a version-3 file with alignment 32. */
upf_status upf_gguf_writer_create(upf_gguf_writer **out);
void upf_gguf_writer_free(upf_gguf_writer *w); /* NULL is fine */
/* 2 or 3 (version 2 is kept to test the reader; it has the same 64-bit layout). */
upf_status upf_gguf_writer_set_version(upf_gguf_writer *w, uint32_t version);
/* Data alignment: a power of two, 1..2^16; also sets "general.alignment" (uint32) unless it is 32,
 * in which case that key is removed (32 is the default every reader assumes). */
upf_status upf_gguf_writer_set_alignment(upf_gguf_writer *w, uint32_t alignment);

/* Metadata, kept in insertion order. Setting an existing key replaces its value in place. Keys and
 * strings are copied; keys must be non-empty. */
upf_status upf_gguf_set_u8(upf_gguf_writer *w, const char *key, uint8_t v);
upf_status upf_gguf_set_i8(upf_gguf_writer *w, const char *key, int8_t v);
upf_status upf_gguf_set_u16(upf_gguf_writer *w, const char *key, uint16_t v);
upf_status upf_gguf_set_i16(upf_gguf_writer *w, const char *key, int16_t v);
upf_status upf_gguf_set_u32(upf_gguf_writer *w, const char *key, uint32_t v);
upf_status upf_gguf_set_i32(upf_gguf_writer *w, const char *key, int32_t v);
upf_status upf_gguf_set_u64(upf_gguf_writer *w, const char *key, uint64_t v);
upf_status upf_gguf_set_i64(upf_gguf_writer *w, const char *key, int64_t v);
upf_status upf_gguf_set_f32(upf_gguf_writer *w, const char *key, float v);
upf_status upf_gguf_set_f64(upf_gguf_writer *w, const char *key, double v);
upf_status upf_gguf_set_bool(upf_gguf_writer *w, const char *key, int v);
upf_status upf_gguf_set_str(upf_gguf_writer *w, const char *key, const char *v); /* NUL-terminated */
/* Numeric or bool array: n elements of `type` (UINT8..FLOAT64, not STRING/ARRAY) in host order. */
upf_status upf_gguf_set_arr(upf_gguf_writer *w, const char *key, upf_gguf_type type, const void *data, uint64_t n);
/* String array: n NUL-terminated strings. */
upf_status upf_gguf_set_arr_str(upf_gguf_writer *w, const char *key, const char *const *strs, uint64_t n);

/* Adds a tensor: n_dims 1..4 extents in GGUF order (ne[0] contiguous, a multiple of the type's block
 * size), `nbytes` of data that must equal upf_ggml_row_size(type, ne[0]) * ne[1]*...; any type with
 * a known block layout (F32, F16, BF16, the quantised ones). The data are copied. Names must be
 * unique and non-empty. */
upf_status upf_gguf_add_tensor(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims,
                               const int64_t *ne, const void *data, uint64_t nbytes);
/* The same without the copy: `data` must stay valid and unchanged until the last write. */
upf_status upf_gguf_add_tensor_ref(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims,
                                   const int64_t *ne, const void *data, uint64_t nbytes);

/* Writes the file as an output set of one (uniprefill/output.h): a regular file through a temporary
 * in the same directory renamed over `path`, so a failure leaves neither a partial file nor the
 * temporary; a link followed; a device or FIFO written in place. The writer can be written again or
 * extended. */
upf_status upf_gguf_writer_write(const upf_gguf_writer *w, const char *path);
/* The same as one output of the set o (`what` names it in messages: the flag, or NULL). */
upf_status upf_gguf_writer_write_to(const upf_gguf_writer *w, upf_outputs *o, const char *path, const char *what);
/* The whole file to an open stream. */
upf_status upf_gguf_writer_write_stream(const upf_gguf_writer *w, FILE *f, const char *what);

/* Streaming, for files larger than memory: declare every tensor with upf_gguf_add_tensor_info (the
 * directory only, no data), write the head, then each tensor's data in the order declared, freeing
 * it after. write_tensor checks that entry i is `name` of nbytes. */
upf_status upf_gguf_add_tensor_info(upf_gguf_writer *w, const char *name, upf_ggml_type type, int n_dims,
                                    const int64_t *ne, uint64_t nbytes);
int64_t upf_gguf_writer_num_tensors(const upf_gguf_writer *w);
upf_status upf_gguf_writer_write_head(const upf_gguf_writer *w, FILE *f, const char *what);
upf_status upf_gguf_writer_write_tensor(const upf_gguf_writer *w, FILE *f, int64_t i, const char *name,
                                        const void *data, uint64_t nbytes, const char *what);
/* The file image in memory (malloc'd, *size bytes; free with free()): for tests and fuzzing. */
upf_status upf_gguf_writer_to_memory(const upf_gguf_writer *w, void **bytes, uint64_t *size);

#ifdef __cplusplus
}
#endif
#endif

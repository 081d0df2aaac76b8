/* Tensor descriptor helpers and bf16 array conversion. */
#include "uniprefill/tensor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"

static const struct {
  const char *name;
  size_t size;
} dtype_info[UPF_DTYPE_COUNT] = {
    [UPF_DTYPE_F32] = {"f32", 4}, [UPF_DTYPE_BF16] = {"bf16", 2}, [UPF_DTYPE_F64] = {"f64", 8},
    [UPF_DTYPE_I32] = {"i32", 4}, [UPF_DTYPE_I64] = {"i64", 8},   [UPF_DTYPE_U8] = {"u8", 1},
    [UPF_DTYPE_BOOL] = {"bool", 1},
};

size_t upf_dtype_size(upf_dtype dtype) {
  return (unsigned)dtype < UPF_DTYPE_COUNT ? dtype_info[dtype].size : 0;
}

const char *upf_dtype_name(upf_dtype dtype) {
  return (unsigned)dtype < UPF_DTYPE_COUNT ? dtype_info[dtype].name : "invalid";
}

upf_status upf_dtype_parse(const char *name, upf_dtype *out) {
  if (!name)
    return upf_fail(UPF_ERR_DTYPE, "dtype: missing name");
  if (!strcmp(name, "fp32") || !strcmp(name, "float32")) {
    *out = UPF_DTYPE_F32;
    return UPF_OK;
  }
  if (!strcmp(name, "bfloat16")) {
    *out = UPF_DTYPE_BF16;
    return UPF_OK;
  }
  for (int i = 0; i < UPF_DTYPE_COUNT; i++) {
    if (!strcmp(name, dtype_info[i].name)) {
      *out = (upf_dtype)i;
      return UPF_OK;
    }
  }
  return upf_fail(UPF_ERR_DTYPE, "dtype: unknown name '%s' (expected f32, bf16, f64, i32, i64, u8, bool)",
                  name);
}

int64_t upf_tensor_numel(const upf_tensor *t) {
  /* A zero extent anywhere makes the count 0 whatever the other extents, so it is looked for first:
   * multiplying in dim order could overflow before reaching it. */
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] <= 0)
      return t->shape[i] == 0 ? 0 : -1;
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    if (__builtin_mul_overflow(n, t->shape[i], &n))
      return -1;
  return n;
}

int upf_tensor_is_contiguous(const upf_tensor *t) {
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->stride[i] != expected)
      return 0;
    if (__builtin_mul_overflow(expected, t->shape[i], &expected))
      return 0;
  }
  return 1;
}

upf_status upf_tensor_init(upf_tensor *t, void *data, upf_dtype dtype, int ndim, const int64_t *shape) {
  if ((unsigned)dtype >= UPF_DTYPE_COUNT)
    return upf_fail(UPF_ERR_DTYPE, "tensor: invalid dtype %d", (int)dtype);
  if (ndim < 0 || ndim > UPF_MAX_DIMS)
    return upf_fail(UPF_ERR_SHAPE, "tensor: ndim %d outside [0, %d]", ndim, UPF_MAX_DIMS);
  memset(t, 0, sizeof *t);
  t->data = data;
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return upf_fail(UPF_ERR_SHAPE, "tensor: negative extent %lld in dim %d", (long long)shape[i], i);
    t->shape[i] = shape[i];
  }
  /* Row-major strides (0 left of a zero extent, as a contiguous layout gives). The product of the
   * nonzero extents, times the element size, must fit in 64 bits whatever the element count: it
   * bounds every stride, every partial product of extents code may form (T * H rows) and the byte
   * size, so a (0, 2^62, 2^62) tensor, which holds nothing, is still refused. */
  char buf[UPF_MAX_DIMS * 22 + 4];
  int64_t stride = 1, nonzero = 1, bytes;
  for (int i = ndim - 1; i >= 0; i--) {
    t->stride[i] = stride;
    if (__builtin_mul_overflow(nonzero, shape[i] ? shape[i] : 1, &nonzero))
      return upf_fail(UPF_ERR_SHAPE, "tensor: the extents of shape %s multiply past 64 bits (strides overflow)",
                      upf_tensor_shape_str(t, buf, sizeof buf));
    stride *= shape[i]; /* 0, or the nonzero product just checked */
  }
  if (__builtin_mul_overflow(nonzero, (int64_t)upf_dtype_size(dtype), &bytes))
    return upf_fail(UPF_ERR_SHAPE, "tensor: the byte size of a %s tensor of shape %s overflows 64 bits",
                    upf_dtype_name(dtype), upf_tensor_shape_str(t, buf, sizeof buf));
  return UPF_OK;
}

upf_status upf_tensor_alloc(upf_tensor *t, upf_dtype dtype, int ndim, const int64_t *shape) {
  UPF_TRY(upf_tensor_init(t, NULL, dtype, ndim, shape));
  /* init bounded numel * size by INT64_MAX, so the rounding below cannot wrap a size_t either. */
  int64_t bytes = upf_tensor_numel(t) * (int64_t)upf_dtype_size(dtype);
  if ((uint64_t)bytes > SIZE_MAX - 63)
    return upf_fail(UPF_ERR_NOMEM, "tensor: %lld bytes do not fit in this machine's address space", (long long)bytes);
  size_t rounded = ((size_t)bytes + 63) & ~(size_t)63;
  t->data = aligned_alloc(64, rounded ? rounded : 64);
  if (!t->data)
    return upf_fail(UPF_ERR_NOMEM, "tensor: cannot allocate %lld bytes", (long long)bytes);
  return UPF_OK;
}

void upf_tensor_free(upf_tensor *t) {
  if (!t)
    return;
  free(t->data);
  t->data = NULL;
}

const char *upf_tensor_shape_str(const upf_tensor *t, char *buf, size_t cap) {
  size_t used = (size_t)snprintf(buf, cap, "(");
  for (int i = 0; i < t->ndim && used < cap; i++)
    used += (size_t)snprintf(buf + used, cap - used, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (used < cap)
    snprintf(buf + used, cap - used, t->ndim == 1 ? ",)" : ")");
  return buf;
}

void upf_bf16_from_f32_array(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = upf_bf16_from_f32(src[i]);
}

void upf_bf16_to_f32_array(float *dst, const uint16_t *src, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = upf_bf16_to_f32(src[i]);
}

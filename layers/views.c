/* Tensor views over the layers' buffers. */
#include "layers/layers.h"

upf_tensor upf_mat(void *data, upf_dtype dtype, int64_t rows, int64_t cols) {
  upf_tensor t;
  const int64_t shape[2] = {rows, cols};
  upf_tensor_init(&t, data, dtype, 2, shape);
  return t;
}

upf_tensor upf_cols(const upf_tensor *mat, int64_t col0, int64_t cols) {
  upf_tensor t = *mat;
  t.data = (char *)mat->data + col0 * (int64_t)upf_dtype_size(mat->dtype);
  t.shape[1] = cols;
  return t;
}

upf_tensor upf_heads(const upf_tensor *mat, int64_t col0, int64_t heads, int64_t dim, int64_t head_stride) {
  upf_tensor t = upf_cols(mat, col0, heads * dim);
  t.ndim = 3;
  t.shape[1] = heads, t.shape[2] = dim;
  t.stride[0] = mat->stride[0], t.stride[1] = head_stride, t.stride[2] = 1;
  return t;
}

upf_tensor upf_rows(const upf_tensor *t, int64_t row0, int64_t rows) {
  upf_tensor r = *t;
  r.data = (char *)t->data + row0 * t->stride[0] * (int64_t)upf_dtype_size(t->dtype);
  r.shape[0] = rows;
  return r;
}

/* Tensor descriptor: element type, shape and strides (in elements, 64-bit), and host helpers for
 * contiguous tensors. A descriptor does not say where its memory lives; each API states whether it
 * takes host or device pointers. */
#ifndef UNIPREFILL_TENSOR_H
#define UNIPREFILL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define UPF_MAX_DIMS 8

typedef enum {
  UPF_DTYPE_F32 = 0, /* npy '<f4' */
  UPF_DTYPE_BF16,    /* npy '<u2' holding bf16 bit patterns */
  UPF_DTYPE_F64,     /* npy '<f8' */
  UPF_DTYPE_I32,     /* npy '<i4' */
  UPF_DTYPE_I64,     /* npy '<i8' */
  UPF_DTYPE_U8,      /* npy '|u1' */
  UPF_DTYPE_BOOL,    /* npy '|b1', one byte 0 or 1 */
  UPF_DTYPE_COUNT
} upf_dtype;

typedef struct {
  void *data;                    /* first element; host or device per the API */
  upf_dtype dtype;
  int ndim;
  int64_t shape[UPF_MAX_DIMS];
  int64_t stride[UPF_MAX_DIMS];  /* in elements */
} upf_tensor;

size_t upf_dtype_size(upf_dtype dtype);
const char *upf_dtype_name(upf_dtype dtype); /* "f32", "bf16", ... */
/* Parses "f32"/"fp32"/"bf16"/...; returns UPF_ERR_DTYPE for anything else. */
upf_status upf_dtype_parse(const char *name, upf_dtype *out);

/* Product of the extents: 0 when any extent is 0 (whatever the others), -1 when an extent is
 * negative or the product overflows 64 bits (a descriptor upf_tensor_init would refuse). */
int64_t upf_tensor_numel(const upf_tensor *t);
int upf_tensor_is_contiguous(const upf_tensor *t);
/* Fills shape and row-major strides; data is left as given. UPF_ERR_SHAPE when an extent is
 * negative or a stride, the element count or the byte size would overflow 64 bits (checked also
 * when an extent is 0), so every stride of an initialised tensor is exact. */
upf_status upf_tensor_init(upf_tensor *t, void *data, upf_dtype dtype, int ndim, const int64_t *shape);
/* Allocates a contiguous host tensor (64-byte aligned); free with upf_tensor_free. */
upf_status upf_tensor_alloc(upf_tensor *t, upf_dtype dtype, int ndim, const int64_t *shape);
void upf_tensor_free(upf_tensor *t);
/* "(4, 32, 128)" into buf. */
const char *upf_tensor_shape_str(const upf_tensor *t, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif

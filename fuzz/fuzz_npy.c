/* libFuzzer target: the .npy reader (core/npy.c) over an in-memory image. A parsed tensor must be
 * contiguous, its byte size must fit the input, and writing it back and reading that must give the
 * same descriptor and bytes (the writer's image is always one the reader takes). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  upf_tensor t = {0};
  if (upf_npy_parse(data, size, "fuzz.npy", &t) != UPF_OK) {
    if (t.data)
      __builtin_trap(); /* a failure leaves the tensor empty */
    return 0;
  }
  const int64_t n = upf_tensor_numel(&t);
  const size_t bytes = (size_t)n * upf_dtype_size(t.dtype);
  if (n < 0 || !upf_tensor_is_contiguous(&t) || bytes > size)
    __builtin_trap();
  /* the round trip through the writer's stream */
  char *img = NULL;
  size_t img_size = 0;
  FILE *f = open_memstream(&img, &img_size);
  if (f) {
    const upf_status st = upf_npy_write_stream(f, "fuzz.npy", &t);
    fclose(f);
    upf_tensor back = {0};
    if (st != UPF_OK || upf_npy_parse(img, img_size, "roundtrip.npy", &back) != UPF_OK)
      __builtin_trap();
    if (back.dtype != t.dtype || back.ndim != t.ndim || memcmp(back.shape, t.shape, sizeof t.shape[0] * (size_t)t.ndim) ||
        (bytes && memcmp(back.data, t.data, bytes)))
      __builtin_trap();
    upf_tensor_free(&back);
  }
  free(img);
  upf_tensor_free(&t);
  return 0;
}

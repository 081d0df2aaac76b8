/* libFuzzer target: the GGUF reader (core/gguf.c) over an in-memory image, then what the CLI reads
 * from an open file: every metadata value and small tensor (dequantised), the model config
 * (models/gguf_model.c) and the tokenizer (core/tokenizer_gguf.c), which encodes and decodes a
 * short text when it builds. Each tensor's data must lie inside the image. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/gguf.h"
#include "uniprefill/model.h"
#include "uniprefill/tokenizer.h"

static volatile uint64_t sink; /* reads every byte a value claims, so ASan sees an overread */

static void walk_arr(const upf_gguf_arr *a, int depth) {
  if (a->n && !a->data && !a->strs && !a->arrs)
    __builtin_trap();
  if (a->strs)
    for (uint64_t i = 0; i < a->n; i++) {
      if (a->strs[i].ptr[a->strs[i].len] != '\0')
        __builtin_trap();
      for (uint64_t j = 0; j < a->strs[i].len; j++)
        sink += (uint8_t)a->strs[i].ptr[j];
    }
  else if (a->arrs)
    for (uint64_t i = 0; i < a->n; i++)
      walk_arr(&a->arrs[i], depth + 1);
  else if (a->data) {
    const size_t es = upf_gguf_type_size(a->type);
    if (!es)
      __builtin_trap();
    for (uint64_t i = 0; i < a->n * es; i++)
      sink += ((const uint8_t *)a->data)[i];
  }
}

static void use_tokenizer(const upf_tokenizer *t) {
  static const char text[] = "Hello world! <|im_start|>  caf\xc3\xa9 12 \xe2\x96\x81<s>\xff\n";
  for (int flags = 0; flags < 4; flags++) {
    int32_t *ids = NULL;
    int64_t n = 0;
    if (upf_tokenizer_encode(t, text, (int64_t)sizeof text - 1, flags, &ids, &n) == UPF_OK) {
      for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= upf_tokenizer_n_tokens(t))
          __builtin_trap();
      char *back = NULL;
      int64_t len = 0;
      if (upf_tokenizer_decode(t, ids, n, flags & 1 ? UPF_DETOKENIZE_RENDER_SPECIAL : 0, &back, &len) == UPF_OK &&
          back[len] != '\0')
        __builtin_trap();
      free(back);
    }
    free(ids);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  upf_gguf *g = NULL;
  if (upf_gguf_open_memory(data, size, "fuzz.gguf", &g) != UPF_OK) {
    if (g)
      __builtin_trap();
    return 0;
  }
  for (int64_t i = 0; i < upf_gguf_kv_count(g); i++) {
    const upf_gguf_kv *kv = upf_gguf_kv_at(g, i);
    const char *key = upf_gguf_kv_key(kv);
    const upf_gguf_arr *arr;
    const char *str;
    uint64_t len;
    double f;
    int64_t v;
    if (upf_gguf_kv_find(g, key) == NULL)
      __builtin_trap();
    if (upf_gguf_get_str(g, key, &str, &len) == UPF_OK)
      for (uint64_t j = 0; j < len; j++)
        sink += (uint8_t)str[j];
    else if (upf_gguf_get_arr(g, key, &arr) == UPF_OK)
      walk_arr(arr, 0);
    else if (upf_gguf_get_f64(g, key, &f) == UPF_OK)
      sink += (uint64_t)(f == f);
    else if (upf_gguf_get_i64(g, key, &v) == UPF_OK)
      sink += (uint64_t)v;
  }
  const uint8_t *end = data + size;
  for (int64_t i = 0; i < upf_gguf_tensor_count(g); i++) {
    const upf_gguf_tensor *t = upf_gguf_tensor_at(g, i);
    if (upf_gguf_tensor_find(g, t->name) == NULL)
      __builtin_trap();
    const uint8_t *p = t->data;
    if (t->nbytes && (p < data || p > end || t->nbytes > (uint64_t)(end - p)))
      __builtin_trap();
    if (t->n_elements > 0 && t->n_elements <= (1 << 16) && upf_ggml_can_dequantize(t->type)) {
      float *dst = malloc((size_t)t->n_elements * sizeof *dst);
      if (dst)
        (void)upf_gguf_tensor_to_f32(t, dst);
      free(dst);
    }
  }
  upf_gguf_model_config cfg;
  (void)upf_model_config_from_gguf(g, &cfg);
  upf_tokenizer *tok = NULL;
  if (upf_tokenizer_from_gguf(g, &tok) == UPF_OK)
    use_tokenizer(tok);
  else if (tok)
    __builtin_trap();
  upf_tokenizer_free(tok);
  upf_gguf_close(g);
  return 0;
}

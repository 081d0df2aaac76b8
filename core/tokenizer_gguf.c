/* upf_tokenizer_from_gguf: the tokenizer.ggml.* metadata of a GGUF file into upf_tokenizer_vocab,
 * with llama.cpp's defaults for absent keys (llama_vocab::impl::load). */
#include <stdlib.h>
#include <string.h>

#include "uniprefill/gguf.h"
#include "uniprefill/tokenizer.h"

/* BPE pre-tokenizer names llama.cpp maps onto the two expressions implemented here, and whether
 * it cleans spaces when decoding. */
static const struct {
  const char *name;
  upf_tokenizer_pre pre;
  int clean_spaces;
} pre_names[] = {
    {"smollm", UPF_TOKENIZER_PRE_SMOLLM, 0},     {"starcoder", UPF_TOKENIZER_PRE_SMOLLM, 1},
    {"refact", UPF_TOKENIZER_PRE_SMOLLM, 1},     {"command-r", UPF_TOKENIZER_PRE_SMOLLM, 0},
    {"codeshell", UPF_TOKENIZER_PRE_SMOLLM, 1},  {"exaone", UPF_TOKENIZER_PRE_SMOLLM, 1},
    {"minerva-7b", UPF_TOKENIZER_PRE_SMOLLM, 1}, {"mellum2", UPF_TOKENIZER_PRE_SMOLLM, 1},
    {"gpt-2", UPF_TOKENIZER_PRE_GPT2, 1},        {"phi-2", UPF_TOKENIZER_PRE_GPT2, 1},
    {"mpt", UPF_TOKENIZER_PRE_GPT2, 1},          {"olmo", UPF_TOKENIZER_PRE_GPT2, 1},
    {"jais", UPF_TOKENIZER_PRE_GPT2, 1},         {"exaone4", UPF_TOKENIZER_PRE_GPT2, 1},
    {"mellum", UPF_TOKENIZER_PRE_GPT2, 1},       {"trillion", UPF_TOKENIZER_PRE_GPT2, 0},
    {"granite-docling", UPF_TOKENIZER_PRE_GPT2, 0},
};

/* Token texts llama.cpp always treats as control (end-of-generation markers), whatever the file's
 * token_type says. */
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
};

/* An optional token id key: stays at *id when absent or out of range (llama.cpp keeps its default
 * then); a present key of a non-integer type is an error. */
/* strict: the id is used on every encode (BOS), so one out of range is refused; the others, which
 * llama.cpp ignores with a warning when out of range, are ignored. */
static upf_status get_id(const upf_gguf *g, const char *key, int32_t n_tokens, int32_t *id, int strict) {
  if (!upf_gguf_kv_find(g, key))
    return UPF_OK;
  uint32_t v;
  UPF_TRY(upf_gguf_get_u32(g, key, &v));
  /* a default in its place would silently be another token (id 1 is <eos> in Gemma) */
  if (v >= (uint32_t)n_tokens && !strict)
    return UPF_OK;
  if (v >= (uint32_t)n_tokens)
    return upf_fail(UPF_ERR_FORMAT, "%s: %s is %u, outside the vocabulary [0, %d) of tokenizer.ggml.tokens",
                    upf_gguf_name(g), key, v, n_tokens);
  *id = (int32_t)v;
  return UPF_OK;
}

upf_status upf_tokenizer_from_gguf(const upf_gguf *g, upf_tokenizer **out) {
  *out = NULL;
  const char *file = upf_gguf_name(g);
  if (!upf_gguf_kv_find(g, "tokenizer.ggml.model"))
    return upf_fail(UPF_ERR_FORMAT, "%s: no tokenizer (tokenizer.ggml.model is absent)", file);
  const char *model = NULL;
  UPF_TRY(upf_gguf_get_str(g, "tokenizer.ggml.model", &model, NULL));
  upf_tokenizer_vocab v = {.bos_id = -1, .eos_id = -1, .unk_id = -1, .pad_id = -1};
  const char *pre = "";
  if (upf_gguf_kv_find(g, "tokenizer.ggml.pre"))
    UPF_TRY(upf_gguf_get_str(g, "tokenizer.ggml.pre", &pre, NULL));
  int32_t dflt_bos, dflt_eos, dflt_unk;
  if (!strcmp(model, "gpt2")) {
    v.model = UPF_TOKENIZER_BPE;
    size_t i = 0, n = sizeof pre_names / sizeof pre_names[0];
    while (i < n && strcmp(pre_names[i].name, pre))
      i++;
    if (i == n)
      return upf_fail(UPF_ERR_UNSUPPORTED,
                      "%s: tokenizer.ggml.pre \"%s\": this BPE pre-tokenizer is not implemented (gpt2 and smollm "
                      "families only)",
                      file, pre);
    v.pre = pre_names[i].pre, v.clean_spaces = pre_names[i].clean_spaces;
    dflt_bos = 11, dflt_eos = 11, dflt_unk = -1;
  } else if (!strcmp(model, "llama")) {
    v.model = UPF_TOKENIZER_SPM, v.pre = UPF_TOKENIZER_PRE_NONE;
    v.add_space_prefix = 1, v.add_bos = 1;
    dflt_bos = 1, dflt_eos = 2, dflt_unk = 0;
  } else if (!strcmp(model, "no_vocab") || !strcmp(model, "none")) {
    return upf_fail(UPF_ERR_FORMAT, "%s: no tokenizer (tokenizer.ggml.model is \"%s\")", file, model);
  } else {
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model \"%s\" is not implemented (gpt2 and llama only)",
                    file, model);
  }

  const upf_gguf_arr *toks;
  UPF_TRY(upf_gguf_get_arr(g, "tokenizer.ggml.tokens", &toks));
  if (toks->type != UPF_GGUF_TYPE_STRING || toks->n == 0 || toks->n > INT32_MAX)
    return upf_fail(UPF_ERR_FORMAT, "%s: tokenizer.ggml.tokens is an array of %llu %s, not of strings", file,
                    (unsigned long long)toks->n, upf_gguf_type_name(toks->type));
  int32_t n = (int32_t)toks->n;
  v.n_tokens = n;
  v.bos_id = dflt_bos < n ? dflt_bos : -1;
  v.eos_id = dflt_eos < n ? dflt_eos : -1;
  v.unk_id = dflt_unk < n ? dflt_unk : -1;

  const char **texts = malloc((size_t)n * sizeof *texts);
  float *scores = NULL;
  int32_t *types = malloc((size_t)n * sizeof *types);
  const char **merges = NULL;
  upf_status st = texts && types ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s: tokenizer arrays of %d tokens", file, n);
  /* llama.cpp reads each text as a C string, so a text ends at its first NUL there too */
  for (int32_t i = 0; st == UPF_OK && i < n; i++)
    texts[i] = toks->strs[i].ptr;

  if (st == UPF_OK && upf_gguf_kv_find(g, "tokenizer.ggml.scores")) {
    const upf_gguf_arr *a;
    st = upf_gguf_get_arr(g, "tokenizer.ggml.scores", &a);
    if (st == UPF_OK && ((a->type != UPF_GGUF_TYPE_FLOAT32 && a->type != UPF_GGUF_TYPE_INT32) || a->n < (uint64_t)n))
      st = upf_fail(UPF_ERR_FORMAT, "%s: tokenizer.ggml.scores is %llu %s for %d tokens (float32 or int32 needed)",
                    file, (unsigned long long)a->n, upf_gguf_type_name(a->type), n);
    if (st == UPF_OK && !(scores = malloc((size_t)n * sizeof *scores)))
      st = upf_fail(UPF_ERR_NOMEM, "%s: scores", file);
    for (int32_t i = 0; st == UPF_OK && i < n; i++)
      scores[i] = a->type == UPF_GGUF_TYPE_FLOAT32 ? ((const float *)a->data)[i] : (float)((const int32_t *)a->data)[i];
  }
  for (int32_t i = 0; st == UPF_OK && i < n; i++)
    types[i] = UPF_TOKEN_NORMAL;
  if (st == UPF_OK && upf_gguf_kv_find(g, "tokenizer.ggml.token_type")) {
    const upf_gguf_arr *a;
    st = upf_gguf_get_arr(g, "tokenizer.ggml.token_type", &a);
    if (st == UPF_OK && (a->type != UPF_GGUF_TYPE_INT32 || a->n < (uint64_t)n))
      st = upf_fail(UPF_ERR_FORMAT, "%s: tokenizer.ggml.token_type is %llu %s for %d tokens (int32 needed)", file,
                    (unsigned long long)a->n, upf_gguf_type_name(a->type), n);
    if (st == UPF_OK)
      memcpy(types, a->data, (size_t)n * sizeof *types);
  }
  if (st == UPF_OK && v.model == UPF_TOKENIZER_BPE) {
    const upf_gguf_arr *a = NULL;
    if (!upf_gguf_kv_find(g, "tokenizer.ggml.merges"))
      st = upf_fail(UPF_ERR_FORMAT, "%s: a gpt2 tokenizer without tokenizer.ggml.merges", file);
    else
      st = upf_gguf_get_arr(g, "tokenizer.ggml.merges", &a);
    if (st == UPF_OK && a->n > 0 && a->type != UPF_GGUF_TYPE_STRING)
      st = upf_fail(UPF_ERR_FORMAT, "%s: tokenizer.ggml.merges is an array of %s, not of strings", file,
                    upf_gguf_type_name(a->type));
    if (st == UPF_OK && a->n > 0 && !(merges = malloc((size_t)a->n * sizeof *merges)))
      st = upf_fail(UPF_ERR_NOMEM, "%s: %llu merges", file, (unsigned long long)a->n);
    for (uint64_t i = 0; st == UPF_OK && i < a->n; i++)
      merges[i] = a->strs[i].ptr;
    if (st == UPF_OK)
      v.n_merges = (int64_t)a->n;
  }
  if (st == UPF_OK) /* llama.cpp's control-looking tokens */
    for (size_t k = 0; k < sizeof eog_texts / sizeof eog_texts[0]; k++)
      for (int32_t i = 0; i < n; i++)
        if (!strcmp(texts[i], eog_texts[k])) {
          types[i] = UPF_TOKEN_CONTROL;
          break;
        }
  if (st == UPF_OK)
    st = get_id(g, "tokenizer.ggml.bos_token_id", n, &v.bos_id, 1);
  if (st == UPF_OK)
    st = get_id(g, "tokenizer.ggml.eos_token_id", n, &v.eos_id, 0);
  if (st == UPF_OK)
    st = get_id(g, "tokenizer.ggml.unknown_token_id", n, &v.unk_id, 0);
  if (st == UPF_OK)
    st = get_id(g, "tokenizer.ggml.padding_token_id", n, &v.pad_id, 0);
  if (st == UPF_OK)
    st = upf_gguf_get_bool_or(g, "tokenizer.ggml.add_bos_token", v.add_bos, &v.add_bos);
  if (st == UPF_OK)
    st = upf_gguf_get_bool_or(g, "tokenizer.ggml.add_eos_token", v.add_eos, &v.add_eos);
  if (st == UPF_OK)
    st = upf_gguf_get_bool_or(g, "tokenizer.ggml.add_space_prefix", v.add_space_prefix, &v.add_space_prefix);
  if (st == UPF_OK) {
    v.tokens = texts, v.scores = scores, v.types = types, v.merges = merges;
    st = upf_tokenizer_create(&v, out);
    if (st != UPF_OK) {
      char ctx[1100];
      snprintf(ctx, sizeof ctx, "%s: ", file);
      upf_fail_context(st, ctx);
    }
  }
  free(texts), free(scores), free(types), free(merges);
  return st;
}

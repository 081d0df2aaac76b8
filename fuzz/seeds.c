/* Writes the seed corpora of the fuzz targets into DIR/<target>/ (`make fuzz-seeds`): small valid
 * inputs made by the library's own writers (.npy, GGUF with tokenizers, model configs and quantised
 * tensors), JSON-lines traces, tokenizer texts and command lines of every command. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "uniprefill/gguf.h"
#include "uniprefill/npy.h"
#include "fuzz/spm_vocab.h"
#include "uniprefill/tokenizer.h"

static const char *root;

static void die(const char *what) {
  fprintf(stderr, "seeds: %s: %s\n", what, upf_last_error());
  exit(1);
}

static void put(const char *target, const char *name, const void *bytes, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", root, target);
  if (mkdir(path, 0755) && errno != EEXIST)
    perror(path), exit(1);
  snprintf(path, sizeof path, "%s/%s/%s", root, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(bytes, 1, n, f) != n || fclose(f))
    perror(path), exit(1);
}

static void npy(const char *name, upf_dtype dt, int ndim, const int64_t *shape) {
  upf_tensor t;
  if (upf_tensor_alloc(&t, dt, ndim, shape) != UPF_OK)
    die(name);
  const int64_t n = upf_tensor_numel(&t);
  for (int64_t i = 0; i < n * (int64_t)upf_dtype_size(dt); i++)
    ((uint8_t *)t.data)[i] = (uint8_t)(i * 37 + 1);
  char *img = NULL;
  size_t size = 0;
  FILE *f = open_memstream(&img, &size);
  if (!f || upf_npy_write_stream(f, name, &t) != UPF_OK)
    die(name);
  fclose(f);
  put("npy", name, img, size);
  free(img);
  upf_tensor_free(&t);
}

static void gguf(const char *name, upf_gguf_writer *w) {
  void *img = NULL;
  uint64_t size = 0;
  if (upf_gguf_writer_to_memory(w, &img, &size) != UPF_OK)
    die(name);
  put("gguf", name, img, (size_t)size);
  free(img);
  upf_gguf_writer_free(w);
}

#define OK(call)                                                                                                       \
  do {                                                                                                                 \
    if ((call) != UPF_OK)                                                                                              \
      die(#call);                                                                                                      \
  } while (0)

static const char *const bpe_toks[] = {"<|endoftext|>", "<|im_start|>", "h", "e", "l", "o", "\xc4\xa0", "w", "r", "d",
                                       "he", "ll", "llo", "hello", "\xc4\xa0w", "or", "\xc4\xa0wor", "ld",
                                       "\xc4\xa0world", "!"};
static const char *const bpe_merges[] = {"h e", "l l", "ll o", "he llo", "\xc4\xa0 w", "o r", "\xc4\xa0w or", "l d",
                                         "\xc4\xa0wor ld"};

static upf_gguf_writer *bpe_writer(const char *arch) {
  upf_gguf_writer *w;
  int32_t types[20];
  for (int i = 0; i < 20; i++)
    types[i] = i < 2 ? UPF_TOKEN_CONTROL : UPF_TOKEN_NORMAL;
  OK(upf_gguf_writer_create(&w));
  OK(upf_gguf_set_str(w, "general.architecture", arch));
  OK(upf_gguf_set_str(w, "tokenizer.ggml.model", "gpt2"));
  OK(upf_gguf_set_str(w, "tokenizer.ggml.pre", "smollm"));
  OK(upf_gguf_set_arr_str(w, "tokenizer.ggml.tokens", bpe_toks, 20));
  OK(upf_gguf_set_arr(w, "tokenizer.ggml.token_type", UPF_GGUF_TYPE_INT32, types, 20));
  OK(upf_gguf_set_arr_str(w, "tokenizer.ggml.merges", bpe_merges, 9));
  OK(upf_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1));
  OK(upf_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 0));
  OK(upf_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", 1));
  return w;
}

/* llama hyper-parameters of a tiny model and its embedding (hidden x vocab, f32) */
static void llama_meta(upf_gguf_writer *w, int32_t hidden, int32_t vocab, upf_ggml_type type) {
  OK(upf_gguf_set_str(w, "general.name", "fuzz-llama"));
  OK(upf_gguf_set_u32(w, "llama.embedding_length", (uint32_t)hidden));
  OK(upf_gguf_set_u32(w, "llama.block_count", 2));
  OK(upf_gguf_set_u32(w, "llama.feed_forward_length", 16));
  OK(upf_gguf_set_u32(w, "llama.attention.head_count", 2));
  OK(upf_gguf_set_u32(w, "llama.attention.head_count_kv", 1));
  OK(upf_gguf_set_u32(w, "llama.context_length", 256));
  OK(upf_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f));
  OK(upf_gguf_set_f32(w, "llama.rope.freq_base", 10000.0f));
  const int64_t ne[2] = {hidden, vocab};
  const uint64_t nbytes = (uint64_t)upf_ggml_row_size(type, hidden) * (uint64_t)vocab;
  uint8_t *data = calloc(nbytes, 1);
  for (uint64_t i = 0; i < nbytes; i++)
    data[i] = (uint8_t)(i % 7 ? 0 : 0x3c);
  OK(upf_gguf_add_tensor(w, "token_embd.weight", type, 2, ne, data, nbytes));
  free(data);
}

static void gguf_seeds(void) {
  gguf("bpe-tokenizer.gguf", bpe_writer("llama"));

  upf_gguf_writer *w = bpe_writer("llama");
  llama_meta(w, 8, 20, UPF_GGML_TYPE_F32);
  gguf("llama-bpe.gguf", w);

  /* SentencePiece: <unk>, <s>, </s>, the 256 byte tokens, a few words with scores */
  enum { NW = 6, N = FUZZ_SPM_FIXED + NW };
  static const char *const words[NW] = {"\xe2\x96\x81", "\xe2\x96\x81hello", "\xe2\x96\x81world", "he", "llo",
                                        "<|im_start|>"};
  char *texts[N];
  int32_t types[N];
  float scores[N];
  fuzz_spm_vocab(words, NW, UPF_TOKEN_USER_DEFINED, texts, types, scores);
  OK(upf_gguf_writer_create(&w));
  OK(upf_gguf_writer_set_version(w, 2));
  OK(upf_gguf_set_str(w, "general.architecture", "llama"));
  OK(upf_gguf_set_str(w, "tokenizer.ggml.model", "llama"));
  OK(upf_gguf_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)texts, N));
  OK(upf_gguf_set_arr(w, "tokenizer.ggml.scores", UPF_GGUF_TYPE_FLOAT32, scores, N));
  OK(upf_gguf_set_arr(w, "tokenizer.ggml.token_type", UPF_GGUF_TYPE_INT32, types, N));
  OK(upf_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1));
  OK(upf_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2));
  OK(upf_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", 0));
  OK(upf_gguf_set_bool(w, "tokenizer.ggml.add_space_prefix", 1));
  llama_meta(w, 8, N, UPF_GGML_TYPE_F16);
  gguf("llama-spm-v2.gguf", w);
  for (int i = 0; i < N; i++)
    free(texts[i]);

  /* gemma3 of the suite's tiny size (the table's 128 x 9), no tokenizer: vocab from vocab_size */
  OK(upf_gguf_writer_create(&w));
  OK(upf_gguf_writer_set_alignment(w, 64));
  OK(upf_gguf_set_str(w, "general.architecture", "gemma3"));
  OK(upf_gguf_set_u32(w, "gemma3.embedding_length", 128));
  OK(upf_gguf_set_u32(w, "gemma3.block_count", 9));
  OK(upf_gguf_set_u32(w, "gemma3.feed_forward_length", 256));
  OK(upf_gguf_set_u32(w, "gemma3.attention.head_count", 4));
  OK(upf_gguf_set_u32(w, "gemma3.attention.head_count_kv", 2));
  OK(upf_gguf_set_u32(w, "gemma3.attention.key_length", 32));
  OK(upf_gguf_set_u32(w, "gemma3.attention.value_length", 32));
  OK(upf_gguf_set_u32(w, "gemma3.attention.sliding_window", 32));
  OK(upf_gguf_set_f32(w, "gemma3.attention.layer_norm_rms_epsilon", 1e-6f));
  OK(upf_gguf_set_f32(w, "gemma3.rope.freq_base", 1e6f));
  OK(upf_gguf_set_str(w, "gemma3.rope.scaling.type", "linear"));
  OK(upf_gguf_set_f32(w, "gemma3.rope.scaling.factor", 8.0f));
  OK(upf_gguf_set_u32(w, "gemma3.vocab_size", 4));
  OK(upf_gguf_set_str(w, "tokenizer.ggml.model", "none"));
  {
    const int64_t ne[2] = {128, 4};
    uint16_t data[512];
    for (int i = 0; i < 512; i++)
      data[i] = (uint16_t)(0x3f80 + (i & 15));
    OK(upf_gguf_add_tensor(w, "token_embd.weight", UPF_GGML_TYPE_BF16, 2, ne, data, sizeof data));
  }
  gguf("gemma3-tiny.gguf", w);

  /* quantised tensors of every dequantisable type (one block row each) and nested arrays */
  OK(upf_gguf_writer_create(&w));
  OK(upf_gguf_set_str(w, "general.architecture", "llama"));
  const uint8_t u8s[3] = {1, 2, 3};
  OK(upf_gguf_set_arr(w, "fuzz.u8s", UPF_GGUF_TYPE_UINT8, u8s, 3));
  OK(upf_gguf_set_f64(w, "fuzz.f64", 0.5));
  OK(upf_gguf_set_i64(w, "fuzz.i64", -5));
  for (int type = 0; type < 64; type++) {
    if (!upf_ggml_can_dequantize((upf_ggml_type)type) || !upf_ggml_type_name((upf_ggml_type)type))
      continue;
    const int64_t ne[1] = {upf_ggml_block_size((upf_ggml_type)type)};
    const int64_t nbytes = upf_ggml_row_size((upf_ggml_type)type, ne[0]);
    uint8_t *data = calloc((size_t)nbytes, 1);
    for (int64_t i = 0; i < nbytes; i++)
      data[i] = (uint8_t)(i * 29 + 3) & 0x3f; /* small scales: finite values */
    char name[64];
    snprintf(name, sizeof name, "t.%s", upf_ggml_type_name((upf_ggml_type)type));
    OK(upf_gguf_add_tensor(w, name, (upf_ggml_type)type, 1, ne, data, (uint64_t)nbytes));
    free(data);
  }
  gguf("quant-types.gguf", w);
}

static void text(const char *target, const char *name, const char *s) { put(target, name, s, strlen(s)); }

/* a tokenizer input: the selector byte (tokenizer, flags, decode flags), then the text */
static void tok(const char *name, uint8_t sel, const char *s) {
  char buf[256];
  buf[0] = (char)sel;
  const size_t n = strlen(s);
  memcpy(buf + 1, s, n);
  put("tokenizer", name, buf, n + 1);
}

/* a command line: the command's index in fuzz_args.c's table, then NUL-separated arguments */
static void args(const char *name, uint8_t cmd, const char *const *argv) {
  char buf[1024];
  size_t n = 0;
  buf[n++] = (char)cmd;
  for (int i = 0; argv[i]; i++) {
    const size_t l = strlen(argv[i]);
    memcpy(buf + n, argv[i], l + 1);
    n += l + 1;
  }
  put("args", name, buf, n - 1);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seeds DIR (writes DIR/<target>/...)\n");
    return 2;
  }
  root = argv[1];
  mkdir(root, 0755);

  npy("f32-2x3.npy", UPF_DTYPE_F32, 2, (const int64_t[]){2, 3});
  npy("bf16-4.npy", UPF_DTYPE_BF16, 1, (const int64_t[]){4});
  npy("i32-cu.npy", UPF_DTYPE_I32, 1, (const int64_t[]){3});
  npy("u8-mask.npy", UPF_DTYPE_U8, 1, (const int64_t[]){5});
  npy("f64-scalar.npy", UPF_DTYPE_F64, 0, NULL);
  npy("i64-3d.npy", UPF_DTYPE_I64, 3, (const int64_t[]){1, 2, 2});
  npy("empty.npy", UPF_DTYPE_F32, 2, (const int64_t[]){0, 3});
  gguf_seeds();

  text("trace", "prompts.jsonl",
       "{\"arrival\": 0, \"prompt\": [1, 2, 3], \"max_new\": 2}\n"
       "{\"arrival\": 0.5, \"prompt_len\": 7, \"seed\": 3, \"id\": 9}\n\n"
       "{\"id\": 4, \"arrival\": 1e-3, \"prompt\": [999], \"max_new\": 1}\n");
  text("trace", "seeded.jsonl", "{\"arrival\":2.5e0,\"prompt_len\":16}\r\n{\"arrival\":0,\"prompt_len\":1,\"max_new\":8}");
  text("trace", "bad-id.jsonl", "{\"arrival\": 0, \"prompt\": [1000]}\n");

  tok("bpe-hello.txt", 0x00, "hello world! <|im_start|>hello 123");
  tok("smollm-digits.txt", 0x05, "The 12345 caf\xc3\xa9's \t\n  x \xf0\x9f\x98\x80 'll");
  tok("spm-hello.txt", 0x02, "hello world \xe2\x96\x81 \xff\xfe <s> x");
  tok("spm-special.txt", 0x36, "<|im_start|>hello</s>");

  args("select.args", 0, (const char *const[]){"--q", "q.npy", "--k", "k.npy", "--cu-seqlens", "cu.npy", "--out-mask",
                                               "m.npy", "--p", "0.9", "--block", "64", "--topk=4", NULL});
  args("verify.args", 1, (const char *const[]){"select", "--backend", "cpu", "--quick", "--variant", "select=a", NULL});
  args("report.args", 2, (const char *const[]){"--compare", "a.json", "b.json", "--threshold", "5%", NULL});
  args("prefill.args", 5, (const char *const[]){"--model", "llama-tiny", "--lengths", "64,32", "--mode", "uniprefill",
                                                "--p", "0.95", "--json", "r.json", NULL});
  args("export.args", 6, (const char *const[]){"--model", "llama-tiny", "--out", "x.gguf", "--seed", "3", NULL});
  args("serve.args", 7, (const char *const[]){"--model", "llama-tiny", "--requests", "4", "--prompt-len", "8..16",
                                              "--rate", "2.5", "--kv-gib", "0.5", "--json", "s.json", NULL});
  args("generate.args", 8, (const char *const[]){"--gguf", "m.gguf", "--text", "hi", "--max-new", "4", "--chunk",
                                                 "8", NULL});
  args("eval.args", 9, (const char *const[]){"--model", "llama-tiny", "--task", "needle", "--tokens", "256,512",
                                             "--depths", "0.5", "--trials", "2", NULL});
  args("tokenize.args", 10, (const char *const[]){"--gguf", "m.gguf", "--text", "hello", "--no-bos", NULL});
  args("block-sparse.args", 11, (const char *const[]){"--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--cu-seqlens",
                                                     "cu.npy", "--out", "o.npy", "--alpha", "0.3", NULL});
  return 0;
}

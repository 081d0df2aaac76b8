/* `upf tokenize`: a GGUF file's tokenizer on a text (printing the count and the ids, optionally writing
 * them as .npy), or on ids (printing their text). Every input is read and checked before any output
 * is written, and the .npy is written whole or not at all. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "uniprefill/gguf.h"
#include "uniprefill/npy.h"
#include "uniprefill/tokenizer.h"

const char upf_cli_tokenize_usage[] =
    "usage: upf tokenize --gguf FILE (--text STR | --file F) [--out IDS.npy] [--no-bos] [--no-parse-special]\n"
    "       upf tokenize --gguf FILE --decode IDS.npy\n"
    "  Tokenizes text with the tokenizer of a GGUF model (byte-level BPE or SentencePiece, as llama.cpp\n"
    "  does) and prints the count and the ids; --out writes them as <i4 (T,).\n"
    "  The model's default BOS is added unless --no-bos; special tokens written in the text\n"
    "  (\"<|im_start|>\") become their ids unless --no-parse-special.\n"
    "  --decode prints the text of the ids of IDS.npy (<i4 or <i8, one dimension), specials rendered.\n";

static int decode_ids(const upf_tokenizer *tok, const char *path) {
  upf_tensor t = {0};
  upf_status st = upf_npy_read(path, &t);
  if (st != UPF_OK)
    return upf_cli_error(st, "tokenize: --decode");
  if (t.ndim != 1 || (t.dtype != UPF_DTYPE_I32 && t.dtype != UPF_DTYPE_I64)) {
    char shape[64];
    fprintf(stderr, "upf tokenize: --decode %s: want <i4 or <i8 ids of one dimension, got %s %s\n", path,
            upf_dtype_name(t.dtype), upf_tensor_shape_str(&t, shape, sizeof shape));
    upf_tensor_free(&t);
    return 1;
  }
  int64_t n = t.shape[0];
  int32_t *ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
  if (!ids) {
    upf_tensor_free(&t);
    return upf_cli_error(upf_fail(UPF_ERR_NOMEM, "%lld ids", (long long)n), "tokenize: --decode");
  }
  const int32_t vocab = upf_tokenizer_n_tokens(tok);
  for (int64_t i = 0; i < n; i++) {
    const int64_t v = t.dtype == UPF_DTYPE_I32 ? ((const int32_t *)t.data)[i] : ((const int64_t *)t.data)[i];
    /* the value as given: a wide id narrowed first would be reported as another number */
    if (v < 0 || v >= vocab) {
      fprintf(stderr, "upf tokenize: --decode %s: ids[%lld] = %lld is outside the vocabulary [0, %d)\n", path,
              (long long)i, (long long)v, vocab);
      free(ids);
      upf_tensor_free(&t);
      return 1;
    }
    ids[i] = (int32_t)v;
  }
  upf_tensor_free(&t);
  char *text = NULL;
  int64_t len = 0;
  st = upf_tokenizer_decode(tok, ids, n, UPF_DETOKENIZE_RENDER_SPECIAL, &text, &len);
  free(ids);
  if (st != UPF_OK) {
    char what[1100];
    snprintf(what, sizeof what, "tokenize: --decode %s", path);
    return upf_cli_error(st, what);
  }
  fwrite(text, 1, (size_t)len, stdout);
  free(text);
  return fflush(stdout) ? 1 : 0;
}

static upf_status write_ids(const char *path, const upf_tensor *t) {
  upf_outputs *o;
  UPF_TRY(upf_outputs_create(&o, 1));
  upf_status st = upf_npy_write_to(o, path, "--out", t);
  if (st == UPF_OK)
    st = upf_outputs_commit(o);
  upf_outputs_free(o);
  return st;
}

int upf_cli_tokenize(int argc, char **argv) {
  const char *gguf = NULL, *text_arg = NULL, *file = NULL, *out = NULL, *decode = NULL;
  int no_bos = 0, no_parse_special = 0;
  upf_arg args[] = {
      {"--gguf", UPF_ARG_STRING, &gguf, 1},   {"--text", UPF_ARG_STRING, &text_arg},
      {"--file", UPF_ARG_STRING, &file},      {"--out", UPF_ARG_STRING, &out},
      {"--decode", UPF_ARG_STRING, &decode},  {"--no-bos", UPF_ARG_SWITCH, &no_bos},
      {"--no-parse-special", UPF_ARG_SWITCH, &no_parse_special},
  };
  upf_arg_parser p = {"upf tokenize", upf_cli_tokenize_usage, args, (int)(sizeof args / sizeof *args), NULL, 0, 0};
  const upf_args_result pr = upf_args_parse(&p, argc, argv);
  if (pr != UPF_ARGS_OK)
    return upf_args_exit_code(pr);
  if (!!text_arg + !!file + !!decode != 1) {
    fprintf(stderr, "upf tokenize: give exactly one of --text, --file and --decode\n");
    return 2;
  }
  if (decode && (out || no_bos || no_parse_special)) {
    fprintf(stderr, "upf tokenize: --decode takes no --out, --no-bos or --no-parse-special\n");
    return 2;
  }
  const upf_arg_path paths[] = {{"--gguf", gguf, 0}, {"--file", file, 0}, {"--decode", decode, 0}, {"--out", out, 1}};
  if (!upf_args_check_paths("upf tokenize", paths, 4))
    return 2;

  upf_gguf *g = NULL;
  upf_status st = upf_gguf_open(gguf, &g);
  if (st != UPF_OK)
    return upf_cli_error(st, "tokenize: --gguf");
  upf_tokenizer *tok = NULL;
  st = upf_tokenizer_from_gguf(g, &tok);
  upf_gguf_close(g);
  if (st != UPF_OK)
    return upf_cli_error(st, "tokenize: --gguf");
  if (decode) {
    int rc = decode_ids(tok, decode);
    upf_tokenizer_free(tok);
    return rc;
  }

  char *owned = NULL;
  const char *text = text_arg;
  int64_t len = text_arg ? (int64_t)strlen(text_arg) : 0;
  if (file && !upf_args_read_file("upf tokenize", "--file", file, &owned, &len)) {
    upf_tokenizer_free(tok);
    return 1;
  }
  if (file)
    text = owned;
  int flags = (no_bos ? 0 : UPF_TOKENIZE_ADD_SPECIAL) | (no_parse_special ? 0 : UPF_TOKENIZE_PARSE_SPECIAL);
  int32_t *ids = NULL;
  int64_t n = 0;
  st = upf_tokenizer_encode(tok, text, len, flags, &ids, &n);
  free(owned);
  upf_tokenizer_free(tok);
  if (st != UPF_OK) {
    char what[1100];
    snprintf(what, sizeof what, "tokenize: %s %s", file ? "--file" : "--text", file ? file : "");
    return upf_cli_error(st, what);
  }
  if (out) {
    upf_tensor t;
    int64_t shape[1] = {n};
    int32_t none = 0;
    st = upf_tensor_init(&t, n ? (void *)ids : (void *)&none, UPF_DTYPE_I32, 1, shape);
    if (st == UPF_OK)
      st = write_ids(out, &t);
    if (st != UPF_OK) {
      free(ids);
      return upf_cli_error(st, "tokenize");
    }
  }
  printf("count: %lld\nids:", (long long)n);
  for (int64_t i = 0; i < n; i++)
    printf(" %d", ids[i]);
  printf("\n");
  free(ids);
  return fflush(stdout) ? 1 : 0;
}

/* The model selection every model-building command shares (cli/model_args.h). */
#include "cli/model_args.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "uniprefill/tokenizer.h"

/* "A:B" into [a, b); 0 on a malformed range. */
static int parse_range(const char *s, int32_t n, int32_t *a, int32_t *b) {
  char *end;
  long x = strtol(s, &end, 10);
  if (end == s || *end != ':')
    return 0;
  const char *s2 = end + 1;
  long y = strtol(s2, &end, 10);
  if (end == s2 || *end)
    return 0;
  *a = (int32_t)x, *b = (int32_t)y;
  return x >= 0 && y <= n && x < y;
}

int upf_model_args_resolve(const char *command, upf_model_args *ma) {
  char what[64];
  if (!ma->model == !ma->gguf) {
    fprintf(stderr, "upf %s: give exactly one of --model (a built-in model) and --gguf (a model file)\n", command);
    return 2;
  }
  if (ma->gguf) {
    snprintf(what, sizeof what, "%s: --gguf", command);
    upf_gguf *file = NULL;
    upf_status st = upf_gguf_open(ma->gguf, &file);
    if (st == UPF_OK)
      st = upf_model_config_from_gguf(file, &ma->file_cfg);
    upf_gguf_close(file);
    if (st != UPF_OK)
      return upf_cli_error(st, what);
    ma->cfg = &ma->file_cfg.cfg;
  } else {
    snprintf(what, sizeof what, "%s: --model", command);
    if (!(ma->cfg = upf_model_config_by_name(ma->model)))
      return upf_cli_error(UPF_ERR_INVALID_ARG, what);
  }
  if (upf_dtype_parse(ma->dtype, &ma->dt) != UPF_OK || (ma->dt != UPF_DTYPE_F32 && ma->dt != UPF_DTYPE_BF16)) {
    fprintf(stderr, "upf %s: --dtype '%s': want f32 or bf16\n", command, ma->dtype);
    return 2;
  }
  const int32_t n = ma->cfg->num_layers;
  ma->layer_begin = 0, ma->layer_end = n;
  if (ma->layers && !parse_range(ma->layers, n, &ma->layer_begin, &ma->layer_end)) {
    fprintf(stderr, "upf %s: --layers '%s': want A:B with 0 <= A < B <= %d\n", command, ma->layers, n);
    return 2;
  }
  snprintf(what, sizeof what, "%s: --backend", command);
  ma->be = ma->backend ? upf_backend_by_name(ma->backend) : upf_cli_default_backend();
  if (!ma->be)
    return upf_cli_error(UPF_ERR_INVALID_ARG, what);
  const upf_status st = ma->be->probe();
  return st == UPF_OK ? 0 : upf_cli_error(st, what);
}

int upf_model_args_partial(const upf_model_args *ma) {
  return ma->layer_begin > 0 || ma->layer_end < ma->cfg->num_layers;
}

upf_status upf_model_args_build(const char *command, const upf_model_args *ma, upf_model *m) {
  return upf_model_args_build_tp(command, ma, NULL, 1, m);
}

upf_status upf_model_args_build_tp(const char *command, const upf_model_args *ma, upf_comm *comm, int rank0,
                                   upf_model *m) {
  if (upf_model_args_partial(ma) && rank0)
    fprintf(stderr, "upf %s: layers %d:%d of %s's %d (a partial model)\n", command, ma->layer_begin, ma->layer_end,
            ma->cfg->name, ma->cfg->num_layers);
  if (!ma->gguf)
    return comm ? upf_model_init_seeded_tp(m, ma->cfg, ma->be, ma->dt, (uint64_t)ma->seed, ma->layer_begin,
                                           ma->layer_end, comm)
                : upf_model_init_seeded(m, ma->cfg, ma->be, ma->dt, (uint64_t)ma->seed, ma->layer_begin, ma->layer_end);
  if (comm)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: --gguf %s: tensor parallelism runs seeded models only (a file's weights "
                    "are not sliced)", command, ma->gguf);
  /* the file was read at resolve time; it is mapped again for the weights */
  upf_gguf *file = NULL;
  upf_status st = upf_gguf_open(ma->gguf, &file);
  if (st == UPF_OK)
    st = upf_model_load_gguf(m, file, ma->cfg, ma->be, ma->dt, ma->layer_begin, ma->layer_end);
  upf_gguf_close(file);
  return st;
}

int upf_model_args_encode(const char *command, const upf_model_args *ma, const char *text, const char *file,
                          int32_t **ids, int64_t *n) {
  const char *flag = text ? "--text" : "--file";
  if (!ma->gguf) {
    fprintf(stderr, "upf %s: %s needs --gguf FILE: the tokenizer comes from the model file (--model %s has none; "
                    "give --token-ids)\n", command, flag, ma->model ? ma->model : "");
    return 2;
  }
  char cmd[64];
  snprintf(cmd, sizeof cmd, "upf %s", command);
  char *owned = NULL;
  int64_t len = text ? (int64_t)strlen(text) : 0;
  if (!text && !upf_args_read_file(cmd, "--file", file, &owned, &len))
    return 2;
  upf_gguf *g = NULL;
  upf_tokenizer *tok = NULL;
  upf_status st = upf_gguf_open(ma->gguf, &g);
  if (st == UPF_OK)
    st = upf_tokenizer_from_gguf(g, &tok);
  char what[96];
  snprintf(what, sizeof what, "%s: --gguf (its tokenizer)", command);
  if (st != UPF_OK) {
    free(owned), upf_gguf_close(g);
    return upf_cli_error(st, what);
  }
  st = upf_tokenizer_encode(tok, text ? text : owned, len, UPF_TOKENIZE_ADD_SPECIAL | UPF_TOKENIZE_PARSE_SPECIAL, ids,
                            n);
  free(owned), upf_tokenizer_free(tok), upf_gguf_close(g);
  snprintf(what, sizeof what, "%s: %s", command, flag);
  if (st != UPF_OK)
    return upf_cli_error(st, what);
  if (*n < 1 || *n > INT32_MAX) {
    fprintf(stderr, "upf %s: %s: the text gives %lld tokens: want 1 to 2^31-1\n", command, flag, (long long)*n);
    free(*ids), *ids = NULL;
    return 2;
  }
  return 0;
}

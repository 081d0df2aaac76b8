/* The model selection every model-building command shares (cli/model_args.h). */
#include "cli/model_args.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "uniprefill/npy.h"
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
      return upf_cli_error(UPF_ERR_INVALID_ARG, what), 2;
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
  if (ma->shared_weights && ma->gguf) {
    fprintf(stderr, "upf %s: --shared-weights needs --model (a seeded model); --gguf %s has its own weights\n", command,
            ma->gguf);
    return 2;
  }
  snprintf(what, sizeof what, "%s: --backend", command);
  ma->be = ma->backend ? upf_backend_by_name(ma->backend) : upf_cli_default_backend();
  if (!ma->be) /* a malformed value, as a bad number is: 2; a backend that cannot run here is 1 */
    return upf_cli_error(UPF_ERR_INVALID_ARG, what), 2;
  const upf_status st = ma->be->probe();
  return st == UPF_OK ? 0 : upf_cli_error(st, what);
}

int upf_model_args_check_seed(const char *command, const upf_model_args *ma, int seed_given, const char *why) {
  if (!seed_given || !why)
    return 1;
  fprintf(stderr, "upf %s: --seed %d means nothing here: %s; leave it out\n", command, ma->seed, why);
  return 0;
}

int upf_model_args_check_context(const char *command, const upf_model_args *ma, const char *flag, const int32_t *cu,
                                 int32_t B, int64_t extra) {
  const int64_t ctx = ma->cfg->context_length;
  if (ctx <= 0)
    return 1;
  for (int32_t r = 0; r < B; r++) {
    const int64_t need = (int64_t)cu[r + 1] - cu[r] + extra;
    if (need <= ctx)
      continue;
    if (ma->allow_over_context) {
      fprintf(stderr, "upf %s: request %d runs %lld positions, past the context_length %lld of %s "
                      "(--allow-over-context: the model is used beyond what it was trained for)\n",
              command, r, (long long)need, (long long)ctx, ma->gguf ? ma->gguf : ma->cfg->name);
      return 1;
    }
    fprintf(stderr, "upf %s: %s: request %d runs %lld positions (%lld tokens%s), past the context_length %lld "
                    "that %s states; shorten it, or pass --allow-over-context to run it anyway\n",
            command, flag, r, (long long)need, (long long)(cu[r + 1] - cu[r]), extra ? " plus the new ones" : "",
            (long long)ctx, ma->gguf ? ma->gguf : ma->cfg->name);
    return 0;
  }
  return 1;
}

int upf_model_args_partial(const upf_model_args *ma) {
  return ma->layer_begin > 0 || ma->layer_end < ma->cfg->num_layers;
}

const char *upf_model_args_label(const upf_model_args *ma) {
  const int partial = upf_model_args_partial(ma);
  return partial && ma->shared_weights ? " (partial model, shared weights)"
         : partial                     ? " (partial model)"
         : ma->shared_weights          ? " (shared weights)"
                                       : "";
}

upf_status upf_model_args_build(const char *command, const upf_model_args *ma, upf_model *m) {
  return upf_model_args_build_tp(command, ma, NULL, 1, m);
}

upf_status upf_model_args_build_tp(const char *command, const upf_model_args *ma, upf_comm *comm, int rank0,
                                   upf_model *m) {
  if (upf_model_args_partial(ma) && rank0)
    fprintf(stderr, "upf %s: layers %d:%d of %s's %d (a partial model)\n", command, ma->layer_begin, ma->layer_end,
            ma->cfg->name, ma->cfg->num_layers);
  upf_weight_bytes distinct;
  if (ma->shared_weights && rank0 &&
      upf_model_config_weight_bytes(ma->cfg, ma->layer_begin, ma->layer_end, &distinct) == UPF_OK)
    fprintf(stderr, "upf %s: every layer of one kind runs on the weights of the first layer of its kind (--shared-weights: "
                    "real shapes, routing and KV sizes, not the model's values; a timing mode). The distinct weights "
                    "of these layers would take %.2f GiB in bf16, %.2f GiB in FP8 (E4M3 projections with per-channel "
                    "f32 scales; embedding, head, routers, conv and norms bf16)\n",
            command, distinct.bf16 / (1 << 30), distinct.fp8_e4m3 / (1 << 30));
  if (ma->shared_weights && comm)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: --shared-weights with tensor parallelism: the slices are not shared",
                    command);
  if (ma->shared_weights)
    return upf_model_init_seeded_shared(m, ma->cfg, ma->be, ma->dt, (uint64_t)ma->seed, ma->layer_begin,
                                        ma->layer_end);
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

/* Reads the ids and the cu_seqlens files: 0 after the message on bad input. */
static int read_ids(const char *command, const char *ids_path, const char *cu_path, int32_t **ids, int32_t **cu,
                    int32_t *B) {
  char what[1100];
  upf_tensor t_ids = {0}, t_cu = {0};
  snprintf(what, sizeof what, "%s: --token-ids", command);
  upf_status st = upf_npy_read(ids_path, &t_ids);
  if (st != UPF_OK)
    return upf_cli_error(st, what), 0;
  *ids = t_ids.data;
  if (t_ids.dtype != UPF_DTYPE_I32 || t_ids.ndim != 1 || t_ids.shape[0] < 1 || t_ids.shape[0] > INT32_MAX) {
    fprintf(stderr, "upf %s: --token-ids %s: want <i4 (T,) with 1 <= T < 2^31, got %s with %d dims\n", command,
            ids_path, upf_dtype_name(t_ids.dtype), t_ids.ndim);
    return 0;
  }
  const int64_t T = t_ids.shape[0];
  if (!cu_path) {
    if (!(*cu = malloc(2 * sizeof **cu)))
      return upf_cli_error(upf_fail(UPF_ERR_NOMEM, "cu_seqlens"), command), 0;
    (*cu)[0] = 0, (*cu)[1] = (int32_t)T, *B = 1;
    return 1;
  }
  snprintf(what, sizeof what, "%s: --cu-seqlens", command);
  st = upf_npy_read(cu_path, &t_cu);
  if (st != UPF_OK)
    return upf_cli_error(st, what), 0;
  *cu = t_cu.data;
  if (t_cu.dtype != UPF_DTYPE_I32 || t_cu.ndim != 1 || t_cu.shape[0] < 2 || t_cu.shape[0] > INT32_MAX) {
    fprintf(stderr, "upf %s: --cu-seqlens %s: want <i4 (B+1,) with B >= 1, got %s with %d dims\n", command, cu_path,
            upf_dtype_name(t_cu.dtype), t_cu.ndim);
    return 0;
  }
  *B = (int32_t)(t_cu.shape[0] - 1);
  /* said in the command's words: the library's check speaks of an op's q/k */
  if ((*cu)[*B] != T) {
    fprintf(stderr, "upf %s: --cu-seqlens %s: its last entry (cu[%d] = %d) must be the %lld tokens of --token-ids %s\n",
            command, cu_path, *B, (*cu)[*B], (long long)T, ids_path);
    return 0;
  }
  st = upf_cu_seqlens_check(*cu, *B, T);
  snprintf(what, sizeof what, "%s: --cu-seqlens %s", command, cu_path);
  if (st != UPF_OK)
    return upf_cli_error(st, what), 0;
  for (int32_t r = 0; r < *B; r++)
    if ((*cu)[r + 1] == (*cu)[r]) {
      fprintf(stderr, "upf %s: --cu-seqlens %s: request %d has no tokens\n", command, cu_path, r);
      return 0;
    }
  return 1;
}

int upf_model_args_batch(const char *command, const upf_model_args *ma, const char *ids_path, const char *cu_path,
                         const char *text, const char *file, int32_t **ids, int32_t **cu, int32_t *B) {
  *ids = NULL, *cu = NULL;
  int ok;
  if (text || file) { /* one request: the text through the file's tokenizer */
    int64_t n = 0;
    ok = !upf_model_args_encode(command, ma, text, file, ids, &n);
    if (ok && !(*cu = malloc(2 * sizeof **cu)))
      ok = 0, upf_cli_error(upf_fail(UPF_ERR_NOMEM, "cu_seqlens"), command);
    if (ok)
      (*cu)[0] = 0, (*cu)[1] = (int32_t)n, *B = 1;
  } else
    ok = read_ids(command, ids_path, cu_path, ids, cu, B);
  const upf_model_config *cfg = ma->cfg;
  for (int32_t t = 0; ok && t < (*cu)[*B]; t++)
    if ((*ids)[t] < 0 || (*ids)[t] >= cfg->vocab) {
      fprintf(stderr, "upf %s: %s %s: id %d at %d is outside the vocabulary [0, %d) of %s\n", command,
              ids_path ? "--token-ids" : text ? "--text" : "--file", ids_path ? ids_path : "(tokenised)", (*ids)[t], t,
              cfg->vocab, cfg->name);
      ok = 0;
    }
  if (!ok) {
    free(*ids), free(*cu);
    *ids = NULL, *cu = NULL;
  }
  return ok;
}

/* ---- FlashPrefill's flags ---- */

static int seen(const upf_arg_parser *p, const char *flag) {
  const upf_arg *a = upf_args_find(p, flag);
  return a && a->seen;
}

int upf_sparse_args_resolve(const char *command, const upf_arg_parser *p, int flashprefill, upf_sparse_args *fa) {
  static const char *const flags[] = {"--alpha", "--block-n", "--mean-correction", "--sink", "--window", "--last-n"};
  for (size_t i = 0; !flashprefill && i < sizeof flags / sizeof *flags; i++)
    if (seen(p, flags[i])) {
      fprintf(stderr, "upf %s: %s needs --mode flashprefill or compact\n", command, flags[i]);
      return 2;
    }
  const int compact = flashprefill == 2;
  if (compact && seen(p, "--last-n")) {
    fprintf(stderr, "upf %s: --last-n needs --mode flashprefill (compact's selector runs last_n 0: dense last tiles "
                    "would make the union dense)\n", command);
    return 2;
  }
  if (!compact && seen(p, "--recent")) {
    fprintf(stderr, "upf %s: --recent needs --mode compact\n", command);
    return 2;
  }
  fa->compact = upf_compact_params_default();
  if (seen(p, "--recent")) {
    if (fa->recent < 0) {
      fprintf(stderr, "upf %s: --recent %d: want >= 0 (key blocks before the chunk always kept)\n", command, fa->recent);
      return 2;
    }
    fa->compact.recent = fa->recent;
  }
  upf_sparse_params sp = upf_prefill_sparse_default();
  if (compact)
    sp.last_n = 0;
  const upf_arg *alpha = upf_args_find(p, "--alpha");
  if (alpha && alpha->seen && alpha->kind == UPF_ARG_FLOAT) {
    if (!(fa->alpha >= 0.0f && fa->alpha <= 1.0f)) {
      fprintf(stderr, "upf %s: --alpha %g: want a value in [0, 1] (0 keeps every block; larger is sparser)\n", command,
              (double)fa->alpha);
      return 2;
    }
    sp.alpha = fa->alpha;
  }
  if (seen(p, "--block-n")) {
    if (fa->block_n != 64 && fa->block_n != 128) {
      fprintf(stderr, "upf %s: --block-n %d: want 64 or 128 (keys a block)\n", command, fa->block_n);
      return 2;
    }
    sp.block_n = fa->block_n;
  }
  if (seen(p, "--mean-correction")) {
    if (strcmp(fa->mean_correction, "on") && strcmp(fa->mean_correction, "off")) {
      fprintf(stderr, "upf %s: --mean-correction '%s': want on or off\n", command, fa->mean_correction);
      return 2;
    }
    sp.mean_correction = !strcmp(fa->mean_correction, "on");
  }
  const struct {
    const char *flag;
    int32_t value, min;
    int32_t *dest;
    const char *what;
  } counts[] = {{"--sink", fa->sink, 0, &sp.sink, "leading key blocks always kept"},
                {"--window", fa->window, 1, &sp.window, "key blocks always kept up to the diagonal"},
                {"--last-n", fa->last_n, 0, &sp.last_n, "last query tiles of a request kept dense"}};
  for (size_t i = 0; i < sizeof counts / sizeof *counts; i++)
    if (seen(p, counts[i].flag)) {
      if (counts[i].value < counts[i].min) {
        fprintf(stderr, "upf %s: %s %d: want >= %d (%s)\n", command, counts[i].flag, counts[i].value, counts[i].min,
                counts[i].what);
        return 2;
      }
      *counts[i].dest = counts[i].value;
    }
  if (upf_sparse_params_check(&sp) != UPF_OK) /* the flags above cover every rule; kept in step with it */
    return upf_cli_error(UPF_ERR_INVALID_ARG, command), 2;
  fa->params = sp;
  return 0;
}

int upf_mode_args_resolve(const char *command, const upf_arg_parser *p, upf_select_args *sa, upf_sparse_args *fa) {
  const char *mode = sa->mode;
  const int compact = !strcmp(mode, "compact");
  const int flash = !strcmp(mode, "flashprefill") || compact;
  if (!flash && strcmp(mode, "dense") && strcmp(mode, "uniprefill")) {
    fprintf(stderr, "upf %s: --mode '%s': want dense, uniprefill or flashprefill (or compact, with --chunk)\n", command,
            mode);
    return 2;
  }
  if (flash && (seen(p, "--p") || seen(p, "--keep"))) {
    fprintf(stderr, "upf %s: --p and --keep need --mode uniprefill (%s drops no token: --alpha sets its "
                    "sparsity)\n", command, mode);
    return 2;
  }
  /* the selection's own rules; flashprefill, which takes none of its flags, passes them as dense */
  sa->mode = flash ? "dense" : mode;
  const int rc = upf_select_args_resolve(command, p, sa);
  sa->mode = mode;
  if (rc)
    return rc;
  if (flash)
    sa->prefill_mode = compact ? UPF_PREFILL_COMPACT : UPF_PREFILL_FLASHPREFILL;
  return upf_sparse_args_resolve(command, p, compact ? 2 : flash, fa);
}

void upf_sparse_args_describe(const upf_sparse_params *p, char *buf, size_t size) {
  snprintf(buf, size, "alpha %g, block_m %d, block_n %d, sink %d, window %d, last_n %d, mean correction %s",
           (double)p->alpha, p->block_m, p->block_n, p->sink, p->window, p->last_n, p->mean_correction ? "on" : "off");
}

void upf_sparse_args_json(FILE *f, const upf_sparse_params *p) {
  fprintf(f, "{\"alpha\": %g, \"block_m\": %d, \"block_n\": %d, \"sink\": %d, \"window\": %d, \"last_n\": %d, "
             "\"min_sparse_q_len\": %d, \"mean_correction\": %s}",
          (double)p->alpha, p->block_m, p->block_n, p->sink, p->window, p->last_n, p->min_sparse_q_len,
          p->mean_correction ? "true" : "false");
}

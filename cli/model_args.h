/* The model a command runs, selected alike by every command that builds one (upf prefill, upf
 * generate, ...): --model NAME (a built-in config, upf models) or --gguf FILE (the llama or gemma3
 * model of a GGUF file, its weights dequantised to --dtype), --seed S (seeded weights and, where a
 * command draws them, its ids), --dtype f32|bf16, --backend cpu|cuda (default: cuda when usable) and
 * --layers A:B (a partial model) and --shared-weights (a seeded model whose layers of one mixer kind share
 * one layer's weights: the full depth of a model too large for the device, for timing). A command puts UPF_MODEL_ARG_FLAGS in its flag table, resolves them before
 * any work and builds the model once its other inputs are checked. */
#ifndef UNIPREFILL_CLI_MODEL_ARGS_H
#define UNIPREFILL_CLI_MODEL_ARGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cli/args.h"
#include "cli/select_args.h"
#include "uniprefill/model.h"

typedef struct {
  /* the flags' values */
  const char *model, *gguf, *dtype, *backend, *layers;
  int32_t seed;
  int allow_over_context; /* --allow-over-context: run requests past the model's context_length */
  int shared_weights; /* --shared-weights: one layer's weights per mixer kind (upf_model_init_seeded_shared) */
  /* set by upf_model_args_resolve */
  const upf_model_config *cfg; /* the built-in config, or file_cfg.cfg */
  upf_gguf_model_config file_cfg; /* --gguf: the file's config (ma must not move after resolve) */
  upf_dtype dt;
  const upf_backend *be;
  int32_t layer_begin, layer_end; /* [begin, end) of cfg's layers */
} upf_model_args;

/* bf16, seed 1, the default backend, every layer. */
#define UPF_MODEL_ARGS_DEFAULT {.dtype = "bf16", .seed = 1}

/* The entries of a command's upf_arg table (ma an lvalue of type upf_model_args). */
#define UPF_MODEL_ARG_FLAGS(ma)                                                                    \
  {"--model", UPF_ARG_STRING, &(ma).model}, {"--gguf", UPF_ARG_STRING, &(ma).gguf},                \
      {"--seed", UPF_ARG_INT, &(ma).seed, 0, 0, INT32_MAX}, \
      {"--dtype", UPF_ARG_STRING, &(ma).dtype}, {"--backend", UPF_ARG_STRING, &(ma).backend},        \
      {"--layers", UPF_ARG_STRING, &(ma).layers}, {"--allow-over-context", UPF_ARG_SWITCH, &(ma).allow_over_context}, {"--shared-weights", UPF_ARG_SWITCH, &(ma).shared_weights}

/* Resolves the flags of `command` ("prefill"): exactly one of --model and --gguf (the file's config is
 * read and its tensor directory checked now), the config, the dtype, the layer range and the backend
 * (probed). Returns 0 when all is well, else the exit code after one line on stderr naming the flag
 * at fault (1 for a backend that cannot run here or a file that cannot be read, 2 for a malformed value or
 * an unknown name). */
int upf_model_args_resolve(const char *command, upf_model_args *ma);

/* --seed given (seed_given) where it would change nothing: why, when not NULL, says so ("the weights
 * are --gguf's and the ids are given"). 0 after one line on stderr naming the command and the flag
 * (exit 2), else 1. */
int upf_model_args_check_seed(const char *command, const upf_model_args *ma, int seed_given, const char *why);

/* Builds the resolved model (seeded weights, or the file's weights) on its backend; a partial model says so on stderr. */
upf_status upf_model_args_build(const char *command, const upf_model_args *ma, upf_model *m);

/* The same for one rank of a tensor-parallel group (comm NULL: upf_model_args_build); only rank0 prints.
 * A GGUF model is not sliced for tensor parallelism: --gguf with a communicator is refused. */
upf_status upf_model_args_build_tp(const char *command, const upf_model_args *ma, upf_comm *comm, int rank0,
                                   upf_model *m);

/* The prompt as text (--text STR, or --file F when text is NULL), encoded by the --gguf file's tokenizer
 * with the model's default special tokens (its BOS) and special tokens written in the text parsed as
 * tokens, as llama.cpp's tools do. 0 with ids (malloc'd, n of them, n >= 1), else the exit code after
 * one line on stderr naming the flag at fault (a built-in model has no tokenizer). */
int upf_model_args_encode(const char *command, const upf_model_args *ma, const char *text, const char *file,
                          int32_t **ids, int64_t *n);

/* The requests of a command's prompt, checked against the resolved model: --text STR or --file F (one
 * request, through upf_model_args_encode), else --token-ids IDS <i4 (T,) and --cu-seqlens CU <i4 (B+1,)
 * (one request when cu_path is NULL); every id within the model's vocabulary and no request empty.
 * 1 with ids (T) and cu (B+1) malloc'd and B set, else 0 after one line on stderr naming the flag at
 * fault, with *ids and *cu NULL. */
int upf_model_args_batch(const char *command, const upf_model_args *ma, const char *ids_path, const char *cu_path,
                         const char *text, const char *file, int32_t **ids, int32_t **cu, int32_t *B);

/* Each request of the batch (cu, B requests), plus `extra` positions a command adds to it (generated
 * tokens), against the model's context_length (the positions it was trained for; a GGUF states it):
 * 1 when within, or when none is stated, or with --allow-over-context (then a note on stderr); else 0
 * after one line on stderr naming the request, the source flag and the override. */
int upf_model_args_check_context(const char *command, const upf_model_args *ma, const char *flag, const int32_t *cu,
                                 int32_t B, int64_t extra);

/* 1 when the layer range is not the whole model. */
int upf_model_args_partial(const upf_model_args *ma);
/* What every output says of such a model: "" for the whole model with its own weights, else
 * " (partial model)", " (shared weights)" or both. */
const char *upf_model_args_label(const upf_model_args *ma);

/* ---- FlashPrefill's flags (--mode flashprefill), shared by prefill, eval, generate and serve-sim ----
 * --alpha A in [0, 1], --block-n 64|128, --mean-correction on|off, --sink S >= 0, --window W >= 1 and
 * --last-n N >= 0 (blocks, blocks, query tiles); each flag not given keeps the model default
 * (upf_prefill_sparse_default: the published values, alpha 0.18 at block_n 128). */
typedef struct {
  /* the flags' values (eval takes --alpha as a list of its own) */
  float alpha;
  int32_t block_n, sink, window, last_n;
  const char *mean_correction;
  int32_t recent; /* --recent (--mode compact) */
  /* set by upf_sparse_args_resolve */
  upf_sparse_params params;
  upf_compact_params compact; /* --mode compact: the union's recent blocks (default 2) */
} upf_sparse_args;

#define UPF_SPARSE_ARGS_DEFAULT {.alpha = -1.0f}

/* The entries of a command's upf_arg table: every flag but --alpha, then --alpha as one value. */
#define UPF_SPARSE_SHAPE_ARG_FLAGS(fa)                                                                         \
  {"--block-n", UPF_ARG_INT, &(fa).block_n}, {"--mean-correction", UPF_ARG_STRING, &(fa).mean_correction},   \
      {"--sink", UPF_ARG_INT, &(fa).sink}, {"--window", UPF_ARG_INT, &(fa).window},                          \
      {"--last-n", UPF_ARG_INT, &(fa).last_n}, {"--recent", UPF_ARG_INT, &(fa).recent}
#define UPF_SPARSE_ARG_FLAGS(fa) UPF_SPARSE_SHAPE_ARG_FLAGS(fa), {"--alpha", UPF_ARG_FLOAT, &(fa).alpha}

/* Checks the FlashPrefill flags p parsed for `command`: given only with flashprefill (1: the mode is
 * flashprefill; 2: compact, which takes them too but not --last-n (its selector runs last_n 0), and
 * --recent R >= 0 only there), each in range, and fills fa->params (and fa->compact). --alpha is read when it is a float flag (a
 * command with a list of its own checks that itself). 0 when all is well, else 2 after one line on
 * stderr naming the flag at fault. */
int upf_sparse_args_resolve(const char *command, const upf_arg_parser *p, int flashprefill, upf_sparse_args *fa);

/* --mode dense|uniprefill|flashprefill|compact with the selection flags (cli/select_args.h, whose rules apply
 * to dense and uniprefill; flashprefill takes neither --p nor --keep) and the FlashPrefill flags:
 * sa->prefill_mode and fa->params set. 0, else 2 after one line on stderr naming the flag at fault. */
int upf_mode_args_resolve(const char *command, const upf_arg_parser *p, upf_select_args *sa, upf_sparse_args *fa);

/* One line describing the parameters: "alpha 0.18, block_m 128, block_n 128, sink 2, window 4, last_n 2,
 * mean correction off". */
void upf_sparse_args_describe(const upf_sparse_params *p, char *buf, size_t size);
/* The parameters as a JSON object. */
void upf_sparse_args_json(FILE *f, const upf_sparse_params *p);

#endif

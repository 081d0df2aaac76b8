/* `upf models` lists the built-in models; `upf prefill` runs the end-to-end prefill of one of them on
 * seeded weights, dense, UniPrefill or FlashPrefill, on the CPU reference or CUDA (in one step, or with
 * --chunk in chunks through a session's paged KV cache), and writes the last-position logits, the drop
 * masks and a JSON record. Every input is checked before any work, and outputs are written only once
 * the whole run succeeded. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/model_args.h"
#include "cli/select_args.h"
#include "uniprefill/model.h"
#include "uniprefill/npy.h"
#include "uniprefill/provenance.h"
#include "uniprefill/session.h"
#include "uniprefill/timeline.h"

const char upf_cli_models_usage[] =
    "usage: upf models\n"
    "  Lists every built-in model: its layer pattern (attention kind, FFN kind) and drop layers.\n";

int upf_cli_models(int argc, char **argv) {
  upf_arg_parser p = {"upf models", upf_cli_models_usage, NULL, 0, NULL, 0, 0};
  const upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  for (int i = 0; i < upf_model_config_count(); i++) {
    const upf_model_config *c = upf_model_config_at(i);
    printf("%-20s %s\n", c->name, c->summary);
    printf("  layers %d, hidden %d, vocab %d, heads %d/%d x %d; FFN %s", c->num_layers, c->hidden, c->vocab,
           c->q_heads, c->kv_heads, c->head_dim, c->ffn == UPF_FFN_MOE ? "moe" : upf_act_name(c->act));
    if (c->ffn == UPF_FFN_MOE)
      printf(" (%d experts, top-%d, shared %d)", c->moe.num_experts, c->moe.top_k, c->moe.shared_inter);
    printf("\n  pattern: ");
    for (int l = 0; l < c->num_layers; l++) {
      const upf_mixer_kind k = upf_model_mixer(c, l);
      printf("%c", upf_model_is_drop_layer(c, l) ? 'D' : k == UPF_MIXER_FULL ? 'F' : k == UPF_MIXER_SLIDING ? 's' : 'g');
    }
    printf("  (F full, s sliding %d, g gdn, D full + drop)\n  drop layers:", c->window);
    for (int k = 0; k < c->num_drop_layers; k++)
      printf(" %d", c->drop_layers[k]);
    printf("; G %d, sink %d, last-q %d, p %g", c->select.block, c->select.sink, c->select.last_q, (double)c->select.p);
    if (c->drop_min_step_tokens)
      printf(", only in steps of more than %lld tokens", (long long)c->drop_min_step_tokens);
    printf("\n");
  }
  return 0;
}

const char upf_cli_prefill_usage[] =
    "usage: upf prefill (--model NAME | --gguf FILE)\n"
    "                   (--lengths N1,N2,... | --token-ids IDS.npy [--cu-seqlens CU.npy] | --text STR | --file F)\n"
    "                   [--seed S] [--mode dense|uniprefill|flashprefill|compact] [--select topp|topk] [--p P]\n"
    "                   [--keep R] [--alpha A] [--block-n 64|128] [--mean-correction on|off] [--sink S]\n"
    "                   [--window W] [--last-n N] [--recent R] [--dump-tables DIR]\n"
    "                   [--dtype f32|bf16] [--backend cpu|cuda] [--layers A:B] [--out-logits L.npy]\n"
    "                   [--tp R] [--comm auto|single|mpi|nccl] [--plan-only] [--check-determinism]\n"
    "                   [--dump-masks DIR] [--replay-masks DIR] [--json R.json] [--warmup N] [--iters N]\n"
    "                   [--out-argmax A.npy] [--out-nll N.npy] [--chunk C] [--timeline TRACE.json]\n"
    "  End-to-end prefill of a built-in model (upf models) on weights seeded by S, or of the llama or\n"
    "  gemma3 model of a GGUF file (--gguf: its weights dequantised to --dtype; drop layers scaled from\n"
    "  the family's published choice, models/README.md).\n"
    "  IDS <i4 (T,), CU <i4 (B+1) (one request when absent); with --lengths the ids come from the seed;\n"
    "  --text / --file (with --gguf): one request, the text through the file's tokenizer (its BOS added,\n"
    "  special tokens in the text parsed).\n"
    "  L <f4 (B, vocab): the last-position logits of each request.\n"
    "  A <i4 (T,): the argmax token at every position (ties to the lowest id); N <f8 (T,): the NLL of the\n"
    "  next token of the request at every position (natural log; NaN at each request's last). Not with\n"
    "  --mode uniprefill: it has outputs at its kept positions only.\n"
    "  --mode uniprefill drops tokens after each drop layer's attention: top-p with --p (default: the\n"
    "  model's), or --select topk --keep R: the ceil(R * blocks) best blocks of each request.\n"
    "  --mode flashprefill: every full-attention layer runs FlashPrefill V2's block-sparse attention (block\n"
    "  means, the index of kept key blocks, attention over them) in place of dense attention; the other\n"
    "  layers are unchanged and no token is dropped. --alpha A in [0, 1] (a block is kept when its score\n"
    "  is >= A times the tile's best; 0 keeps all), --block-n keys a block, --mean-correction on adds each\n"
    "  unkept block's mean term, --sink / --window leading and diagonal blocks always kept, --last-n query\n"
    "  tiles of a request kept dense. Defaults: the published ones, with alpha 0.18 at block_n 128 (the\n"
    "  values calibrated for Llama-3.1-8B), mean correction off. Reports per full-attention layer the\n"
    "  kept share of the visible key blocks and the times of means + index and of the attention.\n"
    "  --index-sharing (flashprefill, one rank, unchunked) also counts, per full-attention layer, the kept\n"
    "  blocks of each query tile that the previous tile of its request and KV head keeps too: the reuse in\n"
    "  L2 that block-sparse attention can have (a list drawn afresh per tile at kept share s shares ~s);\n"
    "  each layer's index is copied to the host for it (outside the index and attention times, inside the\n"
    "  TTFT: time without the flag).\n"
    "  --dump-masks writes DIR/layer<l>.npy (|u1, one entry per token entering drop layer l, compacted\n"
    "  order); --replay-masks uses such masks instead of selecting. --layers A:B runs layers [A, B) only\n"
    "  (a partial model: every output says so). --shared-weights (seeded models): the layers of one mixer\n"
    "  kind run on the weights of its first layer, so a model too large for the device runs at full depth\n"
    "  with its real shapes, routing and KV sizes, for timing (every output says so). --warmup/--iters\n"
    "  repeat the run; times are medians.\n"
    "  --check-determinism: every run (--warmup + --iters) must give the first run's logits and drop masks\n"
    "  bit for bit; the first difference is named and the exit status is 1.\n"
    "  --plan-only: prints the memory plan of the run with the model's distinct weights, in bf16 and in\n"
    "  FP8 (E4M3 projections with per-channel scales), and exits; nothing is built or allocated.\n"
    "  --ideal (uniprefill): also runs dense prefills (warm) at the token counts after each drop, reporting\n"
    "  the dense TTFT and the ideal: the sum of the dense per-layer times (attention block at the count\n"
    "  entering the layer, FFN block at the count leaving its drop) at the kept counts.\n"
    "  --tp R: tensor parallelism over R ranks (mpirun -np R; R must equal the communicator's size): each\n"
    "  rank holds Hq/R heads and 1/R of the FFN; rank 0 prints and writes every output, the others nothing.\n"
    "  --comm: auto (mpi under mpirun, nccl there with --backend cuda), single, mpi or nccl.\n"
    "  --chunk C: chunked prefill through a session's paged KV cache (pages of 16 tokens): each step holds\n"
    "  the next chunk of at most C tokens of every request not yet done (a prompt of at most C tokens in\n"
    "  one row); a chunk writes its KV into the cache and attends to its earlier chunks' KV and itself;\n"
    "  L holds each request's last chunk's logits; times are the steps' summed (per step in the JSON).\n"
    "  Dense chunked equals dense; FlashPrefill runs a chunk block-sparse over its cached context;\n"
    "  UniPrefill runs every chunk of a prompt split in more than one chunk dense (chunks with cached\n"
    "  context run dense, SPEC section 4), prompts of at most C tokens drop as usual. Not with --tp,\n"
    "  --dump-masks, --replay-masks, --ideal, --out-argmax or --out-nll.\n"
    "  --mode compact (needs --chunk): CompactAttention (SPEC section 9): in every full-attention layer a\n"
    "  chunk with cached context attends through the paged cache over the union of the key blocks the\n"
    "  block-sparse selector keeps over its query tiles and the heads of each GQA group, plus its own\n"
    "  blocks and the --recent R (default 2) blocks before them; --alpha, --block-n, --sink, --window as\n"
    "  flashprefill's (last_n 0); whole prompts, first chunks and decode rows run dense. Reports per\n"
    "  full-attention layer the kept share of the chunks' key blocks (kept / visible). --dump-tables DIR\n"
    "  writes DIR/layer<l>/chunk<c>.npy (|u1 (B, Hkv, key_blocks): the union table of step c's chunks; steps\n"
    "  without a chunk with cached context, such as step 0, write none).\n"
    "  --timeline TRACE.json (--backend cuda): one more run after the timed ones, its kernels, copies and\n"
    "  fills recorded by CUPTI (libcupti of the CUDA toolkit; UPF_CUPTI_LIB names another file): prints\n"
    "  the GPU's busy and idle time over the run, the time of each kind of kernel and the gaps between\n"
    "  kernels by length, adds them to the JSON record, and writes the run as a Chrome trace (open it in\n"
    "  ui.perfetto.dev or chrome://tracing). Not with --tp or --comm.\n";

typedef struct {
  upf_model_args sel; /* --model, --seed, --dtype, --backend, --layers */
  upf_select_args sa; /* --mode, --p, --keep */
  upf_sparse_args fa; /* --alpha, --block-n, --mean-correction, --sink, --window, --last-n */
  const char *lengths, *ids_path, *cu_path, *text, *text_file, *select;
  const char *out_logits, *dump_dir, *replay_dir, *json, *comm;
  const char *out_argmax, *out_nll, *dump_tables, *timeline;
  int32_t warmup, iters, ideal, tp, chunk, plan_only, check_determinism, index_sharing;
} prefill_args;

/* What a chunked run adds: its steps and each request's chunks. */
typedef struct {
  int32_t steps;
  double *step_seconds; /* (steps) of the last run */
  int32_t *chunks;      /* (B) */
} chunk_record;

/* Adds a step's per-layer times and token counts and its sparse records to the run's. */
static void add_step(upf_prefill_result *sum, const upf_prefill_result *step, const upf_model *m) {
  for (int32_t l = m->layer_begin; l < m->layer_end; l++) {
    sum->layer_seconds[l] += step->layer_seconds[l], sum->mixer_seconds[l] += step->mixer_seconds[l];
    sum->ffn_seconds[l] += step->ffn_seconds[l], sum->layer_tokens[l] += step->layer_tokens[l];
  }
  sum->total_seconds += step->total_seconds;
  if (!sum->num_sparse) {
    sum->num_sparse = step->num_sparse;
    memcpy(sum->sparse, step->sparse, (size_t)step->num_sparse * sizeof *step->sparse);
  } else {
    for (int32_t k = 0; k < step->num_sparse && k < sum->num_sparse; k++) {
      upf_sparse_record *d = &sum->sparse[k];
      d->kept_blocks += step->sparse[k].kept_blocks, d->visible_blocks += step->sparse[k].visible_blocks;
      d->index_seconds += step->sparse[k].index_seconds, d->attn_seconds += step->sparse[k].attn_seconds;
    }
  }
  for (int k = 0; k < step->num_drops; k++) /* the selection time of every drop layer's steps */
    for (int j = 0; j < sum->num_drops; j++)
      if (sum->drops[j].layer == step->drops[k].layer)
        sum->drops[j].select_seconds += step->drops[k].select_seconds;
}

/* --dump-tables: DIR/layer<l>/chunk<c>.npy for the step c running, staged in the run's output set so
 * that they land with its other outputs or not at all; the first failure is kept. The layer folders
 * this run made are listed, to be removed again when the run fails. */
typedef struct {
  const char *dir;
  upf_outputs *outs;
  int32_t step;
  upf_status st;
  int32_t made[UPF_MODEL_MAX_LAYERS];
  int num_made;
} table_dump;

/* Removes the layer folders d made (empty once the set's temporaries are gone). */
static void table_dump_undo(const table_dump *d) {
  for (int i = 0; i < d->num_made; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/layer%d", d->dir, d->made[i]);
    rmdir(path);
  }
}

static void dump_table(void *user, int32_t layer, const uint8_t *table, int32_t num_chunks, int32_t kv_heads,
                       int32_t key_blocks) {
  table_dump *d = user;
  if (d->st != UPF_OK)
    return;
  char path[4096];
  snprintf(path, sizeof path, "%s/layer%d", d->dir, layer);
  if (mkdir(path, 0755) == 0) {
    if (d->num_made < UPF_MODEL_MAX_LAYERS)
      d->made[d->num_made++] = layer;
  } else if (errno != EEXIST) {
    d->st = upf_fail(UPF_ERR_IO, "--dump-tables: cannot create %s (%s)", path, strerror(errno));
    return;
  }
  snprintf(path, sizeof path, "%s/layer%d/chunk%d.npy", d->dir, layer, d->step);
  const int64_t shape[3] = {num_chunks, kv_heads, key_blocks};
  upf_tensor t;
  d->st = upf_tensor_init(&t, (void *)table, UPF_DTYPE_U8, 3, shape);
  if (d->st == UPF_OK)
    d->st = upf_npy_write_to(d->outs, path, "--dump-tables", &t);
}

/* --chunk: the batch prefilled in chunks through a session; res as upf_model_prefill fills it: each
 * request's last chunk's logits, the layer times and tokens and the sparse records summed over the
 * steps, and per drop layer each request's tokens kept (its prompt, for a request that did not drop). */
static upf_status chunked_run(const upf_model *m, const int32_t *ids, const int32_t *cu, int32_t B,
                              const upf_prefill_options *opt, int32_t C, table_dump *dump,
                              upf_prefill_result *res, chunk_record *cr) {
  const upf_model_config *c = m->cfg;
  const int32_t V = c->vocab;
  memset(res, 0, sizeof *res);
  upf_session_config sc = upf_session_config_default(m);
  sc.mode = opt->mode, sc.select = opt->select, sc.sparse = opt->sparse, sc.max_requests = B;
  sc.compact = opt->compact;
  upf_session_step_options so;
  memset(&so, 0, sizeof so);
  so.on_compact_table = dump ? dump_table : NULL, so.compact_user = dump;
  sc.pages_per_group = 0;
  for (int32_t r = 0; r < B; r++)
    sc.pages_per_group += ((int64_t)cu[r + 1] - cu[r] + sc.page_size - 1) / sc.page_size;
  upf_session *s = NULL;
  UPF_TRY(upf_session_create(m, &sc, &s));
  int32_t *req = malloc((size_t)B * sizeof *req), *done = calloc((size_t)B, sizeof *done);
  int32_t *who = malloc((size_t)B * sizeof *who);
  upf_session_row *rows = malloc((size_t)B * sizeof *rows);
  res->logits = malloc((size_t)B * V * sizeof *res->logits);
  upf_status st = req && done && who && rows && res->logits ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "prefill: --chunk rows");
  res->num_reqs = B, res->vocab = V;
  for (int32_t r = 0; st == UPF_OK && r < B; r++)
    st = upf_session_add_request(s, ids + cu[r], cu[r + 1] - cu[r], &req[r]);
  /* every drop layer of the range, in order, for the per-request kept counts */
  for (int k = 0; st == UPF_OK && opt->mode == UPF_PREFILL_UNIPREFILL && k < c->num_drop_layers; k++)
    if (c->drop_layers[k] >= m->layer_begin && c->drop_layers[k] < m->layer_end)
      res->drops[res->num_drops++].layer = c->drop_layers[k];
  cr->steps = 0;
  memset(cr->chunks, 0, (size_t)B * sizeof *cr->chunks);
  for (int32_t left = B; st == UPF_OK && left > 0;) {
    int32_t n = 0;
    for (int pass = 0; pass < 2; pass++) /* whole prompts, then chunks: the session's row order */
      for (int32_t r = 0; r < B; r++) {
        const int32_t len = cu[r + 1] - cu[r];
        const int32_t k = len - done[r] < C ? len - done[r] : C;
        if (done[r] < len && (k == len) == (pass == 0))
          who[n] = r, rows[n++] = (upf_session_row){req[r], UPF_ROW_PREFILL, 0, k};
      }
    upf_prefill_result step;
    if (dump)
      dump->step = cr->steps;
    st = upf_session_step(s, rows, n, &so, &step);
    if (st == UPF_OK && dump && dump->st != UPF_OK) {
      upf_prefill_result_free(&step);
      st = dump->st;
    }
    if (st != UPF_OK)
      break;
    double *grown = realloc(cr->step_seconds, (size_t)(cr->steps + 1) * sizeof *grown);
    if (grown) {
      cr->step_seconds = grown;
      cr->step_seconds[cr->steps++] = step.total_seconds;
    }
    add_step(res, &step, m);
    for (int32_t j = 0; j < n; j++) {
      const int32_t r = who[j];
      done[r] += rows[j].num_tokens, cr->chunks[r]++;
      if (done[r] == cu[r + 1] - cu[r]) {
        memcpy(res->logits + (size_t)r * V, step.logits + (size_t)j * V, (size_t)V * sizeof *res->logits);
        left--;
      }
    }
    upf_prefill_result_free(&step);
    if (!grown)
      st = upf_fail(UPF_ERR_NOMEM, "prefill: --chunk step times");
  }
  /* per drop layer: each request's tokens entering it and kept (the session's drop history) */
  for (int k = 0; st == UPF_OK && k < res->num_drops; k++) {
    upf_drop_record *d = &res->drops[k];
    d->kept_per_req = calloc((size_t)B, sizeof *d->kept_per_req);
    if (!d->kept_per_req) {
      st = upf_fail(UPF_ERR_NOMEM, "prefill: --chunk drop records");
      break;
    }
    for (int32_t r = 0; r < B && st == UPF_OK; r++) {
      upf_session_request_info info;
      st = upf_session_request(s, req[r], &info);
      int32_t in = cu[r + 1] - cu[r], kept = in;
      for (int32_t j = 0; st == UPF_OK && j < info.num_drops; j++) {
        if (info.drops[j].layer < d->layer)
          in = kept = info.drops[j].kept_len;
        else if (info.drops[j].layer == d->layer)
          kept = info.drops[j].kept_len;
      }
      d->kept_per_req[r] = kept, d->tokens_in += in, d->tokens_kept += kept;
    }
  }
  free(req), free(done), free(who), free(rows);
  upf_session_free(s);
  if (st != UPF_OK)
    upf_prefill_result_free(res);
  return st;
}

/* What --ideal measured: the dense prefill of the same batch, and the sum over layers of the dense
 * per-block times at the token counts the UniPrefill run had there. */
typedef struct {
  int measured;
  double dense_s, ideal_s, select_s;
} ideal_times;

/* Dense prefills at each stage's per-request lengths (stage s: after s drops), one warm run each. */
static upf_status measure_ideal(const upf_model *m, const int32_t *cu, int32_t B, const upf_prefill_result *uni,
                                ideal_times *out) {
  const int stages = uni->num_drops + 1;
  upf_prefill_result *st_res = calloc((size_t)stages, sizeof *st_res);
  int32_t *cu_s = malloc((size_t)(B + 1) * sizeof *cu_s);
  int32_t *ids = malloc((size_t)(cu[B] > 0 ? cu[B] : 1) * sizeof *ids);
  upf_status st = st_res && cu_s && ids ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "ideal: host arrays");
  const upf_prefill_options dense = {.mode = UPF_PREFILL_DENSE, .select = m->cfg->select};
  for (int s = 0; s < stages && st == UPF_OK; s++) {
    cu_s[0] = 0;
    for (int32_t r = 0; r < B; r++)
      cu_s[r + 1] = cu_s[r] + (s == 0 ? cu[r + 1] - cu[r] : uni->drops[s - 1].kept_per_req[r]);
    for (int32_t t = 0; t < cu_s[B]; t++)
      ids[t] = (int32_t)(((uint32_t)t * 2654435761u) % (uint32_t)m->cfg->vocab);
    /* the first run of a stage's shapes is a warm-up (cuBLAS plans, workspace growth) */
    for (int rep = 0; rep < 2 && st == UPF_OK; rep++) {
      upf_prefill_result_free(&st_res[s]);
      st = upf_model_prefill(m, ids, cu_s, B, &dense, &st_res[s]);
    }
  }
  if (st == UPF_OK) {
    int before = 0, upto = 0; /* drops before layer l, and up to and including it */
    double ideal = st_res[0].total_seconds;
    for (int32_t l = m->layer_begin; l < m->layer_end; l++) {
      while (upto < uni->num_drops && uni->drops[upto].layer <= l)
        upto++;
      ideal += st_res[before].mixer_seconds[l] + st_res[upto].ffn_seconds[l] - st_res[0].layer_seconds[l];
      before = upto;
    }
    out->measured = 1, out->dense_s = st_res[0].total_seconds, out->ideal_s = ideal, out->select_s = 0;
    for (int k = 0; k < uni->num_drops; k++)
      out->select_s += uni->drops[k].select_seconds;
  }
  for (int s = 0; st_res && s < stages; s++)
    upf_prefill_result_free(&st_res[s]);
  free(st_res), free(cu_s), free(ids);
  return st;
}

/* "8192,32768" into lengths; each in [1, 2^31). */
/* --lengths "A,B,...": each a decimal count in [1, 2^31-1], nothing else (no sign, space or empty
 * entry), the total under 2^31. 1, or 0 with why in msg. */
static int parse_lengths(const char *s, int32_t **out, int32_t *n, char *msg, size_t msg_size) {
  int32_t cap = 1;
  for (const char *c = s; *c; c++)
    cap += *c == ',';
  *n = 0;
  if (!(*out = malloc((size_t)cap * sizeof **out)))
    return snprintf(msg, msg_size, "out of memory"), 0;
  int64_t total = 0;
  for (const char *c = s;; c++) {
    const char *end = c;
    while (*end >= '0' && *end <= '9')
      end++;
    if (end == c || (*end && *end != ',')) {
      const int len = (int)strcspn(c, ",");
      return snprintf(msg, msg_size, "entry %d ('%.*s') is not a token count (digits only)", *n + 1, len, c), 0;
    }
    long long v = 0;
    for (const char *d = c; d < end && v <= INT32_MAX; d++)
      v = v * 10 + (*d - '0');
    if (v < 1)
      return snprintf(msg, msg_size, "entry %d is 0: a length of 0 is not a request", *n + 1), 0;
    if (v > INT32_MAX || (total += v) > INT32_MAX)
      return snprintf(msg, msg_size, "entry %d ('%.*s') makes the batch longer than 2^31-1 tokens", *n + 1,
                      (int)(end - c), c), 0;
    (*out)[(*n)++] = (int32_t)v;
    if (!*end)
      return 1;
    c = end;
  }
}

static int is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static void progress(void *user, int32_t layer, double seconds, int64_t tokens) {
  const upf_model *m = user;
  fprintf(stderr, "\r  layer %d/%d  %8.3f ms  %lld tokens   ", layer + 1, m->layer_end, seconds * 1e3,
          (long long)tokens);
  if (layer + 1 == m->layer_end)
    fprintf(stderr, "\n");
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void print_plan(FILE *f, const upf_model *m, const upf_memory_plan *p, int64_t T, int32_t B) {
  const double g = 1.0 / (1 << 30);
  fprintf(f, "memory plan (%s, %lld tokens in %d requests): weights %.2f GiB, activations %.2f GiB (reused by every "
             "layer, incl. the widest op's scratch), selection %.3f GiB, K/V the attention layers produce %.2f GiB "
             "(dense; not retained by prefill)",
          m->be->name, (long long)T, B, p->weights * g, p->activations * g, p->selection * g, p->kv_dense * g);
  if (p->sparse > 0)
    fprintf(f, ", FlashPrefill block means + index %.2f MiB (reused by every full-attention layer)", p->sparse / (1 << 20));
  fprintf(f, "\n");
}

/* --plan-only: the plan of a model holding its distinct weights, without building it (the descriptor
 * carries what upf_model_memory_plan_batch reads: config, dtype, layer range, weight bytes). */
static int plan_only(const prefill_args *a, const upf_prefill_options *opt, const int32_t *cu, int32_t B) {
  upf_weight_bytes wb;
  upf_status st = upf_model_config_weight_bytes(a->sel.cfg, a->sel.layer_begin, a->sel.layer_end, &wb);
  int32_t *cu_plan = malloc((size_t)(B + 1) * sizeof *cu_plan);
  if (st == UPF_OK && !cu_plan)
    st = upf_fail(UPF_ERR_NOMEM, "the memory plan");
  upf_model m;
  memset(&m, 0, sizeof m);
  m.cfg = m.full_cfg = a->sel.cfg, m.be = a->sel.be, m.dtype = a->sel.dt, m.tp_size = 1;
  m.layer_begin = a->sel.layer_begin, m.layer_end = a->sel.layer_end;
  m.weight_bytes = a->sel.dt == UPF_DTYPE_BF16 ? wb.bf16 : 2 * wb.bf16; /* f32: every tensor at 4 bytes */
  upf_memory_plan plan;
  if (st == UPF_OK) {
    cu_plan[0] = 0;
    for (int32_t r = 0; r < B; r++)
      cu_plan[r + 1] = cu_plan[r] + (a->chunk && cu[r + 1] - cu[r] > a->chunk ? a->chunk : cu[r + 1] - cu[r]);
    st = upf_model_memory_plan_batch(&m, cu_plan, B, opt, &plan);
  }
  if (st == UPF_OK) {
    const double g = 1.0 / (1 << 30), rest = plan.activations + plan.selection + plan.kv_dense + plan.sparse;
    print_plan(stdout, &m, &plan, cu_plan[B], B);
    printf("total with the distinct weights: %.2f GiB in %s; %.2f GiB with FP8 weights (%.2f GiB of them); nothing "
           "was allocated (--plan-only)\n",
           (m.weight_bytes + rest) * g, upf_dtype_name(m.dtype), (wb.fp8_e4m3 + rest) * g, wb.fp8_e4m3 * g);
  }
  free(cu_plan);
  return st == UPF_OK ? 0 : upf_cli_error(st, "prefill: --plan-only");
}

/* The JSON record of a run (see the issue: per request and drop layer, tokens in and kept, per-layer
 * times, the memory plan, the commit and the command). */
static upf_status write_json(upf_outputs *outs, const char *path, const prefill_args *a, const upf_model *m, const int32_t *cu, int32_t B,
                             const upf_prefill_result *res, const double *totals, int iters,
                             const upf_memory_plan *plan, const ideal_times *ideal, const chunk_record *cr,
                             const upf_timeline *tl, const upf_timeline_summary *tls, double traced_s, int argc,
                             char **argv) {
  FILE *f;
  UPF_TRY(upf_outputs_open(outs, path, "--json", &f));
  const upf_model_config *c = m->cfg;
  char commit[64];
  if (!upf_source_commit(commit, sizeof commit))
    snprintf(commit, sizeof commit, "unknown");
  fprintf(f, "{\n  \"model\": \"%s\",\n  \"layers\": [%d, %d],\n  \"partial_model\": %s,\n  \"shared_weights\": %s,\n",
          c->name, m->layer_begin, m->layer_end, m->layer_begin > 0 || m->layer_end < c->num_layers ? "true" : "false",
          m->shared_weights ? "true" : "false");
  fprintf(f, "  \"mode\": \"%s\",\n  \"dtype\": \"%s\",\n  \"backend\": \"%s\",\n  \"device\": \"%s\",\n", a->sa.mode,
          upf_dtype_name(m->dtype), m->be->name, m->be->describe());
  fprintf(f, "  \"select\": {\"block\": %d, \"sink\": %d, \"last_q\": %d, \"p\": %g, \"keep_ratio\": %g},\n",
          c->select.block, c->select.sink, c->select.last_q, (double)a->sa.p, (double)a->sa.keep);
  fprintf(f, "  \"requests\": [");
  for (int32_t r = 0; r < B; r++)
    fprintf(f, "%s%d", r ? ", " : "", cu[r + 1] - cu[r]);
  fprintf(f, "],\n  \"drops\": [");
  for (int k = 0; k < res->num_drops; k++) {
    const upf_drop_record *d = &res->drops[k];
    fprintf(f, "%s\n    {\"layer\": %d, \"tokens_in\": %lld, \"tokens_kept\": %lld, \"select_ms\": %.4f, ",
            k ? "," : "", d->layer, (long long)d->tokens_in, (long long)d->tokens_kept, d->select_seconds * 1e3);
    if (m->comm)
      fprintf(f, "\"tp_select_ms\": %.4f, \"allreduce_bytes\": %.0f, \"allreduce_ms\": %.4f, \"disagreeing_ranks\": %d, ",
              d->tp_select_seconds * 1e3, d->allreduce_bytes, d->allreduce_seconds * 1e3, d->disagreeing_ranks);
    if (m->comm)
      fprintf(f, "\"tp_split_ms\": {\"block_scores\": %.4f, \"allreduce\": %.4f, \"topp\": %.4f, \"check\": %.4f, "
                 "\"expand\": %.4f}, ",
              d->tp.scores_seconds * 1e3, d->tp.allreduce_seconds * 1e3, d->tp.topp_seconds * 1e3,
              d->tp.check_seconds * 1e3, d->tp.expand_seconds * 1e3);
    fprintf(f, "\"kept_per_request\": [");
    for (int32_t r = 0; r < B; r++)
      fprintf(f, "%s%d", r ? ", " : "", d->kept_per_req[r]);
    fprintf(f, "]}");
  }
  fprintf(f, "\n  ],\n  \"layer_ms\": [");
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    fprintf(f, "%s%.4f", l > m->layer_begin ? ", " : "", res->layer_seconds[l] * 1e3);
  fprintf(f, "],\n  \"layer_tokens\": [");
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    fprintf(f, "%s%lld", l > m->layer_begin ? ", " : "", (long long)res->layer_tokens[l]);
  /* the per-layer-kind breakdown: each layer's kind, its mixer (pre-norm and attention / GDN block) and
   * its FFN / MoE block (after any drop) */
  static const char *const kind_names[] = {"full", "sliding", "gdn"};
  fprintf(f, "],\n  \"layer_kind\": [");
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    fprintf(f, "%s\"%s\"", l > m->layer_begin ? ", " : "", kind_names[upf_model_mixer(m->cfg, l)]);
  fprintf(f, "],\n  \"mixer_ms\": [");
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    fprintf(f, "%s%.4f", l > m->layer_begin ? ", " : "", res->mixer_seconds[l] * 1e3);
  fprintf(f, "],\n  \"ffn_ms\": [");
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    fprintf(f, "%s%.4f", l > m->layer_begin ? ", " : "", res->ffn_seconds[l] * 1e3);
  qsort((void *)totals, (size_t)iters, sizeof *totals, cmp_double);
  fprintf(f, "],\n  \"ttft_ms\": {\"median\": %.4f, \"min\": %.4f, \"max\": %.4f, \"iters\": %d},\n",
          totals[iters / 2] * 1e3, totals[0] * 1e3, totals[iters - 1] * 1e3, iters);
  if (ideal->measured)
    fprintf(f, "  \"dense_ms\": %.4f,\n  \"ideal_ms\": %.4f,\n  \"select_total_ms\": %.4f,\n  \"select_share\": %.5f,\n",
            ideal->dense_s * 1e3, ideal->ideal_s * 1e3, ideal->select_s * 1e3, ideal->select_s / totals[iters / 2]);
  /* the dense work of the batch by ceiling (upf_model_prefill_work): what upf report holds TTFT against */
  upf_prefill_work work;
  int32_t *lens = malloc((size_t)B * sizeof *lens);
  if (lens) {
    for (int32_t r = 0; r < B; r++)
      lens[r] = cu[r + 1] - cu[r];
    upf_model_prefill_work(c, m->layer_begin, m->layer_end, lens, B, m->dtype, &work);
    free(lens);
    fprintf(f, "  \"dense_work\": {\"gemm_flop\": %.15g, \"moe_flop\": %.15g, \"attn_flop\": %.15g, "
               "\"gdn_scan_flop\": %.15g, \"glue_bytes\": %.15g},\n",
            work.gemm_flop, work.moe_flop, work.attn_flop, work.gdn_scan_flop, work.glue_bytes);
  }
  fprintf(f, "  \"memory_gib\": {\"weights\": %.4f, \"activations\": %.4f, \"selection\": %.4f, \"kv_dense\": %.4f",
          plan->weights / (1 << 30), plan->activations / (1 << 30), plan->selection / (1 << 30),
          plan->kv_dense / (1 << 30));
  if (a->sa.prefill_mode == UPF_PREFILL_FLASHPREFILL)
    fprintf(f, ", \"sparse\": %.6f", plan->sparse / (1 << 30));
  fprintf(f, "},\n");
  if (a->sa.prefill_mode == UPF_PREFILL_FLASHPREFILL) {
    fprintf(f, "  \"flashprefill\": ");
    upf_sparse_args_json(f, &a->fa.params);
    double index_s = 0, attn_s = 0;
    for (int i = 0; i < res->num_sparse; i++)
      index_s += res->sparse[i].index_seconds, attn_s += res->sparse[i].attn_seconds;
    fprintf(f, ",\n  \"kept_share\": %.6f,\n  \"sparse_index_ms\": %.4f,\n  \"sparse_attn_ms\": %.4f,\n",
            upf_prefill_kept_share(res), index_s * 1e3, attn_s * 1e3);
    fprintf(f, "  \"sparse_layers\": [");
    for (int i = 0; i < res->num_sparse; i++) {
      const upf_sparse_record *r = &res->sparse[i];
      fprintf(f, "%s\n    {\"layer\": %d, \"kept_blocks\": %lld, \"visible_blocks\": %lld, \"kept_share\": %.6f, "
                 "\"index_ms\": %.4f, \"attn_ms\": %.4f",
              i ? "," : "", r->layer, (long long)r->kept_blocks, (long long)r->visible_blocks,
              r->visible_blocks ? (double)r->kept_blocks / (double)r->visible_blocks : 1.0, r->index_seconds * 1e3,
              r->attn_seconds * 1e3);
      if (a->index_sharing)
        fprintf(f, ", \"neighbour_blocks\": %lld, \"neighbour_shared\": %lld", (long long)r->neighbour_total,
                (long long)r->neighbour_shared);
      fprintf(f, "}");
    }
    fprintf(f, "\n  ],\n");
  }
  if (a->sa.prefill_mode == UPF_PREFILL_COMPACT) {
    fprintf(f, "  \"compact\": {\"recent\": %d, \"selector\": ", a->fa.compact.recent);
    upf_sparse_args_json(f, &a->fa.params);
    double attn_s = 0;
    for (int i = 0; i < res->num_sparse; i++)
      attn_s += res->sparse[i].attn_seconds;
    fprintf(f, "},\n  \"kept_share\": %.6f,\n  \"compact_attn_ms\": %.4f,\n", upf_prefill_kept_share(res),
            attn_s * 1e3);
    fprintf(f, "  \"compact_layers\": [");
    for (int i = 0; i < res->num_sparse; i++) {
      const upf_sparse_record *r = &res->sparse[i];
      fprintf(f, "%s\n    {\"layer\": %d, \"kept_blocks\": %lld, \"visible_blocks\": %lld, \"kept_share\": %.6f, "
                 "\"attn_ms\": %.4f}",
              i ? "," : "", r->layer, (long long)r->kept_blocks, (long long)r->visible_blocks,
              r->visible_blocks ? (double)r->kept_blocks / (double)r->visible_blocks : 1.0, r->attn_seconds * 1e3);
    }
    fprintf(f, "\n  ],\n");
  }
  fprintf(f, "  \"chunk\": %d,\n", a->chunk);
  if (a->chunk) {
    fprintf(f, "  \"chunked_prefill\": {\"steps\": %d, \"step_ms\": [", cr->steps);
    for (int32_t i = 0; i < cr->steps; i++)
      fprintf(f, "%s%.4f", i ? ", " : "", cr->step_seconds[i] * 1e3);
    fprintf(f, "], \"request_chunks\": [");
    for (int32_t r = 0; r < B; r++)
      fprintf(f, "%s%d", r ? ", " : "", cr->chunks[r]);
    fprintf(f, "]");
    if (a->sa.prefill_mode == UPF_PREFILL_UNIPREFILL)
      fprintf(f, ", \"uniprefill\": \"chunks with cached context ran dense: every chunk of a prompt split in more than "
                 "one chunk ran dense; prompts of at most %d tokens dropped as usual\"", a->chunk);
    fprintf(f, "},\n");
  }
  fprintf(f, "  \"tp\": {\"ranks\": %d, \"comm\": \"%s\", \"allreduce_calls\": %lld, \"allreduce_bytes\": %.0f, "
             "\"allreduce_ms\": %.4f},\n",
          m->tp_size, m->comm ? upf_comm_kind_name(upf_comm_kind_of(m->comm)) : "none", (long long)res->comm_calls,
          res->comm_bytes, res->comm_seconds * 1e3);
  if (tl) {
    fprintf(f, "  \"timeline\": {\"file\": ");
    upf_json_string(f, a->timeline);
    fprintf(f, ", \"traced_run_ms\": %.4f, \"summary\": ", traced_s * 1e3);
    upf_timeline_summary_json(f, tl, tls);
    fprintf(f, "},\n");
  }
  fprintf(f, "  \"commit\": \"%s\",\n  \"command\": ", commit);
  upf_json_command(f, "upf", argc, argv);
  fprintf(f, "\n}\n");
  return UPF_OK; /* a write error shows when the set is committed */
}

/* Reads DIR/layer<l>.npy for every drop layer of the range: |u1, 1-D, one entry per token the layer
 * sees (all T at the first, then the ones the mask before kept), each file named with its layer when
 * it does not fit. */
static int read_masks(const char *dir, const upf_model *m, int64_t T, upf_tensor *masks, const uint8_t **ptrs,
                      int64_t *lens) {
  const upf_model_config *c = m->cfg;
  int64_t tokens = T;
  for (int k = 0, first = 1; k < c->num_drop_layers; k++) {
    const int32_t l = c->drop_layers[k];
    if (l < m->layer_begin || l >= m->layer_end)
      continue;
    char path[4096];
    snprintf(path, sizeof path, "%s/layer%d.npy", dir, l);
    upf_status st = upf_npy_read(path, &masks[k]);
    if (st == UPF_OK && (masks[k].ndim != 1 || (masks[k].dtype != UPF_DTYPE_U8 && masks[k].dtype != UPF_DTYPE_BOOL)))
      st = upf_fail(UPF_ERR_FORMAT, "%s: want |u1 (T,), got %s with %d dims", path, upf_dtype_name(masks[k].dtype),
                    masks[k].ndim);
    if (st == UPF_OK && masks[k].shape[0] != tokens)
      st = upf_fail(UPF_ERR_SHAPE, "%s (drop layer %d): replay mask: %lld entries, the layer has %lld tokens (%s)",
                    path, l, (long long)masks[k].shape[0], (long long)tokens,
                    first ? "the whole batch" : "those the mask before it kept");
    if (st != UPF_OK)
      return upf_cli_error(st, "prefill: --replay-masks"), 0;
    ptrs[k] = masks[k].data, lens[k] = masks[k].shape[0];
    tokens = 0, first = 0;
    for (int64_t j = 0; j < lens[k]; j++)
      tokens += ptrs[k][j] != 0;
  }
  return 1;
}

/* Checks the command line against the model and builds the batch; 0 (message printed) on bad input. */
static int build_batch(const prefill_args *a, const upf_model_config *cfg, int32_t **ids, int32_t **cu, int32_t *B) {
  if (a->lengths) {
    int32_t *lens = NULL, n = 0;
    char why[256];
    if (!parse_lengths(a->lengths, &lens, &n, why, sizeof why)) {
      fprintf(stderr, "upf prefill: --lengths '%s': %s; want token counts of at least 1 separated by commas\n",
              a->lengths, why);
      free(lens);
      return 0;
    }
    *cu = malloc((size_t)(n + 1) * sizeof **cu);
    (*cu)[0] = 0;
    for (int32_t r = 0; r < n; r++)
      (*cu)[r + 1] = (*cu)[r] + lens[r];
    free(lens);
    *B = n;
    if (!upf_model_args_check_context("prefill", &a->sel, "--lengths", *cu, n, 0))
      return 0;
    *ids = malloc((size_t)(*cu)[n] * sizeof **ids);
    upf_model_seeded_ids((uint64_t)a->sel.seed, cfg->vocab, (*cu)[n], *ids);
    return 1;
  }
  return upf_model_args_batch("prefill", &a->sel, a->ids_path, a->cu_path, a->text, a->text_file, ids, cu, B) &&
         upf_model_args_check_context("prefill", &a->sel, a->ids_path ? "--token-ids" : a->text ? "--text" : "--file",
                                      *cu, *B, 0);
}

int upf_cli_prefill(int argc, char **argv) {
  prefill_args a = {.sel = UPF_MODEL_ARGS_DEFAULT, .sa = UPF_SELECT_ARGS_DEFAULT, .fa = UPF_SPARSE_ARGS_DEFAULT, .select = "topp", .iters = 1, .tp = 1};
  upf_arg args[] = {
      UPF_MODEL_ARG_FLAGS(a.sel),                    {"--lengths", UPF_ARG_STRING, &a.lengths},
      UPF_SPARSE_ARG_FLAGS(a.fa),
      {"--token-ids", UPF_ARG_STRING, &a.ids_path},  {"--cu-seqlens", UPF_ARG_STRING, &a.cu_path},
      {"--text", UPF_ARG_STRING, &a.text},           {"--file", UPF_ARG_STRING, &a.text_file},
      UPF_SELECT_ARG_FLAGS(a.sa),                    {"--select", UPF_ARG_STRING, &a.select},
      {"--out-logits", UPF_ARG_STRING, &a.out_logits},
      {"--dump-masks", UPF_ARG_STRING, &a.dump_dir}, {"--replay-masks", UPF_ARG_STRING, &a.replay_dir},
      {"--json", UPF_ARG_STRING, &a.json},           {"--warmup", UPF_ARG_INT, &a.warmup, 0, 0, 1000},
      {"--iters", UPF_ARG_INT, &a.iters, 0, 1, 1000},   {"--ideal", UPF_ARG_SWITCH, &a.ideal},
      {"--plan-only", UPF_ARG_SWITCH, &a.plan_only},
      {"--check-determinism", UPF_ARG_SWITCH, &a.check_determinism},
      {"--tp", UPF_ARG_INT, &a.tp, 0, 1, 1 << 16},     {"--comm", UPF_ARG_STRING, &a.comm},
      {"--out-argmax", UPF_ARG_STRING, &a.out_argmax}, {"--out-nll", UPF_ARG_STRING, &a.out_nll},
      {"--chunk", UPF_ARG_INT, &a.chunk, 0, 1, INT32_MAX},
      {"--dump-tables", UPF_ARG_STRING, &a.dump_tables}, {"--timeline", UPF_ARG_STRING, &a.timeline},
      {"--index-sharing", UPF_ARG_SWITCH, &a.index_sharing},
  };
  upf_arg_parser p = {"upf prefill", upf_cli_prefill_usage, args, (int)(sizeof args / sizeof *args), NULL, 0, 0};
  const upf_args_result pr = upf_args_parse(&p, argc, argv);
  if (pr != UPF_ARGS_OK)
    return upf_args_exit_code(pr);

  const int rc_sel = upf_model_args_resolve("prefill", &a.sel);
  if (rc_sel)
    return rc_sel;
  const upf_model_config *cfg = a.sel.cfg;
  if (!!a.lengths + !!a.ids_path + !!a.text + !!a.text_file != 1) {
    fprintf(stderr, "upf prefill: give exactly one of --lengths, --token-ids, --text and --file\n");
    return 2;
  }
  if (a.cu_path && !a.ids_path) {
    fprintf(stderr, "upf prefill: --cu-seqlens goes with --token-ids\n");
    return 2;
  }
  if (!upf_model_args_check_seed("prefill", &a.sel, upf_args_find(&p, "--seed")->seen,
                                 a.sel.gguf && !a.lengths ? "the weights are --gguf's and the prompt is given (the seed "
                                                            "draws ids only for --lengths)" : NULL))
    return 2;
  /* the rules every prefill command shares, then prefill's own: --select topk goes with --keep */
  const int rc_mode = upf_mode_args_resolve("prefill", &p, &a.sa, &a.fa);
  if (rc_mode)
    return rc_mode;
  upf_prefill_options opt = {.mode = a.sa.prefill_mode, .select = cfg->select, .sparse = a.fa.params,
                             .compact = a.fa.compact};
  if (opt.mode == UPF_PREFILL_COMPACT && !a.chunk) {
    fprintf(stderr, "upf prefill: --mode compact needs --chunk C (CompactAttention runs the chunks of a chunked "
                    "prefill over their cached context)\n");
    return 2;
  }
  if (a.index_sharing && (opt.mode != UPF_PREFILL_FLASHPREFILL || a.chunk || a.tp > 1 || a.comm)) {
    fprintf(stderr, "upf prefill: --index-sharing needs --mode flashprefill on one rank, without --chunk\n");
    return 2;
  }
  opt.sparse_sharing = a.index_sharing;
  if (a.dump_tables && opt.mode != UPF_PREFILL_COMPACT) {
    fprintf(stderr, "upf prefill: --dump-tables needs --mode compact\n");
    return 2;
  }
  if (a.dump_tables && !is_dir(a.dump_tables)) {
    fprintf(stderr, "upf prefill: --dump-tables %s: not a directory\n", a.dump_tables);
    return 2;
  }
  const int topk = !strcmp(a.select, "topk");
  if (!topk && strcmp(a.select, "topp")) {
    fprintf(stderr, "upf prefill: --select '%s': want topp or topk\n", a.select);
    return 2;
  }
  if (topk != a.sa.keep_given) {
    fprintf(stderr, "upf prefill: --select topk takes --keep R, and --keep needs --select topk\n");
    return 2;
  }
  if (opt.mode != UPF_PREFILL_UNIPREFILL && (a.dump_dir || a.replay_dir || a.ideal)) {
    fprintf(stderr, "upf prefill: --dump-masks, --replay-masks and --ideal need --mode uniprefill\n");
    return 2;
  }
  if (opt.mode == UPF_PREFILL_UNIPREFILL && (a.out_argmax || a.out_nll)) {
    fprintf(stderr, "upf prefill: --out-argmax and --out-nll need --mode dense or flashprefill (UniPrefill has outputs "
                    "at its kept positions only)\n");
    return 2;
  }
  if (a.timeline && (a.tp > 1 || a.comm)) {
    fprintf(stderr, "upf prefill: --timeline records one process's device: not with --tp or --comm\n");
    return 2;
  }
  if (a.timeline && strcmp(a.sel.be->name, "cuda") != 0) {
    fprintf(stderr, "upf prefill: --timeline records CUDA kernels: it needs --backend cuda (this run is on %s)\n",
            a.sel.be->name);
    return 2;
  }
  if (a.timeline) { /* before the weights are built: a machine without libcupti fails now, not after the runs */
    const upf_status tst = upf_timeline_probe();
    if (tst != UPF_OK)
      return upf_cli_error(tst, "prefill: --timeline");
  }
  if (a.chunk && (a.tp > 1 || a.comm || a.dump_dir || a.replay_dir || a.ideal || a.out_argmax || a.out_nll)) {
    fprintf(stderr, "upf prefill: --chunk runs through a session on one rank: not with --tp, --comm, --dump-masks, "
                    "--replay-masks, --ideal, --out-argmax or --out-nll\n");
    return 2;
  }
  upf_select_args_apply(&a.sa, &opt.select);
  a.sa.p = opt.select.p; /* the JSON's p: the model's when --p was not given */
  const upf_dtype dtype = a.sel.dt;
  const char *dirs[2] = {a.dump_dir, a.replay_dir};
  for (int i = 0; i < 2; i++)
    if (dirs[i] && !is_dir(dirs[i])) {
      fprintf(stderr, "upf prefill: %s %s: not a directory\n", i ? "--replay-masks" : "--dump-masks", dirs[i]);
      return 2;
    }
  const upf_arg_path paths[] = {{"--token-ids", a.ids_path, 0},    {"--cu-seqlens", a.cu_path, 0},
                                {"--file", a.text_file, 0},        {"--gguf", a.sel.gguf, 0},
                                {"--replay-masks", a.replay_dir, 0, 1},
                                {"--out-logits", a.out_logits, 1}, {"--json", a.json, 1},
                                {"--out-argmax", a.out_argmax, 1}, {"--out-nll", a.out_nll, 1},
                                {"--dump-masks", a.dump_dir, 1, 1}, {"--dump-tables", a.dump_tables, 1, 1},
                                {"--timeline", a.timeline, 1}};
  if (!upf_args_check_paths("upf prefill", paths, (int)(sizeof paths / sizeof *paths)))
    return 2;
  const upf_backend *be = a.sel.be;
  upf_status st = UPF_OK;

  /* the ids and the lengths are checked before the weights are built */
  int32_t *ids = NULL, *cu = NULL, B = 0;
  if (!build_batch(&a, cfg, &ids, &cu, &B)) {
    free(ids), free(cu);
    return 2;
  }

  /* --out-nll: the next token of the request at each position, -1 after its last */
  int32_t *targets = NULL;
  if (a.out_argmax || a.out_nll) {
    opt.per_position = 1;
    if (a.out_nll) {
      targets = malloc((size_t)cu[B] * sizeof *targets);
      if (!targets) {
        free(ids), free(cu);
        return upf_cli_error(UPF_ERR_NOMEM, "prefill: --out-nll");
      }
      for (int32_t r = 0; r < B; r++)
        for (int32_t t = cu[r]; t < cu[r + 1]; t++)
          targets[t] = t + 1 < cu[r + 1] ? ids[t + 1] : -1;
      opt.targets = targets;
    }
  }
  if (a.plan_only) {
    const int rc_plan = plan_only(&a, &opt, cu, B);
    free(ids), free(cu), free(targets);
    return rc_plan;
  }
  upf_comm *comm = NULL;
  if (!upf_cli_tp_open("prefill", a.comm, a.tp, be, &comm)) {
    free(ids), free(cu), free(targets);
    return 2;
  }
  const int rank0 = upf_comm_rank(comm) == 0; /* prints and writes; the other ranks only compute */
  upf_model m;
  st = upf_model_args_build_tp("prefill", &a.sel, comm, rank0, &m);
  if (st != UPF_OK) {
    free(ids), free(cu), free(targets);
    upf_comm_destroy(comm);
    return upf_cli_error(st, "prefill: building the model");
  }
  /* with --chunk the widest step is the first: every request's first chunk */
  int32_t *cu_plan = malloc((size_t)(B + 1) * sizeof *cu_plan);
  if (!cu_plan) {
    free(ids), free(cu), free(targets);
    upf_model_free(&m);
    upf_comm_destroy(comm);
    return upf_cli_error(upf_fail(UPF_ERR_NOMEM, "prefill: the memory plan"), "prefill");
  }
  cu_plan[0] = 0;
  for (int32_t r = 0; r < B; r++)
    cu_plan[r + 1] = cu_plan[r] + (a.chunk && cu[r + 1] - cu[r] > a.chunk ? a.chunk : cu[r + 1] - cu[r]);
  upf_memory_plan plan;
  st = upf_model_memory_plan_batch(&m, cu_plan, B, &opt, &plan);
  if (st != UPF_OK) {
    free(ids), free(cu), free(targets), free(cu_plan);
    upf_model_free(&m);
    upf_comm_destroy(comm);
    return upf_cli_error(st, "prefill: --mode flashprefill");
  }
  if (rank0)
    print_plan(stderr, &m, &plan, cu_plan[B], B);
  if (rank0 && a.chunk)
    fprintf(stderr, "chunked prefill: chunks of at most %d tokens (the plan above is the widest step's); the session's "
                    "paged KV cache holds every request's whole prompt%s\n", a.chunk,
            opt.mode == UPF_PREFILL_UNIPREFILL ? "; uniprefill: chunks with cached context run dense (every chunk of a "
                                                 "prompt split in more than one chunk)" : "");
  if (rank0 && opt.mode == UPF_PREFILL_FLASHPREFILL) {
    char params[256];
    upf_sparse_args_describe(&a.fa.params, params, sizeof params);
    fprintf(stderr, "flashprefill: %s\n", params);
  }
  if (rank0 && opt.mode == UPF_PREFILL_COMPACT) {
    char params[256];
    upf_sparse_args_describe(&a.fa.params, params, sizeof params);
    fprintf(stderr, "compact: %s, recent %d\n", params, opt.compact.recent);
  }

  upf_tensor masks[UPF_MODEL_MAX_LAYERS];
  const uint8_t *mask_ptrs[UPF_MODEL_MAX_LAYERS] = {0};
  int64_t mask_lens[UPF_MODEL_MAX_LAYERS] = {0};
  memset(masks, 0, sizeof masks);
  int rc = 0;
  if (a.replay_dir) {
    if (!read_masks(a.replay_dir, &m, cu[B], masks, mask_ptrs, mask_lens))
      rc = 2;
    opt.replay_masks = mask_ptrs, opt.replay_mask_len = mask_lens;
  }
  if (isatty(2) && rank0)
    opt.on_layer = progress, opt.user = &m;
  upf_prefill_result res = {0};
  ideal_times ideal = {0};
  double *totals = calloc((size_t)a.iters, sizeof *totals);
  chunk_record cr = {0, NULL, calloc((size_t)B, sizeof(int32_t))};
  char replay_what[1100];
  snprintf(replay_what, sizeof replay_what, "prefill: --replay-masks %s", a.replay_dir ? a.replay_dir : "");
  /* every output of the run lands together or none does: the set is opened before the run, whose last
   * iteration stages the --dump-tables files in it */
  upf_outputs *outs = NULL;
  if (rc == 0 && rank0 && (st = upf_outputs_create(&outs, 0)) != UPF_OK)
    rc = upf_cli_error(st, "prefill");
  table_dump dump = {a.dump_tables, outs, 0, UPF_OK, {0}, 0};
  upf_prefill_result first; /* --check-determinism: the first run, every later one compared with it */
  memset(&first, 0, sizeof first);
  int runs_compared = 0;
  char difference[256] = "";
  for (int it = 0; rc == 0 && it < a.warmup + a.iters; it++) {
    if (a.check_determinism && it == 1) { /* keep run 1; a later run is compared below */
      first = res;
      memset(&res, 0, sizeof res);
    }
    upf_prefill_result_free(&res);
    table_dump *dump_now = a.dump_tables && rank0 && it + 1 == a.warmup + a.iters ? &dump : NULL;
    st = a.chunk ? chunked_run(&m, ids, cu, B, &opt, a.chunk, dump_now, &res, &cr)
                 : upf_model_prefill(&m, ids, cu, B, &opt, &res);
    if (st != UPF_OK)
      rc = upf_cli_error(st, a.replay_dir ? replay_what : "prefill");
    else if (it >= a.warmup)
      totals[it - a.warmup] = res.total_seconds;
    if (rc == 0 && a.check_determinism && it >= 1 && !difference[0]) {
      char where[200];
      if (upf_prefill_result_identical(&first, &res, where, sizeof where))
        runs_compared++;
      else
        snprintf(difference, sizeof difference, "run %d differs from run 1: %s", it + 1, where);
    }
  }
  upf_prefill_result_free(&first);
  /* --timeline: one more run, recorded by CUPTI; not among the timed runs */
  upf_timeline tl;
  upf_timeline_summary tls;
  memset(&tl, 0, sizeof tl);
  double traced_s = 0;
  if (rc == 0 && a.timeline) {
    upf_prefill_result tr;
    memset(&tr, 0, sizeof tr);
    chunk_record tcr = {0, NULL, calloc((size_t)B, sizeof(int32_t))};
    st = a.chunk && !tcr.chunks ? upf_fail(UPF_ERR_NOMEM, "--timeline: chunk record") : upf_timeline_start();
    if (st == UPF_OK) {
      st = a.chunk ? chunked_run(&m, ids, cu, B, &opt, a.chunk, NULL, &tr, &tcr) : upf_model_prefill(&m, ids, cu, B, &opt, &tr);
      const upf_status stop = upf_timeline_stop(&tl);
      st = st == UPF_OK ? stop : st;
    }
    if (st == UPF_OK)
      st = upf_timeline_summarize(&tl, &tls);
    traced_s = tr.total_seconds;
    upf_prefill_result_free(&tr);
    free(tcr.chunks), free(tcr.step_seconds);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill: --timeline");
  }
  if (rc == 0 && rank0) {
    printf("%s%s, %s, %s on %s: %d requests, %d tokens\n", cfg->name, upf_model_args_label(&a.sel), a.sa.mode, upf_dtype_name(dtype), be->name, B,
           cu[B]);
    if (comm)
      printf("  tensor parallel: %d ranks (%s), %lld all-reduces of %.3f MB per rank, %.3f ms\n", m.tp_size,
             upf_comm_kind_name(upf_comm_kind_of(comm)), (long long)res.comm_calls, res.comm_bytes / 1e6,
             res.comm_seconds * 1e3);
    for (int k = 0; comm && k < res.num_drops; k++)
      printf("  drop layer %2d (tp): block scores %.0f bytes all-reduced in %.3f ms of a %.3f ms selection (block "
             "scores %.3f, top-p %.3f, mask broadcast and check %.3f, expand %.3f ms); %d rank(s) disagreed with rank 0\n",
             res.drops[k].layer, res.drops[k].allreduce_bytes, res.drops[k].allreduce_seconds * 1e3,
             res.drops[k].tp_select_seconds * 1e3, res.drops[k].tp.scores_seconds * 1e3,
             res.drops[k].tp.topp_seconds * 1e3, res.drops[k].tp.check_seconds * 1e3,
             res.drops[k].tp.expand_seconds * 1e3, res.drops[k].disagreeing_ranks);
    for (int k = 0; k < res.num_drops; k++)
      printf("  drop layer %2d: %lld -> %lld tokens (%.1f%%), selection + compaction %.3f ms\n", res.drops[k].layer,
             (long long)res.drops[k].tokens_in, (long long)res.drops[k].tokens_kept,
             100.0 * (double)res.drops[k].tokens_kept / (double)res.drops[k].tokens_in, res.drops[k].select_seconds * 1e3);
    double *sorted = malloc((size_t)a.iters * sizeof *sorted);
    memcpy(sorted, totals, (size_t)a.iters * sizeof *sorted);
    qsort(sorted, (size_t)a.iters, sizeof *sorted, cmp_double);
    printf("  prefill %.3f ms (median of %d)\n", sorted[a.iters / 2] * 1e3, a.iters);
    if (a.check_determinism && difference[0])
      printf("  determinism: %s\n", difference);
    else if (a.check_determinism)
      printf("  determinism: %d runs of the same batch, logits and drop masks bitwise identical to the first\n",
             runs_compared + 1);
    if (a.chunk) {
      int32_t chunked = 0;
      for (int32_t r = 0; r < B; r++)
        chunked += cr.chunks[r] > 1;
      printf("  chunked prefill: chunks of at most %d tokens over %d steps (their times summed); %d of %d requests in "
             "more than one chunk%s\n", a.chunk, cr.steps, chunked, B,
             opt.mode == UPF_PREFILL_UNIPREFILL ? "; chunks with cached context ran dense (every chunk of a prompt "
                                                  "split in more than one chunk)" : "");
    }
    if (opt.mode == UPF_PREFILL_FLASHPREFILL) {
      char params[256];
      upf_sparse_args_describe(&a.fa.params, params, sizeof params);
      double index_s = 0, attn_s = 0;
      for (int i = 0; i < res.num_sparse; i++)
        index_s += res.sparse[i].index_seconds, attn_s += res.sparse[i].attn_seconds;
      printf("  flashprefill (%s): kept share %.4f of the visible key blocks over %d full-attention layers; block "
             "means + index %.3f ms, block-sparse attention %.3f ms (last run)\n",
             params, upf_prefill_kept_share(&res), res.num_sparse, index_s * 1e3, attn_s * 1e3);
      for (int i = 0; i < res.num_sparse; i++) {
        const upf_sparse_record *r = &res.sparse[i];
        printf("  full layer %2d: kept %lld of %lld key blocks, kept share %.4f; means + index %.3f ms, attention "
               "%.3f ms\n", r->layer, (long long)r->kept_blocks, (long long)r->visible_blocks,
               r->visible_blocks ? (double)r->kept_blocks / (double)r->visible_blocks : 1.0, r->index_seconds * 1e3,
               r->attn_seconds * 1e3);
        if (a.index_sharing)
          printf("                 shared with the previous query tile: %lld of %lld kept blocks (%.4f)\n",
                 (long long)r->neighbour_shared, (long long)r->neighbour_total,
                 r->neighbour_total ? (double)r->neighbour_shared / (double)r->neighbour_total : 0.0);
      }
    }
    if (opt.mode == UPF_PREFILL_COMPACT) {
      char params[256];
      upf_sparse_args_describe(&a.fa.params, params, sizeof params);
      double attn_s = 0;
      for (int i = 0; i < res.num_sparse; i++)
        attn_s += res.sparse[i].attn_seconds;
      printf("  compact (%s, recent %d): kept share %.4f of the chunks' visible key blocks over %d full-attention "
             "layers (chunks with cached context; the others ran dense); compact attention %.3f ms (last run)\n",
             params, opt.compact.recent, upf_prefill_kept_share(&res), res.num_sparse, attn_s * 1e3);
      for (int i = 0; i < res.num_sparse; i++) {
        const upf_sparse_record *r = &res.sparse[i];
        printf("  full layer %2d: kept %lld of %lld key blocks, kept share %.4f; compact attention %.3f ms\n",
               r->layer, (long long)r->kept_blocks, (long long)r->visible_blocks,
               r->visible_blocks ? (double)r->kept_blocks / (double)r->visible_blocks : 1.0, r->attn_seconds * 1e3);
      }
    }
    if (a.timeline) {
      printf("  timeline of one more run (%.3f ms with CUPTI recording; not in the median), %s:\n", traced_s * 1e3,
             a.timeline);
      upf_timeline_print(stdout, "    ", &tl, &tls);
    }
    if (a.ideal && !comm) { /* the dense runs are collective under TP: every rank measures below */
      st = measure_ideal(&m, cu, B, &res, &ideal);
      if (st != UPF_OK)
        rc = upf_cli_error(st, "prefill: --ideal");
      else
        printf("  dense %.3f ms; ideal at the kept counts %.3f ms; UniPrefill = %.2fx faster than dense, %.3f of the "
               "ideal; selection + compaction %.3f ms = %.2f%% of its TTFT\n",
               ideal.dense_s * 1e3, ideal.ideal_s * 1e3, ideal.dense_s / sorted[a.iters / 2],
               sorted[a.iters / 2] / ideal.ideal_s, ideal.select_s * 1e3, 100.0 * ideal.select_s / sorted[a.iters / 2]);
    }
    free(sorted);
  }
  if (rc == 0 && a.ideal && comm) {
    st = measure_ideal(&m, cu, B, &res, &ideal);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill: --ideal");
    else if (rank0)
      printf("  dense %.3f ms; ideal at the kept counts %.3f ms; selection + compaction %.3f ms\n", ideal.dense_s * 1e3,
             ideal.ideal_s * 1e3, ideal.select_s * 1e3);
  }
  if (rc == 0 && a.out_logits && rank0) {
    upf_tensor t;
    const int64_t shape[2] = {B, cfg->vocab};
    upf_tensor_init(&t, res.logits, UPF_DTYPE_F32, 2, shape);
    st = upf_npy_write_to(outs, a.out_logits, "--out-logits", &t);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill");
  }
  const int64_t tshape[1] = {cu[B]};
  if (rc == 0 && rank0 && a.out_argmax) {
    upf_tensor t;
    upf_tensor_init(&t, res.argmax, UPF_DTYPE_I32, 1, tshape);
    st = upf_npy_write_to(outs, a.out_argmax, "--out-argmax", &t);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill");
  }
  if (rc == 0 && rank0 && a.out_nll) {
    upf_tensor t;
    upf_tensor_init(&t, res.nll, UPF_DTYPE_F64, 1, tshape);
    st = upf_npy_write_to(outs, a.out_nll, "--out-nll", &t);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill");
  }
  for (int k = 0; rc == 0 && rank0 && a.dump_dir && k < res.num_drops; k++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/layer%d.npy", a.dump_dir, res.drops[k].layer);
    upf_tensor t;
    const int64_t shape[1] = {res.drops[k].tokens_in};
    upf_tensor_init(&t, res.drops[k].mask, UPF_DTYPE_U8, 1, shape);
    st = upf_npy_write_to(outs, path, "--dump-masks", &t);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill");
  }
  if (rc == 0 && a.json && rank0) {
    st = write_json(outs, a.json, &a, &m, cu, B, &res, totals, a.iters, &plan, &ideal, &cr, a.timeline ? &tl : NULL,
                    &tls, traced_s, argc, argv);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill");
  }
  if (rc == 0 && a.timeline && rank0) {
    FILE *f = NULL;
    st = upf_outputs_open(outs, a.timeline, "--timeline", &f);
    if (st == UPF_OK)
      st = upf_timeline_write_chrome(f, &tl, a.timeline);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "prefill");
  }
  upf_timeline_free(&tl);
  if (rc == 0 && outs && (st = upf_outputs_commit(outs)) != UPF_OK)
    rc = upf_cli_error(st, "prefill");
  upf_outputs_free(outs); /* after a failure: the staged files go, then the folders made for them */
  if (rc != 0)
    table_dump_undo(&dump);
  upf_prefill_result_free(&res);
  for (int k = 0; k < UPF_MODEL_MAX_LAYERS; k++)
    upf_tensor_free(&masks[k]);
  free(totals), free(ids), free(cu), free(targets), free(cu_plan), free(cr.chunks), free(cr.step_seconds);
  upf_model_free(&m);
  upf_comm_destroy(comm);
  if (rc == 0 && difference[0]) {
    fprintf(stderr, "upf prefill: --check-determinism: %s\n", difference);
    rc = 1;
  }
  return rc;
}

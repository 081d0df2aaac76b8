/* upf: the command-line front end. `upf select` runs one drop layer's selection on .npy inputs,
 * `upf verify` checks a backend against the CPU reference, `upf report` is the main job (verify +
 * benchmarks + summary), `upf ops` lists the op table and its kernel variants. Library calls return
 * a status; this file turns it into an exit code and a message that names the flag at fault. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "uniprefill/backend.h"
#include "uniprefill/npy.h"
#include "uniprefill/variant.h"
#include "verify/verify.h"

int upf_cli_error(upf_status st, const char *what) {
  fprintf(stderr, "upf %s: %s (%s)\n", what, upf_last_error(), upf_status_name(st));
  return 1;
}

/* ---- select ---- */

static const char select_usage[] =
    "usage: upf select --q Q.npy --k K.npy --cu-seqlens CU.npy --out-mask MASK.npy [--out-blocks B.npy]\n"
    "                  [--out-kept KEPT.npy] [--p 0.99] [--block 64] [--sink 128] [--last-q 128] [--scale S]\n"
    "                  [--topk K] [--backend cpu|cuda] [--tp R] [--comm auto|single|mpi|nccl]\n"
    "  Runs one drop layer's token selection (SPEC section 2) on a varlen batch.\n"
    "  Q (T, Hq, D) and K (T, Hkv, D) as <f4 (fp32) or <u2 (bf16 bits); CU <i4 (B+1).\n"
    "  MASK is |u1 (T,); B is <f4 block scores; KEPT is <i4 kept token indices.\n"
    "  Outputs are written only once the whole selection succeeded; each output names its own file, in\n"
    "  an existing directory. A symbolic link is followed; a FIFO or /dev/stdout is written through.\n"
    "  --tp R (under mpirun -np R): each rank scores its Hq/R heads, the block scores are all-reduced and\n"
    "  rank 0's mask is used everywhere (SPEC section 5); rank 0 writes the outputs, the others nothing.\n";

typedef struct {
  const char *q, *k, *cu, *out_mask, *out_blocks, *out_kept, *backend, *comm_kind;
  upf_select_params params;
  int32_t tp;
  upf_comm *comm; /* NULL: one plain process */
} select_args;

/* The input a failure of validation or of the selection lies with, from the status and the
 * library's message, which names q, k or cu_seqlens first; writes "select: --q Q.npy" into buf. */
static const char *select_blame(upf_status st, const select_args *a, char *buf, size_t cap) {
  const char *msg = upf_last_error();
  if (st == UPF_ERR_CU_SEQLENS || !strncmp(msg, "cu_seqlens", 10))
    snprintf(buf, cap, "select: --cu-seqlens %s", a->cu);
  else if (!strncmp(msg, "q: ", 3))
    snprintf(buf, cap, "select: --q %s", a->q);
  else if (!strncmp(msg, "k: ", 3))
    snprintf(buf, cap, "select: --k %s", a->k);
  else if (st == UPF_ERR_SHAPE || st == UPF_ERR_DTYPE)
    snprintf(buf, cap, "select: --q %s and --k %s", a->q, a->k);
  else
    snprintf(buf, cap, "select (--backend %s)", a->backend);
  return buf;
}

/* Copies of the host inputs and outputs in the backend's memory. */
typedef struct {
  const upf_backend *be;
  void *ptr[10];
  int count;
} backend_allocs;

static upf_status put(backend_allocs *m, void **dst, const void *src, size_t bytes) {
  UPF_TRY(m->be->alloc(dst, bytes ? bytes : 1));
  m->ptr[m->count++] = *dst;
  return src ? m->be->upload(*dst, src, bytes) : UPF_OK;
}

static void release_all(backend_allocs *m) {
  for (int i = 0; i < m->count; i++)
    m->be->release(m->ptr[i]);
}

static upf_status run_select(const select_args *a, const upf_backend *be, const upf_tensor *q, const upf_tensor *k,
                             const upf_tensor *cu, upf_tensor *mask, upf_tensor *blocks, upf_tensor *kept) {
  upf_select_inputs in = {.q = *q, .k = *k, .cu_seqlens_host = cu->data, .num_reqs = (int32_t)(cu->shape[0] - 1)};
  UPF_TRY(upf_select_validate(&in, &a->params));
  UPF_TRY(be->probe());
  int64_t T = q->shape[0], B = in.num_reqs;
  int64_t *off = malloc((size_t)(B + 1) * sizeof *off);
  if (!off)
    return upf_fail(UPF_ERR_NOMEM, "select: block offsets");
  upf_select_block_offsets(cu->data, (int32_t)B, a->params.block, off);
  int64_t nb = off[B];
  free(off);
  int64_t tshape[1] = {T}, bshape[1] = {nb};
  UPF_TRY(upf_tensor_alloc(mask, UPF_DTYPE_U8, 1, tshape));
  UPF_TRY(upf_tensor_alloc(blocks, UPF_DTYPE_F32, 1, bshape));
  UPF_TRY(upf_tensor_alloc(kept, UPF_DTYPE_I32, 1, tshape));
  backend_allocs m = {.be = be};
  upf_select_outputs out = {0};
  size_t elem = upf_dtype_size(q->dtype);
  void *dq, *dk, *dcu, *ncu, *cnt;
  upf_status st = put(&m, &dq, q->data, (size_t)upf_tensor_numel(q) * elem);
  if (st == UPF_OK)
    st = put(&m, &dk, k->data, (size_t)upf_tensor_numel(k) * elem);
  if (st == UPF_OK)
    st = put(&m, &dcu, cu->data, (size_t)(B + 1) * 4);
  if (st == UPF_OK)
    st = put(&m, (void **)&out.block_score, NULL, (size_t)nb * 4);
  if (st == UPF_OK)
    st = put(&m, (void **)&out.token_mask, NULL, (size_t)T);
  if (st == UPF_OK)
    st = put(&m, (void **)&out.kept_index, NULL, (size_t)T * 4);
  if (st == UPF_OK)
    st = put(&m, &ncu, NULL, (size_t)(B + 1) * 4);
  if (st == UPF_OK)
    st = put(&m, &cnt, NULL, (size_t)B * 4);
  if (st == UPF_OK) {
    in.q.data = dq, in.k.data = dk, in.cu_seqlens = dcu;
    out.new_cu_seqlens = ncu, out.kept_count = cnt;
    if (a->comm) { /* this rank's heads of q and k, in place */
      upf_head_split hs;
      st = upf_head_split_of((int32_t)q->shape[1], (int32_t)k->shape[1], upf_comm_rank(a->comm),
                             upf_comm_size(a->comm), &hs);
      in.q.data = (char *)dq + (size_t)hs.q0 * q->stride[1] * elem, in.q.shape[1] = hs.nq;
      in.k.data = (char *)dk + (size_t)hs.kv0 * k->stride[1] * elem, in.k.shape[1] = hs.nkv;
      upf_select_tp_stats ts;
      if (st == UPF_OK)
        st = upf_select_tp_run(a->comm, be, &in, &a->params, &out, NULL, &ts);
      if (st == UPF_OK && upf_comm_rank(a->comm) == 0)
        fprintf(stderr, "upf select (%s, tp %d): %d query heads a rank; %.0f bytes of block scores all-reduced in %.3f ms "
                        "of %.3f ms; %d rank(s) disagreed with rank 0\n",
                be->name, upf_comm_size(a->comm), hs.nq, ts.allreduce_bytes, ts.allreduce_seconds * 1e3,
                ts.seconds * 1e3, ts.disagreeing_ranks);
    } else {
      st = be->select_run(&in, &a->params, &out);
    }
  }
  if (st == UPF_OK)
    st = be->download(mask->data, out.token_mask, (size_t)T);
  if (st == UPF_OK)
    st = be->download(blocks->data, out.block_score, (size_t)nb * 4);
  if (st == UPF_OK)
    st = be->download(kept->data, out.kept_index, (size_t)out.kept_total * 4);
  if (st == UPF_OK) {
    kept->shape[0] = out.kept_total;
    int32_t *counts = malloc((size_t)B * 4);
    if (counts && be->download(counts, cnt, (size_t)B * 4) == UPF_OK && upf_comm_rank(a->comm) == 0) {
      fprintf(stderr, "upf select (%s): kept %lld of %lld tokens;", be->name, (long long)out.kept_total, (long long)T);
      for (int64_t r = 0; r < B && r < 16; r++)
        fprintf(stderr, " %d/%d", counts[r], ((int32_t *)cu->data)[r + 1] - ((int32_t *)cu->data)[r]);
      fprintf(stderr, B > 16 ? " ...\n" : "\n");
    }
    free(counts);
  }
  release_all(&m);
  return st;
}


/* Each selection parameter given is checked on its own against the defaults (which pass), so a bad
 * value is reported under its flag. */
static int check_select_params(const upf_arg_parser *p, const select_args *given, upf_select_params *out) {
  const upf_select_params *g = &given->params;
  static const char *const flags[] = {"--p", "--block", "--sink", "--last-q", "--topk", "--scale"};
  *out = upf_select_params_default();
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
    if (!upf_args_find(p, flags[i])->seen)
      continue;
    switch (i) {
    case 0: out->p = g->p; break;
    case 1: out->block = g->block; break;
    case 2: out->sink = g->sink; break;
    case 3: out->last_q = g->last_q; break;
    case 4: out->topk = g->topk; break;
    default: out->scale = g->scale; break;
    }
    upf_status st = upf_select_params_check(out);
    if (st != UPF_OK) {
      char what[32];
      snprintf(what, sizeof what, "select: %s", flags[i]);
      upf_cli_error(st, what);
      return 0;
    }
  }
  return 1;
}

static int cmd_select(int argc, char **argv) {
  select_args a = {.backend = "cpu", .params = upf_select_params_default(), .tp = 1};
  upf_arg args[] = {
      {"--q", UPF_ARG_STRING, &a.q, 1},
      {"--k", UPF_ARG_STRING, &a.k, 1},
      {"--cu-seqlens", UPF_ARG_STRING, &a.cu, 1},
      {"--out-mask", UPF_ARG_STRING, &a.out_mask, 1},
      {"--out-blocks", UPF_ARG_STRING, &a.out_blocks},
      {"--out-kept", UPF_ARG_STRING, &a.out_kept},
      {"--backend", UPF_ARG_STRING, &a.backend},
      {"--p", UPF_ARG_FLOAT, &a.params.p},
      {"--block", UPF_ARG_INT, &a.params.block},
      {"--sink", UPF_ARG_INT, &a.params.sink},
      {"--last-q", UPF_ARG_INT, &a.params.last_q},
      {"--topk", UPF_ARG_INT, &a.params.topk},
      {"--scale", UPF_ARG_FLOAT, &a.params.scale},
      {"--tp", UPF_ARG_INT, &a.tp, 0, 1, 1 << 16},
      {"--comm", UPF_ARG_STRING, &a.comm_kind},
  };
  upf_arg_parser p = {"upf select", select_usage, args, (int)(sizeof args / sizeof args[0])};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  upf_select_params params;
  if (!check_select_params(&p, &a, &params))
    return 2;
  a.params = params;
  const upf_backend *be = upf_backend_by_name(a.backend);
  if (!be) {
    upf_cli_error(UPF_ERR_INVALID_ARG, "select: --backend");
    return 2;
  }
  const upf_arg_path paths[] = {
      {"--q", a.q, 0},           {"--k", a.k, 0},           {"--cu-seqlens", a.cu, 0},
      {"--out-mask", a.out_mask, 1}, {"--out-blocks", a.out_blocks, 1}, {"--out-kept", a.out_kept, 1},
  };
  if (!upf_args_check_paths("upf select", paths, (int)(sizeof paths / sizeof paths[0])))
    return 2;

  if (!upf_cli_tp_open("select", a.comm_kind, a.tp, be, &a.comm))
    return 2;
  const int rank0 = upf_comm_rank(a.comm) == 0; /* writes the outputs; the other ranks only compute */
  upf_tensor q = {0}, k = {0}, cu = {0}, mask = {0}, blocks = {0}, kept = {0};
  char what[1200] = "select: --q";
  upf_status st = upf_npy_read(a.q, &q);
  if (st == UPF_OK && (st = upf_npy_read(a.k, &k)) != UPF_OK)
    snprintf(what, sizeof what, "select: --k");
  if (st == UPF_OK && (st = upf_npy_read(a.cu, &cu)) != UPF_OK)
    snprintf(what, sizeof what, "select: --cu-seqlens");
  if (st == UPF_OK && (cu.dtype != UPF_DTYPE_I32 || cu.ndim != 1 || cu.shape[0] < 2)) {
    st = upf_fail(UPF_ERR_SHAPE, "%s: cu_seqlens must be a 1-D <i4 array of B+1 >= 2 entries (got %s, %d dims)",
                  a.cu, upf_dtype_name(cu.dtype), cu.ndim);
    snprintf(what, sizeof what, "select: --cu-seqlens");
  }
  if (st == UPF_OK && (st = run_select(&a, be, &q, &k, &cu, &mask, &blocks, &kept)) != UPF_OK)
    select_blame(st, &a, what, sizeof what);
  /* Outputs are written only after the whole selection succeeded, and land together or not at all
   * (uniprefill/output.h). */
  const char *out_flag[3] = {"--out-mask", "--out-blocks", "--out-kept"};
  const char *out_path[3] = {a.out_mask, a.out_blocks, a.out_kept};
  const upf_tensor *out_tensor[3] = {&mask, &blocks, &kept};
  upf_outputs *outs = NULL;
  if (st == UPF_OK && rank0) {
    snprintf(what, sizeof what, "select");
    st = upf_outputs_create(&outs, 0);
    for (int i = 0; i < 3 && st == UPF_OK; i++)
      if (out_path[i])
        st = upf_npy_write_to(outs, out_path[i], out_flag[i], out_tensor[i]);
    if (st == UPF_OK)
      st = upf_outputs_commit(outs);
    upf_outputs_free(outs);
  }
  upf_tensor_free(&q), upf_tensor_free(&k), upf_tensor_free(&cu);
  upf_tensor_free(&mask), upf_tensor_free(&blocks), upf_tensor_free(&kept);
  upf_comm_destroy(a.comm);
  return st == UPF_OK ? 0 : upf_cli_error(st, what);
}

/* ---- verify ---- */

static const char verify_usage[] =
    "usage: upf verify [all|model|<op or op-name prefix>] [--backend cpu|cuda] [--quick] [--log FILE]\n"
    "                  [--variant op=name[,op=name...]] [--case TEXT]\n"
    "  Checks every op of the backend (default: cuda if usable, else cpu) against the CPU reference;\n"
    "  on the cpu, the reference against golden cases and invariants. An op with kernel variants runs\n"
    "  its checks once per variant; --variant op=name runs that op's named variant alone, and the model\n"
    "  checks with it (upf ops lists them; UPF_VARIANT=op=name,... does the same).\n"
    "  `model` (model.prefill) runs the tiny model of every family, dense and UniPrefill, f32 and bf16,\n"
    "  against the CPU reference (after the ops under `all`; not on the cpu itself: see make test);\n"
    "  `model.generate` greedy generation through a session, each decode step's logits and picks.\n"
    "  --case TEXT runs only the seeded cases whose name holds TEXT (their names are the log's variant\n"
    "  column, e.g. --case '1M'); golden cases and bad-input checks still run. For the model checks\n"
    "  TEXT picks the tiny models whose name holds it (e.g. --case qwen3-next).\n";

const upf_backend *upf_cli_default_backend(void) {
  const upf_backend *cuda = upf_backend_cuda();
  return cuda->probe() == UPF_OK ? cuda : upf_backend_cpu();
}

int upf_cli_verify(const upf_backend *be, const char *filter, int quick, const char *case_filter, FILE *log) {
  upf_verify_ctx ctx = {.backend = be, .log = log, .quick = quick, .case_filter = case_filter};
  fprintf(log, "# upf verify %s on %s: %s%s%s%s%s\n", filter, be->name, be->describe(),
          be == upf_backend_cpu() ? " (golden cases, invariants, stage chain vs pipeline)" : " vs the CPU reference",
          case_filter ? " (seeded cases named '" : "", case_filter ? case_filter : "", case_filter ? "' only)" : "");
  upf_verify_run(&ctx, filter);
  fprintf(log, "# %d checks: %d passed, %d failed\n", ctx.passed + ctx.failed, ctx.passed, ctx.failed);
  return ctx.failed;
}

static int cmd_verify(int argc, char **argv) {
  const char *filter = "all", *backend = NULL, *log_path = NULL, *variant = NULL, *case_filter = NULL;
  int quick = 0;
  upf_arg args[] = {
      {"--backend", UPF_ARG_STRING, &backend},
      {"--case", UPF_ARG_STRING, &case_filter},
      {"--log", UPF_ARG_STRING, &log_path},
      {"--quick", UPF_ARG_SWITCH, &quick},
      {"--variant", UPF_ARG_STRING, &variant},
  };
  upf_arg_parser p = {"upf verify", verify_usage, args, (int)(sizeof args / sizeof args[0]), &filter, 1};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  if (!upf_verify_filter_known(filter)) {
    fprintf(stderr, "upf verify: '%s' names no op (see upf ops) and no end-to-end check (model.prefill, model.generate)\n", filter);
    return 2;
  }
  upf_status st = variant ? upf_variant_select_spec(variant) : UPF_OK;
  if (st != UPF_OK) {
    upf_cli_error(st, "verify");
    return 2;
  }
  const upf_backend *be = backend ? upf_backend_by_name(backend) : upf_cli_default_backend();
  if (!be) {
    upf_cli_error(UPF_ERR_INVALID_ARG, "verify: --backend");
    return 2;
  }
  const upf_arg_path paths[] = {{"--log", log_path, 1}};
  if (!upf_args_check_paths("upf verify", paths, 1))
    return 2;
  st = be->probe();
  if (st != UPF_OK)
    return upf_cli_error(st, be == upf_backend_cuda() ? "verify (--backend cuda)" : "verify");
  /* the log is an output like any other: it appears whole once the checks are done, a link is
   * followed and a device written through (uniprefill/output.h) */
  FILE *log = stdout;
  upf_outputs *outs = NULL;
  if (log_path) {
    st = upf_outputs_create(&outs, 1);
    if (st == UPF_OK)
      st = upf_outputs_open(outs, log_path, "--log", &log);
    if (st != UPF_OK) {
      upf_outputs_free(outs);
      return upf_cli_error(st, "verify");
    }
  }
  int failed = upf_cli_verify(be, filter, quick, case_filter, log);
  if (outs) {
    st = upf_outputs_commit(outs);
    upf_outputs_free(outs);
    if (st != UPF_OK)
      return upf_cli_error(st, "verify");
    printf("upf verify: %s (%s)\n", failed ? "FAILED" : "passed", log_path);
  }
  return failed ? 1 : 0;
}

/* ---- ops ---- */

static const char ops_usage[] =
    "usage: upf ops\n"
    "  Lists the op table and, under each op that has kernel variants, its variants (the default first)\n"
    "  and the one in effect (UPF_VARIANT=op=name,... or upf verify --variant selects another).\n";

static int cmd_ops(int argc, char **argv) {
  upf_arg_parser p = {"upf ops", ops_usage, NULL, 0};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  for (int op = 0; op < UPF_OP_COUNT; op++) {
    printf("%-22s %s\n", upf_op_name((upf_op)op), upf_op_summary((upf_op)op));
    int n = upf_variant_count((upf_op)op);
    if (n == 0)
      continue;
    upf_variant current;
    upf_status st = upf_variant_current((upf_op)op, &current);
    if (st != UPF_OK)
      return upf_cli_error(st, "ops");
    for (int i = 0; i < n; i++) {
      upf_variant v = upf_variant_of((upf_op)op, i);
      const char *mark = i == 0 ? "(default)" : v == current ? "(in effect)" : "";
      printf("  variant %-14s %-11s %s\n", upf_variant_name(v), mark, upf_variant_summary(v));
    }
  }
  return 0;
}

/* ---- dispatch ---- */

typedef struct {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *usage; /* the command's --help text; its first line is the synopsis */
} command;

static const command commands[] = {
    {"select", cmd_select, select_usage},
    {"verify", cmd_verify, verify_usage},
    {"report", upf_cli_report, upf_cli_report_usage},
    {"ops", cmd_ops, ops_usage},
    {"models", upf_cli_models, upf_cli_models_usage},
    {"prefill", upf_cli_prefill, upf_cli_prefill_usage},
    {"export", upf_cli_export, upf_cli_export_usage},
    {"serve-sim", upf_cli_serve, upf_cli_serve_usage},
    {"generate", upf_cli_generate, upf_cli_generate_usage},
    {"eval", upf_cli_eval, upf_cli_eval_usage},
    {"tokenize", upf_cli_tokenize, upf_cli_tokenize_usage},
    {"block-sparse", upf_cli_block_sparse, upf_cli_block_sparse_usage},
};

static void usage(FILE *out) {
  fprintf(out, "usage: upf <command> [options]; upf <command> --help describes one command\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fputs(commands[i].usage, out);
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name))
      return commands[i].run(argc - 2, argv + 2);
  fprintf(stderr, "upf: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}

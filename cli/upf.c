/* upf: the command-line front end. `upf select` runs one drop layer's selection on .npy inputs,
 * `upf verify` checks a backend against the CPU reference, `upf report` is the main job (verify +
 * benchmarks + summary). Library calls return a status; this file turns it into an exit code. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "uniprefill/backend.h"
#include "uniprefill/npy.h"
#include "verify/verify.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: upf <command> [options]\n"
          "\n"
          "commands:\n"
          "  select   --q Q.npy --k K.npy --cu-seqlens CU.npy --out-mask MASK.npy [--out-blocks B.npy]\n"
          "           [--out-kept KEPT.npy] [--p 0.99] [--block 64] [--sink 128] [--last-q 128] [--scale S]\n"
          "           [--topk K] [--backend cpu|cuda]\n"
          "           Q (T, Hq, D) and K (T, Hkv, D) as <f4 (fp32) or <u2 (bf16 bits); CU <i4 (B+1).\n"
          "           MASK is |u1 (T,); B is <f4 block scores; KEPT is <i4 kept token indices.\n"
          "  verify   [all|<op or op-name prefix>] [--backend cpu|cuda] [--quick] [--log FILE]\n"
          "           Checks every op of the backend (default: cuda if usable, else cpu) against the\n"
          "           CPU reference; on the cpu, the reference against golden cases and invariants.\n"
          "  report   [--out DIR] [--quick] [--no-bench]\n"
          "           The main job: verify, benchmark, and write DIR/summary.md, verify.log, bench.json.\n"
          "  ops      Lists the op table.\n");
}

int upf_cli_error(upf_status st, const char *what) {
  fprintf(stderr, "upf: %s: %s (%s)\n", what, upf_last_error(), upf_status_name(st));
  return 1;
}

/* ---- select ---- */

typedef struct {
  const char *q, *k, *cu, *out_mask, *out_blocks, *out_kept, *backend;
  upf_select_params params;
} select_args;

static int parse_int(const char *flag, const char *text, int32_t *out) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || *end || end == text || v < -2147483647L || v > 2147483647L) {
    fprintf(stderr, "upf: %s: '%s' is not an integer\n", flag, text);
    return 0;
  }
  *out = (int32_t)v;
  return 1;
}

static int parse_float(const char *flag, const char *text, float *out) {
  char *end;
  errno = 0;
  float v = strtof(text, &end);
  if (errno || *end || end == text) {
    fprintf(stderr, "upf: %s: '%s' is not a number\n", flag, text);
    return 0;
  }
  *out = v;
  return 1;
}

static int parse_select_args(int argc, char **argv, select_args *a) {
  memset(a, 0, sizeof *a);
  a->params = upf_select_params_default();
  a->backend = "cpu";
  for (int i = 0; i < argc; i++) {
    const char *flag = argv[i];
    if (i + 1 >= argc) {
      fprintf(stderr, "upf select: %s needs a value\n", flag);
      return 0;
    }
    const char *val = argv[++i];
    int ok = 1;
    if (!strcmp(flag, "--q"))
      a->q = val;
    else if (!strcmp(flag, "--k"))
      a->k = val;
    else if (!strcmp(flag, "--cu-seqlens"))
      a->cu = val;
    else if (!strcmp(flag, "--out-mask"))
      a->out_mask = val;
    else if (!strcmp(flag, "--out-blocks"))
      a->out_blocks = val;
    else if (!strcmp(flag, "--out-kept"))
      a->out_kept = val;
    else if (!strcmp(flag, "--backend"))
      a->backend = val;
    else if (!strcmp(flag, "--p"))
      ok = parse_float(flag, val, &a->params.p);
    else if (!strcmp(flag, "--scale"))
      ok = parse_float(flag, val, &a->params.scale);
    else if (!strcmp(flag, "--block"))
      ok = parse_int(flag, val, &a->params.block);
    else if (!strcmp(flag, "--sink"))
      ok = parse_int(flag, val, &a->params.sink);
    else if (!strcmp(flag, "--last-q"))
      ok = parse_int(flag, val, &a->params.last_q);
    else if (!strcmp(flag, "--topk"))
      ok = parse_int(flag, val, &a->params.topk);
    else {
      fprintf(stderr, "upf select: unknown option %s\n", flag);
      return 0;
    }
    if (!ok)
      return 0;
  }
  if (!a->q || !a->k || !a->cu || !a->out_mask) {
    fprintf(stderr, "upf select: --q, --k, --cu-seqlens and --out-mask are required\n");
    return 0;
  }
  return 1;
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
  if (cu->dtype != UPF_DTYPE_I32 || cu->ndim != 1 || cu->shape[0] < 2)
    return upf_fail(UPF_ERR_SHAPE, "%s: cu_seqlens must be a 1-D <i4 array of B+1 >= 2 entries (got %s, %d dims)",
                    a->cu, upf_dtype_name(cu->dtype), cu->ndim);
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
    st = be->select_run(&in, &a->params, &out);
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
    if (counts && be->download(counts, cnt, (size_t)B * 4) == UPF_OK) {
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

static int cmd_select(int argc, char **argv) {
  select_args a;
  if (!parse_select_args(argc, argv, &a)) {
    usage(stderr);
    return 2;
  }
  const upf_backend *be = upf_backend_by_name(a.backend);
  if (!be)
    return upf_cli_error(UPF_ERR_INVALID_ARG, "--backend");
  upf_tensor q = {0}, k = {0}, cu = {0}, mask = {0}, blocks = {0}, kept = {0};
  upf_status st = upf_npy_read(a.q, &q);
  const char *what = a.q;
  if (st == UPF_OK)
    st = upf_npy_read(a.k, &k), what = a.k;
  if (st == UPF_OK)
    st = upf_npy_read(a.cu, &cu), what = a.cu;
  if (st == UPF_OK)
    st = run_select(&a, be, &q, &k, &cu, &mask, &blocks, &kept), what = "select";
  /* Outputs are written only after the whole selection succeeded; each write is atomic, and a
   * later failure removes the files written before it, so no partial result is left behind. */
  const char *written[3];
  int nwritten = 0;
  if (st == UPF_OK && (st = upf_npy_write(a.out_mask, &mask)) == UPF_OK)
    written[nwritten++] = a.out_mask;
  what = st == UPF_OK ? what : a.out_mask;
  if (st == UPF_OK && a.out_blocks) {
    if ((st = upf_npy_write(a.out_blocks, &blocks)) == UPF_OK)
      written[nwritten++] = a.out_blocks;
    else
      what = a.out_blocks;
  }
  if (st == UPF_OK && a.out_kept) {
    if ((st = upf_npy_write(a.out_kept, &kept)) == UPF_OK)
      written[nwritten++] = a.out_kept;
    else
      what = a.out_kept;
  }
  if (st != UPF_OK)
    for (int i = 0; i < nwritten; i++)
      unlink(written[i]);
  upf_tensor_free(&q), upf_tensor_free(&k), upf_tensor_free(&cu);
  upf_tensor_free(&mask), upf_tensor_free(&blocks), upf_tensor_free(&kept);
  return st == UPF_OK ? 0 : upf_cli_error(st, what);
}

/* ---- verify ---- */

const upf_backend *upf_cli_default_backend(void) {
  const upf_backend *cuda = upf_backend_cuda();
  return cuda->probe() == UPF_OK ? cuda : upf_backend_cpu();
}

int upf_cli_verify(const upf_backend *be, const char *filter, int quick, FILE *log) {
  upf_verify_ctx ctx = {.backend = be, .log = log, .quick = quick};
  fprintf(log, "# upf verify %s on %s: %s%s\n", filter, be->name, be->describe(),
          be == upf_backend_cpu() ? " (golden cases, invariants, stage chain vs pipeline)" : " vs the CPU reference");
  upf_verify_run(&ctx, filter);
  fprintf(log, "# %d checks: %d passed, %d failed\n", ctx.passed + ctx.failed, ctx.passed, ctx.failed);
  return ctx.failed;
}

static int cmd_verify(int argc, char **argv) {
  const char *filter = "all", *backend = NULL, *log_path = NULL;
  int quick = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--backend") && i + 1 < argc)
      backend = argv[++i];
    else if (!strcmp(argv[i], "--log") && i + 1 < argc)
      log_path = argv[++i];
    else if (!strcmp(argv[i], "--quick"))
      quick = 1;
    else if (argv[i][0] != '-')
      filter = argv[i];
    else {
      fprintf(stderr, "upf verify: unknown option %s\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  int matches = !strcmp(filter, "all");
  for (int op = 0; op < UPF_OP_COUNT && !matches; op++)
    matches = !strncmp(upf_op_name((upf_op)op), filter, strlen(filter));
  if (!matches) {
    fprintf(stderr, "upf verify: '%s' names no op (see upf ops)\n", filter);
    return 2;
  }
  const upf_backend *be = backend ? upf_backend_by_name(backend) : upf_cli_default_backend();
  if (!be)
    return upf_cli_error(UPF_ERR_INVALID_ARG, "--backend");
  upf_status st = be->probe();
  if (st != UPF_OK)
    return upf_cli_error(st, be->name);
  FILE *log = stdout;
  if (log_path && !(log = fopen(log_path, "w"))) {
    fprintf(stderr, "upf verify: cannot open %s: %s\n", log_path, strerror(errno));
    return 1;
  }
  int failed = upf_cli_verify(be, filter, quick, log);
  if (log != stdout) {
    fclose(log);
    printf("upf verify: %s (%s)\n", failed ? "FAILED" : "passed", log_path);
  }
  return failed ? 1 : 0;
}

static int cmd_ops(void) {
  for (int op = 0; op < UPF_OP_COUNT; op++)
    printf("%-22s %s\n", upf_op_name((upf_op)op), upf_op_summary((upf_op)op));
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!strcmp(argv[1], "select"))
    return cmd_select(argc - 2, argv + 2);
  if (!strcmp(argv[1], "verify"))
    return cmd_verify(argc - 2, argv + 2);
  if (!strcmp(argv[1], "report"))
    return upf_cli_report(argc - 2, argv + 2);
  if (!strcmp(argv[1], "ops"))
    return cmd_ops();
  fprintf(stderr, "upf: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}

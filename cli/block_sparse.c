/* `upf block-sparse`: one attention layer of FlashPrefill V2 (SPEC section 8, uniprefill/sparse.h) on .npy
 * inputs, through a backend's ops: block means, the index per (KV head, query tile), block-sparse attention
 * over it; writes the output and, on request, the kept-block mask. Flags, bad inputs and outputs behave as
 * in `upf select`: a bad input is reported naming its flag and file before any work, and an output is
 * written only once the whole layer succeeded (atomically), so a failure leaves none behind. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "uniprefill/backend.h"
#include "uniprefill/npy.h"
#include "uniprefill/select.h"
#include "uniprefill/sparse.h"

const char upf_cli_block_sparse_usage[] =
    "usage: upf block-sparse --q Q.npy --k K.npy --v V.npy --cu-seqlens CU.npy --out O.npy [--out-blocks BLK.npy]\n"
    "                        [--alpha A] [--block-m 128] [--block-n 64] [--sink 2] [--window 4] [--last-n 2]\n"
    "                        [--min-sparse-q-len N] [--mean-correction] [--scale S] [--backend cpu|cuda]\n"
    "  Runs one attention layer of FlashPrefill V2 (SPEC section 8) on a varlen batch of self-attention\n"
    "  prefill: the block means of K (and V), the kept key blocks of every (KV head, query tile), and\n"
    "  block-sparse attention over them, with --mean-correction one mean term per unkept visible block.\n"
    "  Q (T, Hq, D), K and V (T, Hkv, D) as <f4 (fp32) or <u2 (bf16 bits), all of one dtype; CU <i4 (B+1).\n"
    "  O is (T, Hq, D) in that dtype. BLK is |u1 (Hkv, query tiles, key blocks), 1 where a block is kept;\n"
    "  the query tiles of all requests in order, ceil(q_len * Hq/Hkv / block_m) a request.\n"
    "  The defaults are the published ones: --alpha 1 (keep a block whose score is >= alpha x the tile's\n"
    "  largest; larger is sparser, 0 keeps every block), --scale 1/sqrt(D).\n"
    "  Outputs are written only once the whole layer succeeded; each output names its own file, in an\n"
    "  existing directory. A symbolic link is followed; a FIFO or /dev/stdout is written through.\n";

typedef struct {
  const char *q, *k, *v, *cu, *out, *out_blocks, *backend;
  upf_sparse_params params;
} bs_args;

/* Each parameter given is checked on its own against the defaults (which pass), so that a bad value is
 * reported under its flag. */
static int check_params(const upf_arg_parser *p, const bs_args *given, upf_sparse_params *out) {
  const upf_sparse_params *g = &given->params;
  static const char *const flags[] = {"--alpha",  "--block-m",          "--block-n", "--sink",
                                      "--window", "--last-n",           "--min-sparse-q-len", "--scale"};
  *out = upf_sparse_params_default();
  out->mean_correction = g->mean_correction;
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
    if (!upf_args_find(p, flags[i])->seen)
      continue;
    switch (i) {
    case 0: out->alpha = g->alpha; break;
    case 1: out->block_m = g->block_m; break;
    case 2: out->block_n = g->block_n; break;
    case 3: out->sink = g->sink; break;
    case 4: out->window = g->window; break;
    case 5: out->last_n = g->last_n; break;
    case 6: out->min_sparse_q_len = g->min_sparse_q_len; break;
    default: out->scale = g->scale; break;
    }
    upf_status st = upf_sparse_params_check(out);
    if (st != UPF_OK) {
      char what[48];
      snprintf(what, sizeof what, "block-sparse: %s", flags[i]);
      upf_cli_error(st, what);
      return 0;
    }
  }
  return 1;
}

/* The inputs against each other, before any work; on failure `what` names the flag(s) at fault and the
 * message the file(s). */
static upf_status check_inputs(const bs_args *a, const upf_tensor *q, const upf_tensor *k, const upf_tensor *v,
                               const upf_tensor *cu, char *what, size_t cap) {
  snprintf(what, cap, "block-sparse: --cu-seqlens");
  if (cu->dtype != UPF_DTYPE_I32 || cu->ndim != 1 || cu->shape[0] < 2)
    return upf_fail(UPF_ERR_SHAPE, "%s: cu_seqlens must be a 1-D <i4 array of B+1 >= 2 entries (got %s, %d dims)",
                    a->cu, upf_dtype_name(cu->dtype), cu->ndim);
  const upf_tensor *t[3] = {q, k, v};
  const char *flag[3] = {"--q", "--k", "--v"}, *path[3] = {a->q, a->k, a->v};
  for (int i = 0; i < 3; i++) {
    snprintf(what, cap, "block-sparse: %s", flag[i]);
    if (t[i]->dtype != UPF_DTYPE_F32 && t[i]->dtype != UPF_DTYPE_BF16)
      return upf_fail(UPF_ERR_DTYPE, "%s: %s, want <f4 (fp32) or <u2 (bf16 bits)", path[i],
                      upf_dtype_name(t[i]->dtype));
    if (t[i]->ndim != 3 || t[i]->shape[0] < 1 || t[i]->shape[1] < 1 || t[i]->shape[2] < 1)
      return upf_fail(UPF_ERR_SHAPE, "%s: want a 3-D array (T, heads, D) of non-zero extents (%d dims)", path[i],
                      t[i]->ndim);
    if (i && t[i]->dtype != q->dtype)
      return upf_fail(UPF_ERR_DTYPE, "%s is %s but %s is %s: one dtype for Q, K and V", path[i],
                      upf_dtype_name(t[i]->dtype), a->q, upf_dtype_name(q->dtype));
  }
  char shape_k[64], shape_v[64];
  snprintf(what, cap, "block-sparse: --v");
  if (memcmp(k->shape, v->shape, 3 * sizeof k->shape[0]))
    return upf_fail(UPF_ERR_SHAPE, "%s has shape %s but %s has %s: K and V must match", a->v,
                    upf_tensor_shape_str(v, shape_v, sizeof shape_v), a->k,
                    upf_tensor_shape_str(k, shape_k, sizeof shape_k));
  snprintf(what, cap, "block-sparse: --q and --k");
  if (q->shape[0] != k->shape[0])
    return upf_fail(UPF_ERR_SHAPE, "%s has %lld rows but %s has %lld: self-attention prefill, a key for every query",
                    a->q, (long long)q->shape[0], a->k, (long long)k->shape[0]);
  if (q->shape[2] != k->shape[2])
    return upf_fail(UPF_ERR_SHAPE, "%s has head dim %lld but %s has %lld", a->q, (long long)q->shape[2], a->k,
                    (long long)k->shape[2]);
  if (q->shape[1] % k->shape[1] != 0)
    return upf_fail(UPF_ERR_SHAPE, "%s: Hq=%lld is not a multiple of Hkv=%lld of %s (GQA)", a->q,
                    (long long)q->shape[1], (long long)k->shape[1], a->k);
  snprintf(what, cap, "block-sparse: --cu-seqlens");
  if (upf_cu_seqlens_check(cu->data, (int32_t)(cu->shape[0] - 1), q->shape[0]) != UPF_OK) {
    char context[1100];
    snprintf(context, sizeof context, "%s: ", a->cu);
    return upf_fail_context(UPF_ERR_CU_SEQLENS, context);
  }
  return UPF_OK;
}

/* Copies of the host inputs and outputs in the backend's memory. */
typedef struct {
  const upf_backend *be;
  void *ptr[12];
  int count;
} bs_allocs;

static upf_status put(bs_allocs *m, void **dst, const void *src, size_t bytes) {
  UPF_TRY(m->be->alloc(dst, bytes ? bytes : 1));
  m->ptr[m->count++] = *dst;
  return src ? m->be->upload(*dst, src, bytes) : UPF_OK;
}

/* The layer on `be`: out (T, Hq, D) and blk (Hkv, tiles, key blocks) host tensors allocated here. */
static upf_status run_layer(const bs_args *a, const upf_backend *be, const upf_tensor *q, const upf_tensor *k,
                            const upf_tensor *v, const upf_tensor *cu, upf_tensor *out, upf_tensor *blk) {
  UPF_TRY(be->probe());
  const int32_t B = (int32_t)(cu->shape[0] - 1), *cu_host = cu->data;
  const int64_t T = q->shape[0], hq = q->shape[1], hkv = k->shape[1], D = q->shape[2];
  const upf_sparse_params *p = &a->params;
  upf_attn_varlen host_batch = {B, cu_host, cu_host, cu_host, cu_host};
  upf_sparse_batch hb = {&host_batch, NULL};
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(&hb, (int32_t)hq, (int32_t)hkv, p, &plan));
  const int64_t S = plan.num_segments, nkb = plan.max_key_blocks, cap = S * nkb;
  const size_t es = upf_dtype_size(q->dtype), means = (size_t)(B * nkb * hkv * D) * es;
  const int64_t blk_shape[3] = {hkv, plan.total_q_tiles, nkb};
  upf_status st = upf_tensor_alloc(out, q->dtype, 3, q->shape);
  if (st == UPF_OK)
    st = upf_tensor_alloc(blk, UPF_DTYPE_U8, 3, blk_shape);
  int32_t *rp = malloc((size_t)(S + 1) * sizeof *rp), *bl = malloc((size_t)(cap ? cap : 1) * sizeof *bl);
  if (st == UPF_OK && (!rp || !bl))
    st = upf_fail(UPF_ERR_NOMEM, "block-sparse: host index of %lld segments", (long long)S);
  bs_allocs m = {.be = be};
  void *dq = NULL, *dk = NULL, *dv = NULL, *dcu = NULL, *dkb = NULL, *dvb = NULL, *drp = NULL, *dbl = NULL,
       *dout = NULL;
  if (st == UPF_OK)
    st = put(&m, &dq, q->data, (size_t)upf_tensor_numel(q) * es);
  if (st == UPF_OK)
    st = put(&m, &dk, k->data, (size_t)upf_tensor_numel(k) * es);
  if (st == UPF_OK)
    st = put(&m, &dv, v->data, (size_t)upf_tensor_numel(v) * es);
  if (st == UPF_OK)
    st = put(&m, &dcu, cu_host, (size_t)(B + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = put(&m, &dkb, NULL, means);
  if (st == UPF_OK && p->mean_correction)
    st = put(&m, &dvb, NULL, means);
  if (st == UPF_OK)
    st = put(&m, &drp, NULL, (size_t)(S + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = put(&m, &dbl, NULL, (size_t)cap * sizeof(int32_t));
  if (st == UPF_OK)
    st = put(&m, &dout, NULL, (size_t)(T * hq * D) * es);
  upf_attn_varlen batch = {B, dcu, cu_host, dcu, cu_host};
  upf_sparse_batch b = {&batch, NULL};
  upf_tensor tq, tk, tv, tkb, tvb, to;
  const int64_t sm[4] = {B, nkb, hkv, D};
  upf_tensor_init(&tq, dq, q->dtype, 3, q->shape), upf_tensor_init(&tk, dk, q->dtype, 3, k->shape);
  upf_tensor_init(&tv, dv, q->dtype, 3, v->shape), upf_tensor_init(&to, dout, q->dtype, 3, q->shape);
  upf_tensor_init(&tkb, dkb, q->dtype, 4, sm), upf_tensor_init(&tvb, dvb, q->dtype, 4, sm);
  upf_sparse_index idx = {drp, dbl, NULL, -1};
  if (st == UPF_OK)
    st = be->sparse_block_means(&b, &tk, &tv, p, &tkb, p->mean_correction ? &tvb : NULL);
  if (st == UPF_OK)
    st = be->sparse_index(&b, &tq, &tkb, p, &idx);
  if (st == UPF_OK)
    st = be->attn_block_sparse(&b, &tq, &tk, &tv, p, &idx, p->mean_correction ? &tkb : NULL,
                               p->mean_correction ? &tvb : NULL, &to);
  if (st == UPF_OK)
    st = be->synchronize();
  if (st == UPF_OK)
    st = be->download(out->data, dout, (size_t)(T * hq * D) * es);
  if (st == UPF_OK)
    st = be->download(rp, drp, (size_t)(S + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->download(bl, dbl, (size_t)idx.kept_total * sizeof(int32_t));
  if (st == UPF_OK) { /* segment s = h * tiles + tile: BLK's row order */
    uint8_t *mask = blk->data;
    memset(mask, 0, (size_t)cap);
    for (int64_t s = 0; s < S && st == UPF_OK; s++)
      for (int32_t i = rp[s]; i < rp[s + 1]; i++) {
        if (bl[i] < 0 || bl[i] >= nkb) {
          st = upf_fail(UPF_ERR_INVALID_ARG, "block-sparse: the index holds block %d outside [0, %lld)", bl[i],
                        (long long)nkb);
          break;
        }
        mask[s * nkb + bl[i]] = 1;
      }
  }
  if (st == UPF_OK) {
    const int64_t visible = upf_sparse_visible_blocks(&hb, &plan, p);
    fprintf(stderr,
            "upf block-sparse (%s): kept %lld of %lld visible key blocks (%.1f%%) over %d query tiles x %lld KV heads; "
            "alpha %g, block %dx%d, %s\n",
            be->name, (long long)idx.kept_total, (long long)visible,
            visible ? 100.0 * (double)idx.kept_total / (double)visible : 0.0, plan.total_q_tiles, (long long)hkv,
            (double)p->alpha, p->block_m, p->block_n, p->mean_correction ? "mean correction" : "no mean correction");
  }
  for (int i = 0; i < m.count; i++)
    be->release(m.ptr[i]);
  free(rp), free(bl);
  upf_sparse_plan_free(&plan);
  return st;
}

int upf_cli_block_sparse(int argc, char **argv) {
  bs_args a = {.backend = "cpu", .params = upf_sparse_params_default()};
  upf_arg args[] = {
      {"--q", UPF_ARG_STRING, &a.q, 1},
      {"--k", UPF_ARG_STRING, &a.k, 1},
      {"--v", UPF_ARG_STRING, &a.v, 1},
      {"--cu-seqlens", UPF_ARG_STRING, &a.cu, 1},
      {"--out", UPF_ARG_STRING, &a.out, 1},
      {"--out-blocks", UPF_ARG_STRING, &a.out_blocks},
      {"--backend", UPF_ARG_STRING, &a.backend},
      {"--alpha", UPF_ARG_FLOAT, &a.params.alpha},
      {"--block-m", UPF_ARG_INT, &a.params.block_m},
      {"--block-n", UPF_ARG_INT, &a.params.block_n},
      {"--sink", UPF_ARG_INT, &a.params.sink},
      {"--window", UPF_ARG_INT, &a.params.window},
      {"--last-n", UPF_ARG_INT, &a.params.last_n},
      {"--min-sparse-q-len", UPF_ARG_INT, &a.params.min_sparse_q_len},
      {"--mean-correction", UPF_ARG_SWITCH, &a.params.mean_correction},
      {"--scale", UPF_ARG_FLOAT, &a.params.scale},
  };
  upf_arg_parser p = {"upf block-sparse", upf_cli_block_sparse_usage, args, (int)(sizeof args / sizeof args[0])};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  upf_sparse_params params;
  if (!check_params(&p, &a, &params))
    return 2;
  a.params = params;
  const upf_backend *be = upf_backend_by_name(a.backend);
  if (!be) {
    upf_cli_error(UPF_ERR_INVALID_ARG, "block-sparse: --backend");
    return 2;
  }
  const upf_arg_path paths[] = {
      {"--q", a.q, 0},     {"--k", a.k, 0}, {"--v", a.v, 0}, {"--cu-seqlens", a.cu, 0},
      {"--out", a.out, 1}, {"--out-blocks", a.out_blocks, 1},
  };
  if (!upf_args_check_paths("upf block-sparse", paths, (int)(sizeof paths / sizeof paths[0])))
    return 2;

  upf_tensor q = {0}, k = {0}, v = {0}, cu = {0}, out = {0}, blk = {0};
  char what[1200] = "block-sparse: --q";
  upf_status st = upf_npy_read(a.q, &q);
  if (st == UPF_OK && (st = upf_npy_read(a.k, &k)) != UPF_OK)
    snprintf(what, sizeof what, "block-sparse: --k");
  if (st == UPF_OK && (st = upf_npy_read(a.v, &v)) != UPF_OK)
    snprintf(what, sizeof what, "block-sparse: --v");
  if (st == UPF_OK && (st = upf_npy_read(a.cu, &cu)) != UPF_OK)
    snprintf(what, sizeof what, "block-sparse: --cu-seqlens");
  if (st == UPF_OK)
    st = check_inputs(&a, &q, &k, &v, &cu, what, sizeof what);
  if (st == UPF_OK && (st = run_layer(&a, be, &q, &k, &v, &cu, &out, &blk)) != UPF_OK)
    snprintf(what, sizeof what, "block-sparse (--backend %s)", a.backend);
  /* the outputs land together or none does (a failed one leaves an existing file as it was) */
  const char *out_flag[2] = {"--out", "--out-blocks"};
  const char *out_path[2] = {a.out, a.out_blocks};
  const upf_tensor *out_tensor[2] = {&out, &blk};
  upf_outputs *outs = NULL;
  if (st == UPF_OK && (st = upf_outputs_create(&outs, 0)) != UPF_OK)
    snprintf(what, sizeof what, "block-sparse");
  for (int i = 0; i < 2 && st == UPF_OK; i++)
    if (out_path[i] && (st = upf_npy_write_to(outs, out_path[i], out_flag[i], out_tensor[i])) != UPF_OK)
      snprintf(what, sizeof what, "block-sparse: %s", out_flag[i]);
  if (st == UPF_OK && (st = upf_outputs_commit(outs)) != UPF_OK)
    snprintf(what, sizeof what, "block-sparse");
  upf_outputs_free(outs);
  upf_tensor_free(&q), upf_tensor_free(&k), upf_tensor_free(&v), upf_tensor_free(&cu);
  upf_tensor_free(&out), upf_tensor_free(&blk);
  return st == UPF_OK ? 0 : upf_cli_error(st, what);
}

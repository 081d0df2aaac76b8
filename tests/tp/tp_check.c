/* tp_check: tensor parallelism on CPU ranks, run under `mpirun -np R` (tests/tp/run.sh): the MPI
 * communicator's collectives (exact sums, broadcast, a size mismatch reported on every rank), the
 * selection over head-split ranks against the one-rank selection (block scores within fp32
 * tolerance, decisions identical except marginal ones), the forced disagreement (one rank's reduced
 * scores perturbed: the final mask is still identical on every rank), and the tensor-parallel prefill
 * of each tiny model family against the one-rank prefill (drop masks identical, logits within the
 * long-reduction rule against the fp64 truth, the same logits on every rank).
 *   usage: tp_check [family ...]   (default: llama-tiny gemma3-tiny qwen3-next-tiny)
 * Prints one PASS/FAIL line per check from rank 0 (failures from any rank); exits non-zero on every
 * rank when any rank failed. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"
#include "uniprefill/comm.h"
#include "uniprefill/model.h"
#include "verify/compare.h"
#include "verify/model_truth.h"
#include "verify/select_checks.h"
#include "verify/select_inputs.h"

static int failures, rank, size;

static void report(int ok, const char *what, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void report(int ok, const char *what, const char *fmt, ...) {
  char detail[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  if (!ok)
    failures++;
  if (!ok || rank == 0)
    printf("%s tp=%d rank %d: %s: %s\n", ok ? "PASS" : "FAIL", size, rank, what, detail);
  fflush(stdout);
}

static int status_ok(upf_status st, const char *what) {
  if (st != UPF_OK)
    report(0, what, "%s (%s)", upf_last_error(), upf_status_name(st));
  return st == UPF_OK;
}

/* Every rank's value of x equal: all-reduce of x gives size * x on each rank iff all agree (exact for
 * small integers and for bytes as floats). Returns 1 when every element agrees on every rank. */
static int same_on_every_rank(upf_comm *comm, const float *x, int64_t n) {
  float *buf = malloc((size_t)(n ? n : 1) * sizeof *buf);
  float *root = malloc((size_t)(n ? n : 1) * sizeof *root);
  memcpy(buf, x, (size_t)n * sizeof *buf);
  memcpy(root, x, (size_t)n * sizeof *root);
  int ok = upf_comm_broadcast(comm, root, n * (int64_t)sizeof *root, 0) == UPF_OK;
  float differs = ok && memcmp(root, x, (size_t)n * sizeof *x) ? 1.0f : 0.0f;
  ok = ok && upf_comm_allreduce_sum(comm, &differs, 1, UPF_DTYPE_F32) == UPF_OK && differs == 0.0f;
  free(buf), free(root);
  return ok;
}

/* ---- the collectives ---- */

static void check_collectives(upf_comm *comm) {
  enum { N = 1000 };
  float a[N];
  for (int i = 0; i < N; i++)
    a[i] = (float)((rank + 1) * (i + 1));
  int ok = status_ok(upf_comm_allreduce_sum(comm, a, N, UPF_DTYPE_F32), "all-reduce f32");
  for (int i = 0; ok && i < N; i++)
    ok = a[i] == (float)((i + 1) * size * (size + 1) / 2);
  report(ok, "all-reduce f32", "sum over ranks of (rank+1)*(i+1), %d elements, exact", N);

  uint16_t h[4];
  for (int i = 0; i < 4; i++)
    h[i] = upf_bf16_from_f32(0.5f * (float)(rank + 1));
  ok = status_ok(upf_comm_allreduce_sum(comm, h, 4, UPF_DTYPE_BF16), "all-reduce bf16");
  for (int i = 0; ok && i < 4; i++)
    ok = upf_bf16_to_f32(h[i]) == 0.25f * (float)(size * (size + 1));
  report(ok, "all-reduce bf16", "sum of 0.5*(rank+1) = %g", 0.25 * size * (size + 1));

  char msg[64];
  snprintf(msg, sizeof msg, "from rank %d", size - 1);
  char buf[64] = "";
  if (rank == size - 1)
    memcpy(buf, msg, sizeof msg);
  ok = status_ok(upf_comm_broadcast(comm, buf, sizeof buf, size - 1), "broadcast");
  report(ok && !strcmp(buf, msg), "broadcast", "64 bytes from the last rank");
  report(status_ok(upf_comm_barrier(comm), "barrier"), "barrier", "all ranks");

  /* broadcast_check from rank 0: the odd ranks change one byte each (ranks 1 and 3 at -np 4), so every
   * rank ends with rank 0's bytes and the same count of odd ranks */
  unsigned char mine[37];
  for (int i = 0; i < 37; i++)
    mine[i] = (unsigned char)(i * 7 + 1);
  if (rank % 2 == 1)
    mine[rank] ^= 0x5a;
  int32_t differing = -1;
  ok = status_ok(upf_comm_broadcast_check(comm, mine, 37, 0, &differing), "broadcast_check");
  for (int i = 0; ok && i < 37; i++)
    ok = mine[i] == (unsigned char)(i * 7 + 1);
  report(ok && differing == size / 2, "broadcast_check", "37 bytes from rank 0: %d rank(s) differed (want %d)",
         differing, size / 2);
  /* all ranks equal: none differs */
  for (int i = 0; i < 37; i++)
    mine[i] = (unsigned char)i;
  differing = -1;
  ok = status_ok(upf_comm_broadcast_check(comm, mine, 37, 0, &differing), "broadcast_check");
  report(ok && differing == 0, "broadcast_check agreeing", "%d rank(s) differed (want 0)", differing);
}

/* Ranks disagree on the element count: every rank gets UPF_ERR_COMM, none hangs. A fresh
 * communicator, since a failed collective breaks the one it ran on. */
static void check_mismatch(void) {
  upf_comm *bad = NULL;
  if (!status_ok(upf_comm_create("mpi", upf_backend_cpu(), NULL, &bad), "mismatch: create"))
    return;
  float x[8] = {0};
  const upf_status st = upf_comm_allreduce_sum(bad, x, rank == 0 ? 5 : 6, UPF_DTYPE_F32);
  const int ok = st == UPF_ERR_COMM && strstr(upf_last_error(), "disagree");
  report(ok, "mismatched all-reduce", "rank 0 sends 5 floats, the others 6: %s (%s)", upf_last_error(),
         upf_status_name(st));
  const upf_status again = upf_comm_barrier(bad);
  report(again == UPF_ERR_COMM, "broken communicator", "a later collective refuses: %s", upf_status_name(again));
  upf_comm_destroy(bad);
}

/* ---- selection ---- */

static upf_select_inputs head_slice(const upf_select_inputs *full, const upf_head_split *hs) {
  upf_select_inputs in = *full;
  const int64_t D = full->q.shape[2];
  in.q.data = (float *)full->q.data + hs->q0 * D, in.q.shape[1] = hs->nq;
  in.k.data = (float *)full->k.data + hs->kv0 * D, in.k.shape[1] = hs->nkv;
  return in;
}

static void check_selection(upf_comm *comm) {
  const upf_backend *be = upf_backend_cpu();
  const int32_t lens[] = {700, 40, 1, 333};
  const int32_t B = 4, Hq = 8, Hkv = 2, D = 32;
  upf_select_params p = upf_select_params_default();
  p.block = 16, p.sink = 16, p.last_q = 16, p.p = 0.7f;
  upf_select_problem pb;
  if (!status_ok(upf_select_problem_make(&pb, lens, B, Hq, Hkv, D, UPF_DTYPE_F32, UPF_DIST_HEAVY, 11), "select: problem"))
    return;
  const upf_select_inputs full = upf_select_problem_inputs(&pb);
  const int64_t T = pb.cu_seqlens[B];
  int64_t off[5];
  upf_select_block_offsets(pb.cu_seqlens, B, p.block, off);
  const int64_t nb = off[B];

  /* one rank: the fused pipeline over every head */
  float *score1 = calloc((size_t)nb, sizeof *score1), *score = calloc((size_t)nb, sizeof *score);
  uint8_t *bm1 = calloc((size_t)nb, 1), *bm = calloc((size_t)nb, 1), *tm1 = calloc((size_t)T, 1), *tm = calloc((size_t)T, 1);
  int32_t *ki = calloc((size_t)T, 4), *cu = calloc(B + 1, 4), *cnt = calloc(B, 4);
  upf_select_outputs o1 = {score1, bm1, tm1, ki, cu, cnt, 0};
  int ok = status_ok(be->select_run(&full, &p, &o1), "select: one rank");

  upf_head_split hs;
  ok = ok && status_ok(upf_head_split_of(Hq, Hkv, rank, size, &hs), "select: head split");
  const upf_select_inputs mine = head_slice(&full, &hs);
  upf_select_outputs o = {score, bm, tm, ki, cu, cnt, 0};
  upf_select_tp_stats ts;
  ok = ok && status_ok(upf_select_tp_run(comm, be, &mine, &p, &o, NULL, &ts), "select: tp");
  if (ok) {
    double *ref = malloc((size_t)nb * sizeof *ref);
    for (int64_t c = 0; c < nb; c++)
      ref[c] = score1[c];
    upf_check chk;
    memset(&chk, 0, sizeof chk);
    upf_compare_f32(score, ref, nb, upf_tolerance_for(UPF_DTYPE_F32), &chk);
    report(chk.passed, "select: block scores", "%d query heads (%d-%d), kv heads %d-%d of %d/%d: nmse %.3g, budget %.1f%% %s",
           hs.nq, hs.q0, hs.q0 + hs.nq - 1, hs.kv0, hs.kv0 + hs.nkv - 1, Hq, Hkv, chk.nmse, 100 * chk.budget, chk.detail);
    memset(&chk, 0, sizeof chk);
    upf_select_compare_decisions(&full, &p, ref, bm1, bm, upf_select_tau(UPF_DTYPE_F32), &chk);
    report(chk.passed, "select: block decisions", "%lld blocks, identical except marginal: %s", (long long)nb,
           chk.detail[0] ? chk.detail : "all identical");
    memset(&chk, 0, sizeof chk);
    upf_select_compare_token_masks(&full, &p, bm1, bm, tm1, tm, &chk);
    report(chk.passed, "select: token mask", "%lld tokens, kept %lld (one rank: %lld) %s", (long long)T,
           (long long)o.kept_total, (long long)o1.kept_total, chk.detail);
    report(ts.disagreeing_ranks == 0 && ts.allreduce_bytes == (double)nb * 4, "select: stats",
           "%.0f bytes all-reduced, %.3f ms of %.3f ms, %d ranks disagreed", ts.allreduce_bytes,
           1e3 * ts.allreduce_seconds, 1e3 * ts.seconds, ts.disagreeing_ranks);
    free(ref);
  }

  /* forced disagreement: the last rank adds to its reduced scores what reverses the ranking of the
   * long request's blocks, so its own top-p keeps other blocks; the final mask is rank 0's everywhere */
  if (ok && size > 1) {
    uint8_t *unperturbed = malloc((size_t)nb);
    memcpy(unperturbed, bm, (size_t)nb);
    float *bias = calloc((size_t)nb, sizeof *bias);
    if (rank == size - 1)
      for (int64_t c = 0; c < off[1]; c++)
        bias[c] = 10.0f * (float)(c + 1);
    const upf_select_tp_hooks hooks = {bias};
    ok = status_ok(upf_select_tp_run(comm, be, &mine, &p, &o, &hooks, &ts), "disagreement: tp");
    float *maskf = malloc((size_t)(T + nb) * sizeof *maskf);
    for (int64_t t = 0; ok && t < T; t++)
      maskf[t] = tm[t];
    for (int64_t c = 0; ok && c < nb; c++)
      maskf[T + c] = bm[c];
    const int same = ok && same_on_every_rank(comm, maskf, T + nb);
    const int as_rank0 = ok && !memcmp(bm, unperturbed, (size_t)nb);
    report(ok && same && as_rank0 && ts.disagreeing_ranks == 1, "select: forced disagreement",
           "rank %d perturbed: %d rank(s) disagreed; final block and token masks identical on every rank: %s, equal "
           "to rank 0's unperturbed decision: %s",
           size - 1, ts.disagreeing_ranks, same ? "yes" : "no", as_rank0 ? "yes" : "no");
    free(bias), free(maskf), free(unperturbed);
  }
  free(score1), free(score), free(bm1), free(bm), free(tm1), free(tm), free(ki), free(cu), free(cnt);
  upf_select_problem_free(&pb);
}

/* ---- model prefill ---- */

static double max_err(const float *a, const double *truth, int64_t n) {
  double e = 0.0;
  for (int64_t i = 0; i < n; i++)
    e = fmax(e, fabs((double)a[i] - truth[i]));
  return e;
}

static void check_model(upf_comm *comm, const char *name) {
  const upf_model_config *cfg = upf_model_config_by_name(name);
  if (!cfg) {
    report(0, name, "%s", upf_last_error());
    return;
  }
  const upf_backend *be = upf_backend_cpu();
  const int32_t lens[] = {224, 24, 1, 96}, B = 4;
  int32_t cu[5] = {0};
  for (int r = 0; r < B; r++)
    cu[r + 1] = cu[r] + lens[r];
  int32_t *ids = malloc((size_t)cu[B] * sizeof *ids);
  upf_model_seeded_ids(5, cfg->vocab, cu[B], ids);
  upf_prefill_options opt = {.mode = UPF_PREFILL_UNIPREFILL, .select = cfg->select};
  opt.select.p = 0.6f; /* random weights attend near-uniformly: a lower p makes both drop layers drop */
  upf_model m;
  upf_prefill_result res;
  memset(&res, 0, sizeof res);
  char what[96];
  snprintf(what, sizeof what, "%s: tp prefill", name);
  int ok = status_ok(upf_model_init_seeded_tp(&m, cfg, be, UPF_DTYPE_F32, 3, 0, cfg->num_layers, comm), what);
  if (ok) {
    ok = status_ok(upf_model_prefill(&m, ids, cu, B, &opt, &res), what);
    upf_model_free(&m);
  }
  /* every rank holds the same logits (the all-reduce hands out the same bits) */
  const int64_t nl = (int64_t)B * cfg->vocab;
  if (ok)
    report(same_on_every_rank(comm, res.logits, nl), what, "logits identical on every rank (%lld values)",
           (long long)nl);

  if (ok && rank == 0) {
    upf_model m1;
    upf_prefill_result r1;
    memset(&r1, 0, sizeof r1);
    ok = status_ok(upf_model_init_seeded(&m1, cfg, be, UPF_DTYPE_F32, 3, 0, cfg->num_layers), "one rank");
    ok = ok && status_ok(upf_model_prefill(&m1, ids, cu, B, &opt, &r1), "one rank prefill");
    if (ok) {
      int masks_same = r1.num_drops == res.num_drops && r1.num_drops > 0;
      for (int d = 0; masks_same && d < r1.num_drops; d++)
        masks_same = r1.drops[d].tokens_in == res.drops[d].tokens_in &&
                     !memcmp(r1.drops[d].mask, res.drops[d].mask, (size_t)r1.drops[d].tokens_in);
      snprintf(what, sizeof what, "%s: drop masks", name);
      report(masks_same, what, "%d drop layers, tokens %lld -> %lld -> %lld (one rank: -> %lld)", res.num_drops,
             (long long)cu[B], (long long)(res.num_drops > 0 ? res.drops[0].tokens_kept : 0),
             (long long)(res.num_drops > 1 ? res.drops[1].tokens_kept : 0),
             (long long)(r1.num_drops > 1 ? r1.drops[1].tokens_kept : 0));
      double *truth = malloc((size_t)nl * sizeof *truth);
      if (masks_same && upf_model_truth(&m1, ids, cu, B, &r1, 0, truth)) {
        const double e1 = max_err(r1.logits, truth, nl), eR = max_err(res.logits, truth, nl);
        const double atol = upf_tolerance_for(UPF_DTYPE_F32).atol;
        snprintf(what, sizeof what, "%s: logits", name);
        report(eR <= 2 * e1 + atol, what,
               "max error vs fp64 truth %.3g (one rank %.3g; rule <= 2x + %.0e); %lld all-reduces, %.0f bytes, %.1f ms",
               eR, e1, atol, (long long)res.comm_calls, res.comm_bytes, 1e3 * res.comm_seconds);
      } else if (masks_same) {
        report(0, name, "fp64 truth failed");
      }
      free(truth);
      upf_model_free(&m1);
    }
    upf_prefill_result_free(&r1);
  }
  upf_prefill_result_free(&res);
  free(ids);
}

int main(int argc, char **argv) {
  upf_comm *comm = NULL;
  const upf_status st = upf_comm_create("mpi", upf_backend_cpu(), NULL, &comm);
  if (st != UPF_OK) {
    fprintf(stderr, "tp_check: %s (%s)\n", upf_last_error(), upf_status_name(st));
    return 2;
  }
  rank = upf_comm_rank(comm), size = upf_comm_size(comm);
  check_collectives(comm);
  check_mismatch();
  check_selection(comm);
  static const char *const families[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
  if (argc > 1)
    for (int i = 1; i < argc; i++)
      check_model(comm, argv[i]);
  else
    for (int i = 0; i < 3; i++)
      check_model(comm, families[i]);
  float total = (float)failures;
  if (upf_comm_allreduce_sum(comm, &total, 1, UPF_DTYPE_F32) != UPF_OK)
    total = 1;
  if (rank == 0)
    printf("tp_check tp=%d: %s (%.0f failure(s) over all ranks)\n", size, total ? "FAILED" : "all passed", total);
  upf_comm_destroy(comm);
  return total ? 1 : 0;
}

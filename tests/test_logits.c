/* logits.rows and the per-position outputs of a prefill: the verify entries on the CPU and through the
 * CPU twin (the backend-under-test path), chunk boundaries of the LM head, and on the tiny models:
 * argmax and NLL equal plain loops over the whole logits of every position, the last row equals
 * logits.last, a prefill of a prefix gives the logits the full prefill has at that position
 * (causality through every layer), UniPrefill's outputs at its kept positions only, and bad input. */
#include <CUnit/CUnit.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ref_cpu/logits.h"
#include "tests/test_util.h"
#include "uniprefill/model.h"
#include "uniprefill/npy.h"
#include "uniprefill/rng.h"
#include "verify/verify.h"
#include "verify/verify_model.h"

static void test_logits_rows_verify_entries(void) {
  upf_test_verify_op(UPF_OP_LOGITS_ROWS, upf_backend_cpu(), 9); /* 2 goldens, 6 errors, 2 invariants */
  /* the twin runs the backend-under-test path: seeded cases against the reference */
  upf_verify_ctx ctx = {.backend = upf_test_cpu_twin(), .log = NULL, .quick = 1};
  char *text = NULL;
  size_t len = 0;
  ctx.log = open_memstream(&text, &len);
  CU_ASSERT_PTR_NOT_NULL_FATAL(ctx.log);
  upf_verify_fn_for(UPF_OP_LOGITS_ROWS)(&ctx);
  fclose(ctx.log);
  CU_ASSERT_EQUAL(ctx.failed, 0);
  CU_ASSERT(ctx.passed >= 10);
  CU_ASSERT_PTR_NOT_NULL(strstr(text, "odd sizes"));
  if (ctx.failed)
    fprintf(stderr, "%s", text);
  free(text);
}

/* Rows across chunks of the reference's LM head (V = 2^19: 32 rows a chunk; 70 rows: 32 + 32 + 6):
 * each row's results equal those of a call for that row alone, and the full rows at the chunk edges
 * are the rows asked for. Skipped under Valgrind (70 x 2^19 logits). */
static void test_logits_rows_chunks(void) {
  if (upf_test_quick()) {
    printf("(skipped under UPF_TEST_QUICK: 37M logits) ");
    return;
  }
  const int64_t T = 80, H = 4, V = (int64_t)1 << 19, R = 70, F = 6;
  upf_tensor h, n, w;
  const int64_t sh[2] = {T, H}, sn[1] = {H}, sw[2] = {H, V};
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&h, UPF_DTYPE_F32, 2, sh), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&n, UPF_DTYPE_F32, 1, sn), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&w, UPF_DTYPE_F32, 2, sw), UPF_OK);
  upf_rng rng;
  upf_rng_seed(&rng, 99);
  upf_rng_fill_normal(&rng, h.data, T * H, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, n.data, H, 1.0f, 0.1f);
  upf_rng_fill_normal(&rng, w.data, H * V, 0.0f, 1.0f);
  int32_t rows[70], targets[70], arg[70], arg1;
  const int32_t full_rows[6] = {0, 31, 32, 63, 64, 69};
  double lse[70], tgt[70], lse1, tgt1;
  float *full = malloc((size_t)(F * V) * sizeof(float)), *full1 = malloc((size_t)V * sizeof(float));
  CU_ASSERT_FATAL(full && full1);
  for (int i = 0; i < R; i++)
    rows[i] = (int32_t)((i * 37) % T), targets[i] = (int32_t)((i * 7919) % V);
  const upf_norm_params p = {1e-5f, 0};
  const upf_logits_rows_sel sel = {rows, R, targets, full_rows, F};
  const upf_logits_rows_out out = {arg, lse, tgt, full};
  CU_ASSERT_EQUAL_FATAL(cpu_logits_rows(&h, &sel, &n, &p, &w, &out), UPF_OK);
  int f = 0;
  for (int i = 0; i < R; i++) {
    const int32_t one_full[1] = {0};
    const upf_logits_rows_sel one = {&rows[i], 1, &targets[i], one_full, 1};
    const upf_logits_rows_out o1 = {&arg1, &lse1, &tgt1, full1};
    CU_ASSERT_EQUAL_FATAL(cpu_logits_rows(&h, &one, &n, &p, &w, &o1), UPF_OK);
    /* the same row: the same maximum (the ids may differ only on an exact f32 tie), lse, target */
    CU_ASSERT_DOUBLE_EQUAL(full1[arg1], full1[arg[i]], 1e-5);
    CU_ASSERT_DOUBLE_EQUAL(lse1, lse[i], 1e-5);
    CU_ASSERT_DOUBLE_EQUAL(tgt1, tgt[i], 1e-5);
    if (f < F && full_rows[f] == i) {
      double worst = 0;
      for (int64_t j = 0; j < V; j++)
        worst = fmax(worst, fabs((double)full[f * V + j] - full1[j]));
      CU_ASSERT(worst < 1e-5);
      f++;
    }
  }
  free(full), free(full1);
  upf_tensor_free(&h), upf_tensor_free(&n), upf_tensor_free(&w);
}

/* Two requests of 30 tokens on llama-tiny (f32): every position's whole logits (tail_logits = 30),
 * its argmax and the NLL of the next token; plain loops over the whole logits give the same. */
static void test_prefill_positions_dense(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  const int32_t L = 30, B = 2, T = 60, cu[3] = {0, 30, 60};
  const int64_t V = cfg->vocab;
  int32_t ids[60], targets[60];
  upf_model_seeded_ids(5, cfg->vocab, T, ids);
  for (int32_t t = 0; t < T; t++)
    targets[t] = (t + 1) % L ? ids[t + 1] : -1; /* the next token; none after a request's last */
  upf_prefill_options o = {.mode = UPF_PREFILL_DENSE, .select = cfg->select, .per_position = 1, .targets = targets,
                           .tail_logits = L};
  upf_prefill_result res;
  CU_ASSERT_EQUAL_FATAL(upf_model_run_ids(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 7, ids, cu, B, &o, &res), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(res.num_positions, T);
  CU_ASSERT_PTR_NOT_NULL_FATAL(res.argmax);
  CU_ASSERT_PTR_NOT_NULL_FATAL(res.nll);
  CU_ASSERT_PTR_NOT_NULL_FATAL(res.tail_logits);
  CU_ASSERT_EQUAL(res.tail_n, L);
  int argmax_ok = 0, nll_ok = 0;
  for (int32_t t = 0; t < T; t++) {
    CU_ASSERT_EQUAL(res.position_origin[t], t);
    const float *x = res.tail_logits + (int64_t)t * V; /* (B, N, V) with N = L: position t */
    int32_t arg = 0;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; j++)
      if (x[j] > m)
        m = x[j], arg = (int32_t)j;
    for (int64_t j = 0; j < V; j++)
      s += exp(x[j] - m);
    argmax_ok += res.argmax[t] == arg;
    if (targets[t] < 0)
      nll_ok += isnan(res.nll[t]);
    else
      nll_ok += fabs(res.nll[t] - (m + log(s) - x[targets[t]])) < 1e-12 * (1 + fabs(res.nll[t]));
  }
  CU_ASSERT_EQUAL(argmax_ok, T);
  CU_ASSERT_EQUAL(nll_ok, T);
  /* the last row of each request: logits.last's */
  for (int32_t r = 0; r < B; r++)
    for (int64_t j = 0; j < V; j++)
      if (fabs(res.tail_logits[((int64_t)r * L + L - 1) * V + j] - res.logits[r * V + j]) > 1e-5) {
        CU_FAIL("tail row != logits.last");
        break;
      }
  /* a prefill of the first 11 tokens of request 1: its last logits are the full run's at position 10 */
  const int32_t cu_prefix[2] = {0, 11};
  upf_prefill_options plain = {.mode = UPF_PREFILL_DENSE, .select = cfg->select};
  upf_prefill_result pre;
  CU_ASSERT_EQUAL_FATAL(upf_model_run_ids(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 7, ids + 30, cu_prefix, 1, &plain, &pre),
                        UPF_OK);
  double worst = 0;
  for (int64_t j = 0; j < V; j++)
    worst = fmax(worst, fabs((double)pre.logits[j] - res.tail_logits[(int64_t)(L + 10) * V + j]));
  CU_ASSERT(worst < 1e-4);
  CU_ASSERT_PTR_NULL(pre.argmax); /* nothing per position unless asked */
  upf_prefill_result_free(&pre);
  upf_prefill_result_free(&res);
}

/* UniPrefill (gemma3-tiny, its tiny selection at p = 0.5): outputs at the kept positions only, their
 * origins ascending within each request and ending at its last token; the tail rows are the last
 * kept positions, the last one equal to logits.last. Bad tail and target inputs fail by name. */
static void test_prefill_positions_uniprefill(void) {
  const upf_model_config *cfg = upf_model_config_by_name("gemma3-tiny");
  const int32_t lens[2] = {100, 40}, B = 2, N = 4;
  const int64_t V = cfg->vocab;
  upf_prefill_options o = {.mode = UPF_PREFILL_UNIPREFILL, .select = cfg->select, .per_position = 1,
                           .tail_logits = N};
  o.select.p = 0.5f; /* drops blocks of these short requests under near-uniform attention */
  upf_prefill_result res;
  CU_ASSERT_EQUAL_FATAL(upf_model_run_seeded(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 3, lens, B, &o, &res), UPF_OK);
  CU_ASSERT_FATAL(res.num_drops > 0);
  const int64_t kept = res.drops[res.num_drops - 1].tokens_kept;
  CU_ASSERT(kept < lens[0] + lens[1]);
  CU_ASSERT_EQUAL(res.num_positions, kept);
  CU_ASSERT_PTR_NULL(res.nll);
  int64_t i = 0;
  int32_t start = 0;
  for (int32_t r = 0; r < B; r++) {
    const int32_t n_r = res.drops[res.num_drops - 1].kept_per_req[r];
    for (int32_t k = 0; k < n_r; k++, i++) {
      CU_ASSERT(res.position_origin[i] >= start && res.position_origin[i] < start + lens[r]);
      if (k)
        CU_ASSERT(res.position_origin[i] > res.position_origin[i - 1]);
      CU_ASSERT(res.argmax[i] >= 0 && res.argmax[i] < V);
    }
    CU_ASSERT_EQUAL(res.position_origin[i - 1], start + lens[r] - 1);
    start += lens[r];
    const float *last_tail = res.tail_logits + ((int64_t)r * N + N - 1) * V;
    int32_t arg = 0;
    for (int64_t j = 0; j < V; j++) {
      arg = last_tail[j] > last_tail[arg] ? (int32_t)j : arg;
      if (fabs(last_tail[j] - res.logits[r * V + j]) > 1e-5) {
        CU_FAIL("last tail row != logits.last");
        break;
      }
    }
    CU_ASSERT_EQUAL(res.argmax[i - 1], arg);
  }
  upf_prefill_result_free(&res);

  /* bad input: a tail longer than a request; a target outside the vocabulary */
  const int32_t short_lens[2] = {8, 3};
  upf_prefill_options bad = {.mode = UPF_PREFILL_DENSE, .select = cfg->select, .tail_logits = 4};
  CU_ASSERT_EQUAL(upf_model_run_seeded(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 3, short_lens, 2, &bad, &res),
                  UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "request 1"));
  int32_t targets[11];
  for (int t = 0; t < 11; t++)
    targets[t] = t == 6 ? (int32_t)V : 0;
  bad.tail_logits = 0, bad.targets = targets;
  CU_ASSERT_EQUAL(upf_model_run_seeded(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 3, short_lens, 2, &bad, &res),
                  UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "position 6"));
}

/* CUDA against the CPU (dense, f32, llama-tiny and gemma3-tiny): argmax at >= 95% of the positions
 * (the rest near ties), NLL and tail logits within 1e-3. Skipped where no CUDA device is usable. */
static void test_prefill_positions_cuda_vs_cpu(void) {
  const upf_backend *cuda = upf_backend_cuda();
  if (cuda->probe() != UPF_OK) {
    printf("(skipped: %s) ", upf_last_error());
    return;
  }
  const char *names[2] = {"llama-tiny", "gemma3-tiny"};
  const int32_t cu[3] = {0, 70, 110}, T = 110, N = 16;
  for (int i = 0; i < 2; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(names[i]);
    int32_t ids[110], targets[110];
    upf_model_seeded_ids(9, cfg->vocab, T, ids);
    for (int32_t t = 0; t < T; t++)
      targets[t] = t == 69 || t == 109 ? -1 : ids[t + 1];
    upf_prefill_options o = {.select = cfg->select, .per_position = 1, .targets = targets, .tail_logits = N};
    upf_prefill_result c, g;
    CU_ASSERT_EQUAL_FATAL(upf_model_run_ids(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 7, ids, cu, 2, &o, &c), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(upf_model_run_ids(cfg, cuda, UPF_DTYPE_F32, 7, ids, cu, 2, &o, &g), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(g.num_positions, T);
    int agree = 0;
    double worst_nll = 0, worst_tail = 0;
    for (int32_t t = 0; t < T; t++) {
      agree += c.argmax[t] == g.argmax[t];
      if (targets[t] >= 0)
        worst_nll = fmax(worst_nll, fabs(c.nll[t] - g.nll[t]));
      else
        CU_ASSERT(isnan(g.nll[t]));
    }
    for (int64_t j = 0; j < 2 * N * (int64_t)cfg->vocab; j++)
      worst_tail = fmax(worst_tail, fabs((double)c.tail_logits[j] - g.tail_logits[j]));
    CU_ASSERT(agree >= 0.95 * T);
    CU_ASSERT(worst_nll < 1e-3);
    CU_ASSERT(worst_tail < 1e-3);
    printf("(%s: argmax %d/%d, NLL %.2e, tail %.2e) ", names[i], agree, T, worst_nll, worst_tail);
    upf_prefill_result_free(&c), upf_prefill_result_free(&g);
  }
}

/* Runs build/upf (next to this binary) with args in dir; its exit status; stderr to dir/stderr.txt. */
static int run_upf_in(const char *dir, const char *args) {
  char self[PATH_MAX], cmd[PATH_MAX + 2048];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return -1;
  self[n] = '\0';
  snprintf(cmd, sizeof cmd, "cd %s && '%s/upf' %s 2>stderr.txt >stdout.txt", dir, dirname(self), args);
  const int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int stderr_has(const char *dir, const char *needle) {
  char path[128], buf[4096];
  snprintf(path, sizeof path, "%s/stderr.txt", dir);
  FILE *f = fopen(path, "r");
  if (!f)
    return 0;
  const size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  return strstr(buf, needle) != NULL;
}

/* upf prefill --out-argmax / --out-nll on llama-tiny (seed 1, two requests): the files' types and
 * shapes, NaN NLL at each request's last position, the argmax there = that of --out-logits, the NLL
 * = the library's with next-token targets; UniPrefill mode and an unwritable path fail, no file. */
static void test_cli_out_argmax_nll(void) {
  char dir[] = "/tmp/upf_logits_XXXXXX";
  CU_ASSERT_PTR_NOT_NULL_FATAL(mkdtemp(dir));
  const char *base = "prefill --model llama-tiny --backend cpu --dtype f32 --lengths 20,13";
  char args[512];
  snprintf(args, sizeof args, "%s --out-argmax A.npy --out-nll N.npy --out-logits L.npy", base);
  CU_ASSERT_EQUAL_FATAL(run_upf_in(dir, args), 0);
  char pa[96], pn[96], pl[96];
  snprintf(pa, sizeof pa, "%s/A.npy", dir), snprintf(pn, sizeof pn, "%s/N.npy", dir);
  snprintf(pl, sizeof pl, "%s/L.npy", dir);
  upf_tensor ta, tn, tl;
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(pa, &ta), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(pn, &tn), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(pl, &tl), UPF_OK);
  CU_ASSERT(ta.dtype == UPF_DTYPE_I32 && ta.ndim == 1 && ta.shape[0] == 33);
  CU_ASSERT(tn.dtype == UPF_DTYPE_F64 && tn.ndim == 1 && tn.shape[0] == 33);
  const int32_t *a = ta.data;
  const double *nll = tn.data;
  const float *l = tl.data;
  const int32_t last[2] = {19, 32};
  for (int r = 0; r < 2; r++) {
    int32_t arg = 0;
    for (int j = 1; j < 512; j++)
      arg = l[r * 512 + j] > l[r * 512 + arg] ? j : arg;
    CU_ASSERT_EQUAL(a[last[r]], arg);
    CU_ASSERT(isnan(nll[last[r]]));
  }
  /* the library on the same seeded model and ids */
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  int32_t ids[33], targets[33];
  const int32_t cu[3] = {0, 20, 33};
  upf_model_seeded_ids(1, cfg->vocab, 33, ids);
  for (int t = 0; t < 33; t++)
    targets[t] = t == 19 || t == 32 ? -1 : ids[t + 1];
  upf_prefill_options o = {.select = cfg->select, .per_position = 1, .targets = targets};
  upf_prefill_result res;
  CU_ASSERT_EQUAL_FATAL(upf_model_run_ids(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, ids, cu, 2, &o, &res), UPF_OK);
  /* within a rounding: the CLI runs natively, this process may run under Valgrind, where OpenBLAS
   * picks other kernels */
  int same = 0;
  for (int t = 0; t < 33; t++)
    same += res.argmax[t] == a[t] &&
            (t == 19 || t == 32 || (fabs(nll[t] - res.nll[t]) <= 1e-5 * (1 + nll[t]) && nll[t] > 0));
  CU_ASSERT_EQUAL(same, 33);
  upf_prefill_result_free(&res);
  upf_tensor_free(&ta), upf_tensor_free(&tn), upf_tensor_free(&tl);

  /* UniPrefill mode: refused before any work, no file */
  snprintf(args, sizeof args, "%s --mode uniprefill --out-argmax U.npy", base);
  CU_ASSERT_EQUAL(run_upf_in(dir, args), 2);
  CU_ASSERT(stderr_has(dir, "--out-argmax and --out-nll need --mode dense"));
  snprintf(pa, sizeof pa, "%s/U.npy", dir);
  CU_ASSERT_EQUAL(access(pa, F_OK), -1);
  /* an output in a directory that does not exist */
  snprintf(args, sizeof args, "%s --out-nll no/such/dir/N2.npy --out-argmax A2.npy", base);
  CU_ASSERT_EQUAL(run_upf_in(dir, args), 2);
  CU_ASSERT(stderr_has(dir, "--out-nll"));
  snprintf(pa, sizeof pa, "%s/A2.npy", dir);
  CU_ASSERT_EQUAL(access(pa, F_OK), -1);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  CU_ASSERT_EQUAL(system(cmd), 0);
}

static CU_TestInfo logits_tests[] = {
    {"logits.rows verify entries: cpu (goldens, bad inputs, invariants) and the cpu twin (seeded cases)",
     test_logits_rows_verify_entries},
    {"logits.rows across LM-head chunks == one row at a time", test_logits_rows_chunks},
    {"prefill per position (dense): argmax, NLL == loops over every row's logits; prefix == full run",
     test_prefill_positions_dense},
    {"prefill per position (uniprefill): kept positions only, origins, tails; bad tail/targets",
     test_prefill_positions_uniprefill},
    {"upf prefill --out-argmax / --out-nll: files, = the library, errors leave no file", test_cli_out_argmax_nll},
    {"per-position outputs: cuda == cpu (argmax, NLL, tail logits; GPU only)", test_prefill_positions_cuda_vs_cpu},
    CU_TEST_INFO_NULL,
};

void upf_register_logits_tests(void) { upf_test_suite("logits rows and per-position outputs", NULL, NULL, logits_tests); }

/* `upf generate` end to end: the tokens file's shape and dtype and the JSON's fields; the tokens equal
 * those of a greedy loop over the session API written here, and a recomputation by `upf prefill` of
 * prompt + generated tokens picks the last generated token; UniPrefill at p = 1 generates what dense
 * does; every bad input exits non-zero, names the input and writes nothing. Runs the upf binary that
 * sits beside this test binary. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/engine.h"
#include "uniprefill/npy.h"
#include "uniprefill/session.h"

static cli_suite cli;

static int setup(void) { return cli_setup(&cli, "upf_gen"); }
static int teardown(void) { return cli_teardown(&cli); }

/* The prompts: three requests of llama-tiny's vocabulary (the short one below sink + last_q). */
#define NREQ 3
#define NEW 5
static const int32_t lens[NREQ] = {70, 20, 45};
static int32_t prompt_ids[70 + 20 + 45], prompt_cu[NREQ + 1];

static void write_prompts(void) {
  prompt_cu[0] = 0;
  for (int r = 0; r < NREQ; r++)
    prompt_cu[r + 1] = prompt_cu[r] + lens[r];
  upf_model_seeded_ids(21, 512, prompt_cu[NREQ], prompt_ids);
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "ids.npy"), prompt_ids, prompt_cu[NREQ]));
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "cu.npy"), prompt_cu, NREQ + 1));
}

/* Reads a generated tokens file: <i4 (NREQ, NEW). */
static int read_tokens(const char *path, int32_t *out) {
  upf_tensor t = {0};
  if (upf_npy_read(path, &t) != UPF_OK)
    return 0;
  const int ok = t.dtype == UPF_DTYPE_I32 && t.ndim == 2 && t.shape[0] == NREQ && t.shape[1] == NEW;
  if (ok)
    memcpy(out, t.data, sizeof(int32_t) * NREQ * NEW);
  upf_tensor_free(&t);
  return ok;
}

/* The greedy loop over the library, as the command promises it: seed 1, f32, the CPU. */
static void library_tokens(upf_prefill_mode mode, float p, int32_t *out) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, 0, cfg->num_layers), UPF_OK);
  upf_session_config sc = upf_session_config_default(&m);
  sc.mode = mode, sc.select.p = p, sc.max_requests = NREQ;
  upf_session *s = NULL;
  CU_ASSERT_EQUAL_FATAL(upf_session_create(&m, &sc, &s), UPF_OK);
  upf_session_row rows[NREQ];
  for (int r = 0; r < NREQ; r++) {
    int32_t id = -1;
    CU_ASSERT_EQUAL_FATAL(upf_session_add_request(s, prompt_ids + prompt_cu[r], lens[r], &id), UPF_OK);
    rows[r] = (upf_session_row){id, UPF_ROW_PREFILL, 0};
  }
  for (int i = 0; i < NEW; i++) {
    upf_prefill_result res;
    CU_ASSERT_EQUAL_FATAL(upf_session_step(s, rows, NREQ, NULL, &res), UPF_OK);
    for (int r = 0; r < NREQ; r++) {
      out[r * NEW + i] = upf_engine_argmax(res.logits + (size_t)r * cfg->vocab, cfg->vocab);
      rows[r].kind = UPF_ROW_DECODE, rows[r].token = out[r * NEW + i];
    }
    upf_prefill_result_free(&res);
  }
  upf_session_free(s);
  upf_model_free(&m);
}

static const char *base = "generate --model llama-tiny --backend cpu --dtype f32";

static void test_generate_outputs(void) {
  write_prompts();
  char args[4096];
  const char *tok = cli_path(&cli, "tokens.npy"), *json = cli_path(&cli, "gen.json");
  snprintf(args, sizeof args, "%s --token-ids %s --cu-seqlens %s --max-new %d --mode uniprefill --p 0.5 --out-tokens %s "
           "--json %s", base, cli_path(&cli, "ids.npy"), cli_path(&cli, "cu.npy"), NEW, tok, json);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s", args), 0);
  int32_t got[NREQ * NEW], want[NREQ * NEW];
  CU_ASSERT_FATAL(read_tokens(tok, got));
  library_tokens(UPF_PREFILL_UNIPREFILL, 0.5f, want);
  CU_ASSERT_EQUAL(memcmp(got, want, sizeof got), 0);
  /* the JSON: the long request dropped at both drop layers; its KV pages fewer than dense */
  CU_ASSERT(cli_file_contains(json, "\"prompt_len\": 70, \"drops\": [{\"layer\": 2, \"kept\": "));
  CU_ASSERT(cli_file_contains(json, "\"kv_pages_dense\": 15,")); /* ceil((70 + 4) / 16) = 5 pages x 3 groups */
  CU_ASSERT(cli_file_contains(json, "\"token_ms\": ["));
  CU_ASSERT(cli_file_contains(json, "\"bytes_saved\": "));
  char tokens_line[256];
  snprintf(tokens_line, sizeof tokens_line, "\"tokens\": [%d, %d, %d, %d, %d]", got[0], got[1], got[2], got[3], got[4]);
  CU_ASSERT(cli_file_contains(json, tokens_line));
}

/* Dense generation against recomputation: a fresh `upf prefill` of each prompt + its first NEW - 1
 * generated tokens picks the last one, wherever its top-2 margin clears the CPU's decode-vs-prefill
 * difference (f32, well under 1e-3). Then UniPrefill at p = 1 keeps every token: the same tokens. */
static void test_generate_dense_recompute_and_p1(void) {
  char args[4096];
  const char *dense = cli_path(&cli, "dense.npy"), *p1 = cli_path(&cli, "p1.npy");
  snprintf(args, sizeof args, "%s --token-ids %s --cu-seqlens %s --max-new %d --out-tokens %s", base,
           cli_path(&cli, "ids.npy"), cli_path(&cli, "cu.npy"), NEW, dense);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s", args), 0);
  int32_t got[NREQ * NEW], p1_tokens[NREQ * NEW];
  CU_ASSERT_FATAL(read_tokens(dense, got));
  int32_t ids[70 + 20 + 45 + NREQ * NEW], cu[NREQ + 1] = {0};
  for (int r = 0; r < NREQ; r++) {
    memcpy(ids + cu[r], prompt_ids + prompt_cu[r], sizeof(int32_t) * (size_t)lens[r]);
    memcpy(ids + cu[r] + lens[r], got + r * NEW, sizeof(int32_t) * (NEW - 1));
    cu[r + 1] = cu[r] + lens[r] + NEW - 1;
  }
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "re-ids.npy"), ids, cu[NREQ]));
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "re-cu.npy"), cu, NREQ + 1));
  snprintf(args, sizeof args, "prefill --model llama-tiny --backend cpu --dtype f32 --token-ids %s --cu-seqlens %s "
           "--out-logits %s", cli_path(&cli, "re-ids.npy"), cli_path(&cli, "re-cu.npy"), cli_path(&cli, "re-logits.npy"));
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s", args), 0);
  upf_tensor lg = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "re-logits.npy"), &lg), UPF_OK);
  CU_ASSERT_FATAL(lg.ndim == 2 && lg.shape[0] == NREQ && lg.shape[1] == 512);
  int checked = 0;
  for (int r = 0; r < NREQ; r++) {
    const float *row = (const float *)lg.data + (size_t)r * 512;
    const int best = upf_engine_argmax(row, 512);
    float second = -INFINITY;
    for (int v = 0; v < 512; v++)
      if (v != best && row[v] > second)
        second = row[v];
    if (row[best] - second > 1e-3f) {
      CU_ASSERT_EQUAL(got[r * NEW + NEW - 1], best);
      checked++;
    }
  }
  CU_ASSERT(checked >= 2); /* a margin under 1e-3 between random logits is rare: the check really ran */
  upf_tensor_free(&lg);
  snprintf(args, sizeof args, "%s --token-ids %s --cu-seqlens %s --max-new %d --mode uniprefill --p 1 --out-tokens %s",
           base, cli_path(&cli, "ids.npy"), cli_path(&cli, "cu.npy"), NEW, p1);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s", args), 0);
  CU_ASSERT_FATAL(read_tokens(p1, p1_tokens));
  CU_ASSERT_EQUAL(memcmp(got, p1_tokens, sizeof got), 0);
}

static void test_generate_bad_input(void) {
  const int32_t outside[] = {1, 512, 3}, bad_sum[] = {0, 70, 130}, backwards[] = {0, 90, 70, 135};
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "ids-outside.npy"), outside, 3));
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "cu-sum.npy"), bad_sum, 3));
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "cu-backwards.npy"), backwards, 4));
  const float not_int[] = {0, 135};
  upf_tensor t;
  const int64_t two = 2;
  upf_tensor_init(&t, (void *)not_int, UPF_DTYPE_F32, 1, &two);
  CU_ASSERT_EQUAL_FATAL(upf_npy_write(cli_path(&cli, "cu-f32.npy"), &t), UPF_OK);
  const char *ids = cli_path(&cli, "ids.npy"), *dirpath = cli_path(&cli, "a-directory");
  CU_ASSERT_EQUAL_FATAL(mkdir(dirpath, 0755), 0);
  char v[8][512];
  snprintf(v[0], sizeof v[0], "--token-ids %s", cli_path(&cli, "ids-outside.npy"));
  snprintf(v[1], sizeof v[1], "--token-ids %s --cu-seqlens %s", ids, cli_path(&cli, "cu-sum.npy"));
  snprintf(v[2], sizeof v[2], "--token-ids %s --cu-seqlens %s", ids, cli_path(&cli, "cu-backwards.npy"));
  snprintf(v[3], sizeof v[3], "--token-ids %s --cu-seqlens %s", ids, cli_path(&cli, "cu-f32.npy"));
  snprintf(v[4], sizeof v[4], "--token-ids %s --json %s", ids, dirpath);
  snprintf(v[5], sizeof v[5], "--token-ids %s/missing.npy", cli.dir);
  const struct {
    const char *args, *message;
  } bad[] = {
      {"--model llama-huge", "is not one of"},
      {"--max-new 0", "--max-new: 0 is out of range"},
      {"--max-new -3", "--max-new: -3 is out of range"},
      {"--mode fast", "--mode 'fast'"},
      {"--p 0.5", "need --mode uniprefill"},
      {"--mode uniprefill --keep 0", "--keep 0"},
      {"--mode uniprefill --p 0.5 --keep 0.5", "at most one of --p"},
      {"--dtype f16", "--dtype 'f16'"},
      {"--layers 4:9", "--layers '4:9'"},
      {v[0], "id 512 at 1 is outside the vocabulary"},
      {v[1], "--cu-seqlens"},
      {v[2], "--cu-seqlens"},
      {v[3], "want <i4 (B+1,)"},
      {v[4], "--json"},
      {v[5], "--token-ids"},
  };
  const char *out = cli_path(&cli, "must-not-exist.npy"), *json = cli_path(&cli, "must-not-exist.json");
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    char args[4096];
    snprintf(args, sizeof args, "generate %s --backend cpu %s %s %s --out-tokens %s%s%s",
             strstr(bad[i].args, "--model") ? "" : "--model llama-tiny", bad[i].args,
             strstr(bad[i].args, "--token-ids") ? "" : "--token-ids", strstr(bad[i].args, "--token-ids") ? "" : ids,
             out, strstr(bad[i].args, "--max-new") ? "" : " --max-new 3", strstr(bad[i].args, "--json") ? "" : " --json ");
    if (!strstr(bad[i].args, "--json"))
      strncat(args, json, sizeof args - strlen(args) - 1);
    CU_ASSERT_NOT_EQUAL(cli_run(&cli, "%s", args), 0);
    CLI_ASSERT_STDERR(&cli, bad[i].message);
    CU_ASSERT(!cli_exists(out) && !cli_exists(json));
  }
  /* the directory named as an output is left as it was */
  struct stat st;
  CU_ASSERT(stat(dirpath, &st) == 0 && S_ISDIR(st.st_mode));
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --help"), 0);
  CLI_ASSERT_STDOUT(&cli, "usage: upf generate");
}

void upf_register_cli_generate_tests(void) {
  static CU_TestInfo tests[] = {
      {"generate: tokens and JSON; the library's greedy loop", test_generate_outputs},
      {"generate: dense equals recomputation by upf prefill; p = 1 equals dense", test_generate_dense_recompute_and_p1},
      {"generate: bad input exits non-zero, named, nothing written", test_generate_bad_input},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("cli_generate", setup, teardown, tests);
}

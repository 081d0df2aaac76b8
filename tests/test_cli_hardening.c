/* Hostile-but-realistic inputs to the CLI (issue 28): outputs that would destroy files (a device
 * replaced, a link replaced, an input overwritten, half a run's outputs left behind), unbounded
 * inputs, and the messages that name the flag, the file and the reason. The output set
 * (uniprefill/output.h) is checked directly too. Runs the upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/engine.h"
#include "uniprefill/gguf.h"
#include "uniprefill/npy.h"
#include "uniprefill/output.h"
#include "uniprefill/tokenizer.h"

static cli_suite cli;

/* One metadata change to a copy of a GGUF file: a u32 ('u'), f32 ('f') or string ('s') value for key,
 * in place of the file's or added. */
typedef struct {
  const char *key;
  char kind;
  uint32_t u;
  float f;
  const char *s;
} kv_edit;

enum { TOK_NONE, TOK_SPM, TOK_SPM_DUPLICATE };

/* src rewritten to dst with the edits and, for tok != TOK_NONE, a SentencePiece tokenizer of as many
 * tokens as the embedding has rows ("<unk>", "<s>", "</s>", the 256 byte tokens, then words; one
 * text twice for TOK_SPM_DUPLICATE). 1 on success. */
static int rewrite_gguf(const char *src, const char *dst, const kv_edit *edits, int n_edits, int tok) {
  upf_gguf *g = NULL;
  upf_gguf_writer *w = NULL;
  if (upf_gguf_open(src, &g) != UPF_OK || upf_gguf_writer_create(&w) != UPF_OK) {
    upf_gguf_close(g);
    return 0;
  }
  int ok = 1, *used = calloc((size_t)n_edits + 1, sizeof *used);
  for (int64_t i = 0; ok && i < upf_gguf_kv_count(g); i++) {
    const upf_gguf_kv *kv = upf_gguf_kv_at(g, i);
    const char *key = upf_gguf_kv_key(kv), *str;
    if (tok != TOK_NONE && !strncmp(key, "tokenizer.", 10))
      continue;
    int e = 0;
    while (e < n_edits && strcmp(edits[e].key, key))
      e++;
    uint32_t u;
    float x;
    if (e < n_edits) {
      used[e] = 1;
      continue; /* written below */
    }
    if (upf_gguf_kv_type(kv) == UPF_GGUF_TYPE_STRING)
      ok = upf_gguf_get_str(g, key, &str, NULL) == UPF_OK && upf_gguf_set_str(w, key, str) == UPF_OK;
    else if (upf_gguf_kv_type(kv) == UPF_GGUF_TYPE_FLOAT32)
      ok = upf_gguf_get_f32(g, key, &x) == UPF_OK && upf_gguf_set_f32(w, key, x) == UPF_OK;
    else
      ok = upf_gguf_get_u32(g, key, &u) == UPF_OK && upf_gguf_set_u32(w, key, u) == UPF_OK;
  }
  for (int e = 0; ok && e < n_edits; e++)
    ok = (edits[e].kind == 'u'   ? upf_gguf_set_u32(w, edits[e].key, edits[e].u)
          : edits[e].kind == 'f' ? upf_gguf_set_f32(w, edits[e].key, edits[e].f)
                                 : upf_gguf_set_str(w, edits[e].key, edits[e].s)) == UPF_OK;
  const upf_gguf_tensor *embd = upf_gguf_tensor_find(g, "token_embd.weight");
  const int32_t V = embd ? (int32_t)embd->ne[1] : 0;
  char **texts = NULL;
  int32_t *types = NULL;
  if (ok && tok != TOK_NONE) {
    texts = calloc((size_t)V, sizeof *texts), types = calloc((size_t)V, sizeof *types);
    ok = texts && types && V > 300;
    for (int32_t i = 0; ok && i < V; i++) {
      char t[32];
      if (i < 3)
        snprintf(t, sizeof t, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
      else if (i < 259)
        snprintf(t, sizeof t, "<0x%02X>", i - 3);
      else
        snprintf(t, sizeof t, "\xe2\x96\x81w%d", tok == TOK_SPM_DUPLICATE && i == V - 1 ? i - 1 : i);
      types[i] = i == 0 ? UPF_TOKEN_UNKNOWN : i < 3 ? UPF_TOKEN_CONTROL : i < 259 ? UPF_TOKEN_BYTE : UPF_TOKEN_NORMAL;
      ok = (texts[i] = strdup(t)) != NULL;
    }
    ok = ok && upf_gguf_set_str(w, "tokenizer.ggml.model", "llama") == UPF_OK &&
         upf_gguf_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)texts, (uint64_t)V) == UPF_OK &&
         upf_gguf_set_arr(w, "tokenizer.ggml.token_type", UPF_GGUF_TYPE_INT32, types, (uint64_t)V) == UPF_OK;
  }
  for (int64_t i = 0; ok && i < upf_gguf_tensor_count(g); i++) {
    const upf_gguf_tensor *t = upf_gguf_tensor_at(g, i);
    ok = upf_gguf_add_tensor_ref(w, t->name, t->type, t->n_dims, t->ne, t->data, t->nbytes) == UPF_OK;
  }
  ok = ok && upf_gguf_writer_write(w, dst) == UPF_OK;
  for (int32_t i = 0; texts && i < V; i++)
    free(texts[i]);
  free(texts), free(types), free(used);
  upf_gguf_writer_free(w);
  upf_gguf_close(g);
  return ok;
}

static int setup(void) {
  if (cli_setup(&cli, "upf_hard"))
    return 1;
  /* the model file every --gguf case reads, and the same with a tokenizer */
  return cli_run(&cli, "export --model llama-tiny --dtype bf16 --out %s", cli_path(&cli, "m.gguf")) != 0 ||
         !rewrite_gguf(cli_path(&cli, "m.gguf"), cli_path(&cli, "tok.gguf"), NULL, 0, TOK_SPM);
}
static int teardown(void) { return cli_teardown(&cli); }

static long file_size(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

/* Temporaries an output set left in the suite's directory. */
static int leftover_temporaries(void) {
  DIR *d = opendir(cli.dir);
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    n += strstr(e->d_name, ".upf-") != NULL || strstr(e->d_name, ".tmp") != NULL;
  if (d)
    closedir(d);
  return n;
}

static int write_text_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f)
    return 0;
  fputs(text, f);
  return fclose(f) == 0;
}

/* ---- the output set ---- */

static void test_outputs_rules(void) {
  const char *reg = cli_path(&cli, "reg.txt"), *link = cli_path(&cli, "link.txt");
  CU_ASSERT_FATAL(write_text_file(reg, "old"));
  CU_ASSERT_FATAL(chmod(reg, 0600) == 0);
  unlink(link);
  CU_ASSERT_FATAL(symlink("reg.txt", link) == 0);
  /* a link followed: the file it names replaced, the link kept, the mode kept; /dev/null written
   * through, not replaced */
  upf_outputs *o;
  CU_ASSERT_EQUAL_FATAL(upf_outputs_create(&o, 0), UPF_OK);
  FILE *f1, *f2;
  CU_ASSERT_EQUAL(upf_outputs_open(o, link, "--a", &f1), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, "/dev/null", "--b", &f2), UPF_OK);
  fputs("new", f1), fputs("gone", f2);
  CU_ASSERT(cli_file_contains(reg, "old")); /* nothing lands before the commit */
  CU_ASSERT_EQUAL(upf_outputs_commit(o), UPF_OK);
  upf_outputs_free(o);
  struct stat ls, sb;
  CU_ASSERT(lstat(link, &ls) == 0 && S_ISLNK(ls.st_mode));
  CU_ASSERT(cli_file_contains(reg, "new") && !cli_file_contains(reg, "old"));
  CU_ASSERT(stat(reg, &sb) == 0 && (sb.st_mode & 0777) == 0600);
  CU_ASSERT(stat("/dev/null", &sb) == 0 && S_ISCHR(sb.st_mode));
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);

  /* two outputs naming one file (one through the link) */
  CU_ASSERT_EQUAL_FATAL(upf_outputs_create(&o, 0), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, reg, "--a", &f1), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, link, "--b", &f2), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "--a") && strstr(upf_last_error(), "--b"));
  upf_outputs_free(o);
  CU_ASSERT(cli_file_contains(reg, "new"));
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);

  /* a full device in the set: nothing lands, no temporary stays, the device stays a device */
  CU_ASSERT_EQUAL_FATAL(upf_outputs_create(&o, 0), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, reg, "--a", &f1), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, "/dev/full", "--json", &f2), UPF_OK);
  fputs("newer", f1), fputs("{}", f2);
  CU_ASSERT_EQUAL(upf_outputs_commit(o), UPF_ERR_IO);
  CU_ASSERT(strstr(upf_last_error(), "--json /dev/full") != NULL);
  upf_outputs_free(o);
  CU_ASSERT(cli_file_contains(reg, "new") && !cli_file_contains(reg, "newer"));
  CU_ASSERT(stat("/dev/full", &sb) == 0 && S_ISCHR(sb.st_mode));
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);

  /* a set freed without a commit leaves nothing */
  const char *fresh = cli_path(&cli, "fresh.txt");
  CU_ASSERT_EQUAL_FATAL(upf_outputs_create(&o, 0), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, fresh, NULL, &f1), UPF_OK);
  fputs("x", f1);
  upf_outputs_free(o);
  CU_ASSERT(!cli_exists(fresh));
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);

  /* a directory is refused */
  CU_ASSERT_EQUAL_FATAL(upf_outputs_create(&o, 1), UPF_OK);
  CU_ASSERT_EQUAL(upf_outputs_open(o, cli.dir, "--out", &f1), UPF_ERR_IO);
  CU_ASSERT(strstr(upf_last_error(), "a directory") != NULL);
  upf_outputs_free(o);
}

/* ---- data loss through the CLI ---- */

static void test_json_to_device_and_link(void) {
  /* /dev/full: the write fails, named, and the node stays a character device */
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 16 --json /dev/full"), 0);
  CLI_ASSERT_STDERR(&cli, "--json /dev/full");
  CLI_ASSERT_STDERR(&cli, "No space left on device");
  struct stat sb, ls;
  CU_ASSERT(stat("/dev/full", &sb) == 0 && S_ISCHR(sb.st_mode));
  /* a link: followed, the file it names replaced, the link kept */
  const char *target = cli_path(&cli, "target.json"), *link = cli_path(&cli, "link.json");
  CU_ASSERT_FATAL(write_text_file(target, "old"));
  unlink(link);
  CU_ASSERT_FATAL(symlink("target.json", link) == 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 16 --json %s", link), 0);
  CU_ASSERT(lstat(link, &ls) == 0 && S_ISLNK(ls.st_mode));
  CU_ASSERT(cli_file_contains(target, "\"model\": \"llama-tiny\""));
  /* export to stdout: the bytes through the descriptor, equal to the file */
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --dtype bf16 --out /dev/stdout"), 0);
  FILE *a = fopen(cli_path(&cli, "stdout.txt"), "rb"), *b = fopen(cli_path(&cli, "m.gguf"), "rb");
  int same = a && b;
  for (int x, y; same;) {
    x = fgetc(a), y = fgetc(b);
    same = x == y;
    if (x == EOF || y == EOF)
      break;
  }
  CU_ASSERT(same);
  if (a)
    fclose(a);
  if (b)
    fclose(b);
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);
}

static void test_output_naming_an_input(void) {
  const char *gguf = cli_path(&cli, "m.gguf");
  const long size = file_size(gguf);
  CU_ASSERT_FATAL(size > 100000);
  static const char *const flags[] = {"--json", "--out-logits"};
  for (int i = 0; i < 2; i++) {
    CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8 %s %s", gguf, flags[i], gguf), 2);
    CLI_ASSERT_STDERR(&cli, "--gguf");
    CLI_ASSERT_STDERR(&cli, flags[i]);
  }
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --gguf %s --backend cpu --token-ids %s --max-new 2 --out-tokens %s", gguf,
                          gguf, gguf), 2);
  CLI_ASSERT_STDERR(&cli, "--out-tokens");
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --gguf %s --backend cpu --requests 1 --prompt-len 8 --dump-tokens %s", gguf,
                          gguf), 2);
  CLI_ASSERT_STDERR(&cli, "--dump-tokens");
  /* a hard link is the same file under another name */
  const char *hard = cli_path(&cli, "hard.gguf");
  unlink(hard);
  CU_ASSERT_FATAL(link(gguf, hard) == 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8 --json %s", gguf, hard), 2);
  CLI_ASSERT_STDERR(&cli, "name one file");
  unlink(hard);
  CU_ASSERT_EQUAL(file_size(gguf), size);
  /* eval --json naming a --text-file */
  const char *text = cli_path(&cli, "text.txt");
  CU_ASSERT_FATAL(write_text_file(text, "some words to read and keep\n"));
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --tokens 8 --text-file %s --json %s", gguf,
                          text, text), 2);
  CLI_ASSERT_STDERR(&cli, "--text-file");
  CLI_ASSERT_STDERR(&cli, "--json");
  CU_ASSERT(cli_file_contains(text, "some words"));
  /* an output inside the --replay-masks folder */
  const char *masks = cli_path(&cli, "masks");
  mkdir(masks, 0755);
  char inside[512];
  snprintf(inside, sizeof inside, "%s/layer2.npy", masks);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode uniprefill --lengths 64 "
                                "--replay-masks %s --out-logits %s", masks, inside), 2);
  CLI_ASSERT_STDERR(&cli, "--replay-masks");
  CLI_ASSERT_STDERR(&cli, "--out-logits");
  CU_ASSERT(!cli_exists(inside));
}

static void test_all_outputs_or_none(void) {
  /* --out-logits lands only if --json does: /dev/full fails the run, o.npy never appears */
  const char *logits = cli_path(&cli, "o.npy");
  unlink(logits);
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 16 --out-logits %s --json "
                                    "/dev/full", logits), 0);
  CU_ASSERT(!cli_exists(logits));
  /* an existing output keeps its old bytes */
  CU_ASSERT_FATAL(write_text_file(logits, "old logits"));
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 16 --out-logits %s --json "
                                    "/dev/full", logits), 0);
  CU_ASSERT(cli_file_contains(logits, "old logits"));
  /* --dump-masks beside a full --json: no mask file */
  const char *dump = cli_path(&cli, "dump");
  mkdir(dump, 0755);
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode uniprefill --lengths 64 "
                                    "--dump-masks %s --json /dev/full", dump), 0);
  char layer[512];
  snprintf(layer, sizeof layer, "%s/layer2.npy", dump);
  CU_ASSERT(!cli_exists(layer));
  /* generate: --out-tokens and a full --json */
  const char *tokens = cli_path(&cli, "tokens.npy");
  unlink(tokens);
  const int32_t ids[4] = {1, 2, 3, 4};
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "ids.npy"), ids, 4));
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "generate --model llama-tiny --backend cpu --token-ids %s --max-new 2 "
                                    "--out-tokens %s --json /dev/full", cli_path(&cli, "ids.npy"), tokens), 0);
  CU_ASSERT(!cli_exists(tokens));
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);
}

/* ---- unbounded inputs ---- */

static void test_lengths_and_absorbing_values(void) {
  static const struct {
    const char *lengths, *want;
  } cases[] = {{"4,", "entry 2 ('') is not a token count"},
               {" 64", "entry 1 (' 64') is not a token count"},
               {"4,,4", "entry 2 ('') is not a token count"},
               {"+4", "entry 1 ('+4') is not a token count"},
               {"0", "a length of 0 is not a request"},
               {"3000000000", "longer than 2^31-1 tokens"}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths '%s'", cases[i].lengths), 2);
    CLI_ASSERT_STDERR(&cli, cases[i].want);
  }
  CU_ASSERT_FATAL(cli_write_text(&cli, "far.jsonl", "{\"arrival\": 1e308, \"prompt_len\": 4}\n"));
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --backend cpu --trace %s --json %s",
                              cli_path(&cli, "far.jsonl"), cli_path(&cli, "far.json")), 0);
  CLI_ASSERT_STDERR(&cli, "\"arrival\": 1e+308: want seconds in [0, 1e+09]");
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --backend cpu --requests 2 --prompt-len 4 --rate 1e-30 "
                                    "--json %s", cli_path(&cli, "far.json")), 0);
  CLI_ASSERT_STDERR(&cli, "--rate");
  CLI_ASSERT_STDERR(&cli, "past the bound");
  CU_ASSERT(!cli_exists(cli_path(&cli, "far.json")));
}

/* m.gguf copied with llama.context_length set to ctx. */
static int write_short_context(const char *path, uint32_t ctx) {
  FILE *f = fopen(cli_path(&cli, "m.gguf"), "rb");
  if (!f)
    return 0;
  static char buf[4 << 20];
  const size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  static const char key[] = "llama.context_length";
  char *at = NULL;
  for (size_t i = 0; i + sizeof key < n && !at; i++)
    if (!memcmp(buf + i, key, sizeof key - 1))
      at = buf + i + sizeof key - 1;
  if (!at)
    return 0;
  memcpy(at + 4, &ctx, 4); /* after the u32 type tag: the value (little-endian host) */
  f = fopen(path, "wb");
  const int ok = f && fwrite(buf, 1, n, f) == n;
  return f && fclose(f) == 0 && ok;
}

static void test_context_length(void) {
  const char *gguf = cli_path(&cli, "ctx32.gguf");
  CU_ASSERT_FATAL(write_short_context(gguf, 32));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 16,40", gguf), 2);
  CLI_ASSERT_STDERR(&cli, "--lengths: request 1 runs 40 positions");
  CLI_ASSERT_STDERR(&cli, "context_length 32");
  CLI_ASSERT_STDERR(&cli, "--allow-over-context");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 16,40 --allow-over-context", gguf), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 32", gguf), 0);
  /* generate counts the new tokens: 30 + 4 - 1 > 32 */
  int32_t ids[30];
  for (int i = 0; i < 30; i++)
    ids[i] = i + 1;
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "ids30.npy"), ids, 30));
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --gguf %s --backend cpu --token-ids %s --max-new 4", gguf,
                          cli_path(&cli, "ids30.npy")), 2);
  CLI_ASSERT_STDERR(&cli, "context_length 32");
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --gguf %s --backend cpu --requests 1 --prompt-len 40", gguf), 2);
  CLI_ASSERT_STDERR(&cli, "context_length 32");
}

/* A long trace parses in n log n: repeated ids found by sorting, not by comparing every pair (the
 * pairwise check took minutes here). The repeat named is the earliest. */
static void test_long_trace(void) {
  const int n = upf_test_quick() ? 2000 : 300000;
  char *text = malloc((size_t)n * 64 + 256); /* a line is at most 49 bytes, and two more follow */
  CU_ASSERT_FATAL(text != NULL);
  size_t len = 0;
  for (int i = 0; i < n; i++)
    len += (size_t)sprintf(text + len, "{\"arrival\": %d, \"prompt\": [1], \"id\": %d}\n", n - i, i);
  upf_trace t;
  CU_ASSERT_EQUAL(upf_trace_parse_jsonl(&t, text, "long", 16, 1), UPF_OK);
  CU_ASSERT(t.num_reqs == n && t.reqs[0].arrival == 1 && t.reqs[0].id == n - 1);
  upf_trace_free(&t);
  len += (size_t)sprintf(text + len, "{\"arrival\": 0, \"prompt\": [1], \"id\": 7}\n");
  len += (size_t)sprintf(text + len, "{\"arrival\": 0, \"prompt\": [1], \"id\": 3}\n");
  CU_ASSERT_EQUAL(upf_trace_parse_jsonl(&t, text, "long", 16, 1), UPF_ERR_FORMAT);
  char want[96];
  snprintf(want, sizeof want, "line %d: id 7 is also the id of line 8", n + 1);
  CU_ASSERT(strstr(upf_last_error(), want) != NULL);
  free(text);
}

/* ---- messages ---- */

/* Bad flag values exit 2 naming the flag and the reason: an empty value, an unknown backend or model,
 * numbers past their range reported as given. */
static void test_flag_values(void) {
  CU_ASSERT_EQUAL(cli_run(&cli, "tokenize --gguf %s --text ''", cli_path(&cli, "m.gguf")), 2);
  CLI_ASSERT_STDERR(&cli, "--text needs a value (the one given is empty)");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend tpu --lengths 8"), 2);
  CLI_ASSERT_STDERR(&cli, "--backend");
  CLI_ASSERT_STDERR(&cli, "'tpu'");
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --backend tpu --requests 1 --prompt-len 4"), 2);
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --model llama-tiny --backend tpu --task ppl --tokens 8"), 2);
  CLI_ASSERT_STDERR(&cli, "--backend");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-huge --backend cpu --lengths 8"), 2);
  CLI_ASSERT_STDERR(&cli, "--model");
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --model llama-huge --backend cpu --task ppl --tokens 8"), 2);
  CLI_ASSERT_STDERR(&cli, "--model");
  /* a tiny budget is shown as given, not as 0.000 */
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --backend cpu --requests 1 --prompt-len 4 --kv-gib 1e-9"), 2);
  CLI_ASSERT_STDERR(&cli, "--kv-gib 1e-09:");
  CLI_ASSERT_STDERR(&cli, "needs 0.01");
  /* too large: the range is said, not "a length of 0" */
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --backend cpu --requests 1 --prompt-len 1099511627776"), 2);
  CLI_ASSERT_STDERR(&cli, "--prompt-len '1099511627776'");
  CLI_ASSERT_STDERR(&cli, "B <= 2147483647");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 1099511627776"), 2);
  CLI_ASSERT_STDERR(&cli, "entry 1 ('1099511627776') makes the batch longer than 2^31-1 tokens");
  CU_ASSERT(!cli_stderr_has(&cli, "a length of 0"));
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --model llama-tiny --backend cpu --task ppl --tokens 1e12"), 2);
  CLI_ASSERT_STDERR(&cli, "--tokens '1e12': want whole token counts in [2, 2147483647]");
}

/* --seed where nothing is drawn from it is refused, naming the command; where it draws, it runs. */
static void test_seed_that_means_nothing(void) {
  const char *gguf = cli_path(&cli, "m.gguf"), *ids = cli_path(&cli, "ids4.npy");
  const int32_t v[4] = {1, 2, 3, 4};
  CU_ASSERT_FATAL(cli_write_i32(ids, v, 4));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --token-ids %s --seed 3", gguf, ids), 2);
  CLI_ASSERT_STDERR(&cli, "upf prefill: --seed 3 means nothing");
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --gguf %s --backend cpu --token-ids %s --max-new 2 --seed 3", gguf, ids), 2);
  CLI_ASSERT_STDERR(&cli, "upf generate: --seed 3 means nothing");
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --seed 3", gguf), 2);
  CLI_ASSERT_STDERR(&cli, "upf eval: --seed 3 means nothing");
  CU_ASSERT_FATAL(cli_write_text(&cli, "one.jsonl", "{\"arrival\": 0, \"prompt_len\": 4}\n"));
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --gguf %s --backend cpu --trace %s --seed 3", gguf,
                          cli_path(&cli, "one.jsonl")), 2);
  CLI_ASSERT_STDERR(&cli, "upf serve-sim: --seed 3 means nothing");
  /* the seed draws the ids of --lengths, and a built-in model's weights */
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8 --seed 3", gguf), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --token-ids %s --seed 3", ids), 0);
}

/* eval: the default --last fits a model that observes fewer positions; one given is checked; the
 * GGUF's context_length holds as in prefill. */
static void test_eval_defaults_and_context(void) {
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --model llama-tiny --backend cpu --task next-token --tokens 64 --windows 1"), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --model llama-tiny --backend cpu --task next-token --tokens 64 --last 128"), 2);
  CLI_ASSERT_STDERR(&cli, "--last 128: at most the model's last-q (16)");
  const char *gguf = cli_path(&cli, "ctx32t.gguf");
  const kv_edit ctx[] = {{"llama.context_length", 'u', 32}};
  CU_ASSERT_FATAL(rewrite_gguf(cli_path(&cli, "m.gguf"), gguf, ctx, 1, TOK_SPM));
  const char *text = cli_path(&cli, "words.txt");
  FILE *f = fopen(text, "w");
  CU_ASSERT_FATAL(f != NULL);
  for (int i = 0; i < 400; i++)
    fprintf(f, "w%d ", 300 + i % 200);
  fclose(f);
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --tokens 40 --text-file %s", gguf, text), 2);
  CLI_ASSERT_STDERR(&cli, "--tokens 40: past the context_length 32");
  CLI_ASSERT_STDERR(&cli, "--allow-over-context");
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --tokens 40 --text-file %s "
                                "--allow-over-context", gguf, text), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --tokens 32 --text-file %s", gguf, text), 0);
  /* the text's faults are the text file's, with the reason */
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --tokens 16 --text-file %s", gguf, cli.dir), 1);
  CLI_ASSERT_STDERR(&cli, "--text-file");
  CLI_ASSERT_STDERR(&cli, "is a directory");
  CU_ASSERT_EQUAL(cli_run(&cli, "eval --gguf %s --backend cpu --task ppl --tokens 16 --text-file %s", gguf,
                          cli_path(&cli, "absent.txt")), 1);
  CLI_ASSERT_STDERR(&cli, "--text-file");
  CLI_ASSERT_STDERR(&cli, "No such file or directory");
  CU_ASSERT(!cli_stderr_has(&cli, "--gguf"));
}

/* Files whose metadata the model or tokenizer cannot use are refused when read, naming the file and
 * the key: a BOS outside the vocabulary, a vocabulary of 0, an epsilon of NaN, a window of 0; and the
 * library's messages are joined to the file name with a separator. */
static void test_bad_metadata(void) {
  const char *m = cli_path(&cli, "m.gguf");
  const char *bos = cli_path(&cli, "bos.gguf"), *vocab0 = cli_path(&cli, "vocab0.gguf");
  const char *eps = cli_path(&cli, "eps.gguf"), *dup = cli_path(&cli, "dup.gguf");
  const kv_edit bos_edit[] = {{"tokenizer.ggml.bos_token_id", 'u', 600}};
  CU_ASSERT_FATAL(rewrite_gguf(m, bos, bos_edit, 1, TOK_SPM));
  CU_ASSERT_EQUAL(cli_run(&cli, "tokenize --gguf %s --text hi", bos), 1);
  CLI_ASSERT_STDERR(&cli, "tokenizer.ggml.bos_token_id is 600, outside the vocabulary [0, 512)");
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --text hi", bos), 0);
  CLI_ASSERT_STDERR(&cli, "--gguf");
  CLI_ASSERT_STDERR(&cli, "bos_token_id");
  /* the same file with the BOS in range tokenizes */
  const kv_edit bos_ok[] = {{"tokenizer.ggml.bos_token_id", 'u', 1}};
  CU_ASSERT_FATAL(rewrite_gguf(m, bos, bos_ok, 1, TOK_SPM));
  CU_ASSERT_EQUAL(cli_run(&cli, "tokenize --gguf %s --text hi", bos), 0);
  CLI_ASSERT_STDOUT(&cli, "ids: 1 ");

  const kv_edit v0[] = {{"llama.vocab_size", 'u', 0}};
  CU_ASSERT_FATAL(rewrite_gguf(m, vocab0, v0, 1, TOK_NONE));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8", vocab0), 1);
  CLI_ASSERT_STDERR(&cli, "a vocabulary of 0 tokens (llama.vocab_size)");

  const kv_edit nan_eps[] = {{"llama.attention.layer_norm_rms_epsilon", 'f', 0, NAN}};
  CU_ASSERT_FATAL(rewrite_gguf(m, eps, nan_eps, 1, TOK_NONE));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8", eps), 1);
  CLI_ASSERT_STDERR(&cli, "llama.attention.layer_norm_rms_epsilon is nan: want a finite number > 0");
  CU_ASSERT(!cli_stderr_has(&cli, "memory plan")); /* found at the config read, before any weight */

  const char *g = cli_path(&cli, "g.gguf"), *win0 = cli_path(&cli, "win0.gguf");
  CU_ASSERT_FATAL(cli_run(&cli, "export --model gemma3-tiny --out %s", g) == 0);
  const kv_edit w0[] = {{"gemma3.attention.sliding_window", 'u', 0}};
  CU_ASSERT_FATAL(rewrite_gguf(g, win0, w0, 1, TOK_NONE));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8", win0), 1);
  CLI_ASSERT_STDERR(&cli, "gemma3.attention.sliding_window is 0");
  CU_ASSERT(!cli_stderr_has(&cli, "is absent"));

  /* "FILE: tokenizer: ..." and "saving the GGUF: PATH", never run together */
  CU_ASSERT_FATAL(rewrite_gguf(m, dup, NULL, 0, TOK_SPM_DUPLICATE));
  CU_ASSERT_EQUAL(cli_run(&cli, "tokenize --gguf %s --text hi", dup), 1);
  char joined[256];
  snprintf(joined, sizeof joined, "%s: tokenizer: duplicate token text", dup);
  CLI_ASSERT_STDERR(&cli, joined);
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --out %s/no-such-dir/x.gguf", cli.dir), 2);
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --out /proc/version"), 1);
  CLI_ASSERT_STDERR(&cli, ": /proc/version: ");
  CU_ASSERT(!cli_stderr_has(&cli, "export/proc"));

  /* an id past int32 is reported as given */
  const char *wide = cli_path(&cli, "wide.npy");
  int64_t big[2] = {1, (int64_t)1 << 40}, n = 2;
  upf_tensor t;
  CU_ASSERT_FATAL(upf_tensor_init(&t, big, UPF_DTYPE_I64, 1, &n) == UPF_OK && upf_npy_write(wide, &t) == UPF_OK);
  CU_ASSERT_EQUAL(cli_run(&cli, "tokenize --gguf %s --decode %s", bos, wide), 1);
  CLI_ASSERT_STDERR(&cli, "ids[1] = 1099511627776 is outside the vocabulary [0, 512)");
}

/* Inputs named with the reason: --cu-seqlens said in prefill's words, replay masks with their file and
 * layer, a directory where a file belongs. */
static void test_input_messages(void) {
  const char *ids = cli_path(&cli, "ids10.npy"), *cu = cli_path(&cli, "cu5.npy");
  int32_t v[10], c[2] = {0, 5};
  for (int i = 0; i < 10; i++)
    v[i] = i + 1;
  CU_ASSERT_FATAL(cli_write_i32(ids, v, 10) && cli_write_i32(cu, c, 2));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --token-ids %s --cu-seqlens %s", ids, cu), 2);
  CLI_ASSERT_STDERR(&cli, "--cu-seqlens");
  CLI_ASSERT_STDERR(&cli, "must be the 10 tokens of --token-ids");
  CU_ASSERT(!cli_stderr_has(&cli, "q/k"));

  const char *masks = cli_path(&cli, "rmasks");
  mkdir(masks, 0755);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode uniprefill --lengths 64 "
                                      "--dump-masks %s", masks), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode uniprefill --lengths 80 "
                                "--replay-masks %s", masks), 2);
  char want[512];
  snprintf(want, sizeof want, "%s/layer2.npy (drop layer 2): replay mask: 64 entries, the layer has 80 tokens", masks);
  CLI_ASSERT_STDERR(&cli, want);
  /* the second drop layer sees the tokens the first mask kept */
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode uniprefill --lengths 64 "
                                "--replay-masks %s", masks), 0);

  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --backend cpu --lengths 8", cli.dir), 1);
  CLI_ASSERT_STDERR(&cli, "is a directory, not a GGUF file");
  CU_ASSERT_EQUAL(cli_run(&cli, "tokenize --gguf %s --file %s", cli_path(&cli, "tok.gguf"), cli.dir), 1);
  CLI_ASSERT_STDERR(&cli, "--file");
  CLI_ASSERT_STDERR(&cli, "is a directory");
}

/* block-sparse, --dump-tables and verify --log land with the run or not at all. */
static void test_more_outputs_all_or_none(void) {
  const char *tables = cli_path(&cli, "tables");
  mkdir(tables, 0755);
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode compact --chunk 32 --lengths 100 "
                                    "--dump-tables %s --json /dev/full", tables), 0);
  CLI_ASSERT_STDERR(&cli, "--json /dev/full");
  DIR *d = opendir(tables);
  int entries = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    entries += e->d_name[0] != '.';
  if (d)
    closedir(d);
  CU_ASSERT_EQUAL(entries, 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --mode compact --chunk 32 --lengths 100 "
                                "--dump-tables %s", tables), 0);
  char chunk[512];
  snprintf(chunk, sizeof chunk, "%s/layer0/chunk1.npy", tables);
  CU_ASSERT(cli_exists(chunk));

  /* block-sparse: --out lands only if --out-blocks does */
  const int64_t T = 130, qs[3] = {T, 2, 64}, ks[3] = {T, 1, 64};
  float *x = malloc((size_t)T * 2 * 64 * sizeof *x);
  CU_ASSERT_FATAL(x != NULL);
  for (int64_t i = 0; i < T * 2 * 64; i++)
    x[i] = (float)((i * 37) % 11) / 11.0f - 0.5f;
  upf_tensor q, k;
  const int32_t cu2[2] = {0, (int32_t)T};
  CU_ASSERT_FATAL(upf_tensor_init(&q, x, UPF_DTYPE_F32, 3, qs) == UPF_OK &&
                  upf_npy_write(cli_path(&cli, "bq.npy"), &q) == UPF_OK &&
                  upf_tensor_init(&k, x, UPF_DTYPE_F32, 3, ks) == UPF_OK &&
                  upf_npy_write(cli_path(&cli, "bk.npy"), &k) == UPF_OK &&
                  cli_write_i32(cli_path(&cli, "bcu.npy"), cu2, 2));
  free(x);
  const char *bout = cli_path(&cli, "bout.npy");
  unlink(bout);
  const char *bs = "block-sparse --backend cpu --q %s --k %s --v %s --cu-seqlens %s --out %s --out-blocks %s";
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, bs, cli_path(&cli, "bq.npy"), cli_path(&cli, "bk.npy"), cli_path(&cli, "bk.npy"),
                              cli_path(&cli, "bcu.npy"), bout, "/dev/full"), 0);
  CLI_ASSERT_STDERR(&cli, "--out-blocks /dev/full");
  CU_ASSERT(!cli_exists(bout));
  CU_ASSERT_EQUAL(cli_run(&cli, bs, cli_path(&cli, "bq.npy"), cli_path(&cli, "bk.npy"), cli_path(&cli, "bk.npy"),
                          cli_path(&cli, "bcu.npy"), bout, cli_path(&cli, "bblk.npy")), 0);
  CU_ASSERT(cli_exists(bout));

  const char *log = cli_path(&cli, "verify.log");
  CU_ASSERT_FATAL(write_text_file(log, "old log"));
  CU_ASSERT_EQUAL(cli_run(&cli, "verify --backend cpu --log %s norm.rms", log), 0);
  CU_ASSERT(cli_file_contains(log, "checks:") && !cli_file_contains(log, "old log"));
  CU_ASSERT_EQUAL(cli_run(&cli, "verify --backend cpu --log /dev/full norm.rms"), 1);
  CLI_ASSERT_STDERR(&cli, "--log /dev/full");
  CU_ASSERT_EQUAL(leftover_temporaries(), 0);
}

/* --plan-only states what a run would take without building it: Llama-3.1-8B's 8,030,261,248 bf16
 * parameters are 14.96 GiB; Qwen3-Next-80B-A3B's projections in FP8 are 75.11 GiB. A run that built the
 * model (16 GB, 160 GB) would not return within the test. */
static void test_plan_only(void) {
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama3.1-8b --lengths 8192 --backend cpu --plan-only"), 0);
  CLI_ASSERT_STDOUT(&cli, "weights 14.96 GiB");
  CLI_ASSERT_STDOUT(&cli, "nothing was allocated");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model qwen3-next-80b-a3b --lengths 131072 --backend cpu --plan-only"), 0);
  CLI_ASSERT_STDOUT(&cli, "(75.11 GiB of them)");
}

void upf_register_cli_hardening_tests(void) {
  static const CU_TestInfo tests[] = {
      {"output set: links followed, devices written through, all or none", test_outputs_rules},
      {"--json onto /dev/full and a link; export to stdout", test_json_to_device_and_link},
      {"an output naming an input is refused", test_output_naming_an_input},
      {"a failed output leaves none of the run's outputs", test_all_outputs_or_none},
      {"--lengths, arrivals and rates that absorb are refused", test_lengths_and_absorbing_values},
      {"the GGUF's context_length is enforced", test_context_length},
      {"--plan-only: the memory plan without building the model", test_plan_only},
      {"a long trace: linear checks, the earliest repeat named", test_long_trace},
      {"bad flag values exit 2, named as given", test_flag_values},
      {"--seed where it draws nothing is refused", test_seed_that_means_nothing},
      {"eval: the default --last fits, context_length enforced, text faults named", test_eval_defaults_and_context},
      {"bad GGUF metadata refused at read, naming the key", test_bad_metadata},
      {"inputs named with the reason", test_input_messages},
      {"block-sparse, --dump-tables, verify --log: all or none", test_more_outputs_all_or_none},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("cli hardening", setup, teardown, tests);
}

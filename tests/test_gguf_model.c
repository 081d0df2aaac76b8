/* Models from and to GGUF files (models/gguf_model.c):
 *  - round trip: a seeded tiny llama / gemma3 model saved and loaded back holds the same tensors (bit
 *    for bit, except Gemma's f32 norm offsets, which pass through 1 + w) and gives the same logits;
 *  - the saved files of all three architectures read by gguf-py (tests/gguf_model_check.py) when its
 *    venv exists;
 *  - the real files (SmolLM2-135M, Gemma-3-270M; skipped by name when absent): the config read from
 *    the metadata, and last-position logits against transformers' (tests/data/gguf_golden.txt);
 *  - bad files: an unknown architecture, a missing tensor, a wrong shape, a partial model to save;
 *  - (GPU) a file loaded on CUDA holds the same bits as on the CPU. */
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

#include "tests/test_util.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model.h"

static char root[PATH_MAX]; /* the repository: the parent of the test binary's build directory */
static char dir[64];

static int setup(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return 1;
  self[n] = '\0';
  snprintf(root, sizeof root, "%s", dirname(dirname(self)));
  snprintf(dir, sizeof dir, "/tmp/upf_gguf_model_XXXXXX");
  return mkdtemp(dir) ? 0 : 1;
}

static int teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : 1;
}

static int is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* Every tensor of a model as host f32, in upf_model_for_each_tensor order. */
typedef struct {
  int n;
  char names[512][64];
  float *data[512];
  int64_t numel[512];
} host_tensors;

static upf_status grab(const char *name, upf_tensor *t, void *user) {
  host_tensors *h = user;
  if (h->n == 512)
    return upf_fail(UPF_ERR_INVALID_ARG, "too many tensors");
  const int64_t n = upf_tensor_numel(t);
  const size_t es = upf_dtype_size(t->dtype);
  void *raw = malloc((size_t)n * es);
  float *f = malloc((size_t)n * sizeof *f);
  if (!raw || !f)
    return free(raw), free(f), upf_fail(UPF_ERR_NOMEM, "grab");
  upf_status st = upf_backend_cpu()->download(raw, t->data, (size_t)n * es);
  for (int64_t i = 0; i < n; i++)
    f[i] = t->dtype == UPF_DTYPE_BF16 ? upf_bf16_to_f32(((uint16_t *)raw)[i]) : ((float *)raw)[i];
  free(raw);
  snprintf(h->names[h->n], sizeof h->names[h->n], "%s", name);
  h->data[h->n] = f, h->numel[h->n] = n;
  h->n++;
  return st;
}

static void host_free(host_tensors *h) {
  for (int i = 0; i < h->n; i++)
    free(h->data[i]);
  h->n = 0;
}

static int norm_name(const char *name) { return strstr(name, "norm.weight") != NULL; }

/* A fixed prompt of n ids below vocab. */
static void prompt_ids(int32_t vocab, int32_t n, int32_t *ids) {
  for (int32_t t = 0; t < n; t++)
    ids[t] = (int32_t)(((uint32_t)t * 2654435761u + 17u) % (uint32_t)vocab);
}

static int prefill(const upf_model *m, upf_prefill_mode mode, const upf_model_config *sel, int32_t T, float *logits) {
  int32_t *ids = malloc((size_t)T * sizeof *ids), cu[2] = {0, T};
  prompt_ids(m->cfg->vocab, T, ids);
  upf_prefill_options o = {.mode = mode, .select = sel->select};
  upf_prefill_result res;
  upf_status st = upf_model_prefill(m, ids, cu, 1, &o, &res);
  free(ids);
  if (st != UPF_OK) {
    printf("\n  prefill: %s\n", upf_last_error());
    return 0;
  }
  memcpy(logits, res.logits, (size_t)m->cfg->vocab * sizeof *logits);
  upf_prefill_result_free(&res);
  return 1;
}

/* Seeded tiny model -> file -> model: config, tensors and logits. */
static void round_trip(const char *model, upf_dtype dt) {
  const upf_model_config *cfg = upf_model_config_by_name(model);
  const upf_backend *cpu = upf_backend_cpu();
  upf_model a, b;
  CU_ASSERT_FATAL(upf_model_init_seeded(&a, cfg, cpu, dt, 5, 0, cfg->num_layers) == UPF_OK);
  char path[128];
  snprintf(path, sizeof path, "%s/%s-%s.gguf", dir, model, upf_dtype_name(dt));
  upf_status st = upf_model_save_gguf(&a, path, dt);
  if (st != UPF_OK)
    printf("\n  save: %s\n", upf_last_error());
  CU_ASSERT_FATAL(st == UPF_OK);
  upf_gguf *g = NULL;
  CU_ASSERT_FATAL(upf_gguf_open(path, &g) == UPF_OK);
  static upf_gguf_model_config gc; /* cfg.name points into it: it stays put */
  st = upf_model_config_from_gguf(g, &gc);
  if (st != UPF_OK)
    printf("\n  config: %s\n", upf_last_error());
  CU_ASSERT_FATAL(st == UPF_OK);
  upf_model_config *c = &gc.cfg;
  /* what the file states, and what the table and the rules add, equal the built-in config */
  CU_ASSERT_STRING_EQUAL(c->name, cfg->name);
  CU_ASSERT(c->family == cfg->family && c->hidden == cfg->hidden && c->num_layers == cfg->num_layers);
  CU_ASSERT(c->vocab == cfg->vocab && c->q_heads == cfg->q_heads && c->kv_heads == cfg->kv_heads);
  CU_ASSERT(c->head_dim == cfg->head_dim && c->inter == cfg->inter && c->act == cfg->act);
  CU_ASSERT(c->qk_norm == cfg->qk_norm && c->sandwich_norm == cfg->sandwich_norm);
  CU_ASSERT(c->full_attn_interval == cfg->full_attn_interval && c->other_mixer == cfg->other_mixer);
  CU_ASSERT(c->window == cfg->window && c->attn.scale == cfg->attn.scale && c->embed_scale == cfg->embed_scale);
  CU_ASSERT(c->tied_embeddings == cfg->tied_embeddings && !memcmp(&c->norm, &cfg->norm, sizeof c->norm));
  CU_ASSERT(c->drop_min_step_tokens == cfg->drop_min_step_tokens);
  CU_ASSERT_EQUAL(memcmp(&c->rope_full, &cfg->rope_full, sizeof c->rope_full), 0);
  CU_ASSERT_EQUAL(memcmp(&c->rope_sliding, &cfg->rope_sliding, sizeof c->rope_sliding), 0);
  /* the drop layers are the file's defaults (scaled); the UniPrefill comparison below uses the
   * built-in's */
  c->num_drop_layers = cfg->num_drop_layers;
  memcpy(c->drop_layers, cfg->drop_layers, sizeof c->drop_layers);
  c->select = cfg->select;
  st = upf_model_load_gguf(&b, g, c, cpu, dt, 0, c->num_layers);
  upf_gguf_close(g);
  if (st != UPF_OK)
    printf("\n  load: %s\n", upf_last_error());
  CU_ASSERT_FATAL(st == UPF_OK);
  CU_ASSERT_EQUAL(a.weight_bytes, b.weight_bytes);

  host_tensors *ha = calloc(1, sizeof *ha), *hb = calloc(1, sizeof *hb);
  CU_ASSERT_FATAL(ha && hb);
  CU_ASSERT(upf_model_for_each_tensor(&a, grab, ha) == UPF_OK);
  CU_ASSERT(upf_model_for_each_tensor(&b, grab, hb) == UPF_OK);
  CU_ASSERT_EQUAL(ha->n, hb->n);
  /* Gemma's norm offsets w go out as 1 + w and come back as (1 + w) - 1: exact in bf16 for
   * |w| >= 2^-16 (w's last bit is then >= 2^-23) and in f32 only up to the rounding of 1 + w
   * (half an ulp of [0.5, 2): at most 2^-24). Everything else is moved, never computed: exact. */
  const int inexact_norms = cfg->norm.zero_centred;
  int64_t mismatched = 0;
  double worst_norm = 0;
  for (int i = 0; i < ha->n && i < hb->n; i++) {
    CU_ASSERT_STRING_EQUAL(ha->names[i], hb->names[i]);
    CU_ASSERT_EQUAL_FATAL(ha->numel[i], hb->numel[i]);
    for (int64_t j = 0; j < ha->numel[i]; j++) {
      const float x = ha->data[i][j], y = hb->data[i][j];
      if (inexact_norms && norm_name(ha->names[i]) && (dt == UPF_DTYPE_F32 || fabsf(x) < 0x1p-16f)) {
        worst_norm = fmax(worst_norm, fabs((double)x - y));
        continue;
      }
      if (memcmp(&x, &y, sizeof x) && mismatched++ < 3)
        printf("\n  %s[%lld]: %a saved, %a loaded", ha->names[i], (long long)j, (double)x, (double)y);
    }
  }
  CU_ASSERT_EQUAL(mismatched, 0);
  CU_ASSERT(worst_norm <= 0x1p-24);

  /* logits: dense and UniPrefill (the built-in drop layers and selection) */
  const int32_t T = upf_test_quick() ? 48 : 160;
  float *la = malloc((size_t)cfg->vocab * sizeof *la), *lb = malloc((size_t)cfg->vocab * sizeof *lb);
  for (int mode = 0; mode < 2; mode++) {
    const upf_prefill_mode pm = mode ? UPF_PREFILL_UNIPREFILL : UPF_PREFILL_DENSE;
    if (!prefill(&a, pm, cfg, T, la) || !prefill(&b, pm, cfg, T, lb)) {
      CU_FAIL("prefill");
      continue;
    }
    double worst = 0, scale = 0;
    for (int32_t v = 0; v < cfg->vocab; v++)
      worst = fmax(worst, fabs((double)la[v] - lb[v])), scale = fmax(scale, fabs((double)la[v]));
    if (inexact_norms && dt == UPF_DTYPE_F32) {
      /* norm weights moved by <= 2^-24 (relative ~2^-24 .. 2^-21 of 1 + w) over 9 layers: a few f32
       * ulps of the logits' scale */
      CU_ASSERT(worst <= 1e-5 * scale);
    } else {
      CU_ASSERT_EQUAL(memcmp(la, lb, (size_t)cfg->vocab * sizeof *la), 0);
    }
    if (worst > 0)
      printf("(%s %s %s: max |logit diff| %.3g of %.3g) ", model, upf_dtype_name(dt), mode ? "uniprefill" : "dense",
             worst, scale);
  }
  free(la), free(lb);
  host_free(ha), host_free(hb);
  free(ha), free(hb);
  upf_model_free(&a), upf_model_free(&b);
}

static void test_round_trip_llama(void) {
  round_trip("llama-tiny", UPF_DTYPE_F32);
  if (!upf_test_quick())
    round_trip("llama-tiny", UPF_DTYPE_BF16);
}

static void test_round_trip_gemma3(void) {
  round_trip("gemma3-tiny", UPF_DTYPE_BF16);
  if (!upf_test_quick())
    round_trip("gemma3-tiny", UPF_DTYPE_F32);
}

static void test_gguf_py_reads_exports(void) {
  static const char test[] = "gguf-py reads the exports";
  static char py[PATH_MAX];
  if (upf_test_skip_quick("gguf model", test, "the native pass runs gguf-py") ||
      !upf_test_gguf_python(py, sizeof py, "gguf model", test))
    return;
  static const char *const models[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
  static const char *const archs[] = {"llama", "gemma3", "qwen3next"};
  for (int i = 0; i < 3; i++)
    for (int d = 0; d < 2; d++) {
      const upf_model_config *cfg = upf_model_config_by_name(models[i]);
      const upf_dtype dt = d ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
      upf_model m;
      CU_ASSERT_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 3, 0, cfg->num_layers) == UPF_OK);
      char path[128], cmd[PATH_MAX * 2 + 1024];
      snprintf(path, sizeof path, "%s/check-%s-%d.gguf", dir, models[i], d);
      upf_status st = upf_model_save_gguf(&m, path, dt);
      upf_model_free(&m);
      if (st != UPF_OK)
        printf("\n  save %s: %s\n", models[i], upf_last_error());
      CU_ASSERT_FATAL(st == UPF_OK);
      snprintf(cmd, sizeof cmd,
               "'%s' '%s/tests/gguf_model_check.py' %s %s embedding_length=%d block_count=%d attention.head_count=%d "
               "attention.head_count_kv=%d attention.key_length=%d vocab_size=%d rope.freq_base=%g "
               "attention.layer_norm_rms_epsilon=%g > %s/check.txt 2>&1",
               py, root, path, archs[i], cfg->hidden, cfg->num_layers, cfg->q_heads, cfg->kv_heads, cfg->head_dim,
               cfg->vocab, cfg->rope_full.theta, (double)cfg->norm.eps, dir);
      const int rc = system(cmd);
      if (!WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
        snprintf(cmd, sizeof cmd, "cat %s/check.txt", dir);
        if (system(cmd) != 0)
          printf("(no output)\n");
      }
      CU_ASSERT(WIFEXITED(rc) && WEXITSTATUS(rc) == 0);
    }
}

/* ---- Real files ---- */

/* The real file's path (static), or NULL after printing why `test` is skipped: absent, or quick mode. */
static const char *model_file(const char *file, const char *test) {
  static char path[PATH_MAX];
  if (upf_test_skip_quick("gguf model", test, "the real files are read in the native pass"))
    return NULL;
  return upf_test_model_file(path, sizeof path, file, "gguf model", test);
}

static void test_real_configs(void) {
  if (upf_test_skip_quick("gguf model", "real configs", "the real files are read in the native pass"))
    return;
  const char *p = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "real configs");
  upf_gguf *g = NULL;
  static upf_gguf_model_config s, m;
  if (p) {
    CU_ASSERT_FATAL(upf_gguf_open(p, &g) == UPF_OK);
    CU_ASSERT_FATAL(upf_model_config_from_gguf(g, &s) == UPF_OK);
    upf_gguf_close(g);
    const upf_model_config *c = &s.cfg;
    /* HuggingFaceTB/SmolLM2-135M-Instruct config.json */
    CU_ASSERT(c->family == UPF_FAMILY_LLAMA && c->hidden == 576 && c->num_layers == 30 && c->inter == 1536);
    CU_ASSERT(c->q_heads == 9 && c->kv_heads == 3 && c->head_dim == 64 && c->vocab == 49152);
    CU_ASSERT(c->rope_full.theta == 100000.0 && c->rope_full.scaling == UPF_ROPE_DEFAULT && c->norm.eps == 1e-5f);
    CU_ASSERT(c->tied_embeddings && !c->norm.zero_centred && c->act == UPF_ACT_SILU && c->context_length == 8192);
    const int32_t drops[] = {7, 10, 14, 18, 22, 25}; /* 7, 11, ..., 27 of 32 at the same depths of 30 */
    CU_ASSERT_EQUAL(c->num_drop_layers, 6);
    CU_ASSERT_EQUAL(memcmp(c->drop_layers, drops, sizeof drops), 0);
  }
  p = model_file("gemma-3-270m-q4_k_m.gguf", "real configs");
  if (p) {
    CU_ASSERT_FATAL(upf_gguf_open(p, &g) == UPF_OK);
    CU_ASSERT_FATAL(upf_model_config_from_gguf(g, &m) == UPF_OK);
    upf_gguf_close(g);
    const upf_model_config *c = &m.cfg;
    /* google/gemma-3-270m config.json */
    CU_ASSERT(c->family == UPF_FAMILY_GEMMA3 && c->hidden == 640 && c->num_layers == 18 && c->inter == 2048);
    CU_ASSERT(c->q_heads == 4 && c->kv_heads == 1 && c->head_dim == 256 && c->vocab == 262144);
    CU_ASSERT(c->window == 512 && c->full_attn_interval == 6 && c->other_mixer == UPF_MIXER_SLIDING);
    CU_ASSERT(c->rope_full.theta == 1e6 && c->rope_sliding.theta == 10000.0 && c->rope_full.scaling == UPF_ROPE_DEFAULT);
    CU_ASSERT(c->attn.scale == 0.0f); /* query_pre_attn_scalar 256 = head_dim: 1/16 */
    CU_ASSERT(c->norm.zero_centred && c->qk_norm && c->sandwich_norm && c->tied_embeddings);
    CU_ASSERT(c->embed_scale == sqrtf(640.0f) && c->act == UPF_ACT_GELU_TANH && c->drop_min_step_tokens == 512);
    CU_ASSERT(c->num_drop_layers == 1 && c->drop_layers[0] == 11); /* globals 5, 11, 17: later half, not last */
  }
}

/* One golden record: the prompt and transformers' top-K logits at its last position. */
typedef struct {
  char file[128];
  int32_t n, ids[256];
  int32_t k, top_id[32];
  float top_logit[32];
} golden;

static int read_golden(FILE *f, golden *gd) {
  char word[32];
  while (fscanf(f, "%31s", word) == 1) {
    if (word[0] == '#') {
      int ch;
      while ((ch = fgetc(f)) != EOF && ch != '\n')
        ;
      continue;
    }
    if (strcmp(word, "prompt") || fscanf(f, "%127s %d", gd->file, &gd->n) != 2 || gd->n < 1 || gd->n > 256)
      return 0;
    for (int32_t i = 0; i < gd->n; i++)
      if (fscanf(f, "%d", &gd->ids[i]) != 1)
        return 0;
    if (fscanf(f, "%31s %d", word, &gd->k) != 2 || strcmp(word, "top") || gd->k < 1 || gd->k > 32)
      return 0;
    for (int32_t i = 0; i < gd->k; i++)
      if (fscanf(f, "%d:%f", &gd->top_id[i], &gd->top_logit[i]) != 2)
        return 0;
    return 1;
  }
  return 0;
}

/* Loads the file on the CPU in f32 and checks the last-position logits of its golden prompts: the
 * same argmax, and every golden top-K logit within the tolerance. transformers dequantises the same
 * blocks to the same f32 values and computes in f32 like our f32 path; what differs is the order of
 * the sums (OpenBLAS against ATen), ~1e-6 relative per product, grown through the layers: the
 * differences seen are ~3e-5 on logits of 10-30, and the tolerance 5e-4 leaves a margin for other
 * summation orders (thread counts, kernels) while a wrong convention (a missed permutation, the norm
 * offset, the embed scale, a RoPE base) moves logits by whole units. */
static void real_logits(const char *file, const char *test, double tol) {
  const char *p = model_file(file, test);
  if (!p)
    return;
  char gpath[PATH_MAX + 64];
  snprintf(gpath, sizeof gpath, "%s/tests/data/gguf_golden.txt", root);
  FILE *f = fopen(gpath, "r");
  CU_ASSERT_FATAL(f != NULL);
  upf_gguf *g = NULL;
  static upf_gguf_model_config gc;
  upf_model m;
  CU_ASSERT_FATAL(upf_gguf_open(p, &g) == UPF_OK);
  CU_ASSERT_FATAL(upf_model_config_from_gguf(g, &gc) == UPF_OK);
  upf_status st = upf_model_load_gguf(&m, g, &gc.cfg, upf_backend_cpu(), UPF_DTYPE_F32, 0, gc.cfg.num_layers);
  upf_gguf_close(g);
  if (st != UPF_OK)
    printf("\n  load: %s\n", upf_last_error());
  CU_ASSERT_FATAL(st == UPF_OK);
  golden gd;
  int prompts = 0;
  double worst = 0;
  while (read_golden(f, &gd)) {
    if (strcmp(gd.file, file))
      continue;
    prompts++;
    int32_t cu[2] = {0, gd.n};
    upf_prefill_options o = {.mode = UPF_PREFILL_DENSE, .select = gc.cfg.select};
    upf_prefill_result res;
    CU_ASSERT_FATAL(upf_model_prefill(&m, gd.ids, cu, 1, &o, &res) == UPF_OK);
    int32_t best = 0;
    for (int32_t v = 0; v < res.vocab; v++) {
      CU_ASSERT_FATAL(isfinite(res.logits[v]));
      if (res.logits[v] > res.logits[best])
        best = v;
    }
    CU_ASSERT_EQUAL(best, gd.top_id[0]);
    for (int32_t i = 0; i < gd.k; i++) {
      const double d = fabs((double)res.logits[gd.top_id[i]] - gd.top_logit[i]);
      worst = fmax(worst, d);
      if (d > tol)
        printf("\n  %s prompt %d: logit of %d is %.5f, transformers %.5f", file, prompts, gd.top_id[i],
               (double)res.logits[gd.top_id[i]], (double)gd.top_logit[i]);
      CU_ASSERT(d <= tol);
    }
    upf_prefill_result_free(&res);
  }
  fclose(f);
  CU_ASSERT(prompts >= 2);
  printf("(%d prompts, max |logit - transformers| %.2e) ", prompts, worst);
  upf_model_free(&m);
}

static void test_real_smollm2(void) { real_logits("SmolLM2-135M-Instruct.Q4_1.gguf", "real smollm2 logits", 5e-4); }
static void test_real_gemma3(void) { real_logits("gemma-3-270m-q4_k_m.gguf", "real gemma3 logits", 5e-4); }

/* ---- Bad input ---- */

static void test_bad_files(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, 0, cfg->num_layers) == UPF_OK);
  char good[128];
  snprintf(good, sizeof good, "%s/good.gguf", dir);
  CU_ASSERT_FATAL(upf_model_save_gguf(&m, good, UPF_DTYPE_F32) == UPF_OK);
  upf_model_free(&m);
  upf_gguf *g = NULL;
  CU_ASSERT_FATAL(upf_gguf_open(good, &g) == UPF_OK);

  /* rewrite the file with one change: an architecture, a dropped tensor, a reshaped tensor */
  for (int variant = 0; variant < 4; variant++) {
    upf_gguf_writer *w;
    CU_ASSERT_FATAL(upf_gguf_writer_create(&w) == UPF_OK);
    for (int64_t i = 0; i < upf_gguf_kv_count(g); i++) {
      const upf_gguf_kv *kv = upf_gguf_kv_at(g, i);
      const char *key = upf_gguf_kv_key(kv), *s;
      uint32_t u;
      float x;
      if (upf_gguf_kv_type(kv) == UPF_GGUF_TYPE_STRING) {
        CU_ASSERT(upf_gguf_get_str(g, key, &s, NULL) == UPF_OK);
        upf_gguf_set_str(w, key, variant == 0 && !strcmp(key, "general.architecture") ? "mamba" : s);
      } else if (upf_gguf_kv_type(kv) == UPF_GGUF_TYPE_FLOAT32) {
        CU_ASSERT(upf_gguf_get_f32(g, key, &x) == UPF_OK);
        upf_gguf_set_f32(w, key, x);
      } else {
        CU_ASSERT(upf_gguf_get_u32(g, key, &u) == UPF_OK);
        upf_gguf_set_u32(w, key, variant == 3 && !strcmp(key, "llama.feed_forward_length") ? u * 2 : u);
      }
    }
    for (int64_t i = 0; i < upf_gguf_tensor_count(g); i++) {
      const upf_gguf_tensor *t = upf_gguf_tensor_at(g, i);
      if (variant == 1 && !strcmp(t->name, "blk.3.attn_k.weight"))
        continue;
      int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
      if (variant == 2 && !strcmp(t->name, "blk.2.attn_v.weight"))
        ne[0] = t->ne[1], ne[1] = t->ne[0];
      CU_ASSERT(upf_gguf_add_tensor_ref(w, t->name, t->type, t->n_dims, ne, t->data, t->nbytes) == UPF_OK);
    }
    char bad[128];
    snprintf(bad, sizeof bad, "%s/bad%d.gguf", dir, variant);
    CU_ASSERT_FATAL(upf_gguf_writer_write(w, bad) == UPF_OK);
    upf_gguf_writer_free(w);
    upf_gguf *b = NULL;
    CU_ASSERT_FATAL(upf_gguf_open(bad, &b) == UPF_OK);
    static upf_gguf_model_config gc;
    upf_status st = upf_model_config_from_gguf(b, &gc);
    if (st == UPF_OK) { /* the tensor directory is checked when the weights are built */
      st = upf_model_load_gguf(&m, b, &gc.cfg, upf_backend_cpu(), UPF_DTYPE_F32, 0, gc.cfg.num_layers);
      CU_ASSERT(m.weight_bytes == 0 && m.token_embd.data == NULL); /* nothing left allocated */
    }
    const char *want[] = {"\"mamba\"", "blk.3.attn_k.weight", "blk.2.attn_v.weight", "blk.0.ffn_gate.weight"};
    CU_ASSERT(st == (variant == 0 ? UPF_ERR_UNSUPPORTED : UPF_ERR_FORMAT));
    CU_ASSERT(strstr(upf_last_error(), want[variant]) != NULL && strstr(upf_last_error(), bad) != NULL);
    if (!strstr(upf_last_error(), want[variant]))
      printf("\n  variant %d: %s", variant, upf_last_error());
    upf_gguf_close(b);
  }
  upf_gguf_close(g);

  /* a partial model is not a file; an integer dtype is no export type; neither leaves a file */
  CU_ASSERT_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, 1, 3) == UPF_OK);
  char out[128];
  snprintf(out, sizeof out, "%s/partial.gguf", dir);
  CU_ASSERT_EQUAL(upf_model_save_gguf(&m, out, UPF_DTYPE_F32), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "layers 1:3") != NULL);
  CU_ASSERT(!is_file(out));
  upf_model_free(&m);
  CU_ASSERT_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, 0, cfg->num_layers) == UPF_OK);
  CU_ASSERT_EQUAL(upf_model_save_gguf(&m, out, UPF_DTYPE_I32), UPF_ERR_DTYPE);
  CU_ASSERT(!is_file(out));
  snprintf(out, sizeof out, "%s/no/such/dir/x.gguf", dir);
  CU_ASSERT_EQUAL(upf_model_save_gguf(&m, out, UPF_DTYPE_F32), UPF_ERR_IO);
  upf_model_free(&m);
}

/* block_count outside 1..UPF_MODEL_MAX_LAYERS is refused naming the key, before the default drop
 * layers are placed: a Gemma-3 of 200 layers (the fuzzer's file, fuzz/corpus/gguf/regress-block-count.gguf)
 * wrote a drop layer past the end of drop_layers. */
static void test_block_count_bounds(void) {
  static const uint32_t counts[] = {200, 65, 0, 64};
  for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
    upf_gguf_writer *w;
    CU_ASSERT_FATAL(upf_gguf_writer_create(&w) == UPF_OK);
    upf_gguf_set_str(w, "general.architecture", "gemma3");
    upf_gguf_set_u32(w, "gemma3.embedding_length", 128);
    upf_gguf_set_u32(w, "gemma3.block_count", counts[i]);
    upf_gguf_set_u32(w, "gemma3.feed_forward_length", 256);
    upf_gguf_set_u32(w, "gemma3.attention.head_count", 4);
    upf_gguf_set_u32(w, "gemma3.attention.head_count_kv", 2);
    upf_gguf_set_u32(w, "gemma3.attention.sliding_window", 32);
    upf_gguf_set_f32(w, "gemma3.attention.layer_norm_rms_epsilon", 1e-6f);
    upf_gguf_set_u32(w, "gemma3.vocab_size", 4);
    static float embd[128 * 4];
    const int64_t ne[2] = {128, 4};
    CU_ASSERT(upf_gguf_add_tensor_ref(w, "token_embd.weight", UPF_GGML_TYPE_F32, 2, ne, embd, sizeof embd) == UPF_OK);
    void *img = NULL;
    uint64_t size = 0;
    upf_gguf *g = NULL;
    CU_ASSERT_FATAL(upf_gguf_writer_to_memory(w, &img, &size) == UPF_OK);
    upf_gguf_writer_free(w);
    CU_ASSERT_FATAL(upf_gguf_open_memory(img, size, "layers.gguf", &g) == UPF_OK);
    static upf_gguf_model_config gc;
    const upf_status st = upf_model_config_from_gguf(g, &gc);
    char want[96];
    snprintf(want, sizeof want, "layers.gguf: gemma3.block_count is %u: want 1 to 64 layers", counts[i]);
    if (counts[i] == 64) { /* the largest a build holds reads */
      CU_ASSERT_EQUAL(st, UPF_OK);
      CU_ASSERT(gc.cfg.num_layers == 64 && gc.cfg.num_drop_layers > 0 && gc.cfg.drop_layers[gc.cfg.num_drop_layers - 1] < 63);
    } else {
      CU_ASSERT_EQUAL(st, counts[i] ? UPF_ERR_UNSUPPORTED : UPF_ERR_FORMAT);
      CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), want));
    }
    upf_gguf_close(g);
    free(img);
  }
}

/* Bytes of two descriptors' data, each downloaded through its own backend, equal. */
static int same_bits(const upf_backend *ba, const upf_tensor *a, const upf_backend *bb, const upf_tensor *b) {
  const size_t bytes = (size_t)upf_tensor_numel(a) * upf_dtype_size(a->dtype);
  void *x = malloc(bytes), *y = malloc(bytes);
  const int same = x && y && ba->download(x, a->data, bytes) == UPF_OK && bb->download(y, b->data, bytes) == UPF_OK &&
                   !memcmp(x, y, bytes);
  free(x), free(y);
  return same;
}

/* (GPU) The same file loaded on CUDA and on the CPU: the same bits in every tensor. */
static void test_cuda_load_equals_cpu(void) {
  const upf_model_config *cfg = upf_model_config_by_name("gemma3-tiny");
  const upf_backend *cpu = upf_backend_cpu(), *cuda = upf_backend_cuda();
  upf_model a, b;
  CU_ASSERT_FATAL(upf_model_init_seeded(&a, cfg, cpu, UPF_DTYPE_BF16, 9, 0, cfg->num_layers) == UPF_OK);
  char path[128];
  snprintf(path, sizeof path, "%s/cuda.gguf", dir);
  CU_ASSERT_FATAL(upf_model_save_gguf(&a, path, UPF_DTYPE_BF16) == UPF_OK);
  upf_model_free(&a);
  upf_gguf *g = NULL;
  static upf_gguf_model_config gc;
  CU_ASSERT_FATAL(upf_gguf_open(path, &g) == UPF_OK);
  CU_ASSERT_FATAL(upf_model_config_from_gguf(g, &gc) == UPF_OK);
  CU_ASSERT_FATAL(upf_model_load_gguf(&a, g, &gc.cfg, cpu, UPF_DTYPE_BF16, 0, cfg->num_layers) == UPF_OK);
  upf_status st = upf_model_load_gguf(&b, g, &gc.cfg, cuda, UPF_DTYPE_BF16, 0, cfg->num_layers);
  upf_gguf_close(g);
  if (st != UPF_OK)
    printf("\n  load on cuda: %s\n", upf_last_error());
  CU_ASSERT_FATAL(st == UPF_OK);
  int tensors = 0, differ = 0;
  const upf_tensor *top_a[] = {&a.token_embd, &a.output, &a.output_norm}, *top_b[] = {&b.token_embd, &b.output, &b.output_norm};
  for (int i = 0; i < 3; i++)
    tensors++, differ += !same_bits(cpu, top_a[i], cuda, top_b[i]);
  for (int32_t l = 0; l < cfg->num_layers; l++) {
    const upf_tensor *ta = (const upf_tensor *)&a.layers[l], *tb = (const upf_tensor *)&b.layers[l];
    for (size_t i = 0; i < sizeof a.layers[l] / sizeof *ta; i++)
      if (ta[i].data)
        tensors++, differ += !same_bits(cpu, &ta[i], cuda, &tb[i]);
  }
  CU_ASSERT(tensors > 3 * cfg->num_layers);
  CU_ASSERT_EQUAL(differ, 0);
  upf_model_free(&a), upf_model_free(&b);
}

void upf_register_gguf_model_tests(void) {
  static const CU_TestInfo tests[] = {
      {"round trip llama", test_round_trip_llama},
      {"round trip gemma3", test_round_trip_gemma3},
      {"gguf-py reads the exports", test_gguf_py_reads_exports},
      {"real configs", test_real_configs},
      {"real smollm2 logits", test_real_smollm2},
      {"real gemma3 logits", test_real_gemma3},
      {"bad files", test_bad_files},
      {"block_count out of range (fuzz finding)", test_block_count_bounds},
      CU_TEST_INFO_NULL,
  };
  CU_pSuite s = upf_test_suite("gguf model", setup, teardown, tests);
  if (s)
    upf_test_add_gpu(s, "cuda load equals cpu", test_cuda_load_equals_cpu);
}

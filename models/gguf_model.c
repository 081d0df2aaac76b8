/* Models from GGUF files and models to GGUF files (model.h, "GGUF"). The loader reads the
 * hyper-parameters of a `llama` or `gemma3` file into a upf_model_config, dequantises every tensor
 * to f32 through the GGUF reader, brings it to our layout (transposes, un-permuted llama Q/K, fused
 * QKV and gate/up, Gemma norm offsets) and rounds it once to the model dtype on the chosen backend.
 * The writer does the inverse for any model of the suite, in llama.cpp's names and layouts
 * (llama.cpp's convert_hf_to_gguf.py is the reference for every convention used here). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/attn.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model.h"
#include "uniprefill/model_config.h"

/* ---- Layout helpers (host, f32) ---- */

/* dst (cols, rows) = src (rows, cols)^T, in tiles so both sides stay in cache. */
static void transpose(const float *src, int64_t rows, int64_t cols, float *dst) {
  const int64_t B = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += B)
    for (int64_t c0 = 0; c0 < cols; c0 += B) {
      const int64_t r1 = r0 + B < rows ? r0 + B : rows, c1 = c0 + B < cols ? c0 + B : cols;
      for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++)
          dst[c * rows + r] = src[r * cols + c];
    }
}

/* llama.cpp's `permute` (convert_hf_to_gguf.py) of Q/K rows for interleaved-pair RoPE: within each head
 * of D rows, the HF (rotate-half) row s*D/2 + i becomes GGUF row 2i + s. This gives the GGUF row of
 * our (HF-order) row j. */
static int64_t permuted_row(int64_t j, int64_t D) {
  const int64_t h = j / D, r = j % D, s = r / (D / 2), i = r % (D / 2);
  return h * D + 2 * i + s;
}

/* ---- Reading ---- */

typedef struct {
  const upf_gguf *g;
  const char *arch;
  char key[160];
} meta;

static const char *arch_key(meta *k, const char *suffix) {
  snprintf(k->key, sizeof k->key, "%s.%s", k->arch, suffix);
  return k->key;
}

static upf_status get_i32(meta *k, const char *suffix, int32_t *out) {
  uint32_t v;
  UPF_TRY(upf_gguf_get_u32(k->g, arch_key(k, suffix), &v));
  if (v > INT32_MAX)
    return upf_fail(UPF_ERR_FORMAT, "%s: %s = %u is out of range", upf_gguf_name(k->g), k->key, v);
  *out = (int32_t)v;
  return UPF_OK;
}

static upf_status get_i32_or(meta *k, const char *suffix, int32_t dflt, int32_t *out) {
  if (!upf_gguf_kv_find(k->g, arch_key(k, suffix))) {
    *out = dflt;
    return UPF_OK;
  }
  return get_i32(k, suffix, out);
}

/* Expected shape of a GGUF tensor (ne[0], ne[1]; ne1 0 for 1-D); UPF_ERR_FORMAT naming it otherwise. */
static upf_status find_tensor(const upf_gguf *g, const char *name, int64_t ne0, int64_t ne1,
                              const upf_gguf_tensor **out) {
  UPF_TRY(upf_gguf_tensor_get(g, name, out));
  const upf_gguf_tensor *t = *out;
  const int want_dims = ne1 ? 2 : 1;
  int dims = t->n_dims;
  while (dims > want_dims && t->ne[dims - 1] == 1)
    dims--;
  if (dims != want_dims || t->ne[0] != ne0 || (ne1 && t->ne[1] != ne1))
    return upf_fail(UPF_ERR_FORMAT, "%s: tensor %s has ne [%lld, %lld, %lld], the config wants [%lld%s%lld]",
                    upf_gguf_name(g), name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                    (long long)ne0, ne1 ? ", " : "", (long long)(ne1 ? ne1 : 0));
  return UPF_OK;
}

/* Gemma-3 sizes the file does not state, from the published Hugging Face configs
 * (google/gemma-3-{270m,1b-pt,4b-pt,12b-pt,27b-pt}/config.json, "text_config" where nested):
 * query_pre_attn_scalar and the sliding window; every Gemma-3 has sliding_window_pattern 6. The
 * tiny config of the suite (gemma3-tiny) is listed so that its own export loads back as itself. */
typedef struct {
  int32_t hidden, layers;
  int32_t query_pre_attn_scalar; /* 0: head_dim */
  int32_t window, pattern;
  const char *source;
} gemma3_row;

static const gemma3_row gemma3_table[] = {
    {640, 18, 256, 512, 6, "google/gemma-3-270m"},
    {1152, 26, 256, 512, 6, "google/gemma-3-1b-pt"},
    {2560, 34, 256, 1024, 6, "google/gemma-3-4b-pt"},
    {3840, 48, 256, 1024, 6, "google/gemma-3-12b-pt"},
    {5376, 62, 168, 1024, 6, "google/gemma-3-27b-pt (hidden / heads)"},
    {128, 9, 0, 32, 3, "the suite's gemma3-tiny"},
};

static const gemma3_row *gemma3_lookup(int32_t hidden, int32_t layers) {
  for (size_t i = 0; i < sizeof gemma3_table / sizeof *gemma3_table; i++)
    if (gemma3_table[i].hidden == hidden && gemma3_table[i].layers == layers)
      return &gemma3_table[i];
  return NULL;
}

/* Drop layers scaled from the published choice of the family (models/README.md):
 *  llama: Llama-3.1-8B drops after layers 7, 11, ..., 27 of 32; layer l of N sits at the same relative
 *    depth as layer round((l + 1/2) N / 32 - 1/2) of N (centres of the layers), duplicates merged;
 *  gemma3: Gemma-3-12B drops at its global layers of the later half except the last layer (29, 35,
 *    41 of 48); the same rule on N layers. */
static void default_drops(upf_model_config *c) {
  c->num_drop_layers = 0;
  if (c->family == UPF_FAMILY_LLAMA) {
    static const int32_t published[] = {7, 11, 15, 19, 23, 27};
    for (size_t i = 0; i < sizeof published / sizeof *published; i++) {
      int32_t l = (int32_t)lround((published[i] + 0.5) * c->num_layers / 32.0 - 0.5);
      l = l < 0 ? 0 : l >= c->num_layers ? c->num_layers - 1 : l;
      if (c->num_drop_layers == 0 || c->drop_layers[c->num_drop_layers - 1] < l)
        c->drop_layers[c->num_drop_layers++] = l;
    }
  } else {
    for (int32_t l = (c->num_layers + 1) / 2; l < c->num_layers - 1; l++)
      if (upf_model_mixer(c, l) == UPF_MIXER_FULL)
        c->drop_layers[c->num_drop_layers++] = l;
  }
}

static upf_status rope_scaling(meta *k, upf_rope_params *rope) {
  const char *type = NULL;
  if (!upf_gguf_kv_find(k->g, arch_key(k, "rope.scaling.type")))
    return UPF_OK;
  UPF_TRY(upf_gguf_get_str(k->g, k->key, &type, NULL));
  if (!strcmp(type, "none"))
    return UPF_OK;
  if (strcmp(type, "linear"))
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: %s = \"%s\" (linear and none are supported)", upf_gguf_name(k->g),
                    k->key, type);
  float f;
  UPF_TRY(upf_gguf_get_f32(k->g, arch_key(k, "rope.scaling.factor"), &f));
  rope->scaling = UPF_ROPE_LINEAR, rope->factor = f;
  return UPF_OK;
}

/* llama.cpp writes Llama-3 RoPE scaling as rope_freqs.weight: the divisor of each frequency (its
 * LlamaModel.generate_extra_tensors, with low_freq_factor 1, high_freq_factor 4 and an original
 * context of 8192 fixed, the values every Llama-3.x config publishes). Recognised by recomputing
 * those divisors for the largest one as the factor and comparing. */
static upf_status llama3_freqs(meta *k, int32_t D, upf_rope_params *rope) {
  const upf_gguf_tensor *t = upf_gguf_tensor_find(k->g, "rope_freqs.weight");
  if (!t)
    return UPF_OK;
  const char *file = upf_gguf_name(k->g);
  const int32_t n = D / 2;
  UPF_TRY(find_tensor(k->g, "rope_freqs.weight", n, 0, &t));
  float *div = malloc((size_t)n * sizeof *div);
  double *base = malloc((size_t)n * sizeof *base), *scaled = malloc((size_t)n * sizeof *scaled);
  upf_status st = div && base && scaled ? upf_gguf_tensor_to_f32(t, div) : upf_fail(UPF_ERR_NOMEM, "rope_freqs");
  if (st == UPF_OK) {
    float fmax = 1.0f;
    for (int32_t i = 0; i < n; i++)
      fmax = div[i] > fmax ? div[i] : fmax;
    int32_t orig = 8192;
    st = get_i32_or(k, "rope.scaling.original_context_length", 8192, &orig);
    upf_rope_params p = *rope;
    p.scaling = UPF_ROPE_LLAMA3, p.factor = fmax, p.low_freq_factor = 1.0, p.high_freq_factor = 4.0;
    p.original_max_position = orig;
    upf_rope_params plain = *rope;
    upf_rope_inv_freq(&plain, D, base);
    upf_rope_inv_freq(&p, D, scaled);
    for (int32_t i = 0; st == UPF_OK && i < n; i++)
      if (fabs(base[i] / scaled[i] - div[i]) > 1e-5 * div[i])
        st = upf_fail(UPF_ERR_UNSUPPORTED,
                      "%s: rope_freqs.weight[%d] = %g is not the llama3 rule's %g (factor %g, low 1, high 4, "
                      "original context %d)", file, i, (double)div[i], base[i] / scaled[i], (double)fmax, orig);
    if (st == UPF_OK)
      *rope = p;
  }
  free(div), free(base), free(scaled);
  return st;
}

/* A float the model divides by or takes a root of (an epsilon, a RoPE base): NaN, infinite, zero or
 * negative would only show as NaN logits after the weights are loaded, naming nothing. */
static upf_status check_positive(const char *file, const char *key, float v) {
  if (isfinite(v) && v > 0.0f)
    return UPF_OK;
  return upf_fail(UPF_ERR_FORMAT, "%s: %s is %g: want a finite number > 0", file, key, (double)v);
}

upf_status upf_model_config_from_gguf(const upf_gguf *g, upf_gguf_model_config *out) {
  memset(out, 0, sizeof *out);
  upf_model_config *c = &out->cfg;
  const char *file = upf_gguf_name(g), *arch = NULL, *gname = NULL;
  UPF_TRY(upf_gguf_get_str(g, "general.architecture", &arch, NULL));
  meta k = {g, arch, ""};
  if (!strcmp(arch, "llama"))
    c->family = UPF_FAMILY_LLAMA;
  else if (!strcmp(arch, "gemma3"))
    c->family = UPF_FAMILY_GEMMA3;
  else
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: general.architecture \"%s\" (llama and gemma3 are supported)", file,
                    arch);
  const int gemma = c->family == UPF_FAMILY_GEMMA3;
  if (upf_gguf_kv_find(g, "general.name"))
    UPF_TRY(upf_gguf_get_str(g, "general.name", &gname, NULL));
  snprintf(out->name, sizeof out->name, "%s", gname && *gname ? gname : arch);
  c->name = out->name, c->summary = out->summary;

  UPF_TRY(get_i32(&k, "embedding_length", &c->hidden));
  UPF_TRY(get_i32(&k, "block_count", &c->num_layers));
  /* before anything indexes the per-layer arrays (the default drop layers) */
  if (c->num_layers < 1 || c->num_layers > UPF_MODEL_MAX_LAYERS)
    return upf_fail(c->num_layers < 1 ? UPF_ERR_FORMAT : UPF_ERR_UNSUPPORTED,
                    "%s: %s.block_count is %d: want 1 to %d layers", file, arch, c->num_layers, UPF_MODEL_MAX_LAYERS);
  UPF_TRY(get_i32(&k, "feed_forward_length", &c->inter));
  UPF_TRY(get_i32(&k, "attention.head_count", &c->q_heads));
  UPF_TRY(get_i32_or(&k, "attention.head_count_kv", c->q_heads, &c->kv_heads));
  UPF_TRY(get_i32_or(&k, "context_length", 0, &c->context_length));
  if (c->q_heads < 1 || c->hidden < 1)
    return upf_fail(UPF_ERR_FORMAT, "%s: %s.attention.head_count %d, embedding_length %d", file, arch, c->q_heads,
                    c->hidden);
  UPF_TRY(get_i32_or(&k, "attention.key_length", c->hidden / c->q_heads, &c->head_dim));
  int32_t vlen, rope_dim;
  UPF_TRY(get_i32_or(&k, "attention.value_length", c->head_dim, &vlen));
  UPF_TRY(get_i32_or(&k, "rope.dimension_count", c->head_dim, &rope_dim));
  if (vlen != c->head_dim || rope_dim != c->head_dim)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: key length %d, value length %d, rope dimensions %d: all must be equal",
                    file, c->head_dim, vlen, rope_dim);
  float eps;
  UPF_TRY(upf_gguf_get_f32(g, arch_key(&k, "attention.layer_norm_rms_epsilon"), &eps));
  UPF_TRY(check_positive(file, arch_key(&k, "attention.layer_norm_rms_epsilon"), eps));
  float theta;
  UPF_TRY(upf_gguf_get_f32_or(g, arch_key(&k, "rope.freq_base"), 10000.0f, &theta));
  UPF_TRY(check_positive(file, arch_key(&k, "rope.freq_base"), theta));

  /* vocabulary: the token list when present, else vocab_size, else the embedding's rows */
  const upf_gguf_arr *tokens = NULL;
  const upf_gguf_tensor *embd;
  UPF_TRY(upf_gguf_tensor_get(g, "token_embd.weight", &embd));
  int32_t vocab = (int32_t)embd->ne[1];
  if (upf_gguf_kv_find(g, "tokenizer.ggml.tokens")) {
    UPF_TRY(upf_gguf_get_arr(g, "tokenizer.ggml.tokens", &tokens));
    vocab = (int32_t)tokens->n;
  } else
    UPF_TRY(get_i32_or(&k, "vocab_size", vocab, &vocab));
  if (vocab < 1)
    return upf_fail(UPF_ERR_FORMAT, "%s: a vocabulary of %d tokens (%s): a model needs at least one", upf_gguf_name(g),
                    vocab, tokens ? "tokenizer.ggml.tokens" : upf_gguf_kv_find(g, arch_key(&k, "vocab_size"))
                                                                  ? arch_key(&k, "vocab_size") : "token_embd.weight rows");
  c->vocab = vocab;

  c->full_attn_interval = 1, c->other_mixer = UPF_MIXER_FULL, c->ffn = UPF_FFN_DENSE;
  c->norm = (upf_norm_params){eps, gemma};
  c->rope_full = (upf_rope_params){theta, 0, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0};
  c->embed_scale = 1.0f;
  c->act = gemma ? UPF_ACT_GELU_TANH : UPF_ACT_SILU;
  c->tied_embeddings = upf_gguf_tensor_find(g, "output.weight") == NULL;
  c->select = upf_select_params_default();
  const gemma3_row *row = NULL;
  if (gemma) {
    row = gemma3_lookup(c->hidden, c->num_layers);
    c->qk_norm = 1, c->sandwich_norm = 1, c->other_mixer = UPF_MIXER_SLIDING;
    const int window_given = upf_gguf_kv_find(g, arch_key(&k, "attention.sliding_window")) != NULL;
    UPF_TRY(get_i32_or(&k, "attention.sliding_window", row ? row->window : 0, &c->window));
    if (c->window < 1 && window_given)
      return upf_fail(UPF_ERR_FORMAT, "%s: gemma3.attention.sliding_window is %d: a window holds at least one token",
                      file, c->window);
    if (c->window < 1)
      return upf_fail(UPF_ERR_FORMAT, "%s: gemma3.attention.sliding_window is absent and %d x %d layers is not a "
                      "Gemma-3 size the table knows", file, c->hidden, c->num_layers);
    UPF_TRY(get_i32_or(&k, "attention.sliding_window_pattern", row ? row->pattern : 6, &c->full_attn_interval));
    const int32_t qpas = row && row->query_pre_attn_scalar ? row->query_pre_attn_scalar : c->head_dim;
    c->attn.scale = qpas == c->head_dim ? 0.0f : upf_attn_gemma_scale(qpas); /* 0: the op's 1/sqrt(D) */
    float local;
    UPF_TRY(upf_gguf_get_f32_or(g, arch_key(&k, "rope.freq_base_swa"), (float)UPF_GEMMA3_12B_ROPE_LOCAL_BASE, &local));
    UPF_TRY(check_positive(file, arch_key(&k, "rope.freq_base_swa"), local));
    c->rope_sliding = (upf_rope_params){local, 0, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0};
    UPF_TRY(rope_scaling(&k, &c->rope_full)); /* the global layers only, as HF applies rope_scaling */
    c->embed_scale = sqrtf((float)c->hidden);
    c->select.p = 0.975f; /* Gemma-3-12B's default */
    c->drop_min_step_tokens = c->window;
  } else {
    UPF_TRY(rope_scaling(&k, &c->rope_full));
    UPF_TRY(llama3_freqs(&k, c->head_dim, &c->rope_full));
    c->rope_sliding = c->rope_full;
  }
  default_drops(c);
  snprintf(out->summary, sizeof out->summary,
           "%s from GGUF: %d layers, H %d, GQA %d/%d of D %d, %s %d, vocab %d%s%s%s", arch, c->num_layers, c->hidden,
           c->q_heads, c->kv_heads, c->head_dim, gemma ? "GeGLU" : "SwiGLU", c->inter, c->vocab,
           c->tied_embeddings ? ", tied embeddings" : "", gemma ? "; window and pattern: " : "",
           gemma ? (row ? row->source : "the file, else Gemma-3's period 6") : "");
  UPF_TRY(upf_model_config_check(c));
  for (int32_t l = 0; l < c->num_layers; l++)
    UPF_TRY(upf_rope_params_check(upf_model_mixer(c, l) == UPF_MIXER_SLIDING ? &c->rope_sliding : &c->rope_full,
                                  c->head_dim));
  if (embd->ne[0] != c->hidden || embd->ne[1] != c->vocab)
    return upf_fail(UPF_ERR_FORMAT, "%s: token_embd.weight has ne [%lld, %lld], want [%d, %d] (hidden, vocab)", file,
                    (long long)embd->ne[0], (long long)embd->ne[1], c->hidden, c->vocab);
  return UPF_OK;
}

/* ---- Loading ---- */

/* Dequantises a GGUF tensor of ne [ne0, ne1] (ne1 0: 1-D) into a new f32 buffer (ne1 rows of ne0). */
static upf_status fetch(const upf_gguf *g, const char *name, int64_t ne0, int64_t ne1, float **out) {
  const upf_gguf_tensor *t;
  *out = NULL;
  UPF_TRY(find_tensor(g, name, ne0, ne1, &t));
  float *buf = malloc((size_t)(ne0 * (ne1 ? ne1 : 1)) * sizeof *buf);
  if (!buf)
    return upf_fail(UPF_ERR_NOMEM, "%s: %s (%lld x %lld floats)", upf_gguf_name(g), name, (long long)ne0,
                    (long long)ne1);
  upf_status st = upf_gguf_tensor_to_f32(t, buf);
  if (st != UPF_OK) {
    free(buf);
    return st;
  }
  *out = buf;
  return UPF_OK;
}

/* Allocates t (shape d0[, d1]) on the model's backend in its dtype, converts host (f32, overwritten
 * when bf16) and uploads it. */
static upf_status store(upf_model *m, upf_tensor *t, const char *name, int64_t d0, int64_t d1, float *host) {
  const int64_t shape[2] = {d0, d1}, n = d0 * (d1 ? d1 : 1);
  UPF_TRY(upf_tensor_init(t, NULL, m->dtype, d1 ? 2 : 1, shape));
  const size_t bytes = (size_t)n * upf_dtype_size(m->dtype);
  if (m->dtype == UPF_DTYPE_BF16) /* in place: element i's 2 bytes never cover an unread float */
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)host)[i] = upf_bf16_from_f32(host[i]);
  upf_status st = m->be->alloc(&t->data, bytes);
  if (st == UPF_OK)
    m->weight_bytes += (double)bytes, st = m->be->upload(t->data, host, bytes);
  if (st == UPF_OK)
    return UPF_OK;
  char ctx[160];
  snprintf(ctx, sizeof ctx, "%s: ", name);
  return upf_fail_context(st, ctx);
}

/* A norm weight: the file's values, minus 1 where the config's norms are zero-centred. */
static upf_status load_norm(upf_model *m, const upf_gguf *g, upf_tensor *t, const char *name, int64_t n) {
  float *w;
  UPF_TRY(fetch(g, name, n, 0, &w));
  if (m->cfg->norm.zero_centred)
    for (int64_t i = 0; i < n; i++)
      w[i] -= 1.0f;
  upf_status st = store(m, t, name, n, 0, w);
  free(w);
  return st;
}

/* A projection: GGUF (out, in) -> ours (in, out). */
static upf_status load_proj(upf_model *m, const upf_gguf *g, upf_tensor *t, const char *name, int64_t in,
                            int64_t out) {
  float *src, *dst = malloc((size_t)(in * out) * sizeof *dst);
  upf_status st = dst ? fetch(g, name, in, out, &src) : upf_fail(UPF_ERR_NOMEM, "%s", name);
  if (st == UPF_OK) {
    transpose(src, out, in, dst);
    free(src);
    st = store(m, t, name, in, out, dst);
  }
  free(dst);
  return st;
}

/* Column blocks of a fused projection (H, cols): each part a GGUF (out_i, H) tensor, llama's Q and K
 * rows un-permuted (head dim D). */
typedef struct {
  const char *suffix;
  int64_t out;
  int permuted;
} part;

static upf_status load_fused(upf_model *m, const upf_gguf *g, int32_t l, upf_tensor *t, const char *fused_name,
                             const part *parts, int nparts) {
  const int64_t H = m->cfg->hidden, D = m->cfg->head_dim;
  int64_t cols = 0;
  for (int i = 0; i < nparts; i++)
    cols += parts[i].out;
  float *dst = malloc((size_t)(H * cols) * sizeof *dst);
  upf_status st = dst ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s", fused_name);
  int64_t col0 = 0;
  for (int i = 0; i < nparts && st == UPF_OK; i++) {
    char name[96];
    snprintf(name, sizeof name, "blk.%d.%s.weight", l, parts[i].suffix);
    float *src;
    st = fetch(g, name, H, parts[i].out, &src);
    for (int64_t j = 0; st == UPF_OK && j < parts[i].out; j++) {
      const float *row = src + (parts[i].permuted ? permuted_row(j, D) : j) * H;
      for (int64_t h = 0; h < H; h++)
        dst[h * cols + col0 + j] = row[h];
    }
    free(src);
    col0 += parts[i].out;
  }
  if (st == UPF_OK)
    st = store(m, t, fused_name, H, cols, dst);
  free(dst);
  return st;
}

static upf_status load_layer(upf_model *m, const upf_gguf *g, int32_t l) {
  const upf_model_config *c = m->cfg;
  upf_layer_weights *w = &m->layers[l];
  const int64_t H = c->hidden, D = c->head_dim, I = c->inter;
  const int llama = c->family == UPF_FAMILY_LLAMA;
  char name[96];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, l), name)
  UPF_TRY(load_norm(m, g, &w->attn_norm, NAME("attn_norm.weight"), H));
  const part qkv[3] = {{"attn_q", c->q_heads * D, llama}, {"attn_k", c->kv_heads * D, llama},
                       {"attn_v", c->kv_heads * D, 0}};
  UPF_TRY(load_fused(m, g, l, &w->attn_qkv, NAME("attn_qkv.weight"), qkv, 3));
  if (c->qk_norm) {
    UPF_TRY(load_norm(m, g, &w->attn_q_norm, NAME("attn_q_norm.weight"), D));
    UPF_TRY(load_norm(m, g, &w->attn_k_norm, NAME("attn_k_norm.weight"), D));
  }
  UPF_TRY(load_proj(m, g, &w->attn_output, NAME("attn_output.weight"), c->q_heads * D, H));
  if (c->sandwich_norm)
    UPF_TRY(load_norm(m, g, &w->post_attn_norm, NAME("post_attention_norm.weight"), H));
  UPF_TRY(load_norm(m, g, &w->ffn_norm, NAME("ffn_norm.weight"), H));
  const part gate_up[2] = {{"ffn_gate", I, 0}, {"ffn_up", I, 0}};
  UPF_TRY(load_fused(m, g, l, &w->ffn_gate_up, NAME("ffn_gate_up.weight"), gate_up, 2));
  UPF_TRY(load_proj(m, g, &w->ffn_down, NAME("ffn_down.weight"), I, H));
  if (c->sandwich_norm)
    UPF_TRY(load_norm(m, g, &w->post_ffn_norm, NAME("post_ffw_norm.weight"), H));
#undef NAME
  return UPF_OK;
}

static upf_status load_all(upf_model *m, const upf_gguf *g) {
  const upf_model_config *c = m->cfg;
  const int64_t H = c->hidden, V = c->vocab;
  float *embd, *head = malloc((size_t)(H * V) * sizeof *head);
  if (!head)
    return upf_fail(UPF_ERR_NOMEM, "%s: the LM head (%lld x %lld floats)", upf_gguf_name(g), (long long)H,
                    (long long)V);
  upf_status st = fetch(g, "token_embd.weight", H, V, &embd);
  if (st == UPF_OK) {
    if (c->tied_embeddings) /* the head is token_embd^T */
      transpose(embd, V, H, head);
    st = store(m, &m->token_embd, "token_embd.weight", V, H, embd);
    free(embd);
  }
  if (st == UPF_OK && !c->tied_embeddings) {
    float *out;
    st = fetch(g, "output.weight", H, V, &out);
    if (st == UPF_OK)
      transpose(out, V, H, head), free(out);
  }
  if (st == UPF_OK)
    st = store(m, &m->output, "output.weight", H, V, head);
  free(head);
  for (int32_t l = m->layer_begin; l < m->layer_end && st == UPF_OK; l++)
    st = load_layer(m, g, l);
  if (st == UPF_OK)
    st = load_norm(m, g, &m->output_norm, "output_norm.weight", H);
  return st;
}

upf_status upf_model_load_gguf(upf_model *m, const upf_gguf *g, const upf_model_config *cfg, const upf_backend *be,
                               upf_dtype dtype, int32_t layer_begin, int32_t layer_end) {
  memset(m, 0, sizeof *m);
  UPF_TRY(upf_model_config_check(cfg));
  if (cfg->family != UPF_FAMILY_LLAMA && cfg->family != UPF_FAMILY_GEMMA3)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s: model %s: only llama and gemma3 models load from GGUF",
                    upf_gguf_name(g), cfg->name);
  if (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "model %s: dtype %s (f32 or bf16)", cfg->name, upf_dtype_name(dtype));
  if (layer_begin < 0 || layer_end > cfg->num_layers || layer_begin >= layer_end)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: layer range %d:%d outside 0:%d or empty", cfg->name, layer_begin,
                    layer_end, cfg->num_layers);
  UPF_TRY(be->probe());
  m->cfg = cfg, m->be = be, m->dtype = dtype, m->layer_begin = layer_begin, m->layer_end = layer_end;
  upf_status st = load_all(m, g);
  if (st != UPF_OK)
    upf_model_free(m);
  return st;
}

/* ---- Saving ---- */

/* The file is written in two passes over the model so that no more than one layer's host copies
 * live at once (a file larger than memory streams): the first declares every tensor (the directory),
 * the second writes each tensor's bytes as it is made. */
typedef struct {
  const upf_model *m;
  upf_gguf_writer *w;
  upf_ggml_type type;  /* of tensors of 2 or more dims */
  void **bufs;         /* host buffers of the step running, freed by release() */
  int nbufs, capbufs;
  FILE *f;             /* NULL: the declaring pass; else the writing pass's stream */
  int64_t next;        /* the writing pass: the directory entry written next */
  const char *what;    /* the output in messages */
} saver;

static void release(saver *s) {
  for (int i = 0; i < s->nbufs; i++)
    free(s->bufs[i]);
  s->nbufs = 0;
}

static void *keep(saver *s, size_t bytes) {
  if (s->nbufs == s->capbufs) {
    const int cap = s->capbufs ? 2 * s->capbufs : 256;
    void **b = realloc(s->bufs, (size_t)cap * sizeof *b);
    if (!b)
      return NULL;
    s->bufs = b, s->capbufs = cap;
  }
  void *p = malloc(bytes ? bytes : 1);
  if (p)
    s->bufs[s->nbufs++] = p;
  return p;
}

/* The model tensor t as host f32 (a new buffer owned by s). */
static upf_status download_f32(saver *s, const upf_tensor *t, const char *name, float **out) {
  const int64_t n = upf_tensor_numel(t);
  float *f = keep(s, (size_t)n * sizeof *f);
  if (!f)
    return upf_fail(UPF_ERR_NOMEM, "export: %s", name);
  UPF_TRY(s->m->be->download(f, t->data, (size_t)n * upf_dtype_size(t->dtype)));
  if (t->dtype == UPF_DTYPE_BF16) /* widen in place from the back */
    for (int64_t i = n - 1; i >= 0; i--)
      f[i] = upf_bf16_to_f32(((const uint16_t *)f)[i]);
  *out = f;
  return UPF_OK;
}

/* Adds host f32 data of GGUF extents ne (n_dims) as F32 (1-D, or keep_f32) or the export type. */
static upf_status put(saver *s, const char *name, int n_dims, const int64_t *ne, float *data, int keep_f32) {
  int64_t n = 1;
  for (int d = 0; d < n_dims; d++)
    n *= ne[d];
  upf_ggml_type type = n_dims == 1 || keep_f32 ? UPF_GGML_TYPE_F32 : s->type;
  if (type == UPF_GGML_TYPE_BF16) /* narrow in place */
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)data)[i] = upf_bf16_from_f32(data[i]);
  const uint64_t nbytes = (uint64_t)n * (type == UPF_GGML_TYPE_F32 ? 4 : 2);
  if (!s->f)
    return upf_gguf_add_tensor_info(s->w, name, type, n_dims, ne, nbytes);
  return upf_gguf_writer_write_tensor(s->w, s->f, s->next++, name, data, nbytes, s->what);
}

static upf_status put_norm(saver *s, const char *name, const upf_tensor *t, int plus_one) {
  float *f;
  UPF_TRY(download_f32(s, t, name, &f));
  const int64_t n = upf_tensor_numel(t);
  if (plus_one)
    for (int64_t i = 0; i < n; i++)
      f[i] += 1.0f;
  return put(s, name, 1, &n, f, 0);
}

/* Ours (in, out) -> GGUF (out, in), ne = [in, out]. */
static upf_status put_proj(saver *s, const char *name, const upf_tensor *t) {
  float *f, *g;
  const int64_t in = t->shape[0], out = t->shape[1];
  UPF_TRY(download_f32(s, t, name, &f));
  if (!(g = keep(s, (size_t)(in * out) * sizeof *g)))
    return upf_fail(UPF_ERR_NOMEM, "export: %s", name);
  transpose(f, in, out, g);
  const int64_t ne[2] = {in, out};
  return put(s, name, 2, ne, g, 0);
}

/* Column block [col0, col0 + n) of a fused (H, cols) tensor as a GGUF (n, H) tensor; llama Q/K rows
 * permuted (head dim D) as llama.cpp's converter does. */
static upf_status put_cols(saver *s, const char *name, const float *fused, int64_t H, int64_t cols, int64_t col0,
                           int64_t n, int64_t permute_D) {
  float *g = keep(s, (size_t)(n * H) * sizeof *g);
  if (!g)
    return upf_fail(UPF_ERR_NOMEM, "export: %s", name);
  for (int64_t j = 0; j < n; j++) {
    float *row = g + (permute_D ? permuted_row(j, permute_D) : j) * H;
    for (int64_t h = 0; h < H; h++)
      row[h] = fused[h * cols + col0 + j];
  }
  const int64_t ne[2] = {H, n};
  return put(s, name, 2, ne, g, 0);
}

/* A 3-D MoE tensor, ours (E, rows, cols) (the moe op's (out, in)) = GGUF ne [cols, rows, E]; rows
 * [r0, r0 + nr) of each expert. */
static upf_status put_experts(saver *s, const char *name, const float *f, int64_t E, int64_t rows, int64_t cols,
                              int64_t r0, int64_t nr) {
  float *g = keep(s, (size_t)(E * nr * cols) * sizeof *g);
  if (!g)
    return upf_fail(UPF_ERR_NOMEM, "export: %s", name);
  for (int64_t e = 0; e < E; e++)
    memcpy(g + e * nr * cols, f + (e * rows + r0) * cols, (size_t)(nr * cols) * sizeof *g);
  const int64_t ne[3] = {cols, nr, E};
  return put(s, name, E > 1 ? 3 : 2, ne, g, 0); /* a shared expert is one 2-D matrix */
}

static upf_status save_layer(saver *s, int32_t l) {
  const upf_model *m = s->m;
  const upf_model_config *c = m->cfg;
  const upf_layer_weights *w = &m->layers[l];
  const int64_t H = c->hidden, D = c->head_dim;
  const int llama = c->family == UPF_FAMILY_LLAMA, qwen = c->family == UPF_FAMILY_QWEN3_NEXT;
  const int plus = c->norm.zero_centred;
  char name[96];
  float *f;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, l), name)
  UPF_TRY(put_norm(s, NAME("attn_norm.weight"), &w->attn_norm, plus));
  if (upf_model_mixer(c, l) == UPF_MIXER_GDN) {
    /* Qwen3-Next linear attention in llama.cpp's layout: HF's in_proj_qkvz and in_proj_ba grouped by
     * key head ([q Dk | k Dk | v r Dv | z r Dv] and [b r | a r], r = Hv / Hk), conv (C, K), A as
     * -exp(A_log), the gated norm plain (not 1 + w). */
    const int64_t Hk = c->gdn_key_heads, Hv = c->gdn_value_heads, Dk = c->gdn_key_dim, Dv = c->gdn_value_dim;
    const int64_t r = Hv / Hk, C = upf_model_gdn_conv_dim(c), cols = C + Hv * Dv, per = 2 * Dk + 2 * r * Dv;
    UPF_TRY(download_f32(s, &w->ssm_in, NAME("ssm_in.weight"), &f));
    float *g = keep(s, (size_t)(cols * H) * sizeof *g);
    if (!g)
      return upf_fail(UPF_ERR_NOMEM, "export: %s", name);
    for (int64_t kh = 0; kh < Hk; kh++) {
      /* source columns of key head kh: q, k, v (r value heads), z (r value heads) */
      const int64_t src0[4] = {kh * Dk, Hk * Dk + kh * Dk, 2 * Hk * Dk + kh * r * Dv, C + kh * r * Dv};
      const int64_t len[4] = {Dk, Dk, r * Dv, r * Dv};
      int64_t o = kh * per;
      for (int p = 0; p < 4; p++)
        for (int64_t j = 0; j < len[p]; j++, o++)
          for (int64_t h = 0; h < H; h++)
            g[o * H + h] = f[h * cols + src0[p] + j];
    }
    const int64_t ne_in[2] = {H, cols};
    UPF_TRY(put(s, name, 2, ne_in, g, 0));
    UPF_TRY(download_f32(s, &w->ssm_ba, NAME("ssm_ba.weight"), &f));
    if (!(g = keep(s, (size_t)(2 * Hv * H) * sizeof *g)))
      return upf_fail(UPF_ERR_NOMEM, "export: %s", name);
    for (int64_t kh = 0; kh < Hk; kh++)
      for (int p = 0; p < 2; p++)
        for (int64_t j = 0; j < r; j++)
          for (int64_t h = 0; h < H; h++)
            g[(kh * 2 * r + p * r + j) * H + h] = f[h * 2 * Hv + p * Hv + kh * r + j];
    const int64_t ne_ba[2] = {H, 2 * Hv};
    UPF_TRY(put(s, name, 2, ne_ba, g, 0));
    UPF_TRY(download_f32(s, &w->ssm_conv1d, NAME("ssm_conv1d.weight"), &f));
    const int64_t ne_conv[2] = {c->gdn_conv_kernel, C};
    UPF_TRY(put(s, name, 2, ne_conv, f, 1));
    UPF_TRY(download_f32(s, &w->ssm_a, NAME("ssm_a"), &f));
    for (int64_t i = 0; i < Hv; i++)
      f[i] = -expf(f[i]);
    UPF_TRY(put(s, name, 1, &Hv, f, 1));
    UPF_TRY(put_norm(s, NAME("ssm_dt.bias"), &w->ssm_dt, 0));
    UPF_TRY(put_norm(s, NAME("ssm_norm.weight"), &w->ssm_norm, c->gdn_norm.zero_centred));
    UPF_TRY(put_proj(s, NAME("ssm_out.weight"), &w->ssm_out));
  } else {
    const int64_t qcols = c->q_heads * D * (1 + c->attn_gate), kcols = c->kv_heads * D, cols = qcols + 2 * kcols;
    UPF_TRY(download_f32(s, &w->attn_qkv, NAME("attn_qkv.weight"), &f));
    UPF_TRY(put_cols(s, NAME("attn_q.weight"), f, H, cols, 0, qcols, llama ? D : 0));
    UPF_TRY(put_cols(s, NAME("attn_k.weight"), f, H, cols, qcols, kcols, llama ? D : 0));
    UPF_TRY(put_cols(s, NAME("attn_v.weight"), f, H, cols, qcols + kcols, kcols, 0));
    if (c->qk_norm) {
      UPF_TRY(put_norm(s, NAME("attn_q_norm.weight"), &w->attn_q_norm, plus));
      UPF_TRY(put_norm(s, NAME("attn_k_norm.weight"), &w->attn_k_norm, plus));
    }
    UPF_TRY(put_proj(s, NAME("attn_output.weight"), &w->attn_output));
  }
  if (c->sandwich_norm)
    UPF_TRY(put_norm(s, NAME("post_attention_norm.weight"), &w->post_attn_norm, plus));
  /* Qwen3-Next's pre-FFN norm is llama.cpp's post_attention_norm (HF post_attention_layernorm) */
  UPF_TRY(put_norm(s, qwen ? NAME("post_attention_norm.weight") : NAME("ffn_norm.weight"), &w->ffn_norm, plus));
  if (c->ffn == UPF_FFN_MOE) {
    const upf_moe_config *e = &c->moe;
    const int64_t E = e->num_experts, I = e->inter, Is = e->shared_inter;
    UPF_TRY(download_f32(s, &w->moe_router, NAME("ffn_gate_inp.weight"), &f));
    const int64_t ne_r[2] = {H, E};
    UPF_TRY(put(s, name, 2, ne_r, f, 0));
    UPF_TRY(download_f32(s, &w->moe_gate_up, NAME("ffn_gate_exps.weight"), &f));
    UPF_TRY(put_experts(s, name, f, E, 2 * I, H, 0, I));
    UPF_TRY(put_experts(s, NAME("ffn_up_exps.weight"), f, E, 2 * I, H, I, I));
    UPF_TRY(download_f32(s, &w->moe_down, NAME("ffn_down_exps.weight"), &f));
    UPF_TRY(put_experts(s, name, f, E, H, I, 0, H));
    if (Is > 0) {
      UPF_TRY(download_f32(s, &w->moe_shared_gate_up, NAME("ffn_gate_shexp.weight"), &f));
      UPF_TRY(put_experts(s, name, f, 1, 2 * Is, H, 0, Is));
      UPF_TRY(put_experts(s, NAME("ffn_up_shexp.weight"), f, 1, 2 * Is, H, Is, Is));
      UPF_TRY(download_f32(s, &w->moe_shared_down, NAME("ffn_down_shexp.weight"), &f));
      UPF_TRY(put_experts(s, name, f, 1, H, Is, 0, H));
      UPF_TRY(put_norm(s, NAME("ffn_gate_inp_shexp.weight"), &w->moe_shared_gate, 0));
    }
  } else {
    const int64_t I = c->inter;
    UPF_TRY(download_f32(s, &w->ffn_gate_up, NAME("ffn_gate_up.weight"), &f));
    UPF_TRY(put_cols(s, NAME("ffn_gate.weight"), f, H, 2 * I, 0, I, 0));
    UPF_TRY(put_cols(s, NAME("ffn_up.weight"), f, H, 2 * I, I, I, 0));
    UPF_TRY(put_proj(s, NAME("ffn_down.weight"), &w->ffn_down));
  }
  if (c->sandwich_norm)
    UPF_TRY(put_norm(s, NAME("post_ffw_norm.weight"), &w->post_ffn_norm, plus));
#undef NAME
  return UPF_OK;
}

static upf_status save_metadata(saver *s, const char *arch) {
  const upf_model_config *c = s->m->cfg;
  upf_gguf_writer *w = s->w;
  char key[128];
#define KEY(suffix) (snprintf(key, sizeof key, "%s." suffix, arch), key)
  UPF_TRY(upf_gguf_set_str(w, "general.architecture", arch));
  UPF_TRY(upf_gguf_set_str(w, "general.name", c->name));
  UPF_TRY(upf_gguf_set_u32(w, "general.file_type", s->type == UPF_GGML_TYPE_BF16 ? 32 : 0)); /* ALL_F32, MOSTLY_BF16 */
  /* what a built-in config does not state: the published max_position_embeddings of the family */
  const int32_t ctx = c->context_length ? c->context_length
                      : c->family == UPF_FAMILY_QWEN3_NEXT ? 262144 : 131072;
  UPF_TRY(upf_gguf_set_u32(w, KEY("context_length"), (uint32_t)ctx));
  UPF_TRY(upf_gguf_set_u32(w, KEY("embedding_length"), (uint32_t)c->hidden));
  UPF_TRY(upf_gguf_set_u32(w, KEY("block_count"), (uint32_t)c->num_layers));
  if (c->ffn == UPF_FFN_DENSE)
    UPF_TRY(upf_gguf_set_u32(w, KEY("feed_forward_length"), (uint32_t)c->inter));
  UPF_TRY(upf_gguf_set_u32(w, KEY("attention.head_count"), (uint32_t)c->q_heads));
  UPF_TRY(upf_gguf_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)c->kv_heads));
  UPF_TRY(upf_gguf_set_u32(w, KEY("attention.key_length"), (uint32_t)c->head_dim));
  UPF_TRY(upf_gguf_set_u32(w, KEY("attention.value_length"), (uint32_t)c->head_dim));
  UPF_TRY(upf_gguf_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), c->norm.eps));
  UPF_TRY(upf_gguf_set_f32(w, KEY("rope.freq_base"), (float)c->rope_full.theta));
  UPF_TRY(upf_gguf_set_u32(w, KEY("rope.dimension_count"),
                           (uint32_t)upf_rope_rotary_dim(&c->rope_full, c->head_dim)));
  UPF_TRY(upf_gguf_set_u32(w, KEY("vocab_size"), (uint32_t)c->vocab));
  if (c->rope_full.scaling == UPF_ROPE_LINEAR) {
    UPF_TRY(upf_gguf_set_str(w, KEY("rope.scaling.type"), "linear"));
    UPF_TRY(upf_gguf_set_f32(w, KEY("rope.scaling.factor"), (float)c->rope_full.factor));
  }
  if (c->family == UPF_FAMILY_GEMMA3) {
    UPF_TRY(upf_gguf_set_u32(w, KEY("attention.sliding_window"), (uint32_t)c->window));
    UPF_TRY(upf_gguf_set_u32(w, KEY("attention.sliding_window_pattern"), (uint32_t)c->full_attn_interval));
    UPF_TRY(upf_gguf_set_f32(w, KEY("rope.freq_base_swa"), (float)c->rope_sliding.theta));
  }
  if (c->family == UPF_FAMILY_QWEN3_NEXT) { /* llama.cpp's Qwen3NextModel / Qwen2MoeModel keys */
    UPF_TRY(upf_gguf_set_u32(w, KEY("expert_count"), (uint32_t)c->moe.num_experts));
    UPF_TRY(upf_gguf_set_u32(w, KEY("expert_used_count"), (uint32_t)c->moe.top_k));
    UPF_TRY(upf_gguf_set_u32(w, KEY("expert_feed_forward_length"), (uint32_t)c->moe.inter));
    UPF_TRY(upf_gguf_set_u32(w, KEY("expert_shared_feed_forward_length"), (uint32_t)c->moe.shared_inter));
    UPF_TRY(upf_gguf_set_u32(w, KEY("full_attention_interval"), (uint32_t)c->full_attn_interval));
    UPF_TRY(upf_gguf_set_u32(w, KEY("ssm.conv_kernel"), (uint32_t)c->gdn_conv_kernel));
    UPF_TRY(upf_gguf_set_u32(w, KEY("ssm.state_size"), (uint32_t)c->gdn_key_dim));
    UPF_TRY(upf_gguf_set_u32(w, KEY("ssm.group_count"), (uint32_t)c->gdn_key_heads));
    UPF_TRY(upf_gguf_set_u32(w, KEY("ssm.time_step_rank"), (uint32_t)c->gdn_value_heads));
    UPF_TRY(upf_gguf_set_u32(w, KEY("ssm.inner_size"), (uint32_t)(c->gdn_value_heads * c->gdn_value_dim)));
  }
#undef KEY
  /* llama.cpp's loader wants a tokenizer model; "none" is its vocabulary-free one */
  return upf_gguf_set_str(w, "tokenizer.ggml.model", "none");
}

/* llama.cpp's rope_freqs.weight for Llama-3 scaling: the divisor of each frequency. */
static upf_status save_llama3_freqs(saver *s) {
  const upf_model_config *c = s->m->cfg;
  const int32_t D = upf_rope_rotary_dim(&c->rope_full, c->head_dim), n = D / 2;
  double base[512], scaled[512];
  if (n > 512)
    return upf_fail(UPF_ERR_UNSUPPORTED, "export: rotary dim %d", D);
  upf_rope_params plain = c->rope_full;
  plain.scaling = UPF_ROPE_DEFAULT;
  upf_rope_inv_freq(&plain, D, base);
  upf_rope_inv_freq(&c->rope_full, D, scaled);
  float *f = keep(s, (size_t)n * sizeof *f);
  if (!f)
    return upf_fail(UPF_ERR_NOMEM, "export: rope_freqs");
  for (int32_t i = 0; i < n; i++)
    f[i] = (float)(base[i] / scaled[i]);
  const int64_t ne = n;
  return put(s, "rope_freqs.weight", 1, &ne, f, 1);
}

/* Every tensor in the file's order, one step (a layer, the embedding) of host copies at a time. */
static upf_status save_tensors(saver *s) {
  const upf_model *m = s->m;
  const upf_model_config *c = m->cfg;
  float *f = NULL;
  upf_status st = download_f32(s, &m->token_embd, "token_embd.weight", &f);
  if (st == UPF_OK) {
    const int64_t ne[2] = {c->hidden, c->vocab};
    st = put(s, "token_embd.weight", 2, ne, f, 0);
  }
  release(s);
  if (st == UPF_OK && c->rope_full.scaling == UPF_ROPE_LLAMA3)
    st = save_llama3_freqs(s);
  release(s);
  for (int32_t l = 0; l < c->num_layers && st == UPF_OK; l++) {
    st = save_layer(s, l);
    release(s);
  }
  if (st == UPF_OK)
    st = put_norm(s, "output_norm.weight", &m->output_norm, c->norm.zero_centred);
  if (st == UPF_OK && !c->tied_embeddings) /* ours (H, V) -> GGUF (V, H) */
    st = put_proj(s, "output.weight", &m->output);
  release(s);
  return st;
}

upf_status upf_model_save_gguf(const upf_model *m, const char *path, upf_dtype dtype) {
  const upf_model_config *c = m->cfg;
  if (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "export %s: dtype %s (f32 or bf16)", path, upf_dtype_name(dtype));
  if (m->layer_begin != 0 || m->layer_end != c->num_layers)
    return upf_fail(UPF_ERR_INVALID_ARG, "export %s: model %s holds layers %d:%d of %d; a file needs them all", path,
                    c->name, m->layer_begin, m->layer_end, c->num_layers);
  const char *arch = c->family == UPF_FAMILY_LLAMA    ? "llama"
                     : c->family == UPF_FAMILY_GEMMA3 ? "gemma3"
                                                      : "qwen3next";
  if (c->family == UPF_FAMILY_LLAMA && (c->qk_norm || c->sandwich_norm || c->attn_gate || c->other_mixer != UPF_MIXER_FULL))
    return upf_fail(UPF_ERR_UNSUPPORTED, "export %s: model %s is not a plain llama", path, c->name);
  saver s = {m, NULL, dtype == UPF_DTYPE_BF16 ? UPF_GGML_TYPE_BF16 : UPF_GGML_TYPE_F32, NULL, 0, 0, NULL, 0, path};
  upf_outputs *o = NULL;
  FILE *f = NULL;
  upf_status st = upf_outputs_create(&o, 1);
  if (st == UPF_OK) /* first: a path that cannot be written fails before the work */
    st = upf_outputs_open(o, path, NULL, &f);
  if (st == UPF_OK)
    st = upf_gguf_writer_create(&s.w);
  if (st == UPF_OK)
    st = save_metadata(&s, arch);
  if (st == UPF_OK)
    st = save_tensors(&s); /* the directory */
  if (st == UPF_OK)
    st = upf_gguf_writer_write_head(s.w, f, path);
  s.f = f;
  if (st == UPF_OK)
    st = save_tensors(&s); /* the bytes */
  if (st == UPF_OK && s.next != upf_gguf_writer_num_tensors(s.w))
    st = upf_fail(UPF_ERR_INVALID_ARG, "%s: wrote %lld of %lld tensors", path, (long long)s.next,
                  (long long)upf_gguf_writer_num_tensors(s.w));
  if (st == UPF_OK)
    st = upf_outputs_commit(o);
  upf_outputs_free(o);
  upf_gguf_writer_free(s.w);
  release(&s);
  free(s.bufs);
  return st == UPF_OK ? UPF_OK : upf_fail_context(st, "saving the GGUF: ");
}

/* The built-in model configs: the real shapes of the three families (from model_config.h, SPEC.md
 * section 6 for the drop layers) and a tiny config of each family with the same sub-layer kinds and
 * layer pattern (a shorter period where the real one would leave fewer than two drop layers), for
 * tests and CPU runs. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "uniprefill/attn.h"
#include "uniprefill/model.h"
#include "uniprefill/model_config.h"

/* The tiny configs end with a full-attention layer after their second drop layer, so a chained drop
 * is followed by attention over the twice-compacted batch in every family.
 * The selection a tiny config uses: blocks, sink and observation window scaled down with the prompts
 * the tests run (a few hundred tokens), and p low enough that random weights' near-uniform attention
 * still drops blocks. */
static upf_select_params tiny_select(void) {
  upf_select_params p = upf_select_params_default();
  p.block = 16, p.sink = 16, p.last_q = 16, p.p = 0.9f;
  return p;
}

static upf_model_config llama31_8b(void) {
  upf_model_config c = {
      .name = "llama3.1-8b",
      .summary = "Llama-3.1-8B: 32 full-attention layers, GQA 32/8, SwiGLU",
      .family = UPF_FAMILY_LLAMA,
      .hidden = UPF_LLAMA31_8B_HIDDEN,
      .num_layers = UPF_LLAMA31_8B_LAYERS,
      .vocab = UPF_LLAMA31_8B_VOCAB,
      .q_heads = UPF_LLAMA31_8B_Q_HEADS,
      .kv_heads = UPF_LLAMA31_8B_KV_HEADS,
      .head_dim = UPF_LLAMA31_8B_HEAD_DIM,
      .full_attn_interval = 1,
      .other_mixer = UPF_MIXER_FULL,
      .rope_full = upf_llama31_8b_rope(),
      .rope_sliding = upf_llama31_8b_rope(),
      .norm = upf_llama31_8b_norm(),
      .embed_scale = 1.0f,
      .ffn = UPF_FFN_DENSE,
      .inter = UPF_LLAMA31_8B_INTERMEDIATE,
      .act = UPF_ACT_SILU,
      .num_drop_layers = 6,
      .drop_layers = {7, 11, 15, 19, 23, 27},
      .select = upf_select_params_default(),
  };
  return c;
}

static upf_model_config gemma3_12b(void) {
  upf_model_config c = {
      .name = "gemma3-12b",
      .summary = "Gemma-3-12B: every 6th layer global, others sliding window 1024, GeGLU, q/k and sandwich norms",
      .family = UPF_FAMILY_GEMMA3,
      .hidden = UPF_GEMMA3_12B_HIDDEN,
      .num_layers = UPF_GEMMA3_12B_LAYERS,
      .vocab = UPF_GEMMA3_12B_VOCAB,
      .q_heads = UPF_GEMMA3_12B_Q_HEADS,
      .kv_heads = UPF_GEMMA3_12B_KV_HEADS,
      .head_dim = UPF_GEMMA3_12B_HEAD_DIM,
      .qk_norm = 1,
      .sandwich_norm = 1,
      .full_attn_interval = 6,
      .other_mixer = UPF_MIXER_SLIDING,
      .window = UPF_GEMMA3_12B_SLIDING_WINDOW,
      .rope_full = upf_gemma3_12b_rope_global(),
      .rope_sliding = upf_gemma3_12b_rope_local(),
      .norm = upf_gemma3_12b_norm(),
      .embed_scale = (float)UPF_GEMMA3_12B_EMBED_SCALE,
      .tied_embeddings = 1,
      .ffn = UPF_FFN_DENSE,
      .inter = UPF_GEMMA3_12B_INTERMEDIATE,
      .act = UPF_ACT_GELU_TANH,
      .num_drop_layers = 3,
      .drop_layers = {29, 35, 41},
      .select = upf_select_params_default(),
      .drop_min_step_tokens = UPF_GEMMA3_12B_SLIDING_WINDOW,
  };
  c.attn.scale = upf_attn_gemma_scale(UPF_GEMMA3_12B_QUERY_PRE_ATTN_SCALAR);
  c.select.p = 0.975f;
  return c;
}

static upf_model_config qwen3_next_80b(void) {
  upf_model_config c = {
      .name = "qwen3-next-80b-a3b",
      .summary = "Qwen3-Next-80B-A3B: every 4th layer gated full attention, others Gated DeltaNet, MoE 512/10 + shared",
      .family = UPF_FAMILY_QWEN3_NEXT,
      .hidden = UPF_QWEN3N_80B_HIDDEN,
      .num_layers = UPF_QWEN3N_80B_LAYERS,
      .vocab = UPF_QWEN3N_80B_VOCAB,
      .q_heads = UPF_QWEN3N_80B_Q_HEADS,
      .kv_heads = UPF_QWEN3N_80B_KV_HEADS,
      .head_dim = UPF_QWEN3N_80B_HEAD_DIM,
      .attn_gate = 1,
      .qk_norm = 1,
      .full_attn_interval = UPF_QWEN3N_80B_FULL_ATTN_INTERVAL,
      .other_mixer = UPF_MIXER_GDN,
      .rope_full = upf_qwen3n_80b_rope(),
      .rope_sliding = upf_qwen3n_80b_rope(),
      .norm = upf_qwen3n_80b_norm(),
      .embed_scale = 1.0f,
      .ffn = UPF_FFN_MOE,
      .moe = upf_moe_config_qwen3_next(),
      .gdn_key_heads = UPF_QWEN3N_80B_LINEAR_KEY_HEADS,
      .gdn_value_heads = UPF_QWEN3N_80B_LINEAR_VALUE_HEADS,
      .gdn_key_dim = UPF_QWEN3N_80B_LINEAR_KEY_DIM,
      .gdn_value_dim = UPF_QWEN3N_80B_LINEAR_VALUE_DIM,
      .gdn_conv_kernel = UPF_QWEN3N_80B_LINEAR_CONV_KERNEL,
      .gdn_norm = {UPF_QWEN3N_80B_LINEAR_NORM_EPS, 0},
      .num_drop_layers = 10,
      .drop_layers = {7, 11, 15, 19, 23, 27, 31, 35, 39, 43},
      .select = upf_select_params_default(),
  };
  return c;
}

static upf_model_config llama_tiny(void) {
  upf_model_config c = llama31_8b();
  c.name = "llama-tiny";
  c.summary = "tiny Llama: 6 full-attention layers, H 128, GQA 4/2 of D 32, SwiGLU 256, vocab 512";
  c.hidden = 128, c.num_layers = 6, c.vocab = 512, c.q_heads = 4, c.kv_heads = 2, c.head_dim = 32, c.inter = 256;
  c.num_drop_layers = 2, c.drop_layers[0] = 2, c.drop_layers[1] = 4;
  c.select = tiny_select();
  return c;
}

static upf_model_config gemma3_tiny(void) {
  upf_model_config c = gemma3_12b();
  c.name = "gemma3-tiny";
  c.summary = "tiny Gemma-3: 9 layers, every 3rd global, others window 32, H 128, GQA 4/2 of D 32, GeGLU 256";
  c.hidden = 128, c.num_layers = 9, c.vocab = 512, c.q_heads = 4, c.kv_heads = 2, c.head_dim = 32, c.inter = 256;
  c.full_attn_interval = 3, c.window = 32;
  c.attn.scale = 0.0f; /* query_pre_attn_scalar = head_dim, as on the 12B */
  c.embed_scale = sqrtf(128.0f);
  c.num_drop_layers = 2, c.drop_layers[0] = 2, c.drop_layers[1] = 5;
  c.select = tiny_select();
  c.drop_min_step_tokens = c.window;
  return c;
}

static upf_model_config qwen3_next_tiny(void) {
  upf_model_config c = qwen3_next_80b();
  c.name = "qwen3-next-tiny";
  c.summary = "tiny Qwen3-Next: 12 layers, every 4th gated attention, others Gated DeltaNet, MoE 8/2 + shared, H 128";
  c.hidden = 128, c.num_layers = 12, c.vocab = 512, c.q_heads = 4, c.kv_heads = 2, c.head_dim = 32;
  c.rope_full.rotary_dim = 8, c.rope_sliding.rotary_dim = 8; /* partial rotary 0.25 of 32 */
  c.moe.hidden = 128, c.moe.num_experts = 8, c.moe.top_k = 2, c.moe.inter = 64, c.moe.shared_inter = 64;
  c.gdn_key_heads = 2, c.gdn_value_heads = 4, c.gdn_key_dim = 32, c.gdn_value_dim = 32;
  c.num_drop_layers = 2, c.drop_layers[0] = 3, c.drop_layers[1] = 7;
  c.select = tiny_select();
  return c;
}

/* Seeded twins of the two real models of issue 16 (the GGUF files hold the same shapes; helper code
 * that reads those files builds its configs from their metadata). Shapes from the published
 * config.json, for timing the CPU reference at the real sizes and for tests.
 *   SmolLM2-135M: HuggingFaceTB/SmolLM2-135M-Instruct/config.json (Llama architecture).
 *   Gemma-3-270M: google/gemma-3-270m/config.json (rope_scaling null: plain RoPE on both kinds). */
static upf_model_config smollm2_135m(void) {
  upf_model_config c = llama31_8b();
  c.name = "smollm2-135m";
  c.summary = "SmolLM2-135M shapes (seeded weights): 30 full-attention layers, GQA 9/3 of D 64, SwiGLU 1536, tied";
  c.hidden = 576, c.num_layers = 30, c.vocab = 49152, c.q_heads = 9, c.kv_heads = 3, c.head_dim = 64;
  c.inter = 1536, c.tied_embeddings = 1;
  const upf_rope_params rope = {100000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0}; /* rope_theta, no scaling */
  c.rope_full = rope, c.rope_sliding = rope;
  c.norm.eps = 1e-5f; /* rms_norm_eps */
  /* Llama-3.1-8B's drop layers 7, 11, ..., 27 of 32 at the same relative depth: round(l * 30 / 32) */
  c.num_drop_layers = 6;
  const int32_t drops[6] = {7, 10, 14, 18, 22, 25};
  memcpy(c.drop_layers, drops, sizeof drops);
  return c;
}

static upf_model_config gemma3_270m(void) {
  upf_model_config c = gemma3_12b();
  c.name = "gemma3-270m";
  c.summary = "Gemma-3-270M shapes (seeded weights): 18 layers, every 6th global, others window 512, 4/1 heads of D 256";
  c.hidden = 640, c.num_layers = 18, c.vocab = 262144, c.q_heads = 4, c.kv_heads = 1, c.head_dim = 256;
  c.inter = 2048, c.window = 512;
  c.attn.scale = upf_attn_gemma_scale(256); /* query_pre_attn_scalar */
  c.embed_scale = sqrtf(640.0f);
  const upf_rope_params local = {10000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0};    /* rope_local_base_freq */
  const upf_rope_params global = {1000000.0, 0, UPF_ROPE_DEFAULT, 1.0, 0.0, 0.0, 0}; /* rope_theta */
  c.rope_full = global, c.rope_sliding = local;
  /* the 12B's rule (its global layers in the later half but the last: 29, 35, 41 of 48, not 47) on 18
   * layers: 11, as the GGUF loader chooses for the real file (models/README.md) */
  c.num_drop_layers = 1, c.drop_layers[0] = 11;
  c.drop_min_step_tokens = c.window;
  return c;
}

static upf_model_config configs[8];
static int configs_ready;

static void build_configs(void) {
  if (configs_ready)
    return;
  configs[0] = llama31_8b(), configs[1] = gemma3_12b(), configs[2] = qwen3_next_80b();
  configs[3] = llama_tiny(), configs[4] = gemma3_tiny(), configs[5] = qwen3_next_tiny();
  configs[6] = smollm2_135m(), configs[7] = gemma3_270m();
  configs_ready = 1;
}

int upf_model_config_count(void) { return (int)(sizeof configs / sizeof configs[0]); }

const upf_model_config *upf_model_config_at(int i) {
  build_configs();
  return i >= 0 && i < upf_model_config_count() ? &configs[i] : NULL;
}

const upf_model_config *upf_model_config_by_name(const char *name) {
  build_configs();
  char names[256] = "";
  size_t used = 0;
  for (int i = 0; i < upf_model_config_count(); i++) {
    if (name && !strcmp(name, configs[i].name))
      return &configs[i];
    used += (size_t)snprintf(names + used, sizeof names - used, "%s%s", i ? ", " : "", configs[i].name);
  }
  upf_fail(UPF_ERR_INVALID_ARG, "model '%s' is not one of: %s", name ? name : "(null)", names);
  return NULL;
}

upf_mixer_kind upf_model_mixer(const upf_model_config *cfg, int32_t layer) {
  return (layer + 1) % cfg->full_attn_interval == 0 ? UPF_MIXER_FULL : cfg->other_mixer;
}

int upf_model_is_drop_layer(const upf_model_config *cfg, int32_t layer) {
  for (int i = 0; i < cfg->num_drop_layers; i++)
    if (cfg->drop_layers[i] == layer)
      return 1;
  return 0;
}

int64_t upf_model_qkv_cols(const upf_model_config *cfg) {
  return (int64_t)cfg->q_heads * cfg->head_dim * (1 + cfg->attn_gate) + 2 * (int64_t)cfg->kv_heads * cfg->head_dim;
}

int64_t upf_model_gdn_conv_dim(const upf_model_config *cfg) {
  return 2 * (int64_t)cfg->gdn_key_heads * cfg->gdn_key_dim + (int64_t)cfg->gdn_value_heads * cfg->gdn_value_dim;
}

upf_status upf_model_config_check(const upf_model_config *c) {
  const char *n = c->name;
  if (c->hidden < 1 || c->num_layers < 1 || c->num_layers > UPF_MODEL_MAX_LAYERS || c->vocab < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: hidden %d, layers %d (max %d), vocab %d out of range", n,
                    c->hidden, c->num_layers, UPF_MODEL_MAX_LAYERS, c->vocab);
  if (c->q_heads < 1 || c->kv_heads < 1 || c->q_heads % c->kv_heads || c->head_dim < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: heads %d/%d of dim %d", n, c->q_heads, c->kv_heads, c->head_dim);
  if (c->full_attn_interval < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: full_attn_interval %d", n, c->full_attn_interval);
  if (c->other_mixer == UPF_MIXER_SLIDING && c->window < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: sliding layers need a window", n);
  if (c->other_mixer == UPF_MIXER_GDN &&
      (c->gdn_key_heads < 1 || c->gdn_value_heads % c->gdn_key_heads || c->gdn_conv_kernel < 2))
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: Gated DeltaNet heads %d/%d, conv kernel %d", n, c->gdn_key_heads,
                    c->gdn_value_heads, c->gdn_conv_kernel);
  if (c->ffn == UPF_FFN_MOE) {
    UPF_TRY(upf_moe_config_check(&c->moe));
    if (c->moe.hidden != c->hidden)
      return upf_fail(UPF_ERR_INVALID_ARG, "model %s: MoE hidden %d != hidden %d", n, c->moe.hidden, c->hidden);
  } else if (c->inter < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: FFN intermediate %d", n, c->inter);
  UPF_TRY(upf_select_params_check(&c->select));
  for (int i = 0; i < c->num_drop_layers; i++) {
    const int32_t l = c->drop_layers[i];
    if (l < 0 || l >= c->num_layers || upf_model_mixer(c, l) != UPF_MIXER_FULL ||
        (i > 0 && l <= c->drop_layers[i - 1]))
      return upf_fail(UPF_ERR_INVALID_ARG,
                      "model %s: drop layer %d must be a full-attention layer in range, in ascending order", n, l);
  }
  return UPF_OK;
}

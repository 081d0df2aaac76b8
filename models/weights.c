/* Model weights: the tensor list of each config with its GGUF names and shapes, seeded values that
 * depend on (seed, name, index) only, and their allocation on a backend. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"
#include "uniprefill/model.h"
#include "uniprefill/rng.h"

/* How a tensor's seeded values are drawn: uniform in [offset - amp, offset + amp). */
typedef struct {
  char name[64];
  upf_tensor *t;
  int ndim;
  int64_t shape[3];
  int f32_only;   /* stays f32 in a bf16 model (A_log, dt_bias) */
  double amp, offset;
  /* The LM head of a tied model: element (h, v) takes token_embd's value at (v, h). */
  const char *transpose_of;
  /* A tensor-parallel slice: along axis slice_axis, local coordinates run through the segments
   * [seg_start[k], seg_start[k] + seg_len[k]) of the whole tensor (full_shape) in order. */
  int nseg, slice_axis;
  int64_t seg_start[4], seg_len[4];
  int64_t full_shape[3];
} tensor_spec;

#define MAX_SPECS (8 + 24 * UPF_MODEL_MAX_LAYERS)

static void add(tensor_spec *s, int *n, upf_tensor *t, const char *name, int ndim, int64_t d0, int64_t d1, int64_t d2,
                double amp, double offset) {
  tensor_spec *p = &s[(*n)++];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", name);
  p->t = t, p->ndim = ndim, p->shape[0] = d0, p->shape[1] = d1, p->shape[2] = d2, p->amp = amp, p->offset = offset;
  memcpy(p->full_shape, p->shape, sizeof p->shape);
}

/* Under TP, the last added tensor becomes the rank's slice: segments (start, len) along `axis`. */
static void slice_last(const upf_model *m, tensor_spec *s, int n, int axis, int nseg, const int64_t *seg) {
  if (m->tp_size <= 1)
    return;
  tensor_spec *p = &s[n - 1];
  p->nseg = nseg, p->slice_axis = axis, p->shape[axis] = 0;
  for (int k = 0; k < nseg; k++)
    p->seg_start[k] = seg[2 * k], p->seg_len[k] = seg[2 * k + 1], p->shape[axis] += seg[2 * k + 1];
}

/* Element i of a sliced tensor's local row-major order: its index in the whole tensor. */
static int64_t sliced_index(const tensor_spec *s, int64_t i) {
  int64_t coord[3] = {0, 0, 0}, rest = i;
  for (int d = s->ndim - 1; d >= 0; d--)
    coord[d] = rest % s->shape[d], rest /= s->shape[d];
  int64_t c = coord[s->slice_axis];
  for (int k = 0; k < s->nseg; k++) {
    if (c < s->seg_len[k]) {
      coord[s->slice_axis] = s->seg_start[k] + c;
      break;
    }
    c -= s->seg_len[k];
  }
  int64_t g = 0;
  for (int d = 0; d < s->ndim; d++)
    g = g * s->full_shape[d] + coord[d];
  return g;
}

/* Uniform with variance 1/fan_in: a projection keeps its input's scale. */
static double proj_amp(int64_t fan_in) { return sqrt(3.0 / (double)fan_in); }

static void layer_specs(upf_model *m, int32_t l, tensor_spec *s, int *n) {
  const upf_model_config *c = m->full_cfg ? m->full_cfg : m->cfg; /* names and values: the whole model's */
  const upf_model_config *lc = m->cfg;                             /* this rank's slice */
  upf_layer_weights *w = &m->layers[l];
  const int64_t H = c->hidden, D = c->head_dim;
  /* the rank's first query / kv head, GDN value / key head, FFN and expert columns (0 without TP) */
  upf_head_split hs = {0, c->q_heads, 0, c->kv_heads}, gs = {0, c->gdn_value_heads, 0, c->gdn_key_heads};
  if (m->tp_size > 1) {
    upf_head_split_of(c->q_heads, c->kv_heads, m->tp_rank, m->tp_size, &hs);
    if (c->other_mixer == UPF_MIXER_GDN)
      upf_head_split_of(c->gdn_value_heads, c->gdn_key_heads, m->tp_rank, m->tp_size, &gs);
  }
  const int64_t i0 = (int64_t)m->tp_rank * lc->inter, e0 = (int64_t)m->tp_rank * lc->moe.inter,
                s0 = (int64_t)m->tp_rank * lc->moe.shared_inter;
  /* norm weights: 1 + noise, or the noise alone where the norm multiplies by (1 + w) */
  const double norm_off = c->norm.zero_centred ? 0.0 : 1.0, norm_amp = 0.1;
  char name[64];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, l), name)
  add(s, n, &w->attn_norm, NAME("attn_norm.weight"), 1, H, 0, 0, norm_amp, norm_off);
  if (upf_model_mixer(c, l) == UPF_MIXER_GDN) {
    const int64_t C = upf_model_gdn_conv_dim(c), HvDv = (int64_t)c->gdn_value_heads * c->gdn_value_dim;
    const int64_t Hk = c->gdn_key_heads, Hv = c->gdn_value_heads, Dk = c->gdn_key_dim, Dv = c->gdn_value_dim;
    /* channels of the rank's heads: [q (its key heads) | k (its key heads) | v (its value heads)] */
    const int64_t conv_seg[6] = {gs.kv0 * Dk, gs.nkv * Dk, Hk * Dk + gs.kv0 * Dk, gs.nkv * Dk, 2 * Hk * Dk + gs.q0 * Dv,
                                 gs.nq * Dv};
    const int64_t in_seg[8] = {conv_seg[0], conv_seg[1], conv_seg[2], conv_seg[3], conv_seg[4], conv_seg[5],
                               C + gs.q0 * Dv, gs.nq * Dv};
    const int64_t ba_seg[4] = {gs.q0, gs.nq, Hv + gs.q0, gs.nq}, v_seg[2] = {gs.q0, gs.nq},
                  out_seg[2] = {gs.q0 * Dv, gs.nq * Dv};
    add(s, n, &w->ssm_in, NAME("ssm_in.weight"), 2, H, C + HvDv, 0, proj_amp(H), 0);
    slice_last(m, s, *n, 1, 4, in_seg);
    add(s, n, &w->ssm_ba, NAME("ssm_ba.weight"), 2, H, 2 * (int64_t)c->gdn_value_heads, 0, proj_amp(H), 0);
    slice_last(m, s, *n, 1, 2, ba_seg);
    add(s, n, &w->ssm_conv1d, NAME("ssm_conv1d.weight"), 2, C, c->gdn_conv_kernel, 0, proj_amp(c->gdn_conv_kernel), 0);
    slice_last(m, s, *n, 0, 3, conv_seg);
    /* A_log in [0, log 16] (HF draws A in (0, 16)); dt_bias in [-6, -2]: softplus gives steps of 0.002-0.13 */
    add(s, n, &w->ssm_a, NAME("ssm_a"), 1, c->gdn_value_heads, 0, 0, 0.5 * log(16.0), 0.5 * log(16.0));
    s[*n - 1].f32_only = 1;
    slice_last(m, s, *n, 0, 1, v_seg);
    add(s, n, &w->ssm_dt, NAME("ssm_dt.bias"), 1, c->gdn_value_heads, 0, 0, 2.0, -4.0);
    s[*n - 1].f32_only = 1;
    slice_last(m, s, *n, 0, 1, v_seg);
    add(s, n, &w->ssm_norm, NAME("ssm_norm.weight"), 1, c->gdn_value_dim, 0, 0, norm_amp, c->gdn_norm.zero_centred ? 0 : 1);
    add(s, n, &w->ssm_out, NAME("ssm_out.weight"), 2, HvDv, H, 0, proj_amp(HvDv), 0);
    slice_last(m, s, *n, 0, 1, out_seg);
  } else {
    const int64_t qs = D * (1 + c->attn_gate), Hq = c->q_heads, Hkv = c->kv_heads;
    const int64_t qkv_seg[6] = {hs.q0 * qs, hs.nq * qs, Hq * qs + hs.kv0 * D, hs.nkv * D, Hq * qs + (Hkv + hs.kv0) * D,
                                hs.nkv * D};
    const int64_t o_seg[2] = {hs.q0 * D, hs.nq * D};
    add(s, n, &w->attn_qkv, NAME("attn_qkv.weight"), 2, H, upf_model_qkv_cols(c), 0, proj_amp(H), 0);
    slice_last(m, s, *n, 1, 3, qkv_seg);
    if (c->qk_norm) {
      add(s, n, &w->attn_q_norm, NAME("attn_q_norm.weight"), 1, D, 0, 0, norm_amp, norm_off);
      add(s, n, &w->attn_k_norm, NAME("attn_k_norm.weight"), 1, D, 0, 0, norm_amp, norm_off);
    }
    add(s, n, &w->attn_output, NAME("attn_output.weight"), 2, c->q_heads * D, H, 0, proj_amp(c->q_heads * D), 0);
    slice_last(m, s, *n, 0, 1, o_seg);
  }
  if (c->sandwich_norm)
    add(s, n, &w->post_attn_norm, NAME("post_attention_norm.weight"), 1, H, 0, 0, norm_amp, norm_off);
  add(s, n, &w->ffn_norm, NAME("ffn_norm.weight"), 1, H, 0, 0, norm_amp, norm_off);
  if (c->ffn == UPF_FFN_MOE) {
    const upf_moe_config *e = &c->moe;
    add(s, n, &w->moe_router, NAME("ffn_gate_inp.weight"), 2, e->num_experts, H, 0, proj_amp(H), 0);
    const int64_t e_gu[4] = {e0, lc->moe.inter, e->inter + e0, lc->moe.inter}, e_d[2] = {e0, lc->moe.inter};
    const int64_t s_gu[4] = {s0, lc->moe.shared_inter, e->shared_inter + s0, lc->moe.shared_inter},
                  s_d[2] = {s0, lc->moe.shared_inter};
    add(s, n, &w->moe_gate_up, NAME("ffn_gate_up_exps.weight"), 3, e->num_experts, 2 * (int64_t)e->inter, H,
        proj_amp(H), 0);
    slice_last(m, s, *n, 1, 2, e_gu);
    add(s, n, &w->moe_down, NAME("ffn_down_exps.weight"), 3, e->num_experts, H, e->inter, proj_amp(e->inter), 0);
    slice_last(m, s, *n, 2, 1, e_d);
    if (e->shared_inter > 0) {
      add(s, n, &w->moe_shared_gate_up, NAME("ffn_gate_up_shexp.weight"), 2, 2 * (int64_t)e->shared_inter, H, 0,
          proj_amp(H), 0);
      slice_last(m, s, *n, 0, 2, s_gu);
      add(s, n, &w->moe_shared_down, NAME("ffn_down_shexp.weight"), 2, H, e->shared_inter, 0, proj_amp(e->shared_inter),
          0);
      slice_last(m, s, *n, 1, 1, s_d);
      add(s, n, &w->moe_shared_gate, NAME("ffn_gate_inp_shexp.weight"), 1, H, 0, 0, proj_amp(H), 0);
    }
  } else {
    const int64_t f_gu[4] = {i0, lc->inter, c->inter + i0, lc->inter}, f_d[2] = {i0, lc->inter};
    add(s, n, &w->ffn_gate_up, NAME("ffn_gate_up.weight"), 2, H, 2 * (int64_t)c->inter, 0, proj_amp(H), 0);
    slice_last(m, s, *n, 1, 2, f_gu);
    add(s, n, &w->ffn_down, NAME("ffn_down.weight"), 2, c->inter, H, 0, proj_amp(c->inter), 0);
    slice_last(m, s, *n, 0, 1, f_d);
  }
  if (c->sandwich_norm)
    add(s, n, &w->post_ffn_norm, NAME("post_ffw_norm.weight"), 1, H, 0, 0, norm_amp, norm_off);
#undef NAME
}

static int model_specs(upf_model *m, tensor_spec *s) {
  const upf_model_config *c = m->full_cfg ? m->full_cfg : m->cfg;
  int n = 0;
  const double norm_off = c->norm.zero_centred ? 0.0 : 1.0;
  /* unit-variance embeddings after the embed scale */
  add(s, &n, &m->token_embd, "token_embd.weight", 2, c->vocab, c->hidden, 0, sqrt(3.0) / c->embed_scale, 0);
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    if (!m->shared_weights || m->weights_of[l] == l) {
      layer_specs(m, l, s, &n);
    } else if (c->ffn == UPF_FFN_MOE) { /* a layer that borrows keeps its own router (see model.h) */
      char name[64];
      snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
      add(s, &n, &m->layers[l].moe_router, name, 2, c->moe.num_experts, c->hidden, 0, proj_amp(c->hidden), 0);
    }
  add(s, &n, &m->output_norm, "output_norm.weight", 1, c->hidden, 0, 0, 0.1, norm_off);
  add(s, &n, &m->output, "output.weight", 2, c->hidden, c->vocab, 0, proj_amp(c->hidden), 0);
  if (c->tied_embeddings) {
    s[n - 1].amp = s[0].amp;
    s[n - 1].transpose_of = "token_embd.weight";
  }
  return n;
}

static uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static uint64_t name_key(uint64_t seed, const char *name) {
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
  for (; *name; name++)
    h = (h ^ (unsigned char)*name) * 0x100000001b3ull;
  return splitmix64(seed ^ h);
}

/* Element idx of a tensor with key `key`: uniform in [-1, 1), a multiple of 2^-23. */
static float unit_value(uint64_t key, int64_t idx) {
  const uint64_t x = splitmix64(key + (uint64_t)idx * 0x9e3779b97f4a7c15ull);
  return (float)((double)(x >> 40) * (1.0 / 8388608.0) - 1.0);
}

typedef struct {
  const tensor_spec *spec;
  uint64_t key;
  int64_t cols; /* of the transposed tensor: element (h, v) is source (v, h) */
  int64_t begin, end;
  int bf16;
  void *out; /* (end - begin) elements */
} fill_job;

static void *fill_range(void *arg) {
  const fill_job *j = arg;
  const tensor_spec *s = j->spec;
  for (int64_t i = j->begin; i < j->end; i++) {
    int64_t src = s->nseg ? sliced_index(s, i) : i;
    if (s->transpose_of) { /* this tensor is (rows, cols) = source (cols, rows) transposed */
      const int64_t r = i / j->cols, col = i % j->cols, rows = s->shape[0];
      src = col * rows + r;
    }
    const float v = (float)(s->offset + s->amp * unit_value(j->key, src));
    if (j->bf16)
      ((uint16_t *)j->out)[i - j->begin] = upf_bf16_from_f32(v);
    else
      ((float *)j->out)[i - j->begin] = v;
  }
  return NULL;
}

#define FILL_CHUNK (int64_t)(1 << 24)
#define FILL_THREADS 16

/* Fills one backend tensor chunk by chunk through a host buffer, the chunks split over threads. */
static upf_status fill_tensor(const upf_backend *be, const tensor_spec *s, uint64_t seed, void *host) {
  const upf_tensor *t = s->t;
  const int64_t numel = upf_tensor_numel(t);
  const int bf16 = t->dtype == UPF_DTYPE_BF16;
  const size_t esize = upf_dtype_size(t->dtype);
  const uint64_t key = name_key(seed, s->transpose_of ? s->transpose_of : s->name);
  for (int64_t c0 = 0; c0 < numel; c0 += FILL_CHUNK) {
    const int64_t c1 = c0 + FILL_CHUNK < numel ? c0 + FILL_CHUNK : numel;
    const int64_t per = (c1 - c0 + FILL_THREADS - 1) / FILL_THREADS;
    pthread_t th[FILL_THREADS];
    fill_job jobs[FILL_THREADS];
    int started = 0;
    for (int k = 0; k < FILL_THREADS; k++) {
      const int64_t b = c0 + k * per, e = b + per < c1 ? b + per : c1;
      if (b >= e)
        break;
      jobs[k] = (fill_job){s, key, t->ndim == 2 ? t->shape[1] : 1, b, e, bf16, (char *)host + (b - c0) * esize};
      if (c1 - c0 < (1 << 16) || pthread_create(&th[k], NULL, fill_range, &jobs[k]) != 0)
        fill_range(&jobs[k]); /* small tensors (or no thread): inline */
      else
        started |= 1 << k;
    }
    for (int k = 0; k < FILL_THREADS; k++)
      if (started & (1 << k))
        pthread_join(th[k], NULL);
    UPF_TRY(be->upload((char *)t->data + c0 * esize, host, (size_t)(c1 - c0) * esize));
  }
  return UPF_OK;
}

/* Allocates and fills every tensor of m (cfg, full_cfg, tp_*, dtype and layer range set). */
static upf_status fill_model(upf_model *m, uint64_t seed) {
  const upf_backend *be = m->be;
  const upf_model_config *cfg = m->cfg;
  tensor_spec *specs = malloc(MAX_SPECS * sizeof *specs);
  const int n = specs ? model_specs(m, specs) : 0;
  int64_t staging = 1; /* elements: the largest tensor, at most one chunk */
  for (int i = 0; i < n; i++) {
    int64_t numel = 1;
    for (int d = 0; d < specs[i].ndim; d++)
      numel *= specs[i].shape[d];
    staging = numel > staging ? numel : staging;
  }
  staging = staging < FILL_CHUNK ? staging : FILL_CHUNK;
  void *host = malloc((size_t)staging * sizeof(float));
  upf_status st = specs && host ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "model %s: host staging", cfg->name);
  for (int i = 0; i < n && st == UPF_OK; i++) {
    tensor_spec *s = &specs[i];
    const upf_dtype dt = s->f32_only ? UPF_DTYPE_F32 : m->dtype;
    st = upf_tensor_init(s->t, NULL, dt, s->ndim, s->shape);
    const size_t bytes = (size_t)upf_tensor_numel(s->t) * upf_dtype_size(dt);
    if (st == UPF_OK)
      st = be->alloc(&s->t->data, bytes);
    if (st == UPF_OK) {
      m->weight_bytes += (double)bytes;
      st = fill_tensor(be, s, seed, host);
    }
    if (st != UPF_OK) {
      char context[80];
      snprintf(context, sizeof context, "%s: ", s->name);
      upf_fail_context(st, context);
    }
  }
  free(specs);
  free(host);
  for (int32_t l = m->layer_begin; m->shared_weights && st == UPF_OK && l < m->layer_end; l++)
    if (m->weights_of[l] != l) { /* borrowed descriptors (upf_model_free skips them) but the layer's own router */
      const upf_tensor router = m->layers[l].moe_router;
      m->layers[l] = m->layers[m->weights_of[l]];
      if (router.data)
        m->layers[l].moe_router = router;
    }
  if (st != UPF_OK)
    upf_model_free(m);
  return st;
}

static upf_status check_init(const upf_model_config *cfg, upf_dtype dtype, int32_t layer_begin, int32_t layer_end) {
  UPF_TRY(upf_model_config_check(cfg));
  if (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "model %s: dtype %s (f32 or bf16)", cfg->name, upf_dtype_name(dtype));
  if (layer_begin < 0 || layer_end > cfg->num_layers || layer_begin >= layer_end)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: layer range %d:%d outside 0:%d or empty", cfg->name, layer_begin,
                    layer_end, cfg->num_layers);
  return UPF_OK;
}

upf_status upf_model_init_seeded(upf_model *m, const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype,
                                 uint64_t seed, int32_t layer_begin, int32_t layer_end) {
  memset(m, 0, sizeof *m);
  UPF_TRY(check_init(cfg, dtype, layer_begin, layer_end));
  m->cfg = cfg, m->be = be, m->dtype = dtype, m->layer_begin = layer_begin, m->layer_end = layer_end;
  m->full_cfg = cfg, m->tp_size = 1;
  return fill_model(m, seed);
}

upf_status upf_model_init_seeded_tp(upf_model *m, const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype,
                                    uint64_t seed, int32_t layer_begin, int32_t layer_end, upf_comm *comm) {
  memset(m, 0, sizeof *m);
  UPF_TRY(check_init(cfg, dtype, layer_begin, layer_end));
  if (comm && upf_comm_backend(comm) != be)
    return upf_fail(UPF_ERR_INVALID_ARG, "model %s: the communicator works on backend %s, the model on %s", cfg->name,
                    upf_comm_backend(comm)->name, be->name);
  m->tp_rank = upf_comm_rank(comm), m->tp_size = upf_comm_size(comm);
  m->tp_cfg = malloc(sizeof *m->tp_cfg);
  if (!m->tp_cfg)
    return upf_fail(UPF_ERR_NOMEM, "model %s: tensor-parallel config", cfg->name);
  const upf_status st = upf_model_config_tp_slice(cfg, m->tp_rank, m->tp_size, m->tp_cfg);
  if (st != UPF_OK) {
    free(m->tp_cfg);
    m->tp_cfg = NULL;
    return st;
  }
  m->cfg = m->tp_cfg, m->full_cfg = cfg, m->be = be, m->dtype = dtype, m->layer_begin = layer_begin;
  m->layer_end = layer_end;
  m->comm = comm && upf_comm_kind_of(comm) != UPF_COMM_SINGLE ? comm : NULL;
  return fill_model(m, seed);
}

upf_status upf_model_init_seeded_shared(upf_model *m, const upf_model_config *cfg, const upf_backend *be,
                                        upf_dtype dtype, uint64_t seed, int32_t layer_begin, int32_t layer_end) {
  memset(m, 0, sizeof *m);
  UPF_TRY(check_init(cfg, dtype, layer_begin, layer_end));
  m->cfg = cfg, m->be = be, m->dtype = dtype, m->layer_begin = layer_begin, m->layer_end = layer_end;
  m->full_cfg = cfg, m->tp_size = 1, m->shared_weights = 1;
  for (int32_t l = layer_begin; l < layer_end; l++) {
    m->weights_of[l] = l;
    for (int32_t k = layer_begin; k < l; k++)
      if (upf_model_mixer(cfg, k) == upf_model_mixer(cfg, l)) {
        m->weights_of[l] = k;
        break;
      }
  }
  return fill_model(m, seed);
}

/* A projection stored in FP8 by upf_model_config_weight_bytes: a matrix that multiplies activations
 * in a GEMM (not the embedding, head, routers or the depthwise conv). */
static int fp8_projection(const tensor_spec *s) {
  return s->ndim >= 2 && strcmp(s->name, "token_embd.weight") && strcmp(s->name, "output.weight") &&
         !strstr(s->name, "ffn_gate_inp") && !strstr(s->name, "ssm_conv1d");
}

upf_status upf_model_config_weight_bytes(const upf_model_config *cfg, int32_t layer_begin, int32_t layer_end,
                                         upf_weight_bytes *out) {
  UPF_TRY(check_init(cfg, UPF_DTYPE_BF16, layer_begin, layer_end));
  upf_model *m = calloc(1, sizeof *m);
  tensor_spec *specs = malloc(MAX_SPECS * sizeof *specs);
  if (!m || !specs) {
    free(m), free(specs);
    return upf_fail(UPF_ERR_NOMEM, "model %s: tensor list", cfg->name);
  }
  m->cfg = cfg, m->full_cfg = cfg, m->tp_size = 1, m->layer_begin = layer_begin, m->layer_end = layer_end;
  const int n = model_specs(m, specs);
  out->bf16 = out->fp8_e4m3 = 0;
  for (int i = 0; i < n; i++) {
    const tensor_spec *s = &specs[i];
    double numel = 1;
    for (int d = 0; d < s->ndim; d++)
      numel *= (double)s->shape[d];
    const double plain = numel * (s->f32_only ? 4 : 2);
    /* (in, out) matrices, (E, out, in) experts: one scale per output row */
    const double fan_in = (double)(s->ndim == 3 ? s->shape[2] : s->shape[0]);
    out->bf16 += plain;
    out->fp8_e4m3 += fp8_projection(s) ? numel + 4 * numel / fan_in : plain;
  }
  free(specs);
  free(m);
  return UPF_OK;
}

/* Every descriptor of the model, including the ones a config does not use (data NULL). */
static void release_tensor(const upf_backend *be, upf_tensor *t) {
  if (t->data)
    be->release(t->data);
  t->data = NULL;
}

void upf_model_free(upf_model *m) {
  if (!m || !m->be)
    return;
  release_tensor(m->be, &m->token_embd), release_tensor(m->be, &m->output_norm), release_tensor(m->be, &m->output);
  for (int l = 0; l < UPF_MODEL_MAX_LAYERS; l++) {
    if (m->shared_weights && l >= m->layer_begin && l < m->layer_end && m->weights_of[l] != l) {
      if (m->layers[l].moe_router.data != m->layers[m->weights_of[l]].moe_router.data)
        release_tensor(m->be, &m->layers[l].moe_router); /* its own */
      memset(&m->layers[l], 0, sizeof m->layers[l]); /* the rest borrowed from its kind's first layer */
      continue;
    }
    upf_tensor *t = (upf_tensor *)&m->layers[l]; /* upf_layer_weights holds upf_tensor fields only */
    for (size_t i = 0; i < sizeof m->layers[l] / sizeof *t; i++)
      release_tensor(m->be, &t[i]);
  }
  m->weight_bytes = 0;
  if (m->tp_cfg) {
    m->cfg = m->full_cfg;
    free(m->tp_cfg);
    m->tp_cfg = NULL;
  }
}

upf_status upf_model_for_each_tensor(upf_model *m, upf_model_tensor_fn fn, void *user) {
  tensor_spec *specs = malloc(MAX_SPECS * sizeof *specs);
  if (!specs)
    return upf_fail(UPF_ERR_NOMEM, "model: tensor list");
  const int n = model_specs(m, specs);
  upf_status st = UPF_OK;
  for (int i = 0; i < n && st == UPF_OK; i++)
    st = fn(specs[i].name, specs[i].t, user);
  free(specs);
  return st;
}

void upf_model_seeded_ids(uint64_t seed, int32_t vocab, int64_t n, int32_t *ids) {
  upf_rng rng;
  upf_rng_seed(&rng, seed ^ 0x1d5ull);
  for (int64_t t = 0; t < n; t++)
    ids[t] = (int32_t)upf_rng_below(&rng, (uint64_t)vocab);
}

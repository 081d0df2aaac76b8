/* The fp64 truth of a prefill: a naive forward pass of a model, written from the definitions in
 * include/uniprefill/ (plain loops, activations and accumulators in double, llama2.c style). It reads
 * the weights of a model on the CPU backend (f32) and calls no backend op and no ref_cpu function, so
 * it is independent of both backends. It runs over the whole step at every layer and never gathers: a
 * drop marks the tokens it discards dead, and dead tokens are masked out of every later sub-layer
 * (keys of attention, windows counted over alive keys, identity steps of the recurrence, the conv over
 * the previous alive tokens). It serves `upf verify model` (the long-reduction rule of f32 logits) and
 * the masked-path tests. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "verify/model_truth.h"

#define MAX_CONV_K 16
#define MAX_ROT 512

/* ---- the sub-layers, from their definitions ---- */

static const float *wt(const upf_tensor *t) { return (const float *)t->data; }
static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double silu(double x) { return x * sigmoid(x); }
static double softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); } /* torch's threshold 20 */
static double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

/* y (n_out) = x (n_in) . w (n_in, n_out): the (in, out) layout of the model's projections. */
static void proj_in_out(const double *x, const float *w, int64_t n_in, int64_t n_out, double *y) {
  for (int64_t o = 0; o < n_out; o++)
    y[o] = 0.0;
  for (int64_t i = 0; i < n_in; i++) {
    const double xi = x[i];
    const float *row = w + i * n_out;
    for (int64_t o = 0; o < n_out; o++)
      y[o] += xi * (double)row[o];
  }
}

/* y (n_out) = w (n_out, n_in) . x (n_in): the (out, in) layout of the MoE weights. */
static void proj_out_in(const double *x, const float *w, int64_t n_in, int64_t n_out, double *y) {
  for (int64_t o = 0; o < n_out; o++) {
    double acc = 0.0;
    for (int64_t i = 0; i < n_in; i++)
      acc += (double)w[o * n_in + i] * x[i];
    y[o] = acc;
  }
}

/* RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, or * (1 + w) when zero-centred; y may be x. */
static void rms_norm(const double *x, int64_t n, const float *w, const upf_norm_params *p, double *y) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; i++)
    ss += x[i] * x[i];
  const double inv = 1.0 / sqrt(ss / (double)n + (double)p->eps);
  for (int64_t i = 0; i < n; i++)
    y[i] = x[i] * inv * (p->zero_centred ? 1.0 + (double)w[i] : (double)w[i]);
}

/* RoPE, neox layout: dim i pairs with i + rot/2 and both turn by pos * inv_freq[i]; dims >= rot pass. */
static void rope(double *x, int32_t rot, const double *inv_freq, int64_t pos) {
  for (int32_t i = 0; i < rot / 2; i++) {
    const double a = (double)pos * inv_freq[i], cs = cos(a), sn = sin(a), x1 = x[i], x2 = x[i + rot / 2];
    x[i] = x1 * cs - x2 * sn;
    x[i + rot / 2] = x2 * cs + x1 * sn;
  }
}

static void l2_norm(double *x, int64_t n) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; i++)
    ss += x[i] * x[i];
  const double inv = 1.0 / sqrt(ss + (double)UPF_GDN_L2_EPS);
  for (int64_t i = 0; i < n; i++)
    x[i] *= inv;
}

/* The causal depthwise conv1d + SiLU of one request [begin, end) of x (rows ld apart) over its alive
 * tokens: y[t, c] = silu(sum_j w[c, j] x[u_j, c]) with u_{K-1} = t and u_{K-2}, u_{K-3}, ... the alive
 * tokens before t in the request (zero where there are fewer). This is the conv over the compacted
 * sequence, which is not a mask on the contiguous one: zeroing a dead token's input would leave a hole
 * in the window, where the compacted order pulls the previous alive token in. So the window is taken
 * as "the previous K-1 alive tokens" here, and test_conv_compacted_hand pins that by hand. Rows of
 * dead tokens are not written. zero_hole computes the masked contiguous conv instead (the window is
 * the K-1 previous positions, dead ones read as zero): the wrong rule, for the negative control. */
void upf_truth_conv_alive(const double *x, int64_t ld, const uint8_t *alive, int64_t begin, int64_t end, const float *w,
                          int64_t C, int64_t K, int zero_hole, double *y) {
  for (int64_t t = begin; t < end; t++) {
    if (!alive[t])
      continue;
    int64_t src[MAX_CONV_K];
    int64_t u = t;
    for (int64_t j = K - 1; j >= 0; j--) {
      while (!zero_hole && u >= begin && !alive[u])
        u--;
      src[j] = u >= begin && alive[u] ? u : -1;
      u--;
    }
    for (int64_t c = 0; c < C; c++) {
      double acc = 0.0;
      for (int64_t j = 0; j < K; j++)
        acc += src[j] < 0 ? 0.0 : (double)w[c * K + j] * x[src[j] * ld + c];
      y[t * ld + c] = silu(acc);
    }
  }
}

/* ---- the naive forward pass ---- */

/* The masking rules a pass can break on purpose (negative controls: the compacted path must not
 * match a pass that breaks a rule the data exercises). */

/* The state of one pass over the whole step: every token keeps its row; dead tokens keep stale rows,
 * which nothing reads again. */
typedef struct {
  const upf_model *m;
  const upf_model_config *c;
  int64_t T;
  int32_t B;
  const int32_t *cu;   /* (B+1) */
  int32_t *pos;        /* (T) original position in the request */
  uint8_t *alive;      /* (T) 0 once a drop layer discarded the token */
  double *residual;    /* (T, H) */
  double *x;           /* (T, H) normalised input of the current sub-layer */
  double *out;         /* (T, H) output of the current sub-layer */
  int broken;          /* UPF_TRUTH_* flags: 0 for the pass under test */
} naive_pass;

/* Causal attention (full, or a window of the last `window` alive keys including the query's own) over
 * the alive keys of the query's request, GQA, scale and soft-cap; the Qwen3-Next output gate; the
 * output projection. q/k norm per head and RoPE at the original positions before it. */
static int naive_attention(naive_pass *n, int32_t l) {
  const upf_model_config *c = n->c;
  const upf_layer_weights *w = &n->m->layers[l];
  const int64_t H = c->hidden, D = c->head_dim, Hq = c->q_heads, Hkv = c->kv_heads, T = n->T;
  const int64_t qs = D * (1 + c->attn_gate), N = upf_model_qkv_cols(c), k0 = Hq * qs, v0 = k0 + Hkv * D;
  const int sliding = upf_model_mixer(c, l) == UPF_MIXER_SLIDING;
  const upf_rope_params *rp = sliding ? &c->rope_sliding : &c->rope_full;
  const int32_t rot = upf_rope_rotary_dim(rp, D), window = sliding ? c->window : 0;
  const double scale = c->attn.scale > 0 ? (double)c->attn.scale : 1.0 / sqrt((double)D);
  double inv_freq[MAX_ROT / 2];
  if (rot > MAX_ROT)
    return 0;
  upf_rope_inv_freq(rp, rot, inv_freq);
  double *qkv = malloc((size_t)(T * N) * sizeof *qkv), *s = malloc((size_t)T * sizeof *s);
  double *o = malloc((size_t)(Hq * D) * sizeof *o);
  int64_t *key = malloc((size_t)T * sizeof *key);
  if (!qkv || !s || !o || !key) {
    free(qkv), free(s), free(o), free(key);
    return 0;
  }
  for (int64_t t = 0; t < T; t++) {
    if (!n->alive[t])
      continue;
    double *row = qkv + t * N;
    proj_in_out(n->x + t * H, wt(&w->attn_qkv), H, N, row);
    for (int64_t h = 0; h < Hq; h++) {
      if (c->qk_norm)
        rms_norm(row + h * qs, D, wt(&w->attn_q_norm), &c->norm, row + h * qs);
      rope(row + h * qs, rot, inv_freq, n->pos[t]);
    }
    for (int64_t h = 0; h < Hkv; h++) {
      if (c->qk_norm)
        rms_norm(row + k0 + h * D, D, wt(&w->attn_k_norm), &c->norm, row + k0 + h * D);
      rope(row + k0 + h * D, rot, inv_freq, n->pos[t]);
    }
  }
  for (int32_t r = 0; r < n->B; r++)
    for (int64_t t = n->cu[r]; t < n->cu[r + 1]; t++) {
      if (!n->alive[t])
        continue;
      for (int64_t h = 0; h < Hq; h++) {
        const double *q = qkv + t * N + h * qs;
        const int64_t kh = h / (Hq / Hkv);
        int64_t nk = 0;
        double mx = -INFINITY;
        const int by_pos = n->broken & UPF_TRUTH_WINDOW_BY_POSITION;
        for (int64_t j = t; j >= n->cu[r] && (!window || (by_pos ? t - j < window : nk < window)); j--) {
          if (!n->alive[j])
            continue;
          double dot = 0.0;
          for (int64_t d = 0; d < D; d++)
            dot += q[d] * qkv[j * N + k0 + kh * D + d];
          dot *= scale;
          if (c->attn.softcap > 0)
            dot = c->attn.softcap * tanh(dot / c->attn.softcap);
          key[nk] = j, s[nk++] = dot;
          mx = fmax(mx, dot);
        }
        double sum = 0.0;
        for (int64_t i = 0; i < nk; i++)
          sum += s[i] = exp(s[i] - mx);
        for (int64_t d = 0; d < D; d++) {
          double acc = 0.0;
          for (int64_t i = 0; i < nk; i++)
            acc += s[i] * qkv[key[i] * N + v0 + kh * D + d];
          o[h * D + d] = acc / sum;
          if (c->attn_gate)
            o[h * D + d] *= sigmoid(q[D + d]); /* the gate follows the query inside the head's 2D columns */
        }
      }
      proj_in_out(o, wt(&w->attn_output), Hq * D, H, n->out + t * H);
    }
  free(qkv), free(s), free(o), free(key);
  return 1;
}

/* Gated DeltaNet: projections, conv1d + SiLU over the alive tokens, L2-normed q and k, the delta rule
 * with dead tokens as identity steps (the state does not change and they emit nothing), the gated
 * RMSNorm, the output projection. */
static int naive_gdn(naive_pass *n, int32_t l) {
  const upf_model_config *c = n->c;
  const upf_layer_weights *w = &n->m->layers[l];
  const int64_t H = c->hidden, T = n->T, C = upf_model_gdn_conv_dim(c), K = c->gdn_conv_kernel;
  const int64_t Hk = c->gdn_key_heads, Hv = c->gdn_value_heads, Dk = c->gdn_key_dim, Dv = c->gdn_value_dim;
  const int64_t Np = C + Hv * Dv;
  const double scale = 1.0 / sqrt((double)Dk);
  if (K > MAX_CONV_K)
    return 0;
  double *proj = malloc((size_t)(T * Np) * sizeof *proj), *ba = malloc((size_t)(T * 2 * Hv) * sizeof *ba);
  double *conv = malloc((size_t)(T * Np) * sizeof *conv), *o = malloc((size_t)(T * Hv * Dv) * sizeof *o);
  double *S = malloc((size_t)(Dk * Dv) * sizeof *S), *qk = malloc((size_t)(2 * Dk) * sizeof *qk);
  double *delta = malloc((size_t)Dv * sizeof *delta);
  int ok = proj && ba && conv && o && S && qk && delta;
  for (int64_t t = 0; ok && t < T; t++)
    if (n->alive[t]) {
      proj_in_out(n->x + t * H, wt(&w->ssm_in), H, Np, proj + t * Np);
      proj_in_out(n->x + t * H, wt(&w->ssm_ba), H, 2 * Hv, ba + t * 2 * Hv);
    }
  for (int32_t r = 0; ok && r < n->B; r++) {
    upf_truth_conv_alive(proj, Np, n->alive, n->cu[r], n->cu[r + 1], wt(&w->ssm_conv1d), C, K, n->broken & UPF_TRUTH_CONV_ZERO_HOLE,
               conv);
    for (int64_t h = 0; h < Hv; h++) {
      const int64_t kh = h / (Hv / Hk);
      const double a_log = wt(&w->ssm_a)[h], dt_bias = wt(&w->ssm_dt)[h];
      memset(S, 0, (size_t)(Dk * Dv) * sizeof *S); /* S (Dk, Dv) */
      for (int64_t t = n->cu[r]; t < n->cu[r + 1]; t++) {
        if (!n->alive[t])
          continue; /* identity step */
        double *q = qk, *k = qk + Dk;
        const double *v = conv + t * Np + 2 * Hk * Dk + h * Dv;
        memcpy(q, conv + t * Np + kh * Dk, (size_t)Dk * sizeof *q);
        memcpy(k, conv + t * Np + Hk * Dk + kh * Dk, (size_t)Dk * sizeof *k);
        l2_norm(q, Dk), l2_norm(k, Dk);
        const double beta = sigmoid(ba[t * 2 * Hv + h]);
        const double g = -exp(a_log) * softplus(ba[t * 2 * Hv + Hv + h] + dt_bias);
        for (int64_t i = 0; i < Dk * Dv; i++)
          S[i] *= exp(g);
        for (int64_t j = 0; j < Dv; j++) {
          double sk = 0.0;
          for (int64_t i = 0; i < Dk; i++)
            sk += S[i * Dv + j] * k[i];
          delta[j] = beta * (v[j] - sk);
        }
        for (int64_t i = 0; i < Dk; i++)
          for (int64_t j = 0; j < Dv; j++)
            S[i * Dv + j] += k[i] * delta[j];
        double *oh = o + (t * Hv + h) * Dv;
        for (int64_t j = 0; j < Dv; j++) {
          double acc = 0.0;
          for (int64_t i = 0; i < Dk; i++)
            acc += S[i * Dv + j] * q[i];
          oh[j] = scale * acc;
        }
        /* gated RMSNorm: norm(o) * w * silu(z), z the last Hv Dv columns of the input projection */
        rms_norm(oh, Dv, wt(&w->ssm_norm), &c->gdn_norm, oh);
        for (int64_t j = 0; j < Dv; j++)
          oh[j] *= silu(proj[t * Np + C + h * Dv + j]);
      }
    }
  }
  for (int64_t t = 0; ok && t < T; t++)
    if (n->alive[t])
      proj_in_out(o + t * Hv * Dv, wt(&w->ssm_out), Hv * Dv, H, n->out + t * H);
  free(proj), free(ba), free(conv), free(o), free(S), free(qk), free(delta);
  return ok;
}

/* The gated FFN act(x Wg) * (x Wu) Wd, and x's MoE layer: router softmax, the top-K experts by logit
 * (ties to the lower index), weights renormalised, SwiGLU experts, the shared expert under its sigmoid
 * gate. One token. */
static int naive_ffn(const upf_model_config *c, const upf_layer_weights *w, const double *x, double *y) {
  const int64_t H = c->hidden;
  if (c->ffn == UPF_FFN_DENSE) {
    const int64_t I = c->inter;
    double *gu = malloc((size_t)(2 * I) * sizeof *gu);
    if (!gu)
      return 0;
    proj_in_out(x, wt(&w->ffn_gate_up), H, 2 * I, gu);
    for (int64_t i = 0; i < I; i++)
      gu[i] = (c->act == UPF_ACT_SILU ? silu(gu[i]) : gelu_tanh(gu[i])) * gu[I + i];
    proj_in_out(gu, wt(&w->ffn_down), I, H, y);
    free(gu);
    return 1;
  }
  const upf_moe_config *e = &c->moe;
  const int64_t E = e->num_experts, I = e->inter, Is = e->shared_inter, Imax = I > Is ? I : Is;
  double *logit = malloc((size_t)E * sizeof *logit), *gu = malloc((size_t)(2 * Imax) * sizeof *gu);
  double *d = malloc((size_t)H * sizeof *d);
  int *taken = calloc((size_t)E, sizeof *taken);
  if (!logit || !gu || !d || !taken) {
    free(logit), free(gu), free(d), free(taken);
    return 0;
  }
  proj_out_in(x, wt(&w->moe_router), H, E, logit);
  double mx = -INFINITY, z = 0.0, chosen_mass = 0.0;
  for (int64_t i = 0; i < E; i++)
    mx = fmax(mx, logit[i]);
  for (int64_t i = 0; i < E; i++)
    z += exp(logit[i] - mx);
  int64_t top[64];
  for (int32_t k = 0; k < e->top_k; k++) {
    int64_t best = -1;
    for (int64_t i = 0; i < E; i++)
      if (!taken[i] && (best < 0 || logit[i] > logit[best]))
        best = i;
    taken[best] = 1, top[k] = best;
    chosen_mass += exp(logit[best] - mx) / z;
  }
  for (int64_t h = 0; h < H; h++)
    y[h] = 0.0;
  for (int32_t k = 0; k < e->top_k; k++) {
    const int64_t ex = top[k];
    const double p = exp(logit[ex] - mx) / z, wk = e->norm_topk ? p / chosen_mass : p;
    proj_out_in(x, wt(&w->moe_gate_up) + ex * 2 * I * H, H, 2 * I, gu);
    for (int64_t i = 0; i < I; i++)
      gu[i] = silu(gu[i]) * gu[I + i];
    proj_out_in(gu, wt(&w->moe_down) + ex * H * I, I, H, d);
    for (int64_t h = 0; h < H; h++)
      y[h] += wk * d[h];
  }
  if (Is > 0) {
    proj_out_in(x, wt(&w->moe_shared_gate_up), H, 2 * Is, gu);
    for (int64_t i = 0; i < Is; i++)
      gu[i] = silu(gu[i]) * gu[Is + i];
    proj_out_in(gu, wt(&w->moe_shared_down), Is, H, d);
    double gate = 0.0;
    for (int64_t h = 0; h < H; h++)
      gate += (double)wt(&w->moe_shared_gate)[h] * x[h];
    gate = sigmoid(gate);
    for (int64_t h = 0; h < H; h++)
      y[h] += gate * d[h];
  }
  free(logit), free(gu), free(d), free(taken);
  return 1;
}

/* The drop record of layer l in res, or NULL. */
static const upf_drop_record *drop_at(const upf_prefill_result *res, int32_t l) {
  for (int k = 0; res && k < res->num_drops; k++)
    if (res->drops[k].layer == l)
      return &res->drops[k];
  return NULL;
}

/* The mask of a drop record covers the layer's input in compacted order, which is the alive tokens in
 * ascending order: entry j decides the j-th alive token. 0 when the record does not fit. */
static int apply_drop(naive_pass *n, const upf_drop_record *rec) {
  int64_t j = 0;
  for (int64_t t = 0; t < n->T; t++)
    if (n->alive[t]) {
      if (j >= rec->tokens_in)
        return 0;
      n->alive[t] = rec->mask[j++];
    }
  return j == rec->tokens_in;
}

/* Logits (B, V) of the last token of each request. `uni` holds the drops to apply (NULL: dense);
 * `broken` the UPF_TRUTH_* flags of a negative control (0: the pass under test). */
int upf_model_truth(const upf_model *m, const int32_t *ids, const int32_t *cu, int32_t B,
                    const upf_prefill_result *uni, int broken, double *logits) {
  const upf_model_config *c = m->cfg;
  const int64_t T = cu[B], H = c->hidden;
  naive_pass n = {m, c, T, B, cu, malloc((size_t)T * sizeof(int32_t)), malloc((size_t)T),
                  malloc((size_t)(T * H) * sizeof(double)), malloc((size_t)(T * H) * sizeof(double)),
                  malloc((size_t)(T * H) * sizeof(double)), broken};
  int ok = n.pos && n.alive && n.residual && n.x && n.out;
  for (int32_t r = 0; ok && r < B; r++)
    for (int64_t t = cu[r]; t < cu[r + 1]; t++)
      n.pos[t] = (int32_t)(t - cu[r]), n.alive[t] = 1;
  for (int64_t t = 0; ok && t < T; t++)
    for (int64_t h = 0; h < H; h++)
      n.residual[t * H + h] = (double)wt(&m->token_embd)[(int64_t)ids[t] * H + h] * (double)c->embed_scale;
  for (int32_t l = 0; ok && l < c->num_layers; l++) {
    const upf_layer_weights *w = &m->layers[l];
    for (int64_t t = 0; t < T; t++)
      if (n.alive[t])
        rms_norm(n.residual + t * H, H, wt(&w->attn_norm), &c->norm, n.x + t * H);
    ok = upf_model_mixer(c, l) == UPF_MIXER_GDN ? naive_gdn(&n, l) : naive_attention(&n, l);
    for (int64_t t = 0; ok && t < T; t++)
      if (n.alive[t]) {
        if (c->sandwich_norm)
          rms_norm(n.out + t * H, H, wt(&w->post_attn_norm), &c->norm, n.out + t * H);
        for (int64_t h = 0; h < H; h++)
          n.residual[t * H + h] += n.out[t * H + h];
      }
    const upf_drop_record *rec = drop_at(uni, l);
    if (ok && rec) {
      ok = apply_drop(&n, rec);
      if (!ok)
        printf("\n%s: the drop record of layer %d does not fit the alive tokens\n", c->name, l);
    }
    for (int64_t t = 0; ok && t < T; t++)
      if (n.alive[t]) {
        rms_norm(n.residual + t * H, H, wt(&w->ffn_norm), &c->norm, n.x + t * H);
        ok = naive_ffn(c, w, n.x + t * H, n.out + t * H);
        if (ok && c->sandwich_norm)
          rms_norm(n.out + t * H, H, wt(&w->post_ffn_norm), &c->norm, n.out + t * H);
        for (int64_t h = 0; ok && h < H; h++)
          n.residual[t * H + h] += n.out[t * H + h];
      }
  }
  for (int32_t r = 0; ok && r < B; r++) {
    const int64_t t = cu[r + 1] - 1;
    ok = n.alive[t]; /* a request's last token is always kept */
    rms_norm(n.residual + t * H, H, wt(&m->output_norm), &c->norm, n.x + t * H);
    proj_in_out(n.x + t * H, wt(&m->output), H, c->vocab, logits + (int64_t)r * c->vocab);
  }
  free(n.pos), free(n.alive), free(n.residual), free(n.x), free(n.out);
  return ok;
}


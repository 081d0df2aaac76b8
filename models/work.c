/* The work of a dense prefill by ceiling (include/uniprefill/model.h: upf_model_prefill_work). */
#include <math.h>

#include "uniprefill/attn.h"
#include "uniprefill/model.h"
#include "uniprefill/moe.h"

/* Chunk length of the Gated DeltaNet chunked scan whose products are counted. */
enum { GDN_CHUNK = 64 };

void upf_model_prefill_work(const upf_model_config *c, int32_t layer_begin, int32_t layer_end, const int32_t *lengths,
                            int32_t n, upf_dtype dtype, upf_prefill_work *out) {
  double T = 0.0;
  for (int32_t r = 0; r < n; r++)
    T += lengths[r];
  const double e = (double)upf_dtype_size(dtype), H = c->hidden;
  const double q_cols = (double)c->q_heads * c->head_dim, kv_cols = (double)c->kv_heads * c->head_dim;
  upf_prefill_work w = {0};
  /* embedding rows written, the LM head on the last token of each request (and its norm) */
  w.glue_bytes += T * H * e + 2.0 * n * H * e;
  w.gemm_flop += 2.0 * n * H * c->vocab;
  for (int32_t l = layer_begin; l < layer_end; l++) {
    /* the residual add and norm before each sub-layer (read two rows, write two), sandwich norms */
    w.glue_bytes += 2.0 * 4.0 * T * H * e;
    if (c->sandwich_norm)
      w.glue_bytes += 2.0 * 2.0 * T * H * e;
    const upf_mixer_kind kind = upf_model_mixer(c, l);
    if (kind == UPF_MIXER_GDN) {
      const double hv = c->gdn_value_heads, dk = c->gdn_key_dim, dv = c->gdn_value_dim;
      const double conv = (double)upf_model_gdn_conv_dim(c);
      w.gemm_flop += 2.0 * T * H * (conv + hv * dv) + 2.0 * T * H * 2.0 * hv + 2.0 * T * hv * dv * H;
      /* per value head and chunk of L = 64: K K^T and Q K^T (2 L^2 dk each), the state's products with K
       * and Q (2 L dk dv each), its update (2 L dk dv), the intra-chunk output (2 L^2 dv) */
      const double L = GDN_CHUNK;
      w.gdn_scan_flop += T / L * hv * (4.0 * L * L * dk + 6.0 * L * dk * dv + 2.0 * L * L * dv);
      /* conv over the channels (read, write), the gated norm of the output (read o and z, write) */
      w.glue_bytes += 2.0 * T * conv * e + 3.0 * T * hv * dv * e;
    } else {
      w.gemm_flop += 2.0 * T * H * (double)upf_model_qkv_cols(c) + 2.0 * T * q_cols * H;
      w.attn_flop += upf_attn_flops(lengths, lengths, n, c->q_heads, c->head_dim,
                                    kind == UPF_MIXER_SLIDING ? c->window : 0);
      /* RoPE (q and k rows read and written), q/k norms likewise, the KV cache write (read k, v; write
       * them), the output gate (read the gate and the attention output, write) */
      w.glue_bytes += 2.0 * T * (q_cols + kv_cols) * e * (c->qk_norm ? 2.0 : 1.0) + 4.0 * T * kv_cols * e;
      if (c->attn_gate)
        w.glue_bytes += 3.0 * T * q_cols * e;
    }
    if (c->ffn == UPF_FFN_MOE) {
      w.moe_flop += upf_moe_flops(&c->moe, (int64_t)T);
      /* activation-and-multiply of every routed and the shared expert's rows, the weighted combine */
      w.glue_bytes += 3.0 * T * (c->moe.top_k * (double)c->moe.inter + c->moe.shared_inter) * e +
                      2.0 * T * c->moe.top_k * H * e;
    } else {
      w.gemm_flop += 2.0 * T * H * 2.0 * c->inter + 2.0 * T * c->inter * H;
      w.glue_bytes += 3.0 * T * c->inter * e;
    }
  }
  *out = w;
}

double upf_prefill_work_limit(const upf_prefill_work *w, double gemm_rate, double attn_rate, double copy_rate) {
  const double rates[3] = {gemm_rate, attn_rate, copy_rate};
  for (int i = 0; i < 3; i++)
    if (!(rates[i] > 0.0) || isinf(rates[i]))
      return NAN;
  return (w->gemm_flop + w->moe_flop) / gemm_rate + w->attn_flop / attn_rate + w->glue_bytes / copy_rate;
}

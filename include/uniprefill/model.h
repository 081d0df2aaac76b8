/* End-to-end prefill of the three model families (SPEC.md section 6): a model is a config plus
 * weights; the forward pass (models/) walks the layers and calls the sub-layers of layers/, every op
 * through the backend ops table, so the same code runs on the CPU reference and on CUDA. UniPrefill
 * mode runs the drop step (SPEC.md section 3) after the attention block of each drop layer. */
#ifndef UNIPREFILL_MODEL_H
#define UNIPREFILL_MODEL_H

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/comm.h"
#include "uniprefill/compact_attn.h"
#include "uniprefill/dense.h"
#include "uniprefill/gguf.h"
#include "uniprefill/moe.h"
#include "uniprefill/select.h"
#include "uniprefill/sparse.h"

#ifdef __cplusplus
extern "C" {
#endif

#define UPF_MODEL_MAX_LAYERS 64

typedef enum { UPF_FAMILY_LLAMA = 0, UPF_FAMILY_GEMMA3, UPF_FAMILY_QWEN3_NEXT, UPF_FAMILY_COUNT } upf_family;

/* The token mixer of a layer. */
typedef enum {
  UPF_MIXER_FULL = 0, /* causal attention over every token of the request */
  UPF_MIXER_SLIDING,  /* causal sliding-window attention (window counted in compacted indices) */
  UPF_MIXER_GDN,      /* Gated DeltaNet linear attention */
} upf_mixer_kind;

typedef enum { UPF_FFN_DENSE = 0, UPF_FFN_MOE } upf_ffn_kind;

typedef struct {
  const char *name;    /* "llama3.1-8b", "llama-tiny", ... */
  const char *summary; /* one line: where the shapes come from */
  upf_family family;
  int32_t hidden;      /* H */
  int32_t num_layers;
  int32_t vocab;       /* V */
  /* attention layers */
  int32_t q_heads, kv_heads, head_dim; /* Hq, Hkv, D */
  int32_t attn_gate;                   /* 1: q_proj emits (Hq, 2D) = query and output gate (Qwen3-Next) */
  int32_t qk_norm;                     /* 1: per-head RMSNorm of q and k (Gemma-3, Qwen3-Next) */
  int32_t sandwich_norm;               /* 1: post-attention and post-FFN norms (Gemma-3) */
  int32_t full_attn_interval;          /* layer i is full attention iff (i+1) % interval == 0; 1: all */
  upf_mixer_kind other_mixer;          /* the mixer of the other layers: SLIDING or GDN */
  int32_t window;                      /* sliding window (keys, the query's own included) */
  upf_attn_params attn;                /* scale (0 = 1/sqrt(D)), softcap; window is set per layer */
  upf_rope_params rope_full;           /* RoPE of the full-attention layers */
  upf_rope_params rope_sliding;        /* RoPE of the sliding-window layers */
  upf_norm_params norm;                /* every layer norm, the q/k norms and the final norm */
  float embed_scale;                   /* embeddings times this (Gemma-3: sqrt(H)); 1 otherwise */
  int32_t tied_embeddings;             /* 1: the LM head is token_embd^T */
  /* FFN */
  upf_ffn_kind ffn;
  int32_t inter;                       /* I of the dense gated FFN */
  upf_act act;
  upf_moe_config moe;                  /* when ffn == UPF_FFN_MOE */
  /* Gated DeltaNet (other_mixer == GDN) */
  int32_t gdn_key_heads, gdn_value_heads, gdn_key_dim, gdn_value_dim, gdn_conv_kernel;
  upf_norm_params gdn_norm;
  /* UniPrefill: the drop layers (full-attention layers), ascending, and the selection defaults */
  int32_t num_drop_layers;
  int32_t drop_layers[UPF_MODEL_MAX_LAYERS];
  upf_select_params select;
  int64_t drop_min_step_tokens; /* drops run only when the step has more tokens than this (Gemma-3: the window) */
  int32_t context_length;       /* max positions the model was trained for (GGUF context_length); 0: not stated */
} upf_model_config;

/* The built-in models: the real shapes of Llama-3.1-8B, Gemma-3-12B and Qwen3-Next-80B-A3B and a
 * tiny config of each family. NULL (with a message listing the names) for an unknown name. */
const upf_model_config *upf_model_config_by_name(const char *name);
int upf_model_config_count(void);
const upf_model_config *upf_model_config_at(int i);
/* Consistency of a config (heads divide, drop layers are full-attention layers in range, ...). */
upf_status upf_model_config_check(const upf_model_config *cfg);
upf_mixer_kind upf_model_mixer(const upf_model_config *cfg, int32_t layer);
int upf_model_is_drop_layer(const upf_model_config *cfg, int32_t layer);
/* Columns of the fused QKV projection: Hq*D*(1 + attn_gate) + 2*Hkv*D. */
int64_t upf_model_qkv_cols(const upf_model_config *cfg);
/* Gated DeltaNet: conv channels C = 2*Hk*Dk + Hv*Dv and the fused input projection's columns C + Hv*Dv. */
int64_t upf_model_gdn_conv_dim(const upf_model_config *cfg);

/* ---- Weights ----
 * Every tensor has its GGUF name (token_embd.weight, blk.N.attn_qkv.weight, ..., output_norm.weight).
 * Projections are stored (in, out), the layout of the gemm op; GGUF's attn_q/attn_k/attn_v are the
 * column blocks of attn_qkv and ffn_gate/ffn_up those of ffn_gate_up. MoE weights keep the (out, in)
 * layout of the moe op. Norm weights hold what the op multiplies by (zero-centred norms: the offset). */
typedef struct {
  upf_tensor attn_norm;      /* (H)          blk.N.attn_norm.weight */
  upf_tensor attn_qkv;       /* (H, Nqkv)    blk.N.attn_qkv.weight: [q (Hq, D[, gate D]) | k (Hkv D) | v (Hkv D)] */
  upf_tensor attn_q_norm;    /* (D)          blk.N.attn_q_norm.weight (qk_norm) */
  upf_tensor attn_k_norm;    /* (D)          blk.N.attn_k_norm.weight (qk_norm) */
  upf_tensor attn_output;    /* (Hq D, H)    blk.N.attn_output.weight */
  upf_tensor post_attn_norm; /* (H)          blk.N.post_attention_norm.weight (sandwich) */
  /* Gated DeltaNet */
  upf_tensor ssm_in;         /* (H, C + Hv Dv) blk.N.ssm_in.weight: [q (Hk Dk) | k (Hk Dk) | v (Hv Dv) | z (Hv Dv)] */
  upf_tensor ssm_ba;         /* (H, 2 Hv)    blk.N.ssm_ba.weight: [b (Hv) | a (Hv)] */
  upf_tensor ssm_conv1d;     /* (C, K)       blk.N.ssm_conv1d.weight */
  upf_tensor ssm_a;          /* (Hv) f32     blk.N.ssm_a: A_log */
  upf_tensor ssm_dt;         /* (Hv) f32     blk.N.ssm_dt.bias */
  upf_tensor ssm_norm;       /* (Dv)         blk.N.ssm_norm.weight */
  upf_tensor ssm_out;        /* (Hv Dv, H)   blk.N.ssm_out.weight */
  /* FFN */
  upf_tensor ffn_norm;       /* (H)          blk.N.ffn_norm.weight (Gemma-3: pre-feedforward norm) */
  upf_tensor ffn_gate_up;    /* (H, 2I)      blk.N.ffn_gate_up.weight: [gate | up] */
  upf_tensor ffn_down;       /* (I, H)       blk.N.ffn_down.weight */
  upf_tensor post_ffn_norm;  /* (H)          blk.N.post_ffw_norm.weight (sandwich) */
  upf_tensor moe_router;     /* (E, H)       blk.N.ffn_gate_inp.weight */
  upf_tensor moe_gate_up;    /* (E, 2I, H)   blk.N.ffn_gate_up_exps.weight */
  upf_tensor moe_down;       /* (E, H, I)    blk.N.ffn_down_exps.weight */
  upf_tensor moe_shared_gate_up; /* (2Is, H) blk.N.ffn_gate_up_shexp.weight */
  upf_tensor moe_shared_down;    /* (H, Is)  blk.N.ffn_down_shexp.weight */
  upf_tensor moe_shared_gate;    /* (H)      blk.N.ffn_gate_inp_shexp.weight */
} upf_layer_weights;

typedef struct {
  const upf_model_config *cfg;
  const upf_backend *be;      /* where every tensor lives */
  upf_dtype dtype;            /* f32 or bf16: weights and activations (A_log, dt_bias stay f32) */
  int32_t layer_begin, layer_end; /* the layers held: [begin, end) */
  /* A timing mode (upf_model_init_seeded_shared): every layer of one mixer kind holds the tensors of
   * the first layer of that kind in the range (weights_of[l], which owns them); 0: each layer owns its own. */
  int shared_weights;
  int32_t weights_of[UPF_MODEL_MAX_LAYERS];
  upf_tensor token_embd;      /* (V, H)  token_embd.weight */
  upf_tensor output_norm;     /* (H)     output_norm.weight */
  upf_tensor output;          /* (H, V)  output.weight (the transpose of token_embd when tied) */
  upf_layer_weights layers[UPF_MODEL_MAX_LAYERS];
  double weight_bytes;
  /* Tensor parallelism (models/tp.c): NULL comm = one process holding the whole model. With a comm,
   * cfg is this rank's slice (its query/kv heads, GDN heads, I / R of the FFN and of every expert) and
   * full_cfg the whole model's; layers all-reduce their row-parallel outputs through comm and the drop
   * step selects on all-reduced block scores. */
  upf_comm *comm;
  int32_t tp_rank, tp_size;
  const upf_model_config *full_cfg;
  upf_model_config *tp_cfg; /* owned: what cfg points to under TP */
} upf_model;

/* Seeded weights for layers [layer_begin, layer_end) (the embedding and head always): every value is a
 * function of (seed, tensor name, element index) only, so a layer range holds the same values as the
 * whole model. Scaling: projections uniform with variance 1/fan_in (activations keep their scale
 * through each projection), norm weights 1 + small noise (offsets for zero-centred norms), the
 * embedding with unit variance / embed_scale, the decay A_log in [log 1, log 16], dt_bias ~ 0. */
upf_status upf_model_init_seeded(upf_model *m, const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype,
                                 uint64_t seed, int32_t layer_begin, int32_t layer_end);
void upf_model_free(upf_model *m);
/* The seeded model with one set of layer weights per mixer kind (full attention, sliding window, Gated
 * DeltaNet): each layer runs with its own shapes, kind, routing and KV or state sizes on the weights of
 * the first layer of its kind in the range, so a model whose distinct weights do not fit the device
 * (Qwen3-Next-80B-A3B: 48 layers) is timed at full depth. The values are not the whole model's (layer l
 * holds layer weights_of[l]'s): a timing mode, to be stated with every result. A MoE layer keeps its own
 * router (E x H, the whole model's values of that layer): with one router the same layer applied again
 * and again sends the tokens to fewer and fewer experts, and the unbalanced expert GEMMs measured up to
 * 1.25x the distinct model's MoE time (perf/NOTES.md); the experts (1.6 GB a layer) stay shared. */
upf_status upf_model_init_seeded_shared(upf_model *m, const upf_model_config *cfg, const upf_backend *be,
                                        upf_dtype dtype, uint64_t seed, int32_t layer_begin, int32_t layer_end);
/* The bytes the distinct weights of cfg's layers [layer_begin, layer_end) (the embedding and head
 * always) would take: in bf16 (A_log and dt_bias f32), and in FP8 with the projections (attention,
 * Gated DeltaNet in/out, FFN, every expert and the shared expert) in E4M3 with one f32 scale per output
 * channel, the rest (embedding, head, routers, conv, norms) as in bf16. What a shared-weights run
 * stands for, without allocating it. */
typedef struct {
  double bf16, fp8_e4m3;
} upf_weight_bytes;
upf_status upf_model_config_weight_bytes(const upf_model_config *cfg, int32_t layer_begin, int32_t layer_end,
                                         upf_weight_bytes *out);
/* The work of a dense prefill of requests of lengths[0..n) through cfg's layers [layer_begin, layer_end)
 * (the embedding and the LM head on each request's last token always), by the ceiling each part is held
 * to: projections (attention, Gated DeltaNet in/out, dense FFN, LM head) and the MoE layers' routed,
 * shared and router products as GEMM FLOPs (MoE apart: upf_moe_flops); attention as upf_attn_flops over
 * each layer's window; the Gated DeltaNet scan (chunked form: per chunk of 64 and value head, the K K^T,
 * Q K^T, state and output products) apart, since no single ceiling holds it; and the memory-bound glue
 * (norms, residual adds, RoPE, q/k norms, the attention output gate, activation-and-multiply, the KV
 * cache write, the embedding) as bytes read plus written in dtype. A lower bound on time: GEMM FLOPs at
 * the cuBLAS rate + attention FLOPs at the attention kernel's best rate + glue bytes at copy bandwidth
 * (upf report's "limit"). */
typedef struct {
  double gemm_flop, moe_flop, attn_flop, gdn_scan_flop, glue_bytes;
} upf_prefill_work;
void upf_model_prefill_work(const upf_model_config *cfg, int32_t layer_begin, int32_t layer_end,
                            const int32_t *lengths, int32_t n, upf_dtype dtype, upf_prefill_work *out);
/* Seconds of w at the given ceilings (FLOP/s, FLOP/s, bytes/s): (gemm + moe) / gemm_rate + attn /
 * attn_rate + glue / copy_rate, the GDN scan left out; NaN unless every ceiling is positive and finite. */
double upf_prefill_work_limit(const upf_prefill_work *w, double gemm_rate, double attn_rate, double copy_rate);
/* The same seeded model as a tensor-parallel slice for rank upf_comm_rank(comm) of upf_comm_size(comm)
 * (models/tp.c): column-parallel attn_qkv (the rank's query heads, and kv heads, replicated when
 * Hkv < R) and ffn_gate_up / ssm_in (its columns), row-parallel attn_output, ffn_down, ssm_out (its
 * rows), GDN heads split like attention heads (value heads as query heads, key heads as kv heads), MoE
 * split by intermediate (I / R of every expert and of the shared expert; the router replicated),
 * embedding, norms and the LM head replicated. Every slice holds the values of the whole seeded model
 * at its indices, so R ranks compute what one does. comm is borrowed (the caller destroys it after the
 * model); a NULL or single-rank comm gives the whole model, with the TP code path when comm is not
 * NULL and not single. UPF_ERR_SHAPE when the heads or the intermediate sizes do not split over R. */
upf_status upf_model_init_seeded_tp(upf_model *m, const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype,
                                    uint64_t seed, int32_t layer_begin, int32_t layer_end, upf_comm *comm);
/* This rank's slice of cfg (heads and intermediate sizes divided as upf_model_init_seeded_tp does). */
upf_status upf_model_config_tp_slice(const upf_model_config *cfg, int32_t rank, int32_t size, upf_model_config *out);
/* Token ids (n) uniform in [0, vocab) from a seed: the prompts of seeded runs (upf prefill --lengths). */
void upf_model_seeded_ids(uint64_t seed, int32_t vocab, int64_t n, int32_t *ids);

/* Visits every tensor of the model with its GGUF name (the model's layer range only). */
typedef upf_status (*upf_model_tensor_fn)(const char *name, upf_tensor *t, void *user);
upf_status upf_model_for_each_tensor(upf_model *m, upf_model_tensor_fn fn, void *user);

/* ---- GGUF (models/gguf_model.c) ----
 * Models of general.architecture `llama` and `gemma3` built from a GGUF file into the structures of
 * the built-in models, and any model of the suite saved as a GGUF file llama.cpp's tooling reads.
 * Conventions (models/README.md has the table and the sources):
 *  - GGUF stores a projection (out, in) (ne = [in, out]); ours are (in, out): transposed both ways.
 *  - llama's attn_q/attn_k rows are permuted for interleaved-pair RoPE (llama.cpp's converter); our
 *    RoPE is rotate-half, so the rows are un-permuted on load and permuted again on save.
 *  - Gemma-3 (and Qwen3-Next) GGUF norm weights hold 1 + w; ours hold the offset w: w = file - 1 on
 *    load (exact in f32 for file values in [0.5, 2], Sterbenz), file = 1 + w on save.
 *  - What the file does not state is taken from a table keyed on the architecture and the sizes
 *    (Gemma-3: the global-layer period 6 unless attention.sliding_window_pattern says otherwise,
 *    query_pre_attn_scalar, the local RoPE base 10000 unless rope.freq_base_swa says otherwise),
 *    and the drop layers are scaled from the published choice of the family. */

/* A config built from a file. cfg.name and cfg.summary point into the struct: do not copy it. */
typedef struct {
  upf_model_config cfg;
  char name[96];
  char summary[256];
} upf_gguf_model_config;

/* Reads the hyper-parameters of a `llama` or `gemma3` file (and checks its tensor directory holds
 * every tensor the config needs, with the shapes it needs), UPF_ERR_FORMAT / UPF_ERR_UNSUPPORTED
 * naming the file and the key or tensor at fault. */
upf_status upf_model_config_from_gguf(const upf_gguf *g, upf_gguf_model_config *out);
/* Builds the weights of layers [layer_begin, layer_end) (the embedding and head always) from the file
 * on `be` in `dtype` (f32 or bf16): every tensor dequantised to f32, brought to our layout, rounded
 * once to the model dtype. cfg is the file's config (upf_model_config_from_gguf; its drop layers and
 * selection may be changed) and must outlive the model; the file may be closed after the call. */
upf_status upf_model_load_gguf(upf_model *m, const upf_gguf *g, const upf_model_config *cfg, const upf_backend *be,
                               upf_dtype dtype, int32_t layer_begin, int32_t layer_end);
/* Writes a whole model (every layer held) as a version-3 GGUF file of general.architecture llama,
 * gemma3 or qwen3next: tensors of 2 or more dims in `dtype` (f32 or bf16), 1-D ones (norms, A_log,
 * dt bias) in f32 as llama.cpp's converter writes them; the metadata the architecture needs in
 * llama.cpp's key names; tokenizer.ggml.model "none" and vocab_size (llama.cpp wants a tokenizer
 * model; a seeded model has no vocabulary). Atomic: no partial file on failure. */
upf_status upf_model_save_gguf(const upf_model *m, const char *path, upf_dtype dtype);

/* ---- Prefill ---- */

/* FLASHPREFILL: every full-attention layer runs FlashPrefill V2's block-sparse attention (SPEC section
 * 8: block means, the index, attention over the kept blocks) over the step's prefill rows in place of
 * dense attention; sliding-window, Gated DeltaNet, FFN and MoE layers, decode rows and every token
 * are as in dense mode.
 * COMPACT: CompactAttention (SPEC section 9): in a session step, every full-attention layer runs the
 * prefill chunks through upf_compact_attend (the block-sparse selector over the chunk with `sparse`,
 * last_n forced to 0, the block union with `compact`, zero-copy attn.paged over the kept blocks) in
 * place of the dense attn.paged, when a chunk of the step has cached context; whole prompts, decode
 * rows and every other layer are as in dense mode. A first chunk batched with ones that have context
 * keeps all its blocks (they are all the chunk's own: forced), so it attends densely. */
typedef enum {
  UPF_PREFILL_DENSE = 0,
  UPF_PREFILL_UNIPREFILL,
  UPF_PREFILL_FLASHPREFILL,
  UPF_PREFILL_COMPACT,
} upf_prefill_mode;

/* "dense", "uniprefill", "flashprefill", "compact". */
const char *upf_prefill_mode_name(upf_prefill_mode mode);

/* FlashPrefill V2's parameters in a model: the published defaults (upf_sparse_params_default) except
 * alpha 0.18 at block_n 128, the values calibrated for Llama-3.1-8B (FlashPrefill's paper); scale 0
 * stands for the model's own attention scale. */
upf_sparse_params upf_prefill_sparse_default(void);

typedef struct {
  upf_prefill_mode mode;
  upf_select_params select;    /* the selection at every drop layer (defaults: cfg->select) */
  /* Replay: per drop layer, a host token mask (one entry per token entering the layer, compacted
   * order), used instead of selecting; NULL entries select. Indexed like cfg->drop_layers. */
  const uint8_t *const *replay_masks;
  const int64_t *replay_mask_len;
  /* Called after each layer (progress, timing); may be NULL. */
  void (*on_layer)(void *user, int32_t layer, double seconds, int64_t tokens);
  void *user;
  /* Per-position outputs (op logits.rows; the (T, V) logits are never held). Only the positions that
   * reach the LM head have outputs: every position in dense mode, the kept ones in UniPrefill mode
   * (res->position_origin says which). per_position: the argmax at each such position; targets (T)
   * host, or NULL: the token whose NLL is wanted at each input position (-1: none); tail_logits N:
   * the whole logits of the last N such positions of each request (every request must keep N). */
  int32_t per_position;
  const int32_t *targets;
  int32_t tail_logits;
  /* FLASHPREFILL: the parameters (upf_prefill_sparse_default); scale 0 takes the model's attention
   * scale (cfg->attn), a nonzero scale is used as given; COMPACT: the selector's (last_n taken as 0) */
  upf_sparse_params sparse;
  /* FLASHPREFILL: also count how much neighbouring query tiles' lists share (upf_sparse_record's
   * neighbour_*): a host copy of each full-attention layer's index, after its index and attention times
   * (the whole prefill's time includes it) */
  int32_t sparse_sharing;
  /* COMPACT: the union's forced recent blocks (upf_compact_params_default) and, when set, a hook given
   * each full-attention layer's union table of the step's chunks: table |u1 (num_chunks, kv_heads,
   * key_blocks) host (1: kept; columns past a chunk's own blocks 0), valid during the call */
  upf_compact_params compact;
  void (*on_compact_table)(void *user, int32_t layer, const uint8_t *table, int32_t num_chunks, int32_t kv_heads,
                           int32_t key_blocks);
  void *compact_user;
} upf_prefill_options;

/* What one drop layer did. */
typedef struct {
  int32_t layer;
  int64_t tokens_in, tokens_kept;
  int32_t *kept_per_req;  /* (B) host */
  uint8_t *mask;          /* (tokens_in) host token mask, compacted order of the layer's input */
  double select_seconds;  /* selection + compaction (+ the host copies the step needs) */
  /* Tensor parallelism (comm set): the selection over all-reduced block scores */
  double allreduce_bytes;   /* block scores all-reduced (fp32), bytes per rank */
  double allreduce_seconds; /* of which the all-reduce of the block scores */
  double tp_select_seconds; /* the whole TP selection: stages, all-reduce, mask broadcast and check */
  int32_t disagreeing_ranks; /* ranks whose own top-p mask differed from rank 0's (then replaced by it) */
  upf_select_tp_stats tp;    /* the TP selection's steps (their times split the selection) */
} upf_drop_record;

/* What one full-attention layer did in FlashPrefill mode (the step's prefill rows), or in COMPACT mode
 * (the step's chunks with cached context: kept = blocks of the union tables, visible = Hkv
 * ceil(kv_len / block_n) per such chunk; index_seconds 0, attn_seconds the whole upf_compact_attend). */
typedef struct {
  int32_t layer;
  int64_t kept_blocks;    /* index kept_total: kept key blocks summed over (KV head, query tile) */
  int64_t visible_blocks; /* upf_sparse_visible_blocks: the same count with every visible block kept */
  double index_seconds;   /* sparse.block_means + sparse.index */
  double attn_seconds;    /* attn.block_sparse */
  /* FLASHPREFILL with upf_prefill_options.sparse_sharing (0 otherwise): upf_sparse_neighbour_blocks of the
   * layer's index, the kept blocks of tiles with a predecessor and those the predecessor also keeps */
  int64_t neighbour_total, neighbour_shared;
} upf_sparse_record;

typedef struct {
  int32_t num_reqs;
  int32_t vocab;
  float *logits;             /* (B, V) host, f32: last-position logits of each request */
  int32_t num_drops;
  upf_drop_record drops[UPF_MODEL_MAX_LAYERS];
  double layer_seconds[UPF_MODEL_MAX_LAYERS]; /* per layer of [begin, end), indexed by layer */
  double mixer_seconds[UPF_MODEL_MAX_LAYERS]; /* of which the pre-norm and the attention / GDN block */
  double ffn_seconds[UPF_MODEL_MAX_LAYERS];   /* of which the FFN / MoE block (after any drop) */
  int64_t layer_tokens[UPF_MODEL_MAX_LAYERS]; /* tokens each layer processed */
  double total_seconds;       /* embedding to logits, on the host clock after the device finished */
  /* Tensor parallelism: every all-reduce of the prefill (row-parallel outputs and the selection's block
   * scores): calls, bytes per rank, host time */
  int64_t comm_calls;
  double comm_bytes, comm_seconds;
  /* Per-position outputs (see upf_prefill_options; all NULL / 0 when not asked for) */
  int64_t num_positions;      /* P: positions with outputs (T dense; the kept count in UniPrefill) */
  int32_t *position_origin;   /* (P) host: index of each in the packed input ids */
  int32_t *argmax;            /* (P) host: argmax token, the lowest id on ties (per_position) */
  double *nll;                /* (P) host: -log softmax(logits)[target] in double; NaN for target -1 (targets) */
  int32_t tail_n;             /* N */
  float *tail_logits;         /* (B, N, V) host: logits of the last N positions of each request */
  /* FLASHPREFILL: one record per full-attention layer of the range that ran sparse, in layer order
   * (none in a step without prefill rows); COMPACT: one per full-attention layer in a step with a chunk
   * with cached context; the kept share of a layer is kept_blocks / visible_blocks */
  int32_t num_sparse;
  upf_sparse_record sparse[UPF_MODEL_MAX_LAYERS];
} upf_prefill_result;

/* Kept key blocks over visible ones, summed over the result's sparse records (1 when there are none). */
double upf_prefill_kept_share(const upf_prefill_result *res);

/* Device memory a prefill of `total_tokens` (the step's packed tokens) over `num_reqs` requests needs
 * besides the weights: activation buffers (reused across layers), the selection's outputs, and the
 * K/V the step's attention layers produce (not retained by prefill; what a paged cache would hold,
 * dense). Bytes. sparse: FlashPrefill's block means (kbar, and vbar with mean correction) and index
 * (row_ptr, blocks), reused by every full-attention layer (0 unless upf_model_memory_plan_batch). */
typedef struct {
  double weights, activations, selection, kv_dense;
  double sparse;
} upf_memory_plan;
upf_memory_plan upf_model_memory_plan(const upf_model *m, int64_t total_tokens, int32_t num_reqs);
/* The same for the batch cu_seqlens (B+1) host under opt: in FLASHPREFILL mode with the sparse
 * scratch the plan of the batch (upf_sparse_plan_make) sizes; fails on parameters it refuses. */
upf_status upf_model_memory_plan_batch(const upf_model *m, const int32_t *cu_seqlens, int32_t num_reqs,
                                       const upf_prefill_options *opt, upf_memory_plan *plan);

/* Runs the prefill of a packed batch: ids (T) host token ids, cu_seqlens (B+1) host. With a layer
 * range that does not start at 0 the embedding still feeds the first held layer; with one that does
 * not end at num_layers the final norm and head still produce logits (so a range is timed whole).
 * Fills res (free with upf_prefill_result_free). */
upf_status upf_model_prefill(const upf_model *m, const int32_t *ids, const int32_t *cu_seqlens, int32_t num_reqs,
                             const upf_prefill_options *opt, upf_prefill_result *res);
void upf_prefill_result_free(upf_prefill_result *res);
/* 1 when two runs of the same batch gave bitwise-identical last-position logits and drop decisions
 * (the drop layers, kept counts and token masks); else 0 with the first difference written to `where`
 * (cap bytes): "logits of request 1 at id 17: 0.25 vs 0.2500001", "drop 0 (layer 7): mask entry 912". */
int upf_prefill_result_identical(const upf_prefill_result *a, const upf_prefill_result *b, char *where, size_t cap);

#ifdef __cplusplus
}
#endif
#endif

/* The end-to-end model check and the seeded runs it and the tests share. */
#ifndef UNIPREFILL_VERIFY_MODEL_H
#define UNIPREFILL_VERIFY_MODEL_H

#include "uniprefill/model.h"
#include "verify/verify.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Builds the seeded model of cfg on be (all layers), prefills requests of the given lengths with seeded
 * ids, frees the model. res as upf_model_prefill fills it. */
upf_status upf_model_run_seeded(const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype, uint64_t seed,
                                const int32_t *lengths, int32_t num_reqs, const upf_prefill_options *opt,
                                upf_prefill_result *res);
/* The same over given ids (T) and cu_seqlens (B+1), host. */
upf_status upf_model_run_ids(const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype, uint64_t seed,
                             const int32_t *ids, const int32_t *cu, int32_t num_reqs, const upf_prefill_options *opt,
                             upf_prefill_result *res);
/* max |a[i] - truth[i]| over n values; NaN once any difference is NaN (a larger one never hides it). */
double upf_verify_max_abs_diff(const float *a, const double *truth, int64_t n);
/* Whether the model checks take cfg: a tiny config whose name holds --case TEXT where one is given (e.g.
 * `--case qwen3-next`: one family, so that a slow tool can run the families side by side). */
int upf_verify_model_wanted(const upf_verify_ctx *ctx, const upf_model_config *cfg);
/* `upf verify model`: every tiny config, f32 and bf16, dense and UniPrefill, backend against CPU. */
void upf_verify_model(upf_verify_ctx *ctx);
/* `upf verify model.generate` (verify/verify_generate.c): greedy generation through a session, every
 * tiny config, f32 and bf16, dense and UniPrefill (the CPU's masks replayed), backend against CPU. */
void upf_verify_generate(upf_verify_ctx *ctx);
/* Its two checks (dense, UniPrefill) of one config in one dtype. */
void upf_verify_generate_config(upf_verify_ctx *ctx, const upf_model_config *cfg, upf_dtype dt);

#ifdef __cplusplus
}
#endif
#endif

/* PLACEHOLDER (being written) */
#include "verify/verify.h"
void upf_verify_sparse_block_means(upf_verify_ctx *ctx) { (void)ctx; }
void upf_verify_sparse_index(upf_verify_ctx *ctx) { (void)ctx; }
void upf_verify_attn_block_sparse(upf_verify_ctx *ctx) { (void)ctx; }

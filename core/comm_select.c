/* Selection under tensor parallelism (SPEC.md section 5): the stage ops of the backend over this rank's
 * heads, an fp32 all-reduce of the partial block scores, top-p on the reduced scores, rank 0's block
 * mask broadcast to every rank (so all ranks compact the same tokens) and the count of ranks whose own
 * decision differed, then mask expansion. The stage-1 scores take Hq/R * L * n floats per scored
 * request (the staged ops, unlike the fused select_run, hold them whole). */
#include <stdlib.h>
#include <string.h>

#include "core/comm_impl.h"

typedef struct {
  const upf_backend *be;
  void *ptr[6];
  int count;
} tp_allocs;

static upf_status tp_alloc(tp_allocs *a, void **p, size_t bytes) {
  UPF_TRY(a->be->alloc(p, bytes ? bytes : 1));
  a->ptr[a->count++] = *p;
  return UPF_OK;
}

static void tp_release(tp_allocs *a) {
  for (int i = 0; i < a->count; i++)
    a->be->release(a->ptr[i]);
}

/* Steps after validation; every rank reaches every collective unless a local op fails first, in
 * which case the others time out (UPF_ERR_COMM) rather than hang. */
static upf_status tp_steps(upf_comm *comm, const upf_backend *be, const upf_select_inputs *in,
                           const upf_select_params *params, upf_select_outputs *out, const upf_select_tp_hooks *hooks,
                           upf_select_tp_stats *stats, tp_allocs *mem, uint8_t *host_mask) {
  const int32_t B = in->num_reqs;
  const int64_t T = in->cu_seqlens_host[B];
  int64_t *off = malloc((size_t)(B + 1) * sizeof *off);
  if (!off)
    return upf_fail(UPF_ERR_NOMEM, "select tp: offsets");
  upf_select_score_offsets(in->cu_seqlens_host, B, (int32_t)in->q.shape[1], params, off);
  const int64_t score_elems = off[B];
  upf_select_block_offsets(in->cu_seqlens_host, B, params->block, off);
  const int64_t nb = off[B];
  free(off);

  float *scores, *mass, *flag;
  UPF_TRY(tp_alloc(mem, (void **)&scores, (size_t)score_elems * sizeof(float)));
  UPF_TRY(tp_alloc(mem, (void **)&mass, (size_t)T * sizeof(float)));
  UPF_TRY(tp_alloc(mem, (void **)&flag, sizeof(float)));
  if (!out->block_score)
    UPF_TRY(tp_alloc(mem, (void **)&out->block_score, (size_t)nb * sizeof(float)));
  if (!out->block_mask)
    UPF_TRY(tp_alloc(mem, (void **)&out->block_mask, (size_t)nb));

  UPF_TRY(be->select_part_gemm(in, params, scores));
  UPF_TRY(be->select_block_softmax(in, params, scores, mass));
  UPF_TRY(be->select_block_reduce(in, params, mass, out->block_score));

  const double a0 = upf_comm_now();
  UPF_TRY(upf_comm_allreduce_sum(comm, out->block_score, nb, UPF_DTYPE_F32));
  stats->allreduce_seconds = upf_comm_now() - a0;
  stats->allreduce_bytes = (double)nb * sizeof(float);

  if (hooks && hooks->reduced_bias) {
    float *b = malloc((size_t)(nb ? nb : 1) * sizeof *b);
    upf_status st = b ? be->download(b, out->block_score, (size_t)nb * sizeof *b)
                      : upf_fail(UPF_ERR_NOMEM, "select tp: bias");
    for (int64_t c = 0; st == UPF_OK && c < nb; c++)
      b[c] += hooks->reduced_bias[c];
    if (st == UPF_OK)
      st = be->upload(out->block_score, b, (size_t)nb * sizeof *b);
    free(b);
    UPF_TRY(st);
  }
  UPF_TRY(be->select_topp(in, params, out->block_score, out->block_mask));

  const double c0 = upf_comm_now();
  stats->disagreeing_ranks = 0;
  if (upf_comm_size(comm) > 1) {
    uint8_t *mine = host_mask, *root = host_mask + nb;
    UPF_TRY(be->download(mine, out->block_mask, (size_t)nb));
    UPF_TRY(upf_comm_broadcast(comm, out->block_mask, nb, 0));
    UPF_TRY(be->download(root, out->block_mask, (size_t)nb));
    const float differs = memcmp(mine, root, (size_t)nb) ? 1.0f : 0.0f;
    UPF_TRY(be->upload(flag, &differs, sizeof differs));
    UPF_TRY(upf_comm_allreduce_sum(comm, flag, 1, UPF_DTYPE_F32));
    float count = 0.0f;
    UPF_TRY(be->download(&count, flag, sizeof count));
    stats->disagreeing_ranks = (int32_t)(count + 0.5f);
  }
  stats->check_seconds = upf_comm_now() - c0;
  return be->select_expand(in, params, out->block_mask, out);
}

upf_status upf_select_tp_run(upf_comm *comm, const upf_backend *be, const upf_select_inputs *in,
                             const upf_select_params *params, upf_select_outputs *out, const upf_select_tp_hooks *hooks,
                             upf_select_tp_stats *stats) {
  const double t0 = upf_comm_now();
  memset(stats, 0, sizeof *stats);
  if (!comm || upf_comm_backend(comm) != be)
    return upf_fail(UPF_ERR_INVALID_ARG, "select tp: the communicator is missing or works on another backend");
  UPF_TRY(upf_select_validate(in, params));
  const int32_t B = in->num_reqs;
  int64_t *off = malloc((size_t)(B + 1) * sizeof *off);
  if (!off)
    return upf_fail(UPF_ERR_NOMEM, "select tp: offsets");
  upf_select_block_offsets(in->cu_seqlens_host, B, params->block, off);
  const int64_t nb = off[B];
  free(off);
  uint8_t *host_mask = malloc((size_t)(2 * nb + 1));
  if (!host_mask)
    return upf_fail(UPF_ERR_NOMEM, "select tp: host masks");
  /* out's optional arrays are filled through scratch when NULL, and put back afterwards */
  float *const user_score = out->block_score;
  uint8_t *const user_mask = out->block_mask;
  tp_allocs mem = {be, {0}, 0};
  const upf_status st = tp_steps(comm, be, in, params, out, hooks, stats, &mem, host_mask);
  out->block_score = user_score, out->block_mask = user_mask;
  tp_release(&mem);
  free(host_mask);
  stats->seconds = upf_comm_now() - t0;
  return st;
}

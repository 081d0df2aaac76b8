/* Selection under tensor parallelism (SPEC.md section 5): the fused block scores of the backend over
 * this rank's heads, an fp32 all-reduce of the partial block scores, top-p on the reduced scores, rank
 * 0's block mask taken by every rank (so all ranks compact the same tokens) with the count of ranks
 * whose own decision differed, then mask expansion. Nothing is allocated per call once the
 * communicator's scratch has grown to the batch's blocks. */
#include <stdlib.h>
#include <string.h>

#include "core/comm_impl.h"

/* Steps after validation; every rank reaches every collective unless a local op fails first, in
 * which case the others time out (UPF_ERR_COMM) rather than hang. Each step ends with its result
 * known to the host (the backend's ops and the collectives wait), so the times add up. */
static upf_status tp_steps(upf_comm *comm, const upf_backend *be, const upf_select_inputs *in,
                           const upf_select_params *params, upf_select_outputs *out, const upf_select_tp_hooks *hooks,
                           int64_t nb, float *block_score, uint8_t *block_mask, upf_select_tp_stats *stats) {
  double t = upf_comm_now(), now;
  UPF_TRY(be->select_block_scores(in, params, block_score));
  now = upf_comm_now(), stats->scores_seconds = now - t, t = now;

  UPF_TRY(upf_comm_allreduce_sum(comm, block_score, nb, UPF_DTYPE_F32));
  now = upf_comm_now(), stats->allreduce_seconds = now - t, t = now;
  stats->allreduce_bytes = (double)nb * sizeof(float);

  if (hooks && hooks->reduced_bias) {
    float *b = malloc((size_t)(nb ? nb : 1) * sizeof *b);
    upf_status st = b ? be->download(b, block_score, (size_t)nb * sizeof *b)
                      : upf_fail(UPF_ERR_NOMEM, "select tp: bias");
    for (int64_t c = 0; st == UPF_OK && c < nb; c++)
      b[c] += hooks->reduced_bias[c];
    if (st == UPF_OK)
      st = be->upload(block_score, b, (size_t)nb * sizeof *b);
    free(b);
    UPF_TRY(st);
    t = upf_comm_now();
  }
  UPF_TRY(be->select_topp(in, params, block_score, block_mask));
  now = upf_comm_now(), stats->topp_seconds = now - t, t = now;

  /* run with one rank too, so a one-rank run pays (and measures) what R ranks pay */
  UPF_TRY(upf_comm_broadcast_check(comm, block_mask, nb, 0, &stats->disagreeing_ranks));
  now = upf_comm_now(), stats->check_seconds = now - t, t = now;

  UPF_TRY(be->select_expand(in, params, block_mask, out));
  stats->expand_seconds = upf_comm_now() - t;
  return UPF_OK;
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
  /* out's optional arrays, when NULL, in the communicator's scratch: [block_score (nb) | block_mask (nb)] */
  float *block_score = out->block_score;
  uint8_t *block_mask = out->block_mask;
  if (!block_score || !block_mask) {
    const size_t score_bytes = ((size_t)nb * sizeof(float) + 255) & ~(size_t)255;
    void *scratch;
    UPF_TRY(upf_comm_scratch(comm, score_bytes + (size_t)nb + 1, &scratch));
    if (!block_score)
      block_score = scratch;
    if (!block_mask)
      block_mask = (uint8_t *)scratch + score_bytes;
  }
  const upf_status st = tp_steps(comm, be, in, params, out, hooks, nb, block_score, block_mask, stats);
  stats->seconds = upf_comm_now() - t0;
  return st;
}

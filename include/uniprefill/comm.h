/* The communicator of tensor parallelism (SPEC.md section 5): rank, size, all-reduce SUM, broadcast
 * and barrier over the ranks of one tensor-parallel group, with three backends: a single rank
 * (identity), MPI (CPU ranks; OpenMPI) and NCCL (GPU ranks, one GPU per rank, bootstrapped through
 * MPI or through a unique-id file). Buffers live in the memory of the backend the communicator was
 * created for (host for cpu, device for cuda). Every collective checks that all ranks called the same
 * collective with the same size, and waits at most the communicator's timeout: a mismatch or a
 * missing rank is a status (UPF_ERR_COMM) on every rank that can see it, never a hang. */
#ifndef UNIPREFILL_COMM_H
#define UNIPREFILL_COMM_H

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/select.h"
#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { UPF_COMM_SINGLE = 0, UPF_COMM_MPI, UPF_COMM_NCCL, UPF_COMM_KIND_COUNT } upf_comm_kind;

typedef struct upf_comm upf_comm;

typedef struct {
  /* Seconds a collective waits for the other ranks before failing (0: UPF_COMM_TIMEOUT_S from the
   * environment, else 120). */
  double timeout_s;
  /* NCCL without MPI: the unique-id file rank 0 writes (atomically) and the others read (NULL:
   * UPF_NCCL_ID_FILE); rank and size from here, or from UPF_RANK / UPF_WORLD_SIZE (then
   * OMPI_COMM_WORLD_RANK / _SIZE) when size is 0. With neither a file nor mpirun, NCCL runs one rank;
   * under mpirun without a file, rank 0's id goes out through MPI. */
  const char *nccl_id_file;
  int32_t rank, size;
} upf_comm_options;

/* Counters of a communicator since its creation (or the last reset). */
typedef struct {
  int64_t calls;          /* all-reduces */
  double bytes;           /* bytes all-reduced (each rank's buffer, counted once per call) */
  double seconds;         /* host time inside all-reduce calls, the wait for the other ranks included */
  int64_t bcast_calls;
  double bcast_bytes, bcast_seconds;
} upf_comm_stats;

/* "single", "mpi", "nccl"; "auto" picks mpi when the process was started by mpirun (OMPI_COMM_WORLD_SIZE
 * or PMI_SIZE set) and the build has MPI, nccl instead of mpi when be is cuda and the build has NCCL,
 * else single. UPF_ERR_UNSUPPORTED naming what the build lacks ("built without MPI: ..."). */
upf_status upf_comm_create(const char *kind, const upf_backend *be, const upf_comm_options *opt, upf_comm **out);
/* Frees the communicator; the last MPI communicator finalises MPI when this library initialised it. */
void upf_comm_destroy(upf_comm *comm);

int32_t upf_comm_rank(const upf_comm *comm);
int32_t upf_comm_size(const upf_comm *comm);
upf_comm_kind upf_comm_kind_of(const upf_comm *comm);
const char *upf_comm_kind_name(upf_comm_kind kind);
const upf_backend *upf_comm_backend(const upf_comm *comm);
/* Whether this build has each backend: 1 or 0, and a one-line reason when 0. */
int upf_comm_available(upf_comm_kind kind, const char **why_not);

/* buf (count) in place = the sum over ranks of every rank's buf, f32 or bf16 (bf16 is summed in fp32 and
 * rounded once). Every rank gets the same bits. UPF_ERR_COMM when the ranks disagree on count or dtype,
 * or one does not arrive within the timeout. */
upf_status upf_comm_allreduce_sum(upf_comm *comm, void *buf, int64_t count, upf_dtype dtype);
/* buf (bytes) on every rank = root's buf. */
upf_status upf_comm_broadcast(upf_comm *comm, void *buf, int64_t bytes, int32_t root);
/* The same, and *differing (may be NULL) = the number of ranks whose buf differed from root's before the
 * call, the same on every rank: one collective (every rank's bytes gathered), for decisions that must
 * be identical on every rank and whose disagreement is worth counting. */
upf_status upf_comm_broadcast_check(upf_comm *comm, void *buf, int64_t bytes, int32_t root, int32_t *differing);
upf_status upf_comm_barrier(upf_comm *comm);

upf_comm_stats upf_comm_get_stats(const upf_comm *comm);
void upf_comm_reset_stats(upf_comm *comm);

/* The head split of one rank: heads [q0, q0 + nq) of Hq query heads and [kv0, kv0 + nkv) of Hkv
 * key/value heads. Hq must divide by R; Hkv must divide by R, or R by Hkv, in which case each rank
 * holds the one kv head its query heads use (replicated over R / Hkv ranks). */
typedef struct {
  int32_t q0, nq, kv0, nkv;
} upf_head_split;
upf_status upf_head_split_of(int32_t q_heads, int32_t kv_heads, int32_t rank, int32_t size, upf_head_split *out);

/* ---- Selection under tensor parallelism (core/comm_select.c) ----
 * Each rank runs stages 1-3 of the selection (the backend's select_block_scores) over its own heads
 * (in->q (T, Hq/R, D), in->k (T, its kv heads, D)), all-reduces the partial block scores in fp32, runs
 * top-p on the reduced scores, then takes rank 0's block mask (upf_comm_broadcast_check, which counts
 * the ranks whose own decision differed) so every rank compacts the same tokens, and expands it. out as
 * for select_run (block_score receives the reduced scores, block_mask the final mask); when they are
 * NULL, a grow-only buffer of the communicator holds them, so a call allocates nothing once warm. */
typedef struct {
  double allreduce_bytes;   /* block scores all-reduced, per rank */
  /* host time of each step (each ends with the host knowing its result, so the split adds up) */
  double scores_seconds;    /* select_block_scores over this rank's heads */
  double allreduce_seconds; /* the all-reduce of the block scores */
  double topp_seconds;      /* select_topp on the reduced scores */
  double check_seconds;     /* the mask broadcast and the disagreement count */
  double expand_seconds;    /* select_expand */
  double seconds;           /* the whole call */
  int32_t disagreeing_ranks; /* ranks whose own top-p mask differed from rank 0's (the same on every rank) */
} upf_select_tp_stats;

/* Test hook: host (num_blocks) values added to this rank's reduced block scores before its top-p, to
 * force ranks to disagree; NULL in every real run. */
typedef struct {
  const float *reduced_bias;
} upf_select_tp_hooks;

upf_status upf_select_tp_run(upf_comm *comm, const upf_backend *be, const upf_select_inputs *in,
                             const upf_select_params *params, upf_select_outputs *out, const upf_select_tp_hooks *hooks,
                             upf_select_tp_stats *stats);

#ifdef __cplusplus
}
#endif
#endif

/* The communicator's insides, shared by the backends (core/comm.c single rank and the common checks,
 * core/comm_mpi.c, cuda/comm_nccl.cu): a table of the three collectives over one opaque state. */
#ifndef UNIPREFILL_CORE_COMM_IMPL_H
#define UNIPREFILL_CORE_COMM_IMPL_H

#include "uniprefill/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  /* The collective on validated arguments (the common layer checked pointers and sizes locally). */
  upf_status (*allreduce)(upf_comm *c, void *buf, int64_t count, upf_dtype dtype);
  upf_status (*broadcast)(upf_comm *c, void *buf, int64_t bytes, int32_t root);
  upf_status (*broadcast_check)(upf_comm *c, void *buf, int64_t bytes, int32_t root, int32_t *differing);
  upf_status (*barrier)(upf_comm *c);
  void (*destroy)(upf_comm *c);
} upf_comm_ops;

struct upf_comm {
  upf_comm_kind kind;
  const upf_backend *be;
  int32_t rank, size;
  double timeout_s;
  int64_t seq;          /* collectives called so far: every rank must be at the same one */
  int broken;           /* a collective failed part-way: later ones refuse, destroy skips finalising */
  upf_comm_stats stats;
  const upf_comm_ops *ops;
  void *impl;
  upf_comm *boot;       /* NCCL bootstrapped through MPI: the MPI communicator it used */
  void *scratch;        /* (scratch_bytes) grow-only, in be's memory: upf_comm_scratch */
  size_t scratch_bytes;
};

/* Header every rank exchanges before a collective: the same values on every rank or UPF_ERR_COMM. */
enum { UPF_COMM_OP_ALLREDUCE = 1, UPF_COMM_OP_BROADCAST, UPF_COMM_OP_BARRIER, UPF_COMM_OP_BROADCAST_CHECK };

/* *ptr = at least `bytes` of the communicator's scratch in its backend's memory (grown, never shrunk;
 * freed with the communicator): buffers a caller needs on every call, allocated once. */
upf_status upf_comm_scratch(upf_comm *c, size_t bytes, void **ptr);

/* Seconds since an arbitrary origin (monotonic). */
double upf_comm_now(void);

/* MPI (core/comm.c opens the plugin built from core/comm_mpi.c): initialises MPI if needed and fills
 * rank, size, ops, impl of c. */
upf_status upf_comm_mpi_init(upf_comm *c);
int upf_comm_mpi_available(const char **why_not);
/* The plugin's entry point. */
upf_status upf_comm_mpi_plugin_init(upf_comm *c);

/* NCCL (cuda/comm_nccl.cu). */
#define UPF_NCCL_ID_BYTES 128
int upf_comm_nccl_available(const char **why_not);
/* Binds this process to GPU local_rank % device count and writes a fresh unique id (rank 0 only). */
upf_status upf_comm_nccl_unique_id(int32_t local_rank, unsigned char id[UPF_NCCL_ID_BYTES]);
/* ncclCommInitRank with NVLink multicast off (NCCL_NVLS_ENABLE=0 unless set), on GPU local_rank %
 * device count; fills c->ops and c->impl. c->rank, c->size, c->timeout_s set by the caller. */
upf_status upf_comm_nccl_init(upf_comm *c, int32_t local_rank, const unsigned char id[UPF_NCCL_ID_BYTES]);

#ifdef __cplusplus
}
#endif
#endif

/* The MPI backend of the communicator (CPU ranks, OpenMPI): MPI_COMM_WORLD duplicated. Every
 * collective first all-reduces a header (operation, size, dtype, sequence number; max and min at once)
 * so ranks that called different collectives, or the same one with different sizes, fail with
 * UPF_ERR_COMM on every rank instead of corrupting memory or hanging; every wait polls a non-blocking
 * request with the communicator's timeout. The all-reduce gathers every rank's buffer and sums in rank
 * order, in double, so every rank gets the same bits whatever MPI's reduction order. Buffers in a
 * non-host backend's memory are staged through host memory. Built only when mpi.h is found, as the
 * plugin libupf_mpi.so (linked with libmpi) that core/comm.c opens on the first MPI communicator, so
 * no binary needs libmpi to start; the plugin resolves the library's symbols in the executable. */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/comm_impl.h"
#include "uniprefill/bf16.h"

typedef struct {
  MPI_Comm comm;
  void *host;        /* staging and gather buffer */
  size_t host_bytes;
} mpi_state;

static int we_initialised, live_comms;

static upf_status mpi_fail(upf_comm *c, int err, const char *what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(err, msg, &len);
  c->broken = 1;
  return upf_fail(UPF_ERR_COMM, "comm mpi (rank %d of %d): %s failed: %s", c->rank, c->size, what, msg);
}

/* Waits for req with the communicator's timeout, yielding the CPU between polls (ranks oversubscribe
 * cores in tests). A timed-out request is left pending: the communicator is broken and the process is
 * expected to exit (mpirun then ends the job). */
static upf_status wait_request(upf_comm *c, MPI_Request *req, const char *what) {
  const double t0 = upf_comm_now();
  for (long polls = 0;; polls++) {
    int done = 0;
    const int err = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (err != MPI_SUCCESS)
      return mpi_fail(c, err, what);
    if (done)
      return UPF_OK;
    if (upf_comm_now() - t0 > c->timeout_s) {
      c->broken = 1;
      return upf_fail(UPF_ERR_COMM, "comm mpi (rank %d of %d): %s: the other ranks did not arrive within %.0f s",
                      c->rank, c->size, what, c->timeout_s);
    }
    if (polls > 200) {
      const struct timespec ts = {0, 20 * 1000};
      nanosleep(&ts, NULL);
    }
  }
}

/* Every rank's (op, a, b, seq) must be equal: max and min of each in one all-reduce (min as -max). */
static upf_status check_header(upf_comm *c, int op, int64_t a, int64_t b, const char *what) {
  mpi_state *s = c->impl;
  const int64_t mine[4] = {op, a, b, c->seq};
  int64_t send[8], recv[8];
  for (int i = 0; i < 4; i++)
    send[i] = mine[i], send[4 + i] = -mine[i];
  MPI_Request req;
  const int err = MPI_Iallreduce(send, recv, 8, MPI_INT64_T, MPI_MAX, s->comm, &req);
  if (err != MPI_SUCCESS)
    return mpi_fail(c, err, what);
  UPF_TRY(wait_request(c, &req, what));
  static const char *const names[] = {"", "all-reduce", "broadcast", "barrier", "broadcast"};
  for (int i = 0; i < 4; i++) {
    if (recv[i] == -recv[4 + i])
      continue;
    c->broken = 1;
    if (i == 0)
      return upf_fail(UPF_ERR_COMM, "comm mpi (rank %d of %d): %s: the ranks called different collectives", c->rank,
                      c->size, what);
    if (i == 3)
      return upf_fail(UPF_ERR_COMM, "comm mpi (rank %d of %d): %s: the ranks are at different collectives (#%lld here)",
                      c->rank, c->size, what, (long long)c->seq);
    return upf_fail(UPF_ERR_COMM,
                    "comm mpi (rank %d of %d): %s: the ranks disagree on the %s (%lld here, from %lld to %lld over the "
                    "ranks)",
                    c->rank, c->size, names[op], op != UPF_COMM_OP_ALLREDUCE ? (i == 1 ? "size" : "root")
                                                                             : (i == 1 ? "element count" : "dtype"),
                    (long long)mine[i], (long long)-recv[4 + i], (long long)recv[i]);
  }
  return UPF_OK;
}

static upf_status host_buffer(upf_comm *c, size_t bytes) {
  mpi_state *s = c->impl;
  if (bytes <= s->host_bytes)
    return UPF_OK;
  void *p = realloc(s->host, bytes);
  if (!p)
    return upf_fail(UPF_ERR_NOMEM, "comm mpi: %zu bytes of host buffer", bytes);
  s->host = p, s->host_bytes = bytes;
  return UPF_OK;
}

static int on_host(const upf_comm *c) { return c->be == upf_backend_cpu(); }

static upf_status mpi_allreduce(upf_comm *c, void *buf, int64_t count, upf_dtype dtype) {
  mpi_state *s = c->impl;
  UPF_TRY(check_header(c, UPF_COMM_OP_ALLREDUCE, count, dtype, "all-reduce"));
  if (count == 0 || c->size == 1)
    return UPF_OK;
  const size_t esize = upf_dtype_size(dtype), bytes = (size_t)count * esize;
  if (bytes > (size_t)2147483647)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm mpi all-reduce: %zu bytes exceed one MPI message", bytes);
  /* host: [mine (bytes, only when staged) | gathered (size * bytes)] */
  UPF_TRY(host_buffer(c, bytes * (size_t)(c->size + 1)));
  char *mine = buf, *all = (char *)s->host + bytes;
  if (!on_host(c)) {
    mine = s->host;
    UPF_TRY(c->be->download(mine, buf, bytes));
  }
  MPI_Request req;
  const int err = MPI_Iallgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, s->comm, &req);
  if (err != MPI_SUCCESS)
    return mpi_fail(c, err, "all-reduce");
  UPF_TRY(wait_request(c, &req, "all-reduce"));
  char *dst = on_host(c) ? buf : mine;
  for (int64_t i = 0; i < count; i++) {
    double sum = 0.0;
    for (int32_t r = 0; r < c->size; r++) {
      const char *src = all + (size_t)r * bytes;
      sum += dtype == UPF_DTYPE_F32 ? (double)((const float *)src)[i] : (double)upf_bf16_to_f32(((const uint16_t *)src)[i]);
    }
    if (dtype == UPF_DTYPE_F32)
      ((float *)dst)[i] = (float)sum;
    else /* fp32 sum, rounded once to bf16 */
      ((uint16_t *)dst)[i] = upf_bf16_from_f32((float)sum);
  }
  return on_host(c) ? UPF_OK : c->be->upload(buf, dst, bytes);
}

static upf_status mpi_broadcast(upf_comm *c, void *buf, int64_t bytes, int32_t root) {
  mpi_state *s = c->impl;
  UPF_TRY(check_header(c, UPF_COMM_OP_BROADCAST, bytes, root, "broadcast"));
  if (bytes == 0 || c->size == 1)
    return UPF_OK;
  if (bytes > 2147483647)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm mpi broadcast: %lld bytes exceed one MPI message", (long long)bytes);
  void *p = buf;
  if (!on_host(c)) {
    UPF_TRY(host_buffer(c, (size_t)bytes));
    p = s->host;
    if (c->rank == root)
      UPF_TRY(c->be->download(p, buf, (size_t)bytes));
  }
  MPI_Request req;
  const int err = MPI_Ibcast(p, (int)bytes, MPI_BYTE, root, s->comm, &req);
  if (err != MPI_SUCCESS)
    return mpi_fail(c, err, "broadcast");
  UPF_TRY(wait_request(c, &req, "broadcast"));
  return on_host(c) || c->rank == root ? UPF_OK : c->be->upload(buf, p, (size_t)bytes);
}

/* Every rank's bytes gathered on every rank (a single rank too: its own bytes come back), the ranks that
 * differ from root's counted, root's copied into buf. */
static upf_status mpi_broadcast_check(upf_comm *c, void *buf, int64_t bytes, int32_t root, int32_t *differing) {
  mpi_state *s = c->impl;
  *differing = 0;
  UPF_TRY(check_header(c, UPF_COMM_OP_BROADCAST_CHECK, bytes, root, "broadcast"));
  if (bytes == 0)
    return UPF_OK;
  if (bytes > 2147483647 / c->size)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm mpi broadcast: %lld bytes from %d ranks exceed one MPI message",
                    (long long)bytes, c->size);
  /* host: [mine (bytes, only when staged) | gathered (size * bytes)] */
  UPF_TRY(host_buffer(c, (size_t)bytes * (size_t)(c->size + 1)));
  char *mine = buf, *all = (char *)s->host + bytes;
  if (!on_host(c)) {
    mine = s->host;
    UPF_TRY(c->be->download(mine, buf, (size_t)bytes));
  }
  MPI_Request req;
  const int err = MPI_Iallgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, s->comm, &req);
  if (err != MPI_SUCCESS)
    return mpi_fail(c, err, "broadcast");
  UPF_TRY(wait_request(c, &req, "broadcast"));
  const char *from = all + (size_t)root * (size_t)bytes;
  for (int32_t r = 0; r < c->size; r++)
    *differing += memcmp(all + (size_t)r * (size_t)bytes, from, (size_t)bytes) != 0;
  if (on_host(c)) {
    memcpy(buf, from, (size_t)bytes);
    return UPF_OK;
  }
  return c->be->upload(buf, from, (size_t)bytes);
}

static upf_status mpi_barrier(upf_comm *c) {
  mpi_state *s = c->impl;
  UPF_TRY(check_header(c, UPF_COMM_OP_BARRIER, 0, 0, "barrier"));
  MPI_Request req;
  const int err = MPI_Ibarrier(s->comm, &req);
  if (err != MPI_SUCCESS)
    return mpi_fail(c, err, "barrier");
  return wait_request(c, &req, "barrier");
}

static void mpi_destroy(upf_comm *c) {
  mpi_state *s = c->impl;
  if (!s)
    return;
  /* a broken communicator may have a request pending: freeing or finalising could block on it */
  if (!c->broken)
    MPI_Comm_free(&s->comm);
  free(s->host);
  free(s);
  c->impl = NULL;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (--live_comms == 0 && we_initialised && !finalized && !c->broken)
    MPI_Finalize();
}

static const upf_comm_ops mpi_ops = {mpi_allreduce, mpi_broadcast, mpi_broadcast_check, mpi_barrier, mpi_destroy};

upf_status upf_comm_mpi_plugin_init(upf_comm *c) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (finalized)
    return upf_fail(UPF_ERR_COMM, "comm mpi: MPI was already finalised in this process");
  if (!inited) {
    int provided;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      return upf_fail(UPF_ERR_COMM, "comm mpi: MPI_Init_thread failed");
    we_initialised = 1;
  }
  mpi_state *s = calloc(1, sizeof *s);
  if (!s)
    return upf_fail(UPF_ERR_NOMEM, "comm mpi: state");
  /* errors come back as codes, so they become statuses instead of aborting the job */
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if (MPI_Comm_dup(MPI_COMM_WORLD, &s->comm) != MPI_SUCCESS) {
    free(s);
    return upf_fail(UPF_ERR_COMM, "comm mpi: MPI_Comm_dup failed");
  }
  MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(s->comm, &rank);
  MPI_Comm_size(s->comm, &size);
  c->rank = rank, c->size = size, c->impl = s, c->ops = &mpi_ops;
  live_comms++;
  return UPF_OK;
}

/* The communicator's common layer: backend choice, argument checks, counters, the single-rank backend
 * (identity), the NCCL bootstrap (through MPI or through a unique-id file) and the head split of a
 * tensor-parallel rank. The collectives themselves are in core/comm_mpi.c and cuda/comm_nccl.cu. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/comm_impl.h"
#include "core/dl.h"

double upf_comm_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *upf_comm_kind_name(upf_comm_kind kind) {
  switch (kind) {
  case UPF_COMM_SINGLE: return "single";
  case UPF_COMM_MPI: return "mpi";
  case UPF_COMM_NCCL: return "nccl";
  default: return "unknown";
  }
}

/* ---- MPI: the plugin libupf_mpi.so (core/comm_mpi.c), opened on first use ---- */

typedef upf_status (*mpi_init_fn)(upf_comm *c);
static char mpi_why[1024];

/* 1 when the plugin is loaded (it is looked for in UPF_MPI_PLUGIN, next to the executable, then where
 * the build put it), else 0 with the reason in mpi_why. */
static int mpi_load(mpi_init_fn *init) {
  static int state = -1;
  static mpi_init_fn fn;
  if (state < 0) {
#ifndef UPF_HAVE_MPI
    snprintf(mpi_why, sizeof mpi_why,
             "built without MPI (mpicc not found at build time: install libopenmpi-dev, ci/install-deps.sh, and rebuild)");
    state = 0;
#else
    char beside[4096] = "";
    const ssize_t n = readlink("/proc/self/exe", beside, sizeof beside - 32);
    if (n > 0) {
      beside[n] = '\0';
      char *slash = strrchr(beside, '/');
      snprintf(slash ? slash + 1 : beside, 32, "libupf_mpi.so");
    }
    const char *env = getenv("UPF_MPI_PLUGIN");
    const char *candidates[] = {env && *env ? env : NULL, beside[0] ? beside : NULL, UPF_MPI_PLUGIN_PATH};
    char errs[768];
    void *h = upf_dl_open_first(candidates, sizeof candidates / sizeof *candidates, RTLD_NOW | RTLD_GLOBAL, errs,
                                sizeof errs);
    fn = h ? (mpi_init_fn)(uintptr_t)dlsym(h, "upf_comm_mpi_plugin_init") : NULL;
    if (!fn)
      snprintf(mpi_why, sizeof mpi_why, "the MPI plugin libupf_mpi.so cannot be loaded (%s; set UPF_MPI_PLUGIN)",
               h ? "no upf_comm_mpi_plugin_init in it" : errs);
    state = fn != NULL;
#endif
  }
  if (init)
    *init = fn;
  return state;
}

int upf_comm_mpi_available(const char **why_not) {
  const int ok = mpi_load(NULL);
  if (why_not)
    *why_not = ok ? "" : mpi_why;
  return ok;
}

upf_status upf_comm_mpi_init(upf_comm *c) {
  mpi_init_fn init;
  if (!mpi_load(&init))
    return upf_fail(UPF_ERR_UNSUPPORTED, "comm mpi: %s", mpi_why);
  return init(c);
}

#ifndef UPF_HAVE_NCCL
int upf_comm_nccl_available(const char **why_not) {
  if (why_not)
#ifdef UPF_HAVE_CUDA
    *why_not = "built without NCCL (nccl.h not found under NCCL_HOME: set NCCL_HOME and rebuild)";
#else
    *why_not = "built without CUDA (CUDA=0), so without NCCL";
#endif
  return 0;
}
upf_status upf_comm_nccl_unique_id(int32_t local_rank, unsigned char id[UPF_NCCL_ID_BYTES]) {
  const char *why;
  upf_comm_nccl_available(&why);
  return upf_fail(UPF_ERR_UNSUPPORTED, "comm nccl: %s", why);
}
upf_status upf_comm_nccl_init(upf_comm *c, int32_t local_rank, const unsigned char id[UPF_NCCL_ID_BYTES]) {
  return upf_comm_nccl_unique_id(local_rank, NULL);
}
#endif

int upf_comm_available(upf_comm_kind kind, const char **why_not) {
  if (why_not)
    *why_not = "";
  if (kind == UPF_COMM_SINGLE)
    return 1;
  if (kind == UPF_COMM_MPI)
    return upf_comm_mpi_available(why_not);
  if (kind == UPF_COMM_NCCL)
    return upf_comm_nccl_available(why_not);
  if (why_not)
    *why_not = "unknown communicator kind";
  return 0;
}

/* ---- single rank: every collective is the identity ---- */

static upf_status single_allreduce(upf_comm *c, void *buf, int64_t count, upf_dtype dtype) { return UPF_OK; }
static upf_status single_broadcast(upf_comm *c, void *buf, int64_t bytes, int32_t root) { return UPF_OK; }
static upf_status single_broadcast_check(upf_comm *c, void *buf, int64_t bytes, int32_t root, int32_t *differing) {
  *differing = 0;
  return UPF_OK;
}
static upf_status single_barrier(upf_comm *c) { return UPF_OK; }
static void single_destroy(upf_comm *c) {}
static const upf_comm_ops single_ops = {single_allreduce, single_broadcast, single_broadcast_check, single_barrier,
                                        single_destroy};

/* ---- environment ---- */

static int env_int(const char *name, int32_t *out) {
  const char *v = getenv(name);
  if (!v || !*v)
    return 0;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || x < 0 || x > 1 << 20)
    return 0;
  *out = (int32_t)x;
  return 1;
}

/* Started by mpirun (OpenMPI) or another PMI launcher. */
static int launched_by_mpirun(void) {
  int32_t x;
  return env_int("OMPI_COMM_WORLD_SIZE", &x) || env_int("PMI_SIZE", &x);
}

static int32_t local_rank_of(int32_t rank) {
  int32_t x;
  if (env_int("OMPI_COMM_WORLD_LOCAL_RANK", &x) || env_int("UPF_LOCAL_RANK", &x))
    return x;
  return rank;
}

/* ---- NCCL bootstrap through a unique-id file ---- */

/* Rank 0 writes the id to PATH.tmp.<pid> and renames it to PATH (readers never see a partial file);
 * the others poll for PATH until the timeout. A stale file from an earlier run is removed by rank 0
 * before it generates the id; a reader that starts before that removal can read the stale id, so a
 * launcher gives each run its own path. */
static upf_status nccl_id_by_file(const char *path, int32_t rank, int32_t local_rank, double timeout_s,
                                  unsigned char id[UPF_NCCL_ID_BYTES]) {
  if (rank == 0) {
    unlink(path);
    UPF_TRY(upf_comm_nccl_unique_id(local_rank, id));
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f)
      return upf_fail(UPF_ERR_IO, "comm nccl: cannot write the unique-id file %s: %s", tmp, strerror(errno));
    const size_t wrote = fwrite(id, 1, UPF_NCCL_ID_BYTES, f);
    if (fclose(f) != 0 || wrote != UPF_NCCL_ID_BYTES || rename(tmp, path) != 0) {
      unlink(tmp);
      return upf_fail(UPF_ERR_IO, "comm nccl: cannot write the unique-id file %s: %s", path, strerror(errno));
    }
    return UPF_OK;
  }
  const double t0 = upf_comm_now();
  for (;;) {
    FILE *f = fopen(path, "rb");
    if (f) {
      const size_t got = fread(id, 1, UPF_NCCL_ID_BYTES, f);
      fclose(f);
      if (got == UPF_NCCL_ID_BYTES)
        return UPF_OK;
      return upf_fail(UPF_ERR_COMM, "comm nccl: unique-id file %s holds %zu bytes, expected %d", path, got,
                      UPF_NCCL_ID_BYTES);
    }
    if (upf_comm_now() - t0 > timeout_s)
      return upf_fail(UPF_ERR_COMM, "comm nccl: rank %d waited %.0f s for the unique-id file %s (rank 0 writes it)",
                      rank, timeout_s, path);
    const struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

static upf_status create_nccl(upf_comm *c, const upf_comm_options *opt) {
  unsigned char id[UPF_NCCL_ID_BYTES];
  memset(id, 0, sizeof id);
  const char *why;
  if (!upf_comm_nccl_available(&why))
    return upf_fail(UPF_ERR_UNSUPPORTED, "comm nccl: %s", why);
  const char *id_file = opt && opt->nccl_id_file && *opt->nccl_id_file ? opt->nccl_id_file : getenv("UPF_NCCL_ID_FILE");
  if (id_file && *id_file) {
    int32_t rank = opt ? opt->rank : 0, size = opt ? opt->size : 0;
    if (size == 0 && !((env_int("UPF_RANK", &rank) && env_int("UPF_WORLD_SIZE", &size)) ||
                       (env_int("OMPI_COMM_WORLD_RANK", &rank) && env_int("OMPI_COMM_WORLD_SIZE", &size))))
      rank = 0, size = 1;
    if (size < 1 || rank < 0 || rank >= size)
      return upf_fail(UPF_ERR_INVALID_ARG, "comm nccl: rank %d of size %d", rank, size);
    c->rank = rank, c->size = size;
    UPF_TRY(nccl_id_by_file(id_file, rank, local_rank_of(rank), c->timeout_s, id));
  } else if (!launched_by_mpirun()) { /* one process: a one-rank NCCL communicator, nothing to exchange */
    c->rank = 0, c->size = 1;
    UPF_TRY(upf_comm_nccl_unique_id(local_rank_of(0), id));
  } else {
    /* through MPI: rank 0's id broadcast to every rank */
    upf_status st = upf_comm_create("mpi", upf_backend_cpu(), opt, &c->boot);
    if (st != UPF_OK)
      return upf_fail_context(st, "comm nccl: bootstrap through MPI (or give a unique-id file)");
    c->rank = c->boot->rank, c->size = c->boot->size;
    st = c->rank == 0 ? upf_comm_nccl_unique_id(local_rank_of(c->rank), id) : UPF_OK;
    /* every rank joins the broadcast; a failed rank 0 sends an all-zero id, which the others refuse */
    const upf_status bst = upf_comm_broadcast(c->boot, id, UPF_NCCL_ID_BYTES, 0);
    UPF_TRY(st);
    UPF_TRY(bst);
    int nonzero = 0;
    for (int i = 0; i < UPF_NCCL_ID_BYTES; i++)
      nonzero |= id[i];
    if (!nonzero)
      return upf_fail(UPF_ERR_COMM, "comm nccl: rank 0 failed to create the NCCL unique id");
  }
  return upf_comm_nccl_init(c, local_rank_of(c->rank), id);
}

upf_status upf_comm_create(const char *kind, const upf_backend *be, const upf_comm_options *opt, upf_comm **out) {
  *out = NULL;
  if (!be)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm: no backend");
  upf_comm_kind k;
  if (!kind || !strcmp(kind, "auto")) {
    if (!launched_by_mpirun() || !upf_comm_mpi_available(NULL))
      k = UPF_COMM_SINGLE;
    else
      k = strcmp(be->name, "cpu") && upf_comm_nccl_available(NULL) ? UPF_COMM_NCCL : UPF_COMM_MPI;
  } else if (!strcmp(kind, "single")) {
    k = UPF_COMM_SINGLE;
  } else if (!strcmp(kind, "mpi")) {
    k = UPF_COMM_MPI;
  } else if (!strcmp(kind, "nccl")) {
    k = UPF_COMM_NCCL;
  } else {
    return upf_fail(UPF_ERR_INVALID_ARG, "comm: '%s' is not one of auto, single, mpi, nccl", kind);
  }
  if (k == UPF_COMM_NCCL && !strcmp(be->name, "cpu"))
    return upf_fail(UPF_ERR_INVALID_ARG, "comm nccl: needs the cuda backend (CPU ranks use mpi)");
  upf_comm *c = calloc(1, sizeof *c);
  if (!c)
    return upf_fail(UPF_ERR_NOMEM, "comm: state");
  c->kind = k, c->be = be, c->rank = 0, c->size = 1, c->ops = &single_ops;
  c->timeout_s = opt && opt->timeout_s > 0 ? opt->timeout_s : 120.0;
  const char *env_timeout = getenv("UPF_COMM_TIMEOUT_S");
  if (!(opt && opt->timeout_s > 0) && env_timeout && atof(env_timeout) > 0)
    c->timeout_s = atof(env_timeout);
  upf_status st = UPF_OK;
  if (k == UPF_COMM_MPI)
    st = upf_comm_mpi_init(c);
  else if (k == UPF_COMM_NCCL)
    st = create_nccl(c, opt);
  if (st != UPF_OK) {
    if (c->ops != &single_ops)
      c->ops->destroy(c);
    if (c->boot)
      upf_comm_destroy(c->boot);
    free(c);
    return st;
  }
  *out = c;
  return UPF_OK;
}

void upf_comm_destroy(upf_comm *c) {
  if (!c)
    return;
  if (c->scratch)
    c->be->release(c->scratch);
  c->ops->destroy(c);
  if (c->boot)
    upf_comm_destroy(c->boot);
  free(c);
}

int32_t upf_comm_rank(const upf_comm *c) { return c ? c->rank : 0; }
int32_t upf_comm_size(const upf_comm *c) { return c ? c->size : 1; }
upf_comm_kind upf_comm_kind_of(const upf_comm *c) { return c ? c->kind : UPF_COMM_SINGLE; }
const upf_backend *upf_comm_backend(const upf_comm *c) { return c ? c->be : NULL; }
upf_comm_stats upf_comm_get_stats(const upf_comm *c) {
  upf_comm_stats s;
  memset(&s, 0, sizeof s);
  return c ? c->stats : s;
}
void upf_comm_reset_stats(upf_comm *c) {
  if (c)
    memset(&c->stats, 0, sizeof c->stats);
}

static upf_status check_usable(const upf_comm *c, const char *what) {
  if (!c)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm %s: no communicator", what);
  if (c->broken)
    return upf_fail(UPF_ERR_COMM, "comm %s: an earlier collective of this communicator failed", what);
  return UPF_OK;
}

upf_status upf_comm_allreduce_sum(upf_comm *c, void *buf, int64_t count, upf_dtype dtype) {
  UPF_TRY(check_usable(c, "all-reduce"));
  if (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "comm all-reduce: dtype %s (f32 or bf16)", upf_dtype_name(dtype));
  if (count < 0 || (count > 0 && !buf))
    return upf_fail(UPF_ERR_INVALID_ARG, "comm all-reduce: count %lld with buffer %p", (long long)count, buf);
  const double t0 = upf_comm_now();
  const upf_status st = c->ops->allreduce(c, buf, count, dtype);
  c->seq++;
  c->stats.calls++;
  c->stats.bytes += (double)count * (double)upf_dtype_size(dtype);
  c->stats.seconds += upf_comm_now() - t0;
  return st;
}

upf_status upf_comm_broadcast(upf_comm *c, void *buf, int64_t bytes, int32_t root) {
  UPF_TRY(check_usable(c, "broadcast"));
  if (bytes < 0 || (bytes > 0 && !buf) || root < 0 || root >= c->size)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm broadcast: %lld bytes from root %d of %d ranks", (long long)bytes, root,
                    c->size);
  const double t0 = upf_comm_now();
  const upf_status st = c->ops->broadcast(c, buf, bytes, root);
  c->seq++;
  c->stats.bcast_calls++;
  c->stats.bcast_bytes += (double)bytes;
  c->stats.bcast_seconds += upf_comm_now() - t0;
  return st;
}

upf_status upf_comm_broadcast_check(upf_comm *c, void *buf, int64_t bytes, int32_t root, int32_t *differing) {
  int32_t unused;
  UPF_TRY(check_usable(c, "broadcast"));
  if (bytes < 0 || (bytes > 0 && !buf) || root < 0 || root >= c->size)
    return upf_fail(UPF_ERR_INVALID_ARG, "comm broadcast: %lld bytes from root %d of %d ranks", (long long)bytes, root,
                    c->size);
  const double t0 = upf_comm_now();
  const upf_status st = c->ops->broadcast_check(c, buf, bytes, root, differing ? differing : &unused);
  c->seq++;
  c->stats.bcast_calls++;
  c->stats.bcast_bytes += (double)bytes;
  c->stats.bcast_seconds += upf_comm_now() - t0;
  return st;
}

upf_status upf_comm_scratch(upf_comm *c, size_t bytes, void **ptr) {
  if (bytes > c->scratch_bytes) {
    if (c->scratch)
      c->be->release(c->scratch);
    c->scratch = NULL, c->scratch_bytes = 0;
    UPF_TRY(c->be->alloc(&c->scratch, bytes));
    c->scratch_bytes = bytes;
  }
  *ptr = c->scratch;
  return UPF_OK;
}

upf_status upf_comm_barrier(upf_comm *c) {
  UPF_TRY(check_usable(c, "barrier"));
  const upf_status st = c->ops->barrier(c);
  c->seq++;
  return st;
}

upf_status upf_head_split_of(int32_t q_heads, int32_t kv_heads, int32_t rank, int32_t size, upf_head_split *out) {
  if (size < 1 || rank < 0 || rank >= size)
    return upf_fail(UPF_ERR_INVALID_ARG, "head split: rank %d of %d ranks", rank, size);
  if (q_heads < 1 || kv_heads < 1 || q_heads % kv_heads)
    return upf_fail(UPF_ERR_SHAPE, "head split: %d query heads over %d kv heads", q_heads, kv_heads);
  if (q_heads % size)
    return upf_fail(UPF_ERR_SHAPE, "head split: %d query heads do not divide over %d ranks", q_heads, size);
  if (kv_heads % size && size % kv_heads)
    return upf_fail(UPF_ERR_SHAPE, "head split: %d kv heads neither divide over %d ranks nor divide them", kv_heads,
                    size);
  out->nq = q_heads / size, out->q0 = rank * out->nq;
  if (kv_heads % size == 0) {
    out->nkv = kv_heads / size, out->kv0 = rank * out->nkv;
  } else { /* replicated: the kv head of this rank's query heads (all in one group, as nq divides g) */
    out->nkv = 1, out->kv0 = out->q0 / (q_heads / kv_heads);
  }
  return UPF_OK;
}

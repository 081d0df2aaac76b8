/* The NCCL backend of the communicator (GPU ranks, one GPU per rank): a non-blocking NCCL
 * communicator on the CUDA backend's stream. Every collective queues a small header all-reduce (op,
 * size, dtype, sequence number; max and min at once) before its payload on the same stream and waits
 * once for both, checking the header first, so mismatched calls fail on every rank; every wait polls
 * (spinning briefly, then sleeping) the stream and ncclCommGetAsyncError with the communicator's
 * timeout, aborting the NCCL communicator (ncclCommAbort) on timeout, error or mismatch: a status,
 * never a hang. NVLink multicast (NVLS) is
 * off unless NCCL_NVLS_ENABLE is set. bf16 all-reduces use NCCL's bf16 sum (each partial sum rounded).
 * libnccl is opened at run time (UPF_NCCL_LIB, then libnccl.so.2 on the loader's path, then the library
 * the build found), so no binary needs it to start: only nccl.h is needed to build. */
#include "core/comm_impl.h"
#include "core/dl.h"

#ifdef UPF_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"

namespace {

/* The NCCL entry points, from the library opened at run time. */
struct nccl_api {
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
};
nccl_api nccl;
char nccl_why[1024];

/* Opens libnccl once; 1 when every entry point resolved, else 0 with the reason in nccl_why. */
int nccl_load(void) {
  static int state = -1;
  if (state >= 0)
    return state;
  const char *env = getenv("UPF_NCCL_LIB");
#ifdef UPF_NCCL_LIB_PATH
  const char *built = UPF_NCCL_LIB_PATH;
#else
  const char *built = nullptr;
#endif
  const char *candidates[] = {env && *env ? env : nullptr, "libnccl.so.2", "libnccl.so", built};
  char tried[768];
  void *h = upf_dl_open_first(candidates, sizeof candidates / sizeof *candidates, RTLD_NOW | RTLD_LOCAL, tried,
                              sizeof tried);
  if (!h) {
    snprintf(nccl_why, sizeof nccl_why, "libnccl not found (tried %s; set UPF_NCCL_LIB to its path)", tried);
    return state = 0;
  }
  const upf_dl_symbol syms[] = {{(void **)&nccl.GetUniqueId, "ncclGetUniqueId"},
              {(void **)&nccl.CommInitRankConfig, "ncclCommInitRankConfig"},
              {(void **)&nccl.CommGetAsyncError, "ncclCommGetAsyncError"},
              {(void **)&nccl.CommAbort, "ncclCommAbort"},
              {(void **)&nccl.CommDestroy, "ncclCommDestroy"},
              {(void **)&nccl.AllReduce, "ncclAllReduce"},
              {(void **)&nccl.Broadcast, "ncclBroadcast"},
              {(void **)&nccl.AllGather, "ncclAllGather"},
              {(void **)&nccl.GetErrorString, "ncclGetErrorString"},
              {(void **)&nccl.GetLastError, "ncclGetLastError"}};
  if (const char *missing = upf_dl_resolve(h, syms, sizeof syms / sizeof *syms)) {
    snprintf(nccl_why, sizeof nccl_why, "the NCCL library lacks %s (NCCL >= 2.18 needed)", missing);
    return state = 0;
  }
  return state = 1;
}

struct nccl_state {
  ncclComm_t comm = nullptr;
  int64_t *header = nullptr;      /* (8) device */
  int64_t *header_host = nullptr; /* (16) pinned: this rank's header, then the reduced one */
  cudaEvent_t header_done = nullptr; /* the reduced header is on the host */
  uint8_t *gather = nullptr;      /* (gather_bytes) device: broadcast_check's gathered bytes */
  uint8_t *gather_host = nullptr; /* (gather_bytes) pinned */
  size_t gather_bytes = 0;
  bool aborted = false;
};

upf_status nccl_fail(upf_comm *c, ncclResult_t r, const char *what) {
  c->broken = 1;
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const char *last = s && s->comm ? nccl.GetLastError(s->comm) : "";
  return upf_fail(UPF_ERR_COMM, "comm nccl (rank %d of %d): %s failed: %s%s%s", c->rank, c->size, what,
                  nccl.GetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

void abort_comm(upf_comm *c) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  if (!s->aborted)
    nccl.CommAbort(s->comm);
  s->aborted = true, c->broken = 1;
}

/* Spins for the first 200 us of a wait (a one-rank or NVLink collective ends in tens of microseconds,
 * and a sleep costs more than that), then sleeps 20 us between polls. */
void pause_briefly(double waited_s) {
  if (waited_s > 200e-6) {
    const struct timespec ts = {0, 20 * 1000};
    nanosleep(&ts, nullptr);
  }
}

/* Waits until the communicator has no operation in progress (non-blocking init and enqueue). */
upf_status wait_comm(upf_comm *c, ncclResult_t r, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const double t0 = upf_comm_now();
  while (r == ncclInProgress) {
    const double waited = upf_comm_now() - t0;
    if (waited > c->timeout_s) {
      abort_comm(c);
      return upf_fail(UPF_ERR_COMM, "comm nccl (rank %d of %d): %s: not done within %.0f s; communicator aborted",
                      c->rank, c->size, what, c->timeout_s);
    }
    pause_briefly(waited);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t q = nccl.CommGetAsyncError(s->comm, &async);
    r = q != ncclSuccess ? q : async;
  }
  return r == ncclSuccess ? UPF_OK : nccl_fail(c, r, what);
}

/* Waits for the event `ev` (nullptr: the whole stream), watching the communicator for asynchronous
 * errors; aborts it on error or timeout. */
upf_status wait_device(upf_comm *c, cudaEvent_t ev, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const cudaStream_t stream = upf_cuda_stream();
  const double t0 = upf_comm_now();
  for (;;) {
    const cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(stream);
    if (e == cudaSuccess)
      return UPF_OK;
    if (e != cudaErrorNotReady)
      return upf_cuda_fail(e, what, __FILE__, __LINE__);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t q = nccl.CommGetAsyncError(s->comm, &async);
    if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      abort_comm(c);
      return nccl_fail(c, q != ncclSuccess ? q : async, what);
    }
    const double waited = upf_comm_now() - t0;
    if (waited > c->timeout_s) {
      abort_comm(c);
      return upf_fail(UPF_ERR_COMM,
                      "comm nccl (rank %d of %d): %s: the other ranks did not arrive within %.0f s; communicator aborted",
                      c->rank, c->size, what, c->timeout_s);
    }
    pause_briefly(waited);
  }
}

/* Queues on the stream the all-reduce of this rank's header (op, a, b, sequence number: max of each
 * and of its negation at once) and the download of the result, then records header_done. The payload
 * is queued behind it; finish() checks both with one wait. */
upf_status queue_header(upf_comm *c, int op, int64_t a, int64_t b, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const int64_t mine[4] = {op, a, b, c->seq};
  for (int i = 0; i < 4; i++)
    s->header_host[i] = mine[i], s->header_host[4 + i] = -mine[i];
  const cudaStream_t stream = upf_cuda_stream();
  UPF_CUDA_TRY(cudaMemcpyAsync(s->header, s->header_host, 8 * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  UPF_TRY(wait_comm(c, nccl.AllReduce(s->header, s->header, 8, ncclInt64, ncclMax, s->comm, stream), what));
  UPF_CUDA_TRY(cudaMemcpyAsync(s->header_host + 8, s->header, 8 * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
  UPF_CUDA_TRY(cudaEventRecord(s->header_done, stream));
  return UPF_OK;
}

/* Waits for the header and checks it, then waits for the payload. Ranks that disagree may have queued
 * payloads that never match (a hang): a mismatch aborts the NCCL communicator at once, on every rank,
 * rather than waiting for the payload's timeout. */
upf_status finish(upf_comm *c, int op, int64_t a, int64_t b, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  UPF_TRY(wait_device(c, s->header_done, what));
  const int64_t mine[4] = {op, a, b, c->seq};
  const int64_t *max = s->header_host + 8, *negmin = s->header_host + 12;
  for (int i = 0; i < 4; i++)
    if (max[i] != -negmin[i]) {
      abort_comm(c);
      return upf_fail(UPF_ERR_COMM,
                      "comm nccl (rank %d of %d): %s: the ranks disagree on the %s (%lld here, from %lld to %lld); "
                      "communicator aborted",
                      c->rank, c->size, what, i == 0 ? "collective" : i == 3 ? "sequence number" : "size or dtype",
                      (long long)mine[i], (long long)-negmin[i], (long long)max[i]);
    }
  return wait_device(c, nullptr, what);
}

upf_status nccl_allreduce(upf_comm *c, void *buf, int64_t count, upf_dtype dtype) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  UPF_TRY(queue_header(c, UPF_COMM_OP_ALLREDUCE, count, dtype, "all-reduce"));
  if (count > 0) {
    const ncclDataType_t t = dtype == UPF_DTYPE_F32 ? ncclFloat32 : ncclBfloat16;
    UPF_TRY(wait_comm(c, nccl.AllReduce(buf, buf, (size_t)count, t, ncclSum, s->comm, upf_cuda_stream()),
                      "all-reduce"));
  }
  return finish(c, UPF_COMM_OP_ALLREDUCE, count, dtype, "all-reduce");
}

upf_status nccl_broadcast(upf_comm *c, void *buf, int64_t bytes, int32_t root) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  UPF_TRY(queue_header(c, UPF_COMM_OP_BROADCAST, bytes, root, "broadcast"));
  if (bytes > 0)
    UPF_TRY(wait_comm(c, nccl.Broadcast(buf, buf, (size_t)bytes, ncclUint8, root, s->comm, upf_cuda_stream()),
                      "broadcast"));
  return finish(c, UPF_COMM_OP_BROADCAST, bytes, root, "broadcast");
}

/* Every rank's bytes gathered (ncclAllGather) behind the header, downloaded, and root's copied into buf,
 * all on the stream: one wait. */
upf_status nccl_broadcast_check(upf_comm *c, void *buf, int64_t bytes, int32_t root, int32_t *differing) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  *differing = 0;
  const size_t all = (size_t)bytes * (size_t)c->size;
  if (all > s->gather_bytes) { /* grow-only: the first call of a size allocates, later ones do not */
    UPF_CUDA_TRY(cudaStreamSynchronize(upf_cuda_stream()));
    if (s->gather)
      UPF_CUDA_TRY(cudaFree(s->gather));
    if (s->gather_host)
      UPF_CUDA_TRY(cudaFreeHost(s->gather_host));
    s->gather = nullptr, s->gather_host = nullptr, s->gather_bytes = 0;
    UPF_CUDA_TRY(cudaMalloc(&s->gather, all));
    UPF_CUDA_TRY(cudaMallocHost(&s->gather_host, all));
    s->gather_bytes = all;
  }
  UPF_TRY(queue_header(c, UPF_COMM_OP_BROADCAST_CHECK, bytes, root, "broadcast"));
  const cudaStream_t stream = upf_cuda_stream();
  if (bytes > 0) {
    UPF_TRY(wait_comm(c, nccl.AllGather(buf, s->gather, (size_t)bytes, ncclUint8, s->comm, stream), "broadcast"));
    UPF_CUDA_TRY(cudaMemcpyAsync(s->gather_host, s->gather, all, cudaMemcpyDeviceToHost, stream));
    UPF_CUDA_TRY(cudaMemcpyAsync(buf, s->gather + (size_t)root * (size_t)bytes, (size_t)bytes,
                                 cudaMemcpyDeviceToDevice, stream));
  }
  UPF_TRY(finish(c, UPF_COMM_OP_BROADCAST_CHECK, bytes, root, "broadcast"));
  const uint8_t *from = s->gather_host + (size_t)root * (size_t)bytes;
  for (int32_t r = 0; bytes > 0 && r < c->size; r++)
    *differing += memcmp(s->gather_host + (size_t)r * (size_t)bytes, from, (size_t)bytes) != 0;
  return UPF_OK;
}

upf_status nccl_barrier(upf_comm *c) {
  UPF_TRY(queue_header(c, UPF_COMM_OP_BARRIER, 0, 0, "barrier"));
  return finish(c, UPF_COMM_OP_BARRIER, 0, 0, "barrier");
}

void nccl_destroy(upf_comm *c) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  if (!s)
    return;
  if (s->comm && !s->aborted) {
    /* a broken communicator may hold a stuck operation: abort instead of waiting for it */
    if (c->broken)
      nccl.CommAbort(s->comm);
    else
      nccl.CommDestroy(s->comm);
  }
  if (s->header)
    UPF_CUDA_NOTE(cudaFree(s->header));
  if (s->header_host)
    UPF_CUDA_NOTE(cudaFreeHost(s->header_host));
  if (s->header_done)
    UPF_CUDA_NOTE(cudaEventDestroy(s->header_done));
  if (s->gather)
    UPF_CUDA_NOTE(cudaFree(s->gather));
  if (s->gather_host)
    UPF_CUDA_NOTE(cudaFreeHost(s->gather_host));
  delete s;
  c->impl = nullptr;
}

const upf_comm_ops nccl_ops = {nccl_allreduce, nccl_broadcast, nccl_broadcast_check, nccl_barrier, nccl_destroy};

upf_status bind_device(int32_t local_rank) {
  int n = 0;
  UPF_CUDA_TRY(cudaGetDeviceCount(&n));
  if (n < 1)
    return upf_fail(UPF_ERR_NO_DEVICE, "comm nccl: no CUDA device");
  UPF_CUDA_TRY(cudaSetDevice(local_rank % n));
  return UPF_OK;
}

} // namespace

extern "C" int upf_comm_nccl_available(const char **why_not) {
  const int ok = nccl_load();
  if (why_not)
    *why_not = ok ? "" : nccl_why;
  return ok;
}

extern "C" upf_status upf_comm_nccl_unique_id(int32_t local_rank, unsigned char id[UPF_NCCL_ID_BYTES]) {
  static_assert(sizeof(ncclUniqueId) == UPF_NCCL_ID_BYTES, "NCCL unique id size");
  if (!nccl_load())
    return upf_fail(UPF_ERR_UNSUPPORTED, "comm nccl: %s", nccl_why);
  UPF_TRY(bind_device(local_rank));
  ncclUniqueId u;
  const ncclResult_t r = nccl.GetUniqueId(&u);
  if (r != ncclSuccess)
    return upf_fail(UPF_ERR_COMM, "comm nccl: ncclGetUniqueId failed: %s", nccl.GetErrorString(r));
  memcpy(id, &u, UPF_NCCL_ID_BYTES);
  return UPF_OK;
}

extern "C" upf_status upf_comm_nccl_init(upf_comm *c, int32_t local_rank, const unsigned char id[UPF_NCCL_ID_BYTES]) {
  if (!nccl_load())
    return upf_fail(UPF_ERR_UNSUPPORTED, "comm nccl: %s", nccl_why);
  UPF_TRY(bind_device(local_rank));
  UPF_TRY(upf_cuda_init());
  if (!getenv("NCCL_NVLS_ENABLE"))
    setenv("NCCL_NVLS_ENABLE", "0", 0);
  nccl_state *s = new nccl_state();
  c->impl = s, c->ops = &nccl_ops;
  UPF_CUDA_TRY(cudaMalloc(&s->header, 8 * sizeof(int64_t)));
  UPF_CUDA_TRY(cudaMallocHost(&s->header_host, 16 * sizeof(int64_t)));
  UPF_CUDA_TRY(cudaEventCreateWithFlags(&s->header_done, cudaEventDisableTiming));
  ncclUniqueId u;
  memcpy(&u, id, UPF_NCCL_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = nccl.CommInitRankConfig(&s->comm, c->size, u, c->rank, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    return nccl_fail(c, r, "ncclCommInitRankConfig");
  return wait_comm(c, r, "ncclCommInitRankConfig");
}
#endif

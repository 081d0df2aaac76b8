/* The NCCL backend of the communicator (GPU ranks, one GPU per rank): a non-blocking NCCL
 * communicator on the CUDA backend's stream. Every collective first all-reduces a small header (op,
 * size, dtype, sequence number; max and min at once) so mismatched calls fail on every rank, and every
 * wait polls the stream and ncclCommGetAsyncError with the communicator's timeout, aborting the NCCL
 * communicator (ncclCommAbort) on timeout or error: a status, never a hang. NVLink multicast (NVLS) is
 * off unless NCCL_NVLS_ENABLE is set. bf16 all-reduces use NCCL's bf16 sum (each partial sum rounded).
 * libnccl is opened at run time (UPF_NCCL_LIB, then libnccl.so.2 on the loader's path, then the library
 * the build found), so no binary needs it to start: only nccl.h is needed to build. */
#include "core/comm_impl.h"

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
  void *h = nullptr;
  char tried[768] = "";
  for (const char *c : candidates) {
    if (!c || h)
      continue;
    h = dlopen(c, RTLD_NOW | RTLD_LOCAL);
    if (!h)
      snprintf(tried + strlen(tried), sizeof tried - strlen(tried), "%s%s", tried[0] ? ", " : "", c);
  }
  if (!h) {
    snprintf(nccl_why, sizeof nccl_why, "libnccl not found (tried %s; set UPF_NCCL_LIB to its path)", tried);
    return state = 0;
  }
  struct {
    void **slot;
    const char *name;
  } syms[] = {{(void **)&nccl.GetUniqueId, "ncclGetUniqueId"},
              {(void **)&nccl.CommInitRankConfig, "ncclCommInitRankConfig"},
              {(void **)&nccl.CommGetAsyncError, "ncclCommGetAsyncError"},
              {(void **)&nccl.CommAbort, "ncclCommAbort"},
              {(void **)&nccl.CommDestroy, "ncclCommDestroy"},
              {(void **)&nccl.AllReduce, "ncclAllReduce"},
              {(void **)&nccl.Broadcast, "ncclBroadcast"},
              {(void **)&nccl.GetErrorString, "ncclGetErrorString"},
              {(void **)&nccl.GetLastError, "ncclGetLastError"}};
  for (auto &s : syms) {
    *s.slot = dlsym(h, s.name);
    if (!*s.slot) {
      snprintf(nccl_why, sizeof nccl_why, "the NCCL library lacks %s (NCCL >= 2.18 needed)", s.name);
      return state = 0;
    }
  }
  return state = 1;
}

struct nccl_state {
  ncclComm_t comm = nullptr;
  int64_t *header = nullptr;      /* (8) device */
  int64_t *header_host = nullptr; /* (8) pinned */
  bool aborted = false;
};

upf_status nccl_fail(upf_comm *c, ncclResult_t r, const char *what) {
  c->broken = 1;
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const char *last = s && s->comm ? nccl.GetLastError(s->comm) : "";
  return upf_fail(UPF_ERR_COMM, "comm nccl (rank %d of %d): %s failed: %s%s%s", c->rank, c->size, what,
                  nccl.GetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

void pause_briefly(long polls) {
  if (polls > 1000) {
    const struct timespec ts = {0, 20 * 1000};
    nanosleep(&ts, nullptr);
  }
}

/* Waits until the communicator has no operation in progress (non-blocking init and enqueue). */
upf_status wait_comm(upf_comm *c, ncclResult_t r, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const double t0 = upf_comm_now();
  for (long polls = 0; r == ncclInProgress; polls++) {
    if (upf_comm_now() - t0 > c->timeout_s) {
      nccl.CommAbort(s->comm);
      s->aborted = true, c->broken = 1;
      return upf_fail(UPF_ERR_COMM, "comm nccl (rank %d of %d): %s: not done within %.0f s; communicator aborted",
                      c->rank, c->size, what, c->timeout_s);
    }
    pause_briefly(polls);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t q = nccl.CommGetAsyncError(s->comm, &async);
    r = q != ncclSuccess ? q : async;
  }
  return r == ncclSuccess ? UPF_OK : nccl_fail(c, r, what);
}

/* Waits for the backend's stream, watching the communicator for asynchronous errors. */
upf_status wait_stream(upf_comm *c, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const cudaStream_t stream = upf_cuda_stream();
  const double t0 = upf_comm_now();
  for (long polls = 0;; polls++) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess)
      return UPF_OK;
    if (e != cudaErrorNotReady)
      return upf_cuda_fail(e, what, __FILE__, __LINE__);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t q = nccl.CommGetAsyncError(s->comm, &async);
    if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      nccl.CommAbort(s->comm);
      s->aborted = true;
      return nccl_fail(c, q != ncclSuccess ? q : async, what);
    }
    if (upf_comm_now() - t0 > c->timeout_s) {
      nccl.CommAbort(s->comm);
      s->aborted = true, c->broken = 1;
      return upf_fail(UPF_ERR_COMM,
                      "comm nccl (rank %d of %d): %s: the other ranks did not arrive within %.0f s; communicator aborted",
                      c->rank, c->size, what, c->timeout_s);
    }
    pause_briefly(polls);
  }
}

upf_status check_header(upf_comm *c, int op, int64_t a, int64_t b, const char *what) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  const int64_t mine[4] = {op, a, b, c->seq};
  for (int i = 0; i < 4; i++)
    s->header_host[i] = mine[i], s->header_host[4 + i] = -mine[i];
  const cudaStream_t stream = upf_cuda_stream();
  UPF_CUDA_TRY(cudaMemcpyAsync(s->header, s->header_host, 8 * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  UPF_TRY(wait_comm(c, nccl.AllReduce(s->header, s->header, 8, ncclInt64, ncclMax, s->comm, stream), what));
  UPF_CUDA_TRY(cudaMemcpyAsync(s->header_host, s->header, 8 * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
  UPF_TRY(wait_stream(c, what));
  for (int i = 0; i < 4; i++)
    if (s->header_host[i] != -s->header_host[4 + i]) {
      c->broken = 1;
      return upf_fail(UPF_ERR_COMM,
                      "comm nccl (rank %d of %d): %s: the ranks disagree on the %s (%lld here, from %lld to %lld)",
                      c->rank, c->size, what, i == 0 ? "collective" : i == 3 ? "sequence number" : "size or dtype",
                      (long long)mine[i], (long long)-s->header_host[4 + i], (long long)s->header_host[i]);
    }
  return UPF_OK;
}

upf_status nccl_allreduce(upf_comm *c, void *buf, int64_t count, upf_dtype dtype) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  UPF_TRY(check_header(c, UPF_COMM_OP_ALLREDUCE, count, dtype, "all-reduce"));
  if (count == 0)
    return UPF_OK;
  const ncclDataType_t t = dtype == UPF_DTYPE_F32 ? ncclFloat32 : ncclBfloat16;
  UPF_TRY(wait_comm(c, nccl.AllReduce(buf, buf, (size_t)count, t, ncclSum, s->comm, upf_cuda_stream()), "all-reduce"));
  return wait_stream(c, "all-reduce");
}

upf_status nccl_broadcast(upf_comm *c, void *buf, int64_t bytes, int32_t root) {
  nccl_state *s = static_cast<nccl_state *>(c->impl);
  UPF_TRY(check_header(c, UPF_COMM_OP_BROADCAST, bytes, root, "broadcast"));
  if (bytes == 0)
    return UPF_OK;
  UPF_TRY(wait_comm(c, nccl.Broadcast(buf, buf, (size_t)bytes, ncclUint8, root, s->comm, upf_cuda_stream()),
                    "broadcast"));
  return wait_stream(c, "broadcast");
}

upf_status nccl_barrier(upf_comm *c) { return check_header(c, UPF_COMM_OP_BARRIER, 0, 0, "barrier"); }

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
  delete s;
  c->impl = nullptr;
}

const upf_comm_ops nccl_ops = {nccl_allreduce, nccl_broadcast, nccl_barrier, nccl_destroy};

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
  UPF_CUDA_TRY(cudaMallocHost(&s->header_host, 8 * sizeof(int64_t)));
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

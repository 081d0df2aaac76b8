/* Recording the timeline (uniprefill/timeline.h) with CUPTI's activity API: kernels (the concurrent kind,
 * which leaves concurrency alone), copies and fills, their device timestamps. libcupti is opened at run
 * time, so no binary links it and a machine without it fails only --timeline, with the files tried. The
 * records are the ones of the CUPTI release the build's headers describe; another major release is
 * refused (its record layouts differ). */
#include "uniprefill/timeline.h"

#include <stdlib.h>
#include <string.h>

#ifdef UPF_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <cupti.h>
#include <dlfcn.h>
#include <pthread.h>

#include "core/dl.h"

/* The kernel record of this CUPTI release (cupti_activity.h: the concurrent kernel kind's newest). */
typedef CUpti_ActivityKernel10 kernel_record;
typedef CUpti_ActivityMemcpy6 memcpy_record;
typedef CUpti_ActivityMemset4 memset_record;

#define TL_BUFFER_BYTES (8u << 20)
#define TL_MAX_EVENTS ((int64_t)1 << 21) /* ~128 MB of events; past it records count as dropped */

static struct {
  void *lib;
  CUptiResult (*get_version)(uint32_t *);
  CUptiResult (*get_result_string)(CUptiResult, const char **);
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
  CUptiResult (*enable)(CUpti_ActivityKind);
  CUptiResult (*disable)(CUpti_ActivityKind);
  CUptiResult (*flush_all)(uint32_t);
  CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
  CUptiResult (*dropped)(CUcontext, uint32_t, size_t *);
  int registered, running;
  pthread_mutex_t lock; /* the buffer callback may run on CUPTI's thread */
  upf_timeline tl;
  int64_t cap_events, cap_names;
  const char **name_keys; /* CUPTI's name pointer of each interned name */
  int failed;             /* an allocation failed inside a callback */
} tl_state = {.lock = PTHREAD_MUTEX_INITIALIZER};

static const CUpti_ActivityKind tl_kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                              CUPTI_ACTIVITY_KIND_MEMSET};

static upf_status cupti_fail(CUptiResult r, const char *call) {
  const char *msg = NULL;
  if (tl_state.get_result_string)
    tl_state.get_result_string(r, &msg);
  return upf_fail(UPF_ERR_CUDA, "timeline: %s: %s (CUPTI error %d)", call, msg ? msg : "unknown", (int)r);
}

static upf_status open_cupti(void) {
  if (tl_state.lib)
    return UPF_OK;
  const char *env = getenv("UPF_CUPTI_LIB");
  const char *tries[] = {env && *env ? env : NULL, "libcupti.so.13", "libcupti.so",
#ifdef UPF_CUPTI_LIB_PATH
                         UPF_CUPTI_LIB_PATH,
#endif
                         "/usr/local/cuda/lib64/libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"};
  char tried[1024];
  tl_state.lib = upf_dl_open_first(tries, sizeof tries / sizeof *tries, RTLD_NOW | RTLD_LOCAL, tried, sizeof tried);
  if (!tl_state.lib)
    return upf_fail(UPF_ERR_UNSUPPORTED,
                    "timeline: libcupti (the CUDA toolkit's CUPTI) could not be opened; tried %s (set UPF_CUPTI_LIB "
                    "to its file)",
                    tried);
  const upf_dl_symbol syms[] = {{(void **)&tl_state.get_version, "cuptiGetVersion"},
              {(void **)&tl_state.get_result_string, "cuptiGetResultString"},
              {(void **)&tl_state.register_callbacks, "cuptiActivityRegisterCallbacks"},
              {(void **)&tl_state.enable, "cuptiActivityEnable"},
              {(void **)&tl_state.disable, "cuptiActivityDisable"},
              {(void **)&tl_state.flush_all, "cuptiActivityFlushAll"},
              {(void **)&tl_state.next_record, "cuptiActivityGetNextRecord"},
              {(void **)&tl_state.dropped, "cuptiActivityGetNumDroppedRecords"}};
  const char *missing = upf_dl_resolve(tl_state.lib, syms, sizeof syms / sizeof *syms);
  if (missing) {
    dlclose(tl_state.lib);
    tl_state.lib = NULL;
    return upf_fail(UPF_ERR_UNSUPPORTED, "timeline: libcupti lacks %s", missing);
  }
  uint32_t version = 0;
  CUptiResult r = tl_state.get_version(&version);
  if (r != CUPTI_SUCCESS)
    return cupti_fail(r, "cuptiGetVersion");
  if (version / 10000 != CUPTI_API_VERSION / 10000)
    return upf_fail(UPF_ERR_UNSUPPORTED,
                    "timeline: libcupti is API version %u, this build reads the records of version %u (another "
                    "major release lays them out differently): point UPF_CUPTI_LIB at the toolkit's own",
                    version, (unsigned)CUPTI_API_VERSION);
  return UPF_OK;
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, TL_BUFFER_BYTES);
  *size = *buffer ? TL_BUFFER_BYTES : 0;
  *max_records = 0;
}

/* The interned copy of CUPTI's kernel name (its pointer is shared by the records of one kernel). */
static const char *intern(const char *name) {
  upf_timeline *t = &tl_state.tl;
  for (int64_t i = t->num_names - 1; i >= 0; i--)
    if (tl_state.name_keys[i] == name || strcmp(t->names[i], name) == 0)
      return t->names[i];
  if (t->num_names == tl_state.cap_names) {
    const int64_t cap = tl_state.cap_names ? 2 * tl_state.cap_names : 64;
    char **names = realloc(t->names, (size_t)cap * sizeof *names);
    if (names)
      t->names = names;
    const char **keys = realloc(tl_state.name_keys, (size_t)cap * sizeof *keys);
    if (keys)
      tl_state.name_keys = keys;
    if (!names || !keys)
      return NULL;
    tl_state.cap_names = cap;
  }
  char *copy = strdup(name);
  if (!copy)
    return NULL;
  tl_state.name_keys[t->num_names] = name;
  t->names[t->num_names++] = copy;
  return copy;
}

static upf_timeline_event *next_event(void) {
  upf_timeline *t = &tl_state.tl;
  if (t->count == tl_state.cap_events) {
    if (tl_state.cap_events >= TL_MAX_EVENTS)
      return NULL;
    const int64_t cap = tl_state.cap_events ? 2 * tl_state.cap_events : 4096;
    upf_timeline_event *ev = realloc(t->events, (size_t)cap * sizeof *ev);
    if (!ev) {
      tl_state.failed = 1;
      return NULL;
    }
    t->events = ev;
    tl_state.cap_events = cap;
  }
  upf_timeline_event *e = &t->events[t->count++];
  memset(e, 0, sizeof *e);
  return e;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *rec = NULL;
  pthread_mutex_lock(&tl_state.lock);
  while (valid > 0 && tl_state.next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    upf_timeline_event *e = NULL;
    switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
      const kernel_record *k = (const kernel_record *)rec;
      if (!(e = next_event()))
        break;
      e->kind = UPF_TIMELINE_KERNEL;
      e->name = intern(k->name ? k->name : "?");
      if (!e->name)
        e->name = "?", tl_state.failed = 1;
      e->start_ns = k->start, e->end_ns = k->end, e->stream = k->streamId;
      e->grid[0] = (uint32_t)k->gridX, e->grid[1] = (uint32_t)k->gridY, e->grid[2] = (uint32_t)k->gridZ;
      e->block[0] = (uint32_t)k->blockX, e->block[1] = (uint32_t)k->blockY, e->block[2] = (uint32_t)k->blockZ;
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const memcpy_record *m = (const memcpy_record *)rec;
      if (!(e = next_event()))
        break;
      e->kind = UPF_TIMELINE_MEMCPY, e->name = "memcpy";
      e->start_ns = m->start, e->end_ns = m->end, e->stream = m->streamId, e->bytes = m->bytes;
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const memset_record *m = (const memset_record *)rec;
      if (!(e = next_event()))
        break;
      e->kind = UPF_TIMELINE_MEMSET, e->name = "memset";
      e->start_ns = m->start, e->end_ns = m->end, e->stream = m->streamId, e->bytes = m->bytes;
      break;
    }
    default:
      continue;
    }
    if (!e)
      tl_state.tl.dropped++;
  }
  pthread_mutex_unlock(&tl_state.lock);
  free(buffer);
}

upf_status upf_timeline_probe(void) { return open_cupti(); }

upf_status upf_timeline_start(void) {
  if (tl_state.running)
    return upf_fail(UPF_ERR_INVALID_ARG, "timeline: a recording is already running");
  UPF_TRY(open_cupti());
  CUptiResult r;
  if (!tl_state.registered) {
    if ((r = tl_state.register_callbacks(buffer_requested, buffer_completed)) != CUPTI_SUCCESS)
      return cupti_fail(r, "cuptiActivityRegisterCallbacks");
    tl_state.registered = 1;
  }
  /* work queued before the start is not the recording's */
  cudaError_t ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess)
    return upf_fail(UPF_ERR_CUDA, "timeline: cudaDeviceSynchronize: %s", cudaGetErrorString(ce));
  pthread_mutex_lock(&tl_state.lock);
  upf_timeline_free(&tl_state.tl);
  free(tl_state.name_keys);
  tl_state.name_keys = NULL;
  tl_state.cap_events = tl_state.cap_names = 0;
  tl_state.failed = 0;
  pthread_mutex_unlock(&tl_state.lock);
  for (size_t i = 0; i < sizeof tl_kinds / sizeof *tl_kinds; i++)
    if ((r = tl_state.enable(tl_kinds[i])) != CUPTI_SUCCESS) {
      for (size_t j = 0; j < i; j++)
        tl_state.disable(tl_kinds[j]);
      return cupti_fail(r, "cuptiActivityEnable");
    }
  tl_state.running = 1;
  return UPF_OK;
}

static int by_start(const void *a, const void *b) {
  const upf_timeline_event *x = a, *y = b;
  return x->start_ns < y->start_ns ? -1 : x->start_ns > y->start_ns ? 1 : (x->end_ns > y->end_ns) - (x->end_ns < y->end_ns);
}

upf_status upf_timeline_stop(upf_timeline *out) {
  memset(out, 0, sizeof *out);
  if (!tl_state.running)
    return upf_fail(UPF_ERR_INVALID_ARG, "timeline: no recording is running");
  cudaError_t ce = cudaDeviceSynchronize();
  tl_state.running = 0;
  CUptiResult r = tl_state.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (size_t i = 0; i < sizeof tl_kinds / sizeof *tl_kinds; i++)
    tl_state.disable(tl_kinds[i]);
  if (ce != cudaSuccess)
    return upf_fail(UPF_ERR_CUDA, "timeline: cudaDeviceSynchronize: %s", cudaGetErrorString(ce));
  if (r != CUPTI_SUCCESS)
    return cupti_fail(r, "cuptiActivityFlushAll");
  size_t dropped = 0;
  if (tl_state.dropped(NULL, 0, &dropped) != CUPTI_SUCCESS)
    dropped = 0;
  pthread_mutex_lock(&tl_state.lock);
  const int failed = tl_state.failed;
  *out = tl_state.tl;
  out->dropped += (int64_t)dropped;
  memset(&tl_state.tl, 0, sizeof tl_state.tl);
  free(tl_state.name_keys);
  tl_state.name_keys = NULL;
  tl_state.cap_events = tl_state.cap_names = 0;
  pthread_mutex_unlock(&tl_state.lock);
  if (failed) {
    upf_timeline_free(out);
    return upf_fail(UPF_ERR_NOMEM, "timeline: out of memory while recording");
  }
  if (out->count > 1)
    qsort(out->events, (size_t)out->count, sizeof *out->events, by_start);
  return UPF_OK;
}

#else /* a build without CUDA */

upf_status upf_timeline_probe(void) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "timeline: records CUDA work; this build has no CUDA (make CUDA=1)");
}

upf_status upf_timeline_start(void) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "timeline: records CUDA work; this build has no CUDA (make CUDA=1)");
}

upf_status upf_timeline_stop(upf_timeline *out) {
  memset(out, 0, sizeof *out);
  return upf_fail(UPF_ERR_INVALID_ARG, "timeline: no recording is running");
}

#endif

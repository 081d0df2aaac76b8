/* Timing shared by the benchmark families: the spec fields of a device-timed or CPU benchmark, and
 * the event-timed loop with warm-up and optional L2 flush (one loop, so every family measures the
 * same way). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "verify/verify.h"

#ifdef UPF_HAVE_CUDA
#include "cuda/perf_support.cuh"
#endif

void upf_bench_spec_timing(upf_bench_spec *spec, int on_cuda, double min_time_s, int cuda_repetitions,
                           int64_t cpu_iterations) {
  if (on_cuda) {
    spec->flags = UPF_BENCH_MANUAL_TIME;
    spec->unit = UPF_BENCH_US;
    spec->min_time_s = min_time_s;
    spec->repetitions = upf_backend_cuda()->probe() == UPF_OK ? cuda_repetitions : 1;
  } else {
    spec->flags = UPF_BENCH_REAL_TIME;
    spec->unit = UPF_BENCH_MS;
    spec->iterations = cpu_iterations;
    spec->repetitions = 3;
  }
}

upf_status upf_bench_time_cuda(upf_bench_state *st, upf_status (*call)(void *arg), void *arg, int warmup,
                               double working_bytes, upf_bench_timing *timing) {
  timing->total_s = 0.0;
  timing->iterations = 0;
#ifndef UPF_HAVE_CUDA
  (void)st, (void)call, (void)arg, (void)warmup, (void)working_bytes;
  return upf_fail(UPF_ERR_UNSUPPORTED, "cuda backend unavailable (built with CUDA=0)");
#else
  upf_cuda_l2_flush *flush = NULL;
  upf_cuda_timer *timer = NULL;
  int64_t l2 = 0;
  upf_status s = upf_cuda_timer_create(&timer);
  if (s == UPF_OK)
    s = upf_cuda_l2_bytes(&l2);
  if (s == UPF_OK && working_bytes > 0.0 && working_bytes < 3.0 * (double)l2)
    s = upf_cuda_l2_flush_create(&flush);
  for (int i = 0; s == UPF_OK && i < warmup; i++)
    s = call(arg);
  while (s == UPF_OK && upf_bench_keep_running(st)) {
    double seconds = 0.0;
    if (flush)
      s = upf_cuda_l2_flush_run(flush); /* enqueued before the start event: not timed */
    if (s == UPF_OK)
      s = upf_cuda_timer_start(timer);
    if (s == UPF_OK)
      s = call(arg);
    if (s == UPF_OK)
      s = upf_cuda_timer_stop(timer, &seconds);
    if (s != UPF_OK)
      break;
    upf_bench_set_iteration_time(st, seconds);
    timing->total_s += seconds;
    timing->iterations++;
  }
  upf_cuda_timer_destroy(timer);
  upf_cuda_l2_flush_destroy(flush);
  return s;
#endif
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double upf_bench_median(double *v, int n) {
  if (n <= 0)
    return NAN;
  qsort(v, (size_t)n, sizeof v[0], cmp_double);
  return v[n / 2];
}

upf_status upf_bench_steady_median(upf_status (*call)(void *arg), void *arg, double warm_s, int reps,
                                   double *median_s) {
  *median_s = 0.0;
  if (reps < 1 || reps > UPF_BENCH_STEADY_MAX_REPS)
    return upf_fail(UPF_ERR_INVALID_ARG, "upf_bench_steady_median: reps = %d outside [1, %d]", reps,
                    UPF_BENCH_STEADY_MAX_REPS);
#ifndef UPF_HAVE_CUDA
  (void)call, (void)arg, (void)warm_s;
  return upf_fail(UPF_ERR_UNSUPPORTED, "cuda backend unavailable (built with CUDA=0)");
#else
  upf_cuda_timer *timer = NULL;
  double t[UPF_BENCH_STEADY_MAX_REPS];
  upf_status s = upf_cuda_timer_create(&timer);
  for (double warm = 0.0; s == UPF_OK && warm < warm_s;) { /* timed too, to know when warm_s has passed */
    double seconds = 0.0;
    s = upf_cuda_timer_start(timer);
    if (s == UPF_OK)
      s = call(arg);
    if (s == UPF_OK)
      s = upf_cuda_timer_stop(timer, &seconds);
    warm += seconds > 0.0 ? seconds : warm_s; /* a zero-time call cannot stall the loop */
  }
  for (int i = 0; s == UPF_OK && i < reps; i++) {
    s = upf_cuda_timer_start(timer);
    if (s == UPF_OK)
      s = call(arg);
    if (s == UPF_OK)
      s = upf_cuda_timer_stop(timer, &t[i]);
  }
  upf_cuda_timer_destroy(timer);
  if (s != UPF_OK)
    return s;
  *median_s = upf_bench_median(t, reps);
  return UPF_OK;
#endif
}

upf_status upf_bench_copy_ceiling(double *bytes_per_second) {
  *bytes_per_second = 0.0;
#ifndef UPF_HAVE_CUDA
  return upf_fail(UPF_ERR_UNSUPPORTED, "cuda backend unavailable (built with CUDA=0)");
#else
  static double measured;
  static upf_status status = UPF_STATUS_COUNT; /* not measured yet */
  static char message[512];
  if (status == UPF_STATUS_COUNT) {
    status = upf_cuda_copy_bandwidth((size_t)1 << 30, 20, &measured);
    snprintf(message, sizeof message, "%s", upf_last_error());
  }
  *bytes_per_second = measured;
  return status == UPF_OK ? UPF_OK : upf_fail(status, "copy bandwidth ceiling: %s", message);
#endif
}

int upf_bench_op_verified(upf_op op, char *why, size_t cap) {
  static int state[UPF_OP_COUNT]; /* 0 not yet, 1 passed, -1 failed */
  static char failures[UPF_OP_COUNT][160];
  if (state[op] == 0) {
    upf_verify_ctx ctx = {.backend = upf_backend_cuda(), .log = NULL, .quick = 1};
    upf_verify_fn_for(op)(&ctx);
    state[op] = ctx.failed == 0 && ctx.passed > 0 ? 1 : -1;
    snprintf(failures[op], sizeof failures[op], "%d of %d checks failed (run `upf verify %s --quick`)", ctx.failed,
             ctx.passed + ctx.failed, upf_op_name(op));
  }
  snprintf(why, cap, "%s", failures[op]);
  return state[op] == 1;
}

// Google Benchmark glue behind perf/bench.h: C callbacks become benchmark families, run under the
// command line's --benchmark_* flags, and their results come back to C through a reporter that
// wraps the usual display reporter (so console and JSON output stay Google Benchmark's own).
#include "perf/bench.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// The C handle: Google Benchmark's state and which spec it runs.
struct upf_bench_state {
  benchmark::State *gb;
  size_t spec;
};

namespace {

struct Spec {
  upf_bench_spec c;         // as registered (pointers borrowed from the caller)
  std::string name;         // family name with the args appended
  std::vector<int64_t> args;
  std::string first_error;  // first skip message of any run: a run that fails while others pass
                            // would otherwise vanish behind the aggregates
  int64_t iterations = 0;   // of the last run that completed (aggregates only count repetitions)
};

std::vector<Spec> &specs() {
  static std::vector<Spec> all;
  return all;
}

double stat_min(const std::vector<double> &v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }

double median_of(std::vector<double> v) {
  if (v.empty())
    return NAN;
  std::sort(v.begin(), v.end());
  size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

benchmark::TimeUnit gb_unit(upf_bench_unit u) {
  switch (u) {
  case UPF_BENCH_US:
    return benchmark::kMicrosecond;
  case UPF_BENCH_MS:
    return benchmark::kMillisecond;
  case UPF_BENCH_S:
    return benchmark::kSecond;
  default:
    return benchmark::kNanosecond;
  }
}

// What the recorder keeps of one benchmark.
struct Entry {
  std::string name, run_name, label, error;
  int64_t iterations = 0, repetitions = 0;
  bool have_aggregates = false;
  double median = NAN, mean = NAN, stddev = 0.0, cv = 0.0, min = NAN;
  std::vector<double> run_times;  // per-iteration seconds of plain runs (when no aggregates come)
  std::vector<std::pair<std::string, double>> counters;
};

std::vector<std::pair<std::string, double>> counters_of(const benchmark::BenchmarkReporter::Run &run) {
  std::vector<std::pair<std::string, double>> out;
  for (const auto &kv : run.counters)
    out.emplace_back(kv.first, kv.second.value);
  return out;
}

// Forwards everything to the display reporter Google Benchmark would have used (so
// --benchmark_format and colours behave as usual) and records what bench_main needs.
class Recorder : public benchmark::BenchmarkReporter {
 public:
  explicit Recorder(benchmark::BenchmarkReporter *display) : display_(display) {}

  bool ReportContext(const Context &context) override { return display_->ReportContext(context); }

  void ReportRuns(const std::vector<Run> &runs) override {
    for (const Run &run : runs)
      record(run);
    display_->ReportRuns(runs);
  }

  void Finalize() override { display_->Finalize(); }

  std::vector<Entry> entries;

 private:
  Entry &entry_for(const Run &run) {
    const std::string &name = run.run_name.function_name;  // the registered name, unique per spec
    for (Entry &e : entries)
      if (e.name == name)
        return e;
    entries.emplace_back();
    entries.back().name = name;
    entries.back().run_name = run.run_name.str();
    return entries.back();
  }

  void record(const Run &run) {
    Entry &e = entry_for(run);
    if (run.error_occurred) {
      if (e.error.empty())
        e.error = run.error_message.empty() ? "error (no message)" : run.error_message;
      return;
    }
    if (!run.report_label.empty())
      e.label = run.report_label;
    // Time statistics are accumulated over `iterations` (for aggregates: the repetition count), so
    // per-iteration seconds are real_accumulated_time / iterations; cv is a plain fraction.
    double per_iter = run.iterations > 0 ? run.real_accumulated_time / (double)run.iterations : NAN;
    if (run.run_type == Run::RT_Iteration) {
      e.iterations = run.iterations;
      e.run_times.push_back(per_iter);
      if (!e.have_aggregates)
        e.counters = counters_of(run);
      return;
    }
    e.have_aggregates = true;
    e.repetitions = run.repetitions;
    const std::string &agg = run.aggregate_name;
    double value = run.aggregate_unit == benchmark::kPercentage ? run.real_accumulated_time : per_iter;
    if (agg == "median") {
      e.median = value;
      e.counters = counters_of(run);
    } else if (agg == "mean") {
      e.mean = value;
    } else if (agg == "stddev") {
      e.stddev = value;
    } else if (agg == "cv") {
      e.cv = value;
    } else if (agg == "min") {
      e.min = value;
    }
  }

  benchmark::BenchmarkReporter *display_;
};

char *dup_str(const std::string &s) {
  char *p = static_cast<char *>(std::malloc(s.size() + 1));
  if (p)
    std::memcpy(p, s.c_str(), s.size() + 1);
  return p;
}

bool argv_has_flag(int argc, char **argv, const char *flag) {
  size_t n = std::strlen(flag);
  for (int i = 1; i < argc; i++)
    if (argv[i] && std::strncmp(argv[i], flag, n) == 0 && (argv[i][n] == '=' || argv[i][n] == '\0'))
      return true;
  return false;
}

void register_with_google_benchmark(bool repetitions_from_flag) {
  for (size_t i = 0; i < specs().size(); i++) {
    const upf_bench_spec &c = specs()[i].c;
    auto *b = benchmark::RegisterBenchmark(specs()[i].name.c_str(), [i](benchmark::State &gb) {
      upf_bench_state st{&gb, i};
      specs()[i].c.fn(&st, specs()[i].c.ctx);
      // A run skipped before its loop never started, and so counts other iterations than the
      // repetitions that ran; Google Benchmark 1.7.1 aborts on that mismatch when it computes the
      // aggregates. Starting the loop now (it ends at once after a skip) makes the counts agree.
      if (gb.error_occurred())
        while (gb.KeepRunning()) {
        }
      else
        specs()[i].iterations = (int64_t)gb.iterations();
    });
    b->Unit(gb_unit(c.unit));
    if (c.flags & UPF_BENCH_MANUAL_TIME)
      b->UseManualTime();
    else if (c.flags & UPF_BENCH_REAL_TIME)
      b->UseRealTime();
    if (c.iterations > 0)
      b->Iterations(c.iterations);
    else if (c.min_time_s > 0.0)
      b->MinTime(c.min_time_s);
    // An explicit Repetitions() would silently override the command-line flag.
    if (!repetitions_from_flag)
      b->Repetitions(c.repetitions > 0 ? c.repetitions : 1);
    b->ReportAggregatesOnly(true);
    b->ComputeStatistics("min", stat_min);
  }
}

void fill_result(const Entry &e, upf_bench_result *r) {
  *r = upf_bench_result{};
  r->name = dup_str(e.name);
  r->run_name = dup_str(e.run_name);
  r->label = dup_str(e.label);
  if (!e.error.empty()) {
    r->error = dup_str(e.error);
    r->no_device = e.error.compare(0, std::strlen(UPF_BENCH_NO_DEVICE), UPF_BENCH_NO_DEVICE) == 0;
  }
  r->iterations = e.iterations;
  if (e.have_aggregates) {
    r->repetitions = e.repetitions;
    r->median_s = e.median, r->mean_s = e.mean, r->stddev_s = e.stddev, r->cv = e.cv, r->min_s = e.min;
  } else {
    // One repetition (or fewer than two that succeeded): Google Benchmark computes no aggregates.
    r->repetitions = (int64_t)e.run_times.size();
    r->median_s = median_of(e.run_times);
    r->min_s = e.run_times.empty() ? NAN : *std::min_element(e.run_times.begin(), e.run_times.end());
    double sum = 0.0;
    for (double t : e.run_times)
      sum += t;
    r->mean_s = e.run_times.empty() ? NAN : sum / (double)e.run_times.size();
  }
  r->counters = static_cast<upf_bench_counter *>(std::calloc(e.counters.size() + 1, sizeof *r->counters));
  if (r->counters) {
    for (const auto &kv : e.counters)
      r->counters[r->num_counters++] = upf_bench_counter{dup_str(kv.first), kv.second};
  }
}

}  // namespace

extern "C" {

upf_status upf_bench_register(const upf_bench_spec *spec) {
  if (!spec || !spec->name || !spec->fn)
    return upf_fail(UPF_ERR_INVALID_ARG, "bench: a benchmark needs a name and a callback");
  if (spec->num_args < 0 || spec->num_args > UPF_BENCH_MAX_ARGS)
    return upf_fail(UPF_ERR_INVALID_ARG, "bench %s: %d args (at most %d)", spec->name, spec->num_args,
                    UPF_BENCH_MAX_ARGS);
  Spec s;
  s.c = *spec;
  s.name = spec->name;
  for (int i = 0; i < spec->num_args; i++) {
    s.args.push_back(spec->args[i]);
    s.name += "/";
    if (spec->arg_names[i])
      s.name += std::string(spec->arg_names[i]) + ":";
    s.name += std::to_string(spec->args[i]);
  }
  for (const Spec &other : specs())
    if (other.name == s.name)
      return upf_fail(UPF_ERR_INVALID_ARG, "bench: '%s' registered twice", s.name.c_str());
  specs().push_back(s);
  return UPF_OK;
}

void upf_bench_add_context(const char *key, const char *value) {
  benchmark::AddCustomContext(key ? key : "", value ? value : "");
}

int upf_bench_keep_running(upf_bench_state *st) { return st->gb->KeepRunning() ? 1 : 0; }

int64_t upf_bench_arg(const upf_bench_state *st, int index) {
  const std::vector<int64_t> &args = specs()[st->spec].args;
  return index >= 0 && (size_t)index < args.size() ? args[(size_t)index] : 0;
}

int64_t upf_bench_iterations(const upf_bench_state *st) { return (int64_t)st->gb->iterations(); }

void upf_bench_set_iteration_time(upf_bench_state *st, double seconds) { st->gb->SetIterationTime(seconds); }

void upf_bench_skip_with_error(upf_bench_state *st, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  Spec &spec = specs()[st->spec];
  if (spec.first_error.empty())
    spec.first_error = msg;
  st->gb->SkipWithError(msg);
}

void upf_bench_skip_no_device(upf_bench_state *st, const char *reason) {
  upf_bench_skip_with_error(st, UPF_BENCH_NO_DEVICE "%s", reason && *reason ? reason : "(no reason given)");
}

void upf_bench_set_counter(upf_bench_state *st, const char *name, double value, upf_bench_counter_kind kind) {
  // A rate is an amount per iteration: Google Benchmark multiplies by the iteration count and
  // divides by the measured (manual, real or CPU) seconds of the run.
  benchmark::Counter::Flags flags =
      kind == UPF_BENCH_COUNTER_RATE ? benchmark::Counter::kIsIterationInvariantRate : benchmark::Counter::kDefaults;
  st->gb->counters[name] = benchmark::Counter(value, flags);
}

void upf_bench_set_label(upf_bench_state *st, const char *label) { st->gb->SetLabel(label ? label : ""); }

upf_status upf_bench_run(int argc, char **argv, upf_bench_result **results, int *count) {
  *results = nullptr;
  *count = 0;
  // Google Benchmark removes the flags it knows from argv; work on a copy so the caller's stays whole.
  std::vector<char *> args(argv, argv + argc);
  args.push_back(nullptr);
  int gb_argc = argc;
  bool repetitions_from_flag = argv_has_flag(argc, argv, "--benchmark_repetitions");
  benchmark::Initialize(&gb_argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(gb_argc, args.data()))
    return upf_fail(UPF_ERR_INVALID_ARG, "bench: unrecognised argument '%s'", gb_argc > 1 ? args[1] : "");

  register_with_google_benchmark(repetitions_from_flag);
  Recorder recorder(benchmark::CreateDefaultDisplayReporter());
  benchmark::RunSpecifiedBenchmarks(&recorder);
  benchmark::Shutdown();

  for (const Spec &s : specs()) {
    for (Entry &e : recorder.entries)
      if (e.name == s.name) {
        if (e.error.empty() && !s.first_error.empty())
          e.error = s.first_error;
        if (e.iterations == 0)
          e.iterations = s.iterations;
      }
    if (s.c.teardown)
      s.c.teardown(s.c.ctx);
  }
  specs().clear();
  benchmark::ClearRegisteredBenchmarks();

  size_t n = recorder.entries.size();
  upf_bench_result *out = static_cast<upf_bench_result *>(std::calloc(n ? n : 1, sizeof *out));
  if (!out)
    return upf_fail(UPF_ERR_NOMEM, "bench: cannot allocate %zu results", n);
  for (size_t i = 0; i < n; i++)
    fill_result(recorder.entries[i], &out[i]);
  *results = out;
  *count = (int)n;
  return UPF_OK;
}

void upf_bench_results_free(upf_bench_result *results, int count) {
  if (!results)
    return;
  for (int i = 0; i < count; i++) {
    upf_bench_result *r = &results[i];
    std::free(r->name), std::free(r->run_name), std::free(r->label), std::free(r->error);
    for (int c = 0; c < r->num_counters; c++)
      std::free(r->counters[c].name);
    std::free(r->counters);
  }
  std::free(results);
}

double upf_bench_result_counter(const upf_bench_result *result, const char *name) {
  for (int c = 0; c < result->num_counters; c++)
    if (result->counters[c].name && std::strcmp(result->counters[c].name, name) == 0)
      return result->counters[c].value;
  return NAN;
}

}  // extern "C"

/* The timeline's breakdown, names and Chrome trace (uniprefill/timeline.h); the recording itself is
 * core/timeline_cupti.c. Plain C over the event list, so the CPU tests check every number by hand. */
#include "uniprefill/timeline.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

const double upf_timeline_gap_bounds_us[UPF_TIMELINE_GAP_CLASSES - 1] = {10.0, 1000.0};
static const char *const gap_class_names[UPF_TIMELINE_GAP_CLASSES] = {"under 10 us", "10 us - 1 ms", "over 1 ms"};

/* Kernel name pieces, first match wins (selection's part GEMM before cuBLAS's "gemm", MoE's scan before
 * Gated DeltaNet's). The suite's kernels are those of the .cu files under cuda/; cuBLAS's Hopper kernels are nvjet_* (CUDA 12.6
 * and later) or *xmma_gemm* / cutlass. */
static const struct {
  const char *piece, *category;
} category_rules[] = {
    {"sel_", "selection"},
    {"moe_", "MoE routing and combine"},
    {"nvjet", "GEMM (cuBLAS)"},
    {"gemm", "GEMM (cuBLAS)"},
    {"cutlass", "GEMM (cuBLAS)"},
    {"splitKreduce", "GEMM (cuBLAS)"},
    {"sparse_means", "FlashPrefill means and index"},
    {"idx_mma", "FlashPrefill means and index"},
    {"idx_ffma", "FlashPrefill means and index"},
    {"idx_expand", "FlashPrefill means and index"},
    {"union_kernel", "CompactAttention tables"},
    {"tables_kernel", "CompactAttention tables"},
    {"attn_", "attention"},
    {"bs_wgmma", "attention"},
    {"bs_generic", "attention"},
    {"kv_gather", "attention"},
    {"fp8_q_kernel", "attention"},
    {"fp8_rows_kernel", "attention"},
    {"chunk_prep", "Gated DeltaNet"},
    {"chunk_state", "Gated DeltaNet"},
    {"chunk_out", "Gated DeltaNet"},
    {"conv_kernel", "Gated DeltaNet"},
    {"conv_state", "Gated DeltaNet"},
    {"conv_step", "Gated DeltaNet"},
    {"scan_kernel", "Gated DeltaNet"},
    {"gated_norm", "Gated DeltaNet"},
    {"rms_rows", "norms"},
    {"rope_kernel", "RoPE"},
    {"act_mul", "activation and gates"},
    {"gated_kernel", "activation and gates"},
    {"kv_cache_write", "KV cache and compaction"},
    {"kv_slot_mapping", "KV cache and compaction"},
    {"scatter_rows", "KV cache and compaction"},
    {"compact_", "KV cache and compaction"},
    {"embed", "embedding and logits"},
    {"reduce_rows", "embedding and logits"},
};

const char *upf_timeline_category(const upf_timeline_event *e) {
  if (e->kind != UPF_TIMELINE_KERNEL)
    return "copies and fills";
  for (size_t i = 0; e->name && i < sizeof category_rules / sizeof *category_rules; i++)
    if (strstr(e->name, category_rules[i].piece))
      return category_rules[i].category;
  return "other";
}

/* Itanium mangling: "_Z" [L] (<len><id>) or "_ZN" [qualifiers] (<len><id>)+ "E" ...; the last <len><id>
 * before template arguments ("I") or the end of the nested name is the function's identifier. */
void upf_timeline_short_name(const char *name, char *buf, size_t n) {
  if (n == 0)
    return;
  const char *id = NULL;
  size_t id_len = 0;
  if (name && strncmp(name, "_Z", 2) == 0) {
    const char *p = name + 2;
    if (*p == 'L')
      p++;
    const int nested = *p == 'N';
    if (nested) {
      p++;
      while (*p == 'r' || *p == 'V' || *p == 'K')
        p++;
    }
    /* a plain name is one <len><id> (what follows is the parameter types); a nested one, several */
    while (isdigit((unsigned char)*p) && (nested || !id)) {
      char *end;
      const unsigned long len = strtoul(p, &end, 10);
      if (len == 0 || strlen(end) < len)
        break;
      id = end, id_len = len;
      p = end + len;
    }
  }
  if (!id) {
    snprintf(buf, n, "%s", name ? name : "");
    return;
  }
  snprintf(buf, n, "%.*s", (int)id_len, id);
}

static int by_ms_desc(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

upf_status upf_timeline_summarize(const upf_timeline *t, upf_timeline_summary *s) {
  memset(s, 0, sizeof *s);
  s->dropped = t->dropped;
  if (t->count == 0)
    return UPF_OK;
  for (int64_t i = 0; i < t->count; i++) {
    if (t->events[i].end_ns < t->events[i].start_ns)
      return upf_fail(UPF_ERR_INVALID_ARG, "timeline: event %lld ends before it starts", (long long)i);
    if (i > 0 && t->events[i].start_ns < t->events[i - 1].start_ns)
      return upf_fail(UPF_ERR_INVALID_ARG, "timeline: event %lld starts before event %lld", (long long)i,
                      (long long)(i - 1));
  }
  int64_t first = 0; /* the first kernel: the window opens there */
  while (first < t->count && t->events[first].kind != UPF_TIMELINE_KERNEL)
    first++;
  if (first == t->count)
    first = 0;
  s->lead_events = first;
  s->lead_ms = (double)(t->events[first].start_ns - t->events[0].start_ns) * 1e-6;
  uint32_t streams[64];
  int32_t nstreams = 0;
  uint64_t covered_to = t->events[first].start_ns, busy = 0, sum = 0;
  const uint64_t t0 = t->events[first].start_ns;
  int64_t last_end_event = first;
  for (int64_t i = first; i < t->count; i++) {
    const upf_timeline_event *e = &t->events[i];
    if (e->kind == UPF_TIMELINE_KERNEL)
      s->kernels++;
    else
      s->copies++;
    int32_t k = 0;
    while (k < nstreams && streams[k] != e->stream)
      k++;
    if (k == nstreams && nstreams < (int32_t)(sizeof streams / sizeof *streams))
      streams[nstreams++] = e->stream;
    sum += e->end_ns - e->start_ns;
    /* the union of the intervals, and the idle stretches between them */
    if (e->start_ns > covered_to) {
      const double ms = (double)(e->start_ns - covered_to) * 1e-6;
      const double us = ms * 1e3;
      int c = 0;
      while (c < UPF_TIMELINE_GAP_CLASSES - 1 && us >= upf_timeline_gap_bounds_us[c])
        c++;
      s->gaps++;
      s->gap_count[c]++;
      s->gap_ms[c] += ms;
      /* keep the longest few, longest first (an insertion into a short sorted list) */
      int32_t at = s->num_top_gaps;
      while (at > 0 && s->top_gaps[at - 1].ms < ms)
        at--;
      if (at < UPF_TIMELINE_TOP_GAPS) {
        const int32_t last = s->num_top_gaps < UPF_TIMELINE_TOP_GAPS ? s->num_top_gaps : UPF_TIMELINE_TOP_GAPS - 1;
        memmove(&s->top_gaps[at + 1], &s->top_gaps[at], (size_t)(last - at) * sizeof s->top_gaps[0]);
        s->top_gaps[at].at_ms = (double)(covered_to - t0) * 1e-6;
        s->top_gaps[at].ms = ms;
        s->top_gaps[at].before = last_end_event;
        s->top_gaps[at].after = i;
        if (s->num_top_gaps < UPF_TIMELINE_TOP_GAPS)
          s->num_top_gaps++;
      }
      covered_to = e->start_ns;
    }
    if (e->end_ns > covered_to) {
      busy += e->end_ns - (e->start_ns > covered_to ? e->start_ns : covered_to);
      covered_to = e->end_ns;
      last_end_event = i;
    }
    /* time by category */
    const char *cat = upf_timeline_category(e);
    int32_t c = 0;
    while (c < s->num_categories && strcmp(s->categories[c].name, cat) != 0)
      c++;
    if (c == s->num_categories && c < UPF_TIMELINE_MAX_CATEGORIES)
      s->categories[s->num_categories++].name = cat;
    if (c < UPF_TIMELINE_MAX_CATEGORIES) {
      s->categories[c].ms += (double)(e->end_ns - e->start_ns) * 1e-6;
      s->categories[c].count++;
    }
  }
  s->streams = nstreams;
  s->window_ms = (double)(covered_to - t0) * 1e-6;
  s->busy_ms = (double)busy * 1e-6;
  s->idle_ms = s->window_ms - s->busy_ms;
  s->overlap_ms = (double)(sum - busy) * 1e-6;
  /* categories by time, largest first (the entries start with their ms) */
  typedef struct {
    double ms;
    int32_t i;
  } keyed;
  keyed order[UPF_TIMELINE_MAX_CATEGORIES];
  for (int32_t c = 0; c < s->num_categories; c++)
    order[c].ms = s->categories[c].ms, order[c].i = c;
  qsort(order, (size_t)s->num_categories, sizeof *order, by_ms_desc);
  upf_timeline_summary copy = *s;
  for (int32_t c = 0; c < s->num_categories; c++)
    s->categories[c] = copy.categories[order[c].i];
  return UPF_OK;
}

static const char *event_short(const upf_timeline *t, int64_t i, char *buf, size_t n) {
  upf_timeline_short_name(t->events[i].name, buf, n);
  return buf;
}

void upf_timeline_print(FILE *f, const char *indent, const upf_timeline *t, const upf_timeline_summary *s) {
  const double w = s->window_ms > 0 ? s->window_ms : 1.0;
  fprintf(f, "%swindow %.3f ms (the first kernel's start to the last end), %lld kernels and %lld copies or fills on "
             "%d stream(s)%s\n",
          indent, s->window_ms, (long long)s->kernels, (long long)s->copies, s->streams,
          s->dropped ? "; SOME RECORDS WERE DROPPED, the numbers undercount" : "");
  if (s->lead_events)
    fprintf(f, "%sbefore the window: %lld copies or fills over %.3f ms (inputs uploaded before the run's timer)\n",
            indent, (long long)s->lead_events, s->lead_ms);
  fprintf(f, "%sGPU busy %.3f ms (%.1f%%), idle %.3f ms (%.1f%%) in %lld gaps, work beside other work %.3f ms\n", indent,
          s->busy_ms, 100.0 * s->busy_ms / w, s->idle_ms, 100.0 * s->idle_ms / w, (long long)s->gaps, s->overlap_ms);
  for (int32_t c = 0; c < s->num_categories; c++)
    fprintf(f, "%s  %-30s %10.3f ms %5.1f%% %7lld\n", indent, s->categories[c].name, s->categories[c].ms,
            100.0 * s->categories[c].ms / w, (long long)s->categories[c].count);
  fprintf(f, "%sgaps:", indent);
  for (int c = 0; c < UPF_TIMELINE_GAP_CLASSES; c++)
    fprintf(f, "%s %s %lld (%.3f ms)", c ? "," : "", gap_class_names[c], (long long)s->gap_count[c], s->gap_ms[c]);
  fprintf(f, "\n");
  for (int32_t g = 0; g < s->num_top_gaps; g++) {
    char a[96], b[96];
    fprintf(f, "%s  gap %.3f ms at %.3f ms, after %s, before %s\n", indent, s->top_gaps[g].ms, s->top_gaps[g].at_ms,
            event_short(t, s->top_gaps[g].before, a, sizeof a), event_short(t, s->top_gaps[g].after, b, sizeof b));
  }
}

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(f, "\\%c", *p);
    else if (*p < 0x20)
      fprintf(f, "\\u%04x", *p);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

void upf_timeline_summary_json(FILE *f, const upf_timeline *t, const upf_timeline_summary *s) {
  fprintf(f,
          "{\"lead_events\": %lld, \"lead_ms\": %.6f, \"window_ms\": %.6f, \"busy_ms\": %.6f, \"idle_ms\": %.6f, \"overlap_ms\": %.6f, \"kernels\": %lld, "
          "\"copies\": %lld, \"streams\": %d, \"dropped\": %lld, \"categories\": [",
          (long long)s->lead_events, s->lead_ms, s->window_ms, s->busy_ms, s->idle_ms, s->overlap_ms, (long long)s->kernels, (long long)s->copies, s->streams,
          (long long)s->dropped);
  for (int32_t c = 0; c < s->num_categories; c++) {
    fprintf(f, "%s{\"name\": ", c ? ", " : "");
    json_str(f, s->categories[c].name);
    fprintf(f, ", \"ms\": %.6f, \"count\": %lld}", s->categories[c].ms, (long long)s->categories[c].count);
  }
  fprintf(f, "], \"gaps\": {\"count\": %lld, \"classes\": [", (long long)s->gaps);
  for (int c = 0; c < UPF_TIMELINE_GAP_CLASSES; c++) {
    fprintf(f, "%s{\"class\": ", c ? ", " : "");
    json_str(f, gap_class_names[c]);
    fprintf(f, ", \"count\": %lld, \"ms\": %.6f}", (long long)s->gap_count[c], s->gap_ms[c]);
  }
  fprintf(f, "], \"longest\": [");
  for (int32_t g = 0; g < s->num_top_gaps; g++) {
    char a[96], b[96];
    fprintf(f, "%s{\"at_ms\": %.6f, \"ms\": %.6f, \"after\": ", g ? ", " : "", s->top_gaps[g].at_ms, s->top_gaps[g].ms);
    json_str(f, event_short(t, s->top_gaps[g].before, a, sizeof a));
    fprintf(f, ", \"before\": ");
    json_str(f, event_short(t, s->top_gaps[g].after, b, sizeof b));
    fprintf(f, "}");
  }
  fprintf(f, "]}}");
}

upf_status upf_timeline_write_chrome(FILE *f, const upf_timeline *t, const char *what) {
  const uint64_t t0 = t->count ? t->events[0].start_ns : 0;
  fprintf(f, "{\"displayTimeUnit\": \"ns\", \"traceEvents\": [\n");
  for (int64_t i = 0; i < t->count; i++) {
    const upf_timeline_event *e = &t->events[i];
    char name[96];
    upf_timeline_short_name(e->name, name, sizeof name);
    fprintf(f, "%s{\"ph\": \"X\", \"pid\": 0, \"tid\": %u, \"ts\": %.3f, \"dur\": %.3f, \"name\": ", i ? ",\n" : "",
            e->stream, (double)(e->start_ns - t0) * 1e-3, (double)(e->end_ns - e->start_ns) * 1e-3);
    json_str(f, name);
    fprintf(f, ", \"cat\": ");
    json_str(f, upf_timeline_category(e));
    if (e->kind == UPF_TIMELINE_KERNEL) {
      fprintf(f, ", \"args\": {\"grid\": \"%u,%u,%u\", \"block\": \"%u,%u,%u\", \"kernel\": ", e->grid[0], e->grid[1],
              e->grid[2], e->block[0], e->block[1], e->block[2]);
      json_str(f, e->name);
      fprintf(f, "}}");
    } else {
      fprintf(f, ", \"args\": {\"bytes\": %llu}}", (unsigned long long)e->bytes);
    }
  }
  fprintf(f, "\n]}\n");
  if (ferror(f))
    return upf_fail(UPF_ERR_IO, "%s: write error", what ? what : "timeline");
  return UPF_OK;
}

void upf_timeline_free(upf_timeline *t) {
  if (!t)
    return;
  for (int64_t i = 0; i < t->num_names; i++)
    free(t->names[i]);
  free(t->names);
  free(t->events);
  memset(t, 0, sizeof *t);
}

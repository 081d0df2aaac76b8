/* `upf report --compare OLD.json NEW.json [--threshold P%]`: the CI gate over two report.json files
 * (docs/report.md). A table of new/old for every row present in both, the rows present in one only
 * listed, and a failing exit status for a correctness regression or a slowdown beyond threshold + noise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/report.h"
#include "cli/report_json.h"

typedef struct {
  const char *path;
  rj_value doc;
} report_doc;

/* Reads and checks one side: valid JSON, our schema, a version this build reads. */
static int load_report(const char *flag, const char *path, report_doc *d) {
  char *text = NULL;
  int64_t len = 0;
  d->path = path;
  if (!upf_args_read_file("upf report", flag, path, &text, &len))
    return 0;
  upf_status st = rj_parse(text, (size_t)len, path, &d->doc);
  free(text);
  if (st != UPF_OK) {
    fprintf(stderr, "upf report: --compare %s: %s\n", flag, upf_last_error());
    return 0;
  }
  const char *schema = rj_string(&d->doc, "schema");
  const double version = rj_number(&d->doc, "version");
  if (!schema || strcmp(schema, UPF_REPORT_SCHEMA) != 0) {
    fprintf(stderr, "upf report: --compare %s: %s is not a upf report.json (\"schema\" is not \"%s\")\n", flag,
            path, UPF_REPORT_SCHEMA);
    return 0;
  }
  if (!(version >= 1 && version <= UPF_REPORT_VERSION)) {
    fprintf(stderr, "upf report: --compare %s: %s has \"version\" %g; this build reads 1 to %d\n", flag, path,
            version, UPF_REPORT_VERSION);
    return 0;
  }
  return 1;
}

/* "5%" or "5": percent. */
static int parse_threshold(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || (*end && strcmp(end, "%") != 0) || !isfinite(v) || v < 0 || v > 1000) {
    fprintf(stderr, "upf report: --threshold '%s' is not a percentage in [0, 1000] (e.g. 5%%)\n", s);
    return 0;
  }
  *out = v / 100.0;
  return 1;
}

/* The row of `section` in doc with this id, or NULL. */
static const rj_value *find_row(const rj_value *doc, const char *section, const char *id) {
  const rj_value *rows = rj_get(doc, section);
  if (!rows || rows->kind != RJ_ARRAY)
    return NULL;
  for (int i = 0; i < rows->count; i++) {
    const char *rid = rj_string(&rows->items[i], "id");
    if (rid && !strcmp(rid, id))
      return &rows->items[i];
  }
  return NULL;
}

typedef struct {
  int compared, slower, regressed, faster, only_old, only_new, malformed;
} gate_tally;

static double or_zero(double v) { return isnan(v) ? 0.0 : v; }

/* One timed section: `metric` is the median (ms), `spread` its standard deviation. */
static void compare_timed(const report_doc *o, const report_doc *n, const char *section, const char *metric,
                          const char *spread, double threshold, gate_tally *t) {
  const rj_value *rows = rj_get(&n->doc, section);
  for (int i = 0; rows && rows->kind == RJ_ARRAY && i < rows->count; i++) {
    const rj_value *nr = &rows->items[i];
    const char *id = rj_string(nr, "id");
    const rj_value *orow = id ? find_row(&o->doc, section, id) : NULL;
    if (!orow)
      continue;
    const double ov = rj_number(orow, metric), nv = rj_number(nr, metric);
    if (!(ov > 0) || !(nv > 0)) {
      /* a row that did not run on one side (an error, a skipped size): nothing to time against */
      printf("| %s | %s | %s | %s | | | not timed on both sides |\n", section, id, isnan(ov) ? "-" : "ran",
             isnan(nv) ? "-" : "ran");
      t->malformed++;
      continue;
    }
    const double noise = UPF_REPORT_NOISE_K * (or_zero(rj_number(orow, spread)) + or_zero(rj_number(nr, spread)));
    const double allowed = threshold * ov + noise;
    const char *verdict = "ok";
    if (nv - ov > allowed) {
      verdict = "SLOWER";
      t->slower++;
    } else if (ov - nv > allowed) {
      verdict = "faster";
      t->faster++;
    } else if (nv > ov) {
      verdict = "ok (within noise)";
    }
    t->compared++;
    printf("| %s | %s | %.4g ms | %.4g ms | %.3f | +%.3g ms | %s |\n", section, id, ov, nv, nv / ov, allowed,
           verdict);
  }
}

/* Verify rows: a row whose failures grew is a regression wherever it appears (a new op that fails is not
 * "new, so not compared": correctness is absolute). */
static void compare_verify(const report_doc *o, const report_doc *n, gate_tally *t) {
  const rj_value *rows = rj_get(&n->doc, "verify");
  for (int i = 0; rows && rows->kind == RJ_ARRAY && i < rows->count; i++) {
    const rj_value *nr = &rows->items[i];
    const char *id = rj_string(nr, "id");
    if (!id)
      continue;
    const rj_value *orow = find_row(&o->doc, "verify", id);
    const double nf = or_zero(rj_number(nr, "failed")), np = or_zero(rj_number(nr, "passed"));
    const double of = orow ? or_zero(rj_number(orow, "failed")) : 0, op = orow ? or_zero(rj_number(orow, "passed")) : 0;
    char old_cell[64] = "not in OLD";
    if (orow)
      snprintf(old_cell, sizeof old_cell, "%.0f passed, %.0f failed", op, of);
    if (nf > of) {
      t->regressed++;
      printf("| verify | %s | %s | %.0f passed, %.0f failed | | | REGRESSED |\n", id, old_cell, np, nf);
    } else if (orow) {
      t->compared++;
      if (nf > 0 || np != op)
        printf("| verify | %s | %s | %.0f passed, %.0f failed | | | %s |\n", id, old_cell, np, nf,
               nf > 0 ? "failing in both" : "ok (another case set)");
    }
  }
}

/* Agreement rows (end to end and accuracy): a fall by more than UPF_REPORT_AGREEMENT_DROP fails. */
static void compare_agreement(const report_doc *o, const report_doc *n, const char *section, gate_tally *t) {
  const rj_value *rows = rj_get(&n->doc, section);
  for (int i = 0; rows && rows->kind == RJ_ARRAY && i < rows->count; i++) {
    const rj_value *nr = &rows->items[i];
    const char *id = rj_string(nr, "id");
    const rj_value *orow = id ? find_row(&o->doc, section, id) : NULL;
    const double oa = rj_number(orow, "agreement"), na = rj_number(nr, "agreement");
    if (!orow || isnan(oa) || isnan(na))
      continue;
    const int worse = na < oa - UPF_REPORT_AGREEMENT_DROP;
    if (!strcmp(section, "accuracy"))
      t->compared++;
    t->regressed += worse;
    if (worse || !strcmp(section, "accuracy"))
      printf("| %s agreement | %s | %.4f | %.4f | %.3f | -%.2f | %s |\n", section, id, oa, na, oa > 0 ? na / oa : NAN,
             UPF_REPORT_AGREEMENT_DROP, worse ? "REGRESSED" : "ok");
  }
}

/* The rows of `section` in a but not in b. */
static int list_only(const report_doc *a, const report_doc *b, const char *section, const char *side) {
  const rj_value *rows = rj_get(&a->doc, section);
  int n = 0;
  for (int i = 0; rows && rows->kind == RJ_ARRAY && i < rows->count; i++) {
    const char *id = rj_string(&rows->items[i], "id");
    if (!id || find_row(&b->doc, section, id))
      continue;
    if (!strcmp(section, "verify") && !strcmp(side, "NEW") && rj_number(&rows->items[i], "failed") > 0)
      continue; /* listed above as a regression */
    printf("- only in %s: %s %s\n", side, section, id);
    n++;
  }
  return n;
}

static void stamp_line(const char *side, const report_doc *d) {
  const rj_value *s = rj_get(&d->doc, "stamp");
  const char *commit = rj_string(s, "commit"), *device = rj_string(s, "device"), *date = rj_string(s, "date");
  printf("- %s: %s (commit %s, %s, %s)\n", side, d->path, commit ? commit : "?", device ? device : "?",
         date ? date : "?");
}

int upf_cli_report_compare(int argc, char **argv) {
  int compare = 0;
  const char *threshold_arg = "5%";
  const char *files[3] = {0};
  upf_arg args[] = {
      {"--compare", UPF_ARG_SWITCH, &compare},
      {"--threshold", UPF_ARG_STRING, &threshold_arg},
  };
  upf_arg_parser p = {"upf report", upf_cli_report_usage, args, (int)(sizeof args / sizeof args[0]), files, 3, 0};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  if (p.num_positional != 2) {
    fprintf(stderr, "upf report: --compare takes two files, OLD.json NEW.json (got %d)\n", p.num_positional);
    return 2;
  }
  double threshold;
  if (!parse_threshold(threshold_arg, &threshold))
    return 2;
  report_doc o = {0}, n = {0};
  int ok = load_report("OLD", files[0], &o) && load_report("NEW", files[1], &n);
  if (!ok) {
    rj_free(&o.doc);
    rj_free(&n.doc);
    return 2;
  }
  printf("# upf report --compare\n\n");
  stamp_line("OLD", &o);
  stamp_line("NEW", &n);
  const char *od = rj_string(rj_get(&o.doc, "stamp"), "device"), *nd = rj_string(rj_get(&n.doc, "stamp"), "device");
  if (od && nd && strcmp(od, nd) != 0)
    printf("- warning: the devices differ; times compare only on one card\n");
  printf("- rule: a row is SLOWER when new - old > %.3g%% of old + %.0f x (old spread + new spread) (spreads: the\n"
         "  standard deviation over each side's repetitions; 0 where a row has none); a verify row fails when its\n"
         "  failed count grew (also a failing row only NEW has); top-1 agreement fails when it falls by more than\n"
         "  %.2f. Rows in one file only are listed, not failed.\n\n",
         threshold * 100.0, UPF_REPORT_NOISE_K, UPF_REPORT_AGREEMENT_DROP);
  printf("| section | row | old | new | new/old | allowed | verdict |\n|---|---|---:|---:|---:|---:|---|\n");
  gate_tally t = {0};
  compare_verify(&o, &n, &t);
  compare_timed(&o, &n, "kernels", "median_ms", "spread_ms", threshold, &t);
  compare_timed(&o, &n, "e2e", "ttft_ms", "spread_ms", threshold, &t);
  compare_timed(&o, &n, "serving", "ttft_p50_ms", "spread_ms", threshold, &t);
  compare_agreement(&o, &n, "e2e", &t);
  compare_agreement(&o, &n, "accuracy", &t);
  printf("\n");
  static const char *const sections[] = {"verify", "kernels", "e2e", "serving", "accuracy"};
  for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
    t.only_old += list_only(&o, &n, sections[i], "OLD");
    t.only_new += list_only(&n, &o, sections[i], "NEW");
  }
  const int failed = t.slower > 0 || t.regressed > 0;
  printf("%sgate: %s: %d rows compared, %d slower beyond threshold and noise, %d correctness regressions, %d faster, "
         "%d only in OLD, %d only in NEW\n",
         t.only_old || t.only_new ? "\n" : "", failed ? "FAIL" : "PASS", t.compared, t.slower, t.regressed, t.faster,
         t.only_old, t.only_new);
  rj_free(&o.doc);
  rj_free(&n.doc);
  return failed ? 1 : 0;
}

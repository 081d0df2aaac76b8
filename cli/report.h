/* Pieces of `upf report` shared between its files: the gate (cli/report_compare.c) and the end-to-end,
 * serving and accuracy sections (cli/report_e2e.c) that cli/report.c assembles into report.md and
 * report.json (schema: docs/report.md). */
#ifndef UNIPREFILL_CLI_REPORT_H
#define UNIPREFILL_CLI_REPORT_H

#include <stdio.h>

#define UPF_REPORT_SCHEMA "uniprefill-report"
#define UPF_REPORT_VERSION 1

/* `upf report --compare OLD.json NEW.json [--threshold P%]`; argv as given to `upf report`. Returns the
 * exit status: 0 when the gate passes, 1 when it fails, 2 for a bad command line or file. */
int upf_cli_report_compare(int argc, char **argv);

/* The noise rule of the gate: a row is slower when new - old > threshold * old + k * (spread_old +
 * spread_new), k = UPF_REPORT_NOISE_K, spreads the standard deviations over the repetitions. */
#define UPF_REPORT_NOISE_K 2.0
/* Top-1 agreement (a share) may fall this much before the gate fails. */
#define UPF_REPORT_AGREEMENT_DROP 0.01

/* One timed row of the end-to-end and serving sections, as report.json holds it. */
typedef struct {
  char id[160];     /* "<model>/<method>/<length>", unique in the report */
  char model[48];   /* a name of `upf models` or "smollm2-135m-gguf" */
  char family[24];  /* llama, gemma3, qwen3next */
  char method[24];  /* dense, uniprefill, flashprefill, compact */
  char backend[8];  /* cpu, cuda */
  char dtype[8];    /* f32, bf16 */
  long length;      /* prompt tokens of the one request */
  int repetitions;
  double ttft_ms, spread_ms, min_ms; /* median, standard deviation and minimum over the repetitions */
  double kept_share;                 /* tokens of the last layer / prompt (dense 1); NaN when not measured */
  double agreement;                  /* top-1 agreement of the last positions with dense; NaN when not measured */
  double speedup;                    /* dense TTFT / this TTFT at the same model and length */
  double layer_ms[4];                /* attention, linear attention (GDN), FFN/MoE, selection+compaction */
  /* the run's dense work (upf prefill's "dense_work"): GEMM, MoE, attention and GDN-scan FLOPs, glue bytes
   * read and written; NaN when the JSON has none */
  double work[5];
  double limit_ms; /* dense rows: the work at the run's measured ceilings (upf_report_e2e_limits); else NaN */
  int failed;                        /* the run failed (its message in `error`) */
  char error[256];
} upf_report_e2e_row;

typedef struct {
  char id[160];
  char model[48], method[24], backend[8];
  int requests;
  long prompt_min, prompt_max;
  double ttft_p50_ms, ttft_p99_ms, tpot_ms, tokens_per_s, kv_saved;
  int failed;
  char error[256];
} upf_report_serve_row;

typedef struct {
  char id[160];
  char model[48], task[24], method[24];
  long tokens;
  double p, agreement, kept_share, ppl;
  int failed;
  char error[256];
} upf_report_accuracy_row;

/* The ceilings measured in the report's own run that the end-to-end limit holds the dense work to: the
 * best cuBLAS bf16 GEMM rate (gemm_ceiling and the model shapes), the best attention prefill rate among
 * the attn_prefill benchmarks, and copy bandwidth (bytes read plus written a second); NaN where the run
 * measured none. */
typedef struct {
  double gemm_flops, attn_flops, copy_bytes;
} upf_report_ceilings;

/* What the end-to-end part measured, and how to write it. */
typedef struct {
  upf_report_ceilings ceilings; /* set by upf_report_e2e_limits */
  upf_report_e2e_row *e2e;
  int num_e2e;
  upf_report_serve_row *serve;
  int num_serve;
  upf_report_accuracy_row *accuracy;
  int num_accuracy;
  char **commands; /* (num_commands,) each run's command line, as a user would type it */
  int num_commands;
  char notes[1024]; /* what was skipped and why, one line each */
} upf_report_e2e;

/* What the end-to-end part runs. */
typedef struct {
  int on_device;         /* the CUDA backend: the real shapes at 8K / 32K / 128K; else tiny configs on the CPU */
  int quick;             /* the CI size set: 8K on a device, 512 tokens on the CPU; no real-weight accuracy */
  const char *dir;       /* where the runs' JSON (DIR/runs/) and their console output (DIR/e2e.log) go */
  const char *smollm2;   /* the real-weight files (absent: said in the notes) */
  const char *gemma270m;
  const char *models;    /* NULL, or a comma-separated list replacing the default models */
  const char *lengths;   /* NULL, or a comma-separated list replacing the default lengths */
} upf_report_e2e_options;

/* Runs the end-to-end, serving and accuracy measurements through the CLI's own entry points (upf
 * prefill, eval, serve-sim with --json), each run's command recorded; progress on stderr. A failed
 * run is a row with its error, never an abort. */
void upf_report_e2e_run(const upf_report_e2e_options *o, upf_report_e2e *out);
void upf_report_e2e_free(upf_report_e2e *r);
/* The limit of each dense (unchunked) row: GEMM and MoE FLOPs at the GEMM rate + attention FLOPs at the
 * attention rate + glue bytes at copy bandwidth (the Gated DeltaNet scan, which has no single ceiling,
 * left out and said so); NaN without all three ceilings. Keeps c in r for the markdown. */
void upf_report_e2e_limits(upf_report_e2e *r, const upf_report_ceilings *c);
/* Their sections of report.md and members of report.json ("e2e", "serving", "accuracy"). */
void upf_report_e2e_markdown(FILE *f, const upf_report_e2e *r);
void upf_report_e2e_json(FILE *f, const upf_report_e2e *r);

#endif

/* The harness of the suites that run the upf binary beside the test binary (tests/test_cli*.c). A
 * suite holds one cli_suite: cli_setup makes its temporary directory (in the suite's CUnit set-up)
 * and cli_teardown removes it; cli_run runs upf with printf-style arguments, its stdout and stderr
 * captured in stdout.txt and stderr.txt of that directory; cli_path names files there for the whole
 * suite; the rest asks what a run left behind. */
#ifndef UNIPREFILL_TESTS_CLI_HARNESS_H
#define UNIPREFILL_TESTS_CLI_HARNESS_H

#include <CUnit/CUnit.h>
#include <limits.h>
#include <stdint.h>

#define CLI_MAX_PATHS 128

typedef struct {
  char upf[PATH_MAX];     /* the upf binary */
  char dir[64];           /* the suite's temporary directory */
  int run_in_dir;         /* 1: upf runs with dir as its working directory (relative paths name files there) */
  char last_args[4096];   /* the arguments of the last cli_run, for messages */
  char paths[CLI_MAX_PATHS][192];
  int num_paths;
} cli_suite;

/* Finds upf beside the running test binary and makes /tmp/<prefix>_XXXXXX; 0 on success (CUnit's
 * set-up convention). */
int cli_setup(cli_suite *s, const char *prefix);

/* Removes the directory and all in it; 0 on success. */
int cli_teardown(cli_suite *s);

/* dir/name, in a slot of its own per name so that it stays valid for the whole suite. */
const char *cli_path(cli_suite *s, const char *name);

/* Runs `upf <args>` (printf-style; the shell splits and unquotes them) with stdout and stderr to
 * dir/stdout.txt and dir/stderr.txt; returns the exit status (128 when upf did not exit). */
int cli_run(cli_suite *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* 1 when path exists (a file, a directory, or a link to something that does). */
int cli_exists(const char *path);

/* 1 when the file at path holds needle; 0 when it does not or cannot be read. */
int cli_file_contains(const char *path, const char *needle);

/* The same for the last run's stderr and stdout. */
int cli_stderr_has(cli_suite *s, const char *needle);
int cli_stdout_has(cli_suite *s, const char *needle);

/* 1 when the last run's stream ("stderr" or "stdout") holds needle; otherwise prints what was expected,
 * the run's arguments and what the stream held, and returns 0. */
int cli_expect(cli_suite *s, const char *stream, const char *needle);

/* Asserts that the last run's stderr (stdout) holds needle, saying which run and what it printed when
 * not. */
#define CLI_ASSERT_STDERR(s, needle) CU_ASSERT(cli_expect((s), "stderr", (needle)))
#define CLI_ASSERT_STDOUT(s, needle) CU_ASSERT(cli_expect((s), "stdout", (needle)))

/* 1 when both .npy files read and hold the same dtype, shape and bytes. */
int cli_same_npy(const char *a, const char *b);

/* Writes text to dir/name; 0 when it cannot. */
int cli_write_text(cli_suite *s, const char *name, const char *text);

/* Writes the n int32 values as a <i4 (n,) .npy at path; 0 when it cannot. */
int cli_write_i32(const char *path, const int32_t *v, int64_t n);

#endif

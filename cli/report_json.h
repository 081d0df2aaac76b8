/* A small JSON reader for `upf report --compare` (report.json files, RFC 8259 plus NaN/Infinity, which
 * Google Benchmark and Python's json write): the whole document as a tree of values, and lookups by key.
 * Errors are a upf_status whose message names the file and the byte offset. */
#ifndef UNIPREFILL_CLI_REPORT_JSON_H
#define UNIPREFILL_CLI_REPORT_JSON_H

#include <stddef.h>

#include "uniprefill/status.h"

typedef enum { RJ_NULL, RJ_BOOL, RJ_NUMBER, RJ_STRING, RJ_ARRAY, RJ_OBJECT } rj_kind;

typedef struct rj_value {
  rj_kind kind;
  double number;          /* RJ_NUMBER; RJ_BOOL: 0 or 1 */
  char *string;           /* RJ_STRING: UTF-8, NUL-terminated (a \u0000 escape is refused) */
  int count;              /* RJ_ARRAY, RJ_OBJECT: the number of items */
  struct rj_value *items; /* (count,) the elements or the members' values, in document order */
  char **keys;            /* (count,) RJ_OBJECT: the members' names */
} rj_value;

/* Parses text[0, len) into *out (freed with rj_free, also after a failure). `name` goes into messages. */
upf_status rj_parse(const char *text, size_t len, const char *name, rj_value *out);
void rj_free(rj_value *v);

/* The member `key` of an object (the first one of that name), or NULL when v is not an object or
 * has none. */
const rj_value *rj_get(const rj_value *v, const char *key);
/* Its number (NaN when absent or not a number) and its string (NULL when absent or not a string). */
double rj_number(const rj_value *v, const char *key);
const char *rj_string(const rj_value *v, const char *key);

#endif

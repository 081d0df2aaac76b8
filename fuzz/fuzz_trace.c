/* libFuzzer target: serve-sim's JSON-lines trace parser (upf_trace_parse_jsonl, models/engine.c).
 * A parsed trace must hold what the header promises: requests ordered by arrival, arrivals within
 * [0, UPF_TRACE_MAX_ARRIVAL], prompts of ids in [0, vocab), max_new >= 1 and unique ids. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/engine.h"

static int cmp_id(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  enum { VOCAB = 1000, MAX_NEW = 4 };
  char *text = malloc(size + 1); /* the parser takes a NUL-terminated string, as the file reader makes */
  if (!text)
    return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  upf_trace t;
  if (upf_trace_parse_jsonl(&t, text, "fuzz.jsonl", VOCAB, MAX_NEW) == UPF_OK) {
    int64_t *ids = malloc(((size_t)t.num_reqs + 1) * sizeof *ids);
    for (int32_t i = 0; i < t.num_reqs; i++) {
      const upf_engine_request *r = &t.reqs[i];
      if (!(r->arrival >= 0 && r->arrival <= UPF_TRACE_MAX_ARRIVAL) || r->prompt_len < 1 || !r->prompt ||
          r->max_new < 1 || (i && r->arrival < t.reqs[i - 1].arrival))
        __builtin_trap();
      for (int32_t j = 0; j < r->prompt_len; j++)
        if (r->prompt[j] < 0 || r->prompt[j] >= VOCAB)
          __builtin_trap();
      if (ids)
        ids[i] = r->id;
    }
    if (ids) {
      qsort(ids, (size_t)t.num_reqs, sizeof *ids, cmp_id);
      for (int32_t i = 1; i < t.num_reqs; i++)
        if (ids[i] == ids[i - 1])
          __builtin_trap();
    }
    free(ids);
  }
  upf_trace_free(&t);
  free(text);
  return 0;
}

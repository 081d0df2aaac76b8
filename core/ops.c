/* Names of the ops of the op table (ops.def). */
#include "uniprefill/ops.h"

#include <string.h>

static const char *const op_names[UPF_OP_COUNT] = {
#define UPF_OP(id, name, summary, ...) [UPF_OP_##id] = name,
#include "uniprefill/ops.def"
#undef UPF_OP
};

static const char *const op_summaries[UPF_OP_COUNT] = {
#define UPF_OP(id, name, summary, ...) [UPF_OP_##id] = summary,
#include "uniprefill/ops.def"
#undef UPF_OP
};

const char *upf_op_name(upf_op op) { return (unsigned)op < UPF_OP_COUNT ? op_names[op] : "invalid"; }

const char *upf_op_summary(upf_op op) { return (unsigned)op < UPF_OP_COUNT ? op_summaries[op] : ""; }

upf_op upf_op_by_name(const char *name) {
  for (int i = 0; i < UPF_OP_COUNT; i++)
    if (name && !strcmp(name, op_names[i]))
      return (upf_op)i;
  return UPF_OP_COUNT;
}

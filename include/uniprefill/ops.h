/* Op identifiers generated from ops.def, and their names. */
#ifndef UNIPREFILL_OPS_H
#define UNIPREFILL_OPS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
#define UPF_OP(id, name, summary, ...) UPF_OP_##id,
#include "uniprefill/ops.def"
#undef UPF_OP
  UPF_OP_COUNT
} upf_op;

const char *upf_op_name(upf_op op);
const char *upf_op_summary(upf_op op);
/* Returns UPF_OP_COUNT when no op has that name. */
upf_op upf_op_by_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif

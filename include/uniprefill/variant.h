/* Kernel variants: one mechanism for every op. The variants of an op are listed in variants.def
 * (default first) and named by the enum below (UPF_VARIANT_<OP>_<ID>). The variant in effect for an
 * op is, in order: the last upf_variant_select() for it, the environment variable UPF_VARIANT
 * ("attn.prefill=fa2,attn.paged=ffma"), or the op's default. `upf ops` lists them, `upf verify`
 * iterates them (an op whose variant was chosen, by --variant or UPF_VARIANT, runs that one only),
 * `upf verify --variant` and `bench_upf --variant` select them, and every benchmark result records
 * the variants in effect. */
#ifndef UNIPREFILL_VARIANT_H
#define UNIPREFILL_VARIANT_H

#include <stddef.h>

#include "uniprefill/ops.h"
#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
#define UPF_VARIANT(op, id, name, summary) UPF_VARIANT_##op##_##id,
#include "uniprefill/variants.def"
#undef UPF_VARIANT
  UPF_VARIANT_COUNT
} upf_variant;

/* Variants of op (0 when it has a single kernel), and the i-th of them (i < count), default first. */
int upf_variant_count(upf_op op);
upf_variant upf_variant_of(upf_op op, int i);
upf_op upf_variant_op(upf_variant v);
const char *upf_variant_name(upf_variant v);
const char *upf_variant_summary(upf_variant v);
/* The variant of op named `name`; UPF_VARIANT_COUNT when there is none. */
upf_variant upf_variant_by_name(upf_op op, const char *name);

/* The variant in effect for op (see above). An op without variants gives UPF_VARIANT_COUNT. A bad
 * UPF_VARIANT (unknown op, unknown variant, malformed) fails with UPF_ERR_INVALID_ARG naming it, on
 * every call, so a mistyped variant never runs (and times) the default under the variant's name. */
upf_status upf_variant_current(upf_op op, upf_variant *v);
/* The variant chosen for op by upf_variant_select or UPF_VARIANT; UPF_VARIANT_COUNT when op runs its
 * default because nothing chose one. Fails as upf_variant_current does. */
upf_status upf_variant_chosen(upf_op op, upf_variant *v);
/* Makes v the variant in effect for its op in this process (overrides UPF_VARIANT). */
void upf_variant_select(upf_variant v);
/* Back to UPF_VARIANT or the default for op. */
void upf_variant_reset(upf_op op);
/* Parses "op=name[,op=name...]" and selects each; UPF_ERR_INVALID_ARG names the bad item. */
upf_status upf_variant_select_spec(const char *spec);
/* "attn.prefill=wgmma2-nopp,attn.paged=mma": the variant in effect for every op that has variants.
 * Fails as upf_variant_current does. */
upf_status upf_variant_describe(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif

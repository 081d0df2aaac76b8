/* The variant table generated from variants.def, and which variant of each op is in effect. */
#include "uniprefill/variant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
  upf_op op;
  const char *name;
  const char *summary;
} variants[UPF_VARIANT_COUNT + 1] = {
#define UPF_VARIANT(op, id, name, summary) {UPF_OP_##op, name, summary},
#include "uniprefill/variants.def"
#undef UPF_VARIANT
    {UPF_OP_COUNT, "", ""},
};

/* Per op: the variant chosen by upf_variant_select, or UPF_VARIANT_COUNT when none was. */
static upf_variant selected[UPF_OP_COUNT];
static int selected_init;

static void init_selected(void) {
  if (selected_init)
    return;
  for (int op = 0; op < UPF_OP_COUNT; op++)
    selected[op] = UPF_VARIANT_COUNT;
  selected_init = 1;
}

int upf_variant_count(upf_op op) {
  int n = 0;
  for (int v = 0; v < UPF_VARIANT_COUNT; v++)
    n += variants[v].op == op;
  return n;
}

upf_variant upf_variant_of(upf_op op, int i) {
  for (int v = 0; v < UPF_VARIANT_COUNT; v++)
    if (variants[v].op == op && i-- == 0)
      return (upf_variant)v;
  return UPF_VARIANT_COUNT;
}

upf_op upf_variant_op(upf_variant v) { return (unsigned)v < UPF_VARIANT_COUNT ? variants[v].op : UPF_OP_COUNT; }
const char *upf_variant_name(upf_variant v) { return (unsigned)v < UPF_VARIANT_COUNT ? variants[v].name : "invalid"; }
const char *upf_variant_summary(upf_variant v) {
  return (unsigned)v < UPF_VARIANT_COUNT ? variants[v].summary : "";
}

upf_variant upf_variant_by_name(upf_op op, const char *name) {
  for (int v = 0; v < UPF_VARIANT_COUNT; v++)
    if (variants[v].op == op && name && !strcmp(name, variants[v].name))
      return (upf_variant)v;
  return UPF_VARIANT_COUNT;
}

/* One "op=name" item of a spec (len bytes at item); *out is the variant it names. */
static upf_status parse_item(const char *item, size_t len, const char *source, upf_variant *out) {
  char buf[128];
  if (len == 0 || len >= sizeof buf)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: item '%.*s' is not op=variant", source, (int)(len < 64 ? len : 64), item);
  memcpy(buf, item, len);
  buf[len] = '\0';
  char *eq = strchr(buf, '=');
  if (!eq)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: item '%s' is not op=variant", source, buf);
  *eq = '\0';
  const upf_op op = upf_op_by_name(buf);
  if (op == UPF_OP_COUNT)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: '%s' names no op (see upf ops)", source, buf);
  const int n = upf_variant_count(op);
  const upf_variant v = upf_variant_by_name(op, eq + 1);
  if (v == UPF_VARIANT_COUNT) {
    char accepted[256] = "";
    size_t used = 0;
    for (int i = 0; i < n && used < sizeof accepted; i++)
      used += (size_t)snprintf(accepted + used, sizeof accepted - used, "%s%s", i ? "|" : "",
                               upf_variant_name(upf_variant_of(op, i)));
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: op %s has no variant '%s' (%s%s)", source, buf, eq + 1,
                    n ? "accepted: " : "it has a single kernel", accepted);
  }
  *out = v;
  return UPF_OK;
}

/* Walks the items of spec, stopping at the first bad one: with want == UPF_OP_COUNT selects each,
 * else leaves in *found the last item naming op want. */
static upf_status walk_spec(const char *spec, const char *source, upf_op want, upf_variant *found) {
  *found = UPF_VARIANT_COUNT;
  /* an item after every comma: "a=b," is malformed */
  for (const char *p = spec; p && (*p || p != spec);) {
    const char *end = strchr(p, ',');
    const size_t len = end ? (size_t)(end - p) : strlen(p);
    upf_variant v;
    UPF_TRY(parse_item(p, len, source, &v));
    if (want == UPF_OP_COUNT)
      upf_variant_select(v);
    else if (variants[v].op == want)
      *found = v;
    p = end ? end + 1 : NULL;
  }
  return UPF_OK;
}

upf_status upf_variant_chosen(upf_op op, upf_variant *v) {
  init_selected();
  *v = UPF_VARIANT_COUNT;
  if ((unsigned)op >= UPF_OP_COUNT)
    return upf_fail(UPF_ERR_INVALID_ARG, "variant: op %d out of range", (int)op);
  if (upf_variant_count(op) == 0)
    return UPF_OK;
  if (selected[op] != UPF_VARIANT_COUNT) {
    *v = selected[op];
    return UPF_OK;
  }
  /* The whole variable is checked on every read, so a typo anywhere in it is reported. */
  return walk_spec(getenv("UPF_VARIANT"), "UPF_VARIANT", op, v);
}

upf_status upf_variant_current(upf_op op, upf_variant *v) {
  UPF_TRY(upf_variant_chosen(op, v));
  if (*v == UPF_VARIANT_COUNT && upf_variant_count(op) > 0)
    *v = upf_variant_of(op, 0);
  return UPF_OK;
}

void upf_variant_select(upf_variant v) {
  init_selected();
  if ((unsigned)v < UPF_VARIANT_COUNT)
    selected[variants[v].op] = v;
}

void upf_variant_reset(upf_op op) {
  init_selected();
  if ((unsigned)op < UPF_OP_COUNT)
    selected[op] = UPF_VARIANT_COUNT;
}

upf_status upf_variant_select_spec(const char *spec) {
  upf_variant unused;
  /* Check every item before selecting any, so a bad spec changes nothing. */
  /* an item after every comma: "a=b," is malformed */
  for (const char *p = spec; p && (*p || p != spec);) {
    const char *end = strchr(p, ',');
    UPF_TRY(parse_item(p, end ? (size_t)(end - p) : strlen(p), "--variant", &unused));
    p = end ? end + 1 : NULL;
  }
  return walk_spec(spec, "--variant", UPF_OP_COUNT, &unused);
}

upf_status upf_variant_describe(char *buf, size_t cap) {
  size_t used = 0;
  if (cap)
    buf[0] = '\0';
  for (int op = 0; op < UPF_OP_COUNT; op++) {
    if (upf_variant_count((upf_op)op) == 0)
      continue;
    upf_variant v;
    UPF_TRY(upf_variant_current((upf_op)op, &v));
    if (used < cap)
      used += (size_t)snprintf(buf + used, cap - used, "%s%s=%s", used ? "," : "", upf_op_name((upf_op)op),
                               upf_variant_name(v));
  }
  return UPF_OK;
}

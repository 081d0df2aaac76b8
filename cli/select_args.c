/* The token selection flags shared by the commands that run a prefill (cli/select_args.h). */
#include "cli/select_args.h"

#include <stdio.h>
#include <string.h>

static int given(const upf_arg_parser *p, const char *flag) {
  const upf_arg *a = upf_args_find(p, flag);
  return a && a->seen;
}

int upf_select_args_resolve(const char *command, const upf_arg_parser *p, upf_select_args *sa) {
  if (!strcmp(sa->mode, "dense"))
    sa->prefill_mode = UPF_PREFILL_DENSE;
  else if (!strcmp(sa->mode, "uniprefill"))
    sa->prefill_mode = UPF_PREFILL_UNIPREFILL;
  else {
    fprintf(stderr, "upf %s: --mode '%s': want dense or uniprefill\n", command, sa->mode);
    return 2;
  }
  sa->p_given = given(p, "--p"), sa->keep_given = given(p, "--keep");
  if (sa->prefill_mode == UPF_PREFILL_DENSE && (sa->p_given || sa->keep_given)) {
    fprintf(stderr, "upf %s: --p and --keep need --mode uniprefill\n", command);
    return 2;
  }
  if (sa->p_given && sa->keep_given) {
    fprintf(stderr, "upf %s: give at most one of --p (top-p) and --keep (top-k keep ratio)\n", command);
    return 2;
  }
  if (sa->p_given && !(sa->p > 0.0f && sa->p <= 1.0f)) {
    fprintf(stderr, "upf %s: --p %g: want a top-p mass in (0, 1]\n", command, (double)sa->p);
    return 2;
  }
  if (sa->keep_given && !(sa->keep > 0.0f && sa->keep <= 1.0f)) {
    fprintf(stderr, "upf %s: --keep %g: want a keep ratio in (0, 1]\n", command, (double)sa->keep);
    return 2;
  }
  return 0;
}

void upf_select_args_apply(const upf_select_args *sa, upf_select_params *sel) {
  if (sa->p_given)
    sel->p = sa->p;
  if (sa->keep_given)
    sel->keep_ratio = sa->keep;
}

/* `upf export`: a built-in model on weights seeded by S, saved as a GGUF file (F32 or BF16) that
 * llama.cpp's tooling reads (models/gguf_model.c); `upf prefill --gguf` loads it back. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "uniprefill/model.h"

const char upf_cli_export_usage[] =
    "usage: upf export --model NAME --out FILE.gguf [--seed S] [--dtype f32|bf16]\n"
    "  Saves a built-in model (upf models) on weights seeded by S (default 1) as a GGUF file of\n"
    "  general.architecture llama, gemma3 or qwen3next in llama.cpp's names and layouts: tensors of 2+\n"
    "  dims in --dtype (default bf16), norms f32. The file appears only once it is complete.\n";

int upf_cli_export(int argc, char **argv) {
  const char *model = NULL, *out = NULL, *dtype_name = "bf16";
  int32_t seed = 1;
  upf_arg args[] = {
      {"--model", UPF_ARG_STRING, &model, 1},
      {"--out", UPF_ARG_STRING, &out, 1},
      {"--seed", UPF_ARG_INT, &seed, 0, 0, INT32_MAX},
      {"--dtype", UPF_ARG_STRING, &dtype_name},
  };
  upf_arg_parser p = {"upf export", upf_cli_export_usage, args, (int)(sizeof args / sizeof *args), NULL, 0, 0};
  const upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  const upf_model_config *cfg = upf_model_config_by_name(model);
  if (!cfg)
    return upf_cli_error(UPF_ERR_INVALID_ARG, "export: --model"), 2;
  upf_dtype dtype;
  if (upf_dtype_parse(dtype_name, &dtype) != UPF_OK || (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16)) {
    fprintf(stderr, "upf export: --dtype '%s': want f32 or bf16\n", dtype_name);
    return 2;
  }
  const upf_arg_path paths[] = {{"--out", out, 1}};
  if (!upf_args_check_paths("upf export", paths, 1))
    return 2;
  /* the weights are built in the file's dtype, so a bf16 file holds exactly the bf16 model */
  upf_model m;
  upf_status st = upf_model_init_seeded(&m, cfg, upf_backend_cpu(), dtype, (uint64_t)seed, 0, cfg->num_layers);
  if (st != UPF_OK)
    return upf_cli_error(st, "export: building the model");
  st = upf_model_save_gguf(&m, out, dtype);
  upf_model_free(&m);
  if (st != UPF_OK)
    return upf_cli_error(st, "export: --out");
  /* the summary stays out of a file written to stdout */
  struct stat sb;
  const int to_file = stat(out, &sb) == 0 && S_ISREG(sb.st_mode) && fstat(1, &sb) == 0 && !S_ISREG(sb.st_mode);
  fprintf(!to_file ? stderr : stdout, "%s (seed %d, %s) -> %s\n", cfg->name, seed, upf_dtype_name(dtype), out);
  return 0;
}

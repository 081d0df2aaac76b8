#!/usr/bin/env bash
# The accuracy sweep of UniPrefill on the real models (issue 16): dense perplexity, next-token
# agreement / KL and needle accuracy against p, on either backend, one JSON per `upf eval` run.
#
#   perf/accuracy.sh run [--smollm FILE] [--gemma FILE] [--backend cpu|cuda] [--preset cpu|full]
#                        [--out DIR] [--upf BIN] [--p LIST] [--only smollm|gemma]
#   perf/accuracy.sh summary DIR [--report DIR]     # tables, plot and summary JSON (perf/plot_accuracy.py)
#
# run: writes DIR/<model>-<task>-<tokens>.json, DIR/commands.txt (every command, in order, with its
# wall time) and DIR/text.sha256 (the text files and their hashes). A run whose JSON exists is skipped,
# so an interrupted sweep resumes where it stopped. Presets: `cpu` sizes the sweep for a 2-core machine
# (both models at 2K, SmolLM2 at 4K, 4-8 windows, one needle trial a depth; about 40 minutes); `full`
# is the whole sweep (SmolLM2 2K-8K, Gemma-3 2K-32K, 16 windows, 4 needle trials a depth) for a GPU.
# Model files default to $UPF_MODEL_DIR, else the models/ of ci/fetch-models.sh's cache
# ($UPF_MODEL_CACHE, default ~/.cache/uniprefill); a model whose file is absent is skipped with a line.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
models=${UPF_MODEL_DIR:-${UPF_MODEL_CACHE:-$HOME/.cache/uniprefill}/models}
smollm=$models/SmolLM2-135M-Instruct.Q4_1.gguf
gemma=$models/gemma-3-270m-q4_k_m.gguf
backend=cpu
preset=cpu
out=$here/build/accuracy
upf=$here/build/upf
plist=0.8,0.9,0.95,0.975,0.99,0.995,0.999
only=
# The natural text: the licence texts Debian's base-files package ships (present on every Debian
# system), joined in this order; upf eval's default is the same list.
# UPF_TEXT_DIR takes the same files from another folder (a machine without them: perf/carry_models.sh
# carries this machine's copies; text.sha256 in the output records which bytes were read).
text_dir=${UPF_TEXT_DIR:-/usr/share/common-licenses}
texts=("$text_dir/GPL-3" "$text_dir/Apache-2.0" "$text_dir/MPL-2.0" "$text_dir/GFDL-1.3" "$text_dir/LGPL-2.1"
  "$text_dir/GPL-2" "$text_dir/MPL-1.1" "$text_dir/Artistic" "$text_dir/CC0-1.0")

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
run) ;;
summary)
  [ $# -ge 1 ] || { usage >&2; exit 2; }
  dir=$1; shift
  report=$here/perf/reports/accuracy
  while [ $# -gt 0 ]; do
    case "$1" in
    --report) report=$2; shift 2 ;;
    *) echo "accuracy.sh summary: unknown argument $1" >&2; exit 2 ;;
    esac
  done
  py=${UPF_PLOT_PYTHON:-$HOME/.cache/uniprefill/venv-plot/bin/python}
  [ -x "$py" ] || py=python3
  exec "$py" "$here/perf/plot_accuracy.py" "$dir" --out "$report"
  ;;
-h|--help) usage; exit 0 ;;
*) usage >&2; exit 2 ;;
esac

while [ $# -gt 0 ]; do
  case "$1" in
  --smollm) smollm=$2; shift 2 ;;
  --gemma) gemma=$2; shift 2 ;;
  --backend) backend=$2; shift 2 ;;
  --preset) preset=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  --upf) upf=$2; shift 2 ;;
  --p) plist=$2; shift 2 ;;
  --only) only=$2; shift 2 ;;
  *) echo "accuracy.sh run: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$preset" in cpu|full) ;; *) echo "accuracy.sh: --preset $preset: want cpu or full" >&2; exit 2 ;; esac
[ -x "$upf" ] || { echo "accuracy.sh: $upf is not built (make)" >&2; exit 2; }
mkdir -p "$out"
text_list=$(IFS=,; echo "${texts[*]}")
sha256sum "${texts[@]}" >"$out/text.sha256"

# One upf eval run into $out/$name.json, logged to commands.txt; skipped when its JSON exists.
eval_run() {
  local name=$1; shift
  local json=$out/$name.json
  if [ -s "$json" ]; then
    echo "accuracy.sh: $name: done already ($json)"
    return 0
  fi
  local start=$SECONDS
  echo "accuracy.sh: $name: upf eval $*" >&2
  if "$upf" eval "$@" --backend "$backend" --text-file "$text_list" --json "$json" >"$out/$name.log" 2>&1; then
    echo "upf eval $* --backend $backend --text-file $text_list --json $json   # $((SECONDS - start)) s" >>"$out/commands.txt"
    tail -n 3 "$out/$name.log"
  else
    echo "accuracy.sh: $name failed (log: $out/$name.log):" >&2
    tail -n 5 "$out/$name.log" >&2
    echo "# FAILED: upf eval $* --backend $backend  # $((SECONDS - start)) s" >>"$out/commands.txt"
  fi
}

# `task TAG FILE ppl|next-token|needle|floor TOKENS COUNT`: one run; COUNT is the windows (ppl,
# next-token, floor) or the trials a depth (needle).
have() { # tag file: whether this model runs
  if [ -n "$only" ] && [ "$only" != "$1" ]; then return 1; fi
  if [ ! -f "$2" ]; then
    echo "accuracy.sh: $1: $2 absent, skipped (ci/fetch-models.sh fetches it)"
    return 1
  fi
}
task() { # tag file task tokens count
  local tag=$1 file=$2 t=$3 n=$4 c=$5
  have "$tag" "$file" || return 0
  case "$t" in
  ppl) eval_run "$tag-ppl-$n" --gguf "$file" --task ppl --tokens "$n" --windows "$c" ;;
  next-token) eval_run "$tag-next-token-$n" --gguf "$file" --task next-token --tokens "$n" --windows "$c" --p "$plist" ;;
  needle) eval_run "$tag-needle-$n" --gguf "$file" --task needle --tokens "$n" --trials "$c" --p "$plist" ;;
  # p = 1 (UniPrefill keeps every token: must equal dense) and dense in the other dtype against dense
  floor) eval_run "$tag-floor-$n" --gguf "$file" --task next-token --tokens "$n" --windows "$c" --p 1 --dtype-floor ;;
  esac
}

if [ "$preset" = full ]; then
  for n in 2048 4096 8192; do
    task smollm "$smollm" ppl $n 8
    task smollm "$smollm" next-token $n 16
    task smollm "$smollm" floor $n 16
    task smollm "$smollm" needle $n 4
  done
  for n in 2048 4096 8192 16384 32768; do
    task gemma "$gemma" ppl $n 4
    task gemma "$gemma" next-token $n 16
    task gemma "$gemma" floor $n 16
    task gemma "$gemma" needle $n 4
  done
else
  # the most telling runs first: an interrupted CPU sweep still has both models at 2K
  task smollm "$smollm" next-token 2048 8
  task gemma "$gemma" next-token 2048 8
  task smollm "$smollm" needle 2048 1
  task gemma "$gemma" needle 2048 1
  task smollm "$smollm" ppl 2048 4
  task gemma "$gemma" ppl 2048 4
  task smollm "$smollm" floor 2048 4
  task gemma "$gemma" floor 2048 4
  task smollm "$smollm" next-token 4096 4
  task smollm "$smollm" needle 4096 1
fi
echo "accuracy.sh: JSON in $out; summarise with: perf/accuracy.sh summary $out"

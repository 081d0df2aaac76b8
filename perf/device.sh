#!/usr/bin/env bash
# The one driver of GPU evidence. Here (a machine that builds) it stages what a GPU machine needs; there
# (the device tool's machine: a copy of this working tree, $OUT comes back, 10 minutes a call, at most 8
# files back) it runs the checks and timings and writes everything under $OUT/<commit>-<name>/, with
# commands.txt naming each exact command it ran and summary.txt one line a result.
#
#   here:   perf/device.sh stage [--as NAME]          build (make all), pack .devbin/NAME.tar.xz (default bundle)
#   there:  bash perf/device.sh COMMAND [options]     (carry [".devbin"]; [".devbin", ".whl"] for the FLA peer)
#     verify [OPS...] [--quick] [--case TEXT]
#                                         upf verify of each op or prefix (default: every family), side by side;
#                                         --case: only the seeded cases whose name holds TEXT (e.g. '1M')
#     sanitize [OPS...] [--tools LIST] [--split] [--case TEXT]
#                                         compute-sanitizer (memcheck,racecheck,initcheck,synccheck) over `upf verify OP --quick`;
#                                         --split: an op one process a kernel variant, the model checks one a tiny
#                                         model, side by side (racecheck of attn.paged, initcheck of the models)
#     test                                test_upf, every CUnit suite with the device
#     bench [--filter REGEX] [--reps N] [--ab VAR=a,b | --base BUNDLE]
#                                         bench_upf JSON; --ab times A, B, A (A again: drift shows as A != A) with
#                                         VAR=a then VAR=b (an empty value unsets VAR), e.g.
#                                         --ab UPF_VARIANT=,attn.prefill=fa2 or --ab UPF_MOE_BUCKETS=auto,4;
#                                         --base times this bundle, BUNDLE (another commit's stage), this one again
#     peers [sdpa|matmul|fla|vllm|prefill[:MODEL] ...]
#                                         the PyTorch / FLA / vLLM fused_moe (.peers/vllm, carried) peer scripts
#                                         of perf/peers on the benchmarks' shapes;
#                                         prefill[:MODEL]: the end-to-end PyTorch peer (perf/peers/torch_prefill.py,
#                                         MODEL llama, gemma or qwen3-next, the default) at --runs (default 32768
#                                         131072), with --shared (its --shared-weights) and --layers 0:N; FLA from .whl
#     profile BENCH [--kernel REGEX] [--skip N] [--count N] [--set SET | --section S ... | --metrics LIST]
#                                         ncu (clocks left alone) of one benchmark's kernel launches
#                                         --filter-mode per-launch-config: skip and count per launch shape
#                                         (the timed shape's launch without counting the verify launches)
#     prefill [MODELS...] [--runs "T1 T2,T2 ..."] [--keep R1,R2] [--layers A:B] [--iters N]
#                                         end-to-end TTFT (upf prefill, bf16, cuda): per model (default
#                                         llama3.1-8b gemma3-12b) and run (a length, or a comma list: one
#                                         batch; default "8192 32768 131072"), UniPrefill at each top-k keep
#                                         ratio (default 0.5,0.3,0.2) with --ideal, which also times dense
#     methods [MODELS...] [--runs "T1 T2"] [--alpha A[,A2...]] [--keep R1,R2] [--layers A:B] [--iters N] [--shared]
#                                         the three methods end to end (upf prefill, bf16, cuda), per model
#                                         (default llama3.1-8b gemma3-12b) and length (default "32768 131072"):
#                                         dense, FlashPrefill V2 (--mode flashprefill; --alpha A, default the
#                                         mode's 0.18 at block_n 128), UniPrefill at the model's p, and UniPrefill
#                                         top-k at FlashPrefill's full-attention work (where the drop layers allow;
#                                         else at its kept share); methods/table.md (perf/methods_table.py: TTFT,
#                                         speedup, kept share, full-attention work, time by layer kind), JSON a run
#     serve [MODEL] [--keep R1,R2]        perf/serve_sweep.sh: upf serve-sim dense vs UniPrefill top-k (default
#                                         llama3.1-8b, keep 0.5,0.3) at 1, 4, 16, 64 requests of 8K-32K tokens
#                                         (SERVE_* settings: serve_sweep.sh --help); JSON and summary.md under serve/
#     tp [MODELS...] [--runs "T1 T2"] [--iters N]
#                                         tensor parallelism with one NCCL rank on this GPU: test_upf's tp suite
#                                         (NCCL bootstrapped through a unique-id file: all-reduce identity, TP
#                                         path = plain path), then UniPrefill TTFT (bf16, cuda) on the plain path
#                                         and on the TP path (--comm nccl --tp 1) per model (default llama3.1-8b)
#                                         and run (default "8192 32768"); tp/tp.json: both TTFTs, the overhead,
#                                         all-reduce bytes per drop layer and their share of the selection time
#     compact                             CompactAttention (issue 24) in one call: upf verify compact and attn.paged
#                                         and the sanitizers over compact side by side with test_upf's compact_attn,
#                                         model_compact and chunked suites (cap CHECK_S, default 240), then the
#                                         perf/bench_compact.c rows alone on the GPU (cap BENCH_S, default 300): chunk
#                                         attention dense / zero-copy / copy at 32K-128K (8K chunks) with kept_share
#                                         and vs_limit, the selector, union and tables; compact/table.txt
#     chunked [MODELS...] [--runs "T1 T2"] [--alpha A] [--layers A:B] [--iters N]
#                                         end to end with --chunk 8192 (CHUNK=C to change): chunked dense, chunked
#                                         CompactAttention, chunked FlashPrefill V2, unchunked dense and unchunked
#                                         UniPrefill (upf prefill, bf16, cuda) per model (default llama3.1-8b) and
#                                         length (default "32768 131072"); chunked/table.txt: TTFT and kept shares
#     shared [MODEL] [--runs T] [--layers A:B]
#                                         --shared-weights against distinct weights (dense prefill, default
#                                         qwen3-next-80b-a3b, layers 0:12, 32768 tokens): distinct, shared, distinct
#                                         again; per-layer times side by side (perf/shared_table.py)
#     chunkserve [MODEL] [--runs "T1 T2"]
#                                         serving under decode load (default llama3.1-8b, long prompts 32768 and
#                                         131072 beside 32 decoding requests): unchunked dense and UniPrefill,
#                                         chunked (CHUNK, default 8192) dense, CompactAttention and FlashPrefill V2;
#                                         chunkserve/table.md: long-prompt TTFT, decode TPOT p50/p99, throughput
#     determinism [MODEL] [--runs BATCH] [--iters N]
#                                         N (default 100) UniPrefill prefills of one batch (default llama3.1-8b,
#                                         32768,8192), each bit for bit against the first (--check-determinism)
#     timeline [MODELS...] [--runs "T1 T2"] [--keep R]
#                                         one prefill's GPU timeline (upf prefill --timeline: CUPTI, bf16, cuda) per
#                                         model (default llama3.1-8b) and length (default 8192): dense, and UniPrefill
#                                         top-k at --keep R when given; the breakdown (busy, idle, time by kind of
#                                         kernel, gaps by length) into timeline/ and the summary, the Chrome traces
#                                         beside them
#     report [--quick] [--filter REGEX] [--peers]
#                                         upf report (the main job) on this card, into report/r/ (report.md, report.json,
#                                         plots when matplotlib is carried in .whl): --quick the CI size set (8K; a full
#                                         report's 8K-128K of three families takes longer than one call); the
#                                         benchmarks matching --filter (default REPORT_BENCH: the reference set);
#                                         --peers first runs the peers (sdpa, matmul, fla, vllm: carry .whl and
#                                         .peers) and hands their rows to upf report --peers (perf/peers/peer_rows.py)
#     session [--quick]                   the standard full pass: verify, sanitize and test side by side, then
#                                         bench alone on the GPU, then peers
#     side 'STEP' 'STEP' ...              up to 6 of the commands above side by side (each STEP a command line of this
#                                         script, quoted), the bundle unpacked once first; each step writes under its own
#                                         $OUT/sN-COMMAND, packed as sN-COMMAND.tar.xz; the steps' summaries in this one's.
#                                         e.g. side 'verify select.pipeline --case 1M --cap 500' 'sanitize attn.paged
#                                         --tools racecheck --split --cap 500'
#   options of every device command:
#     --name NAME     the folder's name after the commit (default the command's)
#     --env VAR=v     set for every command run (repeatable), e.g. --env UPF_VARIANT=attn.paged=ffma
#     --cap S         time limit of each command, seconds (session: of each phase, see its caps below)
#     --bundle FILE   the staged bundle (default .devbin/bundle.tar.xz of the checkout)
#     --shared        prefill / methods: seeded models with --shared-weights (full depth of a model too large)
# A command that fails or runs out of time stops nothing after it; the exit status is 1 if any did.
# Several commands in one device call write several folders; when more than 8 files would come back,
# each step's folder is packed into <step>.tar.xz (summary.txt and commands.txt stay loose).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s)
STATUS=0

die() {
  echo "device.sh: $*" >&2
  exit 2
}
usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

# ---------------------------------------------------------------------------------------------- stage
# The bundle: bin/ (upf, test_upf, bench_upf, stripped), lib/ (the shared libraries of the Debian
# packages they link, which the device machine lacks, and the toolkit's libcupti), peers/ (perf/peers/*.py),
# device.sh, COMMIT.
STAGE_LIBS="libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libcunit.so.1 libbenchmark.so.1debian"
BUNDLE_MAX=$((64 * 1024 * 1024)) # the device tool carries at most 64 MiB, working tree included

stage() {
  local as=bundle
  while [ $# -gt 0 ]; do
    case $1 in
    --as) as=${2:?--as needs a name}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "stage: unknown argument $1" ;;
    esac
  done
  local repo
  repo=$(cd "$HERE/.." && pwd)
  if [ ! -f "$repo/Makefile" ] || [ ! -d "$repo/perf/peers" ]; then die "stage runs from the checkout (perf/device.sh)"; fi
  cd "$repo" || die "stage: cannot enter $repo"
  make -j"$(nproc)" all >/dev/null || die "stage: make all failed"
  local st
  st=$(mktemp -d) || die "stage: mktemp failed"
  # shellcheck disable=SC2064 # the folder is known now
  trap "rm -rf '$st'" EXIT
  mkdir -p "$st/bin" "$st/lib" "$st/peers" .devbin
  cp build/upf build/test_upf build/bench_upf "$st/bin/" || die "stage: cannot copy the binaries"
  strip "$st"/bin/* || die "stage: strip failed"
  local lib path
  for lib in $STAGE_LIBS; do
    path=$(ldd build/test_upf build/bench_upf | awk -v l="$lib" '$1 == l { print $3; exit }')
    [ -n "$path" ] || die "stage: $lib is not linked by test_upf or bench_upf"
    cp -L "$path" "$st/lib/"
  done
  # libcupti for upf prefill --timeline, in case the device's toolkit lacks it (the timeline opens it at run time)
  for path in /usr/local/cuda/lib64/libcupti.so.13 /usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13; do
    if [ -f "$path" ]; then cp -L "$path" "$st/lib/" && break; fi
  done
  cp perf/peers/*.py "$st/peers/"
  mkdir -p "$st/perf" && cp perf/report_plots.py "$st/perf/" # upf report runs it from its working folder
  cp perf/device.sh perf/serve_sweep.sh "$st/"
  local commit
  commit=$(git rev-parse --short HEAD)
  if ! git diff --quiet HEAD -- .; then
    commit=$commit-dirty
    echo "device.sh stage: warning: uncommitted changes are in the build ($commit)" >&2
  fi
  echo "$commit" >"$st/COMMIT"
  tar -C "$st" -cJf ".devbin/$as.tar.xz" . || die "stage: tar failed"
  local size
  size=$(stat -c %s ".devbin/$as.tar.xz")
  [ "$size" -le "$BUNDLE_MAX" ] || die "stage: .devbin/$as.tar.xz is $size bytes, over the 64 MiB the device tool carries"
  echo ".devbin/$as.tar.xz: $commit, $((size / 1024)) KiB (carry [\".devbin\"])"
}

# --------------------------------------------------------------------------------- device-side helpers
# unpack BUNDLE DIR: the bundle into DIR, unless DIR already holds this very file's contents.
unpack() {
  local stamp
  stamp=$(stat -c %s-%Y "$1") || die "no bundle at $1 (stage it here: perf/device.sh stage; carry .devbin)"
  if [ "$(cat "$2/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$2"
    if ! mkdir -p "$2" || ! tar -C "$2" -xJf "$1"; then die "cannot unpack $1 into $2"; fi
    echo "$stamp" >"$2/.stamp"
  fi
}

# setup: find the bundle (the folder this script runs from when unpacked, else the checkout's
# .devbin/bundle.tar.xz unpacked to /tmp/upf-dev), export what its binaries need, make $DIR.
setup() {
  OUT=${OUT:?set OUT: the folder that comes back (the device tool sets it)}
  if [ -z "$BUNDLE" ] && [ -x "$HERE/bin/upf" ]; then
    DEV=$HERE
  else
    BUNDLE=${BUNDLE:-$HERE/../.devbin/bundle.tar.xz}
    DEV=${UPF_DEV:-/tmp/upf-dev}
    unpack "$BUNDLE" "$DEV"
  fi
  REPO=$(cd "$HERE/.." && pwd)
  COMMIT=$(cat "$DEV/COMMIT" 2>/dev/null || echo unknown)
  export UPF_COMMIT=$COMMIT PYTHONUNBUFFERED=1
  export LD_LIBRARY_PATH=$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # libnccl (opened at run time by the NCCL communicator): the loader's, else the pip package's
  if [ -z "${UPF_NCCL_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2'; then
    local lib
    lib=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(m.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null)
    [ -n "$lib" ] && [ -f "$lib" ] && export UPF_NCCL_LIB=$lib
  fi
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  NPROC=$(nproc)
  DIR=$OUT/$COMMIT-$NAME
  mkdir -p "$DIR" || die "cannot make $DIR"
  CMDS=$DIR/commands.txt
  local gpu="no nvidia-smi"
  command -v nvidia-smi >/dev/null &&
    gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -n 1)
  say "commit $COMMIT, bundle $DEV; $gpu${ENVS[*]:+; env ${ENVS[*]}}"
}

say() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$DIR/summary.txt"; }

# run LOG CAP [ENV ...] -- CMD...: CMD in the bundle's folder under `env ENVS ENV` and `timeout CAP`,
# its output to LOG, "# rc=N" appended; the exact command goes to commands.txt. ENV items are env's
# arguments (VAR=v, or -u VAR). Returns CMD's status.
run() {
  local log=$1 cap=$2 rc
  shift 2
  local envs=("${ENVS[@]}")
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  mkdir -p "$(dirname "$log")"
  # one write per line: commands run side by side append to the same file
  local line
  line=$(printf '(cd %q && env' "$DEV"; printf ' %q' "${envs[@]}" timeout "$cap" "$@"; printf ') > %q 2>&1' "$log")
  printf '%s\n' "$line" >>"$CMDS"
  (cd "$DEV" && env "${envs[@]}" timeout "$cap" "$@") >"$log" 2>&1
  rc=$?
  [ -z "$(tail -c 1 "$log")" ] || echo >>"$log" # a killed command may leave its last line open
  echo "# rc=$rc" >>"$log"
  return "$rc"
}

# pool N: wait until fewer than N background jobs run.
pool() { while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do wait -n; done; }

# note LOG: one summary line for a log (check counts, sanitizer summaries, test totals, rc), then its
# first failures; a non-zero rc makes the driver's status 1.
note() {
  local rc
  rc=$(grep -oE '^# rc=[0-9]+' "$1" | tail -n 1 | cut -d= -f2)
  say "${1#"$DIR"/}: $(grep -E '^# [0-9]+ checks|ERROR SUMMARY|RACECHECK SUMMARY|^ +(tests|asserts) ' "$1" |
    tr -s ' ' | tr '\n' ' ')rc=${rc:-none}$([ "${rc:-}" = 124 ] && echo ' (timed out)')"
  grep -E '^FAIL|Failed|FAILED|not timed' "$1" | cut -c1-220 | head -n 4 | tee -a "$DIR/summary.txt"
  [ "${rc:-1}" = 0 ] || STATUS=1
}

# The op families: the first word of each op name in `upf ops` (select, gemm, attn, moe, ...; its
# indented "variant" lines are not ops), then the model checks (model.prefill, model.generate).
families() {
  (cd "$DEV" && bin/upf ops) | awk '/^[a-z]/ { split($1, a, "."); if (!seen[a[1]]++) print a[1] }'
  echo model
}

# finish: when more than 8 files would come back, pack each step folder (one archive per folder), and
# if that is not enough, each earlier command's whole folder.
finish() {
  local n d
  n=$(find "$OUT" -type f | wc -l)
  if [ "$n" -gt 8 ]; then
    for d in "$OUT"/*/*/; do
      [ -d "$d" ] || continue
      # an earlier step of this call packed the same folder: merge its files back (this step's files win)
      [ -f "${d%/}.tar.xz" ] && tar -C "$(dirname "$d")" --skip-old-files -xJf "${d%/}.tar.xz"
      tar -C "$(dirname "$d")" -cJf "${d%/}.tar.xz" "$(basename "$d")" && rm -rf "$d"
    done
  fi
  n=$(find "$OUT" -type f | wc -l)
  if [ "$n" -gt 8 ]; then # then each earlier command's folder as one archive
    for d in "$OUT"/*/; do
      [ "${d%/}" != "$DIR" ] || continue
      tar -C "$OUT" -cJf "${d%/}.tar.xz" "$(basename "$d")" && rm -rf "$d"
    done
  fi
  n=$(find "$OUT" -type f | wc -l)
  [ "$n" -le 8 ] || say "warning: $n files under OUT; the device tool returns 8"
  say "done, status $STATUS: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
}

# -------------------------------------------------------------------------------------------- steps
# verify [OPS...] [--quick]: each op or prefix in its own process, side by side; OpenBLAS threads
# shared among them (the CPU reference is the long pole of the full sets).
do_verify() {
  local quick=$1 cap=$2
  shift 2
  local ops=("$@") op
  [ ${#ops[@]} -gt 0 ] || mapfile -t ops < <(families)
  local threads=$((NPROC / ${#ops[@]}))
  [ "$threads" -ge 1 ] || threads=1
  say "verify${quick:+ $quick}${CASE:+ --case '$CASE'} ${ops[*]} (cap $cap s, $threads BLAS threads each)"
  for op in "${ops[@]}"; do
    run "$DIR/verify/verify-$op${quick:+-quick}.log" "$cap" OPENBLAS_NUM_THREADS=$threads -- \
      bin/upf verify "$op" ${quick:+"$quick"} ${CASE:+--case "$CASE"} &
  done
  wait
  for op in "${ops[@]}"; do note "$DIR/verify/verify-$op${quick:+-quick}.log"; done
}

# prefill MODELS: one process a (model, run, keep ratio): upf prefill --ideal prints and records dense
# TTFT, the ideal at the kept counts, UniPrefill TTFT and the selection's share; JSON under prefill/.
do_prefill() {
  local cap=$1
  shift
  local models=("$@") m run r tag
  [ ${#models[@]} -gt 0 ] || models=(llama3.1-8b gemma3-12b)
  say "prefill ${models[*]}: runs '$RUNS', keep $KEEPS${LAYERS:+, layers $LAYERS} (cap $cap s each)"
  for m in "${models[@]}"; do
    for run in $RUNS; do
      for r in ${KEEPS//,/ }; do
        tag=$m-${run//,/+}${LAYERS:+-layers${LAYERS/:/-}}-keep$r
        run "$DIR/prefill/$tag.log" "$cap" -- bin/upf prefill --model "$m" --lengths "$run" --mode uniprefill \
          --select topk --keep "$r" --backend cuda --dtype bf16 --warmup 1 --iters "$ITERS" --ideal \
          ${LAYERS:+--layers "$LAYERS"} ${SHARED:+"$SHARED"} --json "$DIR/prefill/$tag.json"
        note "$DIR/prefill/$tag.log"
        grep -E 'UniPrefill =' "$DIR/prefill/$tag.log" | sed "s/^ */$tag: /" | tee -a "$DIR/summary.txt"
      done
    done
  done
}

# methods MODELS: dense, FlashPrefill V2, UniPrefill (the model's p) and UniPrefill top-k at FlashPrefill's
# kept share, one process each, for each model and length; the table of perf/methods_table.py.
do_methods() {
  local cap=$1
  shift
  local models=("$@") m t r base share runs=${RUNS_SET:+$RUNS}
  [ ${#models[@]} -gt 0 ] || models=(llama3.1-8b gemma3-12b)
  runs=${runs:-32768 131072}
  say "methods ${models[*]}: runs '$runs'${ALPHA:+, alpha $ALPHA}${LAYERS:+, layers $LAYERS} (cap $cap s each)"
  mkdir -p "$DIR/methods"
  for m in "${models[@]}"; do
    for t in $runs; do
      base=$DIR/methods/$m-$t
      local common=(bin/upf prefill --model "$m" --lengths "$t" --backend cuda --dtype bf16 --warmup 1 --iters "$ITERS"
        ${LAYERS:+--layers "$LAYERS"} ${SHARED:+"$SHARED"})
      run "$base-dense.log" "$cap" -- "${common[@]}" --mode dense --json "$base-dense.json"
      note "$base-dense.log"
      # --alpha A1,A2,...: the first as "flashprefill", each other as "flashprefill-aA" (on seeded weights
      # the published 0.18 keeps every block; a larger alpha reaches a realistic kept share)
      local alphas=() a fp
      IFS=, read -r -a alphas <<<"$ALPHA"
      [ ${#alphas[@]} -gt 0 ] || alphas=("")
      for a in "${alphas[@]}"; do
        fp=flashprefill${a:+-a$a}
        [ "$a" = "${alphas[0]}" ] && fp=flashprefill
        run "$base-$fp.log" "$cap" -- "${common[@]}" --mode flashprefill ${a:+--alpha "$a"} --json "$base-$fp.json"
        note "$base-$fp.log"
      done
      run "$base-uniprefill-topp.log" "$cap" -- "${common[@]}" --mode uniprefill --json "$base-uniprefill-topp.json"
      note "$base-uniprefill-topp.log"
      share=$(python3 -c 'import json, sys; print("%.3f" % json.load(open(sys.argv[1]))["kept_share"])' \
        "$base-flashprefill.json" 2>/dev/null)
      for r in ${KEEPS_SET:+${KEEPS//,/ }}; do # --keep: UniPrefill top-k at these ratios too
        run "$base-uniprefill-keep$r.log" "$cap" -- "${common[@]}" --mode uniprefill --select topk --keep "$r" \
          --json "$base-uniprefill-keep$r.json"
        note "$base-uniprefill-keep$r.log"
      done
      # UniPrefill top-k at FlashPrefill's full-attention work (perf/methods_table.py --keep-for-work, from the
      # top-p run's drop layers); where even keep -> 0 does more work (the layers before the first drop run
      # whole), at FlashPrefill's kept share as a keep ratio instead, and the summary says so
      local keep=""
      [ -n "$share" ] && keep=$(python3 "$REPO/perf/methods_table.py" --keep-for-work "$base-uniprefill-topp.json" "$share" 2>/dev/null)
      if [ -z "$keep" ] && [ -n "$share" ]; then
        say "methods $m $t: FlashPrefill's full-attention work $share is below what UniPrefill can do (its first drop layer); keep $share instead"
        keep=$share
      fi
      if [ -n "$keep" ]; then
        run "$base-uniprefill-keep$keep.log" "$cap" -- "${common[@]}" --mode uniprefill --select topk --keep "$keep" \
          --json "$base-uniprefill-keep$keep.json"
        note "$base-uniprefill-keep$keep.log"
      fi
    done
  done
  python3 "$REPO/perf/methods_table.py" "$DIR/methods" --out "$DIR/methods/table.md" --json "$DIR/methods/table.json" &&
    tee -a "$DIR/summary.txt" <"$DIR/methods/table.md" >/dev/null
}

# shared [MODEL]: what --shared-weights does to the time: dense prefill of the layer range (default 0:12) with
# distinct weights, shared weights, distinct again (drift shows as A != A), per run (default 32768); the
# per-layer times side by side in shared/table.txt.
do_shared() {
  local cap=$1 m=${2:-qwen3-next-80b-a3b} t tag runs=${RUNS_SET:+$RUNS} layers=${LAYERS:-0:12}
  runs=${runs:-32768}
  say "shared $m: layers $layers, runs '$runs', distinct / shared / distinct (cap $cap s each)"
  mkdir -p "$DIR/shared"
  for t in $runs; do
    for tag in distinct1 shared distinct2; do
      local flag=()
      [ "$tag" = shared ] && flag=(--shared-weights)
      run "$DIR/shared/$m-$t-$tag.log" "$cap" -- bin/upf prefill --model "$m" --lengths "$t" --backend cuda --dtype bf16 \
        --warmup 1 --iters "$ITERS" --layers "$layers" --mode dense "${flag[@]}" --json "$DIR/shared/$m-$t-$tag.json"
      note "$DIR/shared/$m-$t-$tag.log"
    done
    run "$DIR/shared/table-$t.txt" 60 -- python3 "$REPO/perf/shared_table.py" "$DIR/shared/$m-$t-distinct1.json" \
      "$DIR/shared/$m-$t-shared.json" "$DIR/shared/$m-$t-distinct2.json"
    tee -a "$DIR/summary.txt" <"$DIR/shared/table-$t.txt" >/dev/null
  done
}

# chunkserve [MODEL]: serving under decode load (issue 24): perf/chunkserve_trace.py's trace, 32 decoding
# requests at t = 0 and one long prompt per run length after them, served by serve-sim as unchunked dense,
# unchunked UniPrefill (the model's p), and with --chunk $CHUNK: dense, CompactAttention, FlashPrefill V2;
# chunkserve/table.md: the long prompts' TTFT, the decodes' TPOT (p50 / p99), throughput, kept share.
do_chunkserve() {
  local cap=$1 m=${2:-llama3.1-8b} runs=${RUNS_SET:+$RUNS} chunk=${CHUNK:-8192} name
  runs=${runs:-32768 131072}
  say "chunkserve $m: long prompts '$runs' beside 32 decodes, chunk $chunk (cap $cap s each)"
  mkdir -p "$DIR/chunkserve"
  local trace=$DIR/chunkserve/trace.jsonl
  python3 "$REPO/perf/chunkserve_trace.py" "$trace" "${runs// /,}" || { STATUS=1; return; }
  local -A args=([dense]="--mode dense" [uniprefill]="--mode uniprefill"
    [dense-chunked]="--mode dense --chunk $chunk" [compact-chunked]="--mode compact --chunk $chunk"
    [flashprefill-chunked]="--mode flashprefill --chunk $chunk")
  for name in dense uniprefill dense-chunked compact-chunked flashprefill-chunked; do
    # shellcheck disable=SC2086 # the mode's flags are words
    run "$DIR/chunkserve/$m-$name.log" "$cap" -- bin/upf serve-sim --model "$m" --backend cuda --dtype bf16 \
      --trace "$trace" --token-budget $((chunk + 64)) ${args[$name]} --json "$DIR/chunkserve/$m-$name.json"
    note "$DIR/chunkserve/$m-$name.log"
  done
  run "$DIR/chunkserve/table.md" 60 -- python3 - "$DIR/chunkserve" <<'PY'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f)); p = d["points"][0]; reqs = p["per_request"]
    longs = {r["prompt_len"]: r.get("ttft_ms") for r in reqs if r.get("prompt_len", 0) > 4096}
    tpot = sorted(r["tpot_ms"] for r in reqs if r.get("prompt_len", 0) <= 4096 and "tpot_ms" in r)
    share = p.get("sparse", {}).get("kept_share")  # the compact / flashprefill selector's, per point
    rows.append((os.path.basename(f)[:-5], longs, tpot, p["output_tokens_per_s"], share))
lens = sorted({n for row in rows for n in row[1]})
print("| run | " + " | ".join(f"TTFT ms, {n}-token prompt" for n in lens) +
      " | decodes' TPOT ms (p50 / max) | output tok/s | kept share |")
print("|---|" + "---:|" * (len(lens) + 3))
for name, longs, tpot, tps, share in rows:
    ttft = " | ".join(f"{longs[n]:.1f}" if longs.get(n) is not None else "-" for n in lens)
    dec = f"{tpot[len(tpot) // 2]:.2f} / {tpot[-1]:.2f}" if tpot else "-"
    print(f'| {name} | {ttft} | {dec} | {tps:.1f} | {share if share is not None else "-"} |')
PY
  grep -v '^# rc' "$DIR/chunkserve/table.md" | tee -a "$DIR/summary.txt" >/dev/null
}

# determinism [MODEL]: issue 28's check: --iters runs (default 100) of one UniPrefill top-p prefill of the
# batch RUNS (default "32768,8192", one batch), each compared bit for bit with the first (logits, drop masks).
do_determinism() {
  local cap=$1 m=${2:-llama3.1-8b} batch=${RUNS_SET:+$RUNS} iters=$ITERS
  batch=${batch:-32768,8192}
  [ "$iters" -gt 1 ] || iters=100
  say "determinism $m: $iters UniPrefill prefills of the batch $batch (cap $cap s)"
  run "$DIR/determinism/$m-${batch//,/+}.log" "$cap" -- bin/upf prefill --model "$m" --lengths "$batch" \
    --mode uniprefill --backend cuda --dtype bf16 --warmup 0 --iters "$iters" --check-determinism
  note "$DIR/determinism/$m-${batch//,/+}.log"
  grep -E 'determinism:' "$DIR/determinism/$m-${batch//,/+}.log" | tee -a "$DIR/summary.txt"
}

# timeline [MODELS...]: a dense prefill per model and length (and UniPrefill top-k at --keep) with --timeline;
# the breakdown lines go to the summary.
do_timeline() {
  local cap=$1
  shift
  local models=("$@") m t runs=${RUNS_SET:+$RUNS} mode base
  [ ${#models[@]} -gt 0 ] || models=(llama3.1-8b)
  runs=${runs:-8192}
  say "timeline ${models[*]}: runs '$runs'${KEEPS_SET:+, UniPrefill keep $KEEPS} (cap $cap s each)"
  mkdir -p "$DIR/timeline"
  for m in "${models[@]}"; do
    for t in $runs; do
      for mode in dense ${KEEPS_SET:+uniprefill}; do
        base=$DIR/timeline/$m-$t-$mode
        run "$base.log" "$cap" -- bin/upf prefill --model "$m" --lengths "$t" --backend cuda --dtype bf16 --warmup 1 \
          --iters 3 --mode "$mode" ${KEEPS_SET:+$([ "$mode" = uniprefill ] && echo --select topk --keep "$KEEPS")} \
          --timeline "$base.trace.json" --json "$base.json"
        note "$base.log"
        { echo "$m $t $mode:"; sed -n '/prefill .* ms (median/p; /timeline of one more run/,$p' "$base.log" | grep -v '^# rc'; } \
          | tee -a "$DIR/summary.txt" >/dev/null
      done
    done
  done
}

# serve [MODEL]: the serving sweep (perf/serve_sweep.sh), each serve-sim process capped at CAP seconds.
do_serve() {
  local cap=$1 model=${2:-llama3.1-8b} keeps=$KEEPS
  [ "$KEEPS_SET" ] || keeps=0.5,0.3
  say "serve $model: dense and keep $keeps (cap $cap s each)"
  run "$DIR/serve/sweep.log" 580 -- bash "$HERE/serve_sweep.sh" --upf bin/upf --out "$DIR/serve" --model "$model" \
    --keep "$keeps" --cap "$cap"
  note "$DIR/serve/sweep.log"
  grep -E '^serve-|^\|' "$DIR/serve/sweep.log" | tee -a "$DIR/summary.txt"
}

# tp MODELS: see the usage. libnccl: UPF_NCCL_LIB, else the loader's path, else the pip package
# nvidia-nccl-cu* of python3 (the CUDA images may carry NCCL only there; setup looks).
do_tp() {
  local cap=$1
  shift
  local models=("$@") m run tag runs=${RUNS_SET:+$RUNS}
  [ ${#models[@]} -gt 0 ] || models=(llama3.1-8b)
  runs=${runs:-8192 32768}
  say "tp: NCCL ${UPF_NCCL_LIB:-on the loader path}; models ${models[*]}, runs '$runs' (cap $cap s each)"
  mkdir -p "$DIR/tp"
  run "$DIR/tp/test_upf-tp.log" "$cap" TMPDIR=/tmp -- sh -c 'cd bin && exec ./test_upf tp'
  note "$DIR/tp/test_upf-tp.log"
  for m in "${models[@]}"; do
    for run in $runs; do
      tag=$m-${run//,/+}
      run "$DIR/tp/$tag-plain.log" "$cap" -- bin/upf prefill --model "$m" --lengths "$run" --mode uniprefill \
        --backend cuda --dtype bf16 --warmup 1 --iters "$ITERS" --json "$DIR/tp/$tag-plain.json"
      note "$DIR/tp/$tag-plain.log"
      run "$DIR/tp/$tag-tp1.log" "$cap" -- bin/upf prefill --model "$m" --lengths "$run" --mode uniprefill \
        --backend cuda --dtype bf16 --warmup 1 --iters "$ITERS" --comm nccl --tp 1 --json "$DIR/tp/$tag-tp1.json"
      note "$DIR/tp/$tag-tp1.log"
    done
  done
  run "$DIR/tp/tp-summary.txt" 60 -- python3 - "$DIR/tp" <<'PY'
import glob, json, os, sys
d = sys.argv[1]; rows = []
for plain in sorted(glob.glob(os.path.join(d, "*-plain.json"))):
    tp = plain.replace("-plain.json", "-tp1.json")
    if not os.path.exists(tp):
        continue
    a, b = json.load(open(plain)), json.load(open(tp))
    drops = [{"layer": x["layer"], "tokens_in": x["tokens_in"], "allreduce_bytes": x.get("allreduce_bytes"),
              "allreduce_ms": x.get("allreduce_ms"), "tp_select_ms": x.get("tp_select_ms"),
              "allreduce_share_of_selection": (x["allreduce_ms"] / x["tp_select_ms"]) if x.get("tp_select_ms") else None,
              "plain_select_ms": y["select_ms"], "tp_drop_step_ms": x["select_ms"], "tp_split_ms": x.get("tp_split_ms")}
             for x, y in zip(b["drops"], a["drops"])]
    r = {"model": a["model"], "requests": a["requests"], "plain_ttft_ms": a["ttft_ms"]["median"],
         "tp1_ttft_ms": b["ttft_ms"]["median"], "overhead": b["ttft_ms"]["median"] / a["ttft_ms"]["median"] - 1,
         "tp_allreduce": b.get("tp"), "drops": drops, "commit": a["commit"]}
    rows.append(r)
    print(f'{r["model"]} {r["requests"]}: plain {r["plain_ttft_ms"]:.2f} ms, TP path (NCCL, 1 rank) '
          f'{r["tp1_ttft_ms"]:.2f} ms: overhead {100 * r["overhead"]:+.2f}%; '
          + "; ".join(f'drop {x["layer"]}: {x["allreduce_bytes"]:.0f} B all-reduced, {x["allreduce_ms"]:.3f} of '
                      f'{x["tp_select_ms"]:.3f} ms selection' for x in drops if x["tp_select_ms"]))
    for x in drops:  # where the TP selection's time goes, against the plain selection + compaction
        sp = x["tp_split_ms"] or {}
        print(f'  drop {x["layer"]} ({x["tokens_in"]} tokens): TP selection {x["tp_select_ms"] or 0:.3f} ms = '
              + ", ".join(f'{k} {v:.3f}' for k, v in sp.items())
              + f' ms; TP drop step {x["tp_drop_step_ms"]:.3f} ms vs plain {x["plain_select_ms"]:.3f} ms')
json.dump(rows, open(os.path.join(d, "tp.json"), "w"), indent=1)
PY
  note "$DIR/tp/tp-summary.txt"
  grep -v '^# rc' "$DIR/tp/tp-summary.txt" | cut -c1-400 | tee -a "$DIR/summary.txt"
}

# sanitize [OPS...] TOOLS: each tool over `upf verify OP --quick`, at most 8 processes at once.
do_sanitize() {
  local tools=$1 cap=$2
  shift 2
  local ops=("$@") op tool part parts=() logs=()
  [ ${#ops[@]} -gt 0 ] || mapfile -t ops < <(families)
  say "sanitize ($tools) over verify --quick${CASE:+ --case '$CASE'} of ${ops[*]}${SPLIT:+, split} (cap $cap s each)"
  for tool in ${tools//,/ }; do
    for op in "${ops[@]}"; do
      if [ -n "$SPLIT" ]; then mapfile -t parts < <(split_parts "$op"); else parts=("|"); fi
      for part in "${parts[@]}"; do
        local tag=$tool-$op${part#*|}
        tag=${tag//[^A-Za-z0-9._-]/_}
        logs+=("$DIR/sanitize/$tag.log")
        pool 8
        # shellcheck disable=SC2086 # the part's options are words
        run "$DIR/sanitize/$tag.log" "$cap" OPENBLAS_NUM_THREADS=1 -- \
          "$SAN" --tool "$tool" --error-exitcode 9 bin/upf verify "$op" --quick ${CASE:+--case "$CASE"} ${part%%|*} &
      done
    done
  done
  wait
  for part in "${logs[@]}"; do note "$part"; done
}

# split_parts OP: the processes --split runs OP in, one line each: "OPTIONS|TAG". The model checks one tiny
# model a process (--case NAME); an op with kernel variants one variant a process (--variant op=name);
# anything else whole.
split_parts() {
  local op=$1 v
  case $op in
  model | model.*)
    for v in llama-tiny gemma3-tiny qwen3-next-tiny; do echo "--case $v|-$v"; done ;;
  *)
    local names
    names=$( (cd "$DEV" && bin/upf ops) | awk -v op="$op" '/^[a-z]/ { cur = $1 } /^  variant / && cur == op { print $2 }')
    if [ -z "$names" ]; then echo "|"; return; fi
    for v in $names; do echo "--variant $op=$v|-$v"; done ;;
  esac
}

do_test() {
  say "test_upf (cap $1 s)"
  run "$DIR/test/test_upf.log" "$1" -- sh -c 'cd bin && exec ./test_upf'
  note "$DIR/test/test_upf.log"
}

# The benchmarks of the standard pass (the reference shapes of perf/reports/H200/INDEX.md), one
# bench_upf process a family so that a cap cuts one family only.
BENCH_FAMILIES=(
  "select|^copy|^select/cuda/bf16/|^select[.]block_scores/"
  "dense|^copy|^gemm_ceiling|^(gemm|ffn|act_mul)/cuda/bf16/.*/T:(8192|32768)/|^(rmsnorm|rmsnorm_add|qk_norm|rope|gated_output|embed|logits_last|kv_cache_write)/cuda/"
  "moe|^copy|^moe\.(dense_equiv|ffn)/cuda/bf16/T:(8192|32768)/"
  "attn|^copy|^attn_prefill/cuda/bf16/|^attn_paged/cuda/bf16/"
  "gdn|^gdn\.scan/cuda/bf16/qwen3next_(prefill/chunked|batch16x2K/chunked|decode)/"
)

# bench_one TAG FILTER REPS CAP [ENV ...]: one bench_upf run into bench/bench-TAG.{json,log}.
bench_one() {
  local tag=$1 filter=$2 reps=$3 cap=$4 n=2
  shift 4
  # a second bench step of the same call (another --ab) gets bench-A1-2.json etc., not the first one's files
  local stem=$DIR/bench/bench-$tag
  while [ -e "$stem.json" ] || [ -e "$stem.log" ]; do stem=$DIR/bench/bench-$tag-$n n=$((n + 1)); done
  run "$stem.log" "$cap" "$@" -- bin/bench_upf --benchmark_filter="$filter" \
    ${reps:+--benchmark_repetitions="$reps"} --benchmark_out="$stem.json" --benchmark_out_format=json
  note "$stem.log"
  grep -E '_median ' "$stem.log" | sed -E 's/ +/ /g' | cut -c1-200 >>"$DIR/summary.txt"
  BENCH_JSON=$stem.json # for a step that reads what it just ran
}

# bench FILTER REPS CAP AB BASE: one run, or A/B/A over an env setting (AB = VAR=a,b) or a base bundle.
do_bench() {
  local filter=$1 reps=$2 cap=$3 ab=$4 base=$5
  mkdir -p "$DIR/bench"
  if [ -n "$ab" ]; then
    local var=${ab%%=*} vals=${ab#*=}
    if [ "$var" = "$ab" ] || [[ $vals != *,* ]]; then die "bench: --ab wants VAR=a,b, got '$ab'"; fi
    local a=${vals%%,*} b=${vals#*,}
    local ea=("$var=$a") eb=("$var=$b")
    [ -n "$a" ] || ea=(-u "$var")
    [ -n "$b" ] || eb=(-u "$var")
    say "bench A/B/A: A = ${ea[*]}, B = ${eb[*]}; filter $filter"
    bench_one A1 "$filter" "$reps" "$cap" "${ea[@]}"
    bench_one B "$filter" "$reps" "$cap" "${eb[@]}"
    bench_one A2 "$filter" "$reps" "$cap" "${ea[@]}"
    ab_table "B = ${eb[*]}"
  elif [ -n "$base" ]; then
    local bdir=${UPF_DEV:-/tmp/upf-dev}-base
    unpack "$base" "$bdir"
    local here_dev=$DEV
    say "bench A/B/A: A = this bundle ($COMMIT), B = $base ($(cat "$bdir/COMMIT")); filter $filter"
    bench_one A1 "$filter" "$reps" "$cap"
    DEV=$bdir
    bench_one B "$filter" "$reps" "$cap" LD_LIBRARY_PATH="$bdir/lib" UPF_COMMIT="$(cat "$bdir/COMMIT")"
    DEV=$here_dev
    bench_one A2 "$filter" "$reps" "$cap"
    ab_table "B = $(cat "$bdir/COMMIT")"
  elif [ -n "$filter" ]; then
    say "bench $filter (cap $cap s)"
    bench_one "${TAG:-run}" "$filter" "$reps" "$cap"
  else
    local f
    say "bench, the standard families (cap $cap s each)"
    for f in "${BENCH_FAMILIES[@]}"; do bench_one "${f%%|*}" "${f#*|}" "$reps" "$cap"; done
  fi
}

# ab_table LABEL: the A/B/A table of the three bench JSON files this step just wrote (perf/ab_table.py): medians,
# B over the A's mean, the A's drift, vs_limit where a row has it; ab.md (also into the summary) and ab.json.
ab_table() {
  local d sfx=${BENCH_JSON##*/bench-A2}
  d=$(dirname "$BENCH_JSON")
  sfx=${sfx%.json}
  run "$d/ab$sfx.md" 60 -- python3 "$REPO/perf/ab_table.py" "$d/bench-A1$sfx.json" "$d/bench-B$sfx.json" \
    "$d/bench-A2$sfx.json" --counter vs_limit --label-b "$1" --json "$d/ab$sfx.json"
  note "$d/ab$sfx.md"
  grep -E '^[|] [a-z]' "$d/ab$sfx.md" | cut -c1-160 >>"$DIR/summary.txt"
}

# peers [sdpa matmul fla]: the PyTorch peers on the shapes of the standard benchmarks, then the
# comparisons against this folder's bench JSON where there is one. The FLA peer needs the
# flash-linear-attention wheels: carry .whl (perf/reports/H200/README.md names them).
do_peers() {
  local cap=$1
  shift
  local which=("$@") p
  [ ${#which[@]} -gt 0 ] || which=(sdpa matmul fla)
  mkdir -p "$DIR/peers"
  for p in "${which[@]}"; do
    case $p in
    sdpa)
      run "$DIR/peers/torch-sdpa.log" "$cap" -- python3 peers/torch_sdpa.py --only 'llama/T:(32768|131072)' \
        --iters 6 --out "$DIR/peers/torch-sdpa.json"
      note "$DIR/peers/torch-sdpa.log"
      if [ -s "$DIR/bench/bench-attn.json" ]; then
        run "$DIR/peers/compare-attn.txt" 60 -- python3 peers/compare_attn.py "$DIR/bench/bench-attn.json" \
          "$DIR/peers/torch-sdpa.json"
        grep -E 'llama|decode|share' "$DIR/peers/compare-attn.txt" | cut -c1-140 | head -n 20 >>"$DIR/summary.txt"
      fi ;;
    matmul)
      run "$DIR/peers/torch-matmul.log" "$cap" -- python3 peers/torch_matmul.py --out "$DIR/peers/torch-matmul.json" \
        --tokens 8192,32768 --ffn-tokens 8192,32768 --iters 10 --warmup 3
      note "$DIR/peers/torch-matmul.log"
      tail -n 16 "$DIR/peers/torch-matmul.log" | cut -c1-120 >>"$DIR/summary.txt" ;;
    fla)
      carried_wheels
      run "$DIR/peers/fla-gdn.log" "$cap" -- python3 peers/fla_gdn.py --iters 10 --warmup 2 --out "$DIR/peers/fla-gdn.json"
      note "$DIR/peers/fla-gdn.log"
      if [ -s "$DIR/bench/bench-gdn.json" ]; then
        run "$DIR/peers/compare-gdn.txt" 60 -- python3 peers/compare_gdn.py ours="$DIR/bench/bench-gdn.json" \
          --fla "$DIR/peers/fla-gdn.json"
        tee -a "$DIR/summary.txt" <"$DIR/peers/compare-gdn.txt" >/dev/null
      fi ;;
    vllm)
      # vLLM's fused_moe Triton kernel, fetched into the git-ignored .peers/vllm (carry .peers; never committed)
      run "$DIR/peers/vllm-moe.log" "$cap" -- python3 "$REPO/perf/peers/vllm_moe.py" \
        --published "$REPO/.peers/vllm/fused_moe.py" --out "$DIR/peers/vllm-moe.json" --iters 20 --warmup 5
      note "$DIR/peers/vllm-moe.log"
      grep -E '^moe[.]ffn|error' "$DIR/peers/vllm-moe.log" | cut -c1-200 | head -n 4 >>"$DIR/summary.txt" ;;
    prefill | prefill:*)
      # the working tree's script (with its helper modules), so a peer-only change needs no new bundle
      local pm=${p#prefill} plen=${RUNS_SET:+$RUNS} popt=()
      pm=${pm#:}
      pm=${pm:-qwen3-next}
      plen=${plen:-32768 131072}
      if [ -n "$LAYERS" ]; then
        [[ $LAYERS =~ ^0:([0-9]+)$ ]] || die "peers prefill: --layers must be 0:N (the first N layers), not $LAYERS"
        popt+=(--layers "${BASH_REMATCH[1]}")
      fi
      [ -z "$SHARED" ] || popt+=(--shared-weights)
      [[ $pm == qwen3-next ]] && carried_wheels
      run "$DIR/peers/torch-prefill-$pm.log" "$cap" -- python3 "$REPO/perf/peers/torch_prefill.py" --model "$pm" \
        --lengths "${plen// /,}" "${popt[@]}" --out "$DIR/peers/torch-prefill-$pm.json"
      note "$DIR/peers/torch-prefill-$pm.log"
      grep -E '^model\.prefill|not run|layers, weights' "$DIR/peers/torch-prefill-$pm.log" | cut -c1-240 >>"$DIR/summary.txt" ;;
    *) die "peers: unknown peer $p (sdpa, matmul, fla, vllm, prefill[:MODEL])" ;;
    esac
  done
}

# The wheels carried in .whl (flash-linear-attention for the GDN peer, matplotlib for the report's plots),
# installed once per machine where fla does not import.
carried_wheels() {
  if ! python3 -c 'import fla' 2>/dev/null && compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    run "$DIR/pip-wheels.log" 120 -- python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/upf-site "$REPO"/.whl/*.whl
    export PYTHONPATH=/tmp/upf-site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

# The report's benchmarks on a device call: the ceilings (copy, GEMM 8192^3), the reference shapes of
# selection, projections, attention, MoE, GDN, FlashPrefill V2 and CompactAttention.
REPORT_BENCH='^(gemm_ceiling|copy|select/cuda/bf16/T:(8192|131072)/|select[.]block_scores/cuda/bf16/T:131072/|attn_prefill/cuda/bf16/llama_causal/B:1/kv:(32768|131072)/|gemm/cuda/bf16/llama_[a-z_]+/T:8192/|gdn[.]scan/cuda/bf16/qwen3next_prefill/chunked/T:(32768|131072)|moe[.]ffn/cuda/bf16/T:|attn[.]block_sparse/cuda/bf16/llama_128k/keep0[.]2/T|compact[.]attn/cuda/bf16/llama_128k/)'

# report: upf report from the bundle's folder (perf/report_plots.py travels in it) into report/r/.
do_report() {
  local cap=$1 filter=${2:-$REPORT_BENCH} peer_args=()
  carried_wheels
  if [ -n "$WITH_PEERS" ]; then
    local p inputs=()
    for p in sdpa matmul fla vllm; do
      [ "$p" != vllm ] || [ -f "$REPO/.peers/vllm/fused_moe.py" ] || { say "peers: vllm skipped (.peers/vllm not carried)"; continue; }
      do_peers 240 "$p"
    done
    for p in torch-sdpa torch-matmul fla-gdn vllm-moe; do
      [ -s "$DIR/peers/$p.json" ] && inputs+=("$DIR/peers/$p.json")
    done
    (cd "$DEV" && bin/bench_upf --benchmark_list_tests) >"$DIR/peers/ids.txt" 2>/dev/null
    if [ ${#inputs[@]} -gt 0 ] && run "$DIR/peers/peer-rows.log" 60 -- python3 "$REPO/perf/peers/peer_rows.py" \
      "$DIR/peers/peer-rows.json" "${inputs[@]}" --ids "$DIR/peers/ids.txt"; then
      peer_args=(--peers "$DIR/peers/peer-rows.json")
    else
      say "peers: no peer rows (see peers/peer-rows.log); the report runs without them"
    fi
  fi
  say "report${QUICK:+ --quick}, benchmarks '$filter'${peer_args[*]:+, ${peer_args[*]}} (cap $cap s)"
  run "$DIR/report/report.log" "$cap" -- bin/upf report ${QUICK:+--quick} --bench-filter "$filter" "${peer_args[@]}" \
    --out "$DIR/report/r"
  note "$DIR/report/report.log"
  grep -m1 '^verdict' "$DIR/report/report.log" | cut -c1-300 | tee -a "$DIR/summary.txt"
  rm -rf "$DIR/report/r/runs" # each run's JSON: its numbers are in report.json
}

# profile BENCH KERNEL SKIP COUNT NCUARGS...: ncu of COUNT launches of KERNEL after SKIP, in the
# benchmark whose name matches BENCH (five repetitions, so that there are launches to skip).
do_profile() {
  local bench=$1 kernel=$2 skip=$3 count=$4 cap=$5
  shift 5
  local tag
  tag=$(echo "$bench" | tr -c 'A-Za-z0-9._-' '_' | sed -E 's/_+/_/g; s/^_|_$//g' | cut -c1-60)
  say "ncu of ${kernel:-every kernel} in $bench (skip $skip, count $count, $*)"
  run "$DIR/profile/ncu-$tag.log" "$cap" -- "$NCU" --clock-control none ${kernel:+-k "regex:$kernel"} \
    --launch-skip "$skip" --launch-count "$count" "$@" bin/bench_upf --benchmark_filter="$bench" \
    --benchmark_repetitions=5
  note "$DIR/profile/ncu-$tag.log"
  grep -E '^  [a-zA-Z_<].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers Per|gpu__time' \
    "$DIR/profile/ncu-$tag.log" | tr -s ' ' | cut -c1-140 | head -n 40 >>"$DIR/summary.txt"
}

# compact: CompactAttention's checks side by side (nothing timed meanwhile), then its benchmark rows alone;
# the rows' medians with kept_share and vs_limit go to compact/table.txt and the summary.
do_compact() {
  local check=${CHECK_S:-240} bench=${BENCH_S:-300} f
  say "compact: verify compact attn.paged, sanitize compact, test_upf compact_attn model_compact chunked (cap $check s)"
  do_verify "" "$check" compact attn.paged &
  do_sanitize memcheck,racecheck,synccheck "$check" compact &
  run "$DIR/test/test_upf-compact.log" "$check" -- sh -c 'cd bin && exec ./test_upf compact_attn model_compact chunked' &
  wait
  note "$DIR/test/test_upf-compact.log"
  for f in "$DIR"/verify/*.log "$DIR"/sanitize/*.log "$DIR"/test/*.log; do
    grep -q '^# rc=0$' "$f" || STATUS=1
  done
  say "compact: benchmarks alone on the GPU (cap $bench s)"
  mkdir -p "$DIR/bench" "$DIR/compact"
  bench_one compact '^compact\.(block_union|block_tables|select|attn)/cuda/' "${REPS:-3}" "$bench"
  run "$DIR/compact/table.txt" 60 -- python3 - "$BENCH_JSON" <<'PY'
import json, sys
rows = [b for b in json.load(open(sys.argv[1]))["benchmarks"] if b.get("aggregate_name") == "median"]
keys = ("kept_share", "flop_share", "dense_ms", "vs_dense", "vs_limit", "vs_flop_limit")
for b in rows:
    ms = b["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
    extra = ", ".join(f"{k} {b[k]:.3f}" for k in keys if k in b)
    print(f'{b["run_name"].split("/iterations")[0].split("/min_time")[0]}: {ms:.3f} ms' + (f", {extra}" if extra else ""))
PY
  note "$DIR/compact/table.txt"
  grep -v '^# rc' "$DIR/compact/table.txt" | cut -c1-300 | tee -a "$DIR/summary.txt"
}

# chunked MODELS: dense, UniPrefill (chunks with cached context run dense: what --chunk costs it), CompactAttention
# and FlashPrefill V2 under chunked prefill (--chunk $CHUNK) beside the unchunked dense and
# UniPrefill runs, one process each; chunked/table.txt has each run's TTFT and kept share from its JSON.
do_chunked() {
  local cap=$1
  shift
  local models=("$@") m t base runs=${RUNS_SET:+$RUNS} chunk=${CHUNK:-8192} mode
  [ ${#models[@]} -gt 0 ] || models=(llama3.1-8b)
  runs=${runs:-32768 131072}
  say "chunked ${models[*]}: runs '$runs', chunk $chunk${ALPHA:+, alpha $ALPHA}${LAYERS:+, layers $LAYERS} (cap $cap s each)"
  mkdir -p "$DIR/chunked"
  for m in "${models[@]}"; do
    for t in $runs; do
      base=$DIR/chunked/$m-$t
      local common=(bin/upf prefill --model "$m" --lengths "$t" --backend cuda --dtype bf16 --warmup 1 --iters "$ITERS"
        ${LAYERS:+--layers "$LAYERS"})
      for mode in dense uniprefill compact flashprefill; do
        run "$base-chunk$chunk-$mode.log" "$cap" -- "${common[@]}" --chunk "$chunk" --mode "$mode" \
          ${ALPHA:+$([ "$mode" = compact ] || [ "$mode" = flashprefill ] && echo --alpha "$ALPHA")} --json "$base-chunk$chunk-$mode.json"
        note "$base-chunk$chunk-$mode.log"
      done
      for mode in dense uniprefill; do
        run "$base-unchunked-$mode.log" "$cap" -- "${common[@]}" --mode "$mode" --json "$base-unchunked-$mode.json"
        note "$base-unchunked-$mode.log"
      done
    done
  done
  run "$DIR/chunked/table.txt" 60 -- python3 - "$DIR/chunked" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        r = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{os.path.basename(path)}: unreadable ({e})")
        continue
    ttft = r.get("ttft_ms", {})
    ttft = ttft.get("median") if isinstance(ttft, dict) else ttft
    share = r.get("kept_share")
    attn = {k: r[k] for k in ("compact_attn_ms", "sparse_attn_ms") if isinstance(r.get(k), float)}
    print(f'{os.path.basename(path)[:-5]}: TTFT {ttft} ms' + (f", kept share {share:.4f}" if isinstance(share, float) else "")
          + "".join(f", {k} {v:.2f}" for k, v in attn.items()))
PY
  note "$DIR/chunked/table.txt"
  grep -v '^# rc' "$DIR/chunked/table.txt" | cut -c1-300 | tee -a "$DIR/summary.txt"
}

# session: verify (full, or --quick), the sanitizers and test_upf side by side (nothing is timed
# meanwhile), then every standard benchmark alone on the GPU, then the peers. Caps in seconds:
# CHECK_S for the first phase (default 300), BENCH_S per benchmark family (60), PEERS_S per peer (90);
# the defaults fit the device tool's 600 s a call.
do_session() {
  local quick=$1 check=${CHECK_S:-300}
  say "session: phase 1, correctness side by side (cap $check s)"
  do_verify "$quick" "$check" &
  do_sanitize memcheck,racecheck,synccheck "$check" &
  do_test "$check" &
  wait
  # the status of the background subshells is in their logs: read it again here
  for f in "$DIR"/verify/*.log "$DIR"/sanitize/*.log "$DIR"/test/*.log; do
    grep -q '^# rc=0$' "$f" || STATUS=1
  done
  say "session: phase 2, benchmarks alone on the GPU"
  do_bench "" 3 "${BENCH_S:-60}" "" ""
  say "session: phase 3, peers"
  do_peers "${PEERS_S:-90}"
}

# side STEP...: each STEP (a command line of this script) in its own process and $OUT subfolder, side by side.
do_side() {
  [ $# -ge 1 ] && [ $# -le 6 ] || die "side: give 1 to 6 steps, each one quoted command line of device.sh"
  local i=0 step words sub subs=()
  for step in "$@"; do
    i=$((i + 1))
    eval "words=($step)" || die "side: cannot read step $i: $step"
    [[ " $STEP_COMMANDS " == *" ${words[0]:-?} "* ]] || die "side: step $i is not a device command: $step"
    sub=$OUT/s$i-${words[0]}
    subs+=("$sub")
    mkdir -p "$sub"
    say "side: step $i: $step"
    echo "OUT=$sub bash device.sh $step${BUNDLE:+ --bundle $BUNDLE}" >>"$CMDS"
    (OUT=$sub UPF_DEV=$DEV bash "${BASH_SOURCE[0]}" "${words[@]}" ${BUNDLE:+--bundle "$BUNDLE"}) >"$sub.out" 2>&1 &
  done
  wait
  for sub in "${subs[@]}"; do
    find "$sub" -name summary.txt -exec sh -c 'echo "== ${1#$2/}"; cat "$1"' _ {} "$OUT" \; >>"$DIR/summary.txt"
    grep -q 'done, status 0' "$sub"/*/summary.txt 2>/dev/null || STATUS=1
    mv "$sub.out" "$sub/" && tar -C "$OUT" -cJf "$sub.tar.xz" "$(basename "$sub")" && rm -rf "$sub"
  done
}

# ----------------------------------------------------------------------------------------------- main
# the commands a `side` step may be; session and side themselves run steps
STEP_COMMANDS="verify sanitize test bench peers profile prefill methods serve tp shared chunkserve timeline determinism compact chunked report"
[ $# -gt 0 ] || { usage; exit 2; }
CMD=$1
shift
case $CMD in
-h | --help | help) usage; exit 0 ;;
stage) stage "$@"; exit $? ;;
session | side) ;;
*) [[ " $STEP_COMMANDS " == *" $CMD "* ]] ||
  die "unknown command $CMD (stage, side, session, ${STEP_COMMANDS// /, }; --help)" ;;
esac

NAME=$CMD BUNDLE="" CAP="" ENVS=() ARGS=()
QUICK="" CASE="" SPLIT="" TOOLS=memcheck,racecheck,initcheck,synccheck FILTER="" REPS="" AB="" BASE=""
WITH_PEERS="" KERNEL="" SKIP=0 COUNT=1 NCUARGS=() RUNS="8192 32768 131072" RUNS_SET="" KEEPS=0.5,0.3,0.2 KEEPS_SET="" LAYERS="" ITERS=1 ALPHA="" SHARED=""
while [ $# -gt 0 ]; do
  case $1 in
  --name) NAME=${2:?--name needs a value}; shift 2 ;;
  --env) [[ ${2:-} == *=* ]] || die "--env wants VAR=value"; ENVS+=("$2"); shift 2 ;;
  --cap) CAP=${2:?--cap needs seconds}; shift 2 ;;
  --bundle) BUNDLE=${2:?--bundle needs a file}; shift 2 ;;
  --quick) QUICK=--quick; shift ;;
  --case) CASE=${2:?--case needs part of a case name}; shift 2 ;;
  --tools) TOOLS=${2:?--tools needs a list}; shift 2 ;;
  --split) SPLIT=1; shift ;;
  --filter) FILTER=${2:?--filter needs a regex}; shift 2 ;;
  --reps) REPS=${2:?--reps needs a number}; shift 2 ;;
  --ab) AB=${2:?--ab needs VAR=a,b}; shift 2 ;;
  --base) BASE=${2:?--base needs a bundle}; shift 2 ;;
  --kernel) KERNEL=${2:?--kernel needs a regex}; shift 2 ;;
  --skip) SKIP=${2:?--skip needs a number}; shift 2 ;;
  --count) COUNT=${2:?--count needs a number}; shift 2 ;;
  --runs) RUNS=${2:?--runs needs lengths} RUNS_SET=1; shift 2 ;;
  --keep) KEEPS=${2:?--keep needs ratios}; KEEPS_SET=1; shift 2 ;;
  --layers) LAYERS=${2:?--layers needs A:B}; shift 2 ;;
  --iters) ITERS=${2:?--iters needs a number}; shift 2 ;;
  --alpha) ALPHA=${2:?--alpha needs a value}; shift 2 ;;
  --shared) SHARED=--shared-weights; shift ;;
  --peers) WITH_PEERS=1; shift ;;
  --set | --section | --metrics | --filter-mode) NCUARGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
  -h | --help) usage; exit 0 ;;
  -*) die "$CMD: unknown option $1" ;;
  *) ARGS+=("$1"); shift ;;
  esac
done
[ -z "$AB" ] || [ -z "$BASE" ] || die "bench: --ab and --base are one or the other"
[[ $NAME =~ ^[A-Za-z0-9._-]+$ ]] || die "--name: letters, digits, '.', '_' and '-' only (the device tool's rule)"

setup
case $CMD in
verify) do_verify "$QUICK" "${CAP:-300}" "${ARGS[@]}" ;;
sanitize) do_sanitize "$TOOLS" "${CAP:-300}" "${ARGS[@]}" ;;
test) do_test "${CAP:-300}" ;;
prefill) do_prefill "${CAP:-300}" "${ARGS[@]}" ;;
methods) do_methods "${CAP:-240}" "${ARGS[@]}" ;;
serve)
  [ ${#ARGS[@]} -le 1 ] || die "serve takes at most one model"
  do_serve "${CAP:-240}" "${ARGS[@]}" ;;
tp) do_tp "${CAP:-240}" "${ARGS[@]}" ;;
timeline) do_timeline "${CAP:-120}" "${ARGS[@]}" ;;
determinism)
  [ ${#ARGS[@]} -le 1 ] || die "determinism takes at most one model"
  do_determinism "${CAP:-300}" "${ARGS[@]}" ;;
chunkserve)
  [ ${#ARGS[@]} -le 1 ] || die "chunkserve takes at most one model"
  do_chunkserve "${CAP:-240}" "${ARGS[@]}" ;;
shared)
  [ ${#ARGS[@]} -le 1 ] || die "shared takes at most one model"
  do_shared "${CAP:-240}" "${ARGS[@]}" ;;
compact)
  [ ${#ARGS[@]} -eq 0 ] || die "compact takes no operands"
  do_compact ;;
chunked) do_chunked "${CAP:-240}" "${ARGS[@]}" ;;
bench)
  [ ${#ARGS[@]} -eq 0 ] || die "bench takes no operands (--filter REGEX)"
  [ -n "$FILTER" ] || [ -z "$AB$BASE" ] || die "bench: --ab and --base need --filter"
  do_bench "$FILTER" "$REPS" "${CAP:-120}" "$AB" "$BASE" ;;
peers) do_peers "${CAP:-120}" "${ARGS[@]}" ;;
profile)
  [ ${#ARGS[@]} -eq 1 ] || die "profile takes one benchmark name regex"
  [[ " ${NCUARGS[*]} " =~ \ --(set|section|metrics)\  ]] || NCUARGS+=(--set full)
  do_profile "${ARGS[0]}" "$KERNEL" "$SKIP" "$COUNT" "${CAP:-120}" "${NCUARGS[@]}" ;;
side) do_side "${ARGS[@]}" ;;
session)
  [ ${#ARGS[@]} -eq 0 ] || die "session takes no operands"
  do_session "$QUICK" ;;
report)
  [ ${#ARGS[@]} -eq 0 ] || die "report takes no operands (--quick, --filter REGEX)"
  do_report "${CAP:-560}" "$FILTER" ;;
esac
finish
exit "$STATUS"

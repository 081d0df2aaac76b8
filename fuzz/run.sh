#!/usr/bin/env bash
# Runs each fuzz target for SECONDS (JOBS at a time) over its seed corpus and a working corpus, and
# writes OUT/SUMMARY.md: per target the runs, execs/s, coverage (cov/ft), corpus size and findings.
# usage: fuzz/run.sh BUILD SECONDS JOBS TARGET...   (make fuzz-run FUZZ_SECONDS=600 FUZZ_JOBS=2)
# The binaries are BUILD/fuzz/fuzz_<target>; OUT is $FUZZ_OUT, else BUILD (logs, working corpora,
# artifacts). A finding is an artifact libFuzzer wrote (crash-, leak-, timeout-, oom-) under
# OUT/artifacts/<target>/; the script exits 1 when there is one or a target did not run. A slow-unit-
# file (an input over 10 s) is listed but is no finding. FUZZ_SUMMARY_ONLY=1 rewrites the summary of
# the last run without fuzzing.
set -uo pipefail
build=$1 seconds=$2 jobs=$3
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
out=${FUZZ_OUT:-$build}

one() {
  local t=$1 bin=$build/fuzz/fuzz_$1 work=$out/corpus/$1 art=$out/artifacts/$1 log=$out/logs/$1.log
  mkdir -p "$work" "$art" "$out/logs"
  local dict=()
  [ -f "fuzz/$t.dict" ] && dict=(-dict="fuzz/$t.dict")
  # -close_fd_mask=3: the targets' own output (the CLI's messages) is dropped; libFuzzer and the
  # sanitizers report on a duplicate of stderr
  "$bin" -max_total_time="$seconds" -print_final_stats=1 -close_fd_mask=3 -timeout=20 -rss_limit_mb=2048 \
    -artifact_prefix="$art/" "${dict[@]}" "$work" "fuzz/corpus/$t" >"$log" 2>&1
  echo $? >"$out/logs/$t.rc"
}
export -f one
export build out seconds
start=$(date -u '+%Y-%m-%d %H:%M UTC')
if [ -n "${FUZZ_SUMMARY_ONLY:-}" ]; then
  start=$(cat "$out/logs/start")
else
  mkdir -p "$out/logs" && echo "$start" >"$out/logs/start"
  printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'one {}'
fi

summary=$out/SUMMARY.md
failed=0
findings=0
{
  echo "# Fuzzing summary"
  echo
  echo "Started $start on $(hostname) ($(nproc) cores), $(clang --version | head -1)."
  echo "Each target ran ${seconds} s, ${jobs} at a time: \`make fuzz-run FUZZ_SECONDS=$seconds FUZZ_JOBS=$jobs\`"
  echo "(binaries of \`make fuzz\`: clang -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)."
  echo
  echo "| target | runs | execs/s | cov | ft | corpus (files, bytes) | peak RSS MB | exit | findings | slow units |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  for t in "$@"; do
    log=$out/logs/$t.log
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    nfiles=$(find "$out/corpus/$t" "fuzz/corpus/$t" -type f | wc -l)
    nbytes=$(find "$out/corpus/$t" "fuzz/corpus/$t" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    arts=$(find "$out/artifacts/$t" -type f ! -name 'slow-unit-*' | wc -l)
    findings=$((findings + arts))
    list=$(find "$out/artifacts/$t" -type f ! -name 'slow-unit-*' -printf '%f ' | head -c 300)
    slow=$(find "$out/artifacts/$t" -type f -name 'slow-unit-*' | wc -l)
    rc=$(cat "$out/logs/$t.rc")
    [ "$rc" -ne 0 ] && [ "$arts" -eq 0 ] && failed=$((failed + 1))
    echo "| $t | ${runs:-?} | ${eps:-?} | ${cov:-?} | ${ft:-?} | $nfiles, $nbytes | ${rss:-?} | $rc | $arts ${list}| $slow |"
  done
  echo
  echo "Findings: $findings. Logs: $out/logs/<target>.log; working corpora: $out/corpus/<target>/."
  [ "$failed" -eq 0 ] || echo "$failed target(s) exited non-zero without an artifact: see their logs."
} >"$summary"
cat "$summary"
[ "$findings" -eq 0 ] && [ "$failed" -eq 0 ]

#!/usr/bin/env bash
# Runs on the lent GPU machine, from the bundle that perf/stage-device.sh writes: verify against the
# CPU reference, compute-sanitizer memcheck and racecheck over the verify run, the CUnit suites, and
# the benchmarks. Everything lands in $OUT. Usage, in the unpacked bundle:
#   OUT=dir bash device-evidence.sh [verify|sanitize|test|bench ...]   (no argument: all of them)
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export UPF_COMMIT=${UPF_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
BIN=bin
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(verify sanitize test bench)
status=0
for step in "${steps[@]}"; do
  case "$step" in
  verify)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1
    $BIN/upf verify all --log "$OUT/verify.log" || status=1
    tail -n 1 "$OUT/verify.log" ;;
  sanitize)
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 $BIN/upf verify all --quick \
        >"$OUT/sanitizer-$tool.log" 2>&1 || status=1
      tail -n 2 "$OUT/sanitizer-$tool.log"
    done ;;
  test)
    $BIN/test_upf >"$OUT/test.log" 2>&1 || status=1
    grep -A4 "Run Summary" "$OUT/test.log" ;;
  bench)
    $BIN/bench_upf --benchmark_out="$OUT/bench.json" --benchmark_out_format=json >"$OUT/bench.log" 2>&1 || status=1
    tail -n 30 "$OUT/bench.log" ;;
  *) echo "device-evidence: unknown step $step" >&2; status=2 ;;
  esac
done
exit $status

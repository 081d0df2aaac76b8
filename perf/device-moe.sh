#!/usr/bin/env bash
# One device call for a MoE change, from the unpacked bundle of perf/stage-device.sh (and, with BASE=dir,
# an unpacked bundle of the commit before it, timed in the same call: the card drifts 2-4% between calls);
# each step capped, a failing step stops nothing:
#   A. side by side, nothing timed meanwhile: `upf verify moe --quick`, the full `upf verify $FULL` (default
#      moe; its CPU reference of Qwen3-Next at 4K and 32K gets 10 OpenBLAS threads), test_upf, memcheck over
#      `verify moe --quick`, racecheck over `verify moe.route --quick` and `verify moe.ffn --quick`;
#   B. alone on the GPU: bench moe.dense_equiv and moe.ffn (default variant) at 8K and 32K, this bundle
#      then BASE's, then this bundle again (an A/B/A order: drift shows as A != A);
#   C. ncu SpeedOfLight + DRAM/L2 bytes of the MoE layer's own kernels (not cuBLAS's) at 32K.
#   OUT=dir [BASE=dir] [FULL=ops] bash device-moe.sh
set -u
source "$(dirname "$0")/device-common.sh"
BASE=${BASE:-}
FULL=${FULL:-moe} # the ops of the full verify (moe.route alone skips the CPU reference of the 32K layer)

A=$OUT/moe-correctness; mkdir -p "$A"
say "A verify moe (quick, full), test_upf, memcheck, racecheck"
(OPENBLAS_NUM_THREADS=2 timeout 120 bin/upf verify moe --quick --log "$A/verify-moe-quick.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-moe-quick.log") &
(OPENBLAS_NUM_THREADS=10 timeout 240 bin/upf verify $FULL --log "$A/verify-full.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-full.log") &
(cd bin && OPENBLAS_NUM_THREADS=1 timeout 200 ./test_upf >"$A/test_upf.log" 2>&1; echo "# rc=$?" >>"$A/test_upf.log") &
(OPENBLAS_NUM_THREADS=1 timeout 230 "$SAN" --tool memcheck --error-exitcode 9 bin/upf verify moe --quick \
  >"$A/memcheck-moe-quick.log" 2>&1; echo "# rc=$?" >>"$A/memcheck-moe-quick.log") &
for op in moe.route moe.ffn; do # moe.ffn under racecheck runs every cuBLAS variant: it may not finish in 300 s
  (OPENBLAS_NUM_THREADS=1 timeout 300 "$SAN" --tool racecheck --error-exitcode 9 bin/upf verify $op --quick \
    >"$A/racecheck-$op-quick.log" 2>&1; echo "# rc=$?" >>"$A/racecheck-$op-quick.log") &
done
wait
report "$A"
pack moe-correctness

B=$OUT/moe-bench; mkdir -p "$B"
FILTER='^copy|^moe\.(dense_equiv|ffn)/cuda/bf16/T:(8192|32768)'
bench() { # label dir
  (cd "$2" && LD_LIBRARY_PATH=$2/lib timeout 100 bin/bench_upf --benchmark_filter="$FILTER" \
    --benchmark_out="$B/bench-moe-$1.json" --benchmark_out_format=json >"$B/bench-moe-$1.log" 2>&1)
  say "bench $1 ($(cat "$2/COMMIT")) rc=$?"
  grep -E '^moe\.(dense_equiv|ffn).*_median' "$B/bench-moe-$1.log" | sed -E 's/ +/ /g' | cut -c1-300 | tee -a "$OUT/summary.txt"
}
bench new1 "$PWD"
[ -n "$BASE" ] && bench base "$BASE"
bench new2 "$PWD"
pack moe-bench

C=$OUT/moe-ncu; mkdir -p "$C"
say "C ncu of the layer's own kernels at 32K"
timeout 120 "$NCU" --clock-control none --section SpeedOfLight --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
  -k regex:'moe_' --launch-skip 40 --launch-count 16 bin/bench_upf --benchmark_filter='^moe\.ffn/cuda/bf16/T:32768/' \
  >"$C/ncu-moe-32768.txt" 2>&1
say "ncu rc=$?"
grep -E '^  [a-zA-Z<_].*\(|Duration|dram__bytes|lts__t_bytes' "$C/ncu-moe-32768.txt" | sed -E 's/ +/ /g' | cut -c1-120 | head -80 >>"$OUT/summary.txt"
pack moe-ncu
say done

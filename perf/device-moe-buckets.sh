#!/usr/bin/env bash
# One device call for the MoE layer's launch settings (UPF_MOE_BUCKETS, UPF_MOE_BUCKET_LANES,
# UPF_MOE_GATHER_SMS), from the unpacked bundle of perf/stage-device.sh; each step capped, a failing
# step stops nothing:
#   A. side by side, nothing timed meanwhile: `upf verify moe --quick` as built and under ALT (one
#      setting, the path under test: default UPF_MOE_BUCKET_LANES=$LANES_ALT), and under ALT the full
#      `upf verify moe.ffn` (Qwen3-Next at T = 1 .. 32K) and memcheck over `verify moe.ffn --quick`;
#      test_upf as built;
#   B. alone on the GPU: bench moe.dense_equiv and moe.ffn (AUTO = BUCKETED) at 8K and 32K as built,
#      then moe.ffn under each setting of SETTINGS, then as built again (drift shows as A != A).
#   OUT=dir [ALT=VAR=v | LANES_ALT=1] [SETTINGS='label:VAR=v,VAR=v label2:...'] bash device-moe-buckets.sh
#   (94366f4's call, when lanes 2 was a switch that only spread the buckets of each GEMM: LANES_ALT=2
#   and the settings of the bench lines in perf/reports/H200/94366f4-moe-buckets/; 8fa3491's: the
#   defaults, when ALT also ran only the quick verify.)
set -u
source "$(dirname "$0")/device-common.sh"

LANES_ALT=${LANES_ALT:-1}
ALT=${ALT:-UPF_MOE_BUCKET_LANES=$LANES_ALT}
SETTINGS=${SETTINGS:-lanes1:UPF_MOE_BUCKET_LANES=1 b4:UPF_MOE_BUCKETS=4 b8:UPF_MOE_BUCKETS=8}
A=$OUT/buckets-correctness; mkdir -p "$A"
say "A verify moe --quick (as built, $ALT), verify moe.ffn full and memcheck ($ALT), test_upf"
(OPENBLAS_NUM_THREADS=2 timeout 150 bin/upf verify moe --quick --log "$A/verify-moe-quick.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-moe-quick.log") &
(env "$ALT" OPENBLAS_NUM_THREADS=2 timeout 150 bin/upf verify moe --quick --log "$A/verify-moe-quick-alt.log" \
  >/dev/null 2>&1; echo "# rc=$? ($ALT)" >>"$A/verify-moe-quick-alt.log") &
(env "$ALT" OPENBLAS_NUM_THREADS=10 timeout 240 bin/upf verify moe.ffn --log "$A/verify-moe.ffn-full.log" \
  >/dev/null 2>&1; echo "# rc=$? ($ALT)" >>"$A/verify-moe.ffn-full.log") &
(env "$ALT" OPENBLAS_NUM_THREADS=1 timeout 230 "$SAN" --tool memcheck --error-exitcode 9 bin/upf verify moe.ffn \
  --quick >"$A/memcheck-moe.ffn-quick.log" 2>&1; echo "# rc=$? ($ALT)" >>"$A/memcheck-moe.ffn-quick.log") &
(cd bin && OPENBLAS_NUM_THREADS=1 timeout 200 ./test_upf >"$A/test_upf.log" 2>&1; echo "# rc=$?" >>"$A/test_upf.log") &
wait
report "$A"
pack buckets-correctness

B=$OUT/buckets-bench; mkdir -p "$B"
bench() { # label filter [env assignments]
  local label=$1 filter=$2; shift 2
  (env "$@" timeout 100 bin/bench_upf --benchmark_filter="$filter" --benchmark_out="$B/bench-$label.json" \
    --benchmark_out_format=json >"$B/bench-$label.log" 2>&1)
  say "bench $label ($*) rc=$?"
  grep -E '^moe\.(dense_equiv|ffn).*_median' "$B/bench-$label.log" | sed -E 's/ +/ /g' | cut -c1-640 | tee -a "$OUT/summary.txt"
}
ALL='^copy|^moe\.(dense_equiv|ffn)/cuda/bf16/T:(8192|32768)'
FFN='^moe\.ffn/cuda/bf16/T:(8192|32768)'
bench base1 "$ALL"
for setting in $SETTINGS; do
  IFS=, read -r -a vars <<<"${setting#*:}"
  bench "${setting%%:*}" "$FFN" "${vars[@]}"
done
bench base2 "$ALL"
pack buckets-bench
say done

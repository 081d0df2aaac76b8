#!/usr/bin/env bash
# One device call for BUCKETED's launch shape (UPF_MOE_BUCKETS, UPF_MOE_BUCKET_LANES), from the
# unpacked bundle of perf/stage-device.sh; each step capped, a failing step stops nothing:
#   A. side by side, nothing timed meanwhile: `upf verify moe --quick` as built (lanes 1) and with
#      UPF_MOE_BUCKET_LANES=2, the full `upf verify moe.ffn` with lanes 2 (Qwen3-Next at T = 1 .. 32K);
#   B. alone on the GPU: bench moe.dense_equiv and moe.ffn (AUTO = BUCKETED) at 8K and 32K as built,
#      then moe.ffn under each (buckets, lanes) setting, then as built again (drift shows as A != A).
#   OUT=dir bash device-moe-buckets.sh
set -u
source "$(dirname "$0")/device-common.sh"

A=$OUT/buckets-correctness; mkdir -p "$A"
say "A verify moe --quick (lanes 1, lanes 2), verify moe.ffn full (lanes 2)"
(OPENBLAS_NUM_THREADS=2 timeout 150 bin/upf verify moe --quick --log "$A/verify-moe-quick.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-moe-quick.log") &
(UPF_MOE_BUCKET_LANES=2 OPENBLAS_NUM_THREADS=2 timeout 150 bin/upf verify moe --quick \
  --log "$A/verify-moe-quick-lanes2.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/verify-moe-quick-lanes2.log") &
(UPF_MOE_BUCKET_LANES=2 OPENBLAS_NUM_THREADS=10 timeout 240 bin/upf verify moe.ffn \
  --log "$A/verify-moe.ffn-full-lanes2.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/verify-moe.ffn-full-lanes2.log") &
wait
report "$A"
pack buckets-correctness

B=$OUT/buckets-bench; mkdir -p "$B"
bench() { # label filter [env assignments]
  local label=$1 filter=$2; shift 2
  (env "$@" timeout 100 bin/bench_upf --benchmark_filter="$filter" --benchmark_out="$B/bench-$label.json" \
    --benchmark_out_format=json >"$B/bench-$label.log" 2>&1)
  say "bench $label ($*) rc=$?"
  grep -E '^moe\.(dense_equiv|ffn).*_median' "$B/bench-$label.log" | sed -E 's/ +/ /g' | cut -c1-420 | tee -a "$OUT/summary.txt"
}
ALL='^copy|^moe\.(dense_equiv|ffn)/cuda/bf16/T:(8192|32768)'
FFN='^moe\.ffn/cuda/bf16/T:(8192|32768)'
bench base1 "$ALL"
bench lanes2 "$FFN" UPF_MOE_BUCKET_LANES=2
bench lanes2-b4 "$FFN" UPF_MOE_BUCKET_LANES=2 UPF_MOE_BUCKETS=4
bench lanes2-b2 "$FFN" UPF_MOE_BUCKET_LANES=2 UPF_MOE_BUCKETS=2
bench lanes1-b4 "$FFN" UPF_MOE_BUCKETS=4
bench lanes1-b2 "$FFN" UPF_MOE_BUCKETS=2
bench lanes2-b8 "$FFN" UPF_MOE_BUCKET_LANES=2 UPF_MOE_BUCKETS=8
bench base2 "$ALL"
pack buckets-bench
say done

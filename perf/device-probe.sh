#!/usr/bin/env bash
# One device call that gathers what the next round of kernel work needs, from the unpacked bundle
# of perf/stage-device.sh, each step capped and none stopping the next:
#   A. correctness that earlier calls cut short, processes side by side (nothing is timed meanwhile):
#      the FULL verify of ffn, moe, norm and rope (their 32K rows), racecheck over `verify moe --quick`;
#   B. issue 5: device-gdn-v2.sh (the chunked scan's variants: verify, sanitizers, then timings alone);
#   C. ncu, one launch each, hardware counters (--set full, clocks left alone): the wgmma prefill
#      kernel at 32K, the decode v2 kernel at B 16 / kv 32K / page 16; kernel durations over MoE
#      layers at 8K;
#   D. timings alone on the GPU through the benchmark gate (quick verify once per op, one copy
#      ceiling per process): attention prefill 4K and 32K, decode B 16 kv 32K.
# $OUT gets summary.txt plus one archive a step.     OUT=dir bash device-probe.sh
set -u
source "$(dirname "$0")/device-common.sh"

A=$OUT/correctness; mkdir -p "$A"
export OPENBLAS_NUM_THREADS=3
for op in ffn moe norm rope; do
  (timeout "${STEP_A_S:-200}" bin/upf verify "$op" --log "$A/verify-$op-full.log" >/dev/null 2>&1
    echo "# rc=$?" >>"$A/verify-$op-full.log") &
done
(timeout "${STEP_A_S:-200}" "$SAN" --tool racecheck --error-exitcode 9 bin/upf verify moe --quick \
  >"$A/racecheck-moe.log" 2>&1; echo "# rc=$?" >>"$A/racecheck-moe.log") &
wait
unset OPENBLAS_NUM_THREADS
report "$A"; pack correctness

say "B gated deltanet"
gdn_step B

say "C ncu"
P=$OUT/ncu; mkdir -p "$P"
prof() { # tag, kernel regex, launches to skip, bench filter, extra ncu args...
  local tag=$1 kernel=$2 skip=$3 filter=$4; shift 4
  timeout 60 "$NCU" --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 "$@" \
    bin/bench_upf --benchmark_filter="$filter" --benchmark_repetitions=5 >"$P/ncu-$tag.log" 2>&1
  say "ncu $tag rc=$?: $(grep -E 'Duration|Compute \(SM\) Throughput|Memory Throughput' "$P/ncu-$tag.log" | head -3 | tr -s ' ' | tr '\n' ' ')"
}
prof prefill-wgmma-32k attn_wgmma 120 '^attn_prefill/cuda/bf16/llama_causal/B:1/kv:32768/' --set full
prof decode-v2-b16 attn_decode_v2 120 '^attn_paged/cuda/bf16/llama_decode_b16_p16/' --set full
timeout 60 "$NCU" --clock-control none --metrics gpu__time_duration.sum --launch-skip 3000 --launch-count 80 \
  bin/bench_upf --benchmark_filter='^moe.ffn/cuda/bf16/T:8192/' --benchmark_repetitions=5 >"$P/ncu-moe-8k.log" 2>&1
say "ncu moe rc=$?"
pack ncu

say "D timings through the gate"
T=$OUT/bench; mkdir -p "$T"
timeout 60 bin/bench_upf --benchmark_filter='^copy|^attn_prefill/cuda/bf16/llama_causal/B:1/kv:(4096|32768)/|^attn_paged/cuda/bf16/llama_decode_b16_p16/' \
  --benchmark_repetitions=3 --benchmark_out="$T/bench-attn.json" --benchmark_out_format=json >"$T/bench-attn.log" 2>&1
say "D rc=$?"; grep -E 'median|gate|verif|ceiling' "$T/bench-attn.log" | cut -c1-150 | head -12 | tee -a "$OUT/summary.txt"
pack bench
say "done: $(ls "$OUT" | tr '\n' ' ')"

#!/usr/bin/env bash
# Second device call of the 2026-11-29 evening session, from the unpacked bundle of
# perf/stage-device.sh; each step capped, none stopping the next:
#   A. correctness, side by side, nothing timed meanwhile: the FULL verify of gdn.scan under
#      UPF_GDN_PREP=v2 UPF_GDN_STATE=split (the fastest variant of the probe call, candidate default),
#      the full verify of ffn and moe (cut at 170 s in the probe call);
#   B. alone on the GPU: the chunked scan at 8K, 32K, 128K and 16 x 2K, default and v2+split, then the
#      FLA peer on the same shapes (side by side in one run);
#   C. ncu (clocks left alone): the chunked scan's kernels at 32K under v2+split (--set full, one
#      iteration), the wgmma prefill kernel at 4K (--set full, one launch).
# $OUT gets summary.txt plus one archive a step.   OUT=dir bash device-profile.sh (FLA wheels on PYTHONPATH)
set -u
source "$(dirname "$0")/device-common.sh"
V2SPLIT="UPF_GDN_PREP=v2 UPF_GDN_STATE=split"

A=$OUT/correctness; mkdir -p "$A"
(env $V2SPLIT timeout "${STEP_A_S:-200}" bin/upf verify gdn.scan --log "$A/verify-gdn.scan-full-v2split.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-gdn.scan-full-v2split.log") &
for op in ffn moe; do
  (OPENBLAS_NUM_THREADS=7 timeout "${STEP_A_S:-200}" bin/upf verify "$op" --log "$A/verify-$op-full.log" >/dev/null 2>&1
    echo "# rc=$?" >>"$A/verify-$op-full.log") &
done
wait
report "$A"
grep -E "^PASS gdn.scan .*bf16" "$A/verify-gdn.scan-full-v2split.log" | grep -oE "budget= *[0-9.]+%" | sort -t= -k2 -n | tail -n1 |
  sed "s/^/largest bf16 budget use under v2+split: /" | tee -a "$OUT/summary.txt"
pack correctness

say "B timings alone: chunked scan default, v2+split, then FLA"
G=$OUT/gdn; mkdir -p "$G"
FILTER='gdn.scan/cuda/bf16/qwen3next_(prefill/chunked|batch16x2K/chunked)/'
timeout 40 bin/bench_upf --benchmark_filter="$FILTER" --benchmark_repetitions=3 \
  --benchmark_out="$G/bench-gdn-default.json" --benchmark_out_format=json >"$G/bench-gdn-default.log" 2>&1
say "bench default rc=$?"
env $V2SPLIT timeout 40 bin/bench_upf --benchmark_filter="$FILTER" --benchmark_repetitions=3 \
  --benchmark_out="$G/bench-gdn-v2split.json" --benchmark_out_format=json >"$G/bench-gdn-v2split.log" 2>&1
say "bench v2+split rc=$?"
timeout 60 python3 fla_gdn.py --iters 10 --warmup 2 --out "$G/fla-gdn.json" >"$G/fla-gdn.log" 2>&1
say "fla rc=$?"
python3 compare_gdn.py default="$G/bench-gdn-default.json" v2split="$G/bench-gdn-v2split.json" --fla "$G/fla-gdn.json" \
  2>&1 | tee -a "$OUT/summary.txt"
pack gdn

say "C ncu"
P=$OUT/ncu; mkdir -p "$P"
env $V2SPLIT timeout 90 "$NCU" --clock-control none --set full -k regex:chunk_ --launch-skip 90 --launch-count 3 \
  bin/bench_upf --benchmark_filter='gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:32768/' --benchmark_repetitions=5 \
  >"$P/ncu-gdn-v2split-32k.log" 2>&1
say "ncu gdn rc=$?: $(grep -E '^  [a-z_]+.*kernel|Duration' "$P/ncu-gdn-v2split-32k.log" | tr -s ' ' | cut -c1-60 | tr '\n' ' ')"
timeout 60 "$NCU" --clock-control none --set full -k "regex:attn_(wgmma|fa2)" --launch-skip 150 --launch-count 1 \
  bin/bench_upf --benchmark_filter='^attn_prefill/cuda/bf16/llama_causal/B:1/kv:4096/' --benchmark_repetitions=5 \
  >"$P/ncu-prefill-wgmma-4k.log" 2>&1
say "ncu wgmma rc=$?: $(grep -E 'Duration|Compute \(SM\) Throughput|Registers Per' "$P/ncu-prefill-wgmma-4k.log" | tr -s ' ' | tr '\n' ' ')"
pack ncu
say "done: $(ls "$OUT" | tr '\n' ' ')"

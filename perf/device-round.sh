#!/usr/bin/env bash
# One device call that checks and times a round of kernel changes of issues 3 and 5, from the
# unpacked bundle of perf/stage-device.sh; each step capped, a failing step stops nothing:
#   A. quick verify, side by side: attn under the default and under each attention variant, gdn;
#      test_upf (every CUnit suite with the device);
#   B. side by side, nothing timed meanwhile: full verify of attn under each variant that passed A,
#      full verify of gdn.scan; memcheck and racecheck over `verify attn --quick` under every variant
#      that passed A, memcheck over `verify gdn.scan --quick`;
#   C. alone on the GPU: the chunked Gated DeltaNet scan (8K, 32K, 128K, 16 x 2K), then the FLA peer
#      on the same shapes (its Triton compile and autotune take most of its cap); ncu kernel durations
#      and the prep kernel's warp-stall reasons at 32K;
#   D. alone on the GPU: attention prefill (Llama 32K, 128K) and paged decode under the default and
#      each variant that passed A, then the torch SDPA peer; compare_attn.py ratios.
# SDPA=0 leaves the SDPA peer out, GDN=0 step C; GDN_VARIANTS="name=ENV=value ..." adds scan timings (and a
# quick verify) under each. Attention variant names starting decode / swa time the paged-decode / Gemma
# sliding-window and global benches, names starting verify are checked (A, B) but not timed, others time
# Llama prefill. Variants: ATTN_VARIANTS="name=ENV=value[,ENV=value] ..." (default below). $OUT gets summary.txt and
# one archive a step. PROFILE=1 adds step E: ncu --set full of the default prefill kernel at 4K and of the
# GDN state pass at 32K.   OUT=dir bash device-round.sh   (FLA wheels on PYTHONPATH for step C)
set -u
source "$(dirname "$0")/device-common.sh"
ATTN_VARIANTS=${ATTN_VARIANTS:-"decode-mma=UPF_ATTN_DECODE=mma prefill-wgmma2=UPF_ATTN_PREFILL=wgmma2"}
vname() { echo "${1%%=*}"; }
venv() { echo "${1#*=}" | tr ',' ' '; }

A=$OUT/correctness; mkdir -p "$A"
export OPENBLAS_NUM_THREADS=2
(timeout 60 bin/upf verify attn --quick --log "$A/quick-attn-default.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/quick-attn-default.log") &
(timeout 60 bin/upf verify gdn --quick --log "$A/quick-gdn.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/quick-gdn.log") &
(cd bin && timeout 120 ./test_upf >"$A/test_upf.log" 2>&1; echo "# rc=$?" >>"$A/test_upf.log") &
for v in $ATTN_VARIANTS; do
  n=$(vname "$v")
  (env $(venv "$v") timeout 60 bin/upf verify attn --quick --log "$A/quick-attn-$n.log" >/dev/null 2>&1
    echo "# rc=$?" >>"$A/quick-attn-$n.log") &
done
wait
PASSED=""
for v in $ATTN_VARIANTS; do
  n=$(vname "$v")
  grep -q '^# rc=0' "$A/quick-attn-$n.log" && PASSED="$PASSED $v"
done
report "$A"
say "passed quick verify: ${PASSED:-none}"

say "B full verifies and sanitizers"
(timeout 150 bin/upf verify gdn.scan --log "$A/full-gdn.scan.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/full-gdn.scan.log") &
for tool in memcheck racecheck; do
  (timeout 150 "$SAN" --tool $tool --error-exitcode 9 bin/upf verify gdn.scan --quick >"$A/$tool-gdn.scan.log" 2>&1
    echo "# rc=$?" >>"$A/$tool-gdn.scan.log") &
done
for v in $PASSED; do
  n=$(vname "$v")
  (env $(venv "$v") timeout 150 bin/upf verify attn --log "$A/full-attn-$n.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/full-attn-$n.log") &
  for tool in memcheck racecheck; do
    (env $(venv "$v") timeout 150 "$SAN" --tool $tool --error-exitcode 9 bin/upf verify attn --quick >"$A/$tool-attn-$n.log" 2>&1
      echo "# rc=$?" >>"$A/$tool-attn-$n.log") &
  done
done
wait
unset OPENBLAS_NUM_THREADS
report "$A"
grep -E "^PASS gdn.scan .*bf16" "$A/full-gdn.scan.log" | grep -oE "budget= *[0-9.]+%" | sort -t= -k2 -n | tail -n1 |
  sed "s/^/largest bf16 budget use, gdn.scan: /" | tee -a "$OUT/summary.txt"
pack correctness

if [ "${GDN:-1}" = 1 ]; then
say "C Gated DeltaNet timings, then FLA"
G=$OUT/gdn; mkdir -p "$G"
timeout 45 bin/bench_upf --benchmark_filter='gdn.scan/cuda/bf16/qwen3next_(prefill/chunked|batch16x2K/chunked)/' \
  --benchmark_repetitions=3 --benchmark_out="$G/bench-gdn.json" --benchmark_out_format=json >"$G/bench-gdn.log" 2>&1
say "bench gdn rc=$?"
for v in ${GDN_VARIANTS:-}; do
  n=$(vname "$v")
  env $(venv "$v") timeout 45 bin/bench_upf --benchmark_filter='gdn.scan/cuda/bf16/qwen3next_(prefill/chunked|batch16x2K/chunked)/' \
    --benchmark_repetitions=3 --benchmark_out="$G/bench-gdn-$n.json" --benchmark_out_format=json >"$G/bench-gdn-$n.log" 2>&1
  say "bench gdn $n rc=$?"
  (env $(venv "$v") timeout 60 bin/upf verify gdn.scan --quick --log "$G/quick-gdn.scan-$n.log" >/dev/null 2>&1; echo "# rc=$?" >>"$G/quick-gdn.scan-$n.log")
done
timeout "${FLA_S:-110}" python3 fla_gdn.py --iters 10 --warmup 2 --out "$G/fla-gdn.json" >"$G/fla-gdn.log" 2>&1
say "fla rc=$?"
python3 compare_gdn.py ours="$G/bench-gdn.json" $(for v in ${GDN_VARIANTS:-}; do n=$(vname "$v"); echo "$n=$G/bench-gdn-$n.json"; done) --fla "$G/fla-gdn.json" 2>&1 | tee -a "$OUT/summary.txt"
timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum -k regex:chunk_ \
  --launch-skip 90 --launch-count 3 bin/bench_upf --benchmark_filter='gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:32768/' \
  --benchmark_repetitions=5 >"$G/ncu-gdn-32k.log" 2>&1
say "ncu gdn rc=$?: $(grep -E '^  [a-z_ ]+.*chunk_[a-z0-9_]+kernel|gpu__time_duration' "$G/ncu-gdn-32k.log" | sed -E 's/\(.*//; s/ +/ /g' | tr '\n' ' ')"
timeout 40 "$NCU" --clock-control none --section WarpStateStats --section SourceCounters --print-details all \
  -k regex:chunk_prep_v2 --launch-skip 30 --launch-count 1 bin/bench_upf \
  --benchmark_filter='gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:32768/' --benchmark_repetitions=5 >"$G/ncu-prep-stalls-32k.log" 2>&1
say "ncu prep stalls rc=$?"
pack gdn
fi

say "D attention timings"
T=$OUT/attn; mkdir -p "$T"
PF='^copy|^attn_prefill/cuda/bf16/llama_causal/B:1/kv:(32768|131072)/'
DF='^copy|^attn_paged/cuda/bf16/'
SF='^copy|^attn_prefill/cuda/bf16/gemma_(swa1024|global)/'
timeout 60 bin/bench_upf --benchmark_filter="$PF|${DF#^copy|}|${SF#^copy|}" --benchmark_out="$T/bench-attn-default.json" \
  --benchmark_out_format=json >"$T/bench-attn-default.log" 2>&1
say "bench default rc=$?"
for v in $PASSED; do
  n=$(vname "$v")
  case $n in decode*) f=$DF ;; swa*) f=$SF ;; verify*) continue ;; *) f=$PF ;; esac
  env $(venv "$v") timeout 45 bin/bench_upf --benchmark_filter="$f" --benchmark_out="$T/bench-attn-$n.json" \
    --benchmark_out_format=json >"$T/bench-attn-$n.log" 2>&1
  say "bench $n rc=$?"
done
[ "${SDPA:-1}" = 1 ] && (cd peers && timeout 45 python3 torch_sdpa.py --only 'llama/T:(32768|131072)' --iters 6 --out "$T/torch-sdpa.json" \
  >"$T/torch-sdpa.log" 2>&1)
say "sdpa rc=$?"
for j in "$T"/bench-attn-*.json; do
  echo "=== $(basename "$j")" >>"$T/compare-attn.txt"
  python3 peers/compare_attn.py "$j" "$T/torch-sdpa.json" >>"$T/compare-attn.txt" 2>&1
done
grep -E "^===|llama|decode|share" "$T/compare-attn.txt" | cut -c1-140 | head -60 | tee -a "$OUT/summary.txt"
pack attn
if [ "${PROFILE:-0}" = 1 ]; then
say "E ncu, alone on the GPU: the default prefill at 4K, the GDN state pass at 32K"
P=$OUT/ncu; mkdir -p "$P"
timeout 70 "$NCU" --clock-control none --set full -k regex:attn_wgmma2 --launch-skip 150 --launch-count 1 bin/bench_upf \
  --benchmark_filter='^attn_prefill/cuda/bf16/llama_causal/B:1/kv:4096/' --benchmark_repetitions=5 >"$P/ncu-prefill-4k.log" 2>&1
say "ncu prefill rc=$?: $(grep -E ' Duration|Executed Instructions  |Compute \(SM\) Throughput' "$P/ncu-prefill-4k.log" | tr -s ' ' | tr '\n' ' ')"
timeout 70 "$NCU" --clock-control none --set full -k regex:chunk_state_split --launch-skip 30 --launch-count 1 bin/bench_upf \
  --benchmark_filter='gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:32768/' --benchmark_repetitions=5 >"$P/ncu-gdn-state-32k.log" 2>&1
say "ncu gdn state rc=$?: $(grep -E ' Duration|Memory Throughput|DRAM Throughput|L2 Hit Rate  |Executed Instructions  ' "$P/ncu-gdn-state-32k.log" | tr -s ' ' | tr '\n' ' ')"
pack ncu
fi
say "done: $(ls "$OUT" | tr '\n' ' ')"

#!/usr/bin/env bash
# Issue 3's evidence in one device call, from an unpacked bundle (bin/ lib/ peers/; see
# perf/reports/H200/README.md). The default kernels and each new variant (a runtime switch, see
# VARIANTS) are checked and timed in the same call:
#   1. `upf verify attn --quick` under each variant's switch (gates its timing and full verify);
#   2. timings on an otherwise idle GPU: every variant's own benchmark cases, the torch SDPA peer
#      (5 timed calls per backend and shape), the default kernels' GPU attention cases,
#      compare_attn.py ratios for each bench JSON;
#   3. correctness side by side (they time nothing): full `upf verify attn` (+ kv_cache) on the
#      default, full `upf verify attn` under each variant that passed --quick, compute-sanitizer
#      memcheck and racecheck over `verify attn --quick` under each variant, test_upf.
# A failing variant stops nothing. Steps 1-2 are capped to TIMING_S seconds in all, step 3 to CHECK_S.
# What comes back (<= 8 files): summary.txt, compare-attn.txt, bench-attn-default.json,
# bench-attn-variants.tar.xz (bench-attn-<variant>.json each), torch-sdpa.json, logs.tar.xz (every log).
#   OUT=dir TIMING_S=150 CHECK_S=80 bash attn-device-run.sh
set -u
cd "$(dirname "$0")"
OUT=${OUT:?set OUT}
TIMING_S=${TIMING_S:-150}
CHECK_S=${CHECK_S:-80}
BUDGET_S=$TIMING_S
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p "$L"
t0=$(date +%s)
# seconds for a step: its own cap, or what is left of the budget (at least 5: `timeout 0` would never fire)
left() { local l=$((BUDGET_S - ($(date +%s) - t0))); [ "$l" -lt 5 ] && l=5; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/summary.txt"; }

# name | switch (env assignment) | benchmark filter (the cases the switch changes)
VARIANTS=(
  "decode-v2|UPF_ATTN_DECODE=v2|attn_paged/cuda|copy"
  "decode-mma|UPF_ATTN_DECODE=mma|attn_paged/cuda|copy"
  "prefill-wgmma|UPF_ATTN_PREFILL=wgmma|attn_prefill/cuda/bf16/llama"
  "prefill-wgmma-overlap|UPF_ATTN_PREFILL=wgmma-overlap|attn_prefill/cuda/bf16/llama"
  "prefill-wgmma2|UPF_ATTN_PREFILL=wgmma2|attn_prefill/cuda/bf16/llama"
  "prefill-wgmma2-nopp|UPF_ATTN_PREFILL=wgmma2-nopp|attn_prefill/cuda/bf16/llama"
)
vfield() { echo "$1" | cut -d'|' -f"$2"; }
vfilter() { echo "$1" | cut -d'|' -f3-; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
declare -A QUICK_OK QUICK_RC
for v in "${VARIANTS[@]}"; do
  n=$(vfield "$v" 1) sw=$(vfield "$v" 2)
  env "$sw" timeout "$(left 30)" bin/upf verify attn --quick >"$L/verify-attn-quick-$n.log" 2>&1
  rc=$?; QUICK_RC[$n]=$rc QUICK_OK[$n]=$([ $rc = 0 ] && echo 1 || echo 0)
  say "quick verify $n ($sw) rc=$rc: $(grep -E '^# .*checks' "$L/verify-attn-quick-$n.log" | tr '\n' ' ')"
  grep -E "^FAIL" "$L/verify-attn-quick-$n.log" | cut -c1-200 | head -8 | tee -a "$OUT/summary.txt"
done

say "bench"
for v in "${VARIANTS[@]}"; do
  n=$(vfield "$v" 1) sw=$(vfield "$v" 2)
  [ "${QUICK_OK[$n]}" = 1 ] || { say "bench $n skipped (quick verify failed)"; continue; }
  env "$sw" timeout "$(left 30)" bin/bench_upf --benchmark_filter="$(vfilter "$v")" \
    --benchmark_out="$OUT/bench-attn-$n.json" --benchmark_out_format=json >"$L/bench-attn-$n.log" 2>&1
  say "bench $n rc=$?"
done
say "sdpa peer"
(cd peers && timeout "$(left 70)" python3 torch_sdpa.py --iters 5 --warmup 2 --out "$OUT/torch-sdpa.json" \
  >"$L/torch-sdpa.log" 2>&1)
say "sdpa rc=$?"
# the default kernels (unchanged since d6b2582) again, for same-run ratios: GPU prefill and decode cases
timeout "$(left 70)" bin/bench_upf --benchmark_filter='attn_prefill/cuda/bf16|attn_paged/cuda|copy' \
  --benchmark_out="$OUT/bench-attn-default.json" --benchmark_out_format=json >"$L/bench-attn-default.log" 2>&1
say "bench default rc=$?"
for f in "$OUT"/bench-attn-*.json; do
  echo "=== $(basename "$f")" >>"$OUT/compare-attn.txt"
  python3 peers/compare_attn.py "$f" "$OUT/torch-sdpa.json" >>"$OUT/compare-attn.txt" 2>&1
done
grep -E "^===|^llama|^d64|^gemma|  (llama|gemma)_decode" "$OUT/compare-attn.txt" | cut -c1-130

say "correctness, side by side"
BUDGET_S=$(($(date +%s) - t0 + CHECK_S))
cap=$(left "$CHECK_S")
( timeout "$cap" bin/upf verify attn >"$L/verify-attn-default.log" 2>&1; echo "# upf verify attn rc=$?" >>"$L/verify-attn-default.log"
  timeout "$(left 40)" bin/upf verify kv_cache >>"$L/verify-attn-default.log" 2>&1
  echo "# upf verify kv_cache rc=$?" >>"$L/verify-attn-default.log" ) &
( cd bin && timeout "$cap" ./test_upf >"$L/test.log" 2>&1; echo "# test_upf rc=$?" >>"$L/test.log" ) &
for v in "${VARIANTS[@]}"; do
  n=$(vfield "$v" 1) sw=$(vfield "$v" 2)
  if [ "${QUICK_OK[$n]}" = 1 ]; then
    ( env "$sw" timeout "$cap" bin/upf verify attn >"$L/verify-attn-$n.log" 2>&1
      echo "# upf verify attn ($sw) rc=$?" >>"$L/verify-attn-$n.log" ) &
  fi
  case "${QUICK_RC[$n]}" in 124|137) say "sanitizers $n skipped (its quick verify hung)"; continue ;; esac
  for tool in memcheck racecheck; do
    ( env "$sw" timeout "$cap" compute-sanitizer --tool $tool --error-exitcode 9 bin/upf verify attn --quick \
        >"$L/sanitizer-$tool-$n.log" 2>&1
      echo "# $tool ($sw) rc=$?" >>"$L/sanitizer-$tool-$n.log" ) &
  done
done
wait
say "done"
for f in "$L"/verify-attn-*.log; do
  echo "--- $(basename "$f")"; grep -E "^# .*checks|rc=" "$f"; grep -E "^FAIL" "$f" | cut -c1-200 | head -8
done | tee -a "$OUT/summary.txt"
{ grep -A4 "Run Summary" "$L/test.log"; grep -E "SKIPPED|FAILED|failed" "$L/test.log" | head -5; tail -1 "$L/test.log"
  for f in "$L"/sanitizer-*.log; do echo "--- $(basename "$f")"; grep -E "checks:|SUMMARY|rc=" "$f"; done; } | tee -a "$OUT/summary.txt"
tar -C "$OUT" -cJf "$OUT/logs.tar.xz" logs && rm -rf "$L"
# one file for the variants' bench JSONs: the device tool returns at most 8 files
( cd "$OUT" && vj=$(ls bench-attn-*.json 2>/dev/null | grep -v '^bench-attn-default.json$')
  [ -n "$vj" ] && tar -cJf bench-attn-variants.tar.xz $vj && rm -f $vj )
say "packed; $(ls "$OUT" | tr '\n' ' ')"

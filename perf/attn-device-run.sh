#!/usr/bin/env bash
# Issue 3's evidence in one device call, from an unpacked bundle (bin/ lib/ peers/; see
# perf/reports/H200/README.md): timings first on an otherwise idle GPU (bench_upf attention cases and
# the torch SDPA peer, side by side), then the correctness runs side by side (they time nothing):
# the full `upf verify attn` + `kv_cache`, `test_upf`, compute-sanitizer memcheck and racecheck over
# the quick attention verify. Steps are capped so the whole stays inside BUDGET_S seconds.
#   OUT=dir BUDGET_S=290 bash attn-device-run.sh
set -u
cd "$(dirname "$0")"
OUT=${OUT:?set OUT}
BUDGET_S=${BUDGET_S:-290}
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { local l=$((BUDGET_S - ($(date +%s) - t0))); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "[$(($(date +%s) - t0)) s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >"$OUT/verify-attn.log"
say "bench"
timeout "$(left 110)" bin/bench_upf --benchmark_filter='attn_|kv_cache|copy' --benchmark_out="$OUT/bench-attn.json" \
  --benchmark_out_format=json >"$OUT/bench-attn.log" 2>&1
say "bench rc=$?"
grep -E "_median|manual_time |^attn|^kv_cache|^copy" "$OUT/bench-attn.log" | cut -c1-140 | head -40
say "sdpa peer"
(cd peers && timeout "$(left 100)" python3 torch_sdpa.py --out "$OUT/torch-sdpa.json" >"$OUT/torch-sdpa.log" 2>&1)
say "sdpa rc=$?"
grep -E "/best|not run" "$OUT/torch-sdpa.log" | cut -c1-150
python3 peers/compare_attn.py "$OUT/bench-attn.json" "$OUT/torch-sdpa.json" 2>&1 | tee -a "$OUT/torch-sdpa.log"

say "correctness, side by side"
cap=$(left 200)
( timeout "$cap" bin/upf verify attn >>"$OUT/verify-attn.log" 2>&1; echo "# upf verify attn rc=$?" >>"$OUT/verify-attn.log"
  timeout 60 bin/upf verify kv_cache >>"$OUT/verify-attn.log" 2>&1; echo "# upf verify kv_cache rc=$?" >>"$OUT/verify-attn.log" ) &
( cd bin && timeout "$cap" ./test_upf >"$OUT/test.log" 2>&1; echo "# test_upf rc=$?" >>"$OUT/test.log" ) &
( timeout "$cap" compute-sanitizer --tool memcheck --error-exitcode 9 bin/upf verify attn --quick >"$OUT/sanitizer-memcheck.log" 2>&1
  echo "# rc=$?" >>"$OUT/sanitizer-memcheck.log"
  timeout "$(left 60)" compute-sanitizer --tool memcheck --error-exitcode 9 bin/upf verify kv_cache --quick >>"$OUT/sanitizer-memcheck.log" 2>&1
  echo "# rc=$?" >>"$OUT/sanitizer-memcheck.log" ) &
( timeout "$cap" compute-sanitizer --tool racecheck --error-exitcode 9 bin/upf verify attn --quick >"$OUT/sanitizer-racecheck.log" 2>&1
  echo "# rc=$?" >>"$OUT/sanitizer-racecheck.log" ) &
wait
say "done"
grep -E "^# .*checks|rc=" "$OUT/verify-attn.log"; grep -v "^PASS\|^#" "$OUT/verify-attn.log" | head -20
grep -A4 "Run Summary" "$OUT/test.log"; grep -E "SKIPPED|FAILED|failed" "$OUT/test.log" | head -5; tail -1 "$OUT/test.log"
for f in memcheck racecheck; do grep -E "checks:|SUMMARY|rc=" "$OUT/sanitizer-$f.log"; done

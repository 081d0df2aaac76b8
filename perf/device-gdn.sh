#!/usr/bin/env bash
# Device run for issue 5 (Gated DeltaNet), from an unpacked bundle (bin/, lib/, COMMIT, fla_gdn.py,
# peer_common.py, this script; see perf/reports/H200/README.md): the quick verify first, then the
# full verify in the background (its CPU reference is the long pole) beside the timings (bench_upf
# gdn cases, the FLA peer, ncu kernel durations), then memcheck, racecheck, test_upf and the 4-warp
# state pass's quick verify in parallel. Usage: bash device-gdn.sh OUTDIR
set -u
O=$1; B=bin
export UPF_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
echo "== quick verify gdn"; $B/upf verify gdn --quick --log $O/verify-gdn-quick.log > /dev/null; echo "rc=$?"
grep -E "^FAIL" $O/verify-gdn-quick.log | cut -c1-330 | head -12; tail -n1 $O/verify-gdn-quick.log
( timeout 300 $B/upf verify gdn --log $O/verify-gdn-full.log > /dev/null 2>&1; echo "rc=$?" >> $O/verify-gdn-full.log ) &
VP=$!
echo "== bench"; timeout 120 $B/bench_upf --benchmark_filter='gdn' --benchmark_out=$O/bench-gdn.json --benchmark_out_format=json > /tmp/bench-gdn.log 2>&1; echo "rc=$?"
grep -E "^gdn|ERROR|skipped|not timed" /tmp/bench-gdn.log | sed -E 's/ +/ /g' | cut -c1-200
echo "== fla peer"
PYTHONUNBUFFERED=1 timeout 150 python3 fla_gdn.py --out $O/fla-gdn.json > /tmp/fla-gdn.log 2>&1; echo "rc=$?"
grep -vE "^\s*$" /tmp/fla-gdn.log | tail -8 | cut -c1-220
echo "== ncu: kernel durations at T=32K (one request)"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 45 $NCU --clock-control none --metrics gpu__time_duration.sum -k regex:chunk_ --launch-skip 40 --launch-count 4 \
  $B/bench_upf --benchmark_filter='prefill/chunked/T:32768' > /tmp/ncu.log 2>&1; echo "rc=$?"
grep -E "chunk_(prep|state)_kernel|gpu__time_duration" /tmp/ncu.log | sed -E 's/ +/ /g' | cut -c1-160 | head -8
if [ "${SANITIZE:-1}" = 1 ]; then
  echo "== sanitizers + test_upf (parallel)"
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 $B/upf verify gdn --quick > $O/sanitizer-memcheck-gdn.log 2>&1 &
  P1=$!
  timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 $B/upf verify gdn --quick > $O/sanitizer-racecheck-gdn.log 2>&1 &
  P2=$!
  timeout 100 $B/test_upf > $O/test.log 2>&1 &
  P3=$!
  UPF_GDN_STATE_WARPS=4 $B/upf verify gdn.scan --quick --log /tmp/verify-4w.log > /dev/null 2>&1; echo "quick verify gdn.scan, 4 warps: rc=$? $(tail -n1 /tmp/verify-4w.log)"
  wait $P1; echo "memcheck rc=$?"; wait $P2; echo "racecheck rc=$?"; wait $P3; echo "test_upf rc=$?"
  for f in memcheck racecheck; do tail -n 2 $O/sanitizer-$f-gdn.log; done
  grep -A4 "Run Summary" $O/test.log; grep -E "FAILED|Failed" $O/test.log | head -5
fi
wait $VP
echo "== full verify"; grep -cE "^PASS" $O/verify-gdn-full.log; grep -E "^FAIL" $O/verify-gdn-full.log | cut -c1-330 | head -10; tail -n2 $O/verify-gdn-full.log
grep -E "gdn.scan.*(4096|32768)" $O/verify-gdn-full.log | sed -E 's/ +/ /g' | cut -c1-230

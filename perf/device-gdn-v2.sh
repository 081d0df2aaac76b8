#!/usr/bin/env bash
# Device run for issue 5, the switched variants of the chunked Gated DeltaNet scan (cuda/gdn_chunked.cu):
#   prep_v2 = UPF_GDN_PREP=v2                       (chunk_prep_v2_kernel; the fused state pass)
#   prep_v3 = UPF_GDN_PREP=v3                       (chunk_prep_v3_kernel: value-head pairs; fused state pass)
#   split   = UPF_GDN_STATE=split                   (v1 prep; state pass without O + chunk_out_kernel)
#   both    = UPF_GDN_PREP=v2 UPF_GDN_STATE=split
#   both3   = UPF_GDN_PREP=v3 UPF_GDN_STATE=split
# (written when v1 + fused was the default; since 92c0cbd the default is v2 + split, which `both` repeats)
# From an unpacked bundle (bin/, lib/, COMMIT, fla_gdn.py, peer_common.py, this script), within
# GDN_BUDGET_S (default 88 s; device-session.sh caps it at 95). Correctness runs entirely BEFORE any
# timing, and nothing else runs on the GPU while a benchmark runs (the 2321d5f run lost its timings
# because the full verifies ran beside the benchmarks and pushed them past their caps):
#   A  quick verify gdn, the default and every variant, in parallel                       (~10 s, cap 20)
#   B  full verify gdn.scan (~40 s of single-thread CPU reference each) for the default, both and both3
#      (together they run every new kernel; the single-switch variants run the same kernels on the same
#      workspace), in parallel with memcheck and racecheck over `verify gdn.scan --quick` under both3
#      (prep v3, split state pass, out kernel), all waited for                               (cap 50)
#   C  alone on the GPU: bench_upf, chunked gdn.scan at 8K, 32K and 16 x 2K (3 repetitions), one
#      process per variant that passed A, the likeliest new default first:
#      default, both3, prep_v3, both, prep_v2, split; a bench starts only with 6 s or more left
#   D  with the time still left: 128K for default and both3 (>= 14 s), the FLA peer (>= 24 s), ncu
#      kernel durations at 32K under both3 (>= 12 s)
# The variants keep every rounding and summation order of the default, so each variant's verify log
# should carry the default's nmse / max_err figures digit for digit: the summary says "same metrics as
# default" per variant (a difference is not a failure, but it means the bits moved).
# Every log, JSON and the summary are written straight into OUTDIR as each step ends (an outer timeout
# loses only the step it cuts). A failing or timed-out step never stops the script; rc 124 = timed out.
# Without the FLA peer's JSON the summary's FLA column uses the FLA medians of the 282ec2f run (H200,
# perf/reports/H200/fla-gdn-282ec2f.json) and says so.
# Usage: [GDN_BUDGET_S=88] bash /path/to/bundle/device-gdn-v2.sh OUTDIR   (from any directory)
set -u
mkdir -p "$1"
O=$(cd "$1" && pwd)
cd "$(dirname "$0")" # the bundle's top: bin/, lib/, COMMIT, the peers
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=bin
S=$O/gdn-v2-summary.txt
BUDGET=${GDN_BUDGET_S:-88}
export UPF_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
T0=$(date +%s)
say() { echo "$*" | tee -a "$S"; }
stamp() { say "== $1 (t=$(($(date +%s) - T0)) s)"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
envof() {
  case $1 in
    default) echo "" ;;
    prep_v2) echo "UPF_GDN_PREP=v2" ;;
    prep_v3) echo "UPF_GDN_PREP=v3" ;;
    split) echo "UPF_GDN_STATE=split" ;;
    both) echo "UPF_GDN_PREP=v2 UPF_GDN_STATE=split" ;;
    both3) echo "UPF_GDN_PREP=v3 UPF_GDN_STATE=split" ;;
  esac
}
NEW="both3 prep_v3 both prep_v2 split" # the order of step C after the default

say "commit $UPF_COMMIT; budget $BUDGET s; $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1)"
stamp "A: quick verify gdn, default and each variant (parallel)"
export OPENBLAS_NUM_THREADS=2 # the CPU references of up to six processes share the cores
for v in default $NEW; do
  (env $(envof $v) timeout 20 $B/upf verify gdn --quick --log $O/verify-quick-$v.log > /dev/null 2>&1
   echo $? > $O/rc-quick-$v) &
done
wait
PASSED=""
say "quick [default] rc=$(cat $O/rc-quick-default 2>/dev/null): $(tail -n1 $O/verify-quick-default.log 2>/dev/null)"
grep -E "^FAIL" $O/verify-quick-default.log 2>/dev/null | cut -c1-260 | head -4 | tee -a "$S"

same_as_default() { # $1 = log kind (quick|full), $2 = variant: do the check lines match the default's?
  local a=$O/verify-$1-default.log b=$O/verify-$1-$2.log
  [ -s "$a" ] && [ -s "$b" ] || { echo "n/a"; return; }
  if diff -q <(grep -E "^(PASS|FAIL)" "$a") <(grep -E "^(PASS|FAIL)" "$b") > /dev/null; then echo "same metrics as default";
  else echo "DIFFERENT metrics from default ($(diff <(grep -E "^(PASS|FAIL)" "$a") <(grep -E "^(PASS|FAIL)" "$b") | grep -c '^>') lines)"; fi
}
for v in $NEW; do
  rc=$(cat $O/rc-quick-$v 2>/dev/null || echo none)
  say "quick [$v] rc=$rc: $(tail -n1 $O/verify-quick-$v.log 2>/dev/null); $(same_as_default quick $v)"
  grep -E "^FAIL" $O/verify-quick-$v.log 2>/dev/null | cut -c1-260 | head -4 | tee -a "$S"
  [ "$rc" = 0 ] && PASSED="$PASSED $v"
done

FULL="default"
for v in both both3; do case " $PASSED " in *" $v "*) FULL="$FULL $v" ;; esac; done
stamp "B: full verify gdn.scan [$FULL] + memcheck/racecheck over quick verify gdn.scan [both3] (parallel, then waited for)"
for v in $FULL; do
  (env $(envof $v) timeout 50 $B/upf verify gdn.scan --log $O/verify-full-$v.log > /dev/null 2>&1
   echo $? > $O/rc-full-$v) &
done
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  (env $(envof both3) timeout 30 $SAN --tool $tool --error-exitcode 9 $B/upf verify gdn.scan --quick > $O/sanitizer-$tool-both3.log 2>&1
   echo $? > $O/rc-$tool) &
done
wait
unset OPENBLAS_NUM_THREADS
for tool in memcheck racecheck; do
  say "$tool [both3] rc=$(cat $O/rc-$tool 2>/dev/null): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|checks:" $O/sanitizer-$tool-both3.log | tr '\n' ' ' | cut -c1-200)"
done
for v in $FULL; do
  say "full [$v] rc=$(cat $O/rc-full-$v 2>/dev/null): $(tail -n1 $O/verify-full-$v.log 2>/dev/null)$([ $v != default ] && echo "; $(same_as_default full $v)")"
  grep -E "^FAIL" $O/verify-full-$v.log 2>/dev/null | cut -c1-260 | head -4 | tee -a "$S"
done
say "largest budget use, bf16 chunked scan checks:"
for v in $FULL; do
  grep -E "^PASS gdn.scan .*bf16" $O/verify-full-$v.log 2>/dev/null | grep -oE "budget= *[0-9.]+%" | sort -t= -k2 -n | tail -n1 | sed "s/^/  [$v] /" | tee -a "$S"
done

bench() { # $1 variant, $2 filter of the cases, $3 file tag, $4 cap (s)
  env $(envof $1) timeout $4 $B/bench_upf --benchmark_filter="$2" --benchmark_repetitions=3 \
    --benchmark_out=$O/bench-$3-$1.json --benchmark_out_format=json > $O/bench-$3-$1.log 2>&1
  say "bench $3 [$1] rc=$? (t=$(($(date +%s) - T0)) s)"
}
stamp "C: alone on the GPU: bench_upf chunked gdn.scan 8K, 32K, 16 x 2K: default$PASSED"
for v in default $PASSED; do
  L=$(left)
  if [ $L -lt 6 ]; then say "bench [$v] skipped: $L s left"; continue; fi
  bench $v 'gdn.scan/cuda/bf16/qwen3next_(prefill/chunked/T:(8192|32768)|batch16x2K/chunked)/' main $((L < 15 ? L : 15))
done

stamp "D: with the time left: 128K (default, both3), FLA peer, ncu"
for v in default both3; do
  case " default $PASSED " in *" $v "*) ;; *) continue ;; esac
  L=$(left)
  if [ $L -ge 14 ]; then bench $v 'gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:131072/' 128k $((L < 20 ? L : 20));
  else say "bench 128k [$v] skipped: $L s left"; fi
done
L=$(left)
if [ $L -ge 24 ]; then
  PYTHONUNBUFFERED=1 timeout $L python3 fla_gdn.py --iters 10 --warmup 2 --out $O/fla-gdn.json > $O/fla-gdn.log 2>&1
  say "fla rc=$?"
else
  say "fla skipped: $L s left (the FLA column below is the 282ec2f run's)"
fi
L=$(left)
if [ $L -ge 12 ] && case " $PASSED " in *" both3 "*) true ;; *) false ;; esac; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  env $(envof both3) timeout $L $NCU --clock-control none --metrics gpu__time_duration.sum -k regex:chunk_ \
    --launch-skip 30 --launch-count 3 $B/bench_upf --benchmark_filter='prefill/chunked/T:32768' > $O/ncu-both3-32k.log 2>&1
  say "ncu rc=$?"
  grep -E "chunk_[a-z0-9_]+kernel|gpu__time_duration" $O/ncu-both3-32k.log | sed -E 's/ +/ /g; s/\(state_args\)|\(prep_args\)//' | cut -c1-120 | head -6 | tee -a "$S"
else
  say "ncu skipped: $L s left"
fi

say "== medians (ms) of the chunked gdn.scan cases; (ratio) = variant / default; best/FLA"
ARGS=""
for v in default both3 prep_v3 both prep_v2 split; do
  F=$(ls $O/bench-*-$v.json 2>/dev/null | tr '\n' ',' | sed 's/,$//')
  [ -n "$F" ] && ARGS="$ARGS $v=$F"
done
python3 compare_gdn.py $ARGS $([ -s $O/fla-gdn.json ] && echo --fla $O/fla-gdn.json) 2>&1 | tee -a "$S"
stamp "done"

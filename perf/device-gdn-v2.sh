#!/usr/bin/env bash
# Device run for issue 5, the switched variants of the chunked Gated DeltaNet scan (cuda/gdn_chunked.cu):
#   prep_v2 = UPF_GDN_PREP=v2          (chunk_prep_v2_kernel; the fused state pass)
#   split   = UPF_GDN_STATE=split      (v1 prep; state pass without O + chunk_out_kernel)
#   both    = UPF_GDN_PREP=v2 UPF_GDN_STATE=split
# From an unpacked bundle (bin/, lib/, COMMIT, fla_gdn.py, peer_common.py, this script), about 75 s:
#   A  quick verify gdn under each variant and the default, in parallel                (~10 s)
#   B  full verify gdn.scan (~40 s of single-thread CPU reference) for the default and each variant that
#      passed A, in the background (timeout 60 s), and
#      memcheck + racecheck over `verify gdn.scan --quick` under `both` (all 3 new kernels) (<= 25 s)
#   C  bench_upf, the chunked gdn.scan cases, default and each variant that passed A    (~5 s each)
#   D  the FLA peer (same shapes): a timeout there loses only the peer                 (<= 22 s)
#   E  ncu kernel durations (prep v2, split state pass, out kernel) at 32K under `both`, only if at
#      least 12 s of the 72 s are left (one launch of each; the prep/state split of the card)
# The variants keep every rounding and summation order of the default, so each variant's verify log
# should carry the default's nmse / max_err figures digit for digit: the summary says "same metrics as
# default" per variant (a difference is not a failure, but it means the bits moved).
# A failing or timed-out step never stops the script. Everything lands in ONE archive $OUT/gdn-v2.tar
# plus the short $OUT/gdn-v2-summary.txt (also inside the archive). rc 124 = timed out (not a failure).
# Usage: bash device-gdn-v2.sh OUTDIR
set -u
O=$1
B=bin
W=$(mktemp -d /tmp/gdn-v2.XXXXXX)
S=$W/summary.txt
export UPF_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
T0=$(date +%s)
say() { echo "$*" | tee -a "$S"; }
stamp() { say "== $1 (t=$(($(date +%s) - T0)) s)"; }
envof() {
  case $1 in
    default) echo "" ;;
    prep_v2) echo "UPF_GDN_PREP=v2" ;;
    split) echo "UPF_GDN_STATE=split" ;;
    both) echo "UPF_GDN_PREP=v2 UPF_GDN_STATE=split" ;;
  esac
}
NEW="prep_v2 split both"

say "commit $UPF_COMMIT; $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1)"
stamp "A: quick verify gdn, default and each variant"
for v in default $NEW; do
  (env $(envof $v) timeout 25 $B/upf verify gdn --quick --log $W/verify-quick-$v.log > /dev/null 2>&1
   echo $? > $W/rc-quick-$v) &
done
wait
PASSED=""
for v in $NEW; do
  rc=$(cat $W/rc-quick-$v 2>/dev/null || echo none)
  say "quick [$v] rc=$rc: $(tail -n1 $W/verify-quick-$v.log 2>/dev/null)"
  grep -E "^FAIL" $W/verify-quick-$v.log 2>/dev/null | cut -c1-260 | head -4 | tee -a "$S"
  [ "$rc" = 0 ] && PASSED="$PASSED $v"
done

same_as_default() { # $1 = log kind (quick|full), $2 = variant: do the check lines match the default's?
  local a=$W/verify-$1-default.log b=$W/verify-$1-$2.log
  [ -s "$a" ] && [ -s "$b" ] || { echo "n/a"; return; }
  if diff -q <(grep -E "^(PASS|FAIL)" "$a") <(grep -E "^(PASS|FAIL)" "$b") > /dev/null; then echo "same metrics as default";
  else echo "DIFFERENT metrics from default ($(diff <(grep -E "^(PASS|FAIL)" "$a") <(grep -E "^(PASS|FAIL)" "$b") | grep -c '^>') lines)"; fi
}
say "quick [default] rc=$(cat $W/rc-quick-default 2>/dev/null): $(tail -n1 $W/verify-quick-default.log 2>/dev/null)"
for v in $NEW; do say "quick [$v] vs default: $(same_as_default quick $v)"; done

stamp "B: full verify gdn.scan [default${PASSED}] (background) + memcheck/racecheck over quick verify gdn.scan [both]"
for v in default $PASSED; do
  (env $(envof $v) timeout 60 $B/upf verify gdn.scan --log $W/verify-full-$v.log > /dev/null 2>&1
   echo $? > $W/rc-full-$v) &
done
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  (env $(envof both) timeout 25 $SAN --tool $tool --error-exitcode 9 $B/upf verify gdn.scan --quick > $W/sanitizer-$tool-both.log 2>&1
   echo $? > $W/rc-$tool) &
  eval "P_$tool=\$!"
done
wait $P_memcheck $P_racecheck
for tool in memcheck racecheck; do
  say "$tool [both] rc=$(cat $W/rc-$tool): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|checks:" $W/sanitizer-$tool-both.log | tr '\n' ' ' | cut -c1-200)"
done

stamp "C: bench_upf chunked gdn.scan: default${PASSED}"
for v in default $PASSED; do
  env $(envof $v) timeout 15 $B/bench_upf --benchmark_filter='gdn.scan/cuda/bf16/.*/chunked' \
    --benchmark_out=$W/bench-$v.json --benchmark_out_format=json > $W/bench-$v.log 2>&1
  say "bench [$v] rc=$?"
done

stamp "D: FLA peer"
PYTHONUNBUFFERED=1 timeout 22 python3 fla_gdn.py --iters 10 --warmup 2 --out $W/fla-gdn.json > $W/fla-gdn.log 2>&1
say "fla rc=$?"

stamp "E: ncu kernel durations at T=32K under both (only with 12 s or more left of 72)"
LEFT=$((72 - ($(date +%s) - T0)))
if [ $LEFT -ge 12 ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  env $(envof both) timeout $LEFT $NCU --clock-control none --metrics gpu__time_duration.sum -k regex:chunk_ \
    --launch-skip 30 --launch-count 3 $B/bench_upf --benchmark_filter='prefill/chunked/T:32768' > $W/ncu-both-32k.log 2>&1
  say "ncu rc=$?"
  grep -E "chunk_[a-z0-9_]+kernel|gpu__time_duration" $W/ncu-both-32k.log | sed -E 's/ +/ /g; s/\(state_args\)|\(prep_args\)//' | cut -c1-120 | head -6 | tee -a "$S"
else
  say "ncu skipped: $LEFT s left"
fi

stamp "waiting for the full verifies"
wait
for v in default $PASSED; do
  say "full [$v] rc=$(cat $W/rc-full-$v 2>/dev/null): $(tail -n1 $W/verify-full-$v.log 2>/dev/null)$([ $v != default ] && echo "; $(same_as_default full $v)")"
  grep -E "^FAIL" $W/verify-full-$v.log 2>/dev/null | cut -c1-260 | head -4 | tee -a "$S"
done
say "largest budget use, bf16 chunked scan checks (default, then each variant):"
for v in default $PASSED; do
  grep -E "^PASS gdn.scan .*bf16" $W/verify-full-$v.log 2>/dev/null | grep -oE "budget= *[0-9.]+%" | sort -t= -k2 -n | tail -n1 | sed "s/^/  [$v] /" | tee -a "$S"
done

say "== medians (ms) of the chunked gdn.scan cases; ratio = variant / default, FLA = variant / FLA"
python3 - "$W" <<'EOF' 2>&1 | tee -a "$S"
import json, os, sys
w = sys.argv[1]
def ours(v):
    try:
        d = json.load(open(os.path.join(w, f"bench-{v}.json")))
    except Exception:
        return {}
    out = {}
    for b in d.get("benchmarks", []):
        n = b["name"]
        if n.endswith("_median") and "/chunked/" in n:
            key = n.split("/")[3] + "/" + [p for p in n.split("/") if p.startswith("T:")][0]
            out[key] = b["real_time"] / 1000.0  # us -> ms
    return out
fla = {}
try:
    for r in json.load(open(os.path.join(w, "fla-gdn.json")))["results"]:
        fla[r["name"].split("/")[3] + "/" + r["name"].split("/")[4]] = r["median_s"] * 1e3
except Exception:
    pass
runs = {v: ours(v) for v in ["default", "prep_v2", "split", "both"]}
keys = sorted(runs["default"] or next((r for r in runs.values() if r), {}), key=lambda k: (k.split("/")[0], int(k.split(":")[1])))
print(f"{'case':34s} {'default':>8s} {'prep_v2':>14s} {'split':>14s} {'both':>14s} {'FLA':>7s} {'best/FLA':>8s}")
for k in keys:
    d = runs["default"].get(k)
    row = f"{k:34s} {d if d else float('nan'):8.3f}"
    best = d
    for v in ["prep_v2", "split", "both"]:
        x = runs[v].get(k)
        row += f" {x:8.3f} ({x / d:4.2f})" if x and d else f" {'-':>14s}"
        if x and (best is None or x < best):
            best = x
    f = fla.get(k)
    row += f" {f:7.3f} {best / f:8.2f}" if f and best else f" {'-':>7s} {'-':>8s}"
    print(row)
EOF
stamp "done"
cp "$S" "$O/gdn-v2-summary.txt"
tar -C "$W" -cf "$O/gdn-v2.tar" .

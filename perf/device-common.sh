# Sourced by the whole-call device scripts (device-session.sh, device-probe.sh, device-profile.sh,
# device-round.sh) from the unpacked bundle of perf/stage-device.sh: moves to the bundle's top, puts
# its libraries on the loader path and defines the helpers they share. Needs OUT (the device tool's
# output folder).
cd "$(dirname "${BASH_SOURCE[0]}")"
OUT=${OUT:?set OUT}
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
export UPF_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/summary.txt"; }
# one archive per step: the device tool returns at most 8 files
pack() { tar -C "$OUT" -cJf "$OUT/$1.tar.xz" "$1" && rm -rf "${OUT:?}/$1"; }
report() { # dir: one line per log (check counts, sanitizer summaries, rc), then its failures
  for f in "$1"/*.log; do
    say "$(basename "$f"): $(grep -E '^# [0-9]+ checks|ERROR SUMMARY|RACECHECK SUMMARY|^ +tests |^# rc=' "$f" | tr -s ' ' | tr '\n' ' ')"
    grep -E '^FAIL|Failed|FAILED' "$f" | cut -c1-220 | head -4 | tee -a "$OUT/summary.txt"
  done
}
gdn_step() { # step label: device-gdn-v2.sh (the chunked scan's variants) into $OUT/gdn, its summary here
  mkdir -p "$OUT/gdn"
  GDN_BUDGET_S=88 timeout 95 bash device-gdn-v2.sh "$OUT/gdn" >"$OUT/gdn/console.txt" 2>&1
  say "$1 rc=$?"; cat "$OUT/gdn/gdn-v2-summary.txt" >>"$OUT/summary.txt" 2>/dev/null; pack gdn
}
say "commit $UPF_COMMIT; $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader)"

#!/usr/bin/env bash
# A short device call for a small MoE change (fits the end of a session's device time): `upf verify
# moe --quick` on this bundle (with FULL='op ...' also the full `upf verify op` of each and memcheck
# over `upf verify moe.ffn --quick`, side by side; the logs come back packed in correctness.tar.xz),
# then bench moe.dense_equiv and moe.ffn at 8K and 32K (and the rows EXTRA names, a regex) on this
# bundle, on BASE's (the commit before), and on this one again (A/B/A: drift shows as A != A).
#   OUT=dir BASE=dir [FULL='op ...'] [EXTRA=regex] bash device-moe-ab.sh
set -u
source "$(dirname "$0")/device-common.sh"
BASE=${BASE:?set BASE to an unpacked bundle of the commit before}
FULL=${FULL:-}
EXTRA=${EXTRA:-}
say "verify moe --quick${FULL:+, verify $FULL, memcheck over verify moe.ffn --quick}"
(OPENBLAS_NUM_THREADS=4 timeout 150 bin/upf verify moe --quick --log "$OUT/verify-moe-quick.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$OUT/verify-moe-quick.log") &
if [ -n "$FULL" ]; then
  for op in $FULL; do
    (OPENBLAS_NUM_THREADS=6 timeout 240 bin/upf verify "$op" --log "$OUT/verify-$op-full.log" >/dev/null 2>&1
      echo "# rc=$?" >>"$OUT/verify-$op-full.log") &
  done
  (OPENBLAS_NUM_THREADS=1 timeout 230 "$SAN" --tool memcheck --error-exitcode 9 bin/upf verify moe.ffn --quick \
    >"$OUT/memcheck-moe.ffn-quick.log" 2>&1; echo "# rc=$?" >>"$OUT/memcheck-moe.ffn-quick.log") &
fi
wait
report "$OUT"
mkdir -p "$OUT/correctness" && mv "$OUT"/*.log "$OUT/correctness/" && pack correctness
FILTER='^copy|^moe\.(dense_equiv|ffn)/cuda/bf16/T:(8192|32768)'${EXTRA:+|$EXTRA}
bench() { # label dir
  (cd "$2" && LD_LIBRARY_PATH=$2/lib timeout 120 bin/bench_upf --benchmark_filter="$FILTER" \
    --benchmark_out="$OUT/bench-moe-$1.json" --benchmark_out_format=json >"$OUT/bench-moe-$1.log" 2>&1)
  say "bench $1 ($(cat "$2/COMMIT")) rc=$?"
  grep -E '_median' "$OUT/bench-moe-$1.log" | sed -E 's/ +/ /g' | cut -c1-700 >>"$OUT/summary.txt"
}
bench new1 "$PWD"
bench base "$BASE"
bench new2 "$PWD"
say done

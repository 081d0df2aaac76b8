#!/usr/bin/env bash
# A short device call for a small MoE change (fits the end of a session's device time): `upf verify moe
# --quick` on this bundle, then bench moe.dense_equiv and moe.ffn at 8K and 32K on this bundle, on BASE's
# (the commit before), and on this one again (A/B/A: drift shows as A != A).
#   OUT=dir BASE=dir bash device-moe-ab.sh
set -u
source "$(dirname "$0")/device-common.sh"
BASE=${BASE:?set BASE to an unpacked bundle of the commit before}
say "verify moe --quick"
OPENBLAS_NUM_THREADS=8 timeout 100 bin/upf verify moe --quick --log "$OUT/verify-moe-quick.log" >/dev/null 2>&1
echo "# rc=$?" >>"$OUT/verify-moe-quick.log"
report "$OUT"
FILTER='^copy|^moe\.(dense_equiv|ffn)/cuda/bf16/T:(8192|32768)'
bench() { # label dir
  (cd "$2" && LD_LIBRARY_PATH=$2/lib timeout 60 bin/bench_upf --benchmark_filter="$FILTER" \
    --benchmark_out="$OUT/bench-moe-$1.json" --benchmark_out_format=json >"$OUT/bench-moe-$1.log" 2>&1)
  say "bench $1 ($(cat "$2/COMMIT")) rc=$?"
  grep -E '^moe\.(dense_equiv|ffn).*_median' "$OUT/bench-moe-$1.log" | sed -E 's/ +/ /g' | cut -c1-420 >>"$OUT/summary.txt"
}
bench new1 "$PWD"
bench base "$BASE"
bench new2 "$PWD"
say done

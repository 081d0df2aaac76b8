#!/usr/bin/env bash
# One device call: an Nsight Systems timeline of the MoE layer at T (default 32768) on the bundle's
# build, to find the GPU's idle time and the streams' overlap between kernels (ncu times kernels one by
# one and cannot show either). Writes the kernel and memcpy trace as CSV (nsys stats cuda_gpu_trace);
# perf/moe_timeline.py reads it. OUT=dir [T=32768] bash device-moe-timeline.sh
set -u
source "$(dirname "$0")/device-common.sh"
T=${T:-32768}
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
say "nsys: ${NSYS:-none}"
[ -n "$NSYS" ] || exit 0
timeout 200 "$NSYS" profile --trace=cuda --sample=none --cpuctxsw=none -o "$OUT/moe-$T" --force-overwrite true \
  bin/bench_upf --benchmark_filter="^moe\.ffn/cuda/bf16/T:$T/" >"$OUT/nsys-profile-$T.log" 2>&1
say "profile rc=$?"
timeout 200 "$NSYS" stats --report cuda_gpu_trace --format csv -o "$OUT/moe-$T" "$OUT/moe-$T.nsys-rep" \
  >"$OUT/nsys-stats-$T.log" 2>&1
say "stats rc=$?"
ls -la "$OUT" >>"$OUT/summary.txt"
rm -f "$OUT/moe-$T.sqlite"
xz -T0 "$OUT"/*.csv 2>/dev/null
say done

#!/usr/bin/env bash
# One device call: (A) quick verify of attention and Gated DeltaNet from the main bundle (the host launch
# plumbing of 3257f71 had not run on a GPU); (B) from the bundle of branch moe-wgmma (unpacked at $MW):
# quick verify of moe.ffn under UPF_MOE_GEMM=wgmma, then ncu --set full of moe_gateup_wgmma_kernel at
# T = 8K and 32K, and ncu SpeedOfLight of every cuBLAS kernel of one BUCKETED layer at 32K (their names
# carry cuBLAS's tile and cluster shapes).
#   OUT=dir MW=/tmp/mw bash device-moe-profile.sh
set -u
source "$(dirname "$0")/device-common.sh"
MW=${MW:?set MW to the unpacked moe-wgmma bundle}

A=$OUT/verify-main; mkdir -p "$A"
say "A quick verify attn, gdn (main $UPF_COMMIT); B quick verify moe.ffn wgmma ($(cat "$MW/COMMIT"))"
(timeout 150 bin/upf verify attn --quick --log "$A/verify-attn-quick.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/verify-attn-quick.log") &
(timeout 150 bin/upf verify gdn --quick --log "$A/verify-gdn-quick.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/verify-gdn-quick.log") &
(cd "$MW" && UPF_MOE_GEMM=wgmma LD_LIBRARY_PATH=$MW/lib timeout 150 bin/upf verify moe.ffn --quick \
  --log "$A/verify-moe-wgmma-quick.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/verify-moe-wgmma-quick.log") &
wait
report "$A"
pack verify-main

P=$OUT/moe-ncu; mkdir -p "$P"
cd "$MW" && export LD_LIBRARY_PATH=$MW/lib
for T in 8192 32768; do
  say "ncu full: moe_gateup_wgmma_kernel at T=$T"
  timeout 120 "$NCU" --clock-control none --set full -k regex:moe_gateup_wgmma --launch-skip 4 --launch-count 1 \
    -o "$P/wgmma-$T" bin/bench_upf --benchmark_filter="^moe\.ffn/cuda/bf16/wgmma/T:$T/" >"$P/wgmma-$T.console" 2>&1
  say "rc=$?"
  "$NCU" -i "$P/wgmma-$T.ncu-rep" --page details --print-units base >"$P/wgmma-$T.txt" 2>&1
done
say "ncu SpeedOfLight: the cuBLAS kernels of one BUCKETED layer at 32K"
timeout 150 "$NCU" --clock-control none --section SpeedOfLight --section LaunchStats --metrics dram__bytes_read.sum,lts__t_bytes.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
  --launch-skip 120 --launch-count 45 -o "$P/bucketed-32768" bin/bench_upf --benchmark_filter='^moe\.ffn/cuda/bf16/bucketed/T:32768/' \
  >"$P/bucketed-32768.console" 2>&1
say "rc=$?"
"$NCU" -i "$P/bucketed-32768.ncu-rep" --page details --print-units base >"$P/bucketed-32768.txt" 2>&1
grep -hE '^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Memory Throughput|dram__bytes_read|lts__t_bytes|gmma' "$P"/*.txt | cut -c1-160 | head -150 >>"$OUT/summary.txt"
cd "$OUT" && pack moe-ncu
say done

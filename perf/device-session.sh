#!/usr/bin/env bash
# One device call for a whole session's evidence, when the lease is too short for one call per
# issue. Runs from the unpacked bundle that perf/stage-device.sh --bundle writes (bin/ lib/ peers/
# the per-issue scripts, COMMIT), in this order, each step capped in time and none stopping the next:
#   A. correctness that times nothing, in parallel: the full verify of the dense and MoE ops (gemm
#      passed its full set at e296ef7),
#      compute-sanitizer memcheck over the norm ops and racecheck over the MoE ops (quick set), and
#      the quick verify of the selection stages;
#   B. issue 3: attn-device-run.sh (its variants, the default, the SDPA peer, sanitizers, test_upf);
#   C. issue 5: device-gdn.sh (the chunked scan's variants, the FLA peer);
#   D. timings alone on the GPU: norms, RoPE, GEMM and FFN, then the torch.matmul peer.
# Everything lands in $OUT as summary.txt plus one archive per step (the device tool returns at
# most 8 files).   OUT=dir bash device-session.sh
set -u
cd "$(dirname "$0")"
OUT=${OUT:?set OUT}
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
export UPF_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/summary.txt"; }
pack() { tar -C "$OUT" -cJf "$OUT/$1.tar.xz" "$1" && rm -rf "${OUT:?}/$1"; }

say "commit $UPF_COMMIT; $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader)"

A=$OUT/correctness; mkdir -p "$A"
export OPENBLAS_NUM_THREADS=2 # nine processes share the cores
for op in ffn norm rope attn.gated_output embed logits moe; do
  (timeout ${STEP_A_S:-75} bin/upf verify "$op" --log "$A/verify-$op.log" >/dev/null 2>&1; echo "# rc=$?" >>"$A/verify-$op.log") &
done
(timeout ${STEP_A_S:-75} compute-sanitizer --tool memcheck --error-exitcode 9 bin/upf verify norm --quick \
  >"$A/sanitizer-memcheck-norm.log" 2>&1; echo "# rc=$?" >>"$A/sanitizer-memcheck-norm.log") &
(timeout ${STEP_A_S:-75} compute-sanitizer --tool racecheck --error-exitcode 9 bin/upf verify moe --quick \
  >"$A/sanitizer-racecheck-moe.log" 2>&1; echo "# rc=$?" >>"$A/sanitizer-racecheck-moe.log") &
(timeout ${STEP_A_S:-75} bin/upf verify select --quick --log "$A/verify-select-quick.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-select-quick.log") &
wait
for f in "$A"/*.log; do
  say "A $(basename "$f"): $(grep -E '^# [0-9]+ checks|SUMMARY|^# rc=' "$f" | tr '\n' ' ')"
  grep -E '^FAIL' "$f" | cut -c1-200 | head -4 | tee -a "$OUT/summary.txt"
done
pack correctness
unset OPENBLAS_NUM_THREADS

say "B attention"
mkdir -p "$OUT/attn"
OUT=$OUT/attn TIMING_S=${ATTN_TIMING_S:-130} CHECK_S=${ATTN_CHECK_S:-70} bash attn-device-run.sh >/dev/null 2>&1
say "B rc=$?"; cat "$OUT/attn/summary.txt" >>"$OUT/summary.txt"; pack attn

say "C gated deltanet"
mkdir -p "$OUT/gdn"
timeout "${GDN_BUDGET_S:-80}" bash device-gdn.sh "$OUT/gdn" >"$OUT/gdn/console.txt" 2>&1
say "C rc=$?"; tail -n 40 "$OUT/gdn/console.txt" >>"$OUT/summary.txt"; pack gdn

say "D dense timings"
D=$OUT/dense; mkdir -p "$D"
timeout 45 bin/bench_upf \
  --benchmark_filter='copy|gemm_ceiling|(gemm|ffn)/cuda/.*/T:(8192|32768)/|rmsnorm|qk_norm|rope/cuda' \
  --benchmark_repetitions=3 --benchmark_out="$D/bench-dense.json" --benchmark_out_format=json >"$D/bench-dense.log" 2>&1
say "D bench rc=$?"; sed -n '/^summary/,$p' "$D/bench-dense.log" | cut -c1-110 >>"$OUT/summary.txt"
(cd peers && timeout 35 python3 torch_matmul.py --out "$D/torch_matmul.json" --tokens 8192,32768 \
  --ffn-tokens 8192,32768 --iters 10 --warmup 3 >"$D/torch_matmul.log" 2>&1)
say "D torch.matmul rc=$?"; tail -n 16 "$D/torch_matmul.log" | cut -c1-120 >>"$OUT/summary.txt"
pack dense
say "done: $(ls "$OUT" | tr '\n' ' ')"

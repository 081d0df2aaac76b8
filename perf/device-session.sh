#!/usr/bin/env bash
# One device call for a whole session's evidence, when the lease is too short for one call per
# issue. Runs from the unpacked bundle that perf/stage-device.sh writes (bin/ lib/ peers/, the
# per-issue scripts, COMMIT), in this order, each step capped in time and none stopping the next:
#   A. correctness, processes side by side (they time nothing; no sanitizer among them, since
#      instrumented kernels time-slice the GPU against every other process): the full verify of the
#      attention, dense and MoE ops, the quick verify of the selection stages, test_upf;
#   B. compute-sanitizer racecheck over the attention ops and memcheck over the norm ops (quick set);
#   C. issue 5: device-gdn-v2.sh (the chunked scan's variants incl. prep v3: verify and sanitizers first,
#      then timings alone on the GPU, the FLA peer if time is left; logs straight into $OUT/gdn);
#   D. timings alone on the GPU: attention prefill at 32K and 128K beside the torch SDPA peer;
#   E. timings alone on the GPU: norms, RoPE, GEMM and FFN, then the torch.matmul peer.
# $OUT gets summary.txt plus one archive a step (the device tool returns at most 8 files).
#   OUT=dir bash device-session.sh        (FLA wheels on PYTHONPATH for step C's peer)
set -u
source "$(dirname "$0")/device-common.sh"

A=$OUT/correctness; mkdir -p "$A"
export OPENBLAS_NUM_THREADS=2 # the CPU references of nine processes share 16 cores
for op in attn ffn norm rope embed logits moe; do
  (timeout "${STEP_A_S:-130}" bin/upf verify "$op" --log "$A/verify-$op.log" >/dev/null 2>&1
    echo "# rc=$?" >>"$A/verify-$op.log") &
done
(timeout "${STEP_A_S:-130}" bin/upf verify select --quick --log "$A/verify-select-quick.log" >/dev/null 2>&1
  echo "# rc=$?" >>"$A/verify-select-quick.log") &
(cd bin && timeout "${STEP_A_S:-130}" ./test_upf >"$A/test_upf.log" 2>&1; echo "# rc=$?" >>"$A/test_upf.log") &
wait
unset OPENBLAS_NUM_THREADS
report "$A"; pack correctness

S=$OUT/sanitize; mkdir -p "$S"
(timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 bin/upf verify attn --quick \
  >"$S/racecheck-attn.log" 2>&1; echo "# rc=$?" >>"$S/racecheck-attn.log") &
(timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 bin/upf verify norm --quick \
  >"$S/memcheck-norm.log" 2>&1; echo "# rc=$?" >>"$S/memcheck-norm.log") &
wait
report "$S"; pack sanitize

say "C gated deltanet"
gdn_step C

say "D attention timings"
T=$OUT/attn; mkdir -p "$T"
timeout 40 bin/bench_upf --benchmark_filter='^copy|^attn_prefill/cuda/bf16/llama_causal/B:1/kv:(32768|131072)/' \
  --benchmark_out="$T/bench-attn.json" --benchmark_out_format=json >"$T/bench-attn.log" 2>&1
say "D bench rc=$?"
(cd peers && timeout 40 python3 torch_sdpa.py --only 'llama/T:(32768|131072)' --iters 6 --out "$T/torch-sdpa.json" \
  >"$T/torch-sdpa.log" 2>&1)
say "D sdpa rc=$?"
python3 peers/compare_attn.py "$T/bench-attn.json" "$T/torch-sdpa.json" >"$T/compare-attn.txt" 2>&1
grep -E "llama" "$T/compare-attn.txt" | cut -c1-130 | tee -a "$OUT/summary.txt"
pack attn

say "E dense timings"
E=$OUT/dense; mkdir -p "$E"
timeout 40 bin/bench_upf \
  --benchmark_filter='^copy|^gemm_ceiling|^(gemm|ffn)/cuda/.*/T:(8192|32768)/|^(rmsnorm|rmsnorm_add|qk_norm|rope)/cuda/' \
  --benchmark_repetitions=3 --benchmark_out="$E/bench-dense.json" --benchmark_out_format=json >"$E/bench-dense.log" 2>&1
say "E bench rc=$?"; sed -n '/^summary/,$p' "$E/bench-dense.log" | cut -c1-110 >>"$OUT/summary.txt"
(cd peers && timeout 30 python3 torch_matmul.py --out "$E/torch_matmul.json" --tokens 8192,32768 \
  --ffn-tokens 8192,32768 --iters 10 --warmup 3 >"$E/torch_matmul.log" 2>&1)
say "E torch.matmul rc=$?"; tail -n 16 "$E/torch_matmul.log" | cut -c1-120 >>"$OUT/summary.txt"
pack dense
say "done: $(ls "$OUT" | tr '\n' ' ')"

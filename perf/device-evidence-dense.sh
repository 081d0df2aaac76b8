#!/bin/bash
# Issue 4 evidence on one GPU, in one call: the full verify of the dense and MoE ops, memcheck and
# racecheck over their quick verify and test_upf (these four at once: their results do not depend
# on timing), then, alone on the GPU, the dense/MoE/norm/RoPE benchmarks and the torch.matmul peer
# on the same shapes. Run from the unpacked bundle: bin/ (upf, test_upf, bench_upf), peers/.
# OUT: where logs and JSON go. Each step has a time limit so the whole fits a short device lease.
set -u
OUT=${OUT:?set OUT}
B=$PWD/bin
OPS="gemm ffn norm rope attn.gated_output embed logits moe"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

verify_all() { for p in $OPS; do "$B/upf" verify "$p"; done; }
sanitize() { # tool: every op prefix's quick verify under compute-sanitizer
  for p in $OPS; do
    compute-sanitizer --tool "$1" --error-exitcode 9 "$B/upf" verify "$p" --quick || echo "SANITIZER $1 $p rc=$?"
  done
}
timeout 110 bash -c "$(declare -f verify_all); OPS='$OPS' B='$B' verify_all" > "$OUT/verify-dense-moe.log" 2>&1 &
timeout 110 bash -c "$(declare -f sanitize); OPS='$OPS' B='$B' sanitize memcheck" > "$OUT/sanitizer-memcheck-dense-moe.log" 2>&1 &
timeout 110 bash -c "$(declare -f sanitize); OPS='$OPS' B='$B' sanitize racecheck" > "$OUT/sanitizer-racecheck-dense-moe.log" 2>&1 &
(cd "$B" && timeout 110 ./test_upf) > "$OUT/test.log" 2>&1 &
wait
echo "== verify: $(grep -c '^PASS' "$OUT/verify-dense-moe.log") PASS, $(grep -c '^FAIL' "$OUT/verify-dense-moe.log") FAIL"
grep '^# [0-9]* checks' "$OUT/verify-dense-moe.log"
grep '^FAIL' "$OUT/verify-dense-moe.log" | cut -c1-220 | head -5
for t in memcheck racecheck; do
  echo "== $t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$t-dense-moe.log" | sort | uniq -c | tr '\n' ' ')"
  grep -E '^SANITIZER|^# [0-9]* checks' "$OUT/sanitizer-$t-dense-moe.log" | tr '\n' ' '; echo
done
echo "== test_upf:"; grep -A3 'Run Summary' "$OUT/test.log"

timeout 55 "$B/bench_upf" \
  --benchmark_filter='copy|gemm_ceiling|(gemm|ffn|act_mul)/cuda/.*/T:(8192|32768)/|rmsnorm|qk_norm|rope/cuda|moe\.(ffn|dense_equiv)/cuda' \
  --benchmark_repetitions=3 --benchmark_out="$OUT/bench-dense.json" --benchmark_out_format=json > "$OUT/bench-dense.log" 2>&1
echo "== bench rc=$?"
sed -n '/^summary/,$p' "$OUT/bench-dense.log" | cut -c1-100

PYTHONUNBUFFERED=1 timeout 40 python3 peers/torch_matmul.py --out "$OUT/torch_matmul.json" --tokens 8192,32768 \
  --ffn-tokens 8192,32768 --iters 10 --warmup 3 > "$OUT/torch_matmul.log" 2>&1
echo "== torch rc=$?"; tail -16 "$OUT/torch_matmul.log" | cut -c1-120

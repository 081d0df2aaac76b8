#!/usr/bin/env bash
# Tensor parallelism on CPU ranks under mpirun (make test, make test-tp; SPEC.md section 5):
#   tp_check at -np 2 and -np 4: collectives (broadcast_check included), a size mismatch, the head-split
#     selection against one rank, forced disagreement, the TP prefill of every tiny family against one rank and the fp64 truth;
#   upf prefill --tp and upf select --tp: rank 0's outputs against a one-rank run, nothing printed by
#     the other ranks; a --tp that is not the number of ranks fails on every rank, without hanging.
# Every tiny family has 4 query heads over 2 kv heads (GDN: 4 value over 2 key heads), FFN and expert
# sizes divisible by 4, so all run at -np 4 (kv heads replicated over 2 ranks each).
# usage: tests/tp/run.sh BUILD_DIR
set -uo pipefail
BUILD=${1:-build}
if ! command -v mpirun >/dev/null 2>&1; then
  echo "SKIPPED tp: mpirun not installed (ci/install-deps.sh installs openmpi-bin and libopenmpi-dev)"
  exit 0
fi
if [ ! -x "$BUILD/tp_check" ]; then
  echo "SKIPPED tp: $BUILD/tp_check not built (the build found no MPI: mpicc --showme failed)"
  exit 0
fi
# ranks oversubscribe the cores: let a waiting rank yield; a stuck collective fails after this many seconds
export OMPI_MCA_mpi_yield_when_idle=1 UPF_COMM_TIMEOUT_S=60
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
UPF="$BUILD/upf"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
pass() { echo "PASS tp: $*"; }
fail() { echo "FAIL tp: $*"; failed=$((failed + 1)); }
t0=$(date +%s)

for np in 2 4; do
  if "${MPIRUN[@]}" -np $np "$BUILD/tp_check" >"$work/check$np.log" 2>&1; then
    grep -E "^(PASS|FAIL)" "$work/check$np.log" | sed 's/^/  /'
    pass "tp_check -np $np"
  else
    cat "$work/check$np.log"
    fail "tp_check -np $np"
  fi
done

# max |a - b| / (1e-4 + 1e-4 |b|) <= 1 over two <f4 .npy files of the same shape (stdlib only)
npy_close() {
  python3 - "$1" "$2" <<'PY'
import array, struct, sys
def load(p):
    b = open(p, 'rb').read()
    n = struct.unpack('<H', b[8:10])[0]
    a = array.array('f'); a.frombytes(b[10 + n:]); return b[10:10 + n], a
ha, a = load(sys.argv[1]); hb, b = load(sys.argv[2])
worst = max((abs(x - y) / (1e-4 + 1e-4 * abs(y)) for x, y in zip(a, b)), default=0.0)
print(f"{len(a)} values, worst {worst:.3g} of the budget")
sys.exit(0 if ha == hb and len(a) == len(b) and worst <= 1 else 1)
PY
}

# upf prefill --tp: masks equal, logits close, only rank 0 prints
common=(--lengths 200,24,1,96 --mode uniprefill --p 0.6 --dtype f32 --backend cpu)
for model in llama-tiny qwen3-next-tiny; do
  mkdir -p "$work/$model/one" "$work/$model/tp"
  if ! "$UPF" prefill --model $model "${common[@]}" --out-logits "$work/$model/one.npy" \
      --dump-masks "$work/$model/one" >"$work/$model/one.log" 2>&1; then
    cat "$work/$model/one.log"; fail "upf prefill $model (one rank)"; continue
  fi
  if ! "${MPIRUN[@]}" -np 2 "$UPF" prefill --model $model "${common[@]}" --tp 2 --out-logits "$work/$model/tp.npy" \
      --dump-masks "$work/$model/tp" --json "$work/$model/tp.json" >"$work/$model/tp.log" 2>&1; then
    cat "$work/$model/tp.log"; fail "upf prefill --tp 2 $model"; continue
  fi
  same=1
  for f in "$work/$model/one"/*.npy; do cmp -s "$f" "$work/$model/tp/$(basename "$f")" || same=0; done
  [ "$(ls "$work/$model/one" | wc -l)" -eq 2 ] && [ "$(ls "$work/$model/tp" | wc -l)" -eq 2 ] || same=0
  close=$(npy_close "$work/$model/tp.npy" "$work/$model/one.npy") && ok=1 || ok=0
  lines=$(grep -c "prefill .* ms (median" "$work/$model/tp.log")
  if [ $same = 1 ] && [ $ok = 1 ] && [ "$lines" = 1 ] && grep -q '"ranks": 2' "$work/$model/tp.json"; then
    pass "upf prefill --tp 2 $model: drop masks identical to one rank, logits $close, printed by rank 0 only"
  else
    cat "$work/$model/tp.log"
    fail "upf prefill --tp 2 $model: masks same=$same, logits ($close), $lines result lines"
  fi
done

# upf select --tp on 8 query heads over 2 kv heads (kv heads replicated at -np 4)
python3 - "$work" <<'PY'
import array, random, struct, sys
def save(path, code, shape, values):
    hdr = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (code, ", ".join(map(str, shape)) + ("," if len(shape) == 1 else ""))
    hdr += " " * (63 - (10 + len(hdr)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode())
        f.write(array.array("f" if code == "<f4" else "i", values).tobytes())
random.seed(7)
lens = [600, 40, 1, 300]; T = sum(lens); D = 32
save(sys.argv[1] + "/q.npy", "<f4", (T, 8, D), [random.gauss(0, 1) for _ in range(T * 8 * D)])
save(sys.argv[1] + "/k.npy", "<f4", (T, 2, D), [random.gauss(0, 1) for _ in range(T * 2 * D)])
cu = [0]
for n in lens: cu.append(cu[-1] + n)
save(sys.argv[1] + "/cu.npy", "<i4", (len(cu),), cu)
PY
sel=(--q "$work/q.npy" --k "$work/k.npy" --cu-seqlens "$work/cu.npy" --block 16 --sink 16 --last-q 16 --p 0.7)
"$UPF" select "${sel[@]}" --out-mask "$work/mask1.npy" --out-blocks "$work/blocks1.npy" 2>"$work/sel1.log" ||
  { cat "$work/sel1.log"; fail "upf select (one rank)"; }
for np in 2 4; do
  if "${MPIRUN[@]}" -np $np "$UPF" select "${sel[@]}" --tp $np --out-mask "$work/mask$np.npy" \
      --out-blocks "$work/blocks$np.npy" >"$work/sel$np.log" 2>&1 &&
      cmp -s "$work/mask1.npy" "$work/mask$np.npy" && close=$(npy_close "$work/blocks$np.npy" "$work/blocks1.npy"); then
    pass "upf select --tp $np: token mask identical to one rank, block scores $close"
  else
    cat "$work/sel$np.log"; fail "upf select --tp $np"
  fi
done

# a --tp that is not the communicator's size: every rank says so, non-zero exit, no hang
if "${MPIRUN[@]}" -np 2 "$UPF" prefill --model llama-tiny "${common[@]}" --tp 4 >"$work/bad.log" 2>&1; then
  fail "upf prefill --tp 4 on 2 ranks succeeded"
elif [ "$(grep -c -- "--tp 4, but the mpi communicator has 2 ranks" "$work/bad.log")" = 2 ]; then
  pass "upf prefill --tp 4 on 2 ranks: refused by both ranks ($(grep -m1 -- '--tp 4' "$work/bad.log"))"
else
  cat "$work/bad.log"; fail "upf prefill --tp 4 on 2 ranks: want the error from both ranks"
fi
if "$UPF" select "${sel[@]}" --tp 2 --out-mask "$work/never.npy" >"$work/bad1.log" 2>&1 || [ -e "$work/never.npy" ]; then
  fail "upf select --tp 2 without mpirun: want a refusal and no output"
else
  pass "upf select --tp 2 without mpirun: $(head -1 "$work/bad1.log")"
fi

echo "tp: $failed failure(s), $(( $(date +%s) - t0 )) s"
[ $failed = 0 ]

#!/usr/bin/env bash
# one device call: correctness of the sparse ops (quick verify, memcheck, model mode alpha 0 = dense, the
# published-index peer), their benchmarks, then the three methods end to end (Llama-3.1-8B, Gemma-3-12B)
set -u
export PYTHONUNBUFFERED=1
D=perf/device.sh
T0=$(date +%s)
bash $D verify sparse.block_means --quick --name warm >/dev/null 2>&1   # unpacks the bundle once
mkdir -p $OUT/model
( bash $D verify sparse attn.block_sparse --quick --name ops-verify --cap 90 ) &
( bash $D sanitize sparse attn.block_sparse --tools memcheck --name ops-memcheck --cap 90 ) &
( cd /tmp/upf-dev/bin && LD_LIBRARY_PATH=/tmp/upf-dev/lib TMPDIR=/tmp timeout 90 ./test_upf chunked sparse model_sparse > $OUT/model/test_upf.log 2>&1; echo "# rc=$?" >> $OUT/model/test_upf.log ) &
( timeout 90 python3 perf/peers/flashprefill_index.py --upf /tmp/upf-dev/bin/upf --json $OUT/model/peer_index.json > $OUT/model/peer_index.log 2>&1; echo "# rc=$?" >> $OUT/model/peer_index.log ) &
(
  cd /tmp/upf-dev
  export LD_LIBRARY_PATH=/tmp/upf-dev/lib
  for m in llama-tiny gemma3-tiny qwen3-next-tiny; do
    bin/upf prefill --model $m --backend cuda --dtype f32 --lengths 700,300 --mode dense --out-logits /tmp/$m-d.npy >/dev/null 2>&1
    timeout 60 bin/upf prefill --model $m --backend cuda --dtype f32 --lengths 700,300 --mode flashprefill --alpha 0 --block-n 64 --out-logits /tmp/$m-f.npy > /tmp/$m-f.log 2>&1
    echo "$m rc=$? $(grep -m1 'kept share' /tmp/$m-f.log)"
    python3 -c "
import numpy as np;a=np.load('/tmp/$m-d.npy');b=np.load('/tmp/$m-f.npy');print('$m alpha0 vs dense f32 cuda: max|diff| %.3g max|dense| %.3g'%(abs(a-b).max(),abs(a).max()))"
  done
  timeout 60 bin/upf prefill --model llama3.1-8b --layers 0:4 --backend cuda --lengths 16384 --mode dense --out-logits /tmp/L-d.npy >/dev/null 2>&1
  timeout 60 bin/upf prefill --model llama3.1-8b --layers 0:4 --backend cuda --lengths 16384 --mode flashprefill --alpha 0 --out-logits /tmp/L-f.npy > /tmp/L-f.log 2>&1
  python3 -c "
import numpy as np;a=np.load('/tmp/L-d.npy').astype(np.float64);b=np.load('/tmp/L-f.npy').astype(np.float64);print('llama3.1-8b layers 0:4 16K bf16 alpha0 vs dense: max|diff| %.3g nmse %.3g'%(abs(a-b).max(),((a-b)**2).sum()/(a**2).sum()))"
) > $OUT/model/model_checks.log 2>&1 &
wait
echo "[$(( $(date +%s) - T0 )) s] checks done"
bash $D bench --filter '^(sparse[.]|attn[.]block_sparse)[^/]*/cuda/bf16/llama_128k' --reps 3 --name ops-bench --cap 75
echo "[$(( $(date +%s) - T0 )) s] bench done"
bash $D methods llama3.1-8b --runs "131072" --name methods --cap 50
echo "[$(( $(date +%s) - T0 )) s] methods done"

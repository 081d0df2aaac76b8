#!/usr/bin/env bash
# Serving sweep: `upf serve-sim` dense against UniPrefill at top-k keep ratios, at several concurrencies
# (one seeded trace per request count, every request arriving at t = 0 unless SERVE_RATE is set), on one
# model; one process (one model build, one session) per mode, its JSON holding one point per count; then
# a summary table (TTFT p50/p90, TPOT p50, throughput, live requests, KV peak and saved, speedups vs dense).
#
#   perf/serve_sweep.sh [--upf BIN] [--out DIR] [--model M] [--keep R1,R2] [--cap S]
#   perf/serve_sweep.sh --summary DIR          the table of DIR/serve-*.json only
#
# Settings (environment; defaults sized for llama3.1-8b on one H200, bf16, cuda):
#   SERVE_COUNTS="1 4 16 64"  requests per point     SERVE_LEN=8192..32768  prompt lengths (uniform)
#   SERVE_DECODE=32           tokens per request     SERVE_BUDGET=65536     tokens per step
#   SERVE_KV_GIB=90           KV page budget, GiB    SERVE_RATE=0           requests/s (0: all at t = 0)
#   SERVE_SEED=1              weights and trace      SERVE_BACKEND=cuda, SERVE_DTYPE=bf16
# Device time, estimated from perf/reports/H200/INDEX.md (Llama-8B dense prefill 8K 210 ms, 32K 1223 ms:
# 26-39K tokens/s) for the defaults: 85 requests of 20K tokens on average = 1.7M prompt tokens, about
# 60 s dense and 20-30 s per keep ratio (UniPrefill 2-3x faster at 8K-32K), decode steps a few seconds
# (32 steps a wave, 25-35 ms each with 36 requests of 20K tokens live), plus a model build per process:
# about 3 minutes for dense, 0.5 and 0.3. The KV budget holds about 36 dense requests of 20K tokens
# (128 KiB a token at bf16), so dense at 64 requests is limited by pages (requests wait); UniPrefill's
# groups after the first drop hold fewer tokens, and --kv-gib gives them fewer pages, so more run at once.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
UPF="" OUTDIR="" MODEL=llama3.1-8b KEEPS=0.5,0.3 CAP=240 SUMMARY_ONLY=""
die() {
  echo "serve_sweep.sh: $*" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
  --upf) UPF=${2:?--upf needs a binary}; shift 2 ;;
  --out) OUTDIR=${2:?--out needs a folder}; shift 2 ;;
  --model) MODEL=${2:?--model needs a name}; shift 2 ;;
  --keep) KEEPS=${2:?--keep needs ratios}; shift 2 ;;
  --cap) CAP=${2:?--cap needs seconds}; shift 2 ;;
  --summary) SUMMARY_ONLY=1; OUTDIR=${2:?--summary needs a folder}; shift 2 ;;
  -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument $1 (--help)" ;;
  esac
done

# The table: one row per (mode, point), speedups against the dense point of the same count.
summary() {
  command -v python3 >/dev/null || { echo "serve_sweep.sh: no python3 for the table; the JSON files hold it all"; return 0; }
  python3 - "$1" <<'EOF'
import glob, json, os, sys
d = sys.argv[1]
runs = []
for path in sorted(glob.glob(os.path.join(d, "serve-*.json"))):
    with open(path) as f:
        runs.append(json.load(f))
if not runs:
    sys.exit("no serve-*.json under " + d)
def label(r):
    return "dense" if r["mode"] == "dense" else ("topk %g" % r["select"]["keep_ratio"] if r["select"]["kind"] == "topk"
                                                 else "topp %g" % r["select"]["p"])
dense = {p["requests"]: p for r in runs if r["mode"] == "dense" for p in r["points"]}
r0 = runs[0]
print("model %s, %s, %s; %s; prompt %s tokens, %d new, rate %s, token budget %d, KV %.1f GiB, commit %s" % (
    r0["model"], r0["dtype"], r0["backend"], r0["device"], r0["trace"]["prompt_len"], r0["trace"]["decode_len"],
    r0["trace"]["rate"], r0["token_budget"], r0["points"][0]["kv"]["gib_capacity"], r0["commit"]))
print()
print("| mode | requests | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | output tok/s | total tok/s | live max | "
      "KV peak GiB | dense-equiv GiB | KV saved | TTFT p50 vs dense | throughput vs dense |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in sorted(runs, key=lambda r: (r["mode"] != "dense", -r["select"]["keep_ratio"])):
    for p in r["points"]:
        n, k, base = p["requests"], p["kv"], dense.get(p["requests"])
        sp = "%.2fx" % (base["ttft_ms"]["p50"] / p["ttft_ms"]["p50"]) if base and r["mode"] != "dense" else "-"
        tp = "%+.0f%%" % (100 * (p["total_tokens_per_s"] / base["total_tokens_per_s"] - 1)) if base and r["mode"] != "dense" else "-"
        print("| %s | %d | %.1f | %.1f | %.2f | %.1f | %.0f | %d | %.2f | %.2f | %.1f%% | %s | %s |" % (
            label(r), n, p["ttft_ms"]["p50"], p["ttft_ms"]["p90"], p["tpot_ms"]["p50"], p["output_tokens_per_s"],
            p["total_tokens_per_s"], p["batch"]["max_running"], k["gib_peak"], k["gib_dense_peak"],
            100 * k["saved_share"], sp, tp))
EOF
}

if [ -n "$SUMMARY_ONLY" ]; then
  summary "$OUTDIR"
  exit $?
fi
[ -n "$UPF" ] || UPF=$HERE/../build/upf
[ -x "$UPF" ] || die "no upf binary at $UPF (--upf BIN)"
[ -n "$OUTDIR" ] || die "--out DIR is required"
mkdir -p "$OUTDIR" || die "cannot make $OUTDIR"
COUNTS=${SERVE_COUNTS:-1 4 16 64}
COUNTS=${COUNTS// /,}
COMMON=(--model "$MODEL" --backend "${SERVE_BACKEND:-cuda}" --dtype "${SERVE_DTYPE:-bf16}" --requests "$COUNTS"
  --prompt-len "${SERVE_LEN:-8192..32768}" --decode-len "${SERVE_DECODE:-32}" --rate "${SERVE_RATE:-0}"
  --seed "${SERVE_SEED:-1}" --token-budget "${SERVE_BUDGET:-65536}" --kv-gib "${SERVE_KV_GIB:-90}")
STATUS=0
one() { # TAG ARGS...: one serve-sim process, its log and JSON under OUTDIR
  local tag=$1 rc
  shift
  local cmd=("$UPF" serve-sim "${COMMON[@]}" "$@" --json "$OUTDIR/serve-$tag.json")
  printf '%q ' timeout "$CAP" "${cmd[@]}" >>"$OUTDIR/commands.txt"
  printf '> %q 2>&1\n' "$OUTDIR/serve-$tag.log" >>"$OUTDIR/commands.txt"
  local t0=$SECONDS
  timeout "$CAP" "${cmd[@]}" >"$OUTDIR/serve-$tag.log" 2>&1
  rc=$?
  echo "serve-$tag: rc=$rc, $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (timed out)')"
  grep -E 'requests \(|TTFT|throughput|KV peak' "$OUTDIR/serve-$tag.log" | sed 's/^/  /'
  [ $rc = 0 ] || { STATUS=1; tail -n 3 "$OUTDIR/serve-$tag.log" | sed 's/^/  /'; }
}
one dense --mode dense
for r in ${KEEPS//,/ }; do
  one "keep$r" --mode uniprefill --keep "$r"
done
summary "$OUTDIR" | tee "$OUTDIR/summary.md"
exit $STATUS

#!/usr/bin/env bash
# The report gate between a base commit and this checkout, on this machine (docs/report.md, "How CI uses
# it"): builds the base in a temporary git worktree and the checkout as it stands (CPU only, build-gate/),
# runs the quick CPU report of each (`upf report --quick --no-bench --backend cpu`), then
# `upf report --compare BASE HEAD` with the checkout's binary. Exit: the gate's (0 pass, 1 fail), 2 when
# an argument, a build or a report fails before there is anything to compare.
#
#   ci/report-gate.sh [--base REF] [--threshold P%] [--keep DIR]
#
# --base: the commit to compare against (default: the merge base with origin/main, or HEAD~1 when this
#   checkout is main itself). --threshold: the gate's slowdown threshold (default 20%: two CPU reports of
#   a shared 2-core machine, minutes apart, differ by more than the 5% a GPU gate uses; the repetitions'
#   spreads are added to it). --keep DIR: copy both reports and the gate's table into DIR (created).
set -euo pipefail
cd "$(dirname "$0")/.."

base="" threshold="20%" keep=""
while [ $# -gt 0 ]; do
  case $1 in
  --base) base=${2:?--base needs a commit}; shift 2 ;;
  --threshold) threshold=${2:?--threshold needs a percentage}; shift 2 ;;
  --keep) keep=${2:?--keep needs a folder}; shift 2 ;;
  -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "report-gate: unknown argument '$1' (--base REF, --threshold P%, --keep DIR)" >&2; exit 2 ;;
  esac
done

if [ -z "$base" ]; then
  if git rev-parse -q --verify origin/main >/dev/null && [ "$(git merge-base HEAD origin/main)" != "$(git rev-parse HEAD)" ]; then
    base=$(git merge-base HEAD origin/main)
  else
    base=HEAD~1
  fi
fi
base_sha=$(git rev-parse -q --verify "$base^{commit}") || { echo "report-gate: --base '$base' names no commit" >&2; exit 2; }
if [ -n "$keep" ]; then
  mkdir -p "$keep" || { echo "report-gate: --keep '$keep': cannot create it" >&2; exit 2; }
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/report-gate.XXXXXX")
cleanup() {
  git worktree remove --force "$work/base" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
git worktree add -q --detach "$work/base" "$base_sha"
jobs=$(nproc 2>/dev/null || echo 2)
head_desc="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo '+changes')"
echo "report-gate: base $(git rev-parse --short "$base_sha") against head $head_desc, threshold $threshold"

# build SIDE TREE: the CPU-only upf of TREE into TREE/build-gate (the gate compares CPU reports)
build() {
  local side=$1 tree=$2 log=$work/$1-build.log
  echo "report-gate: building the $side (log $log) ..."
  if ! make -C "$tree" -j"$jobs" CUDA=0 BUILD=build-gate build-gate/upf >"$log" 2>&1; then
    echo "report-gate: the $side does not build; the end of its log:" >&2
    tail -n 20 "$log" >&2
    exit 2
  fi
}

# report SIDE TREE: its quick CPU report into $work/SIDE; a failed verify still gives a report to compare
report() {
  local side=$1 tree=$2 status=0
  echo "report-gate: the $side's quick CPU report ..."
  (cd "$tree" && build-gate/upf report --quick --no-bench --backend cpu --out "$work/$side") \
    >"$work/$side-report.log" 2>&1 || status=$?
  if [ ! -s "$work/$side/report.json" ]; then
    echo "report-gate: the $side's report wrote no report.json (exit $status); the end of its log:" >&2
    tail -n 20 "$work/$side-report.log" >&2
    exit 2
  fi
  [ "$status" -eq 0 ] || echo "report-gate: the $side's report exited $status (its verdict: $(tail -n 1 "$work/$side-report.log"))"
}

build base "$work/base"
build head "$PWD"
report base "$work/base"
report head "$PWD"

gate=0
build-gate/upf report --compare "$work/base/report.json" "$work/head/report.json" --threshold "$threshold" |
  tee "$work/gate.md" || gate=${PIPESTATUS[0]}
if [ -n "$keep" ]; then
  cp -r "$work/base" "$keep/base" && cp -r "$work/head" "$keep/head" && cp "$work/gate.md" "$keep/gate.md"
  echo "report-gate: reports and the gate's table in $keep"
fi
exit "$gate"

#!/usr/bin/env bash
# Stages what a run on the lent GPU machine needs and it lacks, as one archive to carry:
# .devbin/bundle.tar.xz holds bin/ (upf, test_upf, bench_upf, stripped), lib/ (the shared libraries
# of the Debian packages they link: OpenBLAS, gfortran, quadmath, CUnit, Google Benchmark), peers/
# (the PyTorch and FLA peer scripts), the device scripts of perf/ at its top, and COMMIT.
# .devbin/ is git-ignored; name it in the device tool's `carry` and unpack it there:
#   D=/tmp/dev; mkdir -p $D && tar -C $D -xJf .devbin/bundle.tar.xz && bash $D/device-session.sh
set -euo pipefail
cd "$(dirname "$0")/.."
make -j"$(nproc)" all >/dev/null
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/peers" .devbin
cp build/upf build/test_upf build/bench_upf "$stage/bin/"
strip "$stage"/bin/*
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libcunit.so.1 libbenchmark.so.1debian; do
  path=$(ldd build/test_upf build/bench_upf | awk -v l="$lib" '$1 == l { print $3; exit }')
  [ -n "$path" ] || { echo "stage-device: $lib not linked?" >&2; exit 1; }
  cp -L "$path" "$stage/lib/"
done
cp perf/peers/*.py "$stage/peers/"
cp perf/peers/*.py perf/*.sh "$stage/" # scripts that expect the peers beside them
git rev-parse --short HEAD >"$stage/COMMIT"
git diff --quiet HEAD -- . || echo "stage-device: warning: uncommitted changes are in the build" >&2
tar -C "$stage" -cJf .devbin/bundle.tar.xz .
du -sh .devbin/bundle.tar.xz

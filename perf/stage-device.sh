#!/usr/bin/env bash
# Stages what a run on the lent GPU machine needs and it lacks: the built binaries (.devbin/) and the
# shared libraries of the Debian packages they link (.devlib/: OpenBLAS, gfortran, quadmath, CUnit,
# Google Benchmark). Both folders are git-ignored; name them in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
make -j"$(nproc)" all >/dev/null
mkdir -p .devbin .devlib
cp build/upf build/test_upf build/bench_upf .devbin/
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libcunit.so.1 libbenchmark.so.1debian; do
  path=$(ldd build/test_upf build/bench_upf | awk -v l="$lib" '$1 == l { print $3; exit }')
  [ -n "$path" ] || { echo "stage-device: $lib not linked?" >&2; exit 1; }
  cp -L "$path" .devlib/
done
du -sh .devbin .devlib

#!/usr/bin/env bash
# Installs the Debian packages the suite builds against, only those that are missing.
# Idempotent: a second run installs nothing and prints nothing but the summary line.
set -euo pipefail

# openmpi-bin and libopenmpi-dev: tensor parallelism on CPU ranks (the MPI communicator, make test's mpirun runs)
packages=(build-essential libopenblas-dev libcunit1-dev libbenchmark-dev valgrind openmpi-bin libopenmpi-dev)
# --fuzz: also clang and its sanitizer and libFuzzer runtimes (libclang-rt-14-dev is only recommended by
# clang, and this script installs without recommends), for `make fuzz` alone; `make test` needs neither
# --report: also matplotlib (Debian's, for the system python3) for the plots of `upf report` (`make run`)
for opt in "$@"; do
  case $opt in
  --fuzz) packages+=(clang libclang-rt-14-dev) ;;
  --report) packages+=(python3-matplotlib) ;;
  *) echo "install-deps: unknown option $opt (--fuzz, --report)" >&2; exit 2 ;;
  esac
done

missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done

if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install-deps: all present (${packages[*]})"

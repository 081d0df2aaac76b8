#!/usr/bin/env bash
# Installs the Debian packages the suite builds against, only those that are missing.
# Idempotent: a second run installs nothing and prints nothing but the summary line.
set -euo pipefail

# openmpi-bin and libopenmpi-dev: tensor parallelism on CPU ranks (the MPI communicator, make test's mpirun runs)
packages=(build-essential libopenblas-dev libcunit1-dev libbenchmark-dev valgrind openmpi-bin libopenmpi-dev)

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

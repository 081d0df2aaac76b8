#!/usr/bin/env python3
"""Per-layer prefill times of a distinct-weight run, a --shared-weights run and the distinct run again
(upf prefill --json, same model, layers and tokens): the table `perf/device.sh shared` writes. The
shared run matches when each layer's time is within the distinct runs' own spread (A against A) plus 3%.
Usage: shared_table.py DISTINCT1.json SHARED.json DISTINCT2.json"""
import json
import sys


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__)
    a1, s, a2 = (json.load(open(p)) for p in argv[1:])
    for r in (a1, s, a2):
        if r["model"] != a1["model"] or r["layers"] != a1["layers"] or r.get("requests") != a1.get("requests"):
            sys.exit("shared_table.py: the three runs differ in model, layers or tokens")
    if s.get("shared_weights") is not True or a1.get("shared_weights") or a2.get("shared_weights"):
        sys.exit("shared_table.py: want distinct, shared, distinct (the JSONs' shared_weights field)")
    first = a1["layers"][0]
    print(f'{a1["model"]} layers {a1["layers"][0]}:{a1["layers"][1]}, requests {a1.get("requests")}, dense: '
          f'per-layer ms, distinct / shared / distinct again')
    print("| layer | kind | distinct | shared | distinct again | shared / distinct mean | within noise |")
    print("|---:|---|---:|---:|---:|---:|---|")
    worst, out = 0.0, 0
    for i, (x1, y, x2) in enumerate(zip(a1["layer_ms"], s["layer_ms"], a2["layer_ms"])):
        mean = (x1 + x2) / 2
        ratio = y / mean if mean > 0 else float("nan")
        ok = abs(y - mean) <= abs(x1 - x2) / 2 + 0.03 * mean
        out += not ok
        worst = max(worst, abs(ratio - 1))
        kind = a1.get("layer_kind", [""] * len(a1["layer_ms"]))[i]
        print(f"| {first + i} | {kind} | {x1:.3f} | {y:.3f} | {x2:.3f} | {ratio:.3f} | {'yes' if ok else 'NO'} |")
    t1, ts, t2 = (r["ttft_ms"]["median"] for r in (a1, s, a2))
    print(f"\nTTFT (median): distinct {t1:.1f} ms, shared {ts:.1f} ms, distinct again {t2:.1f} ms; layers outside noise: {out}; "
          f"largest per-layer difference {100 * worst:.1f}%")


if __name__ == "__main__":
    main(sys.argv)

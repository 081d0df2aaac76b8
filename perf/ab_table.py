#!/usr/bin/env python3
"""The table of an A/B/A benchmark step (perf/device.sh bench --ab or --base): for each benchmark the median
time of A, B and A again, B against the mean of the two A's, the A's own drift, and each named counter's
medians; a compact JSON of the same rows (what a report folder keeps instead of three raw Google Benchmark
files).

  perf/ab_table.py A1.json B.json A2.json [--counter vs_limit ...] [--json OUT.json] [--label-b TEXT]

A row whose B/A lies outside the two A's spread by more than that spread is marked: the difference is larger
than the drift between the two A runs."""
import argparse
import json
import sys


def medians(path):
    """{run_name: aggregate row} of the median aggregates of one bench_upf JSON, and its context."""
    with open(path) as f:
        doc = json.load(f)
    medians_, singles = {}, {}
    for b in doc.get("benchmarks", []):
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                medians_[b["run_name"]] = b
        else:
            singles[b["run_name"]] = b  # with one repetition there is no aggregate: the run itself
    return {**singles, **medians_}, doc.get("context", {})


def to_ms(row):
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[row.get("time_unit", "ns")]
    return row["real_time"] * scale


def short(name):
    """The run name without Google Benchmark's trailing settings (min_time, repeats, manual_time)."""
    keep = [p for p in name.split("/") if not p.startswith(("min_time:", "repeats:", "manual_time", "real_time"))]
    return "/".join(keep)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a1")
    ap.add_argument("b")
    ap.add_argument("a2")
    ap.add_argument("--counter", action="append", default=[], help="a counter to show beside the times")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--label-b", default="B", help="what B is, for the table's heading")
    args = ap.parse_args(argv)

    runs = []
    for path in (args.a1, args.b, args.a2):
        try:
            runs.append(medians(path))
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"ab_table.py: {path}: {e}")
    (a1, ctx_a), (b, ctx_b), (a2, _) = runs
    names = [n for n in a1 if n in b and n in a2]
    if not names:
        sys.exit(f"ab_table.py: no benchmark is in all three of {args.a1}, {args.b}, {args.a2}")

    out = []
    for n in names:
        ta1, tb, ta2 = to_ms(a1[n]), to_ms(b[n]), to_ms(a2[n])
        amean = (ta1 + ta2) / 2
        drift = abs(ta1 - ta2) / amean
        ratio = tb / amean
        row = {"name": short(n), "a1_ms": ta1, "b_ms": tb, "a2_ms": ta2, "b_over_a": ratio, "a_drift": drift,
               "beyond_drift": abs(ratio - 1) > 2 * drift}
        for c in args.counter:
            if c in a1[n]:
                row[c] = [a1[n][c], b[n].get(c), a2[n][c]]
        out.append(row)

    counters = [c for c in args.counter if any(c in r for r in out)]  # a counter no row has: no column
    heads = ["benchmark", "A ms", f"{args.label_b} ms", "A again ms", "B / A", "A drift"] + counters
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" + "---:|" * (len(heads) - 1))
    for r in out:
        cells = [r["name"], f"{r['a1_ms']:.4g}", f"{r['b_ms']:.4g}", f"{r['a2_ms']:.4g}",
                 f"**{r['b_over_a']:.3f}**" if r["beyond_drift"] else f"{r['b_over_a']:.3f}", f"{r['a_drift']:.1%}"]
        for c in counters:
            v = r.get(c)
            cells.append(" / ".join(f"{x:.3f}" if isinstance(x, float) else "-" for x in v) if v else "-")
        print("| " + " | ".join(cells) + " |")
    print(f"\nB / A: B's median over the mean of the two A medians; bold where it differs from 1 by more than "
          f"twice the A's drift. A: {ctx_a.get('commit', '?')} {ctx_a.get('variants', '')}; "
          f"B: {ctx_b.get('commit', '?')} {ctx_b.get('variants', '')}; {ctx_a.get('gpu', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": ctx_a.get("gpu"), "a": {"commit": ctx_a.get("commit"), "variants": ctx_a.get("variants")},
                       "b": {"commit": ctx_b.get("commit"), "variants": ctx_b.get("variants"), "label": args.label_b},
                       "rows": out}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Where a prefill's time goes, kernel by kernel (issue 25's profile): the kernels of one `upf prefill` run
as ncu saw them (`ncu --csv --metrics gpu__time_duration.sum`, one row a launch), grouped by kind (GEMM,
attention, norms, RoPE, activation, MoE, selection, copies, other), against the same run's TTFT timed
without the profiler (its --json). The difference between the TTFT and the sum of kernel times is NOT the
GPU's idle time alone: ncu runs each kernel by itself with the GPU idle before it, so a kernel's time there is
its time at the clocks of a cool GPU, while the real run holds the power limit at lower clocks (perf/NOTES.md
has the size of that difference). The row counts launch gaps, host waits and that clock difference together;
a timeline (nsys) separates them.

  perf/kernel_breakdown.py NCU1.csv NCU2.csv PREFILL.json [--md OUT.md] [--json OUT.json]

NCU1.csv and NCU2.csv profile the same command with --warmup 0 and --iters 1, then --iters 2: whatever
else the program launches (the seeded weights' fills, the logits) is in both, so per kernel name the
difference of counts and times is exactly one prefill.
"""
import argparse, csv, json, re, sys

KINDS = [  # (kind, regex on the demangled kernel name), first match wins
    ("GEMM (cuBLAS)", r"gemm|xmma|cutlass|nvjet|sm90_|cublas"),
    ("attention", r"attn|flash|fa2|bs_|wgmma_kernel|paged"),
    ("selection / sparse index", r"select|score|topp|sparse|block_means|compact"),
    ("MoE routing and scatter", r"moe|route|expert|permute"),
    ("linear attention (GDN)", r"gdn|delta|conv1d"),
    ("norms (+ residual)", r"norm"),
    ("RoPE", r"rope"),
    ("activation x up", r"act|swiglu|gelu|silu"),
    ("embedding / logits", r"embed|logit|lm_head"),
    ("copies and fills", r"copy|fill|memset|gather|scatter|drop"),
]


def to_ms(value, unit):
    v = float(value.replace(",", ""))
    return v * {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
                "second": 1e3, "s": 1e3}[unit.strip()]


def read_ncu(path):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu prints its own log lines before the table
    rows = list(csv.DictReader(lines))
    if not rows or "Kernel Name" not in rows[0]:
        sys.exit(f"kernel_breakdown: {path}: no ncu CSV table (want --csv --metrics gpu__time_duration.sum)")
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        out.append((r["Kernel Name"], to_ms(r["Metric Value"], r["Metric Unit"])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ncu1_csv")
    ap.add_argument("ncu2_csv")
    ap.add_argument("prefill_json")
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args()
    one, two = {}, {}
    for path, acc in ((a.ncu1_csv, one), (a.ncu2_csv, two)):
        for name, ms in read_ncu(path):
            n, t = acc.get(name, (0, 0.0))
            acc[name] = (n + 1, t + ms)
    kernels = []  # (name, launches, ms) of one prefill
    for name, (n, t) in two.items():
        n1, t1 = one.get(name, (0, 0.0))
        if n > n1:
            kernels.append((name, n - n1, t - t1))
    run = json.load(open(a.prefill_json))
    ttft = run["ttft_ms"]["median"]
    by = {}
    for name, launches, ms in kernels:
        kind = next((k for k, rx in KINDS if re.search(rx, name, re.I)), "other")
        n, t, names = by.get(kind, (0, 0.0, {}))
        short = name.split("(")[0][:60]
        names[short] = names.get(short, 0.0) + ms
        by[kind] = (n + launches, t + ms, names)
    total = sum(t for _, t, _ in by.values())
    rows = []
    for kind, (n, t, names) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        top = max(names.items(), key=lambda kv: kv[1])[0]
        rows.append({"kind": kind, "launches": n, "ms": t, "share_of_ttft": t / ttft,
                     "largest": top})
    gap = ttft - total
    md = [f"{run.get('model')} {run.get('mode')} {run.get('dtype')}, requests {run.get('requests')}, "
          f"{run.get('device', '')}", "",
          "| kernel kind | launches | ms | share of TTFT | largest kernel |", "|---|---:|---:|---:|---|"]
    md += [f"| {r['kind']} | {r['launches']} | {r['ms']:.2f} | {100 * r['share_of_ttft']:.1f}% | `{r['largest']}` |"
           for r in rows]
    md += [f"| **all kernels** | {sum(r['launches'] for r in rows)} | {total:.2f} | {100 * total / ttft:.1f}% | |",
           f"| **TTFT - kernels** (launch gaps, host waits, and sustained-load clocks: ncu times each kernel alone) | | {gap:.2f} | {100 * gap / ttft:.1f}% | |",
           f"| **TTFT** (the same run without the profiler, median) | | {ttft:.2f} | 100% | |"]
    text = "\n".join(md) + "\n"
    print(text)
    if a.md:
        open(a.md, "w").write(text)
    if a.json:
        json.dump({"ttft_ms": ttft, "kernels_ms": total, "gap_ms": gap, "kinds": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

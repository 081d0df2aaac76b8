#!/usr/bin/env python3
"""The three methods side by side: dense, FlashPrefill V2 and UniPrefill TTFT per model and length, with
the per-layer-kind time breakdown that explains them (from `upf prefill --json` files).

  perf/methods_table.py DIR [--out table.md] [--json methods.json]
  perf/methods_table.py --self-test      (the work shares on hand-computed runs)
  perf/methods_table.py --keep-for-work UNIPREFILL.json WORK   (the top-k keep ratio matching WORK, or nothing)

DIR holds <model>-<length>-<method>.json as perf/device.sh's `methods` step writes them (method: dense,
flashprefill, flashprefill-aA for further alphas, uniprefill-topp, uniprefill-keepR). Columns: TTFT (median of the iterations), speedup over
dense of the same run, the kept share (FlashPrefill: key blocks kept of those visible, over its
full-attention layers; UniPrefill: tokens kept after the last drop layer), the full-attention work (the share
of dense's causal query-key pairs the full-attention layers computed: what "equal attention work" compares),
and the time of the last
iteration's layers by kind: full attention (pre-norm + attention block), sliding-window attention, Gated
DeltaNet, FFN / MoE, and the method's own overhead (FlashPrefill: block means + index; UniPrefill:
selection + compaction). The layer times are per-layer host timings with a synchronise between
sub-layers, so their sum exceeds TTFT by the synchronisation gaps.
"""
import argparse
import glob
import json
import os
import re
import sys

KINDS = ("full", "sliding", "gdn")


def load(path):
    with open(path) as f:
        return json.load(f)


def breakdown(d):
    out = {k: 0.0 for k in KINDS}
    out["ffn"] = sum(d.get("ffn_ms", []))
    for kind, ms in zip(d.get("layer_kind", []), d.get("mixer_ms", [])):
        out[kind] += ms
    if d["mode"] == "flashprefill":
        out["overhead"] = d.get("sparse_index_ms", 0.0)
    elif d["mode"] == "uniprefill":
        out["overhead"] = sum(x.get("select_ms", 0.0) for x in d.get("drops", []))
    else:
        out["overhead"] = 0.0
    return out


def kept_share(d):
    if d["mode"] == "flashprefill":
        return d.get("kept_share")
    if d["mode"] == "uniprefill" and d.get("drops"):
        total = sum(d["requests"])
        return sum(d["drops"][-1]["kept_per_request"]) / total if total else None
    return None


def full_attn_work(d):
    """The share of dense's full-attention work (causal query-key pairs) the run's full-attention layers did:
    FlashPrefill, each layer's kept share of visible key blocks; UniPrefill, the pairs of each request's
    tokens at that layer (a drop layer attends over what it received, the layers after it over what it
    kept); dense 1. The comparison "at equal kept shares of attention work" reads this column."""
    full = [l for l, k in enumerate(d.get("layer_kind", [])) if k == "full"]
    if not full:
        return None
    if d["mode"] == "dense":
        return 1.0
    if d["mode"] == "flashprefill":
        per = {x["layer"]: x["kept_share"] for x in d.get("sparse_layers", []) if "kept_share" in x}
        if all(l in per for l in full):
            return sum(per[l] for l in full) / len(full)
        return d.get("kept_share")
    if d["mode"] == "uniprefill":
        reqs = list(d["requests"])
        pairs = lambda counts: sum(n * (n + 1) / 2 for n in counts)
        drops = sorted(d.get("drops", []), key=lambda x: x["layer"])
        done = 0.0
        for l in full:
            counts = reqs
            for x in drops:
                if x["layer"] < l:
                    counts = x["kept_per_request"]
            done += pairs(counts)
        return done / (len(full) * pairs(reqs))
    return None


def keep_for_work(d, work):
    """The UniPrefill top-k keep ratio r whose full-attention work (full_attn_work, with each drop layer keeping
    r of the tokens it receives: r^k of the prompt after k drops) equals `work`, for the drop layers and layer
    kinds of the UniPrefill run d; None when even r -> 0 does more (the full-attention layers up to the first
    drop always run whole)."""
    full = [l for l, k in enumerate(d.get("layer_kind", [])) if k == "full"]
    drops = sorted(x["layer"] for x in d.get("drops", []))
    if not full or not drops:
        return None

    def share(r):
        return sum(r ** (2 * sum(1 for x in drops if x < l)) for l in full) / len(full)

    if share(0.0) > work:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) < work else (lo, mid)
    return (lo + hi) / 2


def method_key(name):
    order = {"dense": 0, "flashprefill": 1, "uniprefill-topp": 3}
    return (2 if name.startswith("flashprefill-a") else order.get(name, 4), name)


def self_test():
    """full_attn_work on runs worked out by hand; exit 1 on a mismatch."""
    kinds = ["full", "sliding", "full", "gdn", "full"]  # full-attention layers 0, 2, 4
    cases = [
        ("dense", {"mode": "dense", "layer_kind": kinds, "requests": [8]}, 1.0),
        # per-layer kept shares 0.5, 0.25, 0.75: their mean
        ("flashprefill per layer", {"mode": "flashprefill", "layer_kind": kinds, "requests": [8], "kept_share": 0.1,
                                    "sparse_layers": [{"layer": l, "kept_share": k} for l, k in
                                                      ((0, 0.5), (2, 0.25), (4, 0.75))]}, 0.5),
        # a layer missing from sparse_layers: the run's overall share
        ("flashprefill overall", {"mode": "flashprefill", "layer_kind": kinds, "requests": [8], "kept_share": 0.1,
                                  "sparse_layers": [{"layer": 0, "kept_share": 0.5}]}, 0.1),
        # requests of 3 and 8 tokens (pairs 6 + 36 = 42 a dense layer); a drop at layer 2 keeps 1 and 4 (pairs 1 + 10):
        # layer 0 and the drop layer 2 attend over everything, layer 4 over what was kept: (42 + 42 + 11) / (3 x 42)
        ("uniprefill", {"mode": "uniprefill", "layer_kind": kinds, "requests": [3, 8],
                        "drops": [{"layer": 2, "kept_per_request": [1, 4]}]}, (42 + 42 + 11) / 126),
        ("no full-attention layer", {"mode": "uniprefill", "layer_kind": ["gdn"], "requests": [8]}, None),
    ]
    failures = 0
    for name, d, want in cases:
        got = full_attn_work(d)
        ok = got is None if want is None else got is not None and abs(got - want) < 1e-12
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {got} (want {want})")
    # keep_for_work on the same layers with drops after layers 0 and 2: shares (1 + r^2 + r^4) / 3; r = 0.5
    # gives (1 + 0.25 + 0.0625) / 3 = 0.4375; below 1/3 (layer 0 always whole) nothing matches
    run = {"mode": "uniprefill", "layer_kind": kinds, "requests": [8], "drops": [{"layer": 0}, {"layer": 2}]}
    for work, want in ((0.4375, 0.5), (1.0, 1.0), (0.3, None)):
        got = keep_for_work(run, work)
        ok = (got is None) if want is None else got is not None and abs(got - want) < 1e-9
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} keep for work {work}: {got} (want {want})")
    print(f"{failures} failed" if failures else "self-test passed")
    return 1 if failures else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    if len(sys.argv) == 4 and sys.argv[1] == "--keep-for-work":
        r = keep_for_work(load(sys.argv[2]), float(sys.argv[3]))
        if r is not None:
            print("%.4f" % r)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--out", help="write the markdown table here (default: stdout)")
    ap.add_argument("--json", help="write the rows as JSON here")
    a = ap.parse_args()
    runs = {}
    pat = re.compile(r"^(?P<model>.+)-(?P<length>\d+)-(?P<method>dense|flashprefill(-a[0-9.]+)?|uniprefill-[a-z0-9.]+)\.json$")
    for path in sorted(glob.glob(os.path.join(a.dir, "*.json"))):
        m = pat.match(os.path.basename(path))
        if not m:
            continue
        try:
            d = load(path)
        except (OSError, ValueError) as e:
            print(f"methods_table: skipping {path}: {e}", file=sys.stderr)
            continue
        runs.setdefault((m["model"], int(m["length"])), {})[m["method"]] = d
    if not runs:
        print(f"methods_table: no <model>-<length>-<method>.json under {a.dir}", file=sys.stderr)
        return 2
    lines = ["| model | tokens | method | TTFT ms | vs dense | kept share | full-attn work | full attn ms | sliding ms |"
             " GDN ms | FFN/MoE ms | own overhead ms |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for (model, length), methods in sorted(runs.items()):
        dense = methods.get("dense")
        base = dense["ttft_ms"]["median"] if dense else None
        for name in sorted(methods, key=method_key):
            d = methods[name]
            ttft = d["ttft_ms"]["median"]
            b = breakdown(d)
            share = kept_share(d)
            work = full_attn_work(d)
            label = name
            if name.startswith("flashprefill"):
                fp = d.get("flashprefill", {})
                label = f"flashprefill a={fp.get('alpha')} bn={fp.get('block_n')}" + (
                    " mc" if fp.get("mean_correction") else "")
            partial = " (layers %d:%d)" % tuple(d["layers"]) if d.get("partial_model") else ""
            row = {"model": model + partial, "tokens": length, "method": label, "ttft_ms": ttft,
                   "speedup": base / ttft if base else None, "kept_share": share, "full_attn_work": work,
                   **{k + "_ms": v for k, v in b.items()}}
            rows.append(row)
            lines.append("| %s | %d | %s | %.1f | %s | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f |" % (
                row["model"], length, label, ttft, "%.2fx" % row["speedup"] if base else "-",
                "%.3f" % share if share is not None else "-", "%.3f" % work if work is not None else "-",
                b["full"], b["sliding"], b["gdn"], b["ffn"], b["overhead"]))
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

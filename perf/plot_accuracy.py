#!/usr/bin/env python3
"""Summarises a directory of `upf eval` JSON runs (perf/accuracy.sh run) into the accuracy report:
accuracy.md (tables), accuracy.json (the same numbers) and accuracy.png (top-1 agreement, KL, needle
accuracy and keep ratio against p, one line per model and length). Also reads commands.txt and
text.sha256 of the run directory into the report.

    python3 perf/plot_accuracy.py RUN_DIR --out perf/reports/accuracy
"""
import argparse
import glob
import json
import os
import shutil
import sys

TARGET_AGREEMENT = 0.99  # issue 16: UniPrefill top-1 agreement >= 99% at the default p
NEEDLE_SLACK = 0.01      # and needle accuracy within 1 point of dense


def load_runs(run_dir):
    runs = []
    for path in sorted(glob.glob(os.path.join(run_dir, "*.json"))):
        with open(path) as f:
            try:
                r = json.load(f)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_accuracy: {path}: not JSON ({e})")
        if "task" not in r:
            continue
        r["_file"] = os.path.basename(path)
        runs.append(r)
    return runs


def model_tag(r):
    return r["model"]["name"]


def sweep_key(run):
    return ("p", run["p"]) if "p" in run else ("keep", run["keep"])


def summarise(runs):
    """Per model: its setup, ppl per length, next-token and needle per length and p."""
    out = {}
    for r in runs:
        m = out.setdefault(model_tag(r), {"drop_layers": r["model"]["drop_layers"], "select": r["model"]["select"],
                                          "layers": r["model"]["layers"], "backend": r["backend"],
                                          "dtype": r["dtype"], "text": r.get("text"), "ppl": [],
                                          "next_token": [], "needle": [], "dtype_floor": [], "commits": set()})
        m["commits"].add(r.get("commit", "unknown"))
        if r["task"] == "ppl":
            for L in r["lengths"]:
                m["ppl"].append({"tokens": L["tokens"], "windows": L["windows"], "positions": L["positions"],
                                 "ppl": L["ppl"]})
        elif r["task"] == "next-token":
            for L in r["lengths"]:
                if "dtype_floor" in L:
                    f = L["dtype_floor"]
                    m["dtype_floor"].append({"tokens": L["tokens"], "windows": L["windows"], "dtype": f["dtype"],
                                             "against": r["dtype"], "positions": f["positions"],
                                             "top1_agreement": f["top1_agreement"], "kl_mean": f["kl_mean"],
                                             "kl_max": f["kl_max"]})
                for run in L["runs"]:
                    k, v = sweep_key(run)
                    m["next_token"].append({"tokens": L["tokens"], "windows": L["windows"], k: v,
                                            "last": r.get("last", 128), "positions": run["positions"], "top1_agreement": run["top1_agreement"],
                                            "kl_mean": run["kl_mean"], "kl_max": run["kl_max"],
                                            "keep_ratio": run["keep_ratio"]})
        elif r["task"] == "needle":
            for L in r["lengths"]:
                n = len(L["cases"])
                for run in L["runs"]:
                    k, v = sweep_key(run)
                    m["needle"].append({"tokens": L["tokens"], "cases": n, k: v, "dense_accuracy": L["dense_accuracy"],
                                        "accuracy": run["accuracy"], "by_depth": run["by_depth"],
                                        "dense_by_depth": L["dense_by_depth"], "keep_ratio": run["keep_ratio"],
                                        "depths": r["depths"]})
                if not L["runs"]:
                    m["needle"].append({"tokens": L["tokens"], "cases": n, "dense_accuracy": L["dense_accuracy"],
                                        "dense_by_depth": L["dense_by_depth"], "depths": r["depths"]})
            if r.get("replay_first_token_mismatches"):
                m.setdefault("replay_mismatches", 0)
                m["replay_mismatches"] += r["replay_first_token_mismatches"]
    for m in out.values():
        m["commits"] = sorted(m["commits"])
        m["verdict"] = verdict(m)
    return out


def verdict(m):
    """At the default p: agreement and needle targets; the largest swept p below it that breaks one."""
    p0 = m["select"]["p"]
    rows = [r for r in m["next_token"] if abs(r.get("p", -1) - p0) < 1e-6]
    needles = [r for r in m["needle"] if abs(r.get("p", -1) - p0) < 1e-6]
    v = {"default_p": p0}
    if rows:
        v["agreement_min"] = min(r["top1_agreement"] for r in rows)
        v["agreement_met"] = v["agreement_min"] >= TARGET_AGREEMENT
        v["keep_ratio_last_drop"] = sum(r["keep_ratio"][-1] for r in rows if r["keep_ratio"]) / max(1, len(rows))
    if needles:
        v["needle_gap_max"] = max(r["dense_accuracy"] - r["accuracy"] for r in needles)
        v["needle_met"] = v["needle_gap_max"] <= NEEDLE_SLACK + 1e-9
    ps = sorted({r["p"] for r in m["next_token"] + m["needle"] if "p" in r}, reverse=True)
    broken = []
    for p in ps:
        nt = [r for r in m["next_token"] if r.get("p") == p]
        nd = [r for r in m["needle"] if r.get("p") == p]
        if any(r["top1_agreement"] < TARGET_AGREEMENT for r in nt) or any(
                r["dense_accuracy"] - r["accuracy"] > NEEDLE_SLACK + 1e-9 for r in nd):
            broken.append(p)
    v["p_breaks"] = max(broken) if broken else None
    # the smallest swept p from which every larger swept p meets both targets, and the keep it needs
    meets = [p for p in ps if p not in broken]
    ok = [p for p in meets if all(q in meets for q in ps if q >= p)]
    v["p_meets"] = min(ok) if ok else None
    if v["p_meets"] is not None:
        rows = [r for r in m["next_token"] if r.get("p") == v["p_meets"] and r["keep_ratio"]]
        v["keep_ratio_at_p_meets"] = sum(r["keep_ratio"][-1] for r in rows) / max(1, len(rows)) if rows else None
    return v


def fmt_keep(k):
    return " / ".join(f"{x:.3f}" for x in k) if k else "-"


def write_markdown(summary, run_dir, path):
    lines = ["# UniPrefill accuracy on real weights: tables", "",
             "Generated by `perf/plot_accuracy.py` from the `upf eval` JSON of one run directory "
             "(`perf/accuracy.sh run`); README.md beside this file says what was run and why.", ""]
    for name, m in summary.items():
        lines += [f"## {name}", "",
                  f"{m['layers']} layers, drop layers {m['drop_layers']}, selection G {m['select']['block']}, "
                  f"sink {m['select']['sink']}, last-q {m['select']['last_q']}, default p {m['select']['p']}; "
                  f"backend {m['backend']}, {m['dtype']}; commit {', '.join(m['commits'])}.", ""]
        if m["text"]:
            lines += [f"Text: {len(m['text']['files'])} files, {m['text']['tokens']} tokens "
                      f"({', '.join(os.path.basename(f['path']) for f in m['text']['files'])}).", ""]
        if m["ppl"]:
            lines += ["Dense perplexity:", "", "| tokens | windows | positions | ppl |", "|---|---|---|---|"]
            lines += [f"| {r['tokens']} | {r['windows']} | {r['positions']} | {r['ppl']:.3f} |" for r in m["ppl"]]
            lines.append("")
        if m["next_token"]:
            lasts = sorted({r["last"] for r in m["next_token"]})
            lines += [f"Next-token, last {'/'.join(map(str, lasts))} positions of each window (UniPrefill vs dense):", "",
                      "| tokens | windows | p / keep | top-1 agreement | mean KL | max KL | kept share after each drop layer |",
                      "|---|---|---|---|---|---|---|"]
            for r in sorted(m["next_token"], key=lambda r: (r["tokens"], r.get("p", r.get("keep")))):
                s = f"p {r['p']}" if "p" in r else f"keep {r['keep']}"
                lines.append(f"| {r['tokens']} | {r['windows']} | {s} | {100 * r['top1_agreement']:.2f}% "
                             f"({r['positions']} positions) | {r['kl_mean']:.4g} | {r['kl_max']:.4g} | "
                             f"{fmt_keep(r['keep_ratio'])} |")
            lines.append("")
        if m["dtype_floor"]:
            lines += ["Precision alone (dense in another dtype against dense, same windows and positions):", "",
                      "| tokens | windows | dense | against dense | top-1 agreement | mean KL | max KL |",
                      "|---|---|---|---|---|---|---|"]
            for r in sorted(m["dtype_floor"], key=lambda r: r["tokens"]):
                lines.append(f"| {r['tokens']} | {r['windows']} | {r['dtype']} | {r['against']} | "
                             f"{100 * r['top1_agreement']:.2f}% ({r['positions']} positions) | {r['kl_mean']:.4g} | "
                             f"{r['kl_max']:.4g} |")
            lines.append("")
        if m["needle"]:
            lines += ["Needle (pass key, greedy answer), accuracy over depths x trials:", "",
                      "| tokens | cases | p / keep | dense | UniPrefill | UniPrefill by depth | kept share after each drop layer |",
                      "|---|---|---|---|---|---|---|"]
            for r in sorted(m["needle"], key=lambda r: (r["tokens"], r.get("p", r.get("keep", 0)))):
                if "accuracy" not in r:
                    lines.append(f"| {r['tokens']} | {r['cases']} | - | {100 * r['dense_accuracy']:.1f}% | - | - | - |")
                    continue
                s = f"p {r['p']}" if "p" in r else f"keep {r['keep']}"
                depth = ", ".join(f"{d}: {a:.2f}" for d, a in zip(r["depths"], r["by_depth"]))
                lines.append(f"| {r['tokens']} | {r['cases']} | {s} | {100 * r['dense_accuracy']:.1f}% | "
                             f"{100 * r['accuracy']:.1f}% | {depth} | {fmt_keep(r['keep_ratio'])} |")
            lines.append("")
            if m.get("replay_mismatches"):
                lines += [f"**{m['replay_mismatches']} replayed runs disagreed with their prompt run at the prompt's "
                          f"last position** (the replay is then not what decode would see).", ""]
        v = m["verdict"]
        lines += ["Targets at the default p = %g:" % v["default_p"], ""]
        if "agreement_min" in v:
            lines.append(f"- top-1 agreement >= 99%: {'met' if v['agreement_met'] else 'NOT met'} "
                         f"(lowest over lengths {100 * v['agreement_min']:.2f}%), kept share after the last drop "
                         f"layer {v['keep_ratio_last_drop']:.3f} (mean over lengths)")
        else:
            lines.append("- top-1 agreement: no next-token run at the default p")
        if "needle_gap_max" in v:
            lines.append(f"- needle within 1 point of dense: {'met' if v['needle_met'] else 'NOT met'} "
                         f"(largest gap {100 * v['needle_gap_max']:.1f} points)")
        else:
            lines.append("- needle: no needle run at the default p")
        lines.append(f"- largest swept p at which a target breaks: {v['p_breaks'] if v['p_breaks'] is not None else 'none in the sweep'}")
        if v.get("p_meets") is not None:
            k = v.get("keep_ratio_at_p_meets")
            lines.append(f"- smallest swept p from which both targets hold: {v['p_meets']}"
                         + (f" (kept share after the last drop layer {k:.3f})" if k is not None else ""))
        else:
            lines.append("- no swept p holds both targets")
        lines.append("")
    sha = os.path.join(run_dir, "text.sha256")
    if os.path.exists(sha):
        lines += ["## Text files (sha256)", "", "```"] + open(sha).read().rstrip().splitlines() + ["```", ""]
    cmds = os.path.join(run_dir, "commands.txt")
    if os.path.exists(cmds):
        lines += ["## Commands", "", "```"] + open(cmds).read().rstrip().splitlines() + ["```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    (a_agree, a_kl), (a_needle, a_keep) = ax
    for name, m in summary.items():
        for L in sorted({r["tokens"] for r in m["next_token"] if "p" in r}):
            rows = sorted((r for r in m["next_token"] if r["tokens"] == L and "p" in r), key=lambda r: r["p"])
            ps = [r["p"] for r in rows]
            a_agree.plot(ps, [100 * r["top1_agreement"] for r in rows], "o-", label=f"{name} {L}")
            pos = [r for r in rows if r["kl_mean"] > 0]  # KL 0 (every token kept) has no place on a log axis
            a_kl.plot([r["p"] for r in pos], [r["kl_mean"] for r in pos], "o-", label=f"{name} {L}")
            a_keep.plot(ps, [r["keep_ratio"][-1] if r["keep_ratio"] else 1 for r in rows], "o-",
                        label=f"{name} {L} (after last drop)")
            floor = [f for f in m["dtype_floor"] if f["tokens"] == L]
            if floor:
                a_agree.axhline(100 * floor[0]["top1_agreement"], color=a_agree.lines[-1].get_color(), ls="--", lw=1,
                                label=f"{name} {L}: dense {floor[0]['dtype']} vs {floor[0]['against']}")
        for L in sorted({r["tokens"] for r in m["needle"] if "p" in r}):
            rows = sorted((r for r in m["needle"] if r["tokens"] == L and "p" in r), key=lambda r: r["p"])
            line, = a_needle.plot([r["p"] for r in rows], [100 * r["accuracy"] for r in rows], "o-",
                                  label=f"{name} {L} UniPrefill")
            a_needle.axhline(100 * rows[0]["dense_accuracy"], color=line.get_color(), ls="--", lw=1,
                             label=f"{name} {L} dense")
    a_agree.axhline(100 * TARGET_AGREEMENT, color="k", ls=":", lw=1, label="target 99%")
    a_agree.set(title="top-1 agreement with dense (last 128 positions)", xlabel="p", ylabel="%")
    a_kl.set(title="mean KL(dense || UniPrefill), nats (0 not shown)", xlabel="p", yscale="log")
    a_needle.set(title="needle accuracy (greedy pass key)", xlabel="p", ylabel="%")
    a_keep.set(title="kept share of the prompt after the last drop layer", xlabel="p", ylim=(0, 1.05))
    for a in (a_agree, a_kl, a_needle, a_keep):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = load_runs(args.run_dir)
    if not runs:
        sys.exit(f"plot_accuracy: no upf eval JSON in {args.run_dir}")
    os.makedirs(args.out, exist_ok=True)
    summary = summarise(runs)
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_markdown(summary, args.run_dir, os.path.join(args.out, "accuracy.md"))
    for extra in ("commands.txt", "text.sha256"):
        if os.path.exists(os.path.join(args.run_dir, extra)):
            shutil.copy(os.path.join(args.run_dir, extra), os.path.join(args.out, extra))
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    for r in runs:
        shutil.copy(os.path.join(args.run_dir, r["_file"]), os.path.join(runs_dir, r["_file"]))
    try:
        plot(summary, os.path.join(args.out, "accuracy.png"))
    except ImportError:
        print("plot_accuracy: matplotlib is not installed: tables written, no plot", file=sys.stderr)
    print(f"plot_accuracy: {len(runs)} runs -> {args.out}/accuracy.md, accuracy.json, accuracy.png")


if __name__ == "__main__":
    main()

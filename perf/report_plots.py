#!/usr/bin/env python3
"""The plots of `upf report`, drawn from the report.json of a report folder into that folder (PNG and SVG):
ttft.png (TTFT against prompt length, one line per method, a panel per model), speedup.png (UniPrefill's
speedup against its kept share, with the ideal 1 / kept share), kernels.png (each device kernel's share
of its ceiling) and accuracy.png (top-1 agreement against p on the real weights). Prints one line per
plot written. Exits 3, saying so, when matplotlib is absent: the report then says the plots were skipped.

    python3 perf/report_plots.py REPORT_DIR
"""
import json
import os
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: report_plots.py REPORT_DIR")
    out = sys.argv[1]
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is absent for {sys.executable} (set UPF_PLOT_PYTHON to a python that has it)")
        sys.exit(3)

    def save(fig, name, what):
        fig.tight_layout()
        for ext in ("png", "svg"):
            fig.savefig(os.path.join(out, f"{name}.{ext}"), dpi=110)
        plt.close(fig)
        print(f"- {name}.png / {name}.svg: {what}")

    stamp = rep.get("stamp", {})
    device = stamp.get("device", "?")
    if stamp.get("backend") == "cpu" or device.startswith("none"):
        device = "CPU reference, " + stamp.get("host", "?")  # no device: the backend under test is the CPU
    title = f"{device[:60]} @ {stamp.get('commit', '?')}"
    e2e = [r for r in rep.get("e2e", []) if r.get("ttft_ms")]
    models = sorted({r["model"] for r in e2e})
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
        for ax, model in zip(axes[0], models):
            rows = [r for r in e2e if r["model"] == model]
            for method in sorted({r["method"] for r in rows}):
                pts = sorted((r["length"], r["ttft_ms"]) for r in rows if r["method"] == method)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(model, fontsize=9)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("TTFT (ms)")
            ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=8)
        save(fig, "ttft", "TTFT against prompt length per method")

        uni = [r for r in e2e if r["method"] == "uniprefill" and r.get("speedup") and r.get("kept_share")]
        if uni:
            fig, ax = plt.subplots(figsize=(5, 3.8))
            for model in sorted({r["model"] for r in uni}):
                pts = [(r["kept_share"], r["speedup"]) for r in uni if r["model"] == model]
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=model)
            xs = [x / 100 for x in range(5, 101)]
            ax.plot(xs, [1 / x for x in xs], "k--", linewidth=0.8, label="ideal: 1 / kept share")
            ax.set_xlabel("kept share after the last drop")
            ax.set_ylabel("speedup over dense")
            ax.set_ylim(0, max(4.0, max(r["speedup"] for r in uni) * 1.2))
            ax.legend(fontsize=7)
            ax.set_title(title, fontsize=8)
            save(fig, "speedup", "UniPrefill speedup against kept share, with the ideal")

    kern = [r for r in rep.get("kernels", []) if r.get("ceiling_share")]
    if kern:
        fig, ax = plt.subplots(figsize=(7, max(2.5, 0.22 * len(kern))))
        ax.barh([r["id"] for r in kern], [r["ceiling_share"] for r in kern])
        ax.axvline(1.0, color="k", linewidth=0.8)
        ax.set_xlabel("share of the ceiling measured in the same run (cuBLAS or copy bandwidth)")
        ax.tick_params(axis="y", labelsize=6)
        ax.set_title(title, fontsize=8)
        save(fig, "kernels", "each device kernel's share of its ceiling")

    acc = [r for r in rep.get("accuracy", []) if r.get("agreement") is not None and r.get("p") is not None]
    if acc:
        fig, ax = plt.subplots(figsize=(5, 3.8))
        for key in sorted({(r["model"], r["tokens"]) for r in acc}):
            pts = sorted((r["p"], r["agreement"]) for r in acc if (r["model"], r["tokens"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]}")
        ax.set_xlabel("p")
        ax.set_ylabel("top-1 agreement with dense")
        ax.legend(fontsize=7)
        ax.set_title(title, fontsize=8)
        save(fig, "accuracy", "top-1 agreement against p on the real weights")
    if not (models or kern or acc):
        print("nothing to plot: no end-to-end, device-kernel or accuracy rows")


if __name__ == "__main__":
    main()

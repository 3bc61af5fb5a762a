#!/usr/bin/env python3
"""Chart of apps.json (written by benches/apps.rs): one panel per schedule x application,
every run of every mode as a dot (runs whose steal stayed off its plan as hollow circles),
the median as a bar, and the daemon's ratios to vanilla and to the best oracle in the
title. Usage:
    plot_apps.py apps.json apps.png
Exits non-zero (and the benchmark only warns) when matplotlib is missing.
"""
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "vanilla": "#d9534f",
    "vmigrater": "#2a7ab0",
    "vmigrater_parent": "#7fb3d5",
    "pinned": "#5cb85c",
    "pinned_all": "#3c8d3c",
    "sched_oracle": "#f0ad4e",
}


def main(src, dst):
    report = json.load(open(src))
    modes = report["setup"]["modes"]
    cells = [(s, a) for s, apps in report["cells"].items() for a in apps]
    cols = min(3, len(cells))
    rows = (len(cells) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, (sched, app) in zip(axes.flat, cells):
        runs = [r for r in report["runs"] if r["schedule"] == sched and r["app_name"] == app]
        metric = runs[0]["metric"] if runs else ""
        for i, m in enumerate(modes):
            vals = [r["value"] for r in runs if r["mode"] == m and r["steal_ok"]]
            off = [r["value"] for r in runs if r["mode"] == m and not r["steal_ok"]]
            if vals:
                ax.bar(i, statistics.median(vals), color=COLORS.get(m, "#999"), alpha=0.45)
            ax.scatter([i] * len(vals), vals, color=COLORS.get(m, "#999"), s=14, zorder=3)
            ax.scatter([i] * len(off), off, facecolors="none", edgecolors="k", s=14, zorder=3)
        cell = report["cells"][sched][app]
        vm = cell["modes"].get("vmigrater", {})

        def r(k):
            e = vm.get(k)
            return f"{e['value']:.2f}x" if e else "-"

        ax.set_title(
            f"{sched} / {app}\nvm/vanilla {r('vs_vanilla')}, vm/best oracle {r('vs_best_oracle')}",
            fontsize=8,
        )
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes, rotation=30, fontsize=7)
        ax.set_ylabel(metric, fontsize=8)
        ax.set_ylim(bottom=0)
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    fig.suptitle(
        f"applications under hard-IRQ deschedules ({report['setup']['accounting']} billing), "
        f"build {report.get('commit', '?')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

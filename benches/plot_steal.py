#!/usr/bin/env python3
"""Chart of steal.json (written by benches/steal.rs): one panel per schedule x workload,
every run of every mode as a dot (runs whose steal stayed off its plan as hollow
circles), the median as a bar, and the daemon's ratio of medians to vanilla and to the
pinned oracle in the title. Usage:
    plot_steal.py steal.json steal.png
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
    "vmigrater_dry": "#8fb8d8",
    "vmigrater_no_slice": "#7fa3bf",
    "pinned": "#5cb85c",
    "pinned_slice": "#2e8b57",
    "sched_oracle": "#f0ad4e",
}


def ratio(cell, key):
    e = cell["modes"].get("vmigrater", {}).get(key)
    if not e:
        return "-"
    return f"{e['value']:.2f} [{e['lo']:.2f},{e['hi']:.2f}]"


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as fh:
        report = json.load(fh)
    setup = report["setup"]
    modes = setup["modes"]
    schedules = [s["name"] for s in setup["schedules"]]
    workloads = [(w["name"], w["metric"]) for w in setup["workloads"]]
    runs = report["runs"]
    fig, axes = plt.subplots(
        len(schedules), len(workloads),
        figsize=(max(3.6 * len(workloads), 6.0), 2.9 * len(schedules) + 0.6), squeeze=False)
    for i, sched in enumerate(schedules):
        for j, (wl, metric) in enumerate(workloads):
            ax = axes[i][j]
            cell = report["cells"].get(sched, {}).get(wl)
            for x, mode in enumerate(modes):
                rs = [r for r in runs if r["schedule"] == sched
                      and r["workload_name"] == wl and r["mode"] == mode]
                ok = [r[metric] for r in rs if r.get("steal_ok") and r[metric] is not None]
                off = [r[metric] for r in rs if not r.get("steal_ok") and r[metric] is not None]
                color = COLORS.get(mode, "#555555")
                if ok:
                    ax.bar(x, statistics.median(ok), color=color, alpha=0.35, width=0.7)
                ax.scatter([x] * len(ok), ok, color=color, s=14, zorder=3)
                ax.scatter([x] * len(off), off, facecolors="none", edgecolors=color,
                           s=14, zorder=3)
            ax.set_xticks(range(len(modes)))
            ax.set_xticklabels([m.replace("vmigrater", "vm") for m in modes],
                               rotation=35, ha="right", fontsize=7)
            ax.set_ylim(bottom=0)
            ax.tick_params(axis="y", labelsize=7)
            unit = "IOPS" if metric == "iops" else "MB/s"
            title = f"{sched} / {wl} ({unit})"
            if cell:
                title += f"\nvm/va {ratio(cell, 'vs_vanilla')}\nvm/pin {ratio(cell, 'vs_pinned')}"
            ax.set_title(title, fontsize=7)
    fig.suptitle(
        f"hard-IRQ steal: {setup['reps']} reps x {setup['seconds_per_run']} s per run, "
        f"completion CPU {setup['completion_cpu']}, a hog per CPU\n(dots: runs; bars: "
        f"medians; hollow: steal off plan, left out of the statistics)", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Chart of target/bench/contention.json (written by benches/contention.rs).

Top row: reader throughput per mode per workload (bar = median over rounds, dots = the
rounds), with vmigrater/vanilla and vmigrater/no_sharing annotated. Bottom row: the CPU
hogs' progress per mode, with the hog slowdown against vanilla. Usage:
    plot_contention.py contention.json contention.png
Exits non-zero (and the benchmark only warns) when matplotlib is missing.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = ["no_sharing", "vanilla", "vmigrater"]
COLORS = ["#888888", "#d9534f", "#2a7ab0"]


def bars(ax, medians, rounds, fmt):
    xs = range(len(MODES))
    b = ax.bar(xs, medians, color=COLORS, width=0.6)
    for x, mode in zip(xs, MODES):
        pts = rounds.get(mode, [])
        ax.scatter([x] * len(pts), pts, color="black", s=10, zorder=3)
    for rect, v in zip(b, medians):
        ax.annotate(fmt.format(v), (rect.get_x() + rect.get_width() / 2, v),
                    ha="center", va="bottom", fontsize=9, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(MODES)
    ax.set_ylim(0, max([*medians, *(p for m in MODES for p in rounds.get(m, []))]) * 1.25)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as fh:
        report = json.load(fh)
    workloads = report["workloads"]
    n = len(workloads)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 7.5), squeeze=False)
    for col, (name, w) in enumerate(workloads.items()):
        unit = "MB/s" if w["metric"] == "mb_s" else "IOPS"
        ax = axes[0][col]
        bars(ax, [w["throughput"][m] for m in MODES], w["throughput_rounds"], "{:.0f}")
        ax.set_title(
            f"{name}: speedup {w['speedup']:.2f}× vs vanilla\n"
            f"vmigrater {w['vs_no_sharing']:.2f}, vanilla {w['vanilla_vs_no_sharing']:.2f}"
            " of no_sharing", fontsize=10)
        ax.set_ylabel(f"reader {unit}")
        ax = axes[1][col]
        bars(ax, [w["hog_units_per_s"][m] for m in MODES], w["hog_units_per_s_rounds"],
             "{:.0f}")
        d = w["daemon"]
        ax.set_title(
            f"CPU hogs: {w['hog_slowdown'] * 100:+.1f}% slowdown vmigrater vs vanilla\n"
            f"daemon {d['cpu_pct_of_one_cpu']:.2f}% of a CPU, "
            f"{d['migrations_per_s']:.0f} migrations/s, p50 "
            f"{d['migration_latency_us']['p50']:.1f} µs", fontsize=10)
        ax.set_ylabel("hog work units/s (both hogs)")
    setup = report["setup"]
    fig.suptitle(
        "vmigrater under emulated vCPU descheduling (10 ms on / 10 ms off, anti-phase, "
        f"{setup['cpus']} CPUs; {setup['rounds']} rounds × {setup['seconds_per_round']} s)",
        fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Charts of target/bench/lab.json (written by `vmigrater-lab bench`, `make bench-lab`).

lab.png, one panel per scenario: VM A's 4 KiB reader IOPS per mode (bar = median of the
clean runs, dots = every run, hollow = noisy), speedup over vanilla annotated, and the
co-located VMs' CPU share (right axis, diamonds; dotted: their fair share as peers).
lab-sweep.png: the speedup over vanilla against vCPUs per host CPU, next to the vMigrater
paper's 1.72x (2 VMs) and 4.42x (8 VMs). Usage:
    plot_lab.py lab.json lab.png lab-sweep.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"no_sharing": "#888888", "vanilla": "#d9534f", "vmigrater": "#2a7ab0",
          "agent": "#f0ad4e", "both": "#5cb85c"}


def scenario_panel(ax, sc):
    modes = [s["mode"] for s in sc["summary"]]
    xs = range(len(modes))
    med = [s["iops_4k"] for s in sc["summary"]]
    bars = ax.bar(xs, med, color=[COLORS.get(m, "#555") for m in modes], width=0.6)
    for x, m in zip(xs, modes):
        runs = [r for r in sc["runs"] if r["mode"] == m]
        clean = [r["iops_4k"] for r in runs if not r["noisy"]]
        noisy = [r["iops_4k"] for r in runs if r["noisy"]]
        ax.scatter([x] * len(clean), clean, color="black", s=10, zorder=3)
        ax.scatter([x] * len(noisy), noisy, facecolors="none", edgecolors="black", s=14,
                   zorder=3)
    for rect, s in zip(bars, sc["summary"]):
        sp = s.get("iops_speedup")
        label = f"{s['iops_4k']:.0f}" + (f"\n{sp:.2f}x" if sp else "")
        ax.annotate(label, (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(modes, fontsize=8, rotation=20)
    ax.set_ylabel("4 KiB reads/s (VM A)")
    ax.set_ylim(0, max(r["iops_4k"] for r in sc["runs"]) * 1.35)
    ax.set_title(f"{sc['name']}: {sc['vcpus_per_host_cpu']:g} vCPUs per host CPU", fontsize=9)
    shares = [s["b_cpu_share"] for s in sc["summary"]]
    if any(v > 0 for v in shares):
        ax2 = ax.twinx()
        ax2.scatter(list(xs), shares, marker="D", color="#333", s=18, zorder=4)
        fair = sc.get("b_fair_share", 0.5)
        ax2.axhline(fair, color="#333", lw=0.6, ls=":")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("co-located VMs' CPU share", fontsize=8)


def main():
    src, dst, sweep_dst = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(src) as fh:
        report = json.load(fh)
    scs = report["scenarios"]
    fig, axes = plt.subplots(1, len(scs), figsize=(4.6 * len(scs), 4), squeeze=False)
    for ax, sc in zip(axes[0], scs):
        scenario_panel(ax, sc)
    p = report["params"]
    fig.suptitle(f"vmigrater lab (QEMU TCG, {p['host_slice_ms']:g} ms host slice, "
                 f"{p['secs_per_run']} s x {p['reps']} runs per mode)", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)

    sweep = [s for s in report["sweep"] if s.get("vanilla_iops_4k")]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    x = [s["vcpus_per_host_cpu"] for s in sweep]
    for key, label, color in [("vmigrater_speedup", "vmigrater", COLORS["vmigrater"]),
                              ("both_speedup", "both", COLORS["both"])]:
        ys = [s.get(key) for s in sweep]
        pts = [(a, b) for a, b in zip(x, ys) if b]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{label} (this lab)", color=color)
    ax.plot([2, 8], [report["paper"]["vmigrater_speedup_2_vms"],
                     report["paper"]["vmigrater_speedup_8_vms"]],
            marker="s", ls="--", color="#999", label="vMigrater paper")
    ax.axhline(1.0, color="#d9534f", lw=0.8, ls=":", label="vanilla")
    ax.set_xlabel("vCPUs per host CPU")
    ax.set_ylabel("4 KiB IOPS speedup over vanilla")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sweep_dst, dpi=110)


if __name__ == "__main__":
    main()

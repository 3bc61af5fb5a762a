#!/usr/bin/env python3
"""Bar chart of target/bench/contention.json: throughput per mode per workload."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
report = json.load(open(src))
workloads = report["workloads"]
modes = ["no_sharing", "vanilla", "vmigrater"]
colors = ["#888888", "#d9534f", "#2a7ab0"]
fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4))
if len(workloads) == 1:
    axes = [axes]
for ax, (name, w) in zip(axes, workloads.items()):
    vals = [w["throughput"][m] for m in modes]
    bars = ax.bar(modes, vals, color=colors)
    unit = "MB/s" if w["metric"] == "mb_s" else "IOPS"
    ax.set_title(f"{name}: speedup {w['speedup']:.2f}×, {w['vs_no_sharing']:.2f} of no_sharing")
    ax.set_ylabel(unit)
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
fig.suptitle("vmigrater under emulated vCPU descheduling (10 ms on / 10 ms off, 2 CPUs)")
fig.tight_layout()
fig.savefig(dst, dpi=100)

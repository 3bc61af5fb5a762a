#!/usr/bin/env python3
"""Where the floors of issues 10 and 12 stand: 4 KiB reads of each mode against vanilla,
per scenario, as the ratio of medians with its 95% bootstrap interval (the statistic of
`lab_table.py`), runs pooled per scenario across the files given for a row group.

    benches/plot_status.py OUT.png LABEL=FILE[,FILE...] [LABEL=FILE[,FILE...] ...]

Each LABEL names a group of batches (e.g. "cold" and "warm"); a row is scenario, mode and
label. The dashed line is the floor (0.97x), the solid one vanilla (1.0x).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lab_table import ci  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["sweep1", "steal_inphase", "main", "quad", "four", "sweep4", "free", "steal"]
MODES = ["vmigrater", "agent", "both"]
COLOURS = {"vmigrater": "tab:blue", "agent": "tab:orange", "both": "tab:green"}


def rows(label, files):
    runs = {}
    for path in files:
        for sc in json.load(open(path))["scenarios"]:
            runs.setdefault(sc["name"], []).extend(sc["runs"])
    out = []
    for name, rs in runs.items():
        van = [r["iops_4k"] for r in rs if r["mode"] == "vanilla"]
        for m in MODES:
            got = [r["iops_4k"] for r in rs if r["mode"] == m]
            if len(got) < 2 or len(van) < 2:
                continue
            lo, hi = ci(got, van)
            ratio = statistics.median(got) / statistics.median(van)
            out.append((name, m, label, ratio, lo, hi, len(got)))
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out_png = sys.argv[1]
    data = []
    for arg in sys.argv[2:]:
        label, _, files = arg.partition("=")
        data.extend(rows(label, files.split(",")))
    data.sort(
        key=lambda d: (
            ORDER.index(d[0]) if d[0] in ORDER else len(ORDER),
            MODES.index(d[1]),
            d[2],
        ),
        reverse=True,
    )
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(data) + 1.2))
    for y, (name, mode, label, ratio, lo, hi, n) in enumerate(data):
        ax.errorbar(
            ratio,
            y,
            xerr=[[ratio - lo], [hi - ratio]],
            fmt="o",
            color=COLOURS[mode],
            capsize=3,
        )
    ax.set_yticks(range(len(data)))
    ax.set_yticklabels([f"{d[0]}  {d[1]}  {d[2]} (n={d[6]})" for d in data], fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvline(0.97, color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("4 KiB random-read IOPS vs vanilla (median ratio, 95% bootstrap interval)")
    ax.set_title("Nested-VM lab: where the floors stand (dashed: 0.97x floor)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Chart of target/bench/soak.json (written by `vmigrater-lab soak`, `make soak`).

Top: resident memory of the host agent and of the guest daemon over the soak, with the
32 MB budget; bottom: their open file descriptors. Each fault is a vertical line labelled
with its kind and how long VM A and the agent took to talk again. Usage:
    plot_soak.py soak.json soak.png
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    doc = json.load(open(src))
    samples = doc["samples"]
    t = [s["t_s"] / 60 for s in samples]
    fig, (mem, fds) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    # A sample taken while the agent was down (restarting) reads 0: left out.
    for key, label, color in [("agent", "host agent", "#f0ad4e"), ("guest", "guest daemon", "#2a7ab0")]:
        pts = [(x, s[f"{key}_rss_kb"] / 1024) for x, s in zip(t, samples) if s[f"{key}_rss_kb"]]
        mem.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=2, color=color, label=label)
        pts = [(x, s[f"{key}_fds"]) for x, s in zip(t, samples) if s[f"{key}_fds"]]
        fds.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=2, color=color, label=label)
    limit = doc["params"]["rss_limit_kb"] / 1024
    mem.axhline(limit, color="#d9534f", ls=":", label=f"budget {limit:.0f} MB")
    mem.set_ylim(0, limit * 1.15)
    mem.set_ylabel("resident memory, MB")
    fds.set_ylabel("open file descriptors")
    fds.set_ylim(bottom=0)
    fds.set_xlabel("minutes")
    for f in doc["faults"]:
        x = f["t_s"] / 60
        ok = f["reconnect_s"] is not None and not (isinstance(f["reconnect_s"], float) and math.isnan(f["reconnect_s"]))
        for ax in (mem, fds):
            ax.axvline(x, color="#888" if ok else "#d9534f", lw=0.6, ls="--")
        txt = f"{f['kind']} {f['reconnect_s']:.1f} s" if ok else f"{f['kind']} FAILED"
        mem.text(x, limit * 0.45, txt, rotation=90, fontsize=6, va="bottom", ha="right")
    v = doc["verdict"]
    mem.set_title(
        f"soak {doc['params']['duration_s'] / 60:.0f} min, {len(doc['faults'])} faults: "
        f"max RSS agent {v['agent_rss_max_kb'] / 1024:.1f} MB, guest {v['guest_rss_max_kb'] / 1024:.1f} MB; "
        f"{'PASS' if not v['failures'] else 'FAIL'}",
        fontsize=9,
    )
    mem.legend(loc="lower right", fontsize=8)
    fds.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

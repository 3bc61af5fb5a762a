#!/usr/bin/env python3
"""How long the lab's vCPU threads really run at a stretch, from the host's scheduler.

The vMigrater design predicts a vCPU's next slice end from its last slices, so it needs
slices that are long and regular (the paper's KVM host: 11 ms). This reads the host's own
record of every context switch and reports, per QEMU vCPU thread, the runs between being
switched in and out and the gaps between runs.

    perf sched record -o ps.data -- sleep 3      # on the lab host, during a run
    perf sched timehist -i ps.data > timehist.txt
    benches/vcpu_runs.py timehist.txt [--json OUT]

A run counts from switch-in to switch-out, however short the preemption that ended it:
that is what the guest sees as time it could not run (a guest timer due in the gap fires
late). Gaps are the host time between two runs of the same thread: perf's "wait time"
(asleep, or preempted and waiting) plus the time it waited
for a CPU once woken ("sch delay").
"""
import argparse
import json
import re
import statistics
import sys

LINE = re.compile(
    r"\s*([\d.]+)\s+\[(\d+)\]\s+(.*?)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
)


def pct(v, q):
    return v[min(len(v) - 1, int(len(v) * q))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timehist")
    ap.add_argument("--json")
    args = ap.parse_args()
    # thread -> list of (switch-out time, run ms, off-CPU ms before it, runnable part)
    runs = {}
    with open(args.timehist) as f:
        for line in f:
            m = LINE.match(line)
            if not m or "TCG" not in m.group(3):
                continue
            key = f"{m.group(5) or m.group(4)}/{m.group(3).strip()}"
            wait, delay = float(m.group(6)), float(m.group(7))
            runs.setdefault(key, []).append(
                (float(m.group(1)), float(m.group(8)), wait + delay, delay)
            )
    out = []
    for key, rs in sorted(runs.items()):
        lens = sorted(r for _, r, _, _ in rs)
        span = (rs[-1][0] - rs[0][0]) * 1000 if len(rs) > 1 else 0.0
        if span <= 0:
            continue
        total = sum(lens)
        # Gaps a guest can see (a timer due in them fires >= 1 ms late) and a move could
        # act on; shorter ones are QEMU's own locking and halts, tens of microseconds.
        long_gaps = sorted(g for _, _, g, _ in rs if g >= 1.0)
        row = {
            "thread": key,
            "runs_per_s": len(lens) / span * 1000,
            "run_ms_median": statistics.median(lens),
            "run_ms_p90": pct(lens, 0.9),
            "run_ms_max": lens[-1],
            "cpu_share": total / span,
            # Time spent in runs long enough to predict a push point from (>= 5 ms).
            "share_in_runs_ge_5ms": sum(r for r in lens if r >= 5) / total if total else 0.0,
            "gaps_ge_1ms_per_s": len(long_gaps) / span * 1000,
            "gap_ge_1ms_median_ms": statistics.median(long_gaps) if long_gaps else 0.0,
            "time_in_gaps_ge_1ms": sum(long_gaps) / span,
        }
        out.append(row)
        print(
            f"{key:20} {row['runs_per_s']:5.0f} runs/s, median {row['run_ms_median']:5.3f} ms "
            f"(p90 {row['run_ms_p90']:5.2f}, max {row['run_ms_max']:5.2f}), cpu {row['cpu_share']:.2f}, "
            f"{100 * row['share_in_runs_ge_5ms']:3.0f}% of it in runs >= 5 ms; "
            f"gaps >= 1 ms: {row['gaps_ge_1ms_per_s']:4.0f}/s, median {row['gap_ge_1ms_median_ms']:5.2f} ms, "
            f"{100 * row['time_in_gaps_ge_1ms']:3.0f}% of the time"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if not out:
        sys.exit("no QEMU TCG vCPU thread in the record")


if __name__ == "__main__":
    main()

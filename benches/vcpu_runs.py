#!/usr/bin/env python3
"""How long the lab's vCPU threads really run at a stretch, from the host's scheduler.

The vMigrater design predicts a vCPU's next slice end from its last slices, so it needs
slices that are long and regular (the paper's KVM host: 11 ms). This reads the host's own
record of every context switch and reports, per QEMU vCPU thread, the runs between being
switched in and out and the gaps between runs.

    perf sched record -o ps.data -- sleep 3      # on the lab host, during a run
    perf sched timehist -i ps.data --state > timehist.txt
    benches/vcpu_runs.py timehist.txt [--json OUT]

Why the threads leave the CPU, from one QEMU process's switch-outs with their stacks:

    perf record -e sched:sched_switch -g -p QEMU_PID -o off.data -- sleep 2
    perf script -i off.data > off.txt
    benches/vcpu_runs.py --switches off.txt

A run counts from switch-in to switch-out, however short the preemption that ended it:
that is what the guest sees as time it could not run (a guest timer due in the gap fires
late). Gaps are the host time between two runs of the same thread: perf's "wait time"
(asleep, or preempted and waiting) plus the time it waited for a CPU once woken ("sch
delay").
"""
import argparse
import json
import re
import statistics
import sys
from collections import Counter

LINE = re.compile(
    r"\s*([\d.]+)\s+\[(\d+)\]\s+(.*?)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
    r"(?:\s+(\S+))?"
)

SWITCH = re.compile(
    r"prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> "
    r"next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)"
)


def pct(v, q):
    return v[min(len(v) - 1, int(len(v) * q))]


def switches(path):
    """Tallies the vCPU threads' switch-outs: preempted (still runnable) or asleep, and
    for a sleep, in what (a futex wait in `lll_lock_wait` is a QEMU mutex)."""
    why, by_next, n = Counter(), Counter(), 0
    with open(path) as f:
        events = f.read().split("\n\n")
    for e in events:
        lines = e.strip().split("\n")
        m = SWITCH.search(lines[0]) if lines else None
        if not m or "TCG" not in m.group(1):
            continue
        n += 1
        stack = " ".join(l.split()[1] for l in lines[1:] if len(l.split()) > 1)
        if m.group(4).startswith("R"):
            w = "preempted"
        elif "lll_lock_wait" in stack:
            w = "asleep on a mutex (futex, lll_lock_wait)"
        elif "futex" in stack:
            w = "asleep on another futex"
        elif "poll" in stack:
            w = "asleep in poll"
        else:
            w = "asleep, other"
        why[w] += 1
        nice = int(m.group(7)) - 120
        nxt = f"{m.group(5)} (nice {nice})" if "TCG" in m.group(5) else f"a thread at nice {nice}"
        by_next[(w.split(" ")[0], nxt)] += 1
    print(f"{n} vCPU switch-outs")
    for w, c in why.most_common():
        print(f"{c:7} {100 * c / n:5.1f}%  {w}")
    print("then the CPU went to:")
    for (w, nxt), c in by_next.most_common(8):
        print(f"{c:7}  {w:9} -> {nxt}")
    return {"switch_outs": n, "why": dict(why)}


def runs_and_gaps(path):
    """Per vCPU thread of a `perf sched timehist` record: its runs and its gaps."""
    # thread -> list of (switch-out time, run ms, off-CPU ms before it, state at switch-out)
    runs = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m or "TCG" not in m.group(3):
                continue
            key = f"{m.group(5) or m.group(4)}/{m.group(3).strip()}"
            wait, delay = float(m.group(6)), float(m.group(7))
            runs.setdefault(key, []).append(
                (float(m.group(1)), float(m.group(8)), wait + delay, m.group(9) or "?")
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
        # With --state: the gap after each switch-out, by how the thread left (R:
        # preempted, S: asleep), to tell the host's choices from QEMU's own waits.
        after = {}
        for (_, _, _, st), (_, _, gap, _) in zip(rs, rs[1:]):
            a = after.setdefault(st, [0, 0.0])
            if gap >= 1.0:
                a[0] += 1
                a[1] += gap
        if "?" not in after:
            row["gaps_ge_1ms_after_state"] = {
                st: {"count": c, "ms": round(ms, 1)} for st, (c, ms) in after.items()
            }
        out.append(row)
        print(
            f"{key:20} {row['runs_per_s']:5.0f} runs/s, median {row['run_ms_median']:5.3f} ms "
            f"(p90 {row['run_ms_p90']:5.2f}, max {row['run_ms_max']:5.2f}), cpu {row['cpu_share']:.2f}, "
            f"{100 * row['share_in_runs_ge_5ms']:3.0f}% of it in runs >= 5 ms; "
            f"gaps >= 1 ms: {row['gaps_ge_1ms_per_s']:4.0f}/s, median {row['gap_ge_1ms_median_ms']:5.2f} ms, "
            f"{100 * row['time_in_gaps_ge_1ms']:3.0f}% of the time"
            + "".join(
                f"; after {st}: {a['count']} ({a['ms']:.0f} ms)"
                for st, a in row.get("gaps_ge_1ms_after_state", {}).items()
            )
        )
    if not out:
        sys.exit("no QEMU TCG vCPU thread in the record")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", help="perf sched timehist output, or perf script output with --switches")
    ap.add_argument("--json")
    ap.add_argument("--switches", action="store_true")
    args = ap.parse_args()
    out = switches(args.record) if args.switches else runs_and_gaps(args.record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The bench gate: a few small hard-IRQ cells, judged against stated floors.

Run before any results claim (`make bench-gate`); not in CI, where the machine is shared
and a 20-minute measurement cannot fail a build. It reads the `steal.json`
of `make bench-gate`'s run and exits non-zero, naming each cell and ratio that fell
below its floor. The floors sit well below what the full benchmark measured (the README's
hard-IRQ table: anti-phase 4 KiB 4.65x vanilla and 0.97x the oracle, request 9.05x and
1.00x, none 1.02x and 0.98x), so that a failure says a regression, not noise. Where
nothing can gain the floor is the one we promise, 0.97x vanilla, held by the median of
eight interleaved repetitions of eight seconds.

    benches/gate.py STEAL_JSON
"""

import json
import sys

# (schedule, workload, ratio, floor, what is held to it): the ratio is a key of the
# daemon's cell in steal.json (`vs_MODE`: ratio of medians against MODE); "value" holds
# the median ratio to the floor, "hi" the upper end of its 95% interval.
NEVER_HURT = 0.97
FLOORS = [
    ("anti", "rand4k", "vs_vanilla", 1.5, "value"),
    ("anti", "rand4k", "vs_pinned_slice", 0.85, "value"),
    ("anti", "request", "vs_vanilla", 2.0, "value"),
    ("anti", "request", "vs_pinned_slice", 0.85, "value"),
    ("none", "rand4k", "vs_vanilla", NEVER_HURT, "value"),
    ("none", "request", "vs_vanilla", NEVER_HURT, "value"),
]


def judge(doc):
    """The lines to print and whether every floor held."""
    lines, ok = [], True
    cells = doc.get("cells", {})
    for sched, workload, ratio, floor, held_by in FLOORS:
        cell = cells.get(sched, {}).get(workload)
        what = "" if held_by == "value" else f" ({held_by} of the interval)"
        name = f"{sched:<5} {workload:<8} vmigrater {ratio:<16} floor {floor:.2f}{what}"
        if cell is None:
            lines.append(f"MISSING {name}: the run has no such cell")
            ok = False
            continue
        est = cell["modes"].get("vmigrater", {}).get(ratio)
        if not est or est.get("value") is None:
            lines.append(f"MISSING {name}: no {ratio} in the cell")
            ok = False
            continue
        v, lo, hi = est["value"], est.get("lo"), est.get("hi")
        if held_by == "hi" and hi is None:
            lines.append(f"MISSING {name}: no interval in the cell")
            ok = False
            continue
        held = (v if held_by == "value" else hi) >= floor
        ok &= held
        interval = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
        lines.append(f"{'ok  ' if held else 'FAIL'}    {name}: {v:.2f}x{interval}")
    return lines, ok


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        doc = json.load(f)
    lines, ok = judge(doc)
    print(f"bench gate, build {doc.get('commit', '?')}:")
    for line in lines:
        print("  " + line)
    print("every floor held" if ok else "BELOW A FLOOR: no results claim from this build")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

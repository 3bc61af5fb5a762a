#!/usr/bin/env python3
"""Pools the runs of several apps*.json (benches/apps.rs) cell by cell: batches of one
build measured one after another, so that a cell read from 16 repetitions is not left at
the 8 of each batch. Per schedule x application: the runs of each mode within the steal
tolerance, their medians, the daemon against vanilla (ratio of medians, and the paired
ratio over the repetitions of each batch, each with a 95% bootstrap interval: 10,000
resamples, percentile, seed 1), how many daemon runs fell below their vanilla run, and
in how many runs the daemon placed a task at all.
Usage:
    apps_pool.py apps-a.json apps-b.json ...
"""
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from apps_table import NAMES, sched_label  # noqa: E402

RESAMPLES = 10_000


def interval(values_of, seed=1):
    """95% percentile interval of a statistic over resamples (`values_of(rnd)`)."""
    rnd = random.Random(seed)
    xs = sorted(values_of(rnd) for _ in range(RESAMPLES))
    return xs[int(0.025 * RESAMPLES)], xs[int(0.975 * RESAMPLES) - 1]


def ratio_of_medians(a, b):
    m = statistics.median(a) / statistics.median(b)
    lo, hi = interval(lambda r: statistics.median(r.choices(a, k=len(a)))
                      / statistics.median(r.choices(b, k=len(b))))
    return m, lo, hi


def paired(pairs):
    ratios = [x / y for x, y in pairs]
    m = statistics.median(ratios)
    lo, hi = interval(lambda r: statistics.median(r.choices(ratios, k=len(ratios))))
    return m, lo, hi


def placed(run):
    log = (run.get("daemon") or {}).get("log", [])
    return any("managing it" in l or "kept there tid=" in l for l in log)


def main(paths):
    cells, builds = {}, set()
    for i, p in enumerate(paths):
        doc = json.load(open(p))
        builds.add(doc.get("commit", "?"))
        billing = doc.get("setup", {}).get("accounting", "absorbed")
        for r in doc["runs"]:
            if not r.get("steal_ok", True):
                continue
            key = (r["schedule"] + ("" if billing == "absorbed" else f", {billing}"), r["app_name"])
            cells.setdefault(key, {}).setdefault(r["mode"], []).append((i, r["rep"], r))
    print(f"Builds {', '.join(sorted(builds))}; files: {', '.join(paths)}\n")
    print("| schedule | application | runs | vanilla | vmigrater | medians [95%] | paired [95%] | below their vanilla run | runs where the daemon placed a task |")
    print("|---|---|---|---|---|---|---|---|---|")
    order = list(NAMES)
    rank = {s: i for i, s in enumerate(["anti", "rphase", "xen", "kvm", "in", "none"])}
    for (sched, app), modes in sorted(cells.items(), key=lambda kv: (
            rank.get(kv[0][0], len(rank)), kv[0][0],
            order.index(kv[0][1]) if kv[0][1] in order else len(order))):
        va, vm = modes.get("vanilla", []), modes.get("vmigrater", [])
        if not va or not vm:
            continue
        a = [r["value"] for _, _, r in vm]
        b = [r["value"] for _, _, r in va]
        base = {(i, rep): r["value"] for i, rep, r in va}
        pairs = [(r["value"], base[(i, rep)]) for i, rep, r in vm if (i, rep) in base]
        m, lo, hi = ratio_of_medians(a, b)
        pm, plo, phi = paired(pairs)
        below = sum(1 for x, y in pairs if x < y)
        acted = sum(1 for _, _, r in vm if placed(r))
        name = sched_label(sched)
        print(f"| {name} | {NAMES.get(app, app)} | {len(vm)} + {len(va)} | {statistics.median(b):,.1f} | "
              f"{statistics.median(a):,.1f} | {m:.2f}× [{lo:.2f}, {hi:.2f}] | "
              f"{pm:.2f}× [{plo:.2f}, {phi:.2f}] | {below} of {len(pairs)} | {acted} of {len(vm)} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1:])

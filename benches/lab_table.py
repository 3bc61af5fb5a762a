#!/usr/bin/env python3
"""README tables from `vmigrater-lab bench` JSON files: per scenario and mode the median of
every run, each ratio to vanilla with its 95% percentile-bootstrap interval (runs of both
modes resampled independently, 4000 times, fixed seed), and the daemon's guest CPU.

    benches/lab_table.py benches/results/lab-issue10.json [more.json ...] [--clean-only] [--pool]

--pool merges the runs of a scenario across the files (batches run at different times).
The "paired" column is the median of per-repetition ratios (each mode against the vanilla
run of the same repetition, which ran minutes apart, interleaved), with a bootstrap
interval of that median: it cancels drift between batches that the ratio of medians
does not.

--timeline adds, for runs that recorded it (`reads_4k_per_s`, from session 19 on), the
median 4 KiB reads of each whole second of the run per mode, each mode's ratio to vanilla
per second, and the ratio over the first EARLY_S seconds against the rest, with intervals:
where in a run a cost falls (a daemon's start or all along).

All runs are used unless --clean-only: in runs recorded before `machine_steal_s` existed,
the noise flag counted this machine's own steal time (its hypervisor's, which interleaved
modes share alike) as foreign load, and flagged most runs.
"""
import json
import random
import statistics
import sys

RESAMPLES = 4000


def ci(a, b, seed=1):
    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(seed)
    rs = []
    for _ in range(RESAMPLES):
        ma = statistics.median(rng.choice(a) for _ in a)
        mb = statistics.median(rng.choice(b) for _ in b)
        if mb > 0:
            rs.append(ma / mb)
    rs.sort()
    return rs[round(0.025 * (len(rs) - 1))], rs[round(0.975 * (len(rs) - 1))]


def paired(ratios, seed=1):
    if len(ratios) < 2:
        return "–"
    rng = random.Random(seed)
    ms = sorted(statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(RESAMPLES))
    lo, hi = ms[round(0.025 * (len(ms) - 1))], ms[round(0.975 * (len(ms) - 1))]
    mark = " ✔" if lo > 1.0 else (" ✘" if hi < 1.0 else "")
    return f"{statistics.median(ratios):.2f}× [{lo:.2f}, {hi:.2f}]{mark}"


def fmt_ratio(a, b):
    if not a or not b:
        return "–"
    r = statistics.median(a) / statistics.median(b)
    c = ci(a, b)
    if c is None:
        return f"{r:.2f}×"
    mark = " ✔" if c[0] > 1.0 else (" ✘" if c[1] < 1.0 else "")
    return f"{r:.2f}× [{c[0]:.2f}, {c[1]:.2f}]{mark}"


EARLY_S = 4


def timeline(runs, modes):
    series = lambda m: [r["reads_4k_per_s"] for r in runs if r["mode"] == m and r.get("reads_4k_per_s")]
    van = series("vanilla")
    if not van:
        return
    n = min(len(x) for m in modes for x in series(m) or [[0] * 99])
    print(f"\n4 KiB reads per second, median of runs (first {n} s), and vs vanilla:\n")
    print("| mode | " + " | ".join(f"s{i}" for i in range(n)) + f" | first {EARLY_S} s vs vanilla | rest vs vanilla |")
    print("|---|" + "---|" * n + "---|---|")
    for m in modes:
        ser = series(m)
        if not ser:
            continue
        med = [statistics.median(x[i] for x in ser) for i in range(n)]
        if m == "vanilla":
            cells = [f"{v:.0f}" for v in med]
        else:
            vmed = [statistics.median(x[i] for x in van) for i in range(n)]
            cells = [f"{v:.0f} ({v / b:.2f})" if b else f"{v:.0f}" for v, b in zip(med, vmed)]
        early = lambda ss: [sum(x[:EARLY_S]) for x in ss]
        rest = lambda ss: [sum(x[EARLY_S:n]) for x in ss]
        tail = ("– | –" if m == "vanilla"
                else f"{fmt_ratio(early(ser), early(van))} | {fmt_ratio(rest(ser), rest(van))}")
        print(f"| {m} | " + " | ".join(cells) + f" | {tail} |")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    clean_only = "--clean-only" in sys.argv
    pool = "--pool" in sys.argv
    groups = {}  # (scenario, source) -> (what, runs tagged with their batch)
    for path in args:
        doc = json.load(open(path))
        for sc in doc["scenarios"]:
            key = (sc["name"], "pooled" if pool else path)
            what, runs = groups.setdefault(key, (sc["what"], []))
            runs.extend((path, r) for r in sc["runs"] if not (clean_only and r["noisy"]))
    for (name, source), (what, tagged) in groups.items():
        runs = [r for _, r in tagged]
        modes = []
        for r in runs:
            if r["mode"] not in modes:
                modes.append(r["mode"])
        get = lambda m, k: [r[k] for r in runs if r["mode"] == m]
        van = lambda k: get("vanilla", k)
        base = {(p, r["rep"]): r["iops_4k"] for p, r in tagged if r["mode"] == "vanilla"}
        pairs = lambda m: [
            r["iops_4k"] / base[(p, r["rep"])]
            for p, r in tagged
            if r["mode"] == m and base.get((p, r["rep"]), 0) > 0
        ]
        files = sorted({p for p, _ in tagged})
        print(f"\n{name}: {what} ({', '.join(files)})\n")
        print("| mode | runs | 4 KiB IOPS | vs vanilla [95% CI] | paired [95% CI] | 1 MiB MB/s | vs vanilla [95% CI] | VM A hogs vs vanilla [95% CI] | VM B CPU share | daemon guest CPU-s/run | migrations/run |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for m in modes:
            iops, seq, hog = get(m, "iops_4k"), get(m, "seq_mbps"), get(m, "hog_a_units_s")
            cpu = get(m, "daemon_cpu_s")
            mig = get(m, "migrations")
            bshare = get(m, "b_cpu_share")
            print(
                f"| {m} | {len(iops)} | {statistics.median(iops):.0f} | {fmt_ratio(iops, van('iops_4k'))} "
                f"| {paired(pairs(m)) if m != 'vanilla' else '–'} "
                f"| {statistics.median(seq):.0f} | {fmt_ratio(seq, van('seq_mbps'))} "
                f"| {fmt_ratio(hog, van('hog_a_units_s'))} "
                f"| {statistics.median(bshare):.3f} "
                f"| {max(0.0, statistics.median(cpu)):.2f} | {statistics.median(mig):.0f} |"
            )
        if "--timeline" in sys.argv:
            timeline(runs, modes)


if __name__ == "__main__":
    main()

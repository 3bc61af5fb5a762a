#!/usr/bin/env python3
"""Markdown table of one or more apps*.json (benches/apps.rs): per schedule x application,
the median of each mode, the daemon against vanilla and against the best oracle (ratio of
medians and paired ratio, each [95% bootstrap]), its lowest run against that oracle's
median, how many of its runs fell below the vanilla run of the same repetition, the
run-to-run spread, the daemon's time to its first keep and its CPU, and, where the run
measured it, the daemon against the steal-backoff baseline; the builds and the repetitions
head the table. A schedule measured with the interrupted billing is named so.
Usage:
    apps_table.py [--compact] apps-a.json [apps-b.json ...]
    apps_table.py --readme apps-a.json [apps-b.json ...]
--compact: the older README's columns (medians, the steal-backoff baseline's median, ratios
of medians with their intervals, runs below vanilla, first keep, daemon CPU).
--readme: the README's table (its files from one build): a line per file naming its build,
kernel, repetitions, run length and seeds, then per cell every oracle's median and the
best, the daemon against vanilla and the best oracle, its worst run against the vanilla
run of its repetition, the move guard's verdicts and the time its probes ran without
moves, and the price: the co-located CPU hogs' work per vCPU and in total against
vanilla's. A cell where the daemon beats every oracle is marked: the ceiling is missing
an oracle there.
"""
import json
import statistics
import sys

ORACLES = ["pinned", "pinned_all", "pinned_all_slice", "sched_oracle"]

NAMES = {
    "pg_select_c1": "PostgreSQL select-only, 1 client (tps)",
    "pg_select_c8": "PostgreSQL select-only, 8 clients (tps)",
    "pg_tpcb_c1": "PostgreSQL TPC-B-like, 1 client (tps)",
    "pg_tpcb_c8": "PostgreSQL TPC-B-like, 8 clients (tps)",
    "nginx_c4": "nginx, cold 16 KiB files, 4 connections (req/s)",
    "nginx_c1": "nginx, cold 16 KiB files, 1 connection (req/s)",
    "backup": "tar backup of 100k cold files (MB/s)",
}
SCHEDS = {"anti": "anti-phase 20/10 ms", "none": "none", "in": "in-phase 20/10 ms",
          "rphase": "random phase 20/10 ms", "xen": "Xen-like (30/30 ms)",
          "kvm": "KVM-like (3/3 ms)", "anti:30000:20000": "anti-phase 30/20 ms (3:1)",
          "anti:20000:15000": "anti-phase 20/15 ms (4:1)"}


def sched_label(sched):
    """A schedule's name in a table; a replayed trace by its file's name."""
    if sched.startswith("replay:"):
        return "trace " + sched.rsplit("/", 1)[-1].removesuffix(".trace") + " (replayed)"
    return SCHEDS.get(sched, sched)


def est(e):
    return f"{e['value']:.2f}× [{e['lo']:.2f}, {e['hi']:.2f}]" if e else "–"


def num(x):
    return "–" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}")


def main(paths, compact=False):
    builds = sorted({json.load(open(p)).get("commit", "?") for p in paths})
    reps = sorted({len(c["modes"].get("vmigrater", {}).get("runs", []))
                   for p in paths for apps in json.load(open(p))["cells"].values() for c in apps.values()})
    print(f"Build {', '.join(builds)}; {', '.join(map(str, reps))} interleaved repetitions per cell.\n")
    if compact:
        print("| schedule | application | vanilla | vmigrater | best oracle (which) | steal-backoff | vmigrater / vanilla | vmigrater / best oracle | runs below their vanilla run | first keep, s: median (max) | daemon CPU, % |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| schedule | application | vanilla | vmigrater | best oracle (which) | vmigrater / vanilla: medians; paired | vmigrater / best oracle: medians; paired | lowest run / best oracle | runs below their vanilla run | spread max/min, vanilla → vmigrater | first keep after the first request, s: median (max) | daemon CPU, % | vmigrater / steal-backoff |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        r = json.load(open(p))
        billing = r.get("setup", {}).get("accounting")
        for sched, apps in r["cells"].items():
            label = sched_label(sched) + (", interrupted" if billing == "interrupted" else "")
            order = list(NAMES)
            for app, c in sorted(apps.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
                m = c["modes"]
                vm, va = m.get("vmigrater", {}), m.get("vanilla", {})
                bo = c.get("best_oracle")
                o = m.get(bo, {}) if bo else {}
                low = "–"
                if bo and o.get("median") and vm.get("runs"):
                    low = f"{min(vm['runs']) / o['median']:.2f}×"
                by_rep = {}
                cpu, help_s = [], []
                for run in r["runs"]:
                    if run["app_name"] != app or run["schedule"] != sched:
                        continue
                    by_rep.setdefault(run["rep"], {})[run["mode"]] = run["value"]
                    d = run.get("daemon")
                    if run["mode"] == "vmigrater" and d:
                        cpu.append(d["cpu_pct_of_one_cpu"])
                        if d.get("time_to_help_s") is not None:
                            help_s.append(d["time_to_help_s"])
                pairs = [x for x in by_rep.values() if "vmigrater" in x and "vanilla" in x]
                below = f"{sum(x['vmigrater'] < x['vanilla'] for x in pairs)} of {len(pairs)}"
                cpu = f"{statistics.median(cpu):.2f}" if cpu else "–"
                helped = f"{statistics.median(help_s):.2f} ({max(help_s):.2f})" if help_s else "–"
                spread = " → ".join(f"{x['spread_max_over_min']:.2f}" if x.get("spread_max_over_min") else "–"
                                     for x in (va, vm))
                backoff = est(vm.get("vs_steal_backoff")) if "steal_backoff" in m else "–"
                if compact:
                    print(f"| {label} | {NAMES.get(app, app)} | {num(va.get('median'))} | "
                          f"{num(vm.get('median'))} | {num(o.get('median')) if bo else '–'} ({bo or '–'}) | "
                          f"{num(m.get('steal_backoff', {}).get('median'))} | "
                          f"{est(vm.get('vs_vanilla'))} | {est(vm.get('vs_best_oracle'))} | "
                          f"{below} | {helped} | {cpu} |")
                    continue
                print(f"| {label} | {NAMES.get(app, app)} | {num(va.get('median'))} | "
                      f"{num(vm.get('median'))} | {num(o.get('median')) if bo else '–'} ({bo or '–'}) | "
                      f"{est(vm.get('vs_vanilla'))}; {est(vm.get('paired_vs_vanilla'))} | "
                      f"{est(vm.get('vs_best_oracle'))}; {est(vm.get('paired_vs_best_oracle'))} | "
                      f"{low} | {below} | {spread} | {helped} | {cpu} | {backoff} |")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def hogs_vs_vanilla(runs, mode):
    """'a×, b×; total c×': the mode's median hog work per CPU and in total over vanilla's."""
    def per_cpu(m):
        rows = [r["hog_units_per_s_by_cpu"] for r in runs
                if r["mode"] == m and r.get("hog_units_per_s_by_cpu")]
        if not rows:
            return None
        return [median([row[i] for row in rows]) for i in range(len(rows[0]))], \
            median([sum(row) for row in rows])
    mine, base = per_cpu(mode), per_cpu("vanilla")
    if not mine or not base:
        return "–"
    cpus = ", ".join(f"{a / b:.2f}×" if b else "–" for a, b in zip(mine[0], base[0]))
    return f"{cpus}; total {mine[1] / base[1]:.2f}×"


def worst_paired(runs, mode):
    """The lowest ratio of a run of `mode` to the vanilla run of its repetition."""
    by_rep = {}
    for r in runs:
        by_rep.setdefault(r["rep"], {})[r["mode"]] = r["value"]
    ratios = [x[mode] / x["vanilla"] for x in by_rep.values()
              if mode in x and x.get("vanilla")]
    return f"{min(ratios):.2f}× ({sum(q < 1 for q in ratios)} of {len(ratios)} below 1)" if ratios else "–"


def guard(runs):
    """'paid P, held H; probes without moves S s (F% of the run)' over the daemon's runs."""
    ds = [r["daemon"] for r in runs if r["mode"] == "vmigrater" and r.get("daemon")]
    if not ds or any(d.get("guard_pays") is None for d in ds):
        return "–"
    paid = sum(d["guard_pays"] for d in ds)
    held = sum(d["guard_holds"] for d in ds)
    without = [d.get("guard_without_moves_s") or 0.0 for d in ds]
    secs = [r["elapsed_s"] for r in runs if r["mode"] == "vmigrater" and r.get("daemon")]
    share = 100 * sum(without) / sum(secs) if sum(secs) else 0.0
    return f"paid {paid}, held {held}; {median(without):.1f} s without moves ({share:.1f}%)"


def readme(paths):
    docs = [(p, json.load(open(p))) for p in paths]
    for path, d in docs:
        setup = d["setup"]
        print(f"<!-- {path}: commit {d.get('commit', '?')}, kernel {d.get('kernel', setup.get('kernel'))}, "
              f"{setup['reps']} reps x {setup['seconds_per_run']} s, seeds {setup.get('seeds') or 'one'} -->")
    modes = [m for _, d in docs for m in d["setup"]["modes"]]
    oracles = [o for o in ORACLES if o in modes]
    # The daemon as a user may cap it (its kept slice off), where a run has it.
    capped = [v for v in ("vmigrater_no_slice",) if v in modes]
    print("| schedule | application | vanilla | vmigrater | " +
          " | ".join(oracles) + " | vmigrater / vanilla | worst run / its vanilla run | "
          "vmigrater / best oracle (which) | move guard | CPU hogs vs vanilla, vmigrater: per vCPU; total | "
          "CPU hogs vs vanilla, best oracle | " +
          "".join(f"{v} / vanilla | CPU hogs vs vanilla, {v} | " for v in capped) +
          "first keep, s: median (max) | daemon CPU, % |")
    print("|---" * (12 + len(oracles) + 2 * len(capped)) + "|")
    order = list(NAMES)
    for _, d in docs:
        billing = d["setup"].get("accounting")
        for sched, apps in d["cells"].items():
            label = sched_label(sched) + (", interrupted" if billing == "interrupted" else "")
            for app, c in sorted(apps.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
                print(readme_row(d, sched, label, app, c, oracles, capped))


def readme_row(d, sched, label, app, c, oracles, capped):
    m = c["modes"]
    runs = [r for r in d["runs"] if r["app_name"] == app and r["schedule"] == sched
            and r.get("steal_ok", True)]
    vm, va = m.get("vmigrater", {}), m.get("vanilla", {})
    bo = c.get("best_oracle")
    above = bool(bo and vm.get("median") and m[bo].get("median")
                 and vm["median"] > m[bo]["median"])
    versus = f"{est(vm.get('vs_best_oracle'))} ({bo or '–'})" + (
        " **above every oracle**" if above else "")
    ds = [r["daemon"] for r in runs if r["mode"] == "vmigrater" and r.get("daemon")]
    helps = [x["time_to_help_s"] for x in ds if x.get("time_to_help_s") is not None]
    helped = f"{median(helps):.2f} ({max(helps):.2f})" if helps else "–"
    cpu = median([x.get("cpu_pct_of_one_cpu") for x in ds])
    return (f"| {label} | {NAMES.get(app, app)} | {num(va.get('median'))} | {num(vm.get('median'))} | " +
            " | ".join(num(m.get(o, {}).get("median")) for o in oracles) +
            f" | {est(vm.get('vs_vanilla'))} | {worst_paired(runs, 'vmigrater')} | {versus} | "
            f"{guard(runs)} | {hogs_vs_vanilla(runs, 'vmigrater')} | "
            f"{hogs_vs_vanilla(runs, bo) if bo else '–'} | " +
            "".join(f"{est(m.get(v, {}).get('vs_vanilla'))} | {hogs_vs_vanilla(runs, v)} | "
                    for v in capped) +
            f"{helped} | {'–' if cpu is None else f'{cpu:.2f}'} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--readme"] and len(args) >= 2:
        readme(args[1:])
    else:
        main([a for a in args if a != "--compact"], compact="--compact" in args)

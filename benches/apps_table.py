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
--compact: the README's columns (medians, the steal-backoff baseline's median, ratios of
medians with their intervals, runs below vanilla, first keep, daemon CPU).
"""
import json
import statistics
import sys

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


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if a != "--compact"], compact="--compact" in args)

#!/usr/bin/env python3
"""Markdown table of one or more apps*.json (benches/apps.rs): per schedule x application,
the median of each mode, the daemon against vanilla and against the best oracle (ratio of
medians [95% bootstrap]), its lowest run against that oracle's median, how many of its runs
fell below the vanilla run of the same repetition, the daemon's CPU, the time
to half rate (every mode's, from the application's own per-second figures) and the build.
Usage:
    apps_table.py apps-a.json [apps-b.json ...]
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
          "rphase": "random phase", "xen": "Xen-like", "kvm": "KVM-like"}


def est(e):
    return f"{e['value']:.2f}× [{e['lo']:.2f}, {e['hi']:.2f}]" if e else "–"


def num(x):
    return "–" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}")


def main(paths):
    print("| schedule | application | reps | vanilla | vmigrater | best oracle (which) | vmigrater / vanilla | vmigrater / best oracle | lowest run / best oracle | runs below their vanilla run | daemon CPU, % | ½ rate after, s (vanilla / vmigrater / oracle) | build |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        r = json.load(open(p))
        for sched, apps in r["cells"].items():
            for app, c in apps.items():
                m = c["modes"]
                vm, va = m.get("vmigrater", {}), m.get("vanilla", {})
                bo = c.get("best_oracle")
                o = m.get(bo, {}) if bo else {}
                low = "–"
                if bo and o.get("median") and vm.get("runs"):
                    low = f"{min(vm['runs']) / o['median']:.2f}×"
                half = " / ".join(
                    "–" if x.get("time_to_half_rate_s_median") is None else f"{x['time_to_half_rate_s_median']:.1f}"
                    for x in (va, vm, o)
                )
                reps = len(vm.get("runs", []))
                by_rep = {}
                cpu = []
                for run in r["runs"]:
                    if run["app_name"] != app or run["schedule"] != sched:
                        continue
                    by_rep.setdefault(run["rep"], {})[run["mode"]] = run["value"]
                    if run["mode"] == "vmigrater" and run.get("daemon"):
                        cpu.append(run["daemon"]["cpu_pct_of_one_cpu"])
                pairs = [x for x in by_rep.values() if "vmigrater" in x and "vanilla" in x]
                below = f"{sum(x['vmigrater'] < x['vanilla'] for x in pairs)} of {len(pairs)}"
                cpu = f"{statistics.median(cpu):.2f}" if cpu else "–"
                print(f"| {SCHEDS.get(sched, sched)} | {NAMES.get(app, app)} | {reps} | {num(va.get('median'))} | "
                      f"{num(vm.get('median'))} | {num(o.get('median')) if bo else '–'} ({bo or '–'}) | "
                      f"{est(vm.get('vs_vanilla'))} | {est(vm.get('vs_best_oracle'))} | {low} | {below} | {cpu} | {half} | {r.get('commit', '?')} |")


if __name__ == "__main__":
    main(sys.argv[1:])

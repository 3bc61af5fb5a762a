#!/usr/bin/env python3
"""Markdown tables of `make bench-host` (benches/host.rs) from its JSON.

usage: host_table.py host.json [--detail]

Without --detail (the README's table): one row per cell (host policy, vCPUs per CPU):
vanilla's median IOPS and each shipped mode's and baseline's ratio of medians to vanilla with
its 95% bootstrap interval, then the other VMs' CPU time under the agent's modes against
vanilla (the modes that do not weight vCPUs leave it at 1.00x by construction; --detail shows
them). With --detail: one row per cell and mode, with the worst run, the paired ratio, the
other VMs' CPU time and the guest's share of its CPUs; for applications also the stalled
seconds (whole seconds from the first request below 5% of vanilla's median rate in that
cell, over all runs) and, where the runs sampled it, the share of samples with client and
server on different vCPUs, in all seconds and in the stalled ones.
"""
import json
import sys

MODES = ["vmigrater", "agent", "dryrun", "both", "governor", "pinned", "liar"]
POLICY = {"fair": "fair (KVM-like)", "credit": "credit (Xen-like)"}


def est(e):
    if not e:
        return "–"
    return f"{e['value']:.2f}× [{e['lo']:.2f}, {e['hi']:.2f}]"


def med(e, what):
    """A mode's median or worst run: `value_*` (the workload's figure), `iops_*` in files
    written before applications ran in the loop."""
    return e.get(f"value_{what}", e.get(f"iops_{what}"))


def stalls(runs, floor):
    """Stalled seconds over all runs, and in how many runs."""
    per_run = [sum(1 for x in r.get("per_s", []) if x < floor) for r in runs]
    seconds = sum(len(r.get("per_s", [])) for r in runs)
    return f"{sum(per_run)} of {seconds} s, {sum(1 for n in per_run if n)} of {len(runs)} runs"


def apart(runs, floor):
    """The share of samples with client and server apart, in all seconds and in the stalled
    ones (`–` where the runs did not sample it)."""
    every, stalled = [], []
    for r in runs:
        for x, a in zip(r.get("per_s", []), r.get("apart_per_s") or []):
            if a is None:
                continue
            every.append(a)
            if x < floor:
                stalled.append(a)
    mean = lambda v: f"{sum(v) / len(v):.2f}" if v else "–"
    return f"{mean(every)}, {mean(stalled)}"


def cell_name(name):
    policy, k = name.split(":")
    return f"{POLICY.get(policy, policy)}, {k}:1"


def main():
    path = sys.argv[1]
    detail = "--detail" in sys.argv[2:]
    d = json.load(open(path))
    modes = [m for m in MODES if m in d["setup"]["modes"]]
    metric = {"iops": "IOPS", "tps": "tps"}.get(d["setup"].get("metric", "iops"), "value")
    print(
        f"<!-- {path}: commit {d['commit']}, kernel {d['kernel']}, "
        f"{d['setup']['reps']} reps x {d['setup']['seconds_per_run']} s -->"
    )
    if detail:
        apps = any(r.get("per_s") for r in d["runs"])
        extra = " stalled seconds | client and server apart: all, stalled |" if apps else ""
        print(f"| cell | mode | {metric} (median) | worst run | vs vanilla | paired vs vanilla "
              f"| others' CPU vs vanilla | guest share |{extra}")
        print("|---" * (8 + 2 * apps) + "|")
        for name, c in d["cells"].items():
            for m in ["vanilla"] + modes:
                e = c["modes"][m]
                row = (
                    f"| {cell_name(name)} | {m} | {med(e, 'median'):,.0f} | "
                    f"{med(e, 'worst'):,.0f} | {est(e.get('vs_vanilla'))} | "
                    f"{est(e.get('paired_vs_vanilla'))} | {est(e.get('others_vs_vanilla'))} | "
                    f"{e['guest_share_median']:.3f} |"
                )
                if apps:
                    floor = 0.05 * med(c["modes"]["vanilla"], "median")
                    runs = [r for r in d["runs"] if r["cell"] == name and r["mode"] == m]
                    row += f" {stalls(runs, floor)} | {apart(runs, floor)} |"
                print(row)
        return
    shown = [m for m in modes if m != "liar"]
    weighted = [m for m in ("agent", "both") if m in modes]
    head = " | ".join(f"{m} / vanilla" for m in shown)
    others = " | ".join(f"other VMs' CPU, {m}" for m in weighted)
    print(f"| host, vCPUs per CPU | vanilla {metric} | {head} | {others} |")
    print("|---" * (2 + len(shown) + len(weighted)) + "|")
    for name, c in d["cells"].items():
        row = [cell_name(name), f"{med(c['modes']['vanilla'], 'median'):,.0f}"]
        row += [est(c["modes"][m].get("vs_vanilla")) for m in shown]
        row += [est(c["modes"][m].get("others_vs_vanilla")) for m in weighted]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

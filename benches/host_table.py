#!/usr/bin/env python3
"""Markdown tables of `make bench-host` (benches/host.rs) from its JSON.

usage: host_table.py host.json [--detail]

Without --detail (the README's table): one row per cell (host policy, vCPUs per CPU):
vanilla's median IOPS and each shipped mode's and baseline's ratio of medians to vanilla with
its 95% bootstrap interval, the worst run of each of our modes against the vanilla run of its
repetition, then the other VMs' CPU time under the agent's modes against
vanilla (the modes that do not weight vCPUs leave it at 1.00x by construction; --detail shows
them), then the guest's own co-located work (its CPU hogs) under each of our modes against
vanilla, per vCPU and in total. Where the file has more than one oracle, the best (the
higher median) is named and our modes are given against it. With --detail: one row per
cell and mode, with the worst run and its ratio to the vanilla run of its repetition, the paired ratio, the other VMs'
CPU time, the guest's share of its CPUs and the guest's own co-located work (a CPU hog
pinned on each vCPU) against vanilla's, per vCPU where the file has it and in total; for
applications also the stalled
seconds (whole seconds from the first request below 5% of vanilla's median rate in that
cell, over all runs) and, where the runs sampled it, the share of samples with client and
server on different vCPUs, in all seconds and in the stalled ones.
"""
import json
import statistics
import sys

MODES = ["vmigrater", "agent", "agent_report", "dryrun", "both", "governor", "pinned",
         "host_oracle", "liar"]
# The ceilings: the reader pinned where its I/O completes, inside the guest, and that with
# the agent's own exchange held by the host from the start.
ORACLES = ["pinned", "host_oracle"]
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


def worst_paired(runs, base):
    """The lowest ratio of a run to the vanilla run of its repetition."""
    by_rep = {r["rep"]: r["value"] for r in base}
    ratios = [r["value"] / by_rep[r["rep"]] for r in runs if by_rep.get(r["rep"])]
    return f"{min(ratios):.2f}×" if ratios else "–"


def hogs(runs, base):
    """The guest's own CPU hogs (co-located work) against vanilla's, ratio of medians per
    vCPU and in total; the total alone in files that did not record them per vCPU."""
    def ratio(key, i=None):
        pick = (lambda r: r[key][i]) if i is not None else (lambda r: r[key])
        b = statistics.median(pick(r) for r in base)
        return f"{statistics.median(pick(r) for r in runs) / b:.2f}×" if b else "–"

    total = ratio("hog_units_per_s")
    by_cpu = [r.get("hog_units_per_s_by_cpu") for r in runs + base]
    if not all(by_cpu):
        return f"total {total}"
    return ", ".join(ratio("hog_units_per_s_by_cpu", i) for i in range(len(by_cpu[0]))) + \
        f"; total {total}"


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
        print(f"| cell | mode | {metric} (median) | worst run | worst run / its vanilla run "
              f"| vs vanilla | paired vs vanilla | others' CPU vs vanilla | guest share "
              f"| guest's CPU hogs vs vanilla: per vCPU; total |{extra}")
        print("|---" * (10 + 2 * apps) + "|")
        for name, c in d["cells"].items():
            base = [r for r in d["runs"] if r["cell"] == name and r["mode"] == "vanilla"]
            for m in ["vanilla"] + modes:
                e = c["modes"][m]
                runs = [r for r in d["runs"] if r["cell"] == name and r["mode"] == m]
                row = (
                    f"| {cell_name(name)} | {m} | {med(e, 'median'):,.0f} | "
                    f"{med(e, 'worst'):,.0f} | {worst_paired(runs, base) if m != 'vanilla' else '–'} | "
                    f"{est(e.get('vs_vanilla'))} | "
                    f"{est(e.get('paired_vs_vanilla'))} | {est(e.get('others_vs_vanilla'))} | "
                    f"{e['guest_share_median']:.3f} | {hogs(runs, base)} |"
                )
                if apps:
                    floor = 0.05 * med(c["modes"]["vanilla"], "median")
                    row += f" {stalls(runs, floor)} | {apart(runs, floor)} |"
                print(row)
        return
    shown = [m for m in modes if m != "liar"]
    weighted = [m for m in ("agent", "agent_report", "both") if m in modes]
    ours = [m for m in ("vmigrater", "agent", "both") if m in modes]
    head = " | ".join(f"{m} / vanilla" for m in shown)
    others = " | ".join(f"other VMs' CPU, {m}" for m in weighted)
    guest = " | ".join(f"guest's hogs per vCPU; total, {m}" for m in ours)
    worst = "worst run / its vanilla run: " + ", ".join(ours)
    oracles = [m for m in ORACLES if m in modes]
    ceiling = f" best oracle | {', '.join(ours)} / best oracle |" if len(oracles) > 1 else ""
    print(f"| host, vCPUs per CPU | vanilla {metric} | {head} |{ceiling} {worst} | {others} "
          f"| {guest} |")
    print("|---" * (3 + len(shown) + len(weighted) + len(ours) + 2 * bool(ceiling)) + "|")
    for name, c in d["cells"].items():
        row = [cell_name(name), f"{med(c['modes']['vanilla'], 'median'):,.0f}"]
        row += [est(c["modes"][m].get("vs_vanilla")) for m in shown]
        of = lambda m: [r for r in d["runs"] if r["cell"] == name and r["mode"] == m]
        if ceiling:
            best = max(oracles, key=lambda m: med(c["modes"][m], "median"))
            row += [best]
            row += ["; ".join(est(c["modes"][m].get(f"vs_{best}")) for m in ours)]
        row += [", ".join(worst_paired(of(m), of("vanilla")) for m in ours)]
        row += [est(c["modes"][m].get("others_vs_vanilla")) for m in weighted]
        row += [hogs(of(m), of("vanilla")) for m in ours]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

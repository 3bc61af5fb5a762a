#!/usr/bin/env python3
"""README table from steal.json (benches/steal.rs): per schedule x workload the median of
every mode, the daemon's ratio of medians to vanilla and to the pinned oracle (95%
percentile-bootstrap intervals, computed by the benchmark: runs of each mode resampled
independently, 2000 times, fixed seed), the paired ratio to vanilla (median of
per-repetition ratios), the run-to-run spread (max/min) of vanilla and the daemon, and
the share of daemon runs at >= 0.8x and >= 0.6x of the pinned oracle's median. The
request workload adds a row of p99 latencies.

    benches/steal_table.py benches/results/steal.json

A mark follows an interval entirely above 1 (✔) or entirely below 1 (✘).
"""
import json
import sys


def est(e):
    if not e:
        return "–"
    mark = " ✔" if e["lo"] > 1.0 else (" ✘" if e["hi"] < 1.0 else "")
    return f"{e['value']:.2f}× [{e['lo']:.2f}, {e['hi']:.2f}]{mark}"


def num(x, fmt="{:.0f}"):
    return "–" if x is None else fmt.format(x)


def main():
    doc = json.load(open(sys.argv[1]))
    setup = doc["setup"]
    modes = setup["modes"]
    print(
        f"Hard-IRQ deschedules (irq-steal), {setup['cpus']} CPUs, completion CPU "
        f"{setup['completion_cpu']}, a CPU hog pinned on each CPU; {setup['reps']} interleaved "
        f"repetitions of {setup['seconds_per_run']} s per mode; kernel {doc.get('kernel', setup.get('kernel'))}.\n"
    )
    head = " | ".join(modes)
    print(f"| schedule | workload | unit | {head} | vmigrater / vanilla | paired | "
          f"vmigrater / pinned | spread vanilla / vmigrater | vm runs ≥0.8× / ≥0.6× pinned |")
    print("|---|---|---|" + "---|" * len(modes) + "---|---|---|---|---|")
    specs = {s["name"]: s["spec"] for s in setup["schedules"]}
    # The setup's order (the JSON object's keys are sorted).
    for sched in specs:
        for wl in (w["name"] for w in setup["workloads"]):
            cell = doc["cells"].get(sched, {}).get(wl)
            if cell is None:
                continue
            m = cell["modes"]
            vm = m.get("vmigrater", {})
            unit = "IOPS" if cell["metric"] == "iops" else "MB/s"
            meds = " | ".join(num(m.get(x, {}).get("median")) for x in modes)
            spread = (f"{num(m.get('vanilla', {}).get('spread_max_over_min'), '{:.2f}')} / "
                      f"{num(vm.get('spread_max_over_min'), '{:.2f}')}")
            frac = (f"{num(vm.get('runs_at_least_0.8_of_pinned'), '{:.0%}')} / "
                    f"{num(vm.get('runs_at_least_0.6_of_pinned'), '{:.0%}')}")
            print(f"| {sched} (`{specs.get(sched, sched)}`) | {wl} | {unit} | {meds} | "
                  f"{est(vm.get('vs_vanilla'))} | {est(vm.get('paired_vs_vanilla'))} | "
                  f"{est(vm.get('vs_pinned'))} | {spread} | {frac} |")
            if wl == "request":
                p99 = " | ".join(num(m.get(x, {}).get("p99_us_median")) for x in modes)
                print(f"| | request p99 | µs | {p99} | {est(vm.get('p99_vs_vanilla'))} | | | | |")


if __name__ == "__main__":
    main()

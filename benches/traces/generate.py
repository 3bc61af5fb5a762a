#!/usr/bin/env python3
"""Deschedule traces drawn from published figures, in the testbed's replay form.

`CPU START_US END_US` lines (irq-steal's `replay:PATH`, `make bench-apps
APPS_ARGS="--only replay:PATH"`), the form `vmigrater record` writes on a real guest.

kvm-11ms-2to1: KVM with the 11 ms vCPU time slice that Red Hat recommends and the
vMigrater evaluation used (dissertation ch. 2, "Evaluation": 11 ms slices, two VMs per
core), whose slices it found "almost stable" while I/O- and compute-bound tasks run.
Each of our vCPUs shares its own physical CPU with one vCPU of another VM: it runs a
slice, then waits for the other's, each drawn normal around 11 ms with a 10% spread
(stable, not fixed), and the two physical CPUs are independent (a random phase each).

    benches/traces/generate.py kvm-11ms-2to1 SECONDS SEED > FILE
"""

import random
import sys

MS = 1000  # µs


def kvm_11ms_2to1(secs, seed, cpus=(0, 1)):
    rnd = random.Random(seed)
    length = secs * 1000 * MS
    lines = []
    for cpu in cpus:
        t = rnd.uniform(0, 22 * MS)  # this physical CPU's phase
        while t < length:
            run = max(1 * MS, rnd.gauss(11 * MS, 1.1 * MS))
            out = max(1 * MS, rnd.gauss(11 * MS, 1.1 * MS))
            start, end = int(t + run), int(t + run + out)
            if start >= length:
                break
            lines.append((start, cpu, min(end, length)))
            t += run + out
    lines.sort()
    return lines


TRACES = {"kvm-11ms-2to1": kvm_11ms_2to1}


def main(argv):
    if len(argv) != 4 or argv[1] not in TRACES:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        print(f"traces: {', '.join(TRACES)}", file=sys.stderr)
        return 2
    name, secs, seed = argv[1], int(argv[2]), int(argv[3])
    print(f"# {name}, {secs} s, seed {seed} (benches/traces/generate.py)")
    print("# CPU START_US END_US")
    for start, cpu, end in TRACES[name](secs, seed):
        print(f"{cpu} {start} {end}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

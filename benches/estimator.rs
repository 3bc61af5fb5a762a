//! Cost of one sleeper tick in the slice estimator: it runs on every 300 µs wake-up of a
//! SCHED_FIFO thread, so it must stay far below the ~4 µs the wake-up itself costs.
//! Throughput is per tick (criterion's "elem/s"; time per iteration / 10 000 = per tick).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::hint::black_box;
use vcpu_monitor::{EstimatorConfig, SliceEstimator};

const TICKS: usize = 10_000;
const US: u64 = 1_000;
const MS: u64 = 1_000_000;

/// A 300 µs sleeper on a vCPU that runs `run` and is out for `out`: (expected, actual)
/// pairs. `late(i)` is the wake-up latency of on-time tick `i`.
fn trace(run: u64, out: u64, late: impl Fn(u64) -> u64) -> Vec<(u64, u64)> {
    let period = 300 * US;
    let mut t = 1_000 * MS;
    let mut out_v = Vec::with_capacity(TICKS);
    let mut i = 0u64;
    while out_v.len() < TICKS {
        let slice_end = t + run;
        let mut next = t + period;
        while next < slice_end && out_v.len() < TICKS {
            let actual = next + late(i);
            out_v.push((next, actual));
            i += 1;
            next = actual + period;
        }
        let resume = (slice_end + out).max(next);
        out_v.push((next, resume));
        t = resume;
    }
    out_v.truncate(TICKS);
    out_v
}

fn bench(c: &mut Criterion) {
    let traces = [
        (
            "regular_10ms_slices",
            trace(10 * MS, 10 * MS, |i| 10 * US + (i % 7) * US),
        ),
        // Short slices: a gap every ~4 ticks, the slice path taken most.
        (
            "short_1ms_slices",
            trace(MS, MS, |i| 10 * US + (i % 5) * US),
        ),
        // A loaded guest: every 97th wake-up is a 0.4–1.4 ms hiccup.
        (
            "10ms_slices_with_hiccups",
            trace(10 * MS, 10 * MS, |i| {
                if i % 97 == 0 {
                    400 * US + (i % 11) * 100 * US
                } else {
                    12 * US + (i % 9) * US
                }
            }),
        ),
    ];
    let mut g = c.benchmark_group("estimator_observe");
    g.throughput(Throughput::Elements(TICKS as u64));
    for (name, tr) in &traces {
        g.bench_function(*name, |b| {
            b.iter_batched(
                || SliceEstimator::new(EstimatorConfig::default()),
                |mut est| {
                    for &(e, a) in tr {
                        black_box(est.observe(e, a));
                    }
                    est
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

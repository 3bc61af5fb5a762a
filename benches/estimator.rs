//! Cost of one sleeper tick in the slice estimator (runs on every 300 µs wake-up).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use std::hint::black_box;
use vcpu_monitor::{EstimatorConfig, SliceEstimator};

/// A 300 µs sleeper on a vCPU with 10 ms slices and 10 ms gaps: (expected, actual) pairs.
fn trace(n: usize) -> Vec<(u64, u64)> {
    let (period, us) = (300_000u64, 1_000u64);
    let mut t = 1_000_000_000u64;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let slice_end = t + 10_000_000;
        let mut next = t + period;
        while next < slice_end && out.len() < n {
            out.push((next, next + 10 * us + (out.len() as u64 % 7) * us));
            next += period;
        }
        out.push((next, slice_end + 10_000_000));
        t = slice_end + 10_000_000;
    }
    out
}

fn bench(c: &mut Criterion) {
    let tr = trace(10_000);
    c.bench_function("estimator_observe_10k_ticks", |b| {
        b.iter_batched(
            || SliceEstimator::new(EstimatorConfig::default()),
            |mut est| {
                for &(e, a) in &tr {
                    black_box(est.observe(e, a));
                }
                est
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Cost of one classification window over 200 threads (the detector runs one every 5 ms).

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use task_detector::{ClassifierConfig, Completions, IoClassifier, ThreadObservation};

fn window(w: u64, n: u32) -> Vec<ThreadObservation> {
    (0..n)
        .map(|tid| {
            // A quarter are readers (80% in flight), the rest light I/O.
            let frac = if tid % 4 == 0 { 0.8 } else { 0.05 };
            ThreadObservation {
                tid: tid + 100,
                tgid: tid + 100,
                busy_ns: (w as f64 * 5e6 * frac) as u64,
                ios: w * if tid % 4 == 0 { 150 } else { 1 },
                bytes: w * 4096,
                cpu_ns: w * 1_000_000,
                cpu_out_ns: 0,
                is_kernel: false,
                last_cpu: tid % 2,
                completions: Completions::default(),
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let windows: Vec<_> = (1..=100).map(|w| window(w, 200)).collect();
    c.bench_function("classifier_100_windows_200_threads", |b| {
        b.iter(|| {
            let mut cl = IoClassifier::new(ClassifierConfig::default());
            for (i, w) in windows.iter().enumerate() {
                black_box(cl.observe((i as u64 + 1) * 5_000_000, w));
            }
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

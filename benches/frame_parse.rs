//! Parsing one guest report of 16 vCPUs from bytes (the host parses one per guest per
//! period): framing, JSON, validation and the session rules.

use criterion::{criterion_group, criterion_main, Criterion};
use proto::{GuestSession, Hello, LineReader, Message, Report, VcpuReport};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let report = |seq| {
        Message::Report(Report {
            seq,
            period_ms: 100,
            vcpus: (0..16)
                .map(|cpu| VcpuReport {
                    cpu,
                    io_completions: 1000 + cpu as u64,
                    io_interval_ema_us: 85.5,
                    io_bound_tasks: 1,
                    io_partner_tasks: 0,
                    inactive_ratio: 0.4,
                    slice_estimate_us: 9_900.0,
                })
                .collect(),
        })
        .to_line()
    };
    let lines: Vec<String> = (1..=1000).map(report).collect();
    let hello = Message::Hello(Hello {
        version: 1,
        agent: "bench".into(),
        vcpus: 16,
        follows_host: false,
    })
    .to_line();
    c.bench_function("parse_1000_reports_16vcpu", |b| {
        b.iter(|| {
            let mut reader = LineReader::new();
            let mut session = GuestSession::new(0);
            for l in reader.push(hello.as_bytes()) {
                session.on_line(0, l).expect("hello");
            }
            for (i, line) in lines.iter().enumerate() {
                for l in reader.push(line.as_bytes()) {
                    black_box(session.on_line(i as u64, l).expect("report"));
                }
            }
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

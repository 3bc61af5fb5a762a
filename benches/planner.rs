//! Cost of one `Planner::plan` call, which runs on the SCHED_FIFO monitor thread of the
//! vCPU that changed state: target a few µs for 2–16 vCPUs and ~10 tasks.
//!
//! Scenario per size: half the vCPUs running with staggered remaining slices, the other
//! half descheduled, tasks spread over all vCPUs (so PUSH, PULL and balance all happen),
//! and the steady state that follows (tasks already where the planner wants them).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use migrater::planner::{Planner, PlannerConfig, TaskView, Trigger, VcpuView};
use std::hint::black_box;

const MS: u64 = 1_000_000;

fn vcpus(n: usize) -> Vec<VcpuView> {
    (0..n)
        .map(|cpu| {
            let active = cpu % 2 == 1;
            VcpuView {
                cpu,
                active,
                remaining_ns: if active {
                    (2 + (cpu as u64 * 7) % 9) * MS
                } else {
                    0
                },
                inactive_for_ns: if active { 0 } else { (cpu as u64 % 5) * MS },
                est_slice_ns: 10 * MS,
                back_in_ns: (!active).then(|| (cpu as u64 % 7) * MS),
                last_inactive_ns: 10 * MS,
            }
        })
        .collect()
}

fn tasks(n: usize, cpus: usize) -> Vec<TaskView> {
    (0..n)
        .map(|i| TaskView {
            tid: 1000 + i as u32,
            load: 0.2 + (i % 7) as f64 * 0.1,
            priority: if i % 5 == 0 { 1 } else { 0 },
            placed_on: (i % 3 != 0).then_some(i % cpus),
            last_cpu: i % cpus,
            allowed: (0..cpus).collect(),
        })
        .collect()
}

fn bench_plan(c: &mut Criterion) {
    let planner = Planner::new(PlannerConfig::default());
    let mut group = c.benchmark_group("plan");
    for &nv in &[2usize, 8, 64] {
        for &nt in &[4usize, 32] {
            let v = vcpus(nv);
            let t = tasks(nt, nv);
            let trigger = Trigger::Resumed { cpu: 1 };
            group.bench_with_input(
                BenchmarkId::new("rebalance", format!("{nv}vcpu_{nt}task")),
                &(),
                |b, _| b.iter(|| planner.plan(black_box(trigger), black_box(&v), black_box(&t))),
            );
            // Apply the plan once: the next calls see a settled placement (the common tick).
            let mut settled = t.clone();
            for m in planner.plan(trigger, &v, &t) {
                if let Some(task) = settled.iter_mut().find(|x| x.tid == m.tid) {
                    task.placed_on = Some(m.to);
                    task.last_cpu = m.to;
                }
            }
            let tick = Trigger::Tick { cpu: 1 };
            assert!(
                planner.plan(tick, &v, &settled).is_empty(),
                "settled plans are no-ops"
            );
            group.bench_with_input(
                BenchmarkId::new("settled", format!("{nv}vcpu_{nt}task")),
                &(),
                |b, _| b.iter(|| planner.plan(black_box(tick), black_box(&v), black_box(&settled))),
            );
        }
    }
    group.bench_function("no_tasks", |b| {
        let v = vcpus(8);
        b.iter(|| {
            planner.plan(
                black_box(Trigger::Tick { cpu: 1 }),
                black_box(&v),
                black_box(&[]),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);

//! One ISACS credit period for 1,000 VMs × 16 vCPUs (issue 3: < 10 ms): reallocation
//! (Eq. 2–4) on every host run queue, then Algorithm 2 from each run queue; and the same
//! period as the agent computes it (credits → nice/slice settings, then Algorithm 2 moves
//! with allowed CPUs), which is what bounds the agent's period loop.

use criterion::{criterion_group, criterion_main, Criterion};
use sched_core::{balance_io_load, reallocate, CreditParams, RunQueueLoad, VcpuInput};
use std::hint::black_box;

const VMS: u32 = 1_000;
const VCPUS_PER_VM: u32 = 16;
const HOST_CPUS: usize = 64;

fn run_queues() -> Vec<Vec<VcpuInput>> {
    let mut rqs = vec![Vec::new(); HOST_CPUS];
    for vm in 0..VMS {
        for v in 0..VCPUS_PER_VM {
            let id = vm * VCPUS_PER_VM + v;
            let io = id.is_multiple_of(3);
            rqs[id as usize % HOST_CPUS].push(VcpuInput {
                id,
                events: if io { 50 + (id as u64 % 200) } else { 0 },
                ema_interval_ns: if io {
                    200_000.0 + (id % 97) as f64 * 1_000.0
                } else {
                    0.0
                },
                consumed_ns: 1_000_000 + (id as u64 % 9) * 1_000_000,
            });
        }
    }
    rqs
}

fn bench(c: &mut Criterion) {
    let rqs = run_queues();
    let params = CreditParams::default();
    c.bench_function("credit_period_1000vm_x16vcpu", |b| {
        b.iter(|| {
            let allocs: Vec<_> = rqs.iter().map(|rq| reallocate(&params, rq)).collect();
            let loads: Vec<RunQueueLoad> = allocs
                .iter()
                .zip(&rqs)
                .enumerate()
                .map(|(i, (a, rq))| RunQueueLoad {
                    id: i,
                    io_events: rq.iter().map(|v| v.events).sum(),
                    io_load: a.io_load,
                    vcpus: a.vcpus.iter().map(|v| (v.id, v.iv_credit)).collect(),
                })
                .collect();
            let moves: Vec<_> = (0..HOST_CPUS)
                .filter_map(|s| balance_io_load(s, &loads))
                .collect();
            black_box((allocs, moves))
        })
    });
}

fn agent_period(c: &mut Criterion) {
    use hv_agent::placement::{plan_moves, Placed};
    use hv_agent::weights::{plan, Rules, VcpuFigures};
    let figures: Vec<VcpuFigures> = run_queues()
        .into_iter()
        .enumerate()
        .flat_map(|(q, rq)| {
            rq.into_iter().map(move |v| VcpuFigures {
                key: ((v.id / VCPUS_PER_VM) as usize, v.id % VCPUS_PER_VM),
                run_queue: q,
                events: v.events,
                ema_ns: v.ema_interval_ns,
                consumed_ns: v.consumed_ns,
                carries_io: v.events > 0,
                io_free: v.events == 0,
                always_runnable: true,
                follows_host: false,
            })
        })
        .collect::<Vec<_>>();
    // `plan` returns settings in key order; keep the figures in the same order.
    let mut figures = figures;
    figures.sort_by_key(|f| f.key);
    let params = CreditParams::default();
    // The agent's defaults: the vm-funded share rule.
    let cfg = hv_agent::config::Config::default();
    let rules = Rules {
        share: cfg.share,
        max_nice_delta: cfg.max_nice_delta,
        io_boost_nice: cfg.io_boost_nice,
    };
    c.bench_function("agent_period_1000vm_x16vcpu", |b| {
        b.iter(|| {
            let settings = plan(&params, &rules, black_box(&figures));
            // Each VM may use 4 neighbouring host CPUs (its NUMA node, say).
            let placed: Vec<Placed> = figures
                .iter()
                .zip(&settings)
                .map(|(f, s)| {
                    let base = f.run_queue / 4 * 4;
                    Placed {
                        cpu: f.run_queue,
                        events: f.events,
                        iv_credit: s.iv_credit,
                        allowed: (base..base + 4).collect(),
                        movable: true,
                    }
                })
                .collect();
            black_box(plan_moves(&placed))
        })
    });
}

criterion_group!(benches, bench, agent_period);
criterion_main!(benches);

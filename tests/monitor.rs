//! vCPU monitor on the real kernel: the steal emulator takes CPUs away on a known
//! schedule and the sleepers must see it (issue 2 acceptance (a)). Root only.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use steal_emulator::{Emulator, Pattern};
use vcpu_monitor::{monotonic_ns, Demand, Monitor, MonitorConfig, TickEvent, TickHook, VcpuBoard};
use vmigrater_testbed::require_root;

#[derive(Default)]
struct Recorder {
    /// (cpu, resume time, estimated inactive ns)
    gaps: Mutex<Vec<(usize, u64, u64)>>,
    ticks: Mutex<u64>,
}

impl TickHook for Recorder {
    fn on_tick(&self, cpu: usize, event: TickEvent, _: &VcpuBoard, now_ns: u64) {
        *self.ticks.lock().unwrap() += 1;
        if let TickEvent::Resumed { inactive_ns } = event {
            self.gaps.lock().unwrap().push((cpu, now_ns, inactive_ns));
        }
    }
}

fn percentile(v: &mut [u64], q: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn run_monitor(
    cfg: MonitorConfig,
    demand: Demand,
    f: impl FnOnce(),
) -> (Arc<Recorder>, Arc<VcpuBoard>) {
    let board = Arc::new(VcpuBoard::new(&cfg.cpus, &cfg));
    board.set_demand(demand);
    let rec = Arc::new(Recorder::default());
    let mon = Monitor::start(cfg, board.clone(), rec.clone()).expect("start monitor");
    f();
    mon.stop();
    (rec, board)
}

#[test]
fn detects_emulated_deschedules_and_measures_slices() {
    if !require_root("detects_emulated_deschedules_and_measures_slices") {
        return;
    }
    let cfg = MonitorConfig {
        cpus: vec![0, 1],
        ..MonitorConfig::default()
    };
    let patterns: Vec<Pattern> = vec![
        "0:10000:10000:0".parse().unwrap(),
        "1:10000:10000:10000".parse().unwrap(),
    ];
    let mut truth = Vec::new();
    let (rec, board) = run_monitor(cfg, Demand::Active, || {
        let emu = Emulator::start(&patterns, 50).expect("steal emulator");
        std::thread::sleep(Duration::from_secs(3));
        truth = emu.stop();
    });
    let gaps = rec.gaps.lock().unwrap().clone();
    let warmup = truth
        .iter()
        .flat_map(|r| r.intervals.first())
        .map(|i| i.0)
        .min()
        .unwrap()
        + 200_000_000;
    let (mut bursts, mut detected, mut slice_errs) = (0usize, 0usize, Vec::new());
    let mut matched_gaps = 0usize;
    for r in &truth {
        let cpu_gaps: Vec<_> = gaps.iter().filter(|g| g.0 == r.cpu).collect();
        let ivs: Vec<_> = r.intervals.iter().filter(|iv| iv.0 >= warmup).collect();
        for (k, &&(a, b)) in ivs.iter().enumerate() {
            // The sleeper resumes when the burst ends, plus wake-up latency.
            let hit = cpu_gaps.iter().find(|g| g.1 >= a && g.1 <= b + 1_000_000);
            bursts += 1;
            let Some(hit) = hit else { continue };
            detected += 1;
            matched_gaps += 1;
            // Measured slice: from this resume to the start of the next detected gap.
            if let (Some(&&(na, _)), Some(next)) = (
                ivs.get(k + 1),
                cpu_gaps.iter().find(|g| g.1 > hit.1 + 1_000_000),
            ) {
                let measured = (next.1 - next.2).saturating_sub(hit.1);
                let true_slice = na - b;
                slice_errs.push(measured.abs_diff(true_slice));
            }
        }
    }
    let after_warmup = gaps.iter().filter(|g| g.1 >= warmup).count();
    let false_gaps = after_warmup.saturating_sub(matched_gaps);
    let p50 = percentile(&mut slice_errs.clone(), 0.5);
    let p99 = percentile(&mut slice_errs, 0.99);
    let snap = board.snapshot(monotonic_ns());
    eprintln!(
        "detected {detected}/{bursts} deschedules, {false_gaps} false gaps; slice error p50 {:.3} ms p99 {:.3} ms; estimates {:?} ms; thresholds {:?} µs",
        p50 as f64 / 1e6,
        p99 as f64 / 1e6,
        snap.iter().map(|s| s.est_slice_ns as f64 / 1e6).collect::<Vec<_>>(),
        snap.iter().map(|s| s.gap_threshold_ns / 1000).collect::<Vec<_>>(),
    );
    assert!(bursts >= 200, "the emulator ran only {bursts} bursts");
    assert!(
        detected as f64 >= 0.95 * bursts as f64,
        "detected {detected}/{bursts}"
    );
    assert!(p50 < 1_000_000, "median slice error {p50} ns");
    for s in &snap {
        assert!(
            s.est_slice_ns.abs_diff(10_000_000) < 1_000_000,
            "cpu {} estimates {} ns",
            s.cpu,
            s.est_slice_ns
        );
    }
    assert!(
        false_gaps * 20 <= bursts,
        "{false_gaps} false gaps for {bursts} bursts"
    );
}

#[test]
fn quiet_cpus_show_no_gaps_and_idle_demand_sleeps_longer() {
    if !require_root("quiet_cpus_show_no_gaps_and_idle_demand_sleeps_longer") {
        return;
    }
    let cfg = MonitorConfig::default();
    let n = cfg.cpus.len() as u64;
    let (active, _) = run_monitor(cfg.clone(), Demand::Active, || {
        std::thread::sleep(Duration::from_secs(1))
    });
    let (idle, _) = run_monitor(cfg, Demand::Idle, || {
        std::thread::sleep(Duration::from_secs(1))
    });
    let (ta, ti) = (*active.ticks.lock().unwrap(), *idle.ticks.lock().unwrap());
    let false_gaps = active.gaps.lock().unwrap().len();
    eprintln!("active: {ta} ticks, {false_gaps} gaps; idle: {ti} ticks ({n} CPUs)");
    // With nothing stealing, a SCHED_FIFO sleeper is late only by scheduler noise.
    assert!(false_gaps <= 3, "{false_gaps} gaps with no steal");
    // Active demand without deschedules probes every 2 ms after the first second; idle
    // sleeps 50 ms: at least 3× fewer wake-ups.
    assert!(ti * 3 <= ta, "idle {ti} ticks vs active {ta}");
    assert!(
        ti <= 30 * n,
        "idle demand woke {ti} times in 1 s on {n} CPUs"
    );
}

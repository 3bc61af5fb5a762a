//! How soon detectors find a task, side by side, and the request task under hard-IRQ
//! deschedules they are tried on: shared by `tests/detector.rs` (which asserts that the
//! task is found) and `benches/detection.rs` (which measures how soon, per criterion).
//! Not part of the testbed library, which does not link the detector.

use std::path::Path;
use std::time::{Duration, Instant};
use task_detector::{
    BlockTracking, ClassifierConfig, Detector, IoTracker, TrackerOptions, TrackerStorage,
};
use vmigrater_testbed::workload;

/// Fresh detectors, one per configuration, polled side by side every window for at most
/// `within` (both see the same task over the same time), each told the vCPUs' time out so
/// far as `out_ns` gives it (the daemon's monitor does that); returns, per configuration,
/// when `tid` was first found I/O-bound and its record then.
pub fn found_side_by_side(
    cfgs: &[ClassifierConfig],
    tid: u32,
    within: Duration,
    out_ns: impl Fn() -> Vec<(usize, u64)>,
) -> Vec<Option<(Duration, task_detector::IoTask)>> {
    let mut storages: Vec<TrackerStorage> = cfgs.iter().map(|_| TrackerStorage::new()).collect();
    let mut dets: Vec<_> = storages
        .iter_mut()
        .zip(cfgs)
        .map(|(storage, cfg)| {
            let tracker = IoTracker::open(&TrackerOptions::default(), storage).expect("load BPF");
            Detector::new(tracker, cfg.clone())
        })
        .collect();
    let window = Duration::from_nanos(cfgs.iter().map(|c| c.window_ns).min().unwrap_or(5_000_000));
    let mut found = vec![None; cfgs.len()];
    let t0 = Instant::now();
    while t0.elapsed() < within && found.iter().any(Option::is_none) {
        for (det, slot) in dets.iter_mut().zip(found.iter_mut()) {
            let out = det.poll(&out_ns()).expect("poll");
            if slot.is_none() {
                if let Some(t) = out.tasks.iter().find(|t| t.task.tid == tid) {
                    *slot = Some((t0.elapsed(), t.task.clone()));
                }
            }
        }
        std::thread::sleep(window);
    }
    found
}

/// A request/response task (one read, then 200 µs of CPU work; pinned to `pin` if given)
/// beside a CPU hog on each of the two vCPUs, both taken away by hard-IRQ deschedules on
/// `schedule` for `secs`.
pub struct RequestUnderSteal {
    plan: irq_steal::Plan,
    steal: irq_steal::IrqSteal,
    hogs: Vec<workload::Worker>,
    pub task: workload::Worker,
}

impl RequestUnderSteal {
    pub fn start(file: &Path, schedule: &str, secs: u64, pin: Option<usize>) -> Self {
        let plan = schedule
            .parse::<irq_steal::Schedule>()
            .expect("schedule")
            .plan(&[0, 1], Duration::from_secs(secs))
            .expect("plan");
        let steal = irq_steal::IrqSteal::start(&plan).expect("irq-steal");
        let hogs = (0..2)
            .map(|c| workload::spawn_hog(Some(c)).expect("hog"))
            .collect();
        let spec = workload::IoSpec {
            pin,
            request_work: workload::work_units_for(Duration::from_micros(200)),
            ..workload::IoSpec::new(workload::ReadPattern::Request)
        };
        let task = workload::spawn_io(file, spec).expect("request task");
        std::thread::sleep(Duration::from_millis(300));
        RequestUnderSteal {
            plan,
            steal,
            hogs,
            task,
        }
    }

    /// Each vCPU's planned time out so far: a window where the task's vCPU was out is not
    /// held against it as CPU time, and this stands in for what the daemon's monitor
    /// measures.
    pub fn out_ns(&self) -> Vec<(usize, u64)> {
        let t = os_layer::time::monotonic_ns().saturating_sub(self.steal.start_ns());
        (0..2)
            .map(|c| (c, self.plan.out_between(c, 0, t)))
            .collect()
    }

    /// Stops everything; returns the task's requests and the steal report.
    pub fn stop(self) -> (u64, irq_steal::StealReport) {
        let done = self.task.stop().expect("request task");
        for h in self.hogs {
            h.stop().expect("hog");
        }
        (done, self.steal.stop().expect("stop irq-steal"))
    }
}

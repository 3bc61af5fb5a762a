//! What a running daemon shows: the status report, the metrics at scrape time and the
//! per-vCPU figures for the host channel, built from the engine's snapshot, the vCPU
//! board and the placement. Reads only: it must never change daemon state, and never
//! hold the placement on the channel's path (the planner must not wait for it).

use arc_swap::ArcSwap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use task_detector::AttachMode;
use vcpu_monitor::{monotonic_ns, Demand, VcpuBoard};

use crate::channel::{ChannelStats, VcpuSample};
use crate::metrics::{self, Moves};
use crate::status::{
    self, AttachReport, DemandReport, GateReport, KeptStatus, PartnerStatus, SeenStatus,
    SourceReport, StatusReport, TaskStatus, VcpuStatus,
};
use migrater::affinity::TaskId;
use migrater::engine::{EngineSnapshot, MoveGate};
use migrater::hook::{lock_placement, try_lock_placement, FoundTask, Placement, Shared, TaskEntry};

/// Context of the daemon that the control plane and the channel read.
pub struct Running {
    pub shared: Arc<Shared>,
    pub board: Arc<VcpuBoard>,
    /// The migrations counted as the monitor threads make them (for /metrics).
    pub moves: Arc<Moves>,
    pub engine: Arc<ArcSwap<EngineSnapshot>>,
    /// `None` where the block programs did not load.
    pub attach_mode: Option<AttachMode>,
    pub monitor_source: vcpu_monitor::Source,
    pub dry_run: bool,
    pub started: Instant,
    pub channel: Arc<ChannelStats>,
}

impl From<Option<AttachMode>> for AttachReport {
    fn from(m: Option<AttachMode>) -> Self {
        match m {
            Some(AttachMode::TpBtf) => AttachReport::TpBtf,
            Some(AttachMode::RawTp) => AttachReport::RawTp,
            Some(AttachMode::Tracepoint) => AttachReport::Tracepoint,
            None => AttachReport::None,
        }
    }
}

impl From<vcpu_monitor::Source> for SourceReport {
    fn from(s: vcpu_monitor::Source) -> Self {
        match s {
            vcpu_monitor::Source::Kernel => SourceReport::Kernel,
            vcpu_monitor::Source::Sleepers => SourceReport::Sleepers,
            vcpu_monitor::Source::External => SourceReport::External,
        }
    }
}

impl From<MoveGate> for GateReport {
    fn from(g: MoveGate) -> Self {
        match g {
            MoveGate::Open => GateReport::Open,
            MoveGate::HostHolds => GateReport::HostHolds,
            MoveGate::FollowsHost => GateReport::FollowsHost,
            MoveGate::NotContended => GateReport::NotContended,
            MoveGate::GuardHolding { .. } => GateReport::GuardHolding,
            MoveGate::GuardProbing => GateReport::GuardProbing,
        }
    }
}

impl Running {
    /// Cumulative per-vCPU figures for the host channel.
    pub fn channel_sample(&self) -> Vec<VcpuSample> {
        self.channel_sample_with(|t| {
            os_layer::TaskStat::of_tid(t.tid)
                .filter(|s| s.start_time == t.start_time)
                .and_then(|s| s.last_cpu)
                .map(|c| c as usize)
        })
    }

    /// `channel_sample`, with `cpu_of` telling where a partner that nobody placed last ran.
    fn channel_sample_with(&self, cpu_of: impl Fn(&TaskId) -> Option<usize>) -> Vec<VcpuSample> {
        let now = monotonic_ns();
        let engine = self.engine.load();
        // Every I/O-bound task counts, also while moves are on hold: the host favours
        // the vCPUs that hold them, whoever placed them there.
        let tasks = &engine.found;
        // try_lock: the channel must never hold up the planner; a busy lock only means
        // this period's per-vCPU task counts use the tasks' last CPU instead.
        let placement = try_lock_placement(&self.shared.placement);
        // Where the task runs: where we pinned it, else where it last submitted. Not a dry
        // run's simulated placement: that daemon moves nothing, and told the host its
        // tasks sat on the vCPUs it would have chosen, so the agent took weight from the
        // vCPU they really ran on (a dry-run guest read 0.3x vanilla in the host loop,
        // benches/RESULTS.md "a dry run's reports").
        let on = |t: &FoundTask| {
            placement
                .as_ref()
                .filter(|_| !self.dry_run)
                .and_then(|p| p.placed_on(t.tid))
                .unwrap_or(t.last_cpu)
        };
        // A partner (a database's client) is on every request's path: a vCPU running one
        // must not pay for a favour to the I/O's vCPU (the agent taking time from the
        // client's vCPU read 0.58-0.87x vanilla with PostgreSQL in the host loop,
        // benches/RESULTS.md "the applications in the loop").
        let partner_cpus: Vec<usize> = engine
            .partners
            .iter()
            .filter_map(|p| {
                placement
                    .as_ref()
                    .filter(|_| !self.dry_run)
                    .and_then(|pl| pl.placed_on(p.tid))
                    .or_else(|| {
                        cpu_of(&TaskId {
                            tid: p.tid,
                            start_time: p.start_time,
                        })
                    })
            })
            .collect();
        self.board
            .snapshot(now)
            .iter()
            .map(|s| {
                let io = engine.cpu_io.iter().find(|c| c.cpu as usize == s.cpu);
                VcpuSample {
                    cpu: s.cpu as u32,
                    completions: io.map_or(0, |c| c.completions),
                    ema_interval_ns: io.map_or(0, |c| c.ema_interval_ns),
                    io_bound_tasks: tasks.iter().filter(|t| on(t) == s.cpu).count() as u32,
                    io_partner_tasks: partner_cpus.iter().filter(|&&c| c == s.cpu).count() as u32,
                    inactive_total_ns: s.inactive_total_ns,
                    est_slice_ns: s.est_slice_ns,
                }
            })
            .collect()
    }

    pub fn report(&self) -> StatusReport {
        let now = monotonic_ns();
        let engine = self.engine.load();
        let tasks = self.shared.tasks.load();
        let placement = lock_placement(&self.shared.placement);
        let placed: Vec<Option<usize>> = tasks.iter().map(|t| placement.placed_on(t.tid)).collect();
        let vcpus = self.vcpu_statuses(now, &engine, &placed);
        let executor = placement.executor.as_ref();
        StatusReport {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            dry_run: self.dry_run,
            attach_mode: self.attach_mode.into(),
            monitor_source: self.monitor_source.into(),
            moves_allowed: engine.moves_allowed,
            host_holds: engine.host_holds,
            block_tracking: engine.block_tracking,
            block_attached: engine.block_attached,
            guard_pays: engine.guard_verdicts.pays,
            guard_holds: engine.guard_verdicts.holds,
            guard_without_moves_s: engine.guard_without_moves_ms as f64 / 1e3,
            demand: match engine.demand {
                Demand::Idle => DemandReport::Idle,
                Demand::Active => DemandReport::Active,
            },
            io_tasks: tasks.len() as u64,
            io_bound_tasks: engine.io_bound_tasks as u64,
            releases: engine.releases,
            detector_errors: engine.detector_errors,
            early_samples: engine.early_samples,
            inherited_pins_undone: engine.inherited_pins_undone,
            managed_tasks: executor.map_or(0, |e| e.managed_count()) as u64,
            migrations: self.shared.migrations.load(Ordering::Relaxed),
            hands_off_tasks: placement.hands_off.len() as u64,
            journal_errors: executor.map_or(0, |e| e.journal_errors()),
            channel_connected: self.channel.connected.load(Ordering::Relaxed),
            channel_reports_sent: self.channel.reports_sent.load(Ordering::Relaxed),
            channel_reports_dropped: self.channel.reports_dropped.load(Ordering::Relaxed),
            channel_replies: self.channel.replies.load(Ordering::Relaxed),
            migration_latency_us: status::summarize(
                &placement.latencies.values(),
                placement.latencies.total,
            ),
            vcpus,
            tasks: task_statuses(&tasks, &placed),
            kept_with_completions: engine
                .kept_with_completions
                .iter()
                .map(|k| KeptStatus {
                    tid: k.tid,
                    cpu: k.cpu,
                })
                .collect(),
            move_gate: engine.gate.into(),
            guard_hold_remaining_s: match engine.gate {
                MoveGate::GuardHolding { for_s } => for_s,
                _ => 0.0,
            },
            out_together: engine.out_together,
            seen: seen_statuses(&engine),
            partners: partner_statuses(&engine),
            hands_off: hands_off_tids(&placement),
        }
    }

    /// Per vCPU: the board's figures, the block programs' and the tasks placed on it.
    fn vcpu_statuses(
        &self,
        now: u64,
        engine: &EngineSnapshot,
        placed: &[Option<usize>],
    ) -> Vec<VcpuStatus> {
        self.board
            .snapshot(now)
            .iter()
            .map(|s| {
                let io = engine.cpu_io.iter().find(|c| c.cpu as usize == s.cpu);
                VcpuStatus {
                    cpu: s.cpu,
                    active: s.active,
                    deschedules: s.deschedules,
                    inactive_total_ms: s.inactive_total_ns as f64 / 1e6,
                    covered_total_ms: s.covered_total_ns as f64 / 1e6,
                    last_inactive_ms: s.last_inactive_ns as f64 / 1e6,
                    est_slice_ms: s.est_slice_ns as f64 / 1e6,
                    remaining_ms: s.remaining_ns as f64 / 1e6,
                    gap_threshold_us: s.gap_threshold_ns as f64 / 1e3,
                    io_completions: io.map_or(0, |c| c.completions),
                    io_interval_ema_us: io.map_or(0.0, |c| c.ema_interval_ns as f64 / 1e3),
                    tasks_placed: placed.iter().filter(|p| **p == Some(s.cpu)).count(),
                }
            })
            .collect()
    }

    /// The metrics as of now, in OpenMetrics text: the status report's figures.
    pub fn encode_metrics(&self) -> String {
        metrics::encode(&self.report(), &self.moves)
    }
}

/// The I/O-bound tasks, each with the vCPU it is placed on (`placed`, in the same order).
fn task_statuses(tasks: &[TaskEntry], placed: &[Option<usize>]) -> Vec<TaskStatus> {
    tasks
        .iter()
        .zip(placed)
        .map(|(t, p)| TaskStatus {
            tid: t.tid,
            tgid: t.tgid,
            comm: t.comm.clone(),
            load: t.load,
            priority: t.priority,
            placed_on: *p,
            allowed: t.allowed.clone(),
        })
        .collect()
}

/// What the detector's last window found I/O-bound, excluded tasks included.
fn seen_statuses(engine: &EngineSnapshot) -> Vec<SeenStatus> {
    engine
        .seen
        .iter()
        .map(|t| SeenStatus {
            tid: t.info.task.tid,
            tgid: t.info.task.tgid,
            comm: t.info.comm.clone(),
            io_fraction: t.info.task.io_fraction,
            cpu_fraction: t.info.task.cpu_fraction,
            iops: t.info.task.iops,
            load: t.info.task.load,
            last_cpu: t.info.task.last_cpu,
            completion_cpu: (t.info.task.completion.count > 0)
                .then_some(t.info.task.completion.cpu as usize),
            excluded: t.excluded,
        })
        .collect()
}

/// The threads the I/O-bound tasks wake and are woken by.
fn partner_statuses(engine: &EngineSnapshot) -> Vec<PartnerStatus> {
    engine
        .partners
        .iter()
        .map(|p| PartnerStatus {
            tid: p.tid,
            tgid: p.tgid,
            comm: p.comm.clone(),
            of: p.of,
        })
        .collect()
}

/// The tids of the tasks whose mask someone else changed, sorted.
fn hands_off_tids(placement: &Placement) -> Vec<u32> {
    let mut h: Vec<u32> = placement.hands_off.iter().map(|t| t.tid).collect();
    h.sort_unstable();
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use migrater::hook::{LatencyRing, Placement};
    use std::collections::{HashMap, HashSet};
    use std::sync::Mutex;

    /// A daemon whose engine found one I/O-bound task, tid 7, that last submitted on
    /// vCPU 0, and whose placement holds `simulated` (what a dry run would have done).
    fn running(dry_run: bool, simulated: &[(u32, usize)]) -> Running {
        let shared = Arc::new(Shared {
            tasks: ArcSwap::from_pointee(Vec::new()),
            placement: Mutex::new(Placement {
                executor: None,
                simulated: simulated.iter().copied().collect::<HashMap<_, _>>(),
                latencies: LatencyRing::new(4),
                hands_off: HashSet::new(),
            }),
            moves: Arc::new(Moves::default()),
            migrations: Default::default(),
        });
        let engine = EngineSnapshot {
            found: vec![FoundTask {
                tid: 7,
                tgid: 7,
                start_time: 1,
                last_cpu: 0,
            }],
            partners: vec![task_detector::Partner {
                of: 7,
                tid: 8,
                tgid: 8,
                comm: "client".into(),
                start_time: 2,
                wakes: 100,
            }],
            ..EngineSnapshot::default()
        };
        Running {
            shared,
            board: Arc::new(VcpuBoard::new(&[0, 1], &Default::default())),
            moves: Arc::new(Moves::default()),
            engine: Arc::new(ArcSwap::from_pointee(engine)),
            attach_mode: None,
            monitor_source: vcpu_monitor::Source::Sleepers,
            dry_run,
            started: Instant::now(),
            channel: Arc::new(ChannelStats::default()),
        }
    }

    fn tasks_per_vcpu(r: &Running) -> Vec<u32> {
        r.channel_sample()
            .iter()
            .map(|s| s.io_bound_tasks)
            .collect()
    }

    #[test]
    fn the_report_names_the_mode_and_source_as_their_crates_do() {
        for m in AttachMode::ALL {
            assert_eq!(status::name_of(&AttachReport::from(Some(m))), m.to_string());
        }
        assert_eq!(status::name_of(&AttachReport::from(None)), "none");
        use vcpu_monitor::Source;
        for s in [Source::Kernel, Source::Sleepers, Source::External] {
            assert_eq!(status::name_of(&SourceReport::from(s)), s.as_str());
        }
    }

    #[test]
    fn the_host_hears_where_tasks_run_not_where_a_dry_run_would_put_them() {
        // A dry run "placed" the task on vCPU 1 and moved nothing: it still runs on 0.
        assert_eq!(tasks_per_vcpu(&running(true, &[(7, 1)])), vec![1, 0]);
        assert_eq!(tasks_per_vcpu(&running(true, &[])), vec![1, 0]);
    }

    #[test]
    fn the_host_hears_where_the_partners_of_io_tasks_run() {
        let partners = |r: &Running, cpu_of: &dyn Fn(&TaskId) -> Option<usize>| {
            r.channel_sample_with(cpu_of)
                .iter()
                .map(|s| s.io_partner_tasks)
                .collect::<Vec<_>>()
        };
        // The client of task 7 runs on vCPU 1; a dry run's simulated pin of it is not
        // where it runs, a real pin is.
        let on_1 = |_: &TaskId| Some(1);
        assert_eq!(partners(&running(true, &[]), &on_1), vec![0, 1]);
        assert_eq!(partners(&running(true, &[(8, 0)]), &on_1), vec![0, 1]);
        assert_eq!(partners(&running(false, &[(8, 0)]), &on_1), vec![1, 0]);
        // Gone (or its tid reused): nowhere.
        assert_eq!(partners(&running(false, &[]), &|_| None), vec![0, 0]);
        // The I/O-bound task itself is counted apart.
        assert_eq!(tasks_per_vcpu(&running(false, &[])), vec![1, 0]);
    }
}

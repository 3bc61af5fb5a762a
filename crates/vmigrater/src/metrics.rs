//! Prometheus metrics of the guest daemon (OpenMetrics text on `/metrics`). Owns the
//! registry and the handles the hot path increments (`MoveLog`); the engine's figures and
//! the per-vCPU ones are copied from the engine's snapshot and the lock-free vCPU board
//! when a scrape arrives, so neither the monitor threads nor the detector loop wait on it.
//! Must never carry pid or comm labels: their cardinality is unbounded.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

use migrater::affinity::Outcome;
use migrater::engine::EngineSnapshot;
use migrater::hook::MoveLog;
use migrater::planner::Reason;
use std::sync::atomic::Ordering;
use task_detector::AttachMode;
use vcpu_monitor::VcpuSnapshot;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CpuLabel {
    pub cpu: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MigrationLabel {
    pub reason: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabel {
    pays: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabel {
    version: &'static str,
    dry_run: &'static str,
}

type FloatCounter = Counter<f64, AtomicU64>;
type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    pub deschedules: Family<CpuLabel, Counter>,
    pub inactive_seconds: Family<CpuLabel, FloatCounter>,
    pub covered_seconds: Family<CpuLabel, FloatCounter>,
    pub slice_estimate_seconds: Family<CpuLabel, FloatGauge>,
    pub remaining_slice_seconds: Family<CpuLabel, FloatGauge>,
    pub vcpu_active: Family<CpuLabel, Gauge>,
    pub io_completions: Family<CpuLabel, Counter>,
    pub io_interval_ema_seconds: Family<CpuLabel, FloatGauge>,
    pub io_bound_tasks: Gauge,
    pub managed_tasks: Gauge,
    pub migrations: Family<MigrationLabel, Counter>,
    pub migration_latency: Histogram,
    pub releases: Counter,
    pub detector_errors: Counter,
    pub early_samples: Counter,
    pub inherited_pins_undone: Counter,
    /// Mirrors the executor's count of failed journal writes.
    pub journal_errors: Counter,
    monitor_source: Family<SourceLabel, Gauge>,
    /// 1 while the move guard lets tasks move (or it is off), 0 while moves are on hold.
    pub moves_allowed: Gauge,
    pub host_holds: Gauge,
    guard_verdicts: Family<VerdictLabel, Counter>,
    /// 1 while the block programs track requests, 0 between samples.
    pub block_tracking: Gauge,
    pub block_attached: Gauge,
}

impl Metrics {
    /// `attach_mode` is `None` where the block programs did not load.
    pub fn new(attach_mode: Option<AttachMode>, dry_run: bool) -> Metrics {
        let mut m = Metrics {
            deschedules: Family::default(),
            inactive_seconds: Family::default(),
            covered_seconds: Family::default(),
            slice_estimate_seconds: Family::default(),
            remaining_slice_seconds: Family::default(),
            vcpu_active: Family::default(),
            io_completions: Family::default(),
            io_interval_ema_seconds: Family::default(),
            io_bound_tasks: Gauge::default(),
            managed_tasks: Gauge::default(),
            migrations: Family::default(),
            // 1 µs .. ~65 ms: sched_setaffinity is µs; the paper's migrations averaged 1.63 ms.
            migration_latency: Histogram::new(exponential_buckets(1e-6, 2.0, 17)),
            releases: Counter::default(),
            detector_errors: Counter::default(),
            early_samples: Counter::default(),
            inherited_pins_undone: Counter::default(),
            journal_errors: Counter::default(),
            monitor_source: Family::default(),
            moves_allowed: Gauge::default(),
            host_holds: Gauge::default(),
            block_tracking: Gauge::default(),
            block_attached: Gauge::default(),
            guard_verdicts: Family::default(),
            registry: Registry::with_prefix("vmigrater"),
        };
        let mut registry = Registry::with_prefix("vmigrater");
        m.register_vcpu_figures(&mut registry);
        let r = &mut registry;
        r.register(
            "io_bound_tasks",
            "Threads currently classified I/O-bound",
            m.io_bound_tasks.clone(),
        );
        r.register(
            "managed_tasks",
            "Threads whose affinity the daemon currently manages (original mask journaled)",
            m.managed_tasks.clone(),
        );
        r.register(
            "migrations",
            "Migration attempts by reason (push, pull, balance, held, completion) and result",
            m.migrations.clone(),
        );
        r.register_with_unit(
            "migration_latency",
            "Time of one sched_setaffinity call that moved a task",
            Unit::Seconds,
            m.migration_latency.clone(),
        );
        r.register(
            "releases",
            "Tasks handed back with their original mask (no longer I/O-bound, or exit)",
            m.releases.clone(),
        );
        r.register(
            "detector_errors",
            "Failed polls of the BPF maps",
            m.detector_errors.clone(),
        );
        r.register(
            "early_samples",
            "Block-tracking samples started before their period: a thread quiet for seconds issued block I/O, or the last sample placed a task",
            m.early_samples.clone(),
        );
        r.register(
            "inherited_pins_undone",
            "Threads and processes started by a task the daemon pinned, born with its pin and set back to that task's own mask",
            m.inherited_pins_undone.clone(),
        );
        r.register(
            "journal_errors",
            "Failed writes of the affinity journal (state directory full or read-only): no task is taken over while they fail",
            m.journal_errors.clone(),
        );
        let mode: Family<ModeLabel, Gauge> = Family::default();
        mode.get_or_create(&ModeLabel {
            mode: attach_mode.map_or_else(|| "none".to_string(), |m| m.to_string()),
        })
        .set(1);
        r.register(
            "bpf_attach_mode",
            "The attach mode of the block I/O programs (value is always 1)",
            mode,
        );
        r.register(
            "vcpu_monitor_source",
            "Where vCPU deschedules are learnt from: kernel (late kernel timers, BPF) or sleepers (value is always 1)",
            m.monitor_source.clone(),
        );
        m.register_engine_figures(r);
        // A gauge of 1, not an OpenMetrics info: the classic text format (promtool, older
        // scrapers) has no info type, and the convention (`prometheus_build_info`) is this.
        let build: Family<BuildLabel, Gauge> = Family::default();
        build
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION"),
                dry_run: if dry_run { "true" } else { "false" },
            })
            .set(1);
        r.register("build_info", "Build information (value is always 1)", build);
        m.registry = registry;
        m
    }

    /// The engine's figures, as they stand before its first step.
    fn register_engine_figures(&self, r: &mut Registry) {
        self.moves_allowed.set(1);
        r.register(
            "moves_allowed",
            "1 while tasks may be moved, 0 while the move guard holds them on their own masks",
            self.moves_allowed.clone(),
        );
        r.register(
            "host_holds",
            "1 while the host agent favours vCPUs for our I/O: I/O-bound tasks are anchored there and nothing else moves",
            self.host_holds.clone(),
        );
        self.block_tracking.set(1);
        r.register(
            "block_tracking",
            "1 while the block I/O programs track requests, 0 between samples (advanced.detector.sample_ms of every sample_every_ms)",
            self.block_tracking.clone(),
        );
        self.block_attached.set(1);
        r.register(
            "block_programs_attached",
            "1 while the block I/O programs sit on their tracepoints (tracking or paused), 0 once detached after a long time with nothing to gain or while the move guard holds",
            self.block_attached.clone(),
        );
        for pays in ["true", "false"] {
            let _ = self.guard_verdicts.get_or_create(&VerdictLabel { pays });
        }
        r.register(
            "guard_verdicts",
            "Move-guard probes concluded, by whether moves raised the block I/O rate",
            self.guard_verdicts.clone(),
        );
    }

    /// The per-vCPU figures: the board's and the block programs' counts.
    fn register_vcpu_figures(&self, r: &mut Registry) {
        r.register(
            "vcpu_deschedules",
            "Times a vCPU was seen descheduled (a kernel timer or a sleeper fired later than the gap threshold)",
            self.deschedules.clone(),
        );
        r.register_with_unit(
            "vcpu_inactive",
            "Total time a vCPU was seen descheduled",
            Unit::Seconds,
            self.inactive_seconds.clone(),
        );
        r.register_with_unit(
            "vcpu_inactive_covered",
            "Part of a vCPU's descheduled time during which another vCPU was seen running: what moves could gain (kernel source only)",
            Unit::Seconds,
            self.covered_seconds.clone(),
        );
        r.register_with_unit(
            "vcpu_slice_estimate",
            "Estimated length of the vCPU's current time slice",
            Unit::Seconds,
            self.slice_estimate_seconds.clone(),
        );
        r.register_with_unit(
            "vcpu_remaining_slice",
            "Estimated time left in the vCPU's current slice at scrape time",
            Unit::Seconds,
            self.remaining_slice_seconds.clone(),
        );
        r.register(
            "vcpu_active",
            "1 when the vCPU's sleeper ran recently (the vCPU is running), else 0",
            self.vcpu_active.clone(),
        );
        r.register(
            "io_completions",
            "Block I/O completions handled on the vCPU (ISACS E_n)",
            self.io_completions.clone(),
        );
        r.register_with_unit(
            "io_completion_interval_ema",
            "EMA (0.9) of intervals between block I/O completions on the vCPU (ISACS Eq. 1)",
            Unit::Seconds,
            self.io_interval_ema_seconds.clone(),
        );
    }

    /// Copies the engine's figures, the vCPU board's and the executor's at scrape time.
    pub fn refresh(&self, engine: &EngineSnapshot, vcpus: &[VcpuSnapshot], managed: usize) {
        self.moves_allowed.set(i64::from(engine.moves_allowed));
        self.host_holds.set(i64::from(engine.host_holds));
        self.block_tracking.set(i64::from(engine.block_tracking));
        self.block_attached.set(i64::from(engine.block_attached));
        self.io_bound_tasks.set(engine.io_bound_tasks as i64);
        self.managed_tasks.set(managed as i64);
        let store = |c: &Counter, v: u64| c.inner().store(v, Ordering::Relaxed);
        store(&self.releases, engine.releases);
        store(&self.detector_errors, engine.detector_errors);
        store(&self.early_samples, engine.early_samples);
        store(&self.inherited_pins_undone, engine.inherited_pins_undone);
        let verdicts = engine.guard_verdicts;
        for (pays, n) in [("true", verdicts.pays), ("false", verdicts.holds)] {
            store(
                &self.guard_verdicts.get_or_create(&VerdictLabel { pays }),
                n,
            );
        }
        for s in vcpus {
            let l = CpuLabel { cpu: s.cpu as u32 };
            store(&self.deschedules.get_or_create(&l), s.deschedules);
            let seconds = |ns: u64| (ns as f64 / 1e9).to_bits();
            self.inactive_seconds
                .get_or_create(&l)
                .inner()
                .store(seconds(s.inactive_total_ns), Ordering::Relaxed);
            self.covered_seconds
                .get_or_create(&l)
                .inner()
                .store(seconds(s.covered_total_ns), Ordering::Relaxed);
            self.slice_estimate_seconds
                .get_or_create(&l)
                .set(s.est_slice_ns as f64 / 1e9);
            self.remaining_slice_seconds
                .get_or_create(&l)
                .set(s.remaining_ns as f64 / 1e9);
            self.vcpu_active.get_or_create(&l).set(i64::from(s.active));
        }
        for c in &engine.cpu_io {
            let l = CpuLabel { cpu: c.cpu };
            store(&self.io_completions.get_or_create(&l), c.completions);
            self.io_interval_ema_seconds
                .get_or_create(&l)
                .set(c.ema_interval_ns as f64 / 1e9);
        }
    }

    pub fn set_monitor_source(&self, source: vcpu_monitor::Source) {
        self.monitor_source.clear();
        self.monitor_source
            .get_or_create(&SourceLabel {
                source: source.as_str(),
            })
            .set(1);
    }

    pub fn record_migration(&self, reason: Reason, outcome: &Outcome) {
        self.migrations
            .get_or_create(&MigrationLabel {
                reason: reason.as_str(),
                result: outcome.as_str(),
            })
            .inc();
        if let Outcome::Moved { latency_ns } = outcome {
            self.migration_latency.observe(*latency_ns as f64 * 1e-9);
        }
    }

    pub fn record_dry_run(&self, reason: Reason) {
        self.migrations
            .get_or_create(&MigrationLabel {
                reason: reason.as_str(),
                result: "dry_run",
            })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

impl MoveLog for Metrics {
    fn attempted(&self, reason: Reason, outcome: &Outcome) {
        self.record_migration(reason, outcome);
    }
    fn dry_run(&self, reason: Reason) {
        self.record_dry_run(reason);
    }
}

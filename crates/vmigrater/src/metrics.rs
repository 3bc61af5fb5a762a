//! Prometheus metrics of the guest daemon (OpenMetrics text on `/metrics`), rendered at
//! scrape time from the status report (`view::Running::report`), as the host agent renders
//! its own: a fresh registry per scrape, so that nothing is copied into long-lived handles
//! and `status` and `/metrics` cannot disagree. The one live part is what the monitor
//! threads count as they move tasks (`Moves`, the hook's `MoveLog`), registered into each
//! scrape's registry. Must never carry pid or comm labels: their cardinality is unbounded.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

use crate::status::StatusReport;
use migrater::affinity::Outcome;
use migrater::hook::MoveLog;
use migrater::planner::Reason;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CpuLabel {
    cpu: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigrationLabel {
    reason: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: &'static str,
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
    version: String,
    dry_run: &'static str,
}

type FloatCounter = Counter<f64, AtomicU64>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The migrations the monitor threads make, counted as they make them.
pub struct Moves {
    migrations: Family<MigrationLabel, Counter>,
    latency: Histogram,
}

impl Default for Moves {
    fn default() -> Self {
        Moves {
            migrations: Family::default(),
            // 1 µs .. ~65 ms: sched_setaffinity is µs; the paper's migrations averaged 1.63 ms.
            latency: Histogram::new(exponential_buckets(1e-6, 2.0, 17)),
        }
    }
}

impl MoveLog for Moves {
    fn attempted(&self, reason: Reason, outcome: &Outcome) {
        self.migrations
            .get_or_create(&MigrationLabel {
                reason: reason.as_str(),
                result: outcome.as_str(),
            })
            .inc();
        if let Outcome::Moved { latency_ns } = outcome {
            self.latency.observe(*latency_ns as f64 * 1e-9);
        }
    }
    fn dry_run(&self, reason: Reason) {
        self.migrations
            .get_or_create(&MigrationLabel {
                reason: reason.as_str(),
                result: "dry_run",
            })
            .inc();
    }
}

/// A counter that reads `v`: a fresh one per scrape.
fn counter(v: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(v);
    c
}

fn gauge(v: i64) -> Gauge {
    let g = Gauge::default();
    g.set(v);
    g
}

/// The metrics of `r`, with the moves counted so far, in OpenMetrics text.
pub fn encode(r: &StatusReport, moves: &Moves) -> String {
    let mut reg = Registry::with_prefix("vmigrater");
    register_vcpus(&mut reg, r);
    register_tasks(&mut reg, r, moves);
    register_counts(&mut reg, r);
    register_modes(&mut reg, r);
    let verdicts: Family<VerdictLabel, Counter> = Family::default();
    for (pays, n) in [("true", r.guard_pays), ("false", r.guard_holds)] {
        verdicts.get_or_create(&VerdictLabel { pays }).inc_by(n);
    }
    reg.register(
        "guard_verdicts",
        "Move-guard probes concluded, by whether moves raised the block I/O rate",
        verdicts,
    );
    let without: FloatCounter = FloatCounter::default();
    without.inc_by(r.guard_without_moves_s);
    reg.register_with_unit(
        "guard_probe_without_moves",
        "Time the move guard's probes ran without moves (what probing costs where moves pay)",
        Unit::Seconds,
        without,
    );
    // A gauge of 1, not an OpenMetrics info: the classic text format (promtool, older
    // scrapers) has no info type, and the convention (`prometheus_build_info`) is this.
    let build: Family<BuildLabel, Gauge> = Family::default();
    build
        .get_or_create(&BuildLabel {
            version: r.version.clone(),
            dry_run: if r.dry_run { "true" } else { "false" },
        })
        .set(1);
    reg.register("build_info", "Build information (value is always 1)", build);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg)
        .expect("writing to a String cannot fail");
    out
}

/// The tasks found, managed and moved, and those handed back.
fn register_tasks(reg: &mut Registry, r: &StatusReport, moves: &Moves) {
    reg.register(
        "io_bound_tasks",
        "Threads currently classified I/O-bound",
        gauge(r.io_bound_tasks as i64),
    );
    reg.register(
        "managed_tasks",
        "Threads whose affinity the daemon currently manages (original mask journaled)",
        gauge(r.managed_tasks as i64),
    );
    reg.register(
        "migrations",
        "Migration attempts by reason (push, pull, balance, held, completion) and result",
        moves.migrations.clone(),
    );
    reg.register_with_unit(
        "migration_latency",
        "Time of one sched_setaffinity call that moved a task",
        Unit::Seconds,
        moves.latency.clone(),
    );
    reg.register(
        "releases",
        "Tasks handed back with their original mask (no longer I/O-bound, or exit)",
        counter(r.releases),
    );
}

/// Failed polls and journal writes, early samples and inherited pins undone.
fn register_counts(reg: &mut Registry, r: &StatusReport) {
    reg.register(
        "detector_errors",
        "Failed polls of the BPF maps",
        counter(r.detector_errors),
    );
    reg.register(
        "early_samples",
        "Block-tracking samples started before their period: a thread quiet for seconds issued block I/O, or the last sample placed a task",
        counter(r.early_samples),
    );
    reg.register(
        "inherited_pins_undone",
        "Threads and processes started by a task the daemon pinned, born with its pin and set back to that task's own mask",
        counter(r.inherited_pins_undone),
    );
    reg.register(
        "journal_errors",
        "Failed writes of the affinity journal (state directory full or read-only): no task is taken over while they fail",
        counter(r.journal_errors),
    );
}

/// How the daemon observes (attach mode, vCPU monitor source), and whether moves and
/// block tracking are on.
fn register_modes(reg: &mut Registry, r: &StatusReport) {
    let mode: Family<ModeLabel, Gauge> = Family::default();
    mode.get_or_create(&ModeLabel {
        mode: r.attach_mode.as_str(),
    })
    .set(1);
    reg.register(
        "bpf_attach_mode",
        "The attach mode of the block I/O programs (value is always 1)",
        mode,
    );
    let source: Family<SourceLabel, Gauge> = Family::default();
    source
        .get_or_create(&SourceLabel {
            source: r.monitor_source.as_str(),
        })
        .set(1);
    reg.register(
        "vcpu_monitor_source",
        "Where vCPU deschedules are learnt from: kernel (late kernel timers, BPF) or sleepers (value is always 1)",
        source,
    );
    for (name, help, on) in [
        (
            "moves_allowed",
            "1 while tasks may be moved, 0 while the move guard holds them on their own masks",
            r.moves_allowed,
        ),
        (
            "host_holds",
            "1 while the host agent favours vCPUs for our I/O: I/O-bound tasks are anchored there and nothing else moves",
            r.host_holds,
        ),
        (
            "block_tracking",
            "1 while the block I/O programs track requests, 0 between samples (advanced.detector.sample_ms of every sample_every_ms)",
            r.block_tracking,
        ),
        (
            "block_programs_attached",
            "1 while the block I/O programs sit on their tracepoints (tracking or paused), 0 once detached after a long time with nothing to gain or while the move guard holds",
            r.block_attached,
        ),
    ] {
        reg.register(name, help, gauge(i64::from(on)));
    }
}

/// The per-vCPU figures: the board's and the block programs' counts.
fn register_vcpus(reg: &mut Registry, r: &StatusReport) {
    let deschedules: Family<CpuLabel, Counter> = Family::default();
    let inactive: Family<CpuLabel, FloatCounter> = Family::default();
    let covered: Family<CpuLabel, FloatCounter> = Family::default();
    let slice: Family<CpuLabel, FloatGauge> = Family::default();
    let remaining: Family<CpuLabel, FloatGauge> = Family::default();
    let active: Family<CpuLabel, Gauge> = Family::default();
    let completions: Family<CpuLabel, Counter> = Family::default();
    let ema: Family<CpuLabel, FloatGauge> = Family::default();
    for v in &r.vcpus {
        let l = CpuLabel { cpu: v.cpu as u32 };
        deschedules.get_or_create(&l).inc_by(v.deschedules);
        inactive.get_or_create(&l).inc_by(v.inactive_total_ms / 1e3);
        covered.get_or_create(&l).inc_by(v.covered_total_ms / 1e3);
        slice.get_or_create(&l).set(v.est_slice_ms / 1e3);
        remaining.get_or_create(&l).set(v.remaining_ms / 1e3);
        active.get_or_create(&l).set(i64::from(v.active));
        completions.get_or_create(&l).inc_by(v.io_completions);
        ema.get_or_create(&l).set(v.io_interval_ema_us / 1e6);
    }
    reg.register(
        "vcpu_deschedules",
        "Times a vCPU was seen descheduled (a kernel timer or a sleeper fired later than the gap threshold)",
        deschedules,
    );
    reg.register_with_unit(
        "vcpu_inactive",
        "Total time a vCPU was seen descheduled",
        Unit::Seconds,
        inactive,
    );
    reg.register_with_unit(
        "vcpu_inactive_covered",
        "Part of a vCPU's descheduled time during which another vCPU was seen running: what moves could gain (kernel source only)",
        Unit::Seconds,
        covered,
    );
    reg.register_with_unit(
        "vcpu_slice_estimate",
        "Estimated length of the vCPU's current time slice",
        Unit::Seconds,
        slice,
    );
    reg.register_with_unit(
        "vcpu_remaining_slice",
        "Estimated time left in the vCPU's current slice at scrape time",
        Unit::Seconds,
        remaining,
    );
    reg.register(
        "vcpu_active",
        "1 when the vCPU's sleeper ran recently (the vCPU is running), else 0",
        active,
    );
    reg.register(
        "io_completions",
        "Block I/O completions handled on the vCPU (ISACS E_n)",
        completions,
    );
    reg.register_with_unit(
        "io_completion_interval_ema",
        "EMA (0.9) of intervals between block I/O completions on the vCPU (ISACS Eq. 1)",
        Unit::Seconds,
        ema,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{AttachReport, SourceReport, VcpuStatus};

    #[test]
    fn the_report_and_the_moves_are_what_a_scrape_shows() {
        let r = StatusReport {
            version: "9.9.9".into(),
            attach_mode: AttachReport::RawTp,
            monitor_source: SourceReport::Kernel,
            moves_allowed: true,
            block_attached: true,
            io_bound_tasks: 3,
            managed_tasks: 2,
            releases: 5,
            detector_errors: 1,
            guard_pays: 4,
            guard_holds: 6,
            guard_without_moves_s: 3.0,
            vcpus: vec![VcpuStatus {
                cpu: 1,
                active: true,
                deschedules: 7,
                inactive_total_ms: 1500.0,
                est_slice_ms: 11.0,
                io_completions: 42,
                ..Default::default()
            }],
            ..Default::default()
        };
        let moves = Moves::default();
        moves.attempted(Reason::Completion, &Outcome::Moved { latency_ns: 3_000 });
        moves.dry_run(Reason::Push);
        let text = encode(&r, &moves);
        for line in [
            "vmigrater_io_bound_tasks 3",
            "vmigrater_managed_tasks 2",
            "vmigrater_releases_total 5",
            "vmigrater_detector_errors_total 1",
            "vmigrater_journal_errors_total 0",
            "vmigrater_moves_allowed 1",
            "vmigrater_block_tracking 0",
            "vmigrater_block_programs_attached 1",
            "vmigrater_guard_verdicts_total{pays=\"true\"} 4",
            "vmigrater_guard_verdicts_total{pays=\"false\"} 6",
            "vmigrater_guard_probe_without_moves_seconds_total 3.0",
            "vmigrater_bpf_attach_mode{mode=\"raw_tp\"} 1",
            "vmigrater_vcpu_monitor_source{source=\"kernel\"} 1",
            "vmigrater_build_info{version=\"9.9.9\",dry_run=\"false\"} 1",
            "vmigrater_vcpu_deschedules_total{cpu=\"1\"} 7",
            "vmigrater_vcpu_inactive_seconds_total{cpu=\"1\"} 1.5",
            "vmigrater_vcpu_slice_estimate_seconds{cpu=\"1\"} 0.011",
            "vmigrater_vcpu_active{cpu=\"1\"} 1",
            "vmigrater_io_completions_total{cpu=\"1\"} 42",
            "vmigrater_migrations_total{reason=\"completion\",result=\"moved\"} 1",
            "vmigrater_migrations_total{reason=\"push\",result=\"dry_run\"} 1",
            "vmigrater_migration_latency_seconds_count 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        // Rendered afresh: a vCPU gone from the report is gone from the scrape.
        let text = encode(&StatusReport::default(), &moves);
        assert!(!text.contains("cpu=\"1\""), "{text}");
        assert!(text.contains("vmigrater_migrations_total{"), "{text}");
    }
}

//! The status socket: a running daemon answers each connection on
//! `<state_dir>/status.sock` with one JSON `StatusReport`; `vmigrater status` reads it and
//! prints a table (or the JSON). Owns the report's shape and its rendering; it must never
//! change daemon state.

use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("status.sock")
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VcpuStatus {
    pub cpu: usize,
    pub active: bool,
    pub deschedules: u64,
    pub inactive_total_ms: f64,
    /// Of `inactive_total_ms`, the time another vCPU was seen running (kernel source).
    #[serde(default)]
    pub covered_total_ms: f64,
    pub last_inactive_ms: f64,
    pub est_slice_ms: f64,
    pub remaining_ms: f64,
    pub gap_threshold_us: f64,
    pub io_completions: u64,
    pub io_interval_ema_us: f64,
    pub tasks_placed: usize,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TaskStatus {
    pub tid: u32,
    pub tgid: u32,
    pub comm: String,
    pub load: f64,
    pub priority: i32,
    pub placed_on: Option<usize>,
    pub allowed: Vec<usize>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// How the block programs are attached; `none` where they did not load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachReport {
    TpBtf,
    RawTp,
    Tracepoint,
    #[default]
    None,
}

impl AttachReport {
    /// The metric label: the name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            AttachReport::TpBtf => "tp_btf",
            AttachReport::RawTp => "raw_tp",
            AttachReport::Tracepoint => "tracepoint",
            AttachReport::None => "none",
        }
    }
}

/// Where vCPU deschedules are learnt from (`external`: a source another build links in,
/// the nested-VM lab's oracle); `unknown` from a daemon too old to say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceReport {
    Kernel,
    Sleepers,
    External,
    #[default]
    Unknown,
}

impl SourceReport {
    /// The metric label: the name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceReport::Kernel => "kernel",
            SourceReport::Sleepers => "sleepers",
            SourceReport::External => "external",
            SourceReport::Unknown => "unknown",
        }
    }
}

/// Whether the monitor tracks slices precisely (`active`: tasks to move) or idles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DemandReport {
    #[default]
    Idle,
    Active,
}

/// The name a report's mode has in the JSON, for the table.
pub(crate) fn name_of<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|j| j.as_str().map(str::to_string))
        .unwrap_or_default()
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StatusReport {
    pub version: String,
    pub pid: u32,
    pub uptime_s: f64,
    pub dry_run: bool,
    pub attach_mode: AttachReport,
    #[serde(default)]
    pub monitor_source: SourceReport,
    pub demand: DemandReport,
    /// False while the move guard holds tasks on their own masks.
    #[serde(default)]
    pub moves_allowed: bool,
    /// True while the host agent favours the vCPUs holding I/O-bound tasks (`held` in
    /// its replies): the daemon then leaves the tasks where they are.
    #[serde(default)]
    pub host_holds: bool,
    /// Whether the block programs track requests now (false between samples).
    pub block_tracking: bool,
    /// Whether the block programs are on their tracepoints (false once detached after a
    /// long time with nothing to gain, or while the move guard holds).
    #[serde(default = "yes")]
    pub block_attached: bool,
    /// Probes of the move guard that found moves paying / not paying.
    #[serde(default)]
    pub guard_pays: u64,
    #[serde(default)]
    pub guard_holds: u64,
    /// Seconds the move guard's probes ran without moves (their price where moves pay).
    #[serde(default)]
    pub guard_without_moves_s: f64,
    /// I/O-bound tasks the planner may move (those kept with their completions are in
    /// `kept_with_completions`).
    pub io_tasks: u64,
    /// Threads classified I/O-bound: the managed ones, or while moves are on hold the ones
    /// found (`vmigrater_io_bound_tasks`).
    #[serde(default)]
    pub io_bound_tasks: u64,
    pub managed_tasks: u64,
    /// Tasks handed back with their own mask since start.
    #[serde(default)]
    pub releases: u64,
    /// Failed polls of the block programs' maps.
    #[serde(default)]
    pub detector_errors: u64,
    /// Block-tracking samples started before their period.
    #[serde(default)]
    pub early_samples: u64,
    /// Children born with a managed task's pin and given their parent's own mask.
    #[serde(default)]
    pub inherited_pins_undone: u64,
    pub migrations: u64,
    pub hands_off_tasks: u64,
    /// Journal writes that failed (a full or read-only state directory): while they fail,
    /// no task is taken over.
    #[serde(default)]
    pub journal_errors: u64,
    pub channel_connected: bool,
    pub channel_reports_sent: u64,
    pub channel_reports_dropped: u64,
    pub channel_replies: u64,
    /// Microseconds per sched_setaffinity that moved a task (recent window).
    pub migration_latency_us: LatencySummary,
    pub vcpus: Vec<VcpuStatus>,
    pub tasks: Vec<TaskStatus>,
    /// Tasks pinned to the vCPU that takes their requests' completions (not in `tasks`:
    /// the planner does not move them).
    #[serde(default)]
    pub kept_with_completions: Vec<KeptStatus>,
    /// Why the planner may not move tasks now.
    #[serde(default)]
    pub move_gate: GateReport,
    /// While the guard holds: seconds until its next probe.
    #[serde(default)]
    pub guard_hold_remaining_s: f64,
    /// vCPUs were out all at once lately: only tasks kept with their completions stay
    /// managed.
    #[serde(default)]
    pub out_together: bool,
    /// What the detector found I/O-bound in its last window, the excluded included.
    #[serde(default)]
    pub seen: Vec<SeenStatus>,
    /// Partners of I/O-bound tasks (kept beside them where `keep_partners` is on).
    #[serde(default)]
    pub partners: Vec<PartnerStatus>,
    /// Tasks whose mask someone else changed after the daemon: left alone while they live.
    #[serde(default)]
    pub hands_off: Vec<u32>,
}

/// Why the planner may not move tasks now (`migrater::engine::MoveGate`); `open` when
/// it may, and from a daemon too old to say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateReport {
    #[default]
    Open,
    HostHolds,
    FollowsHost,
    NotContended,
    GuardHolding,
    GuardProbing,
}

/// A thread the detector found I/O-bound in its last window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SeenStatus {
    pub tid: u32,
    pub tgid: u32,
    pub comm: String,
    /// Share of the window with a request of its in flight.
    pub io_fraction: f64,
    /// Share of the window on a CPU.
    pub cpu_fraction: f64,
    pub iops: f64,
    pub load: f64,
    pub last_cpu: u32,
    /// The vCPU its requests complete on, once the daemon knows it.
    pub completion_cpu: Option<usize>,
    /// Its command is in `migration.exclude_comm`, or it is the daemon's own.
    pub excluded: bool,
}

/// A thread an I/O-bound task wakes and is woken by (`migration.keep_partners`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartnerStatus {
    pub tid: u32,
    pub tgid: u32,
    pub comm: String,
    /// The I/O-bound task's tid.
    pub of: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptStatus {
    pub tid: u32,
    pub cpu: usize,
}

/// Asks the daemon behind `state_dir` for its status.
pub fn query(state_dir: &Path) -> Result<StatusReport> {
    control::query(&socket_path(state_dir), "vmigrater")
}

/// Serde default of fields that older daemons did not report.
fn yes() -> bool {
    true
}

/// Human-readable rendering of a report.
pub fn render(r: &StatusReport) -> String {
    let mut s = String::new();
    render_summary(&mut s, r);
    render_vcpus(&mut s, r);
    render_tasks(&mut s, r);
    s
}

/// The daemon's figures, the host channel's included.
fn render_summary(s: &mut String, r: &StatusReport) {
    let _ = writeln!(
        s,
        "vmigrater {} pid {} up {:.0}s  attach={}  monitor={}  demand={}  block programs {}{}",
        r.version,
        r.pid,
        r.uptime_s,
        name_of(&r.attach_mode),
        name_of(&r.monitor_source),
        name_of(&r.demand),
        match (r.block_attached, r.block_tracking) {
            (false, _) => "detached",
            (true, true) => "tracking",
            (true, false) => "paused",
        },
        if r.dry_run { "  DRY-RUN" } else { "" }
    );
    let l = &r.migration_latency_us;
    let _ = writeln!(
        s,
        "io-bound tasks {}  managed {}  hands-off {}  migrations {}  latency µs p50 {:.1} p99 {:.1} max {:.1}",
        r.io_tasks, r.managed_tasks, r.hands_off_tasks, r.migrations, l.p50, l.p99, l.max
    );
    if !r.kept_with_completions.is_empty() {
        let kept: Vec<String> = r
            .kept_with_completions
            .iter()
            .map(|k| format!("{} on vCPU {}", k.tid, k.cpu))
            .collect();
        let _ = writeln!(s, "kept with their completions: {}", kept.join(", "));
    }
    if r.journal_errors > 0 {
        let _ = writeln!(
            s,
            "journal write errors {} (state directory full or read-only?)",
            r.journal_errors
        );
    }
    let _ = writeln!(
        s,
        "host channel {}  reports sent {}  dropped {}  replies {}",
        if r.channel_connected {
            "connected"
        } else {
            "not connected"
        },
        r.channel_reports_sent,
        r.channel_reports_dropped,
        r.channel_replies
    );
}

/// A table row per vCPU.
fn render_vcpus(s: &mut String, r: &StatusReport) {
    let _ = writeln!(
        s,
        "\n{:>4} {:>6} {:>8} {:>10} {:>9} {:>9} {:>8} {:>9} {:>10} {:>6}",
        "vCPU",
        "state",
        "desched",
        "inact_ms",
        "slice_ms",
        "remain_ms",
        "gap_us",
        "io_compl",
        "io_ema_us",
        "tasks"
    );
    for v in &r.vcpus {
        let _ = writeln!(
            s,
            "{:>4} {:>6} {:>8} {:>10.1} {:>9.2} {:>9.2} {:>8.0} {:>9} {:>10.1} {:>6}",
            v.cpu,
            if v.active { "run" } else { "OUT" },
            v.deschedules,
            v.inactive_total_ms,
            v.est_slice_ms,
            v.remaining_ms,
            v.gap_threshold_us,
            v.io_completions,
            v.io_interval_ema_us,
            v.tasks_placed
        );
    }
}

/// A table row per I/O-bound task, if any.
fn render_tasks(s: &mut String, r: &StatusReport) {
    if !r.tasks.is_empty() {
        let _ = writeln!(
            s,
            "\n{:>8} {:>8} {:<16} {:>6} {:>4} {:>6}  allowed",
            "tid", "pid", "comm", "load", "prio", "on"
        );
        for t in &r.tasks {
            let _ = writeln!(
                s,
                "{:>8} {:>8} {:<16} {:>6.2} {:>4} {:>6}  {:?}",
                t.tid,
                t.tgid,
                t.comm,
                t.load,
                t.priority,
                t.placed_on.map_or("-".to_string(), |c| c.to_string()),
                t.allowed
            );
        }
    }
}

/// Percentiles of recent migration latencies, in microseconds.
pub fn summarize(latencies_ns: &[u64], count: u64) -> LatencySummary {
    if latencies_ns.is_empty() {
        return LatencySummary {
            count,
            ..Default::default()
        };
    }
    let mut v = latencies_ns.to_vec();
    v.sort_unstable();
    let pick = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
    LatencySummary {
        count,
        p50: pick(0.5),
        p90: pick(0.9),
        p99: pick(0.99),
        max: pick(1.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_keep_their_names_on_the_wire() {
        // Scripts and dashboards read these strings: typed on our side, the same text.
        let r = StatusReport {
            attach_mode: AttachReport::TpBtf,
            monitor_source: SourceReport::Kernel,
            demand: DemandReport::Active,
            ..StatusReport::default()
        };
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["attach_mode"], "tp_btf");
        assert_eq!(j["monitor_source"], "kernel");
        assert_eq!(j["demand"], "active");
        for (mode, name) in [
            (AttachReport::RawTp, "raw_tp"),
            (AttachReport::Tracepoint, "tracepoint"),
            (AttachReport::None, "none"),
        ] {
            assert_eq!(name_of(&mode), name);
        }
        // A daemon too old to report its source still parses.
        let mut old = j.clone();
        old.as_object_mut().unwrap().remove("monitor_source");
        let back: StatusReport = serde_json::from_value(old).unwrap();
        assert_eq!(back.monitor_source, SourceReport::Unknown);
        assert!(render(&back).contains("attach=tp_btf  monitor=unknown  demand=active"));
    }

    #[test]
    fn metric_labels_are_the_names_on_the_wire() {
        use AttachReport as A;
        for m in [A::TpBtf, A::RawTp, A::Tracepoint, A::None] {
            assert_eq!(m.as_str(), name_of(&m));
        }
        use SourceReport as S;
        for s in [S::Kernel, S::Sleepers, S::External, S::Unknown] {
            assert_eq!(s.as_str(), name_of(&s));
        }
    }

    #[test]
    fn percentiles_of_a_known_series() {
        let v: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        let s = summarize(&v, 100);
        assert_eq!(s.p50, 51.0);
        assert_eq!(s.p99, 99.0);
        assert_eq!(s.max, 100.0);
    }

    #[test]
    fn render_names_every_vcpu() {
        let r = StatusReport {
            vcpus: vec![
                VcpuStatus {
                    cpu: 0,
                    active: true,
                    ..Default::default()
                },
                VcpuStatus {
                    cpu: 1,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let text = render(&r);
        assert!(text.contains("   0    run"), "{text}");
        assert!(text.contains("   1    OUT"), "{text}");
    }
}

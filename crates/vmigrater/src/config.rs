//! The daemon's configuration: `/etc/vmigrater/vmigrater.toml`, every key optional with a
//! default that works on a plain Linux guest. Owns parsing and validation only; it must
//! never touch the system. Unknown keys are errors that name the line, so a typo is never
//! silently ignored.

use anyhow::Result;
use control::{in_range, Invalid};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/vmigrater/vmigrater.toml";
pub const DEFAULT_STATE_DIR: &str = "/run/vmigrater";

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the journal of original affinity masks and the status socket live.
    pub state_dir: PathBuf,
    /// Plan and log migrations but never change a mask.
    pub dry_run: bool,
    pub monitor: MonitorSection,
    pub detector: DetectorSection,
    pub migration: MigrationSection,
    pub metrics: MetricsSection,
    pub channel: ChannelSection,
    /// User priorities: the first matching rule sets a task's priority (higher wins).
    #[serde(rename = "priority")]
    pub priorities: Vec<PriorityRule>,
    /// Timings and limits that our measurements chose (`docs/advanced.md`): a lab, or a
    /// hypervisor unlike any measured, may need others; a user should not.
    pub advanced: Advanced,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            dry_run: false,
            monitor: MonitorSection::default(),
            detector: DetectorSection::default(),
            migration: MigrationSection::default(),
            metrics: MetricsSection::default(),
            channel: ChannelSection::default(),
            priorities: Vec::new(),
            advanced: Advanced::default(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorSection {
    /// Where deschedules are learnt from: "kernel" (late kernel timers seen by BPF, no
    /// wake-up of our own per tick), "sleepers" (a SCHED_FIFO sleeper per vCPU: the only
    /// source that also sees a steal emulator inside the same kernel) or "auto" (kernel,
    /// else sleepers).
    pub source: MonitorSource,
    /// vCPUs to monitor; empty means every online CPU.
    pub cpus: Vec<usize>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum MonitorSource {
    #[default]
    Auto,
    Kernel,
    Sleepers,
}

impl TryFrom<String> for MonitorSource {
    type Error = String;

    /// By hand rather than derived, so that the error names the three values.
    fn try_from(s: String) -> std::result::Result<Self, String> {
        match s.as_str() {
            "auto" => Ok(MonitorSource::Auto),
            "kernel" => Ok(MonitorSource::Kernel),
            "sleepers" => Ok(MonitorSource::Sleepers),
            other => Err(format!(
                "unknown monitor.source {other:?}: expected `auto`, `kernel` or `sleepers`"
            )),
        }
    }
}

/// `detector.attach_mode`: the best mode the kernel offers, or one insisted on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum AttachSetting {
    #[default]
    Auto,
    #[value(name = "tp_btf")]
    TpBtf,
    #[value(name = "raw_tp")]
    RawTp,
    Tracepoint,
}

/// The mode to insist on: none for `auto`.
impl From<AttachSetting> for Option<task_detector::AttachMode> {
    fn from(s: AttachSetting) -> Self {
        use task_detector::AttachMode;
        match s {
            AttachSetting::Auto => None,
            AttachSetting::TpBtf => Some(AttachMode::TpBtf),
            AttachSetting::RawTp => Some(AttachMode::RawTp),
            AttachSetting::Tracepoint => Some(AttachMode::Tracepoint),
        }
    }
}

fn us(d: std::time::Duration) -> u64 {
    d.as_micros() as u64
}

impl From<MonitorSource> for vcpu_monitor::Wanted {
    fn from(s: MonitorSource) -> Self {
        use vcpu_monitor::Wanted;
        match s {
            MonitorSource::Auto => Wanted::Auto,
            MonitorSource::Kernel => Wanted::Kernel,
            MonitorSource::Sleepers => Wanted::Sleepers,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DetectorSection {
    /// BPF attach mode: "auto", "tp_btf", "raw_tp" or "tracepoint".
    pub attach_mode: AttachSetting,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationSection {
    /// Commands (comm) never to migrate.
    pub exclude_comm: Vec<String>,
    /// Measure online whether moves raise the guest's block I/O rate (epochs with and
    /// without moves, compared) and hold tasks on their own masks while they do not.
    pub guard: bool,
    /// Keep an I/O-bound task on the vCPU that takes its requests' completion interrupts
    /// where that vCPU is fixed (a descheduled vCPU holds its interrupts, so elsewhere each
    /// request needs two vCPUs to run). false: always move I/O-bound tasks towards running
    /// vCPUs, for a hypervisor that delivers a descheduled vCPU's interrupts elsewhere or
    /// a steal emulator that does not hold them.
    pub follow_completions: bool,
    /// Keep beside a task kept with its completions the user threads it wakes and is woken
    /// by many times a second (a database backend's client across a socket): on another
    /// vCPU each request would wait for that vCPU's window too. They get the short slice
    /// as well.
    pub keep_partners: bool,
    /// Move I/O-bound tasks only onto the vCPUs the host agent holds for the guest's I/O,
    /// never on the daemon's own judgement: for a host that runs vmigrater-hv-agent and
    /// should make every placement decision. The guest says so in its hello, so the agent
    /// may name a vCPU for its I/O before anything pays for a favour there.
    pub follow_host: bool,
}

impl Default for MigrationSection {
    fn default() -> Self {
        MigrationSection {
            exclude_comm: Vec::new(),
            guard: true,
            follow_completions: true,
            keep_partners: true,
            follow_host: false,
        }
    }
}

/// The host channel: per-vCPU I/O reports to `vmigrater-hv-agent` over a virtio port.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChannelSection {
    pub enabled: bool,
    /// The virtio-serial port (any character device or FIFO works for tests).
    pub path: std::path::PathBuf,
}

impl Default for ChannelSection {
    fn default() -> Self {
        ChannelSection {
            enabled: true,
            path: format!("/dev/virtio-ports/{}", proto::PORT_NAME).into(),
        }
    }
}

/// `[advanced.*]`: what the measurements in `benches/RESULTS.md` chose, documented in
/// `docs/advanced.md`. The nested lab's guest sets some (QEMU TCG emulates every timer
/// wake-up and map read); a user should not need to.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Advanced {
    pub monitor: MonitorTimings,
    pub detector: DetectorTimings,
    pub migration: MigrationLimits,
    pub channel: ChannelTimings,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorTimings {
    /// Sleep period of each vCPU's sleeper while I/O-bound tasks need slice information.
    pub period_us: u64,
    /// Period while I/O-bound tasks exist but no descheduling was seen recently.
    pub probe_period_us: u64,
    /// Period while no task is I/O-bound: the daemon should cost almost nothing then.
    pub idle_period_us: u64,
    /// Floor of the adaptive gap threshold.
    pub min_gap_threshold_us: u64,
    /// Slice length assumed before any slice has been measured (paper: 11 ms).
    pub default_slice_us: u64,
    /// SCHED_FIFO priority of the sleepers; 0 runs them as normal tasks (less precise).
    pub rt_priority: i32,
}

impl Default for MonitorTimings {
    fn default() -> Self {
        MonitorTimings {
            period_us: us(vcpu_monitor::DEFAULT_PERIOD),
            probe_period_us: us(vcpu_monitor::DEFAULT_PROBE_PERIOD),
            idle_period_us: us(vcpu_monitor::DEFAULT_IDLE_PERIOD),
            min_gap_threshold_us: us(vcpu_monitor::DEFAULT_MIN_GAP_THRESHOLD),
            default_slice_us: us(vcpu_monitor::DEFAULT_SLICE),
            rt_priority: vcpu_monitor::DEFAULT_RT_PRIORITY,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DetectorTimings {
    /// Length of one classification window.
    pub window_ms: u64,
    /// Poll period while nothing is I/O-bound and no block I/O is seen.
    pub idle_poll_ms: u64,
    /// Sampled tracking: the block programs run for `sample_ms` out of every
    /// `sample_every_ms` and return at once in between, so most requests pay almost nothing for
    /// them (under QEMU TCG each tracked request paid ~56 us). 0: track every request.
    pub sample_ms: u64,
    pub sample_every_ms: u64,
    /// With nothing to gain (no vCPU descheduled while another runs, no host agent that
    /// could use our figures) for this long, the block programs come off their
    /// tracepoints; paused, each request still runs two that return at once. Attaching
    /// again patches kernel text, so not much shorter than a few contention windows (2 s).
    /// A daemon that has had nothing to gain since it started detaches once its first
    /// window is judged. Never while a vCPU is descheduled: the patch's IPI waits for it.
    /// 0: never detach.
    pub detach_after_ms: u64,
}

impl Default for DetectorTimings {
    fn default() -> Self {
        DetectorTimings {
            window_ms: 5,
            idle_poll_ms: 40,
            sample_ms: 250,
            sample_every_ms: 2_500,
            detach_after_ms: 10_000,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationLimits {
    /// Push I/O-bound tasks off a vCPU whose estimated remaining slice is below this.
    pub push_threshold_us: u64,
    /// Never put more than this much I/O load (sum of task load levels) on one vCPU while
    /// another running vCPU has room.
    pub max_load_per_vcpu: f64,
    /// Length of one move-guard epoch.
    pub guard_epoch_ms: u64,
    /// The scheduler slice of a task kept with its completions (fair tasks whose own is
    /// longer; Linux 6.12+): a short one lets it run first when it wakes beside a CPU-bound
    /// task on that vCPU. Its own slice is journaled and given back when it is no longer
    /// kept. 0: leave slices alone.
    pub kept_slice_us: u64,
}

impl Default for MigrationLimits {
    fn default() -> Self {
        MigrationLimits {
            push_threshold_us: 1_000,
            max_load_per_vcpu: 2.0,
            guard_epoch_ms: 1_000,
            kept_slice_us: 100,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChannelTimings {
    /// Report period.
    pub period_ms: u64,
}

impl Default for ChannelTimings {
    fn default() -> Self {
        ChannelTimings { period_ms: 100 }
    }
}

impl Advanced {
    /// The ranges of `[advanced.*]` (docs/advanced.md).
    fn validate(&self) -> std::result::Result<(), Invalid> {
        self.monitor.validate()?;
        self.detector.validate()?;
        self.migration.validate()?;
        self.channel.validate()
    }
}

impl MonitorTimings {
    fn validate(&self) -> std::result::Result<(), Invalid> {
        in_range("advanced.monitor.period_us", self.period_us, 50, 100_000)?;
        in_range(
            "advanced.monitor.probe_period_us",
            self.probe_period_us,
            self.period_us,
            1_000_000,
        )?;
        in_range(
            "advanced.monitor.idle_period_us",
            self.idle_period_us,
            self.period_us,
            10_000_000,
        )?;
        in_range(
            "advanced.monitor.min_gap_threshold_us",
            self.min_gap_threshold_us,
            10,
            100_000,
        )?;
        in_range(
            "advanced.monitor.default_slice_us",
            self.default_slice_us,
            100,
            1_000_000,
        )?;
        in_range("advanced.monitor.rt_priority", self.rt_priority, 0, 99)?;
        Ok(())
    }
}

impl DetectorTimings {
    fn validate(&self) -> std::result::Result<(), Invalid> {
        in_range("advanced.detector.window_ms", self.window_ms, 1, 1_000)?;
        in_range(
            "advanced.detector.idle_poll_ms",
            self.idle_poll_ms,
            1,
            60_000,
        )?;
        if self.detach_after_ms != 0 {
            in_range(
                "advanced.detector.detach_after_ms",
                self.detach_after_ms,
                1_000,
                3_600_000,
            )
            .map_err(|e| Invalid::new(&e.key, format!("{}, or 0 never to detach", e.message)))?;
        }
        // 0 tracks every request; sample_ms is unused then.
        if self.sample_every_ms != 0 {
            in_range(
                "advanced.detector.sample_ms",
                self.sample_ms,
                self.window_ms,
                60_000,
            )
            .map_err(|e| {
                Invalid::new(
                    &e.key,
                    format!("{} (advanced.detector.window_ms..=60000)", e.message),
                )
            })?;
            in_range(
                "advanced.detector.sample_every_ms",
                self.sample_every_ms,
                self.sample_ms,
                600_000,
            )
            .map_err(|e| {
                Invalid::new(
                    &e.key,
                    format!(
                        "{} (advanced.detector.sample_ms..=600000), or 0 to track every request",
                        e.message
                    ),
                )
            })?;
        }
        Ok(())
    }
}

impl MigrationLimits {
    fn validate(&self) -> std::result::Result<(), Invalid> {
        in_range(
            "advanced.migration.push_threshold_us",
            self.push_threshold_us,
            0,
            100_000,
        )?;
        in_range(
            "advanced.migration.max_load_per_vcpu",
            self.max_load_per_vcpu,
            0.01,
            64.0,
        )?;
        in_range(
            "advanced.migration.guard_epoch_ms",
            self.guard_epoch_ms,
            100,
            60_000,
        )?;
        if self.kept_slice_us != 0 {
            // The kernel's bounds for a custom slice: outside it clamps, and we would not
            // recognise our own value when giving it back.
            in_range(
                "advanced.migration.kept_slice_us",
                self.kept_slice_us,
                100,
                100_000,
            )
            .map_err(|e| {
                Invalid::new(&e.key, format!("{}, or 0 to leave slices alone", e.message))
            })?;
        }
        Ok(())
    }
}

impl ChannelTimings {
    fn validate(&self) -> std::result::Result<(), Invalid> {
        in_range("advanced.channel.period_ms", self.period_ms, 10, 60_000)?;
        Ok(())
    }
}

/// Keys that moved into `[advanced.*]`: a file that still sets one is told where it went
/// (on the line), not handed serde's bare "unknown field".
const MOVED_KEYS: &[(&str, &str)] = &[
    ("monitor.period_us", "advanced.monitor.period_us"),
    (
        "monitor.probe_period_us",
        "advanced.monitor.probe_period_us",
    ),
    ("monitor.idle_period_us", "advanced.monitor.idle_period_us"),
    (
        "monitor.min_gap_threshold_us",
        "advanced.monitor.min_gap_threshold_us",
    ),
    (
        "monitor.default_slice_us",
        "advanced.monitor.default_slice_us",
    ),
    ("monitor.rt_priority", "advanced.monitor.rt_priority"),
    ("detector.window_ms", "advanced.detector.window_ms"),
    ("detector.idle_poll_ms", "advanced.detector.idle_poll_ms"),
    ("detector.sample_ms", "advanced.detector.sample_ms"),
    (
        "detector.sample_every_ms",
        "advanced.detector.sample_every_ms",
    ),
    (
        "detector.detach_after_ms",
        "advanced.detector.detach_after_ms",
    ),
    (
        "migration.push_threshold_us",
        "advanced.migration.push_threshold_us",
    ),
    (
        "migration.max_load_per_vcpu",
        "advanced.migration.max_load_per_vcpu",
    ),
    (
        "migration.guard_epoch_ms",
        "advanced.migration.guard_epoch_ms",
    ),
    (
        "migration.kept_slice_us",
        "advanced.migration.kept_slice_us",
    ),
    ("channel.period_ms", "advanced.channel.period_ms"),
];

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    pub enabled: bool,
    /// Address of the Prometheus endpoint (`/metrics`). Localhost by default on purpose.
    pub listen: SocketAddr,
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            enabled: true,
            listen: "127.0.0.1:9977".parse().expect("static address"),
        }
    }
}

/// A user priority. At least one of `comm`, `pid` or `cgroup` must be given; all given
/// ones must match.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PriorityRule {
    pub comm: Option<String>,
    pub pid: Option<u32>,
    /// Substring of a line of /proc/<pid>/cgroup.
    pub cgroup: Option<String>,
    pub priority: i32,
}

impl PriorityRule {
    pub fn matches(&self, comm: &str, tgid: u32, cgroup: &str) -> bool {
        self.comm.as_deref().is_none_or(|c| c == comm)
            && self.pid.is_none_or(|p| p == tgid)
            && self.cgroup.as_deref().is_none_or(|c| cgroup.contains(c))
    }
}

/// At SIGHUP a running daemon takes up the keys its detector loop reads at every step.
/// Everything else is built into threads, BPF programs, sockets or the monitor's hook at
/// start-up, and needs a restart.
impl control::Reloadable for Config {
    const UNIT: &'static str = "vmigrater";
    const LIVE_KEYS: &'static [&'static str] = &["migration.exclude_comm", "priority"];
    fn with_live_keys(&self, new: &Self) -> Self {
        let mut next = self.clone();
        next.migration.exclude_comm = new.migration.exclude_comm.clone();
        next.priorities = new.priorities.clone();
        next
    }
}

impl Config {
    /// Parses TOML text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        for (old, new) in MOVED_KEYS {
            if let Some(line) = control::key_line(text, old) {
                let (table, key) = new.rsplit_once('.').expect("dotted");
                anyhow::bail!(
                    "{origin}:{line}: {old} is now {new}: an internal timing or limit, set \
                     under [{table}] as `{key} = …` if at all (docs/advanced.md)"
                );
            }
        }
        control::parse_checked(text, origin, Config::validate)
    }

    /// Validates a configuration changed after loading (command-line flags over the
    /// file): the same ranges, the error naming `origin`.
    pub fn revalidate(self, origin: &str) -> Result<Config> {
        self.validate()
            .map_err(|e| anyhow::anyhow!("{origin}: {}", e.message))?;
        Ok(self)
    }

    /// Loads `path`. A missing file at the default location means "all defaults"; a
    /// missing file that the user named explicitly is an error.
    pub fn load(path: &Path, explicit: bool) -> Result<Config> {
        control::load_config(path, explicit, Config::parse)
    }

    /// Every key's range, documented in the README's configuration table and docs/advanced.md.
    fn validate(&self) -> std::result::Result<(), Invalid> {
        // The status socket lives in the state directory.
        control::socket_path_fits("state_dir", &crate::status::socket_path(&self.state_dir))?;
        self.advanced.validate()?;
        for name in &self.migration.exclude_comm {
            comm_fits("migration.exclude_comm", name, "")?;
        }
        for (i, rule) in self.priorities.iter().enumerate() {
            if let Some(name) = &rule.comm {
                comm_fits(
                    "priority.comm",
                    name,
                    &format!(" (priority rule #{})", i + 1),
                )?;
            }
            if rule.comm.is_none() && rule.pid.is_none() && rule.cgroup.is_none() {
                return Err(Invalid::new(
                    "priority",
                    format!(
                        "priority rule #{} matches nothing: give comm, pid or cgroup",
                        i + 1
                    ),
                ));
            }
            in_range("priority.priority", rule.priority, -1_000, 1_000)?;
        }
        Ok(())
    }

    /// The priority of a task under the user's rules (0 when no rule matches).
    pub fn priority_of(&self, comm: &str, tgid: u32, cgroup: &str) -> i32 {
        self.priorities
            .iter()
            .find(|r| r.matches(comm, tgid, cgroup))
            .map_or(0, |r| r.priority)
    }

    /// The default configuration as the package ships it (`vmigrater default-config`):
    /// every user key with a line saying what it does and its default, commented out, and
    /// `[advanced]` as a commented block. The defaults live in the program, so a new
    /// release's defaults reach a machine for every key its file does not set; a file that
    /// froze them (as a plain dump of the defaults would) keeps old timings forever.
    pub fn default_toml() -> String {
        let dump = toml::to_string_pretty(&Config::default()).expect("defaults serialise");
        let body = control::conffile::commented_defaults(
            &dump,
            KEY_DOCS,
            SECTION_DOCS,
            |s| s.starts_with("advanced"),
            // An array of tables, shown by example at the end.
            &["priority"],
        );
        format!("{CONFFILE_HEAD}{body}{CONFFILE_PRIORITY}")
    }
}

const CONFFILE_HEAD: &str = "\
# vmigrater: the guest daemon's configuration (/etc/vmigrater/vmigrater.toml).
# Every key is optional: each is shown with its default and commented out, and the
# default lives in the program, so a new release's defaults apply wherever this file
# sets nothing. Uncomment a key to set it; `systemctl reload vmigrater` takes up
# migration.exclude_comm and the [[priority]] rules, anything else needs a restart.
# An unknown key is an error naming its line. `vmigrater default-config` prints this.

";

const CONFFILE_PRIORITY: &str = "
# User priorities: the first rule that matches a task sets its priority (higher wins
# a vCPU first). A rule matches by command, process id and/or a substring of a line of
# /proc/PID/cgroup, e.g.:
#[[priority]]
#comm = \"postgres\"
#priority = 10
";

/// The comment line(s) over each section of the shipped file.
const SECTION_DOCS: &[(&str, &str)] = &[
    (
        "monitor",
        "Which vCPUs run now, and how long their slices are.",
    ),
    (
        "detector",
        "Which tasks are I/O-bound, from BPF programs on block tracepoints.",
    ),
    ("migration", "Which tasks move, and under what safeguards."),
    (
        "metrics",
        "Prometheus metrics (OpenMetrics text at /metrics).",
    ),
    (
        "channel",
        "Per-vCPU I/O reports to vmigrater-hv-agent on the host, over a virtio-serial port.",
    ),
    (
        "advanced.monitor",
        "Timings and limits our measurements chose (docs/advanced.md, benches/RESULTS.md).\n\
         A lab, or a hypervisor unlike any measured, may need others; a user should not.",
    ),
];

/// The comment line(s) over each key of the shipped file; every key has one
/// (`the_shipped_file_documents_every_key`).
const KEY_DOCS: &[(&str, &str)] = &[
    ("state_dir", "Where the journal of original masks and the status socket live."),
    ("dry_run", "Plan and log migrations but never change a mask."),
    ("monitor.source", "Where deschedules are learnt from: \"kernel\" (late kernel timers seen by BPF),\n\"sleepers\" (a SCHED_FIFO sleeper per vCPU) or \"auto\" (kernel, else sleepers)."),
    ("monitor.cpus", "vCPUs to monitor; empty means every online CPU."),
    ("detector.attach_mode", "BPF attach mode: \"auto\", \"tp_btf\", \"raw_tp\" or \"tracepoint\"."),
    ("migration.exclude_comm", "Commands (comm) never to move, e.g. [\"backup\", \"rsync\"]."),
    ("migration.guard", "Measure whether moves raise the guest's block I/O rate, and hold tasks on\ntheir own masks while they do not."),
    ("migration.follow_completions", "Keep an I/O-bound task on the vCPU that takes its completion interrupts\nwhere that vCPU is fixed; false: always move towards running vCPUs."),
    ("migration.keep_partners", "Keep beside a kept task the threads it wakes many times a second (a\ndatabase backend's client)."),
    ("migration.follow_host", "Move I/O-bound tasks only onto the vCPUs the host agent holds for the\nguest's I/O, never on the daemon's own judgement (a host running vmigrater-hv-agent)."),
    ("metrics.enabled", "Serve metrics."),
    ("metrics.listen", "Address of the metrics endpoint (localhost only by default)."),
    ("channel.enabled", "Report to the host agent when its port exists."),
    ("channel.path", "The virtio-serial port."),
    ("advanced.monitor.period_us", "Sleeper period while I/O-bound tasks need slice information."),
    ("advanced.monitor.probe_period_us", "Period while I/O-bound tasks exist but no deschedule was seen lately."),
    ("advanced.monitor.idle_period_us", "Period while no task is I/O-bound."),
    ("advanced.monitor.min_gap_threshold_us", "Floor of the adaptive gap threshold."),
    ("advanced.monitor.default_slice_us", "Slice length assumed before one has been measured."),
    ("advanced.monitor.rt_priority", "SCHED_FIFO priority of the sleepers; 0 runs them as normal tasks."),
    ("advanced.detector.window_ms", "Length of one classification window."),
    ("advanced.detector.idle_poll_ms", "Poll period while nothing is I/O-bound and no block I/O is seen."),
    ("advanced.detector.sample_ms", "Sampled tracking: the block programs track sample_ms of every\nsample_every_ms; 0 tracks every request."),
    ("advanced.detector.sample_every_ms", "See sample_ms."),
    ("advanced.detector.detach_after_ms", "With nothing to gain for this long the block programs come off; 0: never."),
    ("advanced.migration.push_threshold_us", "Move a task off a vCPU whose slice ends within this."),
    ("advanced.migration.max_load_per_vcpu", "Most runnable tasks a destination vCPU may hold."),
    ("advanced.migration.guard_epoch_ms", "Length of one epoch of the move guard's probe."),
    ("advanced.migration.kept_slice_us", "Scheduler slice of a kept task (shorter turns under contention)."),
    ("advanced.channel.period_ms", "Report period to the host agent."),
];

/// The kernel keeps a task's command in 16 bytes with its NUL (TASK_COMM_LEN): a longer
/// name, or an empty one, would never match, and the rule would silently do nothing.
fn comm_fits(key: &str, name: &str, which: &str) -> std::result::Result<(), Invalid> {
    const COMM_MAX: usize = 15;
    if name.is_empty() || name.len() > COMM_MAX {
        return Err(Invalid::new(
            key,
            format!(
                "{key}{which}: \"{name}\" can never match a command: the kernel keeps 1 to \
                 {COMM_MAX} bytes of one (`ps -o comm` shows them)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_all_defaults() {
        let cfg = Config::parse("", "t.toml").unwrap();
        assert_eq!(cfg.advanced.monitor.period_us, 300);
        assert_eq!(cfg.metrics.listen.to_string(), "127.0.0.1:9977");
    }

    #[test]
    fn unknown_key_names_the_line() {
        let err = Config::parse("dry_run = true\n\n[monitor]\nperiod_uss = 5\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("t.toml:4:"), "{err}");
        assert!(err.contains("period_uss"), "{err}");
    }

    #[test]
    fn a_key_moved_to_advanced_is_refused_naming_its_line_and_new_place() {
        for (old, new) in MOVED_KEYS {
            let (table, key) = old.split_once('.').unwrap();
            let err = format!(
                "{:#}",
                Config::parse(&format!("# c\n[{table}]\n{key} = 1\n"), "t.toml").unwrap_err()
            );
            assert!(
                err.starts_with(&format!("t.toml:3: {old} is now {new}")),
                "{err}"
            );
            // The new place knows the key: only its range may refuse the value.
            let (new_table, _) = new.rsplit_once('.').unwrap();
            if let Err(e) = Config::parse(&format!("[{new_table}]\n{key} = 1\n"), "t.toml") {
                let e = format!("{e:#}");
                assert!(!e.contains("unknown field"), "{e}");
            }
        }
        // Every key of [advanced.*] is listed, so that none moved silently.
        let advanced = toml::Value::try_from(Advanced::default()).unwrap();
        let count: usize = advanced
            .as_table()
            .unwrap()
            .values()
            .map(|t| t.as_table().unwrap().len())
            .sum();
        assert_eq!(count, MOVED_KEYS.len());
    }

    #[test]
    fn the_removed_anchor_key_is_refused_naming_its_line() {
        // Anchoring always gathers now; an old config that chose must be told, not ignored.
        let err = Config::parse("[migration]\nguard = true\nanchor = \"stay\"\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("t.toml:3:"), "{err}");
        assert!(err.contains("anchor"), "{err}");
    }

    #[test]
    fn a_reload_puts_into_effect_exactly_the_live_keys() {
        use control::Reloadable;
        let running = Config::default();
        let bad = || Config::parse("[advanced.monitor]\nperiod_us = 1\n", "bad.toml");
        assert!(
            control::reload(&running, &bad).is_none(),
            "a bad file applies nothing"
        );
        let text =
            "[advanced.monitor]\nperiod_us = 500\n\n[migration]\nexclude_comm = [\"fio\"]\n\n\
                    [[priority]]\ncomm = \"db\"\npriority = 5\n";
        let good = || Config::parse(text, "good.toml");
        let (live, restart) = control::changed_keys(&running, &good().unwrap(), |k| {
            Config::LIVE_KEYS.contains(&k)
        });
        assert_eq!(
            live,
            Config::LIVE_KEYS,
            "every live key changed in this file"
        );
        assert_eq!(restart, ["advanced.monitor.period_us"]);
        let next = control::reload(&running, &good).expect("live keys changed");
        assert_eq!(next.migration.exclude_comm, ["fio"]);
        assert_eq!(next.priority_of("db", 1, ""), 5);
        let (applied, left) = control::changed_keys(&running, &next, |_| true);
        assert_eq!(
            applied,
            Config::LIVE_KEYS,
            "with_live_keys and LIVE_KEYS disagree"
        );
        assert!(
            left.is_empty(),
            "a key that needs a restart must not look applied: {left:?}"
        );
        assert!(
            control::reload(&next, &good).is_none(),
            "nothing live changed"
        );
    }

    #[test]
    fn the_removed_let_go_key_is_refused_naming_its_line() {
        // Measured a loser and removed: a config that turned it on must be told it is gone.
        let err = Config::parse(
            "[migration]\nguard = true\nlet_go_waiting = true\n",
            "t.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("t.toml:3:"), "{err}");
        assert!(err.contains("let_go_waiting"), "{err}");
    }

    #[test]
    fn a_command_the_kernel_cannot_hold_is_refused_naming_its_line() {
        let err = format!(
            "{:#}",
            Config::parse(
                "[migration]\nguard = true\nexclude_comm = [\"fio\", \"postgres-backend\"]\n",
                "t.toml"
            )
            .unwrap_err()
        );
        assert!(err.starts_with("t.toml:3: "), "{err}");
        assert!(err.contains("\"postgres-backend\""), "{err}");
        let err = format!(
            "{:#}",
            Config::parse("[[priority]]\ncomm = \"\"\npriority = 5\n", "t.toml").unwrap_err()
        );
        assert!(err.starts_with("t.toml:2: "), "{err}");
        assert!(err.contains("priority rule #1"), "{err}");
        // 15 bytes is what the kernel keeps, and is accepted.
        Config::parse(
            "[migration]\nexclude_comm = [\"postgres-backen\"]\n",
            "t.toml",
        )
        .unwrap();
    }

    #[test]
    fn wrong_type_names_the_line() {
        let err = Config::parse("[advanced.migration]\npush_threshold_us = \"fast\"\n", "c")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("c:2:"), "{err}");
    }

    #[test]
    fn out_of_range_value_is_refused() {
        let err = format!(
            "{:#}",
            Config::parse("[advanced.monitor]\nperiod_us = 1\n", "c").unwrap_err()
        );
        assert!(err.contains("advanced.monitor.period_us"), "{err}");
    }

    /// Every numeric key at both ends of its range and beyond: accepted inside, refused
    /// outside with the file, the line and the key.
    #[test]
    fn every_key_is_bounded_at_both_ends() {
        // (table, lines before the key, key, lowest, highest, refused values)
        type Case<'a> = (&'a str, &'a str, &'a str, &'a str, &'a str, &'a [&'a str]);
        let cases: &[Case] = &[
            (
                "advanced.monitor",
                "probe_period_us = 100000\nidle_period_us = 100000\n",
                "period_us",
                "50",
                "100000",
                &["49", "100001"],
            ),
            (
                "advanced.monitor",
                "",
                "probe_period_us",
                "300",
                "1000000",
                &["299", "1000001"],
            ),
            (
                "advanced.monitor",
                "",
                "idle_period_us",
                "300",
                "10000000",
                &["299", "9223372036854775807"],
            ),
            (
                "advanced.monitor",
                "",
                "min_gap_threshold_us",
                "10",
                "100000",
                &["9", "100001"],
            ),
            (
                "advanced.monitor",
                "",
                "default_slice_us",
                "100",
                "1000000",
                &["0", "1000001"],
            ),
            (
                "advanced.monitor",
                "",
                "rt_priority",
                "0",
                "99",
                &["-1", "100"],
            ),
            (
                "advanced.detector",
                "sample_every_ms = 0\n",
                "window_ms",
                "1",
                "1000",
                &["0", "1001"],
            ),
            (
                "advanced.detector",
                "",
                "idle_poll_ms",
                "1",
                "60000",
                &["0", "60001"],
            ),
            (
                "advanced.detector",
                "sample_every_ms = 60000\n",
                "sample_ms",
                "5",
                "60000",
                &["4", "60001"],
            ),
            (
                "advanced.detector",
                "",
                "sample_every_ms",
                "250",
                "600000",
                &["249", "600001"],
            ),
            (
                "advanced.migration",
                "",
                "push_threshold_us",
                "0",
                "100000",
                &["100001", "9223372036854775807"],
            ),
            (
                "advanced.migration",
                "",
                "max_load_per_vcpu",
                "0.01",
                "64.0",
                &["0.0", "64.5", "nan", "inf", "-inf"],
            ),
            (
                "advanced.migration",
                "",
                "guard_epoch_ms",
                "100",
                "60000",
                &["99", "60001"],
            ),
            (
                "advanced.migration",
                "",
                "kept_slice_us",
                "100",
                "100000",
                &["99", "100001"],
            ),
            (
                "advanced.channel",
                "",
                "period_ms",
                "10",
                "60000",
                &["9", "60001"],
            ),
            (
                "priority",
                "comm = \"fio\"\n",
                "priority",
                "-1000",
                "1000",
                &["-1001", "1001"],
            ),
        ];
        for (table, before, key, lo, hi, refused) in cases {
            let header = if *table == "priority" {
                "[[priority]]".to_string()
            } else {
                format!("[{table}]")
            };
            let text = |v: &str| format!("# c\n{header}\n{before}{key} = {v}\n");
            for v in [lo, hi] {
                if let Err(e) = Config::parse(&text(v), "c.toml") {
                    panic!("{table}.{key} = {v} refused: {e:#}");
                }
            }
            let line = 3 + before.matches('\n').count();
            for v in *refused {
                let e = match Config::parse(&text(v), "c.toml") {
                    Ok(_) => panic!("{table}.{key} = {v} accepted"),
                    Err(e) => format!("{e:#}"),
                };
                assert!(e.starts_with(&format!("c.toml:{line}: ")), "{e}");
                assert!(e.contains(&format!("{table}.{key}")), "{e}");
            }
        }
    }

    #[test]
    fn kept_slice_zero_leaves_slices_alone() {
        let c = Config::parse("[advanced.migration]\nkept_slice_us = 0\n", "c").unwrap();
        assert_eq!(c.advanced.migration.kept_slice_us, 0);
        assert_eq!(Config::default().advanced.migration.kept_slice_us, 100);
    }

    #[test]
    fn sampling_bounds() {
        let ok = |t: &str| Config::parse(t, "c").map(|c| c.advanced.detector);
        let d = ok("[advanced.detector]\nsample_every_ms = 0\nsample_ms = 0\n").unwrap();
        assert_eq!(
            d.sample_every_ms, 0,
            "0 tracks every request, sample_ms unused"
        );
        assert!(ok(
            "[advanced.detector]\nwindow_ms = 200\nsample_ms = 400\nsample_every_ms = 4000\n"
        )
        .is_ok());
        assert_eq!(
            ok("[advanced.detector]\ndetach_after_ms = 0\n")
                .unwrap()
                .detach_after_ms,
            0,
            "0 never detaches"
        );
        for (text, key) in [
            (
                "[advanced.detector]\nwindow_ms = 50\nsample_ms = 20\n",
                "advanced.detector.sample_ms",
            ),
            (
                "[advanced.detector]\nsample_ms = 60001\nsample_every_ms = 70000\n",
                "advanced.detector.sample_ms",
            ),
            (
                "[advanced.detector]\nsample_ms = 500\nsample_every_ms = 400\n",
                "advanced.detector.sample_every_ms",
            ),
            (
                "[advanced.detector]\nsample_every_ms = 600001\n",
                "advanced.detector.sample_every_ms",
            ),
            (
                "[advanced.detector]\nidle_poll_ms = 60001\n",
                "advanced.detector.idle_poll_ms",
            ),
            (
                "[advanced.detector]\ndetach_after_ms = 500\n",
                "advanced.detector.detach_after_ms",
            ),
        ] {
            let err = format!("{:#}", ok(text).unwrap_err());
            assert!(err.contains(key), "{text}: {err}");
        }
    }

    #[test]
    fn monitor_source_is_typed() {
        let cfg = Config::parse("[monitor]\nsource = \"sleepers\"\n", "c").unwrap();
        assert_eq!(cfg.monitor.source, MonitorSource::Sleepers);
        assert_eq!(
            Config::parse("", "c").unwrap().monitor.source,
            MonitorSource::Auto
        );
        let err = format!(
            "{:#}",
            Config::parse("[monitor]\nsource = \"ticks\"\n", "c").unwrap_err()
        );
        assert!(err.starts_with("c:2:"), "{err}");
        assert!(err.contains("kernel"), "the valid values are listed: {err}");
        // The command line's names are the file's, and each asks the monitor for its source.
        use clap::ValueEnum;
        let names: Vec<(String, String)> = MonitorSource::value_variants()
            .iter()
            .map(|&v| {
                let name = v.to_possible_value().unwrap().get_name().to_string();
                (name, format!("{:?}", vcpu_monitor::Wanted::from(v)))
            })
            .collect();
        assert_eq!(
            names,
            [
                ("auto".into(), "Auto".into()),
                ("kernel".into(), "Kernel".into()),
                ("sleepers".into(), "Sleepers".into())
            ]
        );
    }

    #[test]
    fn attach_mode_is_typed() {
        let cfg = Config::parse("[detector]\nattach_mode = \"raw_tp\"\n", "c").unwrap();
        assert_eq!(cfg.detector.attach_mode, AttachSetting::RawTp);
        use task_detector::AttachMode;
        let forced = |s: AttachSetting| Option::<AttachMode>::from(s);
        assert_eq!(forced(cfg.detector.attach_mode), Some(AttachMode::RawTp));
        assert_eq!(forced(Config::default().detector.attach_mode), None);
        let err = format!(
            "{:#}",
            Config::parse("[detector]\nattach_mode = \"kprobe\"\n", "c").unwrap_err()
        );
        assert!(err.starts_with("c:2:"), "{err}");
        assert!(
            err.contains("`tp_btf`"),
            "the valid values are listed: {err}"
        );
        // The command line's names are the file's.
        use clap::ValueEnum;
        let names: Vec<String> = AttachSetting::value_variants()
            .iter()
            .map(|v| v.to_possible_value().unwrap().get_name().to_string())
            .collect();
        assert_eq!(names, ["auto", "tp_btf", "raw_tp", "tracepoint"]);
    }

    #[test]
    fn flags_are_held_to_the_files_ranges() {
        let mut cfg = Config::default();
        cfg.advanced.monitor.period_us = 1;
        let err = format!("{:#}", cfg.revalidate("command line").unwrap_err());
        assert_eq!(
            err,
            "command line: advanced.monitor.period_us = 1 is outside 50..=100000"
        );
    }

    #[test]
    fn the_oracle_is_no_source_of_the_daemon_naming_the_line() {
        let err = format!(
            "{:#}",
            Config::parse("# lab\n[monitor]\nsource = \"oracle\"\n", "c.toml").unwrap_err()
        );
        assert!(err.starts_with("c.toml:3:"), "{err}");
        assert!(
            err.contains("expected `auto`, `kernel` or `sleepers`"),
            "{err}"
        );
        // The lab's old keys are unknown keys, like any other.
        let err = format!(
            "{:#}",
            Config::parse("[monitor]\noracle_epoch_ns = 5\n", "c.toml").unwrap_err()
        );
        assert!(err.starts_with("c.toml:2:"), "{err}");
    }

    #[test]
    fn priorities_first_match_wins() {
        let cfg = Config::parse(
            "[[priority]]\ncomm = \"postgres\"\npriority = 10\n\n[[priority]]\ncgroup = \"db.slice\"\npriority = 5\n",
            "c",
        )
        .unwrap();
        assert_eq!(cfg.priority_of("postgres", 1, ""), 10);
        assert_eq!(cfg.priority_of("other", 1, "0::/db.slice/x"), 5);
        assert_eq!(cfg.priority_of("other", 1, "0::/"), 0);
    }

    #[test]
    fn empty_priority_rule_is_refused() {
        assert!(Config::parse("[[priority]]\npriority = 3\n", "c").is_err());
    }

    #[test]
    fn default_toml_round_trips() {
        let text = Config::default_toml();
        let cfg = Config::parse(&text, "defaults").unwrap();
        let dump = |c: &Config| toml::to_string_pretty(c).unwrap();
        assert_eq!(dump(&cfg), dump(&Config::default()));
    }

    #[test]
    fn the_shipped_file_sets_nothing_and_documents_every_key() {
        let text = Config::default_toml();
        // Nothing but comments and the user sections' headers: every default stays in
        // the program, so a new release's defaults reach an installed machine.
        for line in text.lines() {
            let active = !line.is_empty() && !line.starts_with('#');
            assert!(
                !active || (line.starts_with('[') && !line.starts_with("[advanced")),
                "the shipped file sets {line:?}"
            );
        }
        // Every key is there, commented, under a line that says what it does.
        let dump = toml::to_string_pretty(&Config::default()).unwrap();
        let missing = control::conffile::undocumented(&dump, KEY_DOCS, &["priority"]);
        assert!(missing.is_empty(), "no line in KEY_DOCS: {missing:?}");
        // The default has no [[priority]] rule: its only `priority` key is the empty array.
        for line in dump
            .lines()
            .filter(|l| l.contains(" = ") && !l.starts_with("priority = "))
        {
            assert!(text.contains(&format!("\n#{line}\n")), "{line} not shown");
        }
        assert!(text.contains("\n#[advanced.monitor]\n"), "{text}");
        assert!(text.contains("\n#[[priority]]\n"), "{text}");
        // Uncommenting a shown default sets that default: the examples parse.
        let uncommented: String = text
            .lines()
            .map(|l| {
                l.strip_prefix('#')
                    .filter(|r| !r.starts_with(' ') && !r.is_empty())
                    .unwrap_or(l)
            })
            .collect::<Vec<_>>()
            .join("\n");
        let cfg = Config::parse(&uncommented, "uncommented").unwrap();
        assert_eq!(cfg.priorities.len(), 1);
        assert_eq!(cfg.advanced.monitor.period_us, 300);
    }
}

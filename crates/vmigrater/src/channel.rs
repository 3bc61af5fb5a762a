//! The host channel (guest side): every period, one `report` line per the wire protocol
//! (`proto`) on the virtio port `org.vmigrater.hint.0`, after a `hello` (while there is
//! nothing to report, one every `QUIET_EVERY` periods). Runs on its own
//! thread with non-blocking I/O: a slow or absent host can never delay a migration — a
//! report that cannot be written at once is dropped (one the port takes in part is
//! finished first, never run into the next). Without the port the daemon runs
//! exactly as before and says so once; a closed host end (EOF, EPIPE) means reconnecting
//! with exponential back-off.

use proto::{Hello, LineReader, Message, Report, VcpuReport, PROTOCOL_VERSION};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tracing::{debug, info, warn};

/// Cumulative figures of one vCPU, sampled each period.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VcpuSample {
    pub cpu: u32,
    pub completions: u64,
    pub ema_interval_ns: u64,
    pub io_bound_tasks: u32,
    /// Partners of I/O-bound tasks running here (`proto::VcpuReport::io_partner_tasks`).
    pub io_partner_tasks: u32,
    pub inactive_total_ns: u64,
    pub est_slice_ns: u64,
}

/// Counters for status and metrics.
#[derive(Debug, Default)]
pub struct ChannelStats {
    pub connected: AtomicBool,
    pub reports_sent: AtomicU64,
    pub reports_dropped: AtomicU64,
    pub replies: AtomicU64,
    /// Until when (monotonic ns) the host's replies favoured each vCPU (`held`).
    pub held_until_ns: HeldUntil,
}

/// vCPUs from this number on are never anchored to (the agent's `held` for them is
/// ignored).
const MAX_HELD_VCPUS: usize = 64;

/// One deadline per vCPU: a hold stands for a while after the last reply that gave it.
#[derive(Debug)]
pub struct HeldUntil([AtomicU64; MAX_HELD_VCPUS]);

impl Default for HeldUntil {
    fn default() -> Self {
        HeldUntil(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl ChannelStats {
    /// The vCPUs the host favours for our I/O-bound tasks: each vCPU that one of its
    /// replies of the last few report periods held. Per vCPU, not the latest reply's set,
    /// because each reply answers a report sent a period earlier: after the daemon anchors
    /// a task, the reply already on its way still names the vCPU the task ran on before,
    /// and taking it as the new truth unpinned and re-pinned the task every period
    /// (tests/daemon.rs `a_host_hold_keeps_the_io_bound_task_where_it_runs` catches it).
    pub fn held_vcpus(&self, now_ns: u64) -> Vec<usize> {
        (0..MAX_HELD_VCPUS)
            .filter(|&c| now_ns < self.held_until_ns.0[c].load(Ordering::Relaxed))
            .collect()
    }

    /// Takes the host's `applied`: each vCPU it holds is favoured for `for_ns` from now.
    pub fn on_applied(&self, a: &proto::Applied, now_ns: u64, for_ns: u64) {
        for v in a.vcpus.iter().filter(|v| v.held) {
            if let Some(until) = self.held_until_ns.0.get(v.cpu as usize) {
                until.store(now_ns + for_ns, Ordering::Relaxed);
            }
        }
    }
}

/// A host's `held` stands this many report periods: long enough to ride out a reply or
/// two lost or late, short enough that a host that stops favouring (or an agent that
/// goes away) gives the daemon its moves back within a few hundred milliseconds.
const HELD_PERIODS: u32 = 3;

/// Turns two consecutive samples into a report (pure): completions and inactive time are
/// deltas over the period.
pub fn build_report(seq: u64, period: Duration, prev: &[VcpuSample], now: &[VcpuSample]) -> Report {
    let period_ns = period.as_nanos().max(1) as f64;
    Report {
        seq,
        period_ms: period.as_millis().clamp(1, 60_000) as u32,
        vcpus: now
            .iter()
            .map(|s| {
                let p = prev.iter().find(|p| p.cpu == s.cpu);
                let inactive = s
                    .inactive_total_ns
                    .saturating_sub(p.map_or(s.inactive_total_ns, |p| p.inactive_total_ns));
                VcpuReport {
                    cpu: s.cpu,
                    io_completions: s
                        .completions
                        .saturating_sub(p.map_or(s.completions, |p| p.completions)),
                    io_interval_ema_us: s.ema_interval_ns as f64 / 1e3,
                    io_bound_tasks: s.io_bound_tasks,
                    io_partner_tasks: s.io_partner_tasks,
                    inactive_ratio: (inactive as f64 / period_ns).clamp(0.0, 1.0),
                    slice_estimate_us: s.est_slice_ns as f64 / 1e3,
                }
            })
            .collect(),
    }
}

/// While the guest has nothing to report, one report in this many periods: the agent
/// then judges the VM by what it sees itself (its reports go stale after a few periods),
/// and neither side pays a write, a device notification and a reply per period for
/// nothing. Under TCG these were the daemon's largest cost with an agent listening:
/// 0.12-0.47 guest CPU-s per 15 s lab run for the channel thread at 100 ms.
pub const QUIET_EVERY: u32 = 20;

/// A report that says nothing: no I/O completed and no I/O-bound task on any vCPU.
fn says_nothing(r: &Report) -> bool {
    r.vcpus
        .iter()
        .all(|v| v.io_completions == 0 && v.io_bound_tasks == 0 && v.io_partner_tasks == 0)
}

/// Whether this period's report goes out (pure): always when it says something or the
/// last one sent did (the host hears that the I/O ended), else every `QUIET_EVERY`
/// periods as a heartbeat.
fn worth_sending(says_nothing: bool, last_said_nothing: bool, periods_since_sent: u32) -> bool {
    !says_nothing || !last_said_nothing || periods_since_sent >= QUIET_EVERY
}

fn open_port(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

/// Whole lines onto a non-blocking port. A line the port takes only in part keeps its rest
/// here, written before anything else, so the host never sees two lines run together; a
/// new line that finds a rest still pending is dropped instead.
#[derive(Default)]
struct LineWriter {
    pending: Vec<u8>,
}

impl LineWriter {
    /// Writes as much of `bytes` as the port takes; the untaken rest.
    fn push(port: &mut impl Write, bytes: &[u8]) -> std::io::Result<usize> {
        let mut done = 0;
        while done < bytes.len() {
            match port.write(&bytes[done..]) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Ok(true): the line is on its way whole (sent, or its rest pending); Ok(false): it
    /// was dropped (the port is full, nothing of it went out).
    fn send(&mut self, port: &mut impl Write, msg: &Message) -> std::io::Result<bool> {
        if !self.pending.is_empty() {
            let n = Self::push(port, &self.pending)?;
            self.pending.drain(..n);
            if !self.pending.is_empty() {
                return Ok(false);
            }
        }
        let line = msg.to_line();
        let n = Self::push(port, line.as_bytes())?;
        if n == 0 {
            return Ok(false);
        }
        self.pending.extend_from_slice(&line.as_bytes()[n..]);
        Ok(true)
    }
}

/// The channel thread's body; returns when `stop` is set.
pub fn run(
    path: &Path,
    period: Duration,
    follows_host: bool,
    sample: impl Fn() -> Vec<VcpuSample>,
    stats: &ChannelStats,
    stop: &control::Stop,
) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(100);
    let mut said_missing = false;
    let mut said_deaf = false;
    let mut backoff = FIRST_BACKOFF;
    let wait = |backoff: &mut Duration| {
        let stopped = stop.nap(*backoff);
        *backoff = (*backoff * 2).min(Duration::from_secs(5));
        stopped
    };
    while !stop.is_set() {
        let mut port = match open_port(path) {
            Ok(f) => f,
            Err(e) => {
                if !said_missing {
                    info!(path = %path.display(), "no host channel ({e}): running standalone");
                    said_missing = true;
                }
                if wait(&mut backoff) {
                    return;
                }
                continue;
            }
        };
        let vcpus = sample().len().max(1) as u32;
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            agent: format!("vmigrater {}", env!("CARGO_PKG_VERSION")),
            vcpus,
            follows_host,
        });
        // A port nobody listens to on the host takes nothing (EAGAIN): no session then,
        // and no report may go out before a whole hello has.
        let mut writer = LineWriter::default();
        match writer.send(&mut port, &hello) {
            Ok(true) => {}
            Ok(false) => {
                if !said_deaf {
                    info!(path = %path.display(), "the host end of the channel takes nothing (no agent listening); retrying");
                    said_deaf = true;
                }
                if wait(&mut backoff) {
                    return;
                }
                continue;
            }
            Err(e) => {
                debug!("hello failed: {e}");
                if wait(&mut backoff) {
                    return;
                }
                continue;
            }
        }
        info!(path = %path.display(), "host channel open");
        said_missing = false;
        said_deaf = false;
        stats.connected.store(true, Ordering::Relaxed);
        let replies0 = stats.replies.load(Ordering::Relaxed);
        let reason = session(&mut port, &mut writer, period, &sample, stats, stop);
        stats.connected.store(false, Ordering::Relaxed);
        // A session the host answered was a working one: the next reconnect starts from
        // the shortest back-off again, not where an old outage left it.
        if stats.replies.load(Ordering::Relaxed) > replies0 {
            backoff = FIRST_BACKOFF;
        }
        match reason {
            None => return,
            Some(why) => {
                info!("host channel closed ({why}); reconnecting");
                if wait(&mut backoff) {
                    return;
                }
            }
        }
    }
}

/// Reports until the host end closes (returns the reason) or `stop` (returns None).
fn session(
    port: &mut File,
    writer: &mut LineWriter,
    period: Duration,
    sample: &impl Fn() -> Vec<VcpuSample>,
    stats: &ChannelStats,
    stop: &control::Stop,
) -> Option<String> {
    let mut reader = LineReader::new();
    let mut prev = sample();
    let mut seq = 0u64;
    let mut buf = [0u8; 4096];
    // The first report always goes out (the host learns the guest is there).
    let (mut last_said_nothing, mut since_sent) = (false, 0u32);
    loop {
        if stop.nap(period) {
            return None;
        }
        let now = sample();
        let report = build_report(seq + 1, period, &prev, &now);
        prev = now;
        since_sent = since_sent.saturating_add(1);
        let quiet = says_nothing(&report);
        if worth_sending(quiet, last_said_nothing, since_sent) {
            seq += 1;
            (last_said_nothing, since_sent) = (quiet, 0);
            match writer.send(port, &Message::Report(report)) {
                Ok(true) => {
                    stats.reports_sent.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {
                    stats.reports_dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Some(format!("write: {e}")),
            }
        }
        loop {
            match port.read(&mut buf) {
                Ok(0) => return Some("EOF".into()),
                Ok(n) => {
                    for line in reader.push(&buf[..n]) {
                        match line.and_then(|l| Message::parse(&l)) {
                            Ok(m) => {
                                stats.replies.fetch_add(1, Ordering::Relaxed);
                                if let Message::Applied(a) = &m {
                                    stats.on_applied(
                                        a,
                                        vcpu_monitor::monotonic_ns(),
                                        (period * HELD_PERIODS).as_nanos() as u64,
                                    );
                                }
                                debug!(?m, "host says");
                            }
                            Err(e) => warn!("bad line from the host: {e}"),
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Some(format!("read: {e}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_vcpus_last_a_few_periods_and_old_agents_hold_none() {
        let stats = ChannelStats::default();
        let weight = |cpu, held| proto::VcpuWeight {
            cpu,
            weight: 1.0,
            held,
        };
        // An agent that predates `held` (or holds nothing) leaves the daemon its moves.
        let plain = proto::Applied {
            seq: 1,
            vcpus: vec![weight(0, false), weight(1, false)],
        };
        stats.on_applied(&plain, 1_000, 300);
        assert!(stats.held_vcpus(1_000).is_empty());
        let held = proto::Applied {
            seq: 2,
            vcpus: vec![weight(0, false), weight(1, true), weight(99, true)],
        };
        stats.on_applied(&held, 2_000, 300);
        assert_eq!(stats.held_vcpus(2_100), vec![1], "vCPU 99 is past the mask");
        // A reply that holds nothing does not cut the hold short (one report without
        // the reader must not start a round of moves)...
        stats.on_applied(&plain, 2_200, 300);
        assert_eq!(stats.held_vcpus(2_250), vec![1]);
        // ...but the hold ends when the host stops renewing it.
        assert!(stats.held_vcpus(2_300).is_empty());
        // A host that moves its hold: the old vCPU stands until its own deadline (a late
        // reply must not unpin a task just anchored), the new one from its first reply.
        let on = |seq, cpu| proto::Applied {
            seq,
            vcpus: vec![weight(0, cpu == 0), weight(1, cpu == 1)],
        };
        stats.on_applied(&on(3, 0), 3_000, 300);
        stats.on_applied(&on(4, 1), 3_100, 300);
        assert_eq!(stats.held_vcpus(3_200), vec![0, 1]);
        assert_eq!(stats.held_vcpus(3_300), vec![1]);
        assert!(stats.held_vcpus(3_400).is_empty());
    }

    #[test]
    fn a_guest_with_nothing_to_say_reports_seldom_and_says_when_io_ends() {
        let busy = build_report(
            1,
            Duration::from_millis(100),
            &[VcpuSample::default()],
            &[VcpuSample {
                completions: 5,
                ..Default::default()
            }],
        );
        let idle = build_report(2, Duration::from_millis(100), &[], &[VcpuSample::default()]);
        let tasks_only = build_report(
            3,
            Duration::from_millis(100),
            &[],
            &[VcpuSample {
                io_bound_tasks: 1,
                ..Default::default()
            }],
        );
        assert!(!says_nothing(&busy) && !says_nothing(&tasks_only));
        assert!(says_nothing(&idle));
        // I/O going on: every period.
        assert!(worth_sending(false, false, 1) && worth_sending(false, true, 1));
        // The first quiet report after I/O goes out at once, the next ones only as a
        // heartbeat every QUIET_EVERY periods.
        assert!(worth_sending(true, false, 1));
        assert!(!worth_sending(true, true, 1));
        assert!(!worth_sending(true, true, QUIET_EVERY - 1));
        assert!(worth_sending(true, true, QUIET_EVERY));
    }

    #[test]
    fn report_is_deltas_over_the_period() {
        let prev = vec![VcpuSample {
            cpu: 0,
            completions: 100,
            inactive_total_ns: 1_000_000,
            ..Default::default()
        }];
        let now = vec![
            VcpuSample {
                cpu: 0,
                completions: 350,
                ema_interval_ns: 80_000,
                io_bound_tasks: 2,
                io_partner_tasks: 1,
                inactive_total_ns: 51_000_000,
                est_slice_ns: 9_900_000,
            },
            VcpuSample {
                cpu: 1,
                completions: 7,
                ..Default::default()
            },
        ];
        let r = build_report(3, Duration::from_millis(100), &prev, &now);
        assert_eq!(r.seq, 3);
        assert_eq!(r.period_ms, 100);
        assert_eq!(r.vcpus[0].io_completions, 250);
        assert!((r.vcpus[0].inactive_ratio - 0.5).abs() < 1e-9);
        assert_eq!(r.vcpus[0].io_interval_ema_us, 80.0);
        assert_eq!(r.vcpus[0].slice_estimate_us, 9_900.0);
        assert_eq!(
            (r.vcpus[0].io_partner_tasks, r.vcpus[1].io_partner_tasks),
            (1, 0)
        );
        // A vCPU first seen now reports no delta rather than its whole history.
        assert_eq!(r.vcpus[1].io_completions, 0);
        // And the result passes the host's validation.
        assert!(Message::parse(Message::Report(r).to_line().trim_end().as_bytes()).is_ok());
    }

    /// A port that takes `room` bytes per write call, then would block.
    struct Port {
        out: Vec<u8>,
        room: usize,
    }

    impl Write for Port {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(ErrorKind::WouldBlock.into());
            }
            let n = b.len().min(self.room);
            self.out.extend_from_slice(&b[..n]);
            self.room -= n;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn report(seq: u64) -> Message {
        Message::Report(build_report(seq, Duration::from_millis(100), &[], &[]))
    }

    #[test]
    fn a_line_taken_in_part_is_finished_before_the_next_and_never_interleaved() {
        let mut w = LineWriter::default();
        let mut port = Port {
            out: Vec::new(),
            room: 10,
        };
        assert!(
            w.send(&mut port, &report(1)).unwrap(),
            "part of it went out"
        );
        // Still full: the rest stays pending and the next line is dropped whole.
        assert!(!w.send(&mut port, &report(2)).unwrap());
        port.room = 4096;
        assert!(w.send(&mut port, &report(3)).unwrap());
        let text = String::from_utf8(port.out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        for (l, seq) in lines.iter().zip([1, 3]) {
            match Message::parse(l.as_bytes()).unwrap() {
                Message::Report(r) => assert_eq!(r.seq, seq),
                m => panic!("{m:?}"),
            }
        }
    }

    #[test]
    fn a_port_that_takes_nothing_sends_nothing() {
        let mut w = LineWriter::default();
        let mut port = Port {
            out: Vec::new(),
            room: 0,
        };
        assert!(!w.send(&mut port, &report(1)).unwrap());
        assert!(w.pending.is_empty());
    }
}

//! The host channel (guest side): every period, one `report` line per the wire protocol
//! (`proto`) on the virtio port `org.vmigrater.hint.0`, after a `hello`. Runs on its own
//! thread with non-blocking I/O: a slow or absent host can never delay a migration — a
//! report that cannot be written at once is dropped. Without the port the daemon runs
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
}

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
                    inactive_ratio: (inactive as f64 / period_ns).clamp(0.0, 1.0),
                    slice_estimate_us: s.est_slice_ns as f64 / 1e3,
                }
            })
            .collect(),
    }
}

fn open_port(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

/// Writes a whole line or nothing that matters: a short or blocked write is a drop.
fn send(port: &mut File, msg: &Message) -> std::io::Result<bool> {
    let line = msg.to_line();
    match port.write(line.as_bytes()) {
        Ok(n) if n == line.len() => Ok(true),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e),
    }
}

/// The channel thread's body; returns when `stop` is set.
pub fn run(
    path: &Path,
    period: Duration,
    sample: impl Fn() -> Vec<VcpuSample>,
    stats: &ChannelStats,
    stop: &control::Stop,
) {
    let mut said_missing = false;
    let mut backoff = Duration::from_millis(100);
    while !stop.is_set() {
        let mut port = match open_port(path) {
            Ok(f) => f,
            Err(e) => {
                if !said_missing {
                    info!(path = %path.display(), "no host channel ({e}): running standalone");
                    said_missing = true;
                }
                if stop.nap(backoff) {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        info!(path = %path.display(), "host channel open");
        let vcpus = sample().len().max(1) as u32;
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            agent: format!("vmigrater {}", env!("CARGO_PKG_VERSION")),
            vcpus,
        });
        if let Err(e) = send(&mut port, &hello) {
            debug!("hello failed: {e}");
            if stop.nap(backoff) {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        stats.connected.store(true, Ordering::Relaxed);
        let reason = session(&mut port, period, &sample, stats, stop);
        stats.connected.store(false, Ordering::Relaxed);
        match reason {
            None => return,
            Some(why) => {
                info!("host channel closed ({why}); reconnecting");
                if stop.nap(backoff) {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Reports until the host end closes (returns the reason) or `stop` (returns None).
fn session(
    port: &mut File,
    period: Duration,
    sample: &impl Fn() -> Vec<VcpuSample>,
    stats: &ChannelStats,
    stop: &control::Stop,
) -> Option<String> {
    let mut reader = LineReader::new();
    let mut prev = sample();
    let mut seq = 0u64;
    let mut buf = [0u8; 4096];
    loop {
        if stop.nap(period) {
            return None;
        }
        let now = sample();
        seq += 1;
        let report = Message::Report(build_report(seq, period, &prev, &now));
        prev = now;
        match send(port, &report) {
            Ok(true) => {
                stats.reports_sent.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {
                stats.reports_dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return Some(format!("write: {e}")),
        }
        loop {
            match port.read(&mut buf) {
                Ok(0) => return Some("EOF".into()),
                Ok(n) => {
                    for line in reader.push(&buf[..n]) {
                        match line.and_then(|l| Message::parse(&l)) {
                            Ok(m) => {
                                stats.replies.fetch_add(1, Ordering::Relaxed);
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
        // A vCPU first seen now reports no delta rather than its whole history.
        assert_eq!(r.vcpus[1].io_completions, 0);
        // And the result passes the host's validation.
        assert!(Message::parse(Message::Report(r).to_line().trim_end().as_bytes()).is_ok());
    }
}

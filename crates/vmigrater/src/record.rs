//! `vmigrater record`: this guest's vCPU deschedules as the kernel monitor sees them (a
//! kernel timer that fires late with no sign of life since its expiry; windows of 2 ms and
//! more), written as `CPU START_US END_US` lines counted from the start of the recording.
//! That is the replay form of the hard-IRQ testbed (`irq-steal`'s `replay:PATH`, and
//! `make bench-apps APPS_ARGS="--only replay:PATH"`), so that the deschedules of a user's
//! own host can be played back there. It watches only: it never moves a task. Root (BPF).

use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use vcpu_monitor::{monotonic_ns, Demand, KernelMonitor, TickEvent, TickHook, VcpuBoard};

use crate::config::Config;

/// One deschedule of a vCPU, on the monotonic clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Out {
    pub cpu: usize,
    pub start_ns: u64,
    pub end_ns: u64,
}

#[derive(Default)]
struct Recorder {
    outs: Mutex<Vec<Out>>,
}

impl TickHook for Recorder {
    fn on_tick(&self, cpu: usize, event: TickEvent, _board: &VcpuBoard, _now_ns: u64) {
        // When the vCPU came back, not when the event thread got to it (the thread may
        // itself wait for a vCPU the host took).
        if let TickEvent::Resumed {
            inactive_ns,
            back_ns,
        } = event
        {
            let out = Out {
                cpu,
                start_ns: back_ns.saturating_sub(inactive_ns),
                end_ns: back_ns,
            };
            self.outs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(out);
        }
    }

    /// No task is held anywhere, so every vCPU's return wakes the recorder (the daemon's
    /// hook is woken only by the vCPUs that do not hold its tasks).
    fn holds_tasks(&self, _cpu: usize) -> bool {
        false
    }
}

/// The replay text of `outs` recorded over `length` from `t0_ns`: `header` as comments,
/// then a line per window in time order, in µs from `t0_ns`. Windows are cut to the
/// recording, and the windows of one vCPU that overlap are joined (the replay refuses
/// overlapping windows; a report of the event thread can come late).
pub fn replay_text(outs: &[Out], t0_ns: u64, length: Duration, header: &str) -> String {
    let end = t0_ns + length.as_nanos() as u64;
    let mut cut: Vec<Out> = outs
        .iter()
        .filter(|o| o.end_ns > t0_ns && o.start_ns < end)
        .map(|o| Out {
            cpu: o.cpu,
            start_ns: o.start_ns.max(t0_ns),
            end_ns: o.end_ns.min(end),
        })
        .collect();
    cut.sort_by_key(|o| (o.cpu, o.start_ns));
    let mut joined: Vec<Out> = Vec::with_capacity(cut.len());
    for o in cut {
        match joined.last_mut() {
            Some(last) if last.cpu == o.cpu && o.start_ns <= last.end_ns => {
                last.end_ns = last.end_ns.max(o.end_ns);
            }
            _ => joined.push(o),
        }
    }
    joined.sort_by_key(|o| (o.start_ns, o.cpu));
    let mut text = String::new();
    for line in header.lines() {
        let _ = writeln!(text, "# {line}");
    }
    let us = |ns: u64| (ns - t0_ns) / 1_000;
    for o in joined {
        let (start, stop) = (us(o.start_ns), us(o.end_ns));
        if stop > start {
            let _ = writeln!(text, "{} {start} {stop}", o.cpu);
        }
    }
    text
}

/// Records for `length` and writes the replay text to `out` (standard output when `None`).
pub fn run(cfg: &Config, length: Duration, out: Option<&Path>) -> Result<()> {
    let mon_cfg = crate::settings::monitor_config(cfg)?;
    let cpus = mon_cfg.cpus.clone();
    let board = Arc::new(VcpuBoard::new(&cpus, &mon_cfg));
    // The programs raise gap events only while something asks for them.
    board.set_demand(Demand::Active);
    let recorder = Arc::new(Recorder::default());
    let monitor = KernelMonitor::start(
        mon_cfg,
        board,
        recorder.clone(),
        Duration::from_micros(cfg.advanced.migration.push_threshold_us),
    )
    .context("starting the kernel-timer monitor (root, and a kernel with BTF: `vmigrater check` says more)")?;
    let t0 = monotonic_ns();
    eprintln!(
        "recording the deschedules of vCPUs {cpus:?} for {} s",
        length.as_secs()
    );
    std::thread::sleep(length);
    monitor.stop();
    let outs = std::mem::take(&mut *recorder.outs.lock().unwrap_or_else(PoisonError::into_inner));
    let header = format!(
        "vmigrater record: the deschedules of vCPUs {cpus:?} over {} s, as the kernel monitor \
         saw them (late kernel timers; windows of 2 ms and more)\nCPU START_US END_US, from \
         the start of the recording",
        length.as_secs()
    );
    let text = replay_text(&outs, t0, length, &header);
    match out {
        Some(p) => std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?,
        None => print!("{text}"),
    }
    let windows = text.lines().filter(|l| !l.starts_with('#')).count();
    eprintln!("{windows} windows recorded");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn windows_are_cut_to_the_recording_joined_per_vcpu_and_written_in_time_order() {
        let t0 = 1_000 * MS;
        let o = |cpu, start_ms: u64, end_ms: u64| Out {
            cpu,
            start_ns: t0 + start_ms * MS,
            end_ns: t0 + end_ms * MS,
        };
        let outs = [
            o(1, 30, 40),
            // Began before the recording: cut at its start.
            Out {
                cpu: 0,
                start_ns: t0 - 5 * MS,
                end_ns: t0 + 3 * MS,
            },
            o(0, 20, 30),
            // Reported late, overlapping the one before on its vCPU: joined.
            o(0, 28, 35),
            // Runs past the end: cut there; after the end: left out.
            o(1, 95, 120),
            o(1, 130, 140),
        ];
        let text = replay_text(&outs, t0, Duration::from_millis(100), "a\nb");
        assert_eq!(
            text,
            "# a\n# b\n0 0 3000\n0 20000 35000\n1 30000 40000\n1 95000 100000\n"
        );
    }
}

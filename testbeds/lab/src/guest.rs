//! The guest daemon and workloads of a lab VM, driven through its command port: start
//! `vmigrater` and wait until it answers, ask its status, stop it, and wait for a JSON
//! result file a background workload writes.

use crate::vm::Vm;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::time::{Duration, Instant};

/// Starts `vmigrater run` (with `--dry-run` if asked) in the background and waits until its
/// status socket answers (BPF loading takes seconds under TCG); the daemon's log is in
/// /tmp/vmigrater.log of the guest.
pub fn start_daemon(vm: &mut Vm, dry_run: bool) -> Result<()> {
    start_daemon_with(vm, if dry_run { "--dry-run" } else { "" })
}

/// `start_daemon` with extra arguments of `run` (e.g. `--config FILE`).
pub fn start_daemon_with(vm: &mut Vm, args: &str) -> Result<()> {
    start_daemon_bin(vm, "vmigrater", args)
}

/// The lab's daemon on the host's known schedule (`vmigrater-oracle ARGS`).
pub fn start_oracle_daemon(vm: &mut Vm, args: &str) -> Result<()> {
    start(vm, &format!("vmigrater-oracle {args}"))
}

/// `start_daemon_with` the daemon binary `bin` (another build, see `Options::daemon_bins`).
pub fn start_daemon_bin(vm: &mut Vm, bin: &str, args: &str) -> Result<()> {
    start(vm, &format!("{bin} run {args}"))
}

/// Starts the daemon command `cmd` in the background and waits until it answers `status`.
fn start(vm: &mut Vm, cmd: &str) -> Result<()> {
    vm.sh(
        &format!("setsid {cmd} </dev/null >/tmp/vmigrater.log 2>&1 &"),
        Duration::from_secs(20),
    )?;
    let t0 = Instant::now();
    while daemon_status(vm).is_none() {
        if t0.elapsed() > Duration::from_secs(180) {
            bail!(
                "guest daemon not up after 180 s: {}",
                vm.sh("cat /tmp/vmigrater.log", Duration::from_secs(20))?
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok(())
}

/// `vmigrater status --json`, or None while the daemon does not answer.
pub fn daemon_status(vm: &mut Vm) -> Option<Value> {
    let out = vm
        .sh("vmigrater status --json", Duration::from_secs(60))
        .ok()?;
    serde_json::from_str(&out).ok()
}

/// SIGTERM and wait: the daemon restores every mask it changed, then exits. The guest's
/// PID 1 (the command agent's shell) does not reap orphans, so an exited daemon stays a
/// zombie and only live processes count.
pub fn stop_daemon(vm: &mut Vm) -> Result<()> {
    vm.sh(
        "live() { for p in $(pidof vmigrater); do grep -q '^State:.*Z' /proc/$p/status || return 0; done; return 1; }; \
         kill $(pidof vmigrater) 2>/dev/null; for i in $(seq 1 600); do live || exit 0; sleep 0.1; done; exit 1",
        Duration::from_secs(120),
    )
    .map(drop)
    .context("guest daemon still running 60 s after SIGTERM")
}

/// Waits until the guest file `path` holds a JSON document (a workload prints its result
/// at the end); on timeout the error carries `path.err`.
pub fn read_json(vm: &mut Vm, path: &str, timeout: Duration) -> Result<Value> {
    let t0 = Instant::now();
    loop {
        let out = vm.sh(
            &format!("cat {path} 2>/dev/null; true"),
            Duration::from_secs(60),
        )?;
        if let Ok(v) = serde_json::from_str::<Value>(out.trim()) {
            return Ok(v);
        }
        if t0.elapsed() > timeout {
            let err = vm.sh(&format!("cat {path}.err; true"), Duration::from_secs(20))?;
            bail!("{}: no result in {path} after {timeout:?}: {err}", vm.name);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The guest's CLOCK_MONOTONIC minus the host's, ns, from `/proc/timer_list`'s "now at"
/// read over the command port; the best of five round trips (its uncertainty is half
/// the round trip, returned as the second value).
pub fn clock_offset(vm: &mut Vm) -> Result<(i64, u64)> {
    let mut best: Option<(i64, u64)> = None;
    for _ in 0..5 {
        let t0 = os_layer::monotonic_ns();
        let out = vm.sh(
            "grep -m1 '^now at' /proc/timer_list",
            Duration::from_secs(20),
        )?;
        let t1 = os_layer::monotonic_ns();
        let guest: u64 = out
            .split_whitespace()
            .nth(2)
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no time in /proc/timer_list's {out:?}"))?;
        let rtt = t1 - t0;
        let offset = guest as i64 - (t0 + rtt / 2) as i64;
        if best.is_none_or(|(_, r)| rtt < r) {
            best = Some((offset, rtt));
        }
    }
    let (offset, rtt) = best.expect("five tries");
    Ok((offset, rtt / 2))
}

/// Writes `text` to the guest file `path` (one shell line: comment lines are dropped,
/// quotes and newlines escaped).
pub fn write_file(vm: &mut Vm, path: &str, text: &str) -> Result<()> {
    let body: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| l.replace('\\', "\\\\").replace('\'', "'\\''") + "\\n")
        .collect();
    vm.sh(
        &format!("printf '%b' '{body}' > {path}"),
        Duration::from_secs(20),
    )
    .map(drop)
}

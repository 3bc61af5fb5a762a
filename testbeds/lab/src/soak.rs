//! The soak and fault-injection pass: both programs together for a long time in
//! the main scenario (VM A with the guest daemon and a streaming workload, hog VM B, the
//! host agent steering both), memory and file descriptors of each program sampled, and
//! faults injected on a cycle while VM A's I/O keeps streaming:
//!
//! - `agent_kill9`: the agent is SIGKILLed and started again. The new one must first put
//!   back what the dead one left changed (its journal), and the guest must reconnect.
//! - `agent_restart`: SIGTERM; every vCPU thread must be back to what the lab set (nice 0,
//!   the 11 ms slice, its pinning) before the next agent starts; the guest reconnects.
//! - `port_replug`: the virtio port is hot-unplugged under the running guest daemon and
//!   plugged back; the daemon keeps serving and reconnects.
//!
//! `vmigrater-lab soak` runs it for an hour (`make soak`); `tests/lab.rs` runs each fault
//! once in CI.

use crate::bench::{self, AgentProc, Guest, Mode, Options, Scenario, HOST_SLICE_NS};
use crate::guest;
use crate::image::{self, Kernel};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The budget for either program's resident memory.
pub const RSS_LIMIT_KB: u64 = 32 * 1024;
/// How long a guest may take to talk to the agent again after a fault: the guest's
/// reconnect back-off is at most 5 s, the agent's first period follows its start.
pub const RECONNECT_LIMIT: Duration = Duration::from_secs(20);

pub struct SoakOptions {
    /// Names the lab's run directory and disks (`run/<name>`), so two soaks never share.
    pub name: &'static str,
    pub bin_dir: PathBuf,
    /// Length of the whole soak.
    pub duration: Duration,
    /// Between two samples of memory and descriptors.
    pub sample_every: Duration,
    /// Between two faults (they cycle through [`FAULTS`]); zero: no faults.
    pub fault_every: Duration,
}

/// Samples needed before memory growth is judged.
pub const MIN_FLAT_SAMPLES: usize = 20;

pub const FAULTS: [&str; 3] = ["agent_kill9", "agent_restart", "port_replug"];

#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub agent_rss_kb: u64,
    pub agent_fds: u64,
    pub agent_threads: u64,
    pub agent_periods: u64,
    pub guest_rss_kb: u64,
    pub guest_fds: u64,
    pub guest_threads: u64,
    pub guest_reports_sent: u64,
    pub guest_replies: u64,
    pub guest_migrations: u64,
    pub guest_connected: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Fault {
    pub kind: &'static str,
    pub t_s: f64,
    /// From the fault's end (agent started again, port plugged back) until the guest's
    /// replies grow again and the agent counts new reports from VM A.
    pub reconnect_s: f64,
    /// vCPU threads the agent had left changed when it was killed, and how many the
    /// next agent said it put back (`agent_kill9`).
    pub stale_threads: usize,
    pub put_back: usize,
    pub detail: String,
}

#[derive(Debug, Serialize)]
pub struct Verdict {
    pub agent_rss_max_kb: u64,
    pub guest_rss_max_kb: u64,
    /// Median RSS of the last quarter of the samples minus that of the first quarter
    /// after the first (warm-up) one, kB: growth, if any. None below [`MIN_FLAT_SAMPLES`]:
    /// a short run cannot tell a leak from warming up.
    pub agent_rss_growth_kb: Option<i64>,
    pub guest_rss_growth_kb: Option<i64>,
    pub agent_fds_min: u64,
    pub agent_fds_max: u64,
    pub guest_fds_min: u64,
    pub guest_fds_max: u64,
    pub reconnect_max_s: f64,
    pub failures: Vec<String>,
}

/// The soak's lab: VM A (2 vCPUs, guest daemon, workload) and hog VM B on the 2 host CPUs.
pub struct Lab {
    guests: Vec<Guest>,
    agent: Option<AgentProc>,
    dir: PathBuf,
    bin_dir: PathBuf,
    starts: usize,
}

fn scenario() -> Scenario {
    Scenario {
        name: "soak",
        what: "the main scenario, both programs",
        a_vcpus: 2,
        hog_vms: 1,
        hog_vcpus: 2,
        host_steal: &[],
        pinned: true,
        modes: vec![Mode::Both],
    }
}

impl Lab {
    /// Boots both VMs, starts VM A's daemon and a workload of `workload` length in both,
    /// and the agent.
    pub fn start(
        name: &str,
        bin_dir: &Path,
        guest_config: &str,
        workload: Duration,
    ) -> Result<Lab> {
        let lab = image::lab_dir();
        let kernel = Kernel::find(&lab)?;
        let dir = lab.join("run").join(format!("{name}-host"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let opts = Options {
            bin_dir: bin_dir.to_path_buf(),
            daemon: None,
            secs: workload.as_secs(),
            reps: 1,
            warmup_secs: 0,
            guest_config: Some(guest_config.to_string()),
            modes: vec![],
            variants: vec![],
            agent_variants: vec![],
            both_variants: vec![],
            daemon_bins: vec![],
        };
        let mut guests = bench::boot(&scenario(), &opts, &kernel, &lab, name)?;
        let ms = workload.as_millis() + 60_000;
        for (i, g) in guests.iter_mut().enumerate() {
            let line = if i == 0 {
                format!(
                    "setsid vmigrater-workload --file /dev/vda --readers 1 --seq-readers 1 --hogs {} --duration-ms {ms} </dev/null >/tmp/w.json 2>/tmp/w.json.err &",
                    g.vcpus.len()
                )
            } else {
                format!(
                    "setsid vmigrater-workload --file /dev/null --readers 0 --hogs {} --duration-ms {ms} </dev/null >/tmp/w.json 2>/tmp/w.json.err &",
                    g.vcpus.len()
                )
            };
            g.vm.sh(&line, Duration::from_secs(60))?;
        }
        guest::start_daemon(&mut guests[0].vm, false)?;
        let mut lab = Lab {
            guests,
            agent: None,
            dir,
            bin_dir: bin_dir.to_path_buf(),
            starts: 0,
        };
        lab.start_agent()?;
        Ok(lab)
    }

    fn agent_dir(&self) -> PathBuf {
        self.dir.join("agent")
    }

    /// Starts the agent (keeping the previous run's log as `agent.log.N`).
    fn start_agent(&mut self) -> Result<()> {
        let dir = self.agent_dir();
        let log = dir.join("agent.log");
        if log.exists() {
            std::fs::rename(&log, dir.join(format!("agent.log.{}", self.starts)))?;
        }
        self.starts += 1;
        let all: Vec<&Guest> = self.guests.iter().collect();
        self.agent = Some(bench::start_agent(&all, &dir, &self.bin_dir, "", false)?);
        Ok(())
    }

    fn agent_status(&self) -> Option<Value> {
        bench::agent_status(&self.agent_dir(), &self.bin_dir)
    }

    /// VM A's reports as the agent counts them, if it answers.
    fn agent_reports(&self) -> Option<u64> {
        let s = self.agent_status()?;
        s["vms"].as_array()?.iter().find(|v| v["name"] == "a")?["reports"].as_u64()
    }

    /// vCPU threads of every VM whose nice or slice is not what the lab set (the agent's
    /// changes), as "vm/vcpu".
    fn changed_threads(&self) -> Vec<String> {
        let mut out = Vec::new();
        for g in &self.guests {
            for (v, &t) in g.vcpus.iter().enumerate() {
                let attr = os_layer::sched::get_attr(t);
                let changed =
                    attr.is_ok_and(|a| a.sched_nice != 0 || a.sched_runtime != HOST_SLICE_NS);
                let pinned = os_layer::get_cpus(t).ok();
                if changed || pinned != Some(vec![v % bench::HOST_CPUS]) {
                    out.push(format!("{}/{v}", g.vm.name));
                }
            }
        }
        out
    }

    /// Waits until VM A and the agent talk again: the guest's replies and the agent's
    /// count of VM A's reports both grow. Returns how long that took.
    fn wait_reconnect(&mut self) -> Result<f64> {
        let t0 = Instant::now();
        let replies0 = self.guest_status()?["channel_replies"]
            .as_u64()
            .unwrap_or(0);
        let reports0 = self.agent_reports().unwrap_or(0);
        loop {
            let g = self.guest_status()?;
            let replies = g["channel_replies"].as_u64().unwrap_or(0);
            let reports = self.agent_reports().unwrap_or(0);
            if g["channel_connected"] == true && replies > replies0 && reports > reports0 {
                return Ok(t0.elapsed().as_secs_f64());
            }
            if t0.elapsed() > RECONNECT_LIMIT {
                bail!(
                    "VM A and the agent did not talk again within {RECONNECT_LIMIT:?}: guest connected {} replies {replies0} -> {replies}, agent reports {reports0} -> {reports}",
                    g["channel_connected"]
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn guest_status(&mut self) -> Result<Value> {
        guest::daemon_status(&mut self.guests[0].vm)
            .context("the guest daemon does not answer its status")
    }

    /// Runs one fault, checks what it must leave behind, and how long reconnecting took.
    pub fn fault(&mut self, kind: &'static str, t_s: f64) -> Result<Fault> {
        let mut f = Fault {
            kind,
            t_s,
            reconnect_s: 0.0,
            stale_threads: 0,
            put_back: 0,
            detail: String::new(),
        };
        match kind {
            "agent_kill9" => {
                self.agent.take().context("no agent")?.kill9()?;
                f.stale_threads = self.changed_threads().len();
                std::thread::sleep(Duration::from_secs(2));
                self.start_agent()?;
                let log = std::fs::read_to_string(self.agent_dir().join("agent.log"))?;
                f.put_back = log
                    .lines()
                    .filter(|l| l.contains("journal: restored a vCPU thread"))
                    .count();
                if f.put_back < f.stale_threads {
                    bail!(
                        "the agent left {} vCPU threads changed at SIGKILL, the next one put back only {}",
                        f.stale_threads,
                        f.put_back
                    );
                }
            }
            "agent_restart" => {
                self.agent.take().context("no agent")?.stop()?;
                let changed = self.changed_threads();
                if !changed.is_empty() {
                    bail!("after SIGTERM the agent left vCPU threads changed: {changed:?}");
                }
                std::thread::sleep(Duration::from_secs(2));
                self.start_agent()?;
            }
            "port_replug" => {
                let vm = &mut self.guests[0].vm;
                vm.unplug_hint()?;
                // The daemon notices (its port read fails) and keeps serving meanwhile.
                let t0 = Instant::now();
                loop {
                    let s = self.guest_status()?;
                    if s["channel_connected"] == false {
                        break;
                    }
                    if t0.elapsed() > Duration::from_secs(10) {
                        bail!("the guest daemon still says connected 10 s after the port left");
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                std::thread::sleep(Duration::from_secs(3));
                self.guests[0].vm.replug_hint()?;
            }
            other => bail!("unknown fault {other:?}"),
        }
        f.reconnect_s = self.wait_reconnect()?;
        Ok(f)
    }

    pub fn sample(&mut self, t_s: f64) -> Result<Sample> {
        let agent_pid = self.agent.as_ref().map_or(0, AgentProc::id);
        let (agent_rss_kb, agent_threads) = proc_status(
            &std::fs::read_to_string(format!("/proc/{agent_pid}/status")).unwrap_or_default(),
        );
        let agent_fds = std::fs::read_dir(format!("/proc/{agent_pid}/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        let agent_periods = self
            .agent_status()
            .and_then(|s| s["periods"].as_u64())
            .unwrap_or(0);
        let vm = &mut self.guests[0].vm;
        let out = vm.sh(
            "p=$(pidof vmigrater); cat /proc/$p/status; echo fds $(ls /proc/$p/fd | wc -l)",
            Duration::from_secs(60),
        )?;
        let (guest_rss_kb, guest_threads) = proc_status(&out);
        let guest_fds = out
            .lines()
            .find_map(|l| l.strip_prefix("fds "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        let g = self.guest_status()?;
        Ok(Sample {
            t_s,
            agent_rss_kb,
            agent_fds,
            agent_threads,
            agent_periods,
            guest_rss_kb,
            guest_fds,
            guest_threads,
            guest_reports_sent: g["channel_reports_sent"].as_u64().unwrap_or(0),
            guest_replies: g["channel_replies"].as_u64().unwrap_or(0),
            guest_migrations: g["migrations"].as_u64().unwrap_or(0),
            guest_connected: g["channel_connected"] == true,
        })
    }

    /// Stops the agent (it must restore everything) and the guest daemon (it must exit on
    /// SIGTERM); the VMs go with `self`.
    pub fn finish(mut self) -> Result<()> {
        self.agent.take().context("no agent")?.stop()?;
        let changed = self.changed_threads();
        if !changed.is_empty() {
            bail!("after the last SIGTERM the agent left vCPU threads changed: {changed:?}");
        }
        guest::stop_daemon(&mut self.guests[0].vm)
    }
}

/// (VmRSS kB, Threads) of a `/proc/<pid>/status` text.
fn proc_status(text: &str) -> (u64, u64) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Median of `xs` (0 when empty).
fn median(mut xs: Vec<u64>) -> u64 {
    xs.sort_unstable();
    xs.get(xs.len() / 2).copied().unwrap_or(0)
}

/// What the issue asks of a soak: each program within [`RSS_LIMIT_KB`], memory and
/// descriptors flat, every fault reconnected in time. Pure.
pub fn judge(samples: &[Sample], faults: &[Fault]) -> Verdict {
    let rss = |f: fn(&Sample) -> u64| samples.iter().map(f).max().unwrap_or(0);
    // Growth: last quarter against the first quarter, the first sample (start-up) left out.
    let growth = |f: fn(&Sample) -> u64| -> Option<i64> {
        // Samples while the agent was down read 0: not a size.
        let body: Vec<u64> = samples.iter().skip(1).map(f).filter(|&x| x > 0).collect();
        if body.len() < MIN_FLAT_SAMPLES {
            return None;
        }
        let q = body.len() / 4;
        Some(median(body[body.len() - q..].to_vec()) as i64 - median(body[..q].to_vec()) as i64)
    };
    let span = |f: fn(&Sample) -> u64| {
        // Samples while the agent was down read 0: not a descriptor count.
        let xs: Vec<u64> = samples.iter().map(f).filter(|&x| x > 0).collect();
        (
            xs.iter().copied().min().unwrap_or(0),
            xs.iter().copied().max().unwrap_or(0),
        )
    };
    let (agent_fds_min, agent_fds_max) = span(|s| s.agent_fds);
    let (guest_fds_min, guest_fds_max) = span(|s| s.guest_fds);
    let mut v = Verdict {
        agent_rss_max_kb: rss(|s| s.agent_rss_kb),
        guest_rss_max_kb: rss(|s| s.guest_rss_kb),
        agent_rss_growth_kb: growth(|s| s.agent_rss_kb),
        guest_rss_growth_kb: growth(|s| s.guest_rss_kb),
        agent_fds_min,
        agent_fds_max,
        guest_fds_min,
        guest_fds_max,
        reconnect_max_s: faults.iter().map(|f| f.reconnect_s).fold(0.0, f64::max),
        failures: Vec::new(),
    };
    for (who, max, growth) in [
        ("agent", v.agent_rss_max_kb, v.agent_rss_growth_kb),
        ("guest daemon", v.guest_rss_max_kb, v.guest_rss_growth_kb),
    ] {
        if max > RSS_LIMIT_KB {
            v.failures
                .push(format!("{who} RSS {max} kB is over {RSS_LIMIT_KB} kB"));
        }
        // Allocator noise is well under a megabyte; a leak of one object per period
        // over an hour is not.
        if let Some(growth) = growth.filter(|&g| g > 1024) {
            v.failures.push(format!(
                "{who} RSS grew {growth} kB from the first quarter to the last"
            ));
        }
    }
    // A descriptor per connection at most comes and goes (status queries, the agent's
    // guest sockets), and in the guest daemon the block programs' links (one per hook, at
    // most 5), which come off while nothing is to gain and back when something is; a leak
    // grows with every period or fault.
    for (who, lo, hi, comes_and_goes) in [
        ("agent", v.agent_fds_min, v.agent_fds_max, 4),
        ("guest daemon", v.guest_fds_min, v.guest_fds_max, 4 + 5),
    ] {
        if hi > lo + comes_and_goes {
            v.failures
                .push(format!("{who} descriptors ranged {lo}..{hi}: not flat"));
        }
    }
    v
}

/// The soak: samples every `sample_every`, a fault every `fault_every`, for `duration`.
/// Returns the JSON document (samples, faults, verdict); the verdict's failures are the
/// caller's to act on.
pub fn soak(opts: &SoakOptions, guest_config: &str) -> Result<Value> {
    let mut lab = Lab::start(opts.name, &opts.bin_dir, guest_config, opts.duration)?;
    let t0 = Instant::now();
    let mut samples = vec![lab.sample(0.0)?];
    let mut faults: Vec<Fault> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let mut next_sample = opts.sample_every;
    let mut next_fault = opts.fault_every;
    while t0.elapsed() < opts.duration {
        std::thread::sleep(Duration::from_millis(500));
        let now = t0.elapsed();
        if !opts.fault_every.is_zero() && now >= next_fault {
            let kind = FAULTS[faults.len() % FAULTS.len()];
            eprintln!("soak: {:6.0} s fault {kind}", now.as_secs_f64());
            match lab.fault(kind, now.as_secs_f64()) {
                Ok(f) => faults.push(f),
                Err(e) => {
                    // Recorded, and the soak goes on with a fresh agent if it has none.
                    errors.push(format!("{kind} at {:.0} s: {e:#}", now.as_secs_f64()));
                    faults.push(Fault {
                        kind,
                        t_s: now.as_secs_f64(),
                        reconnect_s: f64::NAN,
                        stale_threads: 0,
                        put_back: 0,
                        detail: format!("{e:#}"),
                    });
                    if lab.agent.is_none() {
                        lab.start_agent()?;
                    }
                }
            }
            next_fault += opts.fault_every;
        }
        if now >= next_sample {
            let s = lab.sample(t0.elapsed().as_secs_f64())?;
            eprintln!(
                "soak: {:6.0} s agent {} kB {} fds | guest {} kB {} fds, replies {}, migrations {}",
                s.t_s,
                s.agent_rss_kb,
                s.agent_fds,
                s.guest_rss_kb,
                s.guest_fds,
                s.guest_replies,
                s.guest_migrations
            );
            samples.push(s);
            next_sample += opts.sample_every;
        }
    }
    samples.push(lab.sample(t0.elapsed().as_secs_f64())?);
    if let Err(e) = lab.finish() {
        errors.push(format!("at the end: {e:#}"));
    }
    let mut verdict = judge(&samples, &faults);
    verdict.failures.extend(errors);
    Ok(serde_json::json!({
        "bench": "soak",
        "params": {
            "duration_s": opts.duration.as_secs_f64(),
            "sample_every_s": opts.sample_every.as_secs_f64(),
            "fault_every_s": opts.fault_every.as_secs_f64(),
            "scenario": "VM A 2 vCPUs (guest daemon; 4 KiB random + 1 MiB sequential O_DIRECT readers, a CPU hog per vCPU) + hog VM B 2 vCPUs on 2 host CPUs, host agent on both",
            "rss_limit_kb": RSS_LIMIT_KB,
            "reconnect_limit_s": RECONNECT_LIMIT.as_secs_f64(),
        },
        "verdict": verdict,
        "faults": faults,
        "samples": samples,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: f64, agent: u64, guest: u64, fds: u64) -> Sample {
        Sample {
            t_s: t,
            agent_rss_kb: agent,
            guest_rss_kb: guest,
            agent_fds: fds,
            guest_fds: fds,
            ..Sample::default()
        }
    }

    #[test]
    fn flat_memory_passes_and_a_leak_fails() {
        let flat: Vec<Sample> = (0..40)
            .map(|i| s(i as f64, 9000 + i % 3, 12000, 9))
            .collect();
        assert!(
            judge(&flat, &[]).failures.is_empty(),
            "{:?}",
            judge(&flat, &[])
        );
        let leak: Vec<Sample> = (0..40)
            .map(|i| s(i as f64, 9000 + i * 100, 12000, 9))
            .collect();
        let v = judge(&leak, &[]);
        assert_eq!(v.failures.len(), 1, "{v:?}");
        assert!(v.failures[0].contains("agent RSS grew"), "{v:?}");
    }

    #[test]
    fn the_memory_budget_and_descriptor_leaks_are_caught() {
        let short: Vec<Sample> = (0..8)
            .map(|i| s(i as f64, 9000 + i * 1000, 9000, 9))
            .collect();
        assert_eq!(
            judge(&short, &[]).agent_rss_growth_kb,
            None,
            "too short to judge"
        );
        let big: Vec<Sample> = (0..8).map(|i| s(i as f64, 9000, 40000, 9)).collect();
        let v = judge(&big, &[]);
        assert!(
            v.failures
                .iter()
                .any(|f| f.contains("guest daemon RSS 40000")),
            "{v:?}"
        );
        let fds: Vec<Sample> = (0..8).map(|i| s(i as f64, 9000, 9000, 9 + i)).collect();
        let v = judge(&fds, &[]);
        assert!(
            v.failures
                .iter()
                .any(|f| f.contains("descriptors ranged 9..16")),
            "{v:?}"
        );
    }

    #[test]
    fn status_fields_are_read_from_proc_text() {
        let text = "Name:\tvmigrater\nVmRSS:\t   11832 kB\nThreads:\t7\n";
        assert_eq!(proc_status(text), (11832, 7));
        assert_eq!(proc_status(""), (0, 0));
    }
}

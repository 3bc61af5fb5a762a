//! What the configuration means to each part of the daemon: the vCPU monitor's, the
//! classifier's and the engine's settings, and where the disks complete their requests.

use anyhow::Result;
use os_layer::Root;
use std::time::Duration;
use task_detector::queues::QueueMap;
use task_detector::ClassifierConfig;
use tracing::{info, warn};
use vcpu_monitor::MonitorConfig;

use crate::config::Config;
use migrater::completion::{prior, Home};
use migrater::engine::EngineConfig;
use migrater::guard::GuardConfig;
use migrater::sampling::Schedule;

pub fn monitor_config(cfg: &Config) -> Result<MonitorConfig> {
    let m = &cfg.advanced.monitor;
    let mut mc = MonitorConfig::default();
    if !cfg.monitor.cpus.is_empty() {
        mc.cpus = cfg.monitor.cpus.clone();
    }
    mc.period = Duration::from_micros(m.period_us);
    mc.probe_period = Duration::from_micros(m.probe_period_us);
    mc.idle_period = Duration::from_micros(m.idle_period_us);
    mc.min_gap_threshold = Duration::from_micros(m.min_gap_threshold_us);
    mc.default_slice = Duration::from_micros(m.default_slice_us);
    mc.rt_priority = (m.rt_priority > 0).then_some(m.rt_priority);
    anyhow::ensure!(!mc.cpus.is_empty(), "no CPUs to monitor");
    Ok(mc)
}

pub fn classifier_config(cfg: &Config) -> ClassifierConfig {
    ClassifierConfig {
        window_ns: cfg.advanced.detector.window_ms * 1_000_000,
        // A sample (250 ms) at the default window: a server in lock-step with deschedules
        // issues a request every period or two.
        max_window_ns: cfg.advanced.detector.window_ms * 50_000_000,
        ..ClassifierConfig::default()
    }
}

/// The engine's settings. `measures_contention`: whether the monitor's out times tell how
/// contended the vCPUs are.
pub fn engine_config(cfg: &Config, measures_contention: bool, cpus: &[usize]) -> EngineConfig {
    let d = &cfg.advanced.detector;
    EngineConfig {
        window: Duration::from_millis(d.window_ms),
        idle: Duration::from_millis(d.idle_poll_ms.max(d.window_ms)),
        own_pid: std::process::id(),
        exclude_comm: cfg.migration.exclude_comm.clone(),
        schedule: (d.sample_every_ms > 0).then(|| Schedule {
            length: Duration::from_millis(d.sample_ms),
            every: Duration::from_millis(d.sample_every_ms),
        }),
        detach_after: (d.detach_after_ms > 0).then(|| Duration::from_millis(d.detach_after_ms)),
        // Where nothing is descheduled there is nothing to gain: with the guard on (dry run
        // too, to show what would happen), no probe and no move there.
        gate_on_contention: cfg.migration.guard && measures_contention,
        guard: (cfg.migration.guard && !cfg.dry_run).then(|| GuardConfig {
            epoch: Duration::from_millis(cfg.advanced.migration.guard_epoch_ms),
            ..GuardConfig::default()
        }),
        completion_prior: if cfg.migration.follow_completions {
            completion_prior(cpus)
        } else {
            info!("migration.follow_completions = false: I/O-bound tasks follow the running vCPUs wherever their requests complete");
            Home::Unknown
        },
        follow_completions: cfg.migration.follow_completions,
        keep_partners: cfg.migration.keep_partners,
        own_moves: !cfg.migration.follow_host,
    }
}

/// Where block requests complete, by the kernel's queue and interrupt maps, said once.
fn completion_prior(cpus: &[usize]) -> Home {
    let map = match QueueMap::read(&Root::real()) {
        Ok(m) => m,
        Err(e) => {
            warn!("reading the disks' queue map failed ({e:#}): where requests complete is learned from the block programs alone");
            return Home::Unknown;
        }
    };
    for d in &map.disks {
        let queues: Vec<String> = d
            .queues
            .iter()
            .map(|q| format!("{:?}→{:?}", q.submit_cpus, q.completion_cpus))
            .collect();
        info!(disk = %d.disk, queues = %queues.join(" "), "block queues: submitting vCPUs → completing vCPUs");
    }
    let home = prior(&map.completion_cpus(), cpus);
    match home {
        Home::Fixed(c) => info!("every vCPU's requests complete on vCPU {c}: I/O-bound tasks are kept there while moves may pay"),
        Home::FollowsSubmitter => info!("requests complete on the vCPU that submits them: I/O-bound tasks follow the running vCPUs"),
        Home::Unknown => info!("where requests complete is learned per task from the block programs"),
    }
    home
}

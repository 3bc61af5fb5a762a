//! `vmigrater run`: wires monitor → detector → engine together, serves metrics and status,
//! and on SIGTERM/SIGINT/SIGQUIT hands every task back with its original mask; SIGHUP
//! reloads the configuration (`control::reload`). Owns start-up order (the instance lock, then crash
//! recovery, before anything can be moved) and shutdown order (stop moving, then restore).
//! The signals were blocked in `main` before this runs, so one sent at any moment of
//! start-up waits for the control plane and takes the same shutdown path. It must never
//! leave a task pinned on any exit path it controls; for the ones it does not (kill -9),
//! the journal is recovered at the next start.

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use os_layer::Root;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use task_detector::queues::QueueMap;
use task_detector::{ClassifierConfig, TrackerOptions};
use tracing::{info, warn};
use vcpu_monitor::{AnyMonitor, MonitorConfig, VcpuBoard};

use crate::channel::{self, ChannelStats};
use crate::config::Config;
use crate::detect::{DetectStart, DetectorThread, LivePlacement};
use crate::metrics::Moves;
use crate::status;
use crate::view::Running;
use crate::{instance, recovery};
use migrater::affinity::AffinityExecutor;
use migrater::completion::{prior, Home};
use migrater::engine::{self, EngineConfig, EngineSnapshot};
use migrater::guard::GuardConfig;
use migrater::hook::{LatencyRing, MigrationHook, Placement, Shared};
use migrater::planner::{Planner, PlannerConfig};
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

fn classifier_config(cfg: &Config) -> ClassifierConfig {
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
fn engine_config(cfg: &Config, measures_contention: bool, cpus: &[usize]) -> EngineConfig {
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
            epoch_ns: cfg.advanced.migration.guard_epoch_ms * 1_000_000,
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

/// Runs the daemon until a stop signal; `load` reads the configuration again at SIGHUP.
pub fn run(
    cfg: Config,
    mut signals: control::signals::Signals,
    load: Box<dyn Fn() -> Result<Config>>,
) -> Result<()> {
    let _instance = instance::lock()?;
    let state_dir = cfg.state_dir.clone();
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state dir {}", state_dir.display()))?;
    recovery::recover_journal(&state_dir)?;

    let detector = DetectorThread::spawn(
        TrackerOptions {
            force_mode: cfg.detector.attach_mode.forced(),
        },
        classifier_config(&cfg),
    )?;
    let attach_mode = detector.as_ref().map(|d| d.mode);

    let mon_cfg = monitor_config(&cfg)?;
    let cpus = mon_cfg.cpus.clone();
    let board = Arc::new(VcpuBoard::new(&cpus, &mon_cfg));
    let moves = Arc::new(Moves::default());
    let shared = shared_placement(&cfg, moves.clone())?;
    let planner = Planner::new(PlannerConfig {
        push_threshold_ns: cfg.advanced.migration.push_threshold_us * 1_000,
        max_load_per_vcpu: cfg.advanced.migration.max_load_per_vcpu,
        ..PlannerConfig::default()
    });
    let hook = Arc::new(MigrationHook::new(
        shared.clone(),
        planner,
        cfg.advanced.migration.push_threshold_us * 1_000,
        &cpus,
    ));
    let (monitor, fallback) = AnyMonitor::start(
        cfg.monitor.wanted(),
        mon_cfg,
        board.clone(),
        hook,
        Duration::from_micros(cfg.advanced.migration.push_threshold_us),
    )
    .context("starting the vCPU monitor")?;
    if let Some(why) = fallback {
        warn!("kernel-timer vCPU monitor unavailable, using sleepers: {why}");
    }
    let monitor_source = monitor.source();
    info!(cpus = ?cpus, source = monitor_source.as_str(), period_us = cfg.advanced.monitor.period_us, "vCPU monitor started");

    // Every sleep of the detector and channel threads is a nap on this: shutdown wakes
    // them at once, whatever the configured periods.
    let stop = Arc::new(control::Stop::default());
    let live_cfg = Arc::new(ArcSwap::from_pointee(cfg.clone()));
    let engine = Arc::new(ArcSwap::from_pointee(EngineSnapshot::default()));
    let channel_stats = Arc::new(ChannelStats::default());
    let detect_thread = detector.map(|d| {
        d.start(DetectStart {
            shared: shared.clone(),
            board: board.clone(),
            // Only the kernel source sees deschedules while idle; sleepers at their idle
            // period catch a fraction of them, so there the guard judges by I/O alone.
            engine: engine_config(&cfg, monitor_source == vcpu_monitor::Source::Kernel, &cpus),
            snapshot: engine.clone(),
            stop: stop.clone(),
            channel: channel_stats.clone(),
            cfg: live_cfg.clone(),
        })
    });

    let running = Arc::new(Running {
        shared: shared.clone(),
        board: board.clone(),
        moves,
        engine,
        attach_mode,
        monitor_source,
        dry_run: cfg.dry_run,
        started: Instant::now(),
        channel: channel_stats,
    });
    let channel_thread = spawn_channel(&cfg, &running, &stop)?;
    let served = control_plane(&cfg, running, async {
        let signal = control::until_stopped(&mut signals, || {
            if let Some(next) = control::reload(&*live_cfg.load_full(), &*load) {
                live_cfg.store(Arc::new(next));
            }
        })
        .await;
        info!("{signal}: shutting down");
    });

    // Shutdown: stop deciding first, then hand every task back.
    stop.set();
    monitor.stop();
    if detect_thread.is_some_and(|t| t.join().is_err()) {
        warn!("detector thread panicked");
    }
    if channel_thread.is_some_and(|t| t.join().is_err()) {
        warn!("channel thread panicked");
    }
    engine::release_everything(&mut LivePlacement {
        shared: &shared,
        board: &board,
        cfg: live_cfg.load_full(),
        all_cpus: cpus,
    });
    let _ = std::fs::remove_file(status::socket_path(&state_dir));
    served
}

/// The placement shared by the monitor threads, the engine and the control plane, with
/// the executor and its journal (none in dry run).
fn shared_placement(cfg: &Config, moves: Arc<Moves>) -> Result<Arc<Shared>> {
    let executor = if cfg.dry_run {
        info!("dry-run: migrations are planned and logged, no mask is changed");
        None
    } else {
        Some(AffinityExecutor::new(recovery::open_journal(
            &cfg.state_dir,
        )?))
    };
    Ok(Arc::new(Shared {
        tasks: ArcSwap::from_pointee(Vec::new()),
        placement: Mutex::new(Placement {
            executor,
            simulated: HashMap::new(),
            latencies: LatencyRing::new(4096),
            hands_off: HashSet::new(),
        }),
        moves,
        migrations: AtomicU64::new(0),
    }))
}

/// The host channel's thread, if enabled.
fn spawn_channel(
    cfg: &Config,
    running: &Arc<Running>,
    stop: &Arc<control::Stop>,
) -> Result<Option<std::thread::JoinHandle<()>>> {
    if !cfg.channel.enabled {
        return Ok(None);
    }
    let (running, stop, path) = (running.clone(), stop.clone(), cfg.channel.path.clone());
    let period = Duration::from_millis(cfg.advanced.channel.period_ms);
    let handle = std::thread::Builder::new()
        .name("vmigrater-chan".into())
        .spawn(move || {
            channel::run(
                &path,
                period,
                || running.channel_sample(),
                &running.channel,
                &stop,
            )
        })?;
    Ok(Some(handle))
}

/// Tokio runs only the control plane: metrics HTTP, the status socket and signals.
fn control_plane(
    cfg: &Config,
    running: Arc<Running>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let endpoints = control::Endpoints {
        status_socket: status::socket_path(&cfg.state_dir),
        metrics: cfg.metrics.enabled.then_some(cfg.metrics.listen),
    };
    let for_metrics = running.clone();
    control::serve(
        "vmigrater-ctl",
        &endpoints,
        move || serde_json::to_vec(&running.report()).unwrap_or_default(),
        move || for_metrics.encode_metrics(),
        shutdown,
    )
}

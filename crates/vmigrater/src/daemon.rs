//! `vmigrater run`: wires monitor → detector → engine together (their settings from
//! `settings`), serves metrics and status, and on SIGTERM/SIGINT/SIGQUIT hands every task
//! back with its original mask; SIGHUP reloads the configuration (`control::reload`). Owns
//! start-up order (the instance lock, then crash recovery, before anything can be moved)
//! and shutdown order (stop moving, then restore).
//! The signals were blocked in `main` before this runs, so one sent at any moment of
//! start-up waits for the control plane and takes the same shutdown path. It must never
//! leave a task pinned on any exit path it controls; for the ones it does not (kill -9),
//! the journal is recovered at the next start.

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use task_detector::TrackerOptions;
use tracing::{info, warn};
use vcpu_monitor::{AnyMonitor, VcpuBoard};

use crate::channel::{self, ChannelStats};
use crate::config::Config;
use crate::detect::{DetectStart, DetectorThread};
use crate::metrics::Moves;
use crate::settings::{classifier_config, engine_config, monitor_config};
use crate::status;
use crate::view::Running;
use crate::{instance, recovery};
use migrater::affinity::AffinityExecutor;
use migrater::engine::{self, EngineSnapshot};
use migrater::hook::{LatencyRing, MigrationHook, Placement, Shared};
use migrater::live::LivePlacement;
use migrater::planner::{Planner, PlannerConfig};

/// Runs the daemon until a stop signal; `load` reads the configuration again at SIGHUP.
pub fn run(
    cfg: Config,
    signals: control::signals::Signals,
    load: Box<dyn Fn() -> Result<Config>>,
) -> Result<()> {
    run_with_source(cfg, signals, load, None)
}

/// `run`, with the vCPU monitor's ticks from `external` instead of `monitor.source` when
/// given: how the nested-VM lab's build (`vmigrater-oracle`) runs this daemon on the
/// host's known schedule.
pub fn run_with_source(
    cfg: Config,
    mut signals: control::signals::Signals,
    load: Box<dyn Fn() -> Result<Config>>,
    external: Option<vcpu_monitor::StartExternal>,
) -> Result<()> {
    let _instance = instance::lock()?;
    let state_dir = cfg.state_dir.clone();
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state dir {}", state_dir.display()))?;
    recovery::recover_journal(&state_dir)?;

    let detector = DetectorThread::spawn(
        TrackerOptions {
            force_mode: cfg.detector.attach_mode.into(),
        },
        classifier_config(&cfg),
    )?;
    let attach_mode = detector.as_ref().map(|d| d.mode);

    let mon_cfg = monitor_config(&cfg)?;
    let cpus = mon_cfg.cpus.clone();
    let board = Arc::new(VcpuBoard::new(&cpus, &mon_cfg));
    let moves = Arc::new(Moves::default());
    let shared = shared_placement(&cfg, moves.clone())?;
    let monitor = start_monitor(&cfg, external, mon_cfg, &board, &shared)?;
    let monitor_source = monitor.source();

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
    let served = control_plane(
        &cfg,
        running,
        wait_for_stop(&mut signals, &live_cfg, &*load),
    );

    // Shutdown: stop deciding first, then hand every task back.
    stop.set();
    monitor.stop();
    join(detect_thread, "detector");
    join(channel_thread, "channel");
    engine::release_everything(&mut LivePlacement {
        shared: &shared,
        board: &board,
        settings: live_cfg.load_full(),
        all_cpus: cpus,
    });
    let _ = std::fs::remove_file(status::socket_path(&state_dir));
    served
}

/// Waits for a stop signal, reloading `live_cfg` at each SIGHUP.
async fn wait_for_stop(
    signals: &mut control::signals::Signals,
    live_cfg: &ArcSwap<Config>,
    load: &dyn Fn() -> Result<Config>,
) {
    let signal = control::until_stopped(signals, || {
        if let Some(next) = control::reload(&*live_cfg.load_full(), load) {
            live_cfg.store(Arc::new(next));
        }
    })
    .await;
    info!("{signal}: shutting down");
}

/// Waits for a thread told to stop; a panic there is said, not passed on.
fn join(thread: Option<std::thread::JoinHandle<()>>, name: &str) {
    if thread.is_some_and(|t| t.join().is_err()) {
        warn!("{name} thread panicked");
    }
}

/// The vCPU monitor (`external` ticks when given, else `monitor.source`), with the
/// migration hook its threads call.
fn start_monitor(
    cfg: &Config,
    external: Option<vcpu_monitor::StartExternal>,
    mon_cfg: vcpu_monitor::MonitorConfig,
    board: &Arc<VcpuBoard>,
    shared: &Arc<Shared>,
) -> Result<AnyMonitor> {
    let cpus = mon_cfg.cpus.clone();
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
    let wanted = external.map_or_else(|| cfg.monitor.source.into(), vcpu_monitor::Wanted::External);
    let (monitor, fallback) = AnyMonitor::start(
        wanted,
        mon_cfg,
        board.clone(),
        hook,
        Duration::from_micros(cfg.advanced.migration.push_threshold_us),
    )
    .context("starting the vCPU monitor")?;
    if let Some(why) = fallback {
        warn!("kernel-timer vCPU monitor unavailable, using sleepers: {why}");
    }
    info!(cpus = ?cpus, source = monitor.source().as_str(), period_us = cfg.advanced.monitor.period_us, "vCPU monitor started");
    Ok(monitor)
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
    let follows_host = cfg.migration.follow_host;
    let handle = std::thread::Builder::new()
        .name("vmigrater-chan".into())
        .spawn(move || {
            channel::run(
                &path,
                period,
                follows_host,
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

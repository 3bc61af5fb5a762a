//! `vmigrater check`: says plainly what works on this machine (bpftune's support probe).
//! Owns nothing persistent; it may load and immediately unload the BPF programs to prove
//! the attach mode, and must never change any task.

use anyhow::Result;
use std::path::Path;
use std::time::Instant;
use task_detector::{IoTracker, TrackerOptions, TrackerStorage};

use crate::config::{Config, MonitorSource};
use crate::settings::monitor_config;

const HINT_PORT: &str = "/dev/virtio-ports/org.vmigrater.hint.0";

pub fn run(config_path: &Path, cfg: Result<Config>) -> Result<()> {
    let root = print_system()?;
    // What would stop `run` from working: `check` fails with them, so that it can gate a
    // deployment script or a package's post-install step.
    let mut problems: Vec<&str> = Vec::new();
    let cfg = config_or_default(config_path, cfg, &mut problems);
    check_vcpus(&cfg, root, &mut problems);
    let best = print_probe();
    check_attach(&cfg, root, &best, &mut problems);
    println!(
        "host channel:  {}",
        if Path::new(HINT_PORT).exists() {
            "virtio port present"
        } else {
            "no virtio port (runs standalone)"
        }
    );
    if problems.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!("check failed: {}", problems.join("; ")))
    }
}

/// Prints the kernel and whether we are root; returns whether we are.
fn print_system() -> Result<bool> {
    let uname = nix::sys::utsname::uname()?;
    println!(
        "kernel:        {} {}",
        uname.release().to_string_lossy(),
        uname.machine().to_string_lossy()
    );
    let root = nix::unistd::geteuid().is_root();
    println!(
        "root:          {}",
        if root {
            "yes"
        } else {
            "no (run and check need root: BPF, SCHED_FIFO, sched_setaffinity)"
        }
    );
    Ok(root)
}

/// The configuration `run` would use; an invalid one is a problem, and the defaults stand
/// in for it in the checks that follow.
fn config_or_default(
    config_path: &Path,
    cfg: Result<Config>,
    problems: &mut Vec<&'static str>,
) -> Config {
    match cfg {
        Ok(cfg) => {
            let state = if config_path.exists() {
                "ok"
            } else {
                "not present: defaults"
            };
            println!("config:        {} {state}", config_path.display());
            cfg
        }
        Err(e) => {
            println!("config:        ERROR {e:#}");
            problems.push("the configuration is invalid");
            Config::default()
        }
    }
}

/// The vCPUs to monitor and the source the monitor would use.
fn check_vcpus(cfg: &Config, root: bool, problems: &mut Vec<&'static str>) {
    match monitor_config(cfg) {
        Ok(m) => {
            println!("vCPUs:         {:?}", m.cpus);
            println!("vCPU monitor:  {}", monitor_source(cfg, m, root));
        }
        Err(e) => {
            println!("vCPUs:         ERROR {e:#}");
            problems.push("the vCPUs to monitor are invalid");
        }
    }
}

/// What the kernel offers the block I/O programs; returns the best attach mode it allows.
fn print_probe() -> String {
    let probe = task_detector::probe();
    println!(
        "kernel BTF:    {}",
        if probe.btf {
            "yes"
        } else {
            "no (tp_btf unavailable)"
        }
    );
    for (tp, present) in &probe.tracepoints {
        println!(
            "tracepoint:    {tp:<22} {}",
            if *present { "present" } else { "missing" }
        );
    }
    for note in &probe.notes {
        println!("note:          {note}");
    }
    let best = probe
        .best_mode
        .map_or("none".to_string(), |m| m.to_string());
    println!("probed mode:   {best}");
    best
}

/// The attach mode, proven by loading and attaching the block I/O programs when root.
fn check_attach(cfg: &Config, root: bool, best: &str, problems: &mut Vec<&'static str>) {
    if root {
        let t0 = Instant::now();
        let mut storage = TrackerStorage::new();
        let opts = TrackerOptions {
            force_mode: cfg.detector.attach_mode.into(),
        };
        // Only the mode outlives the match: the tracker borrows `storage`.
        let opened = IoTracker::open(&opts, &mut storage).map(|t| t.mode());
        match opened {
            Ok(mode) => println!(
                "attach mode:   {mode} (loaded and attached in {:.1} ms)",
                t0.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => {
                println!("attach mode:   FAILED: {e:#}");
                problems.push("the block tracepoint programs do not load");
            }
        }
    } else {
        println!("attach mode:   {best} (not verified: loading BPF needs root)");
    }
}

struct NoHook;

impl vcpu_monitor::TickHook for NoHook {
    fn on_tick(&self, _: usize, _: vcpu_monitor::TickEvent, _: &vcpu_monitor::VcpuBoard, _: u64) {}
}

/// Which source `run` will use, proven by loading the kernel-timer programs when root.
fn monitor_source(cfg: &Config, m: vcpu_monitor::MonitorConfig, root: bool) -> String {
    let sleepers = format!(
        "sleepers (a SCHED_FIFO sleeper per vCPU, period {} µs)",
        cfg.advanced.monitor.period_us
    );
    if cfg.monitor.source == MonitorSource::Sleepers {
        return format!("{sleepers}, as configured");
    }
    if !root {
        return "kernel timers (not verified: loading BPF needs root)".into();
    }
    let board = std::sync::Arc::new(vcpu_monitor::VcpuBoard::new(&m.cpus, &m));
    let t0 = Instant::now();
    match vcpu_monitor::KernelMonitor::start(
        m,
        board,
        std::sync::Arc::new(NoHook),
        std::time::Duration::from_micros(cfg.advanced.migration.push_threshold_us),
    ) {
        Ok(k) => {
            let attach = k.attach();
            k.stop();
            format!(
                "kernel timers ({attach}, loaded and attached in {:.1} ms; a steal emulator inside this kernel is invisible to it)",
                t0.elapsed().as_secs_f64() * 1e3
            )
        }
        Err(e) if cfg.monitor.source == MonitorSource::Auto => {
            format!("{sleepers}: the kernel source failed: {e:#}")
        }
        Err(e) => format!("FAILED: source = \"kernel\" is configured and does not load: {e:#}"),
    }
}

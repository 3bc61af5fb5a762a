//! `vmigrater-oracle`: the nested-VM lab's build of the guest daemon. It is `vmigrater run`
//! with one difference: the vCPU monitor's ticks come from the host's known steal schedule
//! (`lab_oracle::ScheduleMonitor`), not from detection, so that the lab can measure what
//! migration gains with perfect knowledge beside what the product's detection gets. The
//! lab installs it in its guest image; no package ships it.

use anyhow::{Context, Result};
use clap::Parser;
use lab_oracle::StealSchedule;
use std::path::PathBuf;
use vmigrater::config::Config;

/// The guest daemon on the host's known steal schedule (nested-VM lab only).
#[derive(Parser, Debug)]
#[command(name = "vmigrater-oracle", version, about, long_about = None)]
struct Cli {
    /// The daemon's configuration file (TOML), as `vmigrater run --config`.
    #[arg(long, short = 'c')]
    config: PathBuf,
    /// One vCPU's schedule, `CPU:OUT_US:RUN_US[:PHASE_US]` (repeat per vCPU).
    #[arg(long = "schedule", required = true)]
    schedules: Vec<StealSchedule>,
    /// The schedule's epoch in this guest's CLOCK_MONOTONIC, ns.
    #[arg(long)]
    epoch_ns: u64,
    /// Log filter (RUST_LOG syntax).
    #[arg(long, default_value = "info")]
    log: String,
}

fn main() {
    let cli = Cli::parse();
    // Blocked before the first thread, as `vmigrater run` does (control::signals).
    let signals = match control::signals::block() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vmigrater-oracle: error: {e:#}");
            std::process::exit(1);
        }
    };
    control::logging::init(&cli.log);
    task_detector::libbpf_log::route_to_tracing();
    if let Err(e) = run(cli, signals) {
        eprintln!("vmigrater-oracle: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli, signals: control::signals::Signals) -> Result<()> {
    let cfg = Config::load(&cli.config, true)?;
    let path = cli.config.clone();
    let start = lab_oracle::start_external(cli.schedules, cli.epoch_ns);
    vmigrater::daemon::run_with_source(
        cfg,
        signals,
        Box::new(move || Config::load(&path, true)),
        Some(start),
    )
    .context("the lab's daemon")
}

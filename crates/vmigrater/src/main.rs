//! `vmigrater`: keeps I/O-bound tasks on running vCPUs (see the README).

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use vmigrater::config::{Config, DEFAULT_CONFIG_PATH};
use vmigrater::{check, daemon, explain, record, status};

/// `--version`, with the commit it was built from (`build.rs`): the benchmarks record it
/// beside their own.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("VMIGRATER_COMMIT"),
    ")"
);

/// Keeps I/O-bound tasks on vCPUs that are running right now, so guest I/O does not stall
/// while the hypervisor has a vCPU descheduled.
#[derive(Parser, Debug)]
#[command(name = "vmigrater", version = VERSION, about, long_about = None)]
struct Cli {
    /// Configuration file (TOML). A missing file at the default path means defaults.
    #[arg(long, short = 'c', global = true, default_value = DEFAULT_CONFIG_PATH, env = "VMIGRATER_CONFIG")]
    config: PathBuf,
    /// Log filter, e.g. `info`, `debug`, `vmigrater=debug,migrater=debug` (RUST_LOG syntax).
    #[arg(long, global = true, default_value = "info", env = "VMIGRATER_LOG")]
    log: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon in the foreground (the default when no subcommand is given).
    Run(RunArgs),
    /// Print what this machine supports and which BPF attach mode will be used.
    Check,
    /// Ask a running daemon for its state and print a table.
    Status(StatusArgs),
    /// Why a thread is or is not moved: what the detector saw, whether the daemon manages
    /// it, the rule that decides and what would change it. Without a target, the daemon's
    /// overall state.
    Explain(ExplainArgs),
    /// Print the configuration file the packages ship: every key with its default,
    /// commented out, so the defaults stay in the program.
    DefaultConfig,
    /// Record this guest's vCPU deschedules for a while, as the kernel monitor sees them,
    /// in the replay form of the hard-IRQ testbed (`CPU START_US END_US` lines). Root.
    Record(RecordArgs),
    /// Write man pages and shell completions under DIR (for packaging).
    #[command(hide = true)]
    GenDist { dir: PathBuf },
}

#[derive(clap::Args, Debug, Default, Clone)]
struct RunArgs {
    /// Plan and log migrations, but never change any task's CPU mask.
    #[arg(long)]
    dry_run: bool,
    /// Move tasks only onto the vCPUs the host agent holds (overrides
    /// `migration.follow_host`).
    #[arg(long)]
    follow_host: bool,
    /// Address of the Prometheus `/metrics` endpoint (overrides `metrics.listen`).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Disable the metrics endpoint.
    #[arg(long)]
    no_metrics: bool,
    /// Directory of the affinity journal and the status socket (overrides `state_dir`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// vCPU sleeper period in microseconds while I/O-bound tasks exist (overrides
    /// `advanced.monitor.period_us`).
    #[arg(long)]
    period_us: Option<u64>,
    /// Where vCPU deschedules are learnt from (overrides `monitor.source`): kernel timers,
    /// sleepers, or auto (kernel, else sleepers).
    #[arg(long, value_enum)]
    monitor_source: Option<vmigrater::config::MonitorSource>,
    /// BPF attach mode: auto, tp_btf, raw_tp or tracepoint (overrides `detector.attach_mode`).
    #[arg(long, value_enum)]
    attach_mode: Option<vmigrater::config::AttachSetting>,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// Print the raw JSON report instead of a table.
    #[arg(long)]
    json: bool,
    /// State directory of the daemon to ask (default: the config's `state_dir`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct ExplainArgs {
    /// A process or thread id (every thread of a process), or a command name (every
    /// thread whose command or whose process's command it is).
    target: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// State directory of the daemon to ask (default: the config's `state_dir`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct RecordArgs {
    /// How long to record, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    secs: u64,
    /// Write the trace to FILE instead of standard output.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

fn load_config(cli: &Cli) -> Result<Config> {
    let explicit = cli.config.as_os_str() != DEFAULT_CONFIG_PATH;
    Config::load(&cli.config, explicit)
}

fn main() {
    let cli = Cli::parse();
    // The daemon's signals are blocked before its first thread and before crash
    // recovery (see control::signals); the other subcommands keep the defaults, so that
    // Ctrl-C ends a `status` or `check` at once.
    let signals = match cli.command {
        None | Some(Command::Run(_)) => match control::signals::block() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("vmigrater: error: {e:#}");
                std::process::exit(1);
            }
        },
        _ => None,
    };
    control::logging::init(&cli.log);
    task_detector::libbpf_log::route_to_tracing();
    if let Err(e) = real_main(cli, signals) {
        eprintln!("vmigrater: error: {e:#}");
        std::process::exit(1);
    }
}

/// The configuration `run` uses: the file, then the flags over it, held to the same
/// ranges. Read again at SIGHUP.
fn run_config(config: &std::path::Path, explicit: bool, args: &RunArgs) -> Result<Config> {
    let mut cfg = Config::load(config, explicit)?;
    cfg.dry_run |= args.dry_run;
    cfg.migration.follow_host |= args.follow_host;
    if let Some(a) = args.metrics_addr {
        cfg.metrics.listen = a;
    }
    if args.no_metrics {
        cfg.metrics.enabled = false;
    }
    if let Some(d) = &args.state_dir {
        cfg.state_dir = d.clone();
    }
    if let Some(p) = args.period_us {
        cfg.advanced.monitor.period_us = p;
    }
    if let Some(src) = args.monitor_source {
        cfg.monitor.source = src;
    }
    if let Some(m) = args.attach_mode {
        cfg.detector.attach_mode = m;
    }
    // Flags are held to the file's ranges, so `--period-us 1` gets the same message.
    cfg.revalidate("command line and config")
}

fn real_main(cli: Cli, signals: Option<control::signals::Signals>) -> Result<()> {
    match cli
        .command
        .as_ref()
        .unwrap_or(&Command::Run(RunArgs::default()))
    {
        Command::Run(args) => {
            let explicit = cli.config.as_os_str() != DEFAULT_CONFIG_PATH;
            let cfg = run_config(&cli.config, explicit, args)?;
            let signals = signals.context("the daemon's signals were not blocked")?;
            let (path, args) = (cli.config.clone(), args.clone());
            daemon::run(
                cfg,
                signals,
                Box::new(move || run_config(&path, explicit, &args)),
            )
        }
        Command::Check => {
            let cfg = load_config(&cli);
            check::run(&cli.config, cfg)
        }
        Command::Status(args) => {
            let state_dir = match &args.state_dir {
                Some(d) => d.clone(),
                None => load_config(&cli)?.state_dir,
            };
            let report = status::query(&state_dir)?;
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).context("encoding")?
                );
            } else {
                print!("{}", status::render(&report));
            }
            Ok(())
        }
        Command::Explain(args) => {
            let state_dir = match &args.state_dir {
                Some(d) => d.clone(),
                None => load_config(&cli)?.state_dir,
            };
            let report = status::query(&state_dir)?;
            let threads = match &args.target {
                Some(t) => explain::threads(t)?,
                None => Vec::new(),
            };
            let all: Vec<explain::Explanation> = threads
                .iter()
                .map(|t| explain::explain(&report, t))
                .collect();
            if args.json {
                let v = serde_json::json!({
                    "daemon": explain::overall(&report),
                    "threads": all,
                });
                println!("{}", serde_json::to_string_pretty(&v).context("encoding")?);
            } else {
                print!("{}", explain::render(&report, &all));
            }
            Ok(())
        }
        Command::DefaultConfig => {
            print!("{}", Config::default_toml());
            Ok(())
        }
        Command::Record(args) => record::run(
            &load_config(&cli)?,
            std::time::Duration::from_secs(args.secs),
            args.out.as_deref(),
        ),
        Command::GenDist { dir } => control::dist::write(Cli::command(), dir).map(drop),
    }
}

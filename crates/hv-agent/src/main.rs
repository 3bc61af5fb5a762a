//! `vmigrater-hv-agent`: see the crate docs and the README.

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use hv_agent::agent::Agent;
use hv_agent::backend::Backend as _;
use hv_agent::config::{BackendKind, Config, DEFAULT_CONFIG_PATH};
use hv_agent::status::AgentStatus;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use tracing::{info, warn};

/// Drives the host scheduler with ISACS credits from the I/O reports of vmigrater guests.
#[derive(Parser, Debug)]
#[command(name = "vmigrater-hv-agent", version, about)]
struct Cli {
    /// Configuration file (TOML). A missing file at the default path means defaults.
    #[arg(long, short = 'c', global = true, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Log filter (RUST_LOG syntax).
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the agent in the foreground (default).
    Run {
        /// Compute and log, change nothing (overrides `backend`).
        #[arg(long)]
        dry_run: bool,
    },
    /// Print what this host supports and what each configured VM resolves to.
    Check,
    /// Show the running agent's VMs, vCPUs, credits and applied settings.
    Status {
        /// The raw JSON snapshot instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print the default configuration.
    DefaultConfig,
    /// Write man pages and shell completions under DIR (for packaging).
    #[command(hide = true)]
    GenDist { dir: PathBuf },
}

fn main() {
    let cli = Cli::parse();
    // Blocked before the first thread and before the journal's recovery, so that a signal
    // at any moment of start-up takes the one shutdown path (control::signals).
    let signals = match cli.command {
        None | Some(Command::Run { .. }) => match control::signals::block() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("vmigrater-hv-agent: error: {e:#}");
                std::process::exit(1);
            }
        },
        _ => None,
    };
    control::logging::init(&cli.log);
    if let Err(e) = real_main(cli, signals) {
        eprintln!("vmigrater-hv-agent: error: {e:#}");
        std::process::exit(1);
    }
}

fn real_main(cli: Cli, signals: Option<control::signals::Signals>) -> Result<()> {
    let explicit = cli.config.as_os_str() != DEFAULT_CONFIG_PATH;
    match cli.command.unwrap_or(Command::Run { dry_run: false }) {
        Command::Run { dry_run } => {
            let path = cli.config.clone();
            let load = move || {
                let mut cfg = Config::load(&path, explicit)?;
                if dry_run {
                    cfg.backend = BackendKind::DryRun;
                }
                Ok(cfg)
            };
            let cfg = load()?;
            let signals = signals.context("the agent's signals were not blocked")?;
            run(cfg, signals, &load)
        }
        Command::Status { json } => {
            let cfg = Config::load(&cli.config, explicit)?;
            let s = hv_agent::status::query(&cfg.state_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", hv_agent::status::render(&s));
            }
            Ok(())
        }
        Command::Check => {
            let cfg = Config::load(&cli.config, explicit);
            let uname = nix::sys::utsname::uname()?;
            println!("kernel:   {}", uname.release().to_string_lossy());
            println!(
                "nice:     {}",
                match os_layer::sched::get_attr(0) {
                    Ok(_) => "sched_getattr works (vCPU threads are weighted by nice)",
                    Err(_) => "sched_getattr failed (weight = \"nice\" unusable)",
                }
            );
            match cfg {
                Ok(cfg) => {
                    println!(
                        "config:   ok, backend {}, {} VM(s)",
                        cfg.backend,
                        cfg.vms.len()
                    );
                    println!(
                        "cgroup:   {}",
                        match hv_agent::cgroup::Hierarchy::detect() {
                            Some(h) => format!("{h:?}"),
                            None =>
                                "no cpu controller mounted (weight = \"cgroup\" unusable)".into(),
                        }
                    );
                    // The agent does not start without the model's maps: say whether they
                    // are there and what each modelled VM has in them.
                    let model = (cfg.backend == BackendKind::Model)
                        .then(|| hv_agent::model::Model::open(&cfg.model_dir, &cfg.vms));
                    match &model {
                        Some(Ok(_)) => {
                            println!("model:    maps pinned at {}", cfg.model_dir.display())
                        }
                        Some(Err(e)) => println!("model:    {e:#}"),
                        None => {}
                    }
                    for vm in &cfg.vms {
                        let mut what = hv_agent::agent::describe_threads(vm);
                        if let (Some(Ok(m)), Some(_)) = (&model, vm.model_slot) {
                            let n = m.vcpus(vm).unwrap_or(0);
                            what = format!("{what}; {n} vCPU(s) modelled now");
                        }
                        println!("vm {}:    {what}", vm.name);
                    }
                    if cfg.libvirt.enabled {
                        for vm in hv_agent::discovery::libvirt_all(&cfg.libvirt) {
                            println!(
                                "libvirt {}: {}",
                                vm.name,
                                hv_agent::agent::describe_threads(&vm)
                            );
                        }
                    }
                }
                Err(e) => {
                    println!("config:   ERROR {e:#}");
                    // A deployment script or a package's post-install step gates on this.
                    anyhow::bail!("check failed: the configuration is invalid");
                }
            }
            Ok(())
        }
        Command::DefaultConfig => {
            print!("{}", Config::default_toml());
            Ok(())
        }
        Command::GenDist { dir } => control::dist::write(Cli::command(), &dir).map(drop),
    }
}

/// SIGHUP: a good configuration's live keys are handed to the period loop
/// (`control::reload`).
fn reload(
    running: &mut Config,
    load: &dyn Fn() -> Result<Config>,
    to_loop: &Mutex<Option<Config>>,
) {
    if let Some(next) = control::reload(running, load) {
        *running = next;
        *to_loop.lock().unwrap_or_else(PoisonError::into_inner) = Some(running.clone());
    }
}

/// The period loop on its own thread; the main thread serves the status socket and
/// /metrics until SIGINT/SIGTERM/SIGQUIT (or the loop ends), then the loop restores
/// everything. SIGHUP reloads the configuration.
fn run(
    cfg: Config,
    mut signals: control::signals::Signals,
    load: &dyn Fn() -> Result<Config>,
) -> Result<()> {
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating state_dir {}", cfg.state_dir.display()))?;
    let status = Arc::new(Mutex::new(AgentStatus::default()));
    let agent = Agent::new(cfg.clone(), status.clone())?;
    let stop = Arc::new(control::Stop::default());
    let reloaded = Arc::new(Mutex::new(None));
    let worker = {
        let (stop, reloaded) = (stop.clone(), reloaded.clone());
        std::thread::Builder::new()
            .name("period".into())
            .spawn(move || agent.run(&stop, &reloaded))?
    };
    let mut running = cfg.clone();
    let endpoints = control::Endpoints {
        status_socket: hv_agent::status::socket_path(&cfg.state_dir),
        metrics: cfg.metrics.enabled.then_some(cfg.metrics.listen),
    };
    let for_metrics = status.clone();
    let served = control::serve(
        "hv-agent-ctl",
        &endpoints,
        move || {
            serde_json::to_vec(&*status.lock().unwrap_or_else(PoisonError::into_inner))
                .unwrap_or_default()
        },
        move || {
            hv_agent::metrics::encode(&for_metrics.lock().unwrap_or_else(PoisonError::into_inner))
        },
        async {
            tokio::select! {
                sig = control::until_stopped(&mut signals, || reload(&mut running, load, &reloaded)) => {
                    info!("{sig}: shutting down")
                }
                _ = async {
                    while !worker.is_finished() {
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                } => warn!("period loop ended"),
            }
        },
    );
    stop.set();
    worker
        .join()
        .map_err(|_| anyhow::anyhow!("the period loop panicked"))?;
    served
}

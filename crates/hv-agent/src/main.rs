//! `vmigrater-hv-agent`: see the crate docs and the README.

use anyhow::Result;
use clap::{Parser, Subcommand};
use hv_agent::config::{Config, DEFAULT_CONFIG_PATH};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Drives the host scheduler with ISACS credits from the I/O reports of vmigrater guests.
#[derive(Parser, Debug)]
#[command(version, about)]
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
    /// Print what this host supports.
    Check,
    /// Print the default configuration.
    DefaultConfig,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = real_main(cli) {
        eprintln!("vmigrater-hv-agent: error: {e:#}");
        std::process::exit(1);
    }
}

fn real_main(cli: Cli) -> Result<()> {
    let explicit = cli.config.as_os_str() != DEFAULT_CONFIG_PATH;
    match cli.command.unwrap_or(Command::Run { dry_run: false }) {
        Command::Run { dry_run } => {
            let mut cfg = Config::load(&cli.config, explicit)?;
            if dry_run {
                cfg.backend = "dry-run".into();
            }
            for sig in [libc::SIGINT, libc::SIGTERM] {
                // SAFETY: the handler only stores to an atomic.
                unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
            }
            // The agent polls STOP through an Arc: bridge the static flag.
            let stop = Arc::new(AtomicBool::new(false));
            let bridge = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !STOP.load(Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                    stop.store(true, Ordering::Relaxed);
                })
            };
            let r = hv_agent::agent::run(cfg, stop);
            STOP.store(true, Ordering::Relaxed);
            let _ = bridge.join();
            r
        }
        Command::Check => {
            let cfg = Config::load(&cli.config, explicit);
            let uname = nix::sys::utsname::uname()?;
            println!("kernel:   {}", uname.release().to_string_lossy());
            println!(
                "slice:    {}",
                match hv_agent::backend::get_attr(0) {
                    Ok(_) => "sched_setattr available (custom EEVDF slices need Linux 6.12+)",
                    Err(_) => "sched_getattr failed",
                }
            );
            match cfg {
                Ok(cfg) => {
                    println!(
                        "config:   ok, backend {}, {} VM(s)",
                        cfg.backend,
                        cfg.vms.len()
                    );
                    for vm in &cfg.vms {
                        let threads = match &vm.qmp_socket {
                            Some(q) => match hv_agent::qmp::vcpu_threads(q) {
                                Ok(t) => format!("QMP: vCPU threads {t:?}"),
                                Err(e) => format!("QMP: {e:#}"),
                            },
                            None => format!("configured vCPU threads {:?}", vm.vcpu_threads),
                        };
                        println!("vm {}:    {threads}", vm.name);
                    }
                }
                Err(e) => println!("config:   ERROR {e:#}"),
            }
            Ok(())
        }
        Command::DefaultConfig => {
            print!("{}", toml::to_string_pretty(&Config::default())?);
            Ok(())
        }
    }
}

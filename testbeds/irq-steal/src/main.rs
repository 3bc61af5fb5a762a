//! `irq-steal`: runs a deschedule schedule on this machine (`run`) or prints its windows
//! (`plan`). SIGINT and SIGTERM stop a run early, cleanly (report printed, sysctl
//! restored); SIGKILL leaves the restore to the watchdog process and the detach to the
//! kernel closing our file descriptors.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use irq_steal::{IrqSteal, Schedule};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "irq-steal", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args)]
struct PlanArgs {
    /// The schedule: anti:PERIOD_US:OUT_US, in:PERIOD_US:OUT_US,
    /// rphase:PERIOD_US:OUT_US:SEED, random:RUN_US:GAP_US:exp|uniform:SEED, replay:PATH, none.
    #[arg(long)]
    schedule: Schedule,
    /// Length of the run in seconds (fractions allowed).
    #[arg(long)]
    secs: f64,
    /// The CPUs to take away (e.g. `0,1` or `0-3`); default: every online CPU.
    #[arg(long)]
    cpus: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Steal the schedule's windows, then print what each CPU lost.
    Run {
        #[command(flatten)]
        plan: PlanArgs,
        /// Also write the report and the plan as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Who is charged a window's time: `absorbed` (a real-time thread per CPU, so no
        /// fair task is, as on a guest that subtracts steal time) or `interrupted` (the
        /// task the window interrupts, as this kernel does without IRQ time accounting).
        #[arg(long, default_value = "absorbed")]
        accounting: irq_steal::Accounting,
    },
    /// Print the schedule's windows (`CPU START_US END_US`, the replay format) and stop.
    Plan {
        #[command(flatten)]
        plan: PlanArgs,
    },
}

fn plan_of(a: &PlanArgs) -> Result<irq_steal::Plan> {
    let cpus = match &a.cpus {
        Some(list) => os_layer::parse_cpu_list(list).with_context(|| format!("--cpus {list:?}"))?,
        None => os_layer::Root::real().online_cpus()?,
    };
    anyhow::ensure!(
        a.secs.is_finite() && a.secs > 0.0,
        "--secs {} must be a positive number",
        a.secs
    );
    a.schedule.plan(&cpus, Duration::from_secs_f64(a.secs))
}

/// Blocks SIGINT and SIGTERM in this thread and every thread started after, so that they
/// are taken only by `wait_signal` below, never by a default handler that would kill the
/// process without restoring.
fn block_signals() -> Result<nix::sys::signal::SigSet> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().context("blocking SIGINT/SIGTERM")?;
    Ok(set)
}

/// Waits until `deadline_ns` (CLOCK_MONOTONIC) or one of the blocked signals; returns the
/// signal, if one came.
fn wait_signal(set: &nix::sys::signal::SigSet, deadline_ns: u64) -> Option<i32> {
    loop {
        let now = os_layer::monotonic_ns();
        if now >= deadline_ns {
            return None;
        }
        let left = deadline_ns - now;
        let ts = libc::timespec {
            tv_sec: (left / 1_000_000_000) as libc::time_t,
            tv_nsec: (left % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: a valid set and timespec; no siginfo wanted.
        let sig = unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &ts) };
        if sig > 0 {
            return Some(sig);
        }
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Plan { plan } => {
            let p = plan_of(&plan)?;
            println!(
                "# irq-steal plan --schedule {} --secs {}",
                plan.schedule, plan.secs
            );
            for c in &p.cpus {
                for w in &c.windows {
                    println!("{} {} {}", c.cpu, w.start_ns / 1_000, w.end_ns / 1_000);
                }
            }
        }
        Cmd::Run {
            plan,
            json,
            accounting,
        } => {
            let p = plan_of(&plan)?;
            let signals = block_signals()?;
            let run = IrqSteal::start_with(&p, accounting)?;
            eprintln!(
                "irq-steal: {} on CPUs {:?} for {} s (perf throttling off, windows charged \
                 to: {accounting})",
                plan.schedule,
                p.cpus.iter().map(|c| c.cpu).collect::<Vec<_>>(),
                plan.secs
            );
            // A little past the plan's end, so that the last window's end is seen.
            let end = run.start_ns() + p.length_ns + 2 * irq_steal::SAMPLE_PERIOD_NS;
            let interrupted = wait_signal(&signals, end);
            let report = run.stop()?;
            if let Some(sig) = interrupted {
                eprintln!(
                    "irq-steal: stopped early by signal {sig}: asked times are the whole plan's"
                );
            }
            print!("{report}");
            println!(
                "worst error {:.2}% ({})",
                report.worst_error() * 100.0,
                if report.within(0.05) {
                    "within 5%"
                } else {
                    "NOT within 5%"
                }
            );
            if let Some(path) = json {
                let doc = serde_json::json!({
                    "schedule": plan.schedule.to_string(),
                    "secs": plan.secs,
                    "accounting": accounting,
                    "interrupted_by_signal": interrupted,
                    "report": report,
                    "plan": p,
                });
                std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    Ok(())
}

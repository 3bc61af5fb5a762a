//! `steal-emulator`: takes CPUs away on a schedule (see the library docs).

use anyhow::Result;
use clap::Parser;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use steal_emulator::{Emulator, Pattern};

/// Emulates vCPU descheduling: per CPU a SCHED_FIFO thread that spins for BUSY µs and
/// sleeps IDLE µs, starting PHASE µs into the schedule. Needs root.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// CPU:BUSY_US:IDLE_US[:PHASE_US]; repeat for several CPUs
    /// (e.g. `--pattern 0:10000:10000:0 --pattern 1:10000:10000:10000`).
    #[arg(long = "pattern", required = true)]
    patterns: Vec<Pattern>,
    /// SCHED_FIFO priority of the stealing threads (keep it above vmigrater's sleepers).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i32).range(1..=99))]
    priority: i32,
    /// Stop after this many seconds (default: until SIGINT/SIGTERM).
    #[arg(long)]
    duration_s: Option<f64>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One plain line: a backtrace would bury "needs root".
            eprintln!("steal-emulator: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let t0 = Instant::now();
    let emu = Emulator::start(&args.patterns, args.priority)?;
    let limit = args.duration_s.map(Duration::from_secs_f64);
    while !STOP.load(Ordering::Relaxed) && limit.is_none_or(|l| t0.elapsed() < l) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let per_cpu: Vec<String> = emu
        .stop()
        .iter()
        .map(|r| {
            format!(
                "cpu{} {} bursts {:.3} s ({:.1}%)",
                r.cpu,
                r.intervals.len(),
                r.stolen_ns() as f64 / 1e9,
                r.stolen_ns() as f64 / 1e9 / elapsed * 100.0
            )
        })
        .collect();
    println!(
        "steal-emulator: ran {elapsed:.3} s, stole {}",
        per_cpu.join(", ")
    );
    Ok(())
}

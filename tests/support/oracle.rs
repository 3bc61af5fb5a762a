//! The schedule-aware oracle of the hard-IRQ benchmarks: a thread that knows the
//! deschedule plan in advance and moves a set of tasks, just before each window change, to
//! the CPU that will run (the completion CPU while it runs: `placement::oracle_cpu`). It
//! never decides anything from what it observes; the set of tasks is re-read at every move
//! so that an application's processes started after it are moved too.

use crate::placement;
use anyhow::Result;
use irq_steal::Plan;
use os_layer::time::{monotonic_ns, sleep_until};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The oracle moves its tasks this long before a window change, so the move is done when
/// the CPU they leave goes out.
pub const LEAD: Duration = Duration::from_micros(200);
const PRIORITY: i32 = 10;

/// What the oracle knows in advance: the plan, its t = 0, the CPUs and where completions land.
pub struct OracleView<'a> {
    pub plan: &'a Plan,
    pub start_ns: u64,
    pub cpus: &'a [usize],
    pub completion: Option<usize>,
}

/// What the oracle did in one run.
#[derive(Default)]
pub struct OracleLog {
    moves: AtomicU64,
    errors: AtomicU64,
    late_us_max: AtomicU64,
    late_over_1ms: AtomicU64,
}

impl OracleLog {
    pub fn to_json(&self) -> Value {
        json!({
            "moves": self.moves.load(Ordering::Relaxed),
            "setaffinity_errors": self.errors.load(Ordering::Relaxed),
            "late_wakeup_us_max": self.late_us_max.load(Ordering::Relaxed),
            "late_wakeups_over_1ms": self.late_over_1ms.load(Ordering::Relaxed),
            "lead_us": LEAD.as_micros() as u64,
        })
    }
}

/// Moves every task that `tasks()` names to the CPU that runs after each window change,
/// `LEAD` before it, until `stop`. Runs as SCHED_FIFO so that its own wake-up is not what
/// makes it late, and sleeps on a CPU that runs until its wake-up. A task that exits
/// between the listing and the move counts as an error, not a failure.
pub fn run(
    view: &OracleView,
    mut tasks: impl FnMut() -> Vec<u32>,
    stop: &AtomicBool,
    log: &OracleLog,
) -> Result<()> {
    if let Err(e) = os_layer::sched::set_self_policy(libc::SCHED_FIFO, PRIORITY) {
        eprintln!("WARNING: the schedule-aware oracle runs without SCHED_FIFO: {e}");
    }
    let mut place = |cpu: usize| {
        for tid in tasks() {
            if os_layer::cpus::set_cpus(tid, &[cpu]).is_err() {
                log.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        log.moves.fetch_add(1, Ordering::Relaxed);
    };
    let OracleView {
        plan,
        start_ns,
        cpus,
        completion,
    } = *view;
    let now_rel = || monotonic_ns().saturating_sub(start_ns);
    let target_at = |t: u64| {
        placement::oracle_cpu(
            cpus,
            completion,
            |c| plan.is_out(c, t),
            |c| plan.next_change(c, t),
        )
    };
    let mut current = target_at(now_rel());
    place(current);
    let lead = LEAD.as_nanos() as u64;
    let mut after = now_rel();
    while !stop.load(Ordering::Relaxed) {
        let Some(change) = placement::next_change(cpus, |c| plan.next_change(c, after)) else {
            break;
        };
        // Sleep on a CPU that runs from now until the wake-up: between two changes the set
        // of running CPUs does not change.
        let _ = os_layer::sched::pin_self(target_at(after));
        let wake = start_ns + change.saturating_sub(lead);
        // Short naps, so a stop request is seen within 50 ms.
        while monotonic_ns() < wake && !stop.load(Ordering::Relaxed) {
            sleep_until(wake.min(monotonic_ns() + 50_000_000));
        }
        let late = monotonic_ns().saturating_sub(wake) / 1000;
        log.late_us_max.fetch_max(late, Ordering::Relaxed);
        if late > 1000 {
            log.late_over_1ms.fetch_add(1, Ordering::Relaxed);
        }
        let next = target_at(change);
        if next != current {
            place(next);
            current = next;
        }
        after = change.max(now_rel());
    }
    Ok(())
}

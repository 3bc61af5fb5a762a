//! Who pays for a stolen window. This kernel has no `CONFIG_IRQ_TIME_ACCOUNTING`, so the
//! time the program spins in hard-IRQ context is charged to whatever task it interrupted:
//! a CPU hog or a reader is billed up to 50 ms of CPU it never had, which moves it in the
//! fair scheduler's order (vruntime, lag) as no real deschedule does. A guest of this same
//! kernel on a real host (`CONFIG_PARAVIRT_TIME_ACCOUNTING=y`) subtracts the time its host
//! ran another vCPU from the run queue's clock and bills it to nobody.
//!
//! With `Accounting::Absorbed`, one SCHED_FIFO thread per planned CPU wakes just before
//! each of that CPU's windows and busy-waits to its end, so that it is the task the
//! program interrupts: the window is billed to a real-time thread that no fair task
//! competes with, and nothing else changes (nothing runs on the CPU during the window
//! either way). The program counts the part of each CPU's stolen time spun while its
//! absorber was the task interrupted (`absorbed_ns`), so a run says how well this worked.
//! A window that finds another task running waits up to two sample periods
//! (`IS_ABSORBER_WAIT_NS`) for its absorber: the timer that wakes the absorber and the
//! sample that enters the window can fire in one interrupt when the host delivers them
//! late, and the absorber runs only once that interrupt returns (a CI guest billed 11% of
//! its windows to the busy task so).
//!
//! Must never outlive the run: the threads poll a stop flag at least every 20 ms and are
//! joined on drop. Windows are bounded by the plan (<= 50 ms, <= 60% of any second), so the
//! absorbers are bounded by them too.

use crate::plan::{Plan, Window};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Who is charged a stolen window's time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accounting {
    /// The task the program interrupted, as this kernel does by itself: a testbed
    /// artefact, kept to compare with.
    Interrupted,
    /// A real-time absorber thread per CPU, so no fair task is charged, as on a guest
    /// that subtracts steal time (the default: what the testbed emulates).
    #[default]
    Absorbed,
}

impl std::str::FromStr for Accounting {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "interrupted" => Ok(Accounting::Interrupted),
            "absorbed" => Ok(Accounting::Absorbed),
            _ => anyhow::bail!("accounting {s:?}: expected `interrupted` or `absorbed`"),
        }
    }
}

impl std::fmt::Display for Accounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accounting::Interrupted => "interrupted",
            Accounting::Absorbed => "absorbed",
        })
    }
}

/// How long before a window its absorber wakes: a real-time thread's timer has no slack,
/// and the program enters a window at its first sample inside it (0–250 µs late), so the
/// absorber is running by then.
const LEAD_NS: u64 = 50_000;
/// The longest an absorber sleeps without looking at the stop flag.
const POLL_NS: u64 = 20_000_000;
/// Below the controller's priority, so the heartbeat is never held back by an absorber.
pub(crate) const ABSORBER_PRIORITY: i32 = 1;

pub(crate) struct Absorbers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// (cpu, tid) of every absorber that runs pinned and real-time.
    pub tids: Vec<(usize, u32)>,
}

impl Absorbers {
    /// Starts one absorber per planned CPU for a run whose t = 0 is `start_ns`; returns
    /// once each has said whether it is in place.
    pub fn start(plan: &Plan, start_ns: u64) -> Result<Absorbers> {
        // Built first, so that an error below stops and joins the threads already started.
        let mut absorbers = Absorbers {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::with_capacity(plan.cpus.len()),
            tids: Vec::new(),
        };
        let (tx, rx) = channel();
        for c in &plan.cpus {
            let (cpu, windows, tx) = (c.cpu, c.windows.clone(), tx.clone());
            let stop = absorbers.stop.clone();
            let t = std::thread::Builder::new()
                .name(format!("irq-steal-abs{cpu}"))
                .spawn(move || absorb(cpu, &windows, start_ns, &stop, tx))
                .context("starting an absorber thread")?;
            absorbers.threads.push(t);
        }
        drop(tx);
        absorbers.tids = rx.iter().flatten().collect();
        Ok(absorbers)
    }
}

impl Drop for Absorbers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn absorb(
    cpu: usize,
    windows: &[Window],
    start_ns: u64,
    stop: &AtomicBool,
    ready: std::sync::mpsc::Sender<Option<(usize, u32)>>,
) {
    let placed = os_layer::sched::pin_self(cpu).is_ok();
    let realtime = os_layer::sched::set_self_policy(libc::SCHED_FIFO, ABSORBER_PRIORITY).is_ok();
    if !placed || !realtime {
        // An absorber off its CPU or below the fair tasks would change the workload, not
        // the billing: none at all, and the report's absorbed share says 0%.
        eprintln!(
            "irq-steal: no absorber on CPU {cpu} (pinned {placed}, SCHED_FIFO {realtime}): \
             its windows are charged to the tasks they interrupt"
        );
        let _ = ready.send(None);
        return;
    }
    let _ = ready.send(Some((cpu, nix::unistd::gettid().as_raw() as u32)));
    drop(ready);
    for w in windows {
        let (from, until) = (start_ns + w.start_ns, start_ns + w.end_ns);
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let now = os_layer::monotonic_ns();
            if now + LEAD_NS >= from {
                break;
            }
            os_layer::sleep_until((from - LEAD_NS).min(now + POLL_NS));
        }
        // The program's spin takes the CPU from here to `until`; this loop only keeps the
        // absorber the task it interrupts (and holds the CPU if a spin ends early).
        while os_layer::monotonic_ns() < until {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounting_reads_back_what_it_prints_and_names_a_bad_value() {
        for a in [Accounting::Interrupted, Accounting::Absorbed] {
            assert_eq!(a.to_string().parse::<Accounting>().unwrap(), a);
        }
        assert_eq!(Accounting::default(), Accounting::Absorbed);
        let e = "charged".parse::<Accounting>().unwrap_err().to_string();
        assert!(e.contains("\"charged\"") && e.contains("absorbed"), "{e}");
    }
}

//! Keeps every planned CPU out of its idle state for the run. On this kernel the
//! cpu-clock perf event takes no samples on an idle CPU (measured: 52 samples in 3 s on an
//! idle CPU against ~12,000 on a busy one), so its windows would pass unstolen, while a
//! real host takes a vCPU away whether it computes or halts: an idle vCPU that is out
//! still holds its interrupts. A SCHED_IDLE spinner per CPU keeps the CPU out of the idle
//! loop at no cost to anyone: it runs only when no other task wants the CPU, and the
//! scheduler treats a CPU running only SCHED_IDLE tasks as idle when it places wake-ups.
//!
//! Must never outlive the run: the spinners poll a stop flag and are joined on drop.

use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub struct NoIdle {
    stop: Arc<AtomicBool>,
    spinners: Vec<JoinHandle<()>>,
}

impl NoIdle {
    pub fn start(cpus: &[usize]) -> Result<NoIdle> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut spinners = Vec::with_capacity(cpus.len());
        for &cpu in cpus {
            let stop = stop.clone();
            let spinner = std::thread::Builder::new()
                .name(format!("irq-steal-busy{cpu}"))
                .spawn(move || spin(cpu, &stop))
                .context("starting a SCHED_IDLE spinner")?;
            spinners.push(spinner);
        }
        Ok(NoIdle { stop, spinners })
    }
}

impl Drop for NoIdle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for s in self.spinners.drain(..) {
            let _ = s.join();
        }
    }
}

fn spin(cpu: usize, stop: &AtomicBool) {
    let placed = os_layer::sched::pin_self(cpu).is_ok();
    let idle = os_layer::sched::set_self_policy(libc::SCHED_IDLE, 0).is_ok();
    if !placed || !idle {
        // A spinner that is not pinned or not SCHED_IDLE would take CPU from the guest's
        // tasks: better no spinner (windows on an idle CPU pass unstolen, and the report
        // says so) than a distorted workload.
        eprintln!(
            "irq-steal: no idle-state spinner on CPU {cpu} (pinned {placed}, SCHED_IDLE {idle})"
        );
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        std::hint::spin_loop();
    }
}

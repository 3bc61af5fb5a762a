//! The period loop: every `period_ms`, for every VM, read each vCPU thread's CPU time
//! (host schedstat) and pinning, join the guest's latest report, run the credit core per
//! host run queue, apply the settings through the backend, and tell each guest what was
//! applied. On stop, the backend restores everything it changed.

use anyhow::Result;
use proto::{Applied, Message, VcpuWeight};
use sched_core::CreditParams;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

use crate::backend::{self, Backend};
use crate::config::{Config, VmConfig};
use crate::guest::{self, GuestState};
use crate::weights::{self, VcpuFigures};

struct Vm {
    cfg: VmConfig,
    tids: Vec<u32>,
    guest: Arc<GuestState>,
}

/// On-CPU ns of a host thread (/proc/<tid>/schedstat field 1).
pub fn thread_cpu_ns(tid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{tid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The CPU a thread is pinned to, if exactly one.
fn pinned_cpu(tid: u32) -> Option<usize> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(tid as i32)).ok()?;
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    (cpus.len() == 1).then(|| cpus[0])
}

fn resolve_threads(vm: &VmConfig) -> Vec<u32> {
    if !vm.vcpu_threads.is_empty() {
        return vm.vcpu_threads.clone();
    }
    match &vm.qmp_socket {
        Some(q) => crate::qmp::vcpu_threads(q).unwrap_or_else(|e| {
            warn!(vm = %vm.name, "vCPU threads unknown yet: {e:#}");
            Vec::new()
        }),
        None => Vec::new(),
    }
}

pub fn run(cfg: Config, stop: Arc<AtomicBool>) -> Result<()> {
    let mut backend: Box<dyn Backend> = backend::for_name(&cfg.backend)?;
    let period = Duration::from_millis(cfg.period_ms);
    let params = CreditParams {
        period_ns: period.as_nanos() as u64,
        ..CreditParams::default()
    };
    let mut vms: Vec<Vm> = cfg
        .vms
        .iter()
        .map(|v| Vm {
            cfg: v.clone(),
            tids: resolve_threads(v),
            guest: Arc::new(GuestState::default()),
        })
        .collect();
    let mut threads = Vec::new();
    for vm in &vms {
        if let Some(sock) = vm.cfg.hint_socket.clone() {
            let (name, state, stop) = (vm.cfg.name.clone(), vm.guest.clone(), stop.clone());
            let min = Duration::from_millis(cfg.min_report_interval_ms);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("guest-{name}"))
                    .spawn(move || guest::run(name, sock, min, state, stop))?,
            );
        }
    }
    info!(
        backend = backend.name(),
        vms = vms.len(),
        period_ms = cfg.period_ms,
        "hv-agent running"
    );
    let mut last_cpu: HashMap<u32, u64> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(period);
        let mut figures = Vec::new();
        let mut where_: HashMap<(usize, u32), Option<u32>> = HashMap::new();
        for (i, vm) in vms.iter_mut().enumerate() {
            if vm.tids.is_empty() && vm.cfg.qmp_socket.is_some() {
                vm.tids = resolve_threads(&vm.cfg);
            }
            let reports = vm.guest.fresh(period * 3);
            let n = vm
                .tids
                .len()
                .max(reports.keys().next_back().map_or(0, |&k| k as usize + 1));
            for cpu in 0..n as u32 {
                let tid = vm.tids.get(cpu as usize).copied();
                let consumed = tid.and_then(|t| {
                    let now = thread_cpu_ns(t)?;
                    let prev = last_cpu.insert(t, now)?;
                    Some(now.saturating_sub(prev))
                });
                let r = reports.get(&cpu);
                figures.push(VcpuFigures {
                    key: (i, cpu),
                    run_queue: tid.and_then(pinned_cpu).unwrap_or(usize::MAX),
                    events: r.map_or(0, |r| r.io_completions),
                    ema_ns: r.map_or(0.0, |r| r.io_interval_ema_us * 1e3),
                    consumed_ns: consumed.unwrap_or(0),
                });
                where_.insert((i, cpu), tid);
            }
        }
        let settings = weights::plan(
            &params,
            cfg.max_nice_delta,
            cfg.io_slice_us * 1_000,
            &figures,
        );
        let mut applied: HashMap<usize, Vec<VcpuWeight>> = HashMap::new();
        for s in &settings {
            let vm = &vms[s.key.0];
            let tid = where_.get(&s.key).copied().flatten();
            if let Err(e) = backend.apply(&vm.cfg.name, vm.cfg.domain.as_deref(), tid, s) {
                warn!(vm = %vm.cfg.name, vcpu = s.key.1, "applying failed: {e:#}");
            }
            applied.entry(s.key.0).or_default().push(VcpuWeight {
                cpu: s.key.1,
                weight: 1.25f64.powi(-s.nice),
            });
        }
        if let Err(e) = backend.flush() {
            warn!("backend flush failed: {e:#}");
        }
        for (i, vcpus) in applied {
            let g = &vms[i].guest;
            if g.connected.load(Ordering::Relaxed) && g.reports.load(Ordering::Relaxed) > 0 {
                g.reply(&Message::Applied(Applied {
                    seq: g.last_seq.load(Ordering::Relaxed),
                    vcpus,
                }));
            }
        }
    }
    let restored = backend.restore();
    info!(
        restored,
        backend = backend.name(),
        "restored every scheduling change"
    );
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

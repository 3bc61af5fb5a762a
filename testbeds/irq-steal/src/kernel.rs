//! The kernel side of a run: loads bpf/irqsteal.bpf.c, writes the plan into its maps,
//! opens one `PERF_COUNT_SW_CPU_CLOCK` event per planned CPU with the program attached,
//! and keeps the heartbeat fresh from a controller thread until stopped; then reads what
//! each CPU stole.
//!
//! Owns the BPF object, the perf events, the heartbeat and the liveness thread. Must never
//! start without a validated plan, and never outlive its owner: the links detach when the
//! controller thread ends (stop, drop, or the process's death closes them, or a liveness
//! failure ends it), and the program itself stops stealing when the heartbeat goes stale.

use crate::absorber::{Absorbers, Accounting};
use crate::bpf_skel::IrqstealSkelBuilder;
use crate::controlled::{Controlled, Controller};
use crate::no_idle::NoIdle;
use crate::plan::{Plan, MAX_WINDOWS_PER_CPU};
use crate::report::{CpuSteal, StealReport};
use crate::throttle::ThrottleOff;
use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags};
use std::mem::MaybeUninit;

/// bpf/irqsteal.h IS_MAX_CPUS.
const MAX_CPUS: usize = 1024;
/// The sample period: how often the program looks at the plan on each CPU, and so the
/// most a window can be entered late.
pub const SAMPLE_PERIOD_NS: u64 = 250_000;
/// Between attaching and the plan's t = 0, so that every CPU starts on the same clock.
const LEAD_NS: u64 = 20_000_000;

/// The first fields of `struct perf_event_attr` (PERF_ATTR_SIZE_VER0, 64 bytes), all a
/// software clock event needs.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `disabled`: libbpf enables the event once the program is attached.
const ATTR_DISABLED: u64 = 1;

pub(crate) fn open_cpu_clock(cpu: usize) -> Result<i32> {
    let attr = PerfEventAttr {
        type_: PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        config: PERF_COUNT_SW_CPU_CLOCK,
        sample_period: SAMPLE_PERIOD_NS,
        flags: ATTR_DISABLED,
        ..Default::default()
    };
    // SAFETY: a valid attr that outlives the call; pid -1 with a cpu is a CPU-wide event.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            -1 as libc::pid_t,
            cpu as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(anyhow!(std::io::Error::last_os_error()))
            .with_context(|| format!("perf_event_open(cpu-clock, cpu {cpu})"));
    }
    Ok(fd as i32)
}

/// A running hard-IRQ stealing run.
pub struct IrqSteal {
    run: Controlled<StealReport>,
    /// Dropped after `run`: the spinners end with the run.
    no_idle: Option<NoIdle>,
}

impl IrqSteal {
    /// Validates `plan`, loads and attaches (root), turns perf throttling off, and returns
    /// once every planned CPU is attached; the plan's t = 0 is `start_ns()`, shortly after.
    /// Each window is charged to no fair task (`Accounting::Absorbed`, the default).
    pub fn start(plan: &Plan) -> Result<IrqSteal> {
        IrqSteal::start_with(plan, Accounting::default())
    }

    /// `start`, with the windows' time charged as `accounting` says.
    pub fn start_with(plan: &Plan, accounting: Accounting) -> Result<IrqSteal> {
        let online = os_layer::Root::real().online_cpus()?;
        plan.validate_on(&online).context("refusing the plan")?;
        if !nix::unistd::geteuid().is_root() {
            bail!("irq-steal needs root (BPF, perf events on whole CPUs, a sysctl)");
        }
        for c in &plan.cpus {
            if !online.contains(&c.cpu) || c.cpu >= MAX_CPUS {
                bail!(
                    "CPU {} of the plan is not online (online: {online:?})",
                    c.cpu
                );
            }
        }
        let cpus: Vec<usize> = plan.cpus.iter().map(|c| c.cpu).collect();
        let no_idle = NoIdle::start(&cpus)?;
        let plan = plan.clone();
        let run = Controlled::start("irq-steal", move |ctl| controller(&plan, accounting, ctl))?;
        Ok(IrqSteal {
            run,
            no_idle: Some(no_idle),
        })
    }

    /// CLOCK_MONOTONIC ns of the plan's t = 0 (the clock of `bpf_ktime_get_ns`).
    pub fn start_ns(&self) -> u64 {
        self.run.start_ns()
    }

    /// Makes the liveness thread stop saying that it ran, as when the machine stops
    /// answering: for tests of the controller's answer (starving a normal task on purpose
    /// depends on when the kernel's fair server lets it run, which is not the test's to
    /// choose).
    #[doc(hidden)]
    pub fn silence_liveness(&self) {
        self.run.silence();
    }

    /// Detaches, restores the sysctl and reports what each CPU stole.
    pub fn stop(mut self) -> Result<StealReport> {
        self.finish()
    }

    fn finish(&mut self) -> Result<StealReport> {
        let report = self.run.finish();
        // The spinners end with the run.
        self.no_idle = None;
        report
    }
}

fn controller(plan: &Plan, accounting: Accounting, ctl: Controller) -> Result<StealReport> {
    let mut storage = MaybeUninit::uninit();
    let mut open = match IrqstealSkelBuilder::default()
        .open(&mut storage)
        .context("opening the irq-steal BPF object")
    {
        Ok(o) => o,
        Err(e) => {
            ctl.started(Err(e));
            return Ok(StealReport::default());
        }
    };
    let slots = plan.cpus.len().max(1);
    let set_up = (|| -> Result<_> {
        open.maps
            .windows
            .set_max_entries((slots * MAX_WINDOWS_PER_CPU) as u32)
            .context("sizing the windows map")?;
        let mut skel = open.load().context("loading bpf/irqsteal.bpf.c")?;
        for (slot, c) in plan.cpus.iter().enumerate() {
            for (k, w) in c.windows.iter().enumerate() {
                let key = (slot * MAX_WINDOWS_PER_CPU + k) as u32;
                let mut value = [0u8; 16];
                value[..8].copy_from_slice(&w.start_ns.to_ne_bytes());
                value[8..].copy_from_slice(&w.end_ns.to_ne_bytes());
                skel.maps
                    .windows
                    .update(&key.to_ne_bytes(), &value, MapFlags::ANY)
                    .with_context(|| format!("writing CPU {} window {k}", c.cpu))?;
            }
        }
        let bss = skel
            .maps
            .bss_data
            .as_deref_mut()
            .context("the irq-steal BPF object has no mmapped .bss")?;
        for (slot, c) in plan.cpus.iter().enumerate() {
            bss.cpus[c.cpu].slot = slot as u32;
            bss.cpus[c.cpu].nwindows = c.windows.len() as u32;
        }
        bss.heartbeat_ns = os_layer::monotonic_ns();
        let throttle = ThrottleOff::new()?;
        let mut links = Vec::new();
        for c in &plan.cpus {
            let fd = open_cpu_clock(c.cpu)?;
            // The link owns the fd from here: detaching closes it.
            let link = skel
                .progs
                .steal
                .attach_perf_event(fd)
                .with_context(|| format!("attaching the stealing program on CPU {}", c.cpu))?;
            links.push(link);
        }
        Ok((skel, throttle, links))
    })();
    let (mut skel, throttle, links) = match set_up {
        Ok(x) => x,
        Err(e) => {
            ctl.started(Err(e));
            return Ok(StealReport::default());
        }
    };
    let Some(bss) = skel.maps.bss_data.as_deref_mut() else {
        unreachable!("checked while setting up");
    };
    // Raw pointers: the program writes the counters concurrently, so no Rust reference to
    // the .bss is held across the run.
    let heartbeat: *mut u64 = std::ptr::addr_of_mut!(bss.heartbeat_ns);
    let start: *mut u64 = std::ptr::addr_of_mut!(bss.start_ns);
    let cpus: *mut crate::bpf_skel::types::steal_cpu = std::ptr::addr_of_mut!(bss.cpus).cast();
    let start_ns = os_layer::monotonic_ns() + LEAD_NS;
    let absorbers = match accounting {
        Accounting::Interrupted => None,
        Accounting::Absorbed => match Absorbers::start(plan, start_ns) {
            Ok(a) => Some(a),
            Err(e) => {
                ctl.started(Err(e));
                return Ok(StealReport::default());
            }
        },
    };
    // Real-time only once the absorbers are in place: each turns SCHED_FIFO on its CPU
    // before it says so over a channel, and a receiver of higher priority on that CPU
    // that spins (yields) for a send in progress never lets the sender finish. That hung
    // a benchmark for 20 minutes (the controller at priority 2 yielding on CPU 1, the
    // absorber there at priority 1 runnable and never run).
    ctl.make_realtime();
    for &(cpu, tid) in absorbers.iter().flat_map(|a| a.tids.iter()) {
        // SAFETY: cpu < MAX_CPUS (checked at start); the program reads it at its next
        // sample, and reads 0 (no absorber) until then.
        unsafe { std::ptr::addr_of_mut!((*cpus.add(cpu)).absorber_tid).write_volatile(tid) };
    }
    // SAFETY: both point into the mmapped .bss of the loaded skeleton, alive until return.
    unsafe {
        heartbeat.write_volatile(os_layer::monotonic_ns());
        start.write_volatile(start_ns);
    }
    ctl.started(Ok(start_ns));
    // SAFETY: as above.
    let unanswered = ctl.keep_beating(start_ns, |now| unsafe { heartbeat.write_volatile(now) });
    drop(links);
    drop(absorbers);
    let report = StealReport {
        cpus: plan
            .cpus
            .iter()
            .map(|c| {
                // SAFETY: c.cpu < MAX_CPUS (checked at start); the program is detached.
                let s = unsafe { cpus.add(c.cpu).read_volatile() };
                CpuSteal {
                    cpu: c.cpu,
                    asked_ns: plan.asked_ns(c.cpu),
                    stolen_ns: s.stolen_ns,
                    windows: c.windows.len() as u64,
                    windows_hit: s.windows_hit,
                    windows_missed: s.windows_missed,
                    late_ns: s.late_ns,
                    watchdog_skips: s.watchdog_skips,
                    samples: s.samples,
                    absorbed_ns: s.absorbed_ns,
                }
            })
            .collect(),
    };
    throttle.restore()?;
    if let Some((silent_ns, at_ns)) = unanswered {
        bail!(
            "the machine stopped answering: no normal task of this process ran for {} ms \
             (at {:.3} s of the run); stealing stopped there, {} ms of windows stolen in all",
            silent_ns / 1_000_000,
            at_ns as f64 / 1e9,
            report.cpus.iter().map(|c| c.stolen_ns).sum::<u64>() / 1_000_000
        );
    }
    Ok(report)
}

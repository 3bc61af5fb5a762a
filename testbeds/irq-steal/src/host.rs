//! A host scheduler in the loop: bpf/hostmodel.bpf.c decides online, per CPU, whether our
//! guest's vCPU (this kernel's CPU) or one of the other VMs' vCPUs pinned there holds the
//! CPU, by a fair (KVM-like) or credit (Xen-like) policy, with weights that user space (a
//! benchmark, or the host agent's `model` backend through the pinned `control` map) may
//! change at any time. Unlike a `Plan`, nothing is fixed before the run: a vCPU that halts
//! gives its CPU away and its interrupt wakes it.
//!
//! Owns the BPF object, the perf events, the tracepoint links, the pinned maps and the
//! heartbeat; like `kernel`, it never outlives its owner (the links go with the controller
//! thread, the program stops taking CPUs when the heartbeat goes stale) and unpins its maps
//! when it stops.
//!
//! Not like a real host: the out time is charged to the task interrupted (no steal
//! accounting, no absorber: when the model takes a CPU is not known in advance), and the
//! steal the model publishes (`ModelReader::guest_steal_ns`) is not in `/proc/stat`.

use crate::bpf_skel::hostmodel::{types, HostmodelSkelBuilder};
use crate::controlled::{Controlled, Controller};
use crate::kernel::open_cpu_clock;
use crate::throttle::ThrottleOff;
use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use serde::{Deserialize, Serialize};
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};

/// bpf/hostmodel.h.
pub const MAX_CPUS: usize = 64;
pub const MAX_SLOTS: usize = 8;
const DEFAULT_WEIGHT: u32 = 1024;
const POLICY_FAIR: u32 = 1;
const POLICY_CREDIT: u32 = 2;
/// Between attaching and the model's t = 0.
const LEAD_NS: u64 = 20_000_000;
/// Where the model pins `control` and `entities` unless told otherwise: the agent's
/// `model` backend looks there by default.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/vmigrater-host-model";

/// The host scheduler's policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// KVM's host: weighted vruntime, 3 ms slices, bounded sleeper credit, wake-up
    /// preemption.
    Fair,
    /// Xen's credit1: 30 ms slices, credits by weight, BOOST for a vCPU woken with credit.
    Credit,
}

impl std::str::FromStr for Policy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fair" => Ok(Policy::Fair),
            "credit" => Ok(Policy::Credit),
            _ => bail!("host policy {s:?}: expected `fair` or `credit`"),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::Fair => "fair",
            Policy::Credit => "credit",
        })
    }
}

/// The other VMs' vCPUs compute for `on_ns` of every `period_ns` (each in its own phase)
/// and sleep the rest; without one they are CPU-bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Duty {
    pub period_ns: u64,
    pub on_ns: u64,
}

/// The policies' timings (bpf/hostmodel.bpf.c's read-only data).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    pub base_slice_ns: u64,
    pub wakeup_gran_ns: u64,
    pub sleeper_credit_ns: u64,
    pub credit_slice_ns: u64,
    pub credit_tick_ns: u64,
    pub credit_period_ns: u64,
}

impl Default for Timings {
    fn default() -> Self {
        // EEVDF's base slice on an 8-CPU host (0.75 ms x (1 + log2 8)); CFS's wake-up
        // granularity and gentle sleeper credit; Xen credit1's defaults.
        Timings {
            base_slice_ns: 3_000_000,
            wakeup_gran_ns: 1_000_000,
            sleeper_credit_ns: 3_000_000,
            credit_slice_ns: 30_000_000,
            credit_tick_ns: 10_000_000,
            credit_period_ns: 30_000_000,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostConfig {
    pub policy: Policy,
    /// vCPUs per CPU, ours included (k).
    pub vms_per_cpu: usize,
    pub cpus: Vec<usize>,
    pub duty: Option<Duty>,
    pub timings: Timings,
    /// Where `control` and `entities` are pinned for the run.
    pub pin_dir: PathBuf,
}

impl HostConfig {
    pub fn new(policy: Policy, vms_per_cpu: usize, cpus: Vec<usize>) -> HostConfig {
        HostConfig {
            policy,
            vms_per_cpu,
            cpus,
            duty: None,
            timings: Timings::default(),
            pin_dir: DEFAULT_PIN_DIR.into(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(2..=MAX_SLOTS).contains(&self.vms_per_cpu) {
            bail!(
                "vCPUs per CPU: {} (from 2 to {MAX_SLOTS})",
                self.vms_per_cpu
            );
        }
        if self.cpus.is_empty() {
            bail!("no CPU to model");
        }
        if let Some(c) = self.cpus.iter().find(|&&c| c >= MAX_CPUS) {
            bail!("CPU {c}: the model holds CPUs 0 to {}", MAX_CPUS - 1);
        }
        if let Some(d) = self.duty {
            if d.period_ns == 0 || d.on_ns == 0 || d.on_ns > d.period_ns {
                bail!(
                    "duty cycle {} ns of {} ns: needs 0 < on <= period",
                    d.on_ns,
                    d.period_ns
                );
            }
        }
        let t = &self.timings;
        if [
            t.base_slice_ns,
            t.credit_slice_ns,
            t.credit_tick_ns,
            t.credit_period_ns,
        ]
        .contains(&0)
        {
            bail!("the policies' slices, tick and period must not be 0: {t:?}");
        }
        Ok(())
    }
}

/// What one vCPU of the model did (bpf/hostmodel.h `struct hm_entity`'s counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntityCounters {
    pub run_ns: u64,
    /// Runnable without the CPU: for our vCPU, its steal.
    pub wait_ns: u64,
    pub halted_ns: u64,
    pub wakeups: u64,
}

/// Reads the model's counters while it runs, from any thread.
pub struct ModelReader {
    entities: MapHandle,
    cpus: Vec<usize>,
    vms_per_cpu: usize,
}

fn key(cpu: usize, slot: usize) -> [u8; 4] {
    ((cpu * MAX_SLOTS + slot) as u32).to_ne_bytes()
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

impl ModelReader {
    pub fn entity(&self, cpu: usize, slot: usize) -> Option<EntityCounters> {
        let v = self
            .entities
            .lookup(&key(cpu, slot), MapFlags::ANY)
            .ok()??;
        Some(EntityCounters {
            run_ns: u64_at(&v, 0),
            wait_ns: u64_at(&v, 1),
            halted_ns: u64_at(&v, 2),
            wakeups: u64_at(&v, 3),
        })
    }

    /// Our vCPU's steal so far on each modelled CPU (in `cpus` order).
    pub fn guest_steal_ns(&self) -> Vec<u64> {
        self.cpus
            .iter()
            .map(|&c| self.entity(c, 0).map_or(0, |e| e.wait_ns))
            .collect()
    }

    /// The other VMs' run time so far, summed over the modelled CPUs.
    pub fn others_run_ns(&self) -> u64 {
        self.cpus
            .iter()
            .flat_map(|&c| (1..self.vms_per_cpu).map(move |s| (c, s)))
            .filter_map(|(c, s)| self.entity(c, s))
            .map(|e| e.run_ns)
            .sum()
    }
}

/// One modelled CPU at the end of a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCpu {
    pub cpu: usize,
    /// Our vCPU: run, out (steal), halted time and wake-ups.
    pub guest: EntityCounters,
    /// The other VMs' vCPUs on this CPU, slot 1 first.
    pub others: Vec<EntityCounters>,
    pub samples: u64,
    /// Times our runnable vCPU was taken off, and the time it was out in all.
    pub outs: u64,
    pub out_ns: u64,
    /// Time the hooks spun (out time minus what the vCPU spent out while halted is not
    /// in it: a halted vCPU needs no spin).
    pub spun_ns: u64,
    pub spin_cuts: u64,
    pub wake_preempts: u64,
    pub wake_waits: u64,
    pub wake_wait_ns: u64,
    pub watchdog_skips: u64,
    pub irq_holds: u64,
    pub lumped: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostReport {
    pub policy: Policy,
    pub vms_per_cpu: usize,
    pub duty: Option<Duty>,
    pub timings: Timings,
    pub wall_ns: u64,
    pub cpus: Vec<HostCpu>,
}

impl HostReport {
    /// Our vCPUs' run time over run + out, over every modelled CPU: the share of the CPUs
    /// our guest got while it wanted them.
    pub fn guest_share(&self) -> f64 {
        let run: u64 = self.cpus.iter().map(|c| c.guest.run_ns).sum();
        let out: u64 = self.cpus.iter().map(|c| c.guest.wait_ns).sum();
        run as f64 / (run + out).max(1) as f64
    }

    /// The other VMs' CPU time, all CPUs.
    pub fn others_run_ns(&self) -> u64 {
        self.cpus
            .iter()
            .flat_map(|c| c.others.iter())
            .map(|e| e.run_ns)
            .sum()
    }
}

/// A running model.
pub struct HostModel {
    config: HostConfig,
    run: Controlled<HostReport>,
}

impl HostModel {
    /// Validates, loads, writes the initial state, pins `control` and `entities` in
    /// `config.pin_dir`, attaches on every CPU of `config.cpus` (root) and returns once
    /// the model runs.
    pub fn start(config: &HostConfig) -> Result<HostModel> {
        config.validate().context("refusing the host model")?;
        let online = os_layer::Root::real().online_cpus()?;
        if let Some(c) = config.cpus.iter().find(|c| !online.contains(c)) {
            bail!("CPU {c} is not online (online: {online:?})");
        }
        if !nix::unistd::geteuid().is_root() {
            bail!("the host model needs root (BPF, perf events on whole CPUs, bpffs)");
        }
        mount_bpffs(&config.pin_dir)?;
        let cfg = config.clone();
        Ok(HostModel {
            config: config.clone(),
            run: Controlled::start("host-model", move |ctl| controller(&cfg, ctl))?,
        })
    }

    pub fn start_ns(&self) -> u64 {
        self.run.start_ns()
    }

    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// A reader of the live counters (through the pinned map).
    pub fn reader(&self) -> Result<ModelReader> {
        let path = self.config.pin_dir.join("entities");
        Ok(ModelReader {
            entities: MapHandle::from_pinned_path(&path)
                .with_context(|| format!("opening {}", path.display()))?,
            cpus: self.config.cpus.clone(),
            vms_per_cpu: self.config.vms_per_cpu,
        })
    }

    /// Detaches, unpins and reports.
    pub fn stop(mut self) -> Result<HostReport> {
        self.run.finish()
    }
}

fn mount_bpffs(pin_dir: &Path) -> Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if pin_dir.starts_with(root) {
        let mounted = std::fs::read_to_string("/proc/self/mounts")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf"));
        if !mounted {
            nix::mount::mount(
                Some("bpf"),
                root,
                Some("bpf"),
                nix::mount::MsFlags::empty(),
                None::<&str>,
            )
            .context("mounting bpffs at /sys/fs/bpf")?;
        }
    }
    if pin_dir.exists() {
        // A model that died unstopped leaves its pins; nothing else pins there.
        for f in ["control", "entities"] {
            let _ = std::fs::remove_file(pin_dir.join(f));
        }
    }
    std::fs::create_dir_all(pin_dir).with_context(|| format!("creating {}", pin_dir.display()))
}

/// Removes the pins, whatever happens to the run.
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        for f in ["control", "entities"] {
            let _ = std::fs::remove_file(self.0.join(f));
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn entity_value(slot: usize, k: usize, t: &Timings) -> Vec<u8> {
    let mut v = vec![0u8; std::mem::size_of::<types::hm_entity>()];
    // credit: a period's share each; queued_ns: round robin starts with our vCPU.
    let credit = (t.credit_period_ns / k as u64) as i64;
    v[40..48].copy_from_slice(&credit.to_ne_bytes());
    v[48..56].copy_from_slice(&(slot as u64).to_ne_bytes());
    v[60..64].copy_from_slice(&DEFAULT_WEIGHT.to_ne_bytes());
    v
}

fn controller(config: &HostConfig, ctl: Controller) -> Result<HostReport> {
    let mut storage = MaybeUninit::uninit();
    let mut open = match HostmodelSkelBuilder::default()
        .open(&mut storage)
        .context("opening the host model's BPF object")
    {
        Ok(o) => o,
        Err(e) => {
            ctl.started(Err(e));
            return Err(anyhow!("not started"));
        }
    };
    let set_up = (|| -> Result<_> {
        let t = config.timings;
        let ro = open
            .maps
            .rodata_data
            .as_deref_mut()
            .context("the host model's BPF object has no read-only data")?;
        ro.base_slice_ns = t.base_slice_ns;
        ro.wakeup_gran_ns = t.wakeup_gran_ns;
        ro.sleeper_credit_ns = t.sleeper_credit_ns;
        ro.credit_slice_ns = t.credit_slice_ns;
        ro.credit_tick_ns = t.credit_tick_ns;
        ro.credit_period_ns = t.credit_period_ns;
        let mut skel = open.load().context("loading bpf/hostmodel.bpf.c")?;
        let k = config.vms_per_cpu;
        for &cpu in &config.cpus {
            for slot in 0..k {
                skel.maps
                    .entities
                    .update(&key(cpu, slot), &entity_value(slot, k, &t), MapFlags::ANY)
                    .with_context(|| format!("writing CPU {cpu} slot {slot}"))?;
            }
        }
        let pins = Pins(config.pin_dir.clone());
        skel.maps
            .control
            .pin(config.pin_dir.join("control"))
            .context("pinning the control map")?;
        skel.maps
            .entities
            .pin(config.pin_dir.join("entities"))
            .context("pinning the entities map")?;
        let throttle = ThrottleOff::new()?;
        let mut links = Vec::new();
        for &cpu in &config.cpus {
            let fd = open_cpu_clock(cpu)?;
            links.push(
                skel.progs
                    .tick
                    .attach_perf_event(fd)
                    .with_context(|| format!("attaching the model's tick on CPU {cpu}"))?,
            );
        }
        links.push(
            skel.progs
                .idle
                .attach()
                .context("attaching the model to cpu_idle")?,
        );
        links.push(
            skel.progs
                .irq
                .attach()
                .context("attaching the model to irq_handler_entry")?,
        );
        Ok((skel, pins, throttle, links))
    })();
    let (mut skel, pins, throttle, links) = match set_up {
        Ok(x) => x,
        Err(e) => {
            ctl.started(Err(e));
            return Err(anyhow!("not started"));
        }
    };
    let Some(bss) = skel.maps.bss_data.as_deref_mut() else {
        ctl.started(Err(anyhow!(
            "the host model's BPF object has no mmapped .bss"
        )));
        return Err(anyhow!("not started"));
    };
    let start_ns = os_layer::monotonic_ns() + LEAD_NS;
    let t = config.timings;
    for &cpu in &config.cpus {
        let c = &mut bss.cpus[cpu];
        c.nslots = config.vms_per_cpu as u32;
        c.policy = match config.policy {
            Policy::Fair => POLICY_FAIR,
            Policy::Credit => POLICY_CREDIT,
        };
        if let Some(d) = config.duty {
            c.duty_period_ns = d.period_ns;
            c.duty_on_ns = d.on_ns;
        }
        c.curr = 0;
        c.last_ns = start_ns;
        c.slice_end_ns = start_ns
            + match config.policy {
                Policy::Fair => t.base_slice_ns,
                Policy::Credit => t.credit_slice_ns,
            };
        c.next_tick_ns = start_ns + t.credit_tick_ns;
        c.next_refill_ns = start_ns + t.credit_period_ns;
    }
    // Raw pointers from here: the program writes the counters concurrently.
    let heartbeat: *mut u64 = std::ptr::addr_of_mut!(bss.heartbeat_ns);
    let start: *mut u64 = std::ptr::addr_of_mut!(bss.start_ns);
    let cpus: *mut types::hm_cpu = std::ptr::addr_of_mut!(bss.cpus).cast();
    ctl.make_realtime();
    // SAFETY: both point into the mmapped .bss of the loaded skeleton, alive until return.
    unsafe {
        heartbeat.write_volatile(os_layer::monotonic_ns());
        start.write_volatile(start_ns);
    }
    ctl.started(Ok(start_ns));
    // SAFETY: as above.
    let unanswered = ctl.keep_beating(start_ns, |now| unsafe { heartbeat.write_volatile(now) });
    let end_ns = os_layer::monotonic_ns();
    drop(links);
    let k = config.vms_per_cpu;
    let read = |cpu: usize, slot: usize| -> EntityCounters {
        skel.maps
            .entities
            .lookup(&key(cpu, slot), MapFlags::ANY)
            .ok()
            .flatten()
            .map(|v| EntityCounters {
                run_ns: u64_at(&v, 0),
                wait_ns: u64_at(&v, 1),
                halted_ns: u64_at(&v, 2),
                wakeups: u64_at(&v, 3),
            })
            .unwrap_or_default()
    };
    let report = HostReport {
        policy: config.policy,
        vms_per_cpu: k,
        duty: config.duty,
        timings: config.timings,
        wall_ns: end_ns.saturating_sub(start_ns),
        cpus: config
            .cpus
            .iter()
            .map(|&cpu| {
                // SAFETY: cpu < MAX_CPUS (validated); the programs are detached.
                let c = unsafe { cpus.add(cpu).read_volatile() };
                HostCpu {
                    cpu,
                    guest: read(cpu, 0),
                    others: (1..k).map(|s| read(cpu, s)).collect(),
                    samples: c.samples,
                    outs: c.outs,
                    out_ns: c.out_ns,
                    spun_ns: c.spun_ns,
                    spin_cuts: c.spin_cuts,
                    wake_preempts: c.wake_preempts,
                    wake_waits: c.wake_waits,
                    wake_wait_ns: c.wake_wait_ns,
                    watchdog_skips: c.watchdog_skips,
                    irq_holds: c.irq_holds,
                    lumped: c.lumped,
                }
            })
            .collect(),
    };
    drop(pins);
    throttle.restore()?;
    if let Some((silent_ns, at_ns)) = unanswered {
        bail!(
            "the machine stopped answering: no normal task of this process ran for {} ms \
             (at {:.3} s of the run); the model stopped there",
            silent_ns / 1_000_000,
            at_ns as f64 / 1e9
        );
    }
    Ok(report)
}

//! The BPF adapter: opens, loads and attaches bpf/iotrack.bpf.c with fallbacks
//! (tp_btf → raw_tp → classic tracepoint), and reads its maps. It owns the BPF objects
//! and must never do per-I/O work in user space: it only reads aggregated maps.

use anyhow::{anyhow, Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject};
use std::mem::MaybeUninit;

use crate::bpf_skel::{types, IotrackSkel, IotrackSkelBuilder};
use crate::classifier::Completions;
use crate::hooks::{plan_hooks, AttachMode, INFLIGHT_STALE_NS};
use crate::probe::{probe, tracepoint_in_btf, tracepoint_in_tracefs};

/// Map entries fetched per batch lookup.
const BATCH: u32 = 256;
/// bpf/iotrack.h MAX_CPUS.
const MAX_CPUS: u32 = 1024;
#[derive(Clone, Debug, Default)]
pub struct TrackerOptions {
    /// Use exactly this mode instead of the first that works.
    pub force_mode: Option<AttachMode>,
}

/// One thread's cumulative block I/O.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadIoSample {
    pub tid: u32,
    pub tgid: u32,
    pub ios: u64,
    pub bytes: u64,
    /// Time with ≥ 1 request in flight, including the open interval up to `now_ns`.
    pub busy_ns: u64,
    pub in_flight: u32,
    pub last_cpu: u32,
    /// Last start or completion (CLOCK_MONOTONIC ns).
    pub last_ts: u64,
    pub completions: Completions,
}

/// Wake-ups of `wakee` by `waker` counted by the programs since the last read, where one
/// of the two issued block I/O (`IoTracker::take_wakes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeSample {
    pub waker: u32,
    pub waker_tgid: u32,
    pub wakee: u32,
    pub wakee_tgid: u32,
    pub wakes: u64,
}

/// A thread born with fewer CPUs allowed than the machine has (`IoTracker::take_forks`):
/// it may carry a pin its parent had from us.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkSample {
    pub child: u32,
    pub child_tgid: u32,
    /// The thread that started it.
    pub parent: u32,
    /// Its allowed CPUs 0-63 at birth, one bit each.
    pub mask: u64,
}

impl ForkSample {
    /// Its allowed CPUs at birth, in order.
    pub fn born_cpus(&self) -> Vec<usize> {
        (0..64).filter(|&c| self.mask & (1 << c) != 0).collect()
    }
}

/// One vCPU's I/O completions (ISACS E_n and the Eq. 1 EMA).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuIoSample {
    pub cpu: u32,
    pub completions: u64,
    pub ema_interval_ns: u64,
}

/// Where a tracker's BPF object lives. The caller owns it and keeps it for as long as the
/// tracker, which borrows it (sched-ext/scx keeps its `OpenObject` the same way, on the
/// stack of the thread that runs the scheduler). One slot per attach mode, so a mode that
/// fails part-way leaves the next a fresh one.
pub struct TrackerStorage([MaybeUninit<OpenObject>; AttachMode::ALL.len()]);

impl TrackerStorage {
    pub fn new() -> TrackerStorage {
        TrackerStorage([const { MaybeUninit::uninit() }; AttachMode::ALL.len()])
    }
}

impl Default for TrackerStorage {
    fn default() -> TrackerStorage {
        TrackerStorage::new()
    }
}

/// The loaded and attached programs. Not `Send`: libbpf's objects stay on the thread
/// that opened them, so a daemon opens its tracker on the thread that polls it.
pub struct IoTracker<'obj> {
    // Field order is drop order: links detach first, then the skeleton closes its
    // programs and maps; the storage it borrows outlives both. Empty while detached.
    links: Vec<Link>,
    skel: IotrackSkel<'obj>,
    mode: AttachMode,
    hooks: Vec<&'static str>,
    /// Sampled tracking between samples (bpf/iotrack.bpf.c `paused`).
    paused: bool,
    ncpus: u32,
}

/// The BPF program implementing `hook` in `mode` (see bpf/iotrack.bpf.c).
/// The `wanted` programs of `skel` put on their tracepoints.
fn attach_links(skel: &IotrackSkel<'_>, wanted: &[String]) -> Result<Vec<Link>> {
    let mut links = Vec::new();
    for prog in skel.object().progs_mut() {
        let name = prog.name().to_string_lossy().to_string();
        if wanted.contains(&name) {
            links.push(prog.attach().with_context(|| format!("attaching {name}"))?);
        }
    }
    Ok(links)
}

fn prog_name(mode: AttachMode, hook: &str) -> String {
    let prefix = match mode {
        AttachMode::TpBtf => "btf",
        AttachMode::RawTp => "raw",
        AttachMode::Tracepoint => "tp",
    };
    format!("{prefix}_{}", hook.trim_start_matches("block_"))
}

/// The fd of a loaded program; None for one left unloaded (another mode's).
fn prog_fd(prog: &libbpf_rs::Program<'_>) -> Option<i32> {
    use std::os::fd::{AsFd, AsRawFd};
    if !prog.autoload() {
        return None;
    }
    Some(prog.as_fd().as_raw_fd())
}

/// Turns a load failure into advice when privileges are the likely cause.
fn explain(err: anyhow::Error) -> anyhow::Error {
    let text = format!("{err:#}");
    let perm = text.contains("EPERM")
        || text.contains("Operation not permitted")
        || text.contains("EACCES")
        || text.contains("Permission denied");
    if !nix::unistd::geteuid().is_root() {
        err.context(
            "loading BPF needs root (or CAP_BPF + CAP_PERFMON + CAP_SYS_RESOURCE): run as root",
        )
    } else if perm {
        err.context(
            "permission denied although root: raise the locked-memory limit \
             (`ulimit -l unlimited`, LimitMEMLOCK=infinity in the unit) and check \
             kernel lockdown / kernel.unprivileged_bpf_disabled",
        )
    } else {
        err
    }
}

impl<'obj> IoTracker<'obj> {
    /// Loads and attaches the programs, trying each mode in turn unless one is forced.
    pub fn open(opts: &TrackerOptions, storage: &'obj mut TrackerStorage) -> Result<Self> {
        let modes: Vec<AttachMode> = match opts.force_mode {
            Some(m) => vec![m],
            None => AttachMode::ALL.to_vec(),
        };
        let mut errors = Vec::new();
        for (mode, slot) in modes.into_iter().zip(storage.0.iter_mut()) {
            match Self::open_mode(mode, &[], slot) {
                Ok(t) => return Ok(t),
                Err(e) => {
                    tracing::debug!(%mode, "attach failed: {e:#}");
                    errors.push(format!("{mode}: {e:#}"));
                }
            }
        }
        Err(explain(anyhow!(
            "no BPF attach mode worked ({})",
            errors.join("; ")
        )))
    }

    /// Attaches in `mode` as if the kernel lacked the tracepoints in `hidden`: exercises
    /// the fallbacks for older kernels (e.g. hide `block_io_start` for the pre-6.5 path)
    /// on this one.
    pub fn open_without(
        mode: AttachMode,
        hidden: &[&str],
        storage: &'obj mut TrackerStorage,
    ) -> Result<Self> {
        Self::open_mode(mode, hidden, &mut storage.0[0]).map_err(explain)
    }

    fn open_mode(
        mode: AttachMode,
        hidden: &[&str],
        slot: &'obj mut MaybeUninit<OpenObject>,
    ) -> Result<Self> {
        if mode == AttachMode::Tracepoint {
            crate::probe::ensure_tracefs();
        }
        let hooks = plan_hooks(|tp| {
            !hidden.contains(&tp)
                && match mode {
                    AttachMode::TpBtf => tracepoint_in_btf(tp),
                    AttachMode::RawTp => tracepoint_in_btf(tp) || tracepoint_in_tracefs(tp),
                    AttachMode::Tracepoint => tracepoint_in_tracefs(tp),
                }
        })
        .ok_or_else(|| anyhow!("block tracepoints not available for {mode}"))?;
        let wanted: Vec<String> = hooks.iter().map(|h| prog_name(mode, h)).collect();
        let (skel, links) = Self::load_attach(mode, slot, &wanted)?;
        tracing::debug!(%mode, ?hooks, "block I/O programs attached");
        let ncpus = libbpf_rs::num_possible_cpus()
            .unwrap_or(1)
            .min(MAX_CPUS as usize) as u32;
        let mut tracker = IoTracker {
            links,
            paused: false,
            skel,
            mode,
            hooks,
            ncpus,
        };
        tracker.watch_forks()?;
        Ok(tracker)
    }

    fn load_attach(
        mode: AttachMode,
        slot: &'obj mut MaybeUninit<OpenObject>,
        wanted: &[String],
    ) -> Result<(IotrackSkel<'obj>, Vec<Link>)> {
        let mut open = IotrackSkelBuilder::default()
            .open(slot)
            .context("opening the BPF object")?;
        // Only this mode's programs load: a flavour the kernel lacks must not fail the rest.
        for mut prog in open.open_object_mut().progs_mut() {
            let name = prog.name().to_string_lossy().to_string();
            prog.set_autoload(wanted.contains(&name));
        }
        let skel = open
            .load()
            .with_context(|| format!("loading the {mode} programs"))?;
        let links = attach_links(&skel, wanted)?;
        Ok((skel, links))
    }

    /// Whether the programs track block requests now (not paused).
    pub fn tracking(&self) -> bool {
        !self.paused
    }

    /// The programs' mmapped .bss (their flags and the doorbell).
    fn bss(&mut self) -> Result<&mut types::bss> {
        self.skel
            .maps
            .bss_data
            .as_deref_mut()
            .context("the block I/O BPF object has no mmapped .bss")
    }

    fn set_paused(&mut self, paused: bool) -> Result<()> {
        let bss = self.bss()?;
        // SAFETY: a valid, aligned u32 in the mmapped .bss the programs read concurrently;
        // a volatile store so the write is not elided or torn.
        unsafe { std::ptr::write_volatile(std::ptr::addr_of_mut!(bss.paused), u32::from(paused)) };
        self.paused = paused;
        Ok(())
    }

    /// Whether a thread that did no block I/O for seconds issued a request while paused
    /// (bpf/iotrack.bpf.c `doorbell`): something may have just become I/O-bound. Reading
    /// clears it.
    pub fn take_doorbell(&mut self) -> bool {
        let Ok(bss) = self.bss() else {
            return false;
        };
        // SAFETY: a valid, aligned u32 in the mmapped .bss the programs write concurrently;
        // volatile so neither the read nor the clear is elided. A ring between the two is
        // lost only while another ring is being taken.
        unsafe {
            let rang = std::ptr::read_volatile(std::ptr::addr_of!(bss.doorbell)) != 0;
            if rang {
                std::ptr::write_volatile(std::ptr::addr_of_mut!(bss.doorbell), 0);
            }
            rang
        }
    }

    /// Tells the fork program how many CPUs are online: a child allowed fewer was narrowed
    /// by someone (`take_forks`).
    fn watch_forks(&mut self) -> Result<()> {
        let online = nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
            .ok()
            .flatten()
            .unwrap_or(0)
            .max(0) as u32;
        let bss = self.bss()?;
        // SAFETY: a valid, aligned u32 in the mmapped .bss the programs read concurrently.
        unsafe { std::ptr::write_volatile(std::ptr::addr_of_mut!(bss.all_cpus), online) };
        Ok(())
    }

    /// The threads born narrowed since the last call, and the map emptied.
    pub fn take_forks(&mut self) -> Result<Vec<ForkSample>> {
        drain(&self.skel.maps.forks, |child: u32, f: types::fork_seen| {
            ForkSample {
                child,
                child_tgid: f.child_tgid,
                parent: f.parent,
                mask: f.mask,
            }
        })
    }

    /// The wake-ups counted since the last call, and the map emptied: counts are per
    /// read. A wake-up counted between the read and the delete of its pair is lost.
    pub fn take_wakes(&mut self) -> Result<Vec<WakeSample>> {
        drain(
            &self.skel.maps.wakes,
            |key: types::wake_pair, val: types::wake_stats| WakeSample {
                waker: key.waker,
                waker_tgid: val.waker_tgid,
                wakee: key.wakee,
                wakee_tgid: val.wakee_tgid,
                wakes: val.wakes,
            },
        )
    }

    /// Stops tracking: every hook returns at once (a flag, not a detach: detaching
    /// patches kernel text with IPIs that wait for every vCPU, descheduled ones too),
    /// and the counters stand still. Requests in flight lose their ends, so their
    /// intervals are closed now and the in-flight table is emptied; an end that arrives
    /// after `resume` finds no entry and is ignored, the same as one whose start was
    /// never seen.
    pub fn pause(&mut self, now_ns: u64) -> Result<()> {
        if self.paused {
            return Ok(());
        }
        self.set_paused(true)?;
        wait_for_running_programs();
        let inflight = &self.skel.maps.inflight;
        let keys: Vec<Vec<u8>> = inflight
            .lookup_batch(BATCH, MapFlags::ANY, MapFlags::ANY)?
            .map(|(k, _)| k)
            .collect();
        for k in keys {
            let _ = inflight.delete(&k);
        }
        let threads = &self.skel.maps.threads;
        let open: Vec<(Vec<u8>, types::thread_stats)> = threads
            .lookup_batch(BATCH, MapFlags::ANY, MapFlags::ANY)?
            .filter_map(|(k, v)| Some((k, read_pod::<types::thread_stats>(&v).ok()?)))
            .filter(|(_, s)| s.in_flight > 0)
            .collect();
        for (k, mut s) in open {
            s.busy_ns += now_ns.saturating_sub(s.busy_since);
            s.in_flight = 0;
            threads
                .update(&k, pod_bytes(&s), MapFlags::EXIST)
                .context("closing a paused thread's busy interval")?;
        }
        Ok(())
    }

    /// Tracks again after `pause` (attaching first if detached).
    pub fn resume(&mut self) -> Result<()> {
        self.attach()?;
        if self.paused {
            self.set_paused(false)?;
        }
        Ok(())
    }

    /// Whether the programs sit on their tracepoints (paused or not).
    pub fn attached(&self) -> bool {
        !self.links.is_empty()
    }

    /// Pauses, then takes the programs off their tracepoints: while paused each request
    /// still runs a program that returns at once (on the issuing path and in the
    /// completion interrupt, dear where the CPU is emulated); detached, none. Detaching and attaching
    /// patch kernel text (static keys, IPIs to every CPU), so this is for long pauses
    /// only; maps and what the classifier knows stay.
    pub fn detach(&mut self, now_ns: u64) -> Result<()> {
        self.pause(now_ns)?;
        self.links.clear();
        Ok(())
    }

    /// The kernel ids of the loaded programs (`bpftool prog show id N`; the links the
    /// kernel holds for them say whether they are attached).
    pub fn program_ids(&self) -> Vec<u32> {
        use std::os::fd::AsFd;
        self.skel
            .object()
            .progs()
            .filter(|p| p.autoload())
            .filter_map(|p| libbpf_rs::Program::id_from_fd(p.as_fd()).ok())
            .collect()
    }

    /// Puts detached programs back on their tracepoints, still paused.
    pub fn attach(&mut self) -> Result<()> {
        if self.attached() {
            return Ok(());
        }
        let wanted: Vec<String> = self.hooks.iter().map(|h| prog_name(self.mode, h)).collect();
        self.links = attach_links(&self.skel, &wanted)?;
        Ok(())
    }

    /// The tracepoints this tracker is attached to, e.g. for `check`.
    pub fn hooks(&self) -> &[&'static str] {
        &self.hooks
    }

    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// Every thread in the map, with the open busy interval closed at `now_ns`.
    pub fn sample_threads(&mut self, now_ns: u64) -> Result<Vec<ThreadIoSample>> {
        let map = &self.skel.maps.threads;
        let mut out = Vec::new();
        // One syscall per batch instead of two per thread: polls run every few ms.
        for (key, val) in map.lookup_batch(BATCH, MapFlags::ANY, MapFlags::ANY)? {
            let tid = u32::from_ne_bytes(key[..4].try_into()?);
            let s = read_pod::<types::thread_stats>(&val)?;
            let stale = s.in_flight > 0 && now_ns.saturating_sub(s.last_ts) > INFLIGHT_STALE_NS;
            let open = if s.in_flight > 0 && s.busy_since > 0 {
                // A stale interval is closed at the last event the kernel saw, as the
                // BPF side will do at the thread's next request.
                let end = if stale { s.last_ts } else { now_ns };
                end.saturating_sub(s.busy_since)
            } else {
                0
            };
            out.push(ThreadIoSample {
                tid,
                tgid: s.tgid,
                ios: s.ios,
                bytes: s.bytes,
                busy_ns: s.busy_ns + open,
                in_flight: if stale { 0 } else { s.in_flight },
                last_cpu: s.last_cpu,
                last_ts: s.last_ts,
                completions: Completions {
                    last_cpu: s.done_cpu,
                    total: s.done,
                    remote: s.done_remote,
                },
            });
        }
        Ok(out)
    }

    /// Runs of our programs the kernel skipped (`recursion_misses`): a block event that
    /// fired while another BPF program was running on the same CPU (a completion in a
    /// softirq that interrupts a program, the map syscalls of a reader). Each one is a
    /// request end or start we never saw; the stale reset repairs the counts they leave.
    pub fn missed_runs(&self) -> u64 {
        let mut total = 0;
        for prog in self.skel.object().progs() {
            let Some(fd) = prog_fd(&prog) else { continue };
            let mut info = libbpf_sys::bpf_prog_info::default();
            let mut len = std::mem::size_of_val(&info) as u32;
            // SAFETY: `info` is a valid bpf_prog_info of `len` bytes; the kernel writes
            // at most `len` bytes into it.
            let ret = unsafe {
                libbpf_sys::bpf_obj_get_info_by_fd(
                    fd,
                    (&mut info as *mut libbpf_sys::bpf_prog_info).cast(),
                    &mut len,
                )
            };
            if ret == 0 {
                total += info.recursion_misses;
            }
        }
        total
    }

    /// The requests the programs hold open right now: (key, owner tid, hook state,
    /// start ns). The key is the request address, or dev << 44 ^ sector in classic
    /// tracepoint mode. For diagnosing an in-flight count that does not return to zero.
    pub fn open_requests(&self) -> Result<Vec<(u64, u32, u32, u64)>> {
        let map = &self.skel.maps.inflight;
        let mut out = Vec::new();
        for (key, val) in map.lookup_batch(BATCH, MapFlags::ANY, MapFlags::ANY)? {
            let k = u64::from_ne_bytes(key[..8].try_into()?);
            let f = read_pod::<types::inflight>(&val)?;
            out.push((k, f.tid, f.state, f.start));
        }
        Ok(out)
    }

    /// Forgets threads (e.g. exited or idle for long) so the map stays small.
    pub fn forget_thread(&mut self, tid: u32) {
        let _ = self.skel.maps.threads.delete(&tid.to_ne_bytes());
    }

    /// Completions per CPU.
    pub fn sample_cpus(&self) -> Result<Vec<CpuIoSample>> {
        let map = &self.skel.maps.cpus;
        let mut out = Vec::with_capacity(self.ncpus as usize);
        for (key, val) in map.lookup_batch(BATCH, MapFlags::ANY, MapFlags::ANY)? {
            let cpu = u32::from_ne_bytes(key[..4].try_into()?);
            if cpu >= self.ncpus {
                break;
            }
            let c = read_pod::<types::cpu_stats>(&val)?;
            out.push(CpuIoSample {
                cpu,
                completions: c.completions,
                ema_interval_ns: c.ema_interval_ns,
            });
        }
        Ok(out)
    }

    /// Probe summary for `check`.
    pub fn probe() -> crate::probe::Probe {
        probe()
    }
}

/// Returns once every program run that may have started before now has ended, so the
/// fix-ups of `pause` cannot race a run that saw the flag still clear (its write would
/// undo theirs, and a count that goes backwards reads as a new thread). Tracing programs
/// run under rcu_read_lock, and MEMBARRIER_CMD_GLOBAL waits for an RCU grace period.
fn wait_for_running_programs() {
    const MEMBARRIER_CMD_GLOBAL: libc::c_long = 1;
    // SAFETY: membarrier takes no pointers; an unsupported command returns an error.
    let rc = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL, 0, 0) };
    if rc != 0 {
        // Not available (nohz_full, old kernel): a program run lasts microseconds, but
        // its vCPU may be descheduled mid-run for a hypervisor slice.
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The bytes of a generated `#[repr(C)]` map value, to write it back.
fn pod_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a plain-old-data struct generated from the BPF object's BTF (integers
    // only, no padding in the map value layouts of bpf/iotrack.h); the slice borrows `v`.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// Every entry of a hash map the programs fill, read and deleted in batches (one syscall
/// a batch, not one more per entry).
fn drain<K, V, T>(map: &impl MapCore, each: impl Fn(K, V) -> T) -> Result<Vec<T>>
where
    K: Copy + Default,
    V: Copy + Default,
{
    map.lookup_and_delete_batch(BATCH, MapFlags::ANY, MapFlags::ANY)?
        .map(|(k, v)| Ok(each(read_pod(&k)?, read_pod(&v)?)))
        .collect()
}

/// Copies a map value into its generated `#[repr(C)]` type.
fn read_pod<T: Copy + Default>(bytes: &[u8]) -> Result<T> {
    anyhow::ensure!(
        bytes.len() >= std::mem::size_of::<T>(),
        "map value of {} bytes is too short",
        bytes.len()
    );
    let mut v = T::default();
    // SAFETY: T is a plain-old-data struct generated from the BPF object's BTF (integers
    // only), the source holds at least size_of::<T>() bytes, and the regions are disjoint.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            (&mut v as *mut T).cast::<u8>(),
            std::mem::size_of::<T>(),
        );
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_planned_hook_has_a_program_in_every_mode() {
        let all = crate::hooks::TRACEPOINTS;
        let hooks = plan_hooks(|_| true).unwrap();
        let legacy = plan_hooks(|tp| tp != "block_io_start").unwrap();
        let obj = include_bytes!(concat!(env!("OUT_DIR"), "/iotrack.skel.rs"));
        let text = String::from_utf8_lossy(obj);
        for mode in AttachMode::ALL {
            for hook in hooks.iter().chain(&legacy) {
                assert!(all.contains(hook));
                // Classic mode looks for tracepoints under events/block only: it never
                // plans the scheduler's (no partners there).
                if mode == AttachMode::Tracepoint && hook.starts_with("sched_") {
                    continue;
                }
                let name = prog_name(mode, hook);
                assert!(text.contains(&name), "no program {name} for {mode}");
            }
        }
    }
}

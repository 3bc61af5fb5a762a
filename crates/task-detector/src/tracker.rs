//! The BPF adapter: opens, loads and attaches bpf/iotrack.bpf.c with fallbacks
//! (tp_btf → raw_tp → classic tracepoint), and reads its maps. It owns the BPF objects
//! and must never do per-I/O work in user space: it only reads aggregated maps.

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags};
use std::mem::MaybeUninit;

use crate::bpf_skel::{types, IotrackSkel, IotrackSkelBuilder};
use crate::probe::{probe, tracepoint_in_btf, tracepoint_in_tracefs};

/// Map entries fetched per batch lookup.
const BATCH: u32 = 256;

/// How the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// BTF-typed tracepoints: cheapest, needs kernel BTF.
    TpBtf,
    /// Raw tracepoints: no BTF needed at attach time.
    RawTp,
    /// Classic (perf) tracepoints: oldest, keyed by sector (less precise attribution).
    Tracepoint,
}

impl std::fmt::Display for AttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttachMode::TpBtf => "tp_btf",
            AttachMode::RawTp => "raw_tp",
            AttachMode::Tracepoint => "tracepoint",
        })
    }
}

impl AttachMode {
    pub const ALL: [AttachMode; 3] = [AttachMode::TpBtf, AttachMode::RawTp, AttachMode::Tracepoint];
}

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
}

/// One vCPU's I/O completions (ISACS E_n and the Eq. 1 EMA).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuIoSample {
    pub cpu: u32,
    pub completions: u64,
    pub ema_interval_ns: u64,
}

pub struct IoTracker {
    skel: IotrackSkel<'static>,
    _links: Vec<Link>,
    mode: AttachMode,
    ncpus: u32,
}

/// The (start, done) tracepoint names a mode would use on this kernel.
fn hooks_for(mode: AttachMode) -> Option<(&'static str, &'static str)> {
    let exists = |tp: &str| match mode {
        AttachMode::TpBtf => tracepoint_in_btf(tp),
        AttachMode::RawTp => tracepoint_in_btf(tp) || tracepoint_in_tracefs(tp),
        AttachMode::Tracepoint => tracepoint_in_tracefs(tp),
    };
    if mode == AttachMode::Tracepoint {
        return (exists("block_rq_issue") && exists("block_rq_complete"))
            .then_some(("block_rq_issue", "block_rq_complete"));
    }
    let start = if exists("block_io_start") {
        "block_io_start"
    } else if exists("block_rq_issue") {
        "block_rq_issue"
    } else {
        return None;
    };
    let done = if exists("block_io_done") && start == "block_io_start" {
        "block_io_done"
    } else if exists("block_rq_complete") {
        "block_rq_complete"
    } else {
        return None;
    };
    Some((start, done))
}

impl IoTracker {
    /// Loads and attaches the programs, trying each mode in turn unless one is forced.
    pub fn open(opts: &TrackerOptions) -> Result<IoTracker> {
        let modes: Vec<AttachMode> = match opts.force_mode {
            Some(m) => vec![m],
            None => AttachMode::ALL.to_vec(),
        };
        let mut errors = Vec::new();
        for mode in modes {
            match Self::open_mode(mode) {
                Ok(t) => return Ok(t),
                Err(e) => {
                    tracing::debug!(%mode, "attach failed: {e:#}");
                    errors.push(format!("{mode}: {e:#}"));
                }
            }
        }
        let hint = if nix::unistd::geteuid().is_root() {
            "see `vmigrater check`"
        } else {
            "loading BPF needs root (or CAP_BPF + CAP_PERFMON)"
        };
        bail!("no BPF attach mode worked ({hint}): {}", errors.join("; "))
    }

    fn open_mode(mode: AttachMode) -> Result<IoTracker> {
        if mode == AttachMode::Tracepoint {
            crate::probe::ensure_tracefs();
        }
        let (start, done) =
            hooks_for(mode).ok_or_else(|| anyhow!("block tracepoints not available for {mode}"))?;
        // The skeleton borrows its object storage for its whole life; the tracker lives
        // as long as the daemon, so the storage is leaked once per successful or failed
        // attempt (at most three per process).
        let storage: &'static mut MaybeUninit<libbpf_rs::OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = IotrackSkelBuilder::default()
            .open(storage)
            .context("opening the BPF object")?;
        let wanted: [&str; 2] = match (mode, start, done) {
            (AttachMode::TpBtf, "block_io_start", "block_io_done") => {
                ["btf_io_start", "btf_io_done"]
            }
            (AttachMode::TpBtf, "block_io_start", _) => ["btf_io_start", "btf_rq_complete"],
            (AttachMode::TpBtf, _, _) => ["btf_rq_issue", "btf_rq_complete"],
            (AttachMode::RawTp, "block_io_start", "block_io_done") => {
                ["raw_io_start", "raw_io_done"]
            }
            (AttachMode::RawTp, "block_io_start", _) => ["raw_io_start", "raw_rq_complete"],
            (AttachMode::RawTp, _, _) => ["raw_rq_issue", "raw_rq_complete"],
            (AttachMode::Tracepoint, _, _) => ["tp_rq_issue", "tp_rq_complete"],
        };
        for mut prog in open.open_object_mut().progs_mut() {
            let name = prog.name().to_string_lossy().to_string();
            prog.set_autoload(wanted.contains(&name.as_str()));
        }
        let skel = open
            .load()
            .with_context(|| format!("loading the {mode} programs"))?;
        let mut links = Vec::new();
        for prog in skel.object().progs_mut() {
            if wanted.contains(&prog.name().to_string_lossy().as_ref()) {
                let name = prog.name().to_string_lossy().to_string();
                links.push(prog.attach().with_context(|| format!("attaching {name}"))?);
            }
        }
        tracing::debug!(%mode, start, done, "block I/O programs attached");
        let ncpus = libbpf_rs::num_possible_cpus().unwrap_or(1).min(1024) as u32;
        Ok(IoTracker {
            skel,
            _links: links,
            mode,
            ncpus,
        })
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
            let open = if s.in_flight > 0 && s.busy_since > 0 {
                now_ns.saturating_sub(s.busy_since)
            } else {
                0
            };
            out.push(ThreadIoSample {
                tid,
                tgid: s.tgid,
                ios: s.ios,
                bytes: s.bytes,
                busy_ns: s.busy_ns + open,
                in_flight: s.in_flight,
                last_cpu: s.last_cpu,
                last_ts: s.last_ts,
            });
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

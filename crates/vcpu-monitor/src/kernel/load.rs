//! Opening, loading and attaching the timer programs, the most precise way of attaching
//! first (`TimerAttach`), and opening what the event thread serves from: the .bss and the
//! gap ring buffer.

use anyhow::{anyhow, Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, OpenObject, RingBuffer};
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::rc::Rc;
use tracing::info;

use super::ring::{gap_ring, GapEvent};
use super::state::Bss;
use super::{TimerAttach, MAX_CPUS};
use crate::board::VcpuBoard;
use crate::bpf_skel::{VcputickSkel, VcputickSkelBuilder};

/// A loaded skeleton and the links that keep its programs attached. Fields in drop order:
/// the programs are detached before their object is closed.
pub(super) struct Loaded<'o> {
    _links: Vec<Link>,
    skel: VcputickSkel<'o>,
}

/// What the event thread serves from.
pub(super) struct Bpf<'a> {
    pub(super) attach: TimerAttach,
    pub(super) bss: Bss,
    /// The gap map, which the rescuers watch with epolls of their own.
    pub(super) ring_fd: i32,
    pub(super) rb: RingBuffer<'a>,
    /// The gap events `rb` parsed and the event thread has not handled yet.
    pub(super) events: Rc<RefCell<Vec<GapEvent>>>,
}

/// Loads the programs (`load`) into `storage`, keeps them in `loaded`, and opens their
/// .bss and gap ring buffer.
pub(super) fn open<'a, 'o>(
    storage: &'o mut [MaybeUninit<OpenObject>; 3],
    loaded: &'a mut Option<Loaded<'o>>,
    board: &VcpuBoard,
    threshold_ns: u64,
) -> Result<Bpf<'a>> {
    // A deschedule is compared with every monitored vCPU (ids below this).
    let nr_cpus = board
        .cpus()
        .filter(|&c| c < MAX_CPUS)
        .max()
        .map_or(0, |c| c as u32 + 1);
    let ((skel, links), attach) = load(storage, threshold_ns, nr_cpus)?;
    let Loaded { skel, .. } = loaded.insert(Loaded {
        _links: links,
        skel,
    });
    let bss = Bss::of(skel)?;
    let skel: &'a VcputickSkel<'o> = skel;
    let events: Rc<RefCell<Vec<GapEvent>>> = Rc::default();
    let rb = gap_ring(skel, events.clone())?;
    Ok(Bpf {
        attach,
        bss,
        ring_fd: skel.maps.gaps.as_fd().as_raw_fd(),
        rb,
        events,
    })
}

fn open_attach<'o>(
    storage: &'o mut MaybeUninit<OpenObject>,
    attach: TimerAttach,
    threshold_ns: u64,
    nr_cpus: u32,
) -> Result<(VcputickSkel<'o>, Vec<Link>)> {
    let mut open = VcputickSkelBuilder::default()
        .open(storage)
        .context("opening the timer BPF object")?;
    let rodata = open
        .maps
        .rodata_data
        .as_deref_mut()
        .context("the timer BPF object has no .rodata")?;
    rodata.gap_threshold_ns = threshold_ns;
    rodata.nr_cpus = nr_cpus;
    for mut prog in open.open_object_mut().progs_mut() {
        let name = prog.name().to_string_lossy().to_string();
        prog.set_autoload(attach.loads(&name));
    }
    if attach != TimerAttach::Heartbeat {
        // Its timers are the heartbeat's alone; a kernel without BPF timers still loads
        // the rest.
        open.maps
            .heartbeats
            .set_autocreate(false)
            .context("leaving out the heartbeat timers")?;
    }
    let skel = open
        .load()
        .with_context(|| format!("loading the timer programs ({attach})"))?;
    let mut links = Vec::new();
    for prog in skel.object().progs_mut() {
        if prog.autoload() {
            let name = prog.name().to_string_lossy().to_string();
            links.push(prog.attach().with_context(|| format!("attaching {name}"))?);
        }
    }
    Ok((skel, links))
}

/// The timer programs, attached: tp_btf with the heartbeat where the kernel has BPF
/// timers pinned to a CPU (6.7+), tp_btf without it, else raw_tp; each attempt in a
/// storage of its own (a failed attempt's skeleton still borrows it).
fn load<'o>(
    storage: &'o mut [MaybeUninit<OpenObject>; 3],
    threshold_ns: u64,
    nr_cpus: u32,
) -> Result<((VcputickSkel<'o>, Vec<Link>), TimerAttach)> {
    let mut failed = Vec::new();
    let ways = [
        TimerAttach::Heartbeat,
        TimerAttach::TpBtf,
        TimerAttach::RawTp,
    ];
    for (way, storage) in ways.into_iter().zip(storage.iter_mut()) {
        match open_attach(storage, way, threshold_ns, nr_cpus) {
            Ok(x) => {
                if !failed.is_empty() {
                    info!("timer programs: {}", failed.join("; "));
                }
                return Ok((x, way));
            }
            Err(e) => failed.push(format!("{way} did not load: {e:#}")),
        }
    }
    Err(anyhow!("no timer program loaded ({})", failed.join("; ")))
}

//! The BPF state in the mmapped .bss: each vCPU's state read and copied onto the board,
//! and the words the daemon writes back (the event switch, the vCPUs holding tasks, the
//! slice each heartbeat brackets).

use anyhow::{anyhow, Result};
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::time::Duration;

use super::slices::{timing, Slices};
use super::{MAX_CPUS, QUIET_NS};
use crate::board::VcpuBoard;
use crate::bpf_skel::{types, VcputickSkel};
use crate::monitor::TickHook;

/// The tick period assumed before one is measured (HZ=250, Debian's default).
const DEFAULT_TICK_NS: u64 = 4_000_000;

/// The .bss of a loaded skeleton, as raw pointers.
#[derive(Clone, Copy)]
pub(super) struct Bss {
    vcpus: *const types::vcpu_tick,
    pub(super) emit: *mut u32,
    pub(super) task_cpus: *mut u64,
    hb_slice: *mut u64,
}

impl Bss {
    pub(super) fn of(skel: &mut VcputickSkel<'_>) -> Result<Bss> {
        // Raw pointers into the mmapped .bss, derived from the one mutable view of it: the
        // kernel writes `vcpus` concurrently, so no Rust reference may be held across reads.
        let Some(bss) = skel.maps.bss_data.as_deref_mut() else {
            return Err(anyhow!("the timer BPF object has no mmapped .bss"));
        };
        Ok(Bss {
            vcpus: std::ptr::addr_of!(bss.vcpus).cast(),
            emit: std::ptr::addr_of_mut!(bss.emit_events).cast(),
            task_cpus: std::ptr::addr_of_mut!(bss.task_cpus).cast(),
            hb_slice: std::ptr::addr_of_mut!(bss.hb_slice_ns).cast(),
        })
    }
}

/// A copy of one vCPU's BPF state (read field by field: the kernel writes it meanwhile).
#[derive(Clone, Copy, Debug, Default)]
struct TickState {
    last_seen: u64,
    slice_start: u64,
    last_slice_ns: u64,
    last_slice_err_ns: u64,
    heartbeats: u64,
    last_gap_ns: u64,
    gaps: u64,
    inactive_ns: u64,
    tick_ns: u64,
    idle: bool,
    covered_ns: u64,
}

fn read_state(p: *const types::vcpu_tick) -> TickState {
    // SAFETY: `p` points into the mmapped .bss of a loaded skeleton that outlives this
    // call; each field is an aligned integer the kernel may update concurrently, hence
    // volatile reads of plain values rather than a reference.
    unsafe {
        TickState {
            last_seen: std::ptr::addr_of!((*p).last_seen).read_volatile(),
            slice_start: std::ptr::addr_of!((*p).slice_start).read_volatile(),
            last_slice_ns: std::ptr::addr_of!((*p).last_slice_ns).read_volatile(),
            last_slice_err_ns: std::ptr::addr_of!((*p).last_slice_err_ns).read_volatile(),
            heartbeats: std::ptr::addr_of!((*p).heartbeats).read_volatile(),
            last_gap_ns: std::ptr::addr_of!((*p).last_gap_ns).read_volatile(),
            gaps: std::ptr::addr_of!((*p).gaps).read_volatile(),
            inactive_ns: std::ptr::addr_of!((*p).inactive_ns).read_volatile(),
            tick_ns: std::ptr::addr_of!((*p).tick_ns).read_volatile(),
            idle: std::ptr::addr_of!((*p).idle).read_volatile() != 0,
            covered_ns: std::ptr::addr_of!((*p).covered_ns).read_volatile(),
        }
    }
}

pub(super) fn set_emit(p: *mut u32, on: bool) {
    // SAFETY: `p` is the mmapped .bss `emit_events` of a loaded skeleton.
    unsafe { p.write_volatile(u32::from(on)) }
}

/// Tells the BPF program which vCPUs hold managed tasks (their own return wakes nobody).
pub(super) fn publish_task_cpus(p: *mut u64, cpus: &[usize], hook: &dyn TickHook) {
    let mut mask = [0u64; MAX_CPUS / 64];
    for &c in cpus {
        if hook.holds_tasks(c) {
            mask[c / 64] |= 1 << (c % 64);
        }
    }
    for (i, m) in mask.iter().enumerate() {
        // SAFETY: `p` is the mmapped .bss `task_cpus`, MAX_CPUS / 64 words long.
        unsafe { p.add(i).write_volatile(*m) };
    }
}

/// The BPF state of the monitored vCPUs, and how it maps onto the board.
pub(super) struct BoardView<'a> {
    pub(super) cpus: &'a [usize],
    vcpus: *const types::vcpu_tick,
    /// The .bss `hb_slice_ns`: the slice each vCPU's heartbeat brackets (0: none).
    hb_slice: *mut u64,
    default_slice: u64,
    threshold_ns: u64,
    pub(super) push_ns: u64,
}

impl<'a> BoardView<'a> {
    pub(super) fn new(
        cpus: &'a [usize],
        bss: Bss,
        default_slice: Duration,
        threshold_ns: u64,
        push_threshold: Duration,
    ) -> BoardView<'a> {
        BoardView {
            cpus,
            vcpus: bss.vcpus,
            hb_slice: bss.hb_slice,
            default_slice: default_slice.as_nanos() as u64,
            threshold_ns,
            push_ns: push_threshold.as_nanos() as u64,
        }
    }

    /// Copies the BPF state of every vCPU onto the board, in the sleepers' terms: "seen"
    /// within one tick period plus the threshold is running; an idle vCPU is flagged idle
    /// (halted, it runs as soon as it is given work). Takes each new slice into the
    /// vCPU's history, decides where push points can be timed and where the heartbeat
    /// runs. Returns the heartbeat firings so far.
    pub(super) fn publish(&self, board: &VcpuBoard, slices: &mut Slices, now: u64) -> u64 {
        let (vcpus, default_slice, threshold_ns) =
            (self.vcpus, self.default_slice, self.threshold_ns);
        let mut beats = 0;
        for (i, &cpu) in self.cpus.iter().enumerate() {
            let Some(slot) = board.slot(cpu) else {
                continue;
            };
            // SAFETY: cpu < MAX_CPUS, the length of the .bss array.
            let st = read_state(unsafe { vcpus.add(cpu) });
            beats += st.heartbeats;
            let tick = if st.tick_ns == 0 {
                DEFAULT_TICK_NS
            } else {
                st.tick_ns.clamp(1_000_000, 20_000_000)
            };
            let history = &mut slices.history[i];
            let new_slice = st.gaps != slices.gaps[i] && st.last_slice_ns > 0;
            slices.gaps[i] = st.gaps;
            if new_slice {
                history.push(st.last_slice_ns);
            }
            slot.idle.store(st.idle, Relaxed);
            slot.last_seen_ns.store(st.last_seen.max(1), Relaxed);
            slot.period_ns.store(tick, Relaxed);
            slot.gap_threshold_ns.store(threshold_ns, Relaxed);
            // No deschedule seen for a while (or ever): as far as we know the slice never
            // ends, and no push point is due (`slicing` false).
            let slicing = st.slice_start > 0 && now.saturating_sub(st.slice_start) <= QUIET_NS;
            let t = timing(history, slicing, self.push_ns, tick, default_slice);
            slot.est_slice_ns.store(t.est_ns, Relaxed);
            slices.timed[i] = t.timed;
            if new_slice {
                tracing::trace!(
                    cpu,
                    slice_us = st.last_slice_ns / 1000,
                    gap_us = st.last_gap_ns / 1000,
                    err_us = st.last_slice_err_ns / 1000,
                    est_us = t.est_ns / 1000,
                    timed = t.timed,
                    heartbeat = t.heartbeat,
                    "slice"
                );
            }
            let hb = if t.heartbeat {
                history.median().unwrap_or(0)
            } else {
                0
            };
            // SAFETY: cpu < MAX_CPUS, the length of the .bss array.
            unsafe { self.hb_slice.add(cpu).write_volatile(hb) };
            slot.slice_start_ns
                .store(if slicing { st.slice_start } else { now }, Relaxed);
            slot.deschedules.store(st.gaps, Relaxed);
            slot.inactive_total_ns.store(st.inactive_ns, Relaxed);
            slot.covered_total_ns.store(st.covered_ns, Relaxed);
            slot.last_inactive_ns.store(st.last_gap_ns, Relaxed);
            slot.published_ns.store(now, Release);
        }
        beats
    }

    /// Turns every vCPU's heartbeat off (each stops at its next firing).
    pub(super) fn heartbeat_off(&self) {
        for &cpu in self.cpus {
            // SAFETY: cpu < MAX_CPUS, the length of the .bss array.
            unsafe { self.hb_slice.add(cpu).write_volatile(0) };
        }
    }
}

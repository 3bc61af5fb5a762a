//! The kernel source of vCPU state: bpf/vcputick.bpf.c watches the timers the guest kernel
//! fires anyway (the scheduler tick of every busy vCPU, the next timer of an idle one); a
//! timer that fires late with no sign of life since its expiry means the vCPU was
//! descheduled. One thread ("vcpu-events") copies the per-vCPU state from the mmapped
//! .bss onto the `VcpuBoard` and calls the `TickHook`:
//! - `Resumed` when a vCPU comes back (the BPF program wakes it through a ring buffer,
//!   only while demand is active),
//! - `Running` once per slice, at the predicted push point (slice start + estimated slice
//!   − push threshold) of a vCPU the hook says holds tasks.
//!
//! So the daemon wakes about twice per hypervisor slice while I/O-bound tasks exist, and
//! never while none do: no sleeper per vCPU, no timer of its own per tick. It must never
//! spin or wake on a timer other than those two, and never write the BPF state except its
//! `emit_events` switch.

use anyhow::{anyhow, Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, RingBufferBuilder};
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Relaxed, Release},
};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tracing::{debug, info, warn};

use crate::board::{Demand, VcpuBoard};
use crate::bpf_skel::{types, VcputickSkelBuilder};
use crate::config::MonitorConfig;
use crate::monitor::{TickEvent, TickHook};
use crate::monotonic_ns;

/// bpf/vcputick.h VT_MAX_CPUS.
const MAX_CPUS: usize = 1024;
/// A timer later than this is a deschedule. Interrupts-off sections of a guest kernel
/// last microseconds to a few hundred; hypervisor slices last milliseconds.
pub const MIN_KERNEL_GAP_THRESHOLD: Duration = Duration::from_millis(1);
/// The tick period assumed before one is measured (HZ=250, Debian's default).
const DEFAULT_TICK_NS: u64 = 4_000_000;
/// The longest the event thread waits without looking at the board (metrics freshness,
/// stop flag); events and push points wake it sooner.
const MAX_WAIT: Duration = Duration::from_millis(100);
/// No deschedule for this long: the vCPU is treated as dedicated (no slice end ahead).
const QUIET_NS: u64 = 1_000_000_000;
/// Push points are predicted only from slices at least this long: shorter "slices" are a
/// host's housekeeping chopping a vCPU's time (an emulating host such as QEMU TCG does so
/// constantly), too irregular to time a move by, and a wake-up each would cost more than it could save.
const MIN_PREDICTABLE_SLICE_NS: u64 = 5_000_000;
/// Slices kept per vCPU for the median estimate (as `SliceEstimator`).
const SLICE_HISTORY: usize = 8;

/// How the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimerAttach {
    TpBtf,
    RawTp,
}

impl std::fmt::Display for TimerAttach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TimerAttach::TpBtf => "tp_btf",
            TimerAttach::RawTp => "raw_tp",
        })
    }
}

pub struct KernelMonitor {
    stop: Arc<AtomicBool>,
    board: Arc<VcpuBoard>,
    thread: Option<JoinHandle<()>>,
    attach: TimerAttach,
}

impl KernelMonitor {
    /// Loads and attaches the timer programs (tp_btf, else raw_tp) and starts the event
    /// thread. Fails, with everything undone, when neither loads.
    pub fn start(
        cfg: MonitorConfig,
        board: Arc<VcpuBoard>,
        hook: Arc<dyn TickHook>,
        push_threshold: Duration,
    ) -> Result<KernelMonitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let thread = {
            let (board, stop) = (board.clone(), stop.clone());
            std::thread::Builder::new()
                .name("vcpu-events".into())
                .spawn(move || {
                    event_thread(&cfg, &board, &*hook, push_threshold, &stop, tx);
                })
                .context("spawning the vCPU event thread")?
        };
        match rx.recv() {
            Ok(Ok(attach)) => Ok(KernelMonitor {
                stop,
                board,
                thread: Some(thread),
                attach,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(anyhow!(
                    "the vCPU event thread died while loading its programs"
                ))
            }
        }
    }

    pub fn attach(&self) -> TimerAttach {
        self.attach
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Relaxed);
        self.board.wake_sleepers();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KernelMonitor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Median of a vCPU's last slices, the estimate the planner's remaining slice counts from.
#[derive(Default)]
struct SliceHistory {
    slices: [u64; SLICE_HISTORY],
    n: usize,
    next: usize,
}

impl SliceHistory {
    fn push(&mut self, ns: u64) {
        self.slices[self.next] = ns;
        self.next = (self.next + 1) % SLICE_HISTORY;
        self.n = (self.n + 1).min(SLICE_HISTORY);
    }

    fn median(&self) -> Option<u64> {
        if self.n == 0 {
            return None;
        }
        let mut v = self.slices;
        let v = &mut v[..self.n];
        v.sort_unstable();
        Some(v[self.n / 2])
    }
}

/// A copy of one vCPU's BPF state (read field by field: the kernel writes it meanwhile).
#[derive(Clone, Copy, Debug, Default)]
struct TickState {
    last_seen: u64,
    slice_start: u64,
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
            last_gap_ns: std::ptr::addr_of!((*p).last_gap_ns).read_volatile(),
            gaps: std::ptr::addr_of!((*p).gaps).read_volatile(),
            inactive_ns: std::ptr::addr_of!((*p).inactive_ns).read_volatile(),
            tick_ns: std::ptr::addr_of!((*p).tick_ns).read_volatile(),
            idle: std::ptr::addr_of!((*p).idle).read_volatile() != 0,
            covered_ns: std::ptr::addr_of!((*p).covered_ns).read_volatile(),
        }
    }
}

/// bpf/vcputick.h `struct gap_event` (not in the skeleton's types: no global uses it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GapEvent {
    ts: u64,
    inactive_ns: u64,
    last_slice_ns: u64,
    cpu: u32,
    pad: u32,
}

/// One gap event as the ring buffer carries it.
fn parse_event(data: &[u8]) -> Option<GapEvent> {
    if data.len() < std::mem::size_of::<GapEvent>() {
        return None;
    }
    // SAFETY: length checked; gap_event is plain integers, any bit pattern is valid.
    Some(unsafe { std::ptr::read_unaligned(data.as_ptr().cast::<GapEvent>()) })
}

fn set_emit(p: *mut u32, on: bool) {
    // SAFETY: `p` is the mmapped .bss `emit_events` of a loaded skeleton.
    unsafe { p.write_volatile(u32::from(on)) }
}

fn prepare_thread(rt_priority: Option<i32>) {
    // SAFETY: prctl with integer arguments on the calling thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
    if let Some(prio) = rt_priority {
        let param = libc::sched_param {
            sched_priority: prio,
        };
        // SAFETY: valid param for the calling thread.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
            warn!(
                "the vCPU event thread runs as a normal task ({}): decisions may wait behind CPU hogs",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn open_attach<'o>(
    storage: &'o mut MaybeUninit<libbpf_rs::OpenObject>,
    attach: TimerAttach,
    threshold_ns: u64,
    nr_cpus: u32,
) -> Result<(crate::bpf_skel::VcputickSkel<'o>, Vec<Link>)> {
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
    let prefix = match attach {
        TimerAttach::TpBtf => "btf_",
        TimerAttach::RawTp => "raw_",
    };
    for mut prog in open.open_object_mut().progs_mut() {
        let name = prog.name().to_string_lossy().to_string();
        prog.set_autoload(name.starts_with(prefix));
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

/// The timer programs, attached: tp_btf where the kernel has it, raw_tp otherwise, each
/// attempt in a storage of its own (a failed attempt's skeleton still borrows it).
fn load<'o>(
    btf_storage: &'o mut MaybeUninit<libbpf_rs::OpenObject>,
    raw_storage: &'o mut MaybeUninit<libbpf_rs::OpenObject>,
    threshold_ns: u64,
    nr_cpus: u32,
) -> Result<((crate::bpf_skel::VcputickSkel<'o>, Vec<Link>), TimerAttach)> {
    let tp_btf = match open_attach(btf_storage, TimerAttach::TpBtf, threshold_ns, nr_cpus) {
        Ok(x) => return Ok((x, TimerAttach::TpBtf)),
        Err(e) => e,
    };
    match open_attach(raw_storage, TimerAttach::RawTp, threshold_ns, nr_cpus) {
        Ok(x) => Ok((x, TimerAttach::RawTp)),
        Err(raw_tp) => Err(anyhow!(
            "no timer program loaded (tp_btf: {tp_btf:#}; raw_tp: {raw_tp:#})"
        )),
    }
}

/// The ring buffer of gap events, each parsed into `sink`.
fn gap_ring<'a>(
    skel: &'a crate::bpf_skel::VcputickSkel<'_>,
    sink: Rc<RefCell<Vec<GapEvent>>>,
) -> Result<libbpf_rs::RingBuffer<'a>> {
    let mut b = RingBufferBuilder::new();
    b.add(&skel.maps.gaps, move |data: &[u8]| {
        if let Some(e) = parse_event(data) {
            sink.borrow_mut().push(e);
        }
        0
    })
    .map_err(|e| anyhow!("gap ring buffer: {e}"))?;
    b.build().map_err(|e| anyhow!("gap ring buffer: {e}"))
}

fn event_thread(
    cfg: &MonitorConfig,
    board: &VcpuBoard,
    hook: &dyn TickHook,
    push_threshold: Duration,
    stop: &AtomicBool,
    started: std::sync::mpsc::SyncSender<Result<TimerAttach>>,
) {
    let threshold_ns = cfg
        .min_gap_threshold
        .max(MIN_KERNEL_GAP_THRESHOLD)
        .as_nanos() as u64;
    // A deschedule is compared with every monitored vCPU (ids below this).
    let nr_cpus = board
        .cpus()
        .filter(|&c| c < MAX_CPUS)
        .max()
        .map_or(0, |c| c as u32 + 1);
    // One backing object per attempt: a failed attempt's skeleton still borrows its own.
    let (mut btf_storage, mut raw_storage) = (MaybeUninit::uninit(), MaybeUninit::uninit());
    let ((mut skel, _links), attach) =
        match load(&mut btf_storage, &mut raw_storage, threshold_ns, nr_cpus) {
            Ok(x) => x,
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
    // Raw pointers into the mmapped .bss, derived from the one mutable view of it: the
    // kernel writes `vcpus` concurrently, so no Rust reference may be held across reads.
    let Some(bss) = skel.maps.bss_data.as_deref_mut() else {
        let _ = started.send(Err(anyhow!("the timer BPF object has no mmapped .bss")));
        return;
    };
    let vcpus: *const types::vcpu_tick = std::ptr::addr_of!(bss.vcpus).cast();
    let emit: *mut u32 = std::ptr::addr_of_mut!(bss.emit_events).cast();
    let task_cpus: *mut u64 = std::ptr::addr_of_mut!(bss.task_cpus).cast();
    let events: Rc<RefCell<Vec<GapEvent>>> = Rc::default();
    let rb = match gap_ring(&skel, events.clone()) {
        Ok(rb) => rb,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    prepare_thread(cfg.rt_priority);
    let _ = started.send(Ok(attach));
    info!(%attach, threshold_us = threshold_ns / 1000, "vCPU deschedules watched from kernel timers");

    let cpus: Vec<usize> = board.cpus().filter(|&c| c < MAX_CPUS).collect();
    let mut history: Vec<SliceHistory> = cpus.iter().map(|_| SliceHistory::default()).collect();
    let mut points = PushPoints {
        pushed: vec![0; cpus.len()],
        push_ns: push_threshold.as_nanos() as u64,
    };
    let view = BoardView {
        cpus: &cpus,
        vcpus,
        default_slice: cfg.default_slice.as_nanos() as u64,
        threshold_ns,
    };
    let mut emitting = false;
    let mut slicing = vec![false; cpus.len()];
    while !stop.load(Relaxed) {
        let now = monotonic_ns();
        let active = board.demand() == Demand::Active;
        if active != emitting {
            set_emit(emit, active);
            emitting = active;
            debug!(active, "gap events switched");
        }
        view.publish(board, &history, now, &mut slicing);
        if !active {
            // Events raised just before the switch went off are stale by the next demand.
            let _ = rb.consume();
            events.borrow_mut().clear();
            board.idle_sleep_until(now + cfg.idle_period.as_nanos() as u64);
            continue;
        }
        publish_task_cpus(task_cpus, &cpus, hook);
        // Sleep until the earliest push point of a vCPU holding tasks, or an event.
        let wait = points.wait_ns(board, &cpus, now, &slicing, hook);
        if wait > 0 {
            wait_for_events(rb.epoll_fd(), wait);
        }
        if let Err(e) = rb.consume() {
            warn!("reading the gap ring buffer failed: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let now = monotonic_ns();
        let drained: Vec<GapEvent> = std::mem::take(&mut *events.borrow_mut());
        for e in &drained {
            if let Some(i) = cpus.iter().position(|&c| c == e.cpu as usize) {
                if e.last_slice_ns > 0 {
                    history[i].push(e.last_slice_ns);
                }
            }
        }
        view.publish(board, &history, now, &mut slicing);
        for e in &drained {
            hook.on_tick(
                e.cpu as usize,
                TickEvent::Resumed {
                    inactive_ns: e.inactive_ns,
                    back_ns: e.ts,
                },
                board,
                now,
            );
        }
        points.run_due(board, &cpus, now, &slicing, hook);
    }
    set_emit(emit, false);
    debug!("vCPU event thread stopped");
}

/// The push points of the monitored vCPUs (`push_point`), one handled per slice.
struct PushPoints {
    /// Slice start of the last push point handled, per vCPU.
    pushed: Vec<u64>,
    push_ns: u64,
}

impl PushPoints {
    /// How long until the earliest push point of a vCPU holding tasks (`MAX_WAIT` at most).
    fn wait_ns(
        &self,
        board: &VcpuBoard,
        cpus: &[usize],
        now: u64,
        slicing: &[bool],
        hook: &dyn TickHook,
    ) -> u64 {
        let mut wait = MAX_WAIT.as_nanos() as u64;
        for (i, &cpu) in cpus.iter().enumerate() {
            if let Some((_, at)) = self.point(board, i, cpu, now, slicing, hook) {
                wait = wait.min(at.saturating_sub(now));
            }
        }
        wait
    }

    /// The push point of the `i`-th vCPU, `cpu` (`push_point`).
    fn point(
        &self,
        board: &VcpuBoard,
        i: usize,
        cpu: usize,
        now: u64,
        slicing: &[bool],
        hook: &dyn TickHook,
    ) -> Option<(u64, u64)> {
        push_point(
            board,
            cpu,
            now,
            slicing[i],
            self.pushed[i],
            self.push_ns,
            hook,
        )
    }

    /// Tells the hook of every push point due by `now` (`TickEvent::Running`).
    fn run_due(
        &mut self,
        board: &VcpuBoard,
        cpus: &[usize],
        now: u64,
        slicing: &[bool],
        hook: &dyn TickHook,
    ) {
        for (i, &cpu) in cpus.iter().enumerate() {
            match self.point(board, i, cpu, now, slicing, hook) {
                Some((slice_start, at)) if at <= now => {
                    self.pushed[i] = slice_start;
                    hook.on_tick(cpu, TickEvent::Running, board, now);
                }
                _ => {}
            }
        }
    }
}

/// The push point (slice start, time) of `cpu`'s current run, if one is due at all: it
/// runs, its slices are long enough to predict, this run's point was not handled yet, and
/// it holds tasks.
fn push_point(
    board: &VcpuBoard,
    cpu: usize,
    now: u64,
    slicing: bool,
    pushed: u64,
    push_ns: u64,
    hook: &dyn TickHook,
) -> Option<(u64, u64)> {
    let s = board.cpu_snapshot(cpu, now)?;
    (slicing
        && s.est_slice_ns >= MIN_PREDICTABLE_SLICE_NS
        && s.active
        && pushed != s.slice_start_ns
        && hook.holds_tasks(cpu))
    .then(|| {
        (
            s.slice_start_ns,
            (s.slice_start_ns + s.est_slice_ns).saturating_sub(push_ns),
        )
    })
}

/// Tells the BPF program which vCPUs hold managed tasks (their own return wakes nobody).
fn publish_task_cpus(p: *mut u64, cpus: &[usize], hook: &dyn TickHook) {
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

/// Waits up to `timeout_ns` for the ring buffer's epoll fd. A push point is due at a
/// precise time: the millisecond timeout of `epoll_wait` (and of libbpf's poll) rounds a
/// sub-millisecond wait down to a busy loop, so this uses `epoll_pwait2` (Linux 5.11+)
/// and rounds up to the next millisecond only where that call does not exist.
fn wait_for_events(epfd: i32, timeout_ns: u64) {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: a valid epoll fd owned by the ring buffer, one event slot, a valid timespec
    // and no signal mask.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait2,
            epfd,
            &mut ev as *mut libc::epoll_event,
            1,
            &ts as *const libc::timespec,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
        let ms = timeout_ns.div_ceil(1_000_000).min(i32::MAX as u64) as i32;
        // SAFETY: as above.
        unsafe { libc::epoll_wait(epfd, &mut ev, 1, ms) };
    }
}

/// The BPF state of the monitored vCPUs, and how it maps onto the board.
struct BoardView<'a> {
    cpus: &'a [usize],
    vcpus: *const types::vcpu_tick,
    default_slice: u64,
    threshold_ns: u64,
}

impl BoardView<'_> {
    /// Copies the BPF state of every vCPU onto the board, in the sleepers' terms: "seen"
    /// within one tick period plus the threshold is running; an idle vCPU is flagged idle
    /// (halted, it runs as soon as it is given work).
    fn publish(
        &self,
        board: &VcpuBoard,
        history: &[SliceHistory],
        now: u64,
        slicing_now: &mut [bool],
    ) {
        let (vcpus, default_slice, threshold_ns) =
            (self.vcpus, self.default_slice, self.threshold_ns);
        for (i, &cpu) in self.cpus.iter().enumerate() {
            let Some(slot) = board.slot(cpu) else {
                continue;
            };
            // SAFETY: cpu < MAX_CPUS, the length of the .bss array.
            let st = read_state(unsafe { vcpus.add(cpu) });
            let tick = if st.tick_ns == 0 {
                DEFAULT_TICK_NS
            } else {
                st.tick_ns.clamp(1_000_000, 20_000_000)
            };
            slot.idle.store(st.idle, Relaxed);
            slot.last_seen_ns.store(st.last_seen.max(1), Relaxed);
            slot.period_ns.store(tick, Relaxed);
            slot.gap_threshold_ns.store(threshold_ns, Relaxed);
            slot.est_slice_ns
                .store(history[i].median().unwrap_or(default_slice), Relaxed);
            // No deschedule seen for a while (or ever): as far as we know the slice never
            // ends, and no push point is due (`slicing` false).
            let slicing = st.slice_start > 0 && now.saturating_sub(st.slice_start) <= QUIET_NS;
            slicing_now[i] = slicing;
            slot.slice_start_ns
                .store(if slicing { st.slice_start } else { now }, Relaxed);
            slot.deschedules.store(st.gaps, Relaxed);
            slot.inactive_total_ns.store(st.inactive_ns, Relaxed);
            slot.covered_total_ns.store(st.covered_ns, Relaxed);
            slot.last_inactive_ns.store(st.last_gap_ns, Relaxed);
            slot.published_ns.store(now, Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_history_is_a_median_of_the_last_eight() {
        let mut h = SliceHistory::default();
        assert_eq!(h.median(), None);
        for ms in [11, 12, 10] {
            h.push(ms * 1_000_000);
        }
        assert_eq!(h.median(), Some(11_000_000));
        for _ in 0..8 {
            h.push(3_000_000);
        }
        assert_eq!(h.median(), Some(3_000_000), "old slices age out");
    }

    #[test]
    fn a_short_event_is_not_parsed() {
        assert!(parse_event(&[0u8; 8]).is_none());
        let e = GapEvent {
            ts: 5,
            inactive_ns: 7,
            last_slice_ns: 9,
            cpu: 1,
            pad: 0,
        };
        assert_eq!(std::mem::size_of::<GapEvent>(), 32, "bpf/vcputick.h layout");
        // SAFETY: gap_event is plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&e as *const GapEvent).cast::<u8>(),
                std::mem::size_of_val(&e),
            )
        };
        let p = parse_event(bytes).unwrap();
        assert_eq!((p.ts, p.inactive_ns, p.last_slice_ns, p.cpu), (5, 7, 9, 1));
    }
}

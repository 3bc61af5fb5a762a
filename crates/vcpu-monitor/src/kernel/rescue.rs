//! The rescuers: one thread per vCPU that moves the event thread off a vCPU that went out
//! while events wait for it (`Rescue`).

use libbpf_rs::{AsRawLibbpf, RingBuffer};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::thread::Scope;
use tracing::warn;

use super::prepare_thread;
use super::ring::wait_for_events;
use super::QUIET_NS;

/// The gap ring of the event thread's ring buffer, read (never consumed) by the rescuers.
struct RingPtr(*mut libbpf_sys::ring);
// SAFETY: `ring__avail_data_size` only loads the ring's producer and consumer positions,
// which the kernel and the consuming thread update atomically.
unsafe impl Sync for RingPtr {}

/// `Rescue::asleep_on` while the event thread is not pinned.
pub(super) const UNPINNED: usize = usize::MAX;

/// The event thread sleeps on one vCPU: where its next wake-up should come from. When
/// that vCPU is taken away first (its slice ended before the push point the thread waits
/// for, or another out vCPU came back before it), the thread is frozen with it, and every
/// other vCPU's return waits for that one's: measured on the KVM-like trace, a third of
/// the events were handled 1-10 ms late. One rescuer per vCPU, pinned there, wakes with
/// each event (its own epoll on the ring buffer, edge-triggered: it reads nothing); where
/// events wait unread, the rescuer moves the event thread onto its own vCPU, which runs.
/// A thread that was about to wake anyway loses nothing.
pub(super) struct Rescue<'a> {
    tid: nix::unistd::Pid,
    asleep_on: &'a AtomicUsize,
    /// The gap ring, to see whether events wait unread.
    ring: RingPtr,
    stop: &'a AtomicBool,
    rt_priority: Option<i32>,
    ring_fd: i32,
    /// An eventfd that wakes every rescuer to see `stop`.
    quit_fd: i32,
}

impl<'a> Rescue<'a> {
    /// Called on the event thread: the rescuers move the caller. `ring_fd` is `rb`'s map.
    pub(super) fn new(
        asleep_on: &'a AtomicUsize,
        rb: &'a RingBuffer<'_>,
        ring_fd: i32,
        stop: &'a AtomicBool,
        rt_priority: Option<i32>,
    ) -> Rescue<'a> {
        Rescue {
            tid: nix::unistd::gettid(),
            asleep_on,
            // SAFETY: the ring buffer outlives the rescue (borrowed for 'a), and has its
            // one ring.
            ring: RingPtr(unsafe {
                libbpf_sys::ring_buffer__ring(rb.as_libbpf_object().as_ptr(), 0)
            }),
            stop,
            rt_priority,
            ring_fd,
            // SAFETY: creates an fd `close` closes.
            quit_fd: unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) },
        }
    }

    /// Starts a rescuer on each of `cpus` (none where there is one: nowhere to move to).
    pub(super) fn spawn_all<'s>(&'s self, scope: &'s Scope<'s, '_>, cpus: &[usize]) {
        if cpus.len() > 1 {
            for &cpu in cpus {
                if let Err(e) = std::thread::Builder::new()
                    .name(format!("vcpu-rescue-{cpu}"))
                    .spawn_scoped(scope, move || self.run(cpu))
                {
                    warn!(
                        cpu,
                        "no rescuer for this vCPU ({e}): its events may wait for another"
                    );
                }
            }
        }
    }

    fn run(&self, cpu: usize) {
        if os_layer::sched::pin_self(cpu).is_err() {
            return;
        }
        prepare_thread(self.rt_priority);
        // SAFETY: plain syscalls on fds this thread owns or borrows for its lifetime (the
        // ring buffer outlives the scope this thread runs in).
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return;
        }
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: 0,
        };
        let mut quit = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 1,
        };
        // SAFETY: as above; each event is valid for its call.
        let added = unsafe {
            libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, self.ring_fd, &mut ev) == 0
                && libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, self.quit_fd, &mut quit) == 0
        };
        if !added {
            // SAFETY: `ep` is ours.
            unsafe { libc::close(ep) };
            return;
        }
        while !self.stop.load(Relaxed) {
            if !wait_for_events(ep, QUIET_NS) || self.stop.load(Relaxed) {
                continue;
            }
            // Events still unread: the event thread, woken with this one, has not run yet,
            // and may be frozen with the vCPU it sleeps on, while this vCPU runs. (No timer
            // to give it a moment first: one that expired while a vCPU was out would fire
            // late when it comes back, beside the heartbeat's, and move where the gap is
            // seen to start.)
            // SAFETY: a valid ring of a ring buffer that outlives this thread; the call
            // only reads its two positions.
            let unread = unsafe { libbpf_sys::ring__avail_data_size(self.ring.0) } > 0;
            if !unread || self.asleep_on.load(Relaxed) == cpu {
                continue;
            }
            let mut set = nix::sched::CpuSet::new();
            if set.set(cpu).is_ok() && nix::sched::sched_setaffinity(self.tid, &set).is_ok() {
                self.asleep_on.store(cpu, Relaxed);
                tracing::trace!(cpu, "event thread moved off a vCPU that does not run");
            }
        }
        // SAFETY: `ep` is ours.
        unsafe { libc::close(ep) };
    }

    /// Wakes every rescuer (after `stop` is set).
    pub(super) fn quit(&self) {
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(self.quit_fd, (&one as *const u64).cast(), 8) };
    }

    /// Closes what `new` opened, once every rescuer has exited.
    pub(super) fn close(self) {
        if self.quit_fd >= 0 {
            // SAFETY: ours, and every rescuer has exited.
            unsafe { libc::close(self.quit_fd) };
        }
    }
}

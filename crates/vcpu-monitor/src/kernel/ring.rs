//! The ring buffer the BPF program wakes the daemon through: its gap events, and the
//! precise wait on it that both the event thread and the rescuers use.

use anyhow::{anyhow, Result};
use libbpf_rs::RingBufferBuilder;
use std::cell::RefCell;
use std::rc::Rc;

use crate::bpf_skel::VcputickSkel;

/// bpf/vcputick.h `struct gap_event` (not in the skeleton's types: no global uses it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct GapEvent {
    pub(super) ts: u64,
    pub(super) inactive_ns: u64,
    pub(super) last_slice_ns: u64,
    pub(super) cpu: u32,
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

/// The ring buffer of gap events, each parsed into `sink`.
pub(super) fn gap_ring<'a>(
    skel: &'a VcputickSkel<'_>,
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

/// Waits up to `timeout_ns` for an epoll fd on the ring buffer. A push point is due at a
/// precise time: the millisecond timeout of `epoll_wait` (and of libbpf's poll) rounds a
/// sub-millisecond wait down to a busy loop, so this uses `epoll_pwait2` (Linux 5.11+)
/// and rounds up to the next millisecond only where that call does not exist. Whether an
/// event came.
pub(super) fn wait_for_events(epfd: i32, timeout_ns: u64) -> bool {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: a valid epoll fd, one event slot, a valid timespec and no signal mask.
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
        return unsafe { libc::epoll_wait(epfd, &mut ev, 1, ms) } > 0;
    }
    rc > 0
}

#[cfg(test)]
mod tests {
    use super::*;

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

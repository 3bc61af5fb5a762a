//! The one clock of both programs (CLOCK_MONOTONIC), absolute sleeps on it, and the futex
//! wait/wake pair that lets a sleeper be woken before its deadline without a lock.

use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// A moment on CLOCK_MONOTONIC, the clock of the board, the engine and the kernel's own
/// timestamps: a point, where a `Duration` is a span. Spans between moments never go
/// negative (`since` saturates), as a clock read on two CPUs may be a few ns apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mono(u64);

impl Mono {
    pub const fn from_ns(ns: u64) -> Mono {
        Mono(ns)
    }

    pub fn now() -> Mono {
        Mono(monotonic_ns())
    }

    pub const fn ns(self) -> u64 {
        self.0
    }

    /// The span from `earlier` to this moment; zero if `earlier` is later.
    pub fn since(self, earlier: Mono) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// This moment moved back by `d`; `None` before the clock's start.
    pub fn checked_sub(self, d: Duration) -> Option<Mono> {
        self.0.checked_sub(nanos(d)).map(Mono)
    }
}

impl std::ops::Add<Duration> for Mono {
    type Output = Mono;
    /// Saturates at the end of the clock: `Duration::MAX` from now is never.
    fn add(self, d: Duration) -> Mono {
        Mono(self.0.saturating_add(nanos(d)))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

fn timespec(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// Sleeps until an absolute CLOCK_MONOTONIC deadline. A signal does not cut it short: with
/// an absolute deadline the retry is exact, and an early wake-up would read as "on time"
/// while the deadline was never reached.
pub fn sleep_until(deadline_ns: u64) {
    let ts = timespec(deadline_ns);
    loop {
        // SAFETY: valid timespec, no remainder wanted with TIMER_ABSTIME.
        let rc = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        if rc != libc::EINTR {
            return;
        }
    }
}

/// Blocks while `word` holds `expected`, until the absolute CLOCK_MONOTONIC `deadline_ns`
/// or a `futex_wake_all`. Returns on a wake-up, a changed word or the deadline (the caller
/// re-reads what it waits for); a signal does not end the wait. With FUTEX_WAIT_BITSET the
/// timeout is absolute and honours the timer slack.
pub fn futex_wait_until(word: &AtomicU32, expected: u32, deadline_ns: u64) {
    let ts = timespec(deadline_ns);
    loop {
        // SAFETY: FUTEX_WAIT_BITSET on a live, aligned u32 borrowed for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT_BITSET | libc::FUTEX_PRIVATE_FLAG,
                expected,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                libc::FUTEX_BITSET_MATCH_ANY,
            )
        };
        if rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

/// Wakes every thread blocked in `futex_wait_until` on `word`.
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned u32 borrowed for the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn moments_and_spans() {
        let t = Mono::from_ns(5_000);
        assert_eq!((t + Duration::from_micros(3)).ns(), 8_000);
        assert_eq!(
            (t + Duration::from_micros(3)).since(t),
            Duration::from_micros(3)
        );
        assert_eq!(
            t.since(t + Duration::from_nanos(1)),
            Duration::ZERO,
            "never negative"
        );
        assert_eq!(
            t + Duration::MAX,
            Mono::from_ns(u64::MAX),
            "saturates: never"
        );
        assert_eq!(
            t.checked_sub(Duration::from_micros(5)),
            Some(Mono::from_ns(0))
        );
        assert_eq!(t.checked_sub(Duration::from_micros(6)), None);
    }

    #[test]
    fn sleep_until_reaches_its_deadline() {
        let deadline = monotonic_ns() + 5_000_000;
        sleep_until(deadline);
        assert!(monotonic_ns() >= deadline);
    }

    #[test]
    fn a_futex_wait_ends_at_its_deadline_or_at_a_wake() {
        let word = Arc::new(AtomicU32::new(0));
        let deadline = monotonic_ns() + 5_000_000;
        futex_wait_until(&word, 0, deadline);
        assert!(monotonic_ns() >= deadline, "returned before the deadline");

        let w = word.clone();
        let waiter = std::thread::spawn(move || {
            let t0 = Instant::now();
            while w.load(Relaxed) == 0 {
                futex_wait_until(&w, 0, monotonic_ns() + 60_000_000_000);
            }
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        word.store(1, Relaxed);
        futex_wake_all(&word);
        let waited = waiter.join().unwrap();
        assert!(
            waited < Duration::from_secs(30),
            "the wake was lost: {waited:?}"
        );
    }

    #[test]
    fn a_changed_word_does_not_block() {
        let word = AtomicU32::new(1);
        let t0 = Instant::now();
        futex_wait_until(&word, 0, monotonic_ns() + 60_000_000_000);
        assert!(t0.elapsed() < Duration::from_secs(30));
    }
}

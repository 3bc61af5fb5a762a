//! The signals a user, systemd, logrotate or a shell may send a daemon, taken so that none
//! of them can end it without its restore. `block` runs first in `main`, before any
//! thread exists and before crash recovery: every thread inherits the blocked mask, so a
//! signal that arrives during start-up waits, pending, until the control plane reads it
//! from a signalfd and takes the one shutdown path (restore, exit 0). A handler installed
//! later would leave a window in which the default action (terminate) applies.
//!
//! What each signal does: SIGTERM, SIGINT and SIGQUIT shut down cleanly; SIGHUP reloads
//! the configuration; SIGUSR1 and SIGUSR2 are logged and ignored; SIGPIPE is ignored (a
//! closed socket is an error return, never a death). Must never install a handler that
//! runs daemon code in signal context.

use anyhow::{Context, Result};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// The signals read from the signalfd; SIGPIPE is ignored instead.
pub const TAKEN: [Signal; 6] = [
    Signal::SIGHUP,
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// What a signal asks of the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// SIGTERM, SIGINT, SIGQUIT: restore and exit 0.
    Stop(&'static str),
    /// SIGHUP: read the configuration again.
    Reload,
    /// SIGUSR1, SIGUSR2: said in the log, nothing else.
    Ignored(&'static str),
}

impl Event {
    fn of(sig: Signal) -> Event {
        match sig {
            Signal::SIGHUP => Event::Reload,
            Signal::SIGINT | Signal::SIGTERM | Signal::SIGQUIT => Event::Stop(sig.as_str()),
            other => Event::Ignored(other.as_str()),
        }
    }
}

fn taken() -> SigSet {
    let mut set = SigSet::empty();
    for s in TAKEN {
        set.add(s);
    }
    set
}

/// Blocks the taken signals in the calling thread (and so in every thread it starts),
/// ignores SIGPIPE, and opens the signalfd they are read from. Call it first in `main`.
pub fn block() -> Result<Signals> {
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&taken()), None)
        .context("blocking the daemon's signals")?;
    // SAFETY: SIG_IGN runs no code of ours.
    unsafe { nix::sys::signal::signal(Signal::SIGPIPE, nix::sys::signal::SigHandler::SigIgn) }
        .context("ignoring SIGPIPE")?;
    let fd = SignalFd::with_flags(&taken(), SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .context("opening a signalfd")?;
    Ok(Signals { fd })
}

/// The daemon's signals, read where it chooses (its control plane).
pub struct Signals {
    fd: SignalFd,
}

impl Signals {
    /// A signal already waiting, without blocking.
    pub fn poll(&mut self) -> Option<Event> {
        let info = self.fd.read_signal().ok()??;
        Signal::try_from(info.ssi_signo as i32).ok().map(Event::of)
    }

    /// The next signal. Inside a tokio runtime with I/O enabled.
    pub async fn next(&mut self) -> Event {
        let raw = std::os::fd::AsRawFd::as_raw_fd(&self.fd);
        // SAFETY: the signalfd is `self`'s and outlives this registration, which ends
        // (is dropped) before this call returns; nothing closes or replaces it meanwhile.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(raw, tokio::io::Interest::READABLE)
        };
        let Ok(afd) = registered else {
            // Without the reactor's help the signal is still read, more slowly.
            loop {
                if let Some(e) = self.poll() {
                    return e;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        };
        loop {
            if let Some(e) = self.poll() {
                return e;
            }
            match afd.readable().await {
                Ok(mut ready) => ready.clear_ready(),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signal_asks_for_what_the_readme_says() {
        assert_eq!(Event::of(Signal::SIGTERM), Event::Stop("SIGTERM"));
        assert_eq!(Event::of(Signal::SIGINT), Event::Stop("SIGINT"));
        assert_eq!(Event::of(Signal::SIGQUIT), Event::Stop("SIGQUIT"));
        assert_eq!(Event::of(Signal::SIGHUP), Event::Reload);
        assert_eq!(Event::of(Signal::SIGUSR1), Event::Ignored("SIGUSR1"));
        assert_eq!(Event::of(Signal::SIGUSR2), Event::Ignored("SIGUSR2"));
    }
}

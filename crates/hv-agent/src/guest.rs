//! One guest's channel, on its own thread: connects to the host end of the VM's
//! `org.vmigrater.hint.0` port (QEMU's chardev unix socket), answers `hello` with
//! `welcome`, keeps the latest report per vCPU for the period loop, answers bad lines with
//! `error` and counts them. Guest input is untrusted: framing caps, validation and the
//! session rules (proto) run before anything is kept. Reconnects with back-off.

use nix::sys::socket::MsgFlags;
use proto::{Accepted, GuestSession, LineReader, Message, VcpuReport, Welcome, PROTOCOL_VERSION};
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// What the period loop reads about one guest.
#[derive(Debug, Default)]
pub struct GuestState {
    pub connected: AtomicBool,
    pub reports: AtomicU64,
    pub rejected: AtomicU64,
    /// `seq` of the latest accepted report, echoed in `applied`.
    pub last_seq: AtomicU64,
    /// `reports` when the last `applied` went out: one answer per report.
    pub answered: AtomicU64,
    /// Latest report per guest vCPU, with when it arrived.
    pub latest: Mutex<BTreeMap<u32, (Instant, VcpuReport)>>,
    /// Writer for replies (`applied`), when connected.
    pub writer: Mutex<Option<UnixStream>>,
    /// Connections dropped because the guest stopped reading its replies.
    pub disconnects: AtomicU64,
    /// vCPUs the connected guest announced in its hello (0 while not connected).
    pub vcpus: AtomicU32,
}

impl GuestState {
    /// Reports no older than `max_age` (a silent guest falls back to no I/O figures).
    pub fn fresh(&self, max_age: Duration) -> BTreeMap<u32, VcpuReport> {
        let now = Instant::now();
        self.latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, (t, _))| now.duration_since(*t) <= max_age)
            .map(|(k, (_, r))| (*k, r.clone()))
            .collect()
    }

    /// Never blocks: the period loop serves every VM on the host, and shutdown waits for
    /// it. A guest that stops reading fills its socket buffer; the next reply that does
    /// not fit whole (a partial line would break the framing) disconnects it, and the
    /// reader thread reconnects with a fresh session.
    pub fn reply(&self, vm: &str, msg: &Message) {
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(w) = writer.as_ref() else {
            return;
        };
        let line = msg.to_line();
        let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
        match nix::sys::socket::send(w.as_raw_fd(), line.as_bytes(), flags) {
            Ok(n) if n == line.len() => {}
            outcome => {
                self.disconnects.fetch_add(1, Ordering::Relaxed);
                warn!(
                    vm,
                    "the guest does not read its replies ({}): disconnecting it",
                    match outcome {
                        Ok(n) => format!("{n} of {} bytes fit", line.len()),
                        Err(e) => e.to_string(),
                    }
                );
                let _ = w.shutdown(Shutdown::Both);
                *writer = None;
            }
        }
    }
}

fn monotonic_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

pub fn run(
    vm: String,
    socket: PathBuf,
    min_interval: Duration,
    state: Arc<GuestState>,
    stop: Arc<control::Stop>,
) {
    let epoch = Instant::now();
    let mut backoff = Duration::from_millis(100);
    let mut said = false;
    while !stop.is_set() {
        let stream = match UnixStream::connect(&socket) {
            Ok(s) => s,
            Err(e) => {
                if !said {
                    info!(vm, socket = %socket.display(), "guest channel not reachable ({e}); retrying");
                    said = true;
                }
                stop.nap(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        info!(vm, "guest channel connected");
        said = false;
        backoff = Duration::from_millis(100);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        *state.writer.lock().unwrap_or_else(PoisonError::into_inner) = stream.try_clone().ok();
        state.connected.store(true, Ordering::Relaxed);
        serve(&vm, stream, min_interval, epoch, &state, &stop);
        state.connected.store(false, Ordering::Relaxed);
        state.vcpus.store(0, Ordering::Relaxed);
        // The guest left: its reports no longer stand for its vCPUs.
        state
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        *state.writer.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

fn serve(
    vm: &str,
    mut stream: UnixStream,
    min_interval: Duration,
    epoch: Instant,
    state: &GuestState,
    stop: &control::Stop,
) {
    let mut reader = LineReader::new();
    let mut session = GuestSession::new(min_interval.as_nanos() as u64);
    let mut buf = [0u8; 8192];
    while !stop.is_set() {
        let n = match stream.read(&mut buf) {
            Ok(0) => {
                info!(vm, "guest channel closed");
                return;
            }
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) => {
                warn!(vm, "guest channel read failed: {e}");
                return;
            }
        };
        for line in reader.push(&buf[..n]) {
            match session.on_line(monotonic_ns(epoch), line) {
                Ok(Accepted::Hello(h)) => {
                    info!(vm, agent = %h.agent, vcpus = h.vcpus, "guest said hello");
                    state
                        .latest
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                    state.vcpus.store(h.vcpus, Ordering::Relaxed);
                    state.reply(
                        vm,
                        &Message::Welcome(Welcome {
                            version: PROTOCOL_VERSION,
                            host_slice_us: None,
                        }),
                    );
                }
                Ok(Accepted::Report(r)) => {
                    state.reports.fetch_add(1, Ordering::Relaxed);
                    state.last_seq.store(r.seq, Ordering::Relaxed);
                    let now = Instant::now();
                    let mut latest = state.latest.lock().unwrap_or_else(PoisonError::into_inner);
                    for v in r.vcpus {
                        latest.insert(v.cpu, (now, v));
                    }
                }
                Err(e) => {
                    state.rejected.fetch_add(1, Ordering::Relaxed);
                    debug!(vm, "rejected a guest line: {e}");
                    state.reply(
                        vm,
                        &Message::Error {
                            reason: e.to_string(),
                        },
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader thread that panics while holding the guest's locks must not take the
    /// period loop (every VM's credits) or shutdown down with it.
    #[test]
    fn poisoned_guest_locks_still_serve_the_period_loop() {
        let state = Arc::new(GuestState::default());
        let s = state.clone();
        let _ = std::thread::spawn(move || {
            let _latest = s.latest.lock().unwrap();
            let _writer = s.writer.lock().unwrap();
            panic!("a reader thread dies holding both locks");
        })
        .join();
        assert!(state.latest.is_poisoned() && state.writer.is_poisoned());
        assert!(state.fresh(Duration::from_secs(1)).is_empty());
        state.reply("vm", &Message::Error { reason: "x".into() });
    }
}

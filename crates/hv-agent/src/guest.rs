//! One guest's channel, on its own thread: connects to the host end of the VM's
//! `org.vmigrater.hint.0` port (QEMU's chardev unix socket), answers `hello` with
//! `welcome`, keeps the latest report per vCPU for the period loop, answers bad lines with
//! `error` and counts them. Guest input is untrusted: framing caps, validation and the
//! session rules (proto) run before anything is kept. Reconnects with back-off.

use proto::{Accepted, GuestSession, LineReader, Message, VcpuReport, Welcome, PROTOCOL_VERSION};
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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
    /// Latest report per guest vCPU, with when it arrived.
    pub latest: Mutex<BTreeMap<u32, (Instant, VcpuReport)>>,
    /// Writer for replies (`applied`), when connected.
    pub writer: Mutex<Option<UnixStream>>,
}

impl GuestState {
    /// Reports no older than `max_age` (a silent guest falls back to no I/O figures).
    pub fn fresh(&self, max_age: Duration) -> BTreeMap<u32, VcpuReport> {
        let now = Instant::now();
        self.latest
            .lock()
            .expect("guest state")
            .iter()
            .filter(|(_, (t, _))| now.duration_since(*t) <= max_age)
            .map(|(k, (_, r))| (*k, r.clone()))
            .collect()
    }

    /// Best effort, never blocking the period loop for long.
    pub fn reply(&self, msg: &Message) {
        if let Some(w) = self.writer.lock().expect("guest writer").as_mut() {
            let _ = w.write_all(msg.to_line().as_bytes());
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
    stop: Arc<AtomicBool>,
) {
    let epoch = Instant::now();
    let mut backoff = Duration::from_millis(100);
    let mut said = false;
    while !stop.load(Ordering::Relaxed) {
        let stream = match UnixStream::connect(&socket) {
            Ok(s) => s,
            Err(e) => {
                if !said {
                    info!(vm, socket = %socket.display(), "guest channel not reachable ({e}); retrying");
                    said = true;
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        info!(vm, "guest channel connected");
        said = false;
        backoff = Duration::from_millis(100);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        *state.writer.lock().expect("guest writer") = stream.try_clone().ok();
        state.connected.store(true, Ordering::Relaxed);
        serve(&vm, stream, min_interval, epoch, &state, &stop);
        state.connected.store(false, Ordering::Relaxed);
        *state.writer.lock().expect("guest writer") = None;
    }
}

fn serve(
    vm: &str,
    mut stream: UnixStream,
    min_interval: Duration,
    epoch: Instant,
    state: &GuestState,
    stop: &AtomicBool,
) {
    let mut reader = LineReader::new();
    let mut session = GuestSession::new(min_interval.as_nanos() as u64);
    let mut buf = [0u8; 8192];
    while !stop.load(Ordering::Relaxed) {
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
                    state.latest.lock().expect("guest state").clear();
                    state.reply(&Message::Welcome(Welcome {
                        version: PROTOCOL_VERSION,
                        host_slice_us: None,
                    }));
                }
                Ok(Accepted::Report(r)) => {
                    state.reports.fetch_add(1, Ordering::Relaxed);
                    state.last_seq.store(r.seq, Ordering::Relaxed);
                    let now = Instant::now();
                    let mut latest = state.latest.lock().expect("guest state");
                    for v in r.vcpus {
                        latest.insert(v.cpu, (now, v));
                    }
                }
                Err(e) => {
                    state.rejected.fetch_add(1, Ordering::Relaxed);
                    debug!(vm, "rejected a guest line: {e}");
                    state.reply(&Message::Error {
                        reason: e.to_string(),
                    });
                }
            }
        }
    }
}

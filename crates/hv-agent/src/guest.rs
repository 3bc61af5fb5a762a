//! One guest's channel, on its own thread: connects to the host end of the VM's
//! `org.vmigrater.hint.0` port (QEMU's chardev unix socket), answers `hello` with
//! `welcome`, keeps the latest report per vCPU for the period loop, answers bad lines with
//! `error` and counts them. Guest input is untrusted: framing caps, validation and the
//! session rules (proto) run before anything is kept. Reconnects with back-off, longer
//! for a guest whose sessions keep ending early or carry rejected lines, and logs at most
//! one line per kind and interval per guest, then how many it suppressed: a hostile guest
//! can neither flood the log nor keep the agent reconnecting.

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
use tracing::{info, warn};

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
    /// The connected guest moves its I/O-bound tasks only where the host holds vCPUs
    /// (its hello's `follows_host`; false while not connected).
    pub follows_host: AtomicBool,
    /// Connections made to the guest's channel (a flapping guest makes many).
    pub connections: AtomicU64,
    /// Log lines about this guest suppressed by the rate limit.
    pub log_suppressed: AtomicU64,
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

/// A session shorter than this, or with a rejected line, is a misbehaving one: the next
/// connection waits (`FLAP_BACKOFF_MIN`, doubling up to `FLAP_BACKOFF_MAX`).
const HEALTHY_SESSION: Duration = Duration::from_secs(10);
const FLAP_BACKOFF_MIN: Duration = Duration::from_millis(100);
const FLAP_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// At most one log line per guest and kind in this interval; the rest are counted.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// What the channel of one guest logs, one rate limit each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Said {
    Connected,
    Hello,
    Closed,
    ReadFailed,
    Rejected,
    BackOff,
}

impl Said {
    const ALL: [Said; 6] = [
        Said::Connected,
        Said::Hello,
        Said::Closed,
        Said::ReadFailed,
        Said::Rejected,
        Said::BackOff,
    ];

    fn what(self) -> &'static str {
        match self {
            Said::Connected => "guest channel connected",
            Said::Hello => "guest said hello",
            Said::Closed => "guest channel closed",
            Said::ReadFailed => "guest channel read failed",
            Said::Rejected => "rejected a guest line",
            Said::BackOff => "the guest keeps misbehaving: waiting before reconnecting",
        }
    }
}

/// Per-kind log budget of one guest: a line of a kind passes when none passed within
/// `interval`; the others are counted, and once the interval is over the count is due
/// (said in one line, which starts the next interval). Pure: the caller gives the time.
#[derive(Debug)]
pub struct LogLimit {
    interval: Duration,
    /// Per kind: when its last line (or count) was said, and how many were held back since.
    slots: [(Option<Instant>, u64); Said::ALL.len()],
}

impl LogLimit {
    pub fn new(interval: Duration) -> LogLimit {
        LogLimit {
            interval,
            slots: [(None, 0); Said::ALL.len()],
        }
    }

    /// Whether a line of `kind` may be said now (else it is counted).
    pub fn admit(&mut self, kind: Said, now: Instant) -> bool {
        let slot = &mut self.slots[kind as usize];
        match slot.0 {
            Some(t) if now.saturating_duration_since(t) < self.interval => {
                slot.1 += 1;
                false
            }
            _ => {
                slot.0 = Some(now);
                true
            }
        }
    }

    /// Counts whose interval is over (all of them with `all`, at the end), reset.
    pub fn due(&mut self, now: Instant, all: bool) -> Vec<(Said, u64)> {
        let mut out = Vec::new();
        for kind in Said::ALL {
            let slot = &mut self.slots[kind as usize];
            let over = slot
                .0
                .is_none_or(|t| now.saturating_duration_since(t) >= self.interval);
            if slot.1 > 0 && (over || all) {
                out.push((kind, slot.1));
                *slot = (Some(now), 0);
            }
        }
        out
    }
}

/// One guest's log: its lines pass through `LogLimit`, what was held back is said as a
/// count (and kept in `GuestState::log_suppressed` for status).
struct GuestLog<'a> {
    vm: &'a str,
    limit: LogLimit,
    state: &'a GuestState,
}

impl GuestLog<'_> {
    fn admit(&mut self, kind: Said) -> bool {
        let pass = self.limit.admit(kind, Instant::now());
        if !pass {
            self.state.log_suppressed.fetch_add(1, Ordering::Relaxed);
        }
        pass
    }

    fn flush(&mut self, all: bool) {
        let vm = self.vm;
        for (kind, n) in self.limit.due(Instant::now(), all) {
            let what = kind.what();
            let secs = self.limit.interval.as_secs();
            match kind {
                Said::ReadFailed | Said::Rejected | Said::BackOff => {
                    warn!(
                        vm,
                        suppressed = n,
                        "{n} more \"{what}\" lines suppressed (at most one per {secs} s)"
                    )
                }
                _ => info!(
                    vm,
                    suppressed = n,
                    "{n} more \"{what}\" lines suppressed (at most one per {secs} s)"
                ),
            }
        }
    }
}

/// How a session ended, for the back-off.
struct Session {
    lasted: Duration,
    rejected: u64,
}

/// A unix socket address holds 107 bytes of path; a channel reached through
/// `/proc/<pid>/root` of a pod's QEMU can be longer. Its directory, opened `O_PATH`, is
/// reached through `/proc/self/fd/<n>/` instead, a path of 40-odd bytes.
pub fn connect(path: &std::path::Path) -> std::io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    if path.as_os_str().as_bytes().len() <= control::MAX_SOCKET_PATH {
        return UnixStream::connect(path);
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return UnixStream::connect(path);
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(dir)?;
    let mut short = std::path::PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    short.push(name);
    UnixStream::connect(short)
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
    let mut flap = Duration::ZERO;
    let mut said = false;
    let mut log = GuestLog {
        vm: &vm,
        limit: LogLimit::new(LOG_INTERVAL),
        state: &state,
    };
    while !stop.is_set() {
        log.flush(false);
        let stream = match connect(&socket) {
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
        state.connections.fetch_add(1, Ordering::Relaxed);
        if log.admit(Said::Connected) {
            info!(vm, "guest channel connected");
        }
        said = false;
        backoff = Duration::from_millis(100);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        *state.writer.lock().unwrap_or_else(PoisonError::into_inner) = stream.try_clone().ok();
        state.connected.store(true, Ordering::Relaxed);
        let session = serve(&socket, stream, min_interval, epoch, &mut log, &stop);
        state.connected.store(false, Ordering::Relaxed);
        state.vcpus.store(0, Ordering::Relaxed);
        state.follows_host.store(false, Ordering::Relaxed);
        // The guest left: its reports no longer stand for its vCPUs.
        state
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        *state.writer.lock().unwrap_or_else(PoisonError::into_inner) = None;
        if stop.is_set() {
            break;
        }
        // A guest that closes and reconnects, or sends lines we reject, gets to do so
        // less and less often; a session that went well resets that.
        if session.lasted >= HEALTHY_SESSION && session.rejected == 0 {
            flap = Duration::ZERO;
        } else {
            flap = (flap * 2).clamp(FLAP_BACKOFF_MIN, FLAP_BACKOFF_MAX);
            if log.admit(Said::BackOff) {
                warn!(
                    vm,
                    lasted_ms = session.lasted.as_millis() as u64,
                    rejected = session.rejected,
                    "{}: next connection in {} ms (doubling up to {} s while it goes on)",
                    Said::BackOff.what(),
                    flap.as_millis(),
                    FLAP_BACKOFF_MAX.as_secs()
                );
            }
            stop.nap(flap);
        }
    }
    log.flush(true);
}

fn serve(
    socket: &std::path::Path,
    mut stream: UnixStream,
    min_interval: Duration,
    epoch: Instant,
    log: &mut GuestLog,
    stop: &control::Stop,
) -> Session {
    let (vm, state) = (log.vm, log.state);
    let started = Instant::now();
    let mut reader = LineReader::new();
    let mut session = GuestSession::new(min_interval.as_nanos() as u64);
    let mut buf = [0u8; 8192];
    let mut lines = 0u64;
    let mut rejected = 0u64;
    let ended = |rejected| Session {
        lasted: started.elapsed(),
        rejected,
    };
    while !stop.is_set() {
        log.flush(false);
        let n = match stream.read(&mut buf) {
            Ok(0) => {
                if log.admit(Said::Closed) {
                    info!(vm, "guest channel closed");
                }
                return ended(rejected);
            }
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) => {
                if log.admit(Said::ReadFailed) {
                    warn!(vm, "guest channel read failed: {e}");
                }
                return ended(rejected);
            }
        };
        for line in reader.push(&buf[..n]) {
            lines += 1;
            match session.on_line(monotonic_ns(epoch), line) {
                Ok(Accepted::Hello(h)) => {
                    if log.admit(Said::Hello) {
                        info!(vm, agent = %h.agent, vcpus = h.vcpus, follows_host = h.follows_host, "guest said hello");
                    }
                    state
                        .latest
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                    state.vcpus.store(h.vcpus, Ordering::Relaxed);
                    state.follows_host.store(h.follows_host, Ordering::Relaxed);
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
                    rejected += 1;
                    state.rejected.fetch_add(1, Ordering::Relaxed);
                    if log.admit(Said::Rejected) {
                        warn!(
                            vm,
                            socket = %socket.display(),
                            line = lines,
                            "rejected a guest line (line {lines} of this connection): {e}"
                        );
                    }
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
    ended(rejected)
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

    #[test]
    fn one_line_per_kind_and_interval_then_the_count() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut l = LogLimit::new(Duration::from_secs(10));
        // A flood of closes and rejected lines: the first of each kind passes.
        assert!(l.admit(Said::Closed, t0));
        assert!(l.admit(Said::Rejected, t0));
        let passed = (1..100)
            .filter(|&i| l.admit(Said::Closed, t0 + s * i / 20))
            .count();
        assert_eq!(passed, 0, "a second line within the interval");
        assert!(!l.admit(Said::Rejected, t0 + s));
        // Nothing is due before the interval ends; then each kind's count, once.
        assert!(l.due(t0 + s * 9, false).is_empty());
        assert_eq!(
            l.due(t0 + s * 10, false),
            [(Said::Closed, 99), (Said::Rejected, 1)]
        );
        assert!(l.due(t0 + s * 11, false).is_empty());
        // The count started the next interval: the flood goes on being counted, one
        // line per interval.
        assert!(!l.admit(Said::Closed, t0 + s * 12));
        assert!(l.admit(Said::Closed, t0 + s * 20));
        assert!(l.admit(Said::Hello, t0 + s * 12), "kinds are separate");
        // At the end every count is said, due or not (none is lost when a line passes).
        assert!(!l.admit(Said::Closed, t0 + s * 21));
        assert_eq!(l.due(t0 + s * 22, true), [(Said::Closed, 2)]);
        assert!(l.due(t0 + s * 40, true).is_empty());
    }
}

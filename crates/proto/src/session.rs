//! The host's view of one guest session: `hello` first, then `report`s with strictly
//! increasing `seq`, on average no faster than a minimum interval. A bad line is answered and
//! counted, never fatal: the session state (version, last seq) survives it. Pure: the
//! caller passes the time.

use crate::{FrameError, Hello, Message, Report, PROTOCOL_VERSION};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SessionError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("{0} before hello")]
    BeforeHello(&'static str),
    #[error("unsupported protocol version {0} (this host speaks {PROTOCOL_VERSION})")]
    Version(u32),
    #[error("report seq {got} is not after {last}")]
    OutOfOrder { got: u64, last: u64 },
    #[error("report for cpu {cpu}, but the guest said it has {vcpus} vCPUs")]
    UnknownCpu { cpu: u32, vcpus: u32 },
    #[error("reports faster than one per {interval_ms} ms beyond a burst of {BURST}: too fast")]
    RateLimited { interval_ms: u64 },
    #[error("a guest may not send {0}")]
    Direction(&'static str),
}

/// What an accepted line means to the agent.
#[derive(Debug, PartialEq)]
pub enum Accepted {
    /// A (new) handshake: answer with `welcome`.
    Hello(Hello),
    Report(Report),
}

/// Reports a guest may send back to back before the rate limit bites. Lines that left the
/// guest a period apart can reach the host together: virtio-serial and QEMU's chardev
/// deliver in batches when the vCPU or QEMU's main loop was descheduled (a second's worth
/// of reports within one millisecond, or dozens at once after a stall of seconds on a host
/// whose own hypervisor steals), so arrival gaps alone would punish the very guests this
/// agent exists for. 128 covers a 12 s stall at the default period; a flood is still held
/// to one report per interval, and a burst this size is cheap for the host to parse.
pub const BURST: u64 = 128;

#[derive(Debug)]
pub struct GuestSession {
    hello: Option<Hello>,
    last_seq: Option<u64>,
    /// GCRA: the time at which the bucket would be empty again; a report is refused when
    /// that lies more than `BURST` intervals ahead of now.
    busy_until_ns: Option<u64>,
    min_interval_ns: u64,
    pub rejected: u64,
}

impl GuestSession {
    /// `min_interval_ns`: the sustained rate limit, one report per interval, with bursts of
    /// up to [`BURST`] reports.
    pub fn new(min_interval_ns: u64) -> Self {
        GuestSession {
            hello: None,
            last_seq: None,
            busy_until_ns: None,
            min_interval_ns,
            rejected: 0,
        }
    }

    pub fn hello(&self) -> Option<&Hello> {
        self.hello.as_ref()
    }

    /// One framed line (or framing error) at `now_ns`.
    pub fn on_line(
        &mut self,
        now_ns: u64,
        line: Result<Vec<u8>, FrameError>,
    ) -> Result<Accepted, SessionError> {
        let r = self.accept(now_ns, line);
        if r.is_err() {
            self.rejected += 1;
        }
        r
    }

    fn accept(
        &mut self,
        now_ns: u64,
        line: Result<Vec<u8>, FrameError>,
    ) -> Result<Accepted, SessionError> {
        match Message::parse(&line?)? {
            Message::Hello(h) => {
                if h.version != PROTOCOL_VERSION {
                    return Err(SessionError::Version(h.version));
                }
                // A re-hello (guest daemon restarted) starts the sequence over.
                self.hello = Some(h.clone());
                self.last_seq = None;
                Ok(Accepted::Hello(h))
            }
            Message::Report(r) => {
                let hello = self
                    .hello
                    .as_ref()
                    .ok_or(SessionError::BeforeHello("report"))?;
                if let Some(last) = self.last_seq {
                    if r.seq <= last {
                        return Err(SessionError::OutOfOrder { got: r.seq, last });
                    }
                }
                if let Some(v) = r.vcpus.iter().find(|v| v.cpu >= hello.vcpus) {
                    return Err(SessionError::UnknownCpu {
                        cpu: v.cpu,
                        vcpus: hello.vcpus,
                    });
                }
                let busy = self.busy_until_ns.unwrap_or(0).max(now_ns) + self.min_interval_ns;
                if busy - now_ns > BURST * self.min_interval_ns {
                    return Err(SessionError::RateLimited {
                        interval_ms: self.min_interval_ns / 1_000_000,
                    });
                }
                self.last_seq = Some(r.seq);
                self.busy_until_ns = Some(busy);
                Ok(Accepted::Report(r))
            }
            Message::Welcome(_) => Err(SessionError::Direction("welcome")),
            Message::Applied(_) => Err(SessionError::Direction("applied")),
            Message::Error { .. } => Err(SessionError::Direction("error")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LineReader, VcpuReport};

    const MS: u64 = 1_000_000;

    fn report(seq: u64, cpu: u32) -> Vec<u8> {
        Message::Report(Report {
            seq,
            period_ms: 100,
            vcpus: vec![VcpuReport {
                cpu,
                io_completions: 10,
                io_interval_ema_us: 50.0,
                io_bound_tasks: 1,
                io_partner_tasks: 0,
                inactive_ratio: 0.5,
                slice_estimate_us: 10_000.0,
            }],
        })
        .to_line()
        .into_bytes()
    }

    fn hello(vcpus: u32) -> Vec<u8> {
        Message::Hello(Hello {
            version: 1,
            agent: "t".into(),
            vcpus,
            follows_host: false,
        })
        .to_line()
        .into_bytes()
    }

    fn feed(s: &mut GuestSession, now: u64, bytes: &[u8]) -> Vec<Result<Accepted, SessionError>> {
        let mut r = LineReader::new();
        r.push(bytes)
            .into_iter()
            .map(|l| s.on_line(now, l))
            .collect()
    }

    #[test]
    fn handshake_then_ordered_reports() {
        let mut s = GuestSession::new(10 * MS);
        assert!(matches!(
            feed(&mut s, 0, &report(1, 0))[0],
            Err(SessionError::BeforeHello(_))
        ));
        assert!(matches!(
            feed(&mut s, 0, &hello(2))[0],
            Ok(Accepted::Hello(_))
        ));
        assert!(matches!(
            feed(&mut s, 100 * MS, &report(1, 0))[0],
            Ok(Accepted::Report(_))
        ));
        assert_eq!(
            feed(&mut s, 200 * MS, &report(1, 1))[0],
            Err(SessionError::OutOfOrder { got: 1, last: 1 })
        );
        // State survived the rejection: seq 2 is accepted.
        assert!(matches!(
            feed(&mut s, 300 * MS, &report(2, 1))[0],
            Ok(Accepted::Report(_))
        ));
        assert_eq!(
            feed(&mut s, 400 * MS, &report(3, 5))[0],
            Err(SessionError::UnknownCpu { cpu: 5, vcpus: 2 })
        );
        assert_eq!(s.rejected, 3);
    }

    #[test]
    fn malformed_and_oversized_lines_do_not_lose_the_session() {
        let mut s = GuestSession::new(0);
        feed(&mut s, 0, &hello(2));
        let mut bytes = b"garbage\n".to_vec();
        bytes.extend(vec![b'{'; crate::MAX_LINE + 1]);
        bytes.push(b'\n');
        bytes.extend(report(1, 0));
        let out = feed(&mut s, MS, &bytes);
        assert!(matches!(
            out[0],
            Err(SessionError::Frame(FrameError::Malformed(_)))
        ));
        assert_eq!(out[1], Err(SessionError::Frame(FrameError::TooLong)));
        assert!(matches!(out[2], Ok(Accepted::Report(_))));
        assert_eq!(s.hello().unwrap().vcpus, 2);
    }

    #[test]
    fn rate_limit_and_direction_and_version() {
        let mut s = GuestSession::new(50 * MS);
        feed(&mut s, 0, &hello(1));
        // A batch of BURST reports arriving together (transport batching) is fine...
        for seq in 1..=BURST {
            assert!(
                feed(&mut s, 100 * MS, &report(seq, 0))[0].is_ok(),
                "seq {seq}"
            );
        }
        // ...one more in the same instant is not, and a refused report costs nothing.
        let limited = Err(SessionError::RateLimited { interval_ms: 50 });
        assert_eq!(feed(&mut s, 100 * MS, &report(BURST + 1, 0))[0], limited);
        assert_eq!(feed(&mut s, 110 * MS, &report(BURST + 2, 0))[0], limited);
        // One interval later there is room for exactly one.
        assert!(feed(&mut s, 150 * MS, &report(BURST + 3, 0))[0].is_ok());
        assert_eq!(feed(&mut s, 151 * MS, &report(BURST + 4, 0))[0], limited);
        // Sustained flooding gets one report per interval through, no more.
        let mut ok = 0;
        for i in 0..1000u64 {
            let seq = BURST + 5 + i;
            ok += feed(&mut s, 200 * MS + i * MS, &report(seq, 0))[0].is_ok() as u64;
        }
        assert_eq!(ok, 1000 / 50, "a flood must be held to the sustained rate");
        let welcome = Message::Welcome(crate::Welcome {
            version: 1,
            host_slice_us: None,
        })
        .to_line();
        assert_eq!(
            feed(&mut s, 0, welcome.as_bytes())[0],
            Err(SessionError::Direction("welcome"))
        );
        let v2 = br#"{"type":"hello","version":2,"agent":"x","vcpus":1}
"#;
        assert_eq!(feed(&mut s, 0, v2)[0], Err(SessionError::Version(2)));
        // A restarted guest says hello again and its sequence starts over; the rate
        // budget does not (hello + report must not get around the limit).
        feed(&mut s, 1200 * MS, &hello(1));
        let burst: Vec<_> = (1..=BURST)
            .map(|q| feed(&mut s, 1200 * MS, &report(q, 0)))
            .collect();
        assert_eq!(burst.iter().filter(|r| r[0].is_ok()).count(), 1);
        assert!(feed(&mut s, 2000 * MS, &report(BURST + 1, 0))[0].is_ok());
    }
}

//! The host's session rules over any sequence of guest lines and arrival times: no panic,
//! and nothing accepted that breaks a rule (a report before hello, out of order, or naming
//! a vCPU the hello did not announce).
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto::{Accepted, GuestSession, LineReader};

fuzz_target!(|data: &[u8]| {
    let mut session = GuestSession::new(20_000_000);
    let mut reader = LineReader::new();
    let mut now = 0u64;
    let mut last_seq: Option<u64> = None;
    // Each newline-separated line arrives after a gap taken from its first byte.
    for line in reader.push(data) {
        let gap = line.as_ref().ok().and_then(|l| l.first()).copied().unwrap_or(0);
        now += u64::from(gap) * 1_000_000;
        match session.on_line(now, line) {
            Ok(Accepted::Hello(_)) => last_seq = None,
            Ok(Accepted::Report(r)) => {
                let hello = session.hello().expect("a report is accepted only after hello");
                assert!(r.vcpus.iter().all(|v| v.cpu < hello.vcpus));
                assert!(last_seq.is_none_or(|s| r.seq > s));
                last_seq = Some(r.seq);
            }
            Err(_) => {}
        }
    }
});

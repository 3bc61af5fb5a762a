//! The guest↔host wire format, shared by `vmigrater` (guest) and `vmigrater-hv-agent`
//! (host). Newline-delimited JSON, one object per line, like the QEMU guest agent: easy to
//! watch with `socat`, and a reader resynchronises at the next newline after any garbage.
//! This crate owns framing, parsing, validation and the session rules; it never touches a
//! socket, so both sides and the tests drive it with plain bytes.
//!
//! # Schema (version 1)
//!
//! Every line is an object with a `"type"`. Unknown fields are ignored (newer peers may
//! add some); known fields with a bad type or value reject the whole line with a reason.
//!
//! Guest → host:
//! - `{"type":"hello","version":1,"agent":"vmigrater 0.1.0","vcpus":2}` — first line of a
//!   session. `follows_host` (optional, absent = false; added after version 1 without a
//!   version bump, like `held`): the guest moves its I/O-bound tasks only onto the vCPUs
//!   the host names `held`, and never on its own, so the host may name a vCPU for the
//!   guest's I/O before anything pays for a favour there.
//! - `{"type":"report","seq":7,"period_ms":100,"vcpus":[{"cpu":0,"io_completions":1200,
//!   "io_interval_ema_us":85.5,"io_bound_tasks":1,"inactive_ratio":0.48,
//!   "slice_estimate_us":9900.0}]}` — per period while the guest has I/O to report,
//!   else as a heartbeat (vmigrater: every 20th period); `seq` strictly increases;
//!   `io_completions` counts completions in this period (ISACS E_n), `io_interval_ema_us`
//!   is Eq. 1's EMA, `inactive_ratio` the share of the period the vCPU was seen
//!   descheduled. `io_partner_tasks` (optional, absent = 0; added after version 1 without
//!   a version bump, like `held`): threads on this vCPU that an I/O-bound task wakes and is
//!   woken by (a database's client): they are on the I/O's path, so the host must not make
//!   this vCPU pay for another's favour.
//!
//! Host → guest:
//! - `{"type":"welcome","version":1,"host_slice_us":11000}` (`host_slice_us` optional).
//! - `{"type":"applied","seq":7,"vcpus":[{"cpu":0,"weight":1.56,"held":true},{"cpu":1,
//!   "weight":0.64}]}` — what the host did with report `seq` (relative weights, 1.0 =
//!   fair share); one per report, so a guest that reports seldom is answered seldom. `held` (optional, absent = false; added after version 1 without a version
//!   bump, since old peers ignore it): the host favours this vCPU because the guest said it
//!   holds I/O-bound tasks, so the guest should keep them there rather than move them.
//!   An agent that predates it sends no `held`; a guest that predates it ignores it; both
//!   are tested below.
//! - `{"type":"error","reason":"..."}` — a rejected line; the session goes on.
//!
//! Limits: a line is at most `MAX_LINE` bytes (longer ones are dropped whole), a report
//! has at most `MAX_VCPUS` entries, numbers must be finite and in range.

mod frame;
mod session;

pub use frame::{LineReader, MAX_LINE};
pub use session::{Accepted, GuestSession, SessionError};

use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: u32 = 1;
/// The virtio-serial port name (guest: /dev/virtio-ports/<this>).
pub const PORT_NAME: &str = "org.vmigrater.hint.0";
pub const MAX_VCPUS: usize = 1024;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    Hello(Hello),
    Report(Report),
    Welcome(Welcome),
    Applied(Applied),
    Error { reason: String },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    pub agent: String,
    pub vcpus: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub follows_host: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub seq: u64,
    pub period_ms: u32,
    pub vcpus: Vec<VcpuReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VcpuReport {
    pub cpu: u32,
    pub io_completions: u64,
    pub io_interval_ema_us: f64,
    pub io_bound_tasks: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub io_partner_tasks: u32,
    pub inactive_ratio: f64,
    pub slice_estimate_us: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    pub version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_slice_us: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    pub seq: u64,
    pub vcpus: Vec<VcpuWeight>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VcpuWeight {
    pub cpu: u32,
    pub weight: f64,
    /// The host favours this vCPU for the guest's I/O-bound tasks: keep them on it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
}

/// Why a line was rejected; the text goes back to the peer in an `error` message.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("line longer than {MAX_LINE} bytes: dropped")]
    TooLong,
    #[error("not valid JSON for any message: {0}")]
    Malformed(String),
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> FrameError {
    FrameError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

impl Message {
    /// One line of JSON, with the trailing newline.
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).expect("messages always serialise");
        s.push('\n');
        s
    }

    /// Parses and validates one line (without its newline).
    pub fn parse(line: &[u8]) -> Result<Message, FrameError> {
        if line.len() > MAX_LINE {
            return Err(FrameError::TooLong);
        }
        let msg: Message =
            serde_json::from_slice(line).map_err(|e| FrameError::Malformed(e.to_string()))?;
        msg.validate()?;
        Ok(msg)
    }

    fn validate(&self) -> Result<(), FrameError> {
        match self {
            Message::Hello(h) => {
                if h.vcpus == 0 || h.vcpus as usize > MAX_VCPUS {
                    return Err(invalid(
                        "hello.vcpus",
                        format!("{} is outside 1..={MAX_VCPUS}", h.vcpus),
                    ));
                }
                if h.agent.len() > 256 {
                    return Err(invalid("hello.agent", "longer than 256 bytes"));
                }
            }
            Message::Report(r) => {
                if r.vcpus.len() > MAX_VCPUS {
                    return Err(invalid(
                        "report.vcpus",
                        format!("{} entries, at most {MAX_VCPUS}", r.vcpus.len()),
                    ));
                }
                if r.period_ms == 0 || r.period_ms > 60_000 {
                    return Err(invalid(
                        "report.period_ms",
                        format!("{} is outside 1..=60000", r.period_ms),
                    ));
                }
                let mut seen = std::collections::HashSet::new();
                for (i, v) in r.vcpus.iter().enumerate() {
                    let f = |name: &str| format!("report.vcpus[{i}].{name}");
                    if !seen.insert(v.cpu) {
                        return Err(invalid(f("cpu"), format!("cpu {} appears twice", v.cpu)));
                    }
                    for (name, x) in [
                        ("io_interval_ema_us", v.io_interval_ema_us),
                        ("slice_estimate_us", v.slice_estimate_us),
                    ] {
                        if !x.is_finite() || x < 0.0 {
                            return Err(invalid(
                                f(name),
                                format!("{x} is not a finite non-negative number"),
                            ));
                        }
                    }
                    if !(0.0..=1.0).contains(&v.inactive_ratio) {
                        return Err(invalid(
                            f("inactive_ratio"),
                            format!("{} is outside 0..=1", v.inactive_ratio),
                        ));
                    }
                }
            }
            Message::Applied(a) => {
                if let Some(w) = a
                    .vcpus
                    .iter()
                    .find(|w| !w.weight.is_finite() || w.weight < 0.0)
                {
                    return Err(invalid(
                        "applied.vcpus.weight",
                        format!("{} for cpu {}", w.weight, w.cpu),
                    ));
                }
            }
            Message::Welcome(_) | Message::Error { .. } => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Message {
        Message::Report(Report {
            seq: 7,
            period_ms: 100,
            vcpus: vec![VcpuReport {
                cpu: 0,
                io_completions: 1200,
                io_interval_ema_us: 85.5,
                io_bound_tasks: 1,
                io_partner_tasks: 0,
                inactive_ratio: 0.48,
                slice_estimate_us: 9900.0,
            }],
        })
    }

    /// Found by fuzzing (fuzz/corpus/frame/regression-float-roundtrip): serde_json's
    /// default float parser may land one unit in the last place off, so a report read,
    /// re-encoded and read again changed. With `float_roundtrip` every number survives.
    #[test]
    fn numbers_survive_a_round_trip_exactly() {
        let line = br#"{"type":"report","seq":2,"period_ms":100,"vcpus":[{"cpu":1,"io_completions":3,"io_interval_ema_us":120.0,"io_bound_tasks":1,"inactive_ratio":0.2,"slice_estimate_us":533333333333333333333333333333333333000.0}]}"#;
        let m = Message::parse(line).unwrap();
        let again = Message::parse(m.to_line().trim_end().as_bytes()).unwrap();
        assert_eq!(again, m);
    }

    #[test]
    fn every_message_round_trips() {
        for m in [
            Message::Hello(Hello {
                version: 1,
                agent: "vmigrater 0.1.0".into(),
                vcpus: 2,
                follows_host: false,
            }),
            Message::Hello(Hello {
                version: 1,
                agent: "vmigrater 0.1.0".into(),
                vcpus: 2,
                follows_host: true,
            }),
            report(),
            Message::Welcome(Welcome {
                version: 1,
                host_slice_us: Some(11_000),
            }),
            Message::Welcome(Welcome {
                version: 1,
                host_slice_us: None,
            }),
            Message::Applied(Applied {
                seq: 7,
                vcpus: vec![
                    VcpuWeight {
                        cpu: 0,
                        weight: 1.25,
                        held: true,
                    },
                    VcpuWeight {
                        cpu: 1,
                        weight: 0.8,
                        held: false,
                    },
                ],
            }),
            Message::Error { reason: "x".into() },
        ] {
            let line = m.to_line();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            assert_eq!(Message::parse(line.trim_end().as_bytes()).unwrap(), m);
        }
    }

    #[test]
    fn the_documented_example_parses() {
        let line = br#"{"type":"report","seq":7,"period_ms":100,"vcpus":[{"cpu":0,"io_completions":1200,"io_interval_ema_us":85.5,"io_bound_tasks":1,"inactive_ratio":0.48,"slice_estimate_us":9900.0}]}"#;
        assert_eq!(Message::parse(line).unwrap(), report());
    }

    /// `follows_host` came after version 1: a guest that predates it says nothing (read as
    /// false), and a hello without it is sent exactly as version 1 did.
    #[test]
    fn follows_host_is_compatible_both_ways() {
        let old_guest = br#"{"type":"hello","version":1,"agent":"vmigrater 0.1.0","vcpus":2}"#;
        match Message::parse(old_guest).unwrap() {
            Message::Hello(h) => assert!(!h.follows_host),
            m => panic!("{m:?}"),
        }
        let plain = Message::Hello(Hello {
            version: 1,
            agent: "vmigrater 0.1.0".into(),
            vcpus: 2,
            follows_host: false,
        });
        assert_eq!(plain.to_line().trim_end().as_bytes(), old_guest);
        let follower = Message::Hello(Hello {
            follows_host: true,
            ..match plain {
                Message::Hello(h) => h,
                _ => unreachable!(),
            }
        })
        .to_line();
        assert!(follower.contains(r#""follows_host":true"#), "{follower}");
    }

    /// `held` came after version 1: an agent that predates it sends none (read as false),
    /// and a guest that predates it reads a new agent's `applied` as before.
    #[test]
    fn held_is_compatible_both_ways() {
        let old_agent = br#"{"type":"applied","seq":3,"vcpus":[{"cpu":0,"weight":1.25}]}"#;
        match Message::parse(old_agent).unwrap() {
            Message::Applied(a) => assert!(!a.vcpus[0].held),
            m => panic!("{m:?}"),
        }
        let new_agent = Message::Applied(Applied {
            seq: 3,
            vcpus: vec![VcpuWeight {
                cpu: 0,
                weight: 1.5625,
                held: true,
            }],
        })
        .to_line();
        assert!(new_agent.contains(r#""held":true"#), "{new_agent}");
        // The version-1 shape, as a guest built before `held` has it.
        #[derive(Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum OldMessage {
            Applied { seq: u64, vcpus: Vec<OldWeight> },
        }
        #[derive(Deserialize)]
        struct OldWeight {
            cpu: u32,
            weight: f64,
        }
        let OldMessage::Applied { seq, vcpus } =
            serde_json::from_str::<OldMessage>(new_agent.trim_end()).unwrap();
        assert_eq!((seq, vcpus[0].cpu, vcpus[0].weight), (3, 0, 1.5625));
        // And a weight that is not held is sent exactly as version 1 did.
        let plain = Message::Applied(Applied {
            seq: 4,
            vcpus: vec![VcpuWeight {
                cpu: 1,
                weight: 0.64,
                held: false,
            }],
        });
        assert_eq!(
            plain.to_line(),
            "{\"type\":\"applied\",\"seq\":4,\"vcpus\":[{\"cpu\":1,\"weight\":0.64}]}\n"
        );
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let line = br#"{"type":"hello","version":1,"agent":"a","vcpus":2,"future":{"x":1}}"#;
        assert!(matches!(Message::parse(line), Ok(Message::Hello(_))));
    }

    #[test]
    fn bad_lines_are_rejected_with_a_reason() {
        let cases: [(&[u8], &str); 6] = [
            (b"not json", "not valid JSON"),
            (br#"{"type":"launch"}"#, "not valid JSON"),
            (br#"{"type":"hello","version":1,"agent":"a","vcpus":0}"#, "hello.vcpus"),
            (br#"{"type":"report","seq":1,"period_ms":100,"vcpus":[{"cpu":0,"io_completions":1,"io_interval_ema_us":-1,"io_bound_tasks":0,"inactive_ratio":0.1,"slice_estimate_us":1}]}"#, "io_interval_ema_us"),
            (br#"{"type":"report","seq":1,"period_ms":100,"vcpus":[{"cpu":0,"io_completions":1,"io_interval_ema_us":1,"io_bound_tasks":0,"inactive_ratio":1.5,"slice_estimate_us":1}]}"#, "inactive_ratio"),
            (br#"{"type":"report","seq":1,"period_ms":100,"vcpus":[{"cpu":0,"io_completions":"many","io_interval_ema_us":1,"io_bound_tasks":0,"inactive_ratio":0.1,"slice_estimate_us":1}]}"#, "not valid JSON"),
        ];
        for (line, want) in cases {
            let err = Message::parse(line).unwrap_err().to_string();
            assert!(
                err.contains(want),
                "{} → {err}",
                String::from_utf8_lossy(line)
            );
        }
        let dup = br#"{"type":"report","seq":1,"period_ms":100,"vcpus":[{"cpu":0,"io_completions":1,"io_interval_ema_us":1,"io_bound_tasks":0,"inactive_ratio":0.1,"slice_estimate_us":1},{"cpu":0,"io_completions":1,"io_interval_ema_us":1,"io_bound_tasks":0,"inactive_ratio":0.1,"slice_estimate_us":1}]}"#;
        assert!(Message::parse(dup)
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }
}

//! The agent's state as one snapshot, rebuilt by the period loop every period: served as
//! JSON on `<state_dir>/status.sock`, read by `vmigrater-hv-agent status`, and turned into
//! Prometheus metrics at scrape time (`metrics`). Reading it never changes agent state.

use crate::config::{BackendKind, WeightKind};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::Path;

/// `<state_dir>/status.sock` (the config checks that it fits a socket address).
pub use crate::config::status_socket as socket_path;

/// Where a vCPU's I/O figures came from this period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The guest's `report` (vmigrater in the guest).
    Guest,
    /// Host-side wake-ups of the vCPU thread (`/proc/<tid>/status`), or of a modelled vCPU
    /// (the host model's entity).
    Schedstat,
    /// Host-side device kicks of the vCPU thread above its VM's quietest vCPU
    /// (`/proc/<tid>/io` writes; see `observe`).
    Kicks,
    #[default]
    None,
}

impl Source {
    /// The metric label: the name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Guest => "guest",
            Source::Schedstat => "schedstat",
            Source::Kicks => "kicks",
            Source::None => "none",
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VcpuStatus {
    pub vcpu: u32,
    pub tid: Option<u32>,
    /// Host CPU the thread is pinned to (its run queue), if exactly one.
    pub host_cpu: Option<usize>,
    pub source: Source,
    /// E_n of the last period.
    pub events: u64,
    pub ema_us: f64,
    /// CPU time and run-queue wait of the thread over the last period.
    pub cpu_ms: f64,
    pub wait_ms: f64,
    /// Totals since the agent first saw the thread.
    pub run_ns_total: u64,
    pub wait_ns_total: u64,
    pub iv_credit: f64,
    pub cv_credit: f64,
    pub boost: bool,
    /// Nice offset the credit core asked for (weight = 1.25^−nice).
    pub nice: i32,
    /// Relative CFS weight applied (1.0 = unchanged).
    pub weight: f64,
    /// Algorithm 2 moves of this vCPU so far.
    pub moves: u64,
    /// The vCPU carries its VM's I/O now (guest report, else 3 of the last 4 periods
    /// with I/O wake-ups of its thread).
    #[serde(default)]
    pub carries_io: bool,
    /// Favoured for the VM's I/O by the `vm-funded` rule (the guest is told `held`).
    #[serde(default)]
    pub held: bool,
    /// Runnable nearly all of its last 4 periods (never halted): only such a
    /// vCPU pays under `vm-funded`.
    #[serde(default)]
    pub always_runnable: bool,
    /// Free of its VM's I/O: no I/O-bound task or partner of one reported on it for 8
    /// periods, and under a tenth of the VM's busiest vCPU's I/O events. With
    /// `always_runnable`, what lets it pay for a sibling's favour under `vm-funded`.
    #[serde(default)]
    pub io_free: bool,
}

/// Where the agent learnt of a VM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// A `[[vm]]` table of the configuration: kept while the agent runs.
    #[default]
    Config,
    /// Found through libvirt: dropped when libvirt no longer lists it.
    Libvirt,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Config => "config",
            Origin::Libvirt => "libvirt",
        })
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VmStatus {
    pub name: String,
    pub origin: Origin,
    pub connected: bool,
    pub reports: u64,
    pub rejected: u64,
    /// Connections dropped because the guest stopped reading its replies.
    #[serde(default)]
    pub disconnects: u64,
    /// Connections made to the guest's channel since the VM was found.
    #[serde(default)]
    pub connections: u64,
    /// Log lines about the guest suppressed by the per-guest rate limit.
    #[serde(default)]
    pub log_suppressed: u64,
    pub vcpus: Vec<VcpuStatus>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentStatus {
    pub version: String,
    pub pid: u32,
    pub uptime_s: f64,
    pub backend: BackendKind,
    pub weight: WeightKind,
    pub period_ms: u64,
    pub periods: u64,
    pub apply_errors: u64,
    pub vms: Vec<VmStatus>,
}

pub fn query(state_dir: &Path) -> Result<AgentStatus> {
    control::query(&socket_path(state_dir), "vmigrater-hv-agent")
}

pub fn render(s: &AgentStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "vmigrater-hv-agent {} (pid {}), up {:.0} s, backend {}, weight {}, period {} ms, {} periods, {} apply errors",
        s.version, s.pid, s.uptime_s, s.backend, s.weight, s.period_ms, s.periods, s.apply_errors
    );
    for vm in &s.vms {
        let _ = writeln!(
            out,
            "\nvm {} ({}): channel {}, {} reports, {} rejected frames, {} connections, {} log lines suppressed",
            vm.name,
            vm.origin,
            if vm.connected { "connected" } else { "down" },
            vm.reports,
            vm.rejected,
            vm.connections,
            vm.log_suppressed
        );
        let _ = writeln!(
            out,
            "  {:>4} {:>8} {:>4} {:>9} {:>7} {:>9} {:>8} {:>8} {:>9} {:>9} {:>5} {:>4} {:>5} {:>4}",
            "vcpu",
            "tid",
            "cpu",
            "source",
            "events",
            "ema_us",
            "cpu_ms",
            "wait_ms",
            "iv",
            "cv",
            "boost",
            "nice",
            "moves",
            "io"
        );
        for v in &vm.vcpus {
            let _ = writeln!(
                out,
                "  {:>4} {:>8} {:>4} {:>9} {:>7} {:>9.1} {:>8.1} {:>8.1} {:>9.0} {:>9.0} {:>5} {:>4} {:>5} {:>4}",
                v.vcpu,
                v.tid.map_or("-".into(), |t| t.to_string()),
                v.host_cpu.map_or("-".into(), |c| c.to_string()),
                v.source.as_str(),
                v.events,
                v.ema_us,
                v.cpu_ms,
                v.wait_ms,
                v.iv_credit,
                v.cv_credit,
                if v.boost { "yes" } else { "no" },
                v.nice,
                v.moves,
                // held: favoured for the VM's I/O; io: carries I/O but is not held.
                match (v.held, v.carries_io) {
                    (true, _) => "held",
                    (false, true) => "io",
                    _ => "-",
                }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_table() {
        let s = AgentStatus {
            version: "0.1.0".into(),
            backend: BackendKind::KvmQemu,
            vms: vec![VmStatus {
                name: "web".into(),
                origin: Origin::Config,
                connected: true,
                reports: 7,
                vcpus: vec![VcpuStatus {
                    vcpu: 1,
                    tid: Some(4242),
                    source: Source::Guest,
                    carries_io: true,
                    held: true,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let json: serde_json::Value = serde_json::to_value(&s).unwrap();
        // The modes are typed here and keep their names on the wire (the config's).
        assert_eq!(json["backend"], "kvm-qemu");
        assert_eq!(json["weight"], "nice");
        let back: AgentStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back.vms[0].vcpus[0].source, Source::Guest);
        assert_eq!(back.backend, BackendKind::KvmQemu);
        let table = render(&back);
        assert!(table.contains("backend kvm-qemu, weight nice,"), "{table}");
        assert!(table.contains("vm web (config): channel connected, 7 reports"));
        assert!(table.contains("4242"), "{table}");
        assert!(table.contains("guest"), "{table}");
        assert!(table.contains(" held"), "{table}");
    }

    #[test]
    fn sources_and_origins_keep_their_names_on_the_wire() {
        use Source as S;
        for (s, name) in [
            (S::Guest, "guest"),
            (S::Schedstat, "schedstat"),
            (S::Kicks, "kicks"),
            (S::None, "none"),
        ] {
            assert_eq!(serde_json::to_value(s).unwrap(), name);
            assert_eq!(s.as_str(), name);
        }
        for (o, name) in [(Origin::Config, "config"), (Origin::Libvirt, "libvirt")] {
            assert_eq!(serde_json::to_value(o).unwrap(), name);
            assert_eq!(o.to_string(), name);
        }
    }
}

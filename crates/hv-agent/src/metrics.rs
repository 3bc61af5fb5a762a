//! Prometheus metrics of the host agent, rendered from the status snapshot at scrape time
//! (a fresh registry per scrape: VMs come and go with libvirt, and a vanished VM must not
//! leave stale series behind). Labels are the VM name and the guest vCPU number only.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

use crate::status::{AgentStatus, VmStatus};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmLabel {
    vm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VcpuLabel {
    vm: String,
    vcpu: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    vm: String,
    vcpu: u32,
    source: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub fn encode(s: &AgentStatus) -> String {
    let mut reg = Registry::with_prefix("vmigrater_hv");
    reg.register(
        "periods",
        "Credit periods run",
        ConstCounter::new(s.periods),
    );
    reg.register(
        "apply_errors",
        "Scheduling changes the backend failed to apply",
        ConstCounter::new(s.apply_errors),
    );
    register_vms(&mut reg, &s.vms);
    register_vcpus(&mut reg, &s.vms);
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}

/// Each VM's channel figures. Totals of a VM's own lifetime are gauges, not counters: a
/// VM that restarts (or a guest that reconnects) starts them again, which a counter must
/// never do.
fn register_vms(reg: &mut Registry, vms: &[VmStatus]) {
    let reports = Family::<VmLabel, Gauge>::default();
    let rejected = Family::<VmLabel, Gauge>::default();
    let connected = Family::<VmLabel, Gauge>::default();
    let connections = Family::<VmLabel, Gauge>::default();
    for vm in vms {
        let l = VmLabel {
            vm: vm.name.clone(),
        };
        reports.get_or_create(&l).set(vm.reports as i64);
        rejected.get_or_create(&l).set(vm.rejected as i64);
        connected.get_or_create(&l).set(vm.connected as i64);
        connections.get_or_create(&l).set(vm.connections as i64);
    }
    reg.register(
        "guest_reports",
        "Reports accepted from the guest since its VM was found",
        reports,
    );
    reg.register(
        "guest_rejected_frames",
        "Guest frames rejected (malformed, oversized, out of order, too fast)",
        rejected,
    );
    reg.register(
        "guest_connected",
        "1 while the guest channel is connected",
        connected,
    );
    reg.register(
        "guest_connections",
        "Connections made to the guest channel since its VM was found (a flapping guest makes many; reconnects back off)",
        connections,
    );
}

/// Each vCPU's credits, weight and host figures.
fn register_vcpus(reg: &mut Registry, vms: &[VmStatus]) {
    let iv = Family::<VcpuLabel, FloatGauge>::default();
    let cv = Family::<VcpuLabel, FloatGauge>::default();
    let weight = Family::<VcpuLabel, FloatGauge>::default();
    let nice = Family::<VcpuLabel, Gauge>::default();
    let boost = Family::<VcpuLabel, Gauge>::default();
    let held = Family::<VcpuLabel, Gauge>::default();
    let events = Family::<VcpuLabel, Gauge>::default();
    let run = Family::<VcpuLabel, FloatGauge>::default();
    let wait = Family::<VcpuLabel, FloatGauge>::default();
    let moves = Family::<VcpuLabel, Gauge>::default();
    let sources = Family::<SourceLabel, Gauge>::default();
    for vm in vms {
        for v in &vm.vcpus {
            let l = VcpuLabel {
                vm: vm.name.clone(),
                vcpu: v.vcpu,
            };
            sources
                .get_or_create(&SourceLabel {
                    vm: vm.name.clone(),
                    vcpu: v.vcpu,
                    source: v.source.as_str(),
                })
                .set(1);
            iv.get_or_create(&l).set(v.iv_credit / 1e9);
            cv.get_or_create(&l).set(v.cv_credit / 1e9);
            weight.get_or_create(&l).set(v.weight);
            nice.get_or_create(&l).set(v.nice as i64);
            boost.get_or_create(&l).set(v.boost as i64);
            held.get_or_create(&l).set(v.held as i64);
            events.get_or_create(&l).set(v.events as i64);
            run.get_or_create(&l).set(v.run_ns_total as f64 / 1e9);
            wait.get_or_create(&l).set(v.wait_ns_total as f64 / 1e9);
            moves.get_or_create(&l).set(v.moves as i64);
        }
    }
    reg.register_with_unit(
        "vcpu_iv_credit",
        "ISACS IVCredit of the vCPU in the last period",
        Unit::Seconds,
        iv,
    );
    reg.register_with_unit(
        "vcpu_cv_credit",
        "ISACS CVCredit of the vCPU in the last period",
        Unit::Seconds,
        cv,
    );
    reg.register(
        "vcpu_weight",
        "Relative CFS weight applied to the vCPU thread (1 = unchanged)",
        weight,
    );
    reg.register("vcpu_nice", "Nice offset the credit core applied", nice);
    reg.register(
        "vcpu_boost",
        "1 while the vCPU is in CPU-BOOST state",
        boost,
    );
    reg.register(
        "vcpu_held",
        "1 while the vCPU is favoured for its VM's I/O (vm-funded share rule)",
        held,
    );
    reg.register(
        "vcpu_io_events",
        "I/O events (E_n) of the vCPU in the last period",
        events,
    );
    reg.register_with_unit(
        "vcpu_run",
        "CPU time of the vCPU thread since the agent found it",
        Unit::Seconds,
        run,
    );
    reg.register_with_unit(
        "vcpu_wait",
        "Run-queue wait of the vCPU thread since the agent found it",
        Unit::Seconds,
        wait,
    );
    reg.register(
        "vcpu_source",
        "Where the vCPU's I/O figures come from (guest report, host kicks, host schedstat wake-ups, none); always 1",
        sources,
    );
    reg.register(
        "vcpu_moves",
        "Algorithm 2 (I/O load balancing) moves of the vCPU thread",
        moves,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{Source, VcpuStatus, VmStatus};

    #[test]
    fn every_vm_and_vcpu_has_its_series() {
        let s = AgentStatus {
            periods: 12,
            vms: vec![VmStatus {
                name: "db".into(),
                connected: true,
                reports: 3,
                rejected: 1,
                connections: 2,
                vcpus: vec![VcpuStatus {
                    vcpu: 0,
                    source: Source::Guest,
                    iv_credit: 2e6,
                    nice: -2,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = encode(&s);
        for want in [
            "vmigrater_hv_periods_total 12",
            "vmigrater_hv_guest_reports{vm=\"db\"} 3",
            "vmigrater_hv_guest_rejected_frames{vm=\"db\"} 1",
            "vmigrater_hv_guest_connected{vm=\"db\"} 1",
            "vmigrater_hv_guest_connections{vm=\"db\"} 2",
            "vmigrater_hv_vcpu_iv_credit_seconds{vm=\"db\",vcpu=\"0\"} 0.002",
            "vmigrater_hv_vcpu_nice{vm=\"db\",vcpu=\"0\"} -2",
            "vmigrater_hv_vcpu_source{vm=\"db\",vcpu=\"0\",source=\"guest\"} 1",
            "# EOF",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }
}

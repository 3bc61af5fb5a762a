//! The Grafana dashboard (packaging/grafana/vmigrater.json), the alert rules
//! (packaging/prometheus/*-alerts.yml) and the example scrape config must not drift from
//! what the programs export: every metric a panel, variable or rule queries is a family the
//! real encoders of `vmigrater` and `vmigrater-hv-agent` produce.

use std::collections::BTreeSet;

/// Family names from the `# TYPE name kind` lines, with the sample names each kind allows.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        if f.next() != Some("#") || f.next() != Some("TYPE") {
            continue;
        }
        let (Some(name), Some(kind)) = (f.next(), f.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total", "_created"],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            "info" => &["_info"],
            _ => &[""],
        };
        for s in suffixes {
            names.insert(format!("{name}{s}"));
        }
    }
    names
}

fn ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// Every metric name in `text` that contains `vmigrater_`, recorded names (`level:metric:
/// operations`, with colons) apart from exported ones.
fn names_in(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut exported, mut recorded) = (BTreeSet::new(), BTreeSet::new());
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("vmigrater_") {
        let (mut start, mut end) = (i + at, i + at);
        while start > 0 && ident(bytes[start - 1]) {
            start -= 1;
        }
        while end < bytes.len() && ident(bytes[end]) {
            end += 1;
        }
        let name = &text[start..end];
        // `vmigrater_*` in a description is a prefix, not a metric.
        let metric = !name.ends_with('_') && name.starts_with(|c: char| c.is_ascii_alphabetic());
        if metric && name.contains(':') {
            recorded.insert(name.to_string());
        } else if metric && name.starts_with("vmigrater_") {
            exported.insert(name.to_string());
        }
        i = end;
    }
    (exported, recorded)
}

/// Every exported `vmigrater_*` metric in the dashboard's queries.
fn queried(dashboard: &str) -> BTreeSet<String> {
    names_in(dashboard).0
}

/// The names a recording rules file records.
fn recorded_by(rules: &str) -> BTreeSet<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record:"))
        .map(|n| n.trim().to_string())
        .collect()
}

/// Every family both programs export, with each kind's sample names.
fn exported_by_both() -> BTreeSet<String> {
    // The guest daemon's, as it encodes a status report, with one migration and one vCPU
    // so that every labelled family has a series (an empty family prints nothing at all).
    use migrater::hook::MoveLog as _;
    let report = vmigrater::status::StatusReport {
        vcpus: vec![vmigrater::status::VcpuStatus::default()],
        ..Default::default()
    };
    let moves = vmigrater::metrics::Moves::default();
    moves.attempted(
        migrater::planner::Reason::Push,
        &migrater::affinity::Outcome::Moved { latency_ns: 5_000 },
    );
    // The host agent's, for one VM with one vCPU.
    let host = hv_agent::status::AgentStatus {
        vms: vec![hv_agent::status::VmStatus {
            name: "vm".into(),
            vcpus: vec![hv_agent::status::VcpuStatus::default()],
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut have = exported(&vmigrater::metrics::encode(&report, &moves));
    have.extend(exported(&hv_agent::metrics::encode(&host)));
    have
}

#[test]
fn every_dashboard_metric_is_exported() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dashboard = std::fs::read_to_string(format!("{root}/packaging/grafana/vmigrater.json"))
        .expect("dashboard");
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("dashboard is valid JSON");
    let have = exported_by_both();
    let want = queried(&dashboard);
    assert!(want.len() >= 20, "the dashboard queries only {want:?}");
    let missing: Vec<_> = want.difference(&have).collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics nobody exports: {missing:?}\nexported: {have:?}"
    );
}

/// The rules' own behaviour is tested by promtool (`make lint`); here, that they query
/// what the programs export, so a renamed metric fails the build, not a silent alert.
#[test]
fn every_alert_rule_metric_is_exported() {
    let root = env!("CARGO_MANIFEST_DIR");
    let have = exported_by_both();
    for (file, at_least) in [
        ("vmigrater-alerts.yml", 4),
        ("vmigrater-hv-agent-alerts.yml", 5),
        ("vmigrater-fleet-rules.yml", 6),
    ] {
        let rules = std::fs::read_to_string(format!("{root}/packaging/prometheus/{file}"))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = queried(&rules);
        assert!(want.len() >= at_least, "{file} queries only {want:?}");
        let missing: Vec<_> = want.difference(&have).collect();
        assert!(
            missing.is_empty(),
            "{file} queries metrics nobody exports: {missing:?}\nexported: {have:?}"
        );
    }
}

#[test]
fn the_scrape_config_names_both_default_ports() {
    let root = env!("CARGO_MANIFEST_DIR");
    let scrape = std::fs::read_to_string(format!("{root}/packaging/prometheus/scrape.yml"))
        .expect("scrape config");
    let guest = vmigrater::config::Config::default().metrics.listen.port();
    let host = hv_agent::config::Config::default().metrics.listen.port();
    assert!(scrape.contains(&format!(":{guest}")), "guest port {guest}");
    assert!(scrape.contains(&format!(":{host}")), "host port {host}");
}

/// The fleet dashboard reads recorded series only: each one it queries is recorded by the
/// fleet rules, whose own inputs the test above checks against the programs.
#[test]
fn every_fleet_dashboard_series_is_recorded() {
    let root = env!("CARGO_MANIFEST_DIR");
    let read = |f: &str| std::fs::read_to_string(format!("{root}/packaging/{f}")).unwrap();
    let dashboard = read("grafana/vmigrater-fleet.json");
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("fleet dashboard is valid JSON");
    let rules = read("prometheus/vmigrater-fleet-rules.yml");
    let recorded = recorded_by(&rules);
    let (exported, wanted) = names_in(&dashboard);
    assert!(
        exported.is_empty(),
        "the fleet dashboard queries raw series {exported:?}: record them in the fleet rules"
    );
    assert!(
        wanted.len() >= 8,
        "the fleet dashboard queries only {wanted:?}"
    );
    let missing: Vec<_> = wanted.difference(&recorded).collect();
    assert!(
        missing.is_empty(),
        "the fleet dashboard queries series no rule records: {missing:?}"
    );
    // The federation example pulls what the dashboard reads.
    let federate = read("prometheus/federate.yml");
    assert!(federate.contains("(instance|job|vm|vcpu|fleet):vmigrater.*"));
    for name in &recorded {
        let level = name.split(':').next().unwrap();
        assert!(
            ["instance", "job", "vm", "vcpu", "fleet"].contains(&level),
            "{name}: level {level} is not in federate.yml's match[]"
        );
    }
}

/// The agent's configuration in the KubeVirt manifest is one the agent accepts, and finds
/// VMs from their QEMU processes.
#[test]
fn the_kubevirt_manifest_configures_the_agent_as_it_parses() {
    let root = env!("CARGO_MANIFEST_DIR");
    let manifest = std::fs::read_to_string(format!(
        "{root}/packaging/kubernetes/vmigrater-hv-agent.yaml"
    ))
    .unwrap();
    let start = manifest
        .find("hv-agent.toml: |")
        .expect("the ConfigMap's hv-agent.toml")
        + 16;
    let toml: String = manifest[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.trim_start()))
        .collect();
    let cfg =
        hv_agent::config::Config::parse(&toml, "packaging/kubernetes/vmigrater-hv-agent.yaml")
            .unwrap_or_else(|e| panic!("{e:#}\n{toml}"));
    assert!(cfg.libvirt.enabled && cfg.libvirt.containers, "{toml}");
    assert!(cfg.metrics.enabled);
    let port = cfg.metrics.listen.port();
    assert!(
        manifest.contains(&format!("containerPort: {port}")),
        "the pod does not expose the metrics port {port}"
    );
}

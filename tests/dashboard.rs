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

/// Every `vmigrater_*` identifier in the dashboard's queries.
fn queried(dashboard: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = dashboard.as_bytes();
    let mut i = 0;
    while let Some(at) = dashboard[i..].find("vmigrater_") {
        let start = i + at;
        let before_ok =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        // `vmigrater_*` in the description is a prefix, not a metric.
        if before_ok && !dashboard[start..end].ends_with('_') {
            names.insert(dashboard[start..end].to_string());
        }
        i = end;
    }
    names
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

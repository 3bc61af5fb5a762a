//! The two exposition formats of `/metrics`. prometheus-client writes OpenMetrics; a
//! scraper that does not ask for it (curl, `promtool check metrics`, older collectors) gets
//! the classic text format 0.0.4, derived here. The differences that matter for our
//! metrics: a counter family is named with its `_total` suffix and has no `_created`
//! samples, histograms have no `_created` either, there are no `# UNIT` lines and no
//! `# EOF`.

pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header asks for OpenMetrics (Prometheus does, by default).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("application/openmetrics-text"))
}

/// OpenMetrics text (as prometheus-client encodes it) to the classic text format.
pub fn to_classic(openmetrics: &str) -> String {
    use std::collections::HashSet;
    // Families whose samples `<name>_created` are dropped, and counters to rename.
    let mut counters = HashSet::new();
    let mut created = HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut f = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (f.next(), f.next()) {
                if kind == "counter" {
                    counters.insert(name.to_string());
                }
                if matches!(kind, "counter" | "histogram" | "summary") {
                    created.insert(format!("{name}_created"));
                }
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            let name = if counters.contains(name) {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            out.push_str(&format!("{prefix}{name} {tail}\n"));
            continue;
        }
        let sample = line.split(['{', ' ']).next().unwrap_or("");
        if created.contains(sample) {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "# HELP x_deschedules Times seen.
# TYPE x_deschedules counter
x_deschedules_total{cpu=\"0\"} 3
x_deschedules_created{cpu=\"0\"} 1700000000.0
# HELP x_inactive_seconds Time.
# TYPE x_inactive_seconds counter
# UNIT x_inactive_seconds seconds
x_inactive_seconds_total{cpu=\"0\"} 0.5
# HELP x_latency_seconds Lat.
# TYPE x_latency_seconds histogram
x_latency_seconds_sum 0.1
x_latency_seconds_count 2
x_latency_seconds_bucket{le=\"+Inf\"} 2
x_latency_seconds_created 1700000000.0
# HELP x_build_info Build.
# TYPE x_build_info gauge
x_build_info{version=\"1\"} 1
# EOF
";

    #[test]
    fn counters_take_their_total_name_and_openmetrics_only_lines_go() {
        let c = to_classic(OM);
        assert!(c.contains("# HELP x_deschedules_total Times seen.\n# TYPE x_deschedules_total counter\nx_deschedules_total{cpu=\"0\"} 3\n"));
        assert!(c.contains("# TYPE x_inactive_seconds_total counter\nx_inactive_seconds_total"));
        assert!(c.contains("# TYPE x_latency_seconds histogram\n"));
        assert!(c.contains("x_latency_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(c.contains("x_build_info{version=\"1\"} 1\n"));
        for gone in ["_created", "# UNIT", "# EOF"] {
            assert!(!c.contains(gone), "{gone} left in:\n{c}");
        }
    }

    #[test]
    fn accept_header_picks_the_format() {
        assert!(wants_openmetrics(Some(
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        )));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
    }
}

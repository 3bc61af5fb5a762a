//! What every benchmark's results file and table need: a number read out of its JSON, an
//! estimate written into it and printed from it, and a flag's comma-separated list.

use crate::stats::Estimate;
use serde_json::{json, Value};

/// A JSON number, NaN where there is none (a missing figure stays visible as NaN).
pub fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// An estimate as JSON, null where there is none.
pub fn est(e: Option<Estimate>) -> Value {
    e.map_or(Value::Null, |e| json!(e))
}

/// An estimate from the JSON as "value [lo,hi]", "-" where there is none.
pub fn fmt_est(e: &Value) -> String {
    if e.is_null() {
        return "-".into();
    }
    format!(
        "{:.2} [{:.2},{:.2}]",
        f(&e["value"]),
        f(&e["lo"]),
        f(&e["hi"])
    )
}

/// A flag's value split at commas, blanks dropped.
pub fn list(v: &str) -> Vec<String> {
    v.split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Where a results file came from, merged at the top of every benchmark's JSON: the build
/// (`-dirty` when the tree had changes), the daemon binary's own build, the exact command,
/// the kernel and the CPU model. A table drawn from the file names them.
pub fn provenance() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    json!({
        "commit": crate::commit(),
        "daemon_build": crate::daemon_build(&crate::workspace_bin("vmigrater")),
        "command": std::env::args().collect::<Vec<_>>(),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "cpu_model": cpuinfo.lines().find_map(|l| {
            l.strip_prefix("model name")
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        }),
    })
}

/// `report` with `provenance()` merged in front of its own fields.
pub fn with_provenance(report: Value) -> Value {
    let mut out = provenance();
    if let (Some(o), Value::Object(r)) = (out.as_object_mut(), report) {
        o.extend(r);
    }
    out
}

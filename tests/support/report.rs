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

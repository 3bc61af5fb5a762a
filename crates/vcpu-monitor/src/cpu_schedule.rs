//! The `CPU:A_US:B_US[:PHASE_US]` syntax shared by the steal emulator's patterns and the
//! lab oracle's schedules (which describe the same steal). Parsing only.

use anyhow::{bail, Context, Result};

/// Parses `CPU:A_US:B_US[:PHASE_US]` into (cpu, a_us, b_us, phase_us): the syntax of the
/// steal emulator's patterns and of the oracle's schedules, which describe the same steal.
/// `what` and `names` (the A and B fields) word the errors; A and B must be > 0.
pub fn parse_cpu_schedule(s: &str, what: &str, names: [&str; 2]) -> Result<(usize, u64, u64, u64)> {
    let parts: Vec<&str> = s.split(':').collect();
    if !(3..=4).contains(&parts.len()) {
        bail!(
            "{what} {s:?}: expected CPU:{}:{}[:PHASE_US]",
            names[0],
            names[1]
        );
    }
    let num = |i: usize, field: &str| -> Result<u64> {
        parts[i]
            .trim()
            .parse()
            .with_context(|| format!("{what} {s:?}: {field} {:?} is not a number", parts[i]))
    };
    let cpu = num(0, "CPU")? as usize;
    let (a, b) = (num(1, names[0])?, num(2, names[1])?);
    let phase = if parts.len() == 4 {
        num(3, "PHASE_US")?
    } else {
        0
    };
    if a == 0 || b == 0 {
        bail!("{what} {s:?}: {} and {} must be > 0", names[0], names[1]);
    }
    Ok((cpu, a, b, phase))
}

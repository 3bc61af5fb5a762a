//! libbpf's own messages (load and attach failures, relocations, the verifier's log)
//! go through `tracing` with the daemon's other lines, not raw to stderr.

use libbpf_rs::PrintLevel;

/// Call once, after the `tracing` subscriber is installed. libbpf's warnings stay
/// warnings (a mode that fails before a fallback works says why); its info and debug
/// lines are debug, and are only formatted when debug is on for target `libbpf`.
pub fn route_to_tracing() {
    let level = if tracing::enabled!(target: "libbpf", tracing::Level::DEBUG) {
        PrintLevel::Debug
    } else {
        PrintLevel::Warn
    };
    libbpf_rs::set_print(Some((level, forward)));
}

fn forward(level: PrintLevel, msg: String) {
    // The target already says where it comes from.
    let msg = msg.trim_end();
    let msg = msg.strip_prefix("libbpf: ").unwrap_or(msg);
    match level {
        PrintLevel::Warn => tracing::warn!(target: "libbpf", "{msg}"),
        PrintLevel::Info | PrintLevel::Debug => tracing::debug!(target: "libbpf", "{msg}"),
    }
}

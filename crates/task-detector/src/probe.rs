//! What this kernel offers for block I/O tracing, without loading anything: kernel BTF,
//! which block tracepoints exist (in BTF and in tracefs), and the best attach mode.
//! It may mount tracefs when it is missing and we are root; it changes nothing else.

use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;

use crate::hooks::{plan_hooks, AttachMode, INFLIGHT_STALE_SECS, TRACEPOINTS};

const TRACEFS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
#[derive(Clone, Debug)]
pub struct Probe {
    pub btf: bool,
    /// (name, present in BTF or tracefs)
    pub tracepoints: Vec<(String, bool)>,
    pub best_mode: Option<AttachMode>,
    pub notes: Vec<String>,
}

/// The tracepoints that have a `btf_trace_<name>` typedef in the kernel's BTF, read once
/// through libbpf, which also finds BTF where `/sys/kernel/btf/vmlinux` is missing.
/// `None`: this kernel has no BTF.
fn btf_tracepoints() -> Option<&'static HashSet<String>> {
    static TRACEPOINTS: OnceLock<Option<HashSet<String>>> = OnceLock::new();
    TRACEPOINTS
        .get_or_init(|| {
            let btf = libbpf_rs::btf::Btf::from_vmlinux().ok()?;
            let names = btf
                .type_by_kind::<libbpf_rs::btf::types::Typedef<'_>>()
                .filter_map(|t| {
                    let name = t.name()?.to_str()?;
                    Some(name.strip_prefix("btf_trace_")?.to_string())
                })
                .collect();
            Some(names)
        })
        .as_ref()
}

/// A tracepoint has a `btf_trace_<name>` typedef in the kernel's BTF.
pub fn tracepoint_in_btf(name: &str) -> bool {
    btf_tracepoints().is_some_and(|set| set.contains(name))
}

pub fn tracepoint_in_tracefs(name: &str) -> bool {
    TRACEFS
        .iter()
        .any(|root| Path::new(root).join("events/block").join(name).is_dir())
}

/// Mounts tracefs if no tracefs is visible and we are root (classic tracepoints need it).
pub fn ensure_tracefs() {
    if TRACEFS.iter().any(|r| Path::new(r).join("events").is_dir())
        || !nix::unistd::geteuid().is_root()
    {
        return;
    }
    let r = nix::mount::mount(
        Some("nodev"),
        TRACEFS[0],
        Some("tracefs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    );
    if let Err(e) = r {
        tracing::debug!("mounting tracefs on {}: {e}", TRACEFS[0]);
    }
}

pub fn probe() -> Probe {
    ensure_tracefs();
    let btf = btf_tracepoints().is_some();
    let tracepoints = TRACEPOINTS
        .iter()
        .map(|tp| {
            (
                tp.to_string(),
                tracepoint_in_btf(tp) || tracepoint_in_tracefs(tp),
            )
        })
        .collect::<Vec<_>>();
    let mut notes = Vec::new();
    let has = |n: &str| tracepoints.iter().any(|(t, p)| t == n && *p);
    if !has("block_io_start") {
        notes.push("no block_io_start (kernel < 6.5): I/O is attributed to the issuing thread, not always the submitter".into());
    }
    if !TRACEFS.iter().any(|r| Path::new(r).join("events").is_dir()) {
        notes.push("tracefs is not mounted: classic tracepoints unavailable".into());
    }
    for optional in ["block_rq_requeue", "block_rq_merge"] {
        if !has(optional) {
            notes.push(format!(
                "no {optional}: requests it would close are repaired only when their slot \
                 is reused or after {} s",
                INFLIGHT_STALE_SECS
            ));
        }
    }
    // Order of preference; tp_btf needs the kernel's BTF for its typed arguments.
    let in_tracefs = tracepoint_in_tracefs;
    let best_mode = if btf && plan_hooks(tracepoint_in_btf).is_some() {
        Some(AttachMode::TpBtf)
    } else if plan_hooks(|n| tracepoint_in_btf(n) || in_tracefs(n)).is_some() {
        Some(AttachMode::RawTp)
    } else if plan_hooks(in_tracefs).is_some() {
        notes.push(
            "only classic tracepoints: requests are keyed by device and sector, less precise"
                .into(),
        );
        Some(AttachMode::Tracepoint)
    } else {
        None
    };
    Probe {
        btf,
        tracepoints,
        best_mode,
        notes,
    }
}

//! What the block programs (bpf/iotrack.bpf.c) need from a kernel: the tracepoints they
//! may use, which of them a mode attaches, and how long an open request may stay silent.
//! Pure: both the probe (what this kernel offers) and the tracker (loading) read it.

/// Every tracepoint the programs may use (see `plan_hooks`).
pub const TRACEPOINTS: [&str; 8] = [
    "block_io_start",
    "block_rq_insert",
    "block_rq_issue",
    "block_rq_complete",
    "block_rq_requeue",
    "block_rq_merge",
    "sched_wakeup",
    "sched_process_fork",
];

/// bpf/iotrack.h INFLIGHT_STALE_NS: an open busy interval with no event for this long
/// lost its end; it is reported closed at the last event.
pub(crate) const INFLIGHT_STALE_SECS: u64 = 5;
pub const INFLIGHT_STALE_NS: u64 = INFLIGHT_STALE_SECS * 1_000_000_000;

/// How the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// BTF-typed tracepoints: cheapest, needs kernel BTF.
    TpBtf,
    /// Raw tracepoints: no BTF needed at attach time.
    RawTp,
    /// Classic (perf) tracepoints: oldest, keyed by sector (less precise attribution).
    Tracepoint,
}

impl std::fmt::Display for AttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttachMode::TpBtf => "tp_btf",
            AttachMode::RawTp => "raw_tp",
            AttachMode::Tracepoint => "tracepoint",
        })
    }
}

impl AttachMode {
    pub const ALL: [AttachMode; 3] = [AttachMode::TpBtf, AttachMode::RawTp, AttachMode::Tracepoint];
}

/// The block tracepoints a mode attaches on a kernel where `exists(tp)` says which
/// tracepoints it offers; `None` when the mode cannot account requests there.
///
/// Start: `block_io_start` (6.5+, once per request in the submitter's context), else
/// `block_rq_insert` + `block_rq_issue` (insert sees the submitter on the scheduler
/// path, issue on the direct path). End: `block_rq_complete`. `block_rq_requeue` and
/// `block_rq_merge` keep the in-flight table honest where they exist; `sched_wakeup`
/// (typed and raw modes) finds the threads an I/O thread wakes and is woken by;
/// `sched_process_fork` (typed and raw) sees the children that inherit a pin.
pub fn plan_hooks(exists: impl Fn(&str) -> bool) -> Option<Vec<&'static str>> {
    let mut hooks = Vec::new();
    if exists("block_io_start") {
        hooks.push("block_io_start");
    } else if exists("block_rq_issue") {
        if exists("block_rq_insert") {
            hooks.push("block_rq_insert");
        }
        hooks.push("block_rq_issue");
    } else {
        return None;
    }
    if !exists("block_rq_complete") {
        return None;
    }
    hooks.push("block_rq_complete");
    for optional in [
        "block_rq_requeue",
        "block_rq_merge",
        "sched_wakeup",
        "sched_process_fork",
    ] {
        if exists(optional) {
            hooks.push(optional);
        }
    }
    Some(hooks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(tps: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |tp| tps.contains(&tp)
    }

    #[test]
    fn hooks_prefer_block_io_start_and_fall_back_to_insert_and_issue() {
        // A current kernel has every tracepoint the programs know.
        let now = TRACEPOINTS;
        assert_eq!(
            plan_hooks(|tp| now.contains(&tp)).unwrap(),
            [
                "block_io_start",
                "block_rq_complete",
                "block_rq_requeue",
                "block_rq_merge",
                "sched_wakeup",
                "sched_process_fork"
            ]
        );
        assert_eq!(
            plan_hooks(kernel(&[
                "block_rq_insert",
                "block_rq_issue",
                "block_rq_complete"
            ]))
            .unwrap(),
            ["block_rq_insert", "block_rq_issue", "block_rq_complete"]
        );
        assert_eq!(
            plan_hooks(kernel(&[
                "block_rq_issue",
                "block_rq_complete",
                "block_rq_requeue"
            ]))
            .unwrap(),
            ["block_rq_issue", "block_rq_complete", "block_rq_requeue"]
        );
        assert!(plan_hooks(kernel(&["block_io_start", "block_rq_issue"])).is_none());
        assert!(plan_hooks(kernel(&["block_rq_insert", "block_rq_complete"])).is_none());
    }
}

//! Finds I/O-bound threads (vMigrater §2.4.2): BPF programs on the block request
//! lifecycle aggregate, per thread, the time with I/O in flight and, per vCPU, the I/O
//! completions (ISACS Eq. 1); a pure classifier turns windows of those counters into
//! "I/O-bound" decisions with hysteresis and an I/O load level.
//!
//! Data path: `IoTracker` (BPF adapter) → `Detector` (adds /proc facts) → `IoClassifier`
//! (pure). Kernel threads are never candidates.

mod bpf_skel;
mod classifier;
mod detector;
pub mod diskstats;
mod hooks;
pub mod libbpf_log;
pub mod partners;
mod probe;
pub mod queues;
mod tracker;

pub use classifier::{
    ClassifierConfig, CompletionSite, Completions, IoClassifier, IoTask, ThreadObservation,
};
pub use detector::{BlockTracking, Detector, DetectorOutput, IoTaskInfo, Partner, ProcReader};
pub use hooks::{plan_hooks, AttachMode, INFLIGHT_STALE_NS};
pub use probe::{probe, Probe};
pub use tracker::{
    CpuIoSample, ForkSample, IoTracker, ThreadIoSample, TrackerOptions, TrackerStorage, WakeSample,
};

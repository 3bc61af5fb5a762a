//! vMigrater guest daemon: the data path is monitor (vcpu-monitor) → detector
//! (task-detector) → planner → affinity executor, decided on the monitor thread of the
//! vCPU whose state changed (`hook`), wired together by `daemon`.
pub mod admission;
pub mod affinity;
pub mod channel;
pub mod check;
pub mod config;
pub mod daemon;
pub mod guard;
pub mod hook;
pub mod journal;
pub mod metrics;
pub mod planner;
pub mod sampling;
pub mod status;

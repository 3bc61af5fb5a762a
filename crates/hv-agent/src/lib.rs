//! `vmigrater-hv-agent`: the host half. Data path: guest channel (`guest`) → per-vCPU
//! reports → ISACS credit core (`sched-core`) per host run queue (`weights`) → backend
//! (`backend`: kvm-qemu vCPU threads, xen credit2 weights, dry-run), every period
//! (`agent`). vCPU threads come from QMP `query-cpus-fast` (`qmp`) or the config.
//!
//! ISACS mapped onto Linux: IVCredit buys *latency*, never share — an I/O-intensive vCPU
//! thread gets a short EEVDF slice (`sched_setattr` runtime, 6.12+), so it runs soon after
//! it wakes; its CFS weight stays put, like concealed credit. CVCredit buys share: a
//! CPU-BOOST vCPU's weight rises, the run queue's total weight stays constant. So a guest
//! that lies about its I/O gains no CPU at all.

pub mod agent;
pub mod backend;
pub mod cgroup;
pub mod config;
pub mod discovery;
pub mod guest;
pub mod metrics;
pub mod observe;
pub mod placement;
pub mod qmp;
pub mod status;
pub mod weights;

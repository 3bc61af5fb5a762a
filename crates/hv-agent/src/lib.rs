//! `vmigrater-hv-agent`: the host half. Data path: guest channel (`guest`) → per-vCPU
//! reports (or host-side wake-ups, `observe`) → ISACS credit core (`sched-core`) per host
//! run queue (`weights`) and Algorithm 2 (`placement`) → backend (`backend`: kvm-qemu vCPU
//! threads with nice or `cgroup` weights, xen credit2 weights, the testbed's BPF host
//! scheduler model (`model`), dry-run), every period (`agent`), published as a snapshot
//! (`status`, `metrics`). VMs and their vCPU threads come from the config, libvirt and
//! QEMU's thread names (`discovery`), or QMP (`qmp`).
//!
//! ISACS mapped onto Linux: IVCredit buys no share — an I/O-intensive vCPU thread's CFS
//! weight stays put, like concealed credit. CVCredit buys share: a CPU-BOOST vCPU's weight
//! rises, the run queue's total weight stays constant (`isacs`); or a VM's I/O vCPUs gain
//! weight its other vCPUs give up (`vm-funded`, the default). So a guest that lies about
//! its I/O gains no CPU at all.

pub mod agent;
pub mod backend;
pub mod cgroup;
pub mod config;
pub mod discovery;
pub mod guest;
pub mod journal;
pub mod metrics;
pub mod model;
pub mod observe;
pub mod placement;
pub mod status;
pub mod weights;

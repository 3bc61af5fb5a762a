//! The migration engine of the guest daemon: which I/O-bound tasks to manage
//! (`admission`), where each goes (`planner`), whether moves pay (`guard`), when the block
//! programs track (`sampling`), and the affinity executor with its crash-safe journal of
//! original masks. The detector loop's policy is one unit-tested step (`engine`: observe →
//! decide → act → publish); moves themselves are decided on the monitor thread of the vCPU
//! whose state changed (`hook`); while the host agent favours vCPUs, tasks are anchored on
//! those instead (`anchor`). `live` is the placement the engine acts on in the daemon. The `vmigrater` crate wires it to the monitor, the detector,
//! the host channel and the control plane.
pub mod admission;
pub mod affinity;
pub mod anchor;
pub mod completion;
pub mod engine;
pub mod guard;
pub mod hook;
pub mod journal;
pub mod live;
pub mod planner;
pub mod sampling;

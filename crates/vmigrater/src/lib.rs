//! `vmigrater`, the guest daemon: wires monitor (vcpu-monitor) → detector
//! (task-detector) → migration engine (migrater) → host channel (`channel`), with the
//! control plane (status socket, /metrics), configuration and `check`.
pub mod channel;
pub mod check;
pub mod config;
pub mod daemon;
pub mod detect;
pub mod explain;
pub mod instance;
pub mod metrics;
pub mod record;
pub mod recovery;
pub mod settings;
pub mod status;
pub mod view;

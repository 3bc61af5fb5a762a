//! One daemon per machine: two would fight over the same tasks' masks (each would see the
//! other's change as an administrator's and give up). Owns the instance lock; it must never
//! wait for the lock, only refuse to start.

use anyhow::{Context, Result};
use std::path::Path;

const INSTANCE_LOCK: &str = "/run/lock/vmigrater.lock";

/// Held for the daemon's lifetime; the kernel drops it however the process ends.
pub type InstanceLock = nix::fcntl::Flock<std::fs::File>;

pub fn lock() -> Result<InstanceLock> {
    let path = Path::new(INSTANCE_LOCK);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {INSTANCE_LOCK}"))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
        anyhow::anyhow!(
            "another vmigrater is already running on this machine ({INSTANCE_LOCK} is locked: {e})"
        )
    })
}

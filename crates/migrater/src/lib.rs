//! vMigrater guest daemon library.
pub mod affinity;
pub mod journal;
pub mod planner;

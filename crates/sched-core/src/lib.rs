//! ISACS (I/O strength-aware credit scheduler) as a pure, deterministic library: the
//! host agent feeds it per-vCPU I/O figures and consumed credit, and it returns the
//! credits, the CPU-BOOST group and I/O load-balancing moves. No clocks, no I/O, no
//! randomness, so every figure can be checked against the paper's equations.
//!
//! Credits are in nanoseconds of pCPU time, like Credit2's.
//! - `ema`: Eq. 1, the EMA of I/O event intervals.
//! - `credit`: Eq. 2–4 and the reallocation of Algorithm 1 (lines 13–27).
//! - `runqueue`: Algorithm 1's scheduling with the CPU-BOOST state and credit concealing,
//!   as a simulator the agent and the tests can drive.
//! - `balance`: Algorithm 2, I/O load balancing between run queues.

pub mod balance;
pub mod credit;
pub mod ema;
pub mod runqueue;

pub use balance::{balance_io_load, Migration, RunQueueLoad};
pub use credit::{reallocate, Allocation, CreditParams, VcpuCredit, VcpuInput};
pub use ema::IoEventEma;
pub use runqueue::{RunQueue, Scheduled};

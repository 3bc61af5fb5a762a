//! Hypervisor-like deschedules on the machine itself: takes CPUs away from this kernel in
//! hard-IRQ context, on a planned schedule, so that nothing runs on a CPU during a window
//! (no task, no device interrupt, no IPI), as when a host runs another vCPU.
//!
//! - `plan`: the one representation of a schedule (per-CPU windows) and its safety bounds;
//! - `schedule`: the named schedule families, their text form, and their plans;
//! - `kernel`: the run itself (bpf/irqsteal.bpf.c on per-CPU perf clock events), stopped
//!   when the machine stops answering (no normal task ran for `ANSWER_WITHIN`);
//! - `absorber`: who is charged a window's time (the task interrupted, or nobody);
//! - `throttle`: perf throttling off for the run, restored whatever happens;
//! - `report`: what each CPU stole against what it was asked;
//! - `host`: a host scheduler in the loop instead of a plan (bpf/hostmodel.bpf.c): a fair
//!   or credit policy decides online, an idle vCPU gives its CPU away, weights can change.
//!
//! The plan is the truth a benchmark's oracle reads (`Plan::is_out`, `next_change`),
//! relative to `IrqSteal::start_ns`.

pub mod absorber;
mod bpf_skel;
mod controlled;
pub mod host;
pub mod kernel;
mod no_idle;
pub mod plan;
pub mod report;
pub mod schedule;
pub mod throttle;

pub use absorber::Accounting;
pub use controlled::ANSWER_WITHIN;
pub use kernel::{IrqSteal, SAMPLE_PERIOD_NS};
pub use plan::{
    CpuPlan, Plan, Window, MAX_ALL_OUT_PERCENT, MAX_OUT_PERCENT, MAX_SHORT_OUT_PERCENT,
    MAX_WINDOWS_PER_CPU, MAX_WINDOW_NS, SHORT_STRETCH_NS,
};
pub use report::{CpuSteal, StealReport};
pub use schedule::{Dist, Schedule};
pub use throttle::{read_perf_cpu_time_max_percent, PERF_CPU_TIME_MAX_PERCENT};

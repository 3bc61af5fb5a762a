/* Shared between bpf/irqsteal.bpf.c and testbeds/irq-steal/src/kernel.rs: the per-CPU plan
 * state and counters in .bss, and one window of the `windows` array map. */
#ifndef VMIGRATER_IRQSTEAL_H
#define VMIGRATER_IRQSTEAL_H

#define IS_MAX_CPUS 1024
/* Windows per planned CPU: CPU slot s owns keys [s * IS_MAX_WINDOWS, (s + 1) * IS_MAX_WINDOWS). */
#define IS_MAX_WINDOWS 16384
/* The longest one invocation may spin, and so the longest window a plan may hold. */
#define IS_MAX_SPIN_NS 50000000ULL
/* Stealing stops when user space has not refreshed the heartbeat for this long. */
#define IS_HEARTBEAT_MAX_NS 100000000ULL
/* With an absorber, how long past its start a window waits for the absorber to be the task
 * running: two sample periods. A timer that wakes the absorber and the sample that enters
 * the window can fire in the same interrupt (a late host timer coalesces them), and the
 * absorber can only run once that interrupt returns. */
#define IS_ABSORBER_WAIT_NS 500000ULL

/* One window, ns relative to the run's start (`start_ns`). */
struct steal_window {
	__u64 start_ns;
	__u64 end_ns;
};

/* One CPU, written only by the program on that CPU (after user space set the plan part
 * before attaching), read by user space. */
struct steal_cpu {
	__u32 slot;           /* plan: its windows' slot in `windows` */
	__u32 nwindows;       /* plan: its number of windows (0: never steal here) */
	__u32 cursor;         /* first window that has not ended at the last sample */
	__u32 hit;            /* the window at `cursor` has been entered */
	__u64 samples;        /* program invocations on this CPU */
	__u64 stolen_ns;      /* time spent spinning with interrupts off */
	__u64 windows_hit;    /* windows entered at least once */
	__u64 windows_missed; /* windows that ended between two samples, never entered */
	__u64 late_ns;        /* sum over entered windows of (first sample inside - window start) */
	__u64 watchdog_skips; /* samples inside the run that found the heartbeat stale */
	__u64 last_sample_ns; /* CLOCK_MONOTONIC of the last invocation */
	__u64 absorbed_ns;    /* stolen_ns spun while the CPU's absorber was the task interrupted */
	__u32 absorber_tid;   /* plan: the CPU's absorber thread (0: none) */
	__u32 _pad;
};

#endif

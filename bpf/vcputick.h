/* Shared between bpf/vcputick.bpf.c and crates/vcpu-monitor/src/kernel.rs: the per-vCPU
 * state user space reads from the mmapped .bss and the gap event of the ring buffer. */
#ifndef VMIGRATER_VCPUTICK_H
#define VMIGRATER_VCPUTICK_H

#define VT_MAX_CPUS 1024
/* vCPUs compared at each deschedule (the loop's bound; larger VMs compare the first). */
#define VT_COVER_CPUS 256

/* One vCPU, written only on that vCPU (timer interrupt or idle path), read by anyone.
 * Times are CLOCK_MONOTONIC ns (bpf_ktime_get_ns). */
struct vcpu_tick {
	__u64 last_seen;      /* last sign of life: an on-time timer, idle entry or exit */
	__u64 slice_start;    /* when it came back from its last deschedule */
	__u64 last_slice_ns;  /* length of the run that the last deschedule ended */
	__u64 last_gap_ns;    /* length of the last deschedule */
	__u64 gaps;           /* deschedules seen */
	__u64 inactive_ns;    /* total time seen descheduled */
	__u64 tick_ns;        /* decaying maximum of the on-time intervals: the tick period */
	__u64 timers;         /* timer expiries seen */
	__u32 idle;           /* in the idle loop (halted: no tick, nothing to run) */
	__u32 pad;
	__u64 covered_ns;     /* part of inactive_ns during which another vCPU was seen running:
	                       * what a move could have gained (0 when all are out at once) */
	__u64 last_slice_err_ns; /* how far the last deschedule's start (the end of
	                          * last_slice_ns) may be off: half the time between the last
	                          * sign of life and the late timer's due time */
	__u64 heartbeats;     /* heartbeat timer firings */
	__u32 hb_armed;       /* the heartbeat timer is pending */
	__u32 pad2;
	__u64 hb_due;         /* when it is due, if pending */
};

/* Sent when a vCPU comes back from a deschedule, while user space asks for events. */
struct gap_event {
	__u64 ts;             /* when the vCPU was seen again */
	__u64 inactive_ns;    /* how long it was out */
	__u64 last_slice_ns;  /* the run before the gap (0: unknown) */
	__u32 cpu;
	__u32 pad;
};

#endif

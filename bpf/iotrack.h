/* Shared between bpf/iotrack.bpf.c and crates/task-detector: map sizes and the layouts
 * of the map values user space reads (the Rust side uses the skeleton's generated types,
 * so only the meaning has to stay in sync with task-detector/src/tracker.rs). */
#ifndef VMIGRATER_IOTRACK_H
#define VMIGRATER_IOTRACK_H

#define MAX_CPUS 1024
#define MAX_THREADS 8192
#define MAX_INFLIGHT 16384
/* ISACS Eq. 1: intervals longer than this are not I/O-intensive and reset t_e. */
#define EMA_MAX_INTERVAL_NS 10000000ULL
/* A thread with requests "in flight" but no start, requeue or completion of its own for
 * this long lost their ends (LRU eviction of the in-flight entry, a path without a
 * tracepoint, a program run the kernel skipped): its in-flight count is reset at its
 * next request. Real block requests on a guest disk finish in ms; 5 s is far beyond any
 * timeout-free completion. */
#define INFLIGHT_STALE_NS 5000000000ULL
/* A thread whose last request is older than this (longer than the sampling period, so a
 * task found in the last sample does not ring) rings the doorbell while tracking pauses. */
#define DOORBELL_QUIET_NS 5000000000ULL
/* A thread with fewer tracked requests than this rings too: one that a sample saw start
 * but could not yet judge (a database backend whose first requests wait on its client)
 * is looked at again at once rather than a period later. Bounded: the count only grows. */
#define DOORBELL_YOUNG_IOS 64

/* Per thread (key: tid). Cumulative since the thread's first I/O. */
struct thread_stats {
	__u64 ios;
	__u64 bytes;       /* completed, counted at the end (requests grow after start) */
	__u64 busy_ns;     /* time with >= 1 request in flight, closed intervals only */
	__u64 busy_since;  /* start of the open interval when in_flight > 0 */
	__u64 last_ts;     /* last start, requeue or completion of this thread's requests */
	__u32 in_flight;
	__u32 last_cpu;    /* CPU the thread submitted from last */
	__u32 tgid;
	__u32 stale_resets; /* times in_flight was reset because its ends were lost */
	/* Where this thread's requests complete: the vCPU whose interrupt handled the last
	 * one, how many completed in all, and how many on another vCPU than the one that
	 * submitted them (a fixed-interrupt queue: the submitter needs that vCPU to run too). */
	__u32 done_cpu;
	__u32 _pad;
	__u64 done;
	__u64 done_remote;
};

/* Per CPU (index: the CPU that handled the completion: the vCPU that got the response). */
struct cpu_stats {
	__u64 completions;
	__u64 last_ts;         /* t_e of ISACS Eq. 1 */
	__u64 ema_interval_ns; /* mean I_e, EMA with 0.9 on the newest interval */
};

/* Where a request is in its life: which hook may open it and which merely moves it on. */
enum rq_state {
	RQ_STARTED = 1,  /* block_io_start (6.5+): accounted once, ends at block_io_done */
	RQ_INSERTED = 2, /* block_rq_insert (pre-6.5 path): submitter known, not yet issued */
	RQ_ISSUED = 3,   /* block_rq_issue (pre-6.5 path) */
	RQ_REQUEUED = 4, /* block_rq_requeue: back to the queue, its re-issue is not a new I/O */
};

/* A request in flight (key: request pointer, or dev+sector in classic tracepoint mode). */
struct inflight {
	__u32 tid;
	__u32 state;
	__u64 start;
	__u64 cookie; /* the request's first bio: tells a re-issue from a reuse of the slot */
	__u32 cpu;    /* the vCPU that submitted it */
	__u32 _pad;
};

/* Wake-ups between two user threads while tracking, one of which issued block I/O (key:
 * waker, wakee): a database backend and its client across a socket wake each other for
 * every request. User space reads and empties the map each poll. */
#define MAX_WAKE_PAIRS 4096

struct wake_pair {
	__u32 waker;
	__u32 wakee;
};

struct wake_stats {
	__u64 wakes;
	__u32 waker_tgid;
	__u32 wakee_tgid;
};

/* Children born with fewer CPUs than the machine has, keyed by the child's tid. */
#define MAX_FORKS 1024

struct fork_seen {
	__u32 parent;       /* the thread that forked (its tid) */
	__u32 child_tgid;
	__u64 mask;         /* the child's allowed CPUs 0-63 at birth */
};

#endif

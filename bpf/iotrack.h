/* Shared between bpf/iotrack.bpf.c and crates/task-detector: the layouts of the map
 * values user space reads. Keep in sync with task-detector/src/tracker.rs. */
#ifndef VMIGRATER_IOTRACK_H
#define VMIGRATER_IOTRACK_H

#define MAX_CPUS 1024
#define MAX_THREADS 8192
#define MAX_INFLIGHT 16384
/* ISACS Eq. 1: intervals longer than this are not I/O-intensive and reset t_e. */
#define EMA_MAX_INTERVAL_NS 10000000ULL

/* Per thread (key: tid). Cumulative since the thread's first I/O. */
struct thread_stats {
	__u64 ios;
	__u64 bytes;
	__u64 busy_ns;     /* time with >= 1 request in flight, closed intervals only */
	__u64 busy_since;  /* start of the open interval when in_flight > 0 */
	__u64 last_ts;     /* last start or completion */
	__u32 in_flight;
	__u32 last_cpu;    /* CPU the thread submitted from last */
	__u32 tgid;
	__u32 _pad;
};

/* Per CPU (index: the CPU that handled the completion). */
struct cpu_stats {
	__u64 completions;
	__u64 last_ts;
	__u64 ema_interval_ns;
};

/* A request in flight (key: request pointer, or dev+sector in tracepoint mode). */
struct inflight {
	__u32 tid;
	__u32 _pad;
	__u64 start;
};

#endif

// SPDX-License-Identifier: GPL-2.0
/* Block I/O accounting per thread and per CPU for vmigrater's task detector.
 *
 * Owns: the per-thread counters (requests, bytes, time with >= 1 request in flight), the
 * per-CPU completion counters with the ISACS Eq. 1 interval EMA, and the table of
 * requests in flight that maps a request back to the thread that submitted it; while
 * tracking, the wake-ups between those threads and other user threads (their partners).
 * Must never: wake user space per I/O (no ring buffer, no perf events: aggregating in
 * maps costs a request an order of magnitude less than a record with its wake-up), count
 * kernel threads as submitters, or let a lost completion keep a thread "in flight".
 *
 * Request life and the hooks that see it:
 *  - 6.5+: block_io_start runs in the submitter's context once per request (also after
 *    splits, before any requeue). Before 6.5: block_rq_insert (submitter context,
 *    scheduler path) or block_rq_issue (direct issue: also submitter context; a kworker
 *    dispatch of an inserted request is recognised by the entry already present).
 *  - block_rq_complete with all remaining bytes ends it, in completion context where
 *    `current` is whoever was interrupted. Not block_io_done: it only fires when the
 *    request needs a time stamp (iostats on or an I/O scheduler), so with
 *    `queue/iostats=0` and scheduler `none` every request would look endless.
 *  - block_rq_requeue sends a started request back to the queue: its re-issue is not a
 *    new I/O and the time in between stays busy.
 *  - block_rq_merge: a queued request merged into another is freed without an end of
 *    its own; close it there.
 * tp_btf and raw_tp key requests by pointer (request structs are reused from tag pools,
 * so a reused key whose end was missed is closed on reuse). Classic tracepoints carry no
 * pointer: they key by dev+sector, which is less precise (merges and partial completions
 * do not match; two requests on one sector collide).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "iotrack.h"

char LICENSE[] SEC("license") = "GPL";

#define PF_KTHREAD 0x00200000

/* Sampled tracking: user space sets this between samples, and every hook returns at once.
 * A flag, not a detach: attaching or detaching a tracepoint program patches kernel text
 * (static keys, with IPIs that wait for every vCPU), which on an overcommitted VM means
 * spinning until descheduled vCPUs run again; an early return costs a few instructions. */
volatile __u32 paused;

/* Rung while paused by a user thread's request when that thread did no block I/O in the
 * last DOORBELL_QUIET_NS, or has fewer than DOORBELL_YOUNG_IOS tracked requests (or none):
 * a task that may have just become I/O-bound, so user space samples now instead of at the
 * next period. Set once, cleared by user space: a paused request pays one flag read, or
 * until the first ring a compare (`passes`; a hash lookup where its CPU's last passing
 * thread was another). */
volatile __u32 doorbell;
/* Set by block_io_start's first run (Linux 6.5+): every request then passes it first, so
 * the insert and issue hooks of a paused request need not look at the doorbell again. */
volatile __u32 io_start_seen;
/* The CPUs the machine has (set by user space at load; 0: forks are not watched). */
volatile __u32 all_cpus;

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_THREADS);
	__type(key, __u32);
	__type(value, struct thread_stats);
} threads SEC(".maps");

/* LRU: an entry whose end we never see is evicted under pressure instead of filling the
 * map; the owning thread's count is then repaired by the INFLIGHT_STALE_NS reset. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_INFLIGHT);
	__type(key, __u64);
	__type(value, struct inflight);
} inflight SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CPUS);
	__type(key, __u32);
	__type(value, struct cpu_stats);
} cpus SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_WAKE_PAIRS);
	__type(key, struct wake_pair);
	__type(value, struct wake_stats);
} wakes SEC(".maps");

/* Per CPU: the thread whose paused request last passed the doorbell's check and until
 * when it passes (its last tracked event + DOORBELL_QUIET_NS). A steady I/O thread's
 * next requests then pay a compare instead of a hash lookup: on a fast disk (a loop
 * device over memory, ~4 us a read) the lookups of programs that otherwise return at
 * once cost ~5% of the reads. A per-CPU map, not a global array indexed by the CPU
 * number: with such an array the lab's Linux 6.1 guest counted no completion at all (its
 * verifier's log was not kept; the host's 6.18 took the programs). */
struct doorbell_pass {
	__u32 tid;
	__u32 _pad;
	__u64 until;
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct doorbell_pass);
} passes SEC(".maps");

/* Every thread born with fewer CPUs allowed than `all_cpus`: Linux copies a parent's mask
 * to its children, so a task the daemon pinned passes the pin on to every thread or
 * process it starts. User space sets back the ones it caused. LRU: never full. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_FORKS);
	__type(key, __u32);
	__type(value, struct fork_seen);
} forks SEC(".maps");

/* One of `tid`'s requests ended at `now`; `bytes` of it were transferred. `now == 0`
 * says its end was lost (found only when its key came back): the request is closed at the
 * owner's last seen event, as the stale reset does, because charging the time up to the
 * key's reuse would count seconds of idleness as busy. */
static __always_inline void thread_done(__u32 tid, __u64 now, __u32 bytes)
{
	struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
	if (!s)
		return;
	if (bytes)
		__sync_fetch_and_add(&s->bytes, bytes);
	__u64 end = now ? now : s->last_ts;
	__s32 old = (__s32)__sync_fetch_and_add(&s->in_flight, -1);
	if (old == 1) {
		__u64 since = s->busy_since;
		if (end > since)
			__sync_fetch_and_add(&s->busy_ns, end - since);
	} else if (old <= 0) {
		/* An end whose start we never counted (attached mid-flight, stale reset): undo. */
		__sync_fetch_and_add(&s->in_flight, 1);
	}
	if (now)
		s->last_ts = now;
}

/* Opens a request for the current thread, or moves an already open one on. `kind` is the
 * hook (RQ_STARTED, RQ_INSERTED or RQ_ISSUED); `cookie` tells one life of a request slot
 * from the next (its first bio; 0 when unknown, in classic tracepoint mode). */
static __always_inline void ring_if_new(__u32 kind)
{
	if (doorbell)
		return;
	if (kind != RQ_STARTED && io_start_seen)
		return;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	if (tid == 0)
		return;
	__u64 now = bpf_ktime_get_ns();
	__u32 zero = 0;
	struct doorbell_pass *pass = bpf_map_lookup_elem(&passes, &zero);
	if (!pass)
		return;
	if (pass->tid == tid && now < pass->until)
		return;
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	if (BPF_CORE_READ(task, flags) & PF_KTHREAD)
		return;
	struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
	if (s && s->ios >= DOORBELL_YOUNG_IOS && now - s->last_ts < DOORBELL_QUIET_NS) {
		pass->tid = tid;
		pass->until = s->last_ts + DOORBELL_QUIET_NS;
		return;
	}
	doorbell = 1;
}

static __always_inline void begin(__u64 key, __u64 cookie, __u32 kind)
{
	if (kind == RQ_STARTED && !io_start_seen)
		io_start_seen = 1;
	if (paused) {
		ring_if_new(kind);
		return;
	}
	__u64 now = bpf_ktime_get_ns();
	struct inflight *fl = bpf_map_lookup_elem(&inflight, &key);
	if (fl) {
		if (kind != RQ_STARTED && (!cookie || fl->cookie == cookie)) {
			/* The same request moving on: a dispatch after insert (maybe from a
			 * kworker), a re-insert after requeue, a re-issue after the driver was
			 * busy (that path has no requeue tracepoint). Not a new I/O. */
			fl->state = kind;
			return;
		}
		/* The key came back while we still hold it: its end was missed. Close it, so
		 * the in-flight count of its owner cannot leak (0: at its last seen event). */
		__u32 owner = fl->tid;
		if (bpf_map_delete_elem(&inflight, &key) == 0)
			thread_done(owner, 0, 0);
	}

	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	if (BPF_CORE_READ(task, flags) & PF_KTHREAD)
		return; /* kernel threads are never candidates */
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	if (tid == 0)
		return;

	struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
	if (!s) {
		struct thread_stats init = { .tgid = id >> 32 };
		bpf_map_update_elem(&threads, &tid, &init, BPF_NOEXIST);
		s = bpf_map_lookup_elem(&threads, &tid);
		if (!s)
			return;
	}
	struct inflight nfl = { .tid = tid, .state = kind, .start = now, .cookie = cookie,
				.cpu = bpf_get_smp_processor_id() };
	/* NOEXIST: another CPU may have opened the same key meanwhile (dev+sector keys of
	 * two threads reading one sector); overwriting its entry would strand its count.
	 * Then this request is not tracked: never open what could not be closed. */
	if (bpf_map_update_elem(&inflight, &key, &nfl, BPF_NOEXIST))
		return;

	if (s->in_flight && now > s->last_ts && now - s->last_ts > INFLIGHT_STALE_NS) {
		/* Nothing of this thread moved for seconds while "in flight": its ends were
		 * lost. Close the busy interval at the last event we did see. */
		if (s->last_ts > s->busy_since)
			__sync_fetch_and_add(&s->busy_ns, s->last_ts - s->busy_since);
		s->in_flight = 0;
		s->stale_resets++;
	}
	if (__sync_fetch_and_add(&s->in_flight, 1) == 0)
		s->busy_since = now;
	__sync_fetch_and_add(&s->ios, 1);
	s->last_cpu = bpf_get_smp_processor_id();
	s->last_ts = now;
}

/* `bytes` of a request completed; `final` when nothing remains: count the response on
 * this CPU and close the request. Bytes are taken here, not at start: bios merged into a
 * request after block_io_start grow it. */
static __always_inline void end(__u64 key, __u32 bytes, bool final)
{
	if (paused)
		return;
	if (!final) {
		struct inflight *part = bpf_map_lookup_elem(&inflight, &key);
		if (part) {
			__u32 owner = part->tid;
			struct thread_stats *s = bpf_map_lookup_elem(&threads, &owner);
			if (s)
				__sync_fetch_and_add(&s->bytes, bytes);
		}
		return;
	}
	__u64 now = bpf_ktime_get_ns();
	__u32 cpu = bpf_get_smp_processor_id();
	struct cpu_stats *c = bpf_map_lookup_elem(&cpus, &cpu);
	if (c) {
		/* ISACS Eq. 1: EMA(0.9) of the interval between I/O response events on this
		 * vCPU; an interval over 10 ms is not counted and restarts t_e. */
		__u64 last = c->last_ts;
		if (last && now > last && now - last <= EMA_MAX_INTERVAL_NS) {
			__u64 iv = now - last;
			c->ema_interval_ns = c->ema_interval_ns ? (9 * iv + c->ema_interval_ns) / 10 : iv;
		}
		c->last_ts = now;
		__sync_fetch_and_add(&c->completions, 1);
	}
	struct inflight *fl = bpf_map_lookup_elem(&inflight, &key);
	if (!fl)
		return;
	__u32 tid = fl->tid;
	__u32 from = fl->cpu;
	/* Only the CPU whose delete succeeds closes it: a racing duplicate must not
	 * decrement the owner twice. */
	if (bpf_map_delete_elem(&inflight, &key) == 0) {
		thread_done(tid, now, bytes);
		struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
		if (s) {
			s->done_cpu = cpu;
			__sync_fetch_and_add(&s->done, 1);
			if (from != cpu)
				__sync_fetch_and_add(&s->done_remote, 1);
		}
	}
}

/* Back to the queue: still in flight for its owner, and its re-issue is not new I/O. */
static __always_inline void requeue(__u64 key)
{
	if (paused)
		return;
	struct inflight *fl = bpf_map_lookup_elem(&inflight, &key);
	if (!fl)
		return;
	fl->state = RQ_REQUEUED;
	__u32 tid = fl->tid;
	struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
	if (s)
		s->last_ts = bpf_ktime_get_ns();
}

/* Merged into another request and freed: no end of its own will come. Not a response
 * event, so the CPU counters stay. */
static __always_inline void merged(__u64 key)
{
	if (paused)
		return;
	struct inflight *fl = bpf_map_lookup_elem(&inflight, &key);
	if (!fl)
		return;
	__u32 tid = fl->tid;
	if (bpf_map_delete_elem(&inflight, &key) == 0)
		thread_done(tid, bpf_ktime_get_ns(), 0);
}

/* SCHED_NORMAL, SCHED_BATCH, SCHED_IDLE. */
static __always_inline bool fair(unsigned int policy)
{
	return policy == 0 || policy == 3 || policy == 5;
}

/* `current` wakes `p`: counted when both are user threads and one of them issued block I/O
 * (the map stays small). A wake-up from interrupt context counts the interrupted task as
 * the waker; user space takes as partners only threads that wake each other both ways. */
static __always_inline void woken(struct task_struct *p)
{
	if (paused)
		return;
	__u64 id = bpf_get_current_pid_tgid();
	__u32 waker = (__u32)id;
	__u32 wakee = BPF_CORE_READ(p, pid);
	if (waker == 0 || wakee == 0 || waker == wakee)
		return;
	struct task_struct *cur = (struct task_struct *)bpf_get_current_task();
	if ((BPF_CORE_READ(cur, flags) | BPF_CORE_READ(p, flags)) & PF_KTHREAD)
		return;
	/* Fair-class threads only: a real-time thread's timer that fires while the I/O thread
	 * runs charges the I/O thread as its waker, so two threads that never talk would
	 * look like partners (a testbed's absorber did), and a real-time thread is never ours
	 * to place beside another. */
	if (!fair(BPF_CORE_READ(cur, policy)) || !fair(BPF_CORE_READ(p, policy)))
		return;
	if (!bpf_map_lookup_elem(&threads, &waker) && !bpf_map_lookup_elem(&threads, &wakee))
		return;
	struct wake_pair key = { .waker = waker, .wakee = wakee };
	struct wake_stats *w = bpf_map_lookup_elem(&wakes, &key);
	if (w) {
		__sync_fetch_and_add(&w->wakes, 1);
		return;
	}
	struct wake_stats first = { .wakes = 1, .waker_tgid = id >> 32,
				    .wakee_tgid = BPF_CORE_READ(p, tgid) };
	bpf_map_update_elem(&wakes, &key, &first, BPF_NOEXIST);
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(btf_sched_wakeup, struct task_struct *p)
{
	woken(p);
	return 0;
}

SEC("raw_tp/sched_wakeup")
int BPF_PROG(raw_sched_wakeup, struct task_struct *p)
{
	woken(p);
	return 0;
}

/* `parent` started `child`. Not paused with the block hooks: a pin passed on between two
 * samples must be seen too. */
static __always_inline void forked(struct task_struct *parent, struct task_struct *child)
{
	__u32 n = all_cpus;
	if (!n || BPF_CORE_READ(child, nr_cpus_allowed) >= n)
		return;
	if (BPF_CORE_READ(child, flags) & PF_KTHREAD)
		return;
	__u32 tid = BPF_CORE_READ(child, pid);
	struct fork_seen f = {
		.parent = BPF_CORE_READ(parent, pid),
		.child_tgid = BPF_CORE_READ(child, tgid),
		.mask = BPF_CORE_READ(child, cpus_mask.bits[0]),
	};
	bpf_map_update_elem(&forks, &tid, &f, BPF_ANY);
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(btf_sched_process_fork, struct task_struct *parent, struct task_struct *child)
{
	forked(parent, child);
	return 0;
}

SEC("raw_tp/sched_process_fork")
int BPF_PROG(raw_sched_process_fork, struct task_struct *parent, struct task_struct *child)
{
	forked(parent, child);
	return 0;
}

/* ---- tp_btf: typed arguments, direct loads, cheapest. ---- */
SEC("tp_btf/block_io_start")
int BPF_PROG(btf_io_start, struct request *rq)
{
	begin((__u64)rq, (__u64)BPF_CORE_READ(rq, bio), RQ_STARTED);
	return 0;
}

SEC("tp_btf/block_rq_insert")
int BPF_PROG(btf_rq_insert, struct request *rq)
{
	begin((__u64)rq, (__u64)BPF_CORE_READ(rq, bio), RQ_INSERTED);
	return 0;
}

SEC("tp_btf/block_rq_issue")
int BPF_PROG(btf_rq_issue, struct request *rq)
{
	begin((__u64)rq, (__u64)BPF_CORE_READ(rq, bio), RQ_ISSUED);
	return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(btf_rq_complete, struct request *rq, blk_status_t error, unsigned int nr_bytes)
{
	/* A partial completion (the driver finishing a request piecewise) is not its end. */
	end((__u64)rq, nr_bytes, nr_bytes >= BPF_CORE_READ(rq, __data_len));
	return 0;
}

SEC("tp_btf/block_rq_requeue")
int BPF_PROG(btf_rq_requeue, struct request *rq)
{
	requeue((__u64)rq);
	return 0;
}

SEC("tp_btf/block_rq_merge")
int BPF_PROG(btf_rq_merge, struct request *rq)
{
	merged((__u64)rq);
	return 0;
}

/* ---- raw_tp: the same arguments, read through probe helpers. ---- */
SEC("raw_tp/block_io_start")
int BPF_PROG(raw_io_start, struct request *rq)
{
	begin((__u64)rq, (__u64)BPF_CORE_READ(rq, bio), RQ_STARTED);
	return 0;
}

SEC("raw_tp/block_rq_insert")
int BPF_PROG(raw_rq_insert, struct request *rq)
{
	begin((__u64)rq, (__u64)BPF_CORE_READ(rq, bio), RQ_INSERTED);
	return 0;
}

SEC("raw_tp/block_rq_issue")
int BPF_PROG(raw_rq_issue, struct request *rq)
{
	begin((__u64)rq, (__u64)BPF_CORE_READ(rq, bio), RQ_ISSUED);
	return 0;
}

SEC("raw_tp/block_rq_complete")
int BPF_PROG(raw_rq_complete, struct request *rq, blk_status_t error, unsigned int nr_bytes)
{
	/* A partial completion (the driver finishing a request piecewise) is not its end. */
	end((__u64)rq, nr_bytes, nr_bytes >= BPF_CORE_READ(rq, __data_len));
	return 0;
}

SEC("raw_tp/block_rq_requeue")
int BPF_PROG(raw_rq_requeue, struct request *rq)
{
	requeue((__u64)rq);
	return 0;
}

SEC("raw_tp/block_rq_merge")
int BPF_PROG(raw_rq_merge, struct request *rq)
{
	merged((__u64)rq);
	return 0;
}

/* ---- classic tracepoints: no request pointer, key by device and start sector. ----
 * block_rq_complete reports the start sector of the (fully) completed request, like the
 * start hooks. Fields are read with one constant-offset load each (the verifier refuses
 * arithmetic on the ctx pointer). */
static __always_inline __u64 sector_key(__u32 dev, __u64 sector)
{
	return ((__u64)dev << 44) ^ sector;
}

SEC("tracepoint/block/block_io_start")
int tp_io_start(struct trace_event_raw_block_rq *ctx)
{
	begin(sector_key(ctx->dev, ctx->sector), 0, RQ_STARTED);
	return 0;
}

SEC("tracepoint/block/block_rq_insert")
int tp_rq_insert(struct trace_event_raw_block_rq *ctx)
{
	begin(sector_key(ctx->dev, ctx->sector), 0, RQ_INSERTED);
	return 0;
}

SEC("tracepoint/block/block_rq_issue")
int tp_rq_issue(struct trace_event_raw_block_rq *ctx)
{
	begin(sector_key(ctx->dev, ctx->sector), 0, RQ_ISSUED);
	return 0;
}

SEC("tracepoint/block/block_rq_complete")
int tp_rq_complete(struct trace_event_raw_block_rq_completion *ctx)
{
	/* No remaining length here: a partial completion closes the request early; its
	 * later pieces carry a moved sector and match nothing. */
	end(sector_key(ctx->dev, ctx->sector), ctx->nr_sector << 9, true);
	return 0;
}

SEC("tracepoint/block/block_rq_requeue")
int tp_rq_requeue(struct trace_event_raw_block_rq_requeue *ctx)
{
	requeue(sector_key(ctx->dev, ctx->sector));
	return 0;
}

SEC("tracepoint/block/block_rq_merge")
int tp_rq_merge(struct trace_event_raw_block_rq *ctx)
{
	merged(sector_key(ctx->dev, ctx->sector));
	return 0;
}

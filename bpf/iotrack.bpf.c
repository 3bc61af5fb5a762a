// SPDX-License-Identifier: GPL-2.0
/* Block I/O accounting per thread and per CPU for vmigrater's task detector.
 *
 * A request is attributed to the thread that submitted it (block_io_start runs in the
 * submitter's context, 6.5+; block_rq_issue before that, less precise), keyed by request
 * pointer, and closed at block_io_done / block_rq_complete, which run in completion
 * context where `current` is someone else. Everything is aggregated in maps: nothing
 * wakes user space per I/O. Three flavours of the same logic (tp_btf, raw_tp, classic
 * tracepoint) let the loader fall back on kernels that lack one.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "iotrack.h"

char LICENSE[] SEC("license") = "GPL";

#define PF_KTHREAD 0x00200000

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_THREADS);
	__type(key, __u32);
	__type(value, struct thread_stats);
} threads SEC(".maps");

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

static __always_inline void thread_done(__u32 tid, __u64 now)
{
	struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
	if (!s)
		return;
	__s32 old = __sync_fetch_and_add(&s->in_flight, -1);
	if (old == 1) {
		__u64 since = s->busy_since;
		if (now > since)
			__sync_fetch_and_add(&s->busy_ns, now - since);
	} else if (old <= 0) {
		/* A completion we never saw start (attached mid-flight): undo. */
		__sync_fetch_and_add(&s->in_flight, 1);
	}
	s->last_ts = now;
}

static __always_inline void on_start(__u64 key, __u32 bytes)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	if (BPF_CORE_READ(task, flags) & PF_KTHREAD)
		return; /* kernel threads are never candidates */
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	if (tid == 0)
		return;
	__u64 now = bpf_ktime_get_ns();

	/* A request slot reused while we still hold it: its end was missed (requeue, error
	 * path); close it so in-flight counts cannot leak. */
	struct inflight *stale = bpf_map_lookup_elem(&inflight, &key);
	if (stale)
		thread_done(stale->tid, now);
	struct inflight fl = { .tid = tid, .start = now };
	bpf_map_update_elem(&inflight, &key, &fl, BPF_ANY);

	struct thread_stats *s = bpf_map_lookup_elem(&threads, &tid);
	if (!s) {
		struct thread_stats init = { .tgid = id >> 32 };
		bpf_map_update_elem(&threads, &tid, &init, BPF_NOEXIST);
		s = bpf_map_lookup_elem(&threads, &tid);
		if (!s)
			return;
	}
	if (__sync_fetch_and_add(&s->in_flight, 1) == 0)
		s->busy_since = now;
	__sync_fetch_and_add(&s->ios, 1);
	__sync_fetch_and_add(&s->bytes, bytes);
	s->last_cpu = bpf_get_smp_processor_id();
	s->last_ts = now;
}

static __always_inline void on_done(__u64 key)
{
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
		c->completions++;
	}
	struct inflight *fl = bpf_map_lookup_elem(&inflight, &key);
	if (!fl)
		return;
	__u32 tid = fl->tid;
	bpf_map_delete_elem(&inflight, &key);
	thread_done(tid, now);
}

/* tp_btf: typed arguments, cheapest. */
SEC("tp_btf/block_io_start")
int BPF_PROG(btf_io_start, struct request *rq)
{
	on_start((__u64)rq, BPF_CORE_READ(rq, __data_len));
	return 0;
}

SEC("tp_btf/block_io_done")
int BPF_PROG(btf_io_done, struct request *rq)
{
	on_done((__u64)rq);
	return 0;
}

SEC("tp_btf/block_rq_issue")
int BPF_PROG(btf_rq_issue, struct request *rq)
{
	on_start((__u64)rq, BPF_CORE_READ(rq, __data_len));
	return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(btf_rq_complete, struct request *rq, blk_status_t error, unsigned int nr_bytes)
{
	on_done((__u64)rq);
	return 0;
}

/* raw_tp: same arguments, read through probe helpers. */
SEC("raw_tp/block_io_start")
int BPF_PROG(raw_io_start, struct request *rq)
{
	on_start((__u64)rq, BPF_CORE_READ(rq, __data_len));
	return 0;
}

SEC("raw_tp/block_io_done")
int BPF_PROG(raw_io_done, struct request *rq)
{
	on_done((__u64)rq);
	return 0;
}

SEC("raw_tp/block_rq_issue")
int BPF_PROG(raw_rq_issue, struct request *rq)
{
	on_start((__u64)rq, BPF_CORE_READ(rq, __data_len));
	return 0;
}

SEC("raw_tp/block_rq_complete")
int BPF_PROG(raw_rq_complete, struct request *rq)
{
	on_done((__u64)rq);
	return 0;
}

/* Classic tracepoints carry no request pointer: key by device and start sector, taken
 * at issue (block_io_done sees the sector already advanced). Less precise: the issuing
 * thread is not always the submitter. */
static __always_inline __u64 sector_key(__u32 dev, __u64 sector)
{
	return ((__u64)dev << 44) ^ sector;
}

SEC("tracepoint/block/block_rq_issue")
int tp_rq_issue(struct trace_event_raw_block_rq *ctx)
{
	on_start(sector_key(ctx->dev, ctx->sector), ctx->bytes);
	return 0;
}

SEC("tracepoint/block/block_rq_complete")
int tp_rq_complete(struct trace_event_raw_block_rq_completion *ctx)
{
	on_done(sector_key(ctx->dev, ctx->sector));
	return 0;
}

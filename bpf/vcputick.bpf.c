// SPDX-License-Identifier: GPL-2.0
/* vCPU deschedule detection from timers the guest kernel fires anyway (vmigrater's
 * "kernel" monitor source).
 *
 * A timer interrupt cannot be delivered to a vCPU that the hypervisor has descheduled; it
 * fires when the vCPU runs again, late by about the time it was out. Every busy vCPU
 * already takes the scheduler tick (HZ per second) and every idle one wakes for its next
 * timer, so watching hrtimer expiries measures the hypervisor's slices for free: no
 * sleeper, no extra interrupt, no context switch. User space reads the per-vCPU state
 * from the mmapped .bss without a syscall and is woken only when a vCPU comes back from
 * a deschedule, and only while it asks for that (I/O-bound tasks exist).
 *
 * Owns: the per-vCPU state in `vcpus` and the gap ring buffer. Must never: take a lock,
 * loop on a timer that fires on time (the one loop, over the vCPUs, runs once per
 * deschedule), or wake user space except for a deschedule while `emit_events` is set.
 *
 * The heartbeat (tp_btf only: the kernel refuses timers to raw tracepoint programs): a
 * BPF timer pinned to each vCPU fires every `hb_step_ns` from `hb_span_ns` before that
 * vCPU's expected slice end (its slice start + `hb_slice_ns`, written by user space) to
 * `hb_span_ns` after. Each firing is a sign of life like any timer's, so the start of the
 * next deschedule is known to within half a step instead of half a scheduler tick; and
 * a firing that comes late is itself the deschedule's detection. Armed only while events
 * are asked for, never on an idle vCPU, never where user space wrote 0.
 *
 * What it cannot see: a steal-time emulator inside the same kernel (its threads are
 * preempted by the timer interrupt, which therefore fires on time) — user space falls
 * back to sleepers there; and a vCPU in the idle loop with no timer pending (it is
 * flagged idle instead: halted, so free to take work).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "vcputick.h"

char LICENSE[] SEC("license") = "GPL";

#define PWR_EVENT_EXIT ((unsigned int)-1)
/* include/uapi/linux/time.h (not in vmlinux.h) */
#define CLOCK_MONOTONIC 1
/* Intervals longer than this are not ticks of a busy vCPU (idle, or a gap). */
#define TICK_MAX_NS 50000000ULL

/* A timer later than this, with no sign of life since its expiry, is a deschedule. */
const volatile __u64 gap_threshold_ns = 1000000;

struct vcpu_tick vcpus[VT_MAX_CPUS];
/* Set by user space while it wants a wake-up per deschedule. */
volatile __u32 emit_events;
/* Gaps shorter than this wake nobody: a host's own housekeeping (its I/O threads, an
 * interrupt) preempts a vCPU for a millisecond or two; a hypervisor slice is longer. */
const volatile __u64 event_min_gap_ns = 2000000;
/* Highest monitored CPU id + 1: the vCPUs a deschedule is compared with. */
const volatile __u32 nr_cpus = 0;
/* vCPUs that hold the tasks user space manages: their own return changes nothing for
 * those tasks (they were waiting there and simply run again), so it wakes nobody. */
volatile __u64 task_cpus[VT_MAX_CPUS / 64];
__u64 events_lost;
/* Per vCPU: the expected slice length the heartbeat brackets; 0 turns it off there. */
volatile __u64 hb_slice_ns[VT_MAX_CPUS];
const volatile __u64 hb_step_ns = 250000;
const volatile __u64 hb_span_ns = 2500000;

struct heartbeat {
	struct bpf_timer timer;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, VT_MAX_CPUS);
	__type(key, __u32);
	__type(value, struct heartbeat);
} heartbeats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} gaps SEC(".maps");

static __always_inline struct vcpu_tick *this_vcpu(__u32 *cpu)
{
	*cpu = bpf_get_smp_processor_id();
	if (*cpu >= VT_MAX_CPUS)
		return 0;
	return &vcpus[*cpu];
}

static __always_inline void seen(struct vcpu_tick *v, __u64 ts)
{
	__u64 interval = ts - v->last_seen;
	if (v->last_seen && !v->idle && interval < TICK_MAX_NS) {
		__u64 decayed = v->tick_ns - (v->tick_ns >> 6);
		v->tick_ns = interval > decayed ? interval : decayed;
	}
	v->last_seen = ts;
}

/* How much of [start, end), the deschedule `cpu` just came back from, some other vCPU is
 * known to have run: from `start` to its last sign of life, less its own last deschedule
 * where the two overlap. When the hypervisor takes all vCPUs at once this stays near 0
 * (the others' last signs of life precede `start` or end their own gap), and a move has
 * nowhere to go; user space gates moves on it. Runs once per deschedule, not per timer. */
static __always_inline __u64 covered_by_others(__u32 cpu, __u64 start, __u64 end)
{
	__u64 best = 0;
	for (__u32 i = 0; i < VT_COVER_CPUS; i++) {
		if (i >= nr_cpus)
			break;
		if (i == cpu)
			continue;
		struct vcpu_tick *o = &vcpus[i];
		__u64 seen = o->last_seen;
		if (seen <= start)
			continue;
		if (seen > end)
			seen = end;
		__u64 alive = seen - start;
		__u64 o_end = o->slice_start, o_gap = o->last_gap_ns;
		if (o->gaps && o_end > start && o_end - o_gap < seen) {
			__u64 lo = o_end - o_gap > start ? o_end - o_gap : start;
			__u64 hi = o_end < seen ? o_end : seen;
			__u64 overlap = hi - lo;
			alive = overlap < alive ? alive - overlap : 0;
		}
		if (alive > best)
			best = alive;
	}
	return best;
}

/* When the heartbeat of `v` (on `cpu`) should fire next, after `now`; 0: not in this
 * slice (off, idle, or its window is past). */
static __always_inline __u64 hb_next(__u32 cpu, struct vcpu_tick *v, __u64 now)
{
	__u64 want = hb_slice_ns[cpu & (VT_MAX_CPUS - 1)];
	if (!emit_events || !want || v->idle || !v->slice_start)
		return 0;
	__u64 end = v->slice_start + want;
	__u64 from = end > hb_span_ns ? end - hb_span_ns : 0;
	__u64 next = now + hb_step_ns;
	if (next < from)
		next = from;
	return next <= end + hb_span_ns ? next : 0;
}

static __always_inline void hb_start(struct heartbeat *h, struct vcpu_tick *v, __u64 at)
{
	if (!bpf_timer_start(&h->timer, at, BPF_F_TIMER_ABS | BPF_F_TIMER_CPU_PIN)) {
		v->hb_due = at;
		v->hb_armed = 1;
	}
}

static int hb_fire(void *map, __u32 *key, struct heartbeat *h)
{
	__u32 cpu = *key;
	if (cpu >= VT_MAX_CPUS)
		return 0;
	struct vcpu_tick *v = &vcpus[cpu];
	v->hb_armed = 0;
	v->heartbeats++;
	/* The expiry itself was a sign of life (or a deschedule's end) for on_expiry. */
	__u64 at = hb_next(cpu, v, bpf_ktime_get_ns());
	if (at)
		hb_start(h, v, at);
	return 0;
}

/* At a slice start: arms `cpu`'s heartbeat for this slice's end unless a firing is pending
 * (a late firing re-arms from its own callback). */
static __always_inline void hb_arm(__u32 cpu, struct vcpu_tick *v, __u64 now)
{
	if (v->hb_armed)
		return;
	__u64 at = hb_next(cpu, v, now);
	if (!at)
		return;
	struct heartbeat *h = bpf_map_lookup_elem(&heartbeats, &cpu);
	if (!h)
		return;
	/* -EBUSY once initialised: the timer and its callback stay. */
	bpf_timer_init(&h->timer, &heartbeats, CLOCK_MONOTONIC);
	if (bpf_timer_set_callback(&h->timer, hb_fire))
		return;
	hb_start(h, v, at);
}

/* One timer expiry: `pass_ns` is the clock the expiry pass read when it began
 * (CLOCK_MONOTONIC), `late` how far that is past the timer's expiry. */
static __always_inline int on_expiry(__u64 pass_ns, __s64 late, bool heartbeat)
{
	__u32 cpu;
	struct vcpu_tick *v = this_vcpu(&cpu);
	if (!v)
		return 0;
	__u64 ts = bpf_ktime_get_ns();
	v->timers++;
	if (pass_ns > ts)
		pass_ns = ts;
	__u64 expired = pass_ns - late;
	/* The last time the vCPU is known to have run: its last sign of life, or the start of
	 * this pass if that came later. */
	__u64 in_pass = pass_ns > v->last_seen ? pass_ns : v->last_seen;
	__u64 gap_start, err = 0;
	/* Several timers expire in one pass: only the first can be a gap, since the vCPU was
	 * seen at it. A timer that expired before the last sign of life was merely handled
	 * late (interrupts off), not missed by a descheduled vCPU. */
	if (v->last_seen && late > 0 && (__u64)late > gap_threshold_ns &&
	    expired >= v->last_seen) {
		/* Out from somewhere between the last sign of life and the expiry: the middle.
		 * A heartbeat due in between that has not fired bounds it sooner: hard timers
		 * (the tick) expire before soft ones (the heartbeat) when the vCPU is back, so
		 * the heartbeat's own late expiry comes second and finds the gap taken. */
		__u64 bound = expired;
		if (v->hb_armed && v->hb_due > v->last_seen && v->hb_due < bound)
			bound = v->hb_due;
		err = (bound - v->last_seen) / 2;
		gap_start = v->last_seen + err;
	} else if (v->last_seen && ts - in_pass > gap_threshold_ns) {
		/* On time for a pass that began long ago: the vCPU was last seen when the pass
		 * began or at an earlier callback of it, and was taken since. Counting this as a
		 * sign of life now would hide the late timers of the next pass. */
		gap_start = in_pass;
	} else {
		seen(v, ts);
		return 0;
	}
	__u64 gap = ts - gap_start;
	__u64 run = v->slice_start && gap_start > v->slice_start ? gap_start - v->slice_start : 0;
	__u64 covered = covered_by_others(cpu, gap_start, ts);
	v->last_gap_ns = gap;
	v->last_slice_ns = run;
	v->last_slice_err_ns = err;
	v->gaps++;
	v->inactive_ns += gap;
	v->covered_ns += covered < gap ? covered : gap;
	v->slice_start = ts;
	v->last_seen = ts;
	if (heartbeat)
		hb_arm(cpu, v, ts);
	if (emit_events && gap >= event_min_gap_ns &&
	    !(task_cpus[(cpu / 64) & (VT_MAX_CPUS / 64 - 1)] & (1ULL << (cpu % 64)))) {
		struct gap_event e = {
			.ts = ts,
			.inactive_ns = gap,
			.last_slice_ns = run,
			.cpu = cpu,
		};
		if (bpf_ringbuf_output(&gaps, &e, sizeof(e), 0))
			__sync_fetch_and_add(&events_lost, 1);
	}
	return 0;
}

/* `now` is the pass's clock in the timer's own base (REALTIME, BOOTTIME... carry an
 * offset from CLOCK_MONOTONIC). */
SEC("tp_btf/hrtimer_expire_entry")
int BPF_PROG(hb_hrtimer_expire_entry, struct hrtimer *timer, ktime_t *now)
{
	__s64 n = 0;
	bpf_probe_read_kernel(&n, sizeof(n), now);
	return on_expiry(n - timer->base->offset, n - timer->node.expires, true);
}

/* The same without the heartbeat, for kernels without BPF timers pinned to a CPU. */
SEC("tp_btf/hrtimer_expire_entry")
int BPF_PROG(btf_hrtimer_expire_entry, struct hrtimer *timer, ktime_t *now)
{
	__s64 n = 0;
	bpf_probe_read_kernel(&n, sizeof(n), now);
	return on_expiry(n - timer->base->offset, n - timer->node.expires, false);
}

SEC("raw_tp/hrtimer_expire_entry")
int BPF_PROG(raw_hrtimer_expire_entry, struct hrtimer *timer, ktime_t *now)
{
	__s64 n = 0, expires = 0, offset = 0;
	struct hrtimer_clock_base *base = 0;
	bpf_probe_read_kernel(&n, sizeof(n), now);
	bpf_probe_read_kernel(&expires, sizeof(expires), &timer->node.expires);
	bpf_probe_read_kernel(&base, sizeof(base), &timer->base);
	if (base)
		bpf_probe_read_kernel(&offset, sizeof(offset), &base->offset);
	return on_expiry(n - offset, n - expires, false);
}

static __always_inline int on_idle(unsigned int state)
{
	__u32 cpu;
	struct vcpu_tick *v = this_vcpu(&cpu);
	if (!v)
		return 0;
	__u64 ts = bpf_ktime_get_ns();
	v->idle = state != PWR_EVENT_EXIT;
	v->last_seen = ts;
	return 0;
}

SEC("tp_btf/cpu_idle")
int BPF_PROG(btf_cpu_idle, unsigned int state, unsigned int cpu_id)
{
	return on_idle(state);
}

SEC("raw_tp/cpu_idle")
int BPF_PROG(raw_cpu_idle, unsigned int state, unsigned int cpu_id)
{
	return on_idle(state);
}

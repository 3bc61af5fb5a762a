// SPDX-License-Identifier: GPL-2.0
/* A host scheduler in the loop (testbeds/irq-steal/src/host.rs).
 *
 * Each modelled CPU of this kernel is our guest's vCPU, sharing a host CPU with the vCPUs
 * of nslots - 1 other VMs that exist only here. A host scheduler policy decides online who
 * holds the CPU: while another VM holds it and our vCPU is runnable, the deciding hook
 * spins with interrupts off until our vCPU's turn (nothing of the guest runs, its device
 * interrupts wait), as in bpf/irqsteal.bpf.c; while our vCPU is halted (this kernel's idle
 * loop) the others run without anything spinning, and an interrupt wakes the vCPU, which
 * preempts the running VM or waits for its turn as the policy says.
 *
 * Hooks: a PERF_COUNT_SW_CPU_CLOCK sample per CPU (hard IRQ, every 250 µs while the CPU
 * is busy: slice ends), the cpu_idle tracepoint (halt and wake-up), irq_handler_entry
 * (a device interrupt on a halted vCPU wakes it, and is held while the vCPU is out).
 *
 * Policies:
 * - fair (KVM's host scheduler): lowest weighted vruntime runs for base_slice_ns; a woken
 *   vCPU is placed at most sleeper_credit_ns behind the run queue's minimum and preempts
 *   the running VM when it is more than wakeup_gran_ns (weighted) ahead of it.
 * - credit (Xen's credit1): credits refilled by weight every credit_period_ns and debited
 *   by running; BOOST > UNDER (credit left) > OVER, round robin within a priority,
 *   credit_slice_ns slices; a vCPU woken with credit left (or named by the agent's boost)
 *   gets BOOST until its next 10 ms tick and preempts anything not boosted.
 *
 * Owns the per-CPU model state (`cpus`, `entities`); reads `control` (weights, boost) that
 * user space writes. Must never: spin longer than HM_MAX_SPIN_NS in one invocation, or
 * take a CPU away while the heartbeat user space refreshes is older than
 * HM_HEARTBEAT_MAX_NS.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "hostmodel.h"

char LICENSE[] SEC("license") = "GPL";

const volatile __u64 base_slice_ns = 3000000;
const volatile __u64 wakeup_gran_ns = 1000000;
const volatile __u64 sleeper_credit_ns = 3000000;
const volatile __u64 credit_slice_ns = 30000000;
const volatile __u64 credit_tick_ns = 10000000;
const volatile __u64 credit_period_ns = 30000000;

struct hm_cpu cpus[HM_MAX_CPUS];
/* CLOCK_MONOTONIC of the model's t = 0; 0 while not started. */
volatile __u64 start_ns;
/* CLOCK_MONOTONIC of user space's last sign of life. */
volatile __u64 heartbeat_ns;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, HM_KEYS);
	__type(key, __u32);
	__type(value, struct hm_control);
} control SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, HM_KEYS);
	__type(key, __u32);
	__type(value, struct hm_entity);
} entities SEC(".maps");

#define PWR_EVENT_EXIT ((__u32)-1)

static __always_inline struct hm_cpu *cpu_of(__u32 cpu)
{
	return &cpus[cpu & (HM_MAX_CPUS - 1)];
}

static __always_inline __u32 key_of(__u32 cpu, __u32 slot)
{
	return (cpu & (HM_MAX_CPUS - 1)) * HM_MAX_SLOTS + (slot & (HM_MAX_SLOTS - 1));
}

static __always_inline struct hm_entity *ent(__u32 cpu, __u32 slot)
{
	__u32 key = key_of(cpu, slot);
	return bpf_map_lookup_elem(&entities, &key);
}

static __always_inline struct hm_control *ctl(__u32 cpu, __u32 slot)
{
	__u32 key = key_of(cpu, slot);
	return bpf_map_lookup_elem(&control, &key);
}

static __always_inline __u64 slice_ns(struct hm_cpu *c)
{
	return c->policy == HM_POLICY_CREDIT ? credit_slice_ns : base_slice_ns;
}

/* The other VMs' duty cycles run in phases spread over the period, slot by slot. */
static __always_inline __u64 duty_phase(struct hm_cpu *c, __u32 slot, __u64 t)
{
	__u64 offset = c->duty_period_ns * slot / (c->nslots ? c->nslots : 1);
	return (t + offset) % c->duty_period_ns;
}

static __always_inline int runnable(struct hm_cpu *c, __u32 slot, __u64 t)
{
	if (slot == HM_GUEST)
		return !c->halted;
	if (!c->duty_period_ns)
		return 1;
	return duty_phase(c, slot, t) < c->duty_on_ns;
}

/* The helpers below that loop over the slots are global functions with scalar arguments:
 * the verifier checks each once, not once per path of every caller. */

/* The first time after t that some other VM starts or stops computing. */
__noinline __u64 next_duty_change(__u32 cpu, __u64 t)
{
	struct hm_cpu *c = cpu_of(cpu);
	__u64 next = ~0ULL;
	if (!c->duty_period_ns)
		return next;
	for (__u32 s = 1; s < HM_MAX_SLOTS; s++) {
		if (s >= c->nslots)
			break;
		__u64 phase = duty_phase(c, s, t);
		__u64 at = phase < c->duty_on_ns ? t - phase + c->duty_on_ns
						 : t - phase + c->duty_period_ns;
		if (at < next)
			next = at;
	}
	return next;
}

/* [from, to) with `curr` holding the CPU. */
__noinline int account(__u32 cpu, __u64 from, __u64 to)
{
	struct hm_cpu *c = cpu_of(cpu);
	if (to <= from)
		return 0;
	__u64 dt = to - from;
	for (__u32 s = 0; s < HM_MAX_SLOTS; s++) {
		if (s >= c->nslots)
			break;
		struct hm_entity *e = ent(cpu, s);
		if (!e)
			continue;
		if (s == c->curr) {
			e->run_ns += dt;
			if (c->policy == HM_POLICY_CREDIT)
				e->credit -= dt;
			else
				e->vruntime += dt * HM_DEFAULT_WEIGHT / (e->weight ? e->weight : 1);
		} else if (runnable(c, s, from)) {
			e->wait_ns += dt;
		} else {
			e->halted_ns += dt;
		}
	}
	return 0;
}

/* The weights user space set, into effect; and the fair run queue's minimum vruntime. */
__noinline int refresh(__u32 cpu, __u64 t)
{
	struct hm_cpu *c = cpu_of(cpu);
	__s64 min = 0;
	int any = 0;
	for (__u32 s = 0; s < HM_MAX_SLOTS; s++) {
		if (s >= c->nslots)
			break;
		struct hm_entity *e = ent(cpu, s);
		struct hm_control *k = ctl(cpu, s);
		if (!e)
			continue;
		e->weight = k && k->weight ? k->weight : HM_DEFAULT_WEIGHT;
		if (runnable(c, s, t) && (!any || e->vruntime < min)) {
			min = e->vruntime;
			any = 1;
		}
	}
	if (any && min > c->min_vr)
		c->min_vr = min;
	return 0;
}

static __always_inline __u32 prio_of(struct hm_entity *e)
{
	return e->boosted ? 2 : e->credit > 0 ? 1 : 0;
}

__noinline __u32 pick(__u32 cpu, __u64 t)
{
	struct hm_cpu *c = cpu_of(cpu);
	__u32 best = HM_NONE, best_prio = 0;
	__s64 best_vr = 0;
	__u64 best_q = 0;
	for (__u32 s = 0; s < HM_MAX_SLOTS; s++) {
		if (s >= c->nslots)
			break;
		if (!runnable(c, s, t))
			continue;
		struct hm_entity *e = ent(cpu, s);
		if (!e)
			continue;
		if (c->policy == HM_POLICY_CREDIT) {
			__u32 p = prio_of(e);
			if (best == HM_NONE || p > best_prio ||
			    (p == best_prio && e->queued_ns < best_q)) {
				best = s;
				best_prio = p;
				best_q = e->queued_ns;
			}
		} else if (best == HM_NONE || e->vruntime < best_vr) {
			best = s;
			best_vr = e->vruntime;
		}
	}
	return best;
}

/* The running VM's turn ends at t (slice over, asleep, halted): the policy picks again. */
__noinline int resched(__u32 cpu, __u64 t)
{
	struct hm_cpu *c = cpu_of(cpu);
	if (c->curr != HM_NONE) {
		struct hm_entity *prev = ent(cpu, c->curr);
		if (prev)
			prev->queued_ns = t;
	}
	refresh(cpu, t);
	c->curr = pick(cpu, t);
	c->slice_end_ns = t + slice_ns(c);
	return 0;
}

/* Xen's accounting: each period every vCPU of the CPU gets its weight's part of one
 * period of credit, as many times as periods passed; a vCPU holding more than a slice's
 * worth (one that halted for long) keeps one slice. */
__noinline int refill(__u32 cpu, __u64 periods)
{
	struct hm_cpu *c = cpu_of(cpu);
	__u64 total = 0;
	for (__u32 s = 0; s < HM_MAX_SLOTS; s++) {
		if (s >= c->nslots)
			break;
		struct hm_entity *e = ent(cpu, s);
		if (e)
			total += e->weight ? e->weight : HM_DEFAULT_WEIGHT;
	}
	if (!total)
		return 0;
	__s64 cap = credit_slice_ns;
	for (__u32 s = 0; s < HM_MAX_SLOTS; s++) {
		if (s >= c->nslots)
			break;
		struct hm_entity *e = ent(cpu, s);
		if (!e)
			continue;
		__u64 w = e->weight ? e->weight : HM_DEFAULT_WEIGHT;
		e->credit += (__s64)(periods * credit_period_ns * w / total);
		if (e->credit > cap)
			e->credit = cap;
		if (e->credit < -cap)
			e->credit = -cap;
	}
	return 0;
}

/* Every boundary due at t: credit ticks and refills, the end of the running VM's turn. */
__noinline int boundaries(__u32 cpu, __u64 t)
{
	struct hm_cpu *c = cpu_of(cpu);
	if (c->policy == HM_POLICY_CREDIT) {
		if (t >= c->next_tick_ns) {
			if (c->curr != HM_NONE) {
				struct hm_entity *e = ent(cpu, c->curr);
				if (e)
					e->boosted = 0;
			}
			c->next_tick_ns = t - (t - c->next_tick_ns) % credit_tick_ns + credit_tick_ns;
		}
		if (t >= c->next_refill_ns) {
			__u64 n = (t - c->next_refill_ns) / credit_period_ns + 1;
			refill(cpu, n);
			c->next_refill_ns += n * credit_period_ns;
		}
	}
	if (c->curr == HM_NONE || t >= c->slice_end_ns || !runnable(c, c->curr, t))
		resched(cpu, t);
	return 0;
}

struct sim {
	__u32 cpu;
	__u32 until_guest;  /* stop when our vCPU gets the CPU */
	__u32 guest_picked;
	__u32 done;
	__u64 t;
	__u64 stop_at;
};

/* One segment: the boundaries due now, then time up to the next one. */
static long sim_step(__u32 i, void *data)
{
	struct sim *s = data;
	struct hm_cpu *c = cpu_of(s->cpu);
	__u64 t = s->t;
	boundaries(s->cpu, t);
	if (s->until_guest && c->curr == HM_GUEST) {
		s->guest_picked = 1;
		s->done = 1;
		return 1;
	}
	if (t >= s->stop_at) {
		s->done = 1;
		return 1;
	}
	__u64 end = s->stop_at;
	if (c->curr != HM_NONE && c->slice_end_ns < end)
		end = c->slice_end_ns;
	__u64 d = next_duty_change(s->cpu, t);
	if (d < end)
		end = d;
	if (c->policy == HM_POLICY_CREDIT) {
		if (c->next_tick_ns < end)
			end = c->next_tick_ns;
		if (c->next_refill_ns < end)
			end = c->next_refill_ns;
	}
	if (end <= t)
		end = t + 1;
	account(s->cpu, t, end);
	s->t = end;
	return 0;
}

static __always_inline struct sim simulate(struct hm_cpu *c, __u32 cpu, __u64 from,
					   __u64 stop_at, __u32 until_guest)
{
	struct sim s = { .cpu = cpu, .until_guest = until_guest, .t = from, .stop_at = stop_at };
	bpf_loop(HM_MAX_SEGMENTS, sim_step, &s, 0);
	if (!s.done) {
		account(cpu, s.t, stop_at);
		s.t = stop_at;
		c->lumped++;
	}
	return s;
}

/* Time up to now, as the model says it went. While our vCPU ran, it ran: its turn's end
 * is seen at the first hook past it. */
static __always_inline void advance(struct hm_cpu *c, __u32 cpu, __u64 now)
{
	if (now <= c->last_ns)
		return;
	if (c->curr == HM_GUEST && !c->halted) {
		account(cpu, c->last_ns, now);
		simulate(c, cpu, now, now, 0);
	} else {
		simulate(c, cpu, c->last_ns, now, 0);
	}
	c->last_ns = now;
}

struct spin_ctx {
	__u64 until;
	__u64 now;
};

static long spin(__u32 i, void *data)
{
	struct spin_ctx *s = data;
	s->now = bpf_ktime_get_ns();
	return s->now >= s->until;
}

static __always_inline void spin_until(struct hm_cpu *c, __u64 now, __u64 until)
{
	if (until > now + HM_MAX_SPIN_NS)
		until = now + HM_MAX_SPIN_NS;
	struct spin_ctx sp = { .until = until, .now = now };
	/* ~20 ns per iteration: the bound is far beyond HM_MAX_SPIN_NS. */
	bpf_loop(1 << 23, spin, &sp, 0);
	c->spun_ns += (sp.now < until ? sp.now : until) - now;
}

/* Our runnable vCPU does not hold the CPU at `now`: the policy runs the others until its
 * turn, the model accounts that ahead, and this hook holds the CPU until then. */
static __always_inline void go_out(struct hm_cpu *c, __u32 cpu, __u64 now)
{
	struct sim s = simulate(c, cpu, now, now + HM_MAX_SPIN_NS, 1);
	if (!s.guest_picked) {
		/* Its turn lies beyond one spin (a tiny weight): it runs from the cap on. */
		c->spin_cuts++;
		struct hm_entity *e = c->curr != HM_NONE ? ent(cpu, c->curr) : 0;
		if (e)
			e->queued_ns = s.t;
		c->curr = HM_GUEST;
		c->slice_end_ns = s.t + slice_ns(c);
	}
	c->last_ns = s.t;
	c->resume_ns = s.t;
	c->outs++;
	c->out_ns += s.t - now;
	spin_until(c, now, s.t);
}

static __always_inline void halt(struct hm_cpu *c, __u32 cpu, __u64 now)
{
	if (c->halted)
		return;
	advance(c, cpu, now);
	c->halted = 1;
	if (c->curr == HM_GUEST)
		resched(cpu, now);
}

static __always_inline void wake(struct hm_cpu *c, __u32 cpu, __u64 now)
{
	if (!c->halted)
		return;
	advance(c, cpu, now);
	c->halted = 0;
	refresh(cpu, now);
	struct hm_entity *g = ent(cpu, HM_GUEST);
	if (!g)
		return;
	g->wakeups++;
	g->queued_ns = now;
	struct hm_entity *cur = c->curr != HM_NONE ? ent(cpu, c->curr) : 0;
	int preempt;
	if (c->policy == HM_POLICY_CREDIT) {
		struct hm_control *k = ctl(cpu, HM_GUEST);
		if (g->credit > 0 || (k && k->boost))
			g->boosted = 1;
		preempt = !cur || (g->boosted && !cur->boosted);
	} else {
		__s64 placed = c->min_vr - (__s64)sleeper_credit_ns;
		if (g->vruntime < placed)
			g->vruntime = placed;
		__s64 gran = wakeup_gran_ns * HM_DEFAULT_WEIGHT / (g->weight ? g->weight : 1);
		preempt = !cur || cur->vruntime - g->vruntime > gran;
	}
	if (preempt) {
		if (cur)
			cur->queued_ns = now;
		c->curr = HM_GUEST;
		c->slice_end_ns = now + slice_ns(c);
		c->wake_preempts++;
		return;
	}
	c->wake_waits++;
	go_out(c, cpu, now);
	c->wake_wait_ns += c->resume_ns - now;
}

/* Whether the model runs on this CPU now; counts a stale heartbeat. */
static __always_inline int model_on(struct hm_cpu *c, __u64 now)
{
	if (!c->nslots)
		return 0;
	__u64 start = start_ns;
	if (!start || now < start)
		return 0;
	__u64 hb = heartbeat_ns;
	if (now > hb && now - hb > HM_HEARTBEAT_MAX_NS) {
		c->watchdog_skips++;
		return 0;
	}
	return 1;
}

/* The model of the CPU a hook runs on, and the time; NULL where the model is off. */
static __always_inline struct hm_cpu *hooked(__u32 *cpu, __u64 *now)
{
	*cpu = bpf_get_smp_processor_id();
	if (*cpu >= HM_MAX_CPUS)
		return 0;
	struct hm_cpu *c = cpu_of(*cpu);
	*now = bpf_ktime_get_ns();
	return model_on(c, *now) ? c : 0;
}

/* Inside another hook's decision, or while our vCPU is out: only hold the CPU. */
static __always_inline int held(struct hm_cpu *c, __u64 now)
{
	if (now < c->resume_ns) {
		spin_until(c, now, c->resume_ns);
		return 1;
	}
	return c->in_hook;
}

SEC("perf_event")
int tick(struct bpf_perf_event_data *ctx)
{
	__u32 cpu;
	__u64 now;
	struct hm_cpu *c = hooked(&cpu, &now);
	if (!c)
		return 0;
	c->samples++;
	if (held(c, now))
		return 0;
	c->in_hook = 1;
	advance(c, cpu, now);
	if (!c->halted && c->curr != HM_GUEST)
		go_out(c, cpu, now);
	c->in_hook = 0;
	return 0;
}

SEC("raw_tp/cpu_idle")
int idle(struct bpf_raw_tracepoint_args *ctx)
{
	__u32 state = (__u32)ctx->args[0];
	__u32 cpu;
	__u64 now;
	struct hm_cpu *c = hooked(&cpu, &now);
	if (!c || held(c, now))
		return 0;
	c->in_hook = 1;
	if (state == PWR_EVENT_EXIT)
		wake(c, cpu, now);
	else
		halt(c, cpu, now);
	c->in_hook = 0;
	return 0;
}

SEC("raw_tp/irq_handler_entry")
int irq(struct bpf_raw_tracepoint_args *ctx)
{
	__u32 cpu;
	__u64 now;
	struct hm_cpu *c = hooked(&cpu, &now);
	if (!c)
		return 0;
	if (now < c->resume_ns)
		c->irq_holds++;
	if (held(c, now) || !c->halted)
		return 0;
	c->in_hook = 1;
	wake(c, cpu, now);
	c->in_hook = 0;
	return 0;
}

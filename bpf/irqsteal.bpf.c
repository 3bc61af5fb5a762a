// SPDX-License-Identifier: GPL-2.0
/* Hypervisor-like deschedules on the machine itself (testbeds/irq-steal).
 *
 * Attached to one PERF_COUNT_SW_CPU_CLOCK event per planned CPU, this program runs in
 * hard-IRQ context on that CPU every sample period. When the CPU's plan says it is inside
 * a window, it spins with interrupts off until the window's end: nothing runs on the CPU
 * meanwhile (no task, no device completion, no IPI), which is what a guest sees while its
 * host runs another vCPU.
 *
 * Owns: the per-CPU cursor and counters in `cpus`. Must never: spin past a window's end,
 * spin longer than IS_MAX_SPIN_NS in one invocation, or steal while the heartbeat that
 * user space refreshes is older than IS_HEARTBEAT_MAX_NS (a hung, stopped or dead
 * controller gives every CPU back within that time, whatever its plan says).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "irqsteal.h"

char LICENSE[] SEC("license") = "GPL";

struct steal_cpu cpus[IS_MAX_CPUS];
/* CLOCK_MONOTONIC of the plan's t = 0; 0 while not started. */
volatile __u64 start_ns;
/* CLOCK_MONOTONIC of user space's last sign of life. */
volatile __u64 heartbeat_ns;

/* Sized by user space at load: IS_MAX_WINDOWS keys per planned CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct steal_window);
} windows SEC(".maps");

struct skip_ctx {
	__u32 cpu;
	__u64 t;
};

/* Moves the CPU's cursor past every window that has ended by `t`. */
static long skip_ended(__u32 i, void *data)
{
	struct skip_ctx *s = data;
	struct steal_cpu *c = &cpus[s->cpu & (IS_MAX_CPUS - 1)];
	if (c->cursor >= c->nwindows)
		return 1;
	__u32 key = c->slot * IS_MAX_WINDOWS + c->cursor;
	struct steal_window *w = bpf_map_lookup_elem(&windows, &key);
	if (!w || w->end_ns > s->t)
		return 1;
	if (!c->hit)
		c->windows_missed++;
	c->hit = 0;
	c->cursor++;
	return 0;
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

SEC("perf_event")
int steal(struct bpf_perf_event_data *ctx)
{
	__u32 cpu = bpf_get_smp_processor_id();
	if (cpu >= IS_MAX_CPUS)
		return 0;
	struct steal_cpu *c = &cpus[cpu];
	if (!c->nwindows)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	c->samples++;
	c->last_sample_ns = now;
	__u64 start = start_ns;
	if (!start || now < start)
		return 0;
	__u64 hb = heartbeat_ns;
	if (now > hb && now - hb > IS_HEARTBEAT_MAX_NS) {
		c->watchdog_skips++;
		return 0;
	}
	__u64 t = now - start;
	struct skip_ctx sk = { .cpu = cpu, .t = t };
	bpf_loop(IS_MAX_WINDOWS, skip_ended, &sk, 0);
	if (c->cursor >= c->nwindows)
		return 0;
	__u32 key = c->slot * IS_MAX_WINDOWS + c->cursor;
	struct steal_window *w = bpf_map_lookup_elem(&windows, &key);
	if (!w || t < w->start_ns)
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	if (!c->hit && c->absorber_tid && tid != c->absorber_tid &&
	    t - w->start_ns < IS_ABSORBER_WAIT_NS)
		return 0;
	if (!c->hit) {
		c->hit = 1;
		c->windows_hit++;
		c->late_ns += t - w->start_ns;
	}
	struct spin_ctx sp = { .until = start + w->end_ns, .now = now };
	if (sp.until > now + IS_MAX_SPIN_NS)
		sp.until = now + IS_MAX_SPIN_NS;
	/* ~20 ns per iteration: the bound is far beyond IS_MAX_SPIN_NS, and a loop that runs
	 * out early only steals less. */
	bpf_loop(1 << 23, spin, &sp, 0);
	/* The spin's last clock read lands past `until` (by an iteration, or by however long
	 * this machine's own host kept the vCPU then): the window ends at `until`. */
	__u64 spun = (sp.now < sp.until ? sp.now : sp.until) - now;
	c->stolen_ns += spun;
	/* Without IRQ time accounting the kernel charges the spin to the task interrupted:
	 * user space may keep an absorber running there so that no guest task is charged. */
	if (c->absorber_tid && tid == c->absorber_tid)
		c->absorbed_ns += spun;
	return 0;
}

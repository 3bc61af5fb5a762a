/* Shared between bpf/hostmodel.bpf.c, testbeds/irq-steal/src/host.rs (the testbed that
 * loads it) and crates/hv-agent/src/model.rs (the agent's backend that drives it): the
 * host scheduler model's maps.
 *
 * Per modelled CPU there are `nslots` entities: slot 0 is our guest's vCPU (this kernel's
 * CPU itself), slots 1..nslots-1 the vCPUs of other VMs pinned to that CPU. Map keys are
 * cpu * HM_MAX_SLOTS + slot. */
#ifndef VMIGRATER_HOSTMODEL_H
#define VMIGRATER_HOSTMODEL_H

#define HM_MAX_CPUS 64
#define HM_MAX_SLOTS 8
#define HM_KEYS (HM_MAX_CPUS * HM_MAX_SLOTS)
#define HM_GUEST 0
/* `curr` when no entity is runnable (our vCPU halted, the others asleep). */
#define HM_NONE 255

#define HM_POLICY_FAIR 1
#define HM_POLICY_CREDIT 2

/* The weight of a nice-0 thread (Linux) and of a default domain scaled alike (Xen 256). */
#define HM_DEFAULT_WEIGHT 1024

/* The longest one invocation spins: above the longest out stretch a policy makes at
 * HM_MAX_SLOTS = 4 under the credit policy (3 x 30 ms). */
#define HM_MAX_SPIN_NS 100000000ULL
/* Nothing is taken away once user space has not refreshed the heartbeat for this long:
 * above the longest out stretch, since with both CPUs out the controller cannot beat. */
#define HM_HEARTBEAT_MAX_NS 500000000ULL
/* Segments one decision may simulate (slice ends, ticks, refills) before it lumps the
 * rest of the interval onto the entity holding the CPU. */
#define HM_MAX_SEGMENTS 4096

/* Written by user space: the testbed at start, the agent's `model` backend each period.
 * A weight of 0 means HM_DEFAULT_WEIGHT. `boost`: under the credit policy the vCPU gets
 * BOOST when it wakes whatever its credit; the fair policy ignores it. */
struct hm_control {
	__u32 weight;
	__u32 boost;
};

/* Written only by the program on the entity's CPU; user space reads the first four
 * counters (the agent's schedstat of a modelled vCPU) and may tear a read, never a write. */
struct hm_entity {
	__u64 run_ns;     /* held the CPU */
	__u64 wait_ns;    /* runnable without the CPU: steal, for our vCPU */
	__u64 halted_ns;  /* halted (our vCPU) or asleep by its duty cycle (the others) */
	__u64 wakeups;    /* woken from halt or sleep */
	/* the policy's state */
	__s64 vruntime;   /* fair: weighted run time, ns */
	__s64 credit;     /* credit: ns of CPU it may still use at UNDER */
	__u64 queued_ns;  /* credit: when it last went to the back of the run queue */
	__u32 boosted;    /* credit: BOOST until its next tick */
	__u32 weight;     /* the weight in effect */
};

/* One modelled CPU, in .bss. The plan part is set before attaching; the rest is the
 * program's, read by user space at the end. */
struct hm_cpu {
	/* plan */
	__u32 nslots;         /* entities here (0: not modelled) */
	__u32 policy;         /* HM_POLICY_* */
	__u64 duty_period_ns; /* the other VMs' duty cycle: 0 for CPU-bound */
	__u64 duty_on_ns;     /* ... computing the first duty_on_ns of every period */
	/* state */
	__u32 curr;           /* slot holding the CPU, or HM_NONE */
	__u32 halted;         /* our vCPU is halted (the kernel's idle loop) */
	__u32 in_hook;        /* a hook is deciding or spinning here: a nested one only holds */
	__u32 _pad;
	__s64 min_vr;         /* fair: the run queue's monotonic minimum vruntime */
	__u64 last_ns;        /* time accounted up to */
	__u64 slice_end_ns;   /* when curr's slice ends */
	__u64 resume_ns;      /* while our runnable vCPU is out: when it gets the CPU back */
	__u64 next_tick_ns;   /* credit: the next 10 ms tick */
	__u64 next_refill_ns; /* credit: the next 30 ms accounting */
	/* counters */
	__u64 samples;        /* perf clock samples */
	__u64 outs;           /* times our runnable vCPU was taken off */
	__u64 out_ns;         /* time our runnable vCPU was decided out */
	__u64 spun_ns;        /* time the deciding hooks spun */
	__u64 spin_cuts;      /* spins ended by HM_MAX_SPIN_NS before the vCPU's turn */
	__u64 wake_preempts;  /* wake-ups that preempted the running VM at once */
	__u64 wake_waits;     /* wake-ups that waited for the running VM's turn to end */
	__u64 wake_wait_ns;   /* ... and how long they waited in all */
	__u64 watchdog_skips; /* events that found the heartbeat stale */
	__u64 irq_holds;      /* device interrupts held while our vCPU was out */
	__u64 lumped;         /* decisions that hit HM_MAX_SEGMENTS */
};

#endif

//! The host scheduler model (testbeds/irq-steal `host`, bpf/hostmodel.bpf.c) on the real
//! kernel: the physics a benchmark in the loop rests on. Busy vCPUs get 1/k of their CPU
//! under both policies, as the threads on them see it; a vCPU that sleeps most of the time
//! is woken at its interrupt under the fair policy, while under a plan it waits for its
//! window; a weight written into the pinned control map (what the agent's `model` backend
//! does) moves the share; the maps are unpinned at the end. Root only.

use irq_steal::host::{HostConfig, HostModel, HostReport, Policy};
use irq_steal::{IrqSteal, Schedule};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use vmigrater_testbed::{assert_cpus, assert_root};

/// One model or plan at a time: they take whole CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

const US: u64 = 1_000;
const MS: u64 = 1_000_000;

fn config(policy: Policy, k: usize, tag: &str) -> HostConfig {
    let mut c = HostConfig::new(policy, k, vec![0, 1]);
    c.pin_dir = format!("/sys/fs/bpf/vmigrater-test-{tag}-{}", std::process::id()).into();
    c
}

/// A busy thread pinned to `cpu` that counts the time it saw itself run: consecutive
/// clock reads less than 20 µs apart. Gaps are time the CPU did something else: the
/// model's out time, and this machine's own host's steal.
fn seen_running(cpu: usize, stop: &AtomicBool) -> (u64, u64) {
    os_layer::sched::pin_self(cpu).expect("pin");
    let t0 = os_layer::monotonic_ns();
    let (mut last, mut ran) = (t0, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let now = os_layer::monotonic_ns();
        if now - last < 20 * US {
            ran += now - last;
        }
        last = now;
    }
    (ran, last - t0)
}

/// Runs the model for `secs` with a busy thread on every CPU; returns the report and, per
/// CPU, the share of the wall time its busy thread saw itself run.
fn busy_run(cfg: &HostConfig, secs: f64) -> (HostReport, Vec<f64>) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let model = HostModel::start(cfg).expect("start the model");
        let threads: Vec<_> = cfg
            .cpus
            .iter()
            .map(|&cpu| {
                let stop = &stop;
                s.spawn(move || seen_running(cpu, stop))
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        let seen: Vec<f64> = threads
            .into_iter()
            .map(|t| {
                let (ran, wall) = t.join().unwrap();
                ran as f64 / wall as f64
            })
            .collect();
        (model.stop().expect("stop the model"), seen)
    })
}

/// This machine's own host takes some of its CPUs (it is a KVM guest): the share a thread
/// sees with no model, to compare with.
fn seen_alone() -> f64 {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let t = s.spawn(|| seen_running(0, &stop));
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        let (ran, wall) = t.join().unwrap();
        ran as f64 / wall as f64
    })
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn every_busy_vcpu_gets_one_kth_of_its_cpu() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let alone = seen_alone();
    for policy in [Policy::Fair, Policy::Credit] {
        for k in [2, 3, 4] {
            let (report, seen) = busy_run(&config(policy, k, "share"), 3.0);
            let want = 1.0 / k as f64;
            for (c, seen) in report.cpus.iter().zip(&seen) {
                let share = c.guest.run_ns as f64 / (c.guest.run_ns + c.guest.wait_ns) as f64;
                eprintln!(
                    "{policy} k={k} CPU {}: model share {share:.3}, seen {seen:.3} (alone \
                     {alone:.3}), outs {}, spun {} ms of {} ms out, others {:?} ms",
                    c.cpu,
                    c.outs,
                    c.spun_ns / MS,
                    c.out_ns / MS,
                    c.others.iter().map(|o| o.run_ns / MS).collect::<Vec<_>>()
                );
                assert_eq!(
                    c.watchdog_skips, 0,
                    "CPU {}: the heartbeat went stale",
                    c.cpu
                );
                assert!(
                    (share - want).abs() <= 0.05 * want,
                    "{policy} k={k} CPU {}: the model gave our vCPU {share:.3}, not {want:.3}",
                    c.cpu
                );
                // The out time was really taken, with interrupts off...
                assert!(
                    c.spun_ns as f64 >= 0.98 * c.out_ns as f64,
                    "{policy} k={k} CPU {}: spun {} ms of {} ms out",
                    c.cpu,
                    c.spun_ns / MS,
                    c.out_ns / MS
                );
                // ...so the busy thread ran no more than its share of what this machine's
                // host left it (less when the machine is loaded: no lower bound here), give
                // or take the one slice by which its window and the model's can differ at
                // either end (30 ms of 3 s under credit).
                let slice = match policy {
                    Policy::Fair => report.timings.base_slice_ns,
                    Policy::Credit => report.timings.credit_slice_ns,
                };
                let edge = slice as f64 / report.wall_ns as f64;
                assert!(
                    seen / alone <= 1.05 * want + edge,
                    "{policy} k={k} CPU {}: the busy thread ran {seen:.3} of the time \
                     ({:.3} of what it runs alone), above {want:.3}",
                    c.cpu,
                    seen / alone
                );
                // The other VMs got the rest, evenly.
                for o in &c.others {
                    let theirs = o.run_ns as f64 / (c.guest.run_ns + c.guest.wait_ns) as f64;
                    assert!(
                        (theirs - want).abs() <= 0.05 * want,
                        "{policy} k={k} CPU {}: another VM got {theirs:.3}",
                        c.cpu
                    );
                }
            }
        }
    }
}

/// A thread on `cpu` that sleeps 900 µs and computes 100 µs, over `secs`: each wake-up's
/// deadline (CLOCK_MONOTONIC) and how late it woke, ns.
fn sleeper(cpu: usize, secs: f64) -> Vec<(u64, u64)> {
    os_layer::sched::pin_self(cpu).expect("pin");
    // SAFETY: prctl with an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64) };
    let end = os_layer::monotonic_ns() + (secs * 1e9) as u64;
    let mut late = Vec::new();
    let mut deadline = os_layer::monotonic_ns();
    while deadline < end {
        deadline += 900 * US;
        os_layer::sleep_until(deadline);
        let woke = os_layer::monotonic_ns();
        late.push((deadline, woke.saturating_sub(deadline)));
        while os_layer::monotonic_ns() < woke + 100 * US {}
        deadline = os_layer::monotonic_ns();
    }
    late
}

fn median(mut v: Vec<u64>) -> u64 {
    assert!(!v.is_empty(), "no wake-up to take a median of");
    v.sort_unstable();
    v[v.len() / 2]
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_mostly_sleeping_vcpu_is_woken_at_its_interrupt_and_under_a_plan_waits() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let sample = irq_steal::SAMPLE_PERIOD_NS;
    // Fair, k = 2: CPU 1 carries only the sleeper, so its vCPU halts 90% of the time and
    // the other VM runs then; each timer interrupt wakes the vCPU, which preempts.
    let model = HostModel::start(&config(Policy::Fair, 2, "wake")).expect("start the model");
    let fair = median(
        std::thread::spawn(|| sleeper(1, 2.0))
            .join()
            .unwrap()
            .into_iter()
            .map(|(_, late)| late)
            .collect(),
    );
    let report = model.stop().unwrap();
    let c = &report.cpus[1];
    eprintln!(
        "fair: median lateness {} µs; CPU 1 wake-ups {} ({} preempted, {} waited), our \
         vCPU ran {} ms, halted {} ms, the other VM ran {} ms",
        fair / US,
        c.guest.wakeups,
        c.wake_preempts,
        c.wake_waits,
        c.guest.run_ns / MS,
        c.guest.halted_ns / MS,
        c.others[0].run_ns / MS
    );
    assert!(
        c.guest.wakeups > 1000,
        "the vCPU halted {} times: something else kept CPU 1 busy (run this test alone) \
         or the model missed the idle loop: {c:?}",
        c.guest.wakeups
    );
    assert!(
        c.others[0].run_ns > c.guest.run_ns,
        "a halted vCPU gives its CPU away: {c:?}"
    );
    assert!(
        fair <= sample,
        "under the fair policy the sleeper woke {} µs late at the median (one sample \
         period: {} µs)",
        fair / US,
        sample / US
    );
    // The same sleeper under a plan: CPU 1 out 10 ms of every 20 ms whatever it does.
    let plan = "anti:20000:10000"
        .parse::<Schedule>()
        .unwrap()
        .plan(&[0, 1], Duration::from_secs(3))
        .unwrap();
    let steal = IrqSteal::start(&plan).expect("start irq-steal");
    let start = steal.start_ns();
    let wakes = std::thread::spawn(|| sleeper(1, 2.0)).join().unwrap();
    steal.stop().unwrap();
    // The wake-ups due while CPU 1 was out: each waits for the window's end, on average
    // half a window.
    let due_out: Vec<u64> = wakes
        .iter()
        .filter(|(d, _)| *d > start && plan.is_out(1, d - start))
        .map(|&(_, late)| late)
        .collect();
    let n = due_out.len();
    let planned = median(due_out);
    eprintln!(
        "plan: {n} of {} wake-ups due in a window, median lateness {} µs",
        wakes.len(),
        planned / US
    );
    assert!(
        planned > 4 * sample,
        "under a plan a wake-up due in a window waits for its end: median {} µs",
        planned / US
    );
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_weight_in_the_pinned_control_map_moves_the_share_and_the_pins_go_at_the_end() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for policy in [Policy::Fair, Policy::Credit] {
        let cfg = config(policy, 2, "weight");
        let stop = AtomicBool::new(false);
        let report = std::thread::scope(|s| {
            let model = HostModel::start(&cfg).expect("start the model");
            let control = MapHandle::from_pinned_path(cfg.pin_dir.join("control")).unwrap();
            // Our vCPU on CPU 1 weighs twice the other VM's: two thirds of the CPU.
            // Key cpu * MAX_SLOTS + slot: CPU 1, slot 0.
            let key = (irq_steal::host::MAX_SLOTS as u32).to_ne_bytes();
            let mut value = [0u8; 8];
            value[..4].copy_from_slice(&2048u32.to_ne_bytes());
            control.update(&key, &value, MapFlags::ANY).unwrap();
            let busy: Vec<_> = [0, 1]
                .map(|cpu| {
                    let stop = &stop;
                    s.spawn(move || seen_running(cpu, stop))
                })
                .into();
            std::thread::sleep(Duration::from_secs(3));
            stop.store(true, Ordering::Relaxed);
            for b in busy {
                b.join().unwrap();
            }
            model.stop().unwrap()
        });
        let share = |c: usize| {
            let g = &report.cpus[c].guest;
            g.run_ns as f64 / (g.run_ns + g.wait_ns) as f64
        };
        eprintln!("{policy}: CPU 0 {:.3}, CPU 1 {:.3}", share(0), share(1));
        assert!(
            (share(0) - 0.5).abs() < 0.025,
            "{policy}: CPU 0 {:.3}",
            share(0)
        );
        assert!(
            (share(1) - 2.0 / 3.0).abs() < 0.034,
            "{policy}: weight 2048 on CPU 1 gave {:.3}, not 2/3",
            share(1)
        );
        assert!(
            !cfg.pin_dir.join("control").exists() && !cfg.pin_dir.exists(),
            "the model left its pins in {}",
            cfg.pin_dir.display()
        );
    }
}

//! The user-space steal governor (`vmigrater_testbed::governor`) on the real kernel: the
//! threads of a real `vmigrater-workload` process, real `sched_setaffinity`, steal fed by
//! the test as the benchmarks' host model feeds it. Needs root (it sets the masks of
//! another process's threads and makes one of them SCHED_FIFO) and 2 CPUs; built by another
//! user the tests are reported ignored, and run by another user they fail (`assert_root`).

use os_layer::{get_cpus, set_cpus};
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmigrater_testbed::governor::{
    online_cpus, GovernorConfig, GovernorRecord, GovernorRun, Hysteresis,
};
use vmigrater_testbed::host::Hogs;
use vmigrater_testbed::{assert_cpus, assert_root, workspace_bin};

const INTERVAL: Duration = Duration::from_millis(100);
/// Long enough for every CPU but one to leave (or come back) one interval at a time.
fn settle() -> Duration {
    INTERVAL * (online_cpus().len() as u32 + 20)
}

/// Steal as a host would report it: every CPU stolen the same share of the time that
/// passes, a share the test changes while the governor runs.
#[derive(Clone)]
struct Steal(Arc<Mutex<StealState>>);

struct StealState {
    pct: f64,
    at: Instant,
    ns: Vec<f64>,
}

impl Steal {
    fn new(pct: f64) -> Steal {
        let n = online_cpus().last().map_or(1, |&c| c + 1);
        Steal(Arc::new(Mutex::new(StealState {
            pct,
            at: Instant::now(),
            ns: vec![0.0; n],
        })))
    }

    fn advance(st: &mut StealState) {
        let dt = st.at.elapsed().as_nanos() as f64;
        st.at = Instant::now();
        let pct = st.pct;
        for c in &mut st.ns {
            *c += dt * pct / 100.0;
        }
    }

    fn set(&self, pct: f64) {
        let mut st = self.0.lock().unwrap();
        Self::advance(&mut st);
        st.pct = pct;
    }

    fn reader(&self) -> impl Fn() -> Vec<u64> + Send + 'static {
        let me = self.clone();
        move || {
            let mut st = me.0.lock().unwrap();
            Self::advance(&mut st);
            st.ns.iter().map(|&ns| ns as u64).collect()
        }
    }
}

/// A `vmigrater-workload` process with `hogs` CPU hogs besides its main thread (which
/// sleeps); killed on drop.
struct Workload {
    child: Child,
}

impl Workload {
    fn start(hogs: usize) -> Workload {
        let child = Command::new(workspace_bin("vmigrater-workload"))
            .args(["--file", "/dev/null", "--readers", "0"])
            .args(["--hogs", &hogs.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .expect("start vmigrater-workload");
        let w = Workload { child };
        wait_for("the hog threads", Duration::from_secs(5), || {
            Hogs::find(w.pid()).len() == hogs
        });
        w
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Main thread first, then the hogs.
    fn tids(&self) -> Vec<u32> {
        let mut tids = Hogs::find(self.pid());
        tids.insert(0, self.pid());
        tids
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn masks(tids: &[u32]) -> HashMap<u32, Vec<usize>> {
    tids.iter()
        .map(|&t| (t, get_cpus(t).expect("sched_getaffinity")))
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn config() -> GovernorConfig {
    GovernorConfig {
        interval: INTERVAL,
        hysteresis: Hysteresis::KERNEL,
        cpus: online_cpus(),
    }
}

/// Every decision is what the hysteresis asks of the one before: one CPU off the top above
/// `high`, one back below `low`, never fewer than one nor more than all.
fn assert_follows_hysteresis(rec: &GovernorRecord) {
    let h = rec.hysteresis;
    let n = rec.cpus.len();
    let mut keep = n;
    let mut last_t = 0.0;
    for d in &rec.decisions {
        keep = if d.steal_pct > h.high_pct {
            keep.saturating_sub(1).max(1)
        } else if d.steal_pct < h.low_pct {
            (keep + 1).min(n)
        } else {
            keep
        };
        assert_eq!(
            d.preferred,
            rec.cpus[..keep],
            "{d:?} in {:#?}",
            rec.decisions
        );
        assert!(
            d.t_s > last_t,
            "decisions in time order: {:#?}",
            rec.decisions
        );
        last_t = d.t_s;
    }
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn high_steal_pushes_threads_off_the_top_cpu_and_low_steal_brings_them_back() {
    assert_root();
    assert_cpus(2);
    let cpus = online_cpus();
    let (low, top) = (cpus[0], *cpus.last().unwrap());
    let w = Workload::start(3);
    let tids = w.tids();
    let (main, hog, repinned, pinned) = (tids[0], tids[1], tids[2], tids[3]);
    // A user's affinity from before the governor: only the top CPU.
    set_cpus(pinned, &[top]).unwrap();
    let before = masks(&tids);
    assert!(before[&main].contains(&top), "{before:?}");

    let steal = Steal::new(10.0);
    let run = GovernorRun::start(config(), vec![w.pid()], steal.reader()).unwrap();
    wait_for("the set to shrink to one CPU", settle(), || {
        run.preferred() == [low]
            && [main, hog, repinned]
                .iter()
                .all(|&t| get_cpus(t).unwrap() == [low])
    });
    // Its affinity and the set do not meet: it keeps its own.
    assert_eq!(get_cpus(pinned).unwrap(), vec![top]);

    // Somebody pins a restricted thread to the top CPU: that is its own mask from now on.
    set_cpus(repinned, &[top]).unwrap();
    std::thread::sleep(INTERVAL * 4);
    assert_eq!(get_cpus(repinned).unwrap(), vec![top]);

    steal.set(0.0);
    wait_for("the set to grow back", settle(), || {
        run.preferred() == cpus
            && [main, hog]
                .iter()
                .all(|&t| get_cpus(t).unwrap() == before[&t])
    });
    assert_eq!(get_cpus(pinned).unwrap(), vec![top]);
    assert_eq!(get_cpus(repinned).unwrap(), vec![top]);

    // Stopped while restricting: every mask as it was, the re-pinned one as repinned.
    steal.set(10.0);
    wait_for("the set to shrink again", settle(), || {
        get_cpus(hog).unwrap() == [low]
    });
    let rec = run.stop();
    // Shown when an assertion below fails.
    println!("{}", serde_json::to_string(&rec).unwrap());
    let mut want = before.clone();
    want.insert(repinned, vec![top]);
    assert_eq!(masks(&tids), want);

    assert_follows_hysteresis(&rec);
    let c = &rec.counters;
    assert!(c.shrinks >= 2 * (cpus.len() as u64 - 1), "{c:?}");
    assert!(c.grows >= cpus.len() as u64 - 1, "{c:?}");
    assert_eq!((c.threads_managed, c.threads_skipped), (4, 0), "{c:?}");
    assert_eq!(
        (c.own_mask_changes, c.errors, c.vanished),
        (1, 0, 0),
        "{c:?}"
    );
    assert_eq!(c.restored, 2, "main and the other hog: {c:?}");
    assert_eq!(c.samples, rec.decisions.len() as u64 + 1, "{c:?}");
    // The first shrink moved every thread it could.
    let first = rec.decisions.iter().find(|d| d.steal_pct > 5.0).unwrap();
    assert!(first.threads_moved >= 3, "{first:?}");
    assert!(rec.decisions.iter().any(|d| d.steal_pct < 2.0));
    assert_eq!(rec.interval_ms, 100);
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn real_time_and_kernel_threads_are_left_alone() {
    assert_root();
    assert_cpus(2);
    let cpus = online_cpus();
    let low = cpus[0];
    let w = Workload::start(1);
    let (main, hog) = (w.tids()[0], w.tids()[1]);
    // The main thread sleeps: as SCHED_FIFO it takes no CPU from anybody.
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: plain syscall with a valid param.
    let r = unsafe { libc::sched_setscheduler(main as i32, libc::SCHED_FIFO, &param) };
    assert_eq!(r, 0, "SCHED_FIFO: {}", std::io::Error::last_os_error());
    let kthreadd = 2;
    let before = masks(&[main, hog, kthreadd]);

    let steal = Steal::new(10.0);
    // A process id no process has (above any pid_max) lists no threads.
    let pids = vec![w.pid(), kthreadd, i32::MAX as u32];
    let run = GovernorRun::start(config(), pids, steal.reader()).unwrap();
    wait_for("the hog to be restricted", settle(), || {
        get_cpus(hog).unwrap() == [low]
    });
    std::thread::sleep(INTERVAL * 3);
    assert_eq!(get_cpus(main).unwrap(), before[&main]);
    assert_eq!(get_cpus(kthreadd).unwrap(), before[&kthreadd]);

    // Back in the fair class, it is governed like any other.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as above.
    let r = unsafe { libc::sched_setscheduler(main as i32, libc::SCHED_OTHER, &param) };
    assert_eq!(r, 0, "SCHED_OTHER: {}", std::io::Error::last_os_error());
    wait_for("the main thread to be restricted", settle(), || {
        get_cpus(main).unwrap() == [low]
    });

    let rec = run.stop();
    assert_eq!(masks(&[main, hog, kthreadd]), before);
    let c = &rec.counters;
    assert_eq!(
        c.threads_skipped, 2,
        "kthreadd and the SCHED_FIFO thread: {c:?}"
    );
    assert_eq!(
        (c.threads_managed, c.errors, c.restored),
        (2, 0, 2),
        "{c:?}"
    );
    assert_follows_hysteresis(&rec);
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn drop_gives_the_masks_back_and_stop_does_not_wait_for_the_interval() {
    assert_root();
    assert_cpus(2);
    let low = online_cpus()[0];
    let w = Workload::start(1);
    let tids = w.tids();
    let before = masks(&tids);
    let steal = Steal::new(10.0);
    let run = GovernorRun::start(config(), vec![w.pid()], steal.reader()).unwrap();
    wait_for("the threads to be restricted", settle(), || {
        tids.iter().all(|&t| get_cpus(t).unwrap() == [low])
    });
    drop(run);
    assert_eq!(masks(&tids), before);

    // The kernel's own interval: a stop must not sleep it out.
    let cfg = GovernorConfig {
        interval: Duration::from_secs(10),
        ..config()
    };
    let run = GovernorRun::start(cfg, vec![w.pid()], steal.reader()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let rec = run.stop();
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    // Only the baseline was taken: nothing judged, nothing moved.
    assert!(rec.decisions.is_empty(), "{rec:?}");
    assert_eq!((rec.counters.samples, rec.counters.moves), (1, 0));
    assert_eq!(masks(&tids), before);
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn a_process_that_exits_under_it_is_no_error() {
    assert_root();
    assert_cpus(2);
    let low = online_cpus()[0];
    let gone = Workload::start(2);
    let stays = Workload::start(1);
    let tids = stays.tids();
    let before = masks(&tids);
    let steal = Steal::new(10.0);
    let pids = vec![gone.pid(), stays.pid()];
    let run = GovernorRun::start(config(), pids, steal.reader()).unwrap();
    wait_for("both processes to be restricted", settle(), || {
        gone.tids()
            .iter()
            .chain(&tids)
            .all(|&t| get_cpus(t).unwrap() == [low])
    });
    drop(gone);
    std::thread::sleep(INTERVAL * 3);
    let rec = run.stop();
    assert_eq!(masks(&tids), before);
    let c = &rec.counters;
    assert_eq!(
        (c.threads_managed, c.errors, c.restored),
        (5, 0, 2),
        "{c:?}"
    );
    assert_follows_hysteresis(&rec);
}

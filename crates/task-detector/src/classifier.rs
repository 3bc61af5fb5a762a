//! The I/O-bound classifier: pure, fed cumulative per-thread counters at each window and
//! returning the threads that are I/O-bound now, with an I/O load level. A thread enters
//! after `enter_windows` consecutive windows with at least `enter_fraction` of the time
//! spent with block I/O in flight, or at least `enter_iops` requests a second (and a
//! minimum number of requests, so one slow flush is not "I/O-bound"); it leaves only after
//! `exit_windows` consecutive windows below `exit_fraction` and `exit_iops` — the
//! hysteresis that keeps a bursty reader from flapping. The rate counts because a task
//! that computes a little between frequent synchronous requests (a request/response
//! server: a 4 KiB read, then 200 µs of work) has I/O in flight only a tenth of the time
//! while its completions come promptly, yet every one of its requests waits for the vCPU
//! that takes its completion interrupt: the task such deschedules stall most. A window
//! with more than `max_cpu_fraction` on a CPU (less the time its vCPU was seen taken away,
//! which a kernel may charge to it) is CPU-bound and counts as below.
//! A window with some I/O but fewer requests than the minimum stretches up to
//! `max_window_ns` (a block-tracking sample, 250 ms): a task that issues a request every
//! few milliseconds (one that computes between requests, or whose completions wait for a
//! descheduled vCPU) is judged on enough requests, and so is a server in lock-step with
//! deschedules, one request per period or two (a database backend at 25 queries a second
//! under 20/10 ms windows, which 50 ms windows never saw twice). A window with no I/O at all closes once its thread's vCPU ran `window_ns`
//! (time the vCPU was seen out does not count: a completion that came while it was out
//! left the task nothing in flight and nowhere to run), so a task that stopped leaves as
//! fast as before while its vCPU runs.
//! No clocks, no /proc: the caller provides time and counters.

use std::collections::HashMap;

#[derive(Clone, Debug)]
pub struct ClassifierConfig {
    /// Nominal window; shorter observed windows are merged until this much time passed.
    pub window_ns: u64,
    /// Longest window: one with I/O (a request, or time in flight) but fewer than
    /// `min_ios_per_window` requests is merged with the next ones up to this long.
    pub max_window_ns: u64,
    pub enter_fraction: f64,
    pub exit_fraction: f64,
    /// Requests a second that make a window count toward entering whatever its time in
    /// flight (0: only the fraction counts).
    pub enter_iops: f64,
    /// A window at this rate or above keeps an I/O-bound thread in.
    pub exit_iops: f64,
    pub enter_windows: u32,
    pub exit_windows: u32,
    /// Requests a window must complete or start to count toward entering.
    pub min_ios_per_window: u64,
    /// Threads unseen (no counter change) for this long are forgotten.
    pub forget_after_ns: u64,
    /// Smoothing of the load level (weight of the newest window).
    pub load_alpha: f64,
    /// A window with more on-CPU time than this fraction is CPU-bound whatever its I/O
    /// (async I/O kept in flight by a computing thread): it neither counts toward
    /// entering nor keeps the thread in. A synchronous reader at 80% in flight is on a
    /// CPU ≤ 20% of the time.
    pub max_cpu_fraction: f64,
}

impl Default for ClassifierConfig {
    fn default() -> Self {
        ClassifierConfig {
            window_ns: 5_000_000,
            max_window_ns: 250_000_000,
            enter_fraction: 0.25,
            exit_fraction: 0.10,
            enter_iops: 1_000.0,
            exit_iops: 250.0,
            enter_windows: 2,
            exit_windows: 20,
            min_ios_per_window: 2,
            forget_after_ns: 2_000_000_000,
            load_alpha: 0.3,
            max_cpu_fraction: 0.8,
        }
    }
}

/// One thread's cumulative counters at the time of `observe`.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadObservation {
    pub tid: u32,
    pub tgid: u32,
    /// Cumulative time with ≥ 1 block request in flight.
    pub busy_ns: u64,
    pub ios: u64,
    pub bytes: u64,
    /// Cumulative on-CPU time (/proc/<tid>/schedstat field 1).
    pub cpu_ns: u64,
    /// Cumulative time the thread's last vCPU was seen taken away (0 where unknown). A
    /// kernel without steal accounting for the way it is taken away (an interrupt that
    /// spins, a host that reports no steal) charges that time to whatever was running
    /// there: a thread that waits on I/O would read as CPU-bound.
    pub cpu_out_ns: u64,
    pub is_kernel: bool,
    pub last_cpu: u32,
    pub completions: Completions,
}

/// Where one thread's requests complete, cumulative: the vCPU that took the last
/// completion's interrupt, how many completed, and how many on another vCPU than the one
/// that submitted them. On a disk with one interrupt vector for all vCPUs almost every
/// request of a thread that runs elsewhere completes remotely; on a disk with a queue per
/// vCPU almost none does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completions {
    pub last_cpu: u32,
    pub total: u64,
    pub remote: u64,
}

/// Where an I/O-bound task's requests completed over its last window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompletionSite {
    /// The vCPU whose interrupt handled its last completion.
    pub cpu: u32,
    /// Of the window's completions, the fraction handled on another vCPU than the
    /// submitter's (0 with none in the window).
    pub remote_fraction: f64,
    /// Completions in the window.
    pub count: u64,
    /// Of those, handled on another vCPU than the submitter's.
    pub remote: u64,
}

/// A thread that is I/O-bound now.
#[derive(Clone, Debug, PartialEq)]
pub struct IoTask {
    pub tid: u32,
    pub tgid: u32,
    /// Fraction of the last window with I/O in flight.
    pub io_fraction: f64,
    /// Fraction of the last window on a CPU, less the time its vCPU was seen out.
    pub cpu_fraction: f64,
    pub iops: f64,
    /// Smoothed I/O-in-flight fraction in [0.05, 1]: the planner's weight.
    pub load: f64,
    pub last_cpu: u32,
    pub completion: CompletionSite,
}

#[derive(Clone, Debug)]
struct ThreadState {
    tgid: u32,
    /// Counters at the start of the current window.
    base_ts: u64,
    base_busy: u64,
    base_ios: u64,
    base_cpu: u64,
    /// `cpu_out_ns` at the window's start, and of which vCPU.
    base_out: (u32, u64),
    base_done: Completions,
    above: u32,
    below: u32,
    /// Of the `below` windows, those below only for being on a CPU (for the log).
    below_on_cpu: u32,
    io_bound: bool,
    load: f64,
    last: IoTaskFields,
    last_change_ts: u64,
    last_busy: u64,
    last_ios: u64,
}

#[derive(Clone, Debug, Default)]
struct IoTaskFields {
    io_fraction: f64,
    cpu_fraction: f64,
    iops: f64,
    last_cpu: u32,
    completion: CompletionSite,
}

/// The figures of a thread's window that just closed.
struct Closed {
    dt: u64,
    ios: u64,
    /// Time its vCPU was out during the window.
    out: u64,
    io_fraction: f64,
    cpu_fraction: f64,
    iops: f64,
}

impl ThreadState {
    fn new(t: &ThreadObservation, now_ns: u64) -> Self {
        ThreadState {
            tgid: t.tgid,
            base_ts: now_ns,
            base_busy: t.busy_ns,
            base_ios: t.ios,
            base_cpu: t.cpu_ns,
            base_out: (t.last_cpu, t.cpu_out_ns),
            base_done: t.completions,
            above: 0,
            below: 0,
            below_on_cpu: 0,
            io_bound: false,
            load: 0.0,
            last: IoTaskFields::default(),
            last_change_ts: now_ns,
            last_busy: t.busy_ns,
            last_ios: t.ios,
        }
    }

    /// Closes the thread's window when it is due: its figures go to `last` and `load`,
    /// and the next window starts now. `None` while the window stays open.
    fn close_window(
        &mut self,
        t: &ThreadObservation,
        now_ns: u64,
        cfg: &ClassifierConfig,
    ) -> Option<Closed> {
        let dt = now_ns.saturating_sub(self.base_ts);
        let ios = t.ios - self.base_ios;
        let some_io = ios > 0 || t.busy_ns > self.base_busy;
        // Time its vCPU was out (it may have been charged for it as on-CPU time): a
        // window where it ran on two vCPUs is taken as it is.
        let out = if self.base_out.0 == t.last_cpu {
            t.cpu_out_ns.saturating_sub(self.base_out.1).min(dt)
        } else {
            0
        };
        // A window with enough requests closes on time; one with fewer stretches;
        // one with no I/O at all closes after its vCPU ran a window: a request that
        // completed while the vCPU was out leaves its task with nothing in flight and
        // nowhere to run, and judging that time would read an I/O-bound task as idle.
        let open = if ios >= cfg.min_ios_per_window {
            dt < cfg.window_ns
        } else {
            some_io || dt - out < cfg.window_ns
        };
        if open && dt < cfg.max_window_ns {
            return None;
        }
        let io_fraction = ((t.busy_ns - self.base_busy) as f64 / dt as f64).min(1.0);
        let iops = ios as f64 * 1e9 / dt as f64;
        let on_cpu = t.cpu_ns.saturating_sub(self.base_cpu);
        let cpu_fraction = (on_cpu.saturating_sub(out) as f64 / dt as f64).min(1.0);
        let done = t.completions.total.saturating_sub(self.base_done.total);
        let remote = t.completions.remote.saturating_sub(self.base_done.remote);
        self.last = IoTaskFields {
            io_fraction,
            cpu_fraction,
            iops,
            last_cpu: t.last_cpu,
            completion: CompletionSite {
                cpu: t.completions.last_cpu,
                remote_fraction: if done == 0 {
                    0.0
                } else {
                    (remote.min(done)) as f64 / done as f64
                },
                count: done,
                remote: remote.min(done),
            },
        };
        self.base_done = t.completions;
        self.base_ts = now_ns;
        self.base_busy = t.busy_ns;
        self.base_ios = t.ios;
        self.base_cpu = t.cpu_ns;
        self.base_out = (t.last_cpu, t.cpu_out_ns);
        self.load = if self.load == 0.0 {
            io_fraction
        } else {
            cfg.load_alpha * io_fraction + (1.0 - cfg.load_alpha) * self.load
        };
        Some(Closed {
            dt,
            ios,
            out,
            io_fraction,
            cpu_fraction,
            iops,
        })
    }

    /// The enter and exit windows over a closed window: I/O-bound after `enter_windows`
    /// in a row that qualify, no longer after `exit_windows` in a row that do not.
    fn judge(&mut self, tid: u32, w: &Closed, cfg: &ClassifierConfig) {
        let cpu_ok = w.cpu_fraction <= cfg.max_cpu_fraction;
        tracing::trace!(
            tid,
            dt_us = w.dt / 1000,
            ios = w.ios,
            io_fraction = format!("{:.2}", w.io_fraction),
            cpu_fraction = format!("{:.2}", w.cpu_fraction),
            out_us = w.out / 1000,
            "window"
        );
        let rate_in = |limit: f64| limit > 0.0 && w.iops >= limit;
        let enters = w.io_fraction >= cfg.enter_fraction || rate_in(cfg.enter_iops);
        if enters && w.ios >= cfg.min_ios_per_window && cpu_ok {
            self.above += 1;
        } else {
            self.above = 0;
        }
        let stays = w.io_fraction >= cfg.exit_fraction || rate_in(cfg.exit_iops);
        if !stays || !cpu_ok {
            self.below += 1;
            self.below_on_cpu += u32::from(w.io_fraction >= cfg.exit_fraction);
        } else {
            self.below = 0;
            self.below_on_cpu = 0;
        }
        if !self.io_bound && self.above >= cfg.enter_windows {
            self.io_bound = true;
            self.below = 0;
            self.below_on_cpu = 0;
        } else if self.io_bound && self.below >= cfg.exit_windows {
            self.io_bound = false;
            self.above = 0;
            tracing::debug!(
                tid,
                windows = self.below,
                on_cpu = self.below_on_cpu,
                io_fraction = format!("{:.2}", w.io_fraction),
                cpu_fraction = format!("{:.2}", w.cpu_fraction),
                "no longer I/O-bound: windows below the exit fraction, or on a CPU"
            );
        }
    }
}

pub struct IoClassifier {
    cfg: ClassifierConfig,
    threads: HashMap<u32, ThreadState>,
}

impl IoClassifier {
    pub fn new(cfg: ClassifierConfig) -> Self {
        IoClassifier {
            cfg,
            threads: HashMap::new(),
        }
    }

    pub fn config(&self) -> &ClassifierConfig {
        &self.cfg
    }

    /// True when no thread is being tracked.
    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// The threads being tracked, as (tid, tgid).
    pub fn tracked(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.threads.iter().map(|(&tid, st)| (tid, st.tgid))
    }

    /// The tgid of a tracked thread.
    pub fn tgid_of(&self, tid: u32) -> Option<u32> {
        self.threads.get(&tid).map(|st| st.tgid)
    }

    /// Whether a thread is half-way in: its last window qualified, not yet enough of them.
    /// A sample of the block programs that ends now would leave it undecided.
    pub fn entering(&self) -> bool {
        self.threads.values().any(|st| !st.io_bound && st.above > 0)
    }

    /// Whether `tid` is being tracked (so the caller keeps feeding it even when idle).
    pub fn tracks(&self, tid: u32) -> bool {
        self.threads.contains_key(&tid)
    }

    /// Feeds the counters of the threads the caller saw at `now_ns`; returns the
    /// I/O-bound ones, most loaded first (ties by tid).
    pub fn observe(&mut self, now_ns: u64, threads: &[ThreadObservation]) -> Vec<IoTask> {
        let cfg = self.cfg.clone();
        for t in threads {
            if t.is_kernel || t.tid == 0 {
                continue;
            }
            let st = self
                .threads
                .entry(t.tid)
                .or_insert_with(|| ThreadState::new(t, now_ns));
            if t.busy_ns != st.last_busy || t.ios != st.last_ios {
                st.last_change_ts = now_ns;
                st.last_busy = t.busy_ns;
                st.last_ios = t.ios;
            }
            // Counters went backwards: a new thread reused the tid. Start over.
            if t.busy_ns < st.base_busy || t.ios < st.base_ios || t.tgid != st.tgid {
                self.threads.remove(&t.tid);
                continue;
            }
            if let Some(w) = st.close_window(t, now_ns, &cfg) {
                st.judge(t.tid, &w, &cfg);
            }
        }
        // Forget idle threads; an I/O-bound one leaves through the exit windows first,
        // unless it vanished from the caller's view (exited).
        let seen: std::collections::HashSet<u32> = threads.iter().map(|t| t.tid).collect();
        self.threads.retain(|tid, st| {
            seen.contains(tid)
                && (st.io_bound || now_ns.saturating_sub(st.last_change_ts) < cfg.forget_after_ns)
        });
        let mut out: Vec<IoTask> = self
            .threads
            .iter()
            .filter(|(_, st)| st.io_bound)
            .map(|(&tid, st)| IoTask {
                tid,
                tgid: st.tgid,
                io_fraction: st.last.io_fraction,
                cpu_fraction: st.last.cpu_fraction,
                iops: st.last.iops,
                load: st.load.clamp(0.05, 1.0),
                last_cpu: st.last.last_cpu,
                completion: st.last.completion,
            })
            .collect();
        out.sort_by(|a, b| b.load.total_cmp(&a.load).then(a.tid.cmp(&b.tid)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A synthetic thread: per window of `MS*5`, `busy` fraction in flight, `ios` requests,
    /// `cpu` fraction on CPU.
    #[derive(Clone)]
    struct Synth {
        tid: u32,
        busy: u64,
        ios: u64,
        cpu: u64,
        kernel: bool,
        /// Completions so far on another vCPU than the submitter's.
        remote: u64,
    }

    impl Synth {
        fn new(tid: u32) -> Self {
            Synth {
                tid,
                busy: 0,
                ios: 0,
                cpu: 0,
                kernel: false,
                remote: 0,
            }
        }
        fn step(&mut self, busy_frac: f64, ios: u64, cpu_frac: f64) -> ThreadObservation {
            self.busy += (busy_frac * 5.0 * MS as f64) as u64;
            self.ios += ios;
            self.cpu += (cpu_frac * 5.0 * MS as f64) as u64;
            ThreadObservation {
                tid: self.tid,
                tgid: self.tid,
                busy_ns: self.busy,
                ios: self.ios,
                bytes: self.ios * 4096,
                cpu_ns: self.cpu,
                cpu_out_ns: 0,
                is_kernel: self.kernel,
                last_cpu: 1,
                completions: Completions {
                    last_cpu: 1,
                    total: self.ios,
                    remote: self.remote,
                },
            }
        }
    }

    fn run(
        c: &mut IoClassifier,
        windows: usize,
        mut f: impl FnMut(usize) -> Vec<ThreadObservation>,
    ) -> Vec<Vec<IoTask>> {
        (0..windows)
            .map(|w| c.observe((w as u64 + 1) * 5 * MS, &f(w)))
            .collect()
    }

    #[test]
    fn reader_enters_within_the_enter_windows_and_hog_never() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let (mut reader, mut hog) = (Synth::new(10), Synth::new(11));
        let out = run(&mut c, 20, |_| {
            vec![reader.step(0.8, 150, 0.2), hog.step(0.0, 0, 1.0)]
        });
        // Window 0 is the baseline; windows 1 and 2 are above the threshold.
        assert!(out[1].is_empty());
        assert_eq!(out[2].iter().map(|t| t.tid).collect::<Vec<_>>(), vec![10]);
        assert!(out.iter().all(|o| o.iter().all(|t| t.tid != 11)));
        let t = &out[19][0];
        assert!(
            (t.io_fraction - 0.8).abs() < 1e-9 && (t.iops - 30_000.0).abs() < 1.0,
            "{t:?}"
        );
    }

    #[test]
    fn hysteresis_keeps_a_bursty_reader_and_releases_an_idle_one() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut r = Synth::new(7);
        // Enter, then alternate 0.05 / 0.5: never 20 windows below exit.
        let out = run(&mut c, 60, |w| {
            let f = if w < 5 || w % 2 == 0 { 0.5 } else { 0.05 };
            vec![r.step(f, 10, 0.1)]
        });
        assert!(
            out[5..].iter().all(|o| o.len() == 1),
            "bursty reader flapped"
        );
        // Now idle: leaves after exactly 20 windows below the exit fraction.
        let mut c2 = IoClassifier::new(ClassifierConfig::default());
        let mut r2 = Synth::new(8);
        let out = run(&mut c2, 40, |w| {
            vec![if w < 10 {
                r2.step(0.9, 50, 0.1)
            } else {
                r2.step(0.0, 0, 0.0)
            }]
        });
        assert_eq!(out[28].len(), 1);
        assert!(out[29].is_empty(), "{:?}", out[29]);
    }

    #[test]
    fn time_its_vcpu_was_out_is_not_counted_as_on_cpu() {
        // A reader whose vCPU is taken away half of each window by a spinning interrupt,
        // on a kernel that charges that half to it: 90% "on CPU" as schedstat says.
        let obs = |w: u64, out_per_window: u64| ThreadObservation {
            tid: 5,
            tgid: 5,
            busy_ns: w * 9 * MS / 2,
            ios: w * 4,
            bytes: w * 4 * 4096,
            cpu_ns: w * 9 * MS / 2,
            cpu_out_ns: w * out_per_window,
            is_kernel: false,
            last_cpu: 0,
            completions: Completions::default(),
        };
        let mut told = IoClassifier::new(ClassifierConfig::default());
        let out = run(&mut told, 10, |w| vec![obs(w as u64, 5 * MS / 2)]);
        assert_eq!(out[2].len(), 1, "{out:?}");
        assert!(
            (out[9][0].cpu_fraction - 0.4).abs() < 1e-9,
            "{:?}",
            out[9][0]
        );
        // Not told where its vCPU was: CPU-bound, never I/O-bound.
        let mut blind = IoClassifier::new(ClassifierConfig::default());
        let out = run(&mut blind, 10, |w| vec![obs(w as u64, 0)]);
        assert!(out.iter().all(|o| o.is_empty()));
    }

    #[test]
    fn time_its_vcpu_was_out_with_nothing_in_flight_does_not_close_a_window() {
        // A request task whose completions land while its own vCPU is out (anti-phase
        // deschedules, 10 ms each): a 5 ms window with a request in flight, then one where
        // the request is done but the vCPU is away, so nothing is in flight and it cannot
        // run. Judged on wall-clock windows the second reads as idle and it never enters.
        let obs = |w: u64| {
            let (done, out) = (w.div_ceil(2), w / 2);
            ThreadObservation {
                tid: 7,
                tgid: 7,
                busy_ns: done * 5 * MS,
                ios: done,
                bytes: done * 4096,
                cpu_ns: done * MS / 5,
                cpu_out_ns: out * 5 * MS,
                is_kernel: false,
                last_cpu: 0,
                completions: Completions::default(),
            }
        };
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let out = run(&mut c, 20, |w| vec![obs(w as u64 + 1)]);
        let entered = out
            .iter()
            .position(|o| !o.is_empty())
            .expect("never entered");
        assert!(entered <= 8, "entered at window {entered}");
        assert!(out[entered..].iter().all(|o| o.len() == 1), "flapped");
        // Not told where its vCPU was, the empty windows close on time and break the run.
        let mut blind = IoClassifier::new(ClassifierConfig::default());
        let out = run(&mut blind, 20, |w| {
            vec![ThreadObservation {
                cpu_out_ns: 0,
                ..obs(w as u64 + 1)
            }]
        });
        assert!(out.iter().all(|o| o.is_empty()), "{out:?}");
    }

    #[test]
    fn a_request_task_enters_by_its_rate_and_leaves_when_it_stops() {
        // A 4 KiB read then 200 µs of work, in turn with a CPU hog: 10% of the time in
        // flight, 45% on a CPU, 2,000 requests a second.
        let request = |s: &mut Synth| s.step(0.10, 10, 0.45);
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut r = Synth::new(5);
        let out = run(&mut c, 60, |w| {
            vec![if w < 25 {
                request(&mut r)
            } else {
                r.step(0.0, 0, 0.0)
            }]
        });
        assert!(out[1].is_empty());
        assert_eq!(
            out[2].len(),
            1,
            "entered by its rate within the enter windows"
        );
        assert!(out[2..25].iter().all(|o| o.len() == 1), "flapped");
        // Idle from window 25: out after exactly exit_windows idle windows (25..=44).
        assert_eq!(out[43].len(), 1, "left before exit_windows");
        assert!(out[44].is_empty(), "{:?}", out[44]);
        // The rate criterion off: by time in flight alone it never enters.
        let mut c = IoClassifier::new(ClassifierConfig {
            enter_iops: 0.0,
            exit_iops: 0.0,
            ..ClassifierConfig::default()
        });
        let mut r = Synth::new(5);
        let out = run(&mut c, 40, |_| vec![request(&mut r)]);
        assert!(out.iter().all(|o| o.is_empty()), "{out:?}");
    }

    #[test]
    fn a_computing_task_with_a_few_requests_a_second_does_not_enter() {
        // 400 requests a second (two per window), 10% in flight, 60% on a CPU: below both.
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut r = Synth::new(6);
        let out = run(&mut c, 40, |_| vec![r.step(0.10, 2, 0.6)]);
        assert!(out.iter().all(|o| o.is_empty()), "{out:?}");
    }

    #[test]
    fn one_slow_request_does_not_enter() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut flush = Synth::new(9);
        // One 30 ms flush, then quiet: 100% in flight for six windows, but one request.
        let out = run(&mut c, 40, |w| match w {
            1 => vec![flush.step(1.0, 1, 0.0)],
            2..=6 => vec![flush.step(1.0, 0, 0.0)],
            _ => vec![flush.step(0.0, 0, 0.0)],
        });
        assert!(out.iter().all(|o| o.is_empty()), "{out:?}");
    }

    #[test]
    fn a_task_with_a_request_every_few_windows_is_judged_on_longer_windows() {
        // A request/response server whose reads wait ~12 ms for a descheduled vCPU's
        // completion, then computes 0.5 ms: one request per 2.5 windows, never two in one.
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut server = Synth::new(12);
        let out = run(&mut c, 40, |w| {
            let ios = u64::from(w % 5 == 0 || w % 5 == 3);
            vec![server.step(0.95, ios, 0.05)]
        });
        let entered = out
            .iter()
            .position(|o| !o.is_empty())
            .expect("never entered");
        // Each window needs two requests (≤ 3 nominal windows), and two such windows.
        assert!(entered <= 12, "entered at window {entered}");
        assert!(out[entered..].iter().all(|o| o.len() == 1), "flapped");
        let t = &out[39][0];
        assert!(t.iops > 60.0 && t.iops < 100.0, "iops {}", t.iops);
        // Once it stops, windows with no I/O close on time: it leaves after the last
        // stretched window (≤ 50 nominal ones) and the usual 20 below, not after 20
        // stretched ones.
        let out: Vec<Vec<IoTask>> = (40..140u64)
            .map(|w| c.observe((w + 1) * 5 * MS, &[server.step(0.0, 0, 0.0)]))
            .collect();
        let left = out.iter().position(|o| o.is_empty()).expect("never left");
        assert!(left <= 71, "left after {left} windows");

        // The same server judged on windows that never stretch: never two requests in one.
        let mut fixed = IoClassifier::new(ClassifierConfig {
            max_window_ns: ClassifierConfig::default().window_ns,
            ..ClassifierConfig::default()
        });
        let mut server = Synth::new(12);
        let out = run(&mut fixed, 40, |w| {
            let ios = u64::from(w % 5 == 0 || w % 5 == 3);
            vec![server.step(0.95, ios, 0.05)]
        });
        assert!(out.iter().all(|o| o.is_empty()), "entered on fixed windows");
    }

    #[test]
    fn a_server_in_lock_step_with_deschedules_is_found_on_windows_of_a_sample() {
        // One request per 40 ms (a backend at 25 queries a second, each read waiting for the
        // completion vCPU's window), in flight 60% of the time: never two requests in 50 ms.
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut backend = Synth::new(12);
        let out = run(&mut c, 100, |w| {
            vec![backend.step(0.6, u64::from(w % 8 == 0), 0.02)]
        });
        let entered = out
            .iter()
            .position(|o| !o.is_empty())
            .expect("never entered");
        assert!(entered <= 40, "entered at window {entered} (200 ms)");
        let mut short = IoClassifier::new(ClassifierConfig {
            max_window_ns: 50 * MS,
            ..ClassifierConfig::default()
        });
        let mut backend = Synth::new(12);
        let out = run(&mut short, 100, |w| {
            vec![backend.step(0.6, u64::from(w % 8 == 0), 0.02)]
        });
        assert!(out.iter().all(|o| o.is_empty()), "entered on 50 ms windows");
    }

    #[test]
    fn kernel_threads_are_never_candidates() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut k = Synth::new(2);
        k.kernel = true;
        let out = run(&mut c, 10, |_| vec![k.step(1.0, 100, 0.5)]);
        assert!(out.iter().all(|o| o.is_empty()));
        assert!(!c.tracks(2));
    }

    #[test]
    fn load_levels_order_the_tasks() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let (mut a, mut b) = (Synth::new(1), Synth::new(2));
        let out = run(&mut c, 10, |_| {
            vec![a.step(0.4, 20, 0.1), b.step(0.9, 20, 0.1)]
        });
        let last = &out[9];
        assert_eq!(last.iter().map(|t| t.tid).collect::<Vec<_>>(), vec![2, 1]);
        assert!(last[0].load > last[1].load);
    }

    #[test]
    fn idle_threads_are_forgotten_and_exited_ones_dropped() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut a = Synth::new(1);
        c.observe(5 * MS, &[a.step(0.0, 1, 0.0)]);
        let idle = a.step(0.0, 0, 0.0);
        c.observe(10 * MS, std::slice::from_ref(&idle));
        assert!(c.tracks(1));
        c.observe(3_000 * MS, &[idle]);
        assert!(!c.tracks(1), "idle thread kept");
        let mut b = Synth::new(2);
        run(&mut c, 10, |_| vec![b.step(0.9, 20, 0.1)]);
        assert!(c.tracks(2));
        c.observe(4_000 * MS, &[]);
        assert!(!c.tracks(2), "exited thread kept");
    }

    #[test]
    fn cpu_heavy_async_io_is_not_io_bound_and_turning_cpu_bound_leaves() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut busy = Synth::new(3);
        // Always a request in flight (async I/O) while computing 95% of the time.
        let out = run(&mut c, 20, |_| vec![busy.step(1.0, 100, 0.95)]);
        assert!(out.iter().all(|o| o.is_empty()), "CPU-heavy thread entered");

        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut r = Synth::new(4);
        let out = run(&mut c, 40, |w| {
            vec![if w < 10 {
                r.step(0.8, 100, 0.1)
            } else {
                r.step(0.8, 100, 0.95)
            }]
        });
        assert_eq!(out[9].len(), 1);
        // Leaves after exactly exit_windows CPU-bound windows (10..=29).
        assert_eq!(out[28].len(), 1);
        assert!(out[29].is_empty(), "{:?}", out[29]);
    }

    #[test]
    fn hovering_around_the_enter_threshold_does_not_flap() {
        let cfg = ClassifierConfig::default();
        let (enter, exit) = (cfg.enter_fraction, cfg.exit_fraction);
        let mut c = IoClassifier::new(cfg);
        let mut r = Synth::new(6);
        // Just above, just below, alternating: never two windows above in a row. Then
        // three clear windows, then hovering between exit and enter: stays in. Two
        // requests a window (400 a second): the rate criterion is not what is tested.
        let out = run(&mut c, 60, |w| {
            let f = match w {
                0..30 if w % 2 == 0 => enter + 0.01,
                0..30 => enter - 0.01,
                30..33 => 0.9,
                _ => (enter + exit) / 2.0,
            };
            vec![r.step(f, 2, 0.1)]
        });
        assert!(
            out[..31].iter().all(|o| o.is_empty()),
            "entered without 2 windows above"
        );
        assert!(
            out[31..].iter().all(|o| o.len() == 1),
            "left between the thresholds"
        );
    }

    #[test]
    fn reused_tid_starts_over() {
        let mut c = IoClassifier::new(ClassifierConfig::default());
        let mut a = Synth::new(5);
        let out = run(&mut c, 5, |_| vec![a.step(0.9, 20, 0.1)]);
        assert_eq!(out[4].len(), 1);
        let fresh = Synth::new(5).step(0.9, 20, 0.1);
        assert!(c.observe(30 * MS, &[fresh]).is_empty());
    }

    #[test]
    fn the_completion_site_is_the_last_windows_share_of_remote_completions() {
        let mut c = IoClassifier::new(ClassifierConfig {
            window_ns: 5 * MS,
            ..ClassifierConfig::default()
        });
        let mut t = Synth::new(7);
        let mut out = Vec::new();
        // Every completion on another vCPU (one interrupt vector, the reader elsewhere)...
        for i in 1..=6 {
            let mut o = t.step(0.9, 100, 0.1);
            t.remote += 100;
            o.completions.remote = t.remote;
            out = c.observe(i * 5 * MS, &[o]);
        }
        let site = out.first().expect("an I/O-bound reader").completion;
        assert_eq!(site.count, 100);
        assert!((site.remote_fraction - 1.0).abs() < 1e-9, "{site:?}");
        // ...then every completion where it was submitted: the next window says so.
        let o = t.step(0.9, 100, 0.1);
        out = c.observe(7 * 5 * MS, &[o]);
        let site = out.first().expect("still I/O-bound").completion;
        assert_eq!(site.remote_fraction, 0.0, "{site:?}");
        assert_eq!(site.cpu, 1);
    }
}

//! The engine's first half: whether anything can gain (the contention gate), and so
//! whether the block programs track, pause between samples, or come off their
//! tracepoints. Never decides about tasks.

use os_layer::Mono;
use std::time::Duration;
use tracing::{debug, info, warn};
use vcpu_monitor::VcpuSnapshot;

use super::decision::{self, TrackingSwitch};
use super::{BlockTracking, Engine, HOLD_LEAD};
use crate::guard::{Contention, VcpuOut};
use crate::sampling;

/// What a sampled step does: nap at most this long, or switch the programs (the
/// switch's outcome says the nap).
enum SampleStep {
    Nap(Duration),
    Switch(TrackingSwitch),
}

impl Engine {
    /// Feeds the vCPUs' out times to the gate; says so when its judgement changes.
    pub(super) fn judge_contention(
        &mut self,
        now: Mono,
        vcpus: &[VcpuSnapshot],
        steal: &[(usize, u64)],
    ) {
        let was = (self.tracking.contended, self.out_together());
        let gate = self.cfg.gate_on_contention;
        let out: Vec<VcpuOut> = vcpus
            .iter()
            .map(|v| VcpuOut {
                inactive_ns: v.inactive_total_ns,
                covered_ns: v.covered_total_ns,
                steal_ns: steal.iter().find(|s| s.0 == v.cpu).map_or(0, |s| s.1),
            })
            .collect();
        // Judged without the gate too: whether vCPUs are descheduled at all decides
        // whether the programs may come off (`decide_detach`).
        let verdict = self.tracking.contention.observe(now, &out);
        self.tracking.contended = !gate || verdict;
        if (self.tracking.contended, self.out_together()) != was && gate {
            let c = &self.tracking.contention;
            info!(
                most_out = format!("{:.0}%", c.last_fraction * 100.0),
                others_running = format!("{:.0}%", c.last_covered * 100.0),
                "{}",
                if self.tracking.contended {
                    "vCPUs are descheduled while others run: moves may pay, the guard will probe"
                } else if self.out_together() {
                    "vCPUs are descheduled all at once: nowhere to move to; only tasks whose completions land on one vCPU are kept there"
                } else if c.last_fraction >= Contention::DEFAULT_MIN_FRACTION {
                    "vCPUs are descheduled all at once: nowhere to move to, no moves"
                } else {
                    "vCPUs run nearly all the time: nothing to gain, no moves"
                }
            );
        }
    }

    /// The gate judges no contention although vCPUs are out: they go out all at once, so
    /// no move towards a running vCPU can pay, but keeping a task on the vCPU its
    /// completions land on still can (its wake-up then waits for that vCPU's window
    /// alone, not for two; measured in `benches/RESULTS.md`).
    pub(super) fn out_together(&self) -> bool {
        self.cfg.gate_on_contention
            && self.cfg.follow_completions
            && !self.tracking.contended
            && self.tracking.contention.last_fraction >= Contention::DEFAULT_MIN_FRACTION
    }

    /// Whether the block programs should track now: finding I/O-bound tasks serves moves,
    /// keeps and the host agent's figures only. Moves need another vCPU running while one
    /// is out (contention), keeps only vCPUs out (`out_together`); an answering host agent
    /// can help wherever a vCPU is out at all (it keeps the vCPU carrying our I/O
    /// running), but where no vCPU is descheduled it has nothing to give either, and
    /// tracking for it would only cost every request.
    ///
    /// While the guard holds (moves measured not to pay), nothing is moved or measured
    /// until the next probe, so the programs pause (and come off where no vCPU is
    /// descheduled, `decide_detach`): a daemon that cannot help must cost nothing where
    /// it stays for days. They track again `HOLD_LEAD` before the probe, so that it finds
    /// the I/O-bound tasks.
    fn wants_tracking(&self, now: Mono, agent_answers: bool) -> (bool, bool) {
        let descheduled = self.tracking.contention.descheduled();
        let guard_holds = self
            .guard
            .as_ref()
            .is_some_and(|g| g.holds_past(now + HOLD_LEAD));
        let wants =
            ((!self.cfg.gate_on_contention || self.tracking.contended || self.out_together())
                && !guard_holds)
                || (agent_answers && descheduled);
        (wants, guard_holds)
    }

    /// Decides whether the block programs pause, resume or detach, as the gate, the guard
    /// and the sampling schedule say, and has `decision::switch_tracking` carry each switch
    /// out. A detach is carried out before the rest is decided: whether the programs still
    /// track after it decides what comes next. Returns whether tracking is wanted and the
    /// longest nap before the sample's end or the next sample.
    pub(super) fn steer_tracking(
        &mut self,
        now: Mono,
        agent_answers: bool,
        act: &mut impl BlockTracking,
    ) -> (bool, Duration) {
        let (wants, guard_holds) = self.wants_tracking(now, agent_answers);
        if wants && !self.tracking.wanted_tracking && !act.tracking() {
            // Something can gain again: sample at once rather than at the next period.
            if let Some(s) = self.cfg.schedule {
                self.tracking.sample_start = now
                    .checked_sub(s.every)
                    .unwrap_or(self.tracking.sample_start);
            }
        }
        self.tracking.wanted_tracking = wants;
        if wants {
            self.tracking.ever_wanted = true;
            self.tracking.quiet_since = None;
            if !act.attached() {
                info!("something to gain: the block programs go (back) on their tracepoints");
            }
        } else {
            let detach = self.decide_detach(now, guard_holds, act.attached());
            self.switch(now, detach, act);
        }
        if self.cfg.schedule.is_none() && wants != act.tracking() {
            self.switch(now, TrackingSwitch::Follow { track: wants }, act);
        }
        let nap_limit = match self.cfg.schedule {
            Some(s) => match self.decide_sample(now, s, wants, act) {
                SampleStep::Nap(nap) => nap,
                SampleStep::Switch(switch) => {
                    self.switch(now, switch, act).unwrap_or(Duration::MAX)
                }
            },
            None => Duration::MAX,
        };
        (wants, nap_limit)
    }

    /// Carries a switch out and notes its outcome; returns the nap a sample's switch
    /// leads to.
    fn switch(
        &mut self,
        now: Mono,
        switch: TrackingSwitch,
        act: &mut impl BlockTracking,
    ) -> Option<Duration> {
        let done = decision::switch_tracking(switch, act);
        self.note_switch(now, switch, done)
    }

    /// With nothing to gain for `detach_after`, the programs come off their tracepoints;
    /// the first window that could gain puts them back. The wait is there so that a
    /// workload that gains does not lose its tracking to one quiet window; a daemon that
    /// has had nothing to gain since it started has none to lose, and waiting would only
    /// make every request pay for programs that return at once (on a fast disk, 5% of
    /// its reads), so it detaches as soon as a window is judged. Never while vCPUs are
    /// descheduled (see below).
    fn decide_detach(&mut self, now: Mono, guard_holds: bool, attached: bool) -> TrackingSwitch {
        let Some(after) = self.cfg.detach_after else {
            return TrackingSwitch::None;
        };
        let quiet = now.since(*self.tracking.quiet_since.get_or_insert(now));
        if !attached || (self.tracking.ever_wanted && quiet < after) {
            return TrackingSwitch::None;
        }
        // Attaching again patches kernel text, and every CPU must answer the patch's IPI:
        // a vCPU the host has taken away answers only once it runs again, and the
        // attaching thread busy-waits meanwhile (`benches/RESULTS.md` "attaching its
        // programs under deschedules": 3:1 windows on a fast disk). So the programs come off only once a window has been
        // judged and saw no vCPU descheduled; where vCPUs are taken away they stay on,
        // paused, and nothing patches kernel text while they are.
        let c = &self.tracking.contention;
        if !c.judged() || c.descheduled() {
            return TrackingSwitch::None;
        }
        TrackingSwitch::Detach { quiet, guard_holds }
    }

    /// Sampled tracking: a sample of `s.length` at the start of every `s.every`, skipped
    /// while nothing can gain. Reads the programs (and their doorbell, which reading
    /// clears) but switches nothing.
    fn decide_sample(
        &mut self,
        now: Mono,
        s: sampling::Schedule,
        wants: bool,
        act: &mut impl BlockTracking,
    ) -> SampleStep {
        let into = now.since(self.tracking.sample_start);
        let follow_up = self.tracking.follow_up_at.is_some_and(|at| now >= at);
        // Only a loop that would sample reads the doorbell; otherwise it stays rung for
        // when something can gain again.
        let rung = wants && !act.tracking() && (act.take_doorbell() || follow_up);
        match s.step(act.tracking(), into, rung) {
            sampling::Step::Track(left) => SampleStep::Nap(left),
            // A task half-way through the classifier's enter windows (one issuing a
            // request every few ms needs most of a sample): the sample runs on, up to
            // twice its length, rather than leave it undecided for a whole period.
            sampling::Step::Pause if act.entering() && into < s.length * 2 => {
                SampleStep::Nap(s.length * 2 - into)
            }
            sampling::Step::Pause => SampleStep::Switch(TrackingSwitch::EndSample {
                schedule: s,
                into,
                wants,
            }),
            // Paused where a sample could help: look at the doorbell every poll.
            sampling::Step::Wait(left) if wants => {
                SampleStep::Nap(left.min(sampling::DOORBELL_POLL))
            }
            sampling::Step::Wait(left) => SampleStep::Nap(left),
            sampling::Step::Resume if !wants => {
                // Nothing to gain: skip this sample.
                self.tracking.sample_start = now;
                SampleStep::Nap(s.every)
            }
            sampling::Step::Resume => {
                if rung {
                    self.snap.early_samples += 1;
                    if follow_up {
                        debug!("the last sample placed tasks: sampling again");
                    } else {
                        debug!("a quiet thread issued block I/O: sampling now");
                    }
                }
                self.tracking.sample_start = now;
                self.tracking.follow_up_at = None;
                self.tracking.placed_in_sample = false;
                SampleStep::Switch(TrackingSwitch::StartSample {
                    schedule: s,
                    // A ring from before this sample: the sample sees that thread now.
                    clear_doorbell: !rung,
                })
            }
        }
    }

    /// Notes how a switch went: the state and the log lines it leads to; a failed one is
    /// counted and tried again at the next step. Returns the nap a sample's switch leads
    /// to.
    fn note_switch(
        &mut self,
        now: Mono,
        switch: TrackingSwitch,
        done: anyhow::Result<()>,
    ) -> Option<Duration> {
        let failed = match (switch, done) {
            (TrackingSwitch::None, _) => return None,
            (TrackingSwitch::Detach { quiet, guard_holds }, Ok(())) => {
                self.note_detached(quiet, guard_holds);
                return None;
            }
            (TrackingSwitch::Follow { .. }, Ok(())) => return None,
            (
                TrackingSwitch::EndSample {
                    schedule,
                    into,
                    wants,
                },
                Ok(()),
            ) => {
                debug!("sample over: block tracking paused");
                self.plan_follow_up(now, schedule);
                let left = schedule.every.saturating_sub(into);
                // From the pause on, the doorbell is looked at every poll.
                return Some(if wants {
                    left.min(sampling::DOORBELL_POLL)
                } else {
                    left
                });
            }
            (TrackingSwitch::StartSample { schedule, .. }, Ok(())) => return Some(schedule.length),
            (_, Err(e)) => e,
        };
        self.snap.detector_errors += 1;
        match switch {
            TrackingSwitch::Detach { .. } => {
                warn!("detaching the block programs failed: {failed:#}");
                None
            }
            TrackingSwitch::EndSample { .. } => {
                warn!("pausing block tracking failed: {failed:#}");
                Some(Duration::MAX)
            }
            TrackingSwitch::StartSample { schedule, .. } => {
                warn!("resuming block tracking failed: {failed:#}");
                Some(schedule.every)
            }
            _ => {
                warn!("switching block tracking failed: {failed:#}");
                None
            }
        }
    }

    /// The programs came off their tracepoints.
    fn note_detached(&mut self, quiet: Duration, guard_holds: bool) {
        // What the last sample found goes stale with no sample to come; the per-vCPU
        // counts stand still too, so the host is told nothing and the channel goes quiet
        // until something could gain.
        self.window.found.clear();
        info!(
            quiet_ms = quiet.as_millis() as u64,
            "{}: the block programs come off their tracepoints",
            if guard_holds {
                "moves do not pay here"
            } else if self.tracking.ever_wanted {
                "nothing to gain"
            } else {
                "nothing to gain yet"
            }
        )
    }

    /// At a sample's end: one that placed tasks is followed by another a sample's length
    /// later, up to `FOLLOW_UPS` in a row; one that placed none ends the run.
    fn plan_follow_up(&mut self, now: Mono, s: sampling::Schedule) {
        if !self.tracking.placed_in_sample {
            self.tracking.follow_ups = 0;
        } else if self.tracking.follow_ups < sampling::FOLLOW_UPS {
            self.tracking.follow_ups += 1;
            self.tracking.follow_up_at = Some(now + s.length);
        }
        self.tracking.placed_in_sample = false;
    }
}

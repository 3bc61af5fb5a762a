//! The move guard: measures online whether migrations pay, and stops them while they do
//! not (JUPITER's rule, dissertation ch. 4: a mechanism whose predictions keep failing
//! disables its own decisions). Moves pay only where a running vCPU is there to take a
//! task and the task's I/O can progress there; on a VM with no contention, with every vCPU
//! stolen at once, or where a request's completion waits for the vCPU that queued it
//! anyway, they are pure cost. The guard tells these apart by the guest's own I/O
//! progress, not by a model.
//!
//! A probe alternates epochs with moves and epochs without (ABBA order, so a trend does
//! not favour either side), comparing completed block requests per second. Moves are
//! trusted for `trust`, doubled by each probe in a row that confirms them up to
//! `max_trust`, when the median rate with moves beats the one without by
//! `min_gain` and moves won every pair of epochs (one lucky epoch is not a gain: in the
//! lab, on a VM with nothing to gain, 1 s rates vary by more than `min_gain`, and a
//! median-only rule trusted moves there by chance; two pairs each won by `DECISIVE_GAIN`
//! suffice); otherwise the daemon holds (tasks back on their original masks, the monitor
//! idle) for a back-off that doubles up to `max_hold`, then probes again. The first
//! pair that moves do not win ends the probe at once: the verdict cannot change, and where
//! moves cost (every contended lab scenario) the rest of the probe was pure cost.
//!
//! Pure: time and counters come in as plain values, so every verdict is reproducible.

use os_layer::Mono;
use std::time::Duration;

/// Settings of the guard.
#[derive(Clone, Debug)]
pub struct GuardConfig {
    pub epoch: Duration,
    /// Epoch pairs per probe (each pair: one with moves, one without).
    pub probe_pairs: usize,
    /// Moves must raise the I/O rate by at least this factor.
    pub min_gain: f64,
    pub trust: Duration,
    /// Each probe in a row that finds moves paying doubles the trust up to this. A probe
    /// where moves pay costs its epochs without them (1 s a probe where pins are kept with
    /// their completions): every 30 s that is 3% of the gain for good, the same verdict
    /// bought again and again. Doubling to 2 min brings it to 1% over 10 min; a changed
    /// workload is still judged within 2 min, and a VM that stops being descheduled is
    /// caught sooner by the contention gate, which stops moves within one window.
    pub max_trust: Duration,
    pub hold: Duration,
    pub max_hold: Duration,
    /// A guard's first judgement of moves that only keep tasks with their completions
    /// (`Burden::NotLose`) trusts them for `trust` and probes after, instead of probing
    /// at once: an application started while the daemon runs is helped from its first
    /// requests rather than through a probe's epochs without moves, which its start-up
    /// tasks (a shell, a readiness check loading binaries) begin before its first request.
    /// A loss still shows, at that first probe.
    pub trust_kept_first: bool,
    /// The first whole epoch after I/O-bound tasks appear is not counted (`settling`).
    pub settle: bool,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            epoch: Duration::from_secs(1),
            probe_pairs: 3,
            min_gain: 1.03,
            trust: Duration::from_secs(30),
            max_trust: Duration::from_secs(120),
            hold: Duration::from_secs(30),
            max_hold: Duration::from_secs(240),
            trust_kept_first: true,
            settle: true,
        }
    }
}

/// What a probe asks of moves before they are kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Burden {
    /// Moves chase running vCPUs (wake-ups, migrations, cold caches): kept only when they
    /// win every pair and raise the median rate by `min_gain`. The first pair they do not
    /// win ends the probe.
    #[default]
    Win,
    /// Moves only keep tasks on the vCPU that takes their completions, where the
    /// mechanism is known (each request needs one vCPU's window there instead of two):
    /// held back only when they lose every pair by `NOT_LOSE_MARGIN`. The first pair
    /// they do not lose so ends the probe, so where they pay the verdict comes after one
    /// pair.
    NotLose,
}

/// Under `Burden::NotLose` a pair counts against moves only where the rate without them
/// beats the one with them by this factor. One reader's rate in neighbouring seconds
/// swings by far more than `min_gain` on a vCPU taken away half the time (on the hard-IRQ
/// testbed, 4 KiB reads kept with their completions: 2.1k to 7.3k a second within one
/// run), so a small loss in a pair is noise, and a rule that held pins back at any loss
/// gave different verdicts on identical runs.
pub const NOT_LOSE_MARGIN: f64 = 1.15;

/// Under `Burden::Win`, moves that won each of the first `DECISIVE_PAIRS` pairs by this
/// factor are trusted without the probe's last pair, whose epoch without moves costs a
/// second of the gain. The first two pairs run in opposite orders (M H, H M), so a trend
/// in the rate cannot make both look won, and well beyond the swing of one second's rate
/// twice in a row is no chance reading. On a queue per vCPU the pairs moves won read
/// 1.6-2.1x in anti-phase and 1.2-1.3x on a KVM-like trace (`benches/RESULTS.md` "the
/// guard's decisive pairs"): the first end at two pairs, the second mostly take the whole
/// probe.
pub const DECISIVE_GAIN: f64 = 1.3;
const DECISIVE_PAIRS: usize = 2;

#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    /// Epoch `epoch` of the probe (0-based); moves are on in the ABBA pattern.
    Probing { epoch: usize },
    /// Moves paid in the last probe.
    Trusting { until: Mono },
    /// Moves did not pay: none until `until`.
    Holding { until: Mono },
}

/// What a probe concluded, for the log and the metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub pays: bool,
    /// Median completed requests per second with and without moves.
    pub with_moves: f64,
    pub without_moves: f64,
    /// How long the verdict holds.
    pub lasts: Duration,
}

pub struct MoveGuard {
    cfg: GuardConfig,
    phase: Phase,
    epoch_start: Option<(Mono, u64)>,
    with: Vec<f64>,
    without: Vec<f64>,
    /// How long the next paying verdict trusts moves: doubles while verdicts keep paying.
    trust: Duration,
    hold: Duration,
    burden: Burden,
    /// No I/O-bound task seen yet: nothing judged.
    fresh: bool,
    /// Probe epochs run without moves, in total: what probing cost where moves pay.
    without_moves: Duration,
    /// The next whole epoch is not counted: I/O-bound tasks have just appeared (or come
    /// back), and a task's rate ramps up over its first fraction of a second. On a KVM-like
    /// trace the reader was taken over ~250 ms after its first request and read 2-3k/s
    /// for 250-500 ms more, so the first epoch (with moves) lost to the second by 10-60%
    /// in most runs, and a probe ends at its first lost pair (`benches/RESULTS.md` "the
    /// guard's decisive pairs").
    settling: bool,
}

/// Moves on in probe epoch `e`: pairs alternate M H, H M, M H, ... (ABBA).
fn probe_moves(e: usize) -> bool {
    e.is_multiple_of(2) == (e / 2).is_multiple_of(2)
}

/// A pair moves lost beyond noise (`NOT_LOSE_MARGIN`).
fn clear_loss(with: f64, without: f64) -> bool {
    without > with * NOT_LOSE_MARGIN
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl MoveGuard {
    pub fn new(cfg: GuardConfig) -> Self {
        let (trust, hold) = (cfg.trust, cfg.hold);
        let settling = cfg.settle;
        MoveGuard {
            cfg,
            phase: Phase::Probing { epoch: 0 },
            epoch_start: None,
            with: Vec::new(),
            without: Vec::new(),
            trust,
            hold,
            burden: Burden::Win,
            fresh: true,
            without_moves: Duration::ZERO,
            settling,
        }
    }

    /// What the probe in progress (or the next) asks of moves: the caller knows what its
    /// moves are for.
    pub fn set_burden(&mut self, burden: Burden) {
        self.burden = burden;
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Whether it is measuring now (and so needs a look every epoch).
    pub fn probing(&self) -> bool {
        matches!(self.phase, Phase::Probing { .. })
    }

    /// Whether moves stay on hold past `t`: until then nothing is decided or measured,
    /// so nothing needs to be tracked either.
    pub fn holds_past(&self, t: Mono) -> bool {
        matches!(self.phase, Phase::Holding { until } if until > t)
    }

    /// The time its probes ran without moves, epochs measured so far.
    pub fn time_without_moves(&self) -> Duration {
        self.without_moves
    }

    /// Whether the daemon may move tasks now.
    pub fn moves_allowed(&self) -> bool {
        match self.phase {
            Phase::Probing { epoch } => probe_moves(epoch),
            Phase::Trusting { .. } => true,
            Phase::Holding { .. } => false,
        }
    }

    /// Feeds the cumulative count of completed block requests at `now`. `busy` says
    /// whether I/O-bound tasks exist: without them there is nothing to judge, and an
    /// epoch in progress is dropped. Returns a verdict when a probe ends.
    pub fn observe(&mut self, now: Mono, completed: u64, busy: bool) -> Option<Verdict> {
        if !busy {
            self.epoch_start = None;
            self.settling = self.cfg.settle;
            return None;
        }
        if std::mem::take(&mut self.fresh)
            && self.cfg.trust_kept_first
            && self.burden == Burden::NotLose
        {
            self.phase = Phase::Trusting {
                until: now + self.cfg.trust,
            };
            return None;
        }
        match self.phase {
            Phase::Trusting { until } | Phase::Holding { until } => {
                if now >= until {
                    self.start_probe(now, completed);
                }
                None
            }
            Phase::Probing { epoch } => {
                let Some((t0, c0)) = self.epoch_start else {
                    self.epoch_start = Some((now, completed));
                    return None;
                };
                let dt = now.since(t0);
                if dt < self.cfg.epoch {
                    return None;
                }
                if std::mem::take(&mut self.settling) {
                    self.epoch_start = Some((now, completed));
                    return None;
                }
                let rate = completed.saturating_sub(c0) as f64 / dt.as_secs_f64();
                if probe_moves(epoch) {
                    self.with.push(rate);
                } else {
                    self.without.push(rate);
                    self.without_moves += dt;
                }
                self.epoch_start = Some((now, completed));
                // A pair that settles the verdict ends the probe: under `Win` one that
                // moves did not win (every pair must win) or the last of `DECISIVE_PAIRS`
                // won by `DECISIVE_GAIN`, under `NotLose` one they did not clearly lose
                // (every pair must, to hold them back).
                let pair_done = self.with.len() == self.without.len();
                let settled = pair_done
                    && match (self.with.last(), self.without.last()) {
                        (Some(&w), Some(&wo)) => match self.burden {
                            Burden::Win => w <= wo || self.decisive(),
                            Burden::NotLose => !clear_loss(w, wo),
                        },
                        _ => false,
                    };
                if epoch + 1 < 2 * self.cfg.probe_pairs && !settled {
                    self.phase = Phase::Probing { epoch: epoch + 1 };
                    return None;
                }
                Some(self.conclude(now))
            }
        }
    }

    /// Moves won each of the first `DECISIVE_PAIRS` pairs by `DECISIVE_GAIN`.
    fn decisive(&self) -> bool {
        self.with.len() == DECISIVE_PAIRS
            && self
                .with
                .iter()
                .zip(&self.without)
                .all(|(&w, &wo)| w >= wo * DECISIVE_GAIN)
    }

    fn start_probe(&mut self, now: Mono, completed: u64) {
        // Busy all along (trusted or held): the rate is the tasks' steady one.
        self.settling = false;
        self.phase = Phase::Probing { epoch: 0 };
        self.epoch_start = Some((now, completed));
        self.with.clear();
        self.without.clear();
    }

    fn conclude(&mut self, now: Mono) -> Verdict {
        // Epochs were pushed in order, so the k-th of each side form pair k.
        let pairs = || self.with.iter().zip(&self.without);
        let won_every_pair = pairs().all(|(w, wo)| w > wo);
        let lost_every_pair = pairs().all(|(&w, &wo)| clear_loss(w, wo));
        let with_moves = median(std::mem::take(&mut self.with));
        let without_moves = median(std::mem::take(&mut self.without));
        let pays = match self.burden {
            Burden::Win => {
                won_every_pair
                    && with_moves > 0.0
                    && with_moves >= without_moves * self.cfg.min_gain
            }
            Burden::NotLose => !lost_every_pair,
        };
        let lasts = if pays {
            let trust = self.trust;
            self.trust = (self.trust * 2).min(self.cfg.max_trust);
            self.hold = self.cfg.hold;
            self.phase = Phase::Trusting { until: now + trust };
            trust
        } else {
            let hold = self.hold;
            self.trust = self.cfg.trust;
            self.hold = (self.hold * 2).min(self.cfg.max_hold);
            self.phase = Phase::Holding { until: now + hold };
            hold
        };
        Verdict {
            pays,
            with_moves,
            without_moves,
            lasts,
        }
    }
}

/// Whether moves have anything to gain, judged over each `window`:
/// - some vCPU was out for at least `min_fraction` of the time, as the monitor saw it or as
///   the host's paravirtual steal clock reports it, whichever is more: on a VM whose vCPUs run
///   (nearly) all the time there is no running vCPU to prefer. In the lab a VM alone on
///   its host CPUs still loses 9% of each vCPU to QEMU's own threads; two VMs per host
///   CPU, 35%; host steal 11 of every 22 ms, 50%.
/// - and while vCPUs were out, another one was seen running for at least `min_covered` of
///   that time. A hypervisor that takes all vCPUs at once (in phase) leaves nowhere to
///   move to, however much each one is out; a probe there only costs. Only the monitor
///   sees when a vCPU was out, so this share is of the time it saw out: steal totals
///   cannot tell two vCPUs out together from two out in turn.
///
/// A window far on the other side of `min_covered` (twice it, or under half of it) or
/// with no vCPU out at all changes the judgement at once; one near it only when
/// `WINDOWS_TO_CHANGE` windows in a row say so: the monitor places a gap's edges to
/// within half a timer tick, so one window of vCPUs out together can look partly covered
/// by chance, and a schedule half in phase reads near the line. The guard does not even
/// probe while either fails.
#[derive(Clone, Debug)]
pub struct Contention {
    window: Duration,
    min_fraction: f64,
    min_covered: f64,
    start: Option<(Mono, Vec<VcpuOut>)>,
    contended: bool,
    /// Whole windows in a row whose own judgement differed from `contended`.
    against: u32,
    /// Largest fraction of the last window any vCPU was out.
    pub last_fraction: f64,
    /// Share of the last window's out time during which another vCPU ran.
    pub last_covered: f64,
    /// Whole windows judged so far.
    windows: u64,
}

/// One vCPU's cumulative descheduled time as the monitor saw it, the part of it another
/// vCPU ran through, and the host's steal time (0 where it reports none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VcpuOut {
    pub inactive_ns: u64,
    pub covered_ns: u64,
    pub steal_ns: u64,
}

impl Contention {
    pub const DEFAULT_MIN_FRACTION: f64 = 0.15;
    /// The monitor's error at a gap's edges is up to half a timer tick (2 ms at 250 Hz)
    /// each; measured on a 250 Hz guest whose two vCPUs are taken away in hard-IRQ
    /// context 10 of every 20 ms (per 10 s, both vCPUs): in phase 5% covered, and up to
    /// 15% in single 2 s windows; each period in or out of phase at random 33%; Xen-like
    /// independent 30 ms runs and gaps 59%; KVM-like 3 ms 62%; anti-phase 99%. In the
    /// nested TCG lab (where the guest daemon has nothing to gain, see its results) host
    /// steal in phase read 1–7%, a quarter period apart 15–28%, two VMs per host CPU
    /// 11–23%.
    pub const DEFAULT_MIN_COVERED: f64 = 0.20;
    /// Whole windows in a row near `min_covered` that must judge otherwise before the
    /// judgement changes.
    pub const WINDOWS_TO_CHANGE: u32 = 2;

    pub fn new(window: Duration, min_fraction: f64, min_covered: f64) -> Self {
        Contention {
            window,
            min_fraction,
            min_covered,
            start: None,
            contended: false,
            against: 0,
            last_fraction: 0.0,
            last_covered: 0.0,
            windows: 0,
        }
    }

    /// Whether a whole window has been judged: before, `last_fraction` says nothing.
    pub fn judged(&self) -> bool {
        self.windows > 0
    }

    /// Whether the last whole window saw a vCPU descheduled for `min_fraction` of it.
    pub fn descheduled(&self) -> bool {
        self.last_fraction >= self.min_fraction
    }

    /// Feeds each vCPU's cumulative out time; returns whether the last whole window was
    /// contended (false until one has passed).
    pub fn observe(&mut self, now: Mono, vcpus: &[VcpuOut]) -> bool {
        match &self.start {
            Some((t0, before)) if before.len() == vcpus.len() => {
                let dt = now.since(*t0);
                if dt >= self.window {
                    // The vCPUs' counters are cumulative ns on the board's clock.
                    let dt_ns = dt.as_nanos() as f64;
                    let (mut out, mut covered) = (0u64, 0u64);
                    self.last_fraction = 0.0;
                    for (b, n) in before.iter().zip(vcpus) {
                        let d_out = n.inactive_ns.saturating_sub(b.inactive_ns);
                        let d_steal = n.steal_ns.saturating_sub(b.steal_ns);
                        out += d_out;
                        covered += n.covered_ns.saturating_sub(b.covered_ns).min(d_out);
                        self.last_fraction =
                            self.last_fraction.max(d_out.max(d_steal) as f64 / dt_ns);
                    }
                    self.last_covered = if out == 0 {
                        0.0
                    } else {
                        covered as f64 / out as f64
                    };
                    let out_at_all = self.last_fraction >= self.min_fraction;
                    let window = out_at_all && self.last_covered >= self.min_covered;
                    let clear = !out_at_all
                        || self.last_covered >= 2.0 * self.min_covered
                        || self.last_covered < self.min_covered / 2.0;
                    self.against = if window == self.contended {
                        0
                    } else {
                        self.against + 1
                    };
                    if self.against > 0 && (clear || self.against >= Self::WINDOWS_TO_CHANGE) {
                        self.contended = window;
                        self.against = 0;
                    }
                    self.start = Some((now, vcpus.to_vec()));
                    self.windows += 1;
                }
            }
            _ => {
                // vCPUs hot-added or removed: judge them afresh.
                self.start = Some((now, vcpus.to_vec()));
                self.contended = false;
                self.against = 0;
            }
        }
        self.contended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// A moment `t` ns after the clock's start: the tests keep time as plain ns.
    fn at(t: u64) -> Mono {
        Mono::from_ns(t)
    }

    fn ns(d: Duration) -> u64 {
        d.as_nanos() as u64
    }

    /// A guard whose first epoch counts: the probe's own rules, without the settling.
    fn guard() -> MoveGuard {
        MoveGuard::new(GuardConfig {
            trust_kept_first: false,
            settle: false,
            ..GuardConfig::default()
        })
    }

    #[test]
    fn the_first_epoch_after_tasks_appear_is_not_counted() {
        let settling = || {
            MoveGuard::new(GuardConfig {
                trust_kept_first: false,
                ..GuardConfig::default()
            })
        };
        let mut g = settling();
        let (mut t, mut c) = (0, 0);
        // The task's start: 100 a second, then 1000 with or without moves. Counted, the
        // start would lose the first pair for moves and hold them.
        let mut n = 0;
        let v = probe(&mut g, &mut t, &mut c, |m| {
            n += 1;
            match (m, n) {
                (_, 1) => 100,
                (true, _) => 1100,
                (false, _) => 1000,
            }
        });
        assert!(v.pays, "{v:?}");
        assert_eq!(n, 7, "one epoch settling, then three pairs");
        // A probe after a hold or a trust does not settle: the tasks were busy all along.
        let mut g = settling();
        let (mut t, mut c, mut n) = (0, 0, 0);
        let v = probe(&mut g, &mut t, &mut c, |_| {
            n += 1;
            1000
        });
        assert!(!v.pays);
        assert_eq!(n, 3, "settling, then one pair that moves did not win");
        t += ns(v.lasts);
        n = 0;
        let v = probe(&mut g, &mut t, &mut c, |_| {
            n += 1;
            1000
        });
        assert!(!v.pays);
        assert_eq!(n, 2, "after the hold: one pair");
    }

    #[test]
    fn keeping_with_completions_is_trusted_first_and_probed_after_the_trust() {
        let mut g = MoveGuard::new(GuardConfig::default());
        g.set_burden(Burden::NotLose);
        assert!(g.probing() && g.moves_allowed());
        assert_eq!(
            g.observe(at(5 * S), 0, false),
            None,
            "no task: nothing judged"
        );
        assert!(g.probing());
        assert_eq!(g.observe(at(6 * S), 0, true), None);
        assert_eq!(
            g.phase(),
            &Phase::Trusting {
                until: at(6 * S + ns(GuardConfig::default().trust))
            }
        );
        assert!(g.moves_allowed(), "kept from the first task on");
        // The trust over, a probe as usual: its epoch without moves comes.
        let end = 6 * S + ns(GuardConfig::default().trust);
        assert_eq!(g.observe(at(end), 100, true), None);
        assert!(g.probing());
        assert_eq!(g.observe(at(end + S), 1000, true), None);
        assert!(!g.moves_allowed(), "the probe's epoch without moves");
        // Moves that must win are probed at once, trusted first or not.
        let mut g = MoveGuard::new(GuardConfig::default());
        g.set_burden(Burden::Win);
        assert_eq!(g.observe(at(S), 0, true), None);
        assert!(g.probing());
    }

    /// Drives whole 1 s epochs; `rate(moves)` is the I/O rate the "VM" delivers.
    fn probe(
        g: &mut MoveGuard,
        t: &mut u64,
        c: &mut u64,
        mut rate: impl FnMut(bool) -> u64,
    ) -> Verdict {
        g.observe(at(*t), *c, true);
        loop {
            let moves = g.moves_allowed();
            *t += S;
            *c += rate(moves);
            if let Some(v) = g.observe(at(*t), *c, true) {
                return v;
            }
        }
    }

    #[test]
    fn a_hold_is_seen_until_its_end_and_never_while_probing_or_trusting() {
        let mut g = guard();
        let (mut t, mut c) = (0, 0);
        assert!(!g.holds_past(at(t)), "a new guard probes first");
        let v = probe(&mut g, &mut t, &mut c, |_| 100);
        assert!(!v.pays);
        let end = t + ns(v.lasts);
        assert!(g.holds_past(at(t)) && g.holds_past(at(end - 1)));
        assert!(
            !g.holds_past(at(end)),
            "the hold ends when its probe is due"
        );
        // The next probe starts at the end of the hold; moves that pay end the hold.
        t = end;
        g.observe(at(t), c, true);
        let v = probe(
            &mut g,
            &mut t,
            &mut c,
            |moves| if moves { 200 } else { 100 },
        );
        assert!(v.pays);
        assert!(!g.holds_past(at(t)));
    }

    #[test]
    fn epochs_alternate_abba() {
        let on: Vec<bool> = (0..6).map(probe_moves).collect();
        assert_eq!(on, [true, false, false, true, true, false]);
    }

    #[test]
    fn moves_that_pay_are_trusted_then_probed_again() {
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 1500 } else { 1000 });
        assert!(v.pays);
        assert_eq!((v.with_moves, v.without_moves), (1500.0, 1000.0));
        assert!(g.moves_allowed());
        assert!(matches!(g.phase(), Phase::Trusting { .. }));
        // After the trust period a new probe starts.
        g.observe(at(t + 31 * S), c, true);
        assert_eq!(g.phase(), &Phase::Probing { epoch: 0 });
    }

    #[test]
    fn moves_that_do_not_pay_stop_with_a_growing_back_off() {
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 990 } else { 1000 });
        assert!(!v.pays);
        assert_eq!(ns(v.lasts), 30 * S);
        assert!(!g.moves_allowed());
        t += 30 * S;
        g.observe(at(t), c, true);
        assert!(g.moves_allowed(), "probing again with moves first");
        // A gain below min_gain is no gain: noise must not turn moves on.
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 1020 } else { 1000 });
        assert!(!v.pays);
        assert_eq!(ns(v.lasts), 60 * S, "the back-off doubled");
        // A paying probe resets the back-off.
        t += 60 * S;
        g.observe(at(t), c, true);
        assert!(probe(&mut g, &mut t, &mut c, |m| if m { 2000 } else { 1000 }).pays);
        t += 30 * S;
        g.observe(at(t), c, true);
        let v = probe(&mut g, &mut t, &mut c, |_| 1000);
        assert_eq!(ns(v.lasts), 30 * S);
    }

    #[test]
    fn each_confirming_probe_doubles_the_trust_up_to_its_cap_and_a_loss_resets_it() {
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        let mut lasts = Vec::new();
        for _ in 0..4 {
            let v = probe(&mut g, &mut t, &mut c, |m| if m { 2000 } else { 1000 });
            assert!(v.pays);
            lasts.push(ns(v.lasts) / S);
            t += ns(v.lasts);
            g.observe(at(t), c, true);
        }
        assert_eq!(lasts, [30, 60, 120, 120]);
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 900 } else { 1000 });
        assert!(!v.pays);
        t += ns(v.lasts);
        g.observe(at(t), c, true);
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 2000 } else { 1000 });
        assert_eq!(
            ns(v.lasts),
            30 * S,
            "a losing verdict starts the trust over"
        );
    }

    #[test]
    fn pins_that_keep_paying_cost_at_most_two_percent_of_ten_minutes() {
        // As the daemon runs a kept reader: trusted first, then probed under NotLose,
        // every probe ending at its first pair. The probes' epochs without moves are the
        // gain given up; the steady-state target is <= 2% of 10 minutes.
        let mut g = MoveGuard::new(GuardConfig {
            settle: false,
            ..GuardConfig::default()
        });
        g.set_burden(Burden::NotLose);
        let (mut t, mut c, mut verdicts) = (0, 0, 0);
        while t < 600 * S {
            c += if g.moves_allowed() { 2000 } else { 1000 };
            if g.observe(at(t), c, true).is_some() {
                verdicts += 1;
            }
            t += S / 10;
        }
        let share = g.time_without_moves().as_secs_f64() / 600.0;
        assert!(
            verdicts >= 4,
            "{verdicts} probes in 10 min: the guard still looks"
        );
        assert!(
            share <= 0.02,
            "{:.1}% of 10 min without moves",
            100.0 * share
        );
    }

    #[test]
    fn the_time_probes_run_without_moves_adds_up_over_probes() {
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        assert_eq!(g.time_without_moves(), Duration::ZERO);
        // Moves win decisively: two pairs, one epoch of each without moves.
        assert!(probe(&mut g, &mut t, &mut c, |m| if m { 2000 } else { 1000 }).pays);
        assert_eq!(g.time_without_moves(), Duration::from_secs(2));
        // Trusted: no probe, no time without moves.
        g.observe(at(t + 10 * S), c, true);
        assert_eq!(g.time_without_moves(), Duration::from_secs(2));
        // The next probe, lost at its first pair: one more epoch without moves.
        t += 31 * S;
        g.observe(at(t), c, true);
        assert!(!probe(&mut g, &mut t, &mut c, |m| if m { 900 } else { 1000 }).pays);
        assert_eq!(g.time_without_moves(), Duration::from_secs(3));
    }

    #[test]
    fn idle_time_does_not_count() {
        let (mut g, mut c) = (guard(), 0);
        g.observe(at(0), 0, true);
        // No I/O-bound task for a minute: the epoch in progress is dropped, not judged.
        assert_eq!(g.observe(at(60 * S), 0, false), None);
        assert_eq!(g.phase(), &Phase::Probing { epoch: 0 });
        g.observe(at(61 * S), c, true);
        c += 1000;
        g.observe(at(62 * S), c, true);
        assert_eq!(g.phase(), &Phase::Probing { epoch: 1 });
    }

    #[test]
    fn a_lost_pair_ends_the_probe_at_once() {
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        // One probe at fixed rates with and without moves: its verdict and its epochs.
        let mut run = |g: &mut MoveGuard, with: u64, without: u64| {
            let mut epochs = 0;
            let v = probe(g, &mut t, &mut c, |m| {
                epochs += 1;
                if m {
                    with
                } else {
                    without
                }
            });
            t += ns(v.lasts);
            g.observe(at(t), c, true);
            (v, epochs)
        };
        let (v, epochs) = run(&mut g, 900, 1000);
        assert!(!v.pays);
        assert_eq!(epochs, 2, "one pair decides: moves lost it");
        assert_eq!((v.with_moves, v.without_moves), (900.0, 1000.0));
        assert_eq!(ns(v.lasts), 30 * S, "a hold, as after a whole probe");
        // A tie is not a win either.
        let (v, epochs) = run(&mut g, 1000, 1000);
        assert!(!v.pays);
        assert_eq!(epochs, 2);
        assert_eq!(ns(v.lasts), 60 * S, "the back-off doubles as before");
        // Pairs that moves win go on to the end of the probe...
        let (v, epochs) = run(&mut g, 1200, 1000);
        assert!(v.pays);
        assert_eq!(epochs, 6);
        // ... unless the first two were won by DECISIVE_GAIN: the last pair is skipped.
        let (v, epochs) = run(&mut g, 1300, 1000);
        assert!(v.pays);
        assert_eq!(epochs, 4, "two decisive pairs end the probe");
        assert_eq!((v.with_moves, v.without_moves), (1300.0, 1000.0));
    }

    #[test]
    fn only_two_decisive_pairs_end_a_winning_probe_early() {
        // Epoch rates in ABBA order (M H H M M H); the probe's verdict and its epochs.
        let epochs = |rates: [u64; 6]| {
            let (mut g, mut t, mut c) = (guard(), 0, 0);
            let mut i = 0;
            let v = probe(&mut g, &mut t, &mut c, |_| {
                i += 1;
                rates[i - 1]
            });
            (v.pays, i)
        };
        // A first pair won by 1.5x, a second by 1.1x: the probe runs to its end.
        assert_eq!(epochs([1500, 1000, 1000, 1100, 1200, 1000]), (true, 6));
        // A first pair won by 1.1x, a second by 1.5x: the same.
        assert_eq!(epochs([1100, 1000, 1000, 1500, 1200, 1000]), (true, 6));
        // Both by 1.3x or more: over after the second pair.
        assert_eq!(epochs([1400, 1000, 1000, 1300, 0, 0]), (true, 4));
        // A rate falling 30% an epoch with moves doing nothing: the first pair looks
        // decisive, the second (H M) is lost, so no trend reads as two decisive wins.
        assert_eq!(epochs([1000, 700, 490, 343, 0, 0]), (false, 4));
    }

    #[test]
    fn one_lucky_epoch_is_not_a_gain() {
        // Median +10%, but one pair went the other way: noise, not a gain.
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        let mut n = 0;
        let v = probe(&mut g, &mut t, &mut c, |m| {
            n += 1;
            match (m, n) {
                (true, 5) => 900, // the third pair's epoch with moves
                (true, _) => 1100,
                (false, _) => 1000,
            }
        });
        assert!(!v.pays, "{v:?}");
        assert_eq!((v.with_moves, v.without_moves), (1100.0, 1000.0));
    }

    #[test]
    fn pins_kept_with_completions_are_held_back_only_by_a_clear_loss_in_every_pair() {
        // Losing 10% in every pair: within one reader's second-to-second swing, kept.
        let mut g = guard();
        g.set_burden(Burden::NotLose);
        let (mut t, mut c) = (0, 0);
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 900 } else { 1000 });
        assert!(v.pays, "{v:?}");
        assert_eq!(t, 2 * S, "settled by the first pair");
        // Losing a third in two pairs, 10% in the last: kept, after three pairs.
        let mut g = guard();
        g.set_burden(Burden::NotLose);
        let (mut t, mut c, mut n) = (0, 0, 0);
        let v = probe(&mut g, &mut t, &mut c, |m| {
            n += 1;
            match (m, n) {
                (true, 5) => 900,
                (true, _) => 650,
                (false, _) => 1000,
            }
        });
        assert!(v.pays, "{v:?}");
        assert_eq!(t, 6 * S);
        // Losing a third in every pair: held back.
        let mut g = guard();
        g.set_burden(Burden::NotLose);
        let (mut t, mut c) = (0, 0);
        let v = probe(&mut g, &mut t, &mut c, |m| if m { 650 } else { 1000 });
        assert!(!v.pays, "{v:?}");
        assert_eq!(t, 6 * S);
    }

    /// Out times, every vCPU's gaps fully covered by another's run.
    fn alternating(out_ns: &[u64]) -> Vec<VcpuOut> {
        out_ns
            .iter()
            .map(|&o| VcpuOut {
                inactive_ns: o,
                covered_ns: o,
                steal_ns: 0,
            })
            .collect()
    }

    fn contention() -> Contention {
        Contention::new(
            Duration::from_secs(2),
            Contention::DEFAULT_MIN_FRACTION,
            Contention::DEFAULT_MIN_COVERED,
        )
    }

    #[test]
    fn contention_is_the_busiest_vcpus_time_out_per_window() {
        let mut c = contention();
        assert!(
            !c.observe(at(0), &alternating(&[0, 0])),
            "nothing known before a window"
        );
        // 10% out on each vCPU: a VM alone on its host CPUs.
        assert!(
            !c.observe(at(S), &alternating(&[100_000_000, 100_000_000])),
            "mid-window"
        );
        assert!(!c.observe(at(2 * S), &alternating(&[200_000_000, 200_000_000])));
        assert!((c.last_fraction - 0.1).abs() < 1e-9);
        // One vCPU out half the time, every gap covered: contended at once.
        assert!(c.observe(at(4 * S), &alternating(&[1_200_000_000, 200_000_000])));
        assert!(c.observe(at(6 * S), &alternating(&[2_200_000_000, 200_000_000])));
        // The verdict stands until the next whole window.
        assert!(c.observe(at(7 * S), &alternating(&[2_200_000_000, 200_000_000])));
        // Nothing out at all: closed at once.
        assert!(!c.observe(at(8 * S), &alternating(&[2_200_000_000, 200_000_000])));
        // vCPUs hot-added: start over.
        assert!(!c.observe(at(9 * S), &alternating(&[0, 0, 0])));
    }

    #[test]
    fn vcpus_out_all_at_once_leave_nothing_to_gain() {
        let mut c = contention();
        let out = |inactive_ns, covered_ns| VcpuOut {
            inactive_ns,
            covered_ns,
            steal_ns: 0,
        };
        c.observe(at(0), &[out(0, 0), out(0, 0)]);
        // Both out half the time, in phase: only a tick's worth of each gap is covered.
        assert!(!c.observe(at(2 * S), &[out(S, S / 40), out(S, S / 50)]));
        assert!((c.last_fraction - 0.5).abs() < 1e-9);
        assert!((c.last_covered - 0.0225).abs() < 1e-9);
        // The same out time a quarter period apart: half of each gap has the other
        // running, far above the line: open at once.
        assert!(c.observe(
            at(4 * S),
            &[out(2 * S, S / 40 + S / 2), out(2 * S, S / 50 + S / 2)]
        ));
        assert!((c.last_covered - 0.5).abs() < 1e-9);
        assert!(c.observe(at(6 * S), &[out(3 * S, S / 40 + S), out(3 * S, S / 50 + S)]));
        // A covered count ahead of the out time (two reads apart) counts as fully covered.
        assert!(c.observe(at(8 * S), &[out(4 * S, 6 * S), out(4 * S, 6 * S)]));
        assert!((c.last_covered - 1.0).abs() < 1e-9);
    }

    #[test]
    fn one_window_near_the_line_does_not_flip_the_gate() {
        let mut c = contention();
        let out = |inactive_ns, covered_ns| VcpuOut {
            inactive_ns,
            covered_ns,
            steal_ns: 0,
        };
        // In phase, each vCPU out half of every 2 s window; the edges' error makes every
        // other window look 25% covered (measured: up to 15% on a 250 Hz guest).
        let (mut o, mut cov) = (0, 0);
        c.observe(at(0), &[out(0, 0), out(0, 0)]);
        for w in 1..=9u64 {
            o += S;
            cov += if w % 2 == 0 { S / 4 } else { S / 50 };
            assert!(
                !c.observe(at(2 * w * S), &[out(o, cov), out(o, cov)]),
                "window {w}"
            );
        }
        // Each period in or out of phase at random (a third covered): two windows open it,
        // and one that reads 15% does not close it.
        for w in 10..=15u64 {
            o += S;
            cov += if w == 13 { 3 * S / 20 } else { S / 3 };
            let open = c.observe(at(2 * w * S), &[out(o, cov), out(o, cov)]);
            assert_eq!(open, w >= 11, "window {w}");
        }
        // Plainly in phase again: closed at once.
        o += S;
        cov += S / 50;
        assert!(!c.observe(at(32 * S), &[out(o, cov), out(o, cov)]));
    }

    #[test]
    fn the_hosts_steal_counts_where_the_monitor_saw_less() {
        let mut c = contention();
        let out = |inactive_ns, covered_ns, steal_ns| VcpuOut {
            inactive_ns,
            covered_ns,
            steal_ns,
        };
        c.observe(at(0), &[out(0, 0, 0), out(0, 0, 0)]);
        // The monitor saw vCPU 0 out 10% (every gap covered), the host reports 40% of
        // steal: out enough, and what was seen says another vCPU ran meanwhile.
        assert!(c.observe(at(2 * S), &[out(S / 5, S / 5, 4 * S / 5), out(0, 0, 0)]));
        assert!((c.last_fraction - 0.4).abs() < 1e-9);
        assert!((c.last_covered - 1.0).abs() < 1e-9);
        // Steal alone, nothing seen: no telling whether another vCPU ran, no moves.
        assert!(!c.observe(at(4 * S), &[out(S / 5, S / 5, 2 * S), out(0, 0, S)]));
        assert!((c.last_fraction - 0.6).abs() < 1e-9);
    }

    #[test]
    fn no_io_at_all_never_pays() {
        let (mut g, mut t, mut c) = (guard(), 0, 0);
        assert!(!probe(&mut g, &mut t, &mut c, |_| 0).pays);
    }
}

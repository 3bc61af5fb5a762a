//! Schedules: the named families of deschedule patterns (anti-phase, in-phase, random
//! phase, random runs and gaps, replay of a file) and their text form, each turned into a
//! `Plan` for a set of CPUs and a run length. Random schedules are reproducible from their
//! seed alone.
//!
//! Owns the text form and the generators. Must never touch the kernel, and never produce a
//! plan that `Plan::validate` would refuse when the schedule's own parameters are sound
//! (random gaps are trimmed to the bounds rather than rejected by chance).

use crate::plan::{CpuPlan, Plan, Window, MAX_OUT_PERCENT, MAX_WINDOW_NS};
use anyhow::{anyhow, bail, Context, Result};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

const US: u64 = 1_000;
const SECOND_NS: u64 = 1_000_000_000;

/// How random runs and gaps are drawn around their means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dist {
    /// Memoryless, like a loaded hypervisor's slices and waits.
    Exponential,
    /// Uniform on `[0, 2 × mean]`.
    Uniform,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Each CPU out for `out` every `period`; CPU k (k-th of the list) at phase
    /// `k × period / ncpu`, so that with two CPUs and `out = period / 2` one always runs.
    AntiPhase { period: Duration, out: Duration },
    /// All CPUs out together for `out` every `period`.
    InPhase { period: Duration, out: Duration },
    /// Each CPU out for `out` once every `period`, at a new random phase per CPU and period.
    RandomPhase {
        period: Duration,
        out: Duration,
        seed: u64,
    },
    /// Independent per CPU: runs and gaps drawn around their means; gaps at most 50 ms.
    Random {
        mean_run: Duration,
        mean_gap: Duration,
        dist: Dist,
        seed: u64,
    },
    /// A file of `CPU START_US END_US` lines (`#` comments and blank lines ignored).
    Replay(PathBuf),
    /// No deschedules.
    None,
}

const FORMS: &str = "anti:PERIOD_US:OUT_US, in:PERIOD_US:OUT_US, rphase:PERIOD_US:OUT_US:SEED, \
                     random:RUN_US:GAP_US:exp|uniform:SEED, replay:PATH, none";

fn field(spec: &str, fields: &[&str], i: usize, name: &str) -> Result<u64> {
    let text = fields
        .get(i)
        .ok_or_else(|| anyhow!("schedule {spec:?}: {name} is missing (forms: {FORMS})"))?;
    text.parse()
        .map_err(|e| anyhow!("schedule {spec:?}: {name} {text:?} is not a whole number: {e}"))
}

fn periodic(spec: &str, f: &[&str], n: usize) -> Result<(Duration, Duration)> {
    if f.len() != n {
        bail!(
            "schedule {spec:?}: expected {} fields after {:?} (forms: {FORMS})",
            n - 1,
            f[0]
        );
    }
    let period = field(spec, f, 1, "PERIOD_US")?;
    let out = field(spec, f, 2, "OUT_US")?;
    if period == 0 {
        bail!("schedule {spec:?}: PERIOD_US must be positive");
    }
    if out == 0 || out > period {
        bail!("schedule {spec:?}: OUT_US {out} must be in 1..=PERIOD_US ({period})");
    }
    Ok((Duration::from_micros(period), Duration::from_micros(out)))
}

impl FromStr for Schedule {
    type Err = anyhow::Error;

    /// `anti:20000:10000`, `in:20000:10000`, `rphase:20000:10000:SEED`,
    /// `random:RUN_US:GAP_US:exp:SEED` (KVM-like `random:3000:3000:exp:1`, Xen-like
    /// `random:30000:30000:exp:1`), `replay:PATH`, `none`.
    fn from_str(spec: &str) -> Result<Schedule> {
        let f: Vec<&str> = spec.split(':').collect();
        match f[0] {
            "none" if f.len() == 1 => Ok(Schedule::None),
            "anti" => {
                let (period, out) = periodic(spec, &f, 3)?;
                Ok(Schedule::AntiPhase { period, out })
            }
            "in" => {
                let (period, out) = periodic(spec, &f, 3)?;
                Ok(Schedule::InPhase { period, out })
            }
            "rphase" => {
                let (period, out) = periodic(spec, &f, 4)?;
                let seed = field(spec, &f, 3, "SEED")?;
                Ok(Schedule::RandomPhase { period, out, seed })
            }
            "random" => {
                if f.len() != 5 {
                    bail!("schedule {spec:?}: expected random:RUN_US:GAP_US:exp|uniform:SEED");
                }
                let run = field(spec, &f, 1, "RUN_US")?;
                let gap = field(spec, &f, 2, "GAP_US")?;
                if run == 0 || gap == 0 {
                    bail!("schedule {spec:?}: RUN_US and GAP_US must be positive");
                }
                let dist = match f[3] {
                    "exp" => Dist::Exponential,
                    "uniform" => Dist::Uniform,
                    other => bail!(
                        "schedule {spec:?}: distribution {other:?} is neither exp nor uniform"
                    ),
                };
                let seed = field(spec, &f, 4, "SEED")?;
                Ok(Schedule::Random {
                    mean_run: Duration::from_micros(run),
                    mean_gap: Duration::from_micros(gap),
                    dist,
                    seed,
                })
            }
            "replay" if f.len() > 1 => {
                Ok(Schedule::Replay(PathBuf::from(&spec["replay:".len()..])))
            }
            other => bail!("schedule {spec:?}: unknown kind {other:?} (forms: {FORMS})"),
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |d: &Duration| d.as_micros();
        match self {
            Schedule::AntiPhase { period, out } => write!(f, "anti:{}:{}", us(period), us(out)),
            Schedule::InPhase { period, out } => write!(f, "in:{}:{}", us(period), us(out)),
            Schedule::RandomPhase { period, out, seed } => {
                write!(f, "rphase:{}:{}:{seed}", us(period), us(out))
            }
            Schedule::Random {
                mean_run,
                mean_gap,
                dist,
                seed,
            } => {
                let d = match dist {
                    Dist::Exponential => "exp",
                    Dist::Uniform => "uniform",
                };
                write!(f, "random:{}:{}:{d}:{seed}", us(mean_run), us(mean_gap))
            }
            Schedule::Replay(p) => write!(f, "replay:{}", p.display()),
            Schedule::None => write!(f, "none"),
        }
    }
}

/// SplitMix64: a seed must give the same windows on every build, whatever version of a
/// random-number crate the workspace resolves, so that a schedule is named by its text.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform on [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform on `0..=n`.
    fn below_incl(&mut self, n: u64) -> u64 {
        if n == u64::MAX {
            self.next()
        } else {
            self.next() % (n + 1)
        }
    }

    /// One draw around `mean_ns`, rounded to whole µs (the schedules' text unit).
    fn draw(&mut self, mean_ns: u64, dist: Dist) -> u64 {
        let x = match dist {
            Dist::Exponential => -(1.0 - self.unit()).ln() * mean_ns as f64,
            Dist::Uniform => self.unit() * 2.0 * mean_ns as f64,
        };
        (x / US as f64).round() as u64 * US
    }
}

fn stream(seed: u64, cpu: usize) -> SplitMix {
    let mut s = SplitMix(seed ^ (cpu as u64).wrapping_mul(0xa076_1d64_78bd_642f));
    s.next();
    s
}

fn periodic_windows(
    length: u64,
    period: u64,
    out: u64,
    mut phase: impl FnMut(u64) -> u64,
) -> Vec<Window> {
    let mut ws = Vec::new();
    let mut base = 0;
    while base < length {
        let start = base + phase(base);
        if start < length {
            ws.push(Window {
                start_ns: start,
                end_ns: (start + out).min(length),
            });
        }
        base += period;
    }
    ws
}

/// Random runs and gaps for one CPU: each gap is trimmed so that the CPU is never out more
/// than the allowed share of the second before the gap's end, and to at most 50 ms.
fn random_windows(length: u64, run: u64, gap: u64, dist: Dist, rng: &mut SplitMix) -> Vec<Window> {
    let budget = SECOND_NS / 100 * MAX_OUT_PERCENT;
    let mut ws: Vec<Window> = Vec::new();
    let mut t = 0u64;
    loop {
        t += rng.draw(run, dist).max(US);
        if t >= length {
            break;
        }
        let len = rng.draw(gap, dist).min(MAX_WINDOW_NS).min(length - t) / US;
        // Out-time in the second before the gap's end never falls as the gap grows (each
        // ns more adds one ns out and drops at most one): search for the longest that fits.
        let fits = |len_us: u64| {
            let end = t + len_us * US;
            let from = end.saturating_sub(SECOND_NS);
            let before: u64 = ws
                .iter()
                .rev()
                .take_while(|w| w.end_ns > from)
                .map(|w| w.end_ns - w.start_ns.max(from))
                .sum();
            before + len_us * US <= budget
        };
        let (mut lo, mut hi) = (0u64, len);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let len = lo * US;
        if len > 0 {
            ws.push(Window {
                start_ns: t,
                end_ns: t + len,
            });
        }
        t += len;
    }
    ws
}

fn replay(path: &std::path::Path, cpus: &[usize], length: u64) -> Result<Vec<CpuPlan>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the replay file {}", path.display()))?;
    let mut plans: Vec<CpuPlan> = cpus
        .iter()
        .map(|&cpu| CpuPlan {
            cpu,
            windows: Vec::new(),
        })
        .collect();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), n + 1);
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 3 {
            bail!("{}: expected `CPU START_US END_US`, got {line:?}", at());
        }
        let num = |i: usize, name: &str| -> Result<u64> {
            f[i].parse()
                .map_err(|e| anyhow!("{}: {name} {:?} is not a whole number: {e}", at(), f[i]))
        };
        let (cpu, start, end) = (
            num(0, "CPU")? as usize,
            num(1, "START_US")?,
            num(2, "END_US")?,
        );
        let Some(p) = plans.iter_mut().find(|p| p.cpu == cpu) else {
            bail!("{}: CPU {cpu} is not one of the run's CPUs {cpus:?}", at());
        };
        let (start, end) = (start * US, end * US);
        // A file longer than the run is cut at the run's end.
        if start < length {
            p.windows.push(Window {
                start_ns: start,
                end_ns: end.min(length),
            });
        }
    }
    Ok(plans)
}

impl Schedule {
    /// The plan of this schedule for `cpus` over `length`, validated.
    pub fn plan(&self, cpus: &[usize], length: Duration) -> Result<Plan> {
        let length_ns = length.as_nanos() as u64;
        let ns = |d: &Duration| d.as_nanos() as u64;
        let n = cpus.len() as u64;
        let per_cpu = |f: &mut dyn FnMut(usize, usize) -> Vec<Window>| -> Vec<CpuPlan> {
            cpus.iter()
                .enumerate()
                .map(|(k, &cpu)| CpuPlan {
                    cpu,
                    windows: f(k, cpu),
                })
                .collect()
        };
        let cpu_plans = match self {
            Schedule::None => per_cpu(&mut |_, _| Vec::new()),
            Schedule::AntiPhase { period, out } => per_cpu(&mut |k, _| {
                let phase = ns(period) * k as u64 / n.max(1) / US * US;
                periodic_windows(length_ns, ns(period), ns(out), |_| phase)
            }),
            Schedule::InPhase { period, out } => {
                per_cpu(&mut |_, _| periodic_windows(length_ns, ns(period), ns(out), |_| 0))
            }
            Schedule::RandomPhase { period, out, seed } => per_cpu(&mut |_, cpu| {
                let mut rng = stream(*seed, cpu);
                let slack = (ns(period) - ns(out)) / US;
                periodic_windows(length_ns, ns(period), ns(out), |_| {
                    rng.below_incl(slack) * US
                })
            }),
            Schedule::Random {
                mean_run,
                mean_gap,
                dist,
                seed,
            } => per_cpu(&mut |_, cpu| {
                random_windows(
                    length_ns,
                    ns(mean_run),
                    ns(mean_gap),
                    *dist,
                    &mut stream(*seed, cpu),
                )
            }),
            Schedule::Replay(path) => replay(path, cpus, length_ns)?,
        };
        let plan = Plan {
            cpus: cpu_plans,
            length_ns,
        };
        plan.validate()
            .with_context(|| format!("schedule {self} over {length:?}"))?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn parse(s: &str) -> Schedule {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e:#}"))
    }

    #[test]
    fn text_forms_round_trip() {
        for s in [
            "anti:20000:10000",
            "in:20000:10000",
            "rphase:20000:10000:7",
            "random:3000:3000:exp:1",
            "random:30000:30000:uniform:2",
            "replay:/tmp/x y",
            "none",
        ] {
            assert_eq!(parse(s).to_string(), s);
        }
    }

    #[test]
    fn bad_text_names_the_field() {
        for (s, words) in [
            ("anti:20000:x", &["OUT_US", "\"x\""][..]),
            ("anti:20000", &["expected 2 fields"][..]),
            ("in:0:10", &["PERIOD_US must be positive"][..]),
            ("in:100:200", &["OUT_US 200"][..]),
            ("rphase:20000:10000", &["expected 3 fields"][..]),
            ("random:3000:3000:gauss:1", &["\"gauss\""][..]),
            ("random:3000:0:exp:1", &["GAP_US"][..]),
            (
                "steal:1:2",
                &["unknown kind \"steal\"", "anti:PERIOD_US"][..],
            ),
        ] {
            let e = format!("{:#}", s.parse::<Schedule>().expect_err(s));
            for w in words {
                assert!(e.contains(w), "{s}: {e:?} lacks {w:?}");
            }
        }
    }

    #[test]
    fn anti_phase_keeps_one_cpu_running() {
        let p = parse("anti:20000:10000")
            .plan(&[0, 1], Duration::from_secs(1))
            .unwrap();
        assert_eq!(p.cpus[0].windows.len(), 50);
        assert_eq!(
            p.cpus[1].windows[0],
            Window {
                start_ns: 10 * MS,
                end_ns: 20 * MS
            }
        );
        for t in (0..1000 * MS).step_by(250_000) {
            assert_ne!(p.is_out(0, t), p.is_out(1, t), "at {t}");
        }
        assert_eq!(p.asked_ns(0), 500 * MS);
        assert_eq!(p.asked_ns(1), 500 * MS);
    }

    #[test]
    fn in_phase_takes_all_together() {
        let p = parse("in:20000:10000")
            .plan(&[0, 1], Duration::from_millis(100))
            .unwrap();
        assert_eq!(p.cpus[0].windows, p.cpus[1].windows);
        assert_eq!(p.cpus[0].windows.len(), 5);
    }

    #[test]
    fn random_phase_stays_in_its_period_and_repeats_from_its_seed() {
        let s = parse("rphase:20000:5000:42");
        let p = s.plan(&[0, 1], Duration::from_secs(2)).unwrap();
        assert_eq!(p, s.plan(&[0, 1], Duration::from_secs(2)).unwrap());
        assert_ne!(p.cpus[0].windows, p.cpus[1].windows);
        for c in &p.cpus {
            assert_eq!(c.windows.len(), 100);
            for (m, w) in c.windows.iter().enumerate() {
                let base = m as u64 * 20 * MS;
                assert!(w.start_ns >= base && w.end_ns <= base + 20 * MS, "{w}");
                assert_eq!(w.len_ns(), 5 * MS);
            }
        }
        let other = parse("rphase:20000:5000:43")
            .plan(&[0, 1], Duration::from_secs(2))
            .unwrap();
        assert_ne!(p, other);
    }

    #[test]
    fn random_runs_and_gaps_have_their_means_and_bounds() {
        for (spec, mean_ms) in [
            ("random:3000:3000:exp:1", 3.0),
            ("random:30000:30000:exp:5", 30.0),
        ] {
            let p = parse(spec).plan(&[0, 1], Duration::from_secs(60)).unwrap();
            for c in &p.cpus {
                let n = c.windows.len() as f64;
                let mean_gap = p.asked_ns(c.cpu) as f64 / n / 1e6;
                // Exponential gaps clamped at 50 ms and trimmed to 60%: a little below the mean.
                assert!(
                    mean_gap > mean_ms * 0.75 && mean_gap < mean_ms * 1.1,
                    "{spec}: {mean_gap}"
                );
                let share = p.asked_ns(c.cpu) as f64 / p.length_ns as f64;
                assert!(share > 0.35 && share < 0.55, "{spec}: {share}");
                assert!(c.windows.iter().all(|w| w.len_ns() <= MAX_WINDOW_NS));
            }
            assert_ne!(p.cpus[0].windows, p.cpus[1].windows);
        }
        let u = parse("random:6000:3000:uniform:3")
            .plan(&[0], Duration::from_secs(10))
            .unwrap();
        assert!(u.cpus[0].windows.iter().all(|w| w.len_ns() <= 6 * MS));
    }

    #[test]
    fn random_gaps_are_trimmed_to_the_share_not_refused() {
        // Mean gap 45 ms, mean run 5 ms: about 90% out if drawn freely.
        let p = parse("random:5000:45000:exp:9")
            .plan(&[0, 1], Duration::from_secs(5))
            .unwrap();
        for c in &p.cpus {
            let share = p.asked_ns(c.cpu) as f64 / p.length_ns as f64;
            assert!(share <= 0.6 && share > 0.5, "{share}");
        }
    }

    #[test]
    fn a_schedule_beyond_the_bounds_is_refused_naming_the_window() {
        let e = format!(
            "{:#}",
            parse("anti:100000:60000")
                .plan(&[0], Duration::from_secs(1))
                .unwrap_err()
        );
        assert!(e.contains("CPU 0 window 0") && e.contains("50 ms"), "{e}");
        let e = format!(
            "{:#}",
            parse("in:40000:30000")
                .plan(&[0], Duration::from_secs(2))
                .unwrap_err()
        );
        assert!(
            e.contains("CPU 0 window") && e.contains("60% allowed when a stretch"),
            "{e}"
        );
        // 75% in 15 ms stretches is within a CPU's bounds; on both CPUs in phase the
        // machine would stop 75% of the time, which only the machine-wide check sees.
        let p = parse("in:20000:15000")
            .plan(&[0, 1], Duration::from_secs(2))
            .expect("per CPU, short stretches may take 75%");
        let e = p.validate_on(&[0, 1]).unwrap_err().to_string();
        assert!(e.contains("every CPU would be out together"), "{e}");
        // The headline schedules at 2:1 still pass on the whole machine (a Xen-like plan
        // has both CPUs out together for up to tens of milliseconds).
        for spec in [
            "rphase:20000:10000:1",
            "random:30000:30000:exp:1",
            "random:3000:3000:exp:1",
        ] {
            parse(spec)
                .plan(&[0, 1], Duration::from_secs(60))
                .and_then(|p| p.validate_on(&[0, 1]))
                .unwrap_or_else(|e| panic!("{spec}: {e:#}"));
        }
    }

    #[test]
    fn replay_reads_its_file_and_names_bad_lines() {
        let dir = std::env::temp_dir().join(format!("irq-steal-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(
            &good,
            "# cpu start end\n0 1000 3000\n\n1 2000 2500 # short\n0 980000 1020000\n",
        )
        .unwrap();
        let p = Schedule::Replay(good.clone())
            .plan(&[0, 1], Duration::from_secs(1))
            .unwrap();
        assert_eq!(p.cpus[0].windows.len(), 2);
        assert_eq!(
            p.cpus[0].windows[1].end_ns,
            1000 * MS,
            "cut at the run's end"
        );
        assert_eq!(
            p.cpus[1].windows,
            vec![Window {
                start_ns: 2 * MS,
                end_ns: 2_500_000
            }]
        );
        let bad = dir.join("bad");
        std::fs::write(&bad, "0 1000 3000\n3 1 2\n").unwrap();
        let e = format!(
            "{:#}",
            Schedule::Replay(bad)
                .plan(&[0, 1], Duration::from_secs(1))
                .unwrap_err()
        );
        assert!(e.contains("bad:2") && e.contains("CPU 3"), "{e}");
        let e = format!(
            "{:#}",
            Schedule::Replay(dir.join("none"))
                .plan(&[0], Duration::from_secs(1))
                .unwrap_err()
        );
        assert!(e.contains("reading the replay file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

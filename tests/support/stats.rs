//! The benchmarks' statistics over repeated runs: medians, the ratio of two modes' medians
//! and the median of per-repetition (paired) ratios, each with a percentile-bootstrap
//! interval from a fixed seed, so the same runs always give the same interval. Pure: plain
//! numbers in, plain numbers out; it never measures or reads anything.

use serde::Serialize;

/// Resamples per bootstrap interval.
pub const RESAMPLES: usize = 2000;
/// The fixed seed of every bootstrap: identical runs give identical intervals.
pub const SEED: u64 = 0x05ee_d0f5_7ea1;

/// A point estimate with its 95% percentile-bootstrap interval.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub value: f64,
    pub lo: f64,
    pub hi: f64,
}

/// Median of the finite values; None when there is none.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

/// Largest over smallest finite value: 1.0 means every run agreed. None without values or
/// when the smallest is not positive (a run that did nothing has no finite spread).
pub fn spread(v: &[f64]) -> Option<f64> {
    let s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let lo = s.iter().copied().reduce(f64::min)?;
    let hi = s.iter().copied().reduce(f64::max)?;
    (lo > 0.0).then(|| hi / lo)
}

/// Fraction of the finite values that are at least `floor`.
pub fn fraction_at_least(v: &[f64], floor: f64) -> Option<f64> {
    let s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    (!s.is_empty()).then(|| s.iter().filter(|&&x| x >= floor).count() as f64 / s.len() as f64)
}

/// The bootstrap needs reproducible indices (a fixed seed), not cryptographic ones.
fn resample(rng: &mut fastrand::Rng, v: &[f64], out: &mut Vec<f64>) {
    out.clear();
    out.extend((0..v.len()).map(|_| v[rng.usize(..v.len())]));
}

/// 2.5% and 97.5% quantiles of the (finite) bootstrap statistics, nearest rank.
fn interval(mut stats: Vec<f64>) -> Option<(f64, f64)> {
    stats.retain(|x| x.is_finite());
    if stats.is_empty() {
        return None;
    }
    stats.sort_by(f64::total_cmp);
    let at = |q: f64| stats[((q * stats.len() as f64).ceil() as usize).clamp(1, stats.len()) - 1];
    Some((at(0.025), at(0.975)))
}

fn finite(v: &[f64]) -> Vec<f64> {
    v.iter().copied().filter(|x| x.is_finite()).collect()
}

/// median(a) / median(b), with the runs of each mode resampled independently
/// (`RESAMPLES` times, fixed seed). None when either side has no finite run or b's median
/// is not positive.
pub fn ratio_of_medians(a: &[f64], b: &[f64]) -> Option<Estimate> {
    let (a, b) = (finite(a), finite(b));
    let (ma, mb) = (median(&a)?, median(&b)?);
    if mb <= 0.0 {
        return None;
    }
    let mut rng = fastrand::Rng::with_seed(SEED);
    let (mut ra, mut rb) = (Vec::new(), Vec::new());
    let stats = (0..RESAMPLES)
        .map(|_| {
            resample(&mut rng, &a, &mut ra);
            resample(&mut rng, &b, &mut rb);
            match (median(&ra), median(&rb)) {
                (Some(x), Some(y)) if y > 0.0 => x / y,
                _ => f64::NAN,
            }
        })
        .collect();
    let (lo, hi) = interval(stats)?;
    Some(Estimate {
        value: ma / mb,
        lo,
        hi,
    })
}

/// The median of per-repetition ratios a[i] / b[i] (pairs with a missing or non-positive
/// side are left out), with a bootstrap interval of that median (pairs resampled). Pairing
/// cancels drift that affects both modes of one repetition alike.
pub fn paired_ratio(pairs: &[(f64, f64)]) -> Option<Estimate> {
    let ratios: Vec<f64> = pairs
        .iter()
        .filter(|(a, b)| a.is_finite() && b.is_finite() && *b > 0.0)
        .map(|(a, b)| a / b)
        .collect();
    let value = median(&ratios)?;
    let mut rng = fastrand::Rng::with_seed(SEED);
    let mut r = Vec::new();
    let stats = (0..RESAMPLES)
        .map(|_| {
            resample(&mut rng, &ratios, &mut r);
            median(&r).unwrap_or(f64::NAN)
        })
        .collect();
    let (lo, hi) = interval(stats)?;
    Some(Estimate { value, lo, hi })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
    }

    #[test]
    fn spread_and_fractions() {
        assert_eq!(spread(&[940.0, 8460.0, 4000.0]), Some(9.0));
        assert_eq!(spread(&[0.0, 3.0]), None);
        assert_eq!(fraction_at_least(&[1.0, 2.0, 3.0, 4.0], 2.5), Some(0.5));
        assert_eq!(fraction_at_least(&[], 1.0), None);
    }

    #[test]
    fn ratio_of_medians_finds_a_clear_gain_and_excludes_one() {
        let a = [
            7000.0, 7200.0, 6900.0, 7100.0, 7050.0, 6950.0, 7150.0, 7020.0,
        ];
        let b = [
            3500.0, 3600.0, 3450.0, 3550.0, 3520.0, 3480.0, 3580.0, 3510.0,
        ];
        let e = ratio_of_medians(&a, &b).unwrap();
        assert!((e.value - 2.0).abs() < 0.02, "{e:?}");
        assert!(e.lo > 1.9 && e.hi < 2.1, "{e:?}");
        assert!(e.lo <= e.value && e.value <= e.hi, "{e:?}");
    }

    #[test]
    fn ratio_of_medians_of_noisy_equal_modes_straddles_one() {
        let a = [
            900.0, 8400.0, 4000.0, 2500.0, 6000.0, 1200.0, 7000.0, 3300.0,
        ];
        let b = [
            8000.0, 1000.0, 3000.0, 6500.0, 2000.0, 5000.0, 4200.0, 950.0,
        ];
        let e = ratio_of_medians(&a, &b).unwrap();
        assert!(e.lo < 1.0 && e.hi > 1.0, "{e:?}");
    }

    #[test]
    fn bootstrap_is_reproducible() {
        let a = [1.0, 5.0, 2.0, 8.0, 3.0];
        let b = [2.0, 2.5, 4.0, 1.0, 3.0];
        assert_eq!(ratio_of_medians(&a, &b), ratio_of_medians(&a, &b));
        let p: Vec<_> = a.iter().copied().zip(b.iter().copied()).collect();
        assert_eq!(paired_ratio(&p), paired_ratio(&p));
    }

    #[test]
    fn ratio_needs_runs_on_both_sides_and_a_positive_baseline() {
        assert_eq!(ratio_of_medians(&[1.0], &[]), None);
        assert_eq!(ratio_of_medians(&[], &[1.0]), None);
        assert_eq!(ratio_of_medians(&[1.0], &[0.0]), None);
        let one = ratio_of_medians(&[3.0], &[2.0]).unwrap();
        assert_eq!((one.value, one.lo, one.hi), (1.5, 1.5, 1.5));
    }

    #[test]
    fn paired_ratio_cancels_drift_the_ratio_of_medians_keeps() {
        // Each repetition's two runs share a drift factor of up to 3x; within a pair the
        // first mode is always 1.2x the second.
        let drift = [1.0, 3.0, 1.5, 2.5, 0.8, 2.0, 1.1, 2.8];
        let pairs: Vec<(f64, f64)> = drift.iter().map(|d| (1200.0 * d, 1000.0 * d)).collect();
        let p = paired_ratio(&pairs).unwrap();
        assert!((p.value - 1.2).abs() < 1e-9, "{p:?}");
        assert!(
            (p.lo - 1.2).abs() < 1e-9 && (p.hi - 1.2).abs() < 1e-9,
            "{p:?}"
        );
        let (a, b): (Vec<f64>, Vec<f64>) = pairs.iter().copied().unzip();
        let r = ratio_of_medians(&a, &b).unwrap();
        assert!(r.hi - r.lo > 0.5, "unpaired interval should be wide: {r:?}");
    }

    #[test]
    fn paired_ratio_skips_broken_pairs() {
        let p = paired_ratio(&[(2.0, 1.0), (f64::NAN, 1.0), (3.0, 0.0), (4.0, 2.0)]).unwrap();
        assert_eq!(p.value, 2.0);
        assert_eq!(paired_ratio(&[(1.0, 0.0)]), None);
    }
}

//! The seeds of a benchmark's random schedules: repetition r draws seed r mod their number,
//! so the repetitions of a cell spread over several draws of the same schedule family
//! instead of replaying one draw (`--seeds 1,2,3`).

use anyhow::{ensure, Context, Result};
use irq_steal::Schedule;

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Seeds(Vec<u64>);

impl Default for Seeds {
    /// Three draws: the fewest a table of random schedules may rest on.
    fn default() -> Self {
        Seeds(vec![1, 2, 3])
    }
}

impl Seeds {
    /// `"1,2,3"`; `flag` names the flag in an error.
    pub fn parse(flag: &str, v: &str) -> Result<Seeds> {
        let seeds = crate::report::list(v)
            .iter()
            .map(|x| {
                x.parse()
                    .with_context(|| format!("{flag}: {x:?} is not a seed"))
            })
            .collect::<Result<Vec<u64>>>()?;
        ensure!(!seeds.is_empty(), "{flag}: no seed given");
        Ok(Seeds(seeds))
    }

    /// The seed of repetition `rep`.
    pub fn of_rep(&self, rep: usize) -> u64 {
        self.0[rep % self.0.len()]
    }

    /// Every named schedule (name, spec with `SEED`) of every repetition, parsed before the
    /// first run: `[schedule][rep]`; an error names the schedule and its filled spec.
    pub fn schedules(&self, named: &[(String, String)], reps: usize) -> Result<Vec<Vec<Schedule>>> {
        named
            .iter()
            .map(|(name, spec)| {
                (0..reps)
                    .map(|rep| {
                        let (spec, _) = self.fill(spec, rep);
                        spec.parse::<Schedule>()
                            .with_context(|| format!("schedule {name} ({spec})"))
                    })
                    .collect()
            })
            .collect()
    }

    /// `spec` with its `SEED` placeholder filled for repetition `rep`, and the seed where
    /// it had one.
    pub fn fill(&self, spec: &str, rep: usize) -> (String, Option<u64>) {
        let seed = self.of_rep(rep);
        let filled = spec.replace("SEED", &seed.to_string());
        let used = spec.contains("SEED").then_some(seed);
        (filled, used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_cycle_through_the_seeds_and_fixed_specs_take_none() {
        let s = Seeds::parse("--seeds", "4,9,2").unwrap();
        let drawn: Vec<u64> = (0..7).map(|r| s.of_rep(r)).collect();
        assert_eq!(drawn, [4, 9, 2, 4, 9, 2, 4]);
        assert_eq!(
            s.fill("rphase:20000:10000:SEED", 1),
            ("rphase:20000:10000:9".to_string(), Some(9))
        );
        assert_eq!(
            s.fill("anti:20000:10000", 1),
            ("anti:20000:10000".to_string(), None)
        );
        assert_eq!(Seeds::default().0, [1, 2, 3]);
    }

    #[test]
    fn every_repetition_gets_its_schedule_and_a_bad_spec_names_it() {
        let named = [("rphase".to_string(), "rphase:20000:10000:SEED".to_string())];
        let all = Seeds::default().schedules(&named, 4).unwrap();
        assert_eq!((all.len(), all[0].len()), (1, 4));
        let bad = [("odd".to_string(), "nonsense:SEED".to_string())];
        let e = format!("{:#}", Seeds::default().schedules(&bad, 2).unwrap_err());
        assert!(e.contains("schedule odd (nonsense:1)"), "{e}");
    }

    #[test]
    fn a_bad_seed_names_the_flag_and_the_value() {
        let e = Seeds::parse("--seeds", "1,x").unwrap_err().to_string();
        assert!(e.contains("--seeds") && e.contains("\"x\""), "{e}");
        assert!(Seeds::parse("--seeds", " , ").is_err());
    }
}

//! Where an I/O-bound task's requests complete, and so where it should run. A request
//! completes on the vCPU that takes its queue's interrupt, and a descheduled vCPU holds
//! that interrupt until it runs again. Two geometries exist:
//!
//! - **Fixed**: one interrupt vector for the whole disk (or for a group of vCPUs that
//!   includes the task's). The task's completions land on one vCPU wherever it submits
//!   from, so away from that vCPU it needs two vCPUs' windows per request; with it, one.
//!   Its home is that vCPU, running or not: moving it elsewhere cannot bring the
//!   completion sooner.
//! - **Follows the submitter**: a queue per vCPU; a completion lands where its request was
//!   submitted, so the task is best on a running vCPU, the classic vMigrater move.
//!
//! Known before any I/O from the kernel's queue map (`prior`), then learned per task from
//! its own completions (`CompletionSite`, measured by the block programs), sticky: a task
//! anchored on its completion vCPU submits only from there and its completions look local,
//! which says nothing new. Pure: no clock, no I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use task_detector::CompletionSite;

use crate::affinity::TaskId;

/// What a task's completions say about where it should run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Home {
    /// Not enough completions seen yet, or mixed.
    #[default]
    Unknown,
    /// Its completions land on this vCPU wherever it submits from.
    Fixed(usize),
    /// Its completions land where it submits.
    FollowsSubmitter,
}

#[derive(Clone, Debug)]
pub struct HomeConfig {
    /// Completions a window needs before it says anything.
    pub min_completions: u64,
    /// At least this share handled on another vCPU than the submitter's: a fixed vector.
    pub fixed_above: f64,
    /// At most this share: completions follow the submitter (unless anchored, see below).
    pub follows_below: f64,
}

impl Default for HomeConfig {
    fn default() -> Self {
        HomeConfig {
            min_completions: 20,
            fixed_above: 0.8,
            follows_below: 0.2,
        }
    }
}

/// What the kernel's queue map says before any I/O is seen, for a task that may run on
/// `cpus`: `Fixed` where every one of them has its requests complete on one and the same
/// vCPU, `FollowsSubmitter` where each completes its own, `Unknown` otherwise (several
/// disks that disagree, vCPUs the map does not cover).
pub fn prior(completion_cpus: &BTreeMap<usize, BTreeSet<usize>>, cpus: &[usize]) -> Home {
    let sets: Vec<Option<&BTreeSet<usize>>> = cpus.iter().map(|c| completion_cpus.get(c)).collect();
    if cpus.is_empty() || sets.iter().any(|s| s.is_none_or(|s| s.len() != 1)) {
        return Home::Unknown;
    }
    let single: Vec<usize> = sets
        .iter()
        .filter_map(|s| s.and_then(|s| s.first().copied()))
        .collect();
    if single.iter().all(|&k| k == single[0]) && cpus.len() > 1 {
        Home::Fixed(single[0])
    } else if single.iter().zip(cpus).all(|(k, c)| k == c) {
        Home::FollowsSubmitter
    } else {
        Home::Unknown
    }
}

/// One task's completions since its home was last judged.
#[derive(Clone, Copy, Debug, Default)]
struct Learning {
    home: Home,
    done: u64,
    remote: u64,
    /// The vCPU where its completions were last judged local, while its home is unknown.
    local_on: Option<usize>,
}

/// Each I/O-bound task's learned home, by task (a tid reused by another task starts
/// over).
#[derive(Debug, Default)]
pub struct CompletionHomes {
    cfg: HomeConfig,
    /// Every task's home before its own completions say otherwise.
    prior: Home,
    homes: HashMap<TaskId, Learning>,
}

impl CompletionHomes {
    pub fn new(cfg: HomeConfig, prior: Home) -> Self {
        CompletionHomes {
            cfg,
            prior,
            homes: HashMap::new(),
        }
    }

    /// Feeds one window of `task`'s completions (each window once); returns its home
    /// after it. Windows add up until they hold `min_completions`, then are judged.
    pub fn observe(&mut self, task: TaskId, site: &CompletionSite) -> Home {
        let cfg = &self.cfg;
        let prior = self.prior;
        let l = self.homes.entry(task).or_insert_with(|| Learning {
            home: prior,
            ..Learning::default()
        });
        l.done += site.count;
        l.remote += site.remote.min(site.count);
        if l.done < cfg.min_completions {
            return l.home;
        }
        let remote_fraction = l.remote as f64 / l.done as f64;
        (l.done, l.remote) = (0, 0);
        let cpu = site.cpu as usize;
        l.home = if remote_fraction >= cfg.fixed_above {
            // Completed elsewhere than submitted: that vCPU takes them whatever we do
            // (and if the vector moved, it moved there).
            l.local_on = None;
            Home::Fixed(cpu)
        } else if remote_fraction <= cfg.follows_below {
            match (l.home, l.local_on) {
                // Anchored on it: local completions are what a fixed vector gives too.
                (Home::Fixed(c), _) if c == cpu => Home::Fixed(c),
                (Home::FollowsSubmitter, _) => Home::FollowsSubmitter,
                // Local on two vCPUs: completions follow the submitter.
                (_, Some(other)) if other != cpu => Home::FollowsSubmitter,
                // Local on one vCPU says nothing yet: a task that happens to run on
                // the vector's vCPU sees the same. Its first move away will tell.
                _ => {
                    l.local_on = Some(cpu);
                    Home::Unknown
                }
            }
        } else {
            // Mixed (a task that moved mid-window, or vectors shared by a few vCPUs):
            // keep what was known.
            l.home
        };
        l.home
    }

    pub fn home(&self, task: TaskId) -> Home {
        self.homes.get(&task).map_or(self.prior, |l| l.home)
    }

    /// Forgets the tasks `keep` says are gone.
    pub fn retain(&mut self, mut keep: impl FnMut(TaskId) -> bool) {
        self.homes.retain(|&task, _| keep(task));
    }

    /// Tasks whose completions land on a fixed vCPU, with it.
    pub fn fixed(&self) -> impl Iterator<Item = (TaskId, usize)> + '_ {
        self.homes.iter().filter_map(|(&task, l)| match l.home {
            Home::Fixed(c) => Some((task, c)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(tid: u32) -> TaskId {
        TaskId { tid, start_time: 1 }
    }

    fn site(cpu: u32, remote_fraction: f64, count: u64) -> CompletionSite {
        CompletionSite {
            cpu,
            remote_fraction,
            count,
            remote: (remote_fraction * count as f64).round() as u64,
        }
    }

    #[test]
    fn a_reader_whose_completions_land_elsewhere_is_homed_there_and_stays_once_anchored() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Unknown);
        assert_eq!(h.observe(task(7), &site(1, 1.0, 400)), Home::Fixed(1));
        // Anchored on vCPU 1 it submits and completes there: still homed there.
        assert_eq!(h.observe(task(7), &site(1, 0.0, 400)), Home::Fixed(1));
        assert_eq!(h.fixed().collect::<Vec<_>>(), vec![(task(7), 1)]);
    }

    #[test]
    fn completions_where_submitted_on_two_vcpus_mean_a_queue_per_vcpu() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Unknown);
        // Local on one vCPU: the vector's own, or a queue of its own? Not known yet.
        assert_eq!(h.observe(task(7), &site(0, 0.0, 400)), Home::Unknown);
        assert_eq!(h.observe(task(7), &site(0, 0.0, 400)), Home::Unknown);
        assert_eq!(
            h.observe(task(7), &site(1, 0.05, 400)),
            Home::FollowsSubmitter
        );
        assert_eq!(
            h.observe(task(7), &site(0, 0.0, 400)),
            Home::FollowsSubmitter
        );
        assert_eq!(h.fixed().count(), 0);
    }

    #[test]
    fn a_reader_on_the_vectors_vcpu_is_homed_at_its_first_move_away() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Unknown);
        assert_eq!(h.observe(task(7), &site(1, 0.0, 400)), Home::Unknown);
        assert_eq!(h.observe(task(7), &site(1, 1.0, 400)), Home::Fixed(1));
    }

    #[test]
    fn a_vector_that_moves_takes_the_home_with_it() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Unknown);
        h.observe(task(7), &site(1, 1.0, 400));
        // The interrupt now lands on vCPU 0; the task, still on 1, completes remotely.
        assert_eq!(h.observe(task(7), &site(0, 1.0, 400)), Home::Fixed(0));
        // Or the task now completes locally on another vCPU: not known any more.
        assert_eq!(h.observe(task(7), &site(1, 0.0, 400)), Home::Unknown);
    }

    #[test]
    fn the_queue_map_gives_the_prior() {
        let one_queue = BTreeMap::from([(0, BTreeSet::from([1])), (1, BTreeSet::from([1]))]);
        assert_eq!(prior(&one_queue, &[0, 1]), Home::Fixed(1));
        let per_vcpu = BTreeMap::from([(0, BTreeSet::from([0])), (1, BTreeSet::from([1]))]);
        assert_eq!(prior(&per_vcpu, &[0, 1]), Home::FollowsSubmitter);
        let two_disks = BTreeMap::from([(0, BTreeSet::from([0, 1])), (1, BTreeSet::from([1]))]);
        assert_eq!(prior(&two_disks, &[0, 1]), Home::Unknown);
        assert_eq!(prior(&BTreeMap::new(), &[0, 1]), Home::Unknown);
        assert_eq!(
            prior(&one_queue, &[0, 1, 2]),
            Home::Unknown,
            "vCPU 2 not mapped"
        );
    }

    #[test]
    fn a_fixed_prior_holds_for_local_completions_on_its_vcpu_until_they_say_otherwise() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Fixed(1));
        assert_eq!(h.home(task(7)), Home::Fixed(1), "before any completion");
        assert_eq!(h.observe(task(7), &site(1, 0.0, 400)), Home::Fixed(1));
        // Local completions on another vCPU (another disk): not known any more.
        assert_eq!(h.observe(task(8), &site(0, 0.0, 400)), Home::Unknown);
    }

    #[test]
    fn thin_windows_add_up_until_they_say_something() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Unknown);
        for _ in 0..6 {
            assert_eq!(h.observe(task(7), &site(1, 1.0, 3)), Home::Unknown);
        }
        assert_eq!(
            h.observe(task(7), &site(1, 1.0, 3)),
            Home::Fixed(1),
            "21 completions"
        );
    }

    #[test]
    fn mixed_windows_change_nothing() {
        let mut h = CompletionHomes::new(HomeConfig::default(), Home::Unknown);
        h.observe(task(7), &site(1, 1.0, 400));
        assert_eq!(h.observe(task(7), &site(0, 0.5, 400)), Home::Fixed(1));
        h.retain(|t| t != task(7));
        assert_eq!(h.home(task(7)), Home::Unknown);
    }
}

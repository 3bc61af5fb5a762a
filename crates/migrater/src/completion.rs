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
//! Learned per task from its own completions (`CompletionSite`, measured by the block
//! programs), sticky: a task anchored on its completion vCPU submits only from there and
//! its completions look local, which says nothing new. Pure: no clock, no I/O.

use std::collections::HashMap;
use task_detector::CompletionSite;

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

/// Each I/O-bound task's learned home, by tid.
#[derive(Debug, Default)]
pub struct CompletionHomes {
    cfg: HomeConfig,
    homes: HashMap<u32, Home>,
}

impl CompletionHomes {
    pub fn new(cfg: HomeConfig) -> Self {
        CompletionHomes {
            cfg,
            homes: HashMap::new(),
        }
    }

    /// Feeds one window of `tid`'s completions; returns its home after it.
    pub fn observe(&mut self, tid: u32, site: &CompletionSite) -> Home {
        let cfg = &self.cfg;
        let home = self.homes.entry(tid).or_default();
        if site.count < cfg.min_completions {
            return *home;
        }
        let cpu = site.cpu as usize;
        *home = if site.remote_fraction >= cfg.fixed_above {
            // Completed elsewhere than submitted: that vCPU takes them whatever we do
            // (and if the vector moved, it moved there).
            Home::Fixed(cpu)
        } else if site.remote_fraction <= cfg.follows_below {
            match *home {
                // Anchored on it: local completions are what a fixed vector gives too.
                Home::Fixed(c) if c == cpu => Home::Fixed(c),
                _ => Home::FollowsSubmitter,
            }
        } else {
            // Mixed (a task that moved mid-window, or vectors shared by a few vCPUs):
            // keep what was known.
            *home
        };
        *home
    }

    pub fn home(&self, tid: u32) -> Home {
        self.homes.get(&tid).copied().unwrap_or_default()
    }

    /// Forgets the tasks `keep` says are gone.
    pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        self.homes.retain(|&tid, _| keep(tid));
    }

    /// Tasks whose completions land on a fixed vCPU, with it.
    pub fn fixed(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.homes.iter().filter_map(|(&tid, h)| match h {
            Home::Fixed(c) => Some((tid, *c)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(cpu: u32, remote_fraction: f64, count: u64) -> CompletionSite {
        CompletionSite {
            cpu,
            remote_fraction,
            count,
        }
    }

    #[test]
    fn a_reader_whose_completions_land_elsewhere_is_homed_there_and_stays_once_anchored() {
        let mut h = CompletionHomes::new(HomeConfig::default());
        assert_eq!(h.observe(7, &site(1, 1.0, 400)), Home::Fixed(1));
        // Anchored on vCPU 1 it submits and completes there: still homed there.
        assert_eq!(h.observe(7, &site(1, 0.0, 400)), Home::Fixed(1));
        assert_eq!(h.fixed().collect::<Vec<_>>(), vec![(7, 1)]);
    }

    #[test]
    fn completions_where_submitted_mean_a_queue_per_vcpu() {
        let mut h = CompletionHomes::new(HomeConfig::default());
        assert_eq!(h.observe(7, &site(0, 0.0, 400)), Home::FollowsSubmitter);
        assert_eq!(h.observe(7, &site(1, 0.05, 400)), Home::FollowsSubmitter);
        assert_eq!(h.fixed().count(), 0);
    }

    #[test]
    fn a_vector_that_moves_takes_the_home_with_it() {
        let mut h = CompletionHomes::new(HomeConfig::default());
        h.observe(7, &site(1, 1.0, 400));
        // The interrupt now lands on vCPU 0; the task, still on 1, completes remotely.
        assert_eq!(h.observe(7, &site(0, 1.0, 400)), Home::Fixed(0));
        // Or the task now completes locally on another vCPU: the geometry changed.
        assert_eq!(h.observe(7, &site(1, 0.0, 400)), Home::FollowsSubmitter);
    }

    #[test]
    fn thin_or_mixed_windows_change_nothing() {
        let mut h = CompletionHomes::new(HomeConfig::default());
        assert_eq!(h.observe(7, &site(1, 1.0, 3)), Home::Unknown);
        h.observe(7, &site(1, 1.0, 400));
        assert_eq!(h.observe(7, &site(0, 0.5, 400)), Home::Fixed(1));
        h.retain(|tid| tid != 7);
        assert_eq!(h.home(7), Home::Unknown);
    }
}

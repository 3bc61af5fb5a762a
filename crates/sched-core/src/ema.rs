//! ISACS Eq. 1: `Ī_e = 0.9 × I_e + (1 − 0.9) × Ī_{e−1}` over the intervals between I/O
//! response events of one vCPU; an interval over 10 ms is not reflected and restarts t_e,
//! so a vCPU with infrequent I/O keeps a small I/O strength. Also counts E_n, the events
//! since the last reallocation (Eq. 2).

/// Smoothing constant of Eq. 1 (weight of the newest interval).
pub const SMOOTHING: f64 = 0.9;
/// Intervals longer than this are not I/O-intensive (Eq. 1).
pub const MAX_INTERVAL_NS: u64 = 10_000_000;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct IoEventEma {
    last_ns: Option<u64>,
    ema_ns: f64,
    events: u64,
}

impl IoEventEma {
    pub fn new() -> Self {
        Self::default()
    }

    /// An I/O response event at `t_ns` (monotonic).
    pub fn on_event(&mut self, t_ns: u64) {
        self.events += 1;
        if let Some(last) = self.last_ns {
            let interval = t_ns.saturating_sub(last);
            if interval <= MAX_INTERVAL_NS {
                self.ema_ns = if self.ema_ns == 0.0 {
                    interval as f64
                } else {
                    SMOOTHING * interval as f64 + (1.0 - SMOOTHING) * self.ema_ns
                };
            }
        }
        self.last_ns = Some(t_ns);
    }

    /// Ī_e in ns.
    pub fn ema_ns(&self) -> f64 {
        self.ema_ns
    }

    /// E_n: events since the last `take_events`.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Returns E_n and starts a new reallocation period (the EMA carries over).
    pub fn take_events(&mut self) -> u64 {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn follows_equation_1() {
        let mut e = IoEventEma::new();
        e.on_event(0);
        e.on_event(MS); // first interval seeds the EMA
        assert_eq!(e.ema_ns(), MS as f64);
        e.on_event(3 * MS); // I = 2 ms: 0.9·2 + 0.1·1 = 1.9 ms
        assert!((e.ema_ns() - 1.9e6).abs() < 1e-6);
        e.on_event(3 * MS + 500_000); // I = 0.5 ms: 0.9·0.5 + 0.1·1.9 = 0.64 ms
        assert!((e.ema_ns() - 0.64e6).abs() < 1e-6);
        assert_eq!(e.events(), 4);
    }

    #[test]
    fn long_intervals_are_ignored_and_restart_te() {
        let mut e = IoEventEma::new();
        e.on_event(0);
        e.on_event(2 * MS);
        e.on_event(50 * MS); // 48 ms: ignored
        assert_eq!(e.ema_ns(), 2e6);
        e.on_event(51 * MS); // measured from 50 ms, not from 2 ms
        assert!((e.ema_ns() - (0.9e6 + 0.2e6)).abs() < 1e-6);
    }

    #[test]
    fn take_events_resets_the_count_only() {
        let mut e = IoEventEma::new();
        for t in 0..5 {
            e.on_event(t * MS);
        }
        assert_eq!(e.take_events(), 5);
        assert_eq!(e.events(), 0);
        assert_eq!(e.ema_ns(), 1e6);
    }
}

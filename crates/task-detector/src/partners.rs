//! Partners of I/O-bound threads: the user threads an I/O-bound thread wakes and is woken
//! by, many times in one sample (a database backend and its client across a socket, a
//! server and the worker that writes its log). Such a pair runs one request in turn: if
//! the partner waits on another vCPU, each request waits for two vCPUs' windows.
//!
//! Pure: the wake-up counts come from the block programs' `wakes` map
//! (bpf/iotrack.bpf.c); nothing here reads the kernel.

use std::collections::HashMap;

/// Wake-ups each way within one sample that make two threads partners. A wake-up from an
/// interrupt is charged to whichever task it interrupted, so a thread that an I/O thread
/// never wakes back (a CPU hog) never qualifies.
pub const MIN_WAKES_EACH_WAY: u64 = 8;
/// Partners kept per I/O-bound thread, the busiest first: its vCPU is shared with them.
pub const MAX_PER_TASK: usize = 2;

/// `(of, partner, wakes both ways)`: for each of `io_tids`, the threads it woke and was
/// woken by at least `MIN_WAKES_EACH_WAY` times each way in `wakes` (keyed
/// `(waker, wakee)`), the busiest `MAX_PER_TASK`, never one of `io_tids` itself (those
/// are placed by their own completions). Sorted by `of`, then busiest first, then tid.
pub fn partners(io_tids: &[u32], wakes: &HashMap<(u32, u32), u64>) -> Vec<(u32, u32, u64)> {
    let mut out = Vec::new();
    let mut ofs: Vec<u32> = io_tids.to_vec();
    ofs.sort_unstable();
    ofs.dedup();
    for &of in &ofs {
        let mut found: Vec<(u32, u64)> = wakes
            .iter()
            .filter(|((waker, _), _)| *waker == of)
            .filter_map(|(&(_, other), &there)| {
                let back = wakes.get(&(other, of)).copied().unwrap_or(0);
                (there >= MIN_WAKES_EACH_WAY
                    && back >= MIN_WAKES_EACH_WAY
                    && !io_tids.contains(&other))
                .then_some((other, there + back))
            })
            .collect();
        found.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out.extend(
            found
                .into_iter()
                .take(MAX_PER_TASK)
                .map(|(p, n)| (of, p, n)),
        );
    }
    out
}

/// Whether some pair has woken each other both ways in `wakes`, but one way fewer than
/// `MIN_WAKES_EACH_WAY` times: a sample that runs on a little decides it.
pub fn pending(wakes: &HashMap<(u32, u32), u64>) -> bool {
    wakes.iter().any(|(&(a, b), &there)| {
        let back = wakes.get(&(b, a)).copied().unwrap_or(0);
        back > 0 && there.min(back) < MIN_WAKES_EACH_WAY
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(pairs: &[((u32, u32), u64)]) -> HashMap<(u32, u32), u64> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn a_client_that_wakes_and_is_woken_by_the_backend_is_its_partner() {
        // Backend 10 and client 20 ping-pong; interrupts charged to hog 30 wake 10.
        let wakes = w(&[((10, 20), 120), ((20, 10), 118), ((30, 10), 400)]);
        assert_eq!(partners(&[10], &wakes), vec![(10, 20, 238)]);
    }

    #[test]
    fn a_pair_that_began_to_wake_each_other_is_pending_until_it_qualifies() {
        assert!(!pending(&w(&[((10, 20), 3)])), "one way only");
        assert!(pending(&w(&[((10, 20), 3), ((20, 10), 2)])));
        assert!(!pending(&w(&[((10, 20), 30), ((20, 10), 30)])), "decided");
    }

    #[test]
    fn one_way_or_rare_wake_ups_make_no_partner() {
        let wakes = w(&[((10, 20), 500), ((20, 10), 3), ((10, 40), 50)]);
        assert!(partners(&[10], &wakes).is_empty());
        let at_threshold = w(&[
            ((10, 20), MIN_WAKES_EACH_WAY),
            ((20, 10), MIN_WAKES_EACH_WAY),
        ]);
        assert_eq!(partners(&[10], &at_threshold).len(), 1);
    }

    #[test]
    fn the_busiest_partners_only_and_never_another_io_thread() {
        let wakes = w(&[
            ((10, 20), 100),
            ((20, 10), 100),
            ((10, 21), 50),
            ((21, 10), 50),
            ((10, 22), 9),
            ((22, 10), 9),
            ((10, 11), 300),
            ((11, 10), 300),
        ]);
        assert_eq!(
            partners(&[10, 11], &wakes),
            vec![(10, 20, 200), (10, 21, 100)]
        );
    }
}

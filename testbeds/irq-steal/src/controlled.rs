//! What a plan's run (`kernel`) and the host model (`host`) share: a controller thread that
//! owns the BPF object, says when the run's t = 0 is, and keeps the program's heartbeat
//! fresh; and a liveness thread, a normal task, that says every 10 ms that it ran. When no
//! normal task has run for `ANSWER_WITHIN` the machine has stopped answering: the
//! controller stops beating (the program gives every CPU back) and the run fails.
//!
//! Must never outlive its owner: dropping it stops and joins both threads.

use crate::absorber::ABSORBER_PRIORITY;
use anyhow::{anyhow, bail, Context, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the controller refreshes the heartbeat (the programs give up at 100 ms, the
/// host model at 500 ms).
const HEARTBEAT_EVERY: Duration = Duration::from_millis(10);
/// A normal task of this process that has not run for this long says the machine stopped
/// answering (the controller, real-time, still runs): the run stops taking CPUs and fails.
/// Ten times the longest window a plan may hold.
pub const ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// The controller thread's side.
pub(crate) struct Controller {
    pub stop: Arc<AtomicBool>,
    last_ran: Arc<AtomicU64>,
    started: SyncSender<Result<u64>>,
}

impl Controller {
    /// The run's t = 0, or why it could not start; said once.
    pub fn started(&self, start: Result<u64>) {
        let _ = self.started.send(start);
    }

    /// `beat(now)` every `HEARTBEAT_EVERY` until
    /// stopped. Some((silent_ns, at_ns)) when the machine stopped answering `at_ns` after
    /// `start_ns`.
    pub fn keep_beating(&self, start_ns: u64, mut beat: impl FnMut(u64)) -> Option<(u64, u64)> {
        let mut next = os_layer::monotonic_ns();
        while !self.stop.load(Ordering::Relaxed) {
            let now = os_layer::monotonic_ns();
            let silent = now.saturating_sub(self.last_ran.load(Ordering::Relaxed));
            if silent > ANSWER_WITHIN.as_nanos() as u64 {
                return Some((silent, now.saturating_sub(start_ns)));
            }
            beat(now);
            next += HEARTBEAT_EVERY.as_nanos() as u64;
            os_layer::sleep_until(next.max(os_layer::monotonic_ns()));
        }
        None
    }

    /// A low-priority SCHED_FIFO thread still preempts every CPU hog, so the heartbeat
    /// stays fresh on a loaded machine (it sleeps between beats and costs nothing); above
    /// the absorbers, which busy-wait through windows.
    pub fn make_realtime(&self) {
        if let Err(e) = os_layer::sched::set_self_policy(libc::SCHED_FIFO, ABSORBER_PRIORITY + 1) {
            eprintln!(
                "the controller runs as a normal task ({e}): under load the heartbeat may go \
                 stale and the CPUs be given back"
            );
        }
    }
}

/// A started run: its t = 0 and its two threads.
pub(crate) struct Controlled<R> {
    what: &'static str,
    start_ns: u64,
    stop: Arc<AtomicBool>,
    silenced: Arc<AtomicBool>,
    alive: Option<JoinHandle<()>>,
    controller: Option<JoinHandle<Result<R>>>,
}

impl<R: Send + 'static> Controlled<R> {
    /// Starts both threads and returns once `body` (on the controller thread) said its
    /// t = 0; `body`'s result is what `finish` returns.
    pub fn start(
        what: &'static str,
        body: impl FnOnce(Controller) -> Result<R> + Send + 'static,
    ) -> Result<Controlled<R>> {
        let stop = Arc::new(AtomicBool::new(false));
        let last_ran = Arc::new(AtomicU64::new(os_layer::monotonic_ns()));
        let silenced = Arc::new(AtomicBool::new(false));
        let alive = {
            let (stop, last_ran, silenced) = (stop.clone(), last_ran.clone(), silenced.clone());
            std::thread::Builder::new()
                .name(format!("{what}-alive"))
                .spawn(move || answer(&stop, &silenced, &last_ran))
                .with_context(|| format!("starting the {what} liveness thread"))?
        };
        let (started, rx) = sync_channel(1);
        let ctl = Controller {
            stop: stop.clone(),
            last_ran,
            started,
        };
        let mut run = Controlled {
            what,
            start_ns: 0,
            stop,
            silenced,
            alive: Some(alive),
            controller: None,
        };
        let controller = std::thread::Builder::new()
            .name(what.into())
            .spawn(move || body(ctl))
            .with_context(|| format!("starting the {what} controller thread"))?;
        match rx.recv() {
            Ok(Ok(start_ns)) => {
                run.start_ns = start_ns;
                run.controller = Some(controller);
                Ok(run)
            }
            Ok(Err(e)) => {
                let _ = controller.join();
                Err(e)
            }
            Err(_) => Err(match controller.join() {
                Ok(Err(e)) => e,
                _ => anyhow!("the {what} controller thread died while starting"),
            }),
        }
    }

    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    /// The liveness thread stops saying that it ran, as when the machine stops answering.
    pub fn silence(&self) {
        self.silenced.store(true, Ordering::Relaxed);
    }

    /// Stops the controller and returns what its body returned.
    pub fn finish(&mut self) -> Result<R> {
        self.stop.store(true, Ordering::Relaxed);
        let Some(c) = self.controller.take() else {
            bail!("already stopped");
        };
        c.join()
            .map_err(|_| anyhow!("the {} controller thread panicked", self.what))?
    }
}

impl<R> Drop for Controlled<R> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(c) = self.controller.take() {
            match c.join() {
                Ok(Err(e)) => eprintln!("{}: stopping: {e:#}", self.what),
                Err(_) => eprintln!("{}: the controller thread panicked", self.what),
                Ok(Ok(_)) => {}
            }
        }
        if let Some(a) = self.alive.take() {
            let _ = a.join();
        }
    }
}

/// The liveness thread: a normal task (SCHED_OTHER, whatever policy the run's starter
/// has) that says every 10 ms that it ran, until the run stops.
fn answer(stop: &AtomicBool, silenced: &AtomicBool, last_ran: &AtomicU64) {
    if let Err(e) = os_layer::sched::set_self_policy(libc::SCHED_OTHER, 0) {
        eprintln!("the liveness thread keeps its starter's policy ({e})");
    }
    while !stop.load(Ordering::Relaxed) {
        if !silenced.load(Ordering::Relaxed) {
            last_ran.store(os_layer::monotonic_ns(), Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

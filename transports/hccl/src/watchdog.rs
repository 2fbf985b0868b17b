//! [`Watchdog`]: shows the transfer deadline (and a shutdown) to the callers of batches that a
//! peer's device thread runs with no driver task waiting beside them.
//!
//! A batch submitted straight to the device thread (see `peer`) is completed there; if the
//! deadline passes first (the job is queued behind a communicator build, or the stream wait has
//! no bound on this CANN release), the caller must still hear of the timeout at the deadline.
//! The watchdog keeps those batches in submission order and sleeps until the first deadline. It
//! is never woken by a submission: every deadline is the submission time plus the transfer
//! timeout, taken under the watchdog's lock, so a new one is never earlier than the one it
//! sleeps towards — except after a quiet spell, when it parks and the next submission wakes it
//! once.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ferry_core::Error;
use tokio::sync::{Notify, watch};

use crate::pending::Pending;

/// A batch's requests while a device job holds them; the job takes them out when it ends.
pub(crate) type Held = Arc<Mutex<Option<Pending>>>;

/// Takes the requests out of `held` (`None` once taken).
pub(crate) fn take(held: &Mutex<Option<Pending>>) -> Option<Pending> {
    held.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The deadlines of one peer's batches that run on its device thread.
pub(crate) struct Watchdog {
    timeout: Duration,
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Default)]
struct State {
    /// In submission order, hence in deadline order.
    queue: VecDeque<Watched>,
    /// The watchdog waits for a submission (no deadline to sleep towards).
    parked: bool,
}

struct Watched {
    deadline: Instant,
    held: Weak<Mutex<Option<Pending>>>,
}

impl Watched {
    /// The job ended (it dropped its hold) or took the requests out.
    fn ended(&self) -> bool {
        self.held.upgrade().is_none_or(|h| h.lock().unwrap_or_else(|p| p.into_inner()).is_none())
    }
}

impl Watchdog {
    pub(crate) fn new(timeout: Duration) -> Arc<Self> {
        Arc::new(Self { timeout, state: Mutex::new(State::default()), wake: Notify::new() })
    }

    /// Watches `held` from now until its deadline (now plus the transfer timeout), which it
    /// returns. Never blocks; wakes the watchdog only when it is parked.
    pub(crate) fn watch(&self, held: &Held) -> Instant {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + self.timeout;
        // Batches complete in order, as a rule: forget those that did before this one.
        while st.queue.front().is_some_and(|w| w.held.strong_count() == 0) {
            st.queue.pop_front();
        }
        st.queue.push_back(Watched { deadline, held: Arc::downgrade(held) });
        let parked = std::mem::take(&mut st.parked);
        drop(st);
        if parked {
            self.wake.notify_one();
        }
        deadline
    }

    /// Runs until `stop`: at each deadline, reports `timeout` to the batch's caller unless its job
    /// ended (the job completes the requests — releases their memory — when the device is done
    /// with them); at stop, reports `shutdown` to every batch still watched.
    pub(crate) async fn run(
        self: Arc<Self>,
        timeout: impl Fn() -> Error,
        shutdown: impl Fn() -> Error,
        mut stop: watch::Receiver<bool>,
    ) {
        // The last sleep ended with nothing to watch: the next idle turn parks.
        let mut quiet = false;
        loop {
            let (due, next) = {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let mut due = Vec::new();
                while let Some(w) = st.queue.front() {
                    if w.deadline > now && !w.ended() {
                        break;
                    }
                    let w = st.queue.pop_front().expect("a front entry");
                    if w.deadline <= now {
                        due.push(w.held);
                    }
                }
                let next = match st.queue.front() {
                    Some(w) => Some(w.deadline),
                    None if quiet => {
                        st.parked = true;
                        None
                    }
                    // Any batch submitted from now on has a later deadline than this.
                    None => Some(now + self.timeout),
                };
                quiet = st.queue.is_empty();
                (due, next)
            };
            report(&due, &timeout());
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => self.wake.notified().await,
                }
            };
            tokio::select! {
                _ = sleep => {}
                _ = stopped(&mut stop) => break,
            }
        }
        let all: Vec<_> = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.queue.drain(..).map(|w| w.held).collect()
        };
        report(&all, &shutdown());
    }
}

/// Shows `error` to the callers of the batches still held (without releasing them).
fn report(held: &[Weak<Mutex<Option<Pending>>>], error: &Error) {
    for h in held.iter().filter_map(Weak::upgrade) {
        if let Some(p) = h.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            p.report_all(error);
        }
    }
}

async fn stopped(rx: &mut watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            // The transport is gone: nothing will be submitted or stopped any more.
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::{Batch, ErrorKind, Location, MemoryRegistry, Opcode, SegmentHandle, TransferRequest};

    use super::*;

    /// A batch of one 8-byte read in a registry of its own (never accessed: completed by hand).
    fn batch() -> (MemoryRegistry, Batch, Held) {
        let reg = MemoryRegistry::new();
        // SAFETY: the range is never accessed: these batches are completed by hand.
        unsafe { reg.register(4096, 4096, Location::Any) }.unwrap();
        let req = TransferRequest {
            opcode: Opcode::Read,
            source: 4096,
            target: SegmentHandle::fresh(),
            target_offset: 0,
            length: 8,
        };
        let (b, s) = Batch::lease(&reg, &[req], Vec::new()).unwrap();
        (reg, b, Arc::new(Mutex::new(Some(Pending::new(s)))))
    }

    async fn kind_after_waiting(b: &Batch) -> ErrorKind {
        let status = b.wait(Duration::from_secs(30)).await.expect("an outcome");
        assert_eq!(status.failed, 1, "{status:?}");
        b.errors()[0].1.kind()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadlines_and_shutdown_are_reported_while_the_job_keeps_the_memory() {
        let dog = Watchdog::new(Duration::from_millis(50));
        let (stop, stop_rx) = watch::channel(false);
        let running = tokio::spawn(dog.clone().run(
            || Error::timeout("late"),
            || Error::new(ErrorKind::Shutdown, "stopped"),
            stop_rx,
        ));

        // One whose job ends in time, one whose job outlives its deadline.
        let (_r1, done, held_done) = batch();
        let (_r2, late, held_late) = batch();
        dog.watch(&held_done);
        dog.watch(&held_late);
        take(&held_done).unwrap().complete_all(&Ok(()));
        assert_eq!(kind_after_waiting(&late).await, ErrorKind::Timeout);
        assert!(done.status().is_success());
        assert!(!late.all_released(), "reported, not released: the job still holds it");
        take(&held_late).unwrap().complete_all(&Err(Error::timeout("late")));
        assert!(late.all_released());

        // After a quiet spell the watchdog parks; the next batch wakes it.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (_r3, after_quiet, held_after_quiet) = batch();
        dog.watch(&held_after_quiet);
        assert_eq!(kind_after_waiting(&after_quiet).await, ErrorKind::Timeout);
        drop(held_after_quiet);

        // A stop is reported to what is still watched.
        let (_r4, at_stop, held_at_stop) = batch();
        let dog_long = Watchdog::new(Duration::from_secs(3600));
        let (stop_long, stop_long_rx) = watch::channel(false);
        let running_long = tokio::spawn(dog_long.clone().run(
            || Error::timeout("late"),
            || Error::new(ErrorKind::Shutdown, "stopped"),
            stop_long_rx,
        ));
        dog_long.watch(&held_at_stop);
        stop_long.send(true).unwrap();
        running_long.await.unwrap();
        assert_eq!(kind_after_waiting(&at_stop).await, ErrorKind::Shutdown);
        assert!(!at_stop.all_released());
        take(&held_at_stop).unwrap().complete_all(&Err(Error::new(ErrorKind::Shutdown, "stopped")));

        stop.send(true).unwrap();
        running.await.unwrap();
    }
}

//! When a blocking waiter should be awake: how long an engine's device-completed batches take,
//! by size, and how late this host's timed sleeps return.
//!
//! A waiter that sleeps until the completing thread wakes it pays that wake-up after the batch
//! is done. On a virtualised host whose idle vCPUs halt, that is ~30 µs whenever the waiter
//! slept on the other vCPU (docs/performance.md, issue 15's fifth pass), more than the
//! transport's own work. Polling the whole time instead takes a core from the device's own
//! host threads. The middle way is *hybrid polling*, as Linux's block layer had for polled
//! I/O from 4.10 to 6.3 (`blk_mq_poll_hybrid_sleep` in `block/blk-mq.c`: sleep half the mean
//! completion time of requests of that size, then poll): sleep until a little before the
//! batch is expected to end, then poll the rest.
//!
//! [`WaitModel`] keeps what that needs, per engine:
//!
//! - per size class (the bit length of the batch's byte count), a smoothed completion time
//!   (submission to last outcome) and its mean deviation, with the gains of TCP's RTO
//!   estimator (RFC 6298, §2: 1/8 and 1/4);
//! - the same for how much later than asked a timed sleep on a condition variable returned
//!   (timer slack, 50 µs by default on Linux, plus the wake-up of a halted vCPU).
//!
//! [`WaitModel::plan`] turns them into a [`TailPlan`]. With RFC 6298's K = 4 (its timeout is
//! the smoothed time plus four deviations):
//!
//! - wake at the expected end, less four of its deviations, less the expected lateness and
//!   four of the lateness's deviations;
//! - poll until the expected end plus four deviations, but for at most [`MAX_TAIL_POLL`]
//!   after waking: a size class whose times vary widely polls its likeliest part.
//!
//! A wrong estimate costs little: a waiter that wakes too early polls for at most
//! [`MAX_TAIL_POLL`] and sleeps again; one whose plan says to wake after the batch ended is
//! woken by the completion, as without a plan. Where timed sleeps return late (the 2-core VM:
//! 50 µs of timer slack plus a halted vCPU's wake-up, and a busy vCPU when the timer fires,
//! ~150 µs in all), the plan for a batch of a few hundred microseconds says to wake at once:
//! the waiter then polls, yielding, from the start.
//!
//! Everything is a relaxed atomic: two threads updating one estimate at once may lose one
//! sample, which a smoothed estimate does not miss.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest a waiter polls at the end of a batch before it sleeps again.
pub(crate) const MAX_TAIL_POLL: Duration = Duration::from_micros(500);

/// How many mean deviations past the mean an estimate's bound lies (RFC 6298's K, its
/// retransmission timeout being SRTT + K × RTTVAR).
const K: u64 = 4;

/// Size classes: the bit length of a byte count (0 for 0 bytes, 64 for 2^63 and above).
const CLASSES: usize = 65;

/// A smoothed mean and mean deviation in nanoseconds (RFC 6298, §2), 0 before the first sample.
#[derive(Debug, Default)]
struct Smoothed {
    mean: AtomicU64,
    dev: AtomicU64,
}

impl Smoothed {
    /// Adds one sample: the first sets the mean to it and the deviation to half of it; later
    /// ones move the mean by 1/8 and the deviation by 1/4 of their difference.
    fn record(&self, sample_ns: u64) {
        // A sample of 0 would read as "no estimate yet".
        let sample = sample_ns.max(1);
        let mean = self.mean.load(Ordering::Relaxed);
        if mean == 0 {
            self.dev.store(sample / 2, Ordering::Relaxed);
            self.mean.store(sample, Ordering::Relaxed);
            return;
        }
        let dev = self.dev.load(Ordering::Relaxed);
        let diff = mean.abs_diff(sample);
        // dev' = 3/4 dev + 1/4 |mean - sample|; mean' = 7/8 mean + 1/8 sample. Each weighted sum
        // is taken part by part so that no product can overflow.
        let new_dev = dev - dev / 4 + diff / 4;
        let new_mean = if sample >= mean { mean + diff / 8 } else { mean - diff / 8 };
        self.dev.store(new_dev, Ordering::Relaxed);
        self.mean.store(new_mean.max(1), Ordering::Relaxed);
    }

    /// `(mean, deviation)`, or `None` before the first sample.
    fn get(&self) -> Option<(u64, u64)> {
        let mean = self.mean.load(Ordering::Relaxed);
        (mean != 0).then(|| (mean, self.dev.load(Ordering::Relaxed)))
    }
}

/// When a blocking waiter wakes to poll, and until when it polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TailPlan {
    /// Sleep until this instant (or the completion, if sooner).
    pub(crate) wake_at: Instant,
    /// Then poll until this instant (at most [`MAX_TAIL_POLL`] after `wake_at`), and sleep again
    /// if the batch is not done by then.
    pub(crate) poll_until: Instant,
}

/// Per-engine estimates for hybrid waiting (see the module docs).
#[derive(Debug)]
pub(crate) struct WaitModel {
    completion: [Smoothed; CLASSES],
    lateness: Smoothed,
}

impl Default for WaitModel {
    fn default() -> Self {
        Self { completion: std::array::from_fn(|_| Smoothed::default()), lateness: Smoothed::default() }
    }
}

/// The size class of `bytes`: its bit length.
fn class(bytes: u64) -> usize {
    (u64::BITS - bytes.leading_zeros()) as usize
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl WaitModel {
    /// A batch of `bytes` completed `elapsed` after its submission.
    pub(crate) fn record_completion(&self, bytes: u64, elapsed: Duration) {
        self.completion[class(bytes)].record(nanos(elapsed));
    }

    /// A timed sleep returned `late` after the instant it was asked to wake at.
    pub(crate) fn record_lateness(&self, late: Duration) {
        self.lateness.record(nanos(late));
    }

    /// The plan for a batch of `bytes` submitted at `submitted_at`, once a batch of its size
    /// class has completed; `None` before.
    pub(crate) fn plan(&self, bytes: u64, submitted_at: Instant) -> Option<TailPlan> {
        let (mean, dev) = self.completion[class(bytes)].get()?;
        let (late, late_dev) = self.lateness.get().unwrap_or((0, 0));
        let early = dev.saturating_mul(K).saturating_add(late).saturating_add(late_dev.saturating_mul(K));
        let end = mean.saturating_add(dev.saturating_mul(K));
        let poll_from = mean.saturating_sub(early);
        // A class whose times vary widely polls its likeliest part, from the early wake-up on.
        let poll_to = end.min(poll_from.saturating_add(nanos(MAX_TAIL_POLL)));
        let at = |ns: u64| submitted_at.checked_add(Duration::from_nanos(ns));
        Some(TailPlan { wake_at: at(poll_from)?, poll_until: at(poll_to)? })
    }

    #[cfg(test)]
    fn completion_estimate(&self, bytes: u64) -> Option<(u64, u64)> {
        self.completion[class(bytes)].get()
    }

    /// The smoothed lateness of timed sleeps, `None` before the first one.
    #[cfg(test)]
    pub(crate) fn lateness_estimate(&self) -> Option<Duration> {
        self.lateness.get().map(|(mean, _)| Duration::from_nanos(mean))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn no_plan_before_a_batch_of_the_size_class_completed() {
        let m = WaitModel::default();
        let t0 = Instant::now();
        assert_eq!(m.plan(1 << 20, t0), None);
        m.record_completion(1 << 20, Duration::from_micros(300));
        assert!(m.plan(1 << 20, t0).is_some());
        // 4 KiB is another class.
        assert_eq!(m.plan(4096, t0), None);
    }

    #[test]
    fn the_plan_wakes_before_the_expected_end_by_the_lateness_and_polls_past_it() {
        let m = WaitModel::default();
        let t0 = Instant::now();
        // Mean 300 µs, deviation 150 µs after one sample.
        m.record_completion(1 << 20, Duration::from_micros(300));
        let p = m.plan(1 << 20, t0).unwrap();
        // Wake 4 × 150 µs before the mean: at once. Poll until 4 × 150 µs after it, but for
        // 500 µs at most.
        assert_eq!(p.wake_at - t0, Duration::ZERO);
        assert_eq!(p.poll_until - t0, Duration::from_micros(500));
        // Steady samples shrink the deviation: the wake-up moves towards the mean.
        for _ in 0..200 {
            m.record_completion(1 << 20, Duration::from_micros(300));
        }
        let p = m.plan(1 << 20, t0).unwrap();
        let (mean, dev) = m.completion_estimate(1 << 20).unwrap();
        // Integer steps leave a deviation of a few nanoseconds.
        assert!(mean == 300_000 && dev < 4, "{mean} {dev}");
        let near = |d: Duration, us: u64| d.abs_diff(Duration::from_micros(us)) < Duration::from_nanos(100);
        assert!(near(p.wake_at - t0, 300) && near(p.poll_until - t0, 300), "{p:?}");
        // Timed sleeps that return 40 µs late: the waiter asks to be woken 40 µs earlier.
        for _ in 0..200 {
            m.record_lateness(Duration::from_micros(40));
        }
        let p = m.plan(1 << 20, t0).unwrap();
        assert_eq!(m.lateness_estimate(), Some(Duration::from_micros(40)));
        assert!(near(p.wake_at - t0, 260), "{p:?}");
    }

    #[test]
    fn extreme_sizes_and_durations_neither_panic_nor_overflow() {
        let m = WaitModel::default();
        let t0 = Instant::now();
        for bytes in [0, 1, u64::MAX] {
            m.record_completion(bytes, Duration::MAX);
            m.record_completion(bytes, Duration::ZERO);
            let _ = m.plan(bytes, t0);
        }
        m.record_lateness(Duration::MAX);
        let _ = m.plan(u64::MAX, t0);
    }

    proptest! {
        /// The smoothed mean stays within the samples' range, and a plan never polls for longer
        /// than the cap, nor wakes after it stops polling.
        #[test]
        fn estimates_stay_within_the_samples_and_plans_are_bounded(
            samples in proptest::collection::vec(1u64..10_000_000_000, 1..64),
            late in proptest::collection::vec(0u64..1_000_000, 0..16),
            bytes in any::<u64>(),
        ) {
            let m = WaitModel::default();
            for &s in &samples {
                m.record_completion(bytes, Duration::from_nanos(s));
            }
            for &l in &late {
                m.record_lateness(Duration::from_nanos(l));
            }
            let (mean, _) = m.completion_estimate(bytes).unwrap();
            let (lo, hi) = (*samples.iter().min().unwrap(), *samples.iter().max().unwrap());
            prop_assert!(lo <= mean && mean <= hi, "mean {mean} outside [{lo}, {hi}]");
            let t0 = Instant::now();
            let p = m.plan(bytes, t0).unwrap();
            prop_assert!(p.wake_at <= p.poll_until);
            prop_assert!(p.poll_until - p.wake_at <= MAX_TAIL_POLL);
            prop_assert!(p.wake_at >= t0);
        }
    }
}

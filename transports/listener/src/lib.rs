//! # ferry-listener
//!
//! What Ferry's listening sockets share so that a flood of connections cannot take them down
//! (issue 14 §3): the TCP transport's data port and the P2P handshake listener both use it.
//!
//! - [`raise_open_file_limit`]: every accepted connection takes a file descriptor, and a soft
//!   limit of 1024 is soon reached by a busy node; the soft limit is raised to the hard one
//!   once per process.
//! - [`AcceptBackoff`]: when `accept` fails for want of descriptors the pending connection stays
//!   queued and every retry fails until one is freed; the loop backs off (50 ms doubling to 1 s)
//!   and says so in one line per period with a count, instead of a line per retry.
//! - [`LogThrottle`]: one warning per period, counting what it held back.
//! - [`ConnectionSlots`]: for short-lived connections (handshakes), a limit per remote address
//!   and in all; a new connection over either limit closes the oldest one instead of waiting
//!   behind it, so idle connections cannot starve a real peer.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Raises this process's soft limit on open files to its hard limit, once per process, and says
/// what it did (or why it could not) once. `who` names the listener in that line.
pub fn raise_open_file_limit(who: &str) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let before = rlimit::getrlimit(rlimit::Resource::NOFILE).map(|(soft, _)| soft);
        match (before, rlimit::increase_nofile_limit(u64::MAX)) {
            (Ok(before), Ok(now)) if now > before => {
                tracing::info!(from = before, to = now, "{who}: raised the soft limit on open files")
            }
            (_, Ok(_)) => {}
            (_, Err(e)) => tracing::warn!(error = %e, "{who}: could not raise the soft limit on open files"),
        }
    });
}

/// Lets a repeated warning through at most once per period, counting the occurrences it held
/// back.
#[derive(Debug)]
pub struct LogThrottle {
    period: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogThrottle {
    /// A throttle letting one line through per `period`.
    pub fn new(period: Duration) -> Self {
        Self { period, state: Mutex::new((None, 0)) }
    }

    /// Counts one occurrence; returns how many occurred since the last line (this one included)
    /// when a line is due now.
    pub fn tick(&self) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.1 += 1;
        let now = Instant::now();
        if s.0.is_some_and(|last| now.duration_since(last) < self.period) {
            return None;
        }
        s.0 = Some(now);
        Some(std::mem::take(&mut s.1))
    }
}

/// Sleep after a failed accept that was not for want of file descriptors.
pub const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// First and longest sleep after accepts that failed for want of file descriptors (or memory).
pub const EXHAUSTED_BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));
/// At most one "accept failed" line per this period, with the count of failures.
pub const ACCEPT_LOG_PERIOD: Duration = Duration::from_secs(10);

/// True for accept errors that mean the process (or system) is out of descriptors or memory:
/// retrying at once would fail again.
pub fn exhausted(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// What an accept loop does after `accept` failed: how long to sleep, and one warning per
/// [`ACCEPT_LOG_PERIOD`].
#[derive(Debug)]
pub struct AcceptBackoff {
    who: &'static str,
    backoff: Duration,
    failures: LogThrottle,
}

impl AcceptBackoff {
    /// The backoff of the listener named `who` in its warnings (e.g. `"tcp target"`).
    pub fn new(who: &'static str) -> Self {
        Self { who, backoff: Duration::ZERO, failures: LogThrottle::new(ACCEPT_LOG_PERIOD) }
    }

    /// An accept succeeded: the next failure starts from the shortest sleep.
    pub fn accepted(&mut self) {
        self.backoff = Duration::ZERO;
    }

    /// An accept failed with `e`: logs it (throttled) and returns how long to sleep before the
    /// next accept.
    pub fn failed(&mut self, e: &std::io::Error) -> Duration {
        self.backoff = if exhausted(e) {
            (self.backoff * 2).clamp(EXHAUSTED_BACKOFF.0, EXHAUSTED_BACKOFF.1)
        } else {
            ACCEPT_RETRY
        };
        if let Some(count) = self.failures.tick() {
            tracing::warn!(
                error = %e,
                failures = count,
                retry_in = ?self.backoff,
                "{}: accept failed (this line repeats at most every {ACCEPT_LOG_PERIOD:?}, with the count since the last)",
                self.who
            );
        }
        self.backoff
    }
}

/// Slots for short-lived connections: at most `per_ip` from one remote IP address and `total`
/// in all. A connection admitted over either limit closes the oldest one of its address (or
/// of all) rather than waiting for it: an idle connection holds a slot only until newer ones
/// need it, so a flood of idle connections cannot keep a real peer waiting.
#[derive(Debug)]
pub struct ConnectionSlots {
    per_ip: usize,
    total: usize,
    next_id: AtomicU64,
    live: Mutex<Live>,
    evictions: LogThrottle,
    who: &'static str,
}

#[derive(Debug, Default)]
struct Live {
    /// Admission order: the first entry is the oldest connection.
    by_age: BTreeMap<u64, (IpAddr, oneshot::Sender<()>)>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Live {
    fn remove(&mut self, id: u64) -> bool {
        let Some((ip, _closer)) = self.by_age.remove(&id) else { return false };
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
        true
    }
}

/// A connection's slot: [`Slot::closed`] resolves when a newer connection took the slot over
/// (the connection should close); dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<ConnectionSlots>,
    id: u64,
    closed: oneshot::Receiver<()>,
}

impl Slot {
    /// Resolves once this connection was evicted for a newer one.
    pub async fn closed(&mut self) {
        // The sender is only ever dropped (never used): an error means evicted.
        let _ = (&mut self.closed).await;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.live.lock().unwrap_or_else(|p| p.into_inner()).remove(self.id);
    }
}

impl ConnectionSlots {
    /// Slots for `per_ip` connections per remote IP address and `total` in all (each at
    /// least 1); `who` names the listener in the eviction warning.
    pub fn new(per_ip: usize, total: usize, who: &'static str) -> Arc<Self> {
        Arc::new(Self {
            per_ip: per_ip.max(1),
            total: total.max(1),
            next_id: AtomicU64::new(1),
            live: Mutex::new(Live::default()),
            evictions: LogThrottle::new(Duration::from_secs(10)),
            who,
        })
    }

    /// Admits a connection from `peer`, closing the oldest connection of its address when the
    /// address is at its limit, and the oldest of all when the total is.
    pub fn admit(self: &Arc<Self>, peer: SocketAddr) -> Slot {
        let ip = peer.ip().to_canonical();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (closer, closed) = oneshot::channel();
        let mut evicted = 0u64;
        {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            if live.per_ip.get(&ip).copied().unwrap_or(0) >= self.per_ip {
                let oldest = live.by_age.iter().find(|(_, (i, _))| *i == ip).map(|(id, _)| *id);
                if let Some(oldest) = oldest {
                    evicted += u64::from(live.remove(oldest));
                }
            }
            if live.by_age.len() >= self.total
                && let Some(oldest) = live.by_age.keys().next().copied()
            {
                evicted += u64::from(live.remove(oldest));
            }
            live.by_age.insert(id, (ip, closer));
            *live.per_ip.entry(ip).or_default() += 1;
        }
        if evicted > 0
            && let Some(count) = self.evictions.tick()
        {
            tracing::warn!(
                %ip,
                per_address = self.per_ip,
                total = self.total,
                closed = count,
                "{}: the oldest connections were closed to admit new ones at the connection limit",
                self.who
            );
        }
        Slot { slots: self.clone(), id, closed }
    }

    /// Connections holding a slot now.
    pub fn len(&self) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).by_age.len()
    }

    /// True when no connection holds a slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(ip: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::from((ip, port))
    }

    fn is_closed(slot: &mut Slot) -> bool {
        !matches!(slot.closed.try_recv(), Err(oneshot::error::TryRecvError::Empty))
    }

    #[test]
    fn the_oldest_connection_of_a_full_address_is_closed() {
        let slots = ConnectionSlots::new(2, 100, "test");
        let mut a = slots.admit(from([127, 0, 0, 1], 1));
        let mut b = slots.admit(from([127, 0, 0, 1], 2));
        let mut other = slots.admit(from([127, 0, 0, 2], 1));
        let mut c = slots.admit(from([127, 0, 0, 1], 3));
        assert!(is_closed(&mut a), "the oldest of the full address");
        assert!(!is_closed(&mut b) && !is_closed(&mut c) && !is_closed(&mut other));
        assert_eq!(slots.len(), 3);
        drop(b);
        let mut d = slots.admit(from([127, 0, 0, 1], 4));
        assert!(!is_closed(&mut c) && !is_closed(&mut d), "a freed slot is reused without eviction");
        drop(a); // evicted already: dropping it frees nothing more
        assert_eq!(slots.len(), 3);
    }

    #[test]
    fn the_oldest_of_all_is_closed_when_every_slot_is_taken() {
        let slots = ConnectionSlots::new(10, 3, "test");
        let mut held: Vec<Slot> = (1..=3).map(|i| slots.admit(from([127, 0, 0, i], 1))).collect();
        let mut newest = slots.admit(from([127, 0, 0, 9], 1));
        assert!(is_closed(&mut held[0]));
        assert!(!is_closed(&mut held[1]) && !is_closed(&mut held[2]) && !is_closed(&mut newest));
        assert_eq!(slots.len(), 3);
    }

    #[test]
    fn v4_mapped_v6_is_the_same_address() {
        let slots = ConnectionSlots::new(1, 10, "test");
        let mut a = slots.admit(from([127, 0, 0, 1], 1));
        let _b = slots.admit(SocketAddr::new("::ffff:127.0.0.1".parse().unwrap(), 2));
        assert!(is_closed(&mut a));
    }

    #[tokio::test]
    async fn an_evicted_slot_resolves_closed() {
        let slots = ConnectionSlots::new(1, 10, "test");
        let mut a = slots.admit(from([127, 0, 0, 1], 1));
        let _b = slots.admit(from([127, 0, 0, 1], 2));
        tokio::time::timeout(Duration::from_secs(1), a.closed()).await.unwrap();
    }

    #[test]
    fn the_throttle_counts_what_it_held_back() {
        let t = LogThrottle::new(Duration::from_secs(3600));
        assert_eq!(t.tick(), Some(1));
        assert_eq!((t.tick(), t.tick()), (None, None));
        let t = LogThrottle::new(Duration::ZERO);
        assert_eq!((t.tick(), t.tick()), (Some(1), Some(1)));
    }

    #[test]
    fn running_out_of_descriptors_backs_off_doubling_to_a_second() {
        let mut b = AcceptBackoff::new("test");
        let emfile = std::io::Error::from_raw_os_error(libc::EMFILE);
        let sleeps: Vec<Duration> = (0..7).map(|_| b.failed(&emfile)).collect();
        assert_eq!(sleeps[0], EXHAUSTED_BACKOFF.0);
        assert_eq!(sleeps[1], EXHAUSTED_BACKOFF.0 * 2);
        assert_eq!(*sleeps.last().unwrap(), EXHAUSTED_BACKOFF.1);
        b.accepted();
        assert_eq!(b.failed(&emfile), EXHAUSTED_BACKOFF.0);
        assert_eq!(b.failed(&std::io::Error::from_raw_os_error(libc::ECONNABORTED)), ACCEPT_RETRY);
    }
}

//! The log of refused peers: one warning per peer address, kind of refusal and interval, however
//! often it retries, so a Mooncake engine (or a misconfigured Ferry one) reconnecting in a loop
//! cannot flood the log.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::exchange::AuthError;

/// Peers remembered at once; past this, those not logged within the interval are forgotten.
const MAX_PEERS: usize = 4096;

/// Rate-limited warnings about refused peers, per peer IP address and kind of refusal.
#[derive(Debug)]
pub struct RefusalLog {
    what: &'static str,
    interval: Duration,
    peers: Mutex<HashMap<(IpAddr, Reason), Entry>>,
}

/// The kinds of refusal logged apart (a Mooncake engine and a Ferry engine with another secret
/// on one host are two warnings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Reason {
    NoAuthentication,
    WrongSecret,
    Slow,
    Other,
}

impl Reason {
    fn of(why: &AuthError) -> Self {
        match why {
            AuthError::NotFerry(_) | AuthError::Unanswered(_) => Reason::NoAuthentication,
            AuthError::BadProof | AuthError::Refused => Reason::WrongSecret,
            AuthError::Timeout => Reason::Slow,
            AuthError::Version(_) | AuthError::Io(_) => Reason::Other,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    logged: Instant,
    /// Refusals since the last warning.
    since: u64,
}

impl RefusalLog {
    /// A log for refusals on `what` (`tcp target`, `P2P handshake`), at most one warning per
    /// peer IP address every `interval`.
    pub fn new(what: &'static str, interval: Duration) -> Self {
        Self { what, interval, peers: Mutex::new(HashMap::new()) }
    }

    /// Records that `peer` was refused for `why`; logs a warning unless one was logged for its
    /// address and that kind of refusal within the interval. Returns whether it logged.
    pub fn refused(&self, peer: SocketAddr, why: &AuthError) -> bool {
        let now = Instant::now();
        let reason = Reason::of(why);
        let key = (peer.ip(), reason);
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if !peers.contains_key(&key) && peers.len() >= MAX_PEERS {
            let interval = self.interval;
            peers.retain(|_, e| now.duration_since(e.logged) < interval);
        }
        // Past the bound, every new address shares one entry (the unspecified address): many
        // peers at once still cost one warning per interval and kind.
        let key = if peers.len() < MAX_PEERS || peers.contains_key(&key) {
            key
        } else {
            (IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), reason)
        };
        let suppressed = match peers.get_mut(&key) {
            Some(e) if now.duration_since(e.logged) < self.interval => {
                e.since += 1;
                return false;
            }
            Some(e) => std::mem::replace(e, Entry { logged: now, since: 0 }).since,
            None => {
                peers.insert(key, Entry { logged: now, since: 0 });
                0
            }
        };
        drop(peers);
        let advice = match reason {
            Reason::NoAuthentication => "such peers are refused while authentication is on (Mooncake has none)",
            Reason::WrongSecret => "give every node of the cluster the same auth secret",
            Reason::Slow => "a peer must complete authentication right after connecting",
            Reason::Other => "the connection was closed",
        };
        tracing::warn!(
            %peer,
            refused_before = suppressed,
            "{}: refused a connection from {peer}: {why}; {advice} (one warning per peer every {:?})",
            self.what,
            self.interval
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_peer_and_interval() {
        let log = RefusalLog::new("test", Duration::from_millis(200));
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let a2: SocketAddr = "10.0.0.1:5001".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:5000".parse().unwrap();
        assert!(log.refused(a, &AuthError::BadProof));
        assert!(!log.refused(a2, &AuthError::BadProof), "the same address on another port");
        assert!(log.refused(b, &AuthError::Timeout), "another peer");
        assert!(log.refused(a, &AuthError::NotFerry([0; 8])), "another kind of refusal");
        assert!(!log.refused(a2, &AuthError::Unanswered("closed".into())), "the same kind");
        std::thread::sleep(Duration::from_millis(250));
        assert!(log.refused(a, &AuthError::BadProof), "after the interval");
        assert_eq!(log.peers.lock().unwrap()[&(a.ip(), Reason::WrongSecret)].since, 0);
    }

    #[test]
    fn the_table_is_bounded() {
        let log = RefusalLog::new("test", Duration::from_secs(3600));
        let mut logged = 0;
        for i in 0..(MAX_PEERS as u32 + 100) {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i);
            logged += usize::from(log.refused(SocketAddr::new(ip.into(), 1), &AuthError::Timeout));
        }
        assert!(log.peers.lock().unwrap().len() <= MAX_PEERS + 1);
        assert_eq!(logged, MAX_PEERS + 1, "the peers past the bound share one warning");
    }
}

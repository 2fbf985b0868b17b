//! The target's table of live connections: a limit per remote IP address (the idlest connection
//! of an address that reached it is closed to admit a new one), and the lookup by remote address
//! that a fence request ([`crate::fence`]) uses.
//!
//! Each connection has a [`Conn`]: whether it is in the middle of a request, when it last served
//! one, and whether it was asked to stop (evicted, or fenced). Its task reads those flags at the
//! points where stopping is safe; nothing here touches a socket.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_listener::LogThrottle;
use tokio::sync::Notify;

/// A connection asked to stop: why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Its address has too many connections and it was the idlest: it closes when it next waits
    /// for a request with nothing received.
    Evicted,
    /// Named by a fence request: it serves nothing more.
    Fenced,
}

const LIVE: u8 = 0;
const EVICTED: u8 = 1;
const FENCED: u8 = 2;

/// One live connection, as its task and the table see it.
#[derive(Debug)]
pub(crate) struct Conn {
    id: u64,
    peer: SocketAddr,
    /// In the middle of a request inside registered memory (never evicted then).
    busy: AtomicBool,
    /// When it last served a request inside registered memory, in milliseconds since the
    /// table's epoch plus one (0: never).
    last_served: AtomicU64,
    stop: AtomicU8,
    /// Wakes the task while it waits for a request (eviction and fences).
    pub(crate) idle_wake: Notify,
    /// Wakes the task while it copies a WRITE's payload into memory (fences only).
    pub(crate) fence_wake: Notify,
    /// Held while a WRITE's payload is copied into registered memory: a fence takes it to know
    /// that no copy is under way.
    pub(crate) copying: tokio::sync::Mutex<()>,
}

impl Conn {
    /// The remote address.
    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Whether (and why) it was asked to stop.
    pub(crate) fn stop(&self) -> Option<Stop> {
        match self.stop.load(Ordering::SeqCst) {
            LIVE => None,
            EVICTED => Some(Stop::Evicted),
            _ => Some(Stop::Fenced),
        }
    }

    /// True once a fence named it.
    pub(crate) fn fenced(&self) -> bool {
        self.stop.load(Ordering::SeqCst) == FENCED
    }

    /// Marks the start (`true`) or end of a request inside registered memory.
    pub(crate) fn set_busy(&self, busy: bool) {
        self.busy.store(busy, Ordering::SeqCst);
    }

    /// An eviction found bytes of a request already waiting: the connection stays.
    pub(crate) fn decline_eviction(&self) {
        let _ = self.stop.compare_exchange(EVICTED, LIVE, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Marks it fenced and wakes its task wherever it waits. The caller then takes
    /// [`copying`](Self::copying) to know that no copy into memory is under way.
    pub(crate) fn fence(&self) {
        self.stop.store(FENCED, Ordering::SeqCst);
        self.idle_wake.notify_one();
        self.fence_wake.notify_one();
    }

    fn evictable(&self) -> bool {
        !self.busy.load(Ordering::SeqCst) && self.stop.load(Ordering::SeqCst) == LIVE
    }

    /// Marks it evicted unless it became busy or was stopped meanwhile; wakes its task.
    fn evict(&self) -> bool {
        if self.stop.compare_exchange(LIVE, EVICTED, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return false;
        }
        self.idle_wake.notify_one();
        true
    }
}

/// Asks the idlest of `conns` that is not busy nor stopped to close: one that never served a
/// request first (the oldest of those), else the one that served its last request longest ago;
/// a victim that turns busy in between is skipped. False when none could be asked.
fn evict_idlest<'a>(conns: impl Iterator<Item = &'a Arc<Conn>>) -> bool {
    let mut candidates: Vec<&Arc<Conn>> = conns.filter(|c| c.evictable()).collect();
    candidates.sort_by_key(|c| (c.last_served.load(Ordering::Relaxed), c.id));
    candidates.into_iter().any(|c| c.evict())
}

/// The target's live connections by remote IP address.
#[derive(Debug)]
pub(crate) struct ConnTable {
    by_ip: Mutex<HashMap<IpAddr, Vec<Arc<Conn>>>>,
    per_ip: usize,
    epoch: Instant,
    next_id: AtomicU64,
    evictions: LogThrottle,
}

/// A connection's place in the table; dropping it removes the connection.
#[derive(Debug)]
pub(crate) struct Admitted {
    table: Arc<ConnTable>,
    conn: Arc<Conn>,
}

impl Admitted {
    /// The connection's state.
    pub(crate) fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }

    /// The connection served a request inside registered memory just now.
    pub(crate) fn served(&self) {
        let ms = self.table.epoch.elapsed().as_millis() as u64 + 1;
        self.conn.last_served.store(ms, Ordering::Relaxed);
    }

    /// The table it belongs to.
    pub(crate) fn table(&self) -> &ConnTable {
        &self.table
    }

    /// An eviction found bytes of a request already waiting: the connection stays, and the
    /// idlest other connection of its address is asked to close in its place, so the address
    /// goes back to its limit (none when every other one is busy).
    pub(crate) fn decline_eviction(&self) {
        self.conn.decline_eviction();
        self.table.evict_over_limit(self.conn.peer.ip().to_canonical(), &self.conn);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let ip = self.conn.peer.ip().to_canonical();
        let mut map = self.table.by_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = map.get_mut(&ip) {
            list.retain(|c| c.id != self.conn.id);
            if list.is_empty() {
                map.remove(&ip);
            }
        }
    }
}

impl ConnTable {
    /// A table admitting `per_ip` connections per remote IP address before it evicts.
    pub(crate) fn new(per_ip: usize) -> Arc<Self> {
        Arc::new(Self {
            by_ip: Mutex::new(HashMap::new()),
            per_ip: per_ip.max(1),
            epoch: Instant::now(),
            next_id: AtomicU64::new(1),
            evictions: LogThrottle::new(Duration::from_secs(10)),
        })
    }

    /// Admits a connection from `peer`. When its address already has the limit's number of
    /// connections not asked to stop, the idlest of them that is not in the middle of a
    /// request is asked to close: one that never served a request first (the oldest of those),
    /// else the one that served its last request longest ago. When all of them are busy the
    /// new connection is admitted all the same: busy connections move registered memory for a
    /// peer that knows its addresses, and only idle ones are what a flood is made of.
    pub(crate) fn admit(self: &Arc<Self>, peer: SocketAddr) -> Admitted {
        let conn = Arc::new(Conn {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            peer,
            busy: AtomicBool::new(false),
            last_served: AtomicU64::new(0),
            stop: AtomicU8::new(LIVE),
            idle_wake: Notify::new(),
            fence_wake: Notify::new(),
            copying: tokio::sync::Mutex::new(()),
        });
        let ip = peer.ip().to_canonical();
        let mut evicted = false;
        {
            let mut map = self.by_ip.lock().unwrap_or_else(|p| p.into_inner());
            let list = map.entry(ip).or_default();
            let live = list.iter().filter(|c| c.stop().is_none()).count();
            if live >= self.per_ip {
                evicted = evict_idlest(list.iter());
            }
            list.push(conn.clone());
        }
        if evicted && let Some(count) = self.evictions.tick() {
            tracing::warn!(
                %ip,
                limit = self.per_ip,
                closed = count,
                "tcp target: idle connections closed to admit new ones from an address at its connection limit"
            );
        }
        Admitted { table: self.clone(), conn }
    }

    /// When `ip` has more connections not asked to stop than its limit, asks the idlest of them
    /// other than `except` to close (as [`ConnTable::admit`] picks).
    fn evict_over_limit(&self, ip: IpAddr, except: &Conn) {
        let map = self.by_ip.lock().unwrap_or_else(|p| p.into_inner());
        let Some(list) = map.get(&ip) else { return };
        if list.iter().filter(|c| c.stop().is_none()).count() <= self.per_ip {
            return;
        }
        evict_idlest(list.iter().filter(|c| c.id != except.id));
    }

    /// Asks the idlest connection of all, from any address, to close (as [`ConnTable::admit`]
    /// picks within an address): called when every slot of the target is taken, so that a
    /// flood of idle connections from many addresses cannot keep new ones waiting. False when
    /// every connection is busy.
    pub(crate) fn evict_idlest_anywhere(&self) -> bool {
        let evicted = {
            let map = self.by_ip.lock().unwrap_or_else(|p| p.into_inner());
            evict_idlest(map.values().flatten())
        };
        if evicted && let Some(count) = self.evictions.tick() {
            tracing::warn!(
                closed = count,
                "tcp target: idle connections closed to admit new ones at the target's connection limit (tcp_max_connections)"
            );
        }
        evicted
    }

    /// The live connections whose remote address is `peer`, except `except`.
    pub(crate) fn find(&self, peer: SocketAddr, except: &Conn) -> Vec<Arc<Conn>> {
        let map = self.by_ip.lock().unwrap_or_else(|p| p.into_inner());
        let want = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        map.get(&want.ip())
            .map(|list| {
                list.iter()
                    .filter(|c| c.id != except.id && SocketAddr::new(c.peer.ip().to_canonical(), c.peer.port()) == want)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Connections from `ip` (for tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn count(&self, ip: IpAddr) -> usize {
        self.by_ip.lock().unwrap().get(&ip).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 9], port))
    }

    #[test]
    fn the_idlest_connection_of_a_full_address_is_evicted() {
        let table = ConnTable::new(3);
        let a = table.admit(addr(1));
        let b = table.admit(addr(2));
        let c = table.admit(addr(3));
        b.served();
        c.conn().set_busy(true);
        let other = table.admit(SocketAddr::from(([127, 0, 0, 8], 1)));
        assert!(a.conn().stop().is_none() && other.conn().stop().is_none(), "another address has its own limit");
        let d = table.admit(addr(4));
        assert_eq!(a.conn().stop(), Some(Stop::Evicted), "never served: the first to go");
        let e = table.admit(addr(5));
        assert_eq!(d.conn().stop(), Some(Stop::Evicted), "the oldest that never served");
        a.conn().decline_eviction(); // a request was already waiting on it
        assert!(a.conn().stop().is_none());
        drop(e);
        let _f = table.admit(addr(6));
        assert_eq!(a.conn().stop(), Some(Stop::Evicted));
        assert_eq!(b.conn().stop(), None, "it served a request: kept while others never did");
        assert_eq!(c.conn().stop(), None, "busy: never evicted");
        drop((a, d));
        assert_eq!(table.count(addr(1).ip()), 3);
    }

    #[test]
    fn a_connection_that_declines_its_eviction_passes_it_to_the_next_idlest() {
        let table = ConnTable::new(2);
        let a = table.admit(addr(1));
        let b = table.admit(addr(2));
        let c = table.admit(addr(3));
        assert_eq!(a.conn().stop(), Some(Stop::Evicted));
        a.decline_eviction(); // a request was already waiting on it
        assert_eq!(a.conn().stop(), None);
        assert_eq!(b.conn().stop(), Some(Stop::Evicted), "the next idlest goes in its place");
        assert_eq!(c.conn().stop(), None);
        // b declines too: a, the idlest other one, is asked again.
        b.decline_eviction();
        assert_eq!((a.conn().stop(), b.conn().stop(), c.conn().stop()), (Some(Stop::Evicted), None, None));
        // A decline at the limit asks nobody (c was never asked: nothing changes).
        drop(a);
        c.decline_eviction();
        assert_eq!((b.conn().stop(), c.conn().stop()), (None, None));
        // A busy connection is passed over, as by `admit`; when all the others are busy, nobody
        // is asked and the address stays over its limit.
        let d = table.admit(addr(4));
        assert_eq!(b.conn().stop(), Some(Stop::Evicted));
        c.conn().set_busy(true);
        b.decline_eviction();
        assert_eq!((b.conn().stop(), c.conn().stop(), d.conn().stop()), (None, None, Some(Stop::Evicted)));
        d.conn().set_busy(true);
        d.decline_eviction();
        assert_eq!((b.conn().stop(), c.conn().stop(), d.conn().stop()), (Some(Stop::Evicted), None, None));
        b.decline_eviction();
        assert_eq!((b.conn().stop(), c.conn().stop(), d.conn().stop()), (None, None, None), "c and d are busy");
    }

    #[test]
    fn a_full_address_of_busy_connections_still_admits() {
        let table = ConnTable::new(1);
        let a = table.admit(addr(1));
        a.conn().set_busy(true);
        let b = table.admit(addr(2));
        assert!(a.conn().stop().is_none() && b.conn().stop().is_none());
        assert_eq!(table.count(addr(1).ip()), 2);
    }

    #[test]
    fn the_idlest_of_all_addresses_is_evicted_when_the_target_is_full() {
        let table = ConnTable::new(8);
        let a = table.admit(addr(1));
        let b = table.admit(SocketAddr::from(([127, 0, 0, 2], 1)));
        let c = table.admit(SocketAddr::from(([127, 0, 0, 3], 1)));
        a.served();
        c.conn().set_busy(true);
        assert!(table.evict_idlest_anywhere());
        assert_eq!(b.conn().stop(), Some(Stop::Evicted), "never served: the first to go, whatever its address");
        assert!(table.evict_idlest_anywhere());
        assert_eq!(a.conn().stop(), Some(Stop::Evicted));
        assert!(!table.evict_idlest_anywhere(), "only a busy connection is left");
        assert_eq!(c.conn().stop(), None);
    }

    #[test]
    fn fences_find_connections_by_remote_address() {
        let table = ConnTable::new(8);
        let a = table.admit(addr(1));
        let fence = table.admit(addr(1)); // the same address again (a reused port)
        let v6 = SocketAddr::new("::ffff:127.0.0.9".parse().unwrap(), 1);
        let found = table.find(v6, fence.conn());
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].peer(), a.conn().peer());
        found[0].fence();
        assert!(a.conn().fenced() && !a.conn().evict(), "a fenced connection stays fenced");
        assert!(table.find(addr(2), fence.conn()).is_empty());
    }
}

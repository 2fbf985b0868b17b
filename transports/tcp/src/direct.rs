//! The direct path: one request's whole round trip on the submitting thread.
//!
//! A caller that submits a single request and then blocks waiting for it
//! ([`Submission::caller_waits`]) would otherwise pay two thread wake-ups per request: the lane's
//! I/O thread woken to send it, and the caller woken when that thread completes it. Each costs
//! tens of microseconds on a virtualised host, as much as a small transfer. So when such a
//! request finds one of its peer's *direct connections* idle, the caller's thread writes the
//! header (and a WRITE's payload, in one vectored write, straight from registered memory) and
//! reads the status (and a READ's data, straight into registered memory) itself, over a
//! non-blocking socket it polls and waits on, and completes the request before `submit` returns.
//!
//! What the lanes guarantee holds here too:
//! - **Only when free.** A direct connection is taken only when one is idle, with a lock that
//!   is never waited for (held for a few instructions only); otherwise the request goes through
//!   a lane. v1 peers, peers with a fence due ([`PeerFence::pending`]: the lanes settle it
//!   first), batches of several requests and callers that do not wait go through the lanes.
//! - **Opened off the caller's path.** The first waiting request to a peer goes through a lane
//!   and asks an I/O thread to open a direct connection with the lanes' own
//!   [`connect`](crate::initiator::connect) (peer authentication included), which is then made
//!   a non-blocking std socket and put in the peer's pool (at most as many as the peer has lanes).
//!   A connection that failed is dropped and reopened the same way.
//! - **Deadlines.** The socket is non-blocking; the caller's thread polls it for up to
//!   [`spin_before_sleep`](ferry_core::batch::spin_before_sleep) (the answer to a small request
//!   comes sooner than a sleeping thread wakes), then waits for it with `ppoll`, at most until
//!   the request's deadline.
//! - **Fences.** A connection that failed a WRITE is marked in the peer's [`PeerFence`] before
//!   the failure is reported; the next request then goes through a lane, which fences first.
//! - **Idle closes.** A connection is checked (a peek) before each request; one the
//!   peer closed while idle is dropped and the request goes through a lane, which opens a fresh
//!   connection (READ and WRITE are idempotent, and nothing was sent).
//! - **Shutdown.** Every direct connection is registered with the transport's
//!   [`DirectRegistry`] (a clone of its socket); the transport's shutdown shuts them all down,
//!   which ends a caller's blocked read or write at once with
//!   [`ErrorKind::Shutdown`](ferry_core::ErrorKind::Shutdown).
//! - **Memory.** Memory is touched only through [`bytes`] and [`bytes_mut`], under the lease the
//!   [`Submission`] holds until it is completed, after the last system call on it.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_core::{Error, ErrorKind, Opcode, Submission, ValidatedRequest};

use crate::fence::PeerFence;
use crate::initiator::PeerAddr;
use crate::memory::{bytes, bytes_mut};
use crate::wire::{HEADER_LEN, Header, STATUS_LEN, Status};

/// The transport's direct connections, to cut them all at shutdown.
#[derive(Debug, Default)]
pub(crate) struct DirectRegistry {
    stopped: AtomicBool,
    /// A clone of each open direct connection's socket, by id.
    open: Mutex<Vec<(u64, TcpStream)>>,
    next: AtomicU64,
}

impl DirectRegistry {
    /// True once the transport shuts down: no direct request starts any more.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Shuts every direct connection down (a caller blocked on one returns at once), and
    /// refuses new ones.
    pub(crate) fn stop(&self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        self.stopped.store(true, Ordering::SeqCst);
        for (_, s) in open.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Registers `stream`; `None` once stopped (or when its socket cannot be cloned).
    fn register(self: &Arc<Self>, stream: &TcpStream) -> Option<Registration> {
        let clone = stream.try_clone().ok()?;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock `stop` takes: a connection registered here is cut by a stop
        // that comes later, and a stop that came first refuses it.
        if self.stopped() {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        open.push((id, clone));
        Some(Registration { registry: self.clone(), id })
    }
}

/// A direct connection's entry in the registry, removed when the connection is dropped.
#[derive(Debug)]
struct Registration {
    registry: Arc<DirectRegistry>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.open.lock().unwrap_or_else(|p| p.into_inner()).retain(|(id, _)| *id != self.id);
    }
}

/// One direct connection: a non-blocking std socket that the caller's thread polls and waits on,
/// idle between requests.
#[derive(Debug)]
pub(crate) struct DirectConn {
    stream: TcpStream,
    /// The address the peer sees it from (what a fence names).
    local: SocketAddr,
    _registration: Registration,
}

impl DirectConn {
    /// Makes `stream` (connected, and authenticated when peer authentication is on) a direct
    /// connection registered with `registry`.
    pub(crate) fn new(stream: TcpStream, registry: &Arc<DirectRegistry>) -> std::io::Result<Self> {
        // Non-blocking: every wait is a `ppoll` bounded by the request's deadline.
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        let local = stream.local_addr()?;
        let registration =
            registry.register(&stream).ok_or_else(|| std::io::Error::other("the transport is shutting down"))?;
        Ok(Self { stream, local, _registration: registration })
    }

    /// Whether the peer kept the idle connection open: nothing to read yet. A clean close, an
    /// error or a stray byte all mean it cannot carry a request.
    pub(crate) fn still_open(&self) -> bool {
        matches!(self.stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

/// A peer's direct connections.
#[derive(Debug)]
pub(crate) struct DirectPool {
    state: Mutex<PoolState>,
    /// At most this many connections (idle, in use and being opened).
    max: usize,
}

#[derive(Debug, Default)]
struct PoolState {
    idle: Vec<DirectConn>,
    /// Connections idle, in use or being opened.
    count: usize,
}

/// What [`DirectPool::take`] found.
pub(crate) enum Take {
    /// An idle connection, now the caller's.
    Conn(DirectConn),
    /// None idle; one more should be opened (the pool counts it already).
    Open,
    /// None idle, or the pool was busy for a moment.
    None,
}

impl DirectPool {
    pub(crate) fn new(max: usize) -> Self {
        Self { state: Mutex::new(PoolState::default()), max: max.max(1) }
    }

    /// An idle connection, never waiting for the lock.
    pub(crate) fn take(&self) -> Take {
        let Ok(mut s) = self.state.try_lock() else { return Take::None };
        if let Some(c) = s.idle.pop() {
            return Take::Conn(c);
        }
        if s.count < self.max {
            s.count += 1;
            return Take::Open;
        }
        Take::None
    }

    /// Gives back a connection that served its request.
    pub(crate) fn put(&self, conn: DirectConn) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).idle.push(conn);
    }

    /// A connection taken, or being opened, is gone.
    pub(crate) fn lost(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.count = s.count.saturating_sub(1);
    }
}

/// Counts an opening connection lost unless it was put into the pool.
pub(crate) struct Opening(Option<Arc<DirectPool>>);

impl Opening {
    pub(crate) fn new(pool: Arc<DirectPool>) -> Self {
        Self(Some(pool))
    }

    /// The connection opened: into the pool.
    pub(crate) fn done(mut self, conn: DirectConn) {
        if let Some(pool) = self.0.take() {
            pool.put(conn);
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(pool) = self.0.take() {
            pool.lost();
        }
    }
}

/// Runs the one request of `submission` over `conn` on this thread and completes it. Returns
/// the connection when it can serve another request.
///
/// Before a failure of a WRITE is reported the connection is marked in `fence`.
pub(crate) fn run(
    addr: &PeerAddr,
    conn: DirectConn,
    submission: Submission,
    deadline: Instant,
    fence: &PeerFence,
    registry: &DirectRegistry,
) -> Option<DirectConn> {
    let Some(submission) = submission.unless_cancelled("it was sent") else { return Some(conn) };
    if deadline <= Instant::now() {
        submission.fail_all(&Error::timeout("tcp request not sent before its deadline"));
        return Some(conn);
    }
    let index = submission.indices()[0];
    let v = submission.request(index);
    match round_trip(addr, &conn.stream, v, deadline) {
        Ok(outcome) => {
            submission.complete_all(&outcome);
            Some(conn)
        }
        Err(failure) => {
            // The connection is out of step (or gone): dropped. A WRITE on it may still land,
            // so the peer's lanes fence it before anything more goes to that peer.
            if v.request.opcode == Opcode::Write {
                fence.mark(conn.local);
            }
            drop(conn);
            let failure = if registry.stopped() {
                Error::new(
                    ErrorKind::Shutdown,
                    format!("tcp peer {}:{}: transport shut down while waiting for the response", addr.host, addr.port),
                )
            } else {
                failure
            };
            submission.fail_all(&failure);
            None
        }
    }
}

/// Sends `v` and reads its answer. `Ok` holds the request's outcome (a rejection included: the
/// connection stays in step); `Err`, a failure that ends the connection.
fn round_trip(
    addr: &PeerAddr,
    s: &TcpStream,
    v: &ValidatedRequest,
    deadline: Instant,
) -> Result<Result<(), Error>, Error> {
    let r = &v.request;
    let header = Header { size: r.length, addr: r.target_offset, opcode: r.opcode, v2: true }.encode();
    let payload: &[u8] = match r.opcode {
        Opcode::Write => bytes(&v.local, r.source, r.length)
            .ok_or_else(|| Error::transport("local range outside its leased region"))?,
        Opcode::Read => &[],
    };
    write_all(addr, s, &header, payload, deadline)?;
    // A READ's data goes straight into its destination; the status and the first of the data
    // are read in one call.
    let dst: &mut [u8] = match r.opcode {
        Opcode::Read => bytes_mut(&v.local, r.source, r.length)
            .ok_or_else(|| Error::transport("local range outside its leased region"))?,
        Opcode::Write => &mut [],
    };
    let mut status = [0u8; STATUS_LEN];
    let mut got = 0usize;
    while got < STATUS_LEN {
        // The answer cannot be there yet when the request was just written: wait first.
        got += read_some(addr, s, &mut [IoSliceMut::new(&mut status[got..]), IoSliceMut::new(dst)], deadline, true)?;
    }
    match check_status(r, &status).map_err(|e| protocol(addr, e))? {
        // A rejection comes alone; anything after it is a peer out of step.
        Err(_) if got > STATUS_LEN => Err(protocol(addr, std::io::Error::other("data after a rejection"))),
        Err(rejected) => Ok(Err(rejected)),
        Ok(()) => {
            let mut at = got - STATUS_LEN;
            // A large READ is woken only once a large part of it arrived (each wake-up costs as
            // much as copying tens of KiB here), never for more than is still to come. Not when
            // this thread polls between reads ([`read_some`]): it copies each part as it comes,
            // while the peer sends the next, and a raised mark would only add system calls.
            let polls = !ferry_core::batch::spin_before_sleep().is_zero();
            let mut lowat = Lowat::new(s, dst.len() - at > LOWAT_FROM && !polls);
            while at < dst.len() {
                lowat.at_most(dst.len() - at).map_err(|e| lost(addr, "read failed", e))?;
                at += read_some(addr, s, &mut [IoSliceMut::new(&mut dst[at..])], deadline, lowat.on())?;
            }
            lowat.reset().map_err(|e| lost(addr, "read failed", e))?;
            Ok(Ok(()))
        }
    }
}

fn protocol(addr: &PeerAddr, e: std::io::Error) -> Error {
    Error::unreachable(format!("tcp peer {}:{}: bad response: {e}", addr.host, addr.port))
}

/// The request's outcome from its status frame (`Err` for a frame that is not one).
fn check_status(r: &ferry_core::TransferRequest, st: &[u8; STATUS_LEN]) -> std::io::Result<Result<(), Error>> {
    match Status::decode(st) {
        Ok(Status::Ok) => Ok(Ok(())),
        Ok(Status::Rejected) => Ok(Err(Error::new(
            ErrorKind::OutOfBounds,
            format!(
                "peer rejected {:?} of {:#x}+{}: outside its registered memory",
                r.opcode, r.target_offset, r.length
            ),
        ))),
        Err(e) => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
    }
}

/// READ data beyond this is read with a raised `SO_RCVLOWAT`.
const LOWAT_FROM: usize = 64 * 1024;
/// The highest `SO_RCVLOWAT` set (the kernel grows the receive buffer to twice it).
const LOWAT_MAX: usize = 512 * 1024;

/// A socket's `SO_RCVLOWAT` while a large READ's data is read: the caller's thread is woken
/// once `min(rest, LOWAT_MAX)` bytes are there instead of at every segment. Set back to 1
/// with [`reset`](Self::reset) (a connection that failed is dropped, whatever its setting).
struct Lowat<'a> {
    s: &'a TcpStream,
    /// The value set, 1 when untouched (`None` when not used at all).
    set: Option<usize>,
}

impl<'a> Lowat<'a> {
    fn new(s: &'a TcpStream, used: bool) -> Self {
        Self { s, set: used.then_some(1) }
    }

    /// Whether it is raised: the data of a wait is not there yet.
    fn on(&self) -> bool {
        self.set.is_some_and(|v| v > 1)
    }

    /// Sets it to `min(rest, LOWAT_MAX)` when it is above `rest` or below that: never more than
    /// will come (a wait for it would never end).
    fn at_most(&mut self, rest: usize) -> std::io::Result<()> {
        let Some(set) = self.set else { return Ok(()) };
        let want = rest.min(LOWAT_MAX);
        if set > rest || (set < want && set == 1) {
            crate::io::set_rcvlowat(self.s, want)?;
            self.set = Some(want);
        }
        Ok(())
    }

    fn reset(&mut self) -> std::io::Result<()> {
        if self.on() {
            crate::io::set_rcvlowat(self.s, 1)?;
            self.set = Some(1);
        }
        Ok(())
    }
}

/// Waits until `s` has `events` (`POLLIN`, `POLLOUT`; an error or a hang-up counts too: the next
/// call reports it), at most until `deadline`. `Ok(false)` when the deadline passed.
fn wait(s: &TcpStream, events: libc::c_short, deadline: Instant) -> std::io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(left.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(left.subsec_nanos()),
        };
        let mut fd = libc::pollfd { fd: s.as_raw_fd(), events, revents: 0 };
        // SAFETY: `fd` and `ts` are live locals, one `pollfd` as the count says; a null signal
        // mask leaves the thread's mask alone. The descriptor is `s`'s own, open while borrowed.
        let n = unsafe { libc::ppoll(&mut fd, 1, &ts, std::ptr::null()) };
        match n {
            0 => {}
            n if n > 0 => return Ok(true),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

fn timeout(addr: &PeerAddr, what: &str) -> Error {
    Error::timeout(format!("tcp peer {}:{}: {what} before the request's deadline", addr.host, addr.port))
}

/// Writes the header and the payload before `deadline`.
fn write_all(
    addr: &PeerAddr,
    mut s: &TcpStream,
    header: &[u8; HEADER_LEN],
    payload: &[u8],
    deadline: Instant,
) -> Result<(), Error> {
    let mut slices = [IoSlice::new(header), IoSlice::new(payload)];
    let mut rest: &mut [IoSlice<'_>] = if payload.is_empty() { &mut slices[..1] } else { &mut slices };
    // A full send buffer drains as fast as the target reads: poll for room before sleeping, as
    // `read_some` does for bytes.
    let spin = ferry_core::batch::spin_before_sleep();
    let mut polling_until = Instant::now() + spin;
    while !rest.is_empty() {
        match s.write_vectored(rest) {
            Ok(0) => return Err(lost(addr, "write failed", std::io::ErrorKind::WriteZero.into())),
            Ok(n) => {
                IoSlice::advance_slices(&mut rest, n);
                polling_until = Instant::now() + spin;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now < polling_until && now < deadline {
                    std::hint::spin_loop();
                    continue;
                }
                if !wait(s, libc::POLLOUT, deadline).map_err(|e| lost(addr, "write failed", e))? {
                    return Err(timeout(addr, "request not sent"));
                }
            }
            Err(e) => return Err(lost(addr, "write failed", e)),
        }
    }
    Ok(())
}

/// Reads at least one byte into `bufs` before `deadline`; with `wait_first`, waits for the
/// socket before the first attempt (an answer to a request just sent is not there yet).
fn read_some(
    addr: &PeerAddr,
    mut s: &TcpStream,
    bufs: &mut [IoSliceMut<'_>],
    deadline: Instant,
    wait_first: bool,
) -> Result<usize, Error> {
    let unanswered = "closed the connection without answering: the peer is shutting down (or its process ended)";
    let mut ready = !wait_first;
    // Poll before sleeping: on a virtualised host the wake-up out of `ppoll` costs tens of
    // microseconds, more than the answer to a small request takes to come. This thread is the
    // caller's, which waits anyway; no I/O thread of this process needs its core.
    let spin = ferry_core::batch::spin_before_sleep().min(deadline.saturating_duration_since(Instant::now()));
    let mut polling_until = (!spin.is_zero()).then(|| Instant::now() + spin);
    loop {
        if let Some(until) = polling_until {
            match s.read_vectored(bufs) {
                Ok(0) => return Err(lost(addr, unanswered, std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => {
                    if Instant::now() < until {
                        std::hint::spin_loop();
                    } else {
                        polling_until = None;
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Err(lost(addr, unanswered, e)),
                Err(e) => return Err(lost(addr, "connection lost", e)),
            }
        }
        if !ready && !wait(s, libc::POLLIN, deadline).map_err(|e| lost(addr, "read failed", e))? {
            return Err(timeout(addr, "no response"));
        }
        match s.read_vectored(bufs) {
            Ok(0) => return Err(lost(addr, unanswered, std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => ready = true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => ready = false,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Err(lost(addr, unanswered, e)),
            Err(e) => return Err(lost(addr, "connection lost", e)),
        }
    }
}

fn lost(addr: &PeerAddr, what: &str, e: std::io::Error) -> Error {
    Error::unreachable(format!("tcp peer {}:{}: {what}: {e}", addr.host, addr.port))
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn a_pool_opens_at_most_its_size_and_counts_what_it_loses() {
        let registry = Arc::new(DirectRegistry::default());
        let pool = Arc::new(DirectPool::new(2));
        assert!(matches!(pool.take(), Take::Open));
        assert!(matches!(pool.take(), Take::Open));
        assert!(matches!(pool.take(), Take::None), "two are being opened already");
        // One opening fails (its guard is dropped), the other succeeds.
        drop(Opening::new(pool.clone()));
        let (c, _s) = pair();
        Opening::new(pool.clone()).done(DirectConn::new(c, &registry).unwrap());
        let Take::Conn(conn) = pool.take() else { panic!("the opened connection is idle") };
        assert!(matches!(pool.take(), Take::Open), "the failed one may be opened again");
        pool.put(conn);
        assert!(matches!(pool.take(), Take::Conn(_)));
    }

    #[test]
    fn a_stop_cuts_registered_connections_and_refuses_new_ones() {
        let registry = Arc::new(DirectRegistry::default());
        let (c, mut s) = pair();
        let conn = DirectConn::new(c, &registry).unwrap();
        assert!(conn.still_open());
        registry.stop();
        assert!(registry.stopped());
        assert!(!conn.still_open(), "shut down by the registry");
        let mut b = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut s, &mut b).unwrap(), 0, "the peer sees the close");
        let (c2, _s2) = pair();
        assert!(DirectConn::new(c2, &registry).is_err(), "refused once stopped");
        drop(conn);
        assert!(registry.open.lock().unwrap().is_empty());
    }

    #[test]
    fn an_idle_connection_the_peer_closed_is_seen_closed() {
        let registry = Arc::new(DirectRegistry::default());
        let (c, s) = pair();
        let conn = DirectConn::new(c, &registry).unwrap();
        assert!(conn.still_open());
        drop(s);
        let t = Instant::now();
        while conn.still_open() {
            assert!(t.elapsed() < std::time::Duration::from_secs(5));
            std::thread::yield_now();
        }
        drop(conn);
        assert!(registry.open.lock().unwrap().is_empty(), "a dropped connection leaves the registry");
    }
}

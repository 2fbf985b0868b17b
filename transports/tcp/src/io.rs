//! Socket helpers shared by both sides: a write of several buffers in as few system calls as
//! the kernel allows, and a small input buffer so pipelined headers are parsed without a system
//! call each.

use std::io::IoSlice;
use std::os::fd::AsRawFd;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Writes every byte of `parts`, in order, with vectored writes.
pub(crate) async fn write_all_vectored<W: AsyncWrite + Unpin>(w: &mut W, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)).collect();
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// [`write_all_vectored`] to a tokio socket that first writes straight to it, polling while the
/// kernel takes bytes within `spin` of each other, and waits through tokio once it stops (a
/// full send buffer whose reader is asleep). The poll holds the runtime thread only while
/// bytes keep moving, as a copy would.
pub(crate) async fn write_all_vectored_polling(
    stream: &mut tokio::net::TcpStream,
    parts: &[&[u8]],
    spin: std::time::Duration,
) -> std::io::Result<()> {
    use std::io::Write;
    let mut slices: Vec<IoSlice<'_>> = parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)).collect();
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    let socket = socket2::SockRef::from(&*stream);
    poll_progress(spin, || {
        if rest.is_empty() {
            return Ok(Step::Done);
        }
        match (&*socket).write_vectored(rest) {
            Ok(0) => Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                IoSlice::advance_slices(&mut rest, n);
                Ok(Step::Moved)
            }
            Err(e) => blocked_or(e),
        }
    })?;
    while !rest.is_empty() {
        let n = stream.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Sets `SO_RCVLOWAT` of `socket` to `bytes`: a wait for it to be readable ends once that many
/// bytes are there (or at the end of the stream, or on an error); a non-blocking read still
/// returns what is there. The kernel grows the receive buffer to hold that many.
pub(crate) fn set_rcvlowat(socket: &impl std::os::fd::AsRawFd, bytes: usize) -> std::io::Result<()> {
    let value = libc::c_int::try_from(bytes.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: `value` is a live `c_int` and the length says so; the descriptor is `socket`'s own.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Whether `peer` is on this host, whose address (or one of them) is `own`: a loopback address
/// or `own` itself (Linux routes both over the loopback device).
pub(crate) fn on_this_host(peer: std::net::IpAddr, own: std::net::IpAddr) -> bool {
    let peer = peer.to_canonical();
    peer.is_loopback() || peer == own.to_canonical()
}

/// Gives a connection whose two ends are on this host the congestion control `choice` names
/// (`tcp_local_congestion`); leaves every other connection, and every connection when `choice`
/// is `system`, as it is. A refusal (an algorithm the kernel lacks or does not let this
/// process choose) is logged once per process and the connection keeps the host's default.
pub(crate) fn use_local_congestion(socket: &impl std::os::fd::AsFd, choice: &crate::options::LocalCongestion) {
    let Some(name) = choice.name() else { return };
    let socket = socket2::SockRef::from(socket);
    let ends =
        socket.local_addr().ok().and_then(|l| l.as_socket()).zip(socket.peer_addr().ok().and_then(|p| p.as_socket()));
    if !ends.is_some_and(|(local, peer)| on_this_host(peer.ip(), local.ip())) {
        return;
    }
    if let Err(e) = socket.set_tcp_congestion(name.as_bytes()) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                algorithm = name,
                error = %e,
                "tcp: connections within this host keep the host's congestion control: tcp_local_congestion names \
                 one the kernel refuses here (see net.ipv4.tcp_allowed_congestion_control)"
            )
        });
    }
}

/// Bytes that arrived on `socket` and were not read yet (`FIONREAD`).
pub(crate) fn unread_bytes(socket: &impl std::os::fd::AsRawFd) -> std::io::Result<usize> {
    let mut value: libc::c_int = 0;
    // SAFETY: FIONREAD writes one `c_int` through the pointer, which points at `value`; the
    // descriptor is `socket`'s own.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::FIONREAD, &raw mut value) };
    if rc == 0 { Ok(usize::try_from(value).unwrap_or(0)) } else { Err(std::io::Error::last_os_error()) }
}

/// What a receive buffer holds before the kernel signals it readable while muted
/// ([`ArrivalSignal::mute`]; Linux caps it at half of `tcp_rmem`'s maximum). Raising it also
/// grows the socket's receive buffer to hold that much, and bounds the window it advertises to
/// it until autotuning grows the buffer further (`tcp_set_rcvlowat`): a bound that is no limit
/// at these sizes (4 MiB in flight per connection).
const MUTED_LOWAT: usize = 4 << 20;

/// Whether a socket's arrivals wake tokio's I/O driver.
///
/// While a task reads its socket itself between requests ([`InBuf::poll_fill`]), each arrival
/// still makes the kernel signal the socket readable. That wakes whichever worker sleeps in the
/// driver's `epoll_wait` (edge-triggered: once per arrival). That worker finds nothing to do,
/// yet costs tens of microseconds of a core per request on a virtualised host, taken from the
/// peer that is sending.
///
/// Muting raises `SO_RCVLOWAT`, so the kernel does not signal what arrives. A non-blocking read
/// still returns what is there (`tcp_recvmsg` with no timeout returns what it copied).
/// Unmuting sets it back to 1, and Linux then signals at once what arrived meanwhile
/// (`tcp_set_rcvlowat` calls `tcp_data_ready`), so a wait through tokio after [`unmute`]
/// misses nothing. Every wait through tokio for bytes must come after [`unmute`]: [`InBuf`]
/// keeps a connection's signal and sees to it.
///
/// [`unmute`]: Self::unmute
#[derive(Debug, Default)]
pub(crate) struct ArrivalSignal {
    muted: bool,
}

impl ArrivalSignal {
    /// Stops signalling arrivals. Best effort: a socket that refuses keeps signalling them.
    pub(crate) fn mute(&mut self, socket: &impl AsRawFd) {
        if !self.muted {
            self.muted = set_rcvlowat(socket, MUTED_LOWAT).is_ok();
        }
    }

    /// Signals arrivals again, those that came while muted at once. Must succeed before the
    /// task waits for bytes through tokio: on an error the caller gives the connection up.
    pub(crate) fn unmute(&mut self, socket: &impl AsRawFd) -> std::io::Result<()> {
        if self.muted {
            set_rcvlowat(socket, 1)?;
            self.muted = false;
        }
        Ok(())
    }
}

/// What one non-blocking attempt of [`poll_progress`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Nothing is left to move.
    Done,
    /// Some bytes moved.
    Moved,
    /// The socket had no bytes or no room.
    Blocked,
    /// The caller was told to stop.
    Stopped,
}

/// `Ok(Step::Blocked)` for a would-block or an interrupted call, else the error.
fn blocked_or(e: std::io::Error) -> std::io::Result<Step> {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(Step::Blocked),
        _ => Err(e),
    }
}

/// Repeats `attempt` (one non-blocking read or write) until it is done or stopped, or until no
/// byte moved for `spin` (then `Ok(Step::Blocked)`: the caller waits through tokio). A zero
/// `spin` polls nothing.
fn poll_progress(
    spin: std::time::Duration,
    mut attempt: impl FnMut() -> std::io::Result<Step>,
) -> std::io::Result<Step> {
    if spin.is_zero() {
        return Ok(Step::Blocked);
    }
    let mut until = std::time::Instant::now() + spin;
    loop {
        match attempt()? {
            Step::Moved => until = std::time::Instant::now() + spin,
            Step::Blocked if std::time::Instant::now() >= until => return Ok(Step::Blocked),
            Step::Blocked => std::hint::spin_loop(),
            done => return Ok(done),
        }
    }
}

/// Which tasks may hold a worker of a multi-threaded runtime while they poll a socket without
/// yielding ([`InBuf::poll_fill`] with `hold`).
///
/// - **All but one worker at most**, so one is always left for the I/O driver and every other
///   task. None on a runtime of one worker, where a yield wakes no other thread.
/// - **Only while few connections are awake**: no more than the runtime has workers. Awake
///   means serving a request or polling for the next, as opposed to asleep in tokio. Several
///   busy connections (a peer's lanes pipelining) need every worker: a poll that held one would
///   idle a core that they could use. Those connections poll yielding, as before.
#[derive(Debug)]
pub(crate) struct SpareWorkers {
    held: std::sync::atomic::AtomicUsize,
    awake: std::sync::atomic::AtomicUsize,
    workers: usize,
}

impl SpareWorkers {
    /// For a runtime of `workers` workers.
    pub(crate) fn of(workers: usize) -> Self {
        Self { held: Default::default(), awake: Default::default(), workers }
    }

    /// For the current runtime.
    pub(crate) fn of_current_runtime() -> Self {
        Self::of(tokio::runtime::Handle::current().metrics().num_workers())
    }

    /// Counts a connection awake until the returned guard drops.
    pub(crate) fn awake(&self) -> Awake<'_> {
        self.awake.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Awake(self)
    }

    /// Holds a worker until the returned guard drops; `None` when all but one are held, or
    /// when more connections are awake than there are workers.
    pub(crate) fn try_hold(&self) -> Option<HeldWorker<'_>> {
        use std::sync::atomic::Ordering;
        if self.awake.load(Ordering::Acquire) > self.workers {
            return None;
        }
        let spare = self.workers.saturating_sub(1);
        self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < spare).then_some(n + 1)).ok()?;
        Some(HeldWorker(self))
    }
}

/// A worker of [`SpareWorkers`], held until dropped.
#[derive(Debug)]
pub(crate) struct HeldWorker<'a>(&'a SpareWorkers);

impl Drop for HeldWorker<'_> {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A connection counted awake by [`SpareWorkers::awake`], until dropped.
#[derive(Debug)]
pub(crate) struct Awake<'a>(&'a SpareWorkers);

impl Drop for Awake<'_> {
    fn drop(&mut self) {
        self.0.awake.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// How long [`InBuf::poll_fill`] polls without yielding: about the time a peer that sends one
/// request at a time takes to send the next after an answer reached it.
pub(crate) const TIGHT_POLL: std::time::Duration = std::time::Duration::from_micros(15);

/// Bytes read from a socket but not consumed yet.
///
/// It also keeps the socket's [`ArrivalSignal`]: a poll that holds its worker mutes it, and
/// every wait through tokio for bytes ([`fill`](Self::fill), [`skip`](Self::skip),
/// [`read_exact`](Self::read_exact), the end of
/// [`read_exact_polling`](Self::read_exact_polling)) unmutes it first.
pub(crate) struct InBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The most bytes one fill reads.
    fill_limit: usize,
    arrivals: ArrivalSignal,
}

impl InBuf {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            buf: vec![0; capacity].into_boxed_slice(),
            start: 0,
            end: 0,
            fill_limit: capacity,
            arrivals: ArrivalSignal::default(),
        }
    }

    /// Makes every fill read at most `limit` bytes (at least 1; the capacity at most). A reader
    /// whose next bytes are likely a header and a large payload reads just the header, and the
    /// payload straight into its destination instead of through this buffer.
    pub(crate) fn set_fill_limit(&mut self, limit: usize) {
        self.fill_limit = limit.clamp(1, self.buf.len());
    }

    /// Where the next fill reads to: the free space after the buffered bytes (moved to the
    /// front first), at most the fill limit.
    fn space(&mut self) -> &mut [u8] {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let to = (self.end + self.fill_limit).min(self.buf.len());
        &mut self.buf[self.end..to]
    }

    /// Buffered bytes.
    pub(crate) fn len(&self) -> usize {
        self.end - self.start
    }

    /// Reads once more from `r` (at least one byte unless end of stream). Returns the bytes read.
    pub(crate) async fn fill<R: AsyncRead + AsRawFd + Unpin>(&mut self, r: &mut R) -> std::io::Result<usize> {
        self.arrivals.unmute(r)?;
        let n = r.read(self.space()).await?;
        self.end += n;
        Ok(n)
    }

    /// Reads what `stream` has already received, without waiting: `Ok(0)` at end of stream,
    /// `WouldBlock` when nothing is there. Straight from the socket: tokio's readiness, which
    /// only its driver sets, may not know yet of what arrived (or never, while muted:
    /// [`ArrivalSignal`]).
    pub(crate) fn try_fill(&mut self, stream: &tokio::net::TcpStream) -> std::io::Result<usize> {
        use std::io::Read;
        let n = (&*socket2::SockRef::from(stream)).read(self.space())?;
        self.end += n;
        Ok(n)
    }

    /// Polls `stream` for bytes until `until`, without sleeping: reads straight from the socket
    /// (tokio's readiness, which only its driver sets, would say nothing has come). `Ok(0)` at
    /// end of stream, `WouldBlock` when nothing came in time.
    ///
    /// With `hold` (the caller holds one of the runtime's spare workers, [`SpareWorkers`]) it
    /// mutes the socket's arrivals ([`ArrivalSignal`]) and polls tightly all the way. Without, tightly for [`TIGHT_POLL`], then yielding to the
    /// runtime's other tasks between attempts. Each such yield on a multi-threaded runtime makes
    /// the worker search for work and, on finding this task again, wake an idle worker (tokio's
    /// rule for its last searching worker): tens of microseconds of another core per yield on a
    /// virtualised host, which is why a holder does not yield.
    pub(crate) async fn poll_fill(
        &mut self,
        stream: &tokio::net::TcpStream,
        until: std::time::Instant,
        hold: bool,
    ) -> std::io::Result<usize> {
        use std::io::Read;
        if hold {
            self.arrivals.mute(stream);
        }
        let socket = socket2::SockRef::from(stream);
        // A peer that asks one request at a time asks the next within microseconds: poll
        // tightly that long, then let the runtime's other tasks run between attempts.
        let tight_until = if hold { until } else { (std::time::Instant::now() + TIGHT_POLL).min(until) };
        loop {
            // The socket is non-blocking (tokio's): a read returns at once.
            match (&*socket).read(self.space()) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => {
                    if std::time::Instant::now() >= until {
                        return Err(std::io::ErrorKind::WouldBlock.into());
                    }
                    if std::time::Instant::now() < tight_until {
                        std::hint::spin_loop();
                    } else {
                        tokio::task::yield_now().await;
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Fills `dst` from buffered bytes first, then straight from `stream`, polling the socket
    /// while bytes keep coming within `spin` of each other, and waiting through tokio
    /// ([`read_exact`](Self::read_exact)) once they stop. `stop` is asked before every read:
    /// when it says so, nothing more is read and `Ok(false)` is returned (`Ok(true)`: filled).
    pub(crate) async fn read_exact_polling(
        &mut self,
        stream: &mut tokio::net::TcpStream,
        dst: &mut [u8],
        spin: std::time::Duration,
        stop: impl Fn() -> bool,
    ) -> std::io::Result<bool> {
        use std::io::Read;
        let n = self.len().min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        let mut at = n;
        let socket = socket2::SockRef::from(&*stream);
        let step = poll_progress(spin, || {
            if at == dst.len() {
                return Ok(Step::Done);
            }
            if stop() {
                return Ok(Step::Stopped);
            }
            match (&*socket).read(&mut dst[at..]) {
                Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    at += n;
                    Ok(Step::Moved)
                }
                Err(e) => blocked_or(e),
            }
        })?;
        if step == Step::Stopped {
            return Ok(false);
        }
        if at < dst.len() {
            self.arrivals.unmute(stream)?;
            stream.read_exact(&mut dst[at..]).await?;
        }
        Ok(true)
    }

    /// Whether the next `bytes` bytes are here already, buffered or in `stream`'s receive queue:
    /// reading them will not wait.
    pub(crate) fn holds(&self, stream: &tokio::net::TcpStream, bytes: u64) -> std::io::Result<bool> {
        let buffered = self.len() as u64;
        if buffered >= bytes {
            return Ok(true);
        }
        Ok(buffered + unread_bytes(stream)? as u64 >= bytes)
    }

    /// The next `N` bytes if buffered, left in the buffer.
    pub(crate) fn peek<const N: usize>(&self) -> Option<[u8; N]> {
        (self.len() >= N).then(|| self.buf[self.start..self.start + N].try_into().expect("N bytes buffered"))
    }

    /// Takes `N` bytes if buffered.
    pub(crate) fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let out = self.peek::<N>()?;
        self.start += N;
        Some(out)
    }

    /// Fills `dst` from buffered bytes first, then straight from `r`.
    pub(crate) async fn read_exact<R: AsyncRead + AsRawFd + Unpin>(
        &mut self,
        r: &mut R,
        dst: &mut [u8],
    ) -> std::io::Result<()> {
        let n = self.len().min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if n < dst.len() {
            self.arrivals.unmute(r)?;
            r.read_exact(&mut dst[n..]).await?;
        }
        Ok(())
    }

    /// Discards `count` bytes, buffered first, then read through the buffer.
    pub(crate) async fn skip<R: AsyncRead + AsRawFd + Unpin>(
        &mut self,
        r: &mut R,
        mut count: u64,
    ) -> std::io::Result<()> {
        loop {
            let n = (self.len() as u64).min(count) as usize;
            self.start += n;
            count -= n as u64;
            if count == 0 {
                return Ok(());
            }
            if self.fill(r).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    #[tokio::test]
    async fn poll_fill_takes_what_comes_in_time_and_gives_up_after() {
        for hold in [false, true] {
            poll_fill_case(hold).await;
        }
    }

    async fn poll_fill_case(hold: bool) {
        let (mut a, b) = pair().await;
        let mut input = InBuf::new(64);
        let started = Instant::now();
        let e = input.poll_fill(&b, Instant::now() + Duration::from_millis(5), false).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        assert!(started.elapsed() >= Duration::from_millis(5));
        a.write_all(b"hello").await.unwrap();
        let n = input.poll_fill(&b, Instant::now() + Duration::from_secs(5), hold).await.unwrap();
        assert!((1..=5).contains(&n));
        drop(a);
        let mut got = input.take::<1>().unwrap().to_vec();
        while got.len() < 5 {
            if input.len() == 0 {
                input.poll_fill(&b, Instant::now() + Duration::from_secs(5), hold).await.unwrap();
            }
            got.push(input.take::<1>().unwrap()[0]);
        }
        assert_eq!(got, b"hello");
        assert_eq!(
            input.poll_fill(&b, Instant::now() + Duration::from_secs(5), hold).await.unwrap(),
            0,
            "end of stream"
        );
    }

    /// Whether `s` polls readable now (`poll` with no wait: what `epoll` would report).
    fn readable_now(s: &TcpStream) -> bool {
        use std::os::fd::AsRawFd;
        let mut fd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live `pollfd`, as the count says; no wait.
        let n = unsafe { libc::poll(&mut fd, 1, 0) };
        n == 1 && fd.revents & libc::POLLIN != 0
    }

    #[tokio::test]
    async fn a_muted_socket_signals_nothing_yet_reads_and_unmuting_signals_what_came() {
        let (mut a, b) = pair().await;
        let readable = || tokio::time::timeout(Duration::from_millis(50), b.ready(tokio::io::Interest::READABLE));
        let mut scratch = [0u8; 16];
        // A read through tokio that finds nothing clears what tokio believes (a new socket may
        // start out "readable"): from here on, only an event from the kernel makes it readable.
        let forget = |b: &TcpStream, scratch: &mut [u8]| {
            assert_eq!(b.try_read(scratch).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
        };
        forget(&b, &mut scratch);
        let mut signal = ArrivalSignal::default();
        signal.mute(&b);
        a.write_all(b"header").await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!readable_now(&b), "an arrival on a muted socket is not signalled");
        assert!(readable().await.is_err(), "nor does tokio's driver hear of it");
        let mut input = InBuf::new(64);
        assert_eq!(input.try_fill(&b).unwrap(), 6, "a non-blocking read still takes it");
        a.write_all(b"next").await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!readable_now(&b));
        signal.unmute(&b).unwrap();
        assert!(readable_now(&b), "unmuting signals what came while muted");
        assert!(readable().await.is_ok(), "and tokio's wait ends");
        assert_eq!(input.try_fill(&b).unwrap(), 4);
        signal.unmute(&b).unwrap(); // twice is harmless
        forget(&b, &mut scratch);
        a.write_all(b"!").await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_secs(5), b.readable()).await.is_ok(),
            "arrivals are signalled again"
        );
    }

    #[test]
    fn spare_workers_are_all_but_one_and_come_back_when_dropped() {
        let none = SpareWorkers::of(1);
        assert!(none.try_hold().is_none(), "a runtime of one worker has none to spare");
        let three = SpareWorkers::of(4);
        let held: Vec<_> = (0..3).map(|_| three.try_hold().expect("three to spare")).collect();
        assert!(three.try_hold().is_none(), "the fourth worker stays free");
        drop(held);
        assert!(three.try_hold().is_some(), "released on drop");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        let two = rt.block_on(async { SpareWorkers::of_current_runtime() });
        let one = two.try_hold();
        assert!(one.is_some() && two.try_hold().is_none(), "a runtime of two workers spares one");
    }

    #[test]
    fn no_worker_is_held_while_more_connections_are_awake_than_there_are_workers() {
        let two = SpareWorkers::of(2);
        let (a, b) = (two.awake(), two.awake());
        assert!(two.try_hold().is_some(), "two connections awake on two workers: one may hold");
        let c = two.awake();
        assert!(two.try_hold().is_none(), "three awake: every worker is needed");
        drop(c);
        assert!(two.try_hold().is_some(), "counted asleep again on drop");
        drop((a, b));
    }

    #[tokio::test]
    async fn read_exact_polling_fills_from_the_buffer_then_the_socket_and_stops_when_told() {
        let (mut a, mut b) = pair().await;
        let mut input = InBuf::new(64);
        a.write_all(b"abc").await.unwrap();
        while input.len() < 3 {
            input.fill(&mut b).await.unwrap();
        }
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await; // past the poll: through tokio
            a.write_all(&[7u8; 100_000]).await.unwrap();
            a
        });
        let mut dst = vec![0u8; 100_003];
        assert!(input.read_exact_polling(&mut b, &mut dst, Duration::from_micros(50), || false).await.unwrap());
        assert_eq!(&dst[..3], b"abc");
        assert!(dst[3..].iter().all(|&x| x == 7));
        let mut a = writer.await.unwrap();
        a.write_all(b"xyz").await.unwrap();
        let mut dst = [0u8; 3];
        assert!(!input.read_exact_polling(&mut b, &mut dst, Duration::from_millis(50), || true).await.unwrap());
        assert_eq!(dst, [0; 3], "nothing read once told to stop");
    }

    #[tokio::test]
    async fn write_all_vectored_polling_writes_past_a_full_send_buffer() {
        let (mut a, mut b) = pair().await;
        let big = vec![3u8; 8 << 20]; // more than both socket buffers hold
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut all = Vec::new();
            b.read_to_end(&mut all).await.unwrap();
            all
        });
        write_all_vectored_polling(&mut a, &[b"head", &big], Duration::from_micros(50)).await.unwrap();
        drop(a);
        let all = reader.await.unwrap();
        assert_eq!(all.len(), 4 + big.len());
        assert_eq!(&all[..4], b"head");
        assert!(all[4..].iter().all(|&x| x == 3));
    }

    #[test]
    fn a_peer_is_on_this_host_at_a_loopback_address_or_this_ends_own() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert!(on_this_host(ip("127.0.0.2"), ip("127.0.0.1")));
        assert!(on_this_host(ip("127.0.0.1"), ip("10.0.0.5")));
        assert!(on_this_host(ip("10.0.0.1"), ip("10.0.0.1")));
        assert!(on_this_host(ip("::1"), ip("::1")));
        assert!(on_this_host(ip("10.0.0.1"), ip("::ffff:10.0.0.1")));
        assert!(on_this_host(ip("::ffff:127.0.0.1"), ip("::ffff:10.0.0.1")));
        assert!(!on_this_host(ip("10.0.0.2"), ip("10.0.0.1")));
        assert!(!on_this_host(ip("fe80::2"), ip("fe80::1")));
    }

    /// The host's default congestion control (Linux).
    fn host_default() -> String {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap().trim().to_owned()
    }

    #[tokio::test]
    async fn a_loopback_connection_gets_the_local_congestion_control_and_system_leaves_the_host_default() {
        let congestion = |s: &TcpStream| {
            String::from_utf8(socket2::SockRef::from(s).tcp_congestion().unwrap())
                .unwrap()
                .trim_end_matches('\0')
                .to_owned()
        };
        let (client, server) = pair().await;
        assert_eq!(congestion(&client), host_default());
        use_local_congestion(&client, &crate::options::LocalCongestion::SYSTEM);
        assert_eq!(congestion(&client), host_default(), "system leaves the host's default");
        use_local_congestion(&client, &crate::options::LocalCongestion::reno());
        use_local_congestion(&server, &crate::options::LocalCongestion::reno());
        assert_eq!((congestion(&client), congestion(&server)), ("reno".to_owned(), "reno".to_owned()));
        // An algorithm the kernel lacks is logged, and the connection keeps what it had.
        let (client, _server) = pair().await;
        use_local_congestion(&client, &"no_such_cc".parse().unwrap());
        assert_eq!(congestion(&client), host_default());
    }
}

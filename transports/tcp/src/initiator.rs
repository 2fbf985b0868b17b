//! The initiator side: persistent connections ("lanes") per peer, requests pipelined on each,
//! payloads moved straight between the socket and registered memory.
//!
//! Each lane is one task that owns a connection's write half and a reader task that owns its
//! read half. The writer sends requests in order and queues them for the reader, which reads the
//! responses in the same order. Every request carries a deadline; a response that misses it, or
//! a broken connection, fails exactly the requests that connection carried, and the lane
//! reconnects for the next one. A connection the peer closed while idle is reopened and the
//! requests written to it retried (READ and WRITE are both idempotent).
//!
//! A connection dropped with a WRITE that failed on it is marked in the peer's [`PeerFence`]
//! before that failure is reported; every lane checks the mark (one atomic load) before it
//! writes a request and, while it is set, fences the peer first ([`crate::fence`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_core::{Batch, Error, ErrorKind, Opcode, Submission, ValidatedRequest};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout_at};

use crate::direct::{DirectConn, DirectPool, DirectRegistry, Opening, Take};
use crate::fence::PeerFence;
use crate::io::write_all_vectored;
use crate::memory::{bytes, bytes_mut};
use crate::responses::{Answer, Destination, Responses};
use crate::wire::Header;

/// Payloads up to this size are copied next to their header; larger ones are written from the
/// caller's memory (a copy of 64 KiB costs more than the iovec that saves it).
const COPY_UP_TO: usize = 16 * 1024;
/// Gathered requests are written once they reach this many bytes...
const FLUSH_AT: usize = 512 * 1024;
/// ... or this many parts (a vectored write takes at most `IOV_MAX`, 1024 on Linux).
const MAX_PARTS: usize = 256;
/// Largest request the direct path carries: a target answers a rejected WRITE up to this size
/// after draining its payload, one above it by closing the connection, which a caller blocked
/// in writing that payload would see as a lost connection instead of a rejection.
pub(crate) const DIRECT_MAX: u64 = 16 << 20;

/// One request handed to a lane. It holds the request's [`Submission`] and is moved, never
/// copied: to the reader once its header is written (or kept by the writer for a v1 WRITE, which
/// has no response), and completed exactly once by whoever holds it last; dropping it unfinished
/// completes the request as lost.
pub(crate) struct Job {
    /// The request's batch, to read the request (the writer keeps a clone while the reader holds
    /// the job).
    batch: Batch,
    pub(crate) index: usize,
    submission: Submission,
    pub(crate) deadline: Instant,
    /// Requests queued or in flight on this job's lane.
    load: Arc<AtomicUsize>,
}

impl Job {
    /// The request.
    fn request(&self) -> &ValidatedRequest {
        self.submission.request(self.index as u32)
    }
    fn live(&self) -> bool {
        !self.batch.is_cancelled()
    }
    /// The job leaves its lane.
    fn leave(&self) {
        self.load.fetch_sub(1, Ordering::Relaxed);
    }
    /// Fails the job, unsent, when its deadline already passed (so it cannot make a
    /// connection attempt or a write time out for the fresh requests queued behind it); gives
    /// it back otherwise.
    fn unexpired(self) -> Option<Job> {
        if self.deadline > Instant::now() {
            return Some(self);
        }
        self.finish(Err(Error::timeout("tcp request not sent before its deadline")));
        None
    }
    /// The job leaves its lane unstarted (it was cancelled): the batch learns that its memory
    /// is no longer touched.
    fn release(self) {
        self.finish(Err(Error::new(ErrorKind::Cancelled, "cancelled before it was sent")));
    }
    fn finish(self, outcome: Result<(), Error>) {
        self.leave();
        self.submission.complete_all(&outcome);
    }
}

/// A peer's lanes, and its direct connections ([`crate::direct`]).
pub(crate) struct Peer {
    addr: PeerAddr,
    lanes: Vec<(mpsc::UnboundedSender<Job>, Arc<AtomicUsize>)>,
    /// Idle direct connections, used by callers that wait for a single request.
    direct: Arc<DirectPool>,
    /// The transport's direct connections (cut at shutdown).
    registry: Arc<DirectRegistry>,
    /// The I/O thread that opens this peer's direct connections, with the lanes' `connect`.
    opener: tokio::runtime::Handle,
    setup: ConnectSetup,
    /// A direct connection must open within this (the transfer timeout).
    timeout: Duration,
    /// Connections of the lanes waiting to be fenced.
    fence: Arc<PeerFence>,
    /// When the peer was created, and when a request was last queued, in milliseconds since
    /// then (for pruning peers nobody uses any more).
    created: std::time::Instant,
    last_used_ms: std::sync::atomic::AtomicU64,
}

/// Where and how to reach a peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PeerAddr {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) v2: bool,
    /// The peer advertises fences (`ferry_tcp_fence`, over v2).
    pub(crate) fence: bool,
}

/// How an initiator sets up every data connection it opens.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnectSetup {
    /// The secret each connection proves first, when set (peer authentication).
    pub(crate) auth: Option<Arc<ferry_peer_auth::PeerSecret>>,
    /// The congestion control of a connection within this host (`tcp_local_congestion`).
    pub(crate) local_congestion: crate::options::LocalCongestion,
}

/// Opens a data connection to `addr` (the lanes' and the fences' alike) by `deadline`, set up
/// as `setup` says: its congestion control when it stays on this host, then peer
/// authentication when on, before any request.
pub(crate) async fn connect(addr: &PeerAddr, setup: &ConnectSetup, deadline: Instant) -> Result<TcpStream, Error> {
    match timeout_at(deadline, TcpStream::connect((addr.host.as_str(), addr.port))).await {
        Ok(Ok(s)) => {
            crate::io::use_local_congestion(&s, &setup.local_congestion);
            crate::auth::prove(s, setup.auth.as_deref(), &addr.host, addr.port, deadline).await
        }
        Ok(Err(e)) => Err(lost(addr, "cannot connect", e)),
        Err(_) => Err(Error::timeout(format!("tcp peer {}:{}: connect did not finish in time", addr.host, addr.port))),
    }
}

/// How many connections a peer gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnCounts {
    /// Lanes (persistent pipelined connections), at least one.
    pub(crate) lanes: usize,
    /// Idle direct connections kept for callers that wait for a single request.
    pub(crate) direct: usize,
}

impl Peer {
    /// Starts `counts.lanes` lane tasks for `addr` on `io`'s threads, each setting up every
    /// connection it opens as `setup` says, and keeps up to `counts.direct` idle direct
    /// connections. When `stop` turns true (the transport shuts down), requests waiting for a
    /// response fail at once instead of at their deadline. Direct connections are opened on one
    /// of `io`'s threads too, within `timeout`, and registered with `registry`.
    pub(crate) fn start(
        addr: PeerAddr,
        counts: ConnCounts,
        io: &crate::IoThreads,
        setup: ConnectSetup,
        stop: tokio::sync::watch::Receiver<bool>,
        registry: Arc<DirectRegistry>,
        timeout: Duration,
    ) -> Self {
        let fence = Arc::new(PeerFence::new(addr.fence && addr.v2, setup.clone()));
        let direct = Arc::new(DirectPool::new(counts.direct));
        let opener = io.next().clone();
        let lanes = (0..counts.lanes.max(1))
            .map(|_| {
                let (tx, rx) = mpsc::unbounded_channel();
                io.next().spawn(lane(addr.clone(), rx, setup.clone(), stop.clone(), fence.clone()));
                (tx, Arc::new(AtomicUsize::new(0)))
            })
            .collect();
        Self {
            addr,
            lanes,
            direct,
            registry,
            opener,
            setup,
            timeout,
            fence,
            created: std::time::Instant::now(),
            last_used_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Runs the one request of `submission` on this thread, over an idle direct connection, and
    /// completes it; gives `submission` back, untouched, when none is idle or the request must
    /// go through a lane (a v1 peer, a fence due, a request above [`DIRECT_MAX`], the transport
    /// stopping). Only for a submission whose caller waits for it on this thread
    /// ([`Submission::caller_waits`]).
    pub(crate) fn try_direct(&self, submission: Submission, deadline: Instant) -> Result<(), Submission> {
        let length = submission.request(submission.indices()[0]).request.length;
        // A fence due is settled by the lanes before anything more goes to the peer.
        if !self.addr.v2 || length > DIRECT_MAX || self.fence.pending() || self.registry.stopped() {
            return Err(submission);
        }
        let conn = match self.direct.take() {
            Take::Conn(c) => c,
            Take::Open => {
                self.open_direct();
                return Err(submission);
            }
            Take::None => return Err(submission),
        };
        if !conn.still_open() {
            // The peer closed it while idle (or broke it): the lane sends the request on a
            // connection of its own, and another direct one is opened meanwhile.
            drop(conn);
            self.direct.lost();
            if let Take::Open = self.direct.take() {
                self.open_direct();
            }
            return Err(submission);
        }
        self.last_used_ms.store(self.created.elapsed().as_millis() as u64, Ordering::Relaxed);
        match crate::direct::run(&self.addr, conn, submission, deadline.into_std(), &self.fence, &self.registry) {
            Some(conn) => self.direct.put(conn),
            None => self.direct.lost(),
        }
        Ok(())
    }

    /// Opens a direct connection on an I/O thread (the pool counts it already) and puts it in
    /// the pool; a failure only uncounts it (the next waiting request tries again).
    fn open_direct(&self) {
        let opening = Opening::new(self.direct.clone());
        let (addr, setup, registry) = (self.addr.clone(), self.setup.clone(), self.registry.clone());
        let deadline = deadline(self.timeout);
        self.opener.spawn(async move {
            let opened = match connect(&addr, &setup, deadline).await {
                Ok(s) => s.into_std().and_then(|s| DirectConn::new(s, &registry)).map_err(|e| lost(&addr, "direct", e)),
                Err(e) => Err(e),
            };
            match opened {
                Ok(conn) => opening.done(conn),
                Err(e) => tracing::debug!(error = %e, "tcp initiator: no direct connection"),
            }
        });
    }

    /// True when nothing is queued or in flight, nothing was queued for `idle`, and no fence is
    /// due (forgetting the peer would forget the fence).
    pub(crate) fn unused_for(&self, idle: Duration) -> bool {
        let last = Duration::from_millis(self.last_used_ms.load(Ordering::Relaxed));
        self.lanes.iter().all(|(_, load)| load.load(Ordering::Relaxed) == 0)
            && self.created.elapsed().saturating_sub(last) >= idle
            && !self.fence.pending()
    }

    /// Queues a request on the next lane. Fails (handing the job back) only when the lanes have
    /// stopped.
    /// Queues the one request of `submission`; gives it back when the lane is gone.
    pub(crate) fn send(&self, submission: Submission, deadline: Instant) -> Result<(), Submission> {
        // The least loaded lane, the first of equals: an idle peer keeps using one lane (whose
        // thread is the one most recently awake), a busy one spreads over all of them.
        let (tx, load) = self
            .lanes
            .iter()
            .min_by_key(|(_, load)| load.load(Ordering::Relaxed))
            .expect("a peer has at least one lane");
        load.fetch_add(1, Ordering::Relaxed);
        self.last_used_ms.store(self.created.elapsed().as_millis() as u64, Ordering::Relaxed);
        let index = submission.indices()[0] as usize;
        let batch = submission.batch();
        let job = Job { batch, index, submission, deadline, load: load.clone() };
        match tx.send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                let job = e.0;
                job.leave();
                Err(job.submission)
            }
        }
    }
}

fn lost(addr: &PeerAddr, what: &str, e: impl std::fmt::Display) -> Error {
    Error::unreachable(format!("tcp peer {}:{}: {what}: {e}", addr.host, addr.port))
}

async fn lane(
    addr: PeerAddr,
    mut rx: mpsc::UnboundedReceiver<Job>,
    setup: ConnectSetup,
    stop: tokio::sync::watch::Receiver<bool>,
    fence: Arc<PeerFence>,
) {
    let mut carry: VecDeque<Job> = VecDeque::new();
    loop {
        let job = match carry.pop_front() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        if !job.live() {
            job.release();
            continue;
        }
        let Some(job) = job.unexpired() else { continue };
        let stream = match connect(&addr, &setup, job.deadline).await {
            Ok(s) => s,
            Err(err) => {
                // Everything already waiting for this peer would fail the same way.
                job.finish(Err(err.duplicate()));
                for j in carry.drain(..) {
                    j.finish(Err(err.duplicate()));
                }
                while let Ok(j) = rx.try_recv() {
                    j.finish(Err(err.duplicate()));
                }
                continue;
            }
        };
        carry.push_front(job);
        carry = connection(&addr, stream, carry, &mut rx, stop.clone(), &fence).await;
    }
}

/// Runs one connection until it breaks or the lane closes. Returns requests to retry on a new
/// connection (those written to a connection the peer had already closed while idle).
async fn connection(
    addr: &PeerAddr,
    stream: TcpStream,
    mut queue: VecDeque<Job>,
    rx: &mut mpsc::UnboundedReceiver<Job>,
    stop: tokio::sync::watch::Receiver<bool>,
    fence: &Arc<PeerFence>,
) -> VecDeque<Job> {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "tcp initiator: set_nodelay failed");
    }
    // The address the peer sees this connection from: what a fence names.
    let local = match stream.local_addr() {
        Ok(a) => a,
        Err(e) => {
            let err = lost(addr, "connection has no local address", e);
            queue.drain(..).for_each(|j| j.finish(Err(err.duplicate())));
            return queue;
        }
    };
    let (r, mut w) = stream.into_split();
    let (inflight_tx, inflight_rx) = mpsc::unbounded_channel::<(Job, u64)>();
    // How far the writer got: (every job numbered at most this has all its bytes in the socket,
    // the writer has stopped). The reader completes a WRITE only once its payload is no longer
    // read from memory (a peer may answer before the payload was sent, or the connection may
    // fail in the middle of it), and reports success only if the whole payload went out.
    let (flushed, flushed_rx) = tokio::sync::watch::channel((0u64, false));
    let marker = Marker { fence: fence.clone(), local };
    let mut reader = tokio::spawn(read_responses(addr.clone(), r, inflight_rx, flushed_rx, stop, marker));
    let mut seq = 0u64;
    let mut out = Outgoing::default();
    loop {
        // Everything queued goes out in as few writes as possible: headers and small payloads
        // are copied into one buffer, larger payloads are written from memory, all of it with
        // one vectored write per `FLUSH_AT` bytes.
        while let Ok(job) = rx.try_recv() {
            queue.push_back(job);
        }
        let mut unacked: Vec<Job> = Vec::new(); // v1 writes: complete once written
        let mut deadline: Option<Instant> = None;
        let mut outcome: Result<(), Error> = Ok(());
        while let Some(job) = queue.pop_front() {
            if !job.live() {
                job.release();
                continue;
            }
            let Some(job) = job.unexpired() else { continue };
            if fence.pending() {
                // A connection of this peer failed a WRITE: nothing more goes out before the
                // peer confirmed that nothing of it will land. What is gathered was taken
                // before that failure was reported, and goes first.
                if !out.is_empty() {
                    outcome = out.flush(addr, &mut w, deadline.unwrap_or(job.deadline)).await;
                    if outcome.is_err() {
                        queue.push_front(job);
                        break;
                    }
                    flushed.send_replace((seq, false));
                }
                if let Err(e) = fence.settle(addr, job.deadline).await {
                    job.finish(Err(e));
                    continue;
                }
            }
            // The writer reads the request through the batch; the job itself goes to whoever
            // completes it (the reader, or `unacked` for a v1 WRITE).
            let (batch, index, job_deadline) = (job.batch.clone(), job.index, job.deadline);
            let v = batch.request(index).expect("a job's index is in its batch");
            let r = v.request;
            // A payload written from the caller's memory (one too large to be copied) is
            // numbered: its request completes only once the write that carries it is done.
            let referenced = r.opcode == Opcode::Write && r.length as usize > COPY_UP_TO;
            if addr.v2 || r.opcode == Opcode::Read {
                // Number 0 never waits.
                let number = if referenced { seq + 1 } else { 0 };
                if let Err(mpsc::error::SendError((job, _))) = inflight_tx.send((job, number)) {
                    queue.push_front(job);
                    break;
                }
            } else {
                unacked.push(job);
            }
            let due = *deadline.get_or_insert(job_deadline);
            let due = due.min(job_deadline);
            deadline = Some(due);
            out.copy(&Header { size: r.length, addr: r.target_offset, opcode: r.opcode, v2: addr.v2 }.encode());
            if r.opcode == Opcode::Write {
                let Some(payload) = bytes(&v.local, r.source, r.length) else {
                    outcome = Err(Error::transport("local range outside its leased region"));
                    break;
                };
                if referenced {
                    seq += 1;
                    out.reference(batch.clone(), index, payload.len());
                } else {
                    out.copy(payload);
                }
            }
            if out.full() {
                outcome = out.flush(addr, &mut w, due).await;
                if outcome.is_err() {
                    break;
                }
                flushed.send_replace((seq, false));
            }
        }
        if outcome.is_ok() && !out.is_empty() {
            outcome = out.flush(addr, &mut w, deadline.unwrap_or_else(Instant::now)).await;
            if outcome.is_ok() {
                flushed.send_replace((seq, false));
            }
        }
        // A failed write leaves nothing gathered for the next connection.
        out.clear();
        match outcome {
            Ok(()) => unacked.into_iter().for_each(|j| j.finish(Ok(()))),
            Err(e) => {
                tracing::debug!(host = %addr.host, port = addr.port, error = %e, "tcp initiator: write failed; connection dropped");
                unacked.into_iter().for_each(|j| j.finish(Err(e.duplicate())));
                return finish(w, inflight_tx, flushed, reader, queue).await;
            }
        }
        tokio::select! {
            next = rx.recv() => match next {
                Some(job) => queue.push_back(job),
                None => return finish(w, inflight_tx, flushed, reader, queue).await,
            },
            retry = &mut reader => {
                // The reader ended: the connection is gone. Its requests were failed or handed
                // back for retry.
                let mut retry = retry.unwrap_or_default();
                retry.extend(queue);
                return retry;
            }
        }
    }
}

/// What a lane's writer gathered for its next vectored write: headers and small payloads copied
/// into one buffer, larger payloads left in the requests' memory (their batches held until the
/// write is done).
#[derive(Default)]
struct Outgoing {
    buf: Vec<u8>,
    parts: Vec<Part>,
    /// Bytes gathered.
    len: usize,
}

/// One part of an [`Outgoing`] write.
enum Part {
    /// Bytes of the buffer.
    Copied(std::ops::Range<usize>),
    /// The payload of request `index` of `batch`, from its memory.
    Payload { batch: Batch, index: usize },
}

impl Outgoing {
    /// Appends a copy of `bytes`.
    fn copy(&mut self, bytes: &[u8]) {
        let start = self.buf.len();
        self.buf.extend_from_slice(bytes);
        match self.parts.last_mut() {
            Some(Part::Copied(r)) if r.end == start => r.end = self.buf.len(),
            _ => self.parts.push(Part::Copied(start..self.buf.len())),
        }
        self.len += bytes.len();
    }

    /// Appends the payload (`len` bytes) of request `index` of `batch`, left in its memory.
    fn reference(&mut self, batch: Batch, index: usize, len: usize) {
        self.parts.push(Part::Payload { batch, index });
        self.len += len;
    }

    fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Enough is gathered for one write.
    fn full(&self) -> bool {
        self.len >= FLUSH_AT || self.parts.len() >= MAX_PARTS
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.parts.clear();
        self.len = 0;
    }

    /// Writes everything gathered before `deadline`, and forgets it (written or not).
    async fn flush(&mut self, addr: &PeerAddr, w: &mut OwnedWriteHalf, deadline: Instant) -> Result<(), Error> {
        let slices: Option<Vec<&[u8]>> = self
            .parts
            .iter()
            .map(|p| match p {
                Part::Copied(r) => Some(&self.buf[r.clone()]),
                Part::Payload { batch, index } => {
                    let v = batch.request(*index)?;
                    bytes(&v.local, v.request.source, v.request.length)
                }
            })
            .collect();
        let result = match slices {
            Some(slices) => flush(addr, w, &slices, deadline).await,
            None => Err(Error::transport("local range outside its leased region")),
        };
        self.clear();
        result
    }
}

async fn finish(
    mut w: OwnedWriteHalf,
    inflight_tx: mpsc::UnboundedSender<(Job, u64)>,
    flushed: tokio::sync::watch::Sender<(u64, bool)>,
    reader: tokio::task::JoinHandle<VecDeque<Job>>,
    queue: VecDeque<Job>,
) -> VecDeque<Job> {
    drop(inflight_tx);
    // The writer has stopped: no payload is read from memory any more.
    flushed.send_modify(|f| f.1 = true);
    let _ = w.shutdown().await;
    let mut retry = reader.await.unwrap_or_default();
    retry.extend(queue);
    retry
}

/// Writes `parts` before `deadline`.
async fn flush(addr: &PeerAddr, w: &mut OwnedWriteHalf, parts: &[&[u8]], deadline: Instant) -> Result<(), Error> {
    match timeout_at(deadline, write_all_vectored(w, parts)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(lost(addr, "write failed", e)),
        Err(_) => {
            Err(Error::timeout(format!("tcp peer {}:{}: request not sent before its deadline", addr.host, addr.port)))
        }
    }
}

/// What a reader marks for fencing: this connection, in its peer's fence state.
struct Marker {
    fence: Arc<PeerFence>,
    local: std::net::SocketAddr,
}

impl Marker {
    /// Marks the connection when one of `jobs` is a WRITE (a READ leaves nothing behind at the
    /// target). Called before any of them is completed.
    fn mark_if_writes<'a>(&self, mut jobs: impl Iterator<Item = &'a Job>) {
        if self.fence.supported() && jobs.any(|j| j.request().request.opcode == Opcode::Write) {
            self.fence.mark(self.local);
        }
    }
}

/// Reads responses in request order. Returns the requests to retry when the peer closed the
/// connection while nothing was in flight.
async fn read_responses(
    addr: PeerAddr,
    mut r: OwnedReadHalf,
    mut inflight: mpsc::UnboundedReceiver<(Job, u64)>,
    flushed: tokio::sync::watch::Receiver<(u64, bool)>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    marker: Marker,
) -> VecDeque<Job> {
    let mut done = Completer { addr: addr.clone(), flushed, marker };
    // The responses being read: every one already in flight is laid out for one vectored read
    // (`crate::responses`), up to `GATHER_BYTES`.
    let mut waiting: Responses<Waiting> = Responses::new(addr.v2);
    // The socket's `SO_RCVLOWAT` (`read_some`).
    let mut lowat = 1usize;
    let failure: Error = 'read: loop {
        let mut next = None;
        if waiting.is_empty() {
            next = Some(tokio::select! {
                biased;
                job = inflight.recv() => match job {
                    Some(j) => j,
                    None if !waiting.has_carry() => return VecDeque::new(),
                    None => break 'read lost(&addr, "connection lost", "bytes came that no request asked for"),
                },
                // Nothing in flight: watch for the peer closing the idle connection (bytes read
                // past a rejected status are for requests still on their way here).
                closed = idle_close(&mut r), if !waiting.has_carry() => {
                    tracing::trace!(?closed, "tcp initiator: idle connection closed by peer");
                    inflight.close();
                    let mut retry = VecDeque::new();
                    while let Ok((j, _)) = inflight.try_recv() {
                        retry.push_back(j); // not completed: the writer may still be sending it
                    }
                    // A clean close means the peer serves nothing more on it; anything else (a
                    // reset, a stray byte) leaves that open, and the writes retried elsewhere must
                    // not be overtaken by it.
                    if !matches!(closed, Ok(0)) {
                        done.marker.mark_if_writes(retry.iter());
                    }
                    return retry;
                }
            });
        }
        // Responses already in flight behind it are read along with it.
        loop {
            let (job, seq) = match next.take() {
                Some(j) => j,
                None if waiting.len() < GATHER_COUNT && waiting.expected() < GATHER_BYTES => {
                    let Ok(j) = inflight.try_recv() else { break };
                    j
                }
                None => break,
            };
            if let Err(w) = waiting.push(Waiting { job, seq }) {
                let err = lost(&addr, "connection lost", "local range outside its leased region");
                fail_all(&mut done, err, Some(w), waiting, &mut inflight).await;
                return VecDeque::new();
            }
        }
        if waiting.has_carry() {
            waiting.fill_from_carry();
        } else {
            let due = waiting.items().map(|w| w.job.deadline).min().expect("a response is waiting");
            // Dropping the read (shutdown) stops it touching the requests' memory; the
            // connection is then out of step and is dropped with the others.
            let read = tokio::select! {
                read = timeout_at(due, read_some(&r, &mut waiting, &mut lowat)) => read,
                () = stopped(&mut stop) => break 'read Error::new(
                    ErrorKind::Shutdown,
                    format!("tcp peer {}:{}: transport shut down while waiting for the response", addr.host, addr.port),
                ),
            };
            match read {
                Ok(Ok(())) => {}
                Ok(Err(e)) => break 'read lost(&addr, closed_why(&e), e),
                Err(_) => {
                    break 'read Error::timeout(format!(
                        "tcp peer {}:{}: no response before the request's deadline",
                        addr.host, addr.port
                    ));
                }
            }
        }
        loop {
            match waiting.next_done() {
                Ok(Some((w, Answer::Ok))) => done.done(w.job, w.seq, Ok(())).await,
                Ok(Some((w, Answer::Rejected))) => {
                    let outcome = Err(rejected(w.job.request()));
                    done.done(w.job, w.seq, outcome).await
                }
                Ok(None) => break,
                Err(e) => break 'read lost(&addr, "connection lost", e),
            }
        }
    };
    fail_all(&mut done, failure, None, waiting, &mut inflight).await;
    VecDeque::new()
}

/// At most this many responses are read together.
const GATHER_COUNT: usize = 64;
/// Responses in flight are added to a read while it expects fewer bytes than this.
const GATHER_BYTES: usize = 1 << 20;

/// Completes a lane's requests as their responses come.
struct Completer {
    addr: PeerAddr,
    /// How far the writer got ([`connection`]).
    flushed: tokio::sync::watch::Receiver<(u64, bool)>,
    marker: Marker,
}

impl Completer {
    /// Completes `job` (its payload numbered `seq` by the writer) with `outcome`. A WRITE is
    /// completed (whatever its outcome) only once the writer no longer reads its payload:
    /// completing releases the caller's memory. A status that came before the whole payload
    /// was sent does not make it a success.
    async fn done(&mut self, job: Job, seq: u64, mut outcome: Result<(), Error>) {
        if job.request().request.opcode == Opcode::Write {
            let sent = match self.flushed.wait_for(|&(ok, stopped)| ok >= seq || stopped).await {
                Ok(state) => state.0 >= seq,
                Err(_) => false, // the writer is gone
            };
            if !sent && outcome.is_ok() {
                // The payload's rest may still reach the peer on this connection.
                self.marker.mark_if_writes(std::iter::once(&job));
                outcome = Err(Error::unreachable(format!(
                    "tcp peer {}:{}: answered before the whole payload was sent, which then failed",
                    self.addr.host, self.addr.port
                )));
            }
        }
        job.finish(outcome);
    }
}

/// A request waiting for its response on a lane's reader: the job, and the writer's number of
/// its payload (0: nothing to wait for).
struct Waiting {
    job: Job,
    seq: u64,
}

impl Destination for Waiting {
    fn data(&mut self) -> Option<&mut [u8]> {
        let v = self.job.request();
        let r = &v.request;
        match r.opcode {
            Opcode::Read => bytes_mut(&v.local, r.source, r.length),
            _ => Some(&mut []),
        }
    }
}

/// The connection is dropped with everything it carried: `first` (when given), what `waiting`
/// holds and what is still queued in `inflight`. Before any of it is reported failed, the
/// connection is marked for fencing if a WRITE is among it: a caller told of the failure may
/// reuse the range at once.
async fn fail_all(
    done: &mut Completer,
    failure: Error,
    first: Option<Waiting>,
    waiting: Responses<Waiting>,
    inflight: &mut mpsc::UnboundedReceiver<(Job, u64)>,
) {
    inflight.close();
    let mut all: Vec<(Job, u64)> = first.into_iter().chain(waiting.into_items()).map(|w| (w.job, w.seq)).collect();
    while let Some(j) = inflight.recv().await {
        all.push(j);
    }
    done.marker.mark_if_writes(all.iter().map(|(j, _)| j));
    for (j, seq) in all {
        done.done(j, seq, Err(failure.duplicate())).await;
    }
}

/// Reads what the socket has into the waiting responses (at least one byte).
///
/// The reader asks the kernel to wake it only once a good part of what the responses still
/// expect is there (`SO_RCVLOWAT`, `lowat` holding the value set), not at every block: on a
/// virtualised host each wake-up of a sleeping thread costs tens of microseconds, and with
/// 64 KiB blocks it cost the lane half its rate (docs/performance.md). Only the bytes certain
/// to come may be waited for without a bound: a rejected READ brings no data, so a wait for
/// more than [`Responses::certain`] ends after [`LOWAT_PATIENCE`] and reads what is there.
async fn read_some(r: &OwnedReadHalf, waiting: &mut Responses<Waiting>, lowat: &mut usize) -> std::io::Result<()> {
    let expected = waiting.expected();
    let want = if expected >= LOWAT_FROM { expected.min(LOWAT_MAX) } else { 1 };
    if want != *lowat {
        crate::io::set_rcvlowat(r.as_ref(), want)?;
        *lowat = want;
    }
    let mut bounded = *lowat > waiting.certain();
    loop {
        if bounded {
            if tokio::time::timeout(LOWAT_PATIENCE, r.readable()).await.is_err() {
                // Not that much came in time (a rejection, or a slow peer): read what is there,
                // and from now on wait only for what is certain.
                bounded = false;
                let certain = waiting.certain().max(1);
                crate::io::set_rcvlowat(r.as_ref(), certain)?;
                *lowat = certain;
            }
        } else {
            r.readable().await?;
        }
        match r.try_read_vectored(&mut waiting.slices()) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                waiting.advance(n);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Responses expecting fewer bytes than this wake the reader at their first byte.
const LOWAT_FROM: usize = 16 * 1024;
/// The most bytes a reader waits for before it is woken. 1 MiB was measured to stall a lane of
/// 16 pipelined 64 KiB READs for most of [`LOWAT_PATIENCE`] one batch in ten (the p90 latency
/// doubled); 512 KiB did not (docs/performance.md).
const LOWAT_MAX: usize = 512 << 10;
/// How long a reader waits for more bytes than are certain to come before it reads what came.
const LOWAT_PATIENCE: Duration = Duration::from_micros(500);

/// What a read error says of the peer.
fn closed_why(e: &std::io::Error) -> &'static str {
    // A target closes the connection of a request it will not serve because its engine is
    // shutting down (its status frame cannot say so).
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
            "closed the connection without answering: the peer is shutting down (or its process ended)"
        }
        _ => "connection lost",
    }
}

/// The error of a request the peer rejected.
fn rejected(v: &ValidatedRequest) -> Error {
    let req = &v.request;
    Error::new(
        ErrorKind::OutOfBounds,
        format!(
            "peer rejected {:?} of {:#x}+{}: outside its registered memory",
            req.opcode, req.target_offset, req.length
        ),
    )
}

/// Completes once the transport is shut down (or its stop signal is gone).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|&stopped| stopped).await.map(|_| ());
}

/// Completes when the peer closes (or breaks) a connection on which nothing is in flight; a
/// byte arriving unasked is a protocol error and also ends the connection.
async fn idle_close(r: &mut OwnedReadHalf) -> std::io::Result<usize> {
    let mut b = [0u8; 1];
    r.peek(&mut b).await
}

/// Default request deadline from a timeout.
pub(crate) fn deadline(timeout: Duration) -> Instant {
    Instant::now() + timeout
}

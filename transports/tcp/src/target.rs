//! The target side: serves READ and WRITE requests from any initiator (Ferry or Mooncake)
//! against this engine's registered memory, and Ferry's fence requests ([`crate::fence`]).
//!
//! Every request is checked against the memory registry before a byte is read or written. A
//! rejected v2 request gets status 1 and the connection keeps serving (a rejected WRITE's
//! payload is drained when it is small enough, else the connection is closed). Malformed
//! headers, slow or stalled peers and v1 rejections close the offending connection only.
//!
//! Deadlines are absolute: a header must be complete within [`TargetLimits::header`] of its
//! first byte, a request (its payload included) within [`TargetLimits::io`] of its header, and a
//! connection must serve a request inside registered memory at least every
//! [`TargetLimits::idle`] (rejected and empty requests do not count). Connections are admitted
//! through the [`ConnTable`], which closes the idlest one of a remote address that reached
//! [`TargetLimits::per_ip`].
//!
//! Once the engine is shutting down (its memory registry is closed), a request is answered by
//! closing its connection: the status frame is Mooncake's and has no code for "shutting down",
//! and status 1 would tell the initiator that the range is outside registered memory.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::{MemoryRegistry, Opcode};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout_at};

use crate::auth::DataAuth;
use crate::conns::{Admitted, Conn, ConnTable, Stop};
use crate::fence;
use crate::io::{InBuf, SpareWorkers, write_all_vectored_polling};
use crate::memory::{bytes, bytes_mut};
use crate::wire::{HEADER_LEN, Header, STATUS_LEN, Status};
use ferry_listener::AcceptBackoff;

/// WRITE payloads above this are expected to be read straight into memory: after one, the next
/// header is read alone ([`InBuf::set_fill_limit`]).
const DIRECT_PAYLOAD: u64 = 16 * 1024;

/// Limits of the target side.
#[derive(Debug, Clone)]
pub(crate) struct TargetLimits {
    /// Time a connection may go without serving a request inside registered memory (counted
    /// from its last one, or from its start) before it is closed.
    pub(crate) idle: Duration,
    /// Time to receive the rest of a header once its first byte arrived (slow-loris guard).
    pub(crate) header: Duration,
    /// Time to serve one request, its payload included, from its header on.
    pub(crate) io: Duration,
    /// Largest rejected WRITE payload drained to keep a connection; larger ones close it.
    pub(crate) max_drain: u64,
    /// Connections served at once; a new one beyond it closes the idlest connection of all
    /// (it waits in the accept queue only while every connection is busy).
    pub(crate) max_connections: usize,
    /// Connections per remote IP address before the idlest of them is closed for a new one.
    pub(crate) per_ip: usize,
    /// How long a connection whose peer asks one request at a time polls for the next one
    /// after serving one, before it sleeps ([`ferry_core::batch::spin_before_sleep`]).
    pub(crate) next_request_poll: Duration,
    /// The congestion control of a connection from this host (`tcp_local_congestion`): this
    /// end sends the READs' data.
    pub(crate) local_congestion: crate::options::LocalCongestion,
}

/// Why a connection was closed.
#[derive(Debug)]
enum Close {
    Eof,
    Idle,
    Evicted,
    Fenced,
    Shutdown,
    Protocol(String),
    Io(std::io::Error),
}

impl std::fmt::Display for Close {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Close::Eof => f.write_str("peer closed the connection"),
            Close::Idle => f.write_str("idle timeout"),
            Close::Evicted => f.write_str("idle, closed for a new connection from the same address"),
            Close::Fenced => f.write_str("fenced by its initiator"),
            Close::Shutdown => f.write_str("the engine is shutting down"),
            Close::Protocol(why) => write!(f, "protocol: {why}"),
            Close::Io(e) => write!(f, "i/o: {e}"),
        }
    }
}

impl From<std::io::Error> for Close {
    fn from(e: std::io::Error) -> Self {
        Close::Io(e)
    }
}

/// Accepts connections until `stop` turns true, then aborts and awaits every connection task.
/// Each connection is served only once `auth` admits it (at once when authentication is off).
pub(crate) async fn serve(
    listener: TcpListener,
    memory: Arc<MemoryRegistry>,
    limits: Arc<TargetLimits>,
    auth: DataAuth,
    mut stop: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    let table = ConnTable::new(limits.per_ip);
    let spare = Arc::new(SpareWorkers::of_current_runtime());
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut backoff = AcceptBackoff::new("tcp target");
    loop {
        // Every slot taken: close the idlest connection of all rather than leave new ones (a
        // real peer's among them) queued behind idle ones; wait only while all are busy.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                table.evict_idlest_anywhere();
                tokio::select! {
                    p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                    _ = stop.changed() => break,
                }
            }
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        while conns.try_join_next().is_some() {}
        match accepted {
            Ok((mut stream, peer)) => {
                backoff.accepted();
                let memory = memory.clone();
                let limits = limits.clone();
                let auth = auth.clone();
                let spare = spare.clone();
                // Counted against its address before it proves anything: a flood of
                // unauthenticated connections is held to the per-address limit too.
                let admitted = table.admit(peer);
                conns.spawn(async move {
                    let _permit = permit;
                    if !auth.admit(&mut stream, peer, limits.header).await {
                        return;
                    }
                    let outcome = serve_connection(stream, &admitted, &memory, &limits, &spare).await;
                    match outcome {
                        Close::Eof | Close::Idle | Close::Evicted | Close::Fenced | Close::Shutdown => {
                            tracing::trace!(%peer, reason = %outcome, "tcp target: connection closed")
                        }
                        other => tracing::debug!(%peer, reason = %other, "tcp target: connection closed"),
                    }
                });
            }
            Err(e) => {
                // Out of descriptors, the pending connection stays queued and every retry fails
                // until one is freed: back off, and say so once per period, not once per retry.
                let backoff = backoff.failed(&e);
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => break,
                }
            }
        }
    }
    conns.shutdown().await;
}

async fn serve_connection(
    mut stream: TcpStream,
    admitted: &Admitted,
    memory: &MemoryRegistry,
    limits: &TargetLimits,
    spare: &SpareWorkers,
) -> Close {
    let mut owed = OwedStatuses::default();
    let close = serve_requests(&mut stream, &mut owed, admitted, memory, limits, spare).await;
    // The WRITEs served before a close still get their statuses, unless the socket broke.
    if !owed.is_empty() && !matches!(close, Close::Io(_)) {
        let _ = tokio::time::timeout(limits.header, owed.flush(&mut stream)).await;
    }
    close
}

/// Serves `stream`'s requests until the connection is to close, and says why. Statuses it owes
/// when it returns are in `owed` (the caller sends them).
async fn serve_requests(
    stream: &mut TcpStream,
    owed: &mut OwedStatuses,
    admitted: &Admitted,
    memory: &MemoryRegistry,
    limits: &TargetLimits,
    spare: &SpareWorkers,
) -> Close {
    if let Err(e) = stream.set_nodelay(true) {
        return Close::Io(e);
    }
    crate::io::use_local_congestion(&*stream, &limits.local_congestion);
    let conn = admitted.conn();
    // Pipelined headers arrive together: one read serves many of them. It also mutes the
    // socket's arrivals while a poll holds its worker, and unmutes them before every wait
    // through tokio.
    let mut input = InBuf::new(64 * 1024);
    let mut idle_until = Instant::now() + limits.idle;
    // Counted awake except while asleep in tokio between requests.
    let mut awake = Some(spare.awake());
    let spin = limits.next_request_poll;
    // When the last request was served (the poll for the next one starts there).
    let mut served_at: Option<std::time::Instant> = None;
    // Requests taken from `input` since it was last filled: 1 when the peer asks one at a time
    // (the poll below is for it), more when it pipelines (a lane's batch: no poll, so this task
    // does not hold a runtime thread while other connections wait).
    let mut since_fill = 0u32;
    // Whether the last poll had to wait for its request, which then came in time: a peer that
    // asks after each answer. Only its poll may hold a worker; a pipelining peer's poll (at
    // the end of a batch, when nothing more comes) would only idle a core its other
    // connections need.
    let mut waits_for_answers = false;
    loop {
        let mut header_due: Option<Instant> = None;
        let mut peeked = false;
        let hdr = loop {
            if let Some(h) = input.take::<HEADER_LEN>() {
                break h;
            }
            if !owed.is_empty() {
                // A pipelining peer's next request is usually here already: serve it, and send
                // its status with the ones owed. Before any wait they all go out (a peer that
                // waits for each answer gets it at once, without this look).
                if !peeked && !waits_for_answers {
                    peeked = true;
                    match input.try_fill(stream) {
                        Ok(0) => return Close::Eof,
                        Ok(_) => {
                            since_fill = 0;
                            continue;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Close::Io(e),
                    }
                }
                if let Err(e) = owed.flush(stream).await {
                    return Close::Io(e);
                }
            }
            if input.len() == 0 {
                // Right after a request, poll for the next one before sleeping: a peer that sends
                // one request at a time sends the next within microseconds, and waking this
                // task from the driver costs tens of them on a virtualised host. Only for a peer
                // that asks one request at a time (`since_fill`). The poll holds its worker
                // when the peer waits for answers and one is spare (one always stays free for
                // the driver and other tasks), and else yields to the runtime's other tasks
                // after its first microseconds.
                if let Some(since) = served_at.take()
                    && since_fill == 1
                    && !spin.is_zero()
                {
                    // One attempt first: a pipelining peer's next request is usually here.
                    let polled = match input.try_fill(stream) {
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            let held = if waits_for_answers { spare.try_hold() } else { None };
                            let polled = input.poll_fill(stream, since + spin, held.is_some()).await;
                            drop(held);
                            waits_for_answers = polled.is_ok();
                            polled
                        }
                        other => {
                            waits_for_answers = false;
                            other
                        }
                    };
                    match polled {
                        Ok(0) => return Close::Eof,
                        Ok(_) => {
                            since_fill = 0;
                            // An eviction that came meanwhile found a request arriving: it stays,
                            // as it does when the eviction wakes the wait below.
                            if matches!(conn.stop(), Some(Stop::Evicted)) {
                                admitted.decline_eviction();
                            }
                            continue;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Close::Io(e),
                    }
                }
                // Between requests: until the idle deadline, or until asked to stop.
                drop(awake.take());
                tokio::select! {
                    biased;
                    read = timeout_at(idle_until, input.fill(stream)) => match read {
                        Err(_) => return Close::Idle,
                        Ok(Ok(0)) => return Close::Eof,
                        Ok(Ok(_)) => since_fill = 0,
                        Ok(Err(e)) => return Close::Io(e),
                    },
                    () = conn.idle_wake.notified() => match conn.stop() {
                        Some(Stop::Fenced) => return Close::Fenced,
                        // Evicted: close unless a request's first bytes are already here.
                        Some(Stop::Evicted) => match input.try_fill(stream) {
                            Ok(0) => return Close::Eof,
                            Ok(_) => {
                                since_fill = 0;
                                admitted.decline_eviction();
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Close::Evicted,
                            Err(e) => return Close::Io(e),
                        },
                        None => {}
                    },
                }
                awake = Some(spare.awake());
            } else {
                // Once a header started it must complete, by one deadline however it trickles.
                let due = *header_due.get_or_insert_with(|| Instant::now() + limits.header);
                match timeout_at(due, input.fill(stream)).await {
                    Err(_) => return Close::Protocol("header not completed in time".into()),
                    Ok(Ok(0)) => return Close::Protocol("connection closed inside a header".into()),
                    Ok(Ok(_)) => since_fill = 0,
                    Ok(Err(e)) => return Close::Io(e),
                }
            }
        };
        if fence::is_fence(&hdr) {
            // A fence's answer comes after the statuses of the WRITEs before it.
            if let Err(e) = owed.flush(stream).await {
                return Close::Io(e);
            }
            let size = u64::from_le_bytes(hdr[..8].try_into().expect("8 bytes"));
            let due = Instant::now() + limits.header;
            match fence::serve(stream, &mut input, size, admitted, due).await {
                Ok(_) => continue, // not a request inside registered memory: the idle deadline stays
                Err(e) => return Close::Protocol(format!("fence request: {e}")),
            }
        }
        let header = match Header::decode(&hdr) {
            Ok(h) => h,
            Err(e) => return Close::Protocol(e.to_string()),
        };
        since_fill += 1;
        if conn.fenced() {
            return Close::Fenced;
        }
        let due = Instant::now() + limits.io;
        let serving = async {
            if header.opcode == Opcode::Read {
                owed.flush(stream).await?;
                let (served, more) = serve_reads(stream, &mut input, memory, header, conn).await?;
                since_fill += more;
                Ok(served)
            } else {
                serve_write(stream, &mut input, memory, header, limits, conn, owed).await
            }
        };
        match timeout_at(due, serving).await {
            Err(_) => return Close::Protocol(format!("request {header:?} not completed in {:?}", limits.io)),
            Ok(Err(close)) => return close,
            Ok(Ok(true)) => {
                // After a large WRITE another is likely: read its header alone, and its payload
                // straight into memory rather than through `input` (a copy more per byte).
                input.set_fill_limit(match header.opcode {
                    Opcode::Write if header.size > DIRECT_PAYLOAD => HEADER_LEN,
                    _ => usize::MAX,
                });
                admitted.served();
                idle_until = Instant::now() + limits.idle;
                served_at = Some(std::time::Instant::now());
            }
            Ok(Ok(false)) => {}
        }
        if owed.full()
            && let Err(e) = owed.flush(stream).await
        {
            return Close::Io(e);
        }
        // A task whose peer keeps asking within the poll never waits for its socket: this lets
        // the runtime run its worker's other tasks every so many requests (tokio's budget).
        tokio::task::consume_budget().await;
    }
}

/// Statuses owed are sent once there are this many...
const STATUSES_PER_WRITE: usize = 64;
/// ... or once the WRITEs they answer carried this much payload (what a peer waits on).
const STATUS_PAYLOAD_PER_WRITE: u64 = 1 << 20;

/// Status frames of WRITEs served but not answered yet. A pipelining peer's WRITEs are answered
/// together, with one write, instead of one system call (and one delivery to the peer) each.
/// They go out before this task would wait for anything (the next request, or a WRITE's payload
/// that is not all here yet: a peer may hold it back until it has them), before anything else
/// is written to the peer (a READ's answer, a fence's), once [`STATUSES_PER_WRITE`] are owed or
/// their WRITEs carried [`STATUS_PAYLOAD_PER_WRITE`], and when the connection closes.
#[derive(Debug, Default)]
struct OwedStatuses {
    /// The status frames, in request order.
    frames: Vec<u8>,
    /// Payload bytes of the WRITEs they answer.
    payload: u64,
}

impl OwedStatuses {
    fn push(&mut self, status: Status, payload: u64) {
        self.frames.extend_from_slice(&status.encode());
        self.payload = self.payload.saturating_add(payload);
    }

    fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    fn full(&self) -> bool {
        self.frames.len() >= STATUSES_PER_WRITE * STATUS_LEN || self.payload >= STATUS_PAYLOAD_PER_WRITE
    }

    /// Sends every owed status, in order.
    async fn flush(&mut self, stream: &mut TcpStream) -> std::io::Result<()> {
        if !self.frames.is_empty() {
            stream.write_all(&self.frames).await?;
            self.frames.clear();
            self.payload = 0;
        }
        Ok(())
    }
}

/// At most this many READs already buffered are answered with one write...
const READS_PER_WRITE: usize = 64;
/// ... while their data stays under this.
const READ_BYTES_PER_WRITE: u64 = 1 << 20;

/// Serves the READ `first` and the READs right behind it whose headers are already buffered,
/// answering them with one vectored write (statuses and data, in order): one system call
/// instead of one per request. Stops before anything else (a WRITE, a fence, a malformed
/// header, a rejected v1 READ, a shutdown), which the caller then serves alone. `Ok((served,
/// more))`: whether one of them was inside registered memory, and how many READs were taken
/// after `first`.
async fn serve_reads(
    stream: &mut TcpStream,
    input: &mut InBuf,
    memory: &MemoryRegistry,
    first: Header,
    conn: &Conn,
) -> Result<(bool, u32), Close> {
    let mut reads = vec![(first, lease(memory, &first)?)];
    let mut total = first.size;
    while reads.len() < READS_PER_WRITE && total < READ_BYTES_PER_WRITE {
        let Some(next) = input.peek::<HEADER_LEN>() else { break };
        if fence::is_fence(&next) {
            break;
        }
        let Ok(h) = Header::decode(&next) else { break };
        if h.opcode != Opcode::Read || h.v2 != first.v2 {
            break;
        }
        let Ok(region) = lease(memory, &h) else { break };
        if region.is_none() && !h.v2 {
            break; // v1 cannot say no: the caller closes the connection
        }
        input.take::<HEADER_LEN>();
        total = total.saturating_add(h.size);
        reads.push((h, region));
    }
    let ok = Status::Ok.encode();
    let rejected = Status::Rejected.encode();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(reads.len() * 2);
    for (h, region) in &reads {
        let data = match region {
            Some(r) => {
                Some(bytes(r, h.addr, h.size).ok_or_else(|| Close::Protocol("lease does not cover range".into()))?)
            }
            None => {
                tracing::debug!(addr = h.addr, size = h.size, "tcp target: READ outside registered memory rejected");
                if !h.v2 {
                    return Err(Close::Protocol(format!("v1 request for unregistered range {:#x}+{}", h.addr, h.size)));
                }
                None
            }
        };
        if h.v2 {
            parts.push(if data.is_some() { &ok } else { &rejected });
        }
        parts.extend(data);
    }
    conn.set_busy(true);
    write_all_vectored_polling(stream, &parts, ferry_core::batch::spin_before_sleep()).await?;
    conn.set_busy(false);
    let served = reads.iter().any(|(_, r)| r.is_some());
    Ok((served, reads.len() as u32 - 1))
}

/// A lease on the range `h` names: `Ok(None)` when it is not inside registered memory (or
/// empty), `Close::Shutdown` once the engine is shutting down.
fn lease(memory: &MemoryRegistry, h: &Header) -> Result<Option<ferry_core::memory::RegionLease>, Close> {
    match h.size {
        0 => Ok(None),
        _ => match memory.lease(h.addr, h.size) {
            Ok(lease) => Ok(Some(lease)),
            Err(e) if e.kind() == ferry_core::ErrorKind::Shutdown => Err(Close::Shutdown),
            Err(_) => Ok(None),
        },
    }
}

/// Serves one WRITE; `Ok(true)` when it was inside registered memory (served), `Ok(false)`
/// when it was rejected.
async fn serve_write(
    stream: &mut TcpStream,
    input: &mut InBuf,
    memory: &MemoryRegistry,
    h: Header,
    limits: &TargetLimits,
    conn: &Conn,
    owed: &mut OwedStatuses,
) -> Result<bool, Close> {
    // Statuses owed wait only while this request needs no waiting: a peer may hold its payload
    // back until it has them.
    if !owed.is_empty() && !input.holds(stream, h.size)? {
        owed.flush(stream).await?;
    }
    match lease(memory, &h)? {
        Some(region) => {
            let data = bytes_mut(&region, h.addr, h.size)
                .ok_or_else(|| Close::Protocol("lease does not cover range".into()))?;
            conn.set_busy(true);
            // The payload is copied into memory under `copying`, and the copy stops as soon as a
            // fence names this connection: once a fence holds the lock, nothing more lands.
            let copying = conn.copying.lock().await;
            if conn.fenced() {
                return Err(Close::Fenced);
            }
            // Polling while the payload keeps coming (asking the fence before every read),
            // then through tokio, where the fence's wake-up ends the copy.
            let spin = ferry_core::batch::spin_before_sleep();
            tokio::select! {
                biased;
                copied = input.read_exact_polling(stream, data, spin, || conn.fenced()) => {
                    if !copied? {
                        return Err(Close::Fenced);
                    }
                }
                () = conn.fence_wake.notified() => return Err(Close::Fenced),
            }
            drop(copying);
            if h.v2 {
                owed.push(Status::Ok, h.size);
            }
            conn.set_busy(false);
            Ok(true)
        }
        None => {
            tracing::debug!(addr = h.addr, size = h.size, "tcp target: WRITE outside registered memory rejected");
            if !h.v2 {
                return Err(Close::Protocol(format!("v1 request for unregistered range {:#x}+{}", h.addr, h.size)));
            }
            if h.size > limits.max_drain {
                owed.push(Status::Rejected, 0);
                owed.flush(stream).await?;
                return Err(Close::Protocol(format!("rejected write of {} bytes is too large to drain", h.size)));
            }
            input.skip(stream, h.size).await?;
            owed.push(Status::Rejected, h.size);
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use ferry_core::Location;

    use super::*;

    /// A target over a registered buffer of 4 KiB with an idle limit of 600 ms; its port.
    async fn target(buf: &[u8]) -> (u16, watch::Sender<bool>) {
        target_polling(buf, ferry_core::batch::spin_before_sleep()).await
    }

    /// [`target`], whose connections poll for a peer's next request this long.
    async fn target_polling(buf: &[u8], next_request_poll: Duration) -> (u16, watch::Sender<bool>) {
        let memory = Arc::new(MemoryRegistry::new());
        #[allow(unsafe_code)]
        // SAFETY: the test's buffer outlives the target (the test awaits nothing after it).
        unsafe { memory.register(buf.as_ptr() as u64, buf.len() as u64, Location::Cpu(0)) }.unwrap();
        let limits = Arc::new(TargetLimits {
            idle: Duration::from_millis(600),
            header: Duration::from_millis(500),
            io: Duration::from_secs(1),
            max_drain: 1 << 20,
            max_connections: 64,
            per_ip: 64,
            next_request_poll,
            local_congestion: Default::default(),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(serve(listener, memory, limits, crate::auth::DataAuth::with(None), stop_rx));
        (port, stop)
    }

    /// Sends `request` every 150 ms for 2 s, reading what comes back; the time the target
    /// closed the connection, if it did.
    fn keep_asking(port: u16, request: [u8; HEADER_LEN]) -> Option<Duration> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_secs(2) {
            if s.write_all(&request).is_err() {
                return Some(t.elapsed());
            }
            let mut b = [0u8; 64];
            match s.read(&mut b) {
                Ok(0) => return Some(t.elapsed()),
                Err(e) if !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Some(t.elapsed());
                }
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        None
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_served_requests_keep_a_connection_open() {
        let buf = vec![0u8; 4096];
        let (port, _stop) = target(&buf).await;
        let addr = buf.as_ptr() as u64;
        let empty = Header { size: 0, addr, opcode: Opcode::Read, v2: true }.encode();
        let outside = Header { size: 8, addr: 8, opcode: Opcode::Read, v2: true }.encode();
        let real = Header { size: 8, addr, opcode: Opcode::Read, v2: true }.encode();
        let (empty, outside, real) = tokio::join!(
            tokio::task::spawn_blocking(move || keep_asking(port, empty)),
            tokio::task::spawn_blocking(move || keep_asking(port, outside)),
            tokio::task::spawn_blocking(move || keep_asking(port, real)),
        );
        for (what, closed) in [("empty", empty.unwrap()), ("rejected", outside.unwrap())] {
            assert!(
                closed.is_some_and(|t| t < Duration::from_millis(1500)),
                "{what} requests every 150 ms kept an idle connection open: closed after {closed:?} (idle limit 600 ms)"
            );
        }
        assert_eq!(real.unwrap(), None, "served requests keep a connection open");
    }

    /// A peer that pauses anywhere after a request (before its next header, inside one, inside
    /// a WRITE's payload) while the target polls for that request with arrivals muted is still
    /// served: each wait through tokio comes after the unmute, which signals what came meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_pauses_anywhere_while_the_target_polls_is_served() {
        let buf = vec![0u8; 4096];
        // A poll long enough that this test's next bytes surely arrive inside it.
        let (port, _stop) = target_polling(&buf, Duration::from_millis(10)).await;
        let addr = buf.as_ptr() as u64;
        let client = tokio::task::spawn_blocking(move || {
            let pause = Duration::from_millis(100);
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_nodelay(true).unwrap();
            // Well inside every deadline (idle 600 ms, header 500 ms, request 1 s): a target that
            // missed an arrival would answer only when a deadline closes the connection.
            s.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
            let read = Header { size: 8, addr, opcode: Opcode::Read, v2: true }.encode();
            let ask = |s: &mut std::net::TcpStream, what: &str| {
                let mut answer = [0u8; STATUS_LEN + 8];
                s.write_all(&read).unwrap();
                s.read_exact(&mut answer).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(&answer[..STATUS_LEN], &Status::Ok.encode(), "{what}");
            };
            // Requests each a millisecond after the answer before it, well inside the target's
            // poll: it finds the socket empty, then catches the request. The poll after the
            // last then holds a worker with arrivals muted (a peer that waits for answers).
            let back_to_back = |s: &mut std::net::TcpStream| {
                for _ in 0..3 {
                    std::thread::sleep(Duration::from_millis(1));
                    ask(s, "a request back to back");
                }
            };
            back_to_back(&mut s);
            // Past the poll: the target sleeps on the socket.
            std::thread::sleep(pause);
            ask(&mut s, "a request after a pause");
            back_to_back(&mut s);
            // Half a header inside the poll, the rest after it.
            s.write_all(&read[..10]).unwrap();
            std::thread::sleep(pause);
            s.write_all(&read[10..]).unwrap();
            let mut answer = [0u8; STATUS_LEN + 8];
            s.read_exact(&mut answer).expect("a header split by a pause is answered");
            assert_eq!(&answer[..STATUS_LEN], &Status::Ok.encode());
            back_to_back(&mut s);
            // A WRITE whose payload stops halfway for longer than the target polls for it.
            let write = Header { size: 64, addr: addr + 64, opcode: Opcode::Write, v2: true }.encode();
            let payload = [0x5au8; 64];
            s.write_all(&[&write[..], &payload[..32]].concat()).unwrap();
            std::thread::sleep(pause);
            s.write_all(&payload[32..]).unwrap();
            let mut status = [0u8; STATUS_LEN];
            s.read_exact(&mut status).expect("a WRITE whose payload paused is answered");
            assert_eq!(status, Status::Ok.encode());
        });
        client.await.unwrap();
        assert!(buf[64..128].iter().all(|&b| b == 0x5a), "the paused WRITE landed whole");
    }

    /// Pipelined WRITEs are answered together, in order, rejected ones included, before the
    /// answer to what follows them; and before the connection closes on a bad request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_writes_are_answered_in_order_before_what_follows_them() {
        let buf = vec![0u8; 4096];
        let (port, _stop) = target(&buf).await;
        let addr = buf.as_ptr() as u64;
        let client = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(800))).unwrap();
            let write = |at: u64, size: u64| Header { size, addr: at, opcode: Opcode::Write, v2: true }.encode();
            let mut burst = Vec::new();
            burst.extend_from_slice(&write(addr, 64));
            burst.extend_from_slice(&[0x11; 64]);
            burst.extend_from_slice(&write(8, 16)); // outside registered memory: rejected, drained
            burst.extend_from_slice(&[0xee; 16]);
            burst.extend_from_slice(&write(addr + 64, 64));
            burst.extend_from_slice(&[0x33; 64]);
            burst.extend_from_slice(&Header { size: 128, addr, opcode: Opcode::Read, v2: true }.encode());
            s.write_all(&burst).unwrap();
            let mut answer = [0u8; 4 * STATUS_LEN + 128];
            s.read_exact(&mut answer).expect("every request of the burst is answered");
            let statuses: Vec<[u8; STATUS_LEN]> =
                answer[..4 * STATUS_LEN].chunks(STATUS_LEN).map(|c| c.try_into().unwrap()).collect();
            let (ok, rejected) = (Status::Ok.encode(), Status::Rejected.encode());
            assert_eq!(statuses, [ok, rejected, ok, ok], "statuses in request order");
            let data = &answer[4 * STATUS_LEN..];
            assert!(
                data[..64].iter().all(|&b| b == 0x11) && data[64..].iter().all(|&b| b == 0x33),
                "the READ saw both WRITEs"
            );
            // A WRITE, then a request the target refuses to parse: the WRITE is answered first.
            let mut bad = Header { size: 8, addr, opcode: Opcode::Read, v2: true }.encode();
            bad[16] = 0x80 | 0x7f;
            s.write_all(&[&write(addr + 128, 32)[..], &[0x44; 32], &bad[..]].concat()).unwrap();
            let mut status = [0u8; STATUS_LEN];
            s.read_exact(&mut status).expect("the WRITE before a bad request is answered");
            assert_eq!(status, ok);
            let mut rest = [0u8; 1];
            assert_eq!(s.read(&mut rest).unwrap(), 0, "then the connection closes");
        });
        client.await.unwrap();
        assert!(buf[128..160].iter().all(|&b| b == 0x44));
    }

    /// A peer that sends its next WRITE's header but holds its payload back until the previous
    /// WRITE is answered gets that answer: statuses are owed only while nothing waits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_holding_a_payload_back_for_the_previous_answer_gets_it() {
        let buf = vec![0u8; 4096];
        let (port, _stop) = target(&buf).await;
        let addr = buf.as_ptr() as u64;
        let client = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            // Well inside the request deadline (1 s), which would close the connection.
            s.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
            let write = |at: u64| Header { size: 64, addr: at, opcode: Opcode::Write, v2: true }.encode();
            s.write_all(&[&write(addr)[..], &[0x21; 64], &write(addr + 64)[..]].concat()).unwrap();
            let mut status = [0u8; STATUS_LEN];
            s.read_exact(&mut status).expect("the first WRITE is answered while the second's payload is missing");
            assert_eq!(status, Status::Ok.encode());
            s.write_all(&[0x22; 64]).unwrap();
            s.read_exact(&mut status).expect("the second WRITE is answered");
            assert_eq!(status, Status::Ok.encode());
        });
        client.await.unwrap();
        assert!(buf[..64].iter().all(|&b| b == 0x21) && buf[64..128].iter().all(|&b| b == 0x22));
    }
}

//! Fences: Ferry's guarantee that a request which failed (timed out, or lost its connection)
//! never lands after a later request to the same peer succeeded.
//!
//! A failed request may still be on its way: its bytes sit in socket buffers, or the target was
//! stopped in the middle of copying them, and the target applies them whenever it resumes. So the
//! initiator, before it completes a failed WRITE, marks the connection that carried it as fenced
//! (`PeerFence::mark`) and drops it. Before it sends anything more to that peer, it sends a
//! fence request on a fresh connection, naming the fenced connection by the address the target
//! sees it from (the initiator's local `ip:port` of it), and waits for the answer
//! (`PeerFence::settle`). The target marks that connection dead, waits until a WRITE copying
//! into memory on it has stopped (the copy is cut short), answers, and serves nothing more on
//! it (`serve`). A fence that is not answered within the next request's deadline fails that
//! request instead.
//!
//! The fence request is Ferry's own: opcode byte [`FENCE_OPCODE`] with the v2 bit, `size` the
//! length of the payload, `addr` 0, and the payload `"<fenced ip:port> <this connection's ip:port>"`
//! in ASCII. The answer is a status frame: OK when the named connection is dead (or was gone
//! already), rejected when the target sees the fence's own connection under another address than
//! the one it names (address translation between the two: the fenced connection cannot be
//! identified), or when the fenced connection's IP is not the fence's own (nobody fences another
//! host's connections). It is sent only to peers whose descriptor advertises `ferry_tcp_fence: 1`:
//! Mooncake targets never see it.
//!
//! The per-request cost on the initiator is one atomic load (`PeerFence::pending`); on the
//! target, one uncontended lock per WRITE.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use ferry_core::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use crate::conns::Admitted;
use crate::initiator::PeerAddr;
use crate::io::InBuf;
use crate::wire::{FENCE_OPCODE, HEADER_LEN, STATUS_LEN, Status, V2_FLAG};

/// Largest fence payload a target reads; a longer one closes the connection.
pub(crate) const MAX_PAYLOAD: u64 = 128;

/// Whether `hdr` is a fence request (the v2 fence opcode).
pub(crate) fn is_fence(hdr: &[u8; HEADER_LEN]) -> bool {
    hdr[16] == FENCE_OPCODE | V2_FLAG
}

/// The fence request naming `fenced`, sent on the connection whose local address is `via`.
pub(crate) fn encode(fenced: SocketAddr, via: SocketAddr) -> Vec<u8> {
    let payload = format!("{fenced} {via}");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.push(FENCE_OPCODE | V2_FLAG);
    out.extend_from_slice(&[0u8; 7]);
    out.extend_from_slice(payload.as_bytes());
    out
}

/// The (fenced, via) addresses of a fence payload.
pub(crate) fn decode(payload: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (fenced, via) = text.split_once(' ')?;
    Some((fenced.parse().ok()?, via.parse().ok()?))
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// What a target did with a fence request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// The named connections (this many) serve nothing more; answered OK.
    Fenced(usize),
    /// The fence came from another address than it says: answered rejected.
    Unidentified,
}

/// Serves a fence request of `size` payload bytes that arrived on `this` (the target side):
/// reads the payload, fences the connections it names, and answers, all before `deadline`.
/// `Err` closes the connection (a malformed request, or a fence not completed in time).
pub(crate) async fn serve(
    stream: &mut TcpStream,
    input: &mut InBuf,
    size: u64,
    this: &Admitted,
    deadline: Instant,
) -> std::io::Result<Served> {
    if size > MAX_PAYLOAD {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "fence payload too long"));
    }
    let mut payload = [0u8; MAX_PAYLOAD as usize];
    let payload = &mut payload[..size as usize];
    let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, "fence not completed in time");
    timeout_at(deadline, input.read_exact(stream, payload)).await.map_err(|_| timed_out())??;
    let Some((fenced, via)) = decode(payload) else {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed fence payload"));
    };
    // A fence names a connection of its own sender's address: it cannot close anyone else's.
    if canonical(via) != canonical(this.conn().peer()) || fenced.ip().to_canonical() != via.ip().to_canonical() {
        tracing::warn!(
            seen = %this.conn().peer(),
            says = %via,
            %fenced,
            "tcp target: a fence request names another address than the one it comes from (address translation?): \
             refused"
        );
        stream.write_all(&Status::Rejected.encode()).await?;
        return Ok(Served::Unidentified);
    }
    let conns = this.table().find(fenced, this.conn());
    for c in &conns {
        c.fence();
    }
    for c in &conns {
        // The fenced task releases the lock once its copy stopped (it is cut short at once).
        let _copy = timeout_at(deadline, c.copying.lock()).await.map_err(|_| timed_out())?;
    }
    tracing::debug!(%fenced, count = conns.len(), "tcp target: connection fenced");
    timeout_at(deadline, stream.write_all(&Status::Ok.encode())).await.map_err(|_| timed_out())??;
    Ok(Served::Fenced(conns.len()))
}

/// The initiator's fence state for one peer, shared by its lanes.
#[derive(Debug, Default)]
pub(crate) struct PeerFence {
    /// The peer advertises fences (`ferry_tcp_fence`); without it nothing is ever marked.
    supported: bool,
    /// Some connection waits to be fenced: the one flag every request checks.
    pending: AtomicBool,
    /// Local addresses of the connections to fence.
    fenced: Mutex<Vec<SocketAddr>>,
    /// One fence at a time per peer; the others wait for its outcome.
    gate: tokio::sync::Mutex<()>,
    /// How a fence's connection is set up, as the lanes' are (peer authentication included).
    setup: crate::initiator::ConnectSetup,
    /// A peer behind address translation was reported once.
    translated: AtomicBool,
}

impl PeerFence {
    /// The state for a peer that does (`supported`) or does not advertise fences.
    pub(crate) fn new(supported: bool, setup: crate::initiator::ConnectSetup) -> Self {
        Self { supported, setup, ..Self::default() }
    }

    /// Whether the peer advertises fences.
    pub(crate) fn supported(&self) -> bool {
        self.supported
    }

    /// True while a fence is due: requests to the peer must [`settle`](Self::settle) first.
    #[inline]
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Marks the connection whose local address is `local` as fenced. Called before any request
    /// it carried is reported failed. A no-op for a peer without fences.
    pub(crate) fn mark(&self, local: SocketAddr) {
        if !self.supported {
            return;
        }
        let mut fenced = self.fenced.lock().unwrap_or_else(|p| p.into_inner());
        if !fenced.contains(&local) {
            fenced.push(local);
        }
        self.pending.store(true, Ordering::Release);
    }

    /// Fences every marked connection before `deadline`: on a fresh connection, one fence
    /// request each, answered in order. Returns once none is left (another lane may have done
    /// the work meanwhile).
    ///
    /// # Errors
    /// `PeerUnreachable` when the fence connection fails, `Timeout` when the answers do not come
    /// before `deadline`; the connections stay marked and the next request tries again.
    pub(crate) async fn settle(&self, addr: &PeerAddr, deadline: Instant) -> Result<(), Error> {
        let who = format!("tcp peer {}:{}", addr.host, addr.port);
        let timeout = || Error::timeout(format!("{who}: the fence of a failed request was not answered in time"));
        let _gate = timeout_at(deadline, self.gate.lock()).await.map_err(|_| timeout())?;
        let todo: Vec<SocketAddr> = self.fenced.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if todo.is_empty() {
            self.pending.store(false, Ordering::Release);
            return Ok(());
        }
        let lost = |what: &str, e: std::io::Error| Error::unreachable(format!("{who}: fence {what}: {e}"));
        let mut s = crate::initiator::connect(addr, &self.setup, deadline)
            .await
            .map_err(|e| e.context(format!("{who}: fence: {}", e.message())))?;
        let via = s.local_addr().map_err(|e| lost("connection has no local address", e))?;
        let requests: Vec<u8> = todo.iter().flat_map(|&f| encode(f, via)).collect();
        let answers = async {
            s.write_all(&requests).await?;
            let mut out = Vec::with_capacity(todo.len());
            for _ in &todo {
                let mut st = [0u8; STATUS_LEN];
                s.read_exact(&mut st).await?;
                out.push(Status::decode(&st).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?);
            }
            Ok::<_, std::io::Error>(out)
        };
        let answers = timeout_at(deadline, answers).await.map_err(|_| timeout())?.map_err(|e| lost("failed", e))?;
        if answers.contains(&Status::Rejected) && !self.translated.swap(true, Ordering::Relaxed) {
            // The target cannot tell which connection is meant: nothing stronger than
            // Mooncake's own behaviour can be had with this peer.
            tracing::error!(
                peer = %who,
                "the peer sees this engine under another address (address translation between them): a request that \
                 timed out may still land after a later one; Ferry cannot fence connections to this peer"
            );
        }
        let mut fenced = self.fenced.lock().unwrap_or_else(|p| p.into_inner());
        fenced.retain(|f| !todo.contains(f));
        if fenced.is_empty() {
            self.pending.store(false, Ordering::Release);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_payloads_are_refused() {
        let fenced: SocketAddr = "10.0.0.5:40012".parse().unwrap();
        let via: SocketAddr = "[::1]:7".parse().unwrap();
        let req = encode(fenced, via);
        let hdr: [u8; HEADER_LEN] = req[..HEADER_LEN].try_into().unwrap();
        assert!(is_fence(&hdr));
        assert_eq!(u64::from_le_bytes(hdr[..8].try_into().unwrap()), (req.len() - HEADER_LEN) as u64);
        assert_eq!(crate::wire::Header::decode(&hdr), Err(crate::wire::WireError::BadOpcode(FENCE_OPCODE)));
        assert_eq!(decode(&req[HEADER_LEN..]), Some((fenced, via)));
        for bad in [&b""[..], b"10.0.0.5:1", b"x y", b"10.0.0.5:1 10.0.0.5", &[0xff, b' ', 0xfe]] {
            assert_eq!(decode(bad), None, "{bad:?}");
        }
        let longest = encode("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff%4294967295]:65535".parse().unwrap(), via);
        assert!((longest.len() - HEADER_LEN) as u64 <= MAX_PAYLOAD);
    }

    #[test]
    fn marks_are_kept_only_for_peers_with_fences() {
        let a: SocketAddr = "127.0.0.1:5".parse().unwrap();
        let none = PeerFence::new(false, Default::default());
        none.mark(a);
        assert!(!none.pending(), "a Mooncake peer is never fenced");
        let f = PeerFence::new(true, Default::default());
        f.mark(a);
        f.mark(a);
        assert!(f.pending());
        assert_eq!(f.fenced.lock().unwrap().len(), 1);
    }
}

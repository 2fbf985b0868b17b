//! The target side: serves READ and WRITE requests from any initiator (Ferry or Mooncake)
//! against this engine's registered memory.
//!
//! Every request is checked against the memory registry before a byte is read or written. A
//! rejected v2 request gets status 1 and the connection keeps serving (a rejected WRITE's
//! payload is drained when it is small enough, else the connection is closed). Malformed
//! headers, slow or stalled peers and v1 rejections close the offending connection only.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::{MemoryRegistry, Opcode};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::timeout;

use crate::auth::DataAuth;
use crate::io::{InBuf, write_all_vectored};
use crate::memory::{bytes, bytes_mut};
use crate::wire::{HEADER_LEN, Header, Status};

/// Limits of the target side.
#[derive(Debug, Clone)]
pub(crate) struct TargetLimits {
    /// Time a connection may sit idle between requests before it is closed.
    pub(crate) idle: Duration,
    /// Time to receive the rest of a header once its first byte arrived (slow-loris guard).
    pub(crate) header: Duration,
    /// Time to move one request's payload.
    pub(crate) io: Duration,
    /// Largest rejected WRITE payload drained to keep a connection; larger ones close it.
    pub(crate) max_drain: u64,
    /// Connections served at once; further ones wait in the accept queue.
    pub(crate) max_connections: usize,
}

/// Why a connection was closed.
#[derive(Debug)]
enum Close {
    Eof,
    Idle,
    Protocol(String),
    Io(std::io::Error),
}

impl std::fmt::Display for Close {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Close::Eof => f.write_str("peer closed the connection"),
            Close::Idle => f.write_str("idle timeout"),
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
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = stop.changed() => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        while conns.try_join_next().is_some() {}
        match accepted {
            Ok((mut stream, peer)) => {
                let memory = memory.clone();
                let limits = limits.clone();
                let auth = auth.clone();
                conns.spawn(async move {
                    let _permit = permit;
                    if !auth.admit(&mut stream, peer, limits.header).await {
                        return;
                    }
                    let outcome = serve_connection(stream, &memory, &limits).await;
                    match outcome {
                        Close::Eof | Close::Idle => {
                            tracing::trace!(%peer, reason = %outcome, "tcp target: connection closed")
                        }
                        other => tracing::debug!(%peer, reason = %other, "tcp target: connection closed"),
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "tcp target: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    conns.shutdown().await;
}

async fn serve_connection(mut stream: TcpStream, memory: &MemoryRegistry, limits: &TargetLimits) -> Close {
    if let Err(e) = stream.set_nodelay(true) {
        return Close::Io(e);
    }
    // Pipelined headers arrive together: one read serves many of them.
    let mut input = InBuf::new(64 * 1024);
    loop {
        let hdr = loop {
            if let Some(h) = input.take::<HEADER_LEN>() {
                break h;
            }
            // Between requests a connection may idle; once a header started it must complete.
            let wait = if input.len() == 0 { limits.idle } else { limits.header };
            match timeout(wait, input.fill(&mut stream)).await {
                Err(_) if input.len() == 0 => return Close::Idle,
                Err(_) => return Close::Protocol("header not completed in time".into()),
                Ok(Ok(0)) if input.len() == 0 => return Close::Eof,
                Ok(Ok(0)) => return Close::Protocol("connection closed inside a header".into()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Close::Io(e),
            }
        };
        let header = match Header::decode(&hdr) {
            Ok(h) => h,
            Err(e) => return Close::Protocol(e.to_string()),
        };
        match timeout(limits.io, serve_request(&mut stream, &mut input, memory, header, limits)).await {
            Err(_) => return Close::Protocol(format!("request {header:?} not completed in {:?}", limits.io)),
            Ok(Err(close)) => return close,
            Ok(Ok(())) => {}
        }
    }
}

async fn serve_request(
    stream: &mut TcpStream,
    input: &mut InBuf,
    memory: &MemoryRegistry,
    h: Header,
    limits: &TargetLimits,
) -> Result<(), Close> {
    let lease = if h.size == 0 { None } else { memory.lease(h.addr, h.size).ok() };
    let ok = Status::Ok.encode();
    match (h.opcode, lease) {
        (Opcode::Read, Some(region)) => {
            let data =
                bytes(&region, h.addr, h.size).ok_or_else(|| Close::Protocol("lease does not cover range".into()))?;
            let status: &[u8] = if h.v2 { &ok } else { &[] };
            write_all_vectored(stream, &[status, data]).await?;
            Ok(())
        }
        (Opcode::Write, Some(region)) => {
            let data = bytes_mut(&region, h.addr, h.size)
                .ok_or_else(|| Close::Protocol("lease does not cover range".into()))?;
            input.read_exact(stream, data).await?;
            if h.v2 {
                stream.write_all(&ok).await?;
            }
            Ok(())
        }
        (op, None) => {
            tracing::debug!(
                addr = h.addr,
                size = h.size,
                ?op,
                "tcp target: request outside registered memory rejected"
            );
            if !h.v2 {
                return Err(Close::Protocol(format!("v1 request for unregistered range {:#x}+{}", h.addr, h.size)));
            }
            if op == Opcode::Write {
                if h.size > limits.max_drain {
                    stream.write_all(&Status::Rejected.encode()).await?;
                    return Err(Close::Protocol(format!("rejected write of {} bytes is too large to drain", h.size)));
                }
                input.skip(stream, h.size).await?;
            }
            stream.write_all(&Status::Rejected.encode()).await?;
            Ok(())
        }
    }
}

//! The control channel between two HCCL transports: length-prefixed JSON frames over TCP.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of JSON (at most
//! [`MAX_FRAME`]). The initiator sends a [`Request`], the target answers with one or two
//! [`Reply`]s (a `Transfer` gets `Admitted`, then `Done`). Every read has a deadline.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest frame accepted.
pub const MAX_FRAME: usize = 1 << 20;
/// Most operations one `Transfer` request carries.
pub const MAX_OPS_PER_REQUEST: usize = 256;

/// One two-sided operation, as the target sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireOp {
    /// True: the initiator writes into the target (`addr` receives); false: it reads (`addr`
    /// is sent).
    pub write: bool,
    /// Target address.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// What an initiator asks of a target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    /// Join (or rebuild) the one-sided communicator of this pair at `epoch`, from `rank_table`.
    InitOneSided {
        /// The initiator's segment name (`host:port[...]`; the host must be the address the
        /// request comes from).
        from: String,
        /// The initiator's engine instance (`ferry_instance` of its descriptor): a new one
        /// means the initiator restarted and the communicator must be rebuilt.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        instance: Option<String>,
        /// The initiator's control endpoint (host): its `rank_info.hostIp`, which must be the
        /// address the request comes from.
        host_ip: String,
        /// The initiator's control endpoint (port).
        host_port: u16,
        /// Generation of the communicator (both sides agree on it; at most one past the
        /// target's).
        epoch: u64,
        /// The two-rank v1.0 rank table, exactly as both sides pass it to HCCL.
        rank_table: String,
        /// The target's rank in it.
        your_rank: u32,
        /// The ranges (address, length) the initiator binds to this communicator before its
        /// Prepare: exactly what the target may reach through it (memory bound after Prepare is
        /// not exchanged). Absent from older peers: then unknown.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        buffers: Option<Vec<(u64, u64)>>,
    },
    /// Join the initiator's two-sided communicator (root info from the initiator, which is rank 0).
    InitTwoSided {
        /// The initiator's segment name (as for `InitOneSided`).
        from: String,
        /// Generation of the communicator.
        epoch: u64,
        /// `HcclRootInfo`, hex.
        root_info: String,
    },
    /// Two-sided data: validate these operations and queue the target's half of each.
    Transfer {
        /// The initiator's segment name (as for `InitOneSided`).
        from: String,
        /// Generation of the two-sided communicator they go over.
        epoch: u64,
        /// The operations.
        ops: Vec<WireOp>,
    },
}

/// What a target answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    /// The target is joining (or has joined) the communicator of `epoch`.
    Accepted {
        /// The epoch joined.
        epoch: u64,
        /// For a one-sided communicator: the ranges the target binds to it (as the request's
        /// `buffers`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        buffers: Option<Vec<(u64, u64)>>,
    },
    /// The target is at a later generation: ask again with `epoch`.
    Stale {
        /// The epoch to ask for.
        epoch: u64,
    },
    /// The target cannot use the one-sided service (fall back to two-sided).
    Unsupported {
        /// Why.
        reason: String,
    },
    /// The operations of a `Transfer` that the target refused (index, reason); the target
    /// queued its half of all others, in order.
    Admitted {
        /// Refused operations.
        rejected: Vec<(u32, String)>,
    },
    /// The target's half of a `Transfer` finished (`error` when it failed).
    Done {
        /// The failure, if any.
        error: Option<String>,
    },
    /// The request was refused.
    Error {
        /// Why.
        message: String,
    },
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWriteExt + Unpin, T: Serialize>(w: &mut W, msg: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    if body.len() > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "control frame too large"));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await
}

/// Reads one frame within `timeout`. `Ok(None)` on a clean end of stream before a frame.
pub async fn read_frame<R: AsyncReadExt + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    timeout: Duration,
) -> std::io::Result<Option<T>> {
    let io = async {
        let mut len = [0u8; 4];
        match r.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes(len) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("control frame of {len} bytes (limit {MAX_FRAME})"),
            ));
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).await?;
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad control frame: {e}")))
    };
    tokio::time::timeout(timeout, io)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "control channel read timed out"))?
}

/// Hex encoding of bytes (root info on the wire).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Decodes [`hex`] output.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bad_frames_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let req = Request::Transfer { from: "x".into(), epoch: 3, ops: vec![WireOp { write: true, addr: 9, len: 4 }] };
        write_frame(&mut a, &req).await.unwrap();
        let got: Request = read_frame(&mut b, Duration::from_secs(1)).await.unwrap().unwrap();
        assert_eq!(got, req);
        // Oversized length prefix.
        tokio::io::AsyncWriteExt::write_all(&mut a, &(u32::MAX).to_be_bytes()).await.unwrap();
        let e = read_frame::<_, Request>(&mut b, Duration::from_secs(1)).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        // Garbage JSON.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        tokio::io::AsyncWriteExt::write_all(&mut a, &[0, 0, 0, 3, b'{', b'x', b'}']).await.unwrap();
        assert!(read_frame::<_, Request>(&mut b, Duration::from_secs(1)).await.is_err());
        // Silence: a timeout, not a hang.
        let (_a, mut b) = tokio::io::duplex(16);
        let e = read_frame::<_, Request>(&mut b, Duration::from_millis(20)).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        // Clean end of stream.
        let (a, mut b) = tokio::io::duplex(16);
        drop(a);
        assert!(read_frame::<_, Request>(&mut b, Duration::from_secs(1)).await.unwrap().is_none());
    }

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }
}

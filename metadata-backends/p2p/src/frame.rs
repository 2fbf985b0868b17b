//! Frames of Mooncake's handshake socket (reference `mooncake-wire.md` §4):
//!
//! ```text
//! u64 length (little-endian) — counts the type byte and the payload
//! u8  type: 0 Connection, 1 Metadata, 2 Notify, 3 Probe (a first byte > 3: old protocol, no type)
//! payload (JSON text)
//! ```

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Default largest accepted frame (type byte + payload).
pub const DEFAULT_MAX_FRAME: u64 = 1 << 20;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameType {
    /// RDMA endpoint exchange (not served by Ferry).
    Connection = 0,
    /// Segment descriptor exchange.
    Metadata = 1,
    /// A notification.
    Notify = 2,
    /// Liveness probe.
    Probe = 3,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its type (old-protocol frames count as `Metadata`).
    pub kind: FrameType,
    /// JSON payload.
    pub payload: Vec<u8>,
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Length zero.
    Empty,
    /// Length above the limit.
    TooLong(u64, u64),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Empty => f.write_str("zero-length handshake frame"),
            FrameError::TooLong(n, max) => write!(f, "handshake frame of {n} bytes exceeds the {max}-byte limit"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Encodes a frame.
pub fn encode(kind: FrameType, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&(payload.len() as u64 + 1).to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(payload);
    out
}

/// Decodes one frame from the start of `buf`. `Ok(None)`: more bytes are needed. On success
/// returns the frame and the bytes it used.
pub fn decode(buf: &[u8], max: u64) -> Result<Option<(Frame, usize)>, FrameError> {
    let Some(len) = buf.get(..8) else { return Ok(None) };
    let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    let total = check_len(len, max)?;
    let Some(body) = buf.get(8..total) else { return Ok(None) };
    Ok(Some((classify(body), total)))
}

/// Checks a frame's length against `max`; returns the frame's size with its 8 length bytes.
fn check_len(len: u64, max: u64) -> Result<usize, FrameError> {
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max {
        return Err(FrameError::TooLong(len, max));
    }
    // A limit near `u64::MAX` lets through lengths no buffer of this address space can hold.
    usize::try_from(len).ok().and_then(|n| n.checked_add(8)).ok_or(FrameError::TooLong(len, (usize::MAX - 8) as u64))
}

fn classify(body: &[u8]) -> Frame {
    let kind = match body[0] {
        0 => Some(FrameType::Connection),
        1 => Some(FrameType::Metadata),
        2 => Some(FrameType::Notify),
        3 => Some(FrameType::Probe),
        _ => None,
    };
    match kind {
        Some(kind) => Frame { kind, payload: body[1..].to_vec() },
        // Old protocol: no type byte, the whole body is a metadata payload.
        None => Frame { kind: FrameType::Metadata, payload: body.to_vec() },
    }
}

/// Reads one frame, within `limit` for the whole frame.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: u64, limit: Duration) -> std::io::Result<Frame> {
    let read = async {
        let mut len = [0u8; 8];
        r.read_exact(&mut len).await?;
        let len = u64::from_le_bytes(len);
        check_len(len, max).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        // Grow the buffer as bytes arrive: a client that announces 1 MiB and sends nothing costs
        // nothing.
        let mut body = Vec::new();
        r.take(len).read_to_end(&mut body).await?;
        if body.len() as u64 != len {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(classify(&body))
    };
    tokio::time::timeout(limit, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake frame not received in time"))?
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, kind: FrameType, payload: &[u8]) -> std::io::Result<()> {
    w.write_all(&encode(kind, payload)).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout() {
        let f = encode(FrameType::Notify, b"{}");
        assert_eq!(&f[..8], &3u64.to_le_bytes());
        assert_eq!(f[8], 2);
        let (frame, used) = decode(&f, DEFAULT_MAX_FRAME).unwrap().unwrap();
        assert_eq!((frame.kind, frame.payload.as_slice(), used), (FrameType::Notify, &b"{}"[..], 11));
        // Old protocol: JSON right after the length.
        let mut old = 2u64.to_le_bytes().to_vec();
        old.extend_from_slice(b"{}");
        assert_eq!(
            decode(&old, DEFAULT_MAX_FRAME).unwrap().unwrap().0,
            Frame { kind: FrameType::Metadata, payload: b"{}".to_vec() }
        );
        assert_eq!(decode(&0u64.to_le_bytes(), DEFAULT_MAX_FRAME), Err(FrameError::Empty));
        assert_eq!(
            decode(&u64::MAX.to_le_bytes(), DEFAULT_MAX_FRAME),
            Err(FrameError::TooLong(u64::MAX, DEFAULT_MAX_FRAME))
        );
        assert_eq!(decode(&f[..10], DEFAULT_MAX_FRAME), Ok(None));
    }

    proptest! {
        /// Arbitrary bytes decode to a frame, a request for more bytes, or a clear error; never
        /// a panic, and a decoded frame never claims more bytes than it was given.
        #[test]
        fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..64), max in 1u64..100) {
            match decode(&bytes, max) {
                Ok(Some((_, used))) => prop_assert!(used <= bytes.len()),
                Ok(None) => prop_assert!(bytes.len() < 8 || (bytes.len() as u64) < 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap())),
                Err(_) => prop_assert!(bytes.len() >= 8),
            }
        }

        #[test]
        fn round_trip(kind in 0u8..4, payload in prop::collection::vec(any::<u8>(), 0..200)) {
            let kind = [FrameType::Connection, FrameType::Metadata, FrameType::Notify, FrameType::Probe][kind as usize];
            let enc = encode(kind, &payload);
            let (f, used) = decode(&enc, DEFAULT_MAX_FRAME).unwrap().unwrap();
            prop_assert_eq!(used, enc.len());
            prop_assert_eq!(f, Frame { kind, payload });
        }
    }
}

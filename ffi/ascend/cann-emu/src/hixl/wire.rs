//! The emulated HIXL's protocol between engines, on the emulator's framing (`crate::wire`):
//!
//! - `HX_HELLO` (client name, mode) → `HX_HELLO_ACK` (status, message, the server's remotely
//!   accessible registrations `(address, length, type)`: the link's view, fixed at link time);
//! - `HX_XFER` (op, `(remote address, length)` pairs) → `HX_XFER_ACK` (status, message); for
//!   a read the bytes follow the answer, for a write the client then sends the bytes and the
//!   server answers `HX_XFER_DONE` (status);
//! - `HX_BYE` → `HX_BYE_ACK`.
//!
//! Nothing read from a socket is trusted: frames are bounded, lists are bounded and checked
//! against their frame, and the server checks every range against its registrations before a
//! byte moves.

use std::io;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::abi::TransferOpDesc;
use super::engine::{OP_READ, OP_WRITE, RemoteRegion};
use super::options::Mode;
use crate::codes::*;
use crate::wire::{Dec, Enc, MAX_FRAME, expect_frame, kind, recv_raw, send_raw, set_timeouts, write_frame};

/// At most this many descriptors in one batch frame (also bounded by the frame size).
pub(crate) const MAX_DESCS: usize = 60_000;
/// At most this many registrations in a hello answer.
pub(crate) const MAX_REGIONS: usize = 60_000;

/// Sets the socket timeouts to what is left before `deadline`; an error once it passed.
pub(crate) fn arm(s: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "the timeout passed"));
    }
    set_timeouts(s, Some(left))
}

/// The HIXL status of an I/O error on a link: a timeout is TIMEOUT (`ctrl_msg_plugin.cc`
/// l.250-263), anything else FAILED.
pub(crate) fn io_status(e: io::Error, what: &str) -> EmuError {
    if crate::wire::is_timeout(&e) {
        hixl_err(HIXL_TIMEOUT, format!("{what}: the peer did not answer in time ({e})"))
    } else {
        hixl_err(HIXL_FAILED, format!("{what}: {e}"))
    }
}

fn mode_byte(m: Mode) -> u8 {
    match m {
        Mode::Legacy => 0,
        Mode::ClientServer => 1,
    }
}

/// Decodes the mode byte of a hello.
pub(crate) fn mode_of(b: u8) -> Option<Mode> {
    match b {
        0 => Some(Mode::Legacy),
        1 => Some(Mode::ClientServer),
        _ => None,
    }
}

/// The hello exchange: `(status, message, regions)`.
pub(crate) fn client_hello(
    s: &mut TcpStream,
    name: &str,
    mode: Mode,
    deadline: Instant,
) -> io::Result<(u32, String, Vec<RemoteRegion>)> {
    arm(s, deadline)?;
    write_frame(s, kind::HX_HELLO, &Enc::new().str(name).u8(mode_byte(mode)).0)?;
    arm(s, deadline)?;
    let p = expect_frame(s, kind::HX_HELLO_ACK, MAX_FRAME)?;
    let mut d = Dec::new(&p);
    let status = d.u32()?;
    let message = d.str()?;
    if status != HIXL_SUCCESS {
        return Ok((status, message, Vec::new()));
    }
    let n = d.u32()? as usize;
    if n > MAX_REGIONS {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{n} regions is too many")));
    }
    let mut regions = Vec::with_capacity(n);
    for _ in 0..n {
        let (addr, len, mem_type) = (d.u64()?, d.u64()?, d.u8()?);
        if addr.checked_add(len).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a region wraps around"));
        }
        regions.push(RemoteRegion { addr, len, mem_type });
    }
    Ok((status, message, regions))
}

/// The server's hello answer.
pub(crate) fn hello_ack(status: u32, message: &str, regions: &[(u64, u64, u8)]) -> Vec<u8> {
    let mut e = Enc::new().u32(status).str(message);
    if status == HIXL_SUCCESS {
        e = e.u32(regions.len() as u32);
        for &(a, l, t) in regions {
            e = e.u64(a).u64(l).u8(t);
        }
    }
    e.0
}

/// Encodes a refusal or acceptance.
pub(crate) fn status_frame(status: u32, message: &str) -> Vec<u8> {
    Enc::new().u32(status).str(message).0
}

fn read_status(s: &mut TcpStream, kind: u16) -> io::Result<(u32, String)> {
    let p = expect_frame(s, kind, MAX_FRAME)?;
    let mut d = Dec::new(&p);
    Ok((d.u32()?, d.str()?))
}

/// Runs one checked batch: `Ok(Err(..))` when the server refused it (the link stays in step),
/// `Err` when the link broke or timed out.
pub(crate) fn client_transfer(
    s: &mut TcpStream,
    op: i32,
    descs: &[TransferOpDesc],
    deadline: Instant,
) -> io::Result<Result<(), (u32, String)>> {
    let mut e = Enc::new().u8(op as u8).u32(descs.len() as u32);
    for d in descs {
        e = e.u64(d.remote_addr as u64).u64(d.len as u64);
    }
    arm(s, deadline)?;
    write_frame(s, kind::HX_XFER, &e.0)?;
    arm(s, deadline)?;
    let (status, message) = read_status(s, kind::HX_XFER_ACK)?;
    if status != HIXL_SUCCESS {
        return Ok(Err((status, message)));
    }
    match op {
        OP_READ => {
            for d in descs {
                arm(s, deadline)?;
                // SAFETY: the caller checked `[local_addr, +len)` lies in a local registration
                // whose allocation it keeps alive for the call.
                unsafe { recv_raw(s, d.local_addr as *mut u8, d.len) }?;
            }
        }
        _ => {
            for d in descs {
                arm(s, deadline)?;
                // SAFETY: as above, for reading.
                unsafe { send_raw(s, d.local_addr as *const u8, d.len) }?;
            }
            arm(s, deadline)?;
            let (status, message) = read_status(s, kind::HX_XFER_DONE)?;
            if status != HIXL_SUCCESS {
                return Ok(Err((status, message)));
            }
        }
    }
    Ok(Ok(()))
}

/// Says goodbye on a link.
pub(crate) fn client_bye(s: &mut TcpStream, deadline: Instant) -> io::Result<()> {
    arm(s, deadline)?;
    write_frame(s, kind::HX_BYE, &[])?;
    arm(s, deadline)?;
    expect_frame(s, kind::HX_BYE_ACK, MAX_FRAME).map(|_| ())
}

/// A decoded batch request.
pub(crate) struct Batch {
    pub(crate) op: i32,
    pub(crate) ranges: Vec<(u64, u64)>,
}

/// Decodes an `HX_XFER` payload.
pub(crate) fn decode_batch(p: &[u8]) -> io::Result<Batch> {
    let mut d = Dec::new(p);
    let op = match d.u8()? {
        0 => OP_READ,
        1 => OP_WRITE,
        o => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown transfer op {o}"))),
    };
    let ranges = d.ranges(MAX_DESCS)?;
    Ok(Batch { op, ranges })
}

/// How long a server waits for a new connection's hello.
pub(crate) const HELLO_WAIT: Duration = Duration::from_secs(30);

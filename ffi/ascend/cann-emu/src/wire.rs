//! Framing on the emulator's TCP connections.
//!
//! A frame is a 16-byte header — magic `FEMU` (`0x554d4546` little-endian), `u16` version (1),
//! `u16` kind, `u32` payload length, `u32` reserved — followed by the payload. Integers are
//! little-endian; strings are a `u32` length and UTF-8 bytes. Bulk data (send/recv payloads,
//! one-sided transfers) travels raw after a frame that announced it, and is only read after its
//! length was checked against memory the reader owns.
//!
//! Nothing read from a socket is trusted: a frame longer than the reader's limit, a bad magic, a
//! truncated field or an unknown kind is an error, never an allocation or an access sized by the
//! peer.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x554d_4546;
const VERSION: u16 = 1;
const HEADER: usize = 16;
/// Default limit of a control frame's payload.
pub(crate) const MAX_FRAME: usize = 1 << 20;

/// Frame kinds.
#[cfg_attr(not(feature = "onesided"), allow(dead_code))]
pub(crate) mod kind {
    /// Root-info rendezvous: a rank announces itself.
    pub(crate) const RV_HELLO: u16 = 1;
    /// Root-info rendezvous: the endpoint table (or an error).
    pub(crate) const RV_TABLE: u16 = 2;
    /// First frame on a link or endpoint connection.
    pub(crate) const HELLO: u16 = 3;
    /// Answer to [`HELLO`].
    pub(crate) const HELLO_ACK: u16 = 4;
    /// Two-sided send header (raw bytes follow).
    pub(crate) const SEND: u16 = 5;
    /// One-sided: exchange bound memory, waiting until the peer prepares too.
    pub(crate) const PREPARE: u16 = 6;
    /// Answer to [`PREPARE`].
    pub(crate) const PREPARE_ACK: u16 = 7;
    // 8 and 9 were a re-query of the peer's memory after Prepare, which real HCCL does not do.
    /// One-sided: a batch of reads or writes.
    pub(crate) const BATCH: u16 = 10;
    /// Answer to [`BATCH`]: accepted (raw data follows for reads) or refused.
    pub(crate) const BATCH_ACK: u16 = 11;
    /// One-sided: all bytes of a write batch landed.
    pub(crate) const BATCH_DONE: u16 = 12;
    /// HIXL: a client asks an engine's server for a link (its name and mode).
    pub(crate) const HX_HELLO: u16 = 20;
    /// HIXL: the answer (a status, then the server's remotely accessible registrations).
    pub(crate) const HX_HELLO_ACK: u16 = 21;
    /// HIXL: a batch of reads or writes (op, then `(remote address, length)` pairs).
    pub(crate) const HX_XFER: u16 = 22;
    /// HIXL: the server accepts (read data follows) or refuses a batch.
    pub(crate) const HX_XFER_ACK: u16 = 23;
    /// HIXL: all bytes of a write batch landed.
    pub(crate) const HX_XFER_DONE: u16 = 24;
    /// HIXL: the client closes the link.
    pub(crate) const HX_BYE: u16 = 25;
    /// HIXL: answer to [`HX_BYE`].
    pub(crate) const HX_BYE_ACK: u16 = 26;
}

/// Purposes announced in [`kind::HELLO`].
#[cfg_attr(not(feature = "onesided"), allow(dead_code))]
pub(crate) mod purpose {
    /// A two-sided link of a root-info communicator.
    pub(crate) const ROOT_LINK: u8 = 1;
    /// A two-sided link of a rank-table communicator.
    pub(crate) const CLUSTER_LINK: u8 = 2;
    /// A one-sided service connection.
    pub(crate) const ONE_SIDED: u8 = 3;
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// Writes one frame.
pub(crate) fn write_frame(s: &mut TcpStream, kind: u16, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| invalid("frame payload too long"))?;
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&kind.to_le_bytes());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&0u32.to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)
}

/// Reads one frame whose payload is at most `max` bytes.
pub(crate) fn read_frame(s: &mut TcpStream, max: usize) -> io::Result<(u16, Vec<u8>)> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h)?;
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let version = u16::from_le_bytes([h[4], h[5]]);
    let kind = u16::from_le_bytes([h[6], h[7]]);
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if magic != MAGIC {
        return Err(invalid(format!("bad frame magic {magic:#x}: the peer does not speak the emulator's protocol")));
    }
    if version != VERSION {
        return Err(invalid(format!("unsupported protocol version {version}")));
    }
    if len > max {
        return Err(invalid(format!("frame of {len} bytes exceeds the limit of {max}")));
    }
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Ok((kind, payload))
}

/// Reads one frame and checks its kind.
pub(crate) fn expect_frame(s: &mut TcpStream, expected: u16, max: usize) -> io::Result<Vec<u8>> {
    let (kind, payload) = read_frame(s, max)?;
    if kind != expected {
        return Err(invalid(format!("expected frame kind {expected}, got {kind}")));
    }
    Ok(payload)
}

/// Builds a payload.
#[derive(Debug, Default)]
pub(crate) struct Enc(pub(crate) Vec<u8>);

impl Enc {
    pub(crate) fn new() -> Enc {
        Enc(Vec::new())
    }
    pub(crate) fn u8(mut self, v: u8) -> Enc {
        self.0.push(v);
        self
    }
    pub(crate) fn u32(mut self, v: u32) -> Enc {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Enc {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn str(self, v: &str) -> Enc {
        let mut e = self.u32(v.len() as u32);
        e.0.extend_from_slice(v.as_bytes());
        e
    }
    #[cfg_attr(not(feature = "onesided"), allow(dead_code))]
    pub(crate) fn ranges(self, ranges: &[(u64, u64)]) -> Enc {
        let mut e = self.u32(ranges.len() as u32);
        for &(a, l) in ranges {
            e = e.u64(a).u64(l);
        }
        e
    }
}

/// Reads a payload; every read is bounds-checked.
#[derive(Debug)]
pub(crate) struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Dec<'a> {
        Dec(b)
    }
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(invalid("truncated frame"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> io::Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> io::Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn str(&mut self) -> io::Result<String> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| invalid("string is not UTF-8"))
    }
    /// A list of `(address, length)` pairs of at most `max` entries.
    #[cfg_attr(not(feature = "onesided"), allow(dead_code))]
    pub(crate) fn ranges(&mut self, max: usize) -> io::Result<Vec<(u64, u64)>> {
        let n = self.u32()? as usize;
        if n > max || n.saturating_mul(16) > self.0.len() {
            return Err(invalid(format!("range list of {n} entries is too long or truncated")));
        }
        (0..n).map(|_| Ok((self.u64()?, self.u64()?))).collect()
    }
}

/// Sends `len` raw bytes from `ptr`.
///
/// # Safety
/// `ptr` is valid for reads of `len` bytes for the duration of the call.
pub(crate) unsafe fn send_raw(s: &TcpStream, ptr: *const u8, len: usize) -> io::Result<()> {
    let fd = s.as_raw_fd();
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(1 << 30);
        // SAFETY: `ptr + done .. + chunk` is inside the caller's readable range; `fd` is a
        // connected socket owned by `s`, alive for the call.
        let n = unsafe { libc::send(fd, ptr.add(done).cast(), chunk, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "peer closed the connection"));
        }
        done += n as usize;
    }
    Ok(())
}

/// Receives exactly `len` raw bytes into `ptr`.
///
/// # Safety
/// `ptr` is valid for writes of `len` bytes for the duration of the call.
pub(crate) unsafe fn recv_raw(s: &TcpStream, ptr: *mut u8, len: usize) -> io::Result<()> {
    let fd = s.as_raw_fd();
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(1 << 30);
        // SAFETY: `ptr + done .. + chunk` is inside the caller's writable range; `fd` is a
        // connected socket owned by `s`, alive for the call.
        let n = unsafe { libc::recv(fd, ptr.add(done).cast(), chunk, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"));
        }
        done += n as usize;
    }
    Ok(())
}

/// Connects to `addr`, retrying refused connections until `deadline`.
pub(crate) fn connect_until(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let mut pause = Duration::from_millis(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("{addr} did not accept a connection in time")));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(_) => {
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// Sets both socket timeouts (`None` = block forever).
pub(crate) fn set_timeouts(s: &TcpStream, t: Option<Duration>) -> io::Result<()> {
    let t = t.map(|t| t.max(Duration::from_millis(1)));
    s.set_read_timeout(t)?;
    s.set_write_timeout(t)
}

/// Whether an I/O error is a timeout.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Waits until `fd` is readable or `timeout` passed; true when readable.
pub(crate) fn poll_readable(fd: &impl AsRawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `p` is one valid pollfd on our stack; the fd stays open during the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn frames_round_trip_and_limits_hold() {
        let (mut a, mut b) = pair();
        let payload = Enc::new().u8(3).u32(7).u64(u64::MAX).str("héllo").ranges(&[(1, 2), (3, 4)]).0;
        write_frame(&mut a, kind::HELLO, &payload).unwrap();
        let (k, p) = read_frame(&mut b, MAX_FRAME).unwrap();
        assert_eq!(k, kind::HELLO);
        let mut d = Dec::new(&p);
        assert_eq!((d.u8().unwrap(), d.u32().unwrap(), d.u64().unwrap()), (3, 7, u64::MAX));
        assert_eq!(d.str().unwrap(), "héllo");
        assert_eq!(d.ranges(10).unwrap(), vec![(1, 2), (3, 4)]);
        assert!(d.u8().is_err(), "reading past the end is an error");

        write_frame(&mut a, kind::HELLO, &[0u8; 100]).unwrap();
        assert_eq!(read_frame(&mut b, 99).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_forged_header_is_refused_without_allocating() {
        let (mut a, mut b) = pair();
        let mut h = Vec::new();
        h.extend_from_slice(&MAGIC.to_le_bytes());
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&kind::SEND.to_le_bytes());
        h.extend_from_slice(&u32::MAX.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        a.write_all(&h).unwrap();
        assert!(read_frame(&mut b, MAX_FRAME).unwrap_err().to_string().contains("exceeds the limit"));
        a.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert!(read_frame(&mut b, MAX_FRAME).unwrap_err().to_string().contains("bad frame magic"));
        let huge = Enc::new().u32(u32::MAX).0;
        assert!(Dec::new(&huge).ranges(256).is_err());
        assert!(Dec::new(&huge).str().is_err());
    }

    #[test]
    fn raw_bytes_cross_intact() {
        let (a, b) = pair();
        let src: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let sender = {
            let src = src.clone();
            // SAFETY: `src` lives in the thread for the whole call.
            std::thread::spawn(move || unsafe { send_raw(&a, src.as_ptr(), src.len()) })
        };
        // SAFETY: `dst` is a live, writable buffer of the given length.
        unsafe { recv_raw(&b, dst.as_mut_ptr(), dst.len()) }.unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!(src, dst);
    }
}

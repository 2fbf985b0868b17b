//! Socket helpers shared by both sides: a write of several buffers in as few system calls as
//! the kernel allows, and a small input buffer so pipelined headers are parsed without a system
//! call each.

use std::io::IoSlice;

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

/// How long [`InBuf::poll_fill`] polls without yielding: about the time a peer that sends one
/// request at a time takes to send the next after an answer reached it.
pub(crate) const TIGHT_POLL: std::time::Duration = std::time::Duration::from_micros(15);

/// Bytes read from a socket but not consumed yet.
pub(crate) struct InBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The most bytes one fill reads.
    fill_limit: usize,
}

impl InBuf {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { buf: vec![0; capacity].into_boxed_slice(), start: 0, end: 0, fill_limit: capacity }
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
    pub(crate) async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> std::io::Result<usize> {
        let n = r.read(self.space()).await?;
        self.end += n;
        Ok(n)
    }

    /// Reads what `stream` has already received, without waiting: `Ok(0)` at end of stream,
    /// `WouldBlock` when nothing is there.
    pub(crate) fn try_fill(&mut self, stream: &tokio::net::TcpStream) -> std::io::Result<usize> {
        let n = stream.try_read(self.space())?;
        self.end += n;
        Ok(n)
    }

    /// Polls `stream` for bytes until `until`, without sleeping: reads straight from the socket
    /// (tokio's readiness, which only its driver sets, would say nothing has come): tightly for
    /// [`TIGHT_POLL`], then yielding to the runtime's other tasks between attempts. `Ok(0)` at
    /// end of stream, `WouldBlock` when nothing came in time.
    pub(crate) async fn poll_fill(
        &mut self,
        stream: &tokio::net::TcpStream,
        until: std::time::Instant,
    ) -> std::io::Result<usize> {
        use std::io::Read;
        let socket = socket2::SockRef::from(stream);
        // A peer that asks one request at a time asks the next within microseconds: poll
        // tightly that long, then let the runtime's other tasks run between attempts.
        let tight_until = (std::time::Instant::now() + TIGHT_POLL).min(until);
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
            stream.read_exact(&mut dst[at..]).await?;
        }
        Ok(true)
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
    pub(crate) async fn read_exact<R: AsyncRead + Unpin>(&mut self, r: &mut R, dst: &mut [u8]) -> std::io::Result<()> {
        let n = self.len().min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if n < dst.len() {
            r.read_exact(&mut dst[n..]).await?;
        }
        Ok(())
    }

    /// Discards `count` bytes, buffered first, then read through the buffer.
    pub(crate) async fn skip<R: AsyncRead + Unpin>(&mut self, r: &mut R, mut count: u64) -> std::io::Result<()> {
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
        let (mut a, b) = pair().await;
        let mut input = InBuf::new(64);
        let started = Instant::now();
        let e = input.poll_fill(&b, Instant::now() + Duration::from_millis(5)).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        assert!(started.elapsed() >= Duration::from_millis(5));
        a.write_all(b"hello").await.unwrap();
        let n = input.poll_fill(&b, Instant::now() + Duration::from_secs(5)).await.unwrap();
        assert!((1..=5).contains(&n));
        drop(a);
        let mut got = input.take::<1>().unwrap().to_vec();
        while got.len() < 5 {
            if input.len() == 0 {
                input.poll_fill(&b, Instant::now() + Duration::from_secs(5)).await.unwrap();
            }
            got.push(input.take::<1>().unwrap()[0]);
        }
        assert_eq!(got, b"hello");
        assert_eq!(input.poll_fill(&b, Instant::now() + Duration::from_secs(5)).await.unwrap(), 0, "end of stream");
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
}

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

/// Bytes read from a socket but not consumed yet.
pub(crate) struct InBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl InBuf {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { buf: vec![0; capacity].into_boxed_slice(), start: 0, end: 0 }
    }

    /// Buffered bytes.
    pub(crate) fn len(&self) -> usize {
        self.end - self.start
    }

    /// Reads once more from `r` (at least one byte unless end of stream). Returns the bytes read.
    pub(crate) async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> std::io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = r.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n)
    }

    /// Reads what `stream` has already received, without waiting: `Ok(0)` at end of stream,
    /// `WouldBlock` when nothing is there.
    pub(crate) fn try_fill(&mut self, stream: &tokio::net::TcpStream) -> std::io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = stream.try_read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }

    /// Takes `N` bytes if buffered.
    pub(crate) fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        if self.len() < N {
            return None;
        }
        let out: [u8; N] = self.buf[self.start..self.start + N].try_into().expect("length checked");
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

//! An opened segment: a peer's descriptor as this engine last read it, the transport chosen to
//! reach it, and the remote bounds check.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::batch::SegmentHandle;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, Result};
use crate::transport::{PeerHandle, Transport};

/// A segment this engine has opened. Immutable once built; a refresh replaces it (same handle).
pub struct OpenSegment {
    handle: SegmentHandle,
    descriptor: SegmentDescriptor,
    /// Buffers as sorted, non-wrapping `(start, end)` pairs for binary search.
    ranges: Vec<(u64, u64)>,
    transport: Arc<dyn Transport>,
    /// What the transport opened for this descriptor, or why it could not.
    peer: std::result::Result<PeerHandle, Error>,
    stale: AtomicBool,
}

impl std::fmt::Debug for OpenSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenSegment")
            .field("handle", &self.handle)
            .field("name", &self.descriptor.name)
            .field("transport", &self.transport.protocol())
            .field("buffers", &self.ranges.len())
            .finish()
    }
}

impl OpenSegment {
    /// Wraps a (validated) descriptor, the transport that reaches it and what the transport
    /// opened for it ([`Transport::open`]).
    pub fn new(
        handle: SegmentHandle,
        descriptor: SegmentDescriptor,
        transport: Arc<dyn Transport>,
        peer: std::result::Result<PeerHandle, Error>,
    ) -> Self {
        let mut ranges: Vec<(u64, u64)> = descriptor
            .buffers
            .iter()
            .filter(|b| b.length > 0)
            .map(|b| (b.addr, b.addr.saturating_add(b.length)))
            .collect();
        ranges.sort_unstable();
        Self { handle, descriptor, ranges, transport, peer, stale: AtomicBool::new(false) }
    }

    /// The handle callers use.
    pub fn handle(&self) -> SegmentHandle {
        self.handle
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.descriptor.name
    }

    /// The descriptor as last fetched.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// The transport that serves this segment (the engine's; not handed out: its methods may
    /// register memory the engine no longer vouches for).
    pub(crate) fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// The protocol of the transport that serves this segment.
    pub fn protocol(&self) -> &str {
        self.transport.protocol()
    }

    /// What the serving transport opened for this descriptor, as its own type `T`: the error
    /// `open` returned, or an internal error when the transport kept something else.
    pub fn peer<T: std::any::Any + Send + Sync>(&self) -> Result<&T> {
        match &self.peer {
            Ok(p) => p.downcast_ref::<T>().ok_or_else(|| {
                Error::new(
                    crate::ErrorKind::Internal,
                    format!("segment `{}`: the transport's peer state has another type", self.descriptor.name),
                )
            }),
            Err(e) => Err(e.duplicate()),
        }
    }

    /// Marks the cached descriptor as suspect (its peer failed); the next use refreshes it.
    pub fn mark_stale(&self) {
        self.stale.store(true, Ordering::Release);
    }

    /// True after [`mark_stale`](Self::mark_stale).
    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Acquire)
    }

    /// Checks that `[addr, addr + len)` lies inside one published buffer. Buffers may overlap in
    /// a descriptor from a misbehaving peer; any containing buffer is accepted.
    pub fn check_remote(&self, addr: u64, len: u64) -> Result<()> {
        let end = crate::memory::checked_range(addr, len)?;
        // Last buffer starting at or before addr; because buffers may overlap, scan back while
        // a candidate could still contain the range (descriptors are small).
        let idx = self.ranges.partition_point(|&(start, _)| start <= addr);
        if self.ranges[..idx].iter().rev().any(|&(_, e)| e >= end) {
            return Ok(());
        }
        Err(Error::out_of_bounds(format!(
            "remote range {addr:#x}+{len} is not inside any buffer segment `{}` publishes ({} buffer(s))",
            self.descriptor.name,
            self.ranges.len()
        )))
    }
}

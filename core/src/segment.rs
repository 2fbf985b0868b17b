//! An opened segment: its handle, a peer's descriptor as this engine last read it, what the
//! serving transport opened for it, and the remote bounds check. The engine keeps the serving
//! transport beside it; transports receive it as the target of a submission.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, Result};

/// Handle of an opened segment (see `TransferEngine::open_segment`). Stable for the engine's
/// lifetime, across descriptor refreshes.
///
/// Not made from an integer: handles come from `open_segment` (or [`fresh`](Self::fresh), for
/// a host of its own segments), each unique in the process, so one engine's handle is never
/// another's. Bindings that pass integers (C, Python) turn them back with
/// `TransferEngine::segment_handle`, which checks that the segment is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentHandle(u64);

impl SegmentHandle {
    /// A new handle, unique in this process (never 0).
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// Its number, for bindings that pass handles as integers.
    pub fn raw(self) -> u64 {
        self.0
    }

    /// The handle numbered `raw`, for the engine's checked lookup (never handed out unchecked).
    pub(crate) fn from_raw(raw: u64) -> Self {
        Self(raw)
    }
}

/// What a transport keeps for one opened peer segment ([`Transport::open`](crate::Transport::open)); the transport
/// downcasts it back with [`OpenSegment::peer`].
pub type PeerHandle = Arc<dyn std::any::Any + Send + Sync>;

/// A segment this engine has opened. Immutable once built; a refresh replaces it (same handle).
pub struct OpenSegment {
    handle: SegmentHandle,
    descriptor: SegmentDescriptor,
    /// Buffers as sorted, non-wrapping `(start, end)` pairs for binary search.
    ranges: Vec<(u64, u64)>,
    /// The protocol of the transport that serves it.
    protocol: String,
    /// What the transport opened for this descriptor, or why it could not.
    peer: std::result::Result<PeerHandle, Error>,
    stale: AtomicBool,
    /// The engine's counters for this peer and transport (none for segments built outside an
    /// engine).
    metrics: Option<Arc<crate::metrics::RouteMetrics>>,
}

impl std::fmt::Debug for OpenSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenSegment")
            .field("handle", &self.handle)
            .field("name", &self.descriptor.name)
            .field("protocol", &self.protocol)
            .field("buffers", &self.ranges.len())
            .finish()
    }
}

impl OpenSegment {
    /// Wraps a (validated) descriptor, the protocol of the transport that reaches it and what
    /// that transport opened for it ([`Transport::open`](crate::Transport::open)).
    pub fn new(
        handle: SegmentHandle,
        descriptor: SegmentDescriptor,
        protocol: impl Into<String>,
        peer: std::result::Result<PeerHandle, Error>,
    ) -> Self {
        let mut ranges: Vec<(u64, u64)> = descriptor
            .buffers
            .iter()
            .filter(|b| b.length > 0)
            .map(|b| (b.addr, b.addr.saturating_add(b.length)))
            .collect();
        ranges.sort_unstable();
        Self {
            handle,
            descriptor,
            ranges,
            protocol: protocol.into(),
            peer,
            stale: AtomicBool::new(false),
            metrics: None,
        }
    }

    /// The same segment, counting its requests into `metrics` (the engine's, per route).
    pub(crate) fn with_metrics(mut self, metrics: Arc<crate::metrics::RouteMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The engine's counters of this route, when an engine opened it.
    pub(crate) fn metrics(&self) -> Option<&Arc<crate::metrics::RouteMetrics>> {
        self.metrics.as_ref()
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

    /// The protocol of the transport that serves this segment.
    pub fn protocol(&self) -> &str {
        &self.protocol
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

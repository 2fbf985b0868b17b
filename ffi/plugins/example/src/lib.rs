//! # ferry-transport-example
//!
//! The example transport plugin, protocol `example`: it moves bytes by memcpy between engines
//! of one process. Small, but a real transport, and the model for writing one: it keeps a
//! directory of its live instances by segment name, publishes its instance id in the segment
//! descriptor (`example_instance`), checks every remote range against the target instance's
//! *live* memory registry (not only the published descriptor), and reports one outcome per
//! request through [`Batch::complete`].
//!
//! Built as a `cdylib` it is `libferry_transport_example.so`, loaded by Ferry's plugin host
//! when a config says `"protocol": "example"` (see `docs/plugins.md`); built as an `rlib`,
//! [`ExampleTransportFactory`] can be installed in a `TransportRegistry` like any built-in
//! transport, so the same transport can be measured both ways.
//!
//! Only host memory is moved; device regions are refused with `Unsupported`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use async_trait::async_trait;
use ferry_core::{
    Batch, Capabilities, Error, ErrorKind, MemoryRegistry, Opcode, OpenSegment, Result, SegmentDescriptor, Transport,
    TransportContext, TransportFactory,
};

/// Protocol name.
pub const PROTOCOL: &str = "example";

/// Descriptor field holding the publishing instance's id: a descriptor left over from an
/// earlier instance with the same segment name is recognised as stale.
pub const INSTANCE_FIELD: &str = "example_instance";

ferry_plugin::declare_plugin!(protocol = "example", factory = ExampleTransportFactory);

/// A live instance, as the directory knows it.
struct Live {
    instance: String,
    memory: Weak<MemoryRegistry>,
}

/// Live instances of this library by segment name.
fn directory() -> &'static Mutex<HashMap<String, Live>> {
    static DIR: OnceLock<Mutex<HashMap<String, Live>>> = OnceLock::new();
    DIR.get_or_init(Default::default)
}

/// The live registry of the instance that serves `desc`, or why there is none.
fn peer_memory(desc: &SegmentDescriptor) -> Result<Arc<MemoryRegistry>> {
    let dir = directory().lock().unwrap_or_else(|p| p.into_inner());
    let gone = || {
        Error::unreachable(format!(
            "no `example` instance serves segment `{}` in this process any more (it shut down, or runs elsewhere)",
            desc.name
        ))
    };
    let live = dir.get(&desc.name).ok_or_else(gone)?;
    if let Some(published) = desc.extra.get(INSTANCE_FIELD).and_then(|v| v.as_str())
        && published != live.instance
    {
        return Err(Error::unreachable(format!(
            "segment `{}` was restarted: the descriptor names instance {published}, the live one is {}",
            desc.name, live.instance
        )));
    }
    live.memory.upgrade().ok_or_else(gone)
}

/// Factory of the `example` transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExampleTransportFactory;

#[async_trait]
impl TransportFactory for ExampleTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        let mut dir = directory().lock().unwrap_or_else(|p| p.into_inner());
        dir.retain(|_, live| live.memory.strong_count() > 0);
        if let Some(live) = dir.get(&ctx.segment_name) {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "segment `{}` is already served by `example` instance {} in this process",
                    ctx.segment_name, live.instance
                ),
            ));
        }
        dir.insert(
            ctx.segment_name.clone(),
            Live { instance: ctx.instance.clone(), memory: Arc::downgrade(&ctx.memory) },
        );
        tracing::debug!(segment = %ctx.segment_name, instance = %ctx.instance, "example transport created");
        Ok(Arc::new(ExampleTransport { segment: ctx.segment_name.clone(), instance: ctx.instance.clone() }))
    }
}

/// The `example` transport of one engine.
#[derive(Debug)]
pub struct ExampleTransport {
    segment: String,
    instance: String,
}

impl ExampleTransport {
    /// Leaves the directory (if the entry is still this instance's).
    fn leave(&self) {
        let mut dir = directory().lock().unwrap_or_else(|p| p.into_inner());
        if dir.get(&self.segment).is_some_and(|live| live.instance == self.instance) {
            dir.remove(&self.segment);
        }
    }

    /// Moves request `i` of `batch` between local memory and `peer`'s.
    fn run(peer: &MemoryRegistry, target: &OpenSegment, batch: &Batch, i: usize) -> Result<()> {
        let v = batch.request(i);
        let r = &v.request;
        // The remote range must be registered *now* by the target instance; the lease keeps it
        // registered until the copy is done.
        let remote = peer.lease(r.target_offset, r.length).map_err(|e| {
            let kind = if e.kind() == ErrorKind::Shutdown { ErrorKind::PeerUnreachable } else { e.kind() };
            Error::new(kind, format!("segment `{}`: {}", target.name(), e.message()))
        })?;
        if v.local.location().is_device() || remote.location().is_device() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the example transport moves host memory only (local region is {}, remote region is {})",
                    v.local.location(),
                    remote.location()
                ),
            ));
        }
        let (src, dst) = match r.opcode {
            Opcode::Read => (r.target_offset, r.source),
            Opcode::Write => (r.source, r.target_offset),
        };
        let len = usize::try_from(r.length).map_err(|_| Error::invalid("length exceeds the address space"))?;
        // SAFETY: `src..src+len` and `dst..dst+len` each lie inside host memory registered by
        // its owner: the local range was checked at submit and is held by the batch's lease;
        // the remote range was just checked against the target instance's live registry and
        // is held by `remote`. Registration is the owner's promise that the range stays valid
        // memory until it is unregistered, which neither lease allows before this copy ends.
        // `ptr::copy` is a memmove, so overlapping ranges (a copy within one segment) work.
        unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len) };
        drop(remote);
        Ok(())
    }
}

impl Drop for ExampleTransport {
    fn drop(&mut self) {
        self.leave();
    }
}

#[async_trait]
impl Transport for ExampleTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        ferry_plugin::DEFAULT_CAPABILITIES
    }

    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        descriptor.extra.insert(INSTANCE_FIELD.to_owned(), self.instance.clone().into());
    }

    /// Copies inline: a memcpy transport finishes its requests before `submit` returns.
    fn submit(&self, target: &Arc<OpenSegment>, batch: &Arc<Batch>, indices: &[u32]) -> Result<()> {
        let peer = peer_memory(target.descriptor());
        for &i in indices {
            let i = i as usize;
            let outcome = if batch.is_cancelled() {
                Err(Error::new(ErrorKind::Cancelled, "cancelled before it started"))
            } else {
                match &peer {
                    Ok(peer) => Self::run(peer, target, batch, i),
                    Err(e) => Err(e.duplicate()),
                }
            };
            batch.complete(i, outcome);
        }
        Ok(())
    }

    async fn shutdown(&self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests;

//! # ferry-transport-example
//!
//! The example transport plugin, protocol `example`: it moves bytes by memcpy between engines
//! of one process. Small, but a real transport, and the model for writing one: it keeps a
//! directory of its live instances by segment name, publishes its instance id in the segment
//! descriptor (`example_instance`), checks every remote range against the target instance's
//! *live* memory registry (not only the published descriptor), and reports one outcome per
//! request through [`Submission::complete`](ferry_core::Submission::complete).
//!
//! Built as a `cdylib` it is `libferry_transport_example.so`, loaded by Ferry's plugin host
//! when a config says `"protocol": "example"` (see `docs/plugins.md`); built as an `rlib`,
//! [`ExampleTransportFactory`] can be installed in a `TransportRegistry` like any built-in
//! transport, so the same transport can be measured both ways.
//!
//! Only host memory is moved; device regions are refused with `Unsupported`.
//!
//! It counts the requests it is given ([`ferry_transport_example_requests`], exported for
//! `dlsym`), so a test can tell that a transfer went through the plugin and not through the
//! engine's same-process `local` transport (see `local_transport` in docs/configuration.md).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use async_trait::async_trait;
use ferry_core::{
    Capabilities, Error, ErrorKind, MemoryRegistry, OpenSegment, Result, SegmentDescriptor, Submission, Transport,
    TransportContext, TransportFactory,
};

/// Protocol name.
pub const PROTOCOL: &str = "example";

/// Descriptor field holding the publishing instance's id: a descriptor left over from an
/// earlier instance with the same segment name is recognised as stale.
pub const INSTANCE_FIELD: &str = "example_instance";

ferry_plugin::declare_plugin!(protocol = "example", factory = ExampleTransportFactory);

/// Requests given to the `example` transports of this copy of the library.
static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// Requests the `example` transports of this copy of the library were given to submit since it
/// was loaded (each once, whatever its outcome). Exported unmangled: a host that loaded the
/// plugin reads it with `dlsym(handle, "ferry_transport_example_requests")`, to see that the
/// plugin carried a transfer rather than the engine's same-process `local` transport.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_transport_example_requests() -> u64 {
    REQUESTS.load(Ordering::Relaxed)
}

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
    fn submit(&self, target: &Arc<OpenSegment>, mut submission: Submission) {
        let peer = peer_memory(target.descriptor());
        REQUESTS.fetch_add(submission.indices().len() as u64, Ordering::Relaxed);
        for i in submission.indices().to_vec() {
            let outcome = if submission.is_cancelled() {
                Err(Error::new(ErrorKind::Cancelled, "cancelled before it started"))
            } else {
                match &peer {
                    // The same-process copy of the `local` transport; a peer that shut down
                    // is a peer gone.
                    Ok(peer) => {
                        ferry_transport_local::copy_request(peer, target, &submission, i, PROTOCOL).map_err(|e| {
                            if e.kind() == ErrorKind::Shutdown {
                                Error::new(ErrorKind::PeerUnreachable, e.message())
                            } else {
                                e
                            }
                        })
                    }
                    Err(e) => Err(e.duplicate()),
                }
            };
            submission.complete(i, outcome);
        }
    }

    async fn shutdown(&self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests;

//! # ferry-transport-local
//!
//! The `local` transport: moves bytes by memcpy between engines that live in the same process,
//! and from an engine to its own segment. Mooncake's TCP path sends such transfers through a
//! socket; Ferry takes this shortcut instead.
//!
//! It is installed as a *companion*: beside whatever protocol an engine is configured with, it
//! is tried first and serves every segment whose publisher is a live engine of this process
//! (recognised by the `ferry_instance` field of its descriptor). Bounds are checked twice: by
//! the engine against the published descriptor, and here against the target engine's live
//! memory registry, so memory that was unregistered after publication is never touched.
//! Only host memory is moved; device regions are refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use async_trait::async_trait;
use ferry_core::{
    Capabilities, Error, ErrorKind, MemoryRegistry, Opcode, OpenSegment, Result, SegmentDescriptor, Submission,
    Transport, TransportContext, TransportFactory,
};

/// Protocol name.
pub const PROTOCOL: &str = "local";

struct LiveEngine {
    segment: String,
    memory: Weak<MemoryRegistry>,
}

/// Engines of this process by instance id.
fn directory() -> &'static Mutex<HashMap<String, LiveEngine>> {
    static DIR: OnceLock<Mutex<HashMap<String, LiveEngine>>> = OnceLock::new();
    DIR.get_or_init(Default::default)
}

/// The live registry of the engine that published `desc`. The descriptor's claimed instance
/// must belong to an engine of this process *with that segment name*: a descriptor that names
/// another engine's instance is not trusted.
fn live_memory(desc: &SegmentDescriptor) -> Option<Arc<MemoryRegistry>> {
    let instance = desc.ferry_instance.as_deref()?;
    let dir = directory().lock().unwrap_or_else(|p| p.into_inner());
    dir.get(instance).filter(|e| e.segment == desc.name).and_then(|e| e.memory.upgrade())
}

/// Factory for the `local` transport (a companion: installed beside any configured protocol).
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalTransportFactory;

#[async_trait]
impl TransportFactory for LocalTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    fn companion(&self) -> bool {
        true
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        let mut dir = directory().lock().unwrap_or_else(|p| p.into_inner());
        dir.retain(|_, e| e.memory.strong_count() > 0);
        dir.insert(
            ctx.instance.clone(),
            LiveEngine { segment: ctx.segment_name.clone(), memory: Arc::downgrade(&ctx.memory) },
        );
        Ok(Arc::new(LocalTransport { instance: ctx.instance.clone() }))
    }
}

/// The `local` transport of one engine.
#[derive(Debug)]
pub struct LocalTransport {
    instance: String,
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        directory().lock().unwrap_or_else(|p| p.into_inner()).remove(&self.instance);
    }
}

/// Copies request `i` of `batch` between this process's registered memory and that of another
/// engine in this process, whose live registry is `owner` (the same-process data path, shared
/// with the example plugin). The remote range is leased from `owner` for the copy, so it cannot
/// be unregistered meanwhile; `transport` names the caller in errors.
///
/// Errors: the lease's error (`OutOfBounds`, `Shutdown` when the owner shut down, ...) with the
/// segment's name; [`ErrorKind::Unsupported`] for device memory.
pub fn copy_request(
    owner: &MemoryRegistry,
    seg: &OpenSegment,
    submission: &Submission,
    i: u32,
    transport: &str,
) -> Result<()> {
    // Only a request not released yet has its local memory leased.
    if !submission.is_leased(i) {
        return Err(Error::new(ErrorKind::Internal, format!("request {i} was released already")));
    }
    let v = submission.request(i);
    let r = &v.request;
    // The remote range must be registered *now* in the owner's registry; the lease keeps it
    // registered until the copy is done.
    let remote = owner
        .lease(r.target_offset, r.length)
        .map_err(|e| Error::new(e.kind(), format!("segment `{}`: {}", seg.name(), e.message())))?;
    if v.local.location().is_device() || remote.location().is_device() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the {transport} transport moves host memory only (local region is {}, remote region is {})",
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
    // SAFETY: `src..src+len` and `dst..dst+len` each lie inside a region registered by its
    // owner (the local range was checked by the engine at submit and is held by the request's
    // lease; the remote range was just checked against the owner's live registry and is held
    // by `remote`). Registering memory is the owner's promise that the range is valid,
    // host-addressable memory until it is unregistered, and neither lease allows that to
    // happen before this copy ends. `ptr::copy` is a memmove, so overlapping ranges (a
    // transfer within one segment) are handled.
    unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len) };
    drop(remote);
    Ok(())
}

#[async_trait]
impl Transport for LocalTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read: true,
            write: true,
            notifications: false,
            host_memory: true,
            device_memory: false,
            cross_process: false,
        }
    }

    fn serves(&self, target: &SegmentDescriptor) -> bool {
        live_memory(target).is_some()
    }

    /// Copies inline: a memcpy transport finishes its requests before `submit` returns.
    fn submit(&self, target: &Arc<OpenSegment>, mut submission: Submission) {
        let Some(owner) = live_memory(target.descriptor()) else {
            submission.fail_all(&Error::unreachable(format!(
                "the engine that published segment `{}` is no longer running in this process",
                target.name()
            )));
            return;
        };
        for i in submission.indices().to_vec() {
            let outcome = if submission.is_cancelled() {
                Err(Error::new(ErrorKind::Cancelled, "cancelled before the copy"))
            } else {
                copy_request(&owner, target, &submission, i, PROTOCOL)
            };
            submission.complete(i, outcome);
        }
    }

    async fn shutdown(&self) {
        directory().lock().unwrap_or_else(|p| p.into_inner()).remove(&self.instance);
    }
}

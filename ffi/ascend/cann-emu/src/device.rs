//! Devices, contexts and the per-thread current context.
//!
//! As in CANN, device state is per thread: a thread has a *current context*, set by
//! `aclrtSetDevice(user_id)` (the device's default context) or `aclrtSetCurrentContext`
//! (`aclrtCreateContext` also makes the new context current). A thread that did neither has no
//! device: `aclrtGetDevice`, `aclrtMalloc`, `aclrtCreateStream` and the HCCL calls that need a
//! device fail there (`ACL_ERROR_RT_CONTEXT_NULL` / `HCCL_E_RUNTIME`).
//!
//! `aclrtSetDevice` counts references per device and process; when `aclrtResetDevice` brings
//! the count to zero the default context and the streams created in it are destroyed.
//! Device ids at this API are *user* ids (see `config` for the `ASCEND_RT_VISIBLE_DEVICES`
//! mapping); [`physical_id`] maps one to its physical id.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use crate::boundary::lock;
use crate::codes::*;
use crate::config::config;
use crate::handles::{self, Kind};
use crate::stream::{self, Stream};

/// An ACL context: a device plus the streams created in it.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) handle: u64,
    pub(crate) user_id: u32,
    pub(crate) physical_id: u32,
    pub(crate) is_default: bool,
    alive: AtomicBool,
    default_stream: Mutex<Option<Arc<Stream>>>,
}

impl Context {
    fn new(user_id: u32, physical_id: u32, is_default: bool) -> Arc<Context> {
        Arc::new(Context {
            handle: handles::new_handle(Kind::Context),
            user_id,
            physical_id,
            is_default,
            alive: AtomicBool::new(true),
            default_stream: Mutex::new(None),
        })
    }

    /// Whether the context was not destroyed (by `aclrtResetDevice` or `aclrtDestroyContext`).
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// The context's default stream (what a NULL `aclrtStream` means), created at first use.
    pub(crate) fn default_stream(&self) -> EmuResult<Arc<Stream>> {
        let mut slot = lock(&self.default_stream);
        if let Some(s) = slot.as_ref() {
            return Ok(Arc::clone(s));
        }
        let s = Stream::spawn(self.user_id, self.handle, false)?;
        *slot = Some(Arc::clone(&s));
        Ok(s)
    }

    fn kill(&self) {
        self.alive.store(false, Ordering::Release);
        if let Some(s) = lock(&self.default_stream).take() {
            s.shutdown();
        }
        stream::destroy_streams_of_context(self.handle);
    }
}

#[derive(Debug, Default)]
struct DeviceSlot {
    refcount: u64,
    default_ctx: Option<Arc<Context>>,
}

#[derive(Debug, Default)]
struct Registry {
    devices: HashMap<u32, DeviceSlot>,
    contexts: HashMap<u64, Arc<Context>>,
    initialized: bool,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);

thread_local! {
    static CURRENT: RefCell<Option<Arc<Context>>> = const { RefCell::new(None) };
}

/// Physical id of a user id (`ACL_ERROR_RT_INVALID_DEVICEID` when out of range).
pub(crate) fn physical_id(user_id: i32) -> EmuResult<u32> {
    let visible = &config().visible;
    usize::try_from(user_id).ok().and_then(|u| visible.get(u).copied()).ok_or_else(|| {
        err(
            ACL_ERROR_RT_INVALID_DEVICEID,
            format!(
                "invalid device id {user_id}: this process sees {} of the {} emulated device(s) (user ids 0..{}){}{}",
                visible.len(),
                config().physical_devices,
                visible.len(),
                match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
                    Ok(v) => format!(", ASCEND_RT_VISIBLE_DEVICES={v:?}"),
                    Err(_) => String::new(),
                },
                if config().mounted.len() as u32 == config().physical_devices {
                    String::new()
                } else {
                    format!(
                        ", the container mounts physical cards {:?} (its logical ids 0..{})",
                        config().mounted,
                        config().mounted.len()
                    )
                }
            ),
        )
    })
}

/// Logical id of a user id (`ACL_ERROR_RT_INVALID_DEVICEID` when out of range).
pub(crate) fn logical_id(user_id: i32) -> EmuResult<u32> {
    physical_id(user_id)?;
    Ok(config().visible_logical[user_id as usize])
}

/// `aclInit`: true the first time (until `aclFinalize`).
pub(crate) fn init() -> bool {
    let mut r = lock(&REGISTRY);
    !std::mem::replace(&mut r.initialized, true)
}

/// `aclFinalize`.
pub(crate) fn finalize() {
    lock(&REGISTRY).initialized = false;
}

fn set_current(ctx: Option<Arc<Context>>) {
    let _ = CURRENT.try_with(|c| *c.borrow_mut() = ctx);
}

/// `aclrtSetDevice`: takes a reference on the device and makes its default context current.
pub(crate) fn set_device(user_id: i32) -> EmuResult<()> {
    let physical = physical_id(user_id)?;
    let user = user_id as u32;
    let ctx = {
        let mut guard = lock(&REGISTRY);
        let r = &mut *guard;
        let slot = r.devices.entry(user).or_default();
        slot.refcount += 1;
        let ctx = match &slot.default_ctx {
            Some(c) => Arc::clone(c),
            None => {
                let c = Context::new(user, physical, true);
                slot.default_ctx = Some(Arc::clone(&c));
                c
            }
        };
        r.contexts.insert(ctx.handle, Arc::clone(&ctx));
        ctx
    };
    set_current(Some(ctx));
    Ok(())
}

/// `aclrtResetDevice`: drops a reference; at zero the default context and its streams go away.
pub(crate) fn reset_device(user_id: i32) -> EmuResult<()> {
    physical_id(user_id)?;
    let user = user_id as u32;
    let dead = {
        let mut guard = lock(&REGISTRY);
        let r = &mut *guard;
        let Some(slot) = r.devices.get_mut(&user) else { return Ok(()) };
        slot.refcount = slot.refcount.saturating_sub(1);
        if slot.refcount > 0 {
            return Ok(());
        }
        let dead = slot.default_ctx.take();
        if let Some(c) = &dead {
            r.contexts.remove(&c.handle);
        }
        dead
    };
    if let Some(ctx) = dead {
        ctx.kill();
        let _ = CURRENT.try_with(|c| {
            let mut c = c.borrow_mut();
            if c.as_ref().is_some_and(|cur| cur.handle == ctx.handle) {
                *c = None;
            }
        });
    }
    Ok(())
}

/// The calling thread's current context (`ACL_ERROR_RT_CONTEXT_NULL` if it has none).
pub(crate) fn current() -> EmuResult<Arc<Context>> {
    let ctx = CURRENT.try_with(|c| c.borrow().clone()).ok().flatten();
    match ctx {
        Some(c) if c.is_alive() => Ok(c),
        Some(c) => Err(err(
            ACL_ERROR_RT_CONTEXT_NULL,
            format!("the current context of this thread (device {}) was destroyed or its device reset", c.user_id),
        )),
        None => Err(err(
            ACL_ERROR_RT_CONTEXT_NULL,
            "this thread has no current context: call aclrtSetDevice or aclrtSetCurrentContext on it first",
        )),
    }
}

/// `aclrtCreateContext`: a new context on `user_id`, made current for the calling thread.
pub(crate) fn create_context(user_id: i32) -> EmuResult<Arc<Context>> {
    let physical = physical_id(user_id)?;
    let ctx = Context::new(user_id as u32, physical, false);
    lock(&REGISTRY).contexts.insert(ctx.handle, Arc::clone(&ctx));
    set_current(Some(Arc::clone(&ctx)));
    Ok(ctx)
}

fn lookup(ptr: *const std::ffi::c_void) -> EmuResult<Arc<Context>> {
    if ptr.is_null() {
        return Err(err(ACL_ERROR_INVALID_PARAM, "context is NULL"));
    }
    handles::from_ptr(Kind::Context, ptr)
        .and_then(|h| lock(&REGISTRY).contexts.get(&h).cloned())
        .ok_or_else(|| err(ACL_ERROR_INVALID_PARAM, format!("{ptr:p} is not a live context")))
}

/// `aclrtDestroyContext` (explicit contexts only).
pub(crate) fn destroy_context(ptr: *const std::ffi::c_void) -> EmuResult<()> {
    let ctx = lookup(ptr)?;
    if ctx.is_default {
        return Err(err(
            ACL_ERROR_INVALID_PARAM,
            "aclrtDestroyContext: this is a device's default context (use aclrtResetDevice)",
        ));
    }
    lock(&REGISTRY).contexts.remove(&ctx.handle);
    ctx.kill();
    let _ = CURRENT.try_with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_some_and(|cur| cur.handle == ctx.handle) {
            *c = None;
        }
    });
    Ok(())
}

/// `aclrtSetCurrentContext`.
pub(crate) fn set_current_context(ptr: *const std::ffi::c_void) -> EmuResult<()> {
    let ctx = lookup(ptr)?;
    set_current(Some(ctx));
    Ok(())
}

//! The exported C++ entry points of `adxl::AdxlEngine`, `hixl::Hixl` and `ge::AscendString`,
//! under their Itanium-mangled names (the list is [`super::ADXL_EXPORTS`],
//! [`super::HIXL_EXPORTS`] and [`super::GE_EXPORTS`]).
//!
//! On x86-64 and AArch64 a non-virtual member function is a C function whose first argument is
//! `this`; a reference is a pointer; `Status` is `uint32_t`; the enums are `int`. Constructors
//! and destructors (`C1`/`D1`) return nothing. The engine object the caller allocates is 8
//! bytes (one `std::unique_ptr`): the emulator keeps an engine id in it (0 = no engine, as a
//! null `impl_`). Every entry point catches panics; the C++ half never throws.
//!
//! The checks made here are the wrapper's (HIXL `src/llm_datadist/api/adxl_engine_impl.cc` for
//! `adxl::`, `src/hixl/engine/hixl_impl.cc` for `hixl::`); the engine's are in `engine`.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use super::abi::{self, MemDesc, TransferArgs};
use super::engine::{Engine, MEM_DEVICE, MEM_HOST, OP_READ, OP_WRITE, ReqState};
use crate::boundary::{Api, debug, entry, lock};
use crate::codes::*;
use crate::device;
use crate::memory;

/// Which API an entry point belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    /// `adxl::AdxlEngine` (`libllm_datadist.so`).
    Adxl,
    /// `hixl::Hixl` (`libcann_hixl.so`).
    Hixl,
}

static ENGINES: LazyLock<Mutex<HashMap<u64, Arc<Engine>>>> = LazyLock::new(Default::default);
static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// The 8-byte engine object as an atomic id.
///
/// # Safety
/// `this` points to a live, 8-aligned engine object.
unsafe fn slot<'a>(this: *mut c_void) -> &'a AtomicU64 {
    // SAFETY: guaranteed by the caller; AtomicU64 has the layout of u64.
    unsafe { &*this.cast::<AtomicU64>() }
}

fn not_initialized() -> EmuError {
    hixl_err(HIXL_FAILED, "impl is nullptr, check Initialize")
}

/// The engine behind `this` (FAILED when there is none: "impl is nullptr").
///
/// # Safety
/// `this` is NULL or a live engine object.
unsafe fn engine_of(this: *mut c_void) -> EmuResult<Arc<Engine>> {
    if this.is_null() {
        return Err(not_initialized());
    }
    // SAFETY: non-null and live (caller).
    let id = unsafe { slot(this) }.load(Ordering::Acquire);
    lock(&ENGINES).get(&id).cloned().ok_or_else(not_initialized)
}

/// Takes the engine out of `this` and finalizes it.
///
/// # Safety
/// `this` is NULL or a live engine object.
unsafe fn finalize(this: *mut c_void) {
    if this.is_null() {
        return;
    }
    // SAFETY: non-null and live (caller).
    let id = unsafe { slot(this) }.swap(0, Ordering::AcqRel);
    let engine = lock(&ENGINES).remove(&id);
    if let Some(e) = engine {
        e.finalize();
    }
}

/// Runs an entry point that returns a `Status`.
fn status(name: &'static str, args: impl FnOnce() -> String, body: impl FnOnce() -> EmuResult<()>) -> u32 {
    entry(Api::Hixl, name, args, body) as u32
}

/// Runs an entry point that returns nothing (C1, D1, Finalize): panics are caught and logged.
fn void(name: &'static str, args: impl FnOnce() -> String, body: impl FnOnce()) {
    let r = catch_unwind(AssertUnwindSafe(|| {
        debug(|| format!("{name}({})", args()));
        body();
    }));
    if r.is_err() {
        crate::boundary::log_line(&format!("{name}: internal error in the emulator (panic caught)"));
    }
}

/// Reads an `AscendString` argument ("" when it holds no string).
///
/// # Safety
/// `s` is NULL or a live AscendString.
unsafe fn text(s: *const c_void) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: live (caller).
    unsafe { abi::read_str(s) }.unwrap_or_default()
}

fn timeout_of(ms: i32) -> EmuResult<Duration> {
    // `timeout_in_millis > 0` (`adxl_engine_impl.cc` l.254, l.265, l.280; `hixl_impl.cc` l.289,
    // l.303, l.364).
    if ms <= 0 {
        return Err(hixl_err(HIXL_PARAM_INVALID, format!("timeout_in_millis:{ms} must > 0")));
    }
    Ok(Duration::from_millis(ms as u64))
}

// ---- the shared implementations ------------------------------------------------------------

unsafe fn construct(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: the caller allocated the 8-byte object.
        unsafe { slot(this) }.store(0, Ordering::Release);
    }
}

unsafe fn initialize(flavor: Flavor, this: *mut c_void, local: *const c_void, options: *const c_void) -> EmuResult<()> {
    if this.is_null() || options.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "NULL engine or options"));
    }
    // SAFETY: live arguments (caller).
    let name = unsafe { text(local) };
    // SAFETY: a live std::map<AscendString, AscendString> (caller).
    let pairs = unsafe { abi::read_options(options) };
    debug(|| format!("Initialize {name:?} options {pairs:?}"));
    if flavor == Flavor::Adxl {
        // `AdxlEngine::Initialize` replaces its impl before initializing the new one, so the old
        // engine goes first (`adxl_engine_impl.cc` l.211; the old impl's engine is destroyed
        // with it); the emulator finalizes it.
        // SAFETY: live engine object.
        unsafe { finalize(this) };
    }
    // `Hixl::Initialize` builds a new impl and swaps it in only when it initialized
    // (`hixl_impl.cc` l.246-253): the old engine (still listening on its port) stays on failure.
    let engine = Engine::initialize(&name, &pairs)?;
    let id = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
    lock(&ENGINES).insert(id, engine);
    // SAFETY: live engine object.
    let old = unsafe { slot(this) }.swap(id, Ordering::AcqRel);
    let old = lock(&ENGINES).remove(&old);
    if let Some(e) = old {
        e.finalize();
    }
    Ok(())
}

unsafe fn register(
    flavor: Flavor,
    this: *mut c_void,
    mem: *const MemDesc,
    mem_type: i32,
    handle: *mut *mut c_void,
) -> EmuResult<()> {
    // SAFETY: NULL or live (caller).
    let engine = unsafe { engine_of(this) }?;
    if mem.is_null() || handle.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "NULL MemDesc or handle reference"));
    }
    // SAFETY: a live MemDesc (144 bytes, caller).
    let desc = unsafe { mem.read_unaligned() };
    let h = engine.register(&desc, mem_type, flavor == Flavor::Hixl)?;
    // SAFETY: a live `void*&` (caller).
    unsafe { handle.write_unaligned(h as usize as *mut c_void) };
    Ok(())
}

unsafe fn deregister(this: *mut c_void, handle: *mut c_void) -> EmuResult<()> {
    // SAFETY: NULL or live (caller).
    let engine = unsafe { engine_of(this) }?;
    // `mem_handle != nullptr` (`adxl_engine_impl.cc` l.130, `hixl_impl.cc` l.123).
    if handle.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "mem_handle can not be null"));
    }
    engine.deregister(handle as usize as u64)
}

unsafe fn connect(this: *mut c_void, remote: *const c_void, timeout_ms: i32) -> EmuResult<()> {
    // SAFETY: NULL or live (caller).
    let engine = unsafe { engine_of(this) }?;
    let timeout = timeout_of(timeout_ms)?;
    // SAFETY: live (caller).
    engine.connect(&unsafe { text(remote) }, timeout)
}

unsafe fn disconnect(this: *mut c_void, remote: *const c_void, timeout_ms: i32) -> EmuResult<()> {
    // SAFETY: NULL or live (caller).
    let engine = unsafe { engine_of(this) }?;
    let timeout = timeout_of(timeout_ms)?;
    // SAFETY: live (caller).
    engine.disconnect(&unsafe { text(remote) }, timeout)
}

/// `CheckTransferOpDescs`: no null address (`adxl_engine_impl.cc` l.55-63, `hixl_impl.cc`
/// l.24-32); an unknown op is PARAM_INVALID (an inference).
unsafe fn descs_of(op: i32, descs: *const c_void) -> EmuResult<Vec<abi::TransferOpDesc>> {
    if op != OP_READ && op != OP_WRITE {
        return Err(hixl_err(HIXL_PARAM_INVALID, format!("unknown TransferOp {op}")));
    }
    if descs.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "NULL op_descs"));
    }
    // SAFETY: a live std::vector<TransferOpDesc> (caller).
    let v = unsafe { abi::read_descs(descs) };
    for d in &v {
        if d.local_addr == 0 {
            return Err(hixl_err(HIXL_PARAM_INVALID, "local addr of desc can not be null."));
        }
        if d.remote_addr == 0 {
            return Err(hixl_err(HIXL_PARAM_INVALID, "remote addr of desc can not be null."));
        }
    }
    Ok(v)
}

unsafe fn transfer_sync(
    this: *mut c_void,
    remote: *const c_void,
    op: i32,
    descs: *const c_void,
    timeout_ms: i32,
) -> EmuResult<()> {
    // SAFETY: NULL or live (caller).
    let engine = unsafe { engine_of(this) }?;
    let timeout = timeout_of(timeout_ms)?;
    // SAFETY: live (caller).
    let v = unsafe { descs_of(op, descs) }?;
    // SAFETY: live (caller).
    engine.transfer_sync(&unsafe { text(remote) }, op, &v, timeout)
}

unsafe fn transfer_async(
    this: *mut c_void,
    remote: *const c_void,
    op: i32,
    descs: *const c_void,
    _args: *const TransferArgs,
    req: *mut *mut c_void,
) -> EmuResult<()> {
    // SAFETY: NULL or live (caller).
    let engine = unsafe { engine_of(this) }?;
    if req.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "NULL TransferReq reference"));
    }
    // SAFETY: live (caller).
    let v = unsafe { descs_of(op, descs) }?;
    // SAFETY: live (caller).
    let id = engine.transfer_async(&unsafe { text(remote) }, op, &v)?;
    // SAFETY: a live `void*&` (caller).
    unsafe { req.write_unaligned(id as usize as *mut c_void) };
    Ok(())
}

/// `TransferStatus` values.
const STATUS_WAITING: i32 = 0;
const STATUS_COMPLETED: i32 = 1;
const STATUS_FAILED: i32 = 3;

unsafe fn transfer_status(this: *mut c_void, req: *const *mut c_void, out: *mut i32) -> EmuResult<()> {
    let write = |v: i32| {
        if !out.is_null() {
            // SAFETY: a live `TransferStatus&` (caller).
            unsafe { out.write_unaligned(v) };
        }
    };
    let r = (|| {
        // SAFETY: NULL or live (caller).
        let engine = unsafe { engine_of(this) }?;
        // SAFETY: a live `const TransferReq&` (caller), when non-null.
        let req = if req.is_null() { std::ptr::null_mut() } else { unsafe { req.read_unaligned() } };
        // A null request is FAILED (`adxl_engine_impl.cc` l.307, `hixl_impl.cc` l.388).
        if req.is_null() {
            return Err(hixl_err(HIXL_FAILED, "Req is nullptr, check req."));
        }
        engine.transfer_status(req as usize as u64)
    })();
    match r {
        Ok(state) => {
            write(match state {
                ReqState::Waiting => STATUS_WAITING,
                ReqState::Completed => STATUS_COMPLETED,
                ReqState::Failed => STATUS_FAILED,
            });
            Ok(())
        }
        Err(e) => {
            // On an error the status is FAILED (`adxl_engine_impl.cc` l.175-178,
            // `hixl_impl.cc` l.209-212). (With a null impl HIXL returns before writing; the
            // emulator writes FAILED then too.)
            write(STATUS_FAILED);
            Err(e)
        }
    }
}

/// `GetCapability` (static, no engine needed): AUTO_CONNECT and CLIENT_SERVER_COMM are
/// supported, any other feature is not, a negative one is PARAM_INVALID (`hixl_impl.cc`
/// l.425-438; ADXL forwards, `adxl_engine_impl.cc` l.357-359).
unsafe fn capability(feature: i32, value: *mut i32) -> EmuResult<()> {
    if feature < 0 {
        return Err(hixl_err(HIXL_PARAM_INVALID, format!("feature type {feature} is negative")));
    }
    if value.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "NULL value reference"));
    }
    let v = if feature == 0 || feature == 1 { 1 } else { 0 };
    // SAFETY: a live `int32_t&` (caller).
    unsafe { value.write_unaligned(v) };
    Ok(())
}

/// Memory handed out by `MallocMem` (address → device or host).
static MALLOCED: LazyLock<Mutex<HashSet<usize>>> = LazyLock::new(Default::default);

/// `AdxlEngine::MallocMem` (`fabric_mem_allocator.cc` l.77-112): type HOST or DEVICE, size > 0,
/// `ptr` non-null (else PARAM_INVALID), then the calling thread's device (ACL's error passes
/// through). HIXL maps fabric memory (`aclrtMallocPhysical` + `aclrtMapMem`); the emulator, which
/// does not model those, hands out `aclrtMallocHost` memory for HOST and `aclrtMalloc` memory of
/// the current device for DEVICE, so the result registers like HIXL's does.
unsafe fn malloc_mem(mem_type: i32, size: usize, ptr: *mut *mut c_void) -> EmuResult<()> {
    if mem_type != MEM_HOST && mem_type != MEM_DEVICE {
        return Err(hixl_err(HIXL_PARAM_INVALID, "Only support malloc host or device fabric memory."));
    }
    if size == 0 {
        return Err(hixl_err(HIXL_PARAM_INVALID, "Fabric memory size should be greater than zero."));
    }
    if ptr.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "ptr is nullptr"));
    }
    let ctx = device::current()?;
    let p = if mem_type == MEM_HOST {
        memory::alloc_host(size)
    } else {
        memory::alloc_device(ctx.user_id, ctx.physical_id, size, 0)
    }
    .map_err(|e| hixl_err(e.code as u32, e.message))?;
    lock(&MALLOCED).insert(p);
    // SAFETY: a live `void**` (caller).
    unsafe { ptr.write_unaligned(p as *mut c_void) };
    Ok(())
}

/// `AdxlEngine::FreeMem` (`fabric_mem_allocator.cc` l.114-126): NULL is PARAM_INVALID, memory
/// not from `MallocMem` is FAILED (`GetPaHandleFromVa`, l.165-173).
unsafe fn free_mem(ptr: *mut c_void) -> EmuResult<()> {
    if ptr.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "Fabric memory address cannot be nullptr."));
    }
    let addr = ptr as usize;
    if !lock(&MALLOCED).remove(&addr) {
        return Err(hixl_err(HIXL_FAILED, format!("{addr:#x} was not allocated by MallocMem or is already freed")));
    }
    let device = memory::find_device(addr, 1).is_some_and(|a| a.base == addr);
    memory::free(addr, device).map_err(|e| hixl_err(HIXL_FAILED, e.message))
}

/// `AdxlEngine::ExportToShareableHandle` (`fabric_mem_transfer_service.cc` l.99-102,
/// `fabric_mem_allocator.cc` l.175-191): NULL or memory not from `MallocMem` is PARAM_INVALID;
/// otherwise HIXL calls `aclrtMemExportToShareableHandleV2`, which the emulator does not model
/// (207000, passed through as HIXL passes ACL errors, `hixl_checker.h` l.116-127).
unsafe fn export_handle(addr: *mut c_void, handle: *mut c_void) -> EmuResult<()> {
    if addr.is_null() {
        return Err(hixl_err(HIXL_PARAM_INVALID, "Fabric memory address cannot be nullptr."));
    }
    if !lock(&MALLOCED).contains(&(addr as usize)) {
        return Err(hixl_err(
            HIXL_PARAM_INVALID,
            format!("Address:{:#x} was not allocated by fabric MallocMem or is already freed.", addr as usize),
        ));
    }
    let _ = handle;
    Err(err(
        ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
        "Export fabric share handle failed: aclrtMemExportToShareableHandleV2 is not modelled by the emulator",
    ))
}

// ---- ge::AscendString ----------------------------------------------------------------------

/// `ge::AscendString::AscendString(const char*)`: a `shared_ptr<std::string>` of `name`, or an
/// empty one for NULL.
///
/// # Safety
/// `this` is 16 writable bytes (8-aligned); `name` is NULL or NUL-terminated.
#[unsafe(export_name = "_ZN2ge12AscendStringC1EPKc")]
pub unsafe extern "C" fn ge_ascend_string_c1(this: *mut c_void, name: *const c_char) {
    let r = catch_unwind(AssertUnwindSafe(|| {
        if !this.is_null() {
            // SAFETY: guaranteed by the caller.
            let _ = unsafe { abi::construct_str(this, name) };
        }
    }));
    if r.is_err() {
        crate::boundary::log_line("ge::AscendString: internal error in the emulator (panic caught)");
    }
}

/// `ge::AscendString::operator<(const AscendString&) const`.
///
/// # Safety
/// Both point to live AscendStrings.
#[unsafe(export_name = "_ZNK2ge12AscendStringltERKS0_")]
pub unsafe extern "C" fn ge_ascend_string_lt(this: *const c_void, other: *const c_void) -> bool {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: guaranteed by the caller.
        !this.is_null() && !other.is_null() && unsafe { abi::str_less(this, other) }
    }))
    .unwrap_or(false)
}

// ---- adxl::AdxlEngine and hixl::Hixl -------------------------------------------------------

macro_rules! engine_exports {
    ($flavor:expr, $prefix:literal,
     c1 = $c1:literal, d1 = $d1:literal, init = $init:literal, fin = $fin:literal, reg = $reg:literal,
     dereg = $dereg:literal, conn = $conn:literal, disc = $disc:literal, sync = $sync:literal,
     asyn = $asyn:literal, stat = $stat:literal, cap = $cap:literal,
     fns = ($f_c1:ident, $f_d1:ident, $f_init:ident, $f_fin:ident, $f_reg:ident, $f_dereg:ident, $f_conn:ident,
            $f_disc:ident, $f_sync:ident, $f_asyn:ident, $f_stat:ident, $f_cap:ident)) => {
        #[doc = concat!("`", $prefix, "` constructor (C1): no engine yet.")]
        ///
        /// # Safety
        /// `this` is the caller's 8-byte, 8-aligned engine object.
        #[unsafe(export_name = $c1)]
        pub unsafe extern "C" fn $f_c1(this: *mut c_void) {
            // SAFETY: forwarded contract.
            void(concat!($prefix, ".C1"), || format!("{this:p}"), || unsafe { construct(this) })
        }

        #[doc = concat!("`", $prefix, "` destructor (D1): finalizes (`adxl_engine_impl.cc` l.205-207, `hixl_impl.cc` l.242-244).")]
        ///
        /// # Safety
        /// `this` is a live engine object.
        #[unsafe(export_name = $d1)]
        pub unsafe extern "C" fn $f_d1(this: *mut c_void) {
            // SAFETY: forwarded contract.
            void(concat!($prefix, ".D1"), || format!("{this:p}"), || unsafe { finalize(this) })
        }

        #[doc = concat!("`", $prefix, "::Initialize(const AscendString&, const std::map<AscendString, AscendString>&)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object; the references point to live C++ objects.
        #[unsafe(export_name = $init)]
        pub unsafe extern "C" fn $f_init(this: *mut c_void, local: *const c_void, options: *const c_void) -> u32 {
            // SAFETY: forwarded contract.
            status(concat!($prefix, ".Initialize"), || format!("{this:p}, {:?}", unsafe { text(local) }), || unsafe {
                initialize($flavor, this, local, options)
            })
        }

        #[doc = concat!("`", $prefix, "::Finalize()`: idempotent.")]
        ///
        /// # Safety
        /// `this` is a live engine object.
        #[unsafe(export_name = $fin)]
        pub unsafe extern "C" fn $f_fin(this: *mut c_void) {
            // SAFETY: forwarded contract.
            void(concat!($prefix, ".Finalize"), || format!("{this:p}"), || unsafe { finalize(this) })
        }

        #[doc = concat!("`", $prefix, "::RegisterMem(const MemDesc&, MemType, MemHandle&)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object; `mem` a live 144-byte MemDesc; `handle` writable.
        #[unsafe(export_name = $reg)]
        pub unsafe extern "C" fn $f_reg(
            this: *mut c_void,
            mem: *const MemDesc,
            mem_type: i32,
            handle: *mut *mut c_void,
        ) -> u32 {
            status(
                concat!($prefix, ".RegisterMem"),
                // SAFETY: `mem` is live when non-null (contract).
                || format!("{this:p}, {:?}, type {mem_type}", (!mem.is_null()).then(|| unsafe { (*mem).addr..(*mem).addr + (*mem).len })),
                // SAFETY: forwarded contract.
                || unsafe { register($flavor, this, mem, mem_type, handle) },
            )
        }

        #[doc = concat!("`", $prefix, "::DeregisterMem(MemHandle)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object.
        #[unsafe(export_name = $dereg)]
        pub unsafe extern "C" fn $f_dereg(this: *mut c_void, handle: *mut c_void) -> u32 {
            // SAFETY: forwarded contract.
            status(concat!($prefix, ".DeregisterMem"), || format!("{this:p}, {handle:p}"), || unsafe { deregister(this, handle) })
        }

        #[doc = concat!("`", $prefix, "::Connect(const AscendString&, int32_t)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object; `remote` a live AscendString.
        #[unsafe(export_name = $conn)]
        pub unsafe extern "C" fn $f_conn(this: *mut c_void, remote: *const c_void, timeout_ms: i32) -> u32 {
            // SAFETY: forwarded contract.
            status(concat!($prefix, ".Connect"), || format!("{this:p}, {:?}, {timeout_ms} ms", unsafe { text(remote) }), || unsafe {
                connect(this, remote, timeout_ms)
            })
        }

        #[doc = concat!("`", $prefix, "::Disconnect(const AscendString&, int32_t)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object; `remote` a live AscendString.
        #[unsafe(export_name = $disc)]
        pub unsafe extern "C" fn $f_disc(this: *mut c_void, remote: *const c_void, timeout_ms: i32) -> u32 {
            // SAFETY: forwarded contract.
            status(concat!($prefix, ".Disconnect"), || format!("{this:p}, {:?}, {timeout_ms} ms", unsafe { text(remote) }), || unsafe {
                disconnect(this, remote, timeout_ms)
            })
        }

        #[doc = concat!("`", $prefix, "::TransferSync(const AscendString&, TransferOp, const std::vector<TransferOpDesc>&, int32_t)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object; the references point to live C++ objects; the
        /// descriptors' local ranges are the caller's memory.
        #[unsafe(export_name = $sync)]
        pub unsafe extern "C" fn $f_sync(
            this: *mut c_void,
            remote: *const c_void,
            op: i32,
            descs: *const c_void,
            timeout_ms: i32,
        ) -> u32 {
            status(
                concat!($prefix, ".TransferSync"),
                // SAFETY: live references (contract).
                || format!("{this:p}, {:?}, op {op}, {:?}, {timeout_ms} ms", unsafe { text(remote) }, (!descs.is_null()).then(|| unsafe { abi::read_descs(descs) })),
                // SAFETY: forwarded contract.
                || unsafe { transfer_sync(this, remote, op, descs, timeout_ms) },
            )
        }

        #[doc = concat!("`", $prefix, "::TransferAsync(const AscendString&, TransferOp, const std::vector<TransferOpDesc>&, const TransferArgs&, TransferReq&)`.")]
        ///
        /// # Safety
        /// As for TransferSync; `req` is writable; the local memory stays registered until the
        /// request completes.
        #[unsafe(export_name = $asyn)]
        pub unsafe extern "C" fn $f_asyn(
            this: *mut c_void,
            remote: *const c_void,
            op: i32,
            descs: *const c_void,
            args: *const TransferArgs,
            req: *mut *mut c_void,
        ) -> u32 {
            status(
                concat!($prefix, ".TransferAsync"),
                // SAFETY: live references (contract).
                || format!("{this:p}, {:?}, op {op}, {:?}", unsafe { text(remote) }, (!descs.is_null()).then(|| unsafe { abi::read_descs(descs) })),
                // SAFETY: forwarded contract.
                || unsafe { transfer_async(this, remote, op, descs, args, req) },
            )
        }

        #[doc = concat!("`", $prefix, "::GetTransferStatus(const TransferReq&, TransferStatus&)`.")]
        ///
        /// # Safety
        /// `this` is a live engine object; `req` readable, `out` writable.
        #[unsafe(export_name = $stat)]
        pub unsafe extern "C" fn $f_stat(this: *mut c_void, req: *const *mut c_void, out: *mut i32) -> u32 {
            // SAFETY: forwarded contract.
            status(concat!($prefix, ".GetTransferStatus"), || format!("{this:p}, {req:p}"), || unsafe {
                transfer_status(this, req, out)
            })
        }

        #[doc = concat!("`", $prefix, "::GetCapability(FeatureType, int32_t&)` (static).")]
        ///
        /// # Safety
        /// `value` is writable.
        #[unsafe(export_name = $cap)]
        pub unsafe extern "C" fn $f_cap(feature: i32, value: *mut i32) -> u32 {
            // SAFETY: forwarded contract.
            status(concat!($prefix, ".GetCapability"), || format!("feature {feature}"), || unsafe { capability(feature, value) })
        }
    };
}

engine_exports!(
    Flavor::Adxl,
    "adxl",
    c1 = "_ZN4adxl10AdxlEngineC1Ev",
    d1 = "_ZN4adxl10AdxlEngineD1Ev",
    init = "_ZN4adxl10AdxlEngine10InitializeERKN2ge12AscendStringERKSt3mapIS2_S2_St4lessIS2_ESaISt4pairIS3_S2_EEE",
    fin = "_ZN4adxl10AdxlEngine8FinalizeEv",
    reg = "_ZN4adxl10AdxlEngine11RegisterMemERKNS_7MemDescENS_7MemTypeERPv",
    dereg = "_ZN4adxl10AdxlEngine13DeregisterMemEPv",
    conn = "_ZN4adxl10AdxlEngine7ConnectERKN2ge12AscendStringEi",
    disc = "_ZN4adxl10AdxlEngine10DisconnectERKN2ge12AscendStringEi",
    sync = "_ZN4adxl10AdxlEngine12TransferSyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EEi",
    asyn = "_ZN4adxl10AdxlEngine13TransferAsyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EERKNS_12TransferArgsERPv",
    stat = "_ZN4adxl10AdxlEngine17GetTransferStatusERKPvRNS_14TransferStatusE",
    cap = "_ZN4adxl10AdxlEngine13GetCapabilityENS_11FeatureTypeERi",
    fns = (
        adxl_engine_c1,
        adxl_engine_d1,
        adxl_engine_initialize,
        adxl_engine_finalize,
        adxl_engine_register_mem,
        adxl_engine_deregister_mem,
        adxl_engine_connect,
        adxl_engine_disconnect,
        adxl_engine_transfer_sync,
        adxl_engine_transfer_async,
        adxl_engine_get_transfer_status,
        adxl_engine_get_capability
    )
);

engine_exports!(
    Flavor::Hixl,
    "hixl",
    c1 = "_ZN4hixl4HixlC1Ev",
    d1 = "_ZN4hixl4HixlD1Ev",
    init = "_ZN4hixl4Hixl10InitializeERKN2ge12AscendStringERKSt3mapIS2_S2_St4lessIS2_ESaISt4pairIS3_S2_EEE",
    fin = "_ZN4hixl4Hixl8FinalizeEv",
    reg = "_ZN4hixl4Hixl11RegisterMemERKNS_7MemDescENS_7MemTypeERPv",
    dereg = "_ZN4hixl4Hixl13DeregisterMemEPv",
    conn = "_ZN4hixl4Hixl7ConnectERKN2ge12AscendStringEi",
    disc = "_ZN4hixl4Hixl10DisconnectERKN2ge12AscendStringEi",
    sync = "_ZN4hixl4Hixl12TransferSyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EEi",
    asyn = "_ZN4hixl4Hixl13TransferAsyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EERKNS_12TransferArgsERPv",
    stat = "_ZN4hixl4Hixl17GetTransferStatusERKPvRNS_14TransferStatusE",
    cap = "_ZN4hixl4Hixl13GetCapabilityENS_11FeatureTypeERi",
    fns = (
        hixl_c1,
        hixl_d1,
        hixl_initialize,
        hixl_finalize,
        hixl_register_mem,
        hixl_deregister_mem,
        hixl_connect,
        hixl_disconnect,
        hixl_transfer_sync,
        hixl_transfer_async,
        hixl_get_transfer_status,
        hixl_get_capability
    )
);

/// `adxl::AdxlEngine::MallocMem(MemType, size_t, void**)` (static).
///
/// # Safety
/// `ptr` is writable.
#[unsafe(export_name = "_ZN4adxl10AdxlEngine9MallocMemENS_7MemTypeEmPPv")]
pub unsafe extern "C" fn adxl_engine_malloc_mem(mem_type: i32, size: usize, ptr: *mut *mut c_void) -> u32 {
    // SAFETY: forwarded contract.
    status("adxl.MallocMem", || format!("type {mem_type}, {size} bytes"), || unsafe { malloc_mem(mem_type, size, ptr) })
}

/// `adxl::AdxlEngine::FreeMem(void*)` (static).
///
/// # Safety
/// `ptr` was returned by `MallocMem` (anything else is refused).
#[unsafe(export_name = "_ZN4adxl10AdxlEngine7FreeMemEPv")]
pub unsafe extern "C" fn adxl_engine_free_mem(ptr: *mut c_void) -> u32 {
    // SAFETY: forwarded contract.
    status("adxl.FreeMem", || format!("{ptr:p}"), || unsafe { free_mem(ptr) })
}

/// `adxl::AdxlEngine::ExportToShareableHandle(void*, aclrtMemFabricHandle&)` (static).
///
/// # Safety
/// `handle` is writable (it is never written: the emulator cannot export).
#[unsafe(export_name = "_ZN4adxl10AdxlEngine23ExportToShareableHandleEPvR20aclrtMemFabricHandle")]
pub unsafe extern "C" fn adxl_engine_export_to_shareable_handle(addr: *mut c_void, handle: *mut c_void) -> u32 {
    // SAFETY: forwarded contract.
    status("adxl.ExportToShareableHandle", || format!("{addr:p}"), || unsafe { export_handle(addr, handle) })
}

//! Engines: create (from JSON, a file or the environment), destroy, identity, memory
//! registration and opened segments.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::sync::Mutex;

use ferry::{Config, Error, ErrorKind, HostAllocation, Location, TransferEngine};

use crate::FerryEngine;
use crate::errors::{CResult, Out, OutArray, copy_str, guard, invalid, opt_str_arg, str_arg};
use crate::handles::{ENGINE_TAG, HandleTable};

/// Every live engine of the process.
pub(crate) static ENGINES: HandleTable<TransferEngine> = HandleTable::new(ENGINE_TAG, "engine", "destroyed");

/// Host memory of `ferry_allocate_buffer` not yet freed, by address. Process-wide: a buffer may
/// outlive the engine that allocated it.
static BUFFERS: Mutex<BTreeMap<u64, HostAllocation>> = Mutex::new(BTreeMap::new());

/// The engine behind `handle` (a clone: the table's lock is not held while it is used).
pub(crate) fn engine(handle: FerryEngine) -> CResult<TransferEngine> {
    ENGINES.get(handle).map(|e| TransferEngine::clone(&e))
}

fn env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

/// Builds an engine from `config` with every compiled-in transport and metadata backend, and
/// gives it a handle.
fn create(config: Config) -> CResult<FerryEngine> {
    let engine = ferry::builder().config(config).build_blocking()?;
    match ENGINES.insert(engine.clone()) {
        Ok(h) => Ok(h),
        Err(e) => {
            let _ = engine.shutdown_blocking();
            Err(e)
        }
    }
}

/// Creates an engine configured by `config_json`, the contents of a `mooncake.json` (either
/// of Mooncake's layouts, connector or store style, or Ferry's plain form), and stores its
/// handle in `*out`.
///
/// NULL or an empty string selects the embedded default: in-process metadata and the `local`
/// transport (engines of one process only). The environment overrides (`FERRY_LOCAL_HOSTNAME`,
/// `FERRY_METADATA_SERVER`, `FERRY_PROTOCOL`, ..., `MC_METADATA_CLUSTER_ID`) are applied on
/// top, as by `ferry_core::Config::discover`; `MOONCAKE_CONFIG_PATH` is not read (see
/// `ferry_engine_create_from_env`). Every compiled-in transport and metadata backend is
/// available.
///
/// Example: `{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
/// "protocol": "tcp"}` names the engine `127.0.0.1:<rpc port>` (see
/// `ferry_engine_segment_name`).
///
/// Returns `FERRY_E_CONFIG` for malformed JSON or a bad field (the last error names the field,
/// its line and column), `FERRY_E_INVALID_ARGUMENT` for a null `out` or a string that is not
/// UTF-8, or the error of starting the transports and metadata backend.
///
/// # Safety
/// `config_json` is NULL or a NUL-terminated string; `out` is valid for writing one
/// `FerryEngine`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_create(config_json: *const c_char, out: *mut FerryEngine) -> i32 {
    guard("ferry_engine_create", || {
        // SAFETY: the caller passes NULL or a NUL-terminated string (this function's contract).
        let text = unsafe { opt_str_arg(config_json, "config_json") }?;
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        let mut config = match text.filter(|t| !t.trim().is_empty()) {
            None => Config::embedded(),
            Some(t) => Config::from_json_str(t, None)?,
        };
        config.apply_env(env)?;
        out.write(create(config)?);
        Ok(())
    })
}

/// Creates an engine configured by the `mooncake.json` file at `path` (then the environment
/// overrides, as for `ferry_engine_create`) and stores its handle in `*out`.
///
/// Returns `FERRY_E_CONFIG` when the file cannot be read or is invalid (the last error names
/// the file and the field), `FERRY_E_INVALID_ARGUMENT` for a null argument or a path that is
/// not UTF-8.
///
/// # Safety
/// `path` is a NUL-terminated string; `out` is valid for writing one `FerryEngine`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_create_from_file(path: *const c_char, out: *mut FerryEngine) -> i32 {
    guard("ferry_engine_create_from_file", || {
        // SAFETY: the caller passes a NUL-terminated string (this function's contract).
        let path = unsafe { str_arg(path, "path") }?;
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        if path.is_empty() {
            return Err(invalid("`path` is empty"));
        }
        let mut config = Config::from_file(path)?;
        config.apply_env(env)?;
        out.write(create(config)?);
        Ok(())
    })
}

/// Creates an engine the way Mooncake finds its config: the file named by
/// `MOONCAKE_CONFIG_PATH` if set, else the embedded default, then the environment overrides
/// (`ferry_core::Config::discover`). Stores its handle in `*out`.
///
/// # Safety
/// `out` is valid for writing one `FerryEngine`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_create_from_env(out: *mut FerryEngine) -> i32 {
    guard("ferry_engine_create_from_env", || {
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        out.write(create(Config::discover()?)?);
        Ok(())
    })
}

/// Shuts the engine down and invalidates its handle: later calls with it return
/// `FERRY_E_NOT_FOUND`, a second destroy included.
///
/// Shutting down stops the transports, waits (up to the transfer timeout) until no transfer
/// holds registered memory, forgets every registration and removes the engine's entries from
/// metadata. After `FERRY_OK` the memory the engine had registered may be freed. When transfers
/// still held memory at the deadline it returns `FERRY_E_BUSY`: the handle is gone all the
/// same, but that memory must not be freed until the transports let go of it
/// (`ferry_batch_released` reports 1 for every batch; at the latest, one transfer timeout after
/// the last submission). Batches keep working (poll, wait, free) after their engine was
/// destroyed.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_engine_destroy(engine: FerryEngine) -> i32 {
    guard("ferry_engine_destroy", || {
        // Refused before the handle is invalidated, so the caller can retry from a plain thread.
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(invalid(
                "ferry_engine_destroy called from inside a tokio runtime; call it from a plain thread (the engine is still alive)",
            ));
        }
        ENGINES.remove(engine)?.shutdown_blocking()
    })
}

/// Copies the engine's segment name (the name peers open it by, for example
/// `127.0.0.1:15342`) NUL-terminated into `buf` of `cap` bytes and stores its length without
/// the NUL in `*len`.
///
/// When `cap` is too small (`cap <= *len`) it copies a truncated name and returns
/// `FERRY_E_INVALID_ARGUMENT`, with `*len` set: call with `buf = NULL, cap = 0` to learn the
/// size.
///
/// # Safety
/// `buf` is NULL (then `cap` must be 0) or valid for writing `cap` bytes; `len` is valid for
/// writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_segment_name(
    engine: FerryEngine,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> i32 {
    guard("ferry_engine_segment_name", || {
        // SAFETY: the caller promises `len` is valid for one write (this function's contract).
        let len = unsafe { Out::new(len, "len") }?;
        if buf.is_null() && cap > 0 {
            return Err(invalid(format!("`buf` is null but `cap` is {cap}")));
        }
        let e = self::engine(engine)?;
        let name = e.segment_name();
        len.write(name.len());
        // SAFETY: `buf` is NULL or valid for `cap` bytes (this function's contract).
        if !unsafe { copy_str(name, buf, cap) } {
            return Err(invalid(format!(
                "`cap` is {cap}, too small for the segment name `{name}` ({} bytes plus the NUL); `*len` holds its length",
                name.len()
            )));
        }
        Ok(())
    })
}

/// Stores in `*out` the RPC port this engine publishes in its `rpc_meta` entry, as Mooncake's
/// `get_rpc_port` reports: the port of its handshake listener (with `P2PHANDSHAKE` the port of
/// its `host:port` name; with HTTP, Redis or etcd metadata the config's `rpc_port` or a free
/// port), else the port of a `host:port` name.
///
/// Returns `FERRY_E_NOT_FOUND` when it publishes no RPC entry (the embedded default names
/// engines `ferry-<pid>-<n>` and runs no listener).
///
/// # Safety
/// `out` is valid for writing one `uint16_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_rpc_port(engine: FerryEngine, out: *mut u16) -> i32 {
    guard("ferry_engine_rpc_port", || {
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        let e = self::engine(engine)?;
        let port = e.rpc_port().ok_or_else(|| {
            Error::not_found(format!(
                "engine `{}` publishes no RPC entry: no handshake listener, and its segment name is not host:port",
                e.segment_name()
            ))
        })?;
        out.write(port);
        Ok(())
    })
}

/// Copies a snapshot of the engine's counters, as JSON text, NUL-terminated into `buf` of `cap`
/// bytes and stores its length without the NUL in `*len`.
///
/// The JSON object is `TransferEngine::stats` of the Rust API: `segment`, `transfers` (one
/// object per transport, peer and opcode: `requests`, `bytes`, `failed_requests`), `failures` and
/// `rejected_submissions` (counts by error kind name), `batch_latency` (`count`, `sum_seconds`,
/// `p50_us`, `p90_us`, `p99_us`, `p999_us`, `max_us`, `buckets`), `open_segments`,
/// `registered_bytes`, `registered_regions`, `tail_polls`, `tail_polls_caught`; docs/metrics.md
/// describes each. Fields may be added
/// in later versions, never removed.
///
/// When `cap` is too small (`cap <= *len`) nothing is copied and it returns
/// `FERRY_E_INVALID_ARGUMENT`, with `*len` set: call with `buf = NULL, cap = 0` to learn the size,
/// and leave some room (a few hundred bytes): the counters, and so the text, may grow between
/// the two calls. Works after the engine shut down too (the counters stay readable until
/// `ferry_engine_destroy`).
///
/// # Safety
/// `buf` is NULL (then `cap` must be 0) or valid for writing `cap` bytes; `len` is valid for
/// writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_stats(engine: FerryEngine, buf: *mut c_char, cap: usize, len: *mut usize) -> i32 {
    guard("ferry_engine_stats", || {
        // SAFETY: the caller promises `len` is valid for one write (this function's contract).
        let len = unsafe { Out::new(len, "len") }?;
        if buf.is_null() && cap > 0 {
            return Err(invalid(format!("`buf` is null but `cap` is {cap}")));
        }
        let e = self::engine(engine)?;
        let json = serde_json::to_string(&e.stats())
            .map_err(|err| Error::new(ErrorKind::Internal, format!("encoding the engine's stats as JSON: {err}")))?;
        len.write(json.len());
        if cap <= json.len() {
            return Err(invalid(format!(
                "`cap` is {cap}, too small for the stats ({} bytes plus the NUL); `*len` holds their length",
                json.len()
            )));
        }
        // SAFETY: `buf` is valid for `cap` bytes (this function's contract), and `cap` is larger
        // than the text, so the whole of it and the NUL fit.
        let copied = unsafe { copy_str(&json, buf, cap) };
        debug_assert!(copied);
        Ok(())
    })
}

/// Registers `[addr, addr + length)` with the engine and publishes it: from now on local
/// requests may use the range, and peers may read and write it.
///
/// `location` says where the memory lives: `"cpu:N"` (host memory on NUMA node N), `"npu:N"`,
/// `"cuda:N"` or `"*"` (let the transport detect it); NULL means `"cpu:0"`.
///
/// Registering is the caller's promise that the memory is valid: the range must be memory this
/// process owns, readable and writable from any thread, and it must stay allocated, and not be
/// reused for anything else, until `ferry_unregister_memory` returned `FERRY_OK` for it or its
/// engine was destroyed with `FERRY_OK`. Ferry cannot check this; a broken promise corrupts
/// memory.
///
/// Returns `FERRY_E_INVALID_ARGUMENT` for a zero `addr` or `length` or a bad location tag,
/// `FERRY_E_ALREADY_EXISTS` when the range overlaps a registered one, `FERRY_E_OUT_OF_BOUNDS`
/// when it wraps around the address space.
///
/// # Safety
/// `location` is NULL or a NUL-terminated string; the memory promise above.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_register_memory(
    engine: FerryEngine,
    addr: u64,
    length: u64,
    location: *const c_char,
) -> i32 {
    guard("ferry_register_memory", || {
        // SAFETY: the caller passes NULL or a NUL-terminated string (this function's contract).
        let location = unsafe { opt_str_arg(location, "location") }?;
        let location: Location = location.unwrap_or("cpu:0").parse()?;
        if addr == 0 {
            return Err(invalid("`addr` is 0 (a null address cannot be registered)"));
        }
        if length == 0 {
            return Err(invalid(format!("`length` is 0: nothing to register at {addr:#x}")));
        }
        let e = self::engine(engine)?;
        // SAFETY: registering through the C API is the caller's promise that the range is valid
        // memory it owns until it is unregistered or the engine is destroyed (this function's
        // documented contract), which is exactly `register_memory_blocking`'s contract.
        unsafe { e.register_memory_blocking(addr, length, location) }
    })
}

/// Unregisters the region that starts at `addr` and publishes the change. Waits (up to the
/// transfer timeout) for transfers still using it. After `FERRY_OK` the memory may be freed.
///
/// Returns `FERRY_E_NOT_FOUND` when no region starts at `addr`, `FERRY_E_BUSY` when transfers
/// still used it at the deadline (the region stays registered).
#[unsafe(no_mangle)]
pub extern "C" fn ferry_unregister_memory(engine: FerryEngine, addr: u64) -> i32 {
    guard("ferry_unregister_memory", || self::engine(engine)?.unregister_memory_blocking(addr))
}

/// Allocates `length` bytes of zero-filled host memory suited to the engine's transports and
/// stores its address in `*out_addr`: with the `ascend` transport it is `aclrtMallocHost`
/// memory (the only host memory HCCL can move), otherwise page-aligned memory of the process
/// allocator. It is not registered: register it with `ferry_register_memory` (location `"*"`
/// lets the transport detect it), and free it with `ferry_free_buffer`.
///
/// The buffer belongs to the process, not to the engine: it stays allocated after the engine
/// is destroyed (and may be registered with another engine) until `ferry_free_buffer`.
///
/// Returns `FERRY_E_INVALID_ARGUMENT` for a zero `length` or a null `out_addr`,
/// `FERRY_E_NOT_FOUND` for an engine handle that is not live, or the transport's error when its
/// allocator fails (`FERRY_E_TRANSPORT`, with the ACL error in the last error).
///
/// # Safety
/// `out_addr` is valid for writing one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_allocate_buffer(engine: FerryEngine, length: u64, out_addr: *mut u64) -> i32 {
    guard("ferry_allocate_buffer", || {
        // SAFETY: the caller promises `out_addr` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out_addr, "out_addr") }?;
        if length == 0 {
            return Err(invalid("`length` is 0: nothing to allocate"));
        }
        let len = usize::try_from(length).map_err(|_| invalid(format!("`length` {length} is too large")))?;
        let e = self::engine(engine)?;
        let buffer = e.allocate_host_memory_blocking(len)?;
        let addr = buffer.addr();
        BUFFERS.lock().unwrap_or_else(|p| p.into_inner()).insert(addr, buffer);
        out.write(addr);
        Ok(())
    })
}

/// Frees a buffer of `ferry_allocate_buffer` (by the address it returned). Any engine, or none,
/// may be alive.
///
/// Refused with `FERRY_E_BUSY` while a live engine (of this process's C API) still has a region
/// overlapping the buffer registered, and while the engine that allocated it still holds such a
/// region (it was destroyed while transfers used it): unregister it first (or destroy the engine
/// with `FERRY_OK`); the buffer then stays allocated and may be freed later. Returns
/// `FERRY_E_NOT_FOUND` when `addr` is not the address of a buffer that is still allocated (a
/// second free included).
#[unsafe(no_mangle)]
pub extern "C" fn ferry_free_buffer(addr: u64) -> i32 {
    guard("ferry_free_buffer", || {
        let mut buffers = BUFFERS.lock().unwrap_or_else(|p| p.into_inner());
        let Some(buffer) = buffers.remove(&addr) else {
            return Err(Error::not_found(format!("{addr:#x} is not a buffer of ferry_allocate_buffer (or was freed)")));
        };
        for e in ENGINES.values() {
            if let Some(region) = e.memory().overlapping(addr, buffer.len() as u64) {
                buffers.insert(addr, buffer);
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "buffer {addr:#x} is still registered with engine `{}` (region {:#x}+{}); unregister it first",
                        e.segment_name(),
                        region.addr(),
                        region.len()
                    ),
                ));
            }
        }
        match buffer.free() {
            Ok(()) => Ok(()),
            Err((buffer, e)) => {
                buffers.insert(addr, buffer);
                Err(e)
            }
        }
    })
}

/// Opens the peer segment `name` (a segment name such as `127.0.0.1:15342`, as its owner's
/// `ferry_engine_segment_name` reports; the engine's own name works too) and stores its handle
/// in `*out_segment`, for `FerryTransferRequest.target` and `ferry_kv_submit_blocks`.
///
/// Opening the same name again returns the same handle. Segment handles belong to the engine
/// that opened them.
///
/// Returns `FERRY_E_NOT_FOUND` when no such segment is published, `FERRY_E_PEER_UNREACHABLE`
/// when the metadata service (or, with `P2PHANDSHAKE`, the peer) cannot be reached,
/// `FERRY_E_UNSUPPORTED` when no installed transport serves its protocol.
///
/// # Safety
/// `name` is a NUL-terminated string; `out_segment` is valid for writing one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_open_segment(engine: FerryEngine, name: *const c_char, out_segment: *mut u64) -> i32 {
    guard("ferry_open_segment", || {
        // SAFETY: the caller passes a NUL-terminated string (this function's contract).
        let name = unsafe { str_arg(name, "name") }?;
        // SAFETY: the caller promises `out_segment` is valid for one write (this function's
        // contract).
        let out = unsafe { Out::new(out_segment, "out_segment") }?;
        if name.is_empty() {
            return Err(invalid("`name` is empty"));
        }
        let e = self::engine(engine)?;
        out.write(e.open_segment_blocking(name)?.raw());
        Ok(())
    })
}

/// Forgets an opened segment; its handle becomes invalid (`FERRY_E_NOT_FOUND` from then on).
/// Batches already submitted to it are not affected.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_close_segment(engine: FerryEngine, segment: u64) -> i32 {
    guard("ferry_close_segment", || {
        let e = self::engine(engine)?;
        e.segment_handle(segment)
            .and_then(|h| e.close_segment(h))
            .map_err(|err| Error::new(ErrorKind::NotFound, format!("engine `{}`: {}", e.segment_name(), err.message())))
    })
}

/// Reads the buffers an opened segment publishes: stores their number in `*out_count` and the
/// first `cap` of them in `addrs[i]` / `lengths[i]`, in the order its descriptor lists them
/// (registration order, oldest first, for Ferry and Mooncake engines alike). These
/// are the remote addresses a transfer to that segment may name. Call with `cap = 0` (and null
/// arrays) to learn the count.
///
/// For another engine's segment the list is its descriptor as this engine last fetched it (when
/// the segment was opened, or refreshed after the peer re-published); buffers the peer
/// registered since may be missing until then. For this engine's own segment it is the live list.
///
/// Returns `FERRY_E_NOT_FOUND` for a segment handle this engine did not open (or closed).
///
/// # Safety
/// `addrs` and `lengths` are each NULL (then `cap` must be 0) or valid for writing `cap`
/// `uint64_t`s; `out_count` is valid for writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_segment_buffers(
    engine: FerryEngine,
    segment: u64,
    addrs: *mut u64,
    lengths: *mut u64,
    cap: usize,
    out_count: *mut usize,
) -> i32 {
    guard("ferry_segment_buffers", || {
        // SAFETY: the caller promises `out_count` is valid for one write (this function's
        // contract).
        let count = unsafe { Out::new(out_count, "out_count") }?;
        // SAFETY: the caller promises each array is NULL with `cap == 0` or valid for `cap`
        // writes (this function's contract).
        let (addr_out, len_out) =
            unsafe { (OutArray::new(addrs, cap, "addrs")?, OutArray::new(lengths, cap, "lengths")?) };
        let e = self::engine(engine)?;
        let seg = e.segment(e.segment_handle(segment)?)?;
        // The engine's own segment is answered from its live registrations, not from the copy
        // fetched when it was opened.
        let own = (seg.name() == e.segment_name()).then(|| e.local_descriptor());
        let buffers = &own.as_ref().unwrap_or_else(|| seg.descriptor()).buffers;
        count.write(buffers.len());
        let listed = &buffers[..buffers.len().min(addr_out.len())];
        addr_out.fill(&listed.iter().map(|b| b.addr).collect::<Vec<_>>());
        len_out.fill(&listed.iter().map(|b| b.length).collect::<Vec<_>>());
        Ok(())
    })
}

//! Batches: submit, poll, wait, cancel, free, and the one-call synchronous transfer.

use std::time::Duration;

use ferry::{Batch, BlockBatch, ErrorKind, Opcode, RequestStatus, TransferRequest};
use ferry_abi::{
    FERRY_E_CANCELLED, FERRY_OK, FERRY_OPCODE_READ, FERRY_OPCODE_WRITE, FERRY_STATE_CANCELLED, FERRY_STATE_COMPLETED,
    FERRY_STATE_FAILED, FERRY_STATE_PENDING, FerryTransferRequest, FerryTransferStatus,
};

use crate::engine::engine;
use crate::errors::{CResult, Out, OutArray, code_of, guard, invalid, slice_arg};
use crate::handles::{BATCH_TAG, HandleTable};
use crate::{FerryBatch, FerryEngine};

/// A submitted batch as the C API holds it.
pub(crate) struct BatchEntry {
    batch: Batch,
    /// The submitting engine's transfer timeout (what a wait of 0 ms means).
    timeout: Duration,
    /// For batches from `ferry_kv_submit_blocks`: the runs, to map failures back to blocks.
    blocks: Option<BlockBatch>,
}

/// Every batch not yet freed.
pub(crate) static BATCHES: HandleTable<BatchEntry> = HandleTable::new(BATCH_TAG, "batch", "freed");

/// Gives a submitted batch a handle; if that fails, cancels it (nobody could reach it).
pub(crate) fn insert(batch: Batch, timeout: Duration, blocks: Option<BlockBatch>) -> CResult<FerryBatch> {
    let keep = batch.clone();
    BATCHES.insert(BatchEntry { batch, timeout, blocks }).inspect_err(|_| keep.cancel())
}

/// Parses a `FERRY_OPCODE_*` value; `what` names it in the error.
pub(crate) fn opcode(value: u32, what: &str) -> CResult<Opcode> {
    match value {
        FERRY_OPCODE_READ => Ok(Opcode::Read),
        FERRY_OPCODE_WRITE => Ok(Opcode::Write),
        other => Err(invalid(format!(
            "{what} is {other}, not FERRY_OPCODE_READ ({FERRY_OPCODE_READ}) or FERRY_OPCODE_WRITE ({FERRY_OPCODE_WRITE})"
        ))),
    }
}

/// Converts the C requests (bounds are checked by the engine at submit; each integer target
/// must be a segment `e` has open).
fn requests(e: &ferry::TransferEngine, requests: &[FerryTransferRequest]) -> CResult<Vec<TransferRequest>> {
    // The last target checked (a batch usually names one): one lookup per change of target.
    let mut last: Option<(u64, ferry::SegmentHandle)> = None;
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if r.flags != 0 {
                return Err(invalid(format!("request {i}: flags is {}, but it is reserved and must be 0", r.flags)));
            }
            let opcode = opcode(r.opcode, &format!("request {i}: opcode"))?;
            let target = match last {
                Some((raw, h)) if raw == r.target => h,
                _ => {
                    let h = e
                        .segment_handle(r.target)
                        .map_err(|err| err.context(format!("request {i}: {}", err.message())))?;
                    last = Some((r.target, h));
                    h
                }
            };
            Ok(TransferRequest { opcode, source: r.local_addr, target, target_offset: r.remote_addr, length: r.length })
        })
        .collect()
}

/// Checks and converts the `requests`/`count` arguments.
///
/// # Safety
/// As for `ferry_submit`'s `requests`.
unsafe fn request_args(
    e: &ferry::TransferEngine,
    ptr: *const FerryTransferRequest,
    count: usize,
) -> CResult<Vec<TransferRequest>> {
    if count == 0 {
        return Err(invalid("`count` is 0: a batch needs at least one request"));
    }
    // SAFETY: the caller's contract: `ptr` points to `count` requests.
    requests(e, unsafe { slice_arg(ptr, count, "requests") }?)
}

fn wait_timeout(timeout_ms: u64, default: Duration) -> Duration {
    if timeout_ms == 0 { default } else { Duration::from_millis(timeout_ms) }
}

/// Submits `count` requests to the engine and stores the batch's handle in `*out`.
///
/// Each request moves `length` bytes between local address `local_addr` (inside memory
/// registered with this engine) and `remote_addr` in segment `target` (a handle from
/// `ferry_open_segment`, inside a buffer the peer registered); `opcode` is
/// `FERRY_OPCODE_READ` (remote to local) or `FERRY_OPCODE_WRITE`; `flags` must be 0. Every
/// request is checked before any starts: when one is invalid nothing is submitted, the result
/// is its error (`FERRY_E_OUT_OF_BOUNDS` for a range outside registered memory,
/// `FERRY_E_NOT_FOUND` for an unknown segment handle, `FERRY_E_INVALID_ARGUMENT` for a zero
/// length or a bad opcode) and the last error names the request's index.
///
/// Do not touch a destination range until its request completed, and do not run two requests
/// into overlapping destinations at once. Free the batch with `ferry_batch_free`.
///
/// # Safety
/// `requests` points to `count` initialised `FerryTransferRequest`s; `out` is valid for
/// writing one `FerryBatch`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_submit(
    engine: FerryEngine,
    requests: *const FerryTransferRequest,
    count: usize,
    out: *mut FerryBatch,
) -> i32 {
    guard("ferry_submit", || {
        let e = self::engine(engine)?;
        // SAFETY: the caller promises `requests` holds `count` requests (this function's contract).
        let reqs = unsafe { request_args(&e, requests, count) }?;
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        let batch = e.submit_blocking(&reqs)?;
        out.write(insert(batch, e.transfer_timeout(), None)?);
        Ok(())
    })
}

fn status_of(batch: &Batch, i: usize) -> FerryTransferStatus {
    match batch.request_status(i) {
        Some(RequestStatus::Completed) => FerryTransferStatus {
            state: FERRY_STATE_COMPLETED,
            code: FERRY_OK,
            transferred: batch.request(i).map_or(0, |v| v.request.length),
        },
        Some(RequestStatus::Failed(kind)) => {
            FerryTransferStatus { state: FERRY_STATE_FAILED, code: code_of(kind), transferred: 0 }
        }
        Some(RequestStatus::Cancelled) => {
            FerryTransferStatus { state: FERRY_STATE_CANCELLED, code: FERRY_E_CANCELLED, transferred: 0 }
        }
        Some(RequestStatus::Pending) | None => {
            FerryTransferStatus { state: FERRY_STATE_PENDING, code: FERRY_OK, transferred: 0 }
        }
    }
}

/// Reports the state of each request without blocking: writes `count` statuses to `statuses`
/// (state `FERRY_STATE_*`, `code` the `FERRY_E_*` of a failed or cancelled request, bytes
/// transferred) and the number of requests still pending to `*pending`.
///
/// `count` is 0 (then `statuses` may be NULL and only `*pending` is set) or the batch's
/// length (`ferry_batch_len`; for `ferry_submit`, the number of requests submitted): anything
/// else is `FERRY_E_INVALID_ARGUMENT`. A failed request does not make the poll fail.
///
/// # Safety
/// `statuses` is valid for writing `count` `FerryTransferStatus`es (or NULL with `count`
/// 0); `pending` is valid for writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_poll(
    batch: FerryBatch,
    statuses: *mut FerryTransferStatus,
    count: usize,
    pending: *mut usize,
) -> i32 {
    guard("ferry_batch_poll", || {
        // SAFETY: the caller promises `statuses` is valid for `count` writes (this function's
        // contract).
        let statuses = unsafe { OutArray::new(statuses, count, "statuses") }?;
        // SAFETY: the caller promises `pending` is valid for one write (this function's contract).
        let pending = unsafe { Out::new(pending, "pending") }?;
        let entry = BATCHES.get(batch)?;
        let b = &entry.batch;
        if statuses.len() == 0 {
            pending.write(b.status().pending);
            return Ok(());
        }
        if statuses.len() != b.len() {
            return Err(invalid(format!(
                "`count` is {count} but batch {batch} has {} request(s): pass its length or 0",
                b.len()
            )));
        }
        let all: Vec<FerryTransferStatus> = (0..b.len()).map(|i| status_of(b, i)).collect();
        pending.write(all.iter().filter(|s| s.state == FERRY_STATE_PENDING).count());
        statuses.fill(&all);
        Ok(())
    })
}

/// Blocks the calling thread until no request of the batch is pending, or `timeout_ms`
/// milliseconds passed (0: the engine's transfer timeout, `transfer_timeout_ms`, 30 s by
/// default).
///
/// Returns `FERRY_OK` when every request completed; otherwise the code of the failed (or
/// cancelled) request with the lowest index, and the last error says how many failed and why;
/// `FERRY_E_TIMEOUT` when requests are still pending at the deadline (the batch keeps running:
/// wait again or cancel it). Other threads' calls are not held up while it waits.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_batch_wait(batch: FerryBatch, timeout_ms: u64) -> i32 {
    guard("ferry_batch_wait", || {
        let entry = BATCHES.get(batch)?;
        entry.batch.wait_ok_blocking(wait_timeout(timeout_ms, entry.timeout))
    })
}

/// Cancels every request of the batch that has not completed yet: they report
/// `FERRY_STATE_CANCELLED` at once, and `ferry_batch_wait` returns `FERRY_E_CANCELLED`. A
/// request a transport had already started may still touch its memory until the transport lets
/// go of it: reuse a cancelled request's destination only once `ferry_batch_released` reports 1
/// (registered memory cannot be unregistered before that either). Cancelling a finished batch
/// does nothing.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_batch_cancel(batch: FerryBatch) -> i32 {
    guard("ferry_batch_cancel", || {
        BATCHES.get(batch)?.batch.cancel();
        Ok(())
    })
}

/// Frees the batch's handle (a second free returns `FERRY_E_NOT_FOUND`). Requests still pending
/// are cancelled first (see `ferry_batch_cancel`). Registered memory stays protected from
/// unregistration until the transports let go of it, whether or not the batch was freed.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_batch_free(batch: FerryBatch) -> i32 {
    guard("ferry_batch_free", || {
        let entry = BATCHES.remove(batch)?;
        if !entry.batch.is_done() {
            entry.batch.cancel();
        }
        Ok(())
    })
}

/// Stores 1 in `*released` once the transports have let go of every request of the batch (none
/// of its memory is touched any more, cancelled requests included), else 0. A batch whose
/// requests all completed or failed is released; a cancelled one may take until its requests'
/// transfer deadline.
///
/// # Safety
/// `released` is valid for writing one `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_released(batch: FerryBatch, released: *mut i32) -> i32 {
    guard("ferry_batch_released", || {
        // SAFETY: the caller promises `released` is valid for one write (this function's
        // contract).
        let out = unsafe { Out::new(released, "released") }?;
        out.write(i32::from(BATCHES.get(batch)?.batch.all_released()));
        Ok(())
    })
}

/// Stores the number of requests in the batch in `*out` (for `ferry_batch_poll`; a batch from
/// `ferry_kv_submit_blocks` has one request per merged run of blocks).
///
/// # Safety
/// `out` is valid for writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_len(batch: FerryBatch, out: *mut usize) -> i32 {
    guard("ferry_batch_len", || {
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        out.write(BATCHES.get(batch)?.batch.len());
        Ok(())
    })
}

/// For a batch from `ferry_kv_submit_blocks`: copies the local block ids whose transfer failed
/// or was cancelled (sorted, no duplicates) into `blocks` (room for `cap` ids) and stores how
/// many there are in `*count`. Call it after the batch finished.
///
/// Returns `FERRY_E_INVALID_ARGUMENT` when `cap < *count` (the first `cap` ids are copied,
/// `*count` is set: pass `blocks = NULL, cap = 0` to learn the size) or when the batch was
/// made by `ferry_submit`.
///
/// # Safety
/// `blocks` is valid for writing `cap` `uint32_t`s (or NULL with `cap` 0); `count` is valid
/// for writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_failed_blocks(
    batch: FerryBatch,
    blocks: *mut u32,
    cap: usize,
    count: *mut usize,
) -> i32 {
    guard("ferry_batch_failed_blocks", || {
        // SAFETY: the caller promises `blocks` is valid for `cap` writes (this function's
        // contract).
        let blocks = unsafe { OutArray::new(blocks, cap, "blocks") }?;
        // SAFETY: the caller promises `count` is valid for one write (this function's contract).
        let count = unsafe { Out::new(count, "count") }?;
        let entry = BATCHES.get(batch)?;
        let kv = entry.blocks.as_ref().ok_or_else(|| {
            invalid(format!("batch {batch} was made by ferry_submit, not ferry_kv_submit_blocks: it has no blocks"))
        })?;
        let failed = kv.failed_blocks();
        count.write(failed.len());
        blocks.fill(&failed);
        if cap < failed.len() {
            return Err(invalid(format!(
                "`cap` is {cap} but {} block(s) failed; `*count` holds the number",
                failed.len()
            )));
        }
        Ok(())
    })
}

/// Submits `count` requests (as `ferry_submit`) and waits for them (as `ferry_batch_wait`,
/// `timeout_ms` 0 meaning the engine's transfer timeout) in one call; returns the same codes.
/// On `FERRY_E_TIMEOUT` the requests still pending are cancelled.
///
/// # Safety
/// `requests` points to `count` initialised `FerryTransferRequest`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_transfer_sync(
    engine: FerryEngine,
    requests: *const FerryTransferRequest,
    count: usize,
    timeout_ms: u64,
) -> i32 {
    guard("ferry_transfer_sync", || {
        let e = self::engine(engine)?;
        // SAFETY: the caller promises `requests` holds `count` requests (this function's contract).
        let reqs = unsafe { request_args(&e, requests, count) }?;
        let wait = wait_timeout(timeout_ms, e.transfer_timeout());
        // This thread waits for the batch at once: a transport may run it on this thread, up to
        // the transfer timeout, so only when the caller would wait that long anyway.
        let batch =
            if wait >= e.transfer_timeout() { e.submit_for_blocking_wait(&reqs)? } else { e.submit_blocking(&reqs)? };
        let outcome = batch.wait_ok_blocking(wait);
        if outcome.as_ref().is_err_and(|err| err.kind() == ErrorKind::Timeout) {
            batch.cancel();
        }
        outcome
    })
}

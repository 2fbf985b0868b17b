//! The KV-block API: register a KV cache layout once, then move selected blocks.

use std::ffi::c_char;

use ferry::{BlockTransfer, ErrorKind, KvLayout};

use crate::batch::insert;
use crate::engine::engine;
use crate::errors::{Out, OutArray, guard, invalid, slice_arg, str_arg};
use crate::{FerryBatch, FerryEngine};

/// Registers a KV cache layout of local memory and stores its id in `*out_layout`.
///
/// The layout has `base_count` regions (for example one per layer and K/V tensor); region `i`
/// holds `block_count` blocks of `block_len` bytes starting at `bases[i]`. Block `b` of the
/// cache is block `b` of every region. Each region's bytes must lie inside one registered
/// memory region (`FERRY_E_OUT_OF_BOUNDS` otherwise). Layout ids belong to the engine.
///
/// Returns `FERRY_E_INVALID_ARGUMENT` for a zero `base_count`, `block_count` or `block_len`.
///
/// # Safety
/// `bases` points to `base_count` `uint64_t`s; `out_layout` is valid for writing one
/// `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_kv_layout_register(
    engine: FerryEngine,
    bases: *const u64,
    base_count: usize,
    block_count: u32,
    block_len: u64,
    out_layout: *mut u64,
) -> i32 {
    guard("ferry_kv_layout_register", || {
        // SAFETY: the caller promises `bases` holds `base_count` values (this function's contract).
        let bases = unsafe { slice_arg(bases, base_count, "bases") }?;
        // SAFETY: the caller promises `out_layout` is valid for one write (this function's
        // contract).
        let out = unsafe { Out::new(out_layout, "out_layout") }?;
        if bases.is_empty() {
            return Err(invalid("`base_count` is 0: a KV layout needs at least one region"));
        }
        let e = self::engine(engine)?;
        out.write(e.register_kv_layout(KvLayout::uniform(bases, block_count, block_len))?.raw());
        Ok(())
    })
}

/// Registers a KV cache layout of local memory, as `ferry_kv_layout_register` does, and
/// publishes it under `name` in this engine's segment descriptor, where a peer reads it with
/// `ferry_kv_remote_layout`; stores its id in `*out_layout`. Returns once the descriptor naming
/// it is published.
///
/// Returns `FERRY_E_ALREADY_EXISTS` when a layout of that name is published already,
/// `FERRY_E_INVALID_ARGUMENT` for an empty, over-long (128 bytes) or control-character name,
/// and the codes of `ferry_kv_layout_register`. `ferry_kv_layout_unregister` withdraws it.
///
/// # Safety
/// `name` is a NUL-terminated UTF-8 string; `bases` points to `base_count` `uint64_t`s;
/// `out_layout` is valid for writing one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_kv_layout_publish(
    engine: FerryEngine,
    name: *const c_char,
    bases: *const u64,
    base_count: usize,
    block_count: u32,
    block_len: u64,
    out_layout: *mut u64,
) -> i32 {
    guard("ferry_kv_layout_publish", || {
        // SAFETY: the caller promises `name` is a NUL-terminated string (this function's
        // contract).
        let name = unsafe { str_arg(name, "name") }?;
        // SAFETY: the caller promises `bases` holds `base_count` values (this function's contract).
        let bases = unsafe { slice_arg(bases, base_count, "bases") }?;
        // SAFETY: the caller promises `out_layout` is valid for one write (this function's
        // contract).
        let out = unsafe { Out::new(out_layout, "out_layout") }?;
        if bases.is_empty() {
            return Err(invalid("`base_count` is 0: a KV layout needs at least one region"));
        }
        let e = self::engine(engine)?;
        out.write(e.publish_kv_layout_blocking(name, KvLayout::uniform(bases, block_count, block_len))?.raw());
        Ok(())
    })
}

/// Reads the KV layout that the peer behind `segment` (a handle from `ferry_open_segment`)
/// publishes as `name`: copies its region bases into `bases` (room for `cap`), and stores the
/// number of regions in `*base_count`, the blocks per region in `*block_count` and the bytes
/// per block in `*block_len` — the arguments `ferry_kv_submit_blocks` takes for the remote
/// layout. When the cached descriptor does not name it, the descriptor is fetched again once.
///
/// Returns `FERRY_E_NOT_FOUND` (the message names the layouts the peer publishes),
/// `FERRY_E_INVALID_ARGUMENT` when `cap < *base_count` (the first `cap` bases are copied,
/// `*base_count` is set: pass `bases = NULL, cap = 0` to learn the size) or for a malformed
/// entry, `FERRY_E_UNSUPPORTED` for a layout whose regions differ in block length (publishable
/// from Rust, not expressible here).
///
/// # Safety
/// `name` is a NUL-terminated UTF-8 string; `bases` is valid for writing `cap` `uint64_t`s (or
/// NULL with `cap` 0); `base_count`, `block_count` and `block_len` are each valid for one write.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "a C signature: one out-pointer per field")]
pub unsafe extern "C" fn ferry_kv_remote_layout(
    engine: FerryEngine,
    segment: u64,
    name: *const c_char,
    bases: *mut u64,
    cap: usize,
    base_count: *mut usize,
    block_count: *mut u32,
    block_len: *mut u64,
) -> i32 {
    guard("ferry_kv_remote_layout", || {
        // SAFETY: the caller promises `name` is a NUL-terminated string (this function's
        // contract).
        let name = unsafe { str_arg(name, "name") }?;
        // SAFETY: the caller promises `bases` is valid for `cap` writes (this function's contract).
        let bases = unsafe { OutArray::new(bases, cap, "bases") }?;
        // SAFETY: the caller promises each of these is valid for one write (this function's
        // contract).
        let (count, blocks, len) = unsafe {
            (
                Out::new(base_count, "base_count")?,
                Out::new(block_count, "block_count")?,
                Out::new(block_len, "block_len")?,
            )
        };
        let e = self::engine(engine)?;
        let layout = e.remote_kv_layout_blocking(e.segment_handle(segment)?, name)?;
        let first_len = layout.regions[0].block_len;
        if layout.regions.iter().any(|r| r.block_len != first_len) {
            return Err(ferry::Error::new(
                ErrorKind::Unsupported,
                format!("KV layout `{name}` has regions of different block lengths, which the C API cannot express"),
            ));
        }
        let region_bases: Vec<u64> = layout.regions.iter().map(|r| r.base).collect();
        count.write(region_bases.len());
        blocks.write(layout.block_count);
        len.write(first_len);
        bases.fill(&region_bases);
        if cap < region_bases.len() {
            return Err(invalid(format!(
                "`cap` is {cap} but layout `{name}` has {} regions; `*base_count` holds the number",
                region_bases.len()
            )));
        }
        Ok(())
    })
}

/// Forgets a KV layout registered with `ferry_kv_layout_register` or
/// `ferry_kv_layout_publish` (`FERRY_E_NOT_FOUND` when it is not registered); a published one
/// leaves the descriptor with a re-publication started at once.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_kv_layout_unregister(engine: FerryEngine, layout: u64) -> i32 {
    guard("ferry_kv_layout_unregister", || {
        let e = self::engine(engine)?;
        e.unregister_kv_layout(e.kv_layout_id(layout)?)
    })
}

/// Moves selected blocks between the local layout `local_layout` and the peer's layout in
/// segment `segment` (a handle from `ferry_open_segment`), and stores the batch's handle in
/// `*out`.
///
/// The peer's layout is given as the peer described it: `remote_base_count` region bases (as
/// many as the local layout has regions, in the same order), each with `remote_block_count`
/// blocks of `remote_block_len` bytes. `local_blocks[i]` pairs with `remote_blocks[i]`, for
/// `block_count` pairs; `opcode` `FERRY_OPCODE_READ` pulls remote blocks into local ones,
/// `FERRY_OPCODE_WRITE` pushes local blocks to remote ones. Adjacent blocks are merged into one
/// request per run and region (`ferry_batch_len` says how many); after the batch finished,
/// `ferry_batch_failed_blocks` names the local blocks that did not move.
///
/// Returns `FERRY_E_OUT_OF_BOUNDS` for a block id past its layout, `FERRY_E_INVALID_ARGUMENT`
/// for a region-count or block-length mismatch, a destination block named twice, or a zero
/// count; `FERRY_E_NOT_FOUND` for an unknown layout or segment.
///
/// # Safety
/// `remote_bases` points to `remote_base_count` `uint64_t`s; `local_blocks` and
/// `remote_blocks` each point to `block_count` `uint32_t`s; `out` is valid for writing one
/// `FerryBatch`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "the C signature is fixed by the API spec")]
pub unsafe extern "C" fn ferry_kv_submit_blocks(
    engine: FerryEngine,
    local_layout: u64,
    segment: u64,
    remote_bases: *const u64,
    remote_base_count: usize,
    remote_block_count: u32,
    remote_block_len: u64,
    opcode: u32,
    local_blocks: *const u32,
    remote_blocks: *const u32,
    block_count: usize,
    out: *mut FerryBatch,
) -> i32 {
    guard("ferry_kv_submit_blocks", || {
        let remote = RemoteLayoutArgs {
            bases: remote_bases,
            base_count: remote_base_count,
            block_count: remote_block_count,
            block_len: remote_block_len,
        };
        // SAFETY: this function's contract is submit_blocks's, with no region subset.
        unsafe {
            submit_blocks(
                engine,
                local_layout,
                segment,
                remote,
                opcode,
                (local_blocks, remote_blocks, block_count),
                None,
                out,
            )
        }
    })
}

/// As `ferry_kv_submit_blocks`, moving only the regions `regions[0..region_count]` (indices
/// into both layouts' regions, each at most once, in that order): a layer subset, for
/// layer-wise transfers (layer `l`'s K and V are regions `2l` and `2l + 1` in a layout that
/// lists K and V per layer).
///
/// Returns `FERRY_E_OUT_OF_BOUNDS` for a region index past the layouts' regions,
/// `FERRY_E_INVALID_ARGUMENT` for a region named twice or `region_count` 0, and the codes of
/// `ferry_kv_submit_blocks`.
///
/// # Safety
/// As for `ferry_kv_submit_blocks`, and `regions` points to `region_count` `uint32_t`s.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "ferry_kv_submit_blocks's arguments and the subset")]
pub unsafe extern "C" fn ferry_kv_submit_block_regions(
    engine: FerryEngine,
    local_layout: u64,
    segment: u64,
    remote_bases: *const u64,
    remote_base_count: usize,
    remote_block_count: u32,
    remote_block_len: u64,
    opcode: u32,
    local_blocks: *const u32,
    remote_blocks: *const u32,
    block_count: usize,
    regions: *const u32,
    region_count: usize,
    out: *mut FerryBatch,
) -> i32 {
    guard("ferry_kv_submit_block_regions", || {
        // SAFETY: the caller promises `regions` holds `region_count` values (this function's
        // contract).
        let regions = unsafe { slice_arg(regions, region_count, "regions") }?;
        if regions.is_empty() {
            return Err(invalid("`region_count` is 0: name at least one region (or call ferry_kv_submit_blocks)"));
        }
        let remote = RemoteLayoutArgs {
            bases: remote_bases,
            base_count: remote_base_count,
            block_count: remote_block_count,
            block_len: remote_block_len,
        };
        // SAFETY: this function's contract is submit_blocks's.
        unsafe {
            submit_blocks(
                engine,
                local_layout,
                segment,
                remote,
                opcode,
                (local_blocks, remote_blocks, block_count),
                Some(regions),
                out,
            )
        }
    })
}

/// The remote layout as the C functions take it.
struct RemoteLayoutArgs {
    bases: *const u64,
    base_count: usize,
    block_count: u32,
    block_len: u64,
}

/// The body of the two submit functions.
///
/// # Safety
/// `remote.bases` points to `remote.base_count` `uint64_t`s; both block pointers point to
/// `block_count` `uint32_t`s; `out` is valid for writing one `FerryBatch`.
#[allow(clippy::too_many_arguments, reason = "the C functions' arguments, grouped")]
unsafe fn submit_blocks(
    engine: FerryEngine,
    local_layout: u64,
    segment: u64,
    remote: RemoteLayoutArgs,
    opcode: u32,
    (local_blocks, remote_blocks, block_count): (*const u32, *const u32, usize),
    regions: Option<&[u32]>,
    out: *mut FerryBatch,
) -> crate::errors::CResult<()> {
    // SAFETY: the caller promises `remote.bases` holds `remote.base_count` values.
    let remote_bases = unsafe { slice_arg(remote.bases, remote.base_count, "remote_bases") }?;
    // SAFETY: the caller promises `local_blocks` holds `block_count` ids.
    let local_blocks = unsafe { slice_arg(local_blocks, block_count, "local_blocks") }?;
    // SAFETY: as above, for `remote_blocks`.
    let remote_blocks = unsafe { slice_arg(remote_blocks, block_count, "remote_blocks") }?;
    // SAFETY: the caller promises `out` is valid for one write.
    let out = unsafe { Out::new(out, "out") }?;
    if remote_bases.is_empty() {
        return Err(invalid("`remote_base_count` is 0: the remote layout needs at least one region"));
    }
    if block_count == 0 {
        return Err(invalid("`block_count` is 0: no blocks to transfer"));
    }
    let mut spec = BlockTransfer::new(crate::batch::opcode(opcode, "`opcode`")?, local_blocks, remote_blocks);
    spec.regions = regions;
    let remote = KvLayout::uniform(remote_bases, remote.block_count, remote.block_len);
    let e = self::engine(engine)?;
    let (local, target) = (e.kv_layout_id(local_layout)?, e.segment_handle(segment)?);
    let blocks = e.submit_blocks_blocking(local, target, &remote, &spec)?;
    out.write(insert(blocks.batch().clone(), e.transfer_timeout(), Some(blocks))?);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn opcode_names_the_argument() {
        let e = crate::batch::opcode(7, "`opcode`").unwrap_err();
        assert!(e.message().contains("`opcode` is 7"), "{e}");
    }
}

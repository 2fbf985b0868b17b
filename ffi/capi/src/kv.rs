//! The KV-block API: register a KV cache layout once, then move selected blocks.

use ferry::{BlockTransfer, KvLayout};

use crate::batch::insert;
use crate::engine::engine;
use crate::errors::{Out, guard, invalid, slice_arg};
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

/// Forgets a KV layout registered with `ferry_kv_layout_register`
/// (`FERRY_E_NOT_FOUND` when it is not registered).
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
        // SAFETY: the caller promises `remote_bases` holds `remote_base_count` values (this
        // function's contract).
        let remote_bases = unsafe { slice_arg(remote_bases, remote_base_count, "remote_bases") }?;
        // SAFETY: the caller promises `local_blocks` holds `block_count` ids (this function's
        // contract).
        let local_blocks = unsafe { slice_arg(local_blocks, block_count, "local_blocks") }?;
        // SAFETY: as above, for `remote_blocks`.
        let remote_blocks = unsafe { slice_arg(remote_blocks, block_count, "remote_blocks") }?;
        // SAFETY: the caller promises `out` is valid for one write (this function's contract).
        let out = unsafe { Out::new(out, "out") }?;
        if remote_bases.is_empty() {
            return Err(invalid("`remote_base_count` is 0: the remote layout needs at least one region"));
        }
        if block_count == 0 {
            return Err(invalid("`block_count` is 0: no blocks to transfer"));
        }
        let spec = BlockTransfer {
            opcode: crate::batch::opcode(opcode, "`opcode`")?,
            local_blocks,
            remote_blocks,
            local_slice: None,
            remote_slice: None,
        };
        let remote = KvLayout::uniform(remote_bases, remote_block_count, remote_block_len);
        let e = self::engine(engine)?;
        let (local, target) = (e.kv_layout_id(local_layout)?, e.segment_handle(segment)?);
        let blocks = e.submit_blocks_blocking(local, target, &remote, &spec)?;
        out.write(insert(blocks.batch().clone(), e.transfer_timeout(), Some(blocks))?);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn opcode_names_the_argument() {
        let e = crate::batch::opcode(7, "`opcode`").unwrap_err();
        assert!(e.message().contains("`opcode` is 7"), "{e}");
    }
}

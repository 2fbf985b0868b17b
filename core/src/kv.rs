//! The KV-block API: describe a KV cache as regions × blocks, name the blocks to move, and let
//! Ferry turn them into as few requests as possible (adjacent blocks merged), with per-block
//! failure reporting.
//!
//! This is the fix for the seed's open problem: the reference connector sent the whole KV cache
//! because it tracked buffers with a global counter. Here a caller moves exactly the blocks a
//! request owns.

use serde::{Deserialize, Serialize};

use crate::batch::{Opcode, SegmentHandle, TransferRequest};
use crate::error::{Error, Result};

/// One region of a KV cache (for example one layer's K tensor): `block_count` blocks of
/// `block_len` bytes starting at `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvRegion {
    /// Address of block 0 (in the owner's address space).
    pub base: u64,
    /// Bytes per block in this region (K and V of one layer may differ, e.g. with MLA).
    pub block_len: u64,
}

/// A KV cache layout: every region has the same number of blocks; block `i` of the cache is
/// block `i` of every region. Serialisable, so a peer can send its layout in its own handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Regions, in the same order on both sides of a transfer (layer 0 K, layer 0 V, ...).
    pub regions: Vec<KvRegion>,
    /// Blocks per region.
    pub block_count: u32,
}

impl KvLayout {
    /// Layout of `regions` bases, each with `block_count` blocks of `block_len` bytes.
    pub fn uniform(bases: &[u64], block_count: u32, block_len: u64) -> Self {
        Self { regions: bases.iter().map(|&base| KvRegion { base, block_len }).collect(), block_count }
    }

    /// Checks that the layout is non-empty and that no region wraps around the address space.
    /// Returns each region's `(base, byte length)`.
    pub fn validate(&self) -> Result<Vec<(u64, u64)>> {
        if self.regions.is_empty() {
            return Err(Error::invalid("KV layout has no regions"));
        }
        if self.block_count == 0 {
            return Err(Error::invalid("KV layout has zero blocks"));
        }
        self.regions
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if r.block_len == 0 {
                    return Err(Error::invalid(format!("KV layout region {i} has zero block length")));
                }
                let len = r.block_len.checked_mul(u64::from(self.block_count));
                match len.and_then(|l| r.base.checked_add(l).map(|_| l)) {
                    Some(l) => Ok((r.base, l)),
                    None => Err(Error::out_of_bounds(format!(
                        "KV layout region {i} ({} blocks of {} bytes at {:#x}) wraps around the address space",
                        self.block_count, r.block_len, r.base
                    ))),
                }
            })
            .collect()
    }
}

/// A byte range inside every block (for heterogeneous tensor parallelism, where one side holds
/// a slice of the other's block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSlice {
    /// Offset inside the block.
    pub offset: u64,
    /// Length (non-zero).
    pub len: u64,
}

/// Which blocks to move and how.
#[derive(Debug, Clone, Copy)]
pub struct BlockTransfer<'a> {
    /// Read pulls remote blocks into local ones; write pushes local blocks to remote ones.
    pub opcode: Opcode,
    /// Local block ids; `local_blocks[i]` pairs with `remote_blocks[i]`.
    pub local_blocks: &'a [u32],
    /// Remote block ids.
    pub remote_blocks: &'a [u32],
    /// Part of each local block to move (`None`: the whole block).
    pub local_slice: Option<BlockSlice>,
    /// Part of each remote block to move (`None`: the whole block).
    pub remote_slice: Option<BlockSlice>,
}

/// One request of a plan: a run of adjacent block pairs in one region, merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRun {
    /// Region index.
    pub region: u32,
    /// Index into the pair lists of the first pair in the run.
    pub first_pair: u32,
    /// Number of pairs merged into this run.
    pub pairs: u32,
    /// Local start address.
    pub local_addr: u64,
    /// Remote start address.
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
}

impl BlockRun {
    /// The request this run becomes.
    pub fn to_request(&self, opcode: Opcode, target: SegmentHandle) -> TransferRequest {
        TransferRequest { opcode, source: self.local_addr, target, target_offset: self.remote_addr, length: self.len }
    }
}

fn slice_of(region: usize, side: &str, slice: Option<BlockSlice>, block_len: u64) -> Result<(u64, u64)> {
    match slice {
        None => Ok((0, block_len)),
        Some(s) if s.len == 0 => Err(Error::invalid(format!("{side} block slice has zero length"))),
        Some(s) if s.offset.checked_add(s.len).is_none_or(|end| end > block_len) => Err(Error::out_of_bounds(format!(
            "{side} block slice {}+{} does not fit in region {region}'s {block_len}-byte blocks",
            s.offset, s.len
        ))),
        Some(s) => Ok((s.offset, s.len)),
    }
}

/// Turns a block transfer into merged runs.
///
/// Validates: both layouts, equal region counts, equal pair-list lengths, every id below its
/// layout's block count ([`ErrorKind::OutOfBounds`](crate::ErrorKind::OutOfBounds)), slices inside blocks, equal
/// byte lengths on both sides per region, and no destination block named twice. Pairs `i` and
/// `i + 1` merge when both ids advance by one and both sides move whole blocks (so the bytes
/// are contiguous on both sides). Runs come out region by region, in pair order.
pub fn plan_block_transfer(local: &KvLayout, remote: &KvLayout, spec: &BlockTransfer<'_>) -> Result<Vec<BlockRun>> {
    local.validate().map_err(|e| Error::new(e.kind(), format!("local {}", e.message())))?;
    remote.validate().map_err(|e| Error::new(e.kind(), format!("remote {}", e.message())))?;
    if local.regions.len() != remote.regions.len() {
        return Err(Error::invalid(format!(
            "local layout has {} regions, remote has {}",
            local.regions.len(),
            remote.regions.len()
        )));
    }
    let (lb, rb) = (spec.local_blocks, spec.remote_blocks);
    if lb.len() != rb.len() {
        return Err(Error::invalid(format!("{} local block ids but {} remote block ids", lb.len(), rb.len())));
    }
    if lb.is_empty() {
        return Err(Error::invalid("no blocks to transfer"));
    }
    if lb.len() > u32::MAX as usize {
        return Err(Error::invalid("too many blocks in one transfer"));
    }
    for (side, ids, count) in [("local", lb, local.block_count), ("remote", rb, remote.block_count)] {
        if let Some((i, id)) = ids.iter().enumerate().find(|&(_, &id)| id >= count) {
            return Err(Error::out_of_bounds(format!(
                "{side} block id {id} (position {i}) is out of range: the layout has {count} blocks"
            )));
        }
    }
    let (dest_side, dest) = match spec.opcode {
        Opcode::Write => ("remote", rb),
        Opcode::Read => ("local", lb),
    };
    let mut sorted = dest.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(format!("{dest_side} block id {} is a destination more than once", w[0])));
    }

    let mut runs = Vec::new();
    for (r, (lr, rr)) in local.regions.iter().zip(&remote.regions).enumerate() {
        let (l_off, l_len) = slice_of(r, "local", spec.local_slice, lr.block_len)?;
        let (r_off, r_len) = slice_of(r, "remote", spec.remote_slice, rr.block_len)?;
        if l_len != r_len {
            return Err(Error::invalid(format!(
                "length mismatch in region {r}: local moves {l_len} bytes per block, remote {r_len}"
            )));
        }
        let mergeable = l_len == lr.block_len && r_len == rr.block_len;
        let mut i = 0usize;
        while i < lb.len() {
            let mut n = 1usize;
            while mergeable
                && i + n < lb.len()
                && u64::from(lb[i + n]) == u64::from(lb[i]) + n as u64
                && u64::from(rb[i + n]) == u64::from(rb[i]) + n as u64
            {
                n += 1;
            }
            // In range by validate(): id < block_count and base + block_count*block_len fits.
            runs.push(BlockRun {
                region: r as u32,
                first_pair: i as u32,
                pairs: n as u32,
                local_addr: lr.base + u64::from(lb[i]) * lr.block_len + l_off,
                remote_addr: rr.base + u64::from(rb[i]) * rr.block_len + r_off,
                len: l_len * n as u64,
            });
            i += n;
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use proptest::prelude::*;

    fn spec<'a>(l: &'a [u32], r: &'a [u32]) -> BlockTransfer<'a> {
        BlockTransfer { opcode: Opcode::Read, local_blocks: l, remote_blocks: r, local_slice: None, remote_slice: None }
    }

    #[test]
    fn adjacent_blocks_merge() {
        let local = KvLayout::uniform(&[0x1000, 0x10_0000], 16, 256);
        let remote = KvLayout::uniform(&[0x9000, 0x90_0000], 16, 256);
        let runs = plan_block_transfer(&local, &remote, &spec(&[1, 2, 3, 7, 8], &[4, 5, 6, 9, 11])).unwrap();
        // Region 0: [1..4)->[4..7) merged, 7->9 and 8->11 separate (remote not adjacent).
        assert_eq!(runs.len(), 6);
        assert_eq!(
            runs[0],
            BlockRun {
                region: 0,
                first_pair: 0,
                pairs: 3,
                local_addr: 0x1000 + 256,
                remote_addr: 0x9000 + 4 * 256,
                len: 768
            }
        );
        assert_eq!(runs[1].pairs, 1);
        assert_eq!(runs[3].region, 1);
    }

    #[test]
    fn slices_do_not_merge_and_must_match() {
        let local = KvLayout::uniform(&[0], 8, 128);
        let remote = KvLayout::uniform(&[0], 8, 256);
        let mut s = spec(&[0, 1], &[0, 1]);
        assert!(plan_block_transfer(&local, &remote, &s).unwrap_err().message().contains("length mismatch"));
        s.remote_slice = Some(BlockSlice { offset: 128, len: 128 });
        let runs = plan_block_transfer(&local, &remote, &s).unwrap();
        assert_eq!(runs.len(), 2, "a half block is not contiguous with the next");
        assert_eq!(runs[1].remote_addr, 256 + 128);
        s.remote_slice = Some(BlockSlice { offset: 200, len: 128 });
        assert_eq!(plan_block_transfer(&local, &remote, &s).unwrap_err().kind(), ErrorKind::OutOfBounds);
        s.remote_slice = Some(BlockSlice { offset: 0, len: 0 });
        assert_eq!(plan_block_transfer(&local, &remote, &s).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn bad_ids_and_shapes_are_refused() {
        let l = KvLayout::uniform(&[0], 4, 64);
        let r = KvLayout::uniform(&[0], 8, 64);
        let e = plan_block_transfer(&l, &r, &spec(&[4], &[0])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds);
        assert!(e.message().contains("local block id 4"), "{e}");
        assert_eq!(plan_block_transfer(&l, &r, &spec(&[0], &[8])).unwrap_err().kind(), ErrorKind::OutOfBounds);
        assert_eq!(plan_block_transfer(&l, &r, &spec(&[0, 1], &[0])).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(plan_block_transfer(&l, &r, &spec(&[], &[])).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let e = plan_block_transfer(&l, &r, &spec(&[1, 1], &[0, 1])).unwrap_err();
        assert!(e.message().contains("destination more than once"), "{e}");
        // The same source twice is fine for a read's remote side.
        plan_block_transfer(&l, &r, &spec(&[0, 1], &[3, 3])).unwrap();
        let two = KvLayout::uniform(&[0, 4096], 4, 64);
        assert!(plan_block_transfer(&two, &r, &spec(&[0], &[0])).unwrap_err().message().contains("regions"));
        let wrap = KvLayout::uniform(&[u64::MAX - 10], 4, 64);
        assert_eq!(plan_block_transfer(&wrap, &r, &spec(&[0], &[0])).unwrap_err().kind(), ErrorKind::OutOfBounds);
        let zero = KvLayout::uniform(&[0], 0, 64);
        assert!(plan_block_transfer(&zero, &r, &spec(&[0], &[0])).is_err());
    }

    fn arb_case() -> impl Strategy<Value = (u32, u64, u64, Vec<(u32, u32)>, usize)> {
        (1u32..40, 1u64..64, 1u64..64, 1usize..4).prop_flat_map(|(count, llen, rlen, regions)| {
            let pairs = prop::collection::vec((0..count, 0..count), 1..60);
            (Just(count), Just(llen), Just(rlen), pairs, Just(regions))
        })
    }

    proptest! {
        /// Expanding the merged runs gives back exactly the requested block pairs, every run is
        /// inside both layouts, and no two consecutive runs of a region could have been merged.
        #[test]
        fn merging_is_exact_and_maximal((count, llen, _rlen, pairs, nregions) in arb_case(), same_len in any::<bool>()) {
            let rlen = if same_len { llen } else { llen * 2 };
            let lbases: Vec<u64> = (0..nregions as u64).map(|i| 1_000_000 * (i + 1)).collect();
            let rbases: Vec<u64> = (0..nregions as u64).map(|i| 50_000_000 * (i + 1)).collect();
            let local = KvLayout::uniform(&lbases, count, llen);
            let remote = KvLayout::uniform(&rbases, count, rlen);
            let l: Vec<u32> = pairs.iter().map(|p| p.0).collect();
            let r: Vec<u32> = pairs.iter().map(|p| p.1).collect();
            let s = BlockTransfer { opcode: Opcode::Write, local_blocks: &l, remote_blocks: &r, local_slice: None,
                remote_slice: if same_len { None } else { Some(BlockSlice { offset: rlen - llen, len: llen }) } };
            let mut dedup = r.clone(); dedup.sort_unstable(); dedup.dedup();
            let result = plan_block_transfer(&local, &remote, &s);
            if dedup.len() != r.len() {
                prop_assert!(result.is_err());
                return Ok(());
            }
            let runs = result.unwrap();
            let r_off = if same_len { 0 } else { rlen - llen };
            for reg in 0..nregions {
                let mine: Vec<&BlockRun> = runs.iter().filter(|x| x.region as usize == reg).collect();
                let mut expanded = Vec::new();
                for run in &mine {
                    prop_assert_eq!(run.len, run.pairs as u64 * llen);
                    prop_assert!(run.local_addr >= lbases[reg] && run.local_addr + run.len <= lbases[reg] + count as u64 * llen);
                    prop_assert!(run.remote_addr >= rbases[reg] && run.remote_addr + run.len <= rbases[reg] + count as u64 * rlen);
                    for k in 0..run.pairs {
                        let p = (run.first_pair + k) as usize;
                        expanded.push(p);
                        prop_assert_eq!(run.local_addr + k as u64 * llen, lbases[reg] + l[p] as u64 * llen);
                        prop_assert_eq!(run.remote_addr + k as u64 * rlen, rbases[reg] + r[p] as u64 * rlen + r_off);
                    }
                }
                prop_assert_eq!(expanded, (0..pairs.len()).collect::<Vec<_>>());
                for w in mine.windows(2) {
                    let end = (w[0].first_pair + w[0].pairs - 1) as usize;
                    let next = w[1].first_pair as usize;
                    let could_merge = same_len && l[next] == l[end] + 1 && r[next] == r[end] + 1;
                    prop_assert!(!could_merge, "runs {:?} and {:?} should have merged", w[0], w[1]);
                }
            }
        }
    }
}

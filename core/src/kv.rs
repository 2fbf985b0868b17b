//! The KV-block API: describe a KV cache as regions × blocks, name the blocks to move, and let
//! Ferry turn them into as few requests as possible (adjacent blocks merged), with per-block
//! failure reporting.
//!
//! This is the fix for the seed's open problem: the reference connector sent the whole KV cache
//! because it tracked buffers with a global counter. Here a caller moves exactly the blocks a
//! request owns.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::batch::{Opcode, SegmentHandle, TransferRequest};
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, Result};

/// The segment-descriptor field under which an engine publishes its named KV layouts:
/// `{"<name>": {"regions": [{"base": B, "block_len": L}, ...], "block_count": N}, ...}`.
/// Peers that do not know it (Mooncake) keep it as an unknown field and ignore it.
pub const KV_LAYOUTS_FIELD: &str = "ferry_kv_layouts";

/// The longest KV layout name an engine publishes, in bytes.
pub const KV_LAYOUT_NAME_MAX: usize = 128;

/// Checks a KV layout name for publication: 1 to [`KV_LAYOUT_NAME_MAX`] bytes, no control
/// characters.
pub fn check_kv_layout_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > KV_LAYOUT_NAME_MAX {
        return Err(Error::invalid(format!(
            "KV layout name {name:?} must be 1 to {KV_LAYOUT_NAME_MAX} bytes long (it is {})",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(format!("KV layout name {name:?} contains a control character")));
    }
    Ok(())
}

/// Writes `layouts` into `desc` under [`KV_LAYOUTS_FIELD`] (removes the field when empty).
pub fn publish_kv_layouts<'a>(
    desc: &mut SegmentDescriptor,
    layouts: impl IntoIterator<Item = (&'a str, &'a KvLayout)>,
) {
    let map: serde_json::Map<String, serde_json::Value> = layouts
        .into_iter()
        .map(|(name, layout)| (name.to_owned(), serde_json::to_value(layout).unwrap_or_default()))
        .collect();
    if map.is_empty() {
        desc.extra.remove(KV_LAYOUTS_FIELD);
    } else {
        desc.extra.insert(KV_LAYOUTS_FIELD.to_owned(), serde_json::Value::Object(map));
    }
}

/// The names of the KV layouts `desc` publishes, sorted (none when it publishes no layouts or
/// the field is not an object).
pub fn published_kv_layout_names(desc: &SegmentDescriptor) -> Vec<String> {
    match desc.extra.get(KV_LAYOUTS_FIELD) {
        Some(serde_json::Value::Object(m)) => {
            m.keys().cloned().collect::<std::collections::BTreeSet<_>>().into_iter().collect()
        }
        _ => Vec::new(),
    }
}

/// The KV layout `desc` publishes as `name`, validated ([`KvLayout::validate`]): the
/// descriptor comes from a peer, so a malformed entry is an error naming the segment and the
/// layout, never a panic. `Ok(None)` when it publishes no layout of that name.
pub fn published_kv_layout(desc: &SegmentDescriptor, name: &str) -> Result<Option<KvLayout>> {
    let entry = match desc.extra.get(KV_LAYOUTS_FIELD) {
        None => return Ok(None),
        Some(serde_json::Value::Object(m)) => match m.get(name) {
            None => return Ok(None),
            Some(v) => v,
        },
        Some(_) => {
            return Err(Error::invalid(format!(
                "segment `{}` publishes a malformed `{KV_LAYOUTS_FIELD}` field (not an object)",
                desc.name
            )));
        }
    };
    let context = |msg: String| format!("segment `{}` publishes a malformed KV layout `{name}`: {msg}", desc.name);
    let layout: KvLayout = serde_json::from_value(entry.clone()).map_err(|e| Error::invalid(context(e.to_string())))?;
    layout.validate().map_err(|e| Error::new(e.kind(), context(e.message().to_owned())))?;
    Ok(Some(layout))
}

/// All the KV layouts `desc` publishes, by name, each validated as by
/// [`published_kv_layout`].
pub fn published_kv_layouts(desc: &SegmentDescriptor) -> Result<BTreeMap<String, KvLayout>> {
    published_kv_layout_names(desc)
        .into_iter()
        .filter_map(|n| published_kv_layout(desc, &n).transpose().map(|l| l.map(|l| (n, l))))
        .collect()
}

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

/// Which blocks to move and how. Build one with [`read`](Self::read) or [`write`](Self::write),
/// then narrow it with [`regions`](Self::regions) (a layer subset) or the slice setters.
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
    /// The regions to move, by index, in the same order on both sides (`None`: every region).
    /// Layer-wise transfers name one layer's regions as that layer is ready, for example
    /// [`layer_regions`]`(l..l + 1, 2)` for layer `l`'s K and V.
    pub regions: Option<&'a [u32]>,
}

impl<'a> BlockTransfer<'a> {
    /// Pulls remote blocks `remote_blocks[i]` into local blocks `local_blocks[i]`, whole blocks
    /// of every region.
    pub fn read(local_blocks: &'a [u32], remote_blocks: &'a [u32]) -> Self {
        Self::new(Opcode::Read, local_blocks, remote_blocks)
    }

    /// Pushes local blocks `local_blocks[i]` to remote blocks `remote_blocks[i]`, whole blocks
    /// of every region.
    pub fn write(local_blocks: &'a [u32], remote_blocks: &'a [u32]) -> Self {
        Self::new(Opcode::Write, local_blocks, remote_blocks)
    }

    /// A transfer of whole blocks of every region in direction `opcode`.
    pub fn new(opcode: Opcode, local_blocks: &'a [u32], remote_blocks: &'a [u32]) -> Self {
        Self { opcode, local_blocks, remote_blocks, local_slice: None, remote_slice: None, regions: None }
    }

    /// Moves only `regions` (indices into both layouts' region lists): a layer subset.
    pub fn regions(mut self, regions: &'a [u32]) -> Self {
        self.regions = Some(regions);
        self
    }

    /// Moves only `slice` of each local block.
    pub fn local_slice(mut self, slice: BlockSlice) -> Self {
        self.local_slice = Some(slice);
        self
    }

    /// Moves only `slice` of each remote block.
    pub fn remote_slice(mut self, slice: BlockSlice) -> Self {
        self.remote_slice = Some(slice);
        self
    }
}

/// The region indices of `layers` in a layout that lists `regions_per_layer` regions per layer,
/// layer by layer (layer 0's K and V, then layer 1's, ... : `regions_per_layer` 2). An empty
/// list when `regions_per_layer` is 0; indices that would pass `u32::MAX` are left out.
pub fn layer_regions(layers: std::ops::Range<u32>, regions_per_layer: u32) -> Vec<u32> {
    let per = u64::from(regions_per_layer);
    (u64::from(layers.start) * per..u64::from(layers.end) * per).map_while(|r| u32::try_from(r).ok()).collect()
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

/// Checks a region subset: non-empty, every index below `count`, none twice.
fn select_regions(list: &[u32], count: usize) -> Result<Vec<usize>> {
    if list.is_empty() {
        return Err(Error::invalid("the region subset is empty (leave it unset to move every region)"));
    }
    let mut seen = vec![false; count];
    list.iter()
        .enumerate()
        .map(|(i, &r)| {
            let idx = r as usize;
            match seen.get_mut(idx) {
                None => Err(Error::out_of_bounds(format!(
                    "region {r} (position {i} of the region subset) is out of range: the layouts have {count} regions"
                ))),
                Some(true) => Err(Error::invalid(format!("region {r} is named twice in the region subset"))),
                Some(s) => {
                    *s = true;
                    Ok(idx)
                }
            }
        })
        .collect()
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
/// are contiguous on both sides). Runs come out region by region (in the order of
/// [`BlockTransfer::regions`] when set, which must name each region at most once and only
/// regions both layouts have), in pair order.
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

    let selected: Vec<usize> = match spec.regions {
        None => (0..local.regions.len()).collect(),
        Some(list) => select_regions(list, local.regions.len())?,
    };
    let mut runs = Vec::new();
    for r in selected {
        let (lr, rr) = (&local.regions[r], &remote.regions[r]);
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
        BlockTransfer::read(l, r)
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

    #[test]
    fn a_region_subset_moves_only_those_regions_in_its_order() {
        // Two layers of K and V: regions 0..4.
        let local = KvLayout::uniform(&[0x1000, 0x2000, 0x3000, 0x4000], 8, 64);
        let remote = KvLayout::uniform(&[0x9000, 0xa000, 0xb000, 0xc000], 8, 64);
        let layer1 = layer_regions(1..2, 2);
        assert_eq!(layer1, [2, 3]);
        let runs =
            plan_block_transfer(&local, &remote, &BlockTransfer::read(&[0, 1], &[4, 5]).regions(&layer1)).unwrap();
        assert_eq!(runs.iter().map(|r| r.region).collect::<Vec<_>>(), [2, 3]);
        assert_eq!((runs[0].local_addr, runs[0].remote_addr, runs[0].len), (0x3000, 0xb000 + 4 * 64, 128));
        let runs = plan_block_transfer(&local, &remote, &BlockTransfer::read(&[0], &[0]).regions(&[3, 0])).unwrap();
        assert_eq!(runs.iter().map(|r| r.region).collect::<Vec<_>>(), [3, 0], "the subset's order");
        for (bad, kind, words) in [
            (&[4u32][..], ErrorKind::OutOfBounds, "region 4 (position 0 of the region subset) is out of range"),
            (&[1, 1][..], ErrorKind::InvalidArgument, "region 1 is named twice"),
            (&[][..], ErrorKind::InvalidArgument, "the region subset is empty"),
        ] {
            let e = plan_block_transfer(&local, &remote, &BlockTransfer::write(&[0], &[0]).regions(bad)).unwrap_err();
            assert_eq!(e.kind(), kind);
            assert!(e.message().contains(words), "{e}");
        }
        assert_eq!(layer_regions(0..3, 1), [0, 1, 2]);
        assert!(layer_regions(0..3, 0).is_empty());
        assert_eq!(layer_regions(u32::MAX - 1..u32::MAX, 2), Vec::<u32>::new(), "past u32::MAX is left out");
    }

    #[test]
    fn published_layouts_round_trip_through_the_descriptor_and_bad_ones_are_errors() {
        let a = KvLayout::uniform(&[0x1000, 0x2000], 4, 64);
        let b = KvLayout::uniform(&[0x8000], 2, 512);
        let mut d = SegmentDescriptor::new("10.0.0.1:17000", "tcp");
        publish_kv_layouts(&mut d, [("kv", &a), ("mla", &b)]);
        let back = SegmentDescriptor::from_json("test", &d.to_json()).unwrap();
        assert_eq!(published_kv_layout(&back, "kv").unwrap(), Some(a.clone()));
        assert_eq!(published_kv_layout(&back, "mla").unwrap(), Some(b));
        assert_eq!(published_kv_layout(&back, "other").unwrap(), None);
        assert_eq!(published_kv_layout_names(&back), ["kv", "mla"]);
        assert_eq!(published_kv_layouts(&back).unwrap().len(), 2);
        publish_kv_layouts(&mut d, []);
        assert!(!d.extra.contains_key(KV_LAYOUTS_FIELD), "no layouts, no field");

        for (json, words) in [
            (r#"{"kv": {"regions": [], "block_count": 4}}"#, "has no regions"),
            (r#"{"kv": {"regions": [{"base": 1, "block_len": 0}], "block_count": 4}}"#, "zero block length"),
            (r#"{"kv": {"regions": [{"base": 18446744073709551615, "block_len": 8}], "block_count": 4}}"#, "wraps"),
            (r#"{"kv": {"regions": "many", "block_count": 4}}"#, "invalid type"),
            (r#"{"kv": {"regions": [{"base": -1, "block_len": 8}], "block_count": 4}}"#, "invalid value"),
            (r#"[1, 2]"#, "not an object"),
        ] {
            let mut d = SegmentDescriptor::new("peer", "tcp");
            d.extra.insert(KV_LAYOUTS_FIELD.into(), serde_json::from_str(json).unwrap());
            let e = published_kv_layout(&d, "kv").unwrap_err();
            assert!(e.message().contains("segment `peer`") && e.message().contains(words), "{json}: {e}");
        }
        assert!(check_kv_layout_name("kv").is_ok());
        assert!(check_kv_layout_name("").is_err());
        assert!(check_kv_layout_name(&"x".repeat(KV_LAYOUT_NAME_MAX + 1)).is_err());
        assert!(check_kv_layout_name("a\nb").is_err());
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
                remote_slice: if same_len { None } else { Some(BlockSlice { offset: rlen - llen, len: llen }) },
                regions: None };
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

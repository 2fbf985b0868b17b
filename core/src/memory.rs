//! Registered memory: location tags, the non-overlapping region registry, and the bounds checks
//! every local and remote access goes through.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, RwLock};

use crate::error::{Error, ErrorKind, Result};

/// Where a registered region lives. Parsed from Mooncake's location tags.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory on NUMA node `N` (`cpu:N`).
    Cpu(u32),
    /// Ascend NPU device memory on device `N` (`npu:N`; `N` is the user/logical device id the
    /// process sees, not necessarily the physical id).
    Npu(u32),
    /// CUDA device memory on device `N` (`cuda:N`).
    Cuda(u32),
    /// Unknown; let the transport detect it (`*`).
    Any,
}

impl Location {
    /// Returns true when this is device memory (NPU or CUDA).
    pub fn is_device(&self) -> bool {
        matches!(self, Location::Npu(_) | Location::Cuda(_))
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Cpu(n) => write!(f, "cpu:{n}"),
            Location::Npu(n) => write!(f, "npu:{n}"),
            Location::Cuda(n) => write!(f, "cuda:{n}"),
            Location::Any => f.write_str("*"),
        }
    }
}

impl FromStr for Location {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "*" || s.is_empty() {
            return Ok(Location::Any);
        }
        let bad = || Error::invalid(format!("location tag {s:?} is not one of `cpu:N`, `npu:N`, `cuda:N` or `*`"));
        let (kind, index) = s.split_once(':').ok_or_else(bad)?;
        let index: u32 = index.parse().map_err(|_| bad())?;
        match kind {
            "cpu" => Ok(Location::Cpu(index)),
            "npu" => Ok(Location::Npu(index)),
            "cuda" => Ok(Location::Cuda(index)),
            _ => Err(bad()),
        }
    }
}

/// One registered region: `[addr, addr + len)` in this process's address space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    addr: u64,
    len: u64,
    location: Location,
    /// When it was registered, relative to the other regions of the process.
    seq: u64,
}

/// Registration order across the process (descriptors list buffers in it, as Mooncake does).
static NEXT_REGION_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Region {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes (never zero).
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Always false: zero-length regions are refused at registration. Present for clippy's
    /// `len_without_is_empty` convention.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }
    /// Where it lives.
    pub fn location(&self) -> &Location {
        &self.location
    }
    /// True when `[addr, addr + len)` lies inside this region. `len == 0` is never contained.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0 && addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.end())
    }
}

/// A registered region held by an in-flight request. While any lease exists the region cannot
/// be unregistered (`unregister` answers [`ErrorKind::Busy`]), so a transport never touches memory
/// its owner has already given back.
pub type RegionLease = Arc<Region>;

/// What [`MemoryRegistry::lease_spans`] hands a batch: the region of each range, in order, and
/// the leases that keep them registered (one per distinct region).
#[derive(Debug)]
pub(crate) struct LeasedSpans {
    /// The region holding each range (copies).
    pub(crate) regions: Vec<Region>,
    /// One lease per distinct region.
    pub(crate) leases: Vec<RegionLease>,
}

/// Checks that `addr + len` does not overflow and `len` is non-zero.
pub fn checked_range(addr: u64, len: u64) -> Result<u64> {
    if len == 0 {
        return Err(Error::invalid(format!("zero-length range at {addr:#x}")));
    }
    addr.checked_add(len)
        .ok_or_else(|| Error::out_of_bounds(format!("range {addr:#x}+{len} overflows the address space")))
}

/// The engine's registry of local memory: non-overlapping regions, looked up by address.
///
/// Thread-safe: lookups take a read lock, (un)registration a write lock.
#[derive(Debug, Default)]
pub struct MemoryRegistry {
    regions: RwLock<BTreeMap<u64, Arc<Region>>>,
    /// Set (under the write lock) by [`close`](MemoryRegistry::close): no new leases.
    closed: std::sync::atomic::AtomicBool,
}

impl MemoryRegistry {
    /// Empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `[addr, addr + len)`. Fails with [`ErrorKind::InvalidArgument`] for a zero length,
    /// [`ErrorKind::OutOfBounds`] when the range wraps around the address space, and
    /// [`ErrorKind::AlreadyExists`] when it overlaps a registered region.
    ///
    /// # Safety
    /// Registration is the promise every transport relies on before it reads or writes the range:
    /// `[addr, addr + len)` must be memory owned by this process and valid for reads and writes
    /// from any thread (host memory, or device memory for transports that declare
    /// `device_memory`) until the region is unregistered (or its engine is shut down), and no
    /// Rust reference may be held into it while a transfer may touch it.
    #[allow(unsafe_code)]
    pub unsafe fn register(&self, addr: u64, len: u64, location: Location) -> Result<Arc<Region>> {
        let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        self.check_open()?;
        Self::insert_checked(&mut map, addr, len, location)
    }

    fn insert_checked(
        map: &mut BTreeMap<u64, Arc<Region>>,
        addr: u64,
        len: u64,
        location: Location,
    ) -> Result<Arc<Region>> {
        let end = checked_range(addr, len)?;
        if let Some((_, prev)) = map.range(..=addr).next_back()
            && prev.end() > addr
        {
            return Err(overlap(addr, len, prev));
        }
        if let Some((_, next)) = map.range(addr..).next()
            && next.addr < end
        {
            return Err(overlap(addr, len, next));
        }
        let seq = NEXT_REGION_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let region = Arc::new(Region { addr, len, location, seq });
        map.insert(addr, region.clone());
        Ok(region)
    }

    /// Registers several regions atomically: either all are registered or none is (a failure
    /// rolls back the ones registered before it). Regions in the batch must not overlap each
    /// other either.
    ///
    /// # Safety
    /// As for [`register`](Self::register), for every region.
    #[allow(unsafe_code)]
    pub unsafe fn register_batch(&self, regions: &[(u64, u64, Location)]) -> Result<Vec<Arc<Region>>> {
        let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        self.check_open()?;
        let mut done = Vec::with_capacity(regions.len());
        for (i, (addr, len, loc)) in regions.iter().enumerate() {
            match Self::insert_checked(&mut map, *addr, *len, loc.clone()) {
                Ok(r) => done.push(r),
                Err(e) => {
                    for r in &done {
                        map.remove(&r.addr);
                    }
                    return Err(Error::new(
                        e.kind(),
                        format!("batch registration entry {i}: {}; nothing was registered", e.message()),
                    ));
                }
            }
        }
        Ok(done)
    }

    /// Unregisters the region starting exactly at `addr`. Fails with [`ErrorKind::NotFound`] when
    /// no region starts there and [`ErrorKind::Busy`] while transfers on it are in flight.
    pub fn unregister(&self, addr: u64) -> Result<Arc<Region>> {
        let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        Self::remove_checked(&mut map, addr)
    }

    fn remove_checked(map: &mut BTreeMap<u64, Arc<Region>>, addr: u64) -> Result<Arc<Region>> {
        let region =
            map.get(&addr).ok_or_else(|| Error::not_found(format!("no registered region starts at {addr:#x}")))?;
        // The map holds one reference; any other is a lease held by an in-flight request or a
        // caller. Holding the write lock means no new lease can be taken meanwhile.
        let leases = Arc::strong_count(region) - 1;
        if leases > 0 {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("region {addr:#x}+{} has {leases} transfer(s) in flight", region.len),
            ));
        }
        Ok(map.remove(&addr).expect("present: looked up under the same lock"))
    }

    /// Unregisters several regions: all or none (nothing is removed when one fails).
    pub fn unregister_batch(&self, addrs: &[u64]) -> Result<Vec<Arc<Region>>> {
        let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        for (i, addr) in addrs.iter().enumerate() {
            let Some(region) = map.get(addr) else {
                return Err(Error::not_found(format!(
                    "batch unregistration entry {i}: no registered region starts at {addr:#x}; nothing was unregistered"
                )));
            };
            if Arc::strong_count(region) > 1 {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "batch unregistration entry {i}: region {addr:#x} has transfers in flight; nothing was unregistered"
                    ),
                ));
            }
            if addrs[..i].contains(addr) {
                return Err(Error::invalid(format!(
                    "batch unregistration entry {i}: address {addr:#x} listed twice; nothing was unregistered"
                )));
            }
        }
        Ok(addrs.iter().map(|a| Self::remove_checked(&mut map, *a).expect("checked above")).collect())
    }

    /// Finds the region containing all of `[addr, addr + len)` and returns a lease on it.
    /// Fails with [`ErrorKind::InvalidArgument`] for a zero length and [`ErrorKind::OutOfBounds`]
    /// when the range is not inside a single registered region.
    pub fn lease(&self, addr: u64, len: u64) -> Result<RegionLease> {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        self.check_open()?;
        Self::find_in(&map, addr, len).cloned()
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Shutdown, "the memory registry is closed: its engine shut down"));
        }
        Ok(())
    }

    /// Stops handing out leases (every later lookup fails with [`ErrorKind::Shutdown`]).
    /// Leases already given stay valid until dropped; see [`leases`](Self::leases).
    pub fn close(&self) {
        let _map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        self.closed.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Number of leases outstanding on all regions (requests and batches holding memory).
    pub fn leases(&self) -> usize {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        map.values().map(|r| Arc::strong_count(r) - 1).sum()
    }

    /// Removes every region (after [`close`](Self::close) and once [`leases`](Self::leases) is
    /// zero; fails with [`ErrorKind::Busy`] while any lease is outstanding).
    pub fn clear(&self) -> Result<()> {
        let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        let leased: usize = map.values().map(|r| Arc::strong_count(r) - 1).sum();
        if leased > 0 {
            return Err(Error::new(ErrorKind::Busy, format!("{leased} lease(s) on registered memory are outstanding")));
        }
        map.clear();
        Ok(())
    }

    fn find_in(map: &BTreeMap<u64, Arc<Region>>, addr: u64, len: u64) -> Result<&Arc<Region>> {
        checked_range(addr, len)?;
        match map.range(..=addr).next_back() {
            Some((_, r)) if r.contains(addr, len) => Ok(r),
            Some((_, r)) if r.end() > addr => Err(Error::out_of_bounds(format!(
                "local range {addr:#x}+{len} runs past the end of registered region {:#x}+{}",
                r.addr, r.len
            ))),
            _ => Err(Error::out_of_bounds(format!(
                "local address {addr:#x} (+{len}) is not inside any registered region: this memory was never \
                 registered with this engine (or was unregistered). Register the buffer before transferring \
                 from or into it: register_memory(addr, length) or batch_register_memory(addrs, lengths) in \
                 Python, ferry_register_memory in C ({} region(s) registered now)",
                map.len()
            ))),
        }
    }

    /// Leases several ranges under one read lock (used to validate a whole batch at once).
    /// Returns the index of the first failing range with its error.
    pub fn lease_many(
        &self,
        ranges: impl Iterator<Item = (u64, u64)>,
    ) -> std::result::Result<Vec<RegionLease>, (usize, Error)> {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        self.check_open().map_err(|e| (0, e))?;
        ranges.enumerate().map(|(i, (addr, len))| Self::find_in(&map, addr, len).cloned().map_err(|e| (i, e))).collect()
    }

    /// [`lease_many`](Self::lease_many) as a batch needs it: for each range, a copy of the
    /// region that holds it, and one lease per distinct region (rather than one per range).
    /// A range inside the region of the range before it is not looked up again (a batch's
    /// requests usually lie in a few regions, one after another). Errors as `lease_many`.
    pub(crate) fn lease_spans(
        &self,
        ranges: impl Iterator<Item = (u64, u64)>,
    ) -> std::result::Result<LeasedSpans, (usize, Error)> {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        self.check_open().map_err(|e| (0, e))?;
        let mut regions = Vec::with_capacity(ranges.size_hint().0);
        let mut leases: Vec<RegionLease> = Vec::new();
        for (i, (addr, len)) in ranges.enumerate() {
            // Regions do not overlap: the one that holds the range is the one `find_in` finds.
            let region = match leases.last() {
                Some(last) if last.contains(addr, len) => last,
                _ => {
                    let found = Self::find_in(&map, addr, len).map_err(|e| (i, e))?;
                    leases.push(found.clone());
                    found
                }
            };
            regions.push(Region::clone(region));
        }
        drop(map);
        if leases.len() > 1 {
            leases.sort_unstable_by_key(|l| Arc::as_ptr(l) as usize);
            leases.dedup_by(|a, b| Arc::ptr_eq(a, b));
        }
        Ok(LeasedSpans { regions, leases })
    }

    /// The first registered region that shares a byte with `[addr, addr + len)`, if any (a
    /// copy). Used to refuse freeing memory that is still registered.
    pub fn overlapping(&self, addr: u64, len: u64) -> Option<Region> {
        let end = addr.saturating_add(len);
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        let before = map.range(..=addr).next_back().map(|(_, r)| r).filter(|r| r.end() > addr);
        let inside = map.range(addr..end).next().map(|(_, r)| r);
        before.or(inside).filter(|_| len > 0).map(|r| Region::clone(r))
    }

    /// Snapshot of all regions (copies, not leases), in address order.
    pub fn regions(&self) -> Vec<Region> {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        map.values().map(|r| Region::clone(r)).collect()
    }

    /// Snapshot of all regions in the order they were registered (oldest first): the order a
    /// segment descriptor lists its buffers in, as Mooncake's does.
    pub fn regions_in_registration_order(&self) -> Vec<Region> {
        let mut regions = self.regions();
        regions.sort_by_key(|r| r.seq);
        regions
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.regions.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A read-only view of an engine's registered memory ([`TransferEngine::memory`]).
/// Registering and unregistering go through the engine, which tells its transports (a
/// transport may keep memory registered with a device or a peer): the view cannot change it.
///
/// ```compile_fail
/// # fn f(engine: &ferry_core::TransferEngine) {
/// engine.memory().unregister(0x1000); // only the engine unregisters (and tells its transports)
/// # }
/// ```
///
/// [`TransferEngine::memory`]: crate::TransferEngine::memory
#[derive(Debug, Clone)]
pub struct RegisteredMemory(Arc<MemoryRegistry>);

impl RegisteredMemory {
    pub(crate) fn new(registry: Arc<MemoryRegistry>) -> Self {
        Self(registry)
    }

    /// Snapshot of all regions (copies), in address order.
    pub fn regions(&self) -> Vec<Region> {
        self.0.regions()
    }

    /// Snapshot of all regions in the order they were registered (oldest first).
    pub fn regions_in_registration_order(&self) -> Vec<Region> {
        self.0.regions_in_registration_order()
    }

    /// The first registered region that shares a byte with `[addr, addr + len)`, if any.
    pub fn overlapping(&self, addr: u64, len: u64) -> Option<Region> {
        self.0.overlapping(addr, len)
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Leases held on the regions (requests in flight, and peers copying under a lease).
    pub fn leases(&self) -> usize {
        self.0.leases()
    }
}

fn overlap(addr: u64, len: u64, existing: &Region) -> Error {
    Error::new(
        ErrorKind::AlreadyExists,
        format!("range {addr:#x}+{len} overlaps registered region {:#x}+{}", existing.addr, existing.len),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // These tests register made-up addresses: the registry itself never dereferences them, and
    // nothing here transfers.
    #[allow(unsafe_code)]
    fn reg(r: &MemoryRegistry, addr: u64, len: u64, loc: Location) -> Result<Arc<Region>> {
        // SAFETY: no transport is attached; the addresses are only compared, never accessed.
        unsafe { r.register(addr, len, loc) }
    }

    #[allow(unsafe_code)]
    fn reg_batch(r: &MemoryRegistry, regions: &[(u64, u64, Location)]) -> Result<Vec<Arc<Region>>> {
        // SAFETY: as in `reg`.
        unsafe { r.register_batch(regions) }
    }

    #[test]
    fn regions_are_listed_by_address_or_by_registration() {
        let r = MemoryRegistry::new();
        for addr in [0x9000u64, 0x1000, 0x5000] {
            reg(&r, addr, 0x100, Location::Any).unwrap();
        }
        let by_addr: Vec<u64> = r.regions().iter().map(Region::addr).collect();
        assert_eq!(by_addr, [0x1000, 0x5000, 0x9000]);
        let registered: Vec<u64> = r.regions_in_registration_order().iter().map(Region::addr).collect();
        assert_eq!(registered, [0x9000, 0x1000, 0x5000]);
        // A region registered again after its removal is the newest.
        r.unregister(0x9000).unwrap();
        reg(&r, 0x9000, 0x100, Location::Any).unwrap();
        let registered: Vec<u64> = r.regions_in_registration_order().iter().map(Region::addr).collect();
        assert_eq!(registered, [0x1000, 0x5000, 0x9000]);
    }

    #[test]
    fn location_tags_parse_and_print() {
        for tag in ["cpu:0", "npu:7", "cuda:3", "*"] {
            assert_eq!(tag.parse::<Location>().unwrap().to_string(), tag);
        }
        for bad in ["gpu:0", "cpu", "npu:-1", "cpu:x", "npu:"] {
            let e = bad.parse::<Location>().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}");
            assert!(e.message().contains(bad));
        }
    }

    #[test]
    fn overlapping_and_zero_length_are_refused_with_distinct_kinds() {
        let r = MemoryRegistry::new();
        reg(&r, 1000, 100, Location::Cpu(0)).unwrap();
        assert_eq!(reg(&r, 1050, 10, Location::Any).unwrap_err().kind(), ErrorKind::AlreadyExists);
        assert_eq!(reg(&r, 900, 101, Location::Any).unwrap_err().kind(), ErrorKind::AlreadyExists);
        assert_eq!(reg(&r, 2000, 0, Location::Any).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(reg(&r, u64::MAX - 1, 10, Location::Any).unwrap_err().kind(), ErrorKind::OutOfBounds);
        // Adjacent regions are fine.
        reg(&r, 900, 100, Location::Any).unwrap();
        reg(&r, 1100, 100, Location::Any).unwrap();
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn batch_registration_rolls_back() {
        let r = MemoryRegistry::new();
        reg(&r, 5000, 10, Location::Any).unwrap();
        let err =
            reg_batch(&r, &[(0, 10, Location::Any), (100, 10, Location::Any), (5005, 1, Location::Any)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::AlreadyExists);
        assert!(err.message().contains("entry 2"));
        assert_eq!(r.len(), 1, "the first two entries were rolled back");
        // Overlap within the batch itself.
        assert!(reg_batch(&r, &[(0, 10, Location::Any), (5, 10, Location::Any)]).is_err());
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn leases_block_unregistration() {
        let r = MemoryRegistry::new();
        reg(&r, 1000, 100, Location::Any).unwrap();
        let lease = r.lease(1010, 20).unwrap();
        assert_eq!(r.unregister(1000).unwrap_err().kind(), ErrorKind::Busy);
        assert_eq!(r.unregister_batch(&[1000]).unwrap_err().kind(), ErrorKind::Busy);
        drop(lease);
        r.unregister(1000).unwrap();
        assert_eq!(r.unregister(1000).unwrap_err().kind(), ErrorKind::NotFound);
    }

    #[test]
    fn a_closed_registry_gives_no_new_leases_and_clears_once_leases_are_gone() {
        let r = MemoryRegistry::new();
        reg(&r, 0, 100, Location::Any).unwrap();
        let held = r.lease(0, 10).unwrap();
        let snapshot = r.regions();
        assert_eq!(r.leases(), 1, "a snapshot is not a lease");
        r.close();
        assert_eq!(r.lease(0, 10).unwrap_err().kind(), ErrorKind::Shutdown);
        assert_eq!(r.clear().unwrap_err().kind(), ErrorKind::Busy);
        drop(held);
        r.clear().unwrap();
        assert!(r.is_empty());
        assert_eq!(snapshot.len(), 1);
    }

    #[test]
    fn unregister_batch_is_all_or_nothing() {
        let r = MemoryRegistry::new();
        reg(&r, 0, 10, Location::Any).unwrap();
        reg(&r, 10, 10, Location::Any).unwrap();
        assert_eq!(r.unregister_batch(&[0, 99]).unwrap_err().kind(), ErrorKind::NotFound);
        assert_eq!(r.len(), 2);
        assert_eq!(r.unregister_batch(&[0, 0]).unwrap_err().kind(), ErrorKind::InvalidArgument);
        r.unregister_batch(&[0, 10]).unwrap();
        assert!(r.is_empty());
    }

    #[test]
    fn lookups_report_why() {
        let r = MemoryRegistry::new();
        reg(&r, 1000, 100, Location::Any).unwrap();
        assert!(r.lease(1000, 100).is_ok());
        let e = r.lease(1050, 51).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds);
        assert!(e.message().contains("past the end"));
        assert_eq!(r.lease(999, 1).unwrap_err().kind(), ErrorKind::OutOfBounds);
        assert_eq!(r.lease(1000, 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(r.lease(u64::MAX, 2).unwrap_err().kind(), ErrorKind::OutOfBounds);
    }

    proptest! {
        /// Whatever sequence of registrations is attempted, the accepted regions never overlap,
        /// and a lookup succeeds exactly when the range lies inside one accepted region.
        #[test]
        fn registry_never_holds_overlaps(
            attempts in prop::collection::vec((0u64..10_000, 0u64..500), 1..60),
            probes in prop::collection::vec((0u64..11_000, 0u64..600), 1..60),
        ) {
            let r = MemoryRegistry::new();
            let mut accepted: Vec<(u64, u64)> = Vec::new();
            for (addr, len) in attempts {
                let model_ok = len > 0 && accepted.iter().all(|&(a, l)| addr + len <= a || a + l <= addr);
                let got = reg(&r, addr, len, Location::Any);
                prop_assert_eq!(got.is_ok(), model_ok);
                if model_ok { accepted.push((addr, len)); }
            }
            for (addr, len) in probes {
                let model = len > 0 && accepted.iter().any(|&(a, l)| addr >= a && addr + len <= a + l);
                prop_assert_eq!(r.lease(addr, len).is_ok(), model);
            }
        }

        /// `lease_spans` (one lease per region, no lookup for a range in the region before it)
        /// agrees with `lease_many` (a lookup and a lease per range): the same region for every
        /// range, or the same first failing range with the same error; its leases are the
        /// distinct regions, and it leaves nothing leased once they are dropped.
        #[test]
        fn leasing_spans_agrees_with_leasing_each_range(
            regions in prop::collection::vec((0u64..20u64, 1u64..400), 1..8),
            ranges in prop::collection::vec((0u64..10_000, 0u64..600), 1..40),
        ) {
            let r = MemoryRegistry::new();
            for (slot, len) in regions {
                // One region per 500-byte slot at most, so that some ranges cross a region's end.
                let _ = reg(&r, slot * 500, len, Location::Any);
            }
            let each = r.lease_many(ranges.iter().copied());
            let spans = r.lease_spans(ranges.iter().copied());
            match (each, spans) {
                (Ok(each), Ok(spans)) => {
                    let copies: Vec<Region> = each.iter().map(|l| Region::clone(l)).collect();
                    prop_assert_eq!(&spans.regions, &copies);
                    let mut distinct: Vec<u64> = copies.iter().map(Region::addr).collect();
                    distinct.sort_unstable();
                    distinct.dedup();
                    let mut leased: Vec<u64> = spans.leases.iter().map(|l| l.addr()).collect();
                    leased.sort_unstable();
                    prop_assert_eq!(leased, distinct);
                }
                (Err((i, e)), Err((j, f))) => {
                    prop_assert_eq!(i, j);
                    prop_assert_eq!(e.kind(), f.kind());
                    prop_assert_eq!(e.message(), f.message());
                }
                (each, spans) => prop_assert!(false, "lease_many {:?} but lease_spans {:?}", each.is_ok(), spans.is_ok()),
            }
            prop_assert_eq!(r.leases(), 0);
        }
    }
}

//! Local memory: registering and unregistering regions with every transport (all or none),
//! and host memory allocated for callers.

use super::*;

/// The [`MemoryPromise`] the engine gives its transports for a region of its registry.
pub(super) fn engine_promise() -> MemoryPromise {
    // SAFETY: every region in the engine's registry was registered under
    // `TransferEngine::register_memory`'s contract (valid until unregistered from the engine),
    // and the engine's unregistration succeeds only once every transport's `unregister_memory`
    // for the region returned `Ok` (a refusal re-registers it and tells the caller not to free
    // it); `shutdown` lets the memory go only after every transport's `shutdown` returned. So
    // the memory outlives every transport's use of it.
    #[allow(unsafe_code)]
    unsafe {
        MemoryPromise::new()
    }
}

impl TransferEngine {
    /// Registers `[addr, addr + len)` at `location` and republishes the descriptor. From now on
    /// local requests may use the range, and peers may read and write it.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a zero length, [`ErrorKind::AlreadyExists`]
    /// for an overlap, a transport's error (the registration is then rolled back).
    ///
    /// # Safety
    /// See [`MemoryRegistry::register`]: the range must be memory this process owns, valid for
    /// reads and writes by any thread (host memory, or device memory the transports can reach)
    /// until it is unregistered or the engine is shut down, and Rust code must not hold
    /// references into it while transfers may touch it.
    #[allow(unsafe_code)]
    pub async unsafe fn register_memory(&self, addr: u64, len: u64, location: Location) -> Result<()> {
        // SAFETY: the caller's contract is this function's contract.
        unsafe { self.register_memory_batch(&[(addr, len, location)]).await }
    }

    /// Registers several regions: all or none.
    ///
    /// # Safety
    /// As for [`register_memory`](Self::register_memory), for every region.
    #[allow(unsafe_code)]
    pub async unsafe fn register_memory_batch(&self, regions: &[(u64, u64, Location)]) -> Result<()> {
        self.inner.check_open()?;
        if regions.is_empty() {
            return Err(Error::invalid("no regions to register"));
        }
        // Registry and transports change together: a transport added meanwhile (a peer naming a
        // new protocol) sees each region exactly once.
        let change = self.inner.transport_change.lock().await;
        // SAFETY: the caller's contract is this function's contract.
        let added = unsafe { self.inner.memory.register_batch(regions) }?;
        let addrs: Vec<u64> = added.iter().map(|r| r.addr()).collect();
        if let Err(e) = self.attach(&added).await {
            drop(change);
            drop(added);
            return Err(self.roll_back(&addrs, e, false).await);
        }
        drop(change);
        drop(added);
        if let Err(e) = self.inner.publish().await {
            return Err(self.roll_back(&addrs, e, true).await);
        }
        Ok(())
    }

    /// Undoes a registration that failed with `cause`. A request may have leased the new
    /// regions meanwhile (they were visible): wait for it like `unregister_memory` does; if the
    /// regions still cannot be removed, say so, since the caller must then not free them.
    pub(super) async fn roll_back(&self, addrs: &[u64], cause: Error, attached: bool) -> Error {
        let deadline = tokio::time::Instant::now() + self.transfer_timeout();
        loop {
            let undone = if attached {
                self.unregister_local(addrs).await
            } else {
                self.inner.memory.unregister_batch(addrs).map(|_| ()).map_err(|e| {
                    let wait = e.kind() == ErrorKind::Busy;
                    (e, wait)
                })
            };
            match undone {
                Ok(()) => return cause,
                Err((_, true)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => {
                    let msg = format!(
                        "{}; the registration could not be rolled back ({}): the memory is still registered and must not be freed before unregister_memory succeeds",
                        cause.message(),
                        e.message()
                    );
                    return cause.context(msg);
                }
            }
        }
    }

    /// Tells every transport about new regions; on failure, detaches what was attached. The
    /// caller holds `transport_change`.
    pub(super) async fn attach(&self, regions: &[Arc<Region>]) -> Result<()> {
        let transports = self.inner.transports();
        for (i, region) in regions.iter().enumerate() {
            for (t_idx, t) in transports.iter().enumerate() {
                if let Err(e) = t.register_memory(region, engine_promise()).await {
                    for t in &transports[..t_idx] {
                        let _ = t.unregister_memory(region).await;
                    }
                    for r in &regions[..i] {
                        for t in transports.iter() {
                            let _ = t.unregister_memory(r).await;
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Removes regions from the registry and from every transport. A transport that cannot let
    /// go of a region (a device communicator that still has it bound) makes the whole call fail
    /// with that transport's error: the regions are registered again (in the registry and in
    /// the transports that had already let go), so the caller keeps them and must not free them.
    #[allow(unsafe_code)]
    /// Unregisters `addrs` from the registry, then from every transport. The error says
    /// whether waiting may help: `true` when a lease held the memory (a request finishing),
    /// `false` when a transport refused (it keeps the memory; asking again cannot change that
    /// and must not pretend it did).
    pub(super) async fn unregister_local(&self, addrs: &[u64]) -> std::result::Result<(), (Error, bool)> {
        let _change = self.inner.transport_change.lock().await;
        let removed = self.inner.memory.unregister_batch(addrs).map_err(|e| {
            let wait = e.kind() == ErrorKind::Busy;
            (e, wait)
        })?;
        let transports = self.inner.transports();
        let mut failure: Option<Error> = None;
        let mut detached: Vec<(usize, usize)> = Vec::new(); // (region, transport) pairs undone
        for (r, region) in removed.iter().enumerate() {
            for (t_idx, t) in transports.iter().enumerate() {
                match t.unregister_memory(region).await {
                    Ok(()) => detached.push((r, t_idx)),
                    Err(e) => {
                        tracing::warn!(addr = region.addr(), transport = t.protocol(), error = %e, "transport cannot unregister memory; it stays registered");
                        failure.get_or_insert(e.context(format!(
                            "the {} transport still uses the region at {:#x}: {}; it stays registered and must not be freed",
                            t.protocol(),
                            region.addr(),
                            e.message()
                        )));
                    }
                }
            }
        }
        let Some(failure) = failure else { return Ok(()) };
        let specs: Vec<(u64, u64, Location)> =
            removed.iter().map(|r| (r.addr(), r.len(), r.location().clone())).collect();
        // SAFETY: these regions were registered under `register_memory`'s contract and their
        // unregistration has not succeeded, so the caller still guarantees the memory.
        let restored = unsafe { self.inner.memory.register_batch(&specs) }.map_err(|e| {
            (e.context(format!("{}; restoring the registration failed: {}", failure.message(), e.message())), false)
        })?;
        for (r, t_idx) in detached {
            if let Err(e) = transports[t_idx].register_memory(&restored[r], engine_promise()).await {
                tracing::error!(addr = restored[r].addr(), transport = transports[t_idx].protocol(), error = %e, "re-registering memory after a failed unregister failed");
            }
        }
        Err((failure, false))
    }

    /// Unregisters the region starting at `addr` and republishes.
    ///
    /// Errors: [`ErrorKind::NotFound`] when no region starts there, [`ErrorKind::Busy`] when
    /// requests on it are still in flight after the transfer timeout, or at once when a
    /// transport cannot let go of it (it then stays registered and must not be freed).
    pub async fn unregister_memory(&self, addr: u64) -> Result<()> {
        self.unregister_memory_batch(&[addr]).await
    }

    /// Unregisters several regions: all or none.
    pub async fn unregister_memory_batch(&self, addrs: &[u64]) -> Result<()> {
        self.inner.check_open()?;
        // A transfer that just finished may hold its lease a moment longer (a target's serving
        // task, a transport finishing a cancelled request): wait for it, up to the transfer
        // timeout, before answering Busy.
        let deadline = tokio::time::Instant::now() + self.transfer_timeout();
        loop {
            match self.unregister_local(addrs).await {
                Ok(()) => break,
                Err((_, true)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
        self.inner.publish().await
    }

    /// Blocking form of [`register_memory`](Self::register_memory).
    ///
    /// # Safety
    /// As for [`register_memory`](Self::register_memory).
    #[allow(unsafe_code)]
    pub unsafe fn register_memory_blocking(&self, addr: u64, len: u64, location: Location) -> Result<()> {
        // SAFETY: the caller's contract is this function's contract.
        self.block_on(unsafe { self.register_memory(addr, len, location) })?
    }

    /// Blocking form of [`unregister_memory`](Self::unregister_memory).
    pub fn unregister_memory_blocking(&self, addr: u64) -> Result<()> {
        self.block_on(self.unregister_memory(addr))?
    }

    /// Allocates `len` bytes of zero-filled host memory suited to this engine's transports:
    /// the first transport that allocates host memory its own way
    /// ([`Transport::allocate_host`]; the primary transport is asked first, then the others in
    /// the order they are tried) provides it — `aclrtMallocHost` memory for the `ascend`
    /// transport — else the process allocator does ([`HostAllocation::zeroed`], aligned to
    /// [`HOST_ALIGNMENT`](crate::HOST_ALIGNMENT)).
    ///
    /// The memory is not registered: register it with
    /// [`register_memory`](Self::register_memory) (location `*` lets the transports detect
    /// it). The allocation watches this engine's memory registry: while a region overlapping it
    /// is registered here, [`HostAllocation::free`] refuses with [`ErrorKind::Busy`] and
    /// dropping it leaks the memory instead of freeing it, so memory a transport may still touch
    /// is never given back. It may outlive the engine (its deallocator does not need the engine).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a zero `len`, [`ErrorKind::Shutdown`] after
    /// shutdown, the transport's error when its allocator fails (no fallback then: memory the
    /// transport cannot move would only fail later).
    pub async fn allocate_host_memory(&self, len: usize) -> Result<HostAllocation> {
        self.inner.check_open()?;
        if len == 0 {
            return Err(Error::invalid("cannot allocate 0 bytes of host memory"));
        }
        let transports = self.inner.transports();
        let primary = std::iter::once(&self.inner.primary);
        let others = transports.iter().filter(|t| !Arc::ptr_eq(t, &self.inner.primary));
        let mut allocated = None;
        for t in primary.chain(others) {
            if let Some(r) = t.allocate_host(len).await {
                let a = r.map_err(|e| {
                    let msg = format!(
                        "the {} transport could not allocate {len} bytes of host memory: {}",
                        t.protocol(),
                        e.message()
                    );
                    e.context(msg)
                })?;
                tracing::debug!(
                    addr = a.addr(),
                    len,
                    transport = t.protocol(),
                    origin = a.origin(),
                    "host memory allocated"
                );
                allocated = Some(a);
                break;
            }
        }
        let mut a = match allocated {
            Some(a) => a,
            None => HostAllocation::zeroed(len)?,
        };
        a.watch(self.inner.memory.clone());
        Ok(a)
    }

    /// Blocking form of [`allocate_host_memory`](Self::allocate_host_memory).
    pub fn allocate_host_memory_blocking(&self, len: usize) -> Result<HostAllocation> {
        self.block_on(self.allocate_host_memory(len))?
    }
}

//! The KV-block API on the engine: layouts registered and published by name, peers' layouts
//! fetched, and block transfers planned into merged requests.

use super::*;

/// Identifies a KV layout registered with [`TransferEngine::register_kv_layout`]. Not made from
/// an integer (bindings turn theirs back with [`TransferEngine::kv_layout_id`], which checks it);
/// unique in the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayoutId(u64);

impl KvLayoutId {
    pub(super) fn fresh() -> Self {
        static NEXT_LAYOUT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT_LAYOUT.fetch_add(1, Ordering::Relaxed))
    }

    /// Its number, for bindings that pass ids as integers.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A KV layout this engine registered, with the name it is published under (if any).
pub(super) struct RegisteredLayout {
    layout: Arc<KvLayout>,
    published_as: Option<String>,
}

/// A submitted block transfer: the batch plus the mapping from requests back to blocks.
#[derive(Debug, Clone)]
pub struct BlockBatch {
    batch: Batch,
    runs: Vec<BlockRun>,
    local_blocks: Vec<u32>,
}

impl BlockBatch {
    /// The underlying batch (one request per run).
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// The merged runs, in request order.
    pub fn runs(&self) -> &[BlockRun] {
        &self.runs
    }

    /// Local block ids whose transfer failed or was cancelled (in any region), sorted.
    pub fn failed_blocks(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, run) in self.runs.iter().enumerate() {
            if matches!(
                self.batch.request_status(i),
                Some(crate::RequestStatus::Failed(_) | crate::RequestStatus::Cancelled)
            ) {
                let first = run.first_pair as usize;
                out.extend_from_slice(&self.local_blocks[first..first + run.pairs as usize]);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Waits for every run; `Ok` only when every block moved.
    pub async fn wait(&self, timeout: Duration) -> Result<()> {
        self.batch.wait_ok(timeout).await
    }

    /// Blocking form of [`wait`](Self::wait).
    pub fn wait_blocking(&self, timeout: Duration) -> Result<()> {
        self.batch.wait_ok_blocking(timeout)
    }
}

impl EngineInner {
    /// Writes the layouts published by name into this engine's descriptor `d`.
    pub(super) fn write_published_layouts(&self, d: &mut SegmentDescriptor) {
        let layouts = self.layouts.read().unwrap_or_else(|p| p.into_inner());
        let mut named: Vec<(&str, &KvLayout)> =
            layouts.values().filter_map(|l| l.published_as.as_deref().map(|n| (n, l.layout.as_ref()))).collect();
        named.sort_by_key(|(n, _)| *n);
        publish_kv_layouts(d, named);
    }
}

impl TransferEngine {
    /// The id of a KV layout numbered `raw` ([`KvLayoutId::raw`]), for bindings that pass ids as
    /// integers: [`ErrorKind::NotFound`] unless this engine has it registered.
    pub fn kv_layout_id(&self, raw: u64) -> Result<KvLayoutId> {
        let id = KvLayoutId(raw);
        if self.inner.layouts.read().unwrap_or_else(|p| p.into_inner()).contains_key(&id) {
            Ok(id)
        } else {
            Err(Error::not_found(format!("KV layout {raw} is not registered with this engine")))
        }
    }

    /// Registers a KV layout of local memory. Every region's bytes must lie inside one
    /// registered memory region ([`ErrorKind::OutOfBounds`] otherwise). The layout stays
    /// local; [`publish_kv_layout`](Self::publish_kv_layout) also lets peers fetch it by name.
    pub fn register_kv_layout(&self, layout: KvLayout) -> Result<KvLayoutId> {
        self.inner.check_open()?;
        self.check_layout_memory(&layout)?;
        let id = KvLayoutId::fresh();
        let entry = RegisteredLayout { layout: Arc::new(layout), published_as: None };
        self.inner.layouts.write().unwrap_or_else(|p| p.into_inner()).insert(id, entry);
        Ok(id)
    }

    /// Registers a KV layout of local memory (as [`register_kv_layout`](Self::register_kv_layout))
    /// and publishes it in this engine's descriptor under `name`, where a peer fetches it with
    /// [`remote_kv_layout`](Self::remote_kv_layout). Returns once the descriptor naming it is
    /// published.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for an empty, over-long
    /// ([`KV_LAYOUT_NAME_MAX`](crate::kv::KV_LAYOUT_NAME_MAX) bytes) or control-character name,
    /// [`ErrorKind::AlreadyExists`] when a layout of that name is published already (unregister
    /// it first), the layout's errors as for `register_kv_layout`, the metadata service's error
    /// when publishing fails (nothing is registered then).
    pub async fn publish_kv_layout(&self, name: &str, layout: KvLayout) -> Result<KvLayoutId> {
        self.inner.check_open()?;
        check_kv_layout_name(name)?;
        self.check_layout_memory(&layout)?;
        let id = {
            let mut layouts = self.inner.layouts.write().unwrap_or_else(|p| p.into_inner());
            if layouts.values().any(|l| l.published_as.as_deref() == Some(name)) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("a KV layout named `{name}` is published by engine `{}` already", self.inner.name),
                ));
            }
            let id = KvLayoutId::fresh();
            layouts.insert(id, RegisteredLayout { layout: Arc::new(layout), published_as: Some(name.to_owned()) });
            id
        };
        if let Err(e) = self.inner.publish().await {
            self.inner.layouts.write().unwrap_or_else(|p| p.into_inner()).remove(&id);
            return Err(e.context(format!("publishing KV layout `{name}`: {}", e.message())));
        }
        Ok(id)
    }

    /// Blocking form of [`publish_kv_layout`](Self::publish_kv_layout).
    pub fn publish_kv_layout_blocking(&self, name: &str, layout: KvLayout) -> Result<KvLayoutId> {
        self.block_on(self.publish_kv_layout(name, layout))?
    }

    /// Checks that every region of `layout` lies inside registered memory.
    pub(super) fn check_layout_memory(&self, layout: &KvLayout) -> Result<()> {
        let ranges = layout.validate()?;
        for (i, (base, len)) in ranges.into_iter().enumerate() {
            self.inner.memory.lease(base, len).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("KV layout region {i} ({base:#x}+{len}) is not registered memory: {}", e.message()),
                )
            })?;
        }
        Ok(())
    }

    /// Forgets a KV layout. A published one leaves this engine's descriptor with a
    /// re-publication started at once (in the background: peers that fetched it keep their
    /// copy, and the memory it names stays registered until unregistered).
    pub fn unregister_kv_layout(&self, id: KvLayoutId) -> Result<()> {
        let removed = self
            .inner
            .layouts
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
            .ok_or_else(|| Error::not_found(format!("KV layout {} is not registered", id.0)))?;
        if let Some(name) = removed.published_as {
            let inner = Arc::downgrade(&self.inner);
            self.inner.runtime.spawn(async move {
                let Some(inner) = inner.upgrade() else { return };
                if let Err(e) = inner.publish().await
                    && e.kind() != ErrorKind::Shutdown
                {
                    tracing::warn!(segment = %inner.name, layout = %name, error = %e, "republishing without an unregistered KV layout failed; the next publication drops it");
                }
            });
        }
        Ok(())
    }

    /// The registered layout `id`.
    pub fn kv_layout(&self, id: KvLayoutId) -> Result<Arc<KvLayout>> {
        self.inner
            .layouts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .map(|l| l.layout.clone())
            .ok_or_else(|| Error::not_found(format!("KV layout {} is not registered", id.0)))
    }

    /// The KV layout that the peer behind `target` publishes as `name`
    /// ([`publish_kv_layout`](Self::publish_kv_layout)), validated. When the cached descriptor
    /// does not name it, the descriptor is fetched again once (the peer may have published it
    /// after this engine opened the segment).
    ///
    /// Errors: [`ErrorKind::NotFound`] naming the layouts the peer does publish,
    /// [`ErrorKind::InvalidArgument`] or [`ErrorKind::OutOfBounds`] for a malformed entry, the
    /// metadata service's error when the refetch fails.
    pub async fn remote_kv_layout(&self, target: SegmentHandle, name: &str) -> Result<KvLayout> {
        let seg = self.inner.segment_for_use(target).await?;
        if let Some(layout) = published_kv_layout(seg.descriptor(), name)? {
            return Ok(layout);
        }
        let seg = self.inner.load_segment(seg.name()).await?;
        if let Some(layout) = published_kv_layout(seg.descriptor(), name)? {
            return Ok(layout);
        }
        let names = published_kv_layout_names(seg.descriptor());
        let have = if names.is_empty() {
            "it publishes no KV layouts".to_owned()
        } else {
            format!("it publishes: {}", names.join(", "))
        };
        Err(Error::not_found(format!("segment `{}` publishes no KV layout named `{name}` ({have})", seg.name())))
    }

    /// Blocking form of [`remote_kv_layout`](Self::remote_kv_layout).
    pub fn remote_kv_layout_blocking(&self, target: SegmentHandle, name: &str) -> Result<KvLayout> {
        self.block_on(self.remote_kv_layout(target, name))?
    }

    /// Moves blocks between local layout `local` and `remote_layout` of segment `target`
    /// (the peer's layout, as it described it). Adjacent blocks are merged into one request per
    /// region; [`BlockBatch::failed_blocks`] names the local blocks that did not move.
    pub async fn submit_blocks(
        &self,
        local: KvLayoutId,
        target: SegmentHandle,
        remote_layout: &KvLayout,
        spec: &BlockTransfer<'_>,
    ) -> Result<BlockBatch> {
        let (requests, runs) = self.block_requests(local, target, remote_layout, spec)?;
        let batch = self.submit(&requests).await?;
        Ok(BlockBatch { batch, runs, local_blocks: spec.local_blocks.to_vec() })
    }

    /// The requests that move `spec`'s blocks, and the runs they came from.
    fn block_requests(
        &self,
        local: KvLayoutId,
        target: SegmentHandle,
        remote_layout: &KvLayout,
        spec: &BlockTransfer<'_>,
    ) -> Result<(Vec<TransferRequest>, Vec<BlockRun>)> {
        let layout = self.kv_layout(local)?;
        let runs = plan_block_transfer(&layout, remote_layout, spec)?;
        Ok((runs.iter().map(|r| r.to_request(spec.opcode, target)).collect(), runs))
    }

    /// [`submit_blocks_blocking`](Self::submit_blocks_blocking) for a caller that waits for the
    /// batch on this thread at once ([`BlockBatch::wait_blocking`]), as
    /// [`submit_for_blocking_wait`](Self::submit_for_blocking_wait) is for requests: the
    /// transports may run the transfer on this thread before this returns (the `ascend`
    /// transport does when this thread has its device's context current).
    pub fn submit_blocks_for_blocking_wait(
        &self,
        local: KvLayoutId,
        target: SegmentHandle,
        remote_layout: &KvLayout,
        spec: &BlockTransfer<'_>,
    ) -> Result<BlockBatch> {
        let (requests, runs) = self.block_requests(local, target, remote_layout, spec)?;
        let batch = self.submit_for_blocking_wait(&requests)?;
        Ok(BlockBatch { batch, runs, local_blocks: spec.local_blocks.to_vec() })
    }

    /// Blocking form of [`submit_blocks`](Self::submit_blocks).
    pub fn submit_blocks_blocking(
        &self,
        local: KvLayoutId,
        target: SegmentHandle,
        remote_layout: &KvLayout,
        spec: &BlockTransfer<'_>,
    ) -> Result<BlockBatch> {
        self.block_on(self.submit_blocks(local, target, remote_layout, spec))?
    }
}

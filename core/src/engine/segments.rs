//! The segment cache: opening peers' segments (fetch, pick or load a transport, open the peer
//! once per descriptor), refreshing them when their descriptor changes, closing them.

use super::*;

#[derive(Default)]
pub(super) struct SegmentTable {
    by_name: HashMap<String, SegmentHandle>,
    by_handle: HashMap<SegmentHandle, Route>,
}

impl SegmentTable {
    /// Open segments.
    pub(super) fn len(&self) -> usize {
        self.by_handle.len()
    }
}

/// An open segment and the transport that serves it (the engine's: transports see only the
/// segment, and callers neither, so no caller can reach a transport's methods).
#[derive(Clone)]
pub(super) struct Route {
    pub(super) segment: Arc<OpenSegment>,
    pub(super) transport: Arc<dyn Transport>,
}

impl std::ops::Deref for Route {
    type Target = OpenSegment;

    fn deref(&self) -> &OpenSegment {
        &self.segment
    }
}

pub(super) async fn watch_segments(engine: Weak<EngineInner>, mut rx: tokio::sync::mpsc::Receiver<WatchEvent>) {
    while let Some(event) = rx.recv().await {
        let Some(engine) = engine.upgrade() else { return };
        let Some(name) = engine.keys.segment_name_of(event.key()) else { continue };
        if name == engine.name {
            continue;
        }
        let table = engine.segments.read().unwrap_or_else(|p| p.into_inner());
        if let Some(seg) = table.by_name.get(name).and_then(|h| table.by_handle.get(h)) {
            tracing::debug!(segment = name, "descriptor changed in metadata; cache entry marked stale");
            seg.mark_stale();
        }
    }
}

/// Reads `name`'s descriptor from `store`.
pub(super) async fn fetch_descriptor(
    store: &dyn MetadataStore,
    keys: &MetadataKeys,
    name: &str,
) -> Result<SegmentDescriptor> {
    let key = keys.segment(name);
    let bytes = store.get(&key).await.map_err(|e| {
        Error::new(e.kind(), format!("looking up segment `{name}` in {} metadata: {}", store.name(), e.message()))
            .with_source(e)
    })?;
    let bytes = bytes.ok_or_else(|| {
        Error::not_found(format!(
            "segment `{name}` is not published in the {} metadata store (key {key})",
            store.name()
        ))
    })?;
    SegmentDescriptor::from_json(&key, &bytes)
}

/// The engine's metadata store as a [`DescriptorSource`] for its transports.
pub(super) struct MetadataDescriptors {
    pub(super) store: Arc<dyn MetadataStore>,
    pub(super) keys: MetadataKeys,
}

#[async_trait::async_trait]
impl crate::transport::DescriptorSource for MetadataDescriptors {
    async fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor> {
        fetch_descriptor(self.store.as_ref(), &self.keys, name).await
    }
}

impl EngineInner {
    pub(super) async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        fetch_descriptor(self.store.as_ref(), &self.keys, name).await
    }

    /// The transport serving `desc`: an installed one, else one created from the registry
    /// (loading a plugin when a source has it). A new transport is told about every registered
    /// region and may add fields to this engine's descriptor, which is then republished.
    pub(super) async fn pick_transport(&self, desc: &SegmentDescriptor) -> Result<Arc<dyn Transport>> {
        if let Some(t) = self.transports().iter().find(|t| t.serves(desc)) {
            return Ok(t.clone());
        }
        let _change = self.transport_change.lock().await;
        // Shutdown stops the transports under this lock: none may be added after it.
        self.check_open()?;
        if let Some(t) = self.transports().iter().find(|t| t.serves(desc)) {
            return Ok(t.clone());
        }
        let factory = self
            .transport_registry
            .load(&desc.protocol, &self.config)
            .map_err(|e| e.context(format!("segment `{}`: {}", desc.name, e.message())))?
            .ok_or_else(|| no_transport_for(desc, &self.transport_registry.searched(&self.config)))?;
        if factory.companion() && !self.config.local_transport() {
            // Left out by the config: not brought back for a peer that publishes it.
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "segment `{}` is served by the same-process `{}` transport only, which this engine leaves out \
                     (`local_transport` is false, {})",
                    desc.name,
                    desc.protocol,
                    self.config.describe_source("local_transport")
                ),
            ));
        }
        let transport = factory.create(&self.ctx).await?;
        if !transport.serves(desc) {
            transport.shutdown().await;
            return Err(no_transport_for(desc, &self.transport_registry.searched(&self.config)));
        }
        let regions = self.memory.regions();
        for (i, region) in regions.iter().enumerate() {
            if let Err(e) = transport.register_memory(region, registration::engine_promise()).await {
                for r in &regions[..i] {
                    let _ = transport.unregister_memory(r).await;
                }
                transport.shutdown().await;
                return Err(e.context(format!(
                    "the {} transport (loaded for segment `{}`) refused registered memory: {}",
                    desc.protocol,
                    desc.name,
                    e.message()
                )));
            }
        }
        {
            let mut list = self.transports.write().unwrap_or_else(|p| p.into_inner());
            let mut next = Vec::clone(&list);
            next.push(transport.clone());
            *list = Arc::new(next);
        }
        tracing::info!(segment = %self.name, protocol = %desc.protocol, peer = %desc.name, "transport added for a peer");
        drop(_change);
        if let Err(e) = self.publish().await {
            tracing::warn!(segment = %self.name, error = %e, "republishing after adding a transport failed");
        }
        Ok(transport)
    }

    /// Fetches `name` and stores it under its existing handle or a new one.
    pub(super) async fn load_segment(&self, name: &str) -> Result<Route> {
        let desc = self.fetch(name).await?;
        if desc.name != name {
            return Err(Error::invalid(format!(
                "the descriptor stored for segment `{name}` names another segment, `{}`",
                desc.name
            )));
        }
        let transport = self.pick_transport(&desc).await?;
        // The transport opens the peer once per descriptor; an error is kept for its submits.
        let peer = transport.open(&desc).await;
        let mut table = self.segments.write().unwrap_or_else(|p| p.into_inner());
        let handle = match table.by_name.get(name) {
            Some(h) => *h,
            None => {
                let h = SegmentHandle::fresh();
                table.by_name.insert(name.to_owned(), h);
                h
            }
        };
        // The route's counters are found (or made) here, once per open, never per request.
        let metrics = self.metrics.route(transport.protocol(), name);
        let segment = Arc::new(OpenSegment::new(handle, desc, transport.protocol(), peer).with_metrics(metrics));
        let route = Route { segment, transport };
        table.by_handle.insert(handle, route.clone());
        Ok(route)
    }

    pub(super) fn cached(&self, handle: SegmentHandle) -> Result<Route> {
        let table = self.segments.read().unwrap_or_else(|p| p.into_inner());
        table
            .by_handle
            .get(&handle)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("segment handle {} is not open in this engine", handle.raw())))
    }

    /// The cached segment, refreshed first when it was marked stale.
    pub(super) async fn segment_for_use(&self, handle: SegmentHandle) -> Result<Route> {
        let seg = self.cached(handle)?;
        if seg.is_stale() {
            return match self.load_segment(seg.name()).await {
                // The metadata service is down: keep using what we know (the peer may well
                // still be there); the entry stays stale and is refetched on the next use.
                Err(e) if matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::Timeout) => {
                    tracing::warn!(segment = seg.name(), error = %e, "metadata unreachable; using the cached descriptor");
                    Ok(seg)
                }
                other => other,
            };
        }
        Ok(seg)
    }
}

impl TransferEngine {
    /// Opens the segment `name` (this engine's own name included): looks it up in the cache, or
    /// fetches its descriptor from metadata and picks the transport that serves it. A cached
    /// descriptor marked stale (its peer failed, or metadata reported a change) is refetched.
    ///
    /// Errors: [`ErrorKind::NotFound`] when it is not published; the backend's error when
    /// metadata cannot be reached; [`ErrorKind::Unsupported`] when no installed transport
    /// serves its protocol.
    pub async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        self.inner.check_open()?;
        if name.is_empty() {
            return Err(Error::invalid("segment name is empty"));
        }
        let cached = {
            let table = self.inner.segments.read().unwrap_or_else(|p| p.into_inner());
            table.by_name.get(name).and_then(|h| table.by_handle.get(h)).cloned()
        };
        match cached {
            Some(seg) if !seg.is_stale() => Ok(seg.handle()),
            _ => Ok(self.inner.load_segment(name).await?.handle()),
        }
    }

    /// Blocking form of [`open_segment`](Self::open_segment).
    pub fn open_segment_blocking(&self, name: &str) -> Result<SegmentHandle> {
        self.block_on(self.open_segment(name))?
    }

    /// Refetches a segment's descriptor now.
    pub async fn refresh_segment(&self, handle: SegmentHandle) -> Result<()> {
        let name = self.inner.cached(handle)?.name().to_owned();
        self.inner.load_segment(&name).await.map(|_| ())
    }

    /// The opened segment behind `handle`.
    pub fn segment(&self, handle: SegmentHandle) -> Result<Arc<OpenSegment>> {
        self.inner.cached(handle).map(|route| route.segment)
    }

    /// The handle of an open segment numbered `raw` ([`SegmentHandle::raw`]), for bindings that
    /// pass handles as integers: [`ErrorKind::NotFound`] unless this engine has it open.
    pub fn segment_handle(&self, raw: u64) -> Result<SegmentHandle> {
        let handle = SegmentHandle::from_raw(raw);
        let table = self.inner.segments.read().unwrap_or_else(|p| p.into_inner());
        if table.by_handle.contains_key(&handle) {
            Ok(handle)
        } else {
            Err(Error::not_found(format!("segment handle {raw} is not open in this engine")))
        }
    }

    /// Forgets an opened segment (its handle becomes invalid).
    pub fn close_segment(&self, handle: SegmentHandle) -> Result<()> {
        let mut table = self.inner.segments.write().unwrap_or_else(|p| p.into_inner());
        let seg = table
            .by_handle
            .remove(&handle)
            .ok_or_else(|| Error::not_found(format!("segment handle {} is not open", handle.raw())))?;
        table.by_name.remove(seg.name());
        Ok(())
    }
}

//! Publication: the engine's own descriptor (buffers, KV layouts, what each transport adds),
//! writing it and the `rpc_meta` entry, and keeping them published.

use super::*;

/// How often an engine checks that its descriptor is still published.
pub const REPUBLISH_CHECK: Duration = Duration::from_secs(2);

/// Re-publishes this engine's entries whenever the metadata service lost them (a server
/// restart, an expired etcd lease), once it answers again.
pub(super) async fn keep_published(engine: Weak<EngineInner>) {
    loop {
        tokio::time::sleep(REPUBLISH_CHECK).await;
        let Some(engine) = engine.upgrade() else { return };
        if engine.shut_down.load(Ordering::Acquire) {
            return;
        }
        match engine.store.get(&engine.keys.segment(&engine.name)).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                tracing::warn!(segment = %engine.name, metadata = engine.store.name(), "descriptor missing from metadata; publishing again");
                if let Err(e) = async {
                    engine.publish().await?;
                    engine.publish_rpc().await
                }
                .await
                {
                    tracing::warn!(segment = %engine.name, error = %e, "re-publication failed; will retry");
                }
            }
            Err(e) => tracing::debug!(segment = %engine.name, error = %e, "metadata unreachable; will check again"),
        }
    }
}

impl EngineInner {
    /// Refuses to publish over a descriptor that a live engine of this process owns (same
    /// name, same metadata namespace). A descriptor left by a process that died, or by this
    /// engine's predecessor after a restart, is replaced as Mooncake does.
    pub(super) async fn refuse_live_namesake(&self) -> Result<()> {
        let key = self.keys.segment(&self.name);
        let Ok(Some(bytes)) = self.store.get(&key).await else { return Ok(()) };
        let Ok(existing) = SegmentDescriptor::from_json(&key, &bytes) else { return Ok(()) };
        let live_here = self.transports().iter().any(|t| !t.capabilities().cross_process && t.serves(&existing));
        if live_here && existing.ferry_instance.as_deref() != Some(&self.instance) {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "segment name `{}` is already published by a live engine of this process (key {key})",
                    self.name
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn descriptor(&self) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new(self.name.clone(), self.primary.protocol());
        d.buffers = self
            .memory
            .regions_in_registration_order()
            .iter()
            .map(|r| BufferDesc {
                addr: r.addr(),
                length: r.len(),
                name: r.location().to_string(),
                device_id: None,
                extra: Default::default(),
            })
            .collect();
        d.ferry_instance = Some(self.instance.clone());
        d.timestamp = Some(crate::descriptor::mooncake_timestamp_now());
        self.write_published_layouts(&mut d);
        for t in self.transports().iter() {
            t.publish(&mut d);
        }
        d
    }

    pub(super) async fn publish(&self) -> Result<()> {
        let _guard = self.publish_lock.lock().await;
        // Shutdown removes the entries under this lock: never publish after it.
        self.check_open()?;
        let desc = self.descriptor();
        let key = self.keys.segment(&self.name);
        let json = desc.to_json();
        self.store.put(&key, &json).await.map_err(|e| {
            e.context(format!(
                "publishing segment `{}` to {} metadata (key {key}): {}",
                self.name,
                self.store.name(),
                e.message()
            ))
        })?;
        self.channel.descriptor_published(Some(&json));
        Ok(())
    }

    /// Publishes the `rpc_meta` entry (once, at start: it never changes, and Mooncake's Python
    /// metadata servers refuse a second PUT of it).
    pub(super) async fn publish_rpc(&self) -> Result<()> {
        // The control channel's listener port when it runs one, else the name's port; a name
        // without a port (`host`) is its own host part.
        let (host, port) = match SegmentName::parse(&self.name) {
            Some(n) => (n.host().to_owned(), self.channel.rpc_port().or(Some(n.port()))),
            None => (self.name.clone(), self.channel.rpc_port()),
        };
        if let Some(port) = port {
            let rpc = RpcMeta { ip_or_host_name: host, rpc_port: port };
            let body = serde_json::to_vec(&rpc).expect("serialisable");
            let key = self.keys.rpc(&self.name);
            self.channel.claim_rpc_entry(&key, &body).await?;
            self.store.put(&key, &body).await?;
        }
        Ok(())
    }
}

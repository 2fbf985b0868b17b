//! The [`MetadataBackend`] trait (where segment descriptors are published and found), the
//! in-process backend that is Ferry's embedded default, and the factory table that builds
//! backends from a config's `metadata_server`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::config::{Config, MetadataServer};
use crate::error::{Error, Result};

/// What changed under a watched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// `key` was written.
    Put {
        /// The key.
        key: String,
    },
    /// `key` was removed (or its lease expired).
    Delete {
        /// The key.
        key: String,
    },
}

impl WatchEvent {
    /// The key the event is about.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put { key } | WatchEvent::Delete { key } => key,
        }
    }
}

/// A small key/value store over which segment descriptors and RPC entries are published.
///
/// # Contract
/// - Keys are UTF-8 strings built by [`MetadataKeys`](crate::MetadataKeys); values are opaque
///   bytes (JSON in practice).
/// - `put` is idempotent: writing the same key again replaces the value (a restarted engine must
///   always be able to re-publish).
/// - `get` of an absent key is `Ok(None)`, not an error.
/// - `delete` of an absent key is `Ok(())`.
///
/// # Errors
/// [`ErrorKind::PeerUnreachable`](crate::ErrorKind::PeerUnreachable) when the service cannot be
/// reached, [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when it does not answer in time.
///
/// # Threading
/// Implementations are `Send + Sync` and are called concurrently from any task; every method
/// must finish within the backend's own timeout (no call may hang forever).
#[async_trait]
pub trait MetadataBackend: Send + Sync + 'static {
    /// Short name for logs and `ferry doctor` (`embedded`, `http`, `etcd`, ...).
    fn name(&self) -> &str;

    /// Reads `key`.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Writes `key`.
    async fn put(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Removes `key`.
    async fn delete(&self, key: &str) -> Result<()>;

    /// Subscribes to changes of keys starting with `prefix`. `Ok(None)` means the backend cannot
    /// watch (the engine then relies on refresh-on-failure alone). The stream ends when the
    /// backend shuts down.
    async fn watch(&self, prefix: &str) -> Result<Option<mpsc::Receiver<WatchEvent>>> {
        let _ = prefix;
        Ok(None)
    }

    /// The segment name this backend assigns the local engine, if it decides it (the P2P
    /// handshake names an engine `host:rpc_port`). `None`: the config's name is used.
    fn segment_name_hint(&self) -> Option<String> {
        None
    }

    /// The port of this engine's handshake listener (Mooncake's RPC port, published in the
    /// `rpc_meta` entry), when the backend runs one. `None`: the port of the segment name is
    /// published.
    fn rpc_port(&self) -> Option<u16> {
        None
    }

    /// Sends a notification to the owner of `segment` over the backend's control channel.
    /// Backends without one answer [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported).
    async fn notify(&self, segment: &str, notification: &Notification) -> Result<()> {
        let _ = (segment, notification);
        Err(Error::new(
            crate::ErrorKind::Unsupported,
            format!("the {} metadata backend has no control channel for notifications", self.name()),
        ))
    }

    /// Takes the notifications received so far (oldest first).
    fn drain_notifications(&self) -> Vec<Notification> {
        Vec::new()
    }

    /// Checks that the owner of `segment` is alive: sends a Probe over the control channel
    /// (Mooncake's `send_probe`) and waits for its answer. Backends without a control channel
    /// answer [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) when the segment publishes no
    /// listener, [`ErrorKind::PeerUnreachable`](crate::ErrorKind::PeerUnreachable) or
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when its listener does not answer.
    async fn probe(&self, segment: &str) -> Result<()> {
        let _ = segment;
        Err(Error::new(
            crate::ErrorKind::Unsupported,
            format!("the {} metadata backend has no control channel to probe a peer over", self.name()),
        ))
    }

    /// Releases what the backend holds for its engine (a listening socket, for example), once
    /// the engine has unpublished itself at shutdown. When it returns, the resources are free
    /// (an engine of the same name can start at once).
    async fn close(&self) {}
}

/// A notification: a short message from one engine to another, delivered over the control
/// channel (Mooncake's Notify frame: `{"name": ..., "notify_msg": ...}`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Notification {
    /// Sender's segment name.
    pub name: String,
    /// The message.
    pub notify_msg: String,
}

type Watchers = Vec<(String, mpsc::Sender<WatchEvent>)>;

/// The in-process metadata store: a map in memory shared by the engines of one process.
///
/// [`InProcessMetadata::shared`] is the process-wide instance that engines built without a
/// metadata server use, so two such engines in one process find each other.
#[derive(Default)]
pub struct InProcessMetadata {
    entries: Mutex<BTreeMap<String, Arc<[u8]>>>,
    watchers: Mutex<Watchers>,
}

impl std::fmt::Debug for InProcessMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.entries.lock().map(|e| e.len()).unwrap_or(0);
        f.debug_struct("InProcessMetadata").field("entries", &n).finish()
    }
}

impl InProcessMetadata {
    /// A new, empty, private store.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The process-wide store (the embedded default).
    pub fn shared() -> Arc<Self> {
        static SHARED: OnceLock<Arc<InProcessMetadata>> = OnceLock::new();
        SHARED.get_or_init(InProcessMetadata::new).clone()
    }

    /// All keys currently stored (sorted).
    pub fn keys(&self) -> Vec<String> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }

    fn notify(&self, event: WatchEvent) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain(|(prefix, tx)| {
            if !event.key().starts_with(prefix.as_str()) {
                return !tx.is_closed();
            }
            // A full watcher misses an event rather than blocking writers; the engine treats
            // watch events as hints and still refreshes on failure.
            !matches!(tx.try_send(event.clone()), Err(mpsc::error::TrySendError::Closed(_)))
        });
    }
}

#[async_trait]
impl MetadataBackend for InProcessMetadata {
    fn name(&self) -> &str {
        "embedded"
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        Ok(entries.get(key).map(|v| v.to_vec()))
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("metadata key is empty"));
        }
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned(), value.into());
        self.notify(WatchEvent::Put { key: key.to_owned() });
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let existed = self.entries.lock().unwrap_or_else(|p| p.into_inner()).remove(key).is_some();
        if existed {
            self.notify(WatchEvent::Delete { key: key.to_owned() });
        }
        Ok(())
    }

    async fn watch(&self, prefix: &str) -> Result<Option<mpsc::Receiver<WatchEvent>>> {
        let (tx, rx) = mpsc::channel(256);
        self.watchers.lock().unwrap_or_else(|p| p.into_inner()).push((prefix.to_owned(), tx));
        Ok(Some(rx))
    }
}

/// Builds a metadata backend for one kind of `metadata_server` (`http`, `etcd`, `redis`, `p2p`).
///
/// Backend crates provide one; the facade crate installs those compiled in.
#[async_trait]
pub trait MetadataFactory: Send + Sync + 'static {
    /// The [`MetadataServer::kind`] this factory serves.
    fn kind(&self) -> &'static str;

    /// Connects to the server named in `server` (validated at start: an unreachable server is an
    /// error naming the endpoint and what was tried).
    async fn connect(&self, server: &MetadataServer, config: &Config) -> Result<Arc<dyn MetadataBackend>>;
}

/// Metadata factories by kind. The embedded backend is always available.
#[derive(Default, Clone)]
pub struct MetadataRegistry {
    factories: HashMap<&'static str, Arc<dyn MetadataFactory>>,
}

impl std::fmt::Debug for MetadataRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.kinds()).finish()
    }
}

impl MetadataRegistry {
    /// A registry with only the embedded backend.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the factory for its kind.
    pub fn install(&mut self, factory: Arc<dyn MetadataFactory>) {
        self.factories.insert(factory.kind(), factory);
    }

    /// Kinds available, sorted, `embedded` included.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut k: Vec<_> = self.factories.keys().copied().chain(["embedded"]).collect();
        k.sort_unstable();
        k.dedup();
        k
    }

    /// Builds the backend `config` names.
    pub async fn connect(&self, config: &Config) -> Result<Arc<dyn MetadataBackend>> {
        let server = config.metadata()?;
        if server == MetadataServer::Embedded {
            return Ok(InProcessMetadata::shared());
        }
        let Some(factory) = self.factories.get(server.kind()) else {
            return Err(config.field_error(
                "metadata_server",
                &format!(
                    "the {} metadata backend is not built into this program (available: {})",
                    server.kind(),
                    self.kinds().join(", ")
                ),
            ));
        };
        factory.connect(&server, config).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn in_process_contract() {
        let m = InProcessMetadata::new();
        assert_eq!(m.get("k").await.unwrap(), None);
        let mut w = m.watch("mooncake/").await.unwrap().unwrap();
        m.put("mooncake/ram/a", b"1").await.unwrap();
        m.put("mooncake/ram/a", b"2").await.unwrap(); // idempotent re-publish
        m.put("other/x", b"3").await.unwrap();
        assert_eq!(m.get("mooncake/ram/a").await.unwrap().as_deref(), Some(&b"2"[..]));
        m.delete("mooncake/ram/a").await.unwrap();
        m.delete("mooncake/ram/a").await.unwrap(); // absent: fine
        assert_eq!(m.get("mooncake/ram/a").await.unwrap(), None);
        assert!(m.put("", b"x").await.is_err());
        assert_eq!(w.recv().await.unwrap(), WatchEvent::Put { key: "mooncake/ram/a".into() });
        assert_eq!(w.recv().await.unwrap(), WatchEvent::Put { key: "mooncake/ram/a".into() });
        assert_eq!(w.recv().await.unwrap(), WatchEvent::Delete { key: "mooncake/ram/a".into() });
        assert!(w.try_recv().is_err(), "the other/ key and the absent delete are not reported");
    }

    #[tokio::test]
    async fn missing_backend_is_named() {
        let cfg = Config::from_json_str(r#"{"metadata_server":"etcd://h:2379"}"#, None).unwrap();
        let e = MetadataRegistry::new().connect(&cfg).await.err().expect("no etcd backend installed");
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert!(e.message().contains("etcd metadata backend is not built"), "{e}");
        assert!(e.message().contains("available: embedded"), "{e}");
    }
}

//! The [`MetadataStore`] trait (where segment descriptors are published and found), the
//! in-process store that is Ferry's embedded default, and the registry that builds a config's
//! store (`metadata_server`) and the [`ControlChannel`] beside it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::config::{Config, MetadataServer};
use crate::control::{ControlChannel, NoControlChannel};
use crate::environment::Environment;
use crate::error::{Error, Result};
use crate::options::{OptionSpec, OptionValue};

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
/// A store is only that: how engines talk to each other (notifications, probes) is their
/// [`ControlChannel`], which the [`MetadataRegistry`] starts beside the store. A store that is a
/// channel too (the P2P handshake, where descriptors are fetched from the peers themselves)
/// says so with [`control_channel`](Self::control_channel); others need no channel code.
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
/// reached, [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when it does not answer in time,
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for an empty key on `put`.
///
/// # Threading
/// Implementations are `Send + Sync` and are called concurrently from any task; every method
/// must finish within the store's own timeout (no call may hang forever).
#[async_trait]
pub trait MetadataStore: Send + Sync + 'static {
    /// Short name for logs and `ferry doctor` (`embedded`, `http`, `etcd`, ...).
    fn name(&self) -> &str;

    /// Reads `key`.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Writes `key`.
    async fn put(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Removes `key`.
    async fn delete(&self, key: &str) -> Result<()>;

    /// Subscribes to changes of keys starting with `prefix`. `Ok(None)` means the store cannot
    /// watch (the engine then relies on refresh-on-failure alone). The stream ends when the
    /// store shuts down.
    async fn watch(&self, prefix: &str) -> Result<Option<mpsc::Receiver<WatchEvent>>> {
        let _ = prefix;
        Ok(None)
    }

    /// The control channel this store is itself, when it is one (the P2P handshake: the listener
    /// that serves its descriptor also takes notifications). `None`, the default: the engine
    /// gets the channel the registry starts beside the store, if any.
    fn control_channel(&self) -> Option<Arc<dyn ControlChannel>> {
        None
    }
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
impl MetadataStore for InProcessMetadata {
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

/// Starts a [`ControlChannel`] beside a [`MetadataStore`] that is not one itself.
///
/// The `ferry` facade installs Mooncake's handshake listener (with its `p2p` feature) in
/// [`MetadataRegistry::install_channel`](crate::MetadataRegistry::install_channel), so every
/// store the registry builds gets notifications, as a Mooncake engine on any store does. Stores
/// know nothing of it.
#[async_trait]
pub trait ControlChannelFactory: Send + Sync + 'static {
    /// Short name of the channels it starts (for `ferry doctor`).
    fn name(&self) -> &'static str;

    /// The config options its channels read beyond the core's fields (see [`crate::options`]);
    /// the default declares none. Declared options are not reported as unknown fields.
    fn options(&self) -> &'static [OptionSpec] {
        &[]
    }

    /// The effective value of each of [`options`](Self::options), read and checked as
    /// [`start`](Self::start) reads them (the default shows each as set, unchecked).
    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        self.options().iter().map(|spec| OptionValue::as_set(spec, config, env)).collect()
    }

    /// Starts the channel of an engine configured by `config` on `store` (where it finds its
    /// peers' listeners). Fails when its listener cannot start (a configured port in use, for
    /// example), with an error naming what it tried.
    async fn start(&self, store: Arc<dyn MetadataStore>, config: &Config) -> Result<Arc<dyn ControlChannel>>;
}

/// Builds the metadata store for one kind of `metadata_server` (`http`, `etcd`, `redis`, `p2p`).
///
/// Store crates provide one; the facade crate installs those compiled in. A factory builds the
/// store only: the registry starts the control channel beside it.
#[async_trait]
pub trait MetadataFactory: Send + Sync + 'static {
    /// The [`MetadataServer::kind`] this factory serves.
    fn kind(&self) -> &'static str;

    /// The config options its stores read beyond the core's fields (see [`crate::options`]);
    /// the default declares none. Declared options are not reported as unknown fields.
    fn options(&self) -> &'static [OptionSpec] {
        &[]
    }

    /// The effective value of each of [`options`](Self::options), read and checked as
    /// [`connect`](Self::connect) reads them (the default shows each as set, unchecked).
    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        self.options().iter().map(|spec| OptionValue::as_set(spec, config, env)).collect()
    }

    /// Connects to the server named in `server` (validated at start: an unreachable server is an
    /// error naming the endpoint and what was tried).
    async fn connect(&self, server: &MetadataServer, config: &Config) -> Result<Arc<dyn MetadataStore>>;
}

/// A metadata store and the control channel beside it, as [`MetadataRegistry::connect`] built
/// them for a config.
#[derive(Clone)]
pub struct MetadataConnection {
    /// Where descriptors and rpc entries are published.
    pub store: Arc<dyn MetadataStore>,
    /// How the engine talks to its peers' engines ([`NoControlChannel`] when it has none).
    pub channel: Arc<dyn ControlChannel>,
}

impl std::fmt::Debug for MetadataConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataConnection")
            .field("store", &self.store.name())
            .field("channel", &self.channel.name())
            .finish()
    }
}

/// Metadata store factories by kind, and the control channel started beside the stores that
/// are not channels themselves. The embedded store is always available.
#[derive(Default, Clone)]
pub struct MetadataRegistry {
    factories: HashMap<&'static str, Arc<dyn MetadataFactory>>,
    channel: Option<Arc<dyn ControlChannelFactory>>,
}

impl std::fmt::Debug for MetadataRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataRegistry").field("kinds", &self.kinds()).field("channel", &self.channel_name()).finish()
    }
}

/// Why an engine on the embedded store has no control channel.
const EMBEDDED_HAS_NO_CHANNEL: &str =
    "the in-process store runs no listener; use P2PHANDSHAKE or a metadata server for notifications";

impl MetadataRegistry {
    /// A registry with only the embedded store and no control channel.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the store factory for its kind.
    pub fn install(&mut self, factory: Arc<dyn MetadataFactory>) {
        self.factories.insert(factory.kind(), factory);
    }

    /// Sets the control channel started beside every store this registry builds from a
    /// `metadata_server` that is not a channel itself (replacing any set before).
    pub fn install_channel(&mut self, factory: Arc<dyn ControlChannelFactory>) {
        self.channel = Some(factory);
    }

    /// Kinds available, sorted, `embedded` included.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut k: Vec<_> = self.factories.keys().copied().chain(["embedded"]).collect();
        k.sort_unstable();
        k.dedup();
        k
    }

    /// The options the installed store factories and control channel declare
    /// ([`MetadataFactory::options`], [`ControlChannelFactory::options`]), by kind then the
    /// channel's, each key once.
    pub fn options(&self) -> Vec<&'static OptionSpec> {
        let mut options: Vec<&'static OptionSpec> = Vec::new();
        for spec in
            self.sorted_factories().flat_map(|f| f.options()).chain(self.channel.iter().flat_map(|c| c.options()))
        {
            if !options.iter().any(|o| o.key == spec.key) {
                options.push(spec);
            }
        }
        options
    }

    /// The effective value of each of [`options`](Self::options) under `config` and `env`, as
    /// the factory declaring it reads it (each key once, the first declaration's reading).
    pub fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        let mut values: Vec<OptionValue> = Vec::new();
        let readings = self
            .sorted_factories()
            .flat_map(|f| f.read_options(config, env))
            .chain(self.channel.iter().flat_map(|c| c.read_options(config, env)));
        for v in readings {
            if !values.iter().any(|o| o.spec.key == v.spec.key) {
                values.push(v);
            }
        }
        values
    }

    fn sorted_factories(&self) -> impl Iterator<Item = &Arc<dyn MetadataFactory>> {
        let mut f: Vec<_> = self.factories.values().collect();
        f.sort_unstable_by_key(|f| f.kind());
        f.into_iter()
    }

    /// The name of the control channel started beside stores, if one is installed.
    pub fn channel_name(&self) -> Option<&'static str> {
        self.channel.as_ref().map(|c| c.name())
    }

    /// Builds the store `config` names, without a control channel beside it (for a caller that
    /// only reads, such as `ferry doctor`). A store that is a channel itself (the P2P handshake)
    /// still runs its listener while it lives.
    pub async fn connect_store(&self, config: &Config) -> Result<Arc<dyn MetadataStore>> {
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

    /// Builds the store `config` names and its control channel: the store's own when it is one
    /// ([`MetadataStore::control_channel`]), else the installed channel started beside it, else
    /// (and for the embedded store, which serves the engines of one process) a
    /// [`NoControlChannel`].
    pub async fn connect(&self, config: &Config) -> Result<MetadataConnection> {
        let embedded = config.metadata()? == MetadataServer::Embedded;
        let store = self.connect_store(config).await?;
        let channel = if embedded {
            Arc::new(NoControlChannel::new(store.name(), EMBEDDED_HAS_NO_CHANNEL))
        } else {
            self.channel_beside(&store, config).await?
        };
        Ok(MetadataConnection { store, channel })
    }

    /// The control channel for `store`: its own when it is one, else the installed channel
    /// started beside it, else a [`NoControlChannel`] saying that none is installed.
    pub async fn channel_beside(
        &self,
        store: &Arc<dyn MetadataStore>,
        config: &Config,
    ) -> Result<Arc<dyn ControlChannel>> {
        if let Some(own) = store.control_channel() {
            return Ok(own);
        }
        match &self.channel {
            Some(factory) => factory.start(store.clone(), config).await,
            None => Ok(Arc::new(NoControlChannel::new(
                store.name(),
                "this program has no control channel installed; the `ferry` facade's `p2p` feature provides \
                 Mooncake's handshake listener",
            ))),
        }
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

    /// A channel that only has a name.
    struct Named(&'static str);
    #[async_trait]
    impl ControlChannel for Named {
        fn name(&self) -> &str {
            self.0
        }
        async fn notify(&self, _: &str, _: &crate::Notification) -> Result<()> {
            Ok(())
        }
        fn drain_notifications(&self) -> Vec<crate::Notification> {
            Vec::new()
        }
        async fn probe(&self, _: &str) -> Result<()> {
            Ok(())
        }
    }

    /// Starts a `beside` channel and counts the starts.
    #[derive(Default)]
    struct Beside(std::sync::atomic::AtomicUsize);
    #[async_trait]
    impl ControlChannelFactory for Beside {
        fn name(&self) -> &'static str {
            "beside"
        }
        async fn start(&self, _: Arc<dyn MetadataStore>, _: &Config) -> Result<Arc<dyn ControlChannel>> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Arc::new(Named("beside")))
        }
    }

    /// A store that is its own channel.
    struct Both;
    #[async_trait]
    impl MetadataStore for Both {
        fn name(&self) -> &str {
            "both"
        }
        async fn get(&self, _: &str) -> Result<Option<Vec<u8>>> {
            Ok(None)
        }
        async fn put(&self, _: &str, _: &[u8]) -> Result<()> {
            Ok(())
        }
        async fn delete(&self, _: &str) -> Result<()> {
            Ok(())
        }
        fn control_channel(&self) -> Option<Arc<dyn ControlChannel>> {
            Some(Arc::new(Named("own")))
        }
    }

    /// Builds a store of one kind: `Both` for `p2p`, a private in-process store otherwise.
    struct Stores(&'static str);
    #[async_trait]
    impl MetadataFactory for Stores {
        fn kind(&self) -> &'static str {
            self.0
        }
        async fn connect(&self, _: &MetadataServer, _: &Config) -> Result<Arc<dyn MetadataStore>> {
            Ok(match self.0 {
                "p2p" => Arc::new(Both),
                _ => InProcessMetadata::new(),
            })
        }
    }

    #[tokio::test]
    async fn the_registry_starts_its_channel_beside_stores_that_are_not_channels_themselves() {
        let cfg = |server: &str| Config::from_json_str(&format!(r#"{{"metadata_server":"{server}"}}"#), None).unwrap();
        let mut r = MetadataRegistry::new();
        r.install(Arc::new(Stores("http")));
        r.install(Arc::new(Stores("p2p")));
        // No channel installed: the store alone, and a channel that says why.
        let m = r.connect(&cfg("http://h:1/metadata")).await.unwrap();
        assert_eq!((m.store.name(), m.channel.name()), ("embedded", "none"));
        let e = m.channel.notify("x:1", &crate::Notification { name: "a".into(), notify_msg: "m".into() }).await;
        let e = e.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Unsupported);
        assert!(e.message().contains("no control channel installed") && e.message().contains("`p2p`"), "{e}");

        let beside = Arc::new(Beside::default());
        r.install_channel(beside.clone());
        assert_eq!(r.channel_name(), Some("beside"));
        let m = r.connect(&cfg("http://h:1/metadata")).await.unwrap();
        assert_eq!(m.channel.name(), "beside", "a store built from metadata_server gets the installed channel");
        // A store that is a channel keeps its own; nothing is started beside it.
        let m = r.connect(&cfg("P2PHANDSHAKE")).await.unwrap();
        assert_eq!((m.store.name(), m.channel.name()), ("both", "own"));
        // The embedded store serves the engines of one process: no listener.
        let m = r.connect(&cfg("")).await.unwrap();
        assert_eq!((m.store.name(), m.channel.name()), ("embedded", "none"));
        let e = m.channel.probe("x:1").await.unwrap_err();
        assert!(e.message().starts_with("the embedded metadata backend has no control channel to probe"), "{e}");
        // The store alone starts nothing.
        assert_eq!(r.connect_store(&cfg("http://h:1/metadata")).await.unwrap().name(), "embedded");
        assert_eq!(beside.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// Declares `widget_token` (and, as the channel, `widget_token` again and `widget_port`).
    const TOKEN: OptionSpec =
        OptionSpec { key: "widget_token", env: Some("FERRY_WIDGET_TOKEN"), env_invalid: "", default: "none", doc: "t" };
    const PORT: OptionSpec = OptionSpec { key: "widget_port", env: None, env_invalid: "", default: "0", doc: "p" };
    struct Declaring;
    #[async_trait]
    impl MetadataFactory for Declaring {
        fn kind(&self) -> &'static str {
            "widget"
        }
        async fn connect(&self, _: &MetadataServer, _: &Config) -> Result<Arc<dyn MetadataStore>> {
            Ok(InProcessMetadata::new())
        }
        fn options(&self) -> &'static [OptionSpec] {
            &[TOKEN]
        }
    }
    struct DeclaringChannel;
    #[async_trait]
    impl ControlChannelFactory for DeclaringChannel {
        fn name(&self) -> &'static str {
            "declaring"
        }
        async fn start(&self, _: Arc<dyn MetadataStore>, _: &Config) -> Result<Arc<dyn ControlChannel>> {
            Ok(Arc::new(Named("declaring")))
        }
        fn options(&self) -> &'static [OptionSpec] {
            &[TOKEN, PORT]
        }
    }

    #[test]
    fn stores_and_channels_declare_options_each_key_once() {
        let mut r = MetadataRegistry::new();
        assert!(r.options().is_empty());
        r.install(Arc::new(Stores("http")));
        r.install(Arc::new(Declaring));
        r.install_channel(Arc::new(DeclaringChannel));
        let keys: Vec<&str> = r.options().iter().map(|o| o.key).collect();
        assert_eq!(keys, ["widget_token", "widget_port"]);
        let cfg = Config::from_json_str(r#"{"widget_token": "abc", "widget_port": 7, "other": 1}"#, None).unwrap();
        let env = Environment::from_pairs([("FERRY_WIDGET_TOKEN", "from-env")]);
        let values = r.read_options(&cfg, &env);
        let shown: Vec<(&str, String)> =
            values.iter().map(|v| (v.spec.key, v.setting.as_ref().unwrap().as_ref().unwrap().value.clone())).collect();
        assert_eq!(shown, [("widget_token", "from-env".to_owned()), ("widget_port", "7".to_owned())]);
        assert_eq!(cfg.undeclared_fields(r.options()), ["other"]);
    }

    #[tokio::test]
    async fn missing_backend_is_named() {
        let cfg = Config::from_json_str(r#"{"metadata_server":"etcd://h:2379"}"#, None).unwrap();
        let e = MetadataRegistry::new().connect(&cfg).await.expect_err("no etcd store installed");
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert!(e.message().contains("etcd metadata backend is not built"), "{e}");
        assert!(e.message().contains("available: embedded"), "{e}");
    }
}

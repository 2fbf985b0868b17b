//! The [`ControlChannel`] trait (how an engine talks to its peers' engines: notifications,
//! probes, the RPC port it listens on) and [`NoControlChannel`] for engines that have none.
//! [`ControlChannelFactory`](crate::metadata::ControlChannelFactory), beside the metadata
//! stores, starts one beside any store.
//!
//! A control channel is separate from the store where descriptors are published, as in
//! Mooncake, whose metadata store plugins and handshake plugin are separate too: Mooncake's
//! handshake listener serves an engine on any store. The P2P handshake is both: a store (peers'
//! descriptors are fetched over the handshake) and a channel, and supplies both through
//! [`MetadataStore::control_channel`](crate::MetadataStore::control_channel).

use async_trait::async_trait;

use crate::error::{Error, ErrorKind, Result};

/// A notification: a short message from one engine to another, delivered over the control
/// channel (Mooncake's Notify frame: `{"name": ..., "notify_msg": ...}`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Notification {
    /// Sender's segment name.
    pub name: String,
    /// The message.
    pub notify_msg: String,
}

/// An engine's control channel: the listener peers reach it on (Mooncake's handshake listener
/// on the RPC port) and the client side that reaches theirs.
///
/// # Contract
/// - [`notify`](Self::notify) returns once the peer's listener accepted the notification; the
///   peer then finds it in its [`drain_notifications`](Self::drain_notifications).
/// - [`probe`](Self::probe) returns `Ok` only when the peer's listener answered.
/// - Received notifications are kept, bounded, until drained; each is drained once.
/// - The engine calls [`claim_rpc_entry`](Self::claim_rpc_entry) before each write of its rpc
///   entry, [`descriptor_published`](Self::descriptor_published) after each write (and removal)
///   of its descriptor, and [`close`](Self::close) once at shutdown, after it unpublished itself.
///
/// # Errors
/// [`ErrorKind::Unsupported`] from a channel that cannot do what is asked (see
/// [`NoControlChannel`]), [`ErrorKind::NotFound`] when the peer publishes no listener,
/// [`ErrorKind::PeerUnreachable`] or [`ErrorKind::Timeout`] when its listener does not answer in
/// time, [`ErrorKind::AlreadyExists`] from `claim_rpc_entry` when a live engine holds the name.
///
/// # Threading
/// Implementations are `Send + Sync` and are called concurrently from any task; every method
/// must finish within the channel's own timeout (no call may hang forever). The synchronous
/// methods must not block.
#[async_trait]
pub trait ControlChannel: Send + Sync + 'static {
    /// Short name for logs and `ferry doctor` (`p2p handshake`, `none`, ...).
    fn name(&self) -> &str;

    /// The segment name this channel assigns the local engine, if it decides it (the P2P
    /// handshake names an engine `host:rpc_port`). `None`: the config's name is used.
    fn segment_name_hint(&self) -> Option<String> {
        None
    }

    /// The port of this engine's listener (Mooncake's RPC port, published in the `rpc_meta`
    /// entry), when the channel runs one. `None`: the port of the segment name is published.
    fn rpc_port(&self) -> Option<u16> {
        None
    }

    /// Before the engine writes its rpc entry `entry` under `key` (at start, and again whenever
    /// the store lost it): checks that the name is not a live engine's. A channel that can tell
    /// (it reaches the listener a stored entry names) refuses with
    /// [`ErrorKind::AlreadyExists`]; the default accepts.
    async fn claim_rpc_entry(&self, key: &str, entry: &[u8]) -> Result<()> {
        let _ = (key, entry);
        Ok(())
    }

    /// The engine's descriptor as it was just published (`None`: removed at shutdown), for a
    /// channel that answers descriptor requests itself (the handshake's Metadata frames). The
    /// default ignores it.
    fn descriptor_published(&self, descriptor: Option<&[u8]>) {
        let _ = descriptor;
    }

    /// Sends `notification` to the owner of `segment`.
    async fn notify(&self, segment: &str, notification: &Notification) -> Result<()>;

    /// Takes the notifications received so far (oldest first).
    fn drain_notifications(&self) -> Vec<Notification>;

    /// Checks that the owner of `segment` is alive: sends a Probe to its listener (Mooncake's
    /// `send_probe`) and waits for its answer.
    async fn probe(&self, segment: &str) -> Result<()>;

    /// Releases what the channel holds (its listening socket), once the engine has unpublished
    /// itself at shutdown. When it returns, the resources are free (an engine of the same name
    /// and RPC port can start at once).
    async fn close(&self) {}
}

/// The control channel of an engine that has none: notifications and probes answer
/// [`ErrorKind::Unsupported`], naming the metadata store and why there is no channel; nothing
/// is received.
#[derive(Debug, Clone)]
pub struct NoControlChannel {
    store: String,
    reason: String,
}

impl NoControlChannel {
    /// No channel beside the store named `store`, for `reason` (said in the errors).
    pub fn new(store: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { store: store.into(), reason: reason.into() }
    }

    /// Why there is no channel.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    fn unsupported(&self, what: &str) -> Error {
        Error::new(
            ErrorKind::Unsupported,
            format!("the {} metadata backend has no control channel {what} ({})", self.store, self.reason),
        )
    }
}

#[async_trait]
impl ControlChannel for NoControlChannel {
    fn name(&self) -> &str {
        "none"
    }

    async fn notify(&self, segment: &str, notification: &Notification) -> Result<()> {
        let _ = (segment, notification);
        Err(self.unsupported("for notifications"))
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        Vec::new()
    }

    async fn probe(&self, segment: &str) -> Result<()> {
        let _ = segment;
        Err(self.unsupported("to probe a peer over"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn no_channel_answers_unsupported_naming_the_store_and_why() {
        let c = NoControlChannel::new("http", "none installed");
        let n = Notification { name: "a".into(), notify_msg: "m".into() };
        let e = c.notify("b:1", &n).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert_eq!(e.message(), "the http metadata backend has no control channel for notifications (none installed)");
        let e = c.probe("b:1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.message().starts_with("the http metadata backend has no control channel to probe"), "{e}");
        assert!(c.drain_notifications().is_empty());
        assert_eq!((c.name(), c.rpc_port(), c.segment_name_hint()), ("none", None, None));
        c.claim_rpc_entry("k", b"v").await.unwrap();
    }
}

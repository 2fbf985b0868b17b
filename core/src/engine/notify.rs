//! Notifications and probes over the engine's control channel.

use super::*;

impl TransferEngine {
    /// Sends a notification to the owner of segment `name` over the engine's control channel
    /// (the P2P handshake's Notify frame, which Mooncake peers understand too).
    ///
    /// Errors: [`ErrorKind::Unsupported`] when the engine has no control channel, the channel's
    /// error (for example [`ErrorKind::PeerUnreachable`]) otherwise.
    pub async fn send_notification(&self, name: &str, message: impl Into<String>) -> Result<()> {
        self.send_notification_as(name, self.inner.name.clone(), message).await
    }

    /// [`send_notification`](Self::send_notification) with the `name` field of the
    /// notification chosen by the caller (Mooncake's `TransferNotify.name`, which its receivers
    /// see as given) instead of this engine's segment name.
    pub async fn send_notification_as(
        &self,
        segment: &str,
        sender: impl Into<String>,
        message: impl Into<String>,
    ) -> Result<()> {
        self.inner.check_open()?;
        let n = crate::Notification { name: sender.into(), notify_msg: message.into() };
        self.inner.channel.notify(segment, &n).await
    }

    /// Submits `requests`, waits until every byte landed, then notifies the target segment of
    /// the first request with `message`: the target receives the notification only after the
    /// data. When the transfer fails no notification is sent.
    pub async fn transfer_with_notification(
        &self,
        requests: &[TransferRequest],
        message: impl Into<String>,
    ) -> Result<()> {
        let first = requests.first().ok_or_else(|| Error::invalid("empty batch: no requests to submit"))?;
        let target = self.inner.cached(first.target)?.name().to_owned();
        self.transfer(requests).await?;
        self.send_notification(&target, message).await
    }

    /// Checks that the owner of segment `name` is alive and answers on its control channel
    /// (Mooncake's `send_probe`; SGLang uses it to decide whether a failed peer may be tried
    /// again). Bounded by the channel's handshake timeout.
    pub async fn probe(&self, name: &str) -> Result<()> {
        self.inner.channel.probe(name).await
    }

    /// Takes the notifications received so far, oldest first.
    pub fn get_notifications(&self) -> Vec<crate::Notification> {
        self.inner.channel.drain_notifications()
    }
}

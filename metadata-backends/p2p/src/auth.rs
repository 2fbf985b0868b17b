//! Peer authentication on handshake connections (`ferry-peer-auth`), when the engine has a
//! secret (`auth_secret_file` / `FERRY_AUTH_SECRET_FILE`, or `auth_secret` /
//! `FERRY_AUTH_SECRET`):
//!
//! - the listener runs the responder's side on every connection before it reads a frame, so
//!   descriptors, notifications and probes are served only to peers that know the secret (a
//!   notification can no longer be forged by whoever reaches the port). A peer that sends a
//!   Mooncake frame instead (every Mooncake engine: Mooncake has no authentication, and a Ferry
//!   engine without a secret) is answered with a frame saying that authentication is required
//!   ([`AUTH_REQUIRED_KEY`]) and logged, at most once a minute per address;
//! - every request this engine sends (descriptor fetch, notification, probe) runs the
//!   initiator's side first.
//!
//! Without a secret nothing here runs: the handshake is Mooncake's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{Config, Environment, Error, Result};
use ferry_peer_auth::{AUTH_TIMEOUT, AuthError, PeerSecret, RefusalLog, SCHEME};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::frame::{DEFAULT_MAX_FRAME, FrameType, write_frame};

/// What a handshake connection's proofs are bound to (a data connection's proof does not open
/// a handshake connection).
const CONTEXT: &[u8] = b"ferry p2p handshake";

/// Time between two warnings about the same refused peer address.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// The key of the JSON object a listener with authentication answers a peer that sent a frame
/// without authenticating first; its value is the scheme required (`hmac-sha256-v1`).
pub const AUTH_REQUIRED_KEY: &str = "ferry_auth_required";

/// The listener's side: the secret, if any, and the log of refused peers.
#[derive(Debug, Clone)]
pub(crate) struct ListenerAuth {
    secret: Option<Arc<PeerSecret>>,
    refusals: Arc<RefusalLog>,
}

impl ListenerAuth {
    /// The secret `config` and `env` configure, if any.
    pub(crate) fn load(config: &Config, env: &Environment) -> Result<Self> {
        let secret = ferry_peer_auth::options::load(config, env)?;
        let refusals = RefusalLog::new("P2P handshake (peer authentication on)", REFUSAL_LOG_INTERVAL);
        Ok(Self { secret: secret.map(Arc::new), refusals: Arc::new(refusals) })
    }

    /// The secret this engine proves with when it sends requests.
    pub(crate) fn secret(&self) -> Option<&PeerSecret> {
        self.secret.as_deref()
    }

    /// Runs the exchange on a connection just accepted from `peer`, within `limit` (at most
    /// [`AUTH_TIMEOUT`]). True when its request may be served (also when authentication is
    /// off); false when the connection must be closed (the refusal is logged, and a peer that
    /// sent a handshake frame has been answered that authentication is required).
    pub(crate) async fn admit(&self, s: &mut TcpStream, peer: SocketAddr, limit: Duration) -> bool {
        let Some(secret) = &self.secret else { return true };
        let _ = s.set_nodelay(true);
        let deadline = Instant::now() + limit.min(AUTH_TIMEOUT);
        match ferry_peer_auth::respond(s, secret, CONTEXT, deadline).await {
            Ok(()) => true,
            Err(why) => {
                self.refusals.refused(peer, &why);
                if let AuthError::NotFerry(start) = why {
                    // Best effort: the peer may have gone already.
                    let _ = tokio::time::timeout_at(deadline, answer_unauthenticated(s, start)).await;
                }
                false
            }
        }
    }
}

/// Answers a peer whose frame began with the length `start` (it did not authenticate) with a
/// frame of the same type saying that authentication is required, after reading its frame
/// (so closing does not reset the connection before the answer is read).
async fn answer_unauthenticated(s: &mut TcpStream, start: [u8; 8]) -> std::io::Result<()> {
    let len = u64::from_le_bytes(start);
    if len == 0 || len > DEFAULT_MAX_FRAME {
        return Ok(()); // not a frame either: nothing to answer
    }
    let mut kind = [0u8; 1];
    s.read_exact(&mut kind).await?;
    tokio::io::copy(&mut s.take(len - 1), &mut tokio::io::sink()).await?;
    let kind = match kind[0] {
        0 => FrameType::Connection,
        2 => FrameType::Notify,
        3 => FrameType::Probe,
        _ => FrameType::Metadata,
    };
    let body = serde_json::json!({
        AUTH_REQUIRED_KEY: SCHEME,
        "error": "this Ferry node requires peer authentication on its handshake port; peers without the cluster's \
                  auth secret (Mooncake engines, Ferry engines without auth_secret) are refused",
    });
    write_frame(s, kind, body.to_string().as_bytes()).await?;
    s.shutdown().await
}

/// Runs the exchange on `s`, just connected to the listener at `host:port`, by `deadline` (at
/// most [`AUTH_TIMEOUT`] from now). Nothing happens without a secret.
///
/// # Errors
/// The exchange's failure as an error naming the listener: `Config` when the secrets differ
/// or the peer does not speak the exchange (a Mooncake engine), `Timeout`, `PeerUnreachable`.
pub(crate) async fn prove(
    s: &mut TcpStream,
    secret: Option<&PeerSecret>,
    host: &str,
    port: u16,
    deadline: Instant,
) -> Result<()> {
    let Some(secret) = secret else { return Ok(()) };
    let deadline = deadline.min(Instant::now() + AUTH_TIMEOUT);
    ferry_peer_auth::initiate(s, secret, CONTEXT, deadline)
        .await
        .map_err(|why| why.to_error(&format!("P2P handshake with {host}:{port}")))
}

/// The error a reply means when it is a listener's "authentication required" answer to this
/// engine, which has no secret; `None` for any other reply.
pub(crate) fn required_by(reply: &[u8], host: &str, port: u16) -> Option<Error> {
    let v: serde_json::Value = serde_json::from_slice(reply).ok()?;
    let scheme = v.get(AUTH_REQUIRED_KEY)?.as_str().unwrap_or("?");
    Some(Error::config(format!(
        "P2P handshake with {host}:{port}: the peer requires peer authentication (`{scheme}`), and no auth secret is \
         configured here: set auth_secret_file (FERRY_AUTH_SECRET_FILE) or FERRY_AUTH_SECRET to the cluster's \
         shared secret"
    )))
}

//! Peer authentication on data connections (`ferry-peer-auth`), when the engine has a secret
//! (`auth_secret_file` / `FERRY_AUTH_SECRET_FILE`, or `auth_secret` / `FERRY_AUTH_SECRET`):
//!
//! - the target publishes `ferry_auth: "hmac-sha256-v1"` in its descriptor and runs the
//!   responder's side on every connection it accepts, before it reads a request; a connection
//!   that does not complete it within the authentication deadline (every Mooncake initiator:
//!   Mooncake has no authentication) is closed without a byte of memory touched, and the peer is
//!   logged, at most once a minute per address;
//! - the initiator refuses a peer whose descriptor does not advertise `ferry_auth` (every
//!   Mooncake target), and runs the initiator's side on every connection it opens, before its
//!   first request;
//! - an initiator without a secret refuses a target that advertises `ferry_auth`, saying that
//!   the target requires a secret.
//!
//! Without a secret nothing here runs and nothing is published: the wire is Mooncake's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{Config, Environment, Error, Result};
use ferry_peer_auth::{AUTH_TIMEOUT, PeerSecret, RefusalLog, SCHEME};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::endpoint::TcpEndpoint;

/// What a data connection's proofs are bound to (a handshake connection's proof does not open
/// a data connection).
const CONTEXT: &[u8] = b"ferry tcp data";

/// Time between two warnings about the same refused peer address.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// The data connections' authentication: the secret, if any, and the log of refused peers.
#[derive(Debug, Clone)]
pub(crate) struct DataAuth {
    secret: Option<Arc<PeerSecret>>,
    refusals: Arc<RefusalLog>,
}

impl DataAuth {
    /// The secret `config` and `env` configure, if any.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](ferry_core::ErrorKind::Config) as [`ferry_peer_auth::options::load`].
    pub(crate) fn load(config: &Config, env: &Environment) -> Result<Self> {
        Ok(Self::with(ferry_peer_auth::options::load(config, env)?))
    }

    pub(crate) fn with(secret: Option<PeerSecret>) -> Self {
        let refusals = RefusalLog::new("tcp target (peer authentication on)", REFUSAL_LOG_INTERVAL);
        Self { secret: secret.map(Arc::new), refusals: Arc::new(refusals) }
    }

    /// The scheme this engine's target requires, for its descriptor (`None`: no
    /// authentication).
    pub(crate) fn scheme(&self) -> Option<String> {
        self.secret.as_ref().map(|_| SCHEME.to_owned())
    }

    /// The secret the initiator's lanes prove with.
    pub(crate) fn secret(&self) -> Option<Arc<PeerSecret>> {
        self.secret.clone()
    }

    /// Whether this engine may talk to the segment `segment` whose endpoint is `endpoint`: both
    /// or neither must have authentication, and of a scheme this build speaks.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](ferry_core::ErrorKind::Config) naming the peer and which side lacks
    /// authentication.
    pub(crate) fn check_peer(&self, segment: &str, endpoint: &TcpEndpoint) -> Result<()> {
        match (&self.secret, endpoint.auth.as_deref()) {
            (None, None) => Ok(()),
            (Some(_), Some(s)) if s == SCHEME => Ok(()),
            (Some(secret), None) => Err(Error::config(format!(
                "tcp peer `{segment}`: peer authentication is on here (secret from {}), and the peer does not offer \
                 it (its descriptor has no `ferry_auth`): no request is sent to it. Mooncake engines have no \
                 authentication; a Ferry engine offers it when it has an auth secret",
                secret.source()
            ))),
            (Some(_), Some(other)) => Err(Error::config(format!(
                "tcp peer `{segment}` requires peer authentication `{other}`, which this build does not speak \
                 (it speaks `{SCHEME}`)"
            ))),
            (None, Some(scheme)) => Err(Error::config(format!(
                "tcp peer `{segment}` requires peer authentication (`ferry_auth`: `{scheme}`), and no auth secret is \
                 configured here: set auth_secret_file (FERRY_AUTH_SECRET_FILE) or FERRY_AUTH_SECRET to the \
                 cluster's shared secret"
            ))),
        }
    }

    /// Target side: runs the exchange on a connection just accepted from `peer`, within
    /// `limit` (at most [`AUTH_TIMEOUT`]). True when the connection may be served (also when
    /// authentication is off); false when it must be closed (the refusal is logged).
    pub(crate) async fn admit(&self, stream: &mut TcpStream, peer: SocketAddr, limit: Duration) -> bool {
        let Some(secret) = &self.secret else { return true };
        // The exchange is a few small messages each way: none may wait for an acknowledgement.
        let _ = stream.set_nodelay(true);
        let deadline = Instant::now() + limit.min(AUTH_TIMEOUT);
        match ferry_peer_auth::respond(stream, secret, CONTEXT, deadline).await {
            Ok(()) => true,
            Err(why) => {
                self.refusals.refused(peer, &why);
                false
            }
        }
    }
}

/// Initiator side: runs the exchange on `stream`, just connected to `host:port`, by `deadline`
/// (at most [`AUTH_TIMEOUT`] from now). Without a secret, hands the stream back untouched.
///
/// # Errors
/// The exchange's failure as an error naming the peer
/// ([`AuthError::to_error`](ferry_peer_auth::AuthError::to_error)): `Config` when the secrets
/// differ or the peer does not speak the exchange, `Timeout`, `PeerUnreachable`.
pub(crate) async fn prove(
    mut stream: TcpStream,
    secret: Option<&PeerSecret>,
    host: &str,
    port: u16,
    deadline: Instant,
) -> Result<TcpStream> {
    let Some(secret) = secret else { return Ok(stream) };
    let _ = stream.set_nodelay(true);
    let deadline = deadline.min(Instant::now() + AUTH_TIMEOUT);
    match ferry_peer_auth::initiate(&mut stream, secret, CONTEXT, deadline).await {
        Ok(()) => Ok(stream),
        Err(why) => Err(why.to_error(&format!("tcp peer {host}:{port}"))),
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::ErrorKind;
    use ferry_peer_auth::SecretSource;

    use super::*;

    fn endpoint(auth: Option<&str>) -> TcpEndpoint {
        TcpEndpoint { host: None, port: 1, proto_version: Some(2), fence: None, auth: auth.map(str::to_owned) }
    }

    #[test]
    fn both_sides_or_neither() {
        let on = DataAuth::with(Some(PeerSecret::new(b"0123456789abcdef", SecretSource::Api).unwrap()));
        let off = DataAuth::with(None);
        assert_eq!(on.scheme().as_deref(), Some("hmac-sha256-v1"));
        assert_eq!(off.scheme(), None);
        on.check_peer("a:1", &endpoint(Some(SCHEME))).unwrap();
        off.check_peer("a:1", &endpoint(None)).unwrap();
        let e = on.check_peer("10.0.0.5:17000", &endpoint(None)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("tcp peer `10.0.0.5:17000`: peer authentication is on here (secret from the API)")
                && e.message().contains("does not offer it")
                && e.message().contains("Mooncake engines have no authentication"),
            "{e}"
        );
        let e = off.check_peer("10.0.0.5:17000", &endpoint(Some(SCHEME))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("requires peer authentication") && e.message().contains("no auth secret"), "{e}");
        let e = on.check_peer("x:1", &endpoint(Some("hmac-sha512-v9"))).unwrap_err();
        assert!(e.message().contains("`hmac-sha512-v9`, which this build does not speak"), "{e}");
    }
}

//! The exchange over a connection: [`initiate`] on the side that connected, [`respond`] on the
//! side that accepted, each within a deadline. Neither reads a byte past the exchange, so the
//! connection carries its own protocol right after.

use ferry_core::{Error, ErrorKind};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, timeout_at};

use crate::proof::{
    ACCEPTED, GREETING_LEN, Greeting, MAGIC, PROOF_LEN, REFUSED, Role, VERSION, new_nonce, prove, verify,
};
use crate::secret::PeerSecret;

/// Why an exchange failed.
#[derive(Debug)]
pub enum AuthError {
    /// Reading or writing failed, or the peer closed the connection mid-exchange.
    Io(std::io::Error),
    /// The exchange did not complete before the deadline.
    Timeout,
    /// Responder: the peer's first bytes (given) are not a HELLO: it does not speak the
    /// exchange (a Mooncake engine, or a Ferry engine without a secret). Nothing was sent to it.
    NotFerry([u8; MAGIC.len()]),
    /// Initiator: the peer closed (or reset) the connection instead of answering the HELLO, or
    /// answered it with something else: it does not speak the exchange (a Mooncake engine, or a
    /// Ferry engine without a secret).
    Unanswered(String),
    /// The peer speaks another version of the exchange.
    Version(u8),
    /// Initiator: the responder refused this side's proof: the two sides' secrets differ.
    Refused,
    /// The peer's proof does not verify: it does not know this side's secret.
    BadProof,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthError::Io(e) => write!(f, "the connection failed during authentication: {e}"),
            AuthError::Timeout => f.write_str("authentication did not complete in time"),
            AuthError::NotFerry(_) => f.write_str(
                "it sent no Ferry authentication hello (its first bytes are a Mooncake request or frame): a peer \
                 without Ferry authentication, such as a Mooncake engine or a Ferry engine without the auth secret",
            ),
            AuthError::Unanswered(how) => write!(
                f,
                "the peer {how} instead of answering Ferry's authentication hello: it does not offer Ferry \
                 authentication (Mooncake engines have none; a Ferry engine needs the same auth secret)"
            ),
            AuthError::Version(v) => {
                write!(f, "the peer speaks Ferry authentication version {v}; this node speaks {VERSION}")
            }
            AuthError::Refused => f.write_str("the peer refused this node's proof: the two auth secrets differ"),
            AuthError::BadProof => f.write_str(
                "the peer's proof does not verify: it does not know this node's auth secret (the secrets differ)",
            ),
        }
    }
}

impl std::error::Error for AuthError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AuthError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for AuthError {
    fn from(e: std::io::Error) -> Self {
        AuthError::Io(e)
    }
}

impl AuthError {
    /// The [`ErrorKind`] an initiator reports it with: [`ErrorKind::Timeout`] for a deadline,
    /// [`ErrorKind::PeerUnreachable`] for a connection that broke, [`ErrorKind::Config`] for
    /// everything that says the two sides are not configured alike (another secret, no secret,
    /// no authentication at all): retrying does not help, configuring does.
    pub fn kind(&self) -> ErrorKind {
        match self {
            AuthError::Timeout => ErrorKind::Timeout,
            AuthError::Io(_) => ErrorKind::PeerUnreachable,
            _ => ErrorKind::Config,
        }
    }

    /// This failure as an [`Error`] about `peer` (what the caller calls it: `tcp peer
    /// 10.0.0.5:17001`), saying that authentication is on here.
    pub fn to_error(&self, peer: &str) -> Error {
        Error::new(self.kind(), format!("{peer}: authentication is on here, and it failed: {self}"))
    }
}

/// True for the I/O errors of a peer that closed or reset the connection.
fn closed(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
    )
}

/// Runs the initiator's side on `stream` (just connected): sends HELLO, answers the CHALLENGE
/// with this side's proof, and checks the responder's. `context` names what the connection is
/// for (both sides must pass the same). Completes by `deadline`.
///
/// # Errors
/// [`AuthError`]: the responder refused the proof or its own does not verify (the secrets
/// differ), it does not speak the exchange, the connection broke, or the deadline passed.
pub async fn initiate<S>(
    stream: &mut S,
    secret: &PeerSecret,
    context: &[u8],
    deadline: Instant,
) -> Result<(), AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let run = async {
        let mine = new_nonce()?;
        stream.write_all(&Greeting::new(mine).encode()).await?;
        stream.flush().await?;
        let mut buf = [0u8; GREETING_LEN];
        if let Err(e) = stream.read_exact(&mut buf).await {
            return Err(if closed(&e) { AuthError::Unanswered("closed the connection".into()) } else { e.into() });
        }
        let Some(challenge) = Greeting::decode(&buf) else {
            return Err(AuthError::Unanswered("answered with other bytes".into()));
        };
        if challenge.version != VERSION {
            return Err(AuthError::Version(challenge.version));
        }
        if challenge.nonce == mine {
            // Our own HELLO came back: a reflector, not a peer.
            return Err(AuthError::BadProof);
        }
        stream.write_all(&prove(secret, Role::Initiator, context, &mine, &challenge.nonce)).await?;
        stream.flush().await?;
        let mut verdict = [0u8; 1];
        stream.read_exact(&mut verdict).await?;
        match verdict[0] {
            ACCEPTED => {}
            REFUSED => return Err(AuthError::Refused),
            other => {
                return Err(AuthError::Io(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("verdict byte {other} is neither {ACCEPTED} (accepted) nor {REFUSED} (refused)"),
                )));
            }
        }
        let mut theirs = [0u8; PROOF_LEN];
        stream.read_exact(&mut theirs).await?;
        if !verify(secret, Role::Responder, context, &mine, &challenge.nonce, &theirs) {
            return Err(AuthError::BadProof);
        }
        Ok(())
    };
    timeout_at(deadline, run).await.unwrap_or(Err(AuthError::Timeout))
}

/// Runs the responder's side on `stream` (just accepted): reads HELLO, sends the CHALLENGE,
/// checks the initiator's proof and, if it verifies, sends this side's; if it does not, says
/// so and returns [`AuthError::BadProof`] (the caller closes the connection). Completes by
/// `deadline`.
///
/// A connection whose first 8 bytes are not a HELLO ends at once with
/// [`AuthError::NotFerry`] and those bytes, with nothing sent: the caller may answer it in the
/// peer's own protocol before closing.
///
/// # Errors
/// [`AuthError`], as above, or the connection broke or the deadline passed.
pub async fn respond<S>(stream: &mut S, secret: &PeerSecret, context: &[u8], deadline: Instant) -> Result<(), AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let run = async {
        let mut hello = [0u8; GREETING_LEN];
        stream.read_exact(&mut hello[..MAGIC.len()]).await?;
        if hello[..MAGIC.len()] != MAGIC {
            let mut start = [0u8; MAGIC.len()];
            start.copy_from_slice(&hello[..MAGIC.len()]);
            return Err(AuthError::NotFerry(start));
        }
        stream.read_exact(&mut hello[MAGIC.len()..]).await?;
        let Some(hello) = Greeting::decode(&hello) else { return Err(AuthError::NotFerry(MAGIC)) };
        let mine = new_nonce()?;
        // The CHALLENGE says which version this side speaks, also to a peer of another one.
        stream.write_all(&Greeting::new(mine).encode()).await?;
        stream.flush().await?;
        if hello.version != VERSION {
            return Err(AuthError::Version(hello.version));
        }
        let mut theirs = [0u8; PROOF_LEN];
        stream.read_exact(&mut theirs).await?;
        if !verify(secret, Role::Initiator, context, &hello.nonce, &mine, &theirs) {
            stream.write_all(&[REFUSED]).await?;
            stream.flush().await?;
            return Err(AuthError::BadProof);
        }
        let mut verdict = [0u8; 1 + PROOF_LEN];
        verdict[0] = ACCEPTED;
        verdict[1..].copy_from_slice(&prove(secret, Role::Responder, context, &hello.nonce, &mine));
        stream.write_all(&verdict).await?;
        stream.flush().await?;
        Ok(())
    };
    timeout_at(deadline, run).await.unwrap_or(Err(AuthError::Timeout))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::duplex;

    use super::*;
    use crate::SecretSource;
    use crate::proof::{NONCE_LEN, Nonce};

    /// A secret that lives as long as the test (so futures joined in one statement can borrow it).
    fn secret(s: &str) -> &'static PeerSecret {
        Box::leak(Box::new(PeerSecret::new(s.as_bytes(), SecretSource::Api).unwrap()))
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    const A: &str = "the cluster's secret, version A";
    const B: &str = "the cluster's secret, version B";

    #[tokio::test]
    async fn the_same_secret_passes_both_ways_and_the_stream_is_left_clean() {
        let (mut i, mut r) = duplex(1024);
        let (a, b) = (secret(A), secret(A));
        let initiator = async {
            initiate(&mut i, a, b"test", soon()).await?;
            // The connection's own protocol follows.
            i.write_all(b"after").await?;
            Ok::<_, AuthError>(())
        };
        let responder = async {
            respond(&mut r, b, b"test", soon()).await?;
            let mut next = [0u8; 5];
            r.read_exact(&mut next).await?;
            Ok::<_, AuthError>(next)
        };
        let (x, y) = tokio::join!(initiator, responder);
        x.unwrap();
        assert_eq!(&y.unwrap(), b"after", "the responder read nothing past the exchange");
    }

    #[tokio::test]
    async fn different_secrets_fail_on_both_sides() {
        let (mut i, mut r) = duplex(1024);
        let (x, y) =
            tokio::join!(initiate(&mut i, secret(A), b"test", soon()), respond(&mut r, secret(B), b"test", soon()));
        assert!(matches!(x, Err(AuthError::Refused)), "{x:?}");
        assert!(matches!(y, Err(AuthError::BadProof)), "{y:?}");
        let e = x.unwrap_err().to_error("tcp peer 127.0.0.1:9");
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("tcp peer 127.0.0.1:9: authentication is on here")
                && e.message().contains("secrets differ"),
            "{e}"
        );
        // The same secret for another kind of connection fails too.
        let (mut i, mut r) = duplex(1024);
        let (x, y) =
            tokio::join!(initiate(&mut i, secret(A), b"tcp", soon()), respond(&mut r, secret(A), b"p2p", soon()));
        assert!(matches!((x, y), (Err(AuthError::Refused), Err(AuthError::BadProof))));
    }

    #[tokio::test]
    async fn a_mooncake_peer_is_told_apart_by_its_first_bytes() {
        // A Mooncake v2 READ header on a data connection.
        let (mut i, mut r) = duplex(1024);
        let mut header = [0u8; 24];
        header[..8].copy_from_slice(&64u64.to_le_bytes());
        header[16] = 0x80;
        i.write_all(&header).await.unwrap();
        match respond(&mut r, secret(A), b"tcp", soon()).await {
            Err(AuthError::NotFerry(start)) => assert_eq!(start, header[..8]),
            other => panic!("{other:?}"),
        }
        // An initiator whose peer closes at the HELLO (Mooncake, or Ferry without a secret).
        let (mut i, r) = duplex(1024);
        drop(r);
        let e = initiate(&mut i, secret(A), b"tcp", soon()).await.unwrap_err();
        assert!(matches!(e, AuthError::Io(_) | AuthError::Unanswered(_)), "{e:?}");
        let (mut i, mut r) = duplex(1024);
        let answer = async {
            let mut hello = [0u8; GREETING_LEN];
            r.read_exact(&mut hello).await.unwrap();
            r.write_all(&[0u8; GREETING_LEN]).await.unwrap();
            r
        };
        let (e, _r) = tokio::join!(initiate(&mut i, secret(A), b"tcp", soon()), answer);
        let e = e.unwrap_err();
        assert!(matches!(e, AuthError::Unanswered(_)), "{e:?}");
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("does not offer Ferry authentication"), "{e}");
    }

    #[tokio::test]
    async fn silence_and_slowness_end_at_the_deadline() {
        let (_i, mut r) = duplex(1024);
        let t = Instant::now();
        let e = respond(&mut r, secret(A), b"t", Instant::now() + Duration::from_millis(100)).await.unwrap_err();
        assert!(matches!(e, AuthError::Timeout) && t.elapsed() < Duration::from_secs(2), "{e:?}");
        let (mut i, _r) = duplex(1024);
        let e = initiate(&mut i, secret(A), b"t", Instant::now() + Duration::from_millis(100)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
    }

    #[tokio::test]
    async fn a_reflected_hello_and_a_replayed_proof_fail() {
        // A "responder" that echoes the initiator's HELLO back as its CHALLENGE.
        let (mut i, mut r) = duplex(1024);
        let echo = async {
            let mut hello = [0u8; GREETING_LEN];
            r.read_exact(&mut hello).await.unwrap();
            r.write_all(&hello).await.unwrap();
            r
        };
        let (e, _r) = tokio::join!(initiate(&mut i, secret(A), b"t", soon()), echo);
        assert!(matches!(e, Err(AuthError::BadProof)), "{e:?}");

        // Record an initiator's proof on one connection, replay it on another: the responder's
        // fresh nonce makes it worthless.
        let s = secret(A);
        let nonce: Nonce = [9; NONCE_LEN];
        let (mut i, mut r) = duplex(1024);
        let replay = async {
            i.write_all(&Greeting::new(nonce).encode()).await.unwrap();
            let mut challenge = [0u8; GREETING_LEN];
            i.read_exact(&mut challenge).await.unwrap();
            // A proof made for another responder nonce.
            i.write_all(&prove(s, Role::Initiator, b"t", &nonce, &[1; NONCE_LEN])).await.unwrap();
            let mut verdict = [0u8; 1];
            i.read_exact(&mut verdict).await.unwrap();
            verdict[0]
        };
        let (verdict, out) = tokio::join!(replay, respond(&mut r, secret(A), b"t", soon()));
        assert_eq!(verdict, REFUSED);
        assert!(matches!(out, Err(AuthError::BadProof)));
    }

    #[tokio::test]
    async fn another_version_is_named() {
        let (mut i, mut r) = duplex(1024);
        let mut hello = Greeting::new([3; NONCE_LEN]);
        hello.version = 2;
        i.write_all(&hello.encode()).await.unwrap();
        let out = respond(&mut r, secret(A), b"t", soon()).await;
        assert!(matches!(out, Err(AuthError::Version(2))), "{out:?}");
        let mut challenge = [0u8; GREETING_LEN];
        i.read_exact(&mut challenge).await.unwrap();
        assert_eq!(Greeting::decode(&challenge).unwrap().version, VERSION, "the responder says which it speaks");
    }
}

//! # ferry-peer-auth
//!
//! Opt-in authentication between Ferry nodes: every node of a cluster is given the same secret
//! ([`options`]: `auth_secret_file` / `FERRY_AUTH_SECRET_FILE`, or `auth_secret` /
//! `FERRY_AUTH_SECRET`), and every connection between two of them — a TCP data connection, a P2P
//! handshake connection — starts with a mutual challenge-response ([`exchange`]) in which each
//! side proves it knows the secret without sending it. A peer that cannot prove it (a Mooncake
//! engine, which has no authentication, or a Ferry engine without the secret or with another
//! one) is refused before it can read or write a byte of registered memory, fetch a descriptor
//! or deliver a notification.
//!
//! The scheme, `hmac-sha256-v1` ([`SCHEME`]; messages in [`proof`]):
//!
//! ```text
//! initiator → responder  HELLO      "FERRYAUT" | version 1 | initiator nonce (32 random bytes)
//! responder → initiator  CHALLENGE  "FERRYAUT" | version 1 | responder nonce (32 random bytes)
//! initiator → responder  PROOF      HMAC-SHA256(secret, transcript("initiator"))
//! responder → initiator  VERDICT    0 | HMAC-SHA256(secret, transcript("responder")), or 1 (refused)
//!
//! transcript(role) = label | role | context (what the connection is for) | both nonces
//! ```
//!
//! - Nothing secret crosses the wire: only nonces and HMAC outputs.
//! - A proof is bound to both nonces, so it is worth nothing on another connection (each side
//!   draws a fresh nonce per connection: a recorded exchange cannot be replayed), to its role,
//!   so a proof one side computes cannot be reflected back as the other side's, and to the
//!   context (`tcp data`, `p2p handshake`), so one kind of connection's proof does not open the
//!   other kind.
//! - The initiator proves first; the responder proves only to an initiator that proved, so a
//!   peer without the secret learns no HMAC output of it.
//! - Proofs are compared in constant time (`Mac::verify_slice`).
//!
//! What it does not do: encrypt. The bytes of a transfer travel in clear after the exchange, and
//! an attacker on the network path can read them, or relay an exchange and take over the
//! connection it opened; `docs/security.md` says what that means and what to use for
//! confidentiality.
//!
//! Pure parts: [`proof`] (messages and proofs) and [`PeerSecret`] (the keyed MAC). I/O parts:
//! [`exchange::initiate`] and [`exchange::respond`] over any `AsyncRead + AsyncWrite`, each
//! within a deadline, and [`RefusalLog`], the rate-limited log of refused peers.
#![forbid(unsafe_code)]

pub mod exchange;
pub mod options;
pub mod proof;
mod refusals;
mod secret;

pub use exchange::{AuthError, initiate, respond};
pub use options::{SECRET, SECRET_FILE};
pub use proof::SCHEME;
pub use refusals::RefusalLog;
pub use secret::{MIN_SECRET_LEN, PeerSecret, SecretSource};

/// Time a connection has to complete the exchange, counted from its start (a peer that says
/// nothing, or too little, is refused after this long).
pub const AUTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

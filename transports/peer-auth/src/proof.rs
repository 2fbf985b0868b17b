//! The messages of the exchange and the proofs, as pure functions with no I/O.
//!
//! ```text
//! greeting (HELLO and CHALLENGE, 41 bytes): "FERRYAUT" | u8 version (1) | 32-byte nonce
//! PROOF (32 bytes):                          HMAC-SHA256(secret, transcript(initiator))
//! VERDICT:                                   u8 0 (accepted), then the responder's 32-byte proof,
//!                                            or u8 1 (refused)
//! transcript(role) = "ferry-peer-auth hmac-sha256-v1" | u8 len | role | u8 len | context
//!                    | initiator nonce | responder nonce
//! ```
//!
//! The magic, read as the first 8 bytes of a Mooncake TCP header or handshake frame, is a length
//! above 2^61: no Mooncake peer ever starts a connection with it, so a responder tells a peer that
//! speaks the exchange from one that does not (a Mooncake engine) by its first 8 bytes.

use hmac::Mac;

use crate::secret::PeerSecret;

/// The scheme's name, as a Ferry target advertises it (the `tcp` transport's `ferry_auth`
/// descriptor field).
pub const SCHEME: &str = "hmac-sha256-v1";
/// First bytes of HELLO and CHALLENGE.
pub const MAGIC: [u8; 8] = *b"FERRYAUT";
/// The version of the exchange this crate speaks.
pub const VERSION: u8 = 1;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 output).
pub const PROOF_LEN: usize = 32;
/// Bytes of a greeting (HELLO or CHALLENGE).
pub const GREETING_LEN: usize = MAGIC.len() + 1 + NONCE_LEN;
/// VERDICT byte: the initiator's proof verified; the responder's proof follows.
pub const ACCEPTED: u8 = 0;
/// VERDICT byte: the initiator's proof did not verify; the responder closes the connection.
pub const REFUSED: u8 = 1;

/// Domain separation: what every transcript starts with.
const LABEL: &[u8] = b"ferry-peer-auth hmac-sha256-v1";

/// A nonce: fresh random bytes, one per side and connection.
pub type Nonce = [u8; NONCE_LEN];
/// A proof.
pub type Proof = [u8; PROOF_LEN];

/// The side of a connection a proof is computed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The side that opened the connection.
    Initiator,
    /// The side that accepted it.
    Responder,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Initiator => b"initiator",
            Role::Responder => b"responder",
        }
    }
}

/// A decoded HELLO or CHALLENGE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    /// The version the sender speaks.
    pub version: u8,
    /// The sender's nonce.
    pub nonce: Nonce,
}

impl Greeting {
    /// A greeting of this crate's [`VERSION`] with `nonce`.
    pub fn new(nonce: Nonce) -> Self {
        Self { version: VERSION, nonce }
    }

    /// Encodes the greeting.
    pub fn encode(&self) -> [u8; GREETING_LEN] {
        let mut out = [0u8; GREETING_LEN];
        out[..MAGIC.len()].copy_from_slice(&MAGIC);
        out[MAGIC.len()] = self.version;
        out[MAGIC.len() + 1..].copy_from_slice(&self.nonce);
        out
    }

    /// Decodes a greeting; `None` when it does not start with [`MAGIC`] (the peer does not speak
    /// the exchange). Any version is decoded: the caller decides what it accepts.
    pub fn decode(bytes: &[u8; GREETING_LEN]) -> Option<Self> {
        if !starts_hello(bytes) {
            return None;
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&bytes[MAGIC.len() + 1..]);
        Some(Self { version: bytes[MAGIC.len()], nonce })
    }
}

/// Whether `prefix` (a connection's first bytes, at least 8) starts a greeting.
pub fn starts_hello(prefix: &[u8]) -> bool {
    prefix.get(..MAGIC.len()) == Some(&MAGIC[..])
}

/// A fresh random nonce from the operating system.
///
/// # Errors
/// The operating system's random source failed.
pub fn new_nonce() -> std::io::Result<Nonce> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(format!("no random nonce: {e}")))?;
    Ok(nonce)
}

/// The MAC over `role`'s transcript, ready to finalize or verify.
fn transcript(
    secret: &PeerSecret,
    role: Role,
    context: &[u8],
    initiator: &Nonce,
    responder: &Nonce,
) -> hmac::Hmac<sha2::Sha256> {
    let mut mac = secret.mac();
    mac.update(LABEL);
    let role = role.label();
    mac.update(&(role.len() as u64).to_le_bytes());
    mac.update(role);
    mac.update(&(context.len() as u64).to_le_bytes());
    mac.update(context);
    mac.update(initiator);
    mac.update(responder);
    mac
}

/// The proof `role` sends on a connection for `context` whose nonces are `initiator` and
/// `responder`.
pub fn prove(secret: &PeerSecret, role: Role, context: &[u8], initiator: &Nonce, responder: &Nonce) -> Proof {
    transcript(secret, role, context, initiator, responder).finalize().into_bytes().into()
}

/// Whether `proof` is what `role` would send with `secret` on that connection, compared in
/// constant time. A proof of any other length is refused.
pub fn verify(
    secret: &PeerSecret,
    role: Role,
    context: &[u8],
    initiator: &Nonce,
    responder: &Nonce,
    proof: &[u8],
) -> bool {
    transcript(secret, role, context, initiator, responder).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::SecretSource;

    fn secret(bytes: &[u8]) -> PeerSecret {
        PeerSecret::new(bytes, SecretSource::Api).unwrap()
    }

    #[test]
    fn greetings_round_trip_and_others_are_not_greetings() {
        let g = Greeting::new([7; NONCE_LEN]);
        let bytes = g.encode();
        assert_eq!(&bytes[..8], b"FERRYAUT");
        assert_eq!(bytes[8], VERSION);
        assert_eq!(Greeting::decode(&bytes), Some(g));
        let mut other = bytes;
        other[8] = 9;
        assert_eq!(Greeting::decode(&other).map(|g| g.version), Some(9), "another version still decodes");
        // A Mooncake v2 READ header and a Mooncake handshake frame are not greetings.
        let mut header = [0u8; GREETING_LEN];
        header[..8].copy_from_slice(&4096u64.to_le_bytes());
        header[16] = 0x80;
        assert_eq!(Greeting::decode(&header), None);
        let mut frame = [0u8; GREETING_LEN];
        frame[..8].copy_from_slice(&3u64.to_le_bytes());
        frame[8] = 2;
        assert_eq!(Greeting::decode(&frame), None);
        // As a Mooncake length, the magic is far above any frame limit.
        assert!(u64::from_le_bytes(MAGIC) > 1 << 60);
    }

    #[test]
    fn a_proof_is_bound_to_role_context_and_both_nonces() {
        let s = secret(b"0123456789abcdef0123");
        let (i, r) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = prove(&s, Role::Initiator, b"tcp data", &i, &r);
        assert!(verify(&s, Role::Initiator, b"tcp data", &i, &r, &p));
        assert!(!verify(&s, Role::Responder, b"tcp data", &i, &r, &p), "reflected as the other role");
        assert!(!verify(&s, Role::Initiator, b"p2p handshake", &i, &r, &p), "another kind of connection");
        assert!(!verify(&s, Role::Initiator, b"tcp data", &r, &i, &p), "nonces swapped");
        assert!(!verify(&s, Role::Initiator, b"tcp data", &i, &[3; NONCE_LEN], &p), "another connection");
        assert!(!verify(&s, Role::Initiator, b"tcp data", &i, &r, &p[..31]), "truncated");
        assert!(!verify(&s, Role::Initiator, b"tcp data", &i, &r, &[]), "empty");
        assert!(!verify(&secret(b"0123456789abcdef0124"), Role::Initiator, b"tcp data", &i, &r, &p), "other secret");
        assert_ne!(new_nonce().unwrap(), new_nonce().unwrap());
    }

    proptest! {
        /// Random secrets and nonces: the right secret verifies, any other secret (and any
        /// other proof) fails.
        #[test]
        fn only_the_right_secret_verifies(
            key in prop::collection::vec(any::<u8>(), 16..80),
            other in prop::collection::vec(any::<u8>(), 16..80),
            i in any::<[u8; NONCE_LEN]>(),
            r in any::<[u8; NONCE_LEN]>(),
            role in prop::bool::ANY,
            flip in 0usize..PROOF_LEN * 8,
        ) {
            let role = if role { Role::Initiator } else { Role::Responder };
            let s = secret(&key);
            let p = prove(&s, role, b"ctx", &i, &r);
            prop_assert!(verify(&s, role, b"ctx", &i, &r, &p));
            prop_assert_eq!(p, prove(&secret(&key), role, b"ctx", &i, &r), "deterministic");
            if other != key {
                prop_assert!(!verify(&secret(&other), role, b"ctx", &i, &r, &p));
            }
            let mut bad = p;
            bad[flip / 8] ^= 1 << (flip % 8);
            prop_assert!(!verify(&s, role, b"ctx", &i, &r, &bad));
        }
    }
}

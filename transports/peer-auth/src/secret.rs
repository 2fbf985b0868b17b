//! The shared secret, kept only as a keyed MAC, and where it came from.

use std::path::PathBuf;

use ferry_core::{Error, FieldSource, Result};
use hmac::{Hmac, KeyInit};
use sha2::{Digest, Sha256};

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// Where a secret came from (for messages and `ferry doctor`; never the secret itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// The value itself, from the `auth_secret` field or `FERRY_AUTH_SECRET` (`set_by` says
    /// which).
    Value {
        /// The config file, inline JSON, the variable or the API.
        set_by: FieldSource,
    },
    /// A file, named by `auth_secret_file` or `FERRY_AUTH_SECRET_FILE` (`set_by` says which).
    File {
        /// The file read.
        path: PathBuf,
        /// Where its path was set.
        set_by: FieldSource,
    },
    /// Given through the API ([`PeerSecret::new`]).
    Api,
}

impl std::fmt::Display for SecretSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretSource::Value { set_by } => f.write_str(&set_by.describe(crate::SECRET.key)),
            SecretSource::File { path, set_by } => {
                write!(f, "file {} (named by {})", path.display(), set_by.describe(crate::SECRET_FILE.key))
            }
            SecretSource::Api => f.write_str("the API"),
        }
    }
}

/// The cluster's shared secret, ready to prove and check proofs with.
///
/// The secret's bytes are not kept: only an HMAC-SHA256 instance keyed with a digest of them.
/// Its `Debug` output shows where the secret came from and nothing of it; it has no `Display`.
#[derive(Clone)]
pub struct PeerSecret {
    mac: Hmac<Sha256>,
    len: usize,
    source: SecretSource,
}

impl std::fmt::Debug for PeerSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSecret").field("len", &self.len).field("source", &self.source).finish_non_exhaustive()
    }
}

impl PeerSecret {
    /// A secret of `bytes` from `source`.
    ///
    /// The HMAC key is SHA-256 of a fixed label and the secret, so two different secrets are
    /// always two different keys (HMAC alone would take a secret and the same secret with NUL
    /// bytes appended for one key).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](ferry_core::ErrorKind::Config) naming `source` (never the secret)
    /// when `bytes` is shorter than [`MIN_SECRET_LEN`].
    pub fn new(bytes: &[u8], source: SecretSource) -> Result<Self> {
        if bytes.len() < MIN_SECRET_LEN {
            return Err(Error::config(format!(
                "the peer authentication secret from {source} is {} bytes; at least {MIN_SECRET_LEN} are required \
                 (use a long random one, e.g. the output of `openssl rand -hex 32`)",
                bytes.len()
            )));
        }
        let mut digest = Sha256::new();
        digest.update(b"ferry-peer-auth key v1\0");
        digest.update(bytes);
        let key = digest.finalize();
        let mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&key)
            .map_err(|_| Error::config("HMAC-SHA256 refused a 32-byte key"))?;
        Ok(Self { mac, len: bytes.len(), source })
    }

    /// Where the secret came from.
    pub fn source(&self) -> &SecretSource {
        &self.source
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty secret is refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A fresh copy of the keyed MAC.
    pub(crate) fn mac(&self) -> Hmac<Sha256> {
        self.mac.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_secrets_are_refused_naming_the_source_not_the_secret() {
        let e =
            PeerSecret::new(b"fifteen bytes!!", SecretSource::Value { set_by: FieldSource::Env("FERRY_AUTH_SECRET") })
                .unwrap_err();
        assert_eq!(e.kind(), ferry_core::ErrorKind::Config);
        assert!(e.message().contains("environment variable FERRY_AUTH_SECRET is 15 bytes; at least 16"), "{e}");
        assert!(!e.message().contains("fifteen"), "the secret is never shown: {e}");
        let s = PeerSecret::new(b"sixteen bytes!!!", SecretSource::Api).unwrap();
        assert_eq!((s.len(), s.is_empty()), (16, false));
        let shown = format!("{s:?}");
        assert!(!shown.contains("sixteen") && shown.contains("len: 16"), "{shown}");
    }
}

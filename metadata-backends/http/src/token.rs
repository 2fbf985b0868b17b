//! The write token of `ferry metadata-server`: a shared secret that PUT and DELETE requests
//! carry as `Authorization: Bearer <token>` (reads stay open), read from a file or from the
//! environment by the server and by Ferry's client alike.

use std::path::Path;
use std::sync::Arc;

/// The variable holding the token itself, read by `ferry metadata-server` and by Ferry's HTTP
/// metadata client (where it wins over `metadata_token_file`).
pub const TOKEN_ENV: &str = "FERRY_METADATA_TOKEN";

/// A write token. Its `Debug` does not show it; compare with [`matches`](Self::matches), which
/// takes the same time whatever the first differing byte.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({} bytes, not shown)", self.0.len())
    }
}

impl Token {
    /// A token from its text: at least one character, printable ASCII without spaces (what an
    /// HTTP header carries unchanged; RFC 6750's `b64token` characters and more).
    ///
    /// # Errors
    /// What is wrong with it, without showing it.
    pub fn new(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("the token is empty".into());
        }
        if let Some(i) = text.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(format!(
                "the token's byte {i} is not printable ASCII (spaces, control characters and non-ASCII characters \
                 cannot travel in an Authorization header)"
            ));
        }
        Ok(Self(text.into()))
    }

    /// The token held by the file at `path`: its whole text, less surrounding white space (a
    /// trailing newline, for one).
    ///
    /// # Errors
    /// The file cannot be read, or holds no valid token ([`new`](Self::new)); the message names
    /// the file.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("token file {}: {e}", path.display()))?;
        Self::new(text.trim()).map_err(|e| format!("token file {}: {e}", path.display()))
    }

    /// The token's text (for the header a client sends).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token. The time taken depends on the lengths only, not on
    /// where the bytes differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        if presented.len() != expected.len() {
            return false;
        }
        let diff = expected.iter().zip(presented).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

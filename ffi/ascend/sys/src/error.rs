//! Why the libraries could not be loaded: every candidate tried, and why each was not used.

use std::fmt;

/// One place the loader looked for a library, and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The path (or bare file name, for the dynamic loader's own search) that was tried.
    pub path: String,
    /// Where that candidate came from (`FERRY_ASCEND_LIB_DIR`, `CANN <= 8.3 default root`, ...).
    pub source: String,
    /// Why it was not used.
    pub reason: String,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.path, self.source, self.reason)
    }
}

/// ACL or HCCL could not be loaded ([`Library::load`](crate::Library::load)).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// A library could not be loaded from any candidate; `tried` lists each one with its reason.
    #[error(
        "{library} could not be loaded (is CANN installed? source its set_env.sh or set FERRY_ASCEND_LIB_DIR); tried:{}",
        list(tried)
    )]
    NotFound {
        /// The library looked for (`libascendcl.so`, `libhccl.so`).
        library: &'static str,
        /// Every candidate, in search order.
        tried: Vec<Attempt>,
    },
    /// A required symbol is in none of the loaded libraries (a CANN too old, or not CANN at all).
    #[error("required symbol {symbol} is missing from {searched} (a CANN release Ferry does not support?)")]
    MissingSymbol {
        /// The symbol.
        symbol: &'static str,
        /// The libraries searched.
        searched: String,
    },
}

fn list(tried: &[Attempt]) -> String {
    if tried.is_empty() {
        return " nothing".to_owned();
    }
    tried.iter().map(|a| format!("\n  - {a}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_lists_every_attempt() {
        let nf = LoadError::NotFound {
            library: "libascendcl.so",
            tried: vec![
                Attempt {
                    path: "/a/libascendcl.so".into(),
                    source: "FERRY_ASCEND_LIB_DIR".into(),
                    reason: "no such file".into(),
                },
                Attempt { path: "libascendcl.so".into(), source: "dynamic loader".into(), reason: "not found".into() },
            ],
        };
        let text = nf.to_string();
        assert!(text.contains("/a/libascendcl.so (FERRY_ASCEND_LIB_DIR): no such file"), "{text}");
        assert!(text.contains("libascendcl.so (dynamic loader): not found"), "{text}");
        let none = LoadError::NotFound { library: "libhccl.so", tried: Vec::new() };
        assert!(none.to_string().ends_with("tried: nothing"), "{none}");
    }
}

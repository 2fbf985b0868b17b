//! One error type for the whole engine, with a stable [`ErrorKind`] a caller can act on.

use std::fmt;

/// Boxed underlying cause (an OS error, a JSON error, a device runtime's code wrapped by a transport).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used throughout Ferry.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in terms a caller can act on.
///
/// The set is `#[non_exhaustive]`: new kinds may be added in minor versions, so match with a
/// wildcard arm. Each kind has a stable integer [`code`](ErrorKind::code) used at the C boundary;
/// codes are never reused or renumbered.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The peer (or the metadata service) could not be reached, or went away mid-transfer.
    PeerUnreachable,
    /// A segment, key, region, layout or batch that was named does not exist.
    NotFound,
    /// An argument is malformed: zero length, mismatched lengths, bad location tag, bad id.
    InvalidArgument,
    /// An address range lies outside every registered region (local or remote), or a block id
    /// is past the end of its layout.
    OutOfBounds,
    /// An operation did not finish within its deadline.
    Timeout,
    /// A transport failed while moving data (the transport's own error is the source).
    Transport,
    /// A configuration file or value is invalid.
    Config,
    /// A memory registration overlaps an existing one, or a name is already taken.
    AlreadyExists,
    /// The request was cancelled before it completed.
    Cancelled,
    /// The resource is in use (for example a region with transfers in flight).
    Busy,
    /// The operation is not supported by the selected transport or backend.
    Unsupported,
    /// The engine has been shut down.
    Shutdown,
    /// A transport plugin could not be loaded (not found, not a plugin, wrong ABI version) or
    /// broke its contract (for example it panicked).
    Plugin,
    /// A bug inside Ferry, caught before it could cross a foreign boundary (a panic).
    Internal,
}

impl ErrorKind {
    /// Every kind, in code order.
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::PeerUnreachable,
        ErrorKind::NotFound,
        ErrorKind::InvalidArgument,
        ErrorKind::OutOfBounds,
        ErrorKind::Timeout,
        ErrorKind::Transport,
        ErrorKind::Config,
        ErrorKind::AlreadyExists,
        ErrorKind::Cancelled,
        ErrorKind::Busy,
        ErrorKind::Unsupported,
        ErrorKind::Shutdown,
        ErrorKind::Plugin,
        ErrorKind::Internal,
    ];

    /// The kind with stable code `code` (positive or negated), if any.
    pub fn from_code(code: i32) -> Option<ErrorKind> {
        let code = code.checked_abs()?;
        Self::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Stable integer code of this kind, as returned by the C API (negated there).
    pub const fn code(self) -> i32 {
        match self {
            ErrorKind::PeerUnreachable => 1,
            ErrorKind::NotFound => 2,
            ErrorKind::InvalidArgument => 3,
            ErrorKind::OutOfBounds => 4,
            ErrorKind::Timeout => 5,
            ErrorKind::Transport => 6,
            ErrorKind::Config => 7,
            ErrorKind::AlreadyExists => 8,
            ErrorKind::Cancelled => 9,
            ErrorKind::Busy => 10,
            ErrorKind::Unsupported => 11,
            ErrorKind::Shutdown => 12,
            ErrorKind::Plugin => 13,
            ErrorKind::Internal => 14,
        }
    }

    /// Short snake_case name of this kind (stable; used in logs and JSON output).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::PeerUnreachable => "peer_unreachable",
            ErrorKind::NotFound => "not_found",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::OutOfBounds => "out_of_bounds",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Transport => "transport",
            ErrorKind::Config => "config",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Busy => "busy",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Shutdown => "shutdown",
            ErrorKind::Plugin => "plugin",
            ErrorKind::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Ferry's error: a stable [`ErrorKind`], a human-readable message, and the underlying cause.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<SharedError>,
}

/// The cause as stored: shared, so one failure reported to several requests keeps it.
type SharedError = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

impl Error {
    /// Creates an error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), source: None }
    }

    /// Attaches the underlying cause (kept for `source()` chains and logs).
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(SharedError::from(source.into()));
        self
    }

    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without the kind prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Copies the error, sharing its cause. Used where one failure must be reported to several
    /// requests.
    pub fn duplicate(&self) -> Self {
        Self { kind: self.kind, message: self.message.clone(), source: self.source.clone() }
    }

    /// The same kind and cause with a new message (usually the old one with context added).
    pub fn context(&self, message: impl Into<String>) -> Self {
        Self { kind: self.kind, message: message.into(), source: self.source.clone() }
    }

    /// Shorthand for [`ErrorKind::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// Shorthand for [`ErrorKind::OutOfBounds`].
    pub fn out_of_bounds(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::OutOfBounds, message)
    }

    /// Shorthand for [`ErrorKind::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// Shorthand for [`ErrorKind::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    /// Shorthand for [`ErrorKind::Transport`].
    pub fn transport(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Transport, message)
    }

    /// Shorthand for [`ErrorKind::Timeout`].
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Timeout, message)
    }

    /// Shorthand for [`ErrorKind::PeerUnreachable`].
    pub fn unreachable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PeerUnreachable, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_stable() {
        let kinds = [
            ErrorKind::PeerUnreachable,
            ErrorKind::NotFound,
            ErrorKind::InvalidArgument,
            ErrorKind::OutOfBounds,
            ErrorKind::Timeout,
            ErrorKind::Transport,
            ErrorKind::Config,
            ErrorKind::AlreadyExists,
            ErrorKind::Cancelled,
            ErrorKind::Busy,
            ErrorKind::Unsupported,
            ErrorKind::Shutdown,
            ErrorKind::Plugin,
            ErrorKind::Internal,
        ];
        let codes: std::collections::HashSet<i32> = kinds.iter().map(|k| k.code()).collect();
        assert_eq!(codes.len(), kinds.len());
        assert_eq!(ErrorKind::PeerUnreachable.code(), 1);
        assert_eq!(ErrorKind::Shutdown.code(), 12);
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(k.code()), Some(k));
            assert_eq!(ErrorKind::from_code(-k.code()), Some(k));
        }
        assert_eq!(ErrorKind::from_code(0), None);
        assert_eq!(ErrorKind::from_code(i32::MIN), None);
    }

    #[test]
    fn source_is_kept_and_displayed_in_duplicate() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Error::unreachable("peer 10.0.0.1:1 down").with_source(io);
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(e.to_string(), "peer_unreachable: peer 10.0.0.1:1 down");
        let d = e.duplicate();
        assert_eq!(d.kind(), ErrorKind::PeerUnreachable);
        assert_eq!(d.message(), e.message());
        assert_eq!(std::error::Error::source(&d).unwrap().to_string(), "refused", "the cause is shared, not flattened");
    }
}

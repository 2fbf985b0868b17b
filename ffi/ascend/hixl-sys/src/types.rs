//! HIXL's value types, declared by Ferry (the layouts are those of `hixl_types.h` and
//! `adxl_types.h`, which are the same for everything used here).

use std::fmt;

/// A HIXL status code (`hixl::Status`, `adxl::Status`: `uint32_t`). Kept as the integer, so a
/// code a newer release adds still round-trips; [`Status::name`] knows the documented ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub u32);

impl Status {
    /// `SUCCESS`.
    pub const SUCCESS: Status = Status(0);
    /// `PARAM_INVALID`: a bad argument (a null address, a timeout <= 0, a malformed option, ...).
    pub const PARAM_INVALID: Status = Status(103_900);
    /// `TIMEOUT`.
    pub const TIMEOUT: Status = Status(103_901);
    /// `NOT_CONNECTED`: no link to that engine (and no AutoConnect).
    pub const NOT_CONNECTED: Status = Status(103_902);
    /// `ALREADY_CONNECTED`: `Connect` to an engine already linked.
    pub const ALREADY_CONNECTED: Status = Status(103_903);
    /// `NOTIFY_FAILED` (reserved).
    pub const NOTIFY_FAILED: Status = Status(103_904);
    /// `UNSUPPORTED`.
    pub const UNSUPPORTED: Status = Status(103_905);
    /// `RESOURCE_EXHAUSTED` (stream resources).
    pub const RESOURCE_EXHAUSTED: Status = Status(203_900);
    /// `FAILED`: any other failure.
    pub const FAILED: Status = Status(503_900);

    /// The documented name of this code, or `None` for a code Ferry does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Status::SUCCESS => "SUCCESS",
            Status::PARAM_INVALID => "PARAM_INVALID",
            Status::TIMEOUT => "TIMEOUT",
            Status::NOT_CONNECTED => "NOT_CONNECTED",
            Status::ALREADY_CONNECTED => "ALREADY_CONNECTED",
            Status::NOTIFY_FAILED => "NOTIFY_FAILED",
            Status::UNSUPPORTED => "UNSUPPORTED",
            Status::RESOURCE_EXHAUSTED => "RESOURCE_EXHAUSTED",
            Status::FAILED => "FAILED",
            _ => return None,
        })
    }

    /// Whether this is `SUCCESS`.
    pub fn is_success(self) -> bool {
        self == Status::SUCCESS
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "unknown status {}", self.0),
        }
    }
}

/// Where registered memory lives (`MemType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemType {
    /// `MEM_DEVICE`: NPU memory (`aclrtMalloc`).
    Device,
    /// `MEM_HOST`: host memory (HIXL requires `aclrtMallocHost` memory).
    Host,
}

impl MemType {
    pub(crate) fn raw(self) -> i32 {
        match self {
            MemType::Device => 0,
            MemType::Host => 1,
        }
    }
}

/// The direction of a transfer (`TransferOp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferOp {
    /// `READ`: pull remote memory into local memory.
    Read,
    /// `WRITE`: push local memory to remote memory.
    Write,
}

impl TransferOp {
    pub(crate) fn raw(self) -> i32 {
        match self {
            TransferOp::Read => 0,
            TransferOp::Write => 1,
        }
    }
}

/// One contiguous copy of a transfer (`TransferOpDesc`): `len` bytes between `local_addr` in
/// this engine's registered memory and `remote_addr` in the peer's.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferOpDesc {
    /// The local address.
    pub local_addr: usize,
    /// The remote address.
    pub remote_addr: usize,
    /// The number of bytes.
    pub len: usize,
}

/// A capability `GetCapability` can be asked about (`FeatureType`, an `int32_t`; HIXL appends
/// new values, so any integer can be asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FeatureType(pub i32);

impl FeatureType {
    /// `AUTO_CONNECT`: transfers may skip `Connect` when the `AutoConnect` option is "1".
    pub const AUTO_CONNECT: FeatureType = FeatureType(0);
    /// `CLIENT_SERVER_COMM`: the client/server engine (`LocalCommRes` `{"version":"1.3"}`).
    pub const CLIENT_SERVER_COMM: FeatureType = FeatureType(1);
}

impl fmt::Display for FeatureType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            FeatureType::AUTO_CONNECT => f.write_str("AUTO_CONNECT"),
            FeatureType::CLIENT_SERVER_COMM => f.write_str("CLIENT_SERVER_COMM"),
            FeatureType(v) => write!(f, "feature {v}"),
        }
    }
}

/// The state of an asynchronous transfer (`TransferStatus`).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferStatus {
    /// `WAITING`: still in flight.
    Waiting,
    /// `COMPLETED`.
    Completed,
    /// `TIMEOUT` (HIXL documents it as not reported yet: the caller enforces timeouts).
    Timeout,
    /// `FAILED`.
    Failed,
    /// A value this crate does not know.
    Unknown(i32),
}

impl TransferStatus {
    pub(crate) fn from_raw(v: i32) -> Self {
        match v {
            0 => TransferStatus::Waiting,
            1 => TransferStatus::Completed,
            2 => TransferStatus::Timeout,
            3 => TransferStatus::Failed,
            v => TransferStatus::Unknown(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_are_the_documented_ones() {
        let all = [
            (Status::SUCCESS, "SUCCESS", 0),
            (Status::PARAM_INVALID, "PARAM_INVALID", 103_900),
            (Status::TIMEOUT, "TIMEOUT", 103_901),
            (Status::NOT_CONNECTED, "NOT_CONNECTED", 103_902),
            (Status::ALREADY_CONNECTED, "ALREADY_CONNECTED", 103_903),
            (Status::NOTIFY_FAILED, "NOTIFY_FAILED", 103_904),
            (Status::UNSUPPORTED, "UNSUPPORTED", 103_905),
            (Status::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED", 203_900),
            (Status::FAILED, "FAILED", 503_900),
        ];
        for (s, name, code) in all {
            assert_eq!(s.0, code);
            assert_eq!(s.name(), Some(name));
            assert_eq!(s.to_string(), format!("{name} ({code})"));
        }
        assert_eq!(Status(7).name(), None);
        assert_eq!(Status(7).to_string(), "unknown status 7");
        assert!(Status::SUCCESS.is_success() && !Status::FAILED.is_success());
    }

    #[test]
    fn enums_have_hixls_values() {
        assert_eq!((MemType::Device.raw(), MemType::Host.raw()), (0, 1));
        assert_eq!((TransferOp::Read.raw(), TransferOp::Write.raw()), (0, 1));
        assert_eq!(
            (0..5).map(TransferStatus::from_raw).collect::<Vec<_>>(),
            vec![
                TransferStatus::Waiting,
                TransferStatus::Completed,
                TransferStatus::Timeout,
                TransferStatus::Failed,
                TransferStatus::Unknown(4)
            ]
        );
        assert_eq!(std::mem::size_of::<TransferOpDesc>(), 24);
        assert_eq!(FeatureType::CLIENT_SERVER_COMM.to_string(), "CLIENT_SERVER_COMM");
        assert_eq!(FeatureType(9).to_string(), "feature 9");
    }
}

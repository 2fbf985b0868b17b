//! Mooncake's TCP data protocol (reference `mooncake-wire.md` §5), as pure encode/decode
//! functions with no I/O.
//!
//! ```text
//! header (24 bytes): u64 size LE | u64 addr LE | u8 opcode (READ 0, WRITE 1; 0x80 = v2) | 7 pad
//! status (8 bytes, v2 only): u64 LE, high 32 bits = 0x4D435456 ("MCTV"), low 32 = 0 OK / 1 rejected
//! ```
//!
//! Ferry adds one request of its own, sent only to peers that advertise it: the fence
//! ([`FENCE_OPCODE`], see the crate's `fence` module).

use ferry_core::Opcode;

/// Size of a request header.
pub const HEADER_LEN: usize = 24;
/// Size of a status frame.
pub const STATUS_LEN: usize = 8;
/// Bit set in the opcode byte for v2 framing.
pub const V2_FLAG: u8 = 0x80;
/// Opcode (without the v2 bit) of Ferry's fence request. Never sent to a peer whose descriptor
/// lacks `ferry_tcp_fence` (Mooncake's peers); [`Header::decode`] refuses it like any opcode other
/// than READ and WRITE.
pub const FENCE_OPCODE: u8 = 0x46;
/// Magic in the high 32 bits of a status frame.
pub const STATUS_MAGIC: u32 = 0x4D43_5456;

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes to move.
    pub size: u64,
    /// Target virtual address.
    pub addr: u64,
    /// Read or write.
    pub opcode: Opcode,
    /// v2 framing (status frames).
    pub v2: bool,
}

/// Why a header or status frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireError {
    /// The opcode byte (without the v2 bit) is neither READ nor WRITE.
    BadOpcode(u8),
    /// A status frame without the magic.
    BadMagic(u64),
    /// A status frame with a code other than 0 or 1.
    BadStatus(u32),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::BadOpcode(b) => write!(f, "opcode byte {b:#04x} is neither READ nor WRITE"),
            WireError::BadMagic(v) => write!(f, "status frame {v:#018x} lacks the MCTV magic"),
            WireError::BadStatus(c) => write!(f, "status code {c} is neither 0 (ok) nor 1 (rejected)"),
        }
    }
}

impl std::error::Error for WireError {}

impl Header {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = (self.opcode as u8) | if self.v2 { V2_FLAG } else { 0 };
        b
    }

    /// Decodes a header. Padding is ignored; only the opcode can be invalid.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, WireError> {
        let size = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
        let addr = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let v2 = b[16] & V2_FLAG != 0;
        let opcode = match b[16] & !V2_FLAG {
            0 => Opcode::Read,
            1 => Opcode::Write,
            other => return Err(WireError::BadOpcode(other)),
        };
        Ok(Self { size, addr, opcode, v2 })
    }
}

/// Outcome carried by a status frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The request was served.
    Ok,
    /// The target refused the address range.
    Rejected,
}

impl Status {
    /// Encodes the status frame.
    pub fn encode(self) -> [u8; STATUS_LEN] {
        let code: u32 = match self {
            Status::Ok => 0,
            Status::Rejected => 1,
        };
        ((u64::from(STATUS_MAGIC) << 32) | u64::from(code)).to_le_bytes()
    }

    /// Decodes a status frame.
    pub fn decode(b: &[u8; STATUS_LEN]) -> Result<Self, WireError> {
        let v = u64::from_le_bytes(*b);
        if (v >> 32) as u32 != STATUS_MAGIC {
            return Err(WireError::BadMagic(v));
        }
        match v as u32 {
            0 => Ok(Status::Ok),
            1 => Ok(Status::Rejected),
            c => Err(WireError::BadStatus(c)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_matches_the_reference() {
        let h = Header { size: 0x0102, addr: 0x7f00_0000_1000, opcode: Opcode::Write, v2: true };
        let b = h.encode();
        assert_eq!(&b[0..8], &0x0102u64.to_le_bytes());
        assert_eq!(&b[8..16], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(b[16], 0x81);
        assert_eq!(&b[17..], &[0u8; 7]);
        assert_eq!(Status::Ok.encode(), 0x4D43_5456_0000_0000u64.to_le_bytes());
        assert_eq!(Status::decode(&0x4D43_5456_0000_0001u64.to_le_bytes()), Ok(Status::Rejected));
        assert_eq!(Status::decode(&2u64.to_le_bytes()), Err(WireError::BadMagic(2)));
        assert_eq!(Status::decode(&0x4D43_5456_0000_0007u64.to_le_bytes()), Err(WireError::BadStatus(7)));
    }

    proptest! {
        /// Any 24 bytes decode to a header or a clear error, never a panic, and a decoded header
        /// re-encodes to the same bytes apart from the ignored padding.
        #[test]
        fn arbitrary_headers(bytes in prop::array::uniform24(any::<u8>())) {
            match Header::decode(&bytes) {
                Ok(h) => {
                    let again = h.encode();
                    prop_assert_eq!(&again[..17], &bytes[..17]);
                }
                Err(WireError::BadOpcode(op)) => prop_assert!(op > 1),
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        #[test]
        fn arbitrary_status_frames(v in any::<u64>()) {
            let r = Status::decode(&v.to_le_bytes());
            let valid = (v >> 32) as u32 == STATUS_MAGIC && (v as u32) < 2;
            prop_assert_eq!(r.is_ok(), valid);
            if let Ok(s) = r { prop_assert_eq!(s.encode(), v.to_le_bytes()); }
        }

        #[test]
        fn headers_round_trip(size in any::<u64>(), addr in any::<u64>(), write in any::<bool>(), v2 in any::<bool>()) {
            let h = Header { size, addr, opcode: if write { Opcode::Write } else { Opcode::Read }, v2 };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }
}

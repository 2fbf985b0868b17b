//! Segment names that encode an endpoint: `host:port`, `host:port:npu_N` (Mooncake's form),
//! `host:port:N`, and `[v6addr]:port[:...]` for IPv6 hosts.
//!
//! A segment name is any string (`demo`, `ferry-12-0` are fine names); [`SegmentName`] is the
//! parsed form of the ones that say where the segment lives. Every crate that reads a host, a
//! port or a device out of a name goes through [`SegmentName::parse`] (or
//! [`parse_strict`](SegmentName::parse_strict), which tells a malformed device part apart), so
//! the rules live in one place.

use std::fmt;
use std::str::FromStr;

/// Device ids Ferry accepts (in segment names, the config's `physical_devices`, and the
/// device-identity sources of the transports) are below this. Hosts have at most 16 devices
/// today; the bound leaves room and catches typos such as `40` for `4,0`.
pub const DEVICE_ID_LIMIT: u32 = 64;

/// A parsed segment name: host, port and, optionally, the physical device id.
///
/// Parsing rules (the same for every caller):
/// - `host:port`, where host is non-empty and has no whitespace or `/`, and port is decimal
///   digits only (no sign) and at most 65535; or `[host]:port` (IPv6: the host is what is
///   between the brackets).
/// - optionally `:npu_<N>` or `:<N>` after the port, with `N` decimal digits below
///   [`DEVICE_ID_LIMIT`].
///
/// A name that is not `host:port` at all is not a `SegmentName` (`Ok(None)` from
/// [`parse_strict`](Self::parse_strict)); `host:port:` followed by anything other than a valid
/// device part is an error ([`SegmentNameError`]).
///
/// [`Display`](fmt::Display) writes the canonical form: the host in brackets when it contains a
/// `:` (or starts with `[`), and the device as `npu_<N>`; parsing it gives back an equal value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SegmentName {
    host: String,
    port: u16,
    device: Option<u32>,
}

/// Why a `host:port:<device>` name was refused: its device part is malformed or out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentNameError {
    message: String,
}

impl SegmentNameError {
    /// The message: names the segment, the device part, what is wrong and what was expected.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for SegmentNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SegmentNameError {}

impl SegmentName {
    /// A name from its parts; `None` when they do not make a name that parses back to them
    /// (an empty host, a host with whitespace or `/`, a device id not below
    /// [`DEVICE_ID_LIMIT`], ...).
    pub fn new(host: impl Into<String>, port: u16, device: Option<u32>) -> Option<Self> {
        let candidate = Self { host: host.into(), port, device };
        match Self::parse_strict(&candidate.to_string()) {
            Ok(Some(parsed)) if parsed == candidate => Some(candidate),
            _ => None,
        }
    }

    /// Parses leniently: `None` when `name` is not in one of the encoded forms, including when
    /// its device part is malformed (use [`parse_strict`](Self::parse_strict) to tell those
    /// apart).
    pub fn parse(name: &str) -> Option<Self> {
        Self::parse_strict(name).ok().flatten()
    }

    /// Parses `name`: `Ok(None)` when it is not `host:port[:device]`, an error when it is
    /// `host:port:` followed by something other than `npu_<N>` or `<N>` (N below
    /// [`DEVICE_ID_LIMIT`]).
    pub fn parse_strict(name: &str) -> Result<Option<Self>, SegmentNameError> {
        let (host, rest) = if let Some(stripped) = name.strip_prefix('[') {
            let Some((h, r)) = stripped.split_once(']') else { return Ok(None) };
            let Some(r) = r.strip_prefix(':') else { return Ok(None) };
            (h, r)
        } else {
            let Some(split) = name.split_once(':') else { return Ok(None) };
            split
        };
        if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == '/') {
            return Ok(None);
        }
        let (port, device) = match rest.split_once(':') {
            Some((p, d)) => (p, Some(d)),
            None => (rest, None),
        };
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Ok(None);
        }
        let Ok(port) = port.parse::<u16>() else { return Ok(None) };
        let device = match device {
            None => None,
            Some(d) => Some(parse_device(d).map_err(|why| SegmentNameError {
                message: format!(
                    "segment name {name:?}: device part {d:?} {why}; expected `host:port`, `host:port:npu_<N>` or \
                     `host:port:<N>` with N the physical NPU id"
                ),
            })?),
        };
        Ok(Some(Self { host: host.to_owned(), port, device }))
    }

    /// The host part of a configured name: the host of `host:port[:device]`, or the name
    /// itself when it is a bare host (non-empty, no `:`, `/` or whitespace). `None` otherwise.
    pub fn host_of(name: &str) -> Option<String> {
        match Self::parse(name) {
            Some(n) => Some(n.host),
            None if !name.is_empty() && !name.contains(|c: char| c == ':' || c.is_whitespace() || c == '/') => {
                Some(name.to_owned())
            }
            None => None,
        }
    }

    /// The host (without brackets for IPv6).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The physical device id of a `host:port:npu_N` (or `host:port:N`) name.
    pub fn device(&self) -> Option<u32> {
        self.device
    }

    /// The host, consuming the name.
    pub fn into_host(self) -> String {
        self.host
    }
}

fn parse_device(d: &str) -> Result<u32, String> {
    let digits = match d.strip_prefix("npu_") {
        Some("") => return Err("has nothing after `npu_`".into()),
        Some(rest) => rest,
        None if d.is_empty() => return Err("is empty".into()),
        None => d,
    };
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("is not `npu_<N>` or `<N>`".into());
    }
    match digits.parse::<u32>() {
        Ok(id) if id < DEVICE_ID_LIMIT => Ok(id),
        _ => Err(format!("is out of range (device ids are below {DEVICE_ID_LIMIT})")),
    }
}

impl fmt::Display for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') || self.host.starts_with('[') {
            write!(f, "[{}]:{}", self.host, self.port)?;
        } else {
            write!(f, "{}:{}", self.host, self.port)?;
        }
        match self.device {
            Some(d) => write!(f, ":npu_{d}"),
            None => Ok(()),
        }
    }
}

impl FromStr for SegmentName {
    type Err = SegmentNameError;

    /// [`parse_strict`](SegmentName::parse_strict), with a name that is not `host:port` at all
    /// an error too.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse_strict(s)?.ok_or_else(|| SegmentNameError {
            message: format!(
                "segment name {s:?} is not `host:port`, `host:port:npu_<N>`, `host:port:<N>` or `[v6addr]:port`"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parts(name: &str) -> (String, u16, Option<u32>) {
        let n = SegmentName::parse(name).unwrap();
        (n.host().to_owned(), n.port(), n.device())
    }

    #[test]
    fn forms() {
        assert_eq!(parts("10.0.0.1:17000"), ("10.0.0.1".into(), 17000, None));
        assert_eq!(parts("10.0.0.1:17000:npu_5"), ("10.0.0.1".into(), 17000, Some(5)));
        assert_eq!(parts("10.0.0.1:17000:3"), ("10.0.0.1".into(), 17000, Some(3)));
        assert_eq!(parts("[::1]:80"), ("::1".into(), 80, None));
        assert_eq!(parts("[fe80::1]:80:npu_2"), ("fe80::1".into(), 80, Some(2)));
        for not_encoded in ["demo", "h:", ":80", "h:99999", "[::1]80", "h:+80", "a b:80", "h:x:npu_1", "[::1", ""] {
            assert_eq!(SegmentName::parse_strict(not_encoded), Ok(None), "{not_encoded}");
            assert!(not_encoded.parse::<SegmentName>().unwrap_err().message().contains("is not `host:port`"));
        }
    }

    #[test]
    fn display_is_canonical() {
        for (name, shown) in [
            ("10.0.0.1:17000", "10.0.0.1:17000"),
            ("10.0.0.1:17000:npu_5", "10.0.0.1:17000:npu_5"),
            ("10.0.0.1:17000:3", "10.0.0.1:17000:npu_3"),
            ("[::1]:80", "[::1]:80"),
            ("[node]:80", "node:80"),
            ("[fe80::1]:80:2", "[fe80::1]:80:npu_2"),
        ] {
            assert_eq!(SegmentName::parse(name).unwrap().to_string(), shown, "{name}");
        }
        assert_eq!(SegmentName::new("::1", 7, Some(1)).unwrap().to_string(), "[::1]:7:npu_1");
        assert_eq!(SegmentName::new("", 7, None), None);
        assert_eq!(SegmentName::new("a b", 7, None), None);
        assert_eq!(SegmentName::new("h", 7, Some(DEVICE_ID_LIMIT)), None);
        assert_eq!(SegmentName::new("a]b:c", 7, None), None, "cannot be written back");
    }

    #[test]
    fn malformed_device_parts_are_errors_naming_the_segment() {
        for (bad, why) in [
            ("h:1:npu_x", "is not `npu_<N>`"),
            ("h:1:gpu_1", "is not `npu_<N>`"),
            ("h:1:npu_", "nothing after `npu_`"),
            ("h:1:", "is empty"),
            ("h:1:npu_-1", "is not `npu_<N>`"),
            ("h:1:npu_ 3", "is not `npu_<N>`"),
            ("h:1:npu_99999999999", "out of range (device ids are below 64)"),
            ("h:1:npu_64", "out of range (device ids are below 64)"),
            ("h:1:77", "out of range (device ids are below 64)"),
            ("h:1:npu_3:extra", "is not `npu_<N>`"),
        ] {
            let e = SegmentName::parse_strict(bad).unwrap_err();
            let m = e.to_string();
            assert!(
                m.contains(&format!("{bad:?}")) && m.contains(why) && m.contains("host:port:npu_<N>"),
                "{bad}: {m}"
            );
            assert_eq!(SegmentName::parse(bad), None, "the lenient form stays None: {bad}");
            assert_eq!(bad.parse::<SegmentName>().unwrap_err(), e);
        }
    }

    #[test]
    fn host_of_configured_names() {
        assert_eq!(SegmentName::host_of("10.0.0.5").as_deref(), Some("10.0.0.5"));
        assert_eq!(SegmentName::host_of("10.0.0.5:17000").as_deref(), Some("10.0.0.5"));
        assert_eq!(SegmentName::host_of("10.0.0.5:17000:npu_3").as_deref(), Some("10.0.0.5"));
        assert_eq!(SegmentName::host_of("[::1]:80").as_deref(), Some("::1"));
        assert_eq!(SegmentName::host_of("node7").as_deref(), Some("node7"));
        assert_eq!(SegmentName::host_of("node7:port"), None);
        assert_eq!(SegmentName::host_of("a b"), None);
        assert_eq!(SegmentName::host_of(""), None);
    }

    fn segment_name() -> impl Strategy<Value = SegmentName> {
        let host = prop_oneof![
            "[a-z0-9][a-z0-9.-]{0,20}",
            any::<std::net::Ipv4Addr>().prop_map(|a| a.to_string()),
            any::<std::net::Ipv6Addr>().prop_map(|a| a.to_string()),
        ];
        (host, any::<u16>(), proptest::option::of(0u32..DEVICE_ID_LIMIT))
            .prop_map(|(h, p, d)| SegmentName::new(h, p, d).expect("a valid name"))
    }

    proptest! {
        #[test]
        fn never_panics(name in ".{0,40}") {
            let _ = SegmentName::parse_strict(&name);
            let _ = SegmentName::host_of(&name);
            let _ = name.parse::<SegmentName>();
        }

        #[test]
        fn never_panics_on_name_like_input(name in "[\\[\\]:a-z0-9_ /.-]{0,24}") {
            if let Ok(Some(n)) = SegmentName::parse_strict(&name) {
                prop_assert_eq!(SegmentName::parse(&n.to_string()), Some(n.clone()), "{}", name);
            }
        }

        #[test]
        fn display_round_trips(n in segment_name()) {
            prop_assert_eq!(n.to_string().parse::<SegmentName>().unwrap(), n);
        }

        #[test]
        fn round_trips_from_text(
            host in "[a-z0-9][a-z0-9.-]{0,20}",
            port: u16,
            device in proptest::option::of(0u32..DEVICE_ID_LIMIT),
            npu_prefix: bool,
        ) {
            let name = match device {
                None => format!("{host}:{port}"),
                Some(d) if npu_prefix => format!("{host}:{port}:npu_{d}"),
                Some(d) => format!("{host}:{port}:{d}"),
            };
            let n = SegmentName::parse_strict(&name).unwrap().unwrap();
            prop_assert_eq!(n.host(), host.as_str());
            prop_assert_eq!(n.port(), port);
            prop_assert_eq!(n.device(), device);
            if device.is_none() || npu_prefix {
                prop_assert_eq!(n.to_string(), name);
            }
        }

        #[test]
        fn device_ids_past_the_limit_are_errors(host in "[a-z0-9.]{1,12}", port: u16, device in DEVICE_ID_LIMIT.., npu_prefix: bool) {
            let name = if npu_prefix { format!("{host}:{port}:npu_{device}") } else { format!("{host}:{port}:{device}") };
            let e = SegmentName::parse_strict(&name).unwrap_err();
            prop_assert!(e.message().contains("out of range") && e.message().contains(&format!("{name:?}")), "{}", e);
        }

        #[test]
        fn bad_device_suffixes_are_errors(host in "[a-z0-9.]{1,12}", port: u16, suffix in "[a-zA-Z_ -]{1,8}[0-9]{0,3}") {
            let valid = suffix.strip_prefix("npu_").is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
            prop_assume!(!valid);
            let name = format!("{host}:{port}:{suffix}");
            prop_assert!(SegmentName::parse_strict(&name).is_err(), "{}", name);
        }
    }
}

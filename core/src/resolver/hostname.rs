//! The `hostname` link: identity encoded in a segment name.

use async_trait::async_trait;

use super::{DEVICE_ID_LIMIT, Identity, IdentityField, ResolveQuery, SegmentResolver};
use crate::error::{Error, Result};

/// Reads identity encoded in a segment name: `ip:port`, `ip:port:npu_N` (Mooncake's form) and
/// `ip:port:N`, with `[v6addr]:port` accepted for IPv6. Answers host, port and (with a device
/// part) the physical NPU id, for this process and for peers.
///
/// A name that is not `host:port` at all (`demo`, `ferry-12-0`) is not its to answer. A name
/// that is `host:port` followed by a malformed device part (`npu_x`, `gpu_1`, `npu_`) or a
/// device id not below [`DEVICE_ID_LIMIT`] (`npu_77`) is an error naming the segment and what
/// was expected.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostnameResolver;

impl HostnameResolver {
    /// Parses a segment name leniently; `None` when it is not in one of the encoded forms,
    /// including when its device part is malformed (use [`parse_strict`](Self::parse_strict)
    /// to tell those apart).
    pub fn parse(name: &str) -> Option<Identity> {
        Self::parse_strict(name).ok().flatten()
    }

    /// Parses a segment name: `Ok(None)` when it is not `host:port[:device]`, an error message
    /// when it is `host:port:` followed by something other than `npu_<N>` or `<N>`.
    pub fn parse_strict(name: &str) -> std::result::Result<Option<Identity>, String> {
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
        let physical_device = match device {
            None => None,
            Some(d) => Some(parse_device(d).map_err(|why| {
                format!(
                    "segment name {name:?}: device part {d:?} {why}; expected `host:port`, `host:port:npu_<N>` or \
                     `host:port:<N>` with N the physical NPU id"
                )
            })?),
        };
        Ok(Some(Identity { host: Some(host.to_owned()), port: Some(port), physical_device, ..Identity::default() }))
    }
}

fn parse_device(d: &str) -> std::result::Result<u32, String> {
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

#[async_trait]
impl SegmentResolver for HostnameResolver {
    fn name(&self) -> &str {
        "hostname"
    }

    async fn resolve(&self, query: &ResolveQuery, _known: &Identity) -> Result<Identity> {
        let Some(name) = query.segment_name() else { return Ok(Identity::default()) };
        let whose = if query.is_local() { "this process's" } else { "peer's" };
        let id = Self::parse_strict(name).map_err(|m| Error::config(format!("{whose} {m}")))?;
        let Some(id) = id else { return Ok(Identity::default()) };
        let detail = format!("segment name {name:?}");
        let device_detail = match name.rsplit_once(':') {
            Some((_, d)) if id.physical_device.is_some() => format!("`{d}` in segment name {name:?}"),
            _ => detail.clone(),
        };
        Ok(id.with_detail(IdentityField::PhysicalDevice, device_detail).with_detail_for_all(&detail))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn forms() {
        let id = HostnameResolver::parse("10.0.0.1:17000").unwrap();
        assert_eq!((id.host.as_deref(), id.port, id.physical_device), (Some("10.0.0.1"), Some(17000), None));
        assert_eq!(HostnameResolver::parse("10.0.0.1:17000:npu_5").unwrap().physical_device, Some(5));
        assert_eq!(HostnameResolver::parse("10.0.0.1:17000:3").unwrap().physical_device, Some(3));
        assert_eq!(HostnameResolver::parse("[::1]:80").unwrap().host.as_deref(), Some("::1"));
        assert_eq!(HostnameResolver::parse("[fe80::1]:80:npu_2").unwrap().physical_device, Some(2));
        for not_encoded in ["demo", "h:", ":80", "h:99999", "[::1]80", "h:+80", "a b:80", "h:x:npu_1", "[::1"] {
            assert_eq!(HostnameResolver::parse_strict(not_encoded), Ok(None), "{not_encoded}");
        }
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
            let e = HostnameResolver::parse_strict(bad).unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains(why) && e.contains("host:port:npu_<N>"),
                "{bad}: {e}"
            );
            assert_eq!(HostnameResolver::parse(bad), None, "the lenient form stays None: {bad}");
        }
    }

    #[tokio::test]
    async fn resolver_answers_and_explains_or_fails_for_local_and_peer() {
        let q = ResolveQuery::peer("10.0.0.9:16000:npu_7", Some("x".into()), None);
        let id = HostnameResolver.resolve(&q, &Identity::default()).await.unwrap();
        assert_eq!((id.host.as_deref(), id.port, id.physical_device), (Some("10.0.0.9"), Some(16000), Some(7)));
        assert!(id.details[&IdentityField::PhysicalDevice].contains("`npu_7`"));
        let q = ResolveQuery::local(Some("10.0.0.1:1:gpu_1".into()), None);
        let e = HostnameResolver.resolve(&q, &Identity::default()).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert!(e.message().contains("this process's segment name \"10.0.0.1:1:gpu_1\""), "{e}");
        let q = ResolveQuery::local(None, None);
        assert!(HostnameResolver.resolve(&q, &Identity::default()).await.unwrap().is_empty());
    }

    proptest! {
        #[test]
        fn never_panics(name in ".{0,40}") {
            let _ = HostnameResolver::parse_strict(&name);
        }

        #[test]
        fn round_trips(
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
            let id = HostnameResolver::parse_strict(&name).unwrap().unwrap();
            prop_assert_eq!(id.host.as_deref(), Some(host.as_str()));
            prop_assert_eq!(id.port, Some(port));
            prop_assert_eq!(id.physical_device, device);
        }

        #[test]
        fn device_ids_past_the_limit_are_errors(host in "[a-z0-9.]{1,12}", port: u16, device in DEVICE_ID_LIMIT.., npu_prefix: bool) {
            let name = if npu_prefix { format!("{host}:{port}:npu_{device}") } else { format!("{host}:{port}:{device}") };
            let e = HostnameResolver::parse_strict(&name).unwrap_err();
            prop_assert!(e.contains("out of range") && e.contains(&format!("{name:?}")), "{}", e);
        }

        #[test]
        fn bad_device_suffixes_are_errors(host in "[a-z0-9.]{1,12}", port: u16, suffix in "[a-zA-Z_ -]{1,8}[0-9]{0,3}") {
            let valid = suffix.strip_prefix("npu_").is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
            prop_assume!(!valid);
            let name = format!("{host}:{port}:{suffix}");
            prop_assert!(HostnameResolver::parse_strict(&name).is_err(), "{}", name);
        }
    }
}

//! The `hostname` link: identity encoded in a segment name.

use async_trait::async_trait;

use super::{Identity, IdentityField, ResolveQuery, SegmentResolver};
use crate::error::{Error, Result};
use crate::segment_name::SegmentName;

/// Reads identity encoded in a segment name ([`SegmentName`]): `ip:port`, `ip:port:npu_N`
/// (Mooncake's form) and `ip:port:N`, with `[v6addr]:port` accepted for IPv6. Answers host,
/// port and (with a device part) the physical device id, for this process and for peers.
///
/// A name that is not `host:port` at all (`demo`, `ferry-12-0`) is not its to answer. A name
/// that is `host:port` followed by a malformed device part (`npu_x`, `gpu_1`, `npu_`) or a
/// device id not below [`DEVICE_ID_LIMIT`](crate::DEVICE_ID_LIMIT) (`npu_77`) is an error
/// naming the segment and what was expected.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostnameResolver;

impl HostnameResolver {
    /// The identity a parsed name carries: host, port and the device, if any.
    pub fn identity(name: &SegmentName) -> Identity {
        Identity {
            host: Some(name.host().to_owned()),
            port: Some(name.port()),
            physical_device: name.device(),
            ..Identity::default()
        }
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
        let parsed = SegmentName::parse_strict(name).map_err(|e| Error::config(format!("{whose} {e}")))?;
        let Some(parsed) = parsed else { return Ok(Identity::default()) };
        let detail = format!("segment name {name:?}");
        let device_detail = match name.rsplit_once(':') {
            Some((_, d)) if parsed.device().is_some() => format!("`{d}` in segment name {name:?}"),
            _ => detail.clone(),
        };
        Ok(Self::identity(&parsed)
            .with_detail(IdentityField::PhysicalDevice, device_detail)
            .with_detail_for_all(&detail))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn resolver_answers_and_explains_or_fails_for_local_and_peer() {
        let q = ResolveQuery::peer("10.0.0.9:16000:npu_7", Some("x".into()), None);
        let id = HostnameResolver.resolve(&q, &Identity::default()).await.unwrap();
        assert_eq!((id.host.as_deref(), id.port, id.physical_device), (Some("10.0.0.9"), Some(16000), Some(7)));
        assert!(id.details[&IdentityField::PhysicalDevice].contains("`npu_7`"));
        assert_eq!(id.details[&IdentityField::Port], "segment name \"10.0.0.9:16000:npu_7\"");
        let q = ResolveQuery::local(Some("10.0.0.1:1:gpu_1".into()), None);
        let e = HostnameResolver.resolve(&q, &Identity::default()).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert!(e.message().contains("this process's segment name \"10.0.0.1:1:gpu_1\""), "{e}");
        let q = ResolveQuery::local(None, None);
        assert!(HostnameResolver.resolve(&q, &Identity::default()).await.unwrap().is_empty());
        let q = ResolveQuery::local(Some("demo".into()), None);
        assert!(HostnameResolver.resolve(&q, &Identity::default()).await.unwrap().is_empty());
    }
}

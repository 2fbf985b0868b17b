//! The `port_offset` link: `base_port + local_rank`.

use async_trait::async_trait;

use super::{Identity, IdentityField, ResolveQuery, SegmentResolver};
use crate::config::{BasePort, Config};
use crate::error::Result;

/// The `port_offset` link: this process's port is the config's `base_port` (for its `role`,
/// when the base port is given per role) plus its local rank, so one config serves every rank
/// of a node. Answers nothing without a `base_port`; with one, an unknown local rank or role is
/// an error naming what to set. Peers are not its to answer.
#[derive(Debug, Clone)]
pub struct PortOffsetResolver {
    config: Config,
}

impl PortOffsetResolver {
    /// Offsets from `base_port`.
    pub fn new(base_port: u16) -> Self {
        let mut config = Config::default();
        config.base_port = Some(BasePort::All(base_port));
        Self { config }
    }

    /// Offsets from the config's `base_port` (and `role`); answers nothing when it has none.
    pub fn from_config(config: &Config) -> Self {
        Self { config: config.clone() }
    }
}

#[async_trait]
impl SegmentResolver for PortOffsetResolver {
    fn name(&self) -> &str {
        "port_offset"
    }

    async fn resolve(&self, query: &ResolveQuery, _known: &Identity) -> Result<Identity> {
        if !query.is_local() {
            return Ok(Identity::default());
        }
        let Some(base) = self.config.base_port_for_role()? else { return Ok(Identity::default()) };
        let Some(port) = self.config.port_for_rank(query.local_rank)? else { return Ok(Identity::default()) };
        let rank = u32::from(port - base);
        let id = Identity { port: Some(port), ..Identity::default() };
        Ok(id.with_detail(IdentityField::Port, format!("base_port {base} + local rank {rank}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Role;

    #[tokio::test]
    async fn base_port_plus_local_rank() {
        let r = PortOffsetResolver::new(17000);
        let id = r.resolve(&ResolveQuery::local(None, Some(3)), &Identity::default()).await.unwrap();
        assert_eq!(id.port, Some(17003));
        assert_eq!(id.details[&IdentityField::Port], "base_port 17000 + local rank 3");
        assert!(r.resolve(&ResolveQuery::peer("h:1", None, Some(3)), &Identity::default()).await.unwrap().is_empty());
        let e = r.resolve(&ResolveQuery::local(None, None), &Identity::default()).await.unwrap_err();
        assert!(e.message().contains("local rank is unknown") && e.message().contains("LOCAL_RANK"), "{e}");
        let e = PortOffsetResolver::new(65535).resolve(&ResolveQuery::local(None, Some(1)), &Identity::default()).await;
        assert!(e.unwrap_err().message().contains("past 65535"));
        let none = PortOffsetResolver::from_config(&Config::default());
        assert!(none.resolve(&ResolveQuery::local(None, Some(1)), &Identity::default()).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn per_role_base_ports() {
        async fn port(c: &Config) -> Result<Identity> {
            PortOffsetResolver::from_config(c).resolve(&ResolveQuery::local(None, Some(2)), &Identity::default()).await
        }
        let text = r#"{"base_port": {"prefill": 17000, "decode": 17100}, "role": "decode"}"#;
        let mut c = Config::from_json_str(text, None).unwrap();
        assert_eq!(port(&c).await.unwrap().port, Some(17102));
        c.role = None;
        assert!(port(&c).await.unwrap_err().message().contains("set `role`"));
        c.role = Some(Role::Prefill);
        c.base_port = Some(BasePort::PerRole { prefill: None, decode: Some(1) });
        assert!(port(&c).await.unwrap_err().message().contains("no port for role prefill"));
    }
}

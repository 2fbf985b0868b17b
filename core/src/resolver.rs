//! The [`SegmentResolver`] trait: turning names and the environment into identities (host,
//! port, physical NPU, device IP, rank), and the [`ResolverChain`] that composes resolvers and
//! explains which one answered each field.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::{Error, Result};

/// Whose identity is asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolveTarget {
    /// This process.
    Local,
    /// The owner of the named segment.
    Peer(String),
}

/// A question put to resolvers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveQuery {
    /// Whose identity.
    pub target: ResolveTarget,
    /// This process's segment name, if known.
    pub local_segment: Option<String>,
    /// This process's local rank on its node (`LOCAL_RANK`), if known.
    pub local_rank: Option<u32>,
}

impl ResolveQuery {
    /// The segment name the query is about (the peer's, or ours for `Local`).
    pub fn segment_name(&self) -> Option<&str> {
        match &self.target {
            ResolveTarget::Peer(name) => Some(name),
            ResolveTarget::Local => self.local_segment.as_deref(),
        }
    }
}

/// What is known about a process. Every field is optional: a resolver fills in what it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Host name or IP of the control/data endpoint.
    pub host: Option<String>,
    /// Port of the control/data endpoint.
    pub port: Option<u16>,
    /// Physical NPU id (`/dev/davinciN`, rank tables, `hccn.conf`).
    pub physical_device: Option<u32>,
    /// User device id (what `aclrtSetDevice` takes).
    pub user_device: Option<u32>,
    /// Device (NIC) IP.
    pub device_ip: Option<String>,
    /// Rank in the communication group.
    pub rank: Option<u32>,
}

/// Names of [`Identity`] fields, for explanations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentityField {
    /// [`Identity::host`]
    Host,
    /// [`Identity::port`]
    Port,
    /// [`Identity::physical_device`]
    PhysicalDevice,
    /// [`Identity::user_device`]
    UserDevice,
    /// [`Identity::device_ip`]
    DeviceIp,
    /// [`Identity::rank`]
    Rank,
}

impl fmt::Display for IdentityField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IdentityField::Host => "host",
            IdentityField::Port => "port",
            IdentityField::PhysicalDevice => "physical_device",
            IdentityField::UserDevice => "user_device",
            IdentityField::DeviceIp => "device_ip",
            IdentityField::Rank => "rank",
        })
    }
}

impl Identity {
    /// Each set field as (name, printable value).
    pub fn fields(&self) -> Vec<(IdentityField, String)> {
        let mut out = Vec::new();
        if let Some(v) = &self.host {
            out.push((IdentityField::Host, v.clone()));
        }
        if let Some(v) = self.port {
            out.push((IdentityField::Port, v.to_string()));
        }
        if let Some(v) = self.physical_device {
            out.push((IdentityField::PhysicalDevice, v.to_string()));
        }
        if let Some(v) = self.user_device {
            out.push((IdentityField::UserDevice, v.to_string()));
        }
        if let Some(v) = &self.device_ip {
            out.push((IdentityField::DeviceIp, v.clone()));
        }
        if let Some(v) = self.rank {
            out.push((IdentityField::Rank, v.to_string()));
        }
        out
    }

    /// Fills fields unset in `self` from `other`; returns the fields taken.
    fn fill_from(&mut self, other: Identity) -> Vec<IdentityField> {
        let mut taken = Vec::new();
        macro_rules! take {
            ($f:ident, $name:expr) => {
                if self.$f.is_none() && other.$f.is_some() {
                    self.$f = other.$f;
                    taken.push($name);
                }
            };
        }
        take!(host, IdentityField::Host);
        take!(port, IdentityField::Port);
        take!(physical_device, IdentityField::PhysicalDevice);
        take!(user_device, IdentityField::UserDevice);
        take!(device_ip, IdentityField::DeviceIp);
        take!(rank, IdentityField::Rank);
        taken
    }
}

/// Turns names and the environment into identities.
///
/// # Contract
/// `resolve` returns the fields this resolver knows for the query and leaves the rest `None`;
/// an empty [`Identity`] means "not mine to answer". It returns an error only when its own input
/// is present but wrong (a malformed rank table, an unparsable variable), naming that input.
///
/// # Threading
/// `Send + Sync`; may be called concurrently. Resolvers read files and the environment; they do
/// not open sockets.
#[async_trait]
pub trait SegmentResolver: Send + Sync + 'static {
    /// Short name shown in explanations (`hostname`, `rank-table`, `env`, ...).
    fn name(&self) -> &str;

    /// Answers what it can of `query`.
    async fn resolve(&self, query: &ResolveQuery) -> Result<Identity>;
}

/// One line of an explanation: which resolver supplied which field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The field.
    pub field: IdentityField,
    /// Its value.
    pub value: String,
    /// The resolver that supplied it.
    pub resolver: String,
}

/// The merged answer of a chain, with its explanation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolution {
    /// The merged identity.
    pub identity: Identity,
    /// Which resolver answered each field, in chain order.
    pub answers: Vec<Answer>,
    /// Resolvers consulted, in order.
    pub consulted: Vec<String>,
}

impl fmt::Display for Resolution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.answers.is_empty() {
            return write!(f, "nothing resolved (consulted: {})", self.consulted.join(", "));
        }
        for a in &self.answers {
            writeln!(f, "{:<16} = {:<20} (from {})", a.field.to_string(), a.value, a.resolver)?;
        }
        Ok(())
    }
}

/// Resolvers in priority order: for each field, the first resolver that knows it wins.
#[derive(Clone, Default)]
pub struct ResolverChain {
    links: Vec<Arc<dyn SegmentResolver>>,
}

impl fmt::Debug for ResolverChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.links.iter().map(|l| l.name().to_owned())).finish()
    }
}

impl ResolverChain {
    /// An empty chain.
    pub fn new() -> Self {
        Self::default()
    }

    /// The default chain of this crate: the hostname-encoded resolver. Crates with more
    /// resolvers (environment, rank table, ACL) build longer chains.
    pub fn with_defaults() -> Self {
        Self::new().with(Arc::new(HostnameResolver))
    }

    /// Appends a resolver (lowest priority so far).
    pub fn with(mut self, link: Arc<dyn SegmentResolver>) -> Self {
        self.links.push(link);
        self
    }

    /// Names of the links, in order.
    pub fn names(&self) -> Vec<&str> {
        self.links.iter().map(|l| l.name()).collect()
    }

    /// Asks every link and merges the answers. A link's error stops the chain and names it.
    pub async fn resolve(&self, query: &ResolveQuery) -> Result<Resolution> {
        let mut res = Resolution::default();
        for link in &self.links {
            res.consulted.push(link.name().to_owned());
            let got = link.resolve(query).await.map_err(|e| {
                Error::new(e.kind(), format!("resolver `{}`: {}", link.name(), e.message())).with_source(e)
            })?;
            let values = got.fields();
            for field in res.identity.fill_from(got) {
                let value = values.iter().find(|(f, _)| *f == field).map(|(_, v)| v.clone()).unwrap_or_default();
                res.answers.push(Answer { field, value, resolver: link.name().to_owned() });
            }
        }
        Ok(res)
    }
}

/// Reads identity encoded in a segment name: `ip:port`, `ip:port:npu_N` (Mooncake's form) and
/// `ip:port:N`, with `[v6addr]:port` accepted for IPv6. Names in other forms are not its to
/// answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostnameResolver;

impl HostnameResolver {
    /// Parses a segment name; `None` when it is not in one of the encoded forms.
    pub fn parse(name: &str) -> Option<Identity> {
        let (host, rest) = if let Some(stripped) = name.strip_prefix('[') {
            let (h, r) = stripped.split_once(']')?;
            (h, r.strip_prefix(':')?)
        } else {
            name.split_once(':')?
        };
        if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == '/') {
            return None;
        }
        let (port, device) = match rest.split_once(':') {
            Some((p, d)) => (p, Some(d)),
            None => (rest, None),
        };
        let port: u16 = port.parse().ok()?;
        let physical_device = match device {
            None => None,
            Some(d) => Some(d.strip_prefix("npu_").unwrap_or(d).parse::<u32>().ok()?),
        };
        Some(Identity { host: Some(host.to_owned()), port: Some(port), physical_device, ..Identity::default() })
    }
}

#[async_trait]
impl SegmentResolver for HostnameResolver {
    fn name(&self) -> &str {
        "hostname"
    }

    async fn resolve(&self, query: &ResolveQuery) -> Result<Identity> {
        Ok(query.segment_name().and_then(Self::parse).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostname_forms() {
        let id = HostnameResolver::parse("10.0.0.1:17000").unwrap();
        assert_eq!((id.host.as_deref(), id.port, id.physical_device), (Some("10.0.0.1"), Some(17000), None));
        assert_eq!(HostnameResolver::parse("10.0.0.1:17000:npu_5").unwrap().physical_device, Some(5));
        assert_eq!(HostnameResolver::parse("10.0.0.1:17000:3").unwrap().physical_device, Some(3));
        assert_eq!(HostnameResolver::parse("[::1]:80").unwrap().host.as_deref(), Some("::1"));
        for bad in ["demo", "h:", ":80", "h:99999", "h:1:npu_x", "h:1:gpu_1", "[::1]80"] {
            assert_eq!(HostnameResolver::parse(bad), None, "{bad}");
        }
    }

    struct Fixed(&'static str, Identity);
    #[async_trait]
    impl SegmentResolver for Fixed {
        fn name(&self) -> &str {
            self.0
        }
        async fn resolve(&self, _: &ResolveQuery) -> Result<Identity> {
            Ok(self.1.clone())
        }
    }

    #[tokio::test]
    async fn chain_merges_and_explains() {
        let env = Identity { physical_device: Some(6), rank: Some(2), ..Identity::default() };
        let chain = ResolverChain::with_defaults().with(Arc::new(Fixed("env", env)));
        let q = ResolveQuery {
            target: ResolveTarget::Local,
            local_segment: Some("10.1.1.1:9000:npu_3".into()),
            local_rank: None,
        };
        let r = chain.resolve(&q).await.unwrap();
        assert_eq!(r.identity.physical_device, Some(3), "the earlier link wins");
        assert_eq!(r.identity.rank, Some(2));
        let who = |f| r.answers.iter().find(|a| a.field == f).unwrap().resolver.clone();
        assert_eq!(who(IdentityField::PhysicalDevice), "hostname");
        assert_eq!(who(IdentityField::Rank), "env");
        assert_eq!(r.consulted, vec!["hostname", "env"]);
        assert!(r.to_string().contains("rank"));
    }
}

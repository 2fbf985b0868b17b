//! Device and endpoint identity: the [`SegmentResolver`] trait, the generic resolvers built
//! into the core, and the [`ResolverChain`] that composes them and explains which one answered
//! each field.
//!
//! # The chain
//!
//! A chain asks its links in order. Each link sees what earlier links resolved (`known`) and
//! answers what it can; for every field the first answer wins, later different answers are kept
//! as [`Resolution::disagreements`]. Disagreements about the physical or the user device are
//! refused by the transports that drive a device and by `ferry doctor`
//! ([`Resolution::refuse_device_disagreements`]). A link's error stops the chain and names the
//! link.
//!
//! The core's links ([`ResolverRegistry::with_builtin`]):
//!
//! | name | answers | from |
//! |---|---|---|
//! | `config` | physical device | the config's `physical_devices[local_rank]` |
//! | `hostname` | host, port, physical device | the segment name ([`SegmentName`](crate::SegmentName)): `ip:port`, `ip:port:npu_N`, `ip:port:N` |
//! | `port_offset` | port | `base_port + local_rank` |
//!
//! Links that read a device's own sources (its runtime, rank tables, its environment variables,
//! its host files) come with the transport that drives the device: its crate installs a
//! [`ResolverFactory`] for each in a [`ResolverRegistry`] and places their names in the
//! registry's default order ([`ResolverRegistry::place_in_default_order`]). A config's
//! `resolvers` list (or `FERRY_RESOLVERS`) replaces the order.
//!
//! No resolver guesses: a source that is present but wrong (a malformed file, an unparsable
//! variable, a rank with no entry) is an error naming the source (file and field, variable and
//! value) and what was expected, and no link ever falls back to device 0.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::{Error, Result};

mod explicit;
mod hostname;
mod port;
mod registry;

pub use crate::environment::Environment;
pub use crate::segment_name::DEVICE_ID_LIMIT;
pub use explicit::ExplicitResolver;
pub use hostname::HostnameResolver;
pub use port::PortOffsetResolver;
pub use registry::{BUILTIN_RESOLVER_ORDER, ResolverContext, ResolverFactory, ResolverRegistry};

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
    /// This process's local rank on its node (`FERRY_LOCAL_RANK`, `LOCAL_RANK`, the config's
    /// `local_rank` or `EngineBuilder::local_rank`), if known.
    pub local_rank: Option<u32>,
}

impl ResolveQuery {
    /// A query about this process.
    pub fn local(local_segment: Option<String>, local_rank: Option<u32>) -> Self {
        Self { target: ResolveTarget::Local, local_segment, local_rank }
    }

    /// A query about the owner of segment `peer`.
    pub fn peer(peer: impl Into<String>, local_segment: Option<String>, local_rank: Option<u32>) -> Self {
        Self { target: ResolveTarget::Peer(peer.into()), local_segment, local_rank }
    }

    /// The segment name the query is about (the peer's, or ours for `Local`).
    pub fn segment_name(&self) -> Option<&str> {
        match &self.target {
            ResolveTarget::Peer(name) => Some(name),
            ResolveTarget::Local => self.local_segment.as_deref(),
        }
    }

    /// Whether the query is about this process.
    pub fn is_local(&self) -> bool {
        self.target == ResolveTarget::Local
    }
}

/// What is known about a process. Every field is optional: a resolver fills in what it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Host name or IP of the control/data endpoint.
    pub host: Option<String>,
    /// Port of the control/data endpoint.
    pub port: Option<u16>,
    /// Physical device id (the host's own numbering of the card, as device files and cluster
    /// files name it).
    pub physical_device: Option<u32>,
    /// User device id (what the device runtime's calls take: the index among the devices
    /// visible to this process).
    pub user_device: Option<u32>,
    /// Device (NIC) IP.
    pub device_ip: Option<String>,
    /// Device (NIC) port.
    pub device_port: Option<u16>,
    /// Rank in the communication group.
    pub rank: Option<u32>,
    /// How a resolver derived each field it answered (shown in explanations), e.g.
    /// `physical_devices [4, 5] entry 1 (local rank 1)`.
    pub details: BTreeMap<IdentityField, String>,
}

/// Names of [`Identity`] fields, for explanations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
    /// [`Identity::device_port`]
    DevicePort,
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
            IdentityField::DevicePort => "device_port",
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
        if let Some(v) = self.device_port {
            out.push((IdentityField::DevicePort, v.to_string()));
        }
        if let Some(v) = self.rank {
            out.push((IdentityField::Rank, v.to_string()));
        }
        out
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        self.fields().is_empty()
    }

    /// Records how `field` was derived (builder style).
    pub fn with_detail(mut self, field: IdentityField, detail: impl Into<String>) -> Self {
        self.details.insert(field, detail.into());
        self
    }

    /// Records `detail` for every field set so far that has none yet.
    pub fn with_detail_for_all(mut self, detail: &str) -> Self {
        for (field, _) in self.fields() {
            self.details.entry(field).or_insert_with(|| detail.to_owned());
        }
        self
    }

    /// Fills fields unset in `self` from `other`; returns the fields taken and the fields
    /// `other` answered differently from what `self` already held.
    fn fill_from(&mut self, other: Identity) -> (Vec<IdentityField>, Vec<IdentityField>) {
        let mut taken = Vec::new();
        let mut differ = Vec::new();
        macro_rules! take {
            ($f:ident, $name:expr) => {
                match (&self.$f, &other.$f) {
                    (None, Some(_)) => {
                        self.$f = other.$f.clone();
                        taken.push($name);
                    }
                    (Some(mine), Some(theirs)) if mine != theirs => differ.push($name),
                    _ => {}
                }
            };
        }
        take!(host, IdentityField::Host);
        take!(port, IdentityField::Port);
        take!(physical_device, IdentityField::PhysicalDevice);
        take!(user_device, IdentityField::UserDevice);
        take!(device_ip, IdentityField::DeviceIp);
        take!(device_port, IdentityField::DevicePort);
        take!(rank, IdentityField::Rank);
        for f in &taken {
            if let Some(d) = other.details.get(f) {
                self.details.insert(*f, d.clone());
            }
        }
        (taken, differ)
    }
}

/// Turns names and the environment into identities.
///
/// # Contract
/// `resolve` returns the fields this resolver knows for the query and leaves the rest `None`;
/// an empty [`Identity`] means "not mine to answer". `known` holds what earlier links of the
/// chain resolved (a link may look a file's entry up by the physical device an earlier link
/// found). A resolver returns an error only when its own input is present but wrong (a
/// malformed file, an unparsable variable, a rank with no entry), naming that input and what
/// was expected. It never answers a guess (such as device 0 for want of anything better).
///
/// Fields a resolver answers should carry a short [`Identity::details`] entry saying how they
/// were derived; explanations show it.
///
/// # Threading
/// `Send + Sync`; may be called concurrently. Resolvers read files and the environment; the
/// ones in `ferry-core` open no sockets and touch no devices.
#[async_trait]
pub trait SegmentResolver: Send + Sync + 'static {
    /// Short name shown in explanations and used in the config's `resolvers` list (`config`,
    /// `hostname`, `port_offset`, ...).
    fn name(&self) -> &str;

    /// Answers what it can of `query`, given what earlier links resolved (`known`).
    async fn resolve(&self, query: &ResolveQuery, known: &Identity) -> Result<Identity>;
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
    /// How the resolver derived it (empty when it did not say).
    pub detail: String,
}

/// The merged answer of a chain, with its explanation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolution {
    /// The merged identity.
    pub identity: Identity,
    /// Which resolver answered each field, in chain order.
    pub answers: Vec<Answer>,
    /// Answers ignored because an earlier link had already answered the field with another
    /// value (two sources disagree; about the device, that is refused: see
    /// [`refuse_device_disagreements`](Self::refuse_device_disagreements)).
    pub disagreements: Vec<Answer>,
    /// Resolvers consulted, in order.
    pub consulted: Vec<String>,
}

impl Resolution {
    /// The answer for `field`, if any.
    pub fn answer(&self, field: IdentityField) -> Option<&Answer> {
        self.answers.iter().find(|a| a.field == field)
    }

    /// The [`disagreements`](Self::disagreements) about which device this is: answers for
    /// `physical_device` or `user_device` that differ from the one kept.
    pub fn device_disagreements(&self) -> Vec<&Answer> {
        self.disagreements
            .iter()
            .filter(|d| matches!(d.field, IdentityField::PhysicalDevice | IdentityField::UserDevice))
            .collect()
    }

    /// Refuses a resolution whose sources disagree about the physical or the user device: taking
    /// the first answer would bind one card and publish another (or publish the wrong one). The
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) error shows each pair of answers with
    /// the resolver and source of each. Transports that drive a device and `ferry doctor` call
    /// it; other fields' disagreements stay notes.
    pub fn refuse_device_disagreements(&self) -> Result<()> {
        let conflicts = self.device_disagreements();
        if conflicts.is_empty() {
            return Ok(());
        }
        let says = |a: &Answer| match a.detail.as_str() {
            "" => format!("`{}` says {}", a.resolver, a.value),
            d => format!("`{}` says {} ({d})", a.resolver, a.value),
        };
        let pairs: Vec<String> = conflicts
            .iter()
            .map(|d| match self.answer(d.field) {
                Some(kept) => format!("{}: {}, but {}", d.field, says(kept), says(d)),
                None => format!("{}: {}", d.field, says(d)),
            })
            .collect();
        Err(Error::config(format!(
            "the identity sources disagree about the device: {}; Ferry does not pick one (it would bind or \
             publish the wrong card): make the sources agree, or remove the wrong one (or its link from \
             `resolvers`)",
            pairs.join("; ")
        )))
    }
}

impl fmt::Display for Resolution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.answers.is_empty() {
            writeln!(f, "nothing resolved (consulted: {})", self.consulted.join(", "))?;
        }
        for a in &self.answers {
            write!(f, "{:<16} = {:<20} (from {})", a.field.to_string(), a.value, a.resolver)?;
            if !a.detail.is_empty() {
                write!(f, " {}", a.detail)?;
            }
            writeln!(f)?;
        }
        for d in &self.disagreements {
            let kept = self.answer(d.field);
            write!(f, "note: `{}` said {} = {}", d.resolver, d.field, d.value)?;
            if !d.detail.is_empty() {
                write!(f, " ({})", d.detail)?;
            }
            match kept {
                Some(k) => writeln!(f, "; kept {} from `{}`, which comes first", k.value, k.resolver)?,
                None => writeln!(f)?,
            }
        }
        Ok(())
    }
}

/// Resolvers in priority order: for each field, the first resolver that knows it wins.
#[derive(Clone, Default)]
pub struct ResolverChain {
    links: Vec<Arc<dyn SegmentResolver>>,
    skipped: Vec<String>,
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

    /// The hostname-encoded resolver alone: what needs neither a config nor the environment.
    /// Engines build their chain from the config instead ([`ResolverChain::from_config`]).
    pub fn with_defaults() -> Self {
        Self::new().with(Arc::new(HostnameResolver))
    }

    /// The chain a config asks for (its `resolvers` list, else the default order) from the
    /// resolvers built into the core ([`ResolverRegistry::with_builtin`]), reading `env`.
    pub fn from_config(config: &crate::Config, env: &Environment) -> Result<Self> {
        ResolverRegistry::with_builtin().build_chain(config, env)
    }

    /// Appends a resolver (lowest priority so far).
    pub fn with(mut self, link: Arc<dyn SegmentResolver>) -> Self {
        self.links.push(link);
        self
    }

    /// Inserts `link` just before the first link named `anchor`; returns false (and inserts
    /// nothing) when there is no such link.
    pub fn insert_before(&mut self, anchor: &str, link: Arc<dyn SegmentResolver>) -> bool {
        match self.links.iter().position(|l| l.name() == anchor) {
            Some(i) => {
                self.links.insert(i, link);
                true
            }
            None => false,
        }
    }

    /// Names of the links, in order.
    pub fn names(&self) -> Vec<&str> {
        self.links.iter().map(|l| l.name()).collect()
    }

    /// Names of the default order that this chain lacks because nothing provides them in this
    /// build (a link a transport's crate names but does not provide itself).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    pub(crate) fn note_skipped(&mut self, name: &str) {
        self.skipped.push(name.to_owned());
    }

    /// Asks every link, each seeing what the earlier ones resolved, and merges the answers. A
    /// link's error stops the chain and names it.
    pub async fn resolve(&self, query: &ResolveQuery) -> Result<Resolution> {
        let mut res = Resolution::default();
        for link in &self.links {
            res.consulted.push(link.name().to_owned());
            let got = link.resolve(query, &res.identity).await.map_err(|e| {
                Error::new(e.kind(), format!("resolver `{}`: {}", link.name(), e.message())).with_source(e)
            })?;
            let values = got.fields();
            let details = got.details.clone();
            let answer = |field: IdentityField| Answer {
                field,
                value: values.iter().find(|(f, _)| *f == field).map(|(_, v)| v.clone()).unwrap_or_default(),
                resolver: link.name().to_owned(),
                detail: details.get(&field).cloned().unwrap_or_default(),
            };
            let (taken, differ) = res.identity.fill_from(got);
            for field in taken {
                res.answers.push(answer(field));
            }
            for field in differ {
                tracing::debug!(resolver = link.name(), %field, "answer ignored: an earlier resolver answered differently");
                res.disagreements.push(answer(field));
            }
        }
        Ok(res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(&'static str, Identity);
    #[async_trait]
    impl SegmentResolver for Fixed {
        fn name(&self) -> &str {
            self.0
        }
        async fn resolve(&self, _: &ResolveQuery, _: &Identity) -> Result<Identity> {
            Ok(self.1.clone())
        }
    }

    /// Answers the physical device it is told and records what it was shown.
    struct Sees(std::sync::Mutex<Option<Identity>>);
    #[async_trait]
    impl SegmentResolver for Sees {
        fn name(&self) -> &str {
            "sees"
        }
        async fn resolve(&self, _: &ResolveQuery, known: &Identity) -> Result<Identity> {
            *self.0.lock().unwrap() = Some(known.clone());
            Ok(Identity { device_ip: known.physical_device.map(|p| format!("10.9.9.{p}")), ..Identity::default() })
        }
    }

    #[tokio::test]
    async fn chain_merges_explains_and_passes_what_is_known() {
        let env = Identity { physical_device: Some(6), rank: Some(2), ..Identity::default() }
            .with_detail(IdentityField::Rank, "RANK=2");
        let sees = Arc::new(Sees(std::sync::Mutex::new(None)));
        let chain = ResolverChain::with_defaults().with(Arc::new(Fixed("env", env))).with(sees.clone());
        let q = ResolveQuery::local(Some("10.1.1.1:9000:npu_3".into()), None);
        let r = chain.resolve(&q).await.unwrap();
        assert_eq!(r.identity.physical_device, Some(3), "the earlier link wins");
        assert_eq!(r.identity.rank, Some(2));
        assert_eq!(r.answer(IdentityField::PhysicalDevice).unwrap().resolver, "hostname");
        assert_eq!(r.answer(IdentityField::Rank).unwrap().resolver, "env");
        assert_eq!(r.answer(IdentityField::Rank).unwrap().detail, "RANK=2");
        assert_eq!(r.consulted, vec!["hostname", "env", "sees"]);
        // The later link saw what the earlier ones resolved, and built on it.
        let seen = sees.0.lock().unwrap().clone().unwrap();
        assert_eq!((seen.physical_device, seen.port, seen.rank), (Some(3), Some(9000), Some(2)));
        assert_eq!(r.identity.device_ip.as_deref(), Some("10.9.9.3"));
        // env's physical device 6 disagreed with hostname's 3: kept as a note.
        assert_eq!(r.disagreements.len(), 1);
        assert_eq!((r.disagreements[0].resolver.as_str(), r.disagreements[0].value.as_str()), ("env", "6"));
        let text = r.to_string();
        assert!(text.contains("rank") && text.contains("(from env) RANK=2"), "{text}");
        assert!(text.contains("note: `env` said physical_device = 6; kept 3 from `hostname`"), "{text}");
    }

    #[tokio::test]
    async fn errors_name_the_link_and_empty_chains_say_so() {
        struct Broken;
        #[async_trait]
        impl SegmentResolver for Broken {
            fn name(&self) -> &str {
                "broken"
            }
            async fn resolve(&self, _: &ResolveQuery, _: &Identity) -> Result<Identity> {
                Err(Error::config("/x.json: `status` is \"initializing\""))
            }
        }
        let chain = ResolverChain::new().with(Arc::new(Broken));
        let e = chain.resolve(&ResolveQuery::local(None, None)).await.unwrap_err();
        assert!(e.message().starts_with("resolver `broken`: /x.json"), "{e}");
        let r = ResolverChain::with_defaults().resolve(&ResolveQuery::local(Some("demo".into()), None)).await.unwrap();
        assert!(r.identity.is_empty());
        assert_eq!(r.to_string().trim(), "nothing resolved (consulted: hostname)");
    }

    #[tokio::test]
    async fn a_real_disagreement_about_the_device_is_refused_with_both_answers() {
        let phy = |p, detail: &str| {
            Identity { physical_device: Some(p), ..Identity::default() }
                .with_detail(IdentityField::PhysicalDevice, detail)
        };
        let chain = ResolverChain::with_defaults().with(Arc::new(Fixed("vars", phy(2, "DEVICE=\"2\""))));
        let r = chain.resolve(&ResolveQuery::local(Some("10.0.0.5:17000:npu_3".into()), None)).await.unwrap();
        assert_eq!(r.identity.physical_device, Some(3), "the first answer is kept ...");
        assert_eq!(r.device_disagreements().len(), 1);
        let e = r.refuse_device_disagreements().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        let m = e.message();
        assert!(
            m.contains(
                "physical_device: `hostname` says 3 (`npu_3` in segment name \"10.0.0.5:17000:npu_3\"), but \
                        `vars` says 2 (DEVICE=\"2\")"
            ),
            "... but refused: {m}"
        );
        // A user-device disagreement is refused too; other fields' disagreements stay notes.
        let user = |u| Identity { user_device: Some(u), ..Identity::default() };
        let chain =
            ResolverChain::new().with(Arc::new(Fixed("vars", user(1)))).with(Arc::new(Fixed("runtime", user(0))));
        let r = chain.resolve(&ResolveQuery::local(None, None)).await.unwrap();
        let m = r.refuse_device_disagreements().unwrap_err().message().to_owned();
        assert!(m.contains("user_device: `vars` says 1, but `runtime` says 0; Ferry does not pick one (it would bind or publish the wrong card)"), "{m}");
        let ip = |a: &str| Identity { device_ip: Some(a.into()), ..Identity::default() };
        let chain =
            ResolverChain::new().with(Arc::new(Fixed("a", ip("1.1.1.1")))).with(Arc::new(Fixed("b", ip("2.2.2.2"))));
        let r = chain.resolve(&ResolveQuery::local(None, None)).await.unwrap();
        assert_eq!(r.disagreements.len(), 1);
        r.refuse_device_disagreements().unwrap();
    }

    #[test]
    fn insert_before_places_a_link_by_name() {
        let mut chain = ResolverChain::new()
            .with(Arc::new(Fixed("first", Identity::default())))
            .with(Arc::new(Fixed("last", Identity::default())));
        assert!(chain.insert_before("last", Arc::new(Fixed("middle", Identity::default()))));
        assert!(!chain.insert_before("nope", Arc::new(Fixed("x", Identity::default()))));
        assert_eq!(chain.names(), vec!["first", "middle", "last"]);
    }
}

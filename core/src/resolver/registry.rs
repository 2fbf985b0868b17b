//! Resolvers by name: the [`ResolverRegistry`] that builds a [`ResolverChain`] from a config.

use std::fmt;
use std::sync::Arc;

use super::{
    EnvResolver, Environment, ExplicitResolver, HccnConfResolver, HostnameResolver, PortOffsetResolver,
    RankTableResolver, ResolverChain, SegmentResolver,
};
use crate::config::Config;
use crate::error::{Error, Result};

/// Name of the ACL-query link, provided by the HCCL transport crate (it needs the CANN
/// runtime); builds without it skip the name in the default order.
pub const ACL_RESOLVER: &str = "acl";

/// The default chain order (see the [module docs](super) for what each link answers).
pub const DEFAULT_RESOLVER_ORDER: [&str; 7] =
    ["config", "hostname", "rank_table", "env", ACL_RESOLVER, "hccn_conf", "port_offset"];

/// What a [`ResolverFactory`] builds its link from.
#[non_exhaustive]
#[derive(Debug, Clone, Copy)]
pub struct ResolverContext<'a> {
    /// The engine's config (role, paths, base port, ...), after environment overrides.
    pub config: &'a Config,
    /// The environment resolvers read.
    pub env: &'a Environment,
}

impl<'a> ResolverContext<'a> {
    /// A context on `config` and `env`.
    pub fn new(config: &'a Config, env: &'a Environment) -> Self {
        Self { config, env }
    }
}

/// Creates one named link of a chain. Crates outside the core (the HCCL transport's `acl`
/// link) install theirs in a [`ResolverRegistry`]; the link then takes its name's place in the
/// order.
pub trait ResolverFactory: Send + Sync + 'static {
    /// The link's name, as written in the config's `resolvers` list.
    fn name(&self) -> &str;

    /// Creates the link. An error (a config value it cannot use) fails the engine's start.
    fn create(&self, ctx: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>>;
}

type Make = fn(&ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>>;

struct Builtin(&'static str, Make);

impl ResolverFactory for Builtin {
    fn name(&self) -> &str {
        self.0
    }
    fn create(&self, ctx: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
        (self.1)(ctx)
    }
}

/// Resolver factories by name.
#[derive(Clone, Default)]
pub struct ResolverRegistry {
    factories: Vec<Arc<dyn ResolverFactory>>,
}

impl fmt::Debug for ResolverRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl ResolverRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The resolvers of `ferry-core`: `config`, `hostname`, `rank_table`, `env`, `hccn_conf`,
    /// `port_offset` (not `acl`, which needs the CANN runtime).
    pub fn with_builtin() -> Self {
        let builtins: [Builtin; 6] = [
            Builtin("config", |c| Ok(Arc::new(ExplicitResolver::from_config(c.config)))),
            Builtin("hostname", |_| Ok(Arc::new(HostnameResolver))),
            Builtin("rank_table", |c| Ok(Arc::new(RankTableResolver::from_config(c.config, c.env)))),
            Builtin("env", |c| Ok(Arc::new(EnvResolver::new(c.env.clone())))),
            Builtin("hccn_conf", |c| {
                Ok(Arc::new(match c.config.hccn_conf_path() {
                    Some(p) => HccnConfResolver::at(p, c.config.describe_source("hccn_conf_path")),
                    None => HccnConfResolver::new(),
                }))
            }),
            Builtin("port_offset", |c| Ok(Arc::new(PortOffsetResolver::from_config(c.config)))),
        ];
        let mut r = Self::new();
        for b in builtins {
            r.install(Arc::new(b));
        }
        r
    }

    /// Installs `factory`, replacing one of the same name.
    pub fn install(&mut self, factory: Arc<dyn ResolverFactory>) {
        self.factories.retain(|f| f.name() != factory.name());
        self.factories.push(factory);
    }

    /// [`install`](Self::install), builder style.
    pub fn with(mut self, factory: Arc<dyn ResolverFactory>) -> Self {
        self.install(factory);
        self
    }

    /// Names installed, in installation order.
    pub fn names(&self) -> Vec<&str> {
        self.factories.iter().map(|f| f.name()).collect()
    }

    /// Every name a config may list: the default order, then other installed names.
    pub fn known_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = DEFAULT_RESOLVER_ORDER.to_vec();
        for n in self.names() {
            if !names.contains(&n) {
                names.push(n);
            }
        }
        names
    }

    fn get(&self, name: &str) -> Option<&Arc<dyn ResolverFactory>> {
        self.factories.iter().find(|f| f.name() == name)
    }

    /// Builds the chain `config` asks for: its `resolvers` list (or `FERRY_RESOLVERS`), else
    /// [`DEFAULT_RESOLVER_ORDER`], where names nothing provides in this build are skipped (and
    /// reported by [`ResolverChain::skipped`]). A listed name that is unknown, repeated, or not
    /// provided in this build is a config error naming the field and the known names.
    pub fn build_chain(&self, config: &Config, env: &Environment) -> Result<ResolverChain> {
        let ctx = ResolverContext::new(config, env);
        let listed = config.resolvers.as_deref();
        let order: Vec<&str> = match listed {
            Some(list) => list.iter().map(|s| s.trim()).collect(),
            None => DEFAULT_RESOLVER_ORDER.to_vec(),
        };
        let known = self.known_names();
        let mut chain = ResolverChain::new();
        for (i, name) in order.iter().enumerate() {
            if order[..i].contains(name) {
                return Err(config.field_error("resolvers", &format!("lists {name:?} twice")));
            }
            match self.get(name) {
                Some(f) => {
                    let link = f.create(&ctx).map_err(|e| {
                        Error::new(e.kind(), format!("resolver `{name}`: {}", e.message())).with_source(e)
                    })?;
                    chain = chain.with(link);
                }
                None if !known.contains(name) => {
                    return Err(config.field_error(
                        "resolvers",
                        &format!("unknown resolver {name:?}; known resolvers: {}", known.join(", ")),
                    ));
                }
                None if listed.is_some() => {
                    let hint = if *name == ACL_RESOLVER {
                        " (it is provided by the HCCL transport, crate ferry-transport-hccl)"
                    } else {
                        ""
                    };
                    return Err(config.field_error(
                        "resolvers",
                        &format!(
                            "resolver {name:?} is not available in this build{hint}; available: {}",
                            self.names().join(", ")
                        ),
                    ));
                }
                None => chain.note_skipped(name),
            }
        }
        Ok(chain)
    }
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    use super::*;
    use crate::resolver::{Identity, IdentityField, ResolveQuery};

    struct Acl;
    #[async_trait]
    impl SegmentResolver for Acl {
        fn name(&self) -> &str {
            ACL_RESOLVER
        }
        async fn resolve(&self, _: &ResolveQuery, known: &Identity) -> Result<Identity> {
            Ok(Identity { physical_device: Some(known.user_device.unwrap_or(0) + 10), ..Identity::default() })
        }
    }
    struct AclFactory;
    impl ResolverFactory for AclFactory {
        fn name(&self) -> &str {
            ACL_RESOLVER
        }
        fn create(&self, _: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
            Ok(Arc::new(Acl))
        }
    }

    #[test]
    fn default_order_skips_what_this_build_lacks() {
        let chain = ResolverRegistry::with_builtin().build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), vec!["config", "hostname", "rank_table", "env", "hccn_conf", "port_offset"]);
        assert_eq!(chain.skipped(), ["acl"]);
        let with_acl = ResolverRegistry::with_builtin().with(Arc::new(AclFactory));
        let chain = with_acl.build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), DEFAULT_RESOLVER_ORDER.to_vec(), "an installed acl takes its place by name");
        assert!(chain.skipped().is_empty());
    }

    #[tokio::test]
    async fn a_config_list_reorders_and_an_outside_link_is_consulted_in_its_place() {
        let c = Config::from_json_str(r#"{"resolvers": ["acl", "env"]}"#, None).unwrap();
        let reg = ResolverRegistry::with_builtin().with(Arc::new(AclFactory));
        let chain = reg.build_chain(&c, &Environment::from_pairs([("ASCEND_RT_VISIBLE_DEVICES", "4,10")])).unwrap();
        assert_eq!(chain.names(), vec!["acl", "env"]);
        let r = chain.resolve(&ResolveQuery::local(None, Some(0))).await.unwrap();
        assert_eq!(r.identity.physical_device, Some(10));
        assert_eq!(r.answer(IdentityField::PhysicalDevice).unwrap().resolver, "acl");
        // env, consulted after it, places acl's card in its list: user device 1 (not rank 0).
        assert_eq!(r.identity.user_device, Some(1));
        assert_eq!(r.answer(IdentityField::UserDevice).unwrap().resolver, "env");
        assert!(r.disagreements.is_empty(), "{r}");
    }

    #[test]
    fn bad_lists_are_config_errors_naming_the_field_and_known_names() {
        let reg = ResolverRegistry::with_builtin();
        let e = reg
            .build_chain(
                &Config::from_json_str("{\n \"resolvers\": [\"hostname\", \"dns\"]}", Some("/m.json".as_ref()))
                    .unwrap(),
                &Environment::empty(),
            )
            .unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        let m = e.message();
        assert!(
            m.contains("/m.json") && m.contains("`resolvers` at line 2") && m.contains("unknown resolver \"dns\""),
            "{m}"
        );
        assert!(m.contains("config, hostname, rank_table, env, acl, hccn_conf, port_offset"), "{m}");
        let e = reg.build_chain(
            &Config::from_json_str(r#"{"resolvers": ["env", "env"]}"#, None).unwrap(),
            &Environment::empty(),
        );
        assert!(e.unwrap_err().message().contains("lists \"env\" twice"));
        let e =
            reg.build_chain(&Config::from_json_str(r#"{"resolvers": ["acl"]}"#, None).unwrap(), &Environment::empty());
        let m = e.unwrap_err().message().to_owned();
        assert!(m.contains("\"acl\" is not available in this build") && m.contains("ferry-transport-hccl"), "{m}");
        let mut c = Config::default();
        c.apply_env(|k| (k == "FERRY_RESOLVERS").then(|| "env,nope".to_owned())).unwrap();
        let e = reg.build_chain(&c, &Environment::empty()).unwrap_err();
        assert!(e.message().contains("FERRY_RESOLVERS") && e.message().contains("\"nope\""), "{e}");
    }
}

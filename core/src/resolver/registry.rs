//! Resolvers by name: the [`ResolverRegistry`] that builds a [`ResolverChain`] from a config.
//!
//! The registry holds the factories and the *default order*: the names a chain is built from
//! when the config has no `resolvers` list. The core's registry
//! ([`with_builtin`](ResolverRegistry::with_builtin)) orders its own links as
//! [`BUILTIN_RESOLVER_ORDER`]; a crate that brings links places their names in that order
//! ([`place_in_default_order`](ResolverRegistry::place_in_default_order)), possibly with names
//! another crate provides (such a name, when nothing installs it, is skipped by the default
//! order and reported by [`ResolverChain::skipped`]; listed explicitly it is an error saying
//! which crate provides it).

use std::fmt;
use std::sync::Arc;

use super::{Environment, ExplicitResolver, HostnameResolver, PortOffsetResolver, ResolverChain, SegmentResolver};
use crate::config::Config;
use crate::error::{Error, Result};

/// The default order of the core's own links (see the [module docs](super) for what each
/// answers). Crates outside the core place theirs between them.
pub const BUILTIN_RESOLVER_ORDER: [&str; 3] = ["config", "hostname", "port_offset"];

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

/// Creates one named link of a chain. Crates outside the core (a transport's device-identity
/// links) install theirs in a [`ResolverRegistry`]; the link then takes its name's place in the
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

/// One name of the default order.
#[derive(Debug, Clone)]
struct OrderEntry {
    name: String,
    /// Who provides the link when this registry may lack it (for the error of a list naming it).
    provided_by: Option<String>,
}

/// Resolver factories by name, and the default order of a chain.
#[derive(Clone, Default)]
pub struct ResolverRegistry {
    factories: Vec<Arc<dyn ResolverFactory>>,
    order: Vec<OrderEntry>,
}

impl fmt::Debug for ResolverRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolverRegistry")
            .field("installed", &self.names())
            .field("default_order", &self.default_order())
            .finish()
    }
}

impl ResolverRegistry {
    /// An empty registry (no factories, an empty default order).
    pub fn new() -> Self {
        Self::default()
    }

    /// The resolvers of `ferry-core`, `config`, `hostname` and `port_offset`, in that default
    /// order ([`BUILTIN_RESOLVER_ORDER`]).
    pub fn with_builtin() -> Self {
        let builtins: [Builtin; 3] = [
            Builtin("config", |c| Ok(Arc::new(ExplicitResolver::from_config(c.config)))),
            Builtin("hostname", |_| Ok(Arc::new(HostnameResolver))),
            Builtin("port_offset", |c| Ok(Arc::new(PortOffsetResolver::from_config(c.config)))),
        ];
        let mut r = Self::new();
        for b in builtins {
            r.place_in_default_order(b.0, None, None);
            r.install(Arc::new(b));
        }
        r
    }

    /// Installs `factory`, replacing one of the same name. It is consulted by default only if
    /// its name is in the default order ([`place_in_default_order`](Self::place_in_default_order));
    /// a config's `resolvers` list may name it either way.
    pub fn install(&mut self, factory: Arc<dyn ResolverFactory>) {
        self.factories.retain(|f| f.name() != factory.name());
        self.factories.push(factory);
    }

    /// [`install`](Self::install), builder style.
    pub fn with(mut self, factory: Arc<dyn ResolverFactory>) -> Self {
        self.install(factory);
        self
    }

    /// Puts `name` in the default order just before `before` (at the end when `before` is
    /// `None` or not in the order). A name already in the order keeps its place. `provided_by`
    /// names the crate that provides the link when it may be missing from this registry
    /// (shown when a config lists it and nothing installed it).
    pub fn place_in_default_order(&mut self, name: &str, before: Option<&str>, provided_by: Option<&str>) {
        if let Some(e) = self.order.iter_mut().find(|e| e.name == name) {
            if e.provided_by.is_none() {
                e.provided_by = provided_by.map(str::to_owned);
            }
            return;
        }
        let entry = OrderEntry { name: name.to_owned(), provided_by: provided_by.map(str::to_owned) };
        match before.and_then(|b| self.order.iter().position(|e| e.name == b)) {
            Some(i) => self.order.insert(i, entry),
            None => self.order.push(entry),
        }
    }

    /// The default order: the names a chain is built from when the config lists none.
    pub fn default_order(&self) -> Vec<&str> {
        self.order.iter().map(|e| e.name.as_str()).collect()
    }

    /// Names installed, in installation order.
    pub fn names(&self) -> Vec<&str> {
        self.factories.iter().map(|f| f.name()).collect()
    }

    /// Every name a config may list: the default order, then other installed names.
    pub fn known_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.default_order();
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
    /// the [default order](Self::default_order), where names nothing provides in this build
    /// are skipped (and reported by [`ResolverChain::skipped`]). A listed name that is unknown,
    /// repeated, or not provided in this build is a config error naming the field and the known
    /// names.
    pub fn build_chain(&self, config: &Config, env: &Environment) -> Result<ResolverChain> {
        let ctx = ResolverContext::new(config, env);
        let listed = config.resolvers.as_deref();
        let order: Vec<&str> = match listed {
            Some(list) => list.iter().map(|s| s.trim()).collect(),
            None => self.default_order(),
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
                    let hint = match self.order.iter().find(|e| e.name == *name).and_then(|e| e.provided_by.as_deref())
                    {
                        Some(by) => format!(" (it is provided by {by})"),
                        None => String::new(),
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

    /// A link an outside crate provides: answers the physical device `known.user_device + 10`.
    struct Runtime;
    #[async_trait]
    impl SegmentResolver for Runtime {
        fn name(&self) -> &str {
            "runtime"
        }
        async fn resolve(&self, _: &ResolveQuery, known: &Identity) -> Result<Identity> {
            Ok(Identity { physical_device: Some(known.user_device.unwrap_or(0) + 10), ..Identity::default() })
        }
    }
    struct RuntimeFactory;
    impl ResolverFactory for RuntimeFactory {
        fn name(&self) -> &str {
            "runtime"
        }
        fn create(&self, _: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
            Ok(Arc::new(Runtime))
        }
    }

    /// The core's links with `runtime` placed before `port_offset`, provided elsewhere.
    fn placed() -> ResolverRegistry {
        let mut r = ResolverRegistry::with_builtin();
        r.place_in_default_order("runtime", Some("port_offset"), Some("crate ferry-runtime"));
        r
    }

    #[test]
    fn the_default_order_is_composed_and_skips_what_this_build_lacks() {
        let core = ResolverRegistry::with_builtin();
        assert_eq!(core.default_order(), BUILTIN_RESOLVER_ORDER.to_vec());
        let chain = core.build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), BUILTIN_RESOLVER_ORDER.to_vec());
        let chain = placed().build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), vec!["config", "hostname", "port_offset"]);
        assert_eq!(chain.skipped(), ["runtime"]);
        let with = placed().with(Arc::new(RuntimeFactory));
        let chain = with.build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), vec!["config", "hostname", "runtime", "port_offset"], "installed: in its place");
        assert!(chain.skipped().is_empty());
        // Placing is idempotent and anchors fall back to the end.
        let mut r = placed();
        r.place_in_default_order("runtime", None, None);
        r.place_in_default_order("extra", Some("nope"), None);
        r.place_in_default_order("first", Some("config"), None);
        assert_eq!(r.default_order(), vec!["first", "config", "hostname", "runtime", "port_offset", "extra"]);
        // An installed factory outside the order is known but consulted only when listed.
        let r = ResolverRegistry::with_builtin().with(Arc::new(RuntimeFactory));
        assert_eq!(r.known_names(), vec!["config", "hostname", "port_offset", "runtime"]);
        let chain = r.build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), BUILTIN_RESOLVER_ORDER.to_vec());
    }

    #[tokio::test]
    async fn a_config_list_reorders_and_an_outside_link_is_consulted_in_its_place() {
        let c = Config::from_json_str(r#"{"resolvers": ["runtime", "hostname"]}"#, None).unwrap();
        let reg = placed().with(Arc::new(RuntimeFactory));
        let chain = reg.build_chain(&c, &Environment::empty()).unwrap();
        assert_eq!(chain.names(), vec!["runtime", "hostname"]);
        let r = chain.resolve(&ResolveQuery::local(Some("h:1:npu_3".into()), Some(0))).await.unwrap();
        assert_eq!(r.identity.physical_device, Some(10));
        assert_eq!(r.answer(IdentityField::PhysicalDevice).unwrap().resolver, "runtime");
        assert_eq!(r.disagreements.len(), 1, "{r}");
    }

    #[test]
    fn bad_lists_are_config_errors_naming_the_field_and_known_names() {
        let reg = placed();
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
        assert!(m.contains("known resolvers: config, hostname, runtime, port_offset"), "{m}");
        let e = reg.build_chain(
            &Config::from_json_str(r#"{"resolvers": ["hostname", "hostname"]}"#, None).unwrap(),
            &Environment::empty(),
        );
        assert!(e.unwrap_err().message().contains("lists \"hostname\" twice"));
        let e = reg
            .build_chain(&Config::from_json_str(r#"{"resolvers": ["runtime"]}"#, None).unwrap(), &Environment::empty());
        let m = e.unwrap_err().message().to_owned();
        assert!(
            m.contains("\"runtime\" is not available in this build (it is provided by crate ferry-runtime)"),
            "{m}"
        );
        let mut c = Config::default();
        c.apply_env(|k| (k == "FERRY_RESOLVERS").then(|| "hostname,nope".to_owned())).unwrap();
        let e = reg.build_chain(&c, &Environment::empty()).unwrap_err();
        assert!(e.message().contains("FERRY_RESOLVERS") && e.message().contains("\"nope\""), "{e}");
    }
}

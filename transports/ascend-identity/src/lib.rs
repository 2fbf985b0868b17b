//! # ferry-ascend-identity
//!
//! Where an Ascend NPU process's device identity comes from, without FFI: the resolver links
//! that read Ascend's own sources, and the config options of the Ascend side. The core keeps
//! the [`SegmentResolver`] trait, the chain and the generic links
//! (`config`, `hostname`, `port_offset`); this crate adds:
//!
//! | link | answers | from |
//! |---|---|---|
//! | `rank_table` ([`RankTableResolver`]) | physical device, device IP, device port, rank | an HCCL v1.0/v1.2 or vllm-ascend prefill/decode rank table |
//! | `env` ([`EnvResolver`]) | physical device, user device | `ASCEND_NPU_PHY_ID`, `PHYSICAL_DEVICES`, `ASCEND_RT_VISIBLE_DEVICES` |
//! | `hccn_conf` ([`HccnConfResolver`]) | device IP | `/etc/hccn.conf` (`address_<phy>=<ip>`) |
//!
//! [`install`] puts their factories in a [`ResolverRegistry`] and their names in its default
//! order, which becomes `config, hostname, rank_table, env, acl, hccn_conf, port_offset`. The
//! `acl` link (the ACL runtime's user → physical device query) needs the CANN libraries, so it
//! lives in the Ascend transport's crate, `ferry-transport-hccl`; this crate only gives it its
//! place in the order (skipped, and reported, in builds without it).
//!
//! The options ([`options`]): `rank_table_path` (`FERRY_RANK_TABLE`), `hccn_conf_path`
//! (`FERRY_HCCN_CONF`), `hccl_retries` (`FERRY_HCCL_RETRIES`, Mooncake's
//! `ASCEND_TRANSPORT_TRANSFER_MAX_RETRY_COUNT`), `hccl_control_port`
//! (`FERRY_HCCL_CONTROL_PORT`) and `hccl_bind_address` (`FERRY_HCCL_BIND_ADDRESS`), read from the config's unknown fields and the environment with
//! their sources ([`AscendOptions`]).
//!
//! No link guesses: a source that is present but wrong is an error naming it (file and JSON
//! path, variable and value) and what was expected; no link falls back to device 0.
#![forbid(unsafe_code)]

use std::sync::Arc;

use ferry_core::{ResolverContext, ResolverFactory, ResolverRegistry, Result, SegmentResolver};

pub mod env;
pub mod hccn;
pub mod options;
pub mod rank_table;

pub use env::{
    DEVICE_ID_LIMIT, EnvResolver, NPU_PHY_ID_ENV, PHYSICAL_DEVICES_ENV, VISIBLE_DEVICES_ENV, VisibleDevices,
    VisibleDevicesProblem, VisibleEntryProblem, parse_device_list, parse_visible_devices,
};
pub use hccn::{
    DEFAULT_HCCN_CONF, DEFAULT_HCCN_TOOL, HCCN_TOOL_ENV, HccnAddress, HccnConfResolver, find_hccn_tool,
    parse_hccn_conf, parse_hccn_conf_v6,
};
pub use options::{
    ASCEND_BACKEND, AscendBackend, AscendOptions, HCCL_BIND_ADDRESS, HCCL_CONTROL_PORT, HCCL_RETRIES, HCCN_CONF_PATH,
    OPTIONS, RANK_TABLE_PATH, RETRIES_ENV,
};
pub use rank_table::{
    DisaggregatedDevice, DisaggregatedRankTable, HcclDevice, HcclRankTable, HcclServer, RANK_TABLE_ENV, RankEntry,
    RankTable, RankTableResolver,
};

/// Name of the rank-table link.
pub const RANK_TABLE_RESOLVER: &str = "rank_table";
/// Name of the environment link.
pub const ENV_RESOLVER: &str = "env";
/// Name of the ACL-query link, provided by `ferry-transport-hccl` (it needs the CANN runtime).
pub const ACL_RESOLVER: &str = "acl";
/// Name of the `hccn.conf` link.
pub const HCCN_CONF_RESOLVER: &str = "hccn_conf";

/// Who provides the `acl` link, for the error of a `resolvers` list naming it in a build
/// without it.
const ACL_PROVIDER: &str = "the HCCL transport, crate ferry-transport-hccl";

/// Installs the `rank_table`, `env` and `hccn_conf` factories in `registry` and places them, and
/// `acl`, in its default order before `port_offset`: with the core's links the order is
/// `config, hostname, rank_table, env, acl, hccn_conf, port_offset`.
pub fn install(registry: &mut ResolverRegistry) {
    for (name, provided_by) in [
        (RANK_TABLE_RESOLVER, None),
        (ENV_RESOLVER, None),
        (ACL_RESOLVER, Some(ACL_PROVIDER)),
        (HCCN_CONF_RESOLVER, None),
    ] {
        registry.place_in_default_order(name, Some("port_offset"), provided_by);
    }
    registry.install(Arc::new(RankTableResolverFactory));
    registry.install(Arc::new(EnvResolverFactory));
    registry.install(Arc::new(HccnConfResolverFactory));
}

/// The core's links plus this crate's ([`install`]).
pub fn registry() -> ResolverRegistry {
    let mut r = ResolverRegistry::with_builtin();
    install(&mut r);
    r
}

/// Creates the `rank_table` link from the config (`rank_table_path`, `role`, the host) and the
/// resolver environment ([`RankTableResolver::from_config`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct RankTableResolverFactory;

impl ResolverFactory for RankTableResolverFactory {
    fn name(&self) -> &str {
        RANK_TABLE_RESOLVER
    }

    fn create(&self, ctx: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
        Ok(Arc::new(RankTableResolver::from_config(ctx.config, ctx.env)?))
    }
}

/// Creates the `env` link on the resolver environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct EnvResolverFactory;

impl ResolverFactory for EnvResolverFactory {
    fn name(&self) -> &str {
        ENV_RESOLVER
    }

    fn create(&self, ctx: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
        Ok(Arc::new(EnvResolver::new(ctx.env.clone())))
    }
}

/// Creates the `hccn_conf` link: the file `hccn_conf_path` (or `FERRY_HCCN_CONF`) names, which
/// must exist, else `/etc/hccn.conf`, skipped when absent.
#[derive(Debug, Clone, Copy, Default)]
pub struct HccnConfResolverFactory;

impl ResolverFactory for HccnConfResolverFactory {
    fn name(&self) -> &str {
        HCCN_CONF_RESOLVER
    }

    fn create(&self, ctx: &ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
        Ok(Arc::new(match AscendOptions::hccn_conf_path(ctx.config, ctx.env)? {
            Some(p) => {
                let by = p.describe(&HCCN_CONF_PATH);
                HccnConfResolver::at(p.value, by)
            }
            None => HccnConfResolver::new().with_tool(hccn::find_hccn_tool(|k| ctx.env.get(k))),
        }))
    }
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;
    use ferry_core::{Config, Environment, ErrorKind, Identity, IdentityField, Resolution, ResolveQuery};

    use super::*;

    /// The chain of the core's links and this crate's for `config` (JSON) and `env`, resolved
    /// for local rank `rank`.
    async fn chain(config: &str, env: &[(&str, &str)], rank: Option<u32>) -> Result<Resolution> {
        let mut config = Config::from_json_str(config, None).unwrap();
        if let Some(r) = rank {
            config.set_local_rank(r);
        }
        let env = Environment::from_pairs(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let chain = registry().build_chain(&config, &env)?;
        chain.resolve(&ResolveQuery::local(config.local_segment_name()?, rank)).await
    }

    #[tokio::test]
    async fn a_rank_table_card_with_every_card_visible_is_bound_by_its_position() {
        // The reviewer's case: decode worker 0 of a 4+4 node, every card visible, the rank table
        // gives physical card 4. The user device must be 4 (card 4), not the local rank's 0.
        let dir = std::env::temp_dir().join(format!("ferry-chain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let table = dir.join("pd.json");
        std::fs::write(
            &table,
            r#"{"version":"1.2","server_count":"1","status":"completed",
              "prefill_device_list":[{"server_id":"10.0.0.5","device_id":"0","device_ip":"29.0.0.1"},
                                     {"server_id":"10.0.0.5","device_id":"1","device_ip":"29.0.0.2"}],
              "decode_device_list":[{"server_id":"10.0.0.5","device_id":"4","device_ip":"29.0.0.5"},
                                    {"server_id":"10.0.0.5","device_id":"5","device_ip":"29.0.0.6"}]}"#,
        )
        .unwrap();
        let config = format!(
            r#"{{"local_hostname": "10.0.0.5", "role": "decode", "base_port": 17100, "rank_table_path": {:?}}}"#,
            table.display().to_string()
        );
        let all = [(VISIBLE_DEVICES_ENV, "0,1,2,3,4,5,6,7")];
        let r = chain(&config, &all, Some(0)).await.unwrap();
        assert_eq!((r.identity.physical_device, r.identity.user_device), (Some(4), Some(4)), "{r}");
        assert_eq!(r.answer(IdentityField::PhysicalDevice).unwrap().resolver, "rank_table");
        assert_eq!(r.answer(IdentityField::UserDevice).unwrap().resolver, "env");
        assert!(r.disagreements.is_empty(), "{r}");
        r.refuse_device_disagreements().unwrap();
        let r = chain(&config, &all, Some(1)).await.unwrap();
        assert_eq!((r.identity.physical_device, r.identity.user_device), (Some(5), Some(5)), "{r}");
        // The decode instance that sees only its own cards: user devices 0 and 1.
        let own = [(VISIBLE_DEVICES_ENV, "4,5,6,7")];
        let r = chain(&config, &own, Some(1)).await.unwrap();
        assert_eq!((r.identity.physical_device, r.identity.user_device), (Some(5), Some(1)), "{r}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_card_named_in_the_segment_name_is_found_among_the_visible_ones() {
        // The container case: cards 4 and 5 visible; the segment name says card 5, so the user
        // device is 1, even for local rank 0.
        let config = r#"{"local_hostname": "10.0.0.5:17000:npu_5"}"#;
        let r = chain(config, &[(VISIBLE_DEVICES_ENV, "4,5")], Some(0)).await.unwrap();
        assert_eq!((r.identity.physical_device, r.identity.user_device), (Some(5), Some(1)), "{r}");
        assert_eq!(r.answer(IdentityField::PhysicalDevice).unwrap().resolver, "hostname");
        r.refuse_device_disagreements().unwrap();
        // A card the list does not name: the list holds logical ids (a container's may be
        // anything), so the `env` link leaves the user device to the `acl` link (the ACL runtime
        // maps it); without ACL it stays unknown rather than guessed.
        let r = chain(r#"{"local_hostname": "10.0.0.5:17000:npu_6"}"#, &[(VISIBLE_DEVICES_ENV, "4,5")], Some(0))
            .await
            .unwrap();
        assert_eq!((r.identity.physical_device, r.identity.user_device), (Some(6), None), "{r}");
    }

    #[tokio::test]
    async fn a_real_disagreement_about_the_device_is_refused_with_both_answers() {
        let config = r#"{"local_hostname": "10.0.0.5:17000:npu_3"}"#;
        let r = chain(config, &[(NPU_PHY_ID_ENV, "2")], Some(0)).await.unwrap();
        assert_eq!(r.identity.physical_device, Some(3), "the first answer is kept ...");
        let e = r.refuse_device_disagreements().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let m = e.message();
        assert!(
            m.contains(
                "physical_device: `hostname` says 3 (`npu_3` in segment name \"10.0.0.5:17000:npu_3\"), but \
                        `env` says 2 (ASCEND_NPU_PHY_ID=\"2\")"
            ),
            "... but refused: {m}"
        );
    }

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

    const ORDER: [&str; 7] = ["config", "hostname", "rank_table", "env", "acl", "hccn_conf", "port_offset"];

    #[test]
    fn the_default_order_is_kept_and_skips_acl_without_the_transport() {
        assert_eq!(registry().default_order(), ORDER.to_vec());
        let chain = registry().build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), vec!["config", "hostname", "rank_table", "env", "hccn_conf", "port_offset"]);
        assert_eq!(chain.skipped(), ["acl"]);
        let with_acl = registry().with(Arc::new(AclFactory));
        let chain = with_acl.build_chain(&Config::default(), &Environment::empty()).unwrap();
        assert_eq!(chain.names(), ORDER.to_vec(), "an installed acl takes its place by name");
        assert!(chain.skipped().is_empty());
        // Installing twice changes nothing.
        let mut twice = registry();
        install(&mut twice);
        assert_eq!(twice.default_order(), ORDER.to_vec());
        assert_eq!(twice.names().len(), 6);
    }

    #[tokio::test]
    async fn a_config_list_reorders_and_an_outside_link_is_consulted_in_its_place() {
        let c = Config::from_json_str(r#"{"resolvers": ["acl", "env"]}"#, None).unwrap();
        let reg = registry().with(Arc::new(AclFactory));
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
    fn bad_lists_name_the_known_names_and_who_provides_acl() {
        let reg = registry();
        let c = Config::from_json_str("{\n \"resolvers\": [\"hostname\", \"dns\"]}", Some("/m.json".as_ref())).unwrap();
        let m = reg.build_chain(&c, &Environment::empty()).unwrap_err().message().to_owned();
        assert!(m.contains("known resolvers: config, hostname, rank_table, env, acl, hccn_conf, port_offset"), "{m}");
        let c = Config::from_json_str(r#"{"resolvers": ["acl"]}"#, None).unwrap();
        let m = reg.build_chain(&c, &Environment::empty()).unwrap_err().message().to_owned();
        assert!(
            m.contains("\"acl\" is not available in this build (it is provided by the HCCL transport, crate ferry-transport-hccl)"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn the_factories_read_the_options_and_name_their_source() {
        let dir = std::env::temp_dir().join(format!("ferry-factories-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hccn.conf"), "address_4=29.0.0.5\n").unwrap();
        let text = r#"{"local_hostname": "10.0.0.5:17000:npu_4", "hccn_conf_path": "hccn.conf"}"#;
        let c = Config::from_json_str(text, Some(&dir.join("m.json"))).unwrap();
        let r = registry().build_chain(&c, &Environment::empty()).unwrap();
        let res = r.resolve(&ResolveQuery::local(c.local_segment_name().unwrap(), None)).await.unwrap();
        assert_eq!(res.identity.device_ip.as_deref(), Some("29.0.0.5"), "relative to the config file: {res}");
        // A configured file that is missing names who configured it.
        let missing = Environment::from_pairs([("FERRY_HCCN_CONF", "/nonexistent/hccn.conf")]);
        let r = registry().build_chain(&c, &missing).unwrap();
        let e = r.resolve(&ResolveQuery::local(c.local_segment_name().unwrap(), None)).await.unwrap_err();
        assert!(e.message().contains("(set by environment variable FERRY_HCCN_CONF) cannot be read"), "{e}");
        // A path of the wrong type fails the chain's construction, naming the link and field.
        let bad = Config::from_json_str(r#"{"rank_table_path": ["x"]}"#, None).unwrap();
        let e = registry().build_chain(&bad, &Environment::empty()).unwrap_err();
        let m = e.message();
        assert!(m.starts_with("resolver `rank_table`: config inline config: field `rank_table_path` at line 1"), "{m}");
        assert!(m.contains("expected a string"), "{m}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! # Ferry
//!
//! Ferry moves KV cache (and any registered memory) between processes and machines for
//! prefill/decode-disaggregated LLM serving. It speaks Mooncake Transfer Engine's formats, so a
//! Ferry node can share a metadata service with Mooncake nodes.
//!
//! This is the facade crate: the one dependency a user adds. It re-exports the engine from
//! `ferry-core` and, behind features, each transport:
//!
//! | feature | transport | default |
//! |---|---|---|
//! | `local` | same-process memcpy (`local`) | yes |
//! | `null`  | no-op, for measuring engine overhead (`null`) | no |
//! | `tcp`   | Mooncake-compatible TCP (`tcp`) | yes |
//! | `hccl`  | Ascend NPUs (`ascend`; `hccl` direct HCCL alone; CANN loaded at run time) and the Ascend identity resolvers (`rank_table`, `env`, `acl`, `hccn_conf`) | yes |
//! | `hixl`  | the Ascend transport's HIXL backend (`hixl`, `ascend_direct`; Mooncake `ascend_direct` interop; built with the system `c++`) | yes |
//! | `mock`  | a scriptable transport for unit tests of code built on Ferry (`mock`; see `docs/testing.md`) | no |
//! | `p2p`   | P2P handshake metadata (`P2PHANDSHAKE`), and the handshake listener beside every other metadata store (notifications, probes) | yes |
//! | `http`  | HTTP metadata client (`http://host:port/metadata`) | yes |
//! | `redis` | Redis metadata (`redis://host:port`) | yes |
//! | `etcd`  | etcd metadata (`etcd://h1:2379,h2:2379`; building it needs `protoc`) | no |
//! | `plugins` | transports loaded at run time from `libferry_transport_<protocol>.so` | yes |
//!
//! ```
//! use ferry::{BlockTransfer, KvLayout, Location};
//!
//! # fn main() -> ferry::Result<()> {
//! // Two engines on the embedded default (in-process metadata, `local` transport).
//! let prefill = ferry::builder().build_blocking()?;
//! let decode = ferry::builder().build_blocking()?;
//!
//! // A KV cache of 8 blocks of 64 bytes on each side, registered once.
//! let mut src = vec![7u8; 8 * 64];
//! let mut dst = vec![0u8; 8 * 64];
//! let (src_addr, dst_addr) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
//! // SAFETY: both vectors outlive the engines' use of them, and are read only after the
//! // transfer completed.
//! unsafe { prefill.register_memory_blocking(src_addr, src.len() as u64, Location::Cpu(0)) }?;
//! // SAFETY: as above.
//! unsafe { decode.register_memory_blocking(dst_addr, dst.len() as u64, Location::Cpu(0)) }?;
//! let local = decode.register_kv_layout(KvLayout::uniform(&[dst_addr], 8, 64))?;
//! let remote = KvLayout::uniform(&[src_addr], 8, 64);
//!
//! // Decode pulls prefill's blocks 2 and 3 into its blocks 0 and 1 (one merged request).
//! let peer = decode.open_segment_blocking(prefill.segment_name())?;
//! let spec = BlockTransfer::read(&[0, 1], &[2, 3]);
//! let batch = decode.submit_blocks_blocking(local, peer, &remote, &spec)?;
//! batch.wait_blocking(decode.transfer_timeout())?;
//! assert_eq!(batch.runs().len(), 1);
//! assert!(dst[..128].iter().all(|&b| b == 7) && dst[128..].iter().all(|&b| b == 0));
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub use ferry_core::*;

/// The transport crates compiled into this build.
pub mod transports {
    #[cfg(feature = "hccl")]
    pub use ferry_transport_hccl as hccl;
    #[cfg(feature = "local")]
    pub use ferry_transport_local as local;
    #[cfg(feature = "mock")]
    pub use ferry_transport_mock as mock;
    #[cfg(feature = "null")]
    pub use ferry_transport_null as null;
    #[cfg(feature = "tcp")]
    pub use ferry_transport_tcp as tcp;
}

/// The Prometheus endpoint (`metrics_addr`) and the text it serves.
#[cfg(feature = "metrics")]
pub use ferry_metrics as metrics_endpoint;

/// The metadata backend crates compiled into this build.
pub mod metadata_backends {
    #[cfg(feature = "http")]
    pub use ferry_metadata_http as http;
    #[cfg(feature = "p2p")]
    pub use ferry_metadata_p2p as p2p;
}

/// A transport registry holding every transport compiled in and, with the `plugins` feature,
/// the plugin loader (protocols not built in are looked up in the config's `plugins` list and
/// `FERRY_PLUGIN_DIR`).
pub fn default_transports() -> TransportRegistry {
    #[allow(unused_mut)]
    let mut registry = TransportRegistry::new();
    #[cfg(feature = "local")]
    registry.install(std::sync::Arc::new(ferry_transport_local::LocalTransportFactory));
    #[cfg(feature = "null")]
    registry.install(std::sync::Arc::new(ferry_transport_null::NullTransportFactory));
    #[cfg(feature = "tcp")]
    registry.install(std::sync::Arc::new(ferry_transport_tcp::TcpTransportFactory));
    #[cfg(feature = "hccl")]
    registry.install(std::sync::Arc::new(ferry_transport_hccl::HcclTransportFactory::new()));
    #[cfg(feature = "plugins")]
    registry.add_source(std::sync::Arc::new(ferry_plugin_host::PluginSource));
    registry
}

/// A metadata registry holding every metadata store compiled in (the embedded in-process store
/// is always available) and, with the `p2p` feature, Mooncake's handshake listener as the
/// control channel started beside every store that is not a channel itself (as Mooncake
/// engines on a store run one), so notifications and probes work on every store. Without it,
/// they answer `Unsupported`.
pub fn default_metadata() -> MetadataRegistry {
    #[allow(unused_mut)]
    let mut registry = MetadataRegistry::new();
    #[cfg(feature = "p2p")]
    {
        registry.install(std::sync::Arc::new(ferry_metadata_p2p::P2pMetadataFactory));
        registry.install_channel(std::sync::Arc::new(ferry_metadata_p2p::HandshakeChannelFactory));
    }
    #[cfg(feature = "http")]
    registry.install(std::sync::Arc::new(ferry_metadata_http::HttpMetadataFactory));
    #[cfg(feature = "redis")]
    registry.install(std::sync::Arc::new(ferry_metadata_redis::RedisMetadataFactory));
    #[cfg(feature = "etcd")]
    registry.install(std::sync::Arc::new(ferry_metadata_etcd::EtcdMetadataFactory));
    registry
}

/// The resolvers an engine's chain is built from: the core's links (`config`, `hostname`,
/// `port_offset`) and, with the `hccl` feature, the Ascend links (`rank_table`, `env`, `acl`,
/// `hccn_conf`), in the default order `config, hostname, rank_table, env, acl, hccn_conf,
/// port_offset`.
pub fn default_resolvers() -> ResolverRegistry {
    #[allow(unused_mut)]
    let mut registry = ResolverRegistry::with_builtin();
    #[cfg(feature = "hccl")]
    ferry_transport_hccl::install_resolvers(&mut registry);
    registry
}

/// The config options the transports and metadata backends compiled in declare beyond the
/// core's fields ([`TransportFactory::options`] of each of [`default_transports`]; with the
/// `tcp` feature `tcp_lanes`, `tcp_data_port`, `tcp_io_threads`, with `hccl` the Ascend side's
/// `rank_table_path`, `hccn_conf_path`, `hccl_retries`, `hccl_control_port`, `ascend_backend`;
/// then [`MetadataRegistry::options`] of [`default_metadata`]: with `p2p`
/// `handshake_timeout_ms`, with `http` `metadata_token_file`; with `tcp` or `p2p` peer
/// authentication's `auth_secret`, `auth_secret_file`). A config's other unknown fields
/// are read by nothing in this build ([`Config::undeclared_fields`],
/// [`Config::unknown_field_warnings`]).
pub fn declared_options() -> Vec<&'static OptionSpec> {
    let mut options = default_transports().options();
    for spec in default_metadata().options() {
        if !options.iter().any(|o| o.key == spec.key) {
            options.push(spec);
        }
    }
    options
}

/// An engine builder on the embedded default config with every compiled-in transport, metadata
/// store and control channel available. Replace the config with `.config(Config::discover()?)` to
/// honour `MOONCAKE_CONFIG_PATH` and the environment overrides.
///
/// With the `metrics` feature (default) it also starts the engine's Prometheus endpoint when
/// its config has `metrics_addr` (`FERRY_METRICS_ADDR`; see docs/metrics.md).
pub fn builder() -> EngineBuilder {
    let builder = EngineBuilder::new()
        .transports(default_transports())
        .metadata_registry(default_metadata())
        .resolver_registry(default_resolvers());
    #[cfg(feature = "metrics")]
    let builder = builder.service(std::sync::Arc::new(ferry_metrics::MetricsService));
    builder
}

/// README's Rust example, compiled and run as a doc test (`cargo test --doc -p ferry`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

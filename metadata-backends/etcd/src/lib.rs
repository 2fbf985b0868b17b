//! # ferry-metadata-etcd
//!
//! A [`MetadataStore`](ferry_core::MetadataStore) on etcd for `metadata_server: "etcd://h1:2379,h2:2379"` or a bare
//! `host:2379`. Every key this engine writes is attached to a lease that the backend keeps alive
//! (TTL [`LEASE_TTL_SECS`]), so a dead engine's descriptor disappears on its own; when etcd loses
//! the lease (a restart), a new one is granted and the engine re-publishes (it checks its keys
//! periodically). [`MetadataStore::watch`](ferry_core::MetadataStore::watch) streams changes under a prefix, re-subscribing after
//! etcd comes back.
//!
//! ## Features
//!
//! `client` (off by default) builds the store, `EtcdMetadata`, and its factory,
//! `EtcdMetadataFactory`, on the `etcd-client` crate, whose build script runs `protoc`
//! (Debian's `protobuf-compiler`). Without it this crate has only its constants, so that a
//! plain `cargo build --workspace` needs no system package; `ferry`'s `etcd` feature turns it on.
#![forbid(unsafe_code)]

use std::time::Duration;

/// Lease time-to-live of this engine's keys.
pub const LEASE_TTL_SECS: i64 = 10;
/// Time allowed for one request (and to connect).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(feature = "client")]
mod store;
#[cfg(feature = "client")]
pub use store::{EtcdMetadata, EtcdMetadataFactory};

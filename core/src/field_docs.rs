//! The documentation of every field the core reads, one [`FieldDoc`] per row of the
//! configuration reference: `docs/configuration.md`'s "Fields" table is generated from
//! [`CORE_FIELDS`] (the facade's `tests/docs_reference.rs` checks it and, with `FERRY_BLESS=1`,
//! rewrites it), and a unit test keeps [`CORE_FIELDS`] to exactly the fields of [`Config`].
//! The fields transports and metadata backends declare are documented by their
//! [`OptionSpec`](crate::OptionSpec)s.

#[cfg(doc)]
use crate::Config;

/// One row of the core's configuration reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldDoc {
    /// The JSON keys the row documents (two for a pair such as `prefill_url`, `decode_url`).
    pub keys: &'static [&'static str],
    /// Which config style has the field: `store` (Mooncake Store's `mooncake.json`),
    /// `connector` (the inference engines' connector config), `both`, or `Ferry` (Ferry's own).
    pub style: &'static str,
    /// What it means and which values it accepts (Markdown).
    pub meaning: &'static str,
    /// The default, in words (Markdown).
    pub default: &'static str,
}

/// Every field of [`Config`], in the order of the reference.
pub const CORE_FIELDS: &[FieldDoc] = &[
    FieldDoc {
        keys: &["local_hostname"],
        style: "store",
        meaning: "this engine's segment name, normally `host:port` (`host:port:npu_N` also encodes the physical NPU)",
        default: "connector style: the URL of `role`; embedded: `ferry-<pid>-<n>`",
    },
    FieldDoc {
        keys: &["metadata_server"],
        style: "both",
        meaning: "`P2PHANDSHAKE`, `http://host:port/metadata`, `redis://host:6379`, `etcd://h1:2379,h2:2379` or \
                  bare `host:2379` (etcd: with the `etcd` feature); empty or absent = embedded in-process store; \
                  see `metadata.md`",
        default: "embedded",
    },
    FieldDoc {
        keys: &["metadata_backend"],
        style: "connector",
        meaning: "kind of `metadata_server` when it has no scheme: `etcd`, `redis`, `http`, `p2phandshake`; must \
                  agree with a scheme if both are given",
        default: "from the scheme",
    },
    FieldDoc {
        keys: &["protocol"],
        style: "both",
        meaning: "transport: `tcp`, `local`, `null`, `ascend` (alias `hccl`: Ascend NPUs over HCCL, see \
                  docs/ascend.md), or a plugin's name",
        default: "`tcp` (Mooncake's); the embedded default uses `local`",
    },
    FieldDoc {
        keys: &["device_name"],
        style: "both",
        meaning: "NIC/device selector for the transport",
        default: "none",
    },
    FieldDoc {
        keys: &["prefill_url", "decode_url"],
        style: "connector",
        meaning: "the two roles' addresses; `role` picks which is this process's segment name",
        default: "none",
    },
    FieldDoc {
        keys: &["role"],
        style: "Ferry",
        meaning: "`prefill` or `decode` (also `kv_producer`/`kv_consumer`)",
        default: "none",
    },
    FieldDoc {
        keys: &["master_server_address"],
        style: "store",
        meaning: "Mooncake Store master; read and kept, unused by the transfer engine",
        default: "none",
    },
    FieldDoc {
        keys: &["global_segment_size", "local_buffer_size"],
        style: "store",
        meaning: "sizes: a number of bytes or a string with a binary unit (`\"4GB\"` = 4 GiB, `\"512 MiB\"`, \
                  `\"1.5gb\"`; units B, KB, MB, GB, TB); 0 to 2^64 − 1 bytes (0 is Mooncake's \"contribute no \
                  segment\")",
        default: "none",
    },
    FieldDoc {
        keys: &["transfer_timeout_ms"],
        style: "Ferry",
        meaning: "per-request deadline of the TCP and `ascend` transports; in the `ascend` transport also the \
                  timeout of each stream sync (`aclrtSynchronizeStreamWithTimeout`) and of preparing a \
                  communicator; timeout of `transfer`/`transfer_blocking` (which then cancel) and of `shutdown`'s \
                  wait for in-flight requests; upper bound of the handshake timeout; `Batch::wait` takes its own. \
                  **1 to 86400000** (1 ms to 24 h): 0 is refused rather than given a meaning, since as a deadline \
                  it fails every request before it starts, and \"no deadline\" would let a request to a peer that \
                  stopped answering, and `shutdown`, hang forever (the field is Ferry's: Mooncake has none; its \
                  `MC_TRANSFER_TIMEOUT` is mapped by the Python package, see python.md)",
        default: "30000",
    },
    FieldDoc {
        keys: &["cluster_id"],
        style: "Ferry",
        meaning: "metadata key prefix `mooncake/<id>/`",
        default: "none",
    },
    FieldDoc {
        keys: &["rpc_port"],
        style: "Ferry",
        meaning: "RPC port of the handshake listener (P2P handshake and notifications; published in the rpc entry); \
                  0 to 65535, 0 meaning a free port as when unset",
        default: "with `base_port` the rank's port, else a free one in 15000..17000 (a port in `local_hostname` is \
                  not used, as in Mooncake)",
    },
    FieldDoc {
        keys: &["base_port"],
        style: "Ferry",
        meaning: "port of local rank 0: each process listens on `base_port + local_rank`, and `local_hostname` (or \
                  the role URL) then names the host alone. A number, or one per role: `{\"prefill\": 17000, \
                  \"decode\": 17100}` (prefill and decode on one host). Each 1 to 65535 (0 would give rank 0 a \
                  random port and rank N port N), and `base_port + local_rank` at most 65535. Must not be combined \
                  with `rpc_port`, `tcp_data_port` or the Ascend transport's `hccl_control_port` (one fixed port \
                  for every rank)",
        default: "none (the name carries the port)",
    },
    FieldDoc {
        keys: &["local_rank"],
        style: "Ferry",
        meaning: "this process's local rank on its node; normally from `LOCAL_RANK`/`FERRY_LOCAL_RANK` rather than \
                  the file. 0 to 1023 (a global rank given by mistake is refused rather than turned into a port or \
                  a device)",
        default: "none",
    },
    FieldDoc {
        keys: &["resolvers"],
        style: "Ferry",
        meaning: "identity resolvers to ask, in order, e.g. `[\"rank_table\", \"env\", \"hostname\"]`; an unknown \
                  name is an error listing the known ones",
        default: "the [default order](#device-identity-the-resolver-chain)",
    },
    FieldDoc {
        keys: &["physical_devices"],
        style: "Ferry",
        meaning: "physical NPU id per local rank, e.g. `[4, 5, 6, 7]` (answered by the `config` resolver, ahead of \
                  all others); not empty, ids 0 to 63, none twice",
        default: "none",
    },
    FieldDoc {
        keys: &["plugins"],
        style: "Ferry",
        meaning: "transport plugins: a list of paths, each a `libferry_transport_<protocol>.so` file or a directory \
                  holding such files, searched in order (before `FERRY_PLUGIN_DIR`) when `protocol`, or a peer's \
                  descriptor, names a protocol that is not built in; a relative path is relative to the config \
                  file's directory (see docs/plugins.md, \"Host behaviour\"). Needs the facade's `plugins` feature \
                  (default)",
        default: "none (only `FERRY_PLUGIN_DIR` is searched)",
    },
    FieldDoc {
        keys: &["local_transport"],
        style: "Ferry",
        meaning: "the same-process shortcut: `true` installs the `local` transport beside the configured protocol \
                  and tries it first, so engines of one process reach each other by memcpy whatever their protocol; \
                  `false` leaves it out, so they talk through `protocol` as engines in two processes do (to test a \
                  plugin or the `tcp` transport in one process; see docs/plugins.md, \"Testing a plugin\"), and a \
                  peer whose only transport is `local` is refused (`Unsupported`) rather than reached. `false` with \
                  `protocol` `local` (the embedded default's) is an error naming both",
        default: "`true`",
    },
    FieldDoc {
        keys: &["metrics_addr"],
        style: "Ferry",
        meaning: "where the engine serves its counters as Prometheus text at `GET /metrics`: an IP address and port \
                  (`\"0.0.0.0:9464\"`, `\"127.0.0.1:0\"` for a free port); engines of one process naming the same \
                  address share it. Needs the facade's `metrics` feature (default); an address that cannot be bound \
                  fails the engine's build. See docs/metrics.md",
        default: "none (no endpoint; `TransferEngine::stats` still reads the counters)",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_of_the_config_has_one_row() {
        let documented: Vec<&str> = CORE_FIELDS.iter().flat_map(|row| row.keys.iter().copied()).collect();
        let mut sorted = documented.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), documented.len(), "a field has two rows: {documented:?}");
        let mut fields = crate::Config::core_fields().to_vec();
        fields.sort_unstable();
        assert_eq!(sorted, fields, "CORE_FIELDS documents exactly the fields of Config");
        for row in CORE_FIELDS {
            assert!(!row.meaning.is_empty() && !row.default.is_empty(), "{:?}", row.keys);
            assert!(!row.meaning.contains('\n') && !row.meaning.contains(" | "), "one table cell: {:?}", row.keys);
        }
    }
}

//! Configuration: Mooncake's `mooncake.json` in both the connector and the store style
//! (reference `mooncake-wire.md` §7), found through `MOONCAKE_CONFIG_PATH` or a path, with
//! environment overrides.
//!
//! Every error names the file, the field and its position (line and column), so a user can go
//! straight to the mistake. Unknown fields are kept (and reported by `ferry doctor`), never
//! silently dropped.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::json_fields::strip_position;
use crate::segment_name::{DEVICE_ID_LIMIT, SegmentName};

/// Environment variable naming the config file (Mooncake's).
pub const CONFIG_PATH_ENV: &str = "MOONCAKE_CONFIG_PATH";
/// Environment variable giving the metadata cluster id (Mooncake's).
pub const CLUSTER_ID_ENV: &str = "MC_METADATA_CLUSTER_ID";
/// Mooncake's switch to TCP: when the variable is present at all (any value, even `0` or
/// empty: Mooncake tests `getenv("MC_FORCE_TCP") != NULL`), the engine runs the `tcp` protocol
/// whatever protocol its config or `initialize` named. `FERRY_PROTOCOL` still wins over it.
pub const FORCE_TCP_ENV: &str = "MC_FORCE_TCP";

/// Protocols of Mooncake's RDMA-style NIC transports, which Ferry does not implement (yet).
/// Mooncake's `initialize(..., "rdma", ...)` runs TCP when `MC_FORCE_TCP` is set; without it
/// Ferry refuses them with an error naming `MC_FORCE_TCP` and `FERRY_PROTOCOL`, unless a plugin
/// serves the name.
pub const RDMA_FAMILY_PROTOCOLS: &[&str] = &["rdma", "efa", "barex", "cxi", "ub", "erdma"];

/// Environment overrides of the core's fields: variable name, config field it overrides. Applied
/// in this order, so for a field named twice the later variable wins (`FERRY_LOCAL_RANK` over
/// `LOCAL_RANK`). Options declared by transports read their own variables
/// ([`OptionSpec`](crate::options::OptionSpec)).
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("FERRY_LOCAL_HOSTNAME", "local_hostname"),
    ("FERRY_METADATA_SERVER", "metadata_server"),
    ("FERRY_PROTOCOL", "protocol"),
    ("FERRY_DEVICE_NAME", "device_name"),
    ("FERRY_ROLE", "role"),
    ("FERRY_TRANSFER_TIMEOUT_MS", "transfer_timeout_ms"),
    ("FERRY_RPC_PORT", "rpc_port"),
    (CLUSTER_ID_ENV, "cluster_id"),
    ("FERRY_BASE_PORT", "base_port"),
    ("FERRY_RESOLVERS", "resolvers"),
    (LOCAL_TRANSPORT_ENV, "local_transport"),
    (LOCAL_RANK_ENV, "local_rank"),
    (FERRY_LOCAL_RANK_ENV, "local_rank"),
    (METRICS_ADDR_ENV, "metrics_addr"),
];

/// Environment variable of `metrics_addr` (where an engine serves its Prometheus metrics).
pub const METRICS_ADDR_ENV: &str = "FERRY_METRICS_ADDR";

/// Environment variable of `local_transport` (the same-process shortcut): `0`/`false`/`off`/`no`
/// turns it off, `1`/`true`/`on`/`yes` on ([`Config::local_transport`]).
pub const LOCAL_TRANSPORT_ENV: &str = "FERRY_LOCAL_TRANSPORT";

/// The launcher's local rank (torchrun, vLLM); `FERRY_LOCAL_RANK` wins over it.
pub const LOCAL_RANK_ENV: &str = "LOCAL_RANK";
/// Ferry's own local-rank variable.
pub const FERRY_LOCAL_RANK_ENV: &str = "FERRY_LOCAL_RANK";

/// Default protocol when neither the file nor the environment names one (Mooncake's default).
pub const DEFAULT_PROTOCOL: &str = "tcp";
/// Default per-transfer timeout.
pub const DEFAULT_TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

/// Accepted values of `transfer_timeout_ms` (and `FERRY_TRANSFER_TIMEOUT_MS`): 1 ms to 24 h. The
/// field is Ferry's (Mooncake has no such field). 0 is refused rather than given a meaning: as a
/// deadline it would fail every request before it starts, and "no deadline" would let a request
/// to a peer that stopped answering, and `shutdown`'s wait for it, hang forever. The upper bound
/// keeps every deadline computed from it representable.
pub const TRANSFER_TIMEOUT_MS_RANGE: RangeInclusive<u64> = 1..=86_400_000;
/// Accepted values of `base_port` (and `FERRY_BASE_PORT`), each role's: 1 to 65535 (0 would give
/// rank 0 a random port and rank N port N). `base_port + local_rank` must not pass 65535 either.
pub const BASE_PORT_RANGE: RangeInclusive<u16> = 1..=65535;
/// Accepted values of `local_rank` (and `LOCAL_RANK`, `FERRY_LOCAL_RANK`): 0 to 1023, a rank
/// among the processes of one node (a global rank given by mistake is refused rather than
/// turned into a port or a device).
pub const LOCAL_RANK_RANGE: RangeInclusive<u32> = 0..=1023;

/// `value` inside `range`, else the message `is V; expected LO to HI UNIT` (the form every range
/// error of the config takes, the declared options' included).
pub fn check_range<T: PartialOrd + fmt::Display>(
    value: T,
    range: &RangeInclusive<T>,
    unit: &str,
) -> std::result::Result<T, String> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(format!("is {value}; expected {} to {} {unit}", range.start(), range.end()))
    }
}

/// Which of Mooncake's two config layouts a file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigStyle {
    /// vLLM connector style: `prefill_url`, `decode_url`, `metadata_backend`, ...
    Connector,
    /// Mooncake Store style: `local_hostname`, `master_server_address`, `global_segment_size`, ...
    Store,
    /// Neither marker present (Ferry's own minimal form, or the embedded default).
    Plain,
}

impl fmt::Display for ConfigStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConfigStyle::Connector => "connector",
            ConfigStyle::Store => "store",
            ConfigStyle::Plain => "plain",
        })
    }
}

/// Which side of a prefill/decode pair this process is (selects the URL in connector style).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes KV cache.
    Prefill,
    /// Consumes KV cache.
    Decode,
}

impl std::str::FromStr for Role {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "prefill" | "kv_producer" | "producer" => Ok(Role::Prefill),
            "decode" | "kv_consumer" | "consumer" => Ok(Role::Decode),
            _ => Err(Error::config(format!("role {s:?} is not `prefill` or `decode`"))),
        }
    }
}

/// Where a field's effective value came from (shown by `ferry doctor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldSource {
    /// The config file (with its path).
    File(PathBuf),
    /// A JSON string given programmatically.
    Inline,
    /// An environment variable.
    Env(&'static str),
    /// Set through the API.
    Api,
}

impl FieldSource {
    /// Where `field` was set, for messages: `config field `x` in FILE`, `config field `x``
    /// (inline JSON), `environment variable X`, `` `x` set through the API``.
    pub fn describe(&self, field: &str) -> String {
        match self {
            FieldSource::Env(var) => format!("environment variable {var}"),
            FieldSource::Api => format!("`{field}` set through the API"),
            FieldSource::File(p) => format!("config field `{field}` in {}", p.display()),
            FieldSource::Inline => format!("config field `{field}`"),
        }
    }
}

impl fmt::Display for FieldSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldSource::File(p) => write!(f, "file {}", p.display()),
            FieldSource::Inline => f.write_str("inline JSON"),
            FieldSource::Env(v) => write!(f, "env {v}"),
            FieldSource::Api => f.write_str("API"),
        }
    }
}

/// A byte size: a JSON number, or a string with an optional unit (`"4GB"`, `"512 MiB"`,
/// `"1.5gb"`). Units are binary (KB = KiB = 1024 bytes), as in Mooncake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses a size string.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let num: f64 = num.parse().map_err(|_| format!("size {s:?} does not start with a number"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            "t" | "tb" | "tib" => 1 << 40,
            other => return Err(format!("size {s:?} has unknown unit {other:?} (use B, KB, MB, GB or TB)")),
        };
        let bytes = num * mult as f64;
        // 2^64 itself is the first value that does not fit (`u64::MAX as f64` rounds up to it).
        if !(0.0..18_446_744_073_709_551_616.0).contains(&bytes) {
            return Err(format!("size {s:?} is out of range"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)
            .map_err(|_| serde::de::Error::custom("expected a non-negative integer or a size string such as \"4GB\""))?
        {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// `base_port`: the port of local rank 0, for every role or per role. A process's port is
/// `base_port + local_rank`, so one config serves every rank of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum BasePort {
    /// One base port whatever the role (`"base_port": 17000`).
    All(u16),
    /// A base port per role, for prefill and decode ranks on the same host
    /// (`"base_port": {"prefill": 17000, "decode": 17100}`).
    PerRole {
        /// Base port of prefill ranks.
        #[serde(skip_serializing_if = "Option::is_none")]
        prefill: Option<u16>,
        /// Base port of decode ranks.
        #[serde(skip_serializing_if = "Option::is_none")]
        decode: Option<u16>,
    },
}

impl<'de> Deserialize<'de> for BasePort {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct PerRole {
            prefill: Option<u16>,
            decode: Option<u16>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u16),
            Roles(PerRole),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a port number (1-65535) or {\"prefill\": <port>, \"decode\": <port>}")
        })? {
            Raw::N(p) => Ok(BasePort::All(p)),
            Raw::Roles(PerRole { prefill: None, decode: None }) => {
                Err(serde::de::Error::custom("names no role: expected {\"prefill\": <port>, \"decode\": <port>}"))
            }
            Raw::Roles(r) => Ok(BasePort::PerRole { prefill: r.prefill, decode: r.decode }),
        }
    }
}

/// Parsed form of `metadata_server` (plus `metadata_backend`, when given).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataServer {
    /// No server: the in-process store (the embedded default).
    Embedded,
    /// Mooncake's P2P handshake: descriptors are fetched from the peers themselves.
    P2pHandshake,
    /// Mooncake's HTTP metadata protocol; the full endpoint URL.
    Http(String),
    /// etcd endpoints (`host:port` each).
    Etcd(Vec<String>),
    /// Redis URL.
    Redis(String),
}

impl MetadataServer {
    /// Short name of the backend kind (`embedded`, `p2p`, `http`, `etcd`, `redis`).
    pub fn kind(&self) -> &'static str {
        match self {
            MetadataServer::Embedded => "embedded",
            MetadataServer::P2pHandshake => "p2p",
            MetadataServer::Http(_) => "http",
            MetadataServer::Etcd(_) => "etcd",
            MetadataServer::Redis(_) => "redis",
        }
    }

    /// Parses a `metadata_server` string; `backend` is the connector style's `metadata_backend`.
    pub fn parse(server: Option<&str>, backend: Option<&str>) -> std::result::Result<Self, String> {
        let server = server.map(str::trim).unwrap_or("");
        let backend = backend.map(|b| b.trim().to_ascii_lowercase()).filter(|b| !b.is_empty());
        if server.is_empty() || server.eq_ignore_ascii_case("embedded") {
            return match backend.as_deref() {
                None | Some("embedded") => Ok(MetadataServer::Embedded),
                Some("p2phandshake") => Ok(MetadataServer::P2pHandshake),
                Some(b) => Err(format!("metadata_backend {b:?} needs a metadata_server address")),
            };
        }
        if server.eq_ignore_ascii_case("P2PHANDSHAKE") {
            return Ok(MetadataServer::P2pHandshake);
        }
        let parsed = if let Some((scheme, rest)) = server.split_once("://") {
            match scheme.to_ascii_lowercase().as_str() {
                "http" | "https" => MetadataServer::Http(server.to_owned()),
                "etcd" => MetadataServer::Etcd(split_endpoints(rest)?),
                "redis" | "rediss" => MetadataServer::Redis(server.to_owned()),
                other => {
                    return Err(format!(
                        "metadata server {server:?} has unknown scheme {other:?} (use http://, etcd://, redis:// or P2PHANDSHAKE)"
                    ));
                }
            }
        } else {
            match backend.as_deref() {
                None | Some("etcd") => MetadataServer::Etcd(split_endpoints(server)?),
                Some("redis") => MetadataServer::Redis(format!("redis://{server}")),
                Some("http") => MetadataServer::Http(format!("http://{server}")),
                Some(b) => return Err(format!("metadata_backend {b:?} is not etcd, redis, http or p2phandshake")),
            }
        };
        if let Some(b) = backend.as_deref()
            && b != parsed.kind()
        {
            return Err(format!("metadata_backend {b:?} contradicts metadata_server {server:?} ({})", parsed.kind()));
        }
        Ok(parsed)
    }
}

fn split_endpoints(list: &str) -> std::result::Result<Vec<String>, String> {
    let eps: Vec<String> = list.split(',').map(|e| e.trim().to_owned()).collect();
    for ep in &eps {
        let ok = ep.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !ok {
            return Err(format!("endpoint {ep:?} in {list:?} is not host:port"));
        }
    }
    Ok(eps)
}

/// Where a config came from, kept for error messages.
#[derive(Debug, Clone, Default)]
struct Origin {
    path: Option<PathBuf>,
    text: Option<String>,
}

/// Engine configuration: every field of both Mooncake styles plus Ferry's own.
///
/// Field values are as written; the accessor methods apply defaults and validation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Config {
    /// This engine's segment name (store style), normally `host:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_hostname: Option<String>,
    /// Metadata service: `P2PHANDSHAKE`, `http://host:port/metadata`, `etcd://h1:2379,h2:2379`,
    /// bare `host:2379` (etcd), `redis://host:6379`; absent means the embedded in-process store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_server: Option<String>,
    /// Connector style: backend kind for `metadata_server` (`etcd`, `redis`, `http`, `p2phandshake`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_backend: Option<String>,
    /// Transport protocol (`tcp`, `ascend`/`hccl`, `local`, a plugin's name, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// Device/NIC selector passed to the transport.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    /// Connector style: the prefill node's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_url: Option<String>,
    /// Connector style: the decode node's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_url: Option<String>,
    /// Which URL is this process's in connector style.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Store style: master address (read, kept, unused by the transfer engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_server_address: Option<String>,
    /// Store style: global segment size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_segment_size: Option<ByteSize>,
    /// Store style: local buffer size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_buffer_size: Option<ByteSize>,
    /// Per-transfer timeout in milliseconds (default 30000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_timeout_ms: Option<u64>,
    /// Metadata cluster id (key prefix `mooncake/<id>/`); also `MC_METADATA_CLUSTER_ID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// P2P handshake: RPC port to listen on (default: the port in `local_hostname`, else a free
    /// port in 15000..17000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpc_port: Option<u16>,
    /// Transport plugins: paths of `libferry_transport_<protocol>.so` files or of directories
    /// holding them, searched (before `FERRY_PLUGIN_DIR`) when a protocol is not built in. A
    /// relative path is relative to the config file's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugins: Option<Vec<String>>,
    /// Port of local rank 0: each process listens on `base_port + local_rank`, so one config
    /// serves every rank of a node (`local_hostname` or the role URL then names the host alone).
    /// A number, or one per role: `{"prefill": 17000, "decode": 17100}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_port: Option<BasePort>,
    /// This process's local rank on its node (normally from `LOCAL_RANK`/`FERRY_LOCAL_RANK`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rank: Option<u32>,
    /// Identity resolvers to ask, in order (default: the resolver registry's default order,
    /// [`ResolverRegistry::default_order`](crate::ResolverRegistry::default_order)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolvers: Option<Vec<String>>,
    /// Physical device ids by local rank (answered by the `config` resolver, ahead of every
    /// other).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_devices: Option<Vec<u32>>,
    /// The same-process shortcut (default `true`): the `local` transport is installed beside the
    /// configured protocol and tried first, so engines of one process reach each other by
    /// memcpy whatever their protocol. `false` leaves it out: engines of one process then talk
    /// through the configured protocol (a plugin under test, `tcp`), as engines in two
    /// processes do. See [`Config::local_transport`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_transport: Option<bool>,
    /// Address (`ip:port`) where the engine serves its counters as Prometheus text at
    /// `/metrics` (with the facade's `metrics` feature, default); port 0 picks a free port.
    /// Absent: no endpoint ([`TransferEngine::stats`](crate::TransferEngine::stats) still
    /// reads them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
    /// Fields the core does not know. Kept so nothing is lost: options declared by transports
    /// are read from here ([`Config::option`]); `ferry doctor` lists the fields nothing in its
    /// build declares.
    #[serde(flatten, skip_deserializing)]
    pub extra: Map<String, Value>,
    #[serde(skip)]
    origin: Origin,
    #[serde(skip)]
    sources: BTreeMap<&'static str, FieldSource>,
    /// `local_hostname` already holds the port-offset name (see [`Config::fix_segment_name`]).
    #[serde(skip)]
    segment_name_fixed: bool,
}

impl Config {
    /// The embedded default: no file, in-process metadata, the `local` transport.
    pub fn embedded() -> Self {
        let mut c = Config { protocol: Some(LOCAL_PROTOCOL.into()), ..Config::default() };
        c.sources.insert("protocol", FieldSource::Api);
        c
    }

    /// Parses JSON text. `path` (if any) is used in error messages and provenance.
    pub fn from_json_str(text: &str, path: Option<&Path>) -> Result<Self> {
        let origin_name = path.map(|p| p.display().to_string()).unwrap_or_else(|| "inline config".into());
        let mut de = serde_json::Deserializer::from_str(text);
        let mut cfg: Config = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let field = e.path().to_string();
            let inner = e.into_inner();
            let detail = strip_position(&inner.to_string());
            if inner.is_syntax() || inner.is_eof() {
                return Error::config(format!(
                    "config {origin_name}: is not valid JSON at line {} column {}: {detail}",
                    inner.line(),
                    inner.column()
                ));
            }
            // serde_json places errors raised after a value was read (bad units, out-of-range
            // values) past the value; point at the field's key instead when it can be found.
            let top = field.split(['.', '[']).next().unwrap_or("");
            let (line, column) = field_position(text, top).unwrap_or((inner.line(), inner.column()));
            Error::config(format!("config {origin_name}: field `{field}` at line {line} column {column}: {detail}"))
        })?;
        de.end().map_err(|e| {
            Error::config(format!(
                "config {origin_name}: trailing data after the JSON object at line {} column {}",
                e.line(),
                e.column()
            ))
        })?;
        // Unknown fields in a second pass (a flattened catch-all would lose error positions).
        let value: Value =
            serde_json::from_str(text).map_err(|e| Error::config(format!("config {origin_name}: {e}")))?;
        let known = crate::json_fields::serde_fields::<Config>();
        cfg.extra = crate::json_fields::unknown_fields(&value, known);
        let source = path.map(|p| FieldSource::File(p.to_owned())).unwrap_or(FieldSource::Inline);
        cfg.origin = Origin { path: path.map(Path::to_owned), text: Some(text.to_owned()) };
        // A known field is set when present and not `null` (an absent value's `None`).
        for &f in known.iter().filter(|f| value.get(**f).is_some_and(|v| !v.is_null())) {
            cfg.sources.insert(f, source.clone());
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a config file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::config(format!("config {}: cannot be read", path.display())).with_source(e))?;
        Self::from_json_str(&text, Some(path))
    }

    /// Loads the file named by `MOONCAKE_CONFIG_PATH` if set, else the embedded default, then
    /// applies the environment overrides.
    pub fn discover() -> Result<Self> {
        Self::discover_with(|k| std::env::var(k).ok())
    }

    /// [`discover`](Self::discover) with an explicit environment (for tests and embedding).
    pub fn discover_with(env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut cfg = match env(CONFIG_PATH_ENV).filter(|p| !p.is_empty()) {
            Some(p) => Self::from_file(&p)
                .map_err(|e| Error::config(format!("{} (named by {CONFIG_PATH_ENV})", e.message())))?,
            None => Self::embedded(),
        };
        cfg.apply_env(env)?;
        Ok(cfg)
    }

    /// Applies [`FORCE_TCP_ENV`] (`MC_FORCE_TCP`, present with any value: protocol `tcp`),
    /// then the [`ENV_OVERRIDES`] (an empty variable counts as unset), so `FERRY_PROTOCOL` wins
    /// over `MC_FORCE_TCP`.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        if env(FORCE_TCP_ENV).is_some() {
            if self.protocol() != DEFAULT_PROTOCOL {
                tracing::info!(configured = self.protocol(), "{FORCE_TCP_ENV} is set: using the tcp protocol");
            }
            self.protocol = Some(DEFAULT_PROTOCOL.to_owned());
            self.sources.insert("protocol", FieldSource::Env(FORCE_TCP_ENV));
        }
        self.apply_env_fields(env, |_| true)
    }

    /// Applies only the local-rank variables (`LOCAL_RANK`, then `FERRY_LOCAL_RANK`), unless the
    /// rank was set through the API or already from the environment. Engines call this, so the
    /// launcher's rank counts even for a config that was not [`discover`](Self::discover)ed.
    pub fn apply_local_rank_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        if matches!(self.sources.get("local_rank"), Some(FieldSource::Api | FieldSource::Env(_))) {
            return Ok(());
        }
        self.apply_env_fields(env, |f| f == "local_rank")
    }

    fn apply_env_fields(&mut self, env: impl Fn(&str) -> Option<String>, only: impl Fn(&str) -> bool) -> Result<()> {
        for &(var, field) in ENV_OVERRIDES.iter().filter(|(_, f)| only(f)) {
            let Some(value) = env(var).filter(|v| !v.is_empty()) else { continue };
            let bad = |msg: String| Error::config(format!("environment variable {var}={value:?}: {msg}"));
            match field {
                "local_hostname" => self.local_hostname = Some(value.clone()),
                "metadata_server" => self.metadata_server = Some(value.clone()),
                "protocol" => self.protocol = Some(value.clone()),
                "device_name" => self.device_name = Some(value.clone()),
                "role" => self.role = Some(value.parse().map_err(|e: Error| bad(e.message().to_owned()))?),
                "transfer_timeout_ms" => {
                    self.transfer_timeout_ms = Some(value.parse().map_err(|_| {
                        bad(format!(
                            "not a whole number of milliseconds ({} to {})",
                            TRANSFER_TIMEOUT_MS_RANGE.start(),
                            TRANSFER_TIMEOUT_MS_RANGE.end()
                        ))
                    })?)
                }
                "cluster_id" => self.cluster_id = Some(value.clone()),
                "metrics_addr" => self.metrics_addr = Some(value.clone()),
                "rpc_port" => {
                    self.rpc_port =
                        Some(value.parse().map_err(|_| bad("not a port number (0 to 65535; 0: a free port)".into()))?)
                }
                "base_port" => {
                    self.base_port = Some(BasePort::All(value.parse().map_err(|_| {
                        bad(format!("not a port number ({} to {})", BASE_PORT_RANGE.start(), BASE_PORT_RANGE.end()))
                    })?))
                }
                "local_transport" => {
                    self.local_transport = Some(parse_switch(&value).ok_or_else(|| {
                        bad("expected 1 or 0 (also true/false, on/off, yes/no): keep or leave out the same-process \
                             `local` transport"
                            .into())
                    })?)
                }
                "resolvers" => {
                    let names: Vec<String> = value.split(',').map(|n| n.trim().to_owned()).collect();
                    if names.iter().any(String::is_empty) {
                        return Err(bad("expected comma-separated resolver names, e.g. \"hostname,env\"".into()));
                    }
                    self.resolvers = Some(names)
                }
                "local_rank" => {
                    self.local_rank = Some(value.parse().map_err(|_| {
                        bad(format!(
                            "not a local rank (a whole number, {} to {})",
                            LOCAL_RANK_RANGE.start(),
                            LOCAL_RANK_RANGE.end()
                        ))
                    })?)
                }
                _ => unreachable!("ENV_OVERRIDES names only known fields"),
            }
            self.sources.insert(field, FieldSource::Env(var));
        }
        self.validate()
    }

    /// Checks every numeric field the core owns against its range ([`TRANSFER_TIMEOUT_MS_RANGE`],
    /// [`BASE_PORT_RANGE`], [`LOCAL_RANK_RANGE`], and `physical_devices`, see
    /// [`check_physical_devices`](Self::check_physical_devices); `rpc_port` is any port, which
    /// its type already ensures). Parsing a file and applying the environment run it, engines run
    /// it again when they are built (for values set through the API), and `ferry doctor` reports
    /// its error: each range is checked here only, so the engine and doctor refuse the same
    /// values in the same words. The error names the field and where its value came from (the
    /// file and position, the variable, or the API); a value out of range is never clamped.
    pub fn validate(&self) -> Result<()> {
        self.check_physical_devices()?;
        if let Some(ms) = self.transfer_timeout_ms {
            check_range(ms, &TRANSFER_TIMEOUT_MS_RANGE, "milliseconds")
                .map_err(|m| self.value_error("transfer_timeout_ms", &m))?;
        }
        let base_ports = match self.base_port {
            None => vec![],
            Some(BasePort::All(p)) => vec![p],
            Some(BasePort::PerRole { prefill, decode }) => prefill.into_iter().chain(decode).collect(),
        };
        for port in base_ports {
            check_range(port, &BASE_PORT_RANGE, "").map_err(|m| self.value_error("base_port", m.trim_end()))?;
        }
        if let Some(rank) = self.local_rank {
            check_range(rank, &LOCAL_RANK_RANGE, "(a local rank: one process of a node)")
                .map_err(|m| self.value_error("local_rank", &m))?;
        }
        if let Some(addr) = &self.metrics_addr
            && addr.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(self.value_error(
                "metrics_addr",
                &format!("is \"{addr}\"; expected an IP address and port, e.g. 127.0.0.1:9464 or 0.0.0.0:9464"),
            ));
        }
        if !self.local_transport() && self.protocol() == LOCAL_PROTOCOL {
            return Err(self.value_error(
                "local_transport",
                &format!(
                    "is false, but the protocol is `local` ({}): the same-process transport cannot be both \
                     left out and the engine's transport; set `protocol` (or FERRY_PROTOCOL) to the transport \
                     engines of this process should talk through, or drop `local_transport`",
                    self.describe_source("protocol")
                ),
            ));
        }
        Ok(())
    }

    /// [`field_error`](Self::field_error), or for a value set through the API an error saying so.
    fn value_error(&self, field: &str, msg: &str) -> Error {
        match self.sources.get(field) {
            Some(FieldSource::Api) => Error::config(format!("`{field}` set through the API: {msg}")),
            _ => self.field_error(field, msg),
        }
    }

    /// Checks `physical_devices`: not empty, every id below [`DEVICE_ID_LIMIT`], none twice (two
    /// ranks on one card). The error names the file, the field and its position, and the entry.
    /// Parsing checks it; the `config` resolver checks it again for configs built in code.
    pub fn check_physical_devices(&self) -> Result<()> {
        let Some(list) = &self.physical_devices else { return Ok(()) };
        let expected = "expected physical NPU ids, one per local rank, e.g. [4, 5, 6, 7]";
        if list.is_empty() {
            return Err(self.field_error("physical_devices", &format!("is empty; {expected}")));
        }
        for (i, &id) in list.iter().enumerate() {
            if id >= DEVICE_ID_LIMIT {
                return Err(self.field_error(
                    "physical_devices",
                    &format!("entry {i} ({id}) is out of range (device ids are below {DEVICE_ID_LIMIT}); {expected}"),
                ));
            }
            if let Some(j) = list[..i].iter().position(|&other| other == id) {
                return Err(self.field_error(
                    "physical_devices",
                    &format!("device {id} is listed twice (entries {j} and {i}); {expected}"),
                ));
            }
        }
        Ok(())
    }

    /// Where `field`'s value came from, or `None` when it is a default.
    pub fn source_of(&self, field: &str) -> Option<&FieldSource> {
        self.sources.get(field)
    }

    /// Path of the file this config was read from.
    pub fn path(&self) -> Option<&Path> {
        self.origin.path.as_deref()
    }

    /// The config's layout.
    pub fn style(&self) -> ConfigStyle {
        if self.prefill_url.is_some() || self.decode_url.is_some() || self.metadata_backend.is_some() {
            ConfigStyle::Connector
        } else if self.local_hostname.is_some()
            || self.master_server_address.is_some()
            || self.global_segment_size.is_some()
            || self.local_buffer_size.is_some()
        {
            ConfigStyle::Store
        } else {
            ConfigStyle::Plain
        }
    }

    /// The `plugins` entries as paths; relative ones are resolved against the directory of the
    /// config file they came from (the working directory for an inline config).
    pub fn plugin_paths(&self) -> Vec<PathBuf> {
        self.plugins.iter().flatten().map(|p| self.relative_to(p, self.sources.get("plugins"))).collect()
    }

    /// `path` as set from `source`: relative to the config file's directory when it came from
    /// the file, else as written (relative to the working directory).
    pub(crate) fn relative_to(&self, path: &str, source: Option<&FieldSource>) -> PathBuf {
        let p = Path::new(path);
        let from_file = !matches!(source, Some(FieldSource::Env(_) | FieldSource::Api));
        match self.origin.path.as_deref().and_then(Path::parent) {
            Some(dir) if p.is_relative() && from_file => dir.join(p),
            _ => p.to_owned(),
        }
    }

    /// Where the config's own text came from: its file, else inline JSON.
    pub(crate) fn origin_source(&self) -> FieldSource {
        match &self.origin.path {
            Some(p) => FieldSource::File(p.clone()),
            None => FieldSource::Inline,
        }
    }

    pub(crate) fn set_source(&mut self, field: &'static str, source: FieldSource) {
        self.sources.insert(field, source);
    }

    /// Where a field was set, for messages: `config field `x``, `environment variable X`, ...
    pub fn describe_source(&self, field: &str) -> String {
        match self.sources.get(field) {
            Some(s) => s.describe(field),
            None => FieldSource::Inline.describe(field),
        }
    }

    /// This process's local rank: the API's, else `FERRY_LOCAL_RANK`, else `LOCAL_RANK` (once
    /// applied), else the config's `local_rank`.
    pub fn local_rank(&self) -> Option<u32> {
        self.local_rank
    }

    /// Sets the local rank (as the API does; environment variables no longer override it).
    pub fn set_local_rank(&mut self, rank: u32) {
        self.local_rank = Some(rank);
        self.sources.insert("local_rank", FieldSource::Api);
    }

    /// The base port for this process's role: `None` without `base_port`; an error when it is
    /// given per role and the role is unknown or has no port.
    pub fn base_port_for_role(&self) -> Result<Option<u16>> {
        match self.base_port {
            None => Ok(None),
            Some(BasePort::All(p)) => Ok(Some(p)),
            Some(BasePort::PerRole { prefill, decode }) => {
                let role = self.role.ok_or_else(|| {
                    self.field_error(
                        "role",
                        "base_port is given per role: set `role` (or FERRY_ROLE) to prefill or decode",
                    )
                })?;
                let port = if role == Role::Prefill { prefill } else { decode };
                let name = if role == Role::Prefill { "prefill" } else { "decode" };
                port.map(Some).ok_or_else(|| self.field_error("base_port", &format!("has no port for role {name}")))
            }
        }
    }

    /// `base_port + rank` for this process's role; `None` without `base_port`. An unknown rank
    /// or a port past 65535 is an error.
    pub fn port_for_rank(&self, rank: Option<u32>) -> Result<Option<u16>> {
        let Some(base) = self.base_port_for_role()? else { return Ok(None) };
        let rank = rank.ok_or_else(|| {
            self.field_error(
                "base_port",
                "is set but the local rank is unknown: set LOCAL_RANK or FERRY_LOCAL_RANK (or `local_rank`, or \
                 EngineBuilder::local_rank)",
            )
        })?;
        let port = u64::from(base) + u64::from(rank);
        u16::try_from(port)
            .map(Some)
            .map_err(|_| self.field_error("base_port", &format!("{base} + local rank {rank} = {port} is past 65535")))
    }

    /// Whether the same-process shortcut is on: the `local` transport (every
    /// [companion](crate::TransportFactory::companion) transport) installed beside the configured
    /// protocol and tried first for peers of this process. `local_transport`, else
    /// `FERRY_LOCAL_TRANSPORT`, default `true`.
    pub fn local_transport(&self) -> bool {
        self.local_transport.unwrap_or(true)
    }

    /// The names of the fields the core reads, in declaration order (the fields transports and
    /// metadata backends declare are [`OptionSpec`](crate::OptionSpec)s, listed by their
    /// registries). For generated and checked documentation.
    pub fn core_fields() -> &'static [&'static str] {
        crate::json_fields::serde_fields::<Config>()
    }

    /// Where the engine serves its Prometheus metrics (`metrics_addr`), when set and valid
    /// ([`validate`](Self::validate) refuses an invalid one).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr.as_deref().and_then(|a| a.parse().ok())
    }

    /// Effective protocol (default [`DEFAULT_PROTOCOL`]).
    pub fn protocol(&self) -> &str {
        self.protocol.as_deref().unwrap_or(DEFAULT_PROTOCOL)
    }

    /// Effective transfer timeout.
    pub fn transfer_timeout(&self) -> Duration {
        self.transfer_timeout_ms.map(Duration::from_millis).unwrap_or(DEFAULT_TRANSFER_TIMEOUT)
    }

    /// Parsed metadata server.
    pub fn metadata(&self) -> Result<MetadataServer> {
        MetadataServer::parse(self.metadata_server.as_deref(), self.metadata_backend.as_deref())
            .map_err(|msg| self.field_error("metadata_server", &msg))
    }

    /// This engine's segment name: `local_hostname`, else (connector style) the URL of this
    /// process's `role`. `Ok(None)` when nothing names it.
    ///
    /// With `base_port`, the configured name is the host alone and the port is
    /// `base_port + local_rank` (`10.0.0.5` → `10.0.0.5:17001` for local rank 1). A name with a
    /// malformed device part (`host:port:npu_x`) is an error.
    pub fn local_segment_name(&self) -> Result<Option<String>> {
        let Some((name, field)) = self.configured_name()? else {
            if self.base_port.is_some() {
                return Err(self.field_error(
                    "base_port",
                    "needs this host's name or IP: set local_hostname (or role with prefill_url/decode_url)",
                ));
            }
            return Ok(None);
        };
        // A bare IPv6 address is a host, not `host:port:device`.
        let is_v6 = name.parse::<std::net::Ipv6Addr>().is_ok();
        let parsed = match is_v6 {
            true => None,
            false => SegmentName::parse_strict(&name).map_err(|e| self.field_error(field, e.message()))?,
        };
        if self.base_port.is_none() || self.segment_name_fixed {
            return Ok(Some(name));
        }
        if self.rpc_port.is_some() {
            return Err(self.field_error(
                "rpc_port",
                "is one fixed port, but with base_port every rank of a node shares this config, so every rank would \
                 bind the same port; remove it",
            ));
        }
        if parsed.is_some() {
            return Err(self.field_error(
                field,
                &format!(
                    "{name:?} has a port, but base_port is set: give the host alone (each rank listens on \
                     base_port + local rank)"
                ),
            ));
        }
        let port = self.port_for_rank(self.local_rank)?.unwrap_or_default();
        let bracketed = name.starts_with('[') && name.ends_with(']') && name.len() > 2;
        if is_v6 {
            Ok(Some(format!("[{name}]:{port}")))
        } else if bracketed || !name.contains(|c: char| c == ':' || c == '/' || c.is_whitespace()) {
            Ok(Some(format!("{name}:{port}")))
        } else {
            Err(self.field_error(field, &format!("{name:?} is not a host name or IP address")))
        }
    }

    /// Makes the port-offset segment name (see [`local_segment_name`](Self::local_segment_name))
    /// this config's `local_hostname`, so everything reading `local_hostname` (the P2P handshake's
    /// RPC port) sees this rank's port. Engines call it once at start; returns the name.
    pub fn fix_segment_name(&mut self) -> Result<Option<String>> {
        let name = self.local_segment_name()?;
        if let Some(n) = &name
            && self.base_port.is_some()
            && !self.segment_name_fixed
        {
            self.local_hostname = Some(n.clone());
            self.segment_name_fixed = true;
            if let Some(src) = self.sources.get("base_port").cloned() {
                self.sources.entry("local_hostname").or_insert(src);
            }
        }
        Ok(name)
    }

    /// The configured name before any port offset, and the field it came from.
    fn configured_name(&self) -> Result<Option<(String, &'static str)>> {
        if let Some(h) = &self.local_hostname {
            if h.trim().is_empty() {
                return Err(self.field_error("local_hostname", "is empty"));
            }
            return Ok(Some((h.trim().to_owned(), "local_hostname")));
        }
        match (self.role, &self.prefill_url, &self.decode_url) {
            (Some(Role::Prefill), Some(u), _) => Ok(Some((u.trim().to_owned(), "prefill_url"))),
            (Some(Role::Decode), _, Some(u)) => Ok(Some((u.trim().to_owned(), "decode_url"))),
            (Some(role), _, _) => Err(self.field_error(
                if role == Role::Prefill { "prefill_url" } else { "decode_url" },
                &format!("role is {role:?} but its URL is missing"),
            )),
            (None, Some(_), _) | (None, _, Some(_)) => Err(self.field_error(
                "role",
                "connector-style config: set `role` (or FERRY_ROLE) to `prefill` or `decode` to pick this process's URL",
            )),
            (None, None, None) => Ok(None),
        }
    }

    /// Metadata cluster id, if any.
    pub fn cluster_id(&self) -> Option<&str> {
        self.cluster_id.as_deref().filter(|c| !c.is_empty())
    }

    /// Names of fields present in the file that Ferry does not know.
    pub fn unknown_fields(&self) -> Vec<&str> {
        self.extra.keys().map(String::as_str).collect()
    }

    /// A config error about `field`, naming the file and the field's position when known.
    pub fn field_error(&self, field: &str, msg: &str) -> Error {
        let file = self.origin.path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "inline config".into());
        let from_env =
            ENV_OVERRIDES.iter().find(|(v, f)| *f == field && self.sources.get(field) == Some(&FieldSource::Env(v)));
        if let Some((var, _)) = from_env {
            return Error::config(format!("field `{field}` (from environment variable {var}): {msg}"));
        }
        let pos = self
            .origin
            .text
            .as_deref()
            .and_then(|t| field_position(t, field))
            .map(|(l, c)| format!(" at line {l} column {c}"))
            .unwrap_or_default();
        Error::config(format!("config {file}: field `{field}`{pos}: {msg}"))
    }
}

/// The protocol of the same-process transport, the embedded default's.
const LOCAL_PROTOCOL: &str = "local";

/// An on/off environment value: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no` (any case).
fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// Line and column (1-based) of the first `"field"` key in JSON text.
fn field_position(text: &str, field: &str) -> Option<(usize, usize)> {
    let needle = format!("\"{field}\"");
    let mut from = 0;
    while let Some(i) = text[from..].find(&needle) {
        let at = from + i;
        let after = text[at + needle.len()..].trim_start();
        if after.starts_with(':') {
            let line = text[..at].matches('\n').count() + 1;
            let col = at - text[..at].rfind('\n').map(|n| n + 1).unwrap_or(0) + 1;
            return Some((line, col));
        }
        from = at + needle.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    const CONNECTOR: &str = r#"{
  "prefill_url": "192.168.0.137:13003",
  "decode_url": "192.168.0.139:13003",
  "metadata_server": "192.168.0.139:2379",
  "metadata_backend": "etcd",
  "protocol": "ascend",
  "device_name": ""
}"#;

    const STORE: &str = r#"{
    "local_hostname": "10.0.0.5:17000",
    "metadata_server": "redis://10.0.0.1:6379",
    "protocol": "tcp",
    "device_name": "",
    "master_server_address": "10.0.0.1:50051",
    "global_segment_size": "3.125GB",
    "local_buffer_size": 536870912
}"#;

    #[test]
    fn connector_style() {
        let c = Config::from_json_str(CONNECTOR, Some(Path::new("/etc/mooncake.json"))).unwrap();
        assert_eq!(c.style(), ConfigStyle::Connector);
        assert_eq!(c.metadata().unwrap(), MetadataServer::Etcd(vec!["192.168.0.139:2379".into()]));
        assert_eq!(c.protocol(), "ascend");
        let e = c.local_segment_name().unwrap_err();
        assert!(e.message().contains("FERRY_ROLE"), "{e}");
        let mut c2 = c.clone();
        c2.apply_env(|k| (k == "FERRY_ROLE").then(|| "decode".to_owned())).unwrap();
        assert_eq!(c2.local_segment_name().unwrap().as_deref(), Some("192.168.0.139:13003"));
        assert_eq!(c2.source_of("role"), Some(&FieldSource::Env("FERRY_ROLE")));
        assert_eq!(c2.source_of("protocol"), Some(&FieldSource::File("/etc/mooncake.json".into())));
    }

    #[test]
    fn store_style() {
        let c = Config::from_json_str(STORE, None).unwrap();
        assert_eq!(c.style(), ConfigStyle::Store);
        assert_eq!(c.global_segment_size, Some(ByteSize((3.125 * (1u64 << 30) as f64) as u64)));
        assert_eq!(c.local_buffer_size, Some(ByteSize(536870912)));
        assert_eq!(c.metadata().unwrap(), MetadataServer::Redis("redis://10.0.0.1:6379".into()));
        assert_eq!(c.local_segment_name().unwrap().as_deref(), Some("10.0.0.5:17000"));
    }

    #[test]
    fn metadata_server_forms() {
        use MetadataServer as M;
        let p = |s: &str| M::parse(Some(s), None);
        assert_eq!(p("P2PHANDSHAKE").unwrap(), M::P2pHandshake);
        assert_eq!(p("http://h:8080/metadata").unwrap(), M::Http("http://h:8080/metadata".into()));
        assert_eq!(p("etcd://a:2379,b:2379").unwrap(), M::Etcd(vec!["a:2379".into(), "b:2379".into()]));
        assert_eq!(p("h:2379").unwrap(), M::Etcd(vec!["h:2379".into()]));
        assert_eq!(p("redis://h:6379").unwrap(), M::Redis("redis://h:6379".into()));
        assert_eq!(M::parse(None, None).unwrap(), M::Embedded);
        assert_eq!(M::parse(Some("h:6379"), Some("redis")).unwrap(), M::Redis("redis://h:6379".into()));
        assert!(p("ftp://x").unwrap_err().contains("unknown scheme"));
        assert!(p("justahost").unwrap_err().contains("host:port"));
        assert!(M::parse(Some("redis://h:1"), Some("etcd")).unwrap_err().contains("contradicts"));
    }

    #[test]
    fn errors_name_file_field_and_position() {
        let text = "{\n  \"protocol\": \"tcp\",\n  \"global_segment_size\": \"12XB\"\n}";
        let e = Config::from_json_str(text, Some(Path::new("/tmp/m.json"))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let m = e.message();
        assert!(m.contains("/tmp/m.json") && m.contains("global_segment_size") && m.contains("line 3"), "{m}");

        let e = Config::from_json_str("{\"protocol\": \"tcp\"} {}", None).unwrap_err();
        assert!(e.message().contains("trailing data"), "{e}");

        let e = Config::from_json_str("{\"protocol\": 5}", None).unwrap_err();
        assert!(e.message().contains("`protocol`"), "{e}");

        let e = Config::from_json_str("{\"protocol\": \"tcp\",", Some(Path::new("p.json"))).unwrap_err();
        assert!(e.message().contains("not valid JSON") && e.message().contains("p.json"), "{e}");

        let c =
            Config::from_json_str("{\n\n   \"metadata_server\": \"gopher://x\"}", Some(Path::new("q.json"))).unwrap();
        let e = c.metadata().unwrap_err();
        assert!(e.message().contains("q.json") && e.message().contains("line 3 column 4"), "{e}");
    }

    #[test]
    fn unknown_fields_are_kept() {
        let c = Config::from_json_str(r#"{"protocol":"tcp","rdma_devices":"mlx5_0","tcp_lanes":8}"#, None).unwrap();
        assert_eq!(c.unknown_fields(), vec!["rdma_devices", "tcp_lanes"], "a transport's fields are not the core's");
        let back = serde_json::to_value(&c).unwrap();
        assert_eq!((&back["rdma_devices"], &back["tcp_lanes"]), (&"mlx5_0".into(), &8.into()));
        // The core's fields are the struct's (serde's list), each set one with its source.
        let known = crate::json_fields::serde_fields::<Config>();
        assert!(known.contains(&"physical_devices") && known.contains(&"rpc_port") && !known.contains(&"extra"));
        let c = Config::from_json_str(r#"{"rpc_port": 1, "role": null}"#, Some(Path::new("/m.json"))).unwrap();
        assert_eq!(c.source_of("rpc_port"), Some(&FieldSource::File("/m.json".into())));
        assert_eq!(c.source_of("role"), None, "null is unset");
    }

    #[test]
    fn discovery_uses_env() {
        let dir = std::env::temp_dir().join(format!("ferry-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mooncake.json");
        std::fs::write(&path, STORE).unwrap();
        let p = path.display().to_string();
        let c = Config::discover_with(|k| match k {
            CONFIG_PATH_ENV => Some(p.clone()),
            "FERRY_PROTOCOL" => Some("local".into()),
            "MC_METADATA_CLUSTER_ID" => Some("blue".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.protocol(), "local");
        assert_eq!(c.cluster_id(), Some("blue"));
        assert_eq!(c.path(), Some(path.as_path()));
        let e = Config::discover_with(|k| (k == CONFIG_PATH_ENV).then(|| "/nonexistent/x.json".into())).unwrap_err();
        assert!(e.message().contains("/nonexistent/x.json") && e.message().contains(CONFIG_PATH_ENV), "{e}");
        let e = Config::discover_with(|k| (k == "FERRY_TRANSFER_TIMEOUT_MS").then(|| "soon".into())).unwrap_err();
        assert!(e.message().contains("FERRY_TRANSFER_TIMEOUT_MS"), "{e}");
        let c = Config::discover_with(|_| None).unwrap();
        assert_eq!(c.protocol(), "local");
        assert_eq!(c.metadata().unwrap(), MetadataServer::Embedded);
    }

    #[test]
    fn sizes() {
        assert_eq!(ByteSize::parse("4GB").unwrap().0, 4 << 30);
        assert_eq!(ByteSize::parse("512 MiB").unwrap().0, 512 << 20);
        assert_eq!(ByteSize::parse("100").unwrap().0, 100);
        assert!(ByteSize::parse("-1GB").is_err());
        assert!(ByteSize::parse("GB").is_err());
        assert!(ByteSize::parse("1e400").is_err());
    }

    #[test]
    fn plugin_paths_are_relative_to_the_config_file() {
        let text = r#"{"protocol":"example","plugins":["plugins/", "/opt/ferry/libferry_transport_x.so"]}"#;
        let c = Config::from_json_str(text, Some(Path::new("/etc/ferry/mooncake.json"))).unwrap();
        assert_eq!(
            c.plugin_paths(),
            vec![PathBuf::from("/etc/ferry/plugins/"), PathBuf::from("/opt/ferry/libferry_transport_x.so")]
        );
        assert!(c.unknown_fields().is_empty());
        let e = Config::from_json_str(r#"{"plugins":"not-a-list"}"#, None).unwrap_err();
        assert!(e.message().contains("`plugins`"), "{e}");
        assert!(Config::embedded().plugin_paths().is_empty());
    }

    #[test]
    fn one_config_per_node_fields_and_env() {
        let text = r#"{
  "prefill_url": "10.0.0.5",
  "decode_url": "10.0.0.5",
  "protocol": "ascend",
  "base_port": {"prefill": 17000, "decode": 17100},
  "resolvers": ["hostname", "port_offset"],
  "physical_devices": [4, 5]
}"#;
        let c = Config::from_json_str(text, Some(Path::new("/etc/ferry/mooncake.json"))).unwrap();
        assert!(c.unknown_fields().is_empty(), "{:?}", c.unknown_fields());
        assert_eq!(c.base_port, Some(BasePort::PerRole { prefill: Some(17000), decode: Some(17100) }));
        assert_eq!(c.resolvers.as_deref().unwrap().len(), 2);
        assert_eq!(c.physical_devices, Some(vec![4, 5]));

        let mut d = c.clone();
        let env = |k: &str| match k {
            "FERRY_ROLE" => Some("decode".to_owned()),
            "LOCAL_RANK" => Some("3".to_owned()),
            "FERRY_LOCAL_RANK" => Some("2".to_owned()),
            _ => None,
        };
        d.apply_env(env).unwrap();
        assert_eq!(d.local_rank(), Some(2), "FERRY_LOCAL_RANK wins over LOCAL_RANK");
        assert_eq!(d.source_of("local_rank"), Some(&FieldSource::Env("FERRY_LOCAL_RANK")));
        assert_eq!(d.describe_source("local_rank"), "environment variable FERRY_LOCAL_RANK");
        assert_eq!(d.describe_source("base_port"), "config field `base_port` in /etc/ferry/mooncake.json");
        assert_eq!(d.local_segment_name().unwrap().as_deref(), Some("10.0.0.5:17102"));
        let mut p = c.clone();
        p.apply_env(|k| match k {
            "FERRY_ROLE" => Some("prefill".to_owned()),
            "LOCAL_RANK" => Some("3".to_owned()),
            _ => None,
        })
        .unwrap();
        assert_eq!(p.local_segment_name().unwrap().as_deref(), Some("10.0.0.5:17003"));
        assert_eq!(p.source_of("local_rank"), Some(&FieldSource::Env("LOCAL_RANK")));

        let mut e = Config::default();
        e.apply_env(|k| match k {
            "FERRY_BASE_PORT" => Some("18000".to_owned()),
            "FERRY_RESOLVERS" => Some("env, hostname".to_owned()),
            _ => None,
        })
        .unwrap();
        assert_eq!(e.base_port, Some(BasePort::All(18000)));
        assert_eq!(e.resolvers, Some(vec!["env".to_owned(), "hostname".to_owned()]));
        for (var, value, needle) in [
            ("FERRY_BASE_PORT", "70000", "not a port number"),
            ("LOCAL_RANK", "one", "not a local rank"),
            ("FERRY_LOCAL_RANK", "-1", "not a local rank"),
            ("FERRY_RESOLVERS", "env,,hostname", "comma-separated resolver names"),
        ] {
            let err = Config::default().apply_env(|k| (k == var).then(|| value.to_owned())).unwrap_err();
            assert!(err.message().contains(&format!("{var}={value:?}")) && err.message().contains(needle), "{err}");
        }
    }

    #[test]
    fn physical_devices_are_range_checked_with_the_field_and_position() {
        for (list, needle) in [
            ("[4, 64]", "entry 1 (64) is out of range (device ids are below 64)"),
            ("[4, 5, 4000000]", "entry 2 (4000000) is out of range"),
            ("[4, 5, 4]", "device 4 is listed twice (entries 0 and 2)"),
            ("[]", "is empty"),
        ] {
            let text = format!("{{\n  \"protocol\": \"tcp\",\n  \"physical_devices\": {list}\n}}");
            let e = Config::from_json_str(&text, Some(Path::new("/etc/m.json"))).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            let m = e.message();
            assert!(
                m.contains("config /etc/m.json: field `physical_devices` at line 3 column 3") && m.contains(needle),
                "{list}: {m}"
            );
        }
        let e = Config::from_json_str(r#"{"physical_devices": [-1]}"#, None).unwrap_err();
        assert!(e.message().contains("`physical_devices[0]`"), "{e}");
        let c = Config::from_json_str(r#"{"physical_devices": [0, 63]}"#, None).unwrap();
        assert_eq!(c.physical_devices, Some(vec![0, 63]));
    }

    #[test]
    fn base_port_values_are_checked() {
        for (text, needle) in [
            (r#"{"base_port": "17000"}"#, "expected a port number"),
            (r#"{"base_port": 70000}"#, "expected a port number"),
            (r#"{"base_port": {"prefil": 1}}"#, "expected a port number"),
            (r#"{"base_port": {}}"#, "names no role"),
        ] {
            let e = Config::from_json_str(text, None).unwrap_err();
            assert!(e.message().contains("`base_port`") && e.message().contains(needle), "{text}: {e}");
        }
        let back =
            serde_json::to_value(Config::from_json_str(r#"{"base_port": {"decode": 9}}"#, None).unwrap()).unwrap();
        assert_eq!(back["base_port"], serde_json::json!({"decode": 9}));
    }

    #[test]
    fn port_offset_segment_names() {
        let name = |text: &str, rank: Option<u32>| {
            let mut c = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap();
            if let Some(r) = rank {
                c.set_local_rank(r);
            }
            c.local_segment_name()
        };
        let store = r#"{"local_hostname": "10.0.0.5", "base_port": 17000}"#;
        assert_eq!(name(store, Some(1)).unwrap().as_deref(), Some("10.0.0.5:17001"));
        assert_eq!(
            name(r#"{"local_hostname": "fe80::1", "base_port": 17000}"#, Some(2)).unwrap().as_deref(),
            Some("[fe80::1]:17002")
        );
        assert_eq!(
            name(r#"{"local_hostname": "[::1]", "base_port": 17000}"#, Some(0)).unwrap().as_deref(),
            Some("[::1]:17000")
        );
        let e = name(store, None).unwrap_err();
        assert!(e.message().contains("`base_port`") && e.message().contains("local rank is unknown"), "{e}");
        let e = name(r#"{"local_hostname": "10.0.0.5:16000", "base_port": 17000}"#, Some(1)).unwrap_err();
        assert!(
            e.message().contains("`local_hostname`") && e.message().contains("has a port, but base_port is set"),
            "{e}"
        );
        let e = name(r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "rpc_port": 15000}"#, Some(1)).unwrap_err();
        assert!(e.message().contains("`rpc_port`") && e.message().contains("remove it"), "{e}");
        let mut c = Config::from_json_str(store, None).unwrap();
        c.apply_env(|k| match k {
            "FERRY_RPC_PORT" => Some("18000".to_owned()),
            "LOCAL_RANK" => Some("0".to_owned()),
            _ => None,
        })
        .unwrap();
        let e = c.fix_segment_name().unwrap_err();
        assert!(
            e.message().contains("field `rpc_port` (from environment variable FERRY_RPC_PORT)")
                && e.message().contains("every rank would bind the same port; remove it"),
            "{e}"
        );
        // Without base_port a fixed port is fine (one rank per config).
        let solo = name(r#"{"local_hostname": "10.0.0.5:17000", "rpc_port": 18000}"#, Some(1));
        assert_eq!(solo.unwrap().as_deref(), Some("10.0.0.5:17000"));
        let e = name(r#"{"base_port": 17000}"#, Some(1)).unwrap_err();
        assert!(e.message().contains("needs this host's name"), "{e}");
        let e = name(r#"{"local_hostname": "10.0.0.5", "base_port": 65535}"#, Some(1)).unwrap_err();
        assert!(e.message().contains("past 65535"), "{e}");
        let e = name(r#"{"local_hostname": "10.0.0.5:1:npu_x"}"#, None).unwrap_err();
        assert!(
            e.message().contains("/m.json")
                && e.message().contains("`local_hostname`")
                && e.message().contains("npu_x"),
            "{e}"
        );
        assert_eq!(
            name(r#"{"local_hostname": "10.0.0.5:1:npu_3"}"#, None).unwrap().as_deref(),
            Some("10.0.0.5:1:npu_3")
        );

        // Fixing the name makes it the config's local_hostname, once.
        let mut c = Config::from_json_str(store, None).unwrap();
        c.set_local_rank(4);
        assert_eq!(c.fix_segment_name().unwrap().as_deref(), Some("10.0.0.5:17004"));
        assert_eq!(c.local_hostname.as_deref(), Some("10.0.0.5:17004"));
        assert_eq!(c.fix_segment_name().unwrap().as_deref(), Some("10.0.0.5:17004"));
        assert_eq!(c.local_segment_name().unwrap().as_deref(), Some("10.0.0.5:17004"));
    }

    #[test]
    fn local_rank_env_applies_unless_set_through_the_api() {
        let env = |k: &str| (k == "LOCAL_RANK").then(|| "5".to_owned());
        let mut c = Config::from_json_str(r#"{"local_rank": 1}"#, None).unwrap();
        c.apply_local_rank_env(env).unwrap();
        assert_eq!(c.local_rank(), Some(5), "the environment overrides the file");
        let mut c = Config::default();
        c.set_local_rank(2);
        c.apply_local_rank_env(env).unwrap();
        assert_eq!(c.local_rank(), Some(2), "the API wins");
        let mut c = Config::default();
        c.apply_local_rank_env(|k| match k {
            "LOCAL_RANK" => Some("5".to_owned()),
            "FERRY_PROTOCOL" => Some("tcp".to_owned()),
            _ => None,
        })
        .unwrap();
        assert_eq!((c.local_rank(), c.protocol.as_deref()), (Some(5), None), "only the rank is applied");
        let e = Config::default().apply_local_rank_env(|k| (k == "FERRY_LOCAL_RANK").then(|| "x".to_owned()));
        assert!(e.unwrap_err().message().contains("FERRY_LOCAL_RANK=\"x\""));
        let mut c = Config::from_json_str(r#"{"local_hostname": "h", "base_port": {"decode": 1}}"#, None).unwrap();
        c.apply_env(|k| (k == "FERRY_LOCAL_RANK").then(|| "0".to_owned())).unwrap();
        let e = c.local_segment_name().unwrap_err();
        assert!(e.message().contains("`role`"), "{e}");
        let e = c.field_error("local_rank", "bad");
        assert!(e.message().contains("environment variable FERRY_LOCAL_RANK"), "{e}");
    }

    #[test]
    fn mc_force_tcp_selects_tcp_whatever_its_value_and_ferry_protocol_wins() {
        for value in ["1", "true", "0", ""] {
            let mut c = Config::from_json_str(r#"{"protocol": "rdma"}"#, None).unwrap();
            c.apply_env(|k| (k == FORCE_TCP_ENV).then(|| value.to_owned())).unwrap();
            assert_eq!(c.protocol(), "tcp", "MC_FORCE_TCP={value:?}");
            assert_eq!(c.sources.get("protocol"), Some(&FieldSource::Env(FORCE_TCP_ENV)));
        }
        let mut c = Config::from_json_str(r#"{"protocol": "rdma"}"#, None).unwrap();
        c.apply_env(|k| match k {
            FORCE_TCP_ENV => Some("1".to_owned()),
            "FERRY_PROTOCOL" => Some("local".to_owned()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.protocol(), "local", "FERRY_PROTOCOL wins");
        let mut c = Config::from_json_str(r#"{"protocol": "rdma"}"#, None).unwrap();
        c.apply_env(|_| None).unwrap();
        assert_eq!(c.protocol(), "rdma", "unset: untouched");
    }

    #[test]
    fn numeric_fields_are_range_checked_in_the_file_and_in_the_environment() {
        for (text, needle) in [
            (
                r#"{"transfer_timeout_ms": 0}"#,
                "field `transfer_timeout_ms` at line 1 column 2: is 0; expected 1 to 86400000 milliseconds",
            ),
            (r#"{"transfer_timeout_ms": 86400001}"#, "is 86400001; expected 1 to 86400000 milliseconds"),
            (r#"{"local_rank": 1024}"#, "field `local_rank` at line 1 column 2: is 1024; expected 0 to 1023"),
            (r#"{"base_port": 0}"#, "field `base_port` at line 1 column 2: is 0; expected 1 to 65535"),
            (r#"{"base_port": {"prefill": 17000, "decode": 0}}"#, "is 0; expected 1 to 65535"),
            (r#"{"rpc_port": 65536}"#, "field `rpc_port`"),
            (r#"{"global_segment_size": "16EB"}"#, "unknown unit"),
            (r#"{"global_segment_size": "16384PB"}"#, "unknown unit"),
            (r#"{"global_segment_size": "17179869184GB"}"#, "out of range"),
        ] {
            let e = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.message().contains("/m.json") && e.message().contains(needle), "{text}: {e}");
        }
        let ok = r#"{"transfer_timeout_ms": 1, "local_rank": 1023, "base_port": 65000, "rpc_port": 0,
                     "global_segment_size": 0, "local_buffer_size": "17179869183GB"}"#;
        let c = Config::from_json_str(ok, None).unwrap();
        assert_eq!(c.transfer_timeout(), Duration::from_millis(1));
        assert_eq!(ByteSize::parse("16777216TB").unwrap_err(), "size \"16777216TB\" is out of range");
        for (var, value, needle) in [
            (
                "FERRY_TRANSFER_TIMEOUT_MS",
                "0",
                "field `transfer_timeout_ms` (from environment variable FERRY_TRANSFER_TIMEOUT_MS): is 0; expected 1 to 86400000 milliseconds",
            ),
            (
                "FERRY_TRANSFER_TIMEOUT_MS",
                "soon",
                "FERRY_TRANSFER_TIMEOUT_MS=\"soon\": not a whole number of milliseconds (1 to 86400000)",
            ),
            (
                "FERRY_LOCAL_RANK",
                "4096",
                "field `local_rank` (from environment variable FERRY_LOCAL_RANK): is 4096; expected 0 to 1023",
            ),
            (
                "FERRY_BASE_PORT",
                "0",
                "field `base_port` (from environment variable FERRY_BASE_PORT): is 0; expected 1 to 65535",
            ),
            ("FERRY_RPC_PORT", "70000", "FERRY_RPC_PORT=\"70000\": not a port number (0 to 65535; 0: a free port)"),
        ] {
            let e = Config::default().apply_env(|k| (k == var).then(|| value.to_owned())).unwrap_err();
            assert!(e.message().contains(needle), "{var}={value}: {e}");
        }
    }

    #[test]
    fn local_transport_is_on_by_default_and_turned_off_by_the_field_or_the_variable() {
        assert!(Config::default().local_transport());
        assert!(Config::embedded().local_transport());
        let c = Config::from_json_str(r#"{"protocol": "tcp", "local_transport": false}"#, None).unwrap();
        assert!(!c.local_transport());
        assert!(Config::core_fields().contains(&"local_transport"));
        for (value, on) in [("0", false), ("off", false), ("False", false), ("no", false), ("1", true), ("yes", true)] {
            let mut c = Config::from_json_str(r#"{"protocol": "tcp"}"#, None).unwrap();
            c.apply_env(|k| (k == LOCAL_TRANSPORT_ENV).then(|| value.to_owned())).unwrap();
            assert_eq!(c.local_transport(), on, "{LOCAL_TRANSPORT_ENV}={value}");
            assert_eq!(c.source_of("local_transport"), Some(&FieldSource::Env(LOCAL_TRANSPORT_ENV)));
        }
        let e = Config::from_json_str(r#"{"protocol": "tcp"}"#, None)
            .unwrap()
            .apply_env(|k| (k == LOCAL_TRANSPORT_ENV).then(|| "maybe".to_owned()))
            .unwrap_err();
        assert!(e.message().contains("FERRY_LOCAL_TRANSPORT=\"maybe\": expected 1 or 0"), "{e}");
        let e = Config::from_json_str(r#"{"local_transport": "no"}"#, None).unwrap_err();
        assert!(e.message().contains("field `local_transport`") && e.message().contains("expected a boolean"), "{e}");
    }

    #[test]
    fn leaving_out_the_local_transport_while_it_is_the_protocol_is_refused_naming_both() {
        let e = Config::from_json_str(r#"{"protocol": "local", "local_transport": false}"#, Some(Path::new("/m.json")))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("/m.json: field `local_transport` at line 1 column 23: is false"), "{e}");
        assert!(e.message().contains("the protocol is `local` (config field `protocol` in /m.json)"), "{e}");
        // The embedded default's protocol is `local`: the variable alone names itself.
        let e = Config::discover_with(|k| (k == LOCAL_TRANSPORT_ENV).then(|| "0".to_owned())).unwrap_err();
        assert!(
            e.message().contains("field `local_transport` (from environment variable FERRY_LOCAL_TRANSPORT)"),
            "{e}"
        );
        assert!(e.message().contains("set `protocol` (or FERRY_PROTOCOL)"), "{e}");
        let env = |k: &str| match k {
            "FERRY_LOCAL_TRANSPORT" => Some("0".to_owned()),
            "FERRY_PROTOCOL" => Some("tcp".to_owned()),
            _ => None,
        };
        assert!(!Config::discover_with(env).unwrap().local_transport());
    }

    #[test]
    fn metrics_addr_is_an_ip_and_port_from_the_file_or_the_environment() {
        let c = Config::from_json_str(r#"{"metrics_addr": "127.0.0.1:9464"}"#, None).unwrap();
        assert_eq!(c.metrics_addr(), Some("127.0.0.1:9464".parse().unwrap()));
        assert!(Config::core_fields().contains(&"metrics_addr"));
        let mut c = Config::default();
        c.apply_env(|k| (k == METRICS_ADDR_ENV).then(|| "0.0.0.0:0".to_owned())).unwrap();
        assert_eq!(c.metrics_addr().map(|a| a.port()), Some(0));
        assert_eq!(c.source_of("metrics_addr"), Some(&FieldSource::Env(METRICS_ADDR_ENV)));
        let e = Config::default().apply_env(|k| (k == METRICS_ADDR_ENV).then(|| "localhost".to_owned())).unwrap_err();
        assert!(
            e.message().contains("FERRY_METRICS_ADDR") && e.message().contains("expected an IP address and port"),
            "{e}"
        );
        let e = Config::from_json_str(r#"{"metrics_addr": ":9464"}"#, None).unwrap_err();
        assert!(e.message().contains("metrics_addr"), "{e}");
        assert_eq!(Config::default().metrics_addr(), None);
    }
}

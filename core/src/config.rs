//! Configuration: Mooncake's `mooncake.json` in both the connector and the store style
//! (reference `mooncake-wire.md` §7), found through `MOONCAKE_CONFIG_PATH` or a path, with
//! environment overrides.
//!
//! Every error names the file, the field and its position (line and column), so a user can go
//! straight to the mistake. Unknown fields are kept (and reported by `ferry doctor`), never
//! silently dropped.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Environment variable naming the config file (Mooncake's).
pub const CONFIG_PATH_ENV: &str = "MOONCAKE_CONFIG_PATH";
/// Environment variable giving the metadata cluster id (Mooncake's).
pub const CLUSTER_ID_ENV: &str = "MC_METADATA_CLUSTER_ID";

/// Environment overrides: variable name, config field it overrides.
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("FERRY_LOCAL_HOSTNAME", "local_hostname"),
    ("FERRY_METADATA_SERVER", "metadata_server"),
    ("FERRY_PROTOCOL", "protocol"),
    ("FERRY_DEVICE_NAME", "device_name"),
    ("FERRY_ROLE", "role"),
    ("FERRY_TRANSFER_TIMEOUT_MS", "transfer_timeout_ms"),
    ("FERRY_TCP_LANES", "tcp_lanes"),
    ("FERRY_TCP_DATA_PORT", "tcp_data_port"),
    ("FERRY_RPC_PORT", "rpc_port"),
    (CLUSTER_ID_ENV, "cluster_id"),
];

/// Default protocol when neither the file nor the environment names one (Mooncake's default).
pub const DEFAULT_PROTOCOL: &str = "tcp";
/// Default per-transfer timeout.
pub const DEFAULT_TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

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
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
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
    /// TCP transport: persistent connections per peer (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_lanes: Option<u32>,
    /// TCP transport: data port to listen on (default: any free port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_data_port: Option<u16>,
    /// P2P handshake: RPC port to listen on (default: the port in `local_hostname`, else a free
    /// port in 15000..17000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpc_port: Option<u16>,
    /// Transport plugins: paths of `libferry_transport_<protocol>.so` files or of directories
    /// holding them, searched (before `FERRY_PLUGIN_DIR`) when a protocol is not built in. A
    /// relative path is relative to the config file's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugins: Option<Vec<String>>,
    /// Fields Ferry does not know. Kept so nothing is lost; `ferry doctor` lists them.
    #[serde(flatten, skip_deserializing)]
    pub extra: Map<String, Value>,
    #[serde(skip)]
    origin: Origin,
    #[serde(skip)]
    sources: BTreeMap<&'static str, FieldSource>,
}

const KNOWN_FIELDS: &[&str] = &[
    "local_hostname",
    "metadata_server",
    "metadata_backend",
    "protocol",
    "device_name",
    "prefill_url",
    "decode_url",
    "role",
    "master_server_address",
    "global_segment_size",
    "local_buffer_size",
    "transfer_timeout_ms",
    "cluster_id",
    "tcp_lanes",
    "tcp_data_port",
    "rpc_port",
    "plugins",
];

impl Config {
    /// The embedded default: no file, in-process metadata, the `local` transport.
    pub fn embedded() -> Self {
        let mut c = Config { protocol: Some("local".into()), ..Config::default() };
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
        cfg.extra = crate::descriptor::unknown_fields(&value, KNOWN_FIELDS);
        let source = path.map(|p| FieldSource::File(p.to_owned())).unwrap_or(FieldSource::Inline);
        cfg.origin = Origin { path: path.map(Path::to_owned), text: Some(text.to_owned()) };
        let present: Vec<&'static str> = KNOWN_FIELDS.iter().copied().filter(|f| cfg.is_set(f)).collect();
        for f in present {
            cfg.sources.insert(f, source.clone());
        }
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

    /// Applies the [`ENV_OVERRIDES`]; an empty variable counts as unset.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        for &(var, field) in ENV_OVERRIDES {
            let Some(value) = env(var).filter(|v| !v.is_empty()) else { continue };
            let bad = |msg: String| Error::config(format!("environment variable {var}={value:?}: {msg}"));
            match field {
                "local_hostname" => self.local_hostname = Some(value.clone()),
                "metadata_server" => self.metadata_server = Some(value.clone()),
                "protocol" => self.protocol = Some(value.clone()),
                "device_name" => self.device_name = Some(value.clone()),
                "role" => self.role = Some(value.parse().map_err(|e: Error| bad(e.message().to_owned()))?),
                "transfer_timeout_ms" => {
                    self.transfer_timeout_ms =
                        Some(value.parse().map_err(|_| bad("not a whole number of milliseconds".into()))?)
                }
                "cluster_id" => self.cluster_id = Some(value.clone()),
                "tcp_lanes" => self.tcp_lanes = Some(value.parse().map_err(|_| bad("not a whole number".into()))?),
                "tcp_data_port" => {
                    self.tcp_data_port = Some(value.parse().map_err(|_| bad("not a port number".into()))?)
                }
                "rpc_port" => self.rpc_port = Some(value.parse().map_err(|_| bad("not a port number".into()))?),
                _ => unreachable!("ENV_OVERRIDES names only known fields"),
            }
            self.sources.insert(field, FieldSource::Env(var));
        }
        Ok(())
    }

    fn is_set(&self, field: &str) -> bool {
        match field {
            "local_hostname" => self.local_hostname.is_some(),
            "metadata_server" => self.metadata_server.is_some(),
            "metadata_backend" => self.metadata_backend.is_some(),
            "protocol" => self.protocol.is_some(),
            "device_name" => self.device_name.is_some(),
            "prefill_url" => self.prefill_url.is_some(),
            "decode_url" => self.decode_url.is_some(),
            "role" => self.role.is_some(),
            "master_server_address" => self.master_server_address.is_some(),
            "global_segment_size" => self.global_segment_size.is_some(),
            "local_buffer_size" => self.local_buffer_size.is_some(),
            "transfer_timeout_ms" => self.transfer_timeout_ms.is_some(),
            "cluster_id" => self.cluster_id.is_some(),
            "tcp_lanes" => self.tcp_lanes.is_some(),
            "tcp_data_port" => self.tcp_data_port.is_some(),
            "rpc_port" => self.rpc_port.is_some(),
            "plugins" => self.plugins.is_some(),
            _ => false,
        }
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
        let base = self.origin.path.as_deref().and_then(Path::parent);
        self.plugins
            .iter()
            .flatten()
            .map(|p| {
                let p = Path::new(p);
                match base {
                    Some(dir) if p.is_relative() => dir.join(p),
                    _ => p.to_owned(),
                }
            })
            .collect()
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
    pub fn local_segment_name(&self) -> Result<Option<String>> {
        if let Some(h) = &self.local_hostname {
            if h.trim().is_empty() {
                return Err(self.field_error("local_hostname", "is empty"));
            }
            return Ok(Some(h.trim().to_owned()));
        }
        match (self.role, &self.prefill_url, &self.decode_url) {
            (Some(Role::Prefill), Some(u), _) | (Some(Role::Decode), _, Some(u)) => Ok(Some(u.trim().to_owned())),
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
        let from_env = ENV_OVERRIDES
            .iter()
            .find(|(_, f)| *f == field)
            .filter(|(v, _)| self.sources.get(field) == Some(&FieldSource::Env(v)));
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

/// Removes serde_json's trailing " at line L column C" (the caller reports the position).
pub(crate) fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) if msg[i..].contains(" column ") => msg[..i].to_owned(),
        _ => msg.to_owned(),
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
        let c = Config::from_json_str(r#"{"protocol":"tcp","rdma_devices":"mlx5_0"}"#, None).unwrap();
        assert_eq!(c.unknown_fields(), vec!["rdma_devices"]);
        let back = serde_json::to_value(&c).unwrap();
        assert_eq!(back["rdma_devices"], "mlx5_0");
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
}

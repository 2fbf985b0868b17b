//! The `rank_table` link: HCCL rank tables (v1.0, v1.2) and vllm-ascend's prefill/decode
//! variant.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use serde_json::{Map, Value, json};

use ferry_core::{
    Config, DEVICE_ID_LIMIT, Environment, Error, Identity, IdentityField, ResolveQuery, Result, Role, SegmentName,
    SegmentResolver,
};

use crate::env::{VISIBLE_DEVICES_ENV, parse_visible_devices};
use crate::options::{AscendOptions, RANK_TABLE_PATH};

/// vllm-ascend's variable naming its prefill/decode rank table.
pub const RANK_TABLE_ENV: &str = "DISAGGREGATED_PREFILL_RANK_TABLE_PATH";

/// A validated rank table: `status` was `"completed"` and every field Ferry reads was present
/// and well formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankTable {
    /// HCCL's form: `server_list[].device[]`.
    Hccl(HcclRankTable),
    /// vllm-ascend's disaggregated-prefill form: `prefill_device_list`, `decode_device_list`.
    Disaggregated(DisaggregatedRankTable),
}

/// HCCL rank table, version `"1.0"` or `"1.2"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcclRankTable {
    /// `version`: `"1.0"` or `"1.2"`.
    pub version: String,
    /// `server_list`, in file order.
    pub servers: Vec<HcclServer>,
}

/// One `server_list` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcclServer {
    /// `server_id` (normally the host's IP).
    pub server_id: String,
    /// `host_ip`, when given.
    pub host_ip: Option<String>,
    /// `device`, in file order.
    pub devices: Vec<HcclDevice>,
}

/// One `server_list[].device[]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcclDevice {
    /// `device_id`: the physical NPU id.
    pub device_id: u32,
    /// `device_ip`: the device NIC's IP.
    pub device_ip: String,
    /// `device_port`, when given.
    pub device_port: Option<u16>,
    /// `rank_id`.
    pub rank_id: u32,
    /// `super_device_id` (v1.2), when given.
    pub super_device_id: Option<String>,
}

/// vllm-ascend's disaggregated-prefill rank table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DisaggregatedRankTable {
    /// `version`, when given.
    pub version: Option<String>,
    /// `prefill_device_list`, when given.
    pub prefill: Option<Vec<DisaggregatedDevice>>,
    /// `decode_device_list`, when given.
    pub decode: Option<Vec<DisaggregatedDevice>>,
}

/// One entry of `prefill_device_list` or `decode_device_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DisaggregatedDevice {
    /// `server_id`: the host's IP.
    pub server_id: String,
    /// `device_id`: the physical NPU id.
    pub device_id: u32,
    /// `device_ip`: the device NIC's IP.
    pub device_ip: String,
    /// `super_pod_id`, when given.
    pub super_pod_id: Option<String>,
    /// `super_device_id`, when given.
    pub super_device_id: Option<String>,
    /// `cluster_id`, when given.
    pub cluster_id: Option<String>,
}

/// One device of a rank table, whichever its form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEntry {
    /// JSON path of the entry (`server_list[0].device[3]`, `decode_device_list[1]`).
    pub path: String,
    /// The list it is in, for the prefill/decode form.
    pub role: Option<Role>,
    /// `server_id`.
    pub server_id: String,
    /// `host_ip`, when given.
    pub host_ip: Option<String>,
    /// `device_id`: the physical NPU id.
    pub device_id: u32,
    /// `device_ip`.
    pub device_ip: String,
    /// `device_port`, when given.
    pub device_port: Option<u16>,
    /// `rank_id` (HCCL form).
    pub rank_id: Option<u32>,
}

impl RankEntry {
    fn is_on(&self, host: &str) -> bool {
        self.server_id == host || self.host_ip.as_deref() == Some(host)
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b} (a boolean)"),
        Value::Number(n) => format!("{n} (a number)"),
        Value::String(s) => format!("{s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() { key.to_owned() } else { format!("{parent}.{key}") }
}

/// Field readers that name the file and the JSON path in every error.
struct Reader<'a> {
    origin: &'a str,
}

impl Reader<'_> {
    fn err(&self, path: &str, msg: impl fmt::Display) -> Error {
        Error::config(format!("rank table {}: `{path}` {msg}", self.origin))
    }

    fn object<'v>(&self, v: &'v Value, path: &str, what: &str) -> Result<&'v Map<String, Value>> {
        v.as_object().ok_or_else(|| self.err(path, format!("is {}; expected an object ({what})", describe(v))))
    }

    fn array<'v>(&self, obj: &'v Map<String, Value>, parent: &str, key: &str, what: &str) -> Result<&'v [Value]> {
        let path = join(parent, key);
        match obj.get(key) {
            None => Err(self.err(&path, format!("is missing; expected an array of {what}"))),
            Some(Value::Array(a)) => Ok(a),
            Some(v) => Err(self.err(&path, format!("is {}; expected an array of {what}", describe(v)))),
        }
    }

    fn opt_string<'v>(
        &self,
        obj: &'v Map<String, Value>,
        parent: &str,
        key: &str,
        what: &str,
    ) -> Result<Option<&'v str>> {
        match obj.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(&join(parent, key), format!("is {}; expected a string ({what})", describe(v)))),
        }
    }

    fn string<'v>(&self, obj: &'v Map<String, Value>, parent: &str, key: &str, what: &str) -> Result<&'v str> {
        match self.opt_string(obj, parent, key, what)? {
            None => Err(self.err(&join(parent, key), format!("is missing; expected a string ({what})"))),
            Some("") => Err(self.err(&join(parent, key), format!("is empty; expected {what}"))),
            Some(s) => Ok(s),
        }
    }

    fn opt_number<T: std::str::FromStr>(
        &self,
        obj: &Map<String, Value>,
        parent: &str,
        key: &str,
        what: &str,
    ) -> Result<Option<T>> {
        let Some(s) = self.opt_string(obj, parent, key, what)? else { return Ok(None) };
        let path = join(parent, key);
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.err(&path, format!("is {s:?}; expected a string of digits ({what}), e.g. \"0\"")));
        }
        s.parse().map(Some).map_err(|_| self.err(&path, format!("is {s:?}, out of range for {what}")))
    }

    fn number<T: std::str::FromStr>(&self, obj: &Map<String, Value>, parent: &str, key: &str, what: &str) -> Result<T> {
        self.opt_number(obj, parent, key, what)?
            .ok_or_else(|| self.err(&join(parent, key), format!("is missing; expected a string of digits ({what})")))
    }

    fn device_id(&self, obj: &Map<String, Value>, parent: &str) -> Result<u32> {
        let id: u32 = self.number(obj, parent, "device_id", "the physical NPU id")?;
        if id >= DEVICE_ID_LIMIT {
            return Err(self.err(
                &join(parent, "device_id"),
                format!("is \"{id}\"; expected a device id below {DEVICE_ID_LIMIT}"),
            ));
        }
        Ok(id)
    }

    fn ip(&self, obj: &Map<String, Value>, parent: &str, key: &str, what: &str) -> Result<String> {
        let s = self.string(obj, parent, key, what)?;
        if s.parse::<std::net::IpAddr>().is_err() {
            return Err(self.err(&join(parent, key), format!("is {s:?}; expected an IP address ({what})")));
        }
        Ok(s.to_owned())
    }

    /// A string, or (as some generators write ids) a non-negative integer, kept as a string.
    fn opt_id(&self, obj: &Map<String, Value>, parent: &str, key: &str) -> Result<Option<String>> {
        match obj.get(key) {
            Some(Value::Number(n)) if n.is_u64() => Ok(Some(n.to_string())),
            _ => Ok(self.opt_string(obj, parent, key, "an id")?.map(str::to_owned)),
        }
    }
}

/// The device IPs a rank table gave so far, to refuse one given to two cards. Each NPU has a
/// NIC of its own, and HCCL and HIXL reach a peer card by its device IP: two cards with one
/// address would each take the other's traffic, and a transfer to either would wait for a
/// partner that never comes (as `hccn.conf` duplicates do, see [`crate::hccn`]). The
/// unspecified address (`0.0.0.0`, `::`), which some generators write for cards without a
/// NIC, may repeat.
#[derive(Default)]
struct DeviceIps(HashMap<std::net::IpAddr, String>);

impl DeviceIps {
    /// Records `ip` (already checked to be an IP) as the address of the device at `path`, or
    /// errors naming both devices when another has it.
    fn claim(&mut self, r: &Reader<'_>, ip: &str, path: &str) -> Result<()> {
        let Ok(addr) = ip.parse::<std::net::IpAddr>() else { return Ok(()) };
        if addr.is_unspecified() {
            return Ok(());
        }
        if let Some(first) = self.0.get(&addr) {
            return Err(r.err(path, format!("{ip:?} is also `{first}`: every card needs a device IP of its own")));
        }
        self.0.insert(addr, path.to_owned());
        Ok(())
    }
}

impl RankTable {
    /// Parses and validates rank-table JSON; `origin` (the file) names the source in errors,
    /// which also give the JSON path of the field and what was expected.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            Error::config(format!(
                "rank table {origin}: not valid JSON at line {} column {}: {}",
                e.line(),
                e.column(),
                strip_position(&e.to_string())
            ))
        })?;
        let r = Reader { origin };
        let top = value.as_object().ok_or_else(|| {
            Error::config(format!("rank table {origin}: is {}; expected a JSON object", describe(&value)))
        })?;
        match top.get("status") {
            Some(Value::String(s)) if s == "completed" => {}
            None => return Err(r.err("status", "is missing; expected \"completed\"")),
            Some(v) => {
                return Err(r.err(
                    "status",
                    format!("is {}; expected \"completed\" (the table is not ready until then)", describe(v)),
                ));
            }
        }
        let hccl = top.contains_key("server_list");
        let disaggregated = top.contains_key("prefill_device_list") || top.contains_key("decode_device_list");
        match (hccl, disaggregated) {
            (true, false) => Self::parse_hccl(&r, top).map(RankTable::Hccl),
            (false, true) => Self::parse_disaggregated(&r, top).map(RankTable::Disaggregated),
            (true, true) => Err(Error::config(format!(
                "rank table {origin}: has both `server_list` and `prefill_device_list`/`decode_device_list`; \
                 expected one form"
            ))),
            (false, false) => Err(Error::config(format!(
                "rank table {origin}: has neither `server_list` (an HCCL rank table) nor \
                 `prefill_device_list`/`decode_device_list` (vllm-ascend's prefill/decode table)"
            ))),
        }
    }

    fn parse_hccl(r: &Reader<'_>, top: &Map<String, Value>) -> Result<HcclRankTable> {
        let version = r.string(top, "", "version", "the rank table version")?;
        if version != "1.0" && version != "1.2" {
            return Err(r.err("version", format!("is {version:?}; expected \"1.0\" or \"1.2\"")));
        }
        let count: u32 = r.number(top, "", "server_count", "the number of servers")?;
        let list = r.array(top, "", "server_list", "servers")?;
        if list.is_empty() {
            return Err(r.err("server_list", "is empty; expected at least one server"));
        }
        if count as usize != list.len() {
            return Err(r.err(
                "server_count",
                format!("is \"{count}\" but `server_list` has {} server(s); expected them to match", list.len()),
            ));
        }
        let mut servers: Vec<HcclServer> = Vec::new();
        let mut ranks: Vec<(u32, String)> = Vec::new();
        let mut ips = DeviceIps::default();
        for (i, s) in list.iter().enumerate() {
            let path = format!("server_list[{i}]");
            let obj = r.object(s, &path, "a server")?;
            let server_id = r.string(obj, &path, "server_id", "the server's id, normally its IP")?.to_owned();
            if let Some(j) = servers.iter().position(|s| s.server_id == server_id) {
                return Err(
                    r.err(&join(&path, "server_id"), format!("{server_id:?} repeats server_list[{j}].server_id"))
                );
            }
            let host_ip = match obj.get("host_ip") {
                None => None,
                Some(_) => Some(r.ip(obj, &path, "host_ip", "the host's IP")?),
            };
            let devs = r.array(obj, &path, "device", "devices")?;
            if devs.is_empty() {
                return Err(r.err(&join(&path, "device"), "is empty; expected at least one device"));
            }
            let mut devices: Vec<HcclDevice> = Vec::new();
            for (j, d) in devs.iter().enumerate() {
                let dpath = format!("{path}.device[{j}]");
                let dobj = r.object(d, &dpath, "a device")?;
                let device_id = r.device_id(dobj, &dpath)?;
                if let Some(k) = devices.iter().position(|d| d.device_id == device_id) {
                    return Err(
                        r.err(&join(&dpath, "device_id"), format!("\"{device_id}\" repeats {path}.device[{k}]"))
                    );
                }
                let device_ip = r.ip(dobj, &dpath, "device_ip", "the device NIC's IP")?;
                ips.claim(r, &device_ip, &join(&dpath, "device_ip"))?;
                let device_port = r.opt_number(dobj, &dpath, "device_port", "a port")?;
                let rank_id: u32 = r.number(dobj, &dpath, "rank_id", "the rank")?;
                if let Some((_, other)) = ranks.iter().find(|(rk, _)| *rk == rank_id) {
                    return Err(r.err(&join(&dpath, "rank_id"), format!("\"{rank_id}\" repeats {other}")));
                }
                ranks.push((rank_id, dpath.clone()));
                let super_device_id = r.opt_string(dobj, &dpath, "super_device_id", "the super device id")?;
                devices.push(HcclDevice {
                    device_id,
                    device_ip,
                    device_port,
                    rank_id,
                    super_device_id: super_device_id.map(str::to_owned),
                });
            }
            servers.push(HcclServer { server_id, host_ip, devices });
        }
        let n = ranks.len() as u32;
        if let Some(missing) = (0..n).find(|k| !ranks.iter().any(|(rk, _)| rk == k)) {
            return Err(r.err(
                "server_list[].device[].rank_id",
                format!("has no rank {missing}; expected the {n} devices to have ranks 0 to {} once each", n - 1),
            ));
        }
        Ok(HcclRankTable { version: version.to_owned(), servers })
    }

    fn parse_disaggregated(r: &Reader<'_>, top: &Map<String, Value>) -> Result<DisaggregatedRankTable> {
        let version = r.opt_string(top, "", "version", "the rank table version")?.map(str::to_owned);
        let mut seen: Vec<(String, u32, String)> = Vec::new();
        let mut ips = DeviceIps::default();
        let mut list = |key: &str| -> Result<Option<Vec<DisaggregatedDevice>>> {
            if !top.contains_key(key) {
                return Ok(None);
            }
            let mut out = Vec::new();
            for (i, d) in r.array(top, "", key, "devices")?.iter().enumerate() {
                let path = format!("{key}[{i}]");
                let obj = r.object(d, &path, "a device")?;
                let server_id = r.string(obj, &path, "server_id", "the host's IP")?.to_owned();
                let device_id = r.device_id(obj, &path)?;
                if let Some((_, _, other)) = seen.iter().find(|(s, dv, _)| *s == server_id && *dv == device_id) {
                    return Err(r.err(
                        &path,
                        format!("names device {device_id} of server {server_id:?} again (first in {other})"),
                    ));
                }
                seen.push((server_id.clone(), device_id, path.clone()));
                let device_ip = r.ip(obj, &path, "device_ip", "the device NIC's IP")?;
                ips.claim(r, &device_ip, &join(&path, "device_ip"))?;
                out.push(DisaggregatedDevice {
                    server_id,
                    device_id,
                    device_ip,
                    super_pod_id: r.opt_id(obj, &path, "super_pod_id")?,
                    super_device_id: r.opt_id(obj, &path, "super_device_id")?,
                    cluster_id: r.opt_id(obj, &path, "cluster_id")?,
                });
            }
            Ok(Some(out))
        };
        let prefill = list("prefill_device_list")?;
        let decode = list("decode_device_list")?;
        Ok(DisaggregatedRankTable { version, prefill, decode })
    }

    /// Reads and parses the rank table at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::config(format!("rank table {} cannot be read: {e}", path.display())).with_source(e))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The table as JSON, in its own form (every value a string, `status` `"completed"`).
    pub fn to_json(&self) -> Value {
        match self {
            RankTable::Hccl(t) => {
                let servers: Vec<Value> = t
                    .servers
                    .iter()
                    .map(|s| {
                        let devices: Vec<Value> = s
                            .devices
                            .iter()
                            .map(|d| {
                                let mut o = json!({
                                    "device_id": d.device_id.to_string(),
                                    "device_ip": d.device_ip,
                                    "rank_id": d.rank_id.to_string(),
                                });
                                if let Some(p) = d.device_port {
                                    o["device_port"] = json!(p.to_string());
                                }
                                if let Some(sd) = &d.super_device_id {
                                    o["super_device_id"] = json!(sd);
                                }
                                o
                            })
                            .collect();
                        let mut o = json!({"server_id": s.server_id, "device": devices});
                        if let Some(h) = &s.host_ip {
                            o["host_ip"] = json!(h);
                        }
                        o
                    })
                    .collect();
                json!({
                    "status": "completed",
                    "version": t.version,
                    "server_count": t.servers.len().to_string(),
                    "server_list": servers,
                })
            }
            RankTable::Disaggregated(t) => {
                let list = |l: &[DisaggregatedDevice]| -> Value {
                    l.iter()
                        .map(|d| {
                            let mut o = json!({
                                "server_id": d.server_id,
                                "device_id": d.device_id.to_string(),
                                "device_ip": d.device_ip,
                            });
                            for (k, v) in [
                                ("super_pod_id", &d.super_pod_id),
                                ("super_device_id", &d.super_device_id),
                                ("cluster_id", &d.cluster_id),
                            ] {
                                if let Some(v) = v {
                                    o[k] = json!(v);
                                }
                            }
                            o
                        })
                        .collect()
                };
                let mut o = json!({"status": "completed"});
                if let Some(v) = &t.version {
                    o["version"] = json!(v);
                }
                if let Some(p) = &t.prefill {
                    o["prefill_device_list"] = list(p);
                }
                if let Some(d) = &t.decode {
                    o["decode_device_list"] = list(d);
                }
                o
            }
        }
    }

    /// Every device entry, in file order (for the prefill/decode form: prefill then decode).
    pub fn entries(&self) -> Vec<RankEntry> {
        match self {
            RankTable::Hccl(t) => t
                .servers
                .iter()
                .enumerate()
                .flat_map(|(i, s)| {
                    s.devices.iter().enumerate().map(move |(j, d)| RankEntry {
                        path: format!("server_list[{i}].device[{j}]"),
                        role: None,
                        server_id: s.server_id.clone(),
                        host_ip: s.host_ip.clone(),
                        device_id: d.device_id,
                        device_ip: d.device_ip.clone(),
                        device_port: d.device_port,
                        rank_id: Some(d.rank_id),
                    })
                })
                .collect(),
            RankTable::Disaggregated(t) => {
                [("prefill_device_list", Role::Prefill, &t.prefill), ("decode_device_list", Role::Decode, &t.decode)]
                    .into_iter()
                    .flat_map(|(key, role, list)| {
                        list.iter().flatten().enumerate().map(move |(i, d)| RankEntry {
                            path: format!("{key}[{i}]"),
                            role: Some(role),
                            server_id: d.server_id.clone(),
                            host_ip: None,
                            device_id: d.device_id,
                            device_ip: d.device_ip.clone(),
                            device_port: None,
                            rank_id: None,
                        })
                    })
                    .collect()
            }
        }
    }

    /// A short description of the form (`HCCL v1.0`, `vllm-ascend prefill/decode`).
    pub fn form(&self) -> String {
        match self {
            RankTable::Hccl(t) => format!("HCCL v{}", t.version),
            RankTable::Disaggregated(_) => "vllm-ascend prefill/decode".to_owned(),
        }
    }
}

/// The `rank_table` link.
///
/// For this process: picks this host's entries (`server_id` or `host_ip` equal to the host an
/// earlier link resolved, else the host of the configured segment name; a table with a single
/// server needs no host), in the list of the config's `role` for the prefill/decode form. Then,
/// if an earlier link resolved the physical device, the entry for that device; otherwise, as
/// vllm-ascend does, the entries whose device is in `ASCEND_RT_VISIBLE_DEVICES` (all when it is
/// unset), in file order, indexed by the local rank. Answers physical device, device IP, device
/// port and rank (`rank_id`).
///
/// For a peer: the entry for the peer's host and physical device (both from earlier links);
/// nothing when the table does not list the peer's host.
///
/// Without a table (no `rank_table_path`, `FERRY_RANK_TABLE` or
/// `DISAGGREGATED_PREFILL_RANK_TABLE_PATH`) it answers nothing. A table that cannot be read, is
/// malformed or incomplete, or whose `status` is not `"completed"`, and a host, device or rank
/// with no entry, are errors naming the file, the field and what was expected.
#[derive(Debug, Clone)]
pub struct RankTableResolver {
    path: Option<PathBuf>,
    set_by: String,
    role: Option<Role>,
    env: Environment,
    config_host: Option<String>,
}

impl RankTableResolver {
    /// Reads the table at `path` (`set_by` says who named it, for messages), choosing the
    /// `role` list of a prefill/decode table, filtering by `ASCEND_RT_VISIBLE_DEVICES` in `env`.
    pub fn new(path: impl Into<PathBuf>, set_by: impl Into<String>, role: Option<Role>, env: Environment) -> Self {
        Self { path: Some(path.into()), set_by: set_by.into(), role, env, config_host: None }
    }

    /// The table the config names (`rank_table_path`, `FERRY_RANK_TABLE` in `env`), else the
    /// one `DISAGGREGATED_PREFILL_RANK_TABLE_PATH` names, else none; the config's role and host.
    ///
    /// # Errors
    /// A `rank_table_path` that is not a string (naming the file, field and position).
    pub fn from_config(config: &Config, env: &Environment) -> Result<Self> {
        let (path, set_by) = match AscendOptions::rank_table_path(config, env)? {
            Some(s) => {
                let by = s.describe(&RANK_TABLE_PATH);
                (Some(s.value), by)
            }
            None => match env.get_nonempty(RANK_TABLE_ENV) {
                Some(p) => (Some(PathBuf::from(p)), format!("environment variable {RANK_TABLE_ENV}")),
                None => (None, String::new()),
            },
        };
        let config_host = config.local_segment_name().ok().flatten().and_then(|n| SegmentName::host_of(&n));
        Ok(Self { path, set_by, role: config.role, env: env.clone(), config_host })
    }

    /// The table read, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Who named the table (`environment variable DISAGGREGATED_PREFILL_RANK_TABLE_PATH`, ...).
    pub fn set_by(&self) -> &str {
        &self.set_by
    }

    fn answer(file: &str, e: &RankEntry, how: &str) -> Identity {
        let detail = format!("{file} {} ({how})", e.path);
        Identity {
            physical_device: Some(e.device_id),
            device_ip: Some(e.device_ip.clone()),
            device_port: e.device_port,
            rank: e.rank_id,
            ..Identity::default()
        }
        .with_detail_for_all(&detail)
    }

    fn local(&self, file: &str, table: &RankTable, query: &ResolveQuery, known: &Identity) -> Result<Identity> {
        let all = table.entries();
        let (candidates, list): (Vec<&RankEntry>, &str) = match table {
            RankTable::Hccl(_) => (all.iter().collect(), "server_list"),
            RankTable::Disaggregated(t) => {
                let role = self.role.ok_or_else(|| {
                    Error::config(format!(
                        "rank table {file} is vllm-ascend's prefill/decode form: set `role` (or FERRY_ROLE) to pick \
                         `prefill_device_list` or `decode_device_list`"
                    ))
                })?;
                let (key, present) = match role {
                    Role::Prefill => ("prefill_device_list", t.prefill.is_some()),
                    Role::Decode => ("decode_device_list", t.decode.is_some()),
                };
                if !present {
                    return Err(Error::config(format!(
                        "rank table {file}: `{key}` is missing; expected the devices of this process's role"
                    )));
                }
                (all.iter().filter(|e| e.role == Some(role)).collect(), key)
            }
        };
        let mut servers: Vec<&str> = Vec::new();
        for e in &candidates {
            if !servers.contains(&e.server_id.as_str()) {
                servers.push(&e.server_id);
            }
        }
        let host = known.host.clone().or_else(|| self.config_host.clone());
        let (mine, server): (Vec<&RankEntry>, String) = match &host {
            Some(h) => {
                let mine: Vec<&RankEntry> = candidates.iter().copied().filter(|e| e.is_on(h)).collect();
                if mine.is_empty() {
                    return Err(Error::config(format!(
                        "rank table {file}: no entry of `{list}` has server_id (or host_ip) {h:?}, this host; \
                         servers listed: {servers:?}. Expected this host's IP as server_id (set local_hostname to \
                         it)"
                    )));
                }
                let server = mine[0].server_id.clone();
                (mine, server)
            }
            None if servers.len() == 1 => (candidates.clone(), servers[0].to_owned()),
            None => {
                return Err(Error::config(format!(
                    "rank table {file}: cannot tell which server of `{list}` is this host ({servers:?}): the host is \
                     unknown; set local_hostname to this host's IP"
                )));
            }
        };
        let devices = |es: &[&RankEntry]| es.iter().map(|e| e.device_id).collect::<Vec<u32>>();
        if let Some(phy) = known.physical_device {
            let why = known.details.get(&IdentityField::PhysicalDevice).map(|d| format!(" ({d})")).unwrap_or_default();
            let e = mine.iter().find(|e| e.device_id == phy).ok_or_else(|| {
                Error::config(format!(
                    "rank table {file}: `{list}` has no entry for physical device {phy}{why} on server {server:?}; it \
                     lists devices {:?} for that server",
                    devices(&mine)
                ))
            })?;
            return Ok(Self::answer(file, e, &format!("server {server}, physical device {phy}")));
        }
        let visible = self.env.get(VISIBLE_DEVICES_ENV);
        let (usable, filter_note): (Vec<&RankEntry>, String) = match &visible {
            Some(v) => {
                let ids = parse_visible_devices(v, DEVICE_ID_LIMIT).into_result(v)?;
                let usable = mine.iter().copied().filter(|e| ids.contains(&e.device_id)).collect();
                (usable, format!(" whose device is in {VISIBLE_DEVICES_ENV}={v:?}"))
            }
            None => (mine.clone(), String::new()),
        };
        let (entry, how) = match query.local_rank {
            Some(r) => {
                let e = usable.get(r as usize).ok_or_else(|| {
                    Error::config(format!(
                        "rank table {file}: local rank {r} has no entry: `{list}` lists {} device(s) {:?} for server \
                         {server:?}{filter_note}; expected at least {}",
                        usable.len(),
                        devices(&usable),
                        r + 1
                    ))
                })?;
                (*e, format!("server {server}, local rank {r}"))
            }
            None if usable.len() == 1 => (usable[0], format!("server {server}, its only device")),
            None => {
                return Err(Error::config(format!(
                    "rank table {file}: `{list}` lists {} devices {:?} for server {server:?}{filter_note} and the \
                     local rank is unknown; set LOCAL_RANK or FERRY_LOCAL_RANK",
                    usable.len(),
                    devices(&usable)
                )));
            }
        };
        Ok(Self::answer(file, entry, &how))
    }

    fn peer(file: &str, table: &RankTable, known: &Identity) -> Result<Identity> {
        let (Some(host), Some(phy)) = (&known.host, known.physical_device) else { return Ok(Identity::default()) };
        let all = table.entries();
        let on_host: Vec<&RankEntry> = all.iter().filter(|e| e.is_on(host)).collect();
        if on_host.is_empty() {
            return Ok(Identity::default());
        }
        match on_host.iter().find(|e| e.device_id == phy) {
            Some(e) => Ok(Self::answer(file, e, &format!("peer {host}, physical device {phy}"))),
            None => Err(Error::config(format!(
                "rank table {file} lists server {host:?} but no physical device {phy} on it (it lists {:?}); the \
                 peer's segment name says device {phy}",
                on_host.iter().map(|e| e.device_id).collect::<Vec<_>>()
            ))),
        }
    }
}

#[async_trait]
impl SegmentResolver for RankTableResolver {
    fn name(&self) -> &str {
        "rank_table"
    }

    async fn resolve(&self, query: &ResolveQuery, known: &Identity) -> Result<Identity> {
        let Some(path) = &self.path else { return Ok(Identity::default()) };
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::config(format!("rank table {file} (named by {}) cannot be read: {e}", self.set_by)).with_source(e)
        })?;
        let table = RankTable::parse(&text, &file)?;
        if query.is_local() { self.local(&file, &table, query, known) } else { Self::peer(&file, &table, known) }
    }
}

/// Removes serde_json's trailing " at line L column C" (the message reports the position).
fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) if msg[i..].contains(" column ") => msg[..i].to_owned(),
        _ => msg.to_owned(),
    }
}

#[cfg(test)]
mod tests;

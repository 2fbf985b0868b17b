//! HCCL rank tables (v1.0, and v1.2 with the Atlas A3 fields `super_device_id` and
//! `super_pod_list`).
//!
//! `{"status":"completed","version":"1.0","server_count":"1","server_list":[{"server_id":"…",
//! "device":[{"device_id":"0","device_ip":"…","device_port":"16667","rank_id":"0"}]}]}`: all
//! values are strings, `device_id` is a physical id, `device_port` defaults to 16666. Each rank's
//! endpoint in the emulator is `device_ip:device_port`. Two processes holding the same table
//! (whatever its formatting or key order) compute the same [`RankTable::key`], which is how
//! the ranks of one communicator find each other.

use std::net::{IpAddr, SocketAddr};

use serde_json::Value;

/// HCCL's default device port.
pub(crate) const DEFAULT_DEVICE_PORT: u16 = 16666;
/// Largest rank table accepted (bytes).
pub(crate) const MAX_RANK_TABLE: usize = 16 << 20;

/// One rank of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankEntry {
    pub(crate) rank: u32,
    pub(crate) server_id: String,
    pub(crate) device_id: u32,
    pub(crate) endpoint: SocketAddr,
    /// `super_device_id` (v1.2, Atlas A3), when the table gives it.
    pub(crate) super_device_id: Option<u32>,
    /// The server's `super_pod_id` (v1.2, from `super_pod_list`), when the table gives it.
    pub(crate) super_pod_id: Option<String>,
}

/// A parsed rank table, ranks in rank order.
#[derive(Debug, Clone)]
pub(crate) struct RankTable {
    pub(crate) ranks: Vec<RankEntry>,
    pub(crate) key: u64,
    /// `"1.0"` or `"1.2"`.
    pub(crate) version: String,
}

fn string_field<'a>(v: &'a Value, field: &str, at: &str) -> Result<&'a str, String> {
    match v.get(field) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!("{at}.{field} must be a string, found {other}")),
        None => Err(format!("{at}.{field} is missing")),
    }
}

fn number_field<T: std::str::FromStr>(v: &Value, field: &str, at: &str) -> Result<T, String> {
    let s = string_field(v, field, at)?;
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{at}.{field} = {s:?} is not a decimal number"));
    }
    s.parse::<T>().map_err(|_| format!("{at}.{field} = {s:?} is out of range"))
}

/// FNV-1a, 64 bits: stable across processes and builds.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The key of a named communicator of a table whose key is `key`.
pub(crate) fn keyed_by_name(key: u64, name: &str) -> u64 {
    fnv1a(format!("{key:016x};{name}").as_bytes())
}

/// Parses a rank table; the error names the field and what was expected.
pub(crate) fn parse(json: &str) -> Result<RankTable, String> {
    if json.len() > MAX_RANK_TABLE {
        return Err(format!("the rank table is {} bytes, more than the {MAX_RANK_TABLE} accepted", json.len()));
    }
    let v: Value = serde_json::from_str(json).map_err(|e| format!("the rank table is not JSON: {e}"))?;
    let status = string_field(&v, "status", "rank table")?;
    if status != "completed" {
        return Err(format!("rank table status is {status:?}, expected \"completed\""));
    }
    let version = string_field(&v, "version", "rank table")?;
    if version != "1.0" && version != "1.2" {
        return Err(format!("rank table version {version:?} is not supported (expected \"1.0\" or \"1.2\")"));
    }
    let servers = v.get("server_list").and_then(Value::as_array).ok_or("rank table.server_list must be an array")?;
    let server_count: usize = number_field(&v, "server_count", "rank table")?;
    if server_count != servers.len() {
        return Err(format!("rank table.server_count is {server_count} but server_list has {} entries", servers.len()));
    }
    // v1.2: `super_pod_list: [{"super_pod_id": "0", "server_list": [{"server_id": "…"}]}]`.
    let mut super_pods = std::collections::HashMap::new();
    for (pi, pod) in v.get("super_pod_list").and_then(Value::as_array).into_iter().flatten().enumerate() {
        let at = format!("rank table.super_pod_list[{pi}]");
        let pod_id = string_field(pod, "super_pod_id", &at)?.to_string();
        for s in pod.get("server_list").and_then(Value::as_array).into_iter().flatten() {
            if let Some(Value::String(id)) = s.get("server_id") {
                super_pods.insert(id.clone(), pod_id.clone());
            }
        }
    }
    let mut ranks: Vec<RankEntry> = Vec::new();
    for (si, server) in servers.iter().enumerate() {
        let at = format!("server_list[{si}]");
        let server_id = string_field(server, "server_id", &at)?.to_string();
        // HCOMM `topoinfo_ranktableConcise.cc` `GetSingleServer`, `hccl_ip_address.cc`: a host name is "invalid IPv4 address" → HCCL_E_PARA (docs/ascend.md rule 7).
        if server.get("host_ip").is_some() {
            let host_ip = string_field(server, "host_ip", &at)?;
            host_ip.parse::<IpAddr>().map_err(|_| {
                format!("{at}.host_ip = {host_ip:?} is not an IP address (HCCL takes a literal IPv4/IPv6 address, not a host name)")
            })?;
        }
        let devices = server.get("device").and_then(Value::as_array).ok_or(format!("{at}.device must be an array"))?;
        for (di, d) in devices.iter().enumerate() {
            let at = format!("{at}.device[{di}]");
            let device_id: u32 = number_field(d, "device_id", &at)?;
            let rank: u32 = number_field(d, "rank_id", &at)?;
            let ip_text = string_field(d, "device_ip", &at)?;
            let ip: IpAddr =
                ip_text.parse().map_err(|_| format!("{at}.device_ip = {ip_text:?} is not an IP address"))?;
            let port: u16 = match d.get("device_port") {
                None => DEFAULT_DEVICE_PORT,
                Some(_) => number_field(d, "device_port", &at)?,
            };
            let super_device_id = match d.get("super_device_id") {
                None => None,
                Some(_) => Some(number_field::<u32>(d, "super_device_id", &at)?),
            };
            if ranks.iter().any(|r| r.server_id == server_id && r.device_id == device_id) {
                return Err(format!("{at}: device_id {device_id} appears twice on server {server_id:?}"));
            }
            ranks.push(RankEntry {
                rank,
                server_id: server_id.clone(),
                device_id,
                endpoint: SocketAddr::new(ip, port),
                super_device_id,
                super_pod_id: super_pods.get(&server_id).cloned(),
            });
        }
    }
    if ranks.is_empty() {
        return Err("the rank table has no device".into());
    }
    ranks.sort_by_key(|r| r.rank);
    for (i, r) in ranks.iter().enumerate() {
        if r.rank as usize != i {
            return Err(format!(
                "rank_id values must be 0..{} without gaps or repeats; found rank_id {} at position {i}",
                ranks.len(),
                r.rank
            ));
        }
    }
    let canonical: String =
        ranks.iter().map(|r| format!("{}|{}|{}|{};", r.rank, r.server_id, r.device_id, r.endpoint)).collect::<String>();
    Ok(RankTable { key: fnv1a(format!("{version};{canonical}").as_bytes()), ranks, version: version.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = r#"{"status":"completed","version":"1.0","server_count":"2","server_list":[
        {"server_id":"node_0","device":[{"device_id":"4","device_ip":"127.0.0.1","device_port":"17001","rank_id":"0"}]},
        {"server_id":"node_1","device":[{"device_id":"5","device_ip":"127.0.0.2","rank_id":"1"}]}]}"#;

    #[test]
    fn a_v1_table_parses_and_its_key_ignores_formatting() {
        let t = parse(TABLE).unwrap();
        assert_eq!(t.ranks.len(), 2);
        assert_eq!(t.ranks[0].device_id, 4);
        assert_eq!(t.ranks[0].endpoint, "127.0.0.1:17001".parse().unwrap());
        assert_eq!(t.ranks[1].endpoint.port(), DEFAULT_DEVICE_PORT);
        let compact: Value = serde_json::from_str(TABLE).unwrap();
        assert_eq!(parse(&compact.to_string()).unwrap().key, t.key);
        let other = TABLE.replace("17001", "17002");
        assert_ne!(parse(&other).unwrap().key, t.key);
    }

    #[test]
    fn bad_tables_name_the_field() {
        let cases = [
            (TABLE.replace("completed", "initializing"), "status"),
            (TABLE.replace(r#""device_id":"4""#, r#""device_id":4"#), "device_id must be a string"),
            (TABLE.replace(r#""rank_id":"1""#, r#""rank_id":"0""#), "rank_id"),
            (TABLE.replace("127.0.0.2", "not-an-ip"), "device_ip"),
            (
                TABLE.replace(r#""server_id":"node_1","#, r#""server_id":"node_1","host_ip":"node1.example","#),
                "host_ip",
            ),
            (TABLE.replace(r#""server_count":"2""#, r#""server_count":"3""#), "server_count"),
            (TABLE.replace("\"1.0\"", "\"2.0\""), "version"),
            (TABLE.replace("17001", "99999"), "device_port"),
            ("[]".to_string(), "status"),
            ("{".to_string(), "not JSON"),
        ];
        for (table, needle) in cases {
            let e = parse(&table).unwrap_err();
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
    }
}

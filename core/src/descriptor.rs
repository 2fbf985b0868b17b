//! Segment descriptors in Mooncake's JSON (reference `mooncake-wire.md` §1–2), and the metadata
//! key names they are stored under.
//!
//! Decoding tolerates unknown fields and keeps them, so a descriptor read from a newer peer is
//! written back unchanged; it rejects malformed known fields with an error naming the segment,
//! the field path and the position.
//!
//! The core types only what every transport shares (name, protocol, buffers, the instance and
//! the timestamp) and the Ascend `rank_info`. A transport's own fields are flat top-level keys
//! kept in [`SegmentDescriptor::extra`]; the transport reads and writes them through a typed view
//! of its own ([`SegmentDescriptor::view`], [`SegmentDescriptor::set_view`]), so the JSON stays
//! Mooncake's (the TCP transport's `tcp_data_host`, `tcp_data_port` and `tcp_proto_version`).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::json_fields::{serde_fields, strip_position, unknown_fields};

/// One buffer a segment exposes: `[addr, addr + length)` in the owner's virtual address space.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// The owner's virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// Mooncake writes the location tag here (`cpu:0`, `npu:3`, ...).
    #[serde(default)]
    pub name: String,
    /// Ascend: the device the buffer lives on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<i64>,
    /// Fields this version does not know, kept for round trips.
    #[serde(flatten, skip_deserializing)]
    pub extra: Map<String, Value>,
}

impl BufferDesc {
    /// True when `[addr, addr + len)` lies inside this buffer (`len > 0`).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr >= self.addr
            && match (addr.checked_add(len), self.addr.checked_add(self.length)) {
                (Some(end), Some(buf_end)) => end <= buf_end,
                _ => false,
            }
    }
}

/// Ascend rank information published by HCCL segments (field names as Mooncake writes them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RankInfo {
    /// Rank id in the peer's view.
    #[serde(default)]
    pub rank_id: u64,
    /// Host IP.
    #[serde(default)]
    pub host_ip: String,
    /// Host port of the control channel.
    #[serde(default)]
    pub host_port: u64,
    /// Logical device id.
    #[serde(default)]
    pub device_logic_id: u64,
    /// Physical device id.
    #[serde(default)]
    pub device_phy_id: u64,
    /// Device type code.
    #[serde(default)]
    pub device_type: u64,
    /// Device (NIC) IP.
    #[serde(default)]
    pub device_ip: String,
    /// Device port.
    #[serde(default)]
    pub device_port: u64,
    /// Owning process id.
    #[serde(default)]
    pub pid: u64,
    /// Atlas A3 only: the device's id within its super pod (Ferry's extension; a v1.2 rank
    /// table between servers needs it). Absent elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub super_device_id: Option<String>,
    /// Atlas A3 only: the device's super pod (Ferry's extension, as `super_device_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub super_pod_id: Option<String>,
    /// HIXL engines of the segment (`"ip:port"`, `"[ipv6]:port"`), as Mooncake's
    /// `ascend_direct` transport publishes them: one per device engine, indexed by a buffer's
    /// `device_id`. Omitted when empty (Mooncake reads it only when present).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Fields this version does not know.
    #[serde(flatten, skip_deserializing)]
    pub extra: Map<String, Value>,
}

/// A segment descriptor: what a peer needs to address a segment's memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// Segment name (normally `host:port`).
    pub name: String,
    /// Protocol of the transport that serves it (`tcp`, `ascend`, `local`, ...).
    pub protocol: String,
    /// Exposed buffers.
    #[serde(default)]
    pub buffers: Vec<BufferDesc>,
    /// Ascend transport: rank information.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_info: Option<RankInfo>,
    /// Ferry: identity of the engine instance that published this descriptor (lets a
    /// same-process transport recognise its own engines). Ignored by Mooncake peers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ferry_instance: Option<String>,
    /// Publication time (Mooncake writes `YYYY-MM-DD HH:MM:SS.micros`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Every other top-level field, kept for round trips: the fields of transports, read and
    /// written through their views ([`view`](Self::view), [`set_view`](Self::set_view); the TCP
    /// transport's `tcp_data_port`, ...), and fields no one here knows (`rdma_server_name`).
    #[serde(flatten, skip_deserializing)]
    pub extra: Map<String, Value>,
}

impl SegmentDescriptor {
    /// An empty descriptor for segment `name` served by `protocol`.
    pub fn new(name: impl Into<String>, protocol: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            protocol: protocol.into(),
            buffers: Vec::new(),
            rank_info: None,
            ferry_instance: None,
            timestamp: None,
            extra: Map::new(),
        }
    }

    /// Decodes a descriptor from JSON bytes. `origin` names where it came from (a metadata key,
    /// a peer) and appears in the error.
    pub fn from_json(origin: &str, bytes: &[u8]) -> Result<Self> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let desc: Self = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Error::invalid(format!(
                "segment descriptor from {origin} is malformed: field `{path}` at line {} column {}: {}",
                inner.line(),
                inner.column(),
                strip_position(&inner.to_string())
            ))
        })?;
        de.end().map_err(|e| {
            Error::invalid(format!(
                "segment descriptor from {origin} has trailing data at line {} column {}",
                e.line(),
                e.column()
            ))
        })?;
        let mut desc = desc;
        // Unknown fields are collected in a second pass: a flattened catch-all would make serde
        // buffer the input and lose the field path and position of errors.
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::invalid(format!("segment descriptor from {origin} is malformed: {e}")))?;
        desc.extra = unknown_fields(&value, serde_fields::<SegmentDescriptor>());
        for (buf, v) in desc.buffers.iter_mut().zip(value["buffers"].as_array().into_iter().flatten()) {
            buf.extra = unknown_fields(v, serde_fields::<BufferDesc>());
        }
        if let Some(rank) = desc.rank_info.as_mut() {
            rank.extra = unknown_fields(&value["rank_info"], serde_fields::<RankInfo>());
        }
        desc.validate(origin)?;
        Ok(desc)
    }

    /// Checks invariants serde cannot express: a name, and buffers that do not wrap around.
    pub fn validate(&self, origin: &str) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::invalid(format!("segment descriptor from {origin}: field `name` is empty")));
        }
        if self.protocol.is_empty() {
            return Err(Error::invalid(format!("segment descriptor from {origin}: field `protocol` is empty")));
        }
        for (i, b) in self.buffers.iter().enumerate() {
            if b.addr.checked_add(b.length).is_none() {
                return Err(Error::invalid(format!(
                    "segment descriptor from {origin}: field `buffers[{i}]` ({:#x}+{}) wraps around the address space",
                    b.addr, b.length
                )));
            }
        }
        Ok(())
    }

    /// Encodes as compact JSON.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a descriptor always serialises")
    }

    /// A transport's typed view of its fields: `T` deserialized from the descriptor's flat
    /// top-level fields outside the core's ([`extra`](Self::extra)), fields `T` does not name
    /// ignored. Give `T`'s fields `#[serde(default)]` (or make them `Option`s) to read a
    /// descriptor that lacks them, such as one another transport published.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the segment and
    /// the field when a field has the wrong type or is missing and required by `T`.
    pub fn view<T: DeserializeOwned>(&self) -> Result<T> {
        let fields = self.extra.iter().map(|(k, v)| (k.as_str(), v));
        let de = serde::de::value::MapDeserializer::<_, serde_json::Error>::new(fields);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Error::invalid(format!("segment descriptor of `{}`: field `{path}`: {inner}", self.name))
        })
    }

    /// Writes a transport's typed view into the descriptor: each field `view` serializes
    /// becomes a flat top-level field (replacing one of that name); a field that serializes as
    /// `null` is removed. Other fields are left alone.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) when `view` does not
    /// serialize as a JSON object, or names a field the core types itself (`name`, `buffers`,
    /// `rank_info`, ...); the descriptor is then unchanged.
    pub fn set_view<T: Serialize>(&mut self, view: &T) -> Result<()> {
        let value = serde_json::to_value(view)
            .map_err(|e| Error::invalid(format!("a descriptor view could not be serialized: {e}")))?;
        let Value::Object(fields) = value else {
            return Err(Error::invalid("a descriptor view must serialize as a JSON object"));
        };
        let core = serde_fields::<SegmentDescriptor>();
        if let Some(k) = fields.keys().find(|k| core.contains(&k.as_str())) {
            return Err(Error::invalid(format!(
                "a descriptor view names field `{k}`, which the core types itself; use the descriptor's own field"
            )));
        }
        for (k, v) in fields {
            if v.is_null() {
                self.extra.remove(&k);
            } else {
                self.extra.insert(k, v);
            }
        }
        Ok(())
    }
}

/// The `rpc_meta` entry: where a segment's owner answers handshakes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RpcMeta {
    /// Host name or IP.
    pub ip_or_host_name: String,
    /// RPC port.
    pub rpc_port: u16,
}

/// Builds the metadata keys of reference §1, honouring a cluster id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataKeys {
    prefix: String,
}

impl MetadataKeys {
    /// Keys under `mooncake/`, or `mooncake/<cluster_id>/` when a cluster id is given.
    pub fn new(cluster_id: Option<&str>) -> Self {
        let prefix = match cluster_id {
            Some(id) if !id.is_empty() => format!("mooncake/{id}/"),
            _ => "mooncake/".to_owned(),
        };
        Self { prefix }
    }

    /// Key of a segment's descriptor: `<prefix>ram/<name>`, or `<prefix><name>` for a name that
    /// already contains `/`.
    pub fn segment(&self, name: &str) -> String {
        if name.contains('/') { format!("{}{name}", self.prefix) } else { format!("{}ram/{name}", self.prefix) }
    }

    /// Key of a segment's rpc entry: `<prefix>rpc_meta/<name>`.
    pub fn rpc(&self, name: &str) -> String {
        format!("{}rpc_meta/{name}", self.prefix)
    }

    /// The common prefix of all keys (for watches).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The segment name a descriptor key refers to, if it is one of ours.
    pub fn segment_name_of<'a>(&self, key: &'a str) -> Option<&'a str> {
        let rest = key.strip_prefix(&self.prefix)?;
        if rest.starts_with("rpc_meta/") {
            return None;
        }
        Some(rest.strip_prefix("ram/").unwrap_or(rest))
    }
}

/// Formats the current UTC time as Mooncake does: `YYYY-MM-DD HH:MM:SS.micros`.
pub(crate) fn mooncake_timestamp_now() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:06}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const OBSERVED: &str = r#"{"buffers":[{"addr":140634074640400,"length":1048576,"name":"127.0.0.1:17123"}],
 "name":"127.0.0.1:17123","protocol":"tcp","rdma_server_name":"",
 "tcp_data_host":"192.0.2.2","tcp_data_port":16359,"tcp_proto_version":2,
 "timestamp":"2026-11-30 06:21:30.151346"}"#;

    #[test]
    fn reads_the_wheels_descriptor_and_round_trips_unknown_fields() {
        let d = SegmentDescriptor::from_json("test", OBSERVED.as_bytes()).unwrap();
        assert_eq!(d.buffers[0].addr, 140634074640400);
        assert_eq!(d.extra.get("tcp_data_port"), Some(&Value::from(16359)));
        assert_eq!(d.extra.get("rdma_server_name"), Some(&Value::String(String::new())));
        let back: Value = serde_json::from_slice(&d.to_json()).unwrap();
        let orig: Value = serde_json::from_str(OBSERVED).unwrap();
        assert_eq!(back, orig, "a round trip changes nothing");
    }

    /// A transport's view of its flat fields, as the TCP transport keeps one.
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    struct Widget {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        widget_host: Option<String>,
        #[serde(default)]
        widget_port: Option<u16>,
    }

    #[test]
    fn views_read_and_write_flat_fields_and_keep_the_json_mooncakes() {
        let mut d = SegmentDescriptor::from_json("test", OBSERVED.as_bytes()).unwrap();
        assert_eq!(d.view::<Widget>().unwrap(), Widget::default(), "fields of another transport are ignored");
        d.set_view(&Widget { widget_host: Some("h".into()), widget_port: Some(7) }).unwrap();
        assert_eq!(d.view::<Widget>().unwrap(), Widget { widget_host: Some("h".into()), widget_port: Some(7) });
        let flat: Value = serde_json::from_slice(&d.to_json()).unwrap();
        assert_eq!(
            (&flat["widget_host"], &flat["widget_port"], &flat["tcp_data_port"]),
            (&"h".into(), &7.into(), &16359.into())
        );
        // `null` removes a field; a field left out is left alone.
        d.set_view(&Widget { widget_host: None, widget_port: None }).unwrap();
        assert_eq!(d.view::<Widget>().unwrap(), Widget { widget_host: Some("h".into()), widget_port: None });
        assert!(!d.extra.contains_key("widget_port"));
        let back = SegmentDescriptor::from_json("again", &d.to_json()).unwrap();
        assert_eq!(back, d, "what a view writes survives publication");

        d.extra.insert("widget_port".into(), "seven".into());
        let e = d.view::<Widget>().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.message().contains("`127.0.0.1:17123`") && e.message().contains("field `widget_port`"), "{e}");
        let e = d.set_view(&serde_json::json!({"name": "other"})).unwrap_err();
        assert!(e.message().contains("field `name`"), "{e}");
        assert!(d.set_view(&5).is_err(), "not an object");
        assert_eq!(d.name, "127.0.0.1:17123");
    }

    #[test]
    fn known_field_lists_come_from_the_types() {
        assert_eq!(
            serde_fields::<SegmentDescriptor>(),
            ["name", "protocol", "buffers", "rank_info", "ferry_instance", "timestamp"]
        );
        assert_eq!(serde_fields::<BufferDesc>(), ["addr", "length", "name", "device_id"]);
        assert!(serde_fields::<RankInfo>().contains(&"superDeviceId"));
        // The Atlas A3 fields are typed, so they are not kept (and written) a second time.
        let text = r#"{"name":"n","protocol":"ascend","rank_info":{"rankId":1,"superDeviceId":"3","superPodId":"0"}}"#;
        let d = SegmentDescriptor::from_json("t", text.as_bytes()).unwrap();
        assert!(d.rank_info.as_ref().unwrap().extra.is_empty(), "{:?}", d.rank_info);
        let json = String::from_utf8(d.to_json()).unwrap();
        assert_eq!(json.matches("superDeviceId").count(), 1, "{json}");
    }

    #[test]
    fn ascend_fields_and_future_fields_survive() {
        let text = r#"{"name":"10.0.0.1:2000:npu_3","protocol":"ascend",
          "buffers":[{"addr":1,"length":2,"name":"npu:3","device_id":3,"future_buf":true}],
          "rank_info":{"rankId":1,"hostIp":"10.0.0.1","hostPort":2000,"deviceLogicId":0,
            "devicePhyId":3,"deviceType":4,"deviceIp":"192.168.1.3","devicePort":16666,"pid":77,"newField":[1]},
          "future":{"x":1}}"#;
        let d = SegmentDescriptor::from_json("t", text.as_bytes()).unwrap();
        assert_eq!(d.rank_info.as_ref().unwrap().device_phy_id, 3);
        assert_eq!(d.buffers[0].device_id, Some(3));
        let back: Value = serde_json::from_slice(&d.to_json()).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn mooncake_ascend_direct_endpoints_are_read_and_written_back() {
        // What Mooncake's ascend_direct transport publishes (transfer_metadata.cpp encodes
        // every rank_info field; only hostIp and endpoints are set).
        let text = r#"{"name":"10.0.0.2:16000","protocol":"ascend",
          "buffers":[{"addr":4096,"length":8192,"name":"npu:0","device_id":0}],
          "rank_info":{"rankId":4294967295,"hostIp":"10.0.0.2","hostPort":0,"deviceLogicId":0,
            "devicePhyId":0,"deviceType":5,"deviceIp":"","devicePort":0,"pid":0,
            "endpoints":["10.0.0.2:20213"]}}"#;
        let d = SegmentDescriptor::from_json("t", text.as_bytes()).unwrap();
        let r = d.rank_info.as_ref().unwrap();
        assert_eq!(r.endpoints, vec!["10.0.0.2:20213".to_owned()]);
        assert!(r.extra.is_empty(), "{:?}", r.extra);
        let back: Value = serde_json::from_slice(&d.to_json()).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn malformed_fields_are_named() {
        let e = SegmentDescriptor::from_json(
            "mooncake/ram/x",
            br#"{"name":"x","protocol":"tcp","buffers":[{"addr":"oops","length":1}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.message().contains("buffers[0].addr"), "{e}");
        assert!(e.message().contains("mooncake/ram/x"));
        assert!(e.message().contains("line 1"));
        let e =
            SegmentDescriptor::from_json("p", br#"{"name":"x","protocol":"tcp","buffers":[{"addr":-1,"length":1}]}"#)
                .unwrap_err();
        assert!(e.message().contains("buffers[0].addr"), "{e}");
        let e = SegmentDescriptor::from_json(
            "p",
            format!(r#"{{"name":"x","protocol":"tcp","buffers":[{{"addr":{},"length":2}}]}}"#, u64::MAX).as_bytes(),
        )
        .unwrap_err();
        assert!(e.message().contains("wraps"), "{e}");
        assert!(SegmentDescriptor::from_json("p", b"{\"name\":\"x\"").is_err());
        assert!(SegmentDescriptor::from_json("p", br#"{"name":"","protocol":"tcp"}"#).is_err());
        let e = SegmentDescriptor::from_json("p", br#"{"name":"x","protocol":"tcp"} trailing"#).unwrap_err();
        assert!(e.message().contains("trailing"), "{e}");
    }

    #[test]
    fn keys_follow_mooncake() {
        let k = MetadataKeys::new(None);
        assert_eq!(k.segment("1.2.3.4:5"), "mooncake/ram/1.2.3.4:5");
        assert_eq!(k.rpc("1.2.3.4:5"), "mooncake/rpc_meta/1.2.3.4:5");
        assert_eq!(k.segment("a/b"), "mooncake/a/b");
        let k = MetadataKeys::new(Some("c1"));
        assert_eq!(k.segment("h:1"), "mooncake/c1/ram/h:1");
        assert_eq!(k.segment_name_of("mooncake/c1/ram/h:1"), Some("h:1"));
        assert_eq!(k.segment_name_of("mooncake/c1/rpc_meta/h:1"), None);
        assert_eq!(k.segment_name_of("mooncake/ram/h:1"), None);
    }

    #[test]
    fn buffer_contains_handles_edges() {
        let b = BufferDesc { addr: 100, length: 10, name: String::new(), device_id: None, extra: Map::new() };
        assert!(b.contains(100, 10));
        assert!(!b.contains(100, 11));
        assert!(!b.contains(99, 1));
        assert!(!b.contains(105, 0));
        assert!(!b.contains(u64::MAX, 2));
    }

    #[test]
    fn timestamps_look_like_mooncakes() {
        let t = mooncake_timestamp_now();
        assert_eq!(t.len(), "2026-11-30 06:21:30.151346".len(), "{t}");
        assert!(t.starts_with("20"), "{t}");
        assert_eq!(&t[4..5], "-");
        assert_eq!(&t[10..11], " ");
    }
}

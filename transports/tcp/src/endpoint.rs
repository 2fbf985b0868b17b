//! The `tcp` transport's part of a segment descriptor: `tcp_data_host`, `tcp_data_port` and
//! `tcp_proto_version`, flat top-level fields as Mooncake writes them, and Ferry's own
//! `ferry_tcp_fence` (the target serves Ferry's fence requests) and `ferry_auth` (present only on
//! a target that requires peer authentication), read and written through a typed view over the
//! descriptor's fields ([`SegmentDescriptor::view`]).

use ferry_core::{Result, SegmentDescriptor, SegmentName};
use serde::{Deserialize, Serialize};

/// Where a segment's TCP target listens, and the wire protocol version it speaks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpEndpoint {
    /// `tcp_data_host`: the host to connect to. Empty or absent: the segment name's host.
    #[serde(rename = "tcp_data_host", default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// `tcp_data_port`: the target's data port.
    #[serde(rename = "tcp_data_port")]
    pub port: u16,
    /// `tcp_proto_version`: the wire protocol version (absent means 1).
    #[serde(rename = "tcp_proto_version", default, skip_serializing_if = "Option::is_none")]
    pub proto_version: Option<u32>,
    /// `ferry_tcp_fence`: the target serves Ferry's fence requests (`1`; absent in Mooncake's
    /// descriptors, whose targets are never sent one).
    #[serde(rename = "ferry_tcp_fence", default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<u32>,
    /// `ferry_auth`: the peer authentication scheme the target requires on every data
    /// connection (`hmac-sha256-v1`, [`ferry_peer_auth::SCHEME`]); absent on a target without
    /// authentication (every Mooncake target, and Ferry targets without a secret).
    #[serde(rename = "ferry_auth", default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<String>,
}

/// The view as read: every field optional, so a descriptor without them reads as no endpoint.
#[derive(Deserialize)]
struct Published {
    #[serde(default)]
    tcp_data_host: Option<String>,
    #[serde(default)]
    tcp_data_port: Option<u16>,
    #[serde(default)]
    tcp_proto_version: Option<u32>,
    #[serde(default)]
    ferry_tcp_fence: Option<u32>,
    ferry_auth: Option<String>,
}

impl TcpEndpoint {
    /// The endpoint `d` publishes; `Ok(None)` when it publishes no `tcp_data_port` (a segment
    /// of another transport).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](ferry_core::ErrorKind::InvalidArgument) naming the segment
    /// and the field when one of the fields has the wrong type (a port past 65535, a host that
    /// is not a string, ...).
    pub fn from_descriptor(d: &SegmentDescriptor) -> Result<Option<Self>> {
        let p: Published = d.view()?;
        Ok(p.tcp_data_port.map(|port| Self {
            host: p.tcp_data_host,
            port,
            proto_version: p.tcp_proto_version,
            fence: p.ferry_tcp_fence,
            auth: p.ferry_auth,
        }))
    }

    /// Writes the endpoint's fields into `d` (replacing any it had).
    ///
    /// # Errors
    /// None in practice: the fields always serialize ([`SegmentDescriptor::set_view`]).
    pub fn write_to(&self, d: &mut SegmentDescriptor) -> Result<()> {
        d.set_view(self)
    }

    /// The host to connect to for segment `segment_name`: `tcp_data_host`, else (empty or
    /// absent) the segment name's host.
    pub fn host_for(&self, segment_name: &str) -> Option<String> {
        self.host
            .clone()
            .filter(|h| !h.is_empty())
            .or_else(|| SegmentName::parse(segment_name).map(SegmentName::into_host))
    }

    /// The wire protocol version the target speaks (1 when it publishes none).
    pub fn version(&self) -> u32 {
        self.proto_version.unwrap_or(1)
    }

    /// Whether the target serves fence requests: `ferry_tcp_fence` is 1 or more and it speaks
    /// v2 (the fence's answer is a v2 status frame).
    pub fn fences(&self) -> bool {
        self.fence.is_some_and(|v| v >= 1) && self.version() >= 2
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// What the Mooncake wheel publishes (its TCP transport).
    const WHEEL: &str = r#"{"buffers":[{"addr":140634074640400,"length":1048576,"name":"127.0.0.1:17123"}],
 "name":"127.0.0.1:17123","protocol":"tcp","rdma_server_name":"",
 "tcp_data_host":"192.0.2.2","tcp_data_port":16359,"tcp_proto_version":2,
 "timestamp":"2026-11-30 06:21:30.151346"}"#;

    #[test]
    fn reads_mooncakes_fields_and_writes_them_back_unchanged() {
        let mut d = SegmentDescriptor::from_json("wheel", WHEEL.as_bytes()).unwrap();
        let e = TcpEndpoint::from_descriptor(&d).unwrap().unwrap();
        assert_eq!(
            e,
            TcpEndpoint {
                host: Some("192.0.2.2".into()),
                port: 16359,
                proto_version: Some(2),
                fence: None,
                auth: None
            }
        );
        assert!(!e.fences(), "a Mooncake target is never sent a fence");
        assert_eq!((e.host_for(&d.name).as_deref(), e.version()), (Some("192.0.2.2"), 2));
        e.write_to(&mut d).unwrap();
        let back: Value = serde_json::from_slice(&d.to_json()).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(WHEEL).unwrap(), "the same JSON as the wheel's");

        let mut fresh = SegmentDescriptor::new("10.0.0.5:17000", "tcp");
        TcpEndpoint { host: Some("10.0.0.5".into()), port: 18000, proto_version: Some(2), fence: Some(1), auth: None }
            .write_to(&mut fresh)
            .unwrap();
        let flat: Value = serde_json::from_slice(&fresh.to_json()).unwrap();
        assert_eq!(
            (&flat["tcp_data_host"], &flat["tcp_data_port"], &flat["tcp_proto_version"], &flat["ferry_tcp_fence"]),
            (&Value::from("10.0.0.5"), &Value::from(18000), &Value::from(2), &Value::from(1)),
            "flat keys, Mooncake's names: {flat}"
        );
        assert!(TcpEndpoint::from_descriptor(&fresh).unwrap().unwrap().fences());
        assert!(flat.get("ferry_auth").is_none(), "no authentication, no field: {flat}");
    }

    #[test]
    fn a_target_requiring_authentication_says_so_and_a_bad_advertisement_is_refused() {
        let mut d = SegmentDescriptor::new("10.0.0.5:17000", "tcp");
        let auth = TcpEndpoint {
            host: None,
            port: 18000,
            proto_version: Some(2),
            fence: None,
            auth: Some(ferry_peer_auth::SCHEME.to_owned()),
        };
        auth.write_to(&mut d).unwrap();
        let flat: Value = serde_json::from_slice(&d.to_json()).unwrap();
        assert_eq!(flat["ferry_auth"], Value::from("hmac-sha256-v1"));
        assert_eq!(TcpEndpoint::from_descriptor(&d).unwrap(), Some(auth));
        let bad = br#"{"name":"x:1","protocol":"tcp","tcp_data_port":9,"ferry_auth":true}"#;
        let e = TcpEndpoint::from_descriptor(&SegmentDescriptor::from_json("bad", bad).unwrap()).unwrap_err();
        assert!(e.message().contains("field `ferry_auth`"), "{e}");
    }

    #[test]
    fn absent_fields_and_bad_ones() {
        let d = SegmentDescriptor::new("10.0.0.5:17000", "ascend");
        assert_eq!(TcpEndpoint::from_descriptor(&d).unwrap(), None, "no tcp_data_port: not a tcp segment");
        let v1 = br#"{"name":"10.0.0.5:17000","protocol":"tcp","tcp_data_host":"","tcp_data_port":9}"#;
        let d = SegmentDescriptor::from_json("v1", v1).unwrap();
        let e = TcpEndpoint::from_descriptor(&d).unwrap().unwrap();
        assert_eq!((e.host_for(&d.name).as_deref(), e.version()), (Some("10.0.0.5"), 1), "the name's host, v1");
        let v1_fence = TcpEndpoint { fence: Some(1), ..e };
        assert!(!v1_fence.fences(), "a fence is answered with a v2 status frame");
        let bad = br#"{"name":"x:1","protocol":"tcp","tcp_data_port":70000}"#;
        let e = TcpEndpoint::from_descriptor(&SegmentDescriptor::from_json("bad", bad).unwrap()).unwrap_err();
        assert_eq!(e.kind(), ferry_core::ErrorKind::InvalidArgument);
        assert!(e.message().contains("`x:1`") && e.message().contains("field `tcp_data_port`"), "{e}");
    }
}

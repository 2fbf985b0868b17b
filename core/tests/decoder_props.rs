//! Property tests of the core's decoders of untrusted input: `SegmentDescriptor::from_json`
//! (what peers and metadata stores publish) and `Config::from_json_str` (`mooncake.json`), on
//! the stable toolchain. Arbitrary bytes, and structured mutations of real descriptors and
//! configs (bytes inserted, deleted or replaced; values of any JSON type put at any path;
//! numbers at the edges of their types): decoding never panics, an error names where the input
//! came from, and what decodes re-encodes to an equal value (and to the same text the second
//! time). The fuzz targets `descriptor` and `config` (fuzz/, nightly) check the same at scale.
//!
//! Seeded (a fixed proptest seed), a few hundred cases each: seconds.

use std::path::Path;

use ferry_core::{Config, SegmentDescriptor, SegmentName};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use serde_json::Value;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0xFE44_1DEC),
        failure_persistence: None,
        max_shrink_time: 20_000,
        ..ProptestConfig::default()
    }
}

/// Descriptors as published: Mooncake's wheel (TCP), Mooncake's Ascend and `ascend_direct`
/// transports, an older TCP peer (v1), an Atlas A3 segment, and a Ferry engine.
const DESCRIPTORS: &[&str] = &[
    r#"{"buffers":[{"addr":140634074640400,"length":1048576,"name":"127.0.0.1:17123"}],
 "name":"127.0.0.1:17123","protocol":"tcp","rdma_server_name":"",
 "tcp_data_host":"192.0.2.2","tcp_data_port":16359,"tcp_proto_version":2,
 "timestamp":"2026-11-30 06:21:30.151346"}"#,
    r#"{"name":"10.0.0.1:2000:npu_3","protocol":"ascend",
  "buffers":[{"addr":1,"length":2,"name":"npu:3","device_id":3,"future_buf":true}],
  "rank_info":{"rankId":1,"hostIp":"10.0.0.1","hostPort":2000,"deviceLogicId":0,
    "devicePhyId":3,"deviceType":4,"deviceIp":"192.168.1.3","devicePort":16666,"pid":77,"newField":[1]},
  "future":{"x":1}}"#,
    r#"{"name":"10.0.0.2:16000","protocol":"ascend",
  "buffers":[{"addr":4096,"length":8192,"name":"npu:0","device_id":0}],
  "rank_info":{"rankId":4294967295,"hostIp":"10.0.0.2","hostPort":0,"deviceLogicId":0,
    "devicePhyId":0,"deviceType":5,"deviceIp":"","devicePort":0,"pid":0,
    "endpoints":["10.0.0.2:20213"]}}"#,
    r#"{"name":"10.0.0.5:17000","protocol":"tcp","tcp_data_host":"","tcp_data_port":9}"#,
    r#"{"name":"n","protocol":"ascend","rank_info":{"rankId":1,"superDeviceId":"3","superPodId":"0"}}"#,
    r#"{"name":"127.0.0.1:15123","protocol":"tcp","buffers":[{"addr":94000000000000,"length":65536,"name":"cpu:0"}],
 "ferry_instance":"f-1","tcp_data_host":"127.0.0.1","tcp_data_port":40000,"tcp_proto_version":2,"rdma_server_name":""}"#,
];

/// Configs in both of Mooncake's layouts and with Ferry's own fields.
const CONFIGS: &[&str] = &[
    r#"{
  "prefill_url": "192.168.0.137:13003",
  "decode_url": "192.168.0.139:13003",
  "metadata_server": "192.168.0.139:2379",
  "metadata_backend": "etcd",
  "protocol": "ascend",
  "device_name": ""
}"#,
    r#"{
    "local_hostname": "10.0.0.5:17000",
    "metadata_server": "redis://10.0.0.1:6379",
    "protocol": "tcp",
    "device_name": "",
    "master_server_address": "10.0.0.1:50051",
    "global_segment_size": "3.125GB",
    "local_buffer_size": 536870912
}"#,
    r#"{"prefill_url": "10.0.0.5", "decode_url": "10.0.0.5", "metadata_server": "P2PHANDSHAKE",
  "protocol": "ascend", "device_name": "", "base_port": {"prefill": 17000, "decode": 17100},
  "rank_table_path": "ranktable.json"}"#,
    r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
  "transfer_timeout_ms": 5000, "handshake_timeout_ms": 2000, "tcp_lanes": 8, "tcp_data_port": 0}"#,
    r#"{"protocol":"example","plugins":["plugins/","/opt/ferry/libferry_transport_x.so"],"role":"decode",
  "local_rank":3,"physical_devices":[4,5,6,7],"resolvers":["config","env"],"cluster_id":"c1","rpc_port":15000}"#,
];

/// Checks one input to the descriptor decoder.
fn descriptor(bytes: &[u8]) -> Result<(), TestCaseError> {
    let d = match SegmentDescriptor::from_json("mooncake/ram/peer", bytes) {
        Ok(d) => d,
        Err(e) => {
            prop_assert!(e.message().contains("mooncake/ram/peer"), "the error names the origin: {}", e);
            return Ok(());
        }
    };
    prop_assert!(d.validate("again").is_ok());
    let json = d.to_json();
    let again = SegmentDescriptor::from_json("again", &json);
    prop_assert!(again.is_ok(), "{} does not decode again: {:?}", String::from_utf8_lossy(&json), again);
    let again = again.unwrap();
    prop_assert_eq!(&again, &d, "a round trip changes nothing");
    prop_assert_eq!(again.to_json(), json, "re-encoding is stable");
    for b in &d.buffers {
        prop_assert_eq!(b.contains(b.addr, b.length), b.length > 0);
    }
    let _ = SegmentName::parse(&d.name);
    Ok(())
}

/// Checks one input to the config decoder.
fn config_text(text: &str) -> Result<(), TestCaseError> {
    let cfg = match Config::from_json_str(text, Some(Path::new("/etc/mooncake.json"))) {
        Ok(c) => c,
        Err(e) => {
            prop_assert!(e.message().starts_with("config /etc/mooncake.json"), "the error names the file: {}", e);
            return Ok(());
        }
    };
    let _ = (cfg.metadata(), cfg.local_segment_name(), cfg.transfer_timeout(), cfg.protocol(), cfg.style());
    let _ = (cfg.plugin_paths(), cfg.unknown_fields(), cfg.base_port_for_role());
    for rank in [None, Some(0), Some(7), Some(1023)] {
        let _ = cfg.port_for_rank(rank);
    }
    let mut with_env = cfg.clone();
    let _ = with_env.apply_env(|k| (k == "FERRY_LOCAL_RANK").then(|| "2".to_owned()));
    let _ = with_env.fix_segment_name();
    let json = serde_json::to_string(&cfg).unwrap();
    let again = Config::from_json_str(&json, None);
    prop_assert!(again.is_ok(), "{} does not parse again: {:?}", json, again.err());
    prop_assert_eq!(serde_json::to_string(&again.unwrap()).unwrap(), json, "a round trip changes nothing");
    Ok(())
}

/// Any JSON value, a few levels deep, numbers at the edges of the integer types among them.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop::sample::select(vec![0u64, 1, 255, 256, 65535, 65536, 86_400_000, 86_400_001, u64::MAX])
            .prop_map(Value::from),
        prop::num::f64::NORMAL.prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec!["", "tcp", "P2PHANDSHAKE", "127.0.0.1:1", "[::1]:0", "4GB", "prefill", "\u{0}"])
            .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every path to a value in `v` (object keys and array indices), the root included.
fn paths(v: &Value, at: Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => m.iter().for_each(|(k, x)| paths(x, [at.clone(), vec![k.clone()]].concat(), out)),
        Value::Array(a) => {
            a.iter().enumerate().for_each(|(i, x)| paths(x, [at.clone(), vec![i.to_string()]].concat(), out))
        }
        _ => {}
    }
}

fn at_path<'a>(v: &'a mut Value, path: &[String]) -> &'a mut Value {
    path.iter().fold(v, |v, k| match v {
        Value::Object(m) => m.get_mut(k).expect("a path found by `paths`"),
        Value::Array(a) => &mut a[k.parse::<usize>().expect("an index")],
        _ => unreachable!("paths only lead through objects and arrays"),
    })
}

/// A structured mutation of JSON text.
#[derive(Debug, Clone)]
enum Mutation {
    /// The value at the `n`-th path (modulo their number) replaced.
    Replace(usize, Value),
    /// A member `key: value` added to the `n`-th object found (or to the root).
    Add(usize, String, Value),
    /// The `n`-th path's value removed from its parent.
    Remove(usize),
    /// Bytes deleted at a position.
    Delete(usize, usize),
    /// Bytes inserted at a position.
    Insert(usize, Vec<u8>),
    /// One byte replaced.
    Byte(usize, u8),
    /// The text cut short.
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let keys = prop::sample::select(vec![
        "name",
        "protocol",
        "buffers",
        "addr",
        "length",
        "rank_info",
        "tcp_data_port",
        "tcp_proto_version",
        "metadata_server",
        "base_port",
        "local_rank",
        "transfer_timeout_ms",
        "physical_devices",
        "prefill",
        "global_segment_size",
        "role",
        "rpc_port",
        "endpoints",
        "device_id",
    ])
    .prop_map(str::to_owned);
    prop_oneof![
        3 => (any::<usize>(), json_value()).prop_map(|(n, v)| Mutation::Replace(n, v)),
        2 => (any::<usize>(), keys, json_value()).prop_map(|(n, k, v)| Mutation::Add(n, k, v)),
        1 => any::<usize>().prop_map(Mutation::Remove),
        1 => (any::<usize>(), 1usize..8).prop_map(|(at, n)| Mutation::Delete(at, n)),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, b)| Mutation::Insert(at, b)),
        1 => (any::<usize>(), prop::sample::select(b"{}[]\",:0-9e.\\ \x00\xff".to_vec())).prop_map(|(at, b)| Mutation::Byte(at, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

/// `text` after `mutations`.
fn mutate(text: &str, mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = text.as_bytes().to_vec();
    for m in mutations {
        // Structured mutations work on the value while the text is still JSON.
        if let (Some(mut v), true) = (
            serde_json::from_slice::<Value>(&bytes).ok(),
            matches!(m, Mutation::Replace(..) | Mutation::Add(..) | Mutation::Remove(_)),
        ) {
            let mut all = Vec::new();
            paths(&v, Vec::new(), &mut all);
            match m {
                Mutation::Replace(n, new) => *at_path(&mut v, &all[n % all.len()]) = new.clone(),
                Mutation::Add(n, key, new) => {
                    let objects: Vec<_> =
                        all.iter().filter(|p| at_path(&mut v.clone(), p).is_object()).cloned().collect();
                    if let Some(p) = objects.get(n % objects.len().max(1)) {
                        at_path(&mut v, p).as_object_mut().unwrap().insert(key.clone(), new.clone());
                    }
                }
                Mutation::Remove(n) => {
                    let p = &all[n % all.len()];
                    if let Some((last, parent)) = p.split_last() {
                        match at_path(&mut v, parent) {
                            Value::Object(o) => {
                                o.remove(last);
                            }
                            Value::Array(a) => {
                                a.remove(last.parse::<usize>().unwrap());
                            }
                            _ => {}
                        }
                    }
                }
                _ => unreachable!(),
            }
            bytes = serde_json::to_vec(&v).unwrap();
            continue;
        }
        let len = bytes.len();
        match m {
            Mutation::Delete(at, n) if len > 0 => {
                let at = at % len;
                bytes.drain(at..(at + n).min(len));
            }
            Mutation::Insert(at, b) => {
                let at = at % (len + 1);
                bytes.splice(at..at, b.iter().copied());
            }
            Mutation::Byte(at, b) if len > 0 => bytes[at % len] = *b,
            Mutation::Truncate(at) => bytes.truncate(at % (len + 1)),
            _ => {}
        }
    }
    bytes
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn arbitrary_bytes_into_the_descriptor_decoder(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        descriptor(&bytes)?;
    }

    #[test]
    fn arbitrary_json_into_the_descriptor_decoder(v in json_value()) {
        descriptor(&serde_json::to_vec(&v).unwrap())?;
    }

    #[test]
    fn mutated_real_descriptors(
        which in 0..DESCRIPTORS.len(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        descriptor(&mutate(DESCRIPTORS[which], &mutations))?;
    }

    #[test]
    fn arbitrary_text_into_the_config_decoder(text in ".{0,200}") {
        config_text(&text)?;
    }

    #[test]
    fn arbitrary_json_into_the_config_decoder(v in json_value()) {
        config_text(&serde_json::to_string(&v).unwrap())?;
    }

    #[test]
    fn mutated_real_configs(which in 0..CONFIGS.len(), mutations in prop::collection::vec(mutation(), 1..4)) {
        let bytes = mutate(CONFIGS[which], &mutations);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            config_text(text)?;
        }
    }
}

#[test]
fn the_real_inputs_decode_and_round_trip() {
    for d in DESCRIPTORS {
        assert!(SegmentDescriptor::from_json("t", d.as_bytes()).is_ok(), "{d}");
        descriptor(d.as_bytes()).unwrap();
    }
    for c in CONFIGS {
        assert!(Config::from_json_str(c, None).is_ok(), "{c}");
        config_text(c).unwrap();
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    for depth in [200, 100_000] {
        let deep = format!(r#"{{"name":"n","protocol":"tcp","x":{}{}}}"#, "[".repeat(depth), "]".repeat(depth));
        let e = SegmentDescriptor::from_json("deep", deep.as_bytes()).unwrap_err();
        assert!(e.message().contains("deep"), "{e}");
        let deep = format!(r#"{{"x":{}{}}}"#, "{\"a\":".repeat(depth), "}".repeat(depth));
        assert!(Config::from_json_str(&deep, None).is_err());
    }
}

/// Unknown fields are written back unchanged, floats included (serde_json parses them exactly:
/// its `float_roundtrip` feature).
#[test]
fn unknown_float_fields_are_written_back_unchanged() {
    let text = r#"{"name":"127.0.0.1:15123","protocol":"tcp","load":5.3604e+116,"ratio":0.1}"#;
    let d = SegmentDescriptor::from_json("t", text.as_bytes()).unwrap();
    let json = String::from_utf8(d.to_json()).unwrap();
    assert!(json.contains(r#""load":5.3604e+116"#) && json.contains(r#""ratio":0.1"#), "{json}");
    let cfg = Config::from_json_str(r#"{"local_hostnamsize":5.3604e+116}"#, None).unwrap();
    assert_eq!(serde_json::to_string(&cfg).unwrap(), r#"{"local_hostnamsize":5.3604e+116}"#);
}

use std::net::Ipv4Addr;

use proptest::prelude::*;

use super::*;
use ferry_core::ErrorKind;

/// The reference's v1.0 example, two servers.
const V10: &str = r#"{"status":"completed","version":"1.0","server_count":"2","server_list":[
  {"server_id":"10.0.0.5","host_ip":"10.0.0.5","device":[
    {"device_id":"0","device_ip":"192.168.1.8","device_port":"16667","rank_id":"0"},
    {"device_id":"1","device_ip":"192.168.1.9","device_port":"16667","rank_id":"1"},
    {"device_id":"4","device_ip":"192.168.1.12","device_port":"16667","rank_id":"2"},
    {"device_id":"5","device_ip":"192.168.1.13","device_port":"16667","rank_id":"3"}]},
  {"server_id":"node_1","host_ip":"10.0.0.6","device":[
    {"device_id":"0","device_ip":"192.168.2.8","rank_id":"4"}]}]}"#;

/// vllm-ascend's form: 4 prefill + 4 decode cards on one 8-card node.
const PD: &str = r#"{"version":"1.2","server_count":"1","status":"completed",
  "prefill_device_list":[
    {"server_id":"10.0.0.5","device_id":"0","device_ip":"29.0.0.1","super_pod_id":"0","super_device_id":"0","cluster_id":"1"},
    {"server_id":"10.0.0.5","device_id":"1","device_ip":"29.0.0.2","cluster_id":"2"},
    {"server_id":"10.0.0.5","device_id":"2","device_ip":"29.0.0.3","cluster_id":3},
    {"server_id":"10.0.0.5","device_id":"3","device_ip":"29.0.0.4","cluster_id":"4"}],
  "decode_device_list":[
    {"server_id":"10.0.0.5","device_id":"4","device_ip":"29.0.0.5","cluster_id":"5"},
    {"server_id":"10.0.0.5","device_id":"5","device_ip":"29.0.0.6","cluster_id":"6"},
    {"server_id":"10.0.0.5","device_id":"6","device_ip":"29.0.0.7","cluster_id":"7"},
    {"server_id":"10.0.0.5","device_id":"7","device_ip":"29.0.0.8","cluster_id":"8"}]}"#;

fn tmp(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-ranktable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn resolver(name: &str, text: &str, role: Option<Role>, env: &[(&str, &str)]) -> RankTableResolver {
    let env = Environment::from_pairs(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    RankTableResolver::new(tmp(name, text), "test", role, env)
}

fn host(h: &str) -> Identity {
    Identity { host: Some(h.into()), ..Identity::default() }
}

async fn local(r: &RankTableResolver, rank: Option<u32>, known: &Identity) -> Result<Identity> {
    r.resolve(&ResolveQuery::local(None, rank), known).await
}

#[test]
fn parses_both_forms() {
    let t = RankTable::parse(V10, "v10.json").unwrap();
    let RankTable::Hccl(h) = &t else { panic!("{t:?}") };
    assert_eq!(h.version, "1.0");
    assert_eq!(h.servers.len(), 2);
    assert_eq!(
        h.servers[0].devices[2],
        HcclDevice {
            device_id: 4,
            device_ip: "192.168.1.12".into(),
            device_port: Some(16667),
            rank_id: 2,
            super_device_id: None
        }
    );
    assert_eq!(t.entries()[4].path, "server_list[1].device[0]");
    assert_eq!(t.form(), "HCCL v1.0");

    let v12 = r#"{"status":"completed","version":"1.2","server_count":"1","server_list":[
      {"server_id":"10.0.0.7","device":[{"device_id":"3","device_ip":"1.2.3.4","rank_id":"0","super_device_id":"7"}]}],
      "super_pod_list":[{"super_pod_id":"0","server_list":[{"server_id":"10.0.0.7"}]}]}"#;
    let t = RankTable::parse(v12, "v12.json").unwrap();
    let RankTable::Hccl(h) = &t else { panic!() };
    assert_eq!((h.version.as_str(), h.servers[0].devices[0].super_device_id.as_deref()), ("1.2", Some("7")));

    let t = RankTable::parse(PD, "pd.json").unwrap();
    let RankTable::Disaggregated(d) = &t else { panic!("{t:?}") };
    assert_eq!(d.prefill.as_ref().unwrap().len(), 4);
    assert_eq!(d.prefill.as_ref().unwrap()[2].cluster_id.as_deref(), Some("3"), "numeric ids are kept as text");
    assert_eq!(d.decode.as_ref().unwrap()[3].device_id, 7);
    let e = &t.entries()[5];
    assert_eq!((e.path.as_str(), e.role, e.device_id), ("decode_device_list[1]", Some(Role::Decode), 5));
}

#[test]
fn bad_tables_name_the_file_the_field_and_what_was_expected() {
    let cases: Vec<(String, &str)> = vec![
        (V10.replace("completed", "initializing"), "`status` is \"initializing\"; expected \"completed\""),
        (V10.replace("\"status\":\"completed\",", ""), "`status` is missing; expected \"completed\""),
        (V10.replace("\"1.0\"", "\"2.0\""), "`version` is \"2.0\"; expected \"1.0\" or \"1.2\""),
        (V10.replace("\"server_count\":\"2\"", "\"server_count\":\"3\""), "`server_count` is \"3\" but `server_list` has 2"),
        (V10.replace("\"server_count\":\"2\"", "\"server_count\":2"), "`server_count` is 2 (a number); expected a string"),
        (V10.replace("\"device_id\":\"4\"", "\"device_id\":4"), "`server_list[0].device[2].device_id` is 4 (a number)"),
        (V10.replace("\"device_id\":\"4\"", "\"device_id\":\"four\""), "`server_list[0].device[2].device_id` is \"four\"; expected a string of digits"),
        (V10.replace("\"device_id\":\"4\"", "\"device_id\":\"99\""), "`server_list[0].device[2].device_id` is \"99\"; expected a device id below 64"),
        (V10.replace("\"device_id\":\"4\"", "\"device_id\":\"1\""), "`server_list[0].device[2].device_id` \"1\" repeats server_list[0].device[1]"),
        (V10.replace("\"device_ip\":\"192.168.1.12\",", ""), "`server_list[0].device[2].device_ip` is missing; expected a string"),
        (V10.replace("192.168.1.12", "192.168.1"), "`server_list[0].device[2].device_ip` is \"192.168.1\"; expected an IP address"),
        (V10.replace(",\"rank_id\":\"2\"", ""), "`server_list[0].device[2].rank_id` is missing"),
        (V10.replace("\"rank_id\":\"2\"", "\"rank_id\":\"1\""), "`server_list[0].device[2].rank_id` \"1\" repeats server_list[0].device[1]"),
        (V10.replace("\"rank_id\":\"4\"", "\"rank_id\":\"9\""), "`server_list[].device[].rank_id` has no rank 4"),
        (V10.replace("\"device_port\":\"16667\"", "\"device_port\":\"70000\""), "out of range for a port"),
        (V10.replace("\"server_id\":\"node_1\"", "\"server_id\":\"10.0.0.5\""), "`server_list[1].server_id` \"10.0.0.5\" repeats server_list[0].server_id"),
        (V10.replace("\"server_id\":\"node_1\",", ""), "`server_list[1].server_id` is missing"),
        (V10.replace("\"host_ip\":\"10.0.0.6\"", "\"host_ip\":\"nowhere\""), "`server_list[1].host_ip` is \"nowhere\""),
        (r#"{"status":"completed","version":"1.0","server_count":"0","server_list":[]}"#.into(), "`server_list` is empty"),
        (r#"{"status":"completed","version":"1.0","server_count":"1","server_list":[{"server_id":"a","device":[]}]}"#.into(), "`server_list[0].device` is empty"),
        (r#"{"status":"completed","version":"1.0","server_count":"1","server_list":{}}"#.into(), "`server_list` is an object; expected an array"),
        (r#"{"status":"completed","version":"1.0","server_count":"1","server_list":[5]}"#.into(), "`server_list[0]` is 5 (a number); expected an object"),
        (r#"{"status":"completed"}"#.into(), "has neither `server_list`"),
        (r#"{"status":"completed","server_list":[],"decode_device_list":[]}"#.into(), "has both"),
        ("[1,2]".into(), "is an array; expected a JSON object"),
        ("{\"status\": ".into(), "not valid JSON at line 1"),
        (PD.replace("\"device_id\":\"5\"", "\"device_id\":\"4\""), "`decode_device_list[1]` names device 4 of server \"10.0.0.5\" again (first in decode_device_list[0])"),
        (PD.replace("\"device_ip\":\"29.0.0.7\"", "\"device_ip\":7"), "`decode_device_list[2].device_ip` is 7 (a number)"),
        (PD.replace("\"server_id\":\"10.0.0.5\",\"device_id\":\"6\"", "\"server_id\":\"\",\"device_id\":\"6\""), "`decode_device_list[2].server_id` is empty"),
        (PD.replace("\"completed\"", "\"pending\""), "`status` is \"pending\""),
        (V10.replace("192.168.1.12", "192.168.1.9"), "`server_list[0].device[2].device_ip` \"192.168.1.9\" is also `server_list[0].device[1].device_ip`: every card needs a device IP of its own"),
        (V10.replace("192.168.2.8", "192.168.1.8"), "`server_list[1].device[0].device_ip` \"192.168.1.8\" is also `server_list[0].device[0].device_ip`"),
        (PD.replace("29.0.0.5", "29.0.0.1"), "`decode_device_list[0].device_ip` \"29.0.0.1\" is also `prefill_device_list[0].device_ip`"),
    ];
    for (text, needle) in cases {
        let e = RankTable::parse(&text, "/etc/rt.json").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().starts_with("rank table /etc/rt.json") && e.message().contains(needle),
            "want {needle:?}\n got {e}"
        );
    }
}

#[tokio::test]
async fn hccl_local_by_host_and_local_rank() {
    let r = resolver("a.json", V10, None, &[]);
    let id = local(&r, Some(2), &host("10.0.0.5")).await.unwrap();
    assert_eq!(
        (id.physical_device, id.device_ip.as_deref(), id.rank, id.device_port),
        (Some(4), Some("192.168.1.12"), Some(2), Some(16667))
    );
    assert!(
        id.details[&IdentityField::DeviceIp]
            .ends_with("a.json server_list[0].device[2] (server 10.0.0.5, local rank 2)"),
        "{:?}",
        id.details
    );
    // host_ip matches too.
    let id = local(&r, Some(0), &host("10.0.0.6")).await.unwrap();
    assert_eq!((id.physical_device, id.rank, id.device_port), (Some(0), Some(4), None));
    // A known physical device is looked up instead of indexing by rank.
    let known = Identity { physical_device: Some(5), ..host("10.0.0.5") };
    assert_eq!(local(&r, Some(0), &known).await.unwrap().rank, Some(3));
}

#[tokio::test]
async fn visible_devices_filter_as_vllm_ascend_does() {
    let r = resolver("b.json", V10, None, &[(VISIBLE_DEVICES_ENV, "4,5")]);
    let id = local(&r, Some(1), &host("10.0.0.5")).await.unwrap();
    assert_eq!((id.physical_device, id.rank), (Some(5), Some(3)));
    let e = local(&r, Some(2), &host("10.0.0.5")).await.unwrap_err();
    let m = e.message();
    assert!(
        m.contains("local rank 2 has no entry")
            && m.contains("[4, 5]")
            && m.contains("ASCEND_RT_VISIBLE_DEVICES=\"4,5\""),
        "{m}"
    );
    let bad = resolver("b2.json", V10, None, &[(VISIBLE_DEVICES_ENV, "5,4")]);
    let e = local(&bad, Some(0), &host("10.0.0.5")).await.unwrap_err();
    assert!(e.message().contains("ASCEND_RT_VISIBLE_DEVICES=\"5,4\""), "{e}");
}

#[tokio::test]
async fn local_selection_errors() {
    let r = resolver("c.json", V10, None, &[]);
    let e = local(&r, Some(9), &host("10.0.0.5")).await.unwrap_err();
    assert!(
        e.message().contains("c.json")
            && e.message().contains("local rank 9 has no entry")
            && e.message().contains("expected at least 10"),
        "{e}"
    );
    let e = local(&r, Some(0), &host("10.9.9.9")).await.unwrap_err();
    assert!(
        e.message().contains("server_id (or host_ip) \"10.9.9.9\"")
            && e.message().contains("[\"10.0.0.5\", \"node_1\"]"),
        "{e}"
    );
    let e = local(&r, Some(0), &Identity::default()).await.unwrap_err();
    assert!(e.message().contains("cannot tell which server"), "{e}");
    let e = local(&r, None, &host("10.0.0.5")).await.unwrap_err();
    assert!(e.message().contains("local rank is unknown"), "{e}");
    let known = Identity { physical_device: Some(7), ..host("10.0.0.5") }
        .with_detail(IdentityField::PhysicalDevice, "`npu_7` in segment name");
    let e = local(&r, Some(0), &known).await.unwrap_err();
    assert!(
        e.message().contains("no entry for physical device 7 (`npu_7` in segment name)")
            && e.message().contains("[0, 1, 4, 5]"),
        "{e}"
    );
    // The single-server table needs no host, and its only device no rank.
    let one = r#"{"status":"completed","version":"1.0","server_count":"1","server_list":[{"server_id":"s","device":[{"device_id":"3","device_ip":"1.2.3.4","rank_id":"0"}]}]}"#;
    let id = local(&resolver("one.json", one, None, &[]), None, &Identity::default()).await.unwrap();
    assert_eq!(id.physical_device, Some(3));
    // An unreadable table names who named it.
    let missing = RankTableResolver::new("/nonexistent/rt.json", "environment variable X", None, Environment::empty());
    let e = local(&missing, Some(0), &Identity::default()).await.unwrap_err();
    assert!(e.message().contains("/nonexistent/rt.json (named by environment variable X) cannot be read"), "{e}");
}

#[tokio::test]
async fn prefill_decode_table_picks_the_roles_list() {
    let decode = resolver("pd.json", PD, Some(Role::Decode), &[]);
    let id = local(&decode, Some(2), &host("10.0.0.5")).await.unwrap();
    assert_eq!((id.physical_device, id.device_ip.as_deref(), id.rank), (Some(6), Some("29.0.0.7"), None));
    assert!(id.details[&IdentityField::PhysicalDevice].contains("decode_device_list[2]"));
    let prefill = resolver("pd.json", PD, Some(Role::Prefill), &[]);
    assert_eq!(local(&prefill, Some(2), &host("10.0.0.5")).await.unwrap().physical_device, Some(2));
    // In a container that sees only cards 4-7 (the decode instance), entries are filtered first.
    let d2 = resolver("pd2.json", PD, Some(Role::Decode), &[(VISIBLE_DEVICES_ENV, "6,7")]);
    assert_eq!(local(&d2, Some(1), &host("10.0.0.5")).await.unwrap().physical_device, Some(7));
    let none = resolver("pd.json", PD, None, &[]);
    let e = local(&none, Some(0), &host("10.0.0.5")).await.unwrap_err();
    assert!(e.message().contains("set `role` (or FERRY_ROLE)"), "{e}");
    let only_prefill =
        PD.split("\"decode_device_list\"").next().unwrap().trim_end().trim_end_matches(',').to_owned() + "}";
    let e = local(&resolver("p.json", &only_prefill, Some(Role::Decode), &[]), Some(0), &host("10.0.0.5"))
        .await
        .unwrap_err();
    assert!(e.message().contains("`decode_device_list` is missing"), "{e}");
}

#[tokio::test]
async fn peers_are_looked_up_by_host_and_device() {
    let r = resolver("peer.json", V10, None, &[]);
    let peer = |h: &str, d: Option<u32>| Identity { physical_device: d, ..host(h) };
    let q = ResolveQuery::peer("10.0.0.6:1:npu_0", None, None);
    let id = r.resolve(&q, &peer("10.0.0.6", Some(0))).await.unwrap();
    assert_eq!((id.device_ip.as_deref(), id.rank), (Some("192.168.2.8"), Some(4)));
    assert!(r.resolve(&q, &peer("10.0.0.6", None)).await.unwrap().is_empty(), "no device: nothing to look up");
    assert!(r.resolve(&q, &peer("10.7.7.7", Some(0))).await.unwrap().is_empty(), "not in this table");
    let e = r.resolve(&q, &peer("10.0.0.6", Some(3))).await.unwrap_err();
    assert!(e.message().contains("lists server \"10.0.0.6\" but no physical device 3"), "{e}");
    // A prefill process finds its decode peer in the other list.
    let pd = resolver("pd.json", PD, Some(Role::Prefill), &[]);
    let id = pd.resolve(&q, &peer("10.0.0.5", Some(5))).await.unwrap();
    assert_eq!(id.device_ip.as_deref(), Some("29.0.0.6"));
}

#[tokio::test]
async fn from_config_prefers_the_config_then_vllm_ascends_variable() {
    let p = tmp("cfg.json", PD);
    let env = Environment::from_pairs([(RANK_TABLE_ENV, p.display().to_string())]);
    let c = Config::from_json_str(r#"{"local_hostname": "10.0.0.5", "role": "decode"}"#, None).unwrap();
    let r = RankTableResolver::from_config(&c, &env).unwrap();
    assert_eq!(r.path(), Some(p.as_path()));
    assert_eq!(r.set_by(), "environment variable DISAGGREGATED_PREFILL_RANK_TABLE_PATH");
    // The host comes from the config when no earlier link answered it.
    assert_eq!(local(&r, Some(3), &Identity::default()).await.unwrap().physical_device, Some(7));
    let c = Config::from_json_str(r#"{"rank_table_path": "/x/rt.json"}"#, None).unwrap();
    let r = RankTableResolver::from_config(&c, &env).unwrap();
    assert_eq!((r.path(), r.set_by()), (Some(Path::new("/x/rt.json")), "config field `rank_table_path`"));
    let r = RankTableResolver::from_config(&Config::default(), &Environment::empty()).unwrap();
    assert!(r.path().is_none());
    assert!(local(&r, Some(0), &Identity::default()).await.unwrap().is_empty());
}

fn ip() -> impl Strategy<Value = String> {
    any::<Ipv4Addr>().prop_map(|a| a.to_string())
}

/// `ip`, or a fresh address when an earlier card of the table has it (a valid table gives
/// every card its own device IP).
fn unique_ip(ip: String, seen: &mut std::collections::HashSet<String>) -> String {
    let mut ip = ip;
    let mut n = 1u32;
    while !seen.insert(ip.clone()) {
        ip = Ipv4Addr::from(0x0a00_0000 + n).to_string();
        n += 1;
    }
    ip
}

fn hccl_table() -> impl Strategy<Value = HcclRankTable> {
    let device = (ip(), proptest::option::of(any::<u16>()), proptest::option::of("[0-9]{1,3}"));
    let server = (proptest::option::of(ip()), proptest::collection::btree_map(0u32..DEVICE_ID_LIMIT, device, 1..6));
    (prop_oneof![Just("1.0"), Just("1.2")], proptest::collection::vec(server, 1..4))
        .prop_flat_map(|(version, servers)| {
            let total: u32 = servers.iter().map(|(_, d)| d.len() as u32).sum();
            (Just(version), Just(servers), Just((0..total).collect::<Vec<u32>>()).prop_shuffle())
        })
        .prop_map(|(version, servers, ranks)| {
            let mut next = ranks.into_iter();
            let mut seen = std::collections::HashSet::new();
            let servers = servers
                .into_iter()
                .enumerate()
                .map(|(i, (host_ip, devices))| HcclServer {
                    server_id: format!("10.0.0.{i}"),
                    host_ip,
                    devices: devices
                        .into_iter()
                        .map(|(device_id, (device_ip, device_port, super_device_id))| HcclDevice {
                            device_id,
                            device_ip: unique_ip(device_ip, &mut seen),
                            device_port,
                            rank_id: next.next().unwrap_or_default(),
                            super_device_id,
                        })
                        .collect(),
                })
                .collect();
            HcclRankTable { version: version.to_owned(), servers }
        })
}

fn disaggregated_table() -> impl Strategy<Value = DisaggregatedRankTable> {
    let entry = (ip(), any::<bool>(), proptest::option::of("[0-9]{1,3}"), proptest::option::of("[0-9]{1,3}"));
    (
        proptest::option::of(Just("1.2".to_owned())),
        proptest::collection::btree_map((0u8..3, 0u32..DEVICE_ID_LIMIT), entry, 0..12),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(version, entries, with_prefill, with_decode)| {
            let (mut prefill, mut decode) = (Vec::new(), Vec::new());
            let mut seen = std::collections::HashSet::new();
            for ((server, device_id), (device_ip, is_prefill, super_device_id, cluster_id)) in entries {
                let d = DisaggregatedDevice {
                    server_id: format!("10.1.0.{server}"),
                    device_id,
                    device_ip: unique_ip(device_ip, &mut seen),
                    super_pod_id: None,
                    super_device_id,
                    cluster_id,
                };
                if is_prefill { prefill.push(d) } else { decode.push(d) }
            }
            let (prefill, decode) = match (with_prefill || !prefill.is_empty(), with_decode || !decode.is_empty()) {
                (false, false) => (Some(prefill), None),
                (p, d) => (p.then_some(prefill), d.then_some(decode)),
            };
            DisaggregatedRankTable { version, prefill, decode }
        })
}

/// JSON pointers of every value in `v`.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = format!("{at}/{k}");
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        _ => {}
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        ".{0,8}".prop_map(Value::String),
        "[0-9]{1,12}".prop_map(Value::String),
        Just(json!([])),
        Just(json!({})),
    ]
}

proptest! {
    #[test]
    fn hccl_tables_round_trip(t in hccl_table()) {
        let t = RankTable::Hccl(t);
        let text = serde_json::to_string_pretty(&t.to_json()).unwrap();
        prop_assert_eq!(RankTable::parse(&text, "gen.json").unwrap(), t);
    }

    #[test]
    fn disaggregated_tables_round_trip(t in disaggregated_table()) {
        let t = RankTable::Disaggregated(t);
        let text = t.to_json().to_string();
        prop_assert_eq!(RankTable::parse(&text, "gen.json").unwrap(), t);
    }

    #[test]
    fn damaged_tables_never_panic_and_errors_name_the_file(
        hccl in hccl_table(),
        pd in disaggregated_table(),
        which: bool,
        pick: prop::sample::Index,
        delete: bool,
        replacement in any_json(),
    ) {
        let mut v = if which { RankTable::Hccl(hccl).to_json() } else { RankTable::Disaggregated(pd).to_json() };
        let mut all = Vec::new();
        pointers(&v, String::new(), &mut all);
        if !all.is_empty() {
            let ptr = pick.get(&all).clone();
            if delete {
                let (parent, key) = ptr.rsplit_once('/').unwrap();
                match v.pointer_mut(parent) {
                    Some(Value::Object(m)) => { m.remove(key); }
                    Some(Value::Array(a)) => { let i: usize = key.parse().unwrap(); a.remove(i); }
                    _ => {}
                }
            } else if let Some(slot) = v.pointer_mut(&ptr) {
                *slot = replacement;
            }
        }
        if let Err(e) = RankTable::parse(&v.to_string(), "damaged.json") {
            prop_assert!(e.message().starts_with("rank table damaged.json"), "{}", e);
        }
    }

    #[test]
    fn arbitrary_text_never_panics(text in ".{0,64}") {
        let _ = RankTable::parse(&text, "x");
    }
}
